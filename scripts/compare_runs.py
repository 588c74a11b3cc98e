"""Compare two runs: their debug traces step by step, or their resume checkpoints tensor by tensor.

Run from the repository root:

    # two --save_debug_train_output traces: same samples and losses at every (step, rank)?
    python -m scripts.compare_runs run_a/trace.jsonl run_b/trace.jsonl [--atol 1e-6] [--num_samples 37]
    # two resume files: same weights, optimizer moments and data position?
    python -m scripts.compare_runs a/pretrain_32_resume.pth b/pretrain_32_resume.pth [--atol 0]

Exit code 0 when the runs agree (within --atol, default 0: bit-identical), 1 when they differ,
2 when the inputs cannot be compared. This is the check behind the resume contract: a resumed run
on the same world size must match an uninterrupted one exactly, and every epoch must train each
sample exactly once.

When the two traces ran on different world sizes, per-rank records cannot match by design; the
comparison then works per step: the step's samples (as a set) and its loss over all ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from trainer.hardening.checkpoint_io import CheckpointError, load_trusted

# Scalars of a resume file that say where the run stands; all must agree.
RESUME_SCALARS = ("epoch", "global_step", "samples_consumed", "world_size", "lr")


# ---- debug traces ---------------------------------------------------------------------------

def load_trace(path: str | Path) -> dict[tuple[int, int], dict]:
    """Records of a trace keyed by (step, rank); a key seen twice is an error (two runs in one file)."""
    records: dict[tuple[int, int], dict] = {}
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            key = (record["step"], record["rank"])
            if key in records:
                # The trace is opened in append mode, so rerunning into the same file repeats steps.
                raise ValueError(f"{path}, line {line_number}: step {key[0]} rank {key[1]} appears twice; "
                                 f"was the file reused by another run? Delete it before training")
            records[key] = record
    return records


def _losses_differ(a: float, b: float, atol: float) -> bool:
    if math.isnan(a) or math.isnan(b):  # a step both runs skipped (NaN loss) agrees; NaN never equals itself
        return not (math.isnan(a) and math.isnan(b))
    return a != b and not abs(a - b) <= atol  # written so that inf agrees with inf (inf - inf is NaN)


def _per_step(trace: dict[tuple[int, int], dict]) -> dict[int, dict]:
    """Records merged over ranks: all samples of the step and the loss over all its tokens."""
    steps: dict[int, dict] = defaultdict(lambda: {"samples": [], "loss_sum": 0.0, "tokens": 0})
    for (step, _), record in trace.items():
        merged = steps[step]
        merged["samples"] += record["samples"]
        merged["loss_sum"] += record["loss_sum"]
        merged["tokens"] += record["local_tokens"]
    for merged in steps.values():
        merged["samples"] = sorted(merged["samples"])
        merged["loss"] = merged["loss_sum"] / max(merged["tokens"], 1)
    return dict(steps)


def compare_traces(a: dict[tuple[int, int], dict], b: dict[tuple[int, int], dict],
                   atol: float = 0.0) -> tuple[bool, str]:
    """(identical, one line saying so or naming the first step that differs and both values)."""
    world_a = {r["world_size"] for r in a.values()}
    world_b = {r["world_size"] for r in b.values()}
    if world_a != world_b:
        return _compare_steps(_per_step(a), _per_step(b), atol, f"world sizes {sorted(world_a)} vs {sorted(world_b)}")
    for key in sorted(set(a) | set(b)):
        step, rank = key
        if key not in a or key not in b:
            present, absent = ("B", "A") if key not in a else ("A", "B")
            return False, f"step {step} rank {rank}: only in {present} (trace {absent} stops earlier or skips it)"
        ra, rb = a[key], b[key]
        if ra["samples"] != rb["samples"]:
            return False, f"first difference at step {step} rank {rank}: samples {ra['samples']} vs {rb['samples']}"
        if _losses_differ(ra["loss"], rb["loss"], atol):
            return False, (f"first difference at step {step} rank {rank}: loss {ra['loss']!r} vs {rb['loss']!r} "
                           f"(|diff| {abs(ra['loss'] - rb['loss']):.3g} > atol {atol:g})")
    steps = len({step for step, _ in a})
    ranks = len({rank for _, rank in a})
    return True, f"identical: {steps} steps x {ranks} ranks"


def _compare_steps(a: dict[int, dict], b: dict[int, dict], atol: float, why: str) -> tuple[bool, str]:
    """Step-level comparison, for traces whose ranks split the same steps differently."""
    for step in sorted(set(a) | set(b)):
        if step not in a or step not in b:
            return False, f"{why}; step {step} is only in {'A' if step in a else 'B'}"
        sa, sb = a[step], b[step]
        if sa["samples"] != sb["samples"]:
            return False, f"{why}; first difference at step {step}: samples {sa['samples']} vs {sb['samples']}"
        if _losses_differ(sa["loss"], sb["loss"], atol):
            return False, (f"{why}; first difference at step {step}: loss over all ranks {sa['loss']!r} vs "
                           f"{sb['loss']!r} (|diff| {abs(sa['loss'] - sb['loss']):.3g} > atol {atol:g})")
    return True, f"identical per step ({why}): {len(a)} steps, same samples and loss over all ranks"


def epoch_coverage(trace: dict[tuple[int, int], dict], num_samples: int | None = None) -> list[str]:
    """Per epoch: was every sample trained exactly once? One line per epoch.

    Without `num_samples` only repeats can be seen; with it, samples never trained are listed too.
    """
    per_epoch: dict[int, Counter] = defaultdict(Counter)
    for record in trace.values():
        per_epoch[record["epoch"]].update(record["samples"])
    lines = []
    for epoch in sorted(per_epoch):
        counts = per_epoch[epoch]
        repeated = sorted(i for i, c in counts.items() if c > 1)
        missing = [] if num_samples is None else [i for i in range(num_samples) if i not in counts]
        line = f"epoch {epoch}: {sum(counts.values())} sample slots, {len(counts)} distinct samples"
        if repeated:
            shown = ", ".join(f"{i} (x{counts[i]})" for i in repeated[:10])
            line += f"; {len(repeated)} trained more than once: {shown}{' ...' if len(repeated) > 10 else ''}"
        if missing:
            line += f"; {len(missing)} of {num_samples} never trained (epoch incomplete?): {missing[:10]}"
        if not repeated and not missing:
            line += ", each exactly once" + (" (complete)" if num_samples is not None else "")
        lines.append(line)
    return lines


# ---- resume checkpoints ---------------------------------------------------------------------

def _named_optimizer_tensors(state: dict) -> dict[str, torch.Tensor]:
    """Optimizer moments keyed by the parameter's name where it can be matched, else by its index.

    The optimizer numbers parameters in model.parameters() order, which is the state dict order
    with the tied lm_head (the embedding under a second name) left out.
    """
    optimizer_state = state["optimizer"]["state"]
    names = [n for n in state["model"] if not (n == "lm_head.weight" and
                                              state.get("lm_config", {}).get("tie_word_embeddings", True))]
    param_ids = [i for group in state["optimizer"]["param_groups"] for i in group["params"]]
    label = dict(zip(param_ids, names)) if len(names) == len(param_ids) else {}
    tensors = {}
    for index, slots in optimizer_state.items():
        for slot, value in slots.items():
            tensors[f"optimizer[{label.get(index, index)}].{slot}"] = torch.as_tensor(value)
    return tensors


def _max_abs_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x.double() - y.double()).abs().max().item() if x.numel() else 0.0


def compare_resume_states(a: dict, b: dict, atol: float = 0.0) -> tuple[bool, list[str]]:
    """(identical, report lines): scalars, then every model and optimizer tensor."""
    lines, identical = [], True
    for key in RESUME_SCALARS:
        if a.get(key) != b.get(key):
            identical = False
            lines.append(f"{key}: {a.get(key)!r} vs {b.get(key)!r}")
    tensors_a, tensors_b = dict(a["model"]), dict(b["model"])
    tensors_a.update(_named_optimizer_tensors(a))
    tensors_b.update(_named_optimizer_tensors(b))
    only = sorted(set(tensors_a) ^ set(tensors_b))
    if only:
        identical = False
        lines.append(f"{len(only)} tensors exist in one file only, e.g. {only[0]}")
    differing = []
    for name in tensors_a:
        if name not in tensors_b:
            continue
        x, y = tensors_a[name], tensors_b[name]
        if x.shape != y.shape:
            differing.append((name, f"shape {tuple(x.shape)} vs {tuple(y.shape)}"))
        elif not torch.equal(x, y):
            diff = _max_abs_diff(x, y)
            if not diff <= atol:  # written so that a NaN difference counts as different
                differing.append((name, f"max |diff| {diff:.3g}"))
    if differing:
        identical = False
        name, what = differing[0]
        lines.append(f"first differing tensor: {name} ({what}); {len(differing)} of {len(tensors_a)} tensors differ")
    if identical:
        lines.append(f"identical: {len(tensors_a)} model and optimizer tensors, and "
                     f"{', '.join(RESUME_SCALARS)} (atol {atol:g})")
    return identical, lines


# ---- command line ---------------------------------------------------------------------------

def compare_paths(path_a: Path, path_b: Path, atol: float = 0.0, num_samples: int | None = None) -> tuple[int, str]:
    """(exit code, report) for two traces or two resume files."""
    kinds = {path_a.suffix, path_b.suffix}
    if kinds == {".jsonl"}:
        a, b = load_trace(path_a), load_trace(path_b)
        same, summary = compare_traces(a, b, atol)
        report = [summary]
        for label, path, trace in (("A", path_a, a), ("B", path_b, b)):
            report.append(f"{label} ({path}):")
            report += [f"  {line}" for line in epoch_coverage(trace, num_samples)]
        return (0 if same else 1), "\n".join(report)
    if kinds == {".pth"}:
        states = [load_trusted(path) for path in (path_a, path_b)]
        for path, state in zip((path_a, path_b), states):
            if not {"model", "optimizer"} <= set(state):
                return 2, f"{path} is not a resume checkpoint (no model/optimizer state); out/ weights are not compared"
        same, lines = compare_resume_states(*states, atol)
        return (0 if same else 1), "\n".join(lines)
    return 2, f"cannot compare {path_a.name} with {path_b.name}: pass two .jsonl traces or two .pth resume files"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare two debug traces or two resume checkpoints")
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--atol", type=float, default=0.0, help="allowed |difference| of losses / tensors")
    parser.add_argument("--num_samples", type=int, default=None,
                        help="dataset size, to also list samples an epoch never trained")
    args = parser.parse_args(argv)
    try:
        code, report = compare_paths(args.a, args.b, args.atol, args.num_samples)
    except (OSError, ValueError, KeyError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(report, file=sys.stdout if code < 2 else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

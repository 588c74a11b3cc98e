"""Draw which samples each rank trains in an epoch stopped on 2 ranks and resumed on 3.

Top panel: the steps taken on 2 ranks before the stop. Bottom panel: the samples already trained,
greyed, then the steps taken on 3 ranks after `--from_resume 1`. One row per optimizer step; a cell is
a sample's index, coloured by the rank that trains it, grouped by rank and micro-batch; a hatched cell
is a placeholder (a rank without data in the short last step). Who trains what comes from the trainer's
own `epoch_order` and `SkipBatchSampler` (trainer_utils.py, section 3), so the picture shows what the
trainer does; a step's label is the number of global batches that reach the cursor (`step_in_epoch`).

    python scripts/draw_resume.py                      # -> docs/resume_2_to_3.png (the README's picture)
    python scripts/draw_resume.py --global_batch_size 0 --batch_size 4 4 --out /tmp/rescaled.png
        # without --global_batch_size the global batch follows the GPU count (8 -> 12): the label rescales
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from trainer.hardening.anomaly_policy import steps_left
from trainer.trainer_utils import PLACEHOLDER_INDEX, SkipBatchSampler, epoch_order, resolve_accumulation

RANK_COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
TRAINED_GREY = "#d9d9d9"


def step_in_epoch(num_samples: int, samples_consumed: int, global_batch: int) -> int:
    """The step label of a cursor: optimizer steps of `global_batch` that reach `samples_consumed`."""
    return steps_left(num_samples, 0, global_batch) - steps_left(num_samples, samples_consumed, global_batch)


class Geometry(NamedTuple):
    """How a launch splits a step: world_size x batch_size x accumulation = global_batch."""
    world_size: int
    batch_size: int
    accumulation: int
    global_batch: int

    def __str__(self) -> str:
        return (f"{self.world_size} ranks x batch {self.batch_size} x accumulation {self.accumulation} = "
                f"global batch {self.global_batch}")


def geometry(world_size: int, batch_size: int, accumulation_steps: int, global_batch_size: int | None) -> Geometry:
    """The launch's geometry as the training scripts derive it (resolve_accumulation)."""
    accumulation, global_batch = resolve_accumulation(batch_size, world_size, accumulation_steps, global_batch_size)
    return Geometry(world_size, batch_size, accumulation, global_batch)


def steps_from(order, samples_consumed: int, g: Geometry) -> list[list[list[list[int]]]]:
    """steps[s][rank] = the micro-batches SkipBatchSampler gives `rank` in step s, from the cursor on."""
    per_rank = []
    for rank in range(g.world_size):
        sampler = SkipBatchSampler(order, samples_consumed, g.global_batch, g.batch_size, rank, g.world_size)
        batches = iter(sampler)
        per_rank.append([[next(batches) for _ in range(sampler.micro_steps_per_step(s))]
                         for s in range(sampler.num_steps())])
    return [list(ranks) for ranks in zip(*per_rank)]


def trained_count(ranks: list[list[list[int]]]) -> int:
    """The samples a step trains: its ranks' micro-batches, placeholders left out."""
    return sum(i != PLACEHOLDER_INDEX for micro_batches in ranks for micro in micro_batches for i in micro)


def resume_assignment(num_samples: int, seed: int, stop_step: int, before: Geometry, after: Geometry) -> dict:
    """Epoch 0 stopped after `stop_step` steps on `before`, resumed on `after`: who trains what, as plain data."""
    if not 1 <= stop_step < steps_left(num_samples, 0, before.global_batch):
        raise ValueError(f"--stop_step {stop_step} must leave part of the epoch: 1 to "
                         f"{steps_left(num_samples, 0, before.global_batch) - 1} for {num_samples} samples")
    order = epoch_order(seed, 0, num_samples)
    taken = steps_from(order, 0, before)[:stop_step]
    samples_consumed = sum(trained_count(step) for step in taken)  # the one number the checkpoint keeps
    return {"seed": seed, "order": order.tolist(), "samples_consumed": samples_consumed,
            "stop_label": step_in_epoch(num_samples, samples_consumed, before.global_batch),
            "resume_label": step_in_epoch(num_samples, samples_consumed, after.global_batch),
            "before": taken, "after": steps_from(order, samples_consumed, after)}


def _x(g: Geometry, rank: int, micro: int, k: int) -> float:
    """Where a cell sits in a row: a block per rank, a gap between micro-batches, a wider one between ranks."""
    return rank * (g.accumulation * (g.batch_size + 0.25) + 0.6) + micro * (g.batch_size + 0.25) + k


def _row(ax, y: int, ranks: list[list[list[int]]], g: Geometry, trained: bool = False) -> None:
    """One step's cells: coloured by rank (grey if already trained), hatched for a placeholder."""
    for rank, micro_batches in enumerate(ranks):
        for m, micro in enumerate(micro_batches):
            for k, index in enumerate(micro):
                x, placeholder = _x(g, rank, m, k), index == PLACEHOLDER_INDEX
                colour = "grey" if trained else RANK_COLOURS[rank]
                face = TRAINED_GREY if trained else "white" if placeholder else colour
                ax.add_patch(Rectangle((x, y), 0.92, 0.8, facecolor=face, edgecolor=colour,
                                       hatch="///" if placeholder else None))
                ax.text(x + 0.46, y + 0.4, "" if placeholder else str(index), ha="center", va="center", fontsize=9,
                        color="dimgrey" if trained else "white", fontweight="normal" if trained else "bold")


def _axes(ax, labels: list[str], g: Geometry, title: str) -> None:
    block = g.accumulation * (g.batch_size + 0.25) - 0.25
    ax.set_xlim(-0.3, _x(g, g.world_size, 0, 0) - 0.3)
    ax.set_ylim(len(labels), -0.3)
    ax.set_yticks([i + 0.4 for i in range(len(labels))], labels)
    ax.set_xticks([_x(g, r, 0, 0) + block / 2 for r in range(g.world_size)], [f"rank {r}" for r in range(g.world_size)])
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    ax.spines[:].set_visible(False)
    ax.set_title(title, fontsize=10, loc="left")


def draw_resume(plan: dict, before: Geometry, after: Geometry, out_path: str | Path) -> Path:
    """Write the two-panel picture of `plan` (from resume_assignment) to `out_path`."""
    n, consumed, G = len(plan["order"]), plan["samples_consumed"], after.global_batch
    # The second launch's context: the samples already trained, in rows of its global batch.
    done = [plan["order"][i:min(i + G, consumed)] for i in range(0, consumed, G)]
    rows = len(plan["before"]) + len(done) + len(plan["after"])
    figure = Figure(figsize=(10, 2.2 + 0.42 * rows), layout="constrained")
    FigureCanvasAgg(figure)  # a Figure with its own Agg canvas, not pyplot: no display needed
    top, bottom = figure.subplots(2, 1, height_ratios=[len(plan["before"]) + 1.5, len(done) + len(plan["after"]) + 2])

    labels, start = [], 0
    for y, ranks in enumerate(plan["before"]):
        _row(top, y, ranks, before)
        labels.append(f"step {y + 1}: order[{start}:{start + trained_count(ranks)}]")
        start += trained_count(ranks)
    _axes(top, labels, before, f"First launch: {before}.\nStopped after step {plan['stop_label']} "
                               f"on {before.world_size} ranks (samples_consumed {consumed}).")

    per_rank = after.accumulation * after.batch_size
    labels = []
    for y, samples in enumerate(done):  # laid out as the new ranks' cells, to line up with the steps below
        shares = [[samples[r * per_rank + m * after.batch_size:][:after.batch_size] for m in range(after.accumulation)]
                  for r in range(after.world_size)]
        _row(bottom, y, shares, after, trained=True)
        labels.append(f"trained: order[{y * G}:{y * G + len(samples)}]")
    for s, ranks in enumerate(plan["after"]):
        _row(bottom, len(done) + s, ranks, after)
        labels.append(f"step {plan['resume_label'] + s + 1}: order[{start}:{start + trained_count(ranks)}]")
        start += trained_count(ranks)
    _axes(bottom, labels, after, f"--from_resume 1: {after}.\nResumes at step {plan['resume_label']} "
                                 f"on {after.world_size} ranks (step_in_epoch({n}, {consumed}, {G}) = "
                                 f"{plan['resume_label']}), at order[{consumed}].")

    handles = [Patch(color=RANK_COLOURS[r], label=f"rank {r}") for r in range(max(before.world_size, after.world_size))]
    handles += [Patch(facecolor=TRAINED_GREY, edgecolor="grey", label="trained before the stop"),
                Patch(facecolor="white", edgecolor="grey", hatch="///", label="placeholder (labels ignored)")]
    figure.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=9, frameon=False)
    figure.suptitle(f"One epoch of {n} samples (seed {plan['seed']}); a cell is a sample's index, "
                    f"grouped by rank and micro-batch", fontsize=11)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=110)
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Draw which samples each rank trains across a 2 -> 3 rank resume.")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "resume_2_to_3.png")
    parser.add_argument("--num_samples", type=int, default=55)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--stop_step", type=int, default=3, help="optimizer steps the first launch takes")
    parser.add_argument("--world_size", type=int, nargs=2, default=[2, 3], help="ranks before and after")
    parser.add_argument("--batch_size", type=int, nargs=2, default=[3, 2], help="per-rank batch before and after")
    parser.add_argument("--accumulation_steps", type=int, default=1, help="used without --global_batch_size")
    parser.add_argument("--global_batch_size", type=int, default=12, help="0: the global batch follows the world size")
    args = parser.parse_args(argv)
    try:
        before, after = (geometry(ws, bs, args.accumulation_steps, args.global_batch_size or None)
                         for ws, bs in zip(args.world_size, args.batch_size))
        plan = resume_assignment(args.num_samples, args.seed, args.stop_step, before, after)
    except ValueError as error:  # numbers that do not divide, a stop outside the epoch: one line, no traceback
        sys.exit(f"error: {error}")
    print(f"wrote {draw_resume(plan, before, after, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

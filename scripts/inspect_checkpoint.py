"""Say what a checkpoint file holds, without training or even building a model.

Run from the repository root:

    python -m scripts.inspect_checkpoint checkpoints/pretrain_512_resume.pth   # a resume checkpoint
    python -m scripts.inspect_checkpoint out/full_sft_512.pth                  # FP16 inference weights
    python -m scripts.inspect_checkpoint checkpoints --run pretrain_512        # every kept history file

A resume file is checked against its manifest (size and SHA-256) before anything else: a file can
load fine and still hold flipped bytes. Files are only ever opened with `weights_only=True`; one
that needs arbitrary pickled code is refused (exit code 1).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from model.weights import infer_sizes, size_flags
from model.lora import adapter_shape
from trainer.hardening.checkpoint_io import CheckpointError, RunFiles, load_trusted, manifest_of, verify


# ---- small helpers --------------------------------------------------------------------------

def human_size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{num_bytes} B"
        size /= 1024
    raise AssertionError("unreachable")


def count_parameters(state_dict: dict[str, torch.Tensor]) -> int:
    """Values in the model, each tensor once.

    The lm_head is tied to the embedding: in a resume file saved from the CPU both names share one
    storage (same data_ptr); in an FP16 file, or one saved from a GPU, they are two equal copies.
    Either way the matrix is one set of parameters, so it is counted once.
    """
    seen, total = set(), 0
    for name, tensor in state_dict.items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key in seen:
            continue
        embed = state_dict.get("model.embed_tokens.weight")
        if name == "lm_head.weight" and embed is not None and torch.equal(tensor, embed):
            continue
        seen.add(key)
        total += tensor.numel()
    return total


def find_manifested_file(path: Path) -> Path | None:
    """The history file whose manifest describes `path`'s bytes, or None.

    A history file has its manifest beside it. `R_resume.pth` is a hard link to the newest history
    file, so it is matched by inode (os.path.samefile), falling back to the `R_latest.txt` pointer.
    """
    if manifest_of(path).is_file():
        return path
    if not path.name.endswith("_resume.pth"):
        return None
    files = RunFiles(path.parent, path.name[:-len("_resume.pth")])
    for candidate in files.history():
        if os.path.samefile(candidate, path):
            return candidate
    if files.latest_pointer.is_file():
        candidate = path.parent / files.latest_pointer.read_text().strip()
        if candidate.is_file() and manifest_of(candidate).is_file():
            return candidate
    return None


def integrity(path: Path) -> tuple[bool | None, str]:
    """(True: verified / False: problem / None: no manifest, description)."""
    source = find_manifested_file(path)
    if source is None:
        return None, "no manifest (cannot verify the bytes; out/ files and copied checkpoints have none)"
    where = f"{source.parent.name}/{manifest_of(source).name}"
    if os.path.samefile(source, path):
        problem = verify(source)
    else:
        problem = verify(path, manifest_of(source))
    if problem:
        return False, f"PROBLEM: {problem} (manifest {where})"
    return True, f"OK, verified against manifest {where} (size and SHA-256 match)"


# ---- descriptions ---------------------------------------------------------------------------

def describe_resume(state: dict) -> list[str]:
    args, fingerprint = state.get("train_args", {}), state.get("data_fingerprint", {})
    lines_in_data = fingerprint.get("lines")
    consumed = f"{state['samples_consumed']}"
    if lines_in_data is not None:
        consumed += f" of {lines_in_data} samples in the epoch"
    if args.get("global_batch_size") is not None:
        global_batch = f"{args['global_batch_size']} (fixed by --global_batch_size)"
    elif args:
        ws = args.get("world_size", state["world_size"])
        product = args["batch_size"] * ws * args["accumulation_steps"]
        global_batch = (f"{product} = batch_size {args['batch_size']} x world_size {ws} x "
                        f"accumulation {args['accumulation_steps']}")
    else:
        global_batch = "unknown (no train_args)"
    scaler = state.get("scaler")
    scale = f"{float(scaler['scale']):g}" if scaler else "not used (bf16 or fp32 training)"
    tracker_ids = ", ".join(f"{k}={v}" for k, v in state.get("tracker_ids", {}).items() if v) or "none"
    config = state.get("lm_config", {})
    lines = [
        f"epoch:            {state['epoch']} (0-based; the log calls it epoch {state['epoch'] + 1})",
        f"global step:      {state['global_step']}",
        f"samples consumed: {consumed}",
        f"world size:       {state['world_size']}",
        f"global batch:     {global_batch}",
        f"lr:               {state.get('lr', float('nan')):.6g}",
        f"GradScaler scale: {scale}",
        f"parameters:       {count_parameters(state['model']):,}",
        "model config:     " + ", ".join(f"{k}={v}" for k, v in config.items()),
        "train args:       " + ", ".join(f"{k}={v}" for k, v in args.items()),
        "data fingerprint: " + ", ".join(f"{k}={v}" for k, v in fingerprint.items()),
        f"tracker run ids:  {tracker_ids}",
    ]
    return lines


def describe_weights(state: dict[str, torch.Tensor]) -> list[str]:
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
    lines = [f"dtype:            {', '.join(dtypes)}",
             f"parameters:       {count_parameters(state):,}"]
    if all(".lora_" in name for name in state):  # trainer/train_lora.py's out/ file: the adapter alone
        rank, targets = adapter_shape(state)
        lines.append(f"LoRA adapter:     rank {rank} in {','.join(targets)} (alpha: the .json beside it); apply it "
                     f"with eval_model.py --lora, or merge it with scripts/export_hf.py --merge_lora")
        return lines
    try:
        sizes = infer_sizes(state)
    except ValueError as error:  # not this model's layout: say so, the rest of the description stands
        lines.append(f"sizes:            cannot infer: {error}")
        return lines
    lines.append("inferred sizes:   " + ", ".join(f"{k}={v}" for k, v in sizes.items()))
    lines.append(f"size flags:       {size_flags(sizes)} (optional: every loader reads them from the file)")
    return lines


def describe_checkpoint(path: str | Path) -> str:
    """A multi-line description of a resume checkpoint or an FP16 weights file.

    Raises CheckpointError when the file cannot be loaded safely; the message then also says
    what the manifest check found (e.g. a truncated file).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    verified, integrity_line = integrity(path)
    try:
        state = load_trusted(path)
    except CheckpointError as error:
        if isinstance(error.__cause__, pickle.UnpicklingError):
            # torch's own message goes on to explain how to load it unsafely; say what matters here.
            error = CheckpointError(f"{path} refused: it holds pickled objects other than tensors and plain "
                                    f"types, so loading it could run code. Only a file you made yourself "
                                    f"with this project should be inspected")
        raise CheckpointError(f"{error} [integrity: {integrity_line}]") from None
    header = [f"file:             {path} ({human_size(path.stat().st_size)}, {path.stat().st_size} bytes)"]
    if "model" in state and "optimizer" in state:
        header.append("kind:             resume checkpoint")
        header.append(f"integrity:        {integrity_line}")
        return "\n".join(header + describe_resume(state))
    if state and all(isinstance(v, torch.Tensor) for v in state.values()):
        header.append("kind:             inference weights (state dict; the model config is not inside)")
        if verified is not None:
            header.append(f"integrity:        {integrity_line}")
        return "\n".join(header + describe_weights(state))
    raise CheckpointError(f"{path} is a dict with keys {sorted(state)[:8]}: neither a resume checkpoint nor weights")


def describe_history(checkpoint_dir: str | Path, run: str) -> str:
    """Every kept history file of `run`, newest first, with its manifest status."""
    files = RunFiles(Path(checkpoint_dir), run)
    history = files.history()
    if not history:
        return f"no history files in {files.history_dir}"
    resume = files.resume_link if files.resume_link.is_file() else None
    lines = [f"{run}: {len(history)} kept checkpoint(s) in {files.history_dir}, newest first"]
    for path in history:
        problem = verify(path)
        status = "OK" if problem is None else f"PROBLEM: {problem}"
        info = ""
        if manifest_of(path).is_file() and problem is None:
            m = json.loads(manifest_of(path).read_text())
            info = f" epoch {m.get('epoch')} global step {m.get('global_step')} samples {m.get('samples_consumed')}"
        mark = " <- resume link" if resume is not None and os.path.samefile(resume, path) else ""
        lines.append(f"  {path.name}  {human_size(path.stat().st_size):>10}  {status}{info}{mark}")
    aside = sorted(files.history_dir.glob("discarded_after_*"))
    if aside:
        lines.append("set aside by --resume_path: " + ", ".join(p.name for p in aside))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Describe a resume checkpoint or an FP16 weights file")
    parser.add_argument("path", help="a .pth file, or a checkpoint directory together with --run")
    parser.add_argument("--run", default=None, help="with a directory: the run name, e.g. pretrain_512")
    args = parser.parse_args(argv)
    path = Path(args.path)
    try:
        if path.is_dir():
            if args.run is None:
                names = sorted(p.name[:-len("_resume.pth")] for p in path.glob("*_resume.pth"))
                print(f"error: {path} is a directory; pass --run NAME (runs here: {', '.join(names) or 'none'})",
                      file=sys.stderr)
                return 1
            print(describe_history(path, args.run))
        else:
            print(describe_checkpoint(path))
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

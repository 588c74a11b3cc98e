"""Reading what a run leaves on disk, for the tools in scripts/ and for the tests.

    status files      read_status (checks the fields every status file has), list_runs
    resume states     state_differences: two checkpoints compared bit for bit, structure first

The trainer itself only writes these files (trainer/hardening/metrics_files.py, trainer/hardening/checkpoint_io.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.hardening.metrics_files import read_json

# The fields every status file has (see trainer/hardening/metrics_files.py); readers check for them.
STATUS_FIELDS = ("job_id", "status", "current_step", "total_steps", "anomaly_detected", "anomaly_reason",
                 "latest_metrics")


def list_runs(metrics_dir: str | Path) -> list[str]:
    """Names of the runs that have a status file in `metrics_dir`, sorted."""
    suffix = "_status.json"
    return sorted(p.name[:-len(suffix)] for p in Path(metrics_dir).glob(f"*{suffix}"))


def read_status(path: str | Path) -> dict:
    """The status object (a NaN or inf in it, written as text, back as a float); the file is replaced
    atomically, so a read never sees half of it.

    Raises ValueError naming the file and what is wrong: not a JSON object, or without some of STATUS_FIELDS
    (a file written by an older version of the trainer, or not by the trainer at all).
    """
    try:
        status = read_json(Path(path).read_text(encoding="utf-8"))
    except ValueError as error:  # not JSON, or not UTF-8: the error alone would not say which file
        raise ValueError(f"{path}: not a status file of this trainer, it is not JSON ({error}). Rerun (or resume) "
                         f"the run to rewrite it, or move it out of the way.") from None
    if not isinstance(status, dict):  # `"job_id" in status` would look in a list or a string
        raise ValueError(f"{path}: not a status file of this trainer, it holds a JSON {type(status).__name__}, "
                         f"not an object. Rerun (or resume) the run to rewrite it, or move it out of the way.")
    missing = [name for name in STATUS_FIELDS if name not in status]
    if missing:
        raise ValueError(f"{path}: not a status file of this trainer, missing {', '.join(missing)}. "
                         f"Rerun (or resume) the run with this version to rewrite it.")
    return status


# What a resumed run must reproduce bit for bit on the same world size: weights, optimizer, scaler,
# every rank's RNG and the data position. Tests and benchmarks/soak_kill.py judge resumes by it.
TRAINING_STATE_FIELDS = ("model", "optimizer", "scaler", "rng", "epoch", "global_step", "samples_consumed")


def state_differences(a, b, where: str = "") -> list[str]:
    """Every difference between two nested checkpoint values, structure first.

    Dicts must have the same keys and lists the same length before their items are compared, so
    a truncated optimizer state or a missing RNG entry is a difference, never silently skipped.
    Tensors must agree in dtype, shape and every element.
    """
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where or 'top level'}: keys differ, only in first {sorted(map(str, a.keys() - b.keys()))}, "
                    f"only in second {sorted(map(str, b.keys() - a.keys()))}"]
        return [d for key in a for d in state_differences(a[key], b[key], f"{where}.{key}" if where else str(key))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in state_differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        return [] if torch.equal(a, b) else [f"{where}: values differ"]
    if type(a) is not type(b) or a != b:
        return [f"{where}: {a!r} vs {b!r}"]
    return []

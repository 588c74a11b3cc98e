"""What a resume must restore and what it must refuse.

A resumed run continues bit-identically only if everything that shapes the next step is the
same: the weights (FP32), the optimizer moments, every random number generator, the data
position, and the settings that decide which samples form a step. This module captures the
random state, fingerprints the data file, and compares a checkpoint's settings with the current
ones — refusing a change it cannot honour exactly, and saying what it adapted otherwise.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

# Settings that change which samples form a step or how the run's LR curve looks. Refused when
# they differ on resume (world size may change; batch geometry is checked separately).
FIXED_TRAINING_ARGS = ("epochs", "seed", "max_seq_len", "learning_rate", "warmup_ratio", "grad_clip")


class ResumeMismatch(ValueError):
    """The checkpoint was made for another model, data file or training setup."""


# ---- random state -------------------------------------------------------------------------

def capture_rng_state() -> dict:
    """Every RNG this process uses, as tensors and plain types (loadable with weights_only=True)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss_next": py_gauss},
    }


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    py_state = state["python"]
    random.setstate((py_state["version"], tuple(py_state["state"].tolist()), py_state["gauss_next"]))


# ---- data fingerprint ---------------------------------------------------------------------

def data_fingerprint(source, sampled_lines: int = 64) -> dict:
    """Identify a JSONL file cheaply: size, line count and a hash of evenly spaced raw lines.

    `source` is the dataset's indexed JSONL file (it knows the line offsets, so no extra pass).
    The path is recorded for the reader but not compared: a moved file is still the same data.
    """
    count = len(source)
    digest = hashlib.sha256()
    for i in sorted({(k * count) // sampled_lines for k in range(min(sampled_lines, count))}):
        digest.update(source.raw_line(i))
    return {"path": str(source.path), "size": int(source.file_size), "lines": count,
            "sample_sha256": digest.hexdigest()}


# ---- compatibility ------------------------------------------------------------------------

def _diff(kind: str, saved: dict, current: dict, keys) -> list[str]:
    return [f"  {kind}.{key}: checkpoint has {saved.get(key)!r}, this run has {current.get(key)!r}"
            for key in keys if saved.get(key) != current.get(key)]


def check_resume_compatible(saved: dict, lm_config: dict, fingerprint: dict, train_args: dict) -> list[str]:
    """Raise ResumeMismatch listing every field that differs; return notes on what was adapted.

    `train_args` holds batch_size, accumulation_steps, global_batch_size (the requested one or
    None), world_size and FIXED_TRAINING_ARGS of the current run.
    """
    problems = _diff("model", saved["lm_config"], lm_config, sorted(set(saved["lm_config"]) | set(lm_config)))
    problems += _diff("data", saved["data_fingerprint"], fingerprint, ("size", "lines", "sample_sha256"))
    old = saved["train_args"]
    problems += _diff("args", old, train_args, FIXED_TRAINING_ARGS)
    notes = []
    if old["global_batch_size"] is not None or train_args["global_batch_size"] is not None:
        # A fixed global batch makes every step the same set of samples, whatever the split.
        problems += _diff("args", old, train_args, ("global_batch_size",))
        if old["batch_size"] != train_args["batch_size"] or old["world_size"] != train_args["world_size"]:
            notes.append(f"global batch {train_args['global_batch_size']} kept: batch_size x world_size x "
                         f"accumulation {old['batch_size']}x{old['world_size']}x{old['accumulation_steps']} -> "
                         f"{train_args['batch_size']}x{train_args['world_size']}x{train_args['accumulation_steps']}")
    else:
        problems += _diff("args", old, train_args, ("batch_size", "accumulation_steps"))
        if old["world_size"] != train_args["world_size"]:
            notes.append(f"global batch changes with the world size: "
                         f"{old['batch_size'] * old['world_size'] * old['accumulation_steps']} -> "
                         f"{train_args['batch_size'] * train_args['world_size'] * train_args['accumulation_steps']} "
                         f"samples per step (pass --global_batch_size to keep it fixed)")
    if problems:
        raise ResumeMismatch(
            "cannot resume: the checkpoint was made with other settings:\n" + "\n".join(problems) +
            "\nRun with the checkpoint's settings, or start a new run (another --save_weight or "
            "--checkpoint_dir) instead of --from_resume 1.")
    return notes


def rng_state_for_rank(saved_states: list[dict], rank: int, world_size: int) -> dict | None:
    """This rank's saved RNG state when the world size is unchanged, else None (reseed instead)."""
    if len(saved_states) != world_size:
        return None
    return saved_states[rank]


def plain(value: Any) -> Any:
    """Arguments as plain types for the checkpoint (weights_only loading accepts only those)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)

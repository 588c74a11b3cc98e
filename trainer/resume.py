"""Resuming a run: what it restores, and what it refuses.

A resumed run continues bit-identically only if everything that shapes the next step is the
same: the weights (FP32), the optimizer moments, every random number generator, the data
position, and the settings that decide which samples form a step. The load path is

    train_loop.run_training -> resume_if_asked -> trainer_utils.lm_checkpoint -> checkpoint_io

`resume_if_asked` compares the checkpoint's settings with the current ones, refusing a change it
cannot honour exactly (with a diff naming each field) and saying what it adapted otherwise, then
puts the weights, optimizer, RNG and data cursor back with `restore_training_state`.
"""

from __future__ import annotations

import hashlib

import torch

from pathlib import Path

from trainer.checkpoint_io import RunFiles, set_aside_unmanaged_resume_file
from trainer.data_order import step_in_epoch, steps_in_epoch
from trainer.flags import initial_weights_path, model_config_and_weights
from trainer.trainer_utils import ConfigError, lm_checkpoint, restore_rng_state, run_name, unwrap

# Settings that change which samples form a step or how the run's LR curve looks. Refused when
# they differ on resume (world size may change; batch geometry is checked separately).
FIXED_TRAINING_ARGS = ("epochs", "seed", "max_seq_len", "learning_rate", "warmup_ratio", "grad_clip",
                       "system_prompt_ratio", "drop_empty_think_ratio")  # the last two: SFT only


class ResumeMismatch(ConfigError):
    """The checkpoint was made for another model, data file or training setup."""


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


# ---- restoring ----------------------------------------------------------------------------

def load_checkpoint_state(run, resume_path: str | None = None) -> dict | None:
    """The newest good checkpoint of this run (or `resume_path`), its step label for this geometry."""
    return lm_checkpoint(run.lm_config, weight=run.args.save_weight, checkpoint_dir=run.args.checkpoint_dir,
                         resume_path=resume_path, num_samples=len(run.dataset), global_batch=run.global_batch,
                         log=run.log)


def resume_if_asked(run) -> dict:
    """Restore a checkpoint into `run` when --from_resume/--resume_path ask; returns tracker ids."""
    args = run.args
    if not args.from_resume and args.resume_path is None:
        return {}
    state = load_checkpoint_state(run, args.resume_path)
    if state is None:
        run.log(f"--from_resume 1: no checkpoint of {run_name(args.save_weight, run.lm_config)} in "
                f"{args.checkpoint_dir}; starting fresh")
        lm_config, weights = model_config_and_weights(args, run.lm_config.vocab_size, run.log, fresh=True)
        if weights is not None:
            if lm_config != run.lm_config:
                raise ConfigError(f"--from_resume 1 found nothing to resume, and {initial_weights_path(args)} has "
                                  f"another shape than the size flags: pass the file's sizes, or --from_weight none")
            unwrap(run.model).load_state_dict(weights, strict=True)
        return {}
    from_minimind = is_minimind_layout(state)
    if from_minimind:
        state = from_minimind_layout(state, run)
    for note in check_resume_compatible(state, run.lm_config.to_dict(), run.fingerprint, run.train_args()):
        run.log(f"resume: {note}")
    rng_restored = restore_training_state(run, state)
    run.guard.load_state_dict(state.get("anomaly", {}))  # absent in files of older versions
    old_args = state["train_args"]
    old_batch = old_args["batch_size"] * state["world_size"] * old_args["accumulation_steps"]
    old_step = step_in_epoch(len(run.dataset), run.samples_consumed, old_batch)
    old_ws, new_ws = state["world_size"], run.dist.world_size
    change = f"world size {old_ws} -> {new_ws}: " if old_ws != new_ws else ""
    exactness = "the count only: minimind's order differs" if from_minimind else "exact"
    rng = "RNG restored" if rng_restored else "RNG reseeded" + ("" if from_minimind else " for the new world size")
    run.log(f"resumed from {state['resumed_from']}: {change}epoch step {old_step} -> {state['step']}, resuming at "
            f"sample {run.samples_consumed} of epoch {run.epoch + 1} "
            f"({exactness}; global step {run.global_step}, {rng})")
    return state["tracker_ids"]


def keep_unmanaged_resume_file(run) -> None:
    """A `{run}_resume.pth` no manifest accounts for is renamed, never overwritten by our next save."""
    if not run.dist.is_main:
        return
    files = RunFiles(Path(run.args.checkpoint_dir), run_name(run.args.save_weight, run.lm_config))
    aside = set_aside_unmanaged_resume_file(files)
    if aside is not None:
        run.log(f"kept {files.resume_link.name}, which this project's checkpoints do not account for, as {aside} "
                f"(the next save writes {files.resume_link.name})")


# ---- minimind's resume files ----------------------------------------------------------------

MINIMIND_KEYS = {"model", "optimizer", "epoch", "step", "world_size"}


def is_minimind_layout(state: dict) -> bool:
    """minimind's `lm_checkpoint` writes model (fp16), optimizer, epoch, step, world_size, wandb_id."""
    return MINIMIND_KEYS <= set(state) and "samples_consumed" not in state


def from_minimind_layout(raw: dict, run) -> dict:
    """This project's resume state from a minimind one: weights, optimizer, epoch and position kept.

    minimind's `step` counts the micro-batches each rank had taken in the epoch, so the samples
    consumed are step x batch_size x world_size (with this run's --batch_size: minimind does not save
    its own). What minimind does not record cannot be restored, and the log says so.
    """
    samples = min(int(raw["step"]) * run.args.batch_size * int(raw["world_size"]), len(run.dataset))
    run.log(f"resume: {raw['resumed_from']} is a minimind resume file: weights (fp16 -> fp32), optimizer, epoch "
            f"{int(raw['epoch']) + 1} and {samples} samples consumed (step {raw['step']} x batch_size "
            f"{run.args.batch_size} x world size {raw['world_size']}) are restored. Not restored: the exact sample "
            f"cursor (minimind's data order differs, so which samples of this epoch were trained is unknown), the "
            f"RNG states, and the checks of model config, data and settings (the weights still load strictly)")
    return {
        "model": {name: t.float() for name, t in raw["model"].items()},
        "optimizer": raw["optimizer"], "scaler": raw.get("scaler"),
        "epoch": int(raw["epoch"]), "samples_consumed": samples,
        "step": step_in_epoch(len(run.dataset), samples, run.global_batch),
        "global_step": int(raw["epoch"]) * steps_in_epoch(len(run.dataset), run.global_batch)
        + step_in_epoch(len(run.dataset), samples, run.global_batch),
        "world_size": int(raw["world_size"]), "rng": [],  # no RNG states: every rank is reseeded
        "lm_config": run.lm_config.to_dict(), "data_fingerprint": run.fingerprint, "train_args": run.train_args(),
        "tracker_ids": {"wandb": raw.get("wandb_id"), "swanlab": None}, "resumed_from": raw["resumed_from"],
    }


def restore_training_state(run, state: dict) -> bool:
    """Load weights, optimizer, scaler, cursor and (same world size only) RNG; True if RNG restored."""
    unwrap(run.model).load_state_dict(state["model"], strict=True)
    run.optimizer.load_state_dict(state["optimizer"])
    if state["scaler"] is not None:
        run.scaler.load_state_dict(state["scaler"])
    run.epoch, run.samples_consumed = state["epoch"], state["samples_consumed"]
    run.global_step = state["global_step"]
    # Each rank's RNG continues only where it existed; on another world size the ranks were reseeded.
    same_world = len(state["rng"]) == run.dist.world_size
    if same_world:
        restore_rng_state(state["rng"][run.dist.rank])
    return same_world


# ---- judging a resume -----------------------------------------------------------------------

# What a resumed run must reproduce bit for bit on the same world size: weights, optimizer, scaler,
# every rank's RNG and the data position. Tests and scripts/soak_kill.py judge resumes by it.
TRAINING_STATE_FIELDS = ("model", "optimizer", "scaler", "rng", "epoch", "step", "global_step", "samples_consumed")


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

"""Putting weights and training state back into a run: initial weights, resume, rollback.

All three end in the same place: the model, optimizer, GradScaler, random generators and data
cursor hold exactly what a checkpoint recorded, so the next step is the one that would have
followed it. `run` is the loop's RunContext.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.data_order import steps_in_epoch, steps_left
from trainer.resume import check_resume_compatible, restore_rng_state, rng_state_for_rank
from trainer.trainer_utils import lm_checkpoint, run_name, unwrap
from trainer.anomaly_guard import AnomalyStop


def load_initial_weights(model: torch.nn.Module, args, lm_config, log) -> None:
    """--from_weight NAME loads `{save_dir}/{NAME}_{hidden}[_moe].pth` strictly; 'none' keeps random init."""
    if args.from_weight == "none":
        return
    path = Path(args.save_dir) / f"{run_name(args.from_weight, lm_config)}.pth"
    if not path.is_file():
        raise FileNotFoundError(f"--from_weight {args.from_weight}: {path} does not exist. Train that stage first "
                                f"(e.g. trainer/train_pretrain.py with the same --hidden_size), or pass "
                                f"--from_weight none to start from random weights")
    weights = torch.load(path, map_location="cpu", weights_only=True)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as error:
        raise RuntimeError(f"{path} does not fit the model built from the flags (check --hidden_size, "
                           f"--num_hidden_layers, heads, --use_moe):\n{error}") from None
    log(f"loaded initial weights from {path}")


def load_checkpoint_state(run, resume_path: str | None = None) -> dict | None:
    """The newest good checkpoint of this run (or `resume_path`), step rescaled to this geometry."""
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
        load_initial_weights(run.model, args, run.lm_config, run.log)
        return {}
    for note in check_resume_compatible(state, run.lm_config.to_dict(), run.fingerprint, run.train_args()):
        run.log(f"resume: {note}")
    rng_restored = restore_training_state(run, state)
    old_ws, new_ws = state["world_size"], run.dist.world_size
    old_args, n = state["train_args"], len(run.dataset)
    old_batch = old_args["batch_size"] * old_ws * old_args["accumulation_steps"]
    old_step = steps_in_epoch(n, old_batch) - steps_left(n, run.samples_consumed, old_batch)
    change = f"world size {old_ws} -> {new_ws}: " if old_ws != new_ws else ""
    run.log(f"resumed from {state['resumed_from']}: {change}epoch step {old_step} -> {state['step']}, resuming at "
            f"sample {run.samples_consumed} of epoch {run.epoch + 1} (exact; global step {run.global_step}"
            f"{', RNG restored' if rng_restored else ', RNG reseeded for the new world size'})")
    return state["tracker_ids"]


def restore_training_state(run, state: dict) -> bool:
    """Load weights, optimizer, scaler, cursor and (same world size only) RNG; True if RNG restored."""
    unwrap(run.model).load_state_dict(state["model"], strict=True)
    run.optimizer.load_state_dict(state["optimizer"])
    if state["scaler"] is not None:
        run.scaler.load_state_dict(state["scaler"])
    run.epoch, run.samples_consumed = state["epoch"], state["samples_consumed"]
    run.global_step = state["global_step"]
    rng = rng_state_for_rank(state["rng"], run.dist.rank, run.dist.world_size)
    if rng is not None:
        restore_rng_state(rng)
    return rng is not None


def roll_back(run, bad_epoch: int, bad_window_start: int, reason: str) -> None:
    """Return to the newest good checkpoint and arrange to step over the window that went wrong."""
    state = load_checkpoint_state(run)
    if state is None:
        raise AnomalyStop(f"{reason}; no checkpoint to roll back to yet (lower --save_interval)")
    run.guard.plan_rollback(bad_epoch, bad_window_start)
    restore_training_state(run, state)
    run.log(f"rollback {run.guard.rollbacks}/{run.guard.max_rollbacks}: back to step {run.global_step} "
            f"({state['resumed_from']}); will skip the batch window at sample {bad_window_start} of epoch "
            f"{bad_epoch + 1}; lr scale now {run.guard.lr_scale:g}")

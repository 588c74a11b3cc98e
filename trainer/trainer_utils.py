"""Pieces both training scripts share: flags, distributed setup, logging, LR, checkpoints.

`train_pretrain.py` and `train_full_sft.py` differ only in their dataset and defaults; all the
rest lives here (and in the few focused modules next to it) so the two can never drift apart.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from model.model import LMConfig
from trainer import checkpoint_io
from trainer.data_order import steps_in_epoch, steps_left
from trainer.resume import capture_rng_state, plain

REPO_ROOT = Path(__file__).resolve().parent.parent


# ---- flags ----------------------------------------------------------------------------------

def build_arg_parser(description: str, *, save_weight: str, from_weight: str, data_path: str,
                     learning_rate: float, epochs: int) -> argparse.ArgumentParser:
    """The flags common to both scripts (see ARCHITECTURE.md); the script passes its defaults."""
    p = argparse.ArgumentParser(description=description)
    a = p.add_argument
    a("--data_path", default=str(REPO_ROOT / data_path), help="JSONL training data")
    a("--tokenizer_path", default=str(REPO_ROOT / "model" / "tokenizer.json"))
    a("--save_dir", default=str(REPO_ROOT / "out"), help="where FP16 inference weights go")
    a("--checkpoint_dir", default=str(REPO_ROOT / "checkpoints"), help="where resume state goes")
    a("--save_weight", default=save_weight, help="name prefix of the saved files")
    a("--from_weight", default=from_weight, help="'none' or a weight name in --save_dir to start from")
    a("--from_resume", type=int, default=0, choices=(0, 1), help="1: continue from the newest good checkpoint")
    a("--resume_path", default=None, help="resume from this kept checkpoint file instead of the newest")
    a("--keep_last", type=int, default=2, help="verified checkpoints to keep")
    a("--epochs", type=int, default=epochs)
    a("--batch_size", type=int, default=32, help="micro-batch per rank")
    a("--accumulation_steps", type=int, default=1)
    a("--global_batch_size", type=int, default=None,
      help="samples per optimizer step; derives accumulation_steps and keeps steps identical on any GPU count")
    a("--learning_rate", type=float, default=learning_rate)
    a("--warmup_ratio", type=float, default=0.01)
    a("--max_seq_len", type=int, default=340)
    a("--hidden_size", type=int, default=512)
    a("--num_hidden_layers", type=int, default=8)
    a("--num_attention_heads", type=int, default=8)
    a("--num_key_value_heads", type=int, default=4)
    a("--use_moe", type=int, default=0, choices=(0, 1))
    a("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
      help="autocast dtype on CUDA (CPU always trains in float32)")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a("--num_workers", type=int, default=1)
    a("--grad_clip", type=float, default=1.0)
    a("--log_interval", type=int, default=10, help="optimizer steps between log lines")
    a("--save_interval", type=int, default=100, help="optimizer steps between checkpoints")
    a("--max_steps", type=int, default=None, help="stop (and save) after this many steps of this invocation")
    a("--seed", type=int, default=42)
    a("--use_compile", type=int, default=0, choices=(0, 1))
    a("--use_wandb", action="store_true")
    a("--use_swanlab", action="store_true")
    a("--wandb_project", default="tiny-llm-trainer")
    a("--save_debug_train_output", default=None,
      help="JSONL path: one record per optimizer step and rank (sample indices, loss, lr)")
    a("--save_hf", type=int, default=0, choices=(0, 1), help="1: also write a Hugging Face export at each save")
    # Watching the run: metrics files, trackers, validation.
    a("--logger", default="console,file", help="any of console,file,wandb,swanlab, comma-separated")
    a("--metrics_dir", default=None, help="where {run_name}_metrics.jsonl and _status.json go (default --save_dir)")
    a("--run_name", default=None, help="name of the metrics files and tracker run (default {weight}_{hidden})")
    a("--val_data", default=None, help="JSONL validation file in the training format")
    a("--eval_interval", type=int, default=100, help="optimizer steps between validations")
    # Anomalies: what to do when a step looks wrong.
    a("--on_anomaly", default="warn", choices=("warn", "stop", "rollback"))
    a("--patience", type=int, default=0, help="steps without loss improvement that count as a plateau (0: off)")
    a("--max_rollbacks", type=int, default=3)
    a("--rollback_lr_factor", type=float, default=1.0, help="multiply the LR by this after each rollback")
    a("--debug_inject", default=None, help="test aid: nan:K or spike:K makes step K's loss NaN or huge")
    return p


def lm_config_from_args(args, vocab_size: int) -> LMConfig:
    return LMConfig(vocab_size=vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                    num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                    use_moe=bool(args.use_moe))


def run_name(weight: str, lm_config: LMConfig) -> str:
    """`{weight}_{hidden}[_moe]`: the stem of every file a run writes."""
    return f"{weight}_{lm_config.hidden_size}{'_moe' if lm_config.use_moe else ''}"


# ---- distributed ----------------------------------------------------------------------------

@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_flag: str) -> DistInfo:
    """One process (`python`) or one of many (`torchrun` sets RANK/WORLD_SIZE): nccl on CUDA, gloo on CPU."""
    if "RANK" not in os.environ:
        return DistInfo(0, 0, 1, torch.device(device_flag))
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if device_flag.startswith("cuda"):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return DistInfo(rank, local_rank, world_size, device)


def cleanup_distributed(exit_code: int = 0) -> None:
    """Tear the process group down; under torchrun, then end the process at once with `exit_code`.

    Known PyTorch issue: with gloo, C++ worker threads can still be alive when the interpreter
    finalizes, and their destructors abort the process ("terminate called without an active
    exception", exit -6) after training succeeded. Once every rank has passed the barrier and
    the group is destroyed there is nothing left to clean up, so the process exits directly.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


class Logger:
    """Prints on rank 0 only, flushed, so torchrun's interleaved output stays readable."""

    def __init__(self, is_main: bool):
        self.is_main = is_main

    def __call__(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)


def setup_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# Dense bf16 peak of common GPUs (TFLOPS), for MFU = achieved / peak model FLOPs.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "4090": 165.0, "A10": 125.0}


def peak_flops(device: torch.device) -> float | None:
    """The GPU's dense bf16 peak in FLOP/s if it is a known model, else None (MFU is then not logged)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward + backward) plus causal attention scores."""
    return 6 * num_params + 12 * num_layers * hidden_size * seq_len


# ---- schedule and batch geometry ------------------------------------------------------------

def get_lr(progress: float, base_lr: float, warmup_ratio: float) -> float:
    """LR at `progress` = samples trained / samples of the whole run, in [0, 1].

    Following the position in the data (not a step count) keeps the curve continuous when a
    resume changes the world size and with it the number of steps. Linear warmup, then cosine
    from base_lr down to base_lr / 10.
    """
    if warmup_ratio > 0 and progress < warmup_ratio:
        return base_lr * (progress + 1e-8) / warmup_ratio
    decay = (progress - warmup_ratio) / max(1e-8, 1 - warmup_ratio)
    return base_lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(decay, 1.0))))


def resolve_accumulation(batch_size: int, world_size: int, accumulation_steps: int,
                         global_batch_size: int | None) -> tuple[int, int]:
    """(accumulation_steps, global batch). With --global_batch_size, accumulation is derived from it."""
    if global_batch_size is None:
        return accumulation_steps, batch_size * world_size * accumulation_steps
    per_micro_step = batch_size * world_size
    if global_batch_size % per_micro_step != 0:
        raise ValueError(f"--global_batch_size {global_batch_size} is not a multiple of batch_size "
                         f"{batch_size} x world_size {world_size} = {per_micro_step}; choose a global batch "
                         f"or batch size so that it divides")
    return global_batch_size // per_micro_step, global_batch_size


# ---- checkpoints ----------------------------------------------------------------------------

def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model inside DDP and torch.compile wrappers (their state_dict keys get prefixes)."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def lm_checkpoint(lm_config: LMConfig, weight: str = "full_sft", model=None, optimizer=None, epoch: int = 0,
                  step: int = 0, wandb=None, save_dir: str = "out", checkpoint_dir: str = "checkpoints",
                  **kwargs):
    """Save mode (model given): write the FP16 `out/` weights and a verified resume checkpoint.
    Load mode (no model): return the newest good resume state (or `resume_path`'s), else None.

    Save mode must be called on every rank (it gathers each rank's RNG state). kwargs in save
    mode: samples_consumed, global_step, scaler, lr, train_args, data_fingerprint, keep_last,
    swanlab (run). kwargs in load mode: resume_path, num_samples and global_batch (to rescale the
    step to this run's geometry), log.
    """
    files = checkpoint_io.RunFiles(Path(checkpoint_dir), run_name(weight, lm_config))
    if model is None:
        return _load_resume_state(files, **kwargs)
    rng_states = [capture_rng_state()]
    if dist.is_initialized():
        rng_states = [None] * dist.get_world_size()
        dist.all_gather_object(rng_states, capture_rng_state())
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            _write_checkpoint(files, lm_config, unwrap(model), optimizer, epoch, step, wandb, save_dir,
                              rng_states, **kwargs)
        except Exception as caught:  # re-raised below, after telling the other ranks to stop too
            error = caught
    if dist.is_initialized():  # every rank must stop together if rank 0 could not save
        failed = [error is not None]
        dist.broadcast_object_list(failed, src=0)
        if failed[0] and error is None:
            raise checkpoint_io.CheckpointError("rank 0 could not save the checkpoint (see its error)")
    if error is not None:
        raise error


def cast_state_dict(state_dict: dict, dtype: torch.dtype) -> dict:
    """CPU copies in `dtype` that keep tied tensors tied (embedding = lm_head), so files hold them once."""
    converted = {}
    return {name: converted.setdefault(t.data_ptr(), t.detach().to("cpu", dtype))
            for name, t in state_dict.items()}


def _tracker_id(run, name: str) -> str | None:
    if run is None:
        return None
    if not hasattr(run, "id"):
        raise TypeError(f"pass the run object returned by {name}.init(), not the {name} module")
    return str(run.id)


def _write_checkpoint(files, lm_config, model, optimizer, epoch, step, wandb, save_dir, rng_states, *,
                      samples_consumed: int, global_step: int, scaler=None, lr: float = 0.0,
                      train_args: dict | None = None, data_fingerprint: dict | None = None,
                      keep_last: int = 2, swanlab=None) -> None:
    weights = cast_state_dict(model.state_dict(), torch.float16)
    out_path = Path(save_dir) / f"{files.name}.pth"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        checkpoint_io.atomic_write(out_path, lambda f: torch.save(weights, f))
    except OSError as error:
        raise checkpoint_io.CheckpointError(f"could not write {out_path}: {error}") from error
    state = {
        "format_version": 1,
        "model": cast_state_dict(model.state_dict(), torch.float32),  # FP32 master weights
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        "epoch": epoch, "step": step, "global_step": global_step, "samples_consumed": samples_consumed,
        "world_size": len(rng_states), "lr": lr,
        "lm_config": plain(lm_config.to_dict()), "train_args": plain(train_args or {}),
        "data_fingerprint": plain(data_fingerprint or {}), "rng": rng_states,
        "tracker_ids": {"wandb": _tracker_id(wandb, "wandb"), "swanlab": _tracker_id(swanlab, "swanlab")},
    }
    info = {"epoch": epoch, "global_step": global_step, "samples_consumed": samples_consumed}
    checkpoint_io.save_verified(files, state, global_step, keep_last, info)


def _load_resume_state(files, *, resume_path: str | None = None, num_samples: int | None = None,
                       global_batch: int | None = None, log=print) -> dict | None:
    """Pick the checkpoint on rank 0, share the choice, load it on every rank."""
    choice, state = [None], None
    if not dist.is_initialized() or dist.get_rank() == 0:
        choice[0], state = _choose_checkpoint(files, resume_path, log)
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    if state is None:  # the other ranks read the file rank 0 chose and verified
        state = checkpoint_io.load_trusted(Path(choice[0]))
    state["resumed_from"] = choice[0]
    if num_samples is not None and global_batch is not None:
        # The step within the epoch is derived from the sample cursor, so it is exact at any geometry.
        state["step"] = steps_in_epoch(num_samples, global_batch) - steps_left(
            num_samples, state["samples_consumed"], global_batch)
    return state


def _choose_checkpoint(files, resume_path: str | None, log) -> tuple[str | None, dict | None]:
    """(path, loaded state) of the checkpoint to resume; (None, None) when there is nothing."""
    if resume_path is None:
        found = checkpoint_io.newest_good_checkpoint(files, log)
        return (None, None) if found is None else (str(found[0]), found[1])
    path = Path(resume_path)
    problem = checkpoint_io.verify(path)
    if problem:
        raise checkpoint_io.CheckpointError(f"--resume_path {path} cannot be trusted: {problem}")
    newer = [p for p in files.history() if p.name > path.name]
    if newer and path.parent.resolve() == files.history_dir.resolve():
        # Set newer checkpoints aside (not deleted): otherwise a later --from_resume 1 would jump
        # back to the abandoned future instead of continuing this branch of the run.
        aside = files.history_dir / f"discarded_after_{path.stem}"
        aside.mkdir(exist_ok=True)
        for p in newer:
            for f in (p, checkpoint_io.manifest_path(p)):
                if f.exists():
                    os.replace(f, aside / f.name)
        log(f"resuming from {path}; moved the newer checkpoints {', '.join(p.name for p in newer)} to {aside}")
    return str(path), checkpoint_io.load_trusted(path)

"""Pieces both training scripts share, and the checkpoint at the heart of this project.

    distributed   init_distributed / cleanup_distributed, the rank-0 Logger, seeds
    throughput    FLOPs per token and the GPU's peak, for MFU
    schedule      the LR as a function of the position in the data; batch geometry
    validation    the mean loss per token over a validation file
    weights       unwrap (DDP / compile wrappers), the run's file name stem
    checkpoints   lm_checkpoint: what a `_resume.pth` holds, how it is saved and found again

`train_pretrain.py` and `train_full_sft.py` differ only in their dataset and defaults; the loop they
share is train_loop.py, the flags (and the model config, from flags or --from_weight) flags.py.
A save goes lm_checkpoint -> background_save.py (copy to CPU memory, write in a thread) ->
checkpoint_io.py (atomic, hashed, manifested, rotated); a resume goes resume.py (what it restores
or refuses) -> lm_checkpoint -> checkpoint_io.py. stopping.py holds signals and teardown.
"""

from __future__ import annotations

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
from trainer.background_save import BackgroundSaver, StateSnapshot
from trainer.data_order import SkipBatchSampler, step_in_epoch

REPO_ROOT = Path(__file__).resolve().parent.parent


# minimind's readers look for the sampler here (`from trainer.trainer_utils import SkipBatchSampler`).
__all__ = ["SkipBatchSampler", "lm_checkpoint"]


class ConfigError(ValueError):
    """A flag, weights file or checkpoint that does not fit this run: the user's to fix, no traceback."""


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
    """FLOPs of one forward + backward per token (the usual estimate, as in PaLM's appendix B).

    6 * params: every weight does one multiply-add (2 FLOPs) per token forward and two backward.
    The tied embedding counts once: its lookup is free, its use as lm_head is a real matmul.
    12 * layers * hidden * seq: attention scores (Q K^T) and the weighted sum (A V), 2 * seq * hidden
    FLOPs each per token forward, times 3 for forward + backward. Counted for the full square even
    though causal attention could skip half of it, which is the common convention.
    """
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
        raise ConfigError(f"--global_batch_size {global_batch_size} is not a multiple of batch_size "
                         f"{batch_size} x world_size {world_size} = {per_micro_step}; choose a global batch "
                         f"or batch size so that it divides")
    return global_batch_size // per_micro_step, global_batch_size


# ---- validation ---------------------------------------------------------------------------

@torch.no_grad()
def validation_loss(model: torch.nn.Module, dataset, batch_size: int, device: torch.device, autocast) -> float:
    """Mean loss per token over the whole validation file; each rank takes every world_size-th sample."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
    indices = list(range(rank, len(dataset), world_size))
    for start in range(0, len(indices), batch_size):
        rows = [dataset[i] for i in indices[start:start + batch_size]]
        input_ids = torch.stack([r[0] for r in rows]).to(device)
        labels = torch.stack([r[1] for r in rows]).to(device)
        with autocast:
            out = model(input_ids, labels=labels, loss_reduction="sum")
        totals[0] += out.loss.double()
        totals[1] += (labels[:, 1:] != -100).sum()
    if dist.is_initialized():
        dist.all_reduce(totals)
    model.train(was_training)
    return (totals[0] / totals[1].clamp(min=1)).item()


# ---- weights --------------------------------------------------------------------------------

def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model inside DDP and torch.compile wrappers (their state_dict keys get prefixes)."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def run_name(weight: str, lm_config: LMConfig) -> str:
    """`{weight}_{hidden}[_moe]`: the stem of every file a run writes."""
    return f"{weight}_{lm_config.hidden_size}{'_moe' if lm_config.use_moe else ''}"


# ---- checkpoints ----------------------------------------------------------------------------
#
# Two files per save. `out/{run}.pth`: FP16 weights only, for inference and the next stage.
# `checkpoints/{run}_resume.pth`: everything the next optimizer step depends on, so a resumed run
# continues exactly (see resume.py for what it checks). Written by rank 0 through checkpoint_io,
# which makes the file durable, verified and rotated; every rank contributes its RNG state.

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


def cast_state_dict(state_dict: dict, dtype: torch.dtype) -> dict:
    """CPU copies in `dtype` that keep tied tensors tied (embedding = lm_head), so files hold them once."""
    converted = {}
    return {name: converted.setdefault(t.data_ptr(), t.detach().to("cpu", dtype))
            for name, t in state_dict.items()}


def plain(value):
    """Settings as plain types for the checkpoint (weights_only loading accepts only those)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _tracker_id(run, name: str) -> str | None:
    if run is None:
        return None
    if not hasattr(run, "id"):
        raise TypeError(f"pass the run object returned by {name}.init(), not the {name} module")
    return str(run.id)


def lm_checkpoint(lm_config: LMConfig, weight: str = "full_sft", model=None, optimizer=None, epoch: int = 0,
                  step: int = 0, wandb=None, save_dir: str = "out", checkpoint_dir: str = "checkpoints", *,
                  samples_consumed: int = 0, global_step: int = 0, scaler=None, lr: float = 0.0,
                  train_args: dict | None = None, data_fingerprint: dict | None = None,
                  anomaly_state: dict | None = None, keep_last: int = 2, swanlab=None,
                  saver: BackgroundSaver | None = None, resume_path: str | None = None, num_samples: int | None = None,
                  global_batch: int | None = None, log=print) -> dict | None:
    """Save a checkpoint (when `model` is given) or load the newest good one (when it is not).

    Saving must be called on every rank (it gathers each rank's RNG state); rank 0 writes, in the
    background when a `saver` is given (only the copy to CPU memory blocks). The
    positional parameters are minimind's; the keywords after `*` are what exact resume adds.
    `samples_consumed` is the data position; `step` (optimizer steps into the epoch) is only a
    label derived from it for the current global batch.

    Loading returns the state dict of the newest checkpoint that verifies (or `resume_path`'s), or
    None if the run has none. With `num_samples` and `global_batch` its "step" is re-derived for
    this run's global batch: minimind's `step * old_ws // new_ws` is the special case of that when
    all the counts divide.
    """
    files = checkpoint_io.RunFiles(Path(checkpoint_dir), run_name(weight, lm_config))
    if model is None:
        state = _load_resume_state(files, resume_path, log)
        # (A minimind file has no cursor: resume.py converts it, its "step" is minimind's own.)
        if state is not None and "samples_consumed" in state and num_samples is not None and global_batch is not None:
            state["step"] = step_in_epoch(num_samples, state["samples_consumed"], global_batch)
        return state
    rng_states = [capture_rng_state()]
    if dist.is_initialized():
        rng_states = [None] * dist.get_world_size()
        dist.all_gather_object(rng_states, capture_rng_state())
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            model = unwrap(model)
            # What a `_resume.pth` holds: everything the next optimizer step depends on.
            state = {
                "format_version": 1,
                "model": model.state_dict(),  # FP32 master weights (the out/ file gets an FP16 copy)
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
                "epoch": epoch, "step": step, "global_step": global_step,
                "samples_consumed": samples_consumed,  # the data position: the one number resume trusts
                "world_size": len(rng_states), "lr": lr,
                "rng": rng_states,  # one entry per rank: torch, cuda, numpy, python
                "lm_config": plain(lm_config.to_dict()), "train_args": plain(train_args or {}),
                "data_fingerprint": plain(data_fingerprint or {}),
                "anomaly": plain(anomaly_state or {}),
                "tracker_ids": {"wandb": _tracker_id(wandb, "wandb"), "swanlab": _tracker_id(swanlab, "swanlab")},
            }
            info = {"epoch": epoch, "global_step": global_step, "samples_consumed": samples_consumed}
            out_path = Path(save_dir) / f"{files.name}.pth"
            if saver is None:  # synchronous: copy, write, verify, rotate, then return
                write_checkpoint_files(files, out_path, StateSnapshot(pin_memory=False).take(state), keep_last, info)
            else:  # background: only the copy to CPU memory blocks training
                saver.wait()  # at most one save in flight; its buffers are about to be reused
                snapshot = saver.snapshot.take(state)
                saver.submit(lambda: write_checkpoint_files(files, out_path, snapshot, keep_last, info))
        except Exception as caught:  # re-raised below, after telling the other ranks to stop too
            error = caught
    if dist.is_initialized():  # every rank must stop together if rank 0 could not save
        failed = [error is not None]
        dist.broadcast_object_list(failed, src=0)
        if failed[0] and error is None:
            raise checkpoint_io.CheckpointError("rank 0 could not save the checkpoint (see its error)")
    if error is not None:
        raise error
    return None


def write_checkpoint_files(files: checkpoint_io.RunFiles, out_path: Path, state: dict, keep_last: int,
                           info: dict) -> None:
    """Write `out/{run}.pth` (FP16) and the verified resume checkpoint from a CPU copy of the state."""
    weights = cast_state_dict(state["model"], torch.float16)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        checkpoint_io.atomic_write(out_path, lambda f: torch.save(weights, f))
    except OSError as error:
        raise checkpoint_io.CheckpointError(f"could not write {out_path}: {error}") from error
    checkpoint_io.save_verified(files, state, info["global_step"], keep_last, info)


def _load_resume_state(files: checkpoint_io.RunFiles, resume_path: str | None, log) -> dict | None:
    """Rank 0 picks and verifies the checkpoint, shares the choice; every rank loads it."""
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
    return state


def _choose_checkpoint(files: checkpoint_io.RunFiles, resume_path: str | None, log) -> tuple[str | None, dict | None]:
    """(path, loaded state) of the checkpoint to resume; (None, None) when there is nothing."""
    if resume_path is None:
        found = checkpoint_io.newest_good_checkpoint(files, log)
        if found is None and files.resume_link.is_file():  # a lone file: copied here, or minimind's
            log(f"{files.resume_link} has no manifest, so its bytes could not be checksum-verified; "
                f"loading it with weights_only=True")
            return str(files.resume_link), checkpoint_io.load_trusted(files.resume_link)
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

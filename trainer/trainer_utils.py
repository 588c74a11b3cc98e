"""The one helper module both training scripts call, as in minimind. Read it after the script.

    1. running         REPO_ROOT, distributed init, logger, seeds (how a run exits: hardening/process_exit.py)
    2. schedule, step  get_lr (follows the position in the data), batch geometry, optimizer_step (what skips one)
    3. data order      samples_consumed -> SkipBatchSampler: which samples each rank trains, in what order
    4. model           the model from flags or from --from_weight's file
    5. checkpoints     lm_checkpoint: the commented `_resume.pth` dict on save; on load (_load_checkpoint),
                       the state and the step label rescaled to this run's GPU count

The production hardening sits behind one call each in trainer/hardening/, which a first reading skips.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler

from model.hf import export_hf
from model.weights import load_project_weights
from model.model import CausalLM, LMConfig
from trainer.hardening import checkpoint_io, resume_checks, sharding
from trainer.hardening.background_save import BackgroundSaver
from trainer.hardening.durable_files import sha256_of
from trainer.hardening.elastic_store import attempt_store, setup_timeout
from trainer.hardening.flag_checks import check_fits_in_memory
from trainer.hardening.resume_checks import ConfigError
from trainer.hardening.save_on_ranks import gather_rng_states, raise_on_every_rank, write_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent

# ---- 1. running -------------------------------------------------------------------------------

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
    # torchrun hands a restarted group the store of the group before it: keys of this attempt only.
    store = attempt_store(rank, world_size, timeout=setup_timeout())
    if device_flag.startswith("cuda"):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return DistInfo(rank, local_rank, world_size, device)


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over every rank, in place (one process: as it is)."""
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def rank0_logger(is_main: bool) -> Callable[[str], None]:
    """`log(message)`: printed on rank 0 only, flushed, so torchrun's interleaved output stays readable."""
    return (lambda message: print(message, flush=True)) if is_main else (lambda message: None)


def setup_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# ---- 2. schedule, batch geometry and the optimizer step ----------------------------------------

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


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, grad_norm: torch.Tensor,
                   skip: bool = False) -> None:
    """AdamW's step, unless a gradient holds an inf or a NaN, decided on the device: the host does not wait.

    What skips a step, and nothing else does:
      - a non-finite gradient (`grad_norm`, of the gradients all ranks share, so every rank skips alike).
        Under fp16 it is GradScaler's own check (its unscale_ looked at every gradient); under bf16/fp32 the
        same test on the norm, handed to fused AdamW as `found_inf`, the attribute GradScaler sets for it.
        Where it is 1 the kernel leaves weights, moments and step count as they were. A non-finite loss
        makes non-finite gradients, so it is skipped too.
      - `skip`: a window a rollback steps over (the host knows it before the step).
    A spike is applied here; the anomaly guard judges it at the next log line or save, before any
    checkpoint holds it (hardening/step_judge.py).
    """
    if not optimizer.defaults.get("fused"):
        raise ValueError("optimizer_step skips a step on the device: it needs AdamW(..., fused=True)")
    if skip:
        scaler.update()  # (fp16: the unscale_ of this step expects an update; otherwise it does nothing)
        return
    if scaler.is_enabled():
        scaler.step(optimizer)  # fp16: skipped where unscale_ found an inf or NaN
    else:
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # (FSDP: a DTensor)
        optimizer.found_inf = (~torch.isfinite(norm)).float()  # read by the fused kernel, on the device
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    scaler.update()


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


# ---- 3. data order -----------------------------------------------------------------------------
#
# The whole data position of a run is one number: `samples_consumed`, how many samples of the
# current epoch's permutation all ranks together have trained on. Everything else is derived:
#
#     order     = epoch_order(seed, epoch, len(dataset))      # same for python and torchrun
#     remaining = order[samples_consumed:]                    # a view: skipping costs O(1)
#     step s    = remaining[s*G : (s+1)*G]                    # G = the global batch
#     rank r    = step[r::world_size]                         # interleaved share, no overlap
#
# A run stopped after k steps has consumed exactly k*G more samples whatever its world size, and a
# run resumed on another world size continues at that cursor. The last step of an epoch may be
# short; every rank still runs the same number of micro-steps (DDP needs that), and a rank without
# data in a slot gets a placeholder row whose labels are all ignored: it adds nothing to the gradient.

PLACEHOLDER_INDEX = -1


def epoch_order(seed: int, epoch: int, num_samples: int) -> torch.Tensor:
    """The permutation of sample indices for one epoch; depends only on (seed, epoch, num_samples)."""
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def steps_left(num_samples: int, samples_consumed: int, global_batch: int) -> int:
    """Optimizer steps still to take in an epoch (the last one may be a short window)."""
    return math.ceil((num_samples - samples_consumed) / global_batch)


def step_in_epoch(num_samples: int, samples_consumed: int, global_batch: int) -> int:
    """The step label of a cursor: optimizer steps of `global_batch` that reach `samples_consumed`."""
    return steps_left(num_samples, 0, global_batch) - steps_left(num_samples, samples_consumed, global_batch)


class SkipBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches for the rest of one epoch, from a sample cursor, grouped by step.

    Resuming never reads the skipped samples: it slices the order.
    """

    def __init__(self, order: torch.Tensor, samples_consumed: int, global_batch: int,
                 batch_size: int, rank: int, world_size: int):
        if global_batch % (batch_size * world_size) != 0:
            raise ValueError(f"global batch {global_batch} is not a multiple of batch_size {batch_size} "
                             f"x world_size {world_size}")
        if not 0 <= samples_consumed <= len(order):
            raise ValueError(f"samples_consumed {samples_consumed} is outside the epoch of {len(order)} samples")
        self.remaining = order[samples_consumed:]
        self.global_batch, self.batch_size, self.rank, self.world_size = global_batch, batch_size, rank, world_size

    def num_steps(self) -> int:
        return math.ceil(len(self.remaining) / self.global_batch)

    def step_window(self, step: int) -> torch.Tensor:
        """The samples (of all ranks) that optimizer step `step` trains on."""
        return self.remaining[step * self.global_batch:(step + 1) * self.global_batch]

    def micro_steps_per_step(self, step: int) -> int:
        # Rank 0 has the longest share of a short window, so its count is the one all ranks use.
        return math.ceil(math.ceil(len(self.step_window(step)) / self.world_size) / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.num_steps()):
            share = self.step_window(step)[self.rank::self.world_size]
            for micro in range(self.micro_steps_per_step(step)):
                indices = share[micro * self.batch_size:(micro + 1) * self.batch_size].tolist()
                yield indices if indices else [PLACEHOLDER_INDEX]

    def __len__(self) -> int:
        return sum(self.micro_steps_per_step(step) for step in range(self.num_steps()))


def trained_indices(micro_batches: list) -> list[int]:
    """The sample indices in a step's micro-batches (as IndexedDataset yields them), placeholders left out."""
    return [int(i) for indices, _, _ in micro_batches for i in indices if i != PLACEHOLDER_INDEX]


class IndexedDataset(Dataset):
    """Items carry their index (for the debug trace); the placeholder is a row with every label ignored."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        input_ids, labels = self.dataset[max(index, 0)]
        return index, input_ids, labels if index != PLACEHOLDER_INDEX else torch.full_like(labels, -100)


# ---- 4. model ----------------------------------------------------------------------------------

# The flags that shape the model; None means "not given" (the model's default applies).
SIZE_FLAGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "use_moe",
              "intermediate_size", "num_experts", "num_experts_per_tok")


def given_sizes(args) -> dict:
    """The size flags given on the command line (the others are None)."""
    sizes = {name: getattr(args, name) for name in SIZE_FLAGS if getattr(args, name) is not None}
    return {**sizes, "use_moe": bool(sizes.get("use_moe", 0))}


def model_config(args, vocab_size: int) -> LMConfig:
    """The model the size flags describe, for a tokenizer of `vocab_size` tokens; one that cannot fit in the
    device's memory is refused here, before anything is allocated or any directory made (ConfigError)."""
    lm_config = LMConfig(vocab_size=vocab_size, **given_sizes(args))
    check_fits_in_memory(lm_config, args)
    return lm_config


def init_model(args, lm_config: LMConfig, log: Callable[[str], None],
               resume_state: dict | None = None) -> tuple[CausalLM, LMConfig]:
    """The model to train: the checkpoint's when resuming (its weights are restored later), else one
    of `lm_config` with --from_weight's weights, or random ones with --from_weight none.

    With a weights file the sizes are read from its tensors, so minimind's files (or ours of any
    shape) need no size flags; size flags given are checked against it, and a mismatch names both.
    """
    if resume_state is not None:
        lm_config = LMConfig.from_dict(resume_state["lm_config"])  # lm_checkpoint checked it against the flags
        return CausalLM(lm_config), lm_config
    if args.from_weight == "none":
        return CausalLM(lm_config), lm_config
    path = from_weight_path(args)
    if not path.is_file():
        raise FileNotFoundError(f"--from_weight {args.from_weight}: {path} does not exist. Train that stage first "
                                f"(e.g. trainer/train_pretrain.py with the same --hidden_size), or pass "
                                f"--from_weight none to start from random weights")
    try:
        weights, file_config = load_project_weights(path, {name: getattr(args, name) for name in SIZE_FLAGS},
                                                    lm_config.vocab_size)
    except ValueError as error:  # the file does not fit the flags or the tokenizer: the message says how
        raise ConfigError(f"--from_weight {args.from_weight}: {error}") from None
    log(f"initial weights: {path} ({file_config.hidden_size}x{file_config.num_hidden_layers}, "
        f"intermediate {file_config.intermediate_size}{', MoE' if file_config.use_moe else ''})")
    model = CausalLM(file_config)
    model.load_state_dict(weights, strict=True)
    return model, file_config


def from_weight_path(args) -> Path:
    """--from_weight's file: `{save_dir}/{from_weight}_{hidden}[_moe].pth`."""
    return Path(args.save_dir) / f"{args.from_weight}_{args.hidden_size}{'_moe' if args.use_moe else ''}.pth"


def frozen_model(args, lm_config: LMConfig, log: Callable[[str], None]) -> tuple[CausalLM, dict]:
    """--from_weight's model with every weight frozen (LoRA's base, DPO's reference model), and the settings
    that name it: {"base_file", "base_sha256"}. A checkpoint records these instead of a copy of the weights,
    and a resume refuses a file whose hash changed (resume_checks compares "base_sha256")."""
    if args.from_weight == "none":
        raise ConfigError("--from_weight none: this stage starts from trained weights; name them, e.g. "
                          "--from_weight full_sft")
    model, _ = init_model(args, lm_config, log)
    path = from_weight_path(args)
    return model.requires_grad_(False).eval(), {"base_file": str(path), "base_sha256": sha256_of(path)}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model inside DDP and torch.compile wrappers (their state_dict keys get prefixes)."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def run_name(weight: str, lm_config: LMConfig) -> str:
    """`{weight}_{hidden}[_moe]`: the stem of every file a run writes."""
    return f"{weight}_{lm_config.hidden_size}{'_moe' if lm_config.use_moe else ''}"


# ---- 5. checkpoints ----------------------------------------------------------------------------
#
# Two files per save. `out/{run}.pth`: FP16 weights only, for inference and the next stage.
# `checkpoints/{run}_resume.pth`: everything the next optimizer step depends on, so a resumed run
# continues exactly. Rank 0 writes both through checkpoint_io (durable, hashed, rotated); every
# rank contributes its RNG state.

def capture_rng_state() -> dict:
    """Every RNG this process uses, as tensors and plain types (loadable with weights_only=True)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                      "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
            "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64),
                       "gauss_next": py_gauss}}


def restore_training_state(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           scaler: torch.amp.GradScaler, rank: int, world_size: int) -> None:
    """Weights, optimizer, scaler and (on the same world size only) this rank's RNG from `state`."""
    if sharding.is_sharded(model) or "sharded_dir" in state:  # FSDP, or a sharded checkpoint (sharding.py)
        sharding.restore(state, unwrap(model), optimizer)
    else:
        unwrap(model).load_state_dict(state["model"], strict=True)
        optimizer.load_state_dict(state["optimizer"])
    if state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    if len(state["rng"]) == world_size:  # on another world size every rank keeps its fresh seed
        rng = state["rng"][rank]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        n = rng["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
        random.setstate((rng["python"]["version"], tuple(rng["python"]["state"].tolist()), rng["python"]["gauss_next"]))


class Position(NamedTuple):
    """Where a run is in its data: the epoch, the samples of its permutation consumed, the steps taken."""
    epoch: int = 0
    samples_consumed: int = 0  # the data position: the one number a resume trusts
    global_step: int = 0  # optimizer steps since the run began; trackers log against it

    def after(self, window: int, num_samples: int) -> "Position":
        """The position once a step of `window` samples is taken (an epoch's last step starts the next)."""
        consumed = self.samples_consumed + window
        return Position(self.epoch + (consumed == num_samples), consumed % num_samples, self.global_step + 1)


class RunSpec(NamedTuple):
    """What a checkpoint of this run records and a resume of it checks; and which checkpoint resumes it."""
    settings: dict  # batch geometry, seed, LR, epochs (resume_checks.resume_settings)
    data_fingerprint: dict  # size, records and hash of the training file
    num_samples: int
    global_batch: int
    given_sizes: dict  # the size flags given on the command line
    resume_path: str | None = None  # None: the newest good checkpoint


def total_steps(at: Position, num_samples: int, global_batch: int, epochs: int) -> int:
    """The step the run will end at, from its position in the data."""
    return at.global_step + steps_left(num_samples, at.samples_consumed, global_batch) + (
        epochs - at.epoch - 1) * steps_left(num_samples, 0, global_batch)


def lm_checkpoint(lm_config: LMConfig, weight: str = "full_sft", model=None, optimizer=None, epoch: int = 0,
                  step: int = 0, wandb=None, save_dir: str = "out", checkpoint_dir: str = "checkpoints", *,
                  position: Position | None = None, scaler=None, run: RunSpec | None = None,
                  anomaly_state: dict | None = None, trackers: dict | None = None,
                  saver: BackgroundSaver | None = None) -> dict | Path | None:
    """Save a checkpoint (when `model` is given; returns the kept file it writes) or load the newest good one.

    The positional parameters are minimind's (`wandb`: a wandb run); the keywords are what exact resume
    adds (`trackers`: the tracker runs by name, {"wandb": run, "swanlab": run}). Saving runs on every rank,
    right after the step it saves: it gathers each rank's RNG state as it is now; rank 0 writes through
    `saver` (background or not, how many to keep). A sharded (FSDP) model is saved by every rank.
    Loading returns the newest checkpoint that verifies (or `run.resume_path`'s), checked against `run`
    and this `lm_config`, its step label rescaled to this run's global batch; None if the run has none.
    """
    files = checkpoint_io.RunFiles(Path(checkpoint_dir), run_name(weight, lm_config))
    if model is None:
        return _load_checkpoint(files, lm_config, run)
    position = position or Position(epoch, 0, step)
    rng_states = gather_rng_states(position.global_step, capture_rng_state())  # in rank order
    trackers = trackers if trackers is not None else {"wandb": wandb}
    saver = saver or BackgroundSaver(background=False, pin_memory=False)
    error, sharded, kept = None, sharding.is_sharded(model), files.history_file(position.global_step)
    if sharded or not dist.is_initialized() or dist.get_rank() == 0:
        # What a `_resume.pth` holds: everything the next optimizer step depends on.
        state = {
            "format_version": 1,
            # FP32 master weights. The out/ file is this dict with each tensor cast, `t.to("cpu", torch.float16)`
            # (checkpoint_io.write_checkpoint_files, on the copy the writer holds: training is not slowed).
            "model": unwrap(model).state_dict(),
            # AdamW: {"state": {param index: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{"lr", ...}]}
            "optimizer": optimizer.state_dict(),
            # fp16 only: GradScaler's {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            "epoch": position.epoch,
            "samples_consumed": position.samples_consumed,  # the data position: the one number resume trusts
            "step": step,  # a label: this run's global batches that reach samples_consumed
            "global_step": position.global_step,  # optimizer steps since the run began; trackers log against it
            "world_size": len(rng_states), "lr": optimizer.param_groups[0]["lr"],
            # One entry per rank (capture_rng_state): {"torch": CPU generator state, "cuda": [one per GPU],
            # "numpy": {"kind", "keys", "pos", "has_gauss", "cached_gaussian"}, "python": {"version", "state",
            # "gauss_next"}}. A resume on the same world size restores each rank's own (restore_training_state).
            "rng": rng_states,
            # What resume_checks compares, to refuse a resume that would not continue this run:
            "lm_config": resume_checks.plain(lm_config.to_dict()),  # LMConfig's fields: sizes, vocab, rope, MoE
            # {"batch_size", "accumulation_steps", "global_batch_size", "world_size", "epochs", "seed",
            #  "max_seq_len", "pack", "learning_rate", "warmup_ratio", "grad_clip", SFT's two ratios, LoRA's
            #  "lora_rank", "lora_alpha", "lora_targets", DPO's "beta"; LoRA and DPO: "base_file", "base_sha256",
            #  the frozen --from_weight file named, not copied (frozen_model)}
            "train_args": resume_checks.plain(run.settings if run else {}),
            "data_fingerprint": resume_checks.plain(run.data_fingerprint if run else {}),  # path, size, lines, sha256
            # The anomaly guard's memory after this step: {"detector": {"losses", "grad_norms" (the last 20
            # accepted), "best_loss", "best_step", "checks_since_best"}, "rollbacks", "lr_scale", "skip_windows",
            # "skipped_in_a_row" (non-finite steps skipped since the last applied one; --max_skipped_steps)}
            "anomaly": resume_checks.plain(anomaly_state or {}),
            # The wandb / SwanLab run ids (None: not used). A resume hands them back to `init(id=...,
            # resume="allow")` (the script's section 6: Tracker(..., tracker_ids=state["tracker_ids"])),
            # so the curves continue in the same tracker run.
            "tracker_ids": {name: _tracker_id(trackers.get(name), name) for name in ("wandb", "swanlab")},
        }
        info = {"epoch": position.epoch, "global_step": position.global_step,
                "samples_consumed": position.samples_consumed}  # for the manifest
        try:  # copy to CPU memory, then write (in the background if the saver does): checkpoint_io's protocol
            out_path = Path(save_dir) / f"{files.name}.pth"
            kept = write_checkpoint(files, state, unwrap(model), optimizer, out_path, info, saver)
        except Exception as caught:  # re-raised below, after telling the other ranks to stop too
            error = caught
    raise_on_every_rank(error)
    if saver.hf_tokenizer is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        export_hf(unwrap(model).state_dict(), lm_config, Path(save_dir) / f"{files.name}_hf", saver.hf_tokenizer)
    return kept  # the kept copy (the _resume.pth link moves on at the next save)


def _load_checkpoint(files: checkpoint_io.RunFiles, lm_config: LMConfig, run: RunSpec | None) -> dict | None:
    """lm_checkpoint's load: the newest checkpoint that verifies, checked against this run, its step label
    rescaled to this run's global batch (minimind's call, without `run`: the state as saved)."""
    log = _rank0_print
    state = checkpoint_io.load_newest(files, run.resume_path if run else None, log)
    if state is None or run is None:
        if run is not None:
            log(f"--from_resume 1: no checkpoint of {files.name} in {files.checkpoint_dir} yet; starting fresh")
        return state
    if resume_checks.is_minimind_layout(state):  # minimind's file has no cursor: a position from its step
        state = resume_checks.from_minimind_layout(state, lm_config, run.data_fingerprint, run.settings,
                                                   run.num_samples, log)
    try:  # sizes no flag gives are the checkpoint's own, as with --from_weight's file
        lm_config = LMConfig.from_dict({**state["lm_config"], **run.given_sizes})
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{state['resumed_from']}: its model config does not fit this version ({error})")
    for note in resume_checks.check_resume_compatible(state, lm_config.to_dict(), run.data_fingerprint,
                                                      run.settings):
        log(f"resume: {note}")
    # The step label on this GPU count. The data position is samples_consumed, so the label is
    # the number of this run's global batches that reach it, ceil-divided at an epoch's short
    # tail: `samples_consumed // global_batch` when it divides. minimind rescales its step instead,
    # `step * old_ws // new_ws`; its step counts micro-batches, so that is the same number only with
    # --accumulation_steps 1 (and the division exact). With accumulation it lands elsewhere in the data.
    state["step"] = step_in_epoch(run.num_samples, state["samples_consumed"], run.global_batch)
    if state["global_step"] is None:  # minimind's file does not count the steps of earlier epochs
        steps_per_epoch = step_in_epoch(run.num_samples, run.num_samples, run.global_batch)
        state["global_step"] = state["epoch"] * steps_per_epoch + state["step"]
    log(resume_checks.resume_summary(state, run.settings["world_size"], run.global_batch))
    return state


def _rank0_print(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def _tracker_id(run, name: str) -> str | None:
    if run is not None and not hasattr(run, "id"):
        raise TypeError(f"pass the run object returned by {name}.init(), not the {name} module")
    return None if run is None else str(run.id)

"""The helper module with the step's math, as minimind's trainer_utils. Read it after the script, hardening/ later.

    1. running         REPO_ROOT, sums over ranks, logger, seeds (joining torchrun: hardening/process_group.py)
    2. the step        get_lr (follows the data), no_sync (gradient sync on the last micro-step), make_optimizer
                       (AdamW; Muon), optimizer_step (what skips a step), Step and read_on_host (step N's numbers)
    3. data order      resolve_accumulation (the global batch), samples_consumed -> SkipBatchSampler (who trains what)
    4. checkpoints     model_config, lm_checkpoint (the commented `_resume.pth` dict; the FP16 out/ file:
                       write_checkpoint_files), load_checkpoint (the newest good one, checked; another GPU count:
                       resume_checks), restore_training_state (what a resume restores); kill -9: checkpoint_io's top
Every number of a step is computed here, in the script or the model's forward (the epoch's order less the windows
rollbacks left out: hardening/anomaly_policy.py); trainer/hardening/ keeps files safe, times the log, stops runs."""

from __future__ import annotations

import math
import random
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from dataset.indexed import PLACEHOLDER_INDEX
from model.hf import export_hf
from model.model import CausalLM, LMConfig
from trainer.hardening import checkpoint_io, out_weights, resume_checks, sharding
from trainer.hardening.anomaly_policy import cursor_after, kept_spans, steps_left
from trainer.hardening.background_save import BackgroundSaver
from trainer.hardening.flag_checks import check_fits_in_memory
from trainer.hardening.from_weight import given_sizes
from trainer.hardening.run_lock import raise_if_lock_lost
from trainer.hardening.save_on_ranks import gather_rng_states, raise_on_every_rank, restore_rng_state

REPO_ROOT = Path(__file__).resolve().parent.parent

# ---- 1. running -------------------------------------------------------------------------------

def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:  # in place (one process: as it is)
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def rank0_logger(is_main: bool) -> Callable[[str], None]:  # log(message): on rank 0 only, flushed
    return (lambda message: print(message, flush=True)) if is_main else (lambda message: None)


def setup_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every device's generator, each GPU's too


# ---- 2. the step: its LR, what skips it, its numbers -------------------------------------------

def get_lr(progress: float, base_lr: float, warmup_ratio: float) -> float:
    """LR at `progress` (the data position the step reaches / the run's): linear warmup, then cosine to base_lr / 10.
    It follows the data, not a step count, so a resume on another GPU count continues the same curve."""
    if warmup_ratio > 0 and progress < warmup_ratio:
        return base_lr * (progress + 1e-8) / warmup_ratio
    decay = (progress - warmup_ratio) / max(1e-8, 1 - warmup_ratio)
    return base_lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(decay, 1.0))))


@contextmanager
def no_sync(model: torch.nn.Module, accumulate_only: bool = True) -> Iterator[None]:
    """A micro-step whose gradients are only accumulated, not yet all-reduced: DDP's no_sync (FSDP: its switch).
    `accumulate_only` False (a step's last micro-step): nothing changes, the gradients are reduced once per step."""
    if not accumulate_only or (not sharding.is_sharded(model) and not hasattr(model, "no_sync")):  # 1 process
        yield
    elif not sharding.is_sharded(model):
        with model.no_sync():
            yield
    else:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, grad_norm: torch.Tensor) -> None:
    """The step, skipped where, and only where, `grad_norm` (of the gradients all ranks share: all skip alike) is not
    finite: on the device (fp16: GradScaler's own check; Muon: the host reads it). A spike is applied, judged later."""
    if not optimizer.defaults.get("fused"):
        raise ValueError("optimizer_step skips a step on the device: it needs AdamW(..., fused=True)")
    if scaler.is_enabled():
        scaler.step(optimizer)  # fp16: skipped where unscale_ found an inf or NaN
    else:
        # = `if torch.isfinite(grad_norm): optimizer.step()`, whose `if` makes the host wait for the GPU every step.
        # torch >= 2.4: AdamW.step() (optim/adamw.py; adam.py once AdamW became Adam) hands getattr(self, "found_inf")
        # to the fused kernel: where 1, weights, moments, step count stay (tried before training: optimizer_checks.py).
        optimizer.found_inf = (~torch.isfinite(sharding.whole(grad_norm))).float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    scaler.update()


def make_optimizer(module: torch.nn.Module, args) -> torch.optim.Optimizer:
    """AdamW over `module`'s trainable parameters (fused: one kernel, and it can skip a step on the device), or with
    --optimizer muon (pretraining, SFT) Muon (below) for the hidden matrices and AdamW for the rest: the embedding
    (= the tied LM head: a lookup table, a row per token), the norms' gains and MoE's router."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]  # the tied head: once
    on_muon = {id(p) for name, p in named if p.ndim == 2 and name.endswith("_proj.weight")  # q, k, v, o; gate, up,
               and getattr(args, "optimizer", "adamw") == "muon"}  # down: 2-D matrices acting on hidden states
    adamw = torch.optim.AdamW([p for _, p in named if id(p) not in on_muon], lr=args.learning_rate,
                              weight_decay=getattr(args, "weight_decay", 0.01), fused=True)
    if not on_muon:
        return adamw
    muon = Muon([p for _, p in named if id(p) in on_muon], lr=args.muon_learning_rate,
                weight_decay=args.muon_weight_decay, adjust_lr_fn="match_rms_adamw")  # (Muon.step reads no other)
    muon.param_groups[0]["lr_ratio"] = args.muon_learning_rate / args.learning_rate  # the loop: schedule x lr_ratio
    return MuonAndAdamW(muon, adamw)


class Muon(torch.optim.Muon):
    """torch's Muon (arguments, state: a "momentum_buffer" a matrix), its step written out to run Newton-Schulz in
    float32 on a CPU: torch's runs it in bfloat16, which a CPU emulates (15x slower at the demo's shape)."""
    cpu_dtype = torch.float32

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in [p for p in group["params"] if p.grad is not None]:
                momentum = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                momentum.lerp_(p.grad, 1 - group["momentum"])  # m = 0.95 m + 0.05 g
                update = p.grad.lerp(momentum, group["momentum"]) if group["nesterov"] else momentum  # 0.05 g + 0.95 m
                update = newton_schulz(update, group["ns_steps"], self.cpu_dtype if p.is_cpu else torch.bfloat16)
                p.mul_(1 - group["lr"] * group["weight_decay"])  # match_rms_adamw: the RMS of an update is about
                p.add_(update, alpha=-group["lr"] * 0.2 * math.sqrt(max(p.shape)))  # AdamW's, so is the LR


def newton_schulz(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """What Muon does to a matrix's update: `steps` times x <- a x + (b x x^T + c (x x^T)^2) x move every singular
    value of x towards 1 and keep its singular vectors: the update keeps its directions, each moved as far."""
    a, b, c = 3.4445, -4.7750, 2.0315  # torch's: a quintic chosen to pull small singular values up fast (slope a)
    tall = update.shape[0] > update.shape[1]  # x x^T: the smaller Gram matrix
    x = update.to(dtype).T if tall else update.to(dtype)
    x = x / x.norm().clamp(min=1e-7)  # the Frobenius norm >= the largest singular value: every one starts <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # (as torch's, op for op)
    return x.T if tall else x


class MuonAndAdamW:
    """Muon and AdamW stepped together, seen by the loop, GradScaler and the checkpoint as one optimizer."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw, self.defaults = muon, adamw, adamw.defaults  # defaults["fused"]: optimizer_step

    @property  # (each load_state_dict gives the optimizer new group dicts, so they are read anew each time)
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups + self.muon.param_groups  # AdamW's first: the checkpoint's "lr"

    def step(self) -> None:
        # found_inf (optimizer_step; 1: a gradient not finite) skips AdamW's fused step on the device; Muon's step
        # takes none, so the host reads it: with --optimizer muon, one wait for the device a step
        found_inf = self.adamw.found_inf = getattr(self, "found_inf", None)
        self.adamw.step()
        del self.adamw.found_inf
        if found_inf is None or not found_inf.item():
            self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none)
        self.muon.zero_grad(set_to_none)

    def state_dict(self) -> dict:  # `_resume.pth`'s "optimizer": Muon's state is one "momentum_buffer" a matrix
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: dict) -> None:  # (resume_checks refused a checkpoint of the other --optimizer)
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])

    def register_step_pre_hook(self, hook):  # background_save.py: the copy of step N ends before a weight changes
        return self.adamw.register_step_pre_hook(hook), self.muon.register_step_pre_hook(hook)


class Step(NamedTuple):  # what the host knows of optimizer step N without asking the device
    number: int  # N: the global step (1 for the first step of a run)
    epoch: int
    start: int  # samples_consumed at the window's start
    end: int  # and after it (past a window a rollback left out): [start, end) is what a rollback leaves out
    lr: float
    samples: list[int]  # the sample indices this rank trained in it
    input_tokens: int  # this rank's tokens, for tokens/s


class StepNumbers(NamedTuple):  # step N's numbers, read from the device (read_on_host)
    loss: float  # the loss sum of all ranks / the label tokens of the whole global batch (MoE: no aux_loss)
    grad_norm: float  # before clipping, of the gradients all ranks share
    loss_sum: float  # this rank's part of the loss sum
    local_tokens: int  # this rank's label tokens
    all_input_tokens: int  # the input tokens of all ranks, for tokens/s


def read_on_host(taken: list[tuple[Step, list[torch.Tensor]]]) -> list[tuple[Step, StepNumbers]]:
    """Each step taken since the last wait, with its numbers: `taken` holds its [loss sum, label tokens, global
    label tokens, grad norm] on the device, read in one transfer (`tolist`: the host waits for the device). The
    loss sums and input tokens are added over the ranks in rank order, the same for 1 step read or 10."""
    steps = [step for step, _ in taken]
    local = torch.stack([torch.stack([loss_sum, local_tokens, global_tokens, sharding.whole(grad_norm).double()])
                         for _, (loss_sum, local_tokens, global_tokens, grad_norm) in taken])
    inputs = torch.tensor([float(s.input_tokens) for s in steps], dtype=torch.float64)  # known on the host, sent to
    shared = torch.stack([local[:, 0], inputs.to(local.device, non_blocking=True)], dim=1)  # the device with no wait
    if dist.is_initialized():
        gathered = [torch.empty_like(shared) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, shared)
        shared = sum(gathered[1:], gathered[0])
    rows = torch.cat([local, shared], dim=1).tolist()  # the one wait for the device
    return [(step, StepNumbers(all_loss / max(global_tokens, 1.0), grad_norm, loss_sum, int(local_tokens), int(inputs)))
            for step, (loss_sum, local_tokens, global_tokens, grad_norm, all_loss, inputs) in zip(steps, rows)]


# ---- 3. data order -----------------------------------------------------------------------------
# The whole data position of a run is one number: `samples_consumed`, how far into the current epoch's
# permutation all ranks together have got (trained, or a skipped step's). Everything else is derived:
#     order     = epoch_order(seed, epoch, len(dataset))      # same for python and torchrun
#     remaining = order[samples_consumed:]                    # a view: skipping costs O(1)
#     step s    = remaining[s*G : (s+1)*G]                    # G = the global batch
#     rank r    = step[r::world_size]                         # interleaved share, no overlap
#
# After k more full steps the cursor is k*G further (and past any window a rollback left out); a run resumed on
# another world size continues there. The last step of an epoch may be short; every rank still runs the same
# number of micro-steps (DDP needs that), and a rank without data in a slot gets a placeholder row, labels all
# ignored: nothing in the next-token loss or its gradient (under MoE it is routed: in aux_loss).

def resolve_accumulation(batch_size: int, world_size: int, accumulation_steps: int,
                         global_batch_size: int | None) -> tuple[int, int]:
    """(accumulation_steps, global batch G). With --global_batch_size, accumulation is derived from it, so a step
    trains the same G samples on any GPU count; without, G = batch_size x world_size x accumulation_steps."""
    if global_batch_size is None:
        return accumulation_steps, batch_size * world_size * accumulation_steps
    per_micro_step = batch_size * world_size
    if global_batch_size % per_micro_step != 0:
        raise resume_checks.ConfigError(f"--global_batch_size {global_batch_size} is not a multiple of batch_size "
                                        f"x world_size = {per_micro_step}; choose a global batch or batch size to fit")
    return global_batch_size // per_micro_step, global_batch_size


def epoch_order(seed: int, epoch: int, num_samples: int) -> torch.Tensor:
    """The permutation of sample indices for one epoch: the same for (seed, epoch, num_samples) under one torch."""
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


class SkipBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches for the rest of an epoch: what was trained is skipped (sliced, never read) at one
    global sample cursor, the same on any GPU count. After a rollback only, its `left_out` windows are cut out too."""

    def __init__(self, order: torch.Tensor, samples_consumed: int, global_batch: int,
                 batch_size: int, rank: int, world_size: int, left_out=()):
        if global_batch % (batch_size * world_size) != 0:
            raise ValueError(f"global batch {global_batch} % (batch_size x world_size {batch_size * world_size}) != 0")
        if not 0 <= samples_consumed <= len(order):
            raise ValueError(f"samples_consumed {samples_consumed} is outside the epoch of {len(order)} samples")
        self.start, self.num_samples, self.spans = samples_consumed, len(order), None
        self.remaining = order[samples_consumed:]  # a view: skipping what was trained costs nothing
        if left_out:  # the order less the windows: its kept spans, joined (step_end maps a cursor back through them)
            self.spans = kept_spans(samples_consumed, len(order), left_out)
            self.remaining = torch.cat([order[start:end] for start, end in self.spans] or [order[:0]])
        self.global_batch, self.batch_size, self.rank, self.world_size = global_batch, batch_size, rank, world_size

    def num_steps(self) -> int:
        return math.ceil(len(self.remaining) / self.global_batch)

    def step_window(self, step: int) -> torch.Tensor:
        """The samples (of all ranks) that optimizer step `step` trains on."""
        return self.remaining[step * self.global_batch:(step + 1) * self.global_batch]

    def step_end(self, step: int) -> int:
        """The data position once step `step` is taken: samples_consumed + (step + 1) x G, or the epoch's end."""
        if self.spans is not None:  # past the windows a rollback left out
            return cursor_after(self.spans, (step + 1) * self.global_batch, self.num_samples)
        return min(self.start + (step + 1) * self.global_batch, self.num_samples)

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


def model_config(args, vocab_size: int) -> LMConfig:
    """The model the size flags describe, for a tokenizer of `vocab_size` tokens."""
    lm_config = LMConfig(vocab_size=vocab_size, **given_sizes(args))
    check_fits_in_memory(lm_config, args)  # one that cannot fit is refused now, before anything is allocated
    return lm_config


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model inside DDP and torch.compile wrappers (their state_dict keys get prefixes)."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def run_name(weight: str, lm_config: LMConfig) -> str:
    """`{weight}_{hidden}[_moe]`: the stem of every file a run writes."""
    return f"{weight}_{lm_config.hidden_size}{'_moe' if lm_config.use_moe else ''}"


# ---- 4. checkpoints: `out/{run}.pth` (FP16, for inference) and `checkpoints/{run}_resume.pth` ---------

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
    if len(state["rng"]) == world_size:  # this rank's RNGs as saved, so it draws what a run never stopped would
        restore_rng_state(state["rng"][rank])  # (on another world size, each rank keeps its fresh seed)


class Position(NamedTuple):
    """Where a run is: the epoch, the samples of its permutation consumed, the optimizer steps taken."""
    epoch: int = 0
    samples_consumed: int = 0  # the data position: the one number a resume trusts
    global_step: int = 0  # optimizer steps since the run began; trackers log against it

    def after(self, end: int, num_samples: int) -> "Position":  # once a step ending at cursor `end` is taken
        return Position(self.epoch + (end == num_samples), end % num_samples, self.global_step + 1)


class RunSpec(NamedTuple):
    """What a checkpoint of this run records and a resume of it checks; and which checkpoint resumes it."""
    settings: dict  # batch geometry, seed, LR, epochs (resume_checks.resume_settings)
    data_fingerprint: dict  # size, records and hash of the training file
    num_samples: int
    global_batch: int
    given_sizes: dict  # the size flags given on the command line
    resume_path: str | None = None  # None: the newest good checkpoint


def total_steps(at: Position, num_samples: int, global_batch: int, epochs: int, left_out=()) -> int:
    """The step the run ends at, from its position in the data, less the (epoch, start, end) windows `left_out`."""
    return at.global_step + sum(steps_left(num_samples, at.samples_consumed if epoch == at.epoch else 0, global_batch,
                                           [(start, end) for e, start, end in left_out if e == epoch])
                                for epoch in range(at.epoch, epochs))


def lm_checkpoint(lm_config: LMConfig, weight: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                  position: Position, run: RunSpec, save_dir: str = "out", checkpoint_dir: str = "checkpoints",
                  scaler: torch.amp.GradScaler | None = None, anomaly_state: dict | None = None,
                  trackers: dict | None = None, saver: BackgroundSaver | None = None) -> Path:
    """Save step `position.global_step`: `out/{run}.pth` and the `_resume.pth` dict below. Every rank calls it
    right after that step: each gives its RNG state, rank 0 writes (sharded: each rank its slices) through
    `saver` (in a thread with --async_save; how many to keep). `trackers`: the wandb/SwanLab runs by name."""
    files = checkpoint_io.RunFiles(Path(checkpoint_dir), run_name(weight, lm_config))
    out_path = Path(save_dir) / f"{files.name}.pth"
    rng_states = gather_rng_states(position.global_step)  # every rank's, in rank order
    saver, trackers = saver or BackgroundSaver(False, False), {"wandb": None, "swanlab": None, **(trackers or {})}
    error, sharded, kept = None, sharding.is_sharded(model), files.history_file(position.global_step)
    if sharded or not dist.is_initialized() or dist.get_rank() == 0:
        # What a `_resume.pth` holds: everything the next optimizer step depends on.
        state = {
            "format_version": 1,
            "model": unwrap(model).state_dict(),  # FP32 master weights (the out/ file: write_checkpoint_files)
            # AdamW: {"state": {param index: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{"lr", ...}]}
            "optimizer": optimizer.state_dict(),
            # fp16 only: GradScaler's {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            "epoch": position.epoch,
            "samples_consumed": position.samples_consumed,  # the data position: the one number resume trusts
            # The epoch's first samples as this torch draws its order: a torch that draws another is refused on resume
            "order_head": epoch_order(run.settings["seed"], position.epoch, run.num_samples)[:8].tolist(),
            "global_step": position.global_step,  # optimizer steps since the run began; trackers log against it
            "world_size": len(rng_states), "lr": optimizer.param_groups[0]["lr"],  # (read by people: get_lr recomputes)
            # Each rank's RNG states ({"torch", "cuda", "numpy", "python"}), in rank order; a resume on the
            "rng": rng_states,  # same world size restores each rank's own (restore_training_state)
            # What resume_checks compares, to refuse a resume that would not continue this run:
            "lm_config": resume_checks.plain(lm_config.to_dict()),  # LMConfig's fields: sizes, vocab, rope, MoE
            # {"batch_size", "accumulation_steps", "global_batch_size", "world_size", "epochs", "seed", "max_seq_len",
            #  "learning_rate", ..., each stage's own (resume_checks.FIXED_TRAINING_ARGS), the frozen model's hash}
            "train_args": resume_checks.plain(run.settings),
            "data_fingerprint": resume_checks.plain(run.data_fingerprint),  # path, size, lines, sha256
            # The anomaly guard's memory after this step: {"detector": {"losses", "grad_norms" (the last 20
            # accepted), "best_loss", "best_step", "checks_since_best"}, "rollbacks", "lr_scale", "left_out" (the
            # [epoch, start, end] windows rollbacks left out of training), "skipped_in_a_row" (non-finite steps
            # skipped since the last applied one; --max_skipped_steps)}
            "anomaly": resume_checks.plain(anomaly_state or {}),
            # The wandb / SwanLab run ids (None: not used): a resume continues them (the script's Tracker(tracker_ids=))
            "tracker_ids": {name: None if run is None else str(run.id) for name, run in trackers.items()},
        }
        info = {key: state[key] for key in ("epoch", "global_step", "samples_consumed")}  # for the manifest
        try:
            if sharded:  # every rank writes its slices of the weights and moments, rank 0 the rest (sharding.py)
                kept = sharding.save_sharded(files, state, model, optimizer, out_path, saver.keep_last, info, saver,
                                             saver.gather_weights)
            else:
                # The save holds step N: copy = `state` with each tensor copied to the CPU before the next optimizer
                # step can change a weight (on a GPU: into reused pinned buffers, on a side stream the next step waits
                # for on the device); write_checkpoint_files then runs now, or with --async_save on a thread.
                copy = saver.copy(state)  # (first waits for the save before, if it is still being written)
                saver.write(write_checkpoint_files, files, out_path, copy, info, saver.keep_last)
        except Exception as caught:  # re-raised below, after telling the other ranks to stop too
            error = caught
    raise_on_every_rank(error)
    if saver.hf_tokenizer is not None and (not dist.is_initialized() or dist.get_rank() == 0):  # --save_hf
        export_hf(unwrap(model).state_dict(), lm_config, Path(save_dir) / f"{files.name}_hf", saver.hf_tokenizer)
    return kept  # the kept copy (the _resume.pth link moves on at the next save)


def write_checkpoint_files(files: checkpoint_io.RunFiles, out_path: Path, copy: dict, info: dict,
                           keep_last: int) -> None:
    """From the CPU copy of step N: out/{run}.pth and .json, {run}_history/step_N.pth, its manifest, `_resume.pth` (a
    hard link), `_latest.txt`, each via a temp file. Why a kill -9 tears none: hardening/checkpoint_io.py's top."""
    raise_if_lock_lost()  # LockLost if another run took these directories over (run_lock.py): nothing written
    # The out/ file: every weight cast to FP16, half the bytes, for inference and the next stage (the resume file
    # keeps the FP32 masters). Tensors that share storage (the tied embedding and lm_head) stay one tensor.
    fp16 = {}
    weights = {name: fp16.setdefault(t.data_ptr(), t.to(torch.float16)) for name, t in copy["model"].items()}
    out_weights.write_out_weights(out_path, weights, copy["train_args"], raise_if_lock_lost)  # + out/{run}.json
    checkpoint_io.save_verified(files, copy, info["global_step"], keep_last, info, raise_if_lock_lost)


def load_checkpoint(lm_config: LMConfig, weight: str, checkpoint_dir: str, run: RunSpec) -> dict | None:
    """The `_resume.pth` dict of the newest checkpoint that verifies (or of `run.resume_path`), checked against
    this run: same model, data and settings, or a readable diff (resume_checks.py). None if the run has none."""
    files = checkpoint_io.RunFiles(Path(checkpoint_dir), run_name(weight, lm_config))
    log = rank0_logger(not dist.is_initialized() or dist.get_rank() == 0)
    state = checkpoint_io.load_newest(files, run.resume_path, log)
    if state is None:
        log(f"--from_resume 1: no checkpoint of {files.name} in {files.checkpoint_dir} yet; starting fresh")
        return None
    # A minimind file (a step count, no sample cursor) is converted; a resume that changed the model, data or
    # settings is refused with a diff. No step is rescaled to this GPU count: the position is samples_consumed,
    # the same on any (section 3); resume_checks.gpu_count_rule says what another GPU count may change.
    state = resume_checks.checked_for_resume(state, lm_config, run, log)
    drawn = epoch_order(run.settings["seed"], state["epoch"], run.num_samples)[:8].tolist()
    if state.get("order_head", drawn) != drawn:  # another torch.randperm: samples would repeat and be skipped
        raise resume_checks.ConfigError(f"{state['resumed_from']}: torch {torch.__version__} orders the epoch's samples"
                                        f" otherwise than the torch that saved it; resume under that one or start anew")
    return state

"""The training run both scripts share, as numbered sections you can read top to bottom.

    1. distributed init   2. config   3. precision   4. data   5. model + optimizer
    6. resume             7. compile + DDP            8. train  9. cleanup

One optimizer step (`train_step`) = the next global batch of the epoch's order, split across
ranks and micro-steps; gradients are synced only on the last micro-step (DDP `no_sync`), and the
loss is normalised by the token count of the whole global batch, so the gradient is the same
however the batch is split across GPUs and micro-steps.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from dataset.lm_dataset import load_tokenizer
from model.model import CausalLM
from trainer import callbacks as cb
from trainer.data_order import IndexedDataset, SkipBatchSampler, epoch_order, steps_in_epoch, steps_left
from trainer.resume import (FIXED_TRAINING_ARGS, check_resume_compatible, data_fingerprint,
                            restore_rng_state, rng_state_for_rank)
from trainer.trainer_utils import (DistInfo, Logger, cleanup_distributed, get_lr, init_distributed,
                                   lm_checkpoint, lm_config_from_args, resolve_accumulation, run_name,
                                   setup_seed, unwrap)


# Test-only: seconds to sleep after each step, so a test can signal a run while it is training.
STEP_DELAY_ENV = "TRAINER_TEST_STEP_DELAY_S"


def pause_for_tests(variable: str) -> None:
    delay = float(os.environ.get(variable, "0") or 0)
    if delay > 0:
        time.sleep(delay)


@dataclass
class RunContext:
    """Everything one run holds; passed to the step function and to callbacks."""

    args: object
    dist: DistInfo
    log: Logger
    lm_config: object
    dataset: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast: object
    accumulation: int
    global_batch: int
    fingerprint: dict
    callbacks: cb.CallbackList = None
    epoch: int = 0
    samples_consumed: int = 0        # of the current epoch's order, all ranks together
    global_step: int = 0             # optimizer steps since the run began (monotonic, for trackers)
    steps_this_invocation: int = 0
    meter: dict = field(default_factory=dict)  # wall clock and tokens, for tokens/s and ETA
    tracker_runs: dict = field(default_factory=dict)
    stop_signal: str | None = None

    @property
    def total_steps(self) -> int:
        return self.args.epochs * steps_in_epoch(len(self.dataset), self.global_batch)

    def steps_remaining(self) -> int:
        n, g = len(self.dataset), self.global_batch
        return steps_left(n, self.samples_consumed, g) + (self.args.epochs - self.epoch - 1) * steps_in_epoch(n, g)

    def progress(self) -> float:
        """Fraction of the whole run's samples trained so far: the LR schedule's clock."""
        n = len(self.dataset)
        return (self.epoch * n + self.samples_consumed) / (self.args.epochs * n)

    def train_args(self) -> dict:
        a = self.args
        return {"batch_size": a.batch_size, "accumulation_steps": self.accumulation,
                "global_batch_size": a.global_batch_size, "world_size": self.dist.world_size,
                **{k: getattr(a, k) for k in FIXED_TRAINING_ARGS}}


def run_training(args, make_dataset) -> None:
    """Train with `args` on `make_dataset(data_path, tokenizer, max_seq_len)`."""
    # 1. Distributed init: one process, or one per GPU/CPU rank under torchrun.
    dist_info = init_distributed(args.device)
    log = Logger(dist_info.is_main)
    setup_seed(args.seed)  # identical initial weights on every rank

    # 2. Config: model shape from flags and tokenizer; batch geometry from the world size.
    tokenizer = load_tokenizer(args.tokenizer_path)
    lm_config = lm_config_from_args(args, tokenizer.get_vocab_size())
    accumulation, global_batch = resolve_accumulation(args.batch_size, dist_info.world_size,
                                                      args.accumulation_steps, args.global_batch_size)

    # 3. Precision: bf16 (or fp16 + GradScaler) autocast on CUDA; plain fp32 on CPU.
    use_cuda = dist_info.device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    autocast = torch.autocast("cuda", dtype=dtype) if use_cuda and dtype != torch.float32 else nullcontext()
    scaler = torch.amp.GradScaler("cuda", enabled=use_cuda and dtype == torch.float16)

    # 4. Data: the dataset indexes and validates the whole file before any training starts.
    dataset = make_dataset(args.data_path, tokenizer, args.max_seq_len)

    # 5. Model and optimizer.
    model = CausalLM(lm_config)
    if not args.from_resume and args.resume_path is None:
        load_initial_weights(model, args, lm_config, log)
    model.to(dist_info.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01, fused=use_cuda)
    run = RunContext(args, dist_info, log, lm_config, dataset, model, optimizer, scaler, autocast,
                     accumulation, global_batch, data_fingerprint(dataset.source))
    log(f"{lm_config.hidden_size}x{lm_config.num_hidden_layers} model, {unwrap(model).num_parameters() / 1e6:.2f}M "
        f"params; {len(dataset)} samples; global batch {global_batch} = {args.batch_size} x "
        f"{dist_info.world_size} ranks x {accumulation} accumulation; {run.total_steps} steps")

    # 6. Resume: weights, optimizer, RNG and data cursor, after checking nothing important changed.
    setup_seed(args.seed + dist_info.rank)  # ranks differ in dropout noise
    tracker_ids = resume_if_asked(run)

    # 7. Compile and DDP (after loading, so state_dict keys carry no wrapper prefixes).
    if args.use_compile:
        run.model = torch.compile(run.model)
    if dist_info.world_size > 1:
        run.model = DistributedDataParallel(run.model, device_ids=[dist_info.local_rank] if use_cuda else None)
    run.callbacks = cb.CallbackList(make_callbacks(run, tracker_ids))
    install_stop_handlers(run)

    # 8. Train, epoch by epoch, from the resumed position.
    status = "completed"
    try:
        run.meter["start"] = time.perf_counter()
        run.callbacks.fire("on_train_begin", run)
        while run.epoch < args.epochs and status == "completed":
            status = train_epoch(run)
    except BaseException:
        run.callbacks.fire("on_train_end", run, "failed")
        raise

    # 9. Cleanup.
    run.callbacks.fire("on_train_end", run, status)
    if status == "stopped":
        reason = run.stop_signal or f"--max_steps {args.max_steps} reached"
        command = " ".join(sys.argv) + ("" if args.from_resume else " --from_resume 1")
        log(f"stopped at step {run.global_step} ({reason}); checkpoint saved. To continue: {command}")
    else:
        log(f"training finished at step {run.global_step}; weights in {args.save_dir}")
    run.model = None  # release DDP's reducer (it holds gloo/nccl work) before the process group goes
    cleanup_distributed()


def load_initial_weights(model, args, lm_config, log) -> None:
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


def resume_if_asked(run: RunContext) -> dict:
    """Restore a checkpoint into `run` when --from_resume/--resume_path ask; returns tracker ids."""
    args = run.args
    if not args.from_resume and args.resume_path is None:
        return {}
    state = lm_checkpoint(run.lm_config, weight=args.save_weight, checkpoint_dir=args.checkpoint_dir,
                          resume_path=args.resume_path, num_samples=len(run.dataset),
                          global_batch=run.global_batch, log=run.log)
    if state is None:
        run.log(f"--from_resume 1: no checkpoint of {run_name(args.save_weight, run.lm_config)} in "
                f"{args.checkpoint_dir}; starting fresh")
        load_initial_weights(run.model, args, run.lm_config, run.log)
        return {}
    for note in check_resume_compatible(state, run.lm_config.to_dict(), run.fingerprint, run.train_args()):
        run.log(f"resume: {note}")
    unwrap(run.model).load_state_dict(state["model"], strict=True)
    run.optimizer.load_state_dict(state["optimizer"])
    if state["scaler"] is not None:
        run.scaler.load_state_dict(state["scaler"])
    run.epoch, run.samples_consumed, run.global_step = state["epoch"], state["samples_consumed"], state["global_step"]
    old_ws, new_ws = state["world_size"], run.dist.world_size
    rng = rng_state_for_rank(state["rng"], run.dist.rank, new_ws)
    if rng is not None:
        restore_rng_state(rng)
    old_step = state["train_args"]["batch_size"] * old_ws * state["train_args"]["accumulation_steps"]
    old_step = steps_in_epoch(len(run.dataset), old_step) - steps_left(len(run.dataset), run.samples_consumed, old_step)
    change = f"world size {old_ws} -> {new_ws}: " if old_ws != new_ws else ""
    run.log(f"resumed from {state['resumed_from']}: {change}epoch step {old_step} -> {state['step']}, resuming at "
            f"sample {run.samples_consumed} of epoch {run.epoch + 1} (exact; global step {run.global_step}"
            f"{', RNG restored' if rng is not None else ', RNG reseeded for the new world size'})")
    return state["tracker_ids"]


def make_callbacks(run: RunContext, tracker_ids: dict) -> list[cb.TrainerCallback]:
    args, callbacks = run.args, []
    if args.save_debug_train_output:
        callbacks.append(cb.DebugTraceWriter(args.save_debug_train_output))
    if run.dist.is_main:
        callbacks.append(cb.ConsoleLogger())
        name = run_name(args.save_weight, run.lm_config)
        config = {k: v for k, v in vars(args).items()}
        if args.use_wandb:
            callbacks.append(cb.WandbLogger(args.wandb_project, name, config, tracker_ids.get("wandb")))
            run.tracker_runs["wandb"] = callbacks[-1].run
        if args.use_swanlab:
            callbacks.append(cb.SwanLabLogger(args.wandb_project, name, config, tracker_ids.get("swanlab")))
            run.tracker_runs["swanlab"] = callbacks[-1].run
    return callbacks


def install_stop_handlers(run: RunContext) -> None:
    """SIGTERM (preemption) and SIGINT (Ctrl-C) finish the current step, save, and exit 0."""
    def request_stop(signum, frame):
        run.stop_signal = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts at once

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


def stop_requested(run: RunContext) -> bool:
    """True on every rank if any rank got a stop signal, so all ranks stop at the same step."""
    flag = torch.tensor([1.0 if run.stop_signal else 0.0], device=run.dist.device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0 and run.stop_signal is None:
        run.stop_signal = "stop signal on another rank"
    return flag.item() > 0


def train_epoch(run: RunContext) -> str:
    """Train from the cursor to the end of the epoch; returns 'completed' or 'stopped'."""
    args, n = run.args, len(run.dataset)
    sampler = SkipBatchSampler(epoch_order(args.seed, run.epoch, n), run.samples_consumed, run.global_batch,
                               args.batch_size, run.dist.rank, run.dist.world_size)
    loader = DataLoader(IndexedDataset(run.dataset), batch_sampler=sampler, num_workers=args.num_workers,
                        pin_memory=run.dist.device.type == "cuda")
    batches = iter(loader)
    run.callbacks.fire("on_epoch_begin", run, run.epoch)
    for step_in_call in range(sampler.num_steps()):
        window_size = len(sampler.step_window(step_in_call))
        micro_batches = [next(batches) for _ in range(sampler.micro_steps_per_step(step_in_call))]
        record = train_step(run, micro_batches)
        run.samples_consumed += window_size
        run.global_step += 1
        run.steps_this_invocation += 1
        run.meter["tokens"] = run.meter.get("tokens", 0) + record.pop("tokens")
        run.callbacks.fire("on_step_end", run, record)
        pause_for_tests(STEP_DELAY_ENV)
        epoch_done = run.samples_consumed == n
        if epoch_done:
            run.epoch, run.samples_consumed = run.epoch + 1, 0
        if run.global_step % args.log_interval == 0 or epoch_done:
            log_metrics(run, record)
        stop = stop_requested(run) or (args.max_steps is not None and run.steps_this_invocation >= args.max_steps)
        if stop or epoch_done or run.global_step % args.save_interval == 0:
            save_checkpoint(run, lr=record["lr"])
        if stop:
            return "stopped"
    run.callbacks.fire("on_epoch_end", run, run.epoch - 1)
    return "completed"


def train_step(run: RunContext, micro_batches: list) -> dict:
    """One optimizer step over this rank's micro-batches of the global batch."""
    model, args = run.model, run.args
    lr = get_lr(run.progress(), args.learning_rate, args.warmup_ratio)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    # Tokens that carry loss in the whole global batch (all ranks): the loss denominator.
    local_tokens = sum(int((labels[:, 1:] != -100).sum()) for _, _, labels in micro_batches)
    total_tokens = torch.tensor([local_tokens], dtype=torch.float64, device=run.dist.device)
    if dist.is_initialized():
        dist.all_reduce(total_tokens)
    # DDP averages gradients over ranks, so scale by world_size to get a sum over all tokens / total.
    loss_scale = run.dist.world_size / max(total_tokens.item(), 1.0)
    loss_sum = torch.zeros((), device=run.dist.device)
    trained = []
    for i, (indices, input_ids, labels) in enumerate(micro_batches):
        input_ids = input_ids.to(run.dist.device, non_blocking=True)
        labels = labels.to(run.dist.device, non_blocking=True)
        is_last = i == len(micro_batches) - 1
        # Only the last micro-step needs the gradient all-reduce; the others just accumulate.
        sync = nullcontext() if is_last or not isinstance(model, DistributedDataParallel) else model.no_sync()
        with sync:
            with run.autocast:
                out = model(input_ids, labels=labels, loss_reduction="sum")
                loss = out.loss * loss_scale + out.aux_loss / len(micro_batches)
            run.scaler.scale(loss).backward()
        loss_sum += out.loss.detach()
        trained += [int(i) for i in indices if i >= 0]
    run.scaler.unscale_(run.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return {"step": run.global_step + 1, "epoch": run.epoch, "rank": run.dist.rank,
            "world_size": run.dist.world_size, "samples": trained,
            "loss": loss_sum.item() / max(local_tokens, 1), "loss_sum": loss_sum.item(),
            "local_tokens": local_tokens, "grad_norm": grad_norm.item(), "lr": lr,
            "tokens": sum(int(x.numel()) for _, x, _ in micro_batches)}


def log_metrics(run: RunContext, record: dict) -> None:
    """The step's loss over all ranks (one all-reduce, only at log steps) and throughput."""
    totals = torch.tensor([record["loss_sum"], record["local_tokens"], run.meter.pop("tokens", 0)],
                          dtype=torch.float64, device=run.dist.device)
    if dist.is_initialized():
        dist.all_reduce(totals)
    now = time.perf_counter()
    since_last_log = now - run.meter.get("last_log", run.meter["start"])
    run.meter["last_log"] = now
    seconds_per_step = (now - run.meter["start"]) / max(run.steps_this_invocation, 1)
    metrics = {"step": record["step"], "epoch": record["epoch"], "samples_consumed": run.samples_consumed,
               "loss": totals[0].item() / max(totals[1].item(), 1.0), "lr": record["lr"],
               "grad_norm": record["grad_norm"], "tokens_per_s": totals[2].item() / max(since_last_log, 1e-9),
               "eta_s": run.steps_remaining() * seconds_per_step}
    if run.dist.is_main:
        run.callbacks.fire("on_log", run, metrics)


def save_checkpoint(run: RunContext, lr: float) -> None:
    n = len(run.dataset)
    step_in_epoch = steps_in_epoch(n, run.global_batch) - steps_left(n, run.samples_consumed, run.global_batch)
    lm_checkpoint(run.lm_config, weight=run.args.save_weight, model=run.model, optimizer=run.optimizer,
                  epoch=run.epoch, step=step_in_epoch, wandb=run.tracker_runs.get("wandb"),
                  save_dir=run.args.save_dir, checkpoint_dir=run.args.checkpoint_dir,
                  samples_consumed=run.samples_consumed, global_step=run.global_step, scaler=run.scaler, lr=lr,
                  train_args=run.train_args(), data_fingerprint=run.fingerprint, keep_last=run.args.keep_last,
                  swanlab=run.tracker_runs.get("swanlab"))
    run.callbacks.fire("on_checkpoint_saved", run, str(run.args.checkpoint_dir))

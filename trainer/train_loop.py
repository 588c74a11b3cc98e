"""The training run both scripts share, as numbered sections you can read top to bottom.

    1. distributed init   2. config   3. precision   4. data   5. model + optimizer
    6. resume             7. compile + DDP + callbacks            8. train  9. cleanup

One optimizer step (`train_step`) = the next global batch of the epoch's order, split across
ranks and micro-steps; gradients are synced only on the last micro-step (DDP `no_sync`), and the
loss is normalised by the token count of the whole global batch, so the gradient is the same
however the batch is split across GPUs and micro-steps.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from dataset.jsonl_file import DataFileError
from model.hf import export_hf
from model.model import CausalLM
from model.tokenizer import load_tokenizer
from trainer import callbacks as cb
from trainer.anomaly import AnomalyGuard, AnomalyStop, StepAction, install_debug_injection
from trainer.background_save import BackgroundSaver, finish_saves
from trainer.checkpoint_io import CheckpointError
from trainer.data_order import IndexedDataset, SkipBatchSampler, epoch_order, step_in_epoch, steps_in_epoch, steps_left
from trainer.flags import model_config_and_weights
from trainer.metrics_files import MetricsFileWriter
from trainer.resume import (FIXED_TRAINING_ARGS, data_fingerprint, keep_unmanaged_resume_file, load_checkpoint_state,
                            restore_training_state, resume_if_asked)
from trainer.stopping import continue_command, install_stop_handlers, release_before_teardown
from trainer.trainer_utils import (ConfigError, DistInfo, Logger, cleanup_distributed, flops_per_token, get_lr,
                                   init_distributed, lm_checkpoint, peak_flops, resolve_accumulation, run_name,
                                   setup_seed, unwrap, validation_loss)


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
    guard: AnomalyGuard
    saver: BackgroundSaver | None  # rank 0 with --async_save 1: writes checkpoints in a thread
    val_dataset: object = None
    callbacks: cb.CallbackList = None
    epoch: int = 0
    samples_consumed: int = 0        # of the current epoch's order, all ranks together
    global_step: int = 0             # optimizer steps since the run began (monotonic, for trackers)
    steps_this_invocation: int = 0
    meter: dict = field(default_factory=dict)  # wall clock and tokens, for tokens/s and ETA
    tracker_runs: dict = field(default_factory=dict)
    stop_signal: str | None = None

    def steps_remaining(self) -> int:
        n, g = len(self.dataset), self.global_batch
        return steps_left(n, self.samples_consumed, g) + (self.args.epochs - self.epoch - 1) * steps_in_epoch(n, g)

    def progress(self, extra_samples: int = 0) -> float:
        """Fraction of the whole run's samples trained (plus `extra_samples`): the LR schedule's clock."""
        n = len(self.dataset)
        return (self.epoch * n + self.samples_consumed + extra_samples) / (self.args.epochs * n)

    def train_args(self) -> dict:
        a = self.args
        return {"batch_size": a.batch_size, "accumulation_steps": self.accumulation,
                "global_batch_size": a.global_batch_size, "world_size": self.dist.world_size,
                **{k: getattr(a, k, None) for k in FIXED_TRAINING_ARGS}}


@dataclass
class StepResult:
    """What one optimizer step did: the loop's decision (`action`) and the trace record it logs."""

    action: StepAction
    record: dict          # the --save_debug_train_output line: samples, losses, grad norm, lr
    tokens: int = 0       # input tokens of the global batch, for tokens/s
    stop_requested: bool = False
    save_failed: bool = False  # rank 0's background save failed: every rank stops
    anomaly: str = ""


# What a user can cause and fix (bad data, a missing file, flags or a checkpoint that do not fit):
# one message and exit code 2, not a traceback. Anything else is a bug and keeps its traceback.
EXPECTED_ERRORS = (FileNotFoundError, DataFileError, ConfigError, CheckpointError)


def run_training(args, make_dataset) -> None:
    """Train with `args` on `make_dataset(data_path, tokenizer, max_seq_len)`; expected errors exit 2."""
    try:
        train(args, make_dataset)
    except EXPECTED_ERRORS as error:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        if dist.is_initialized():  # other ranks may wait in a collective: leave at once, torchrun reports it
            sys.stdout.flush()
            os._exit(2)
        sys.exit(2)


def train(args, make_dataset) -> None:
    """The run, section by section."""
    # 1. Distributed init: one process, or one per GPU/CPU rank under torchrun.
    dist_info = init_distributed(args.device)
    log = Logger(dist_info.is_main)
    setup_seed(args.seed)  # identical initial weights on every rank

    # 2. Config: model shape from flags and tokenizer; batch geometry from the world size.
    tokenizer = load_tokenizer(args.tokenizer_path)
    fresh = not args.from_resume and args.resume_path is None
    lm_config, initial_weights = model_config_and_weights(args, tokenizer.get_vocab_size(), log, fresh)
    accumulation, global_batch = resolve_accumulation(args.batch_size, dist_info.world_size,
                                                      args.accumulation_steps, args.global_batch_size)

    # 3. Precision: bf16 (or fp16 + GradScaler) autocast on CUDA; plain fp32 on CPU.
    use_cuda = dist_info.device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    autocast = torch.autocast("cuda", dtype=dtype) if use_cuda and dtype != torch.float32 else nullcontext()
    scaler = torch.amp.GradScaler("cuda", enabled=use_cuda and dtype == torch.float16)

    # 4. Data: the datasets index and validate their whole files before any training starts.
    dataset = make_dataset(args.data_path, tokenizer, args.max_seq_len)
    val_dataset = make_dataset(args.val_data, tokenizer, args.max_seq_len) if args.val_data else None

    # 5. Model and optimizer.
    model = CausalLM(lm_config)
    if initial_weights is not None:
        model.load_state_dict(initial_weights, strict=True)  # shapes were checked with the config
    model.to(dist_info.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01, fused=use_cuda)
    guard = AnomalyGuard(args.on_anomaly, args.patience, args.max_rollbacks, args.rollback_lr_factor)
    saver = BackgroundSaver(pin_memory=use_cuda) if args.async_save and dist_info.is_main else None
    run = RunContext(args, dist_info, log, lm_config, dataset, model, optimizer, scaler, autocast,
                     accumulation, global_batch, data_fingerprint(dataset.source), guard, saver, val_dataset)
    install_debug_injection(model, args.debug_inject, current_step=lambda: run.global_step + 1)
    log(f"{lm_config.hidden_size}x{lm_config.num_hidden_layers} model, {unwrap(model).num_parameters() / 1e6:.2f}M "
        f"params; {len(dataset)} samples; global batch {global_batch} = {args.batch_size} x "
        f"{dist_info.world_size} ranks x {accumulation} accumulation; {run.steps_remaining()} steps")

    # 6. Resume: weights, optimizer, RNG and data cursor, after checking nothing important changed.
    setup_seed(args.seed + dist_info.rank)  # ranks differ in dropout noise
    tracker_ids = resume_if_asked(run)
    keep_unmanaged_resume_file(run)

    # 7. Compile and DDP (after loading, so state_dict keys carry no wrapper prefixes); callbacks.
    if args.use_compile:
        run.model = torch.compile(run.model)
    if dist_info.world_size > 1:
        run.model = DistributedDataParallel(run.model, device_ids=[dist_info.local_rank] if use_cuda else None)
    run.callbacks = cb.CallbackList(make_callbacks(run, tracker_ids))
    install_stop_handlers(run)

    # 8. Train, epoch by epoch, from the resumed position (a rollback restarts the epoch loop).
    status = "completed"
    try:
        run.meter["start"] = time.perf_counter()
        run.callbacks.fire("on_train_begin", run)
        while run.epoch < args.epochs and status in ("completed", "rolled back"):
            status = train_epoch(run)
        status = "completed" if status == "rolled back" else status
        finish_saves(run.saver)
    except BaseException as error:
        if run.saver is not None:  # let an in-flight save complete; the error at hand is what we report
            run.saver.wait(raise_error=False)
        run.callbacks.fire("on_train_end", run, "failed")
        if isinstance(error, AnomalyStop):
            log(f"stopping on anomaly: {error}. The newest checkpoint in {args.checkpoint_dir} is from before it.")
            release_before_teardown(run)
            cleanup_distributed(exit_code=3)
            sys.exit(3)
        raise

    # 9. Cleanup.
    run.callbacks.fire("on_train_end", run, status)
    blocked, saves = run.meter.get("save_blocked_s", 0.0), run.meter.get("saves", 0)
    log(f"{saves} saves blocked training for {blocked:.3f} s "
        f"({100 * blocked / max(time.perf_counter() - run.meter['start'], 1e-9):.2f}% of this run's time)")
    if status == "stopped":
        reason = run.stop_signal or f"--max_steps {args.max_steps} reached"
        log(f"stopped at step {run.global_step} ({reason}); checkpoint saved. To continue: "
            f"{continue_command(sys.argv, dist_info.world_size)}")
    else:
        log(f"training finished at step {run.global_step}; weights in {args.save_dir}")
    release_before_teardown(run)
    cleanup_distributed()


def make_callbacks(run: RunContext, tracker_ids: dict) -> list[cb.TrainerCallback]:
    args, callbacks = run.args, []
    if args.save_debug_train_output:
        callbacks.append(cb.DebugTraceWriter(args.save_debug_train_output))
    if not run.dist.is_main:
        return callbacks
    loggers = set(args.logger.split(",")) | ({"wandb"} if args.use_wandb else set()) | (
        {"swanlab"} if args.use_swanlab else set())
    name = args.run_name or run_name(args.save_weight, run.lm_config)
    config = dict(vars(args))
    if "console" in loggers:
        callbacks.append(cb.ConsoleLogger())
    if "file" in loggers:
        callbacks.append(MetricsFileWriter(args.metrics_dir or args.save_dir, name))
    if "wandb" in loggers:
        callbacks.append(cb.WandbLogger(args.wandb_project, name, config, tracker_ids.get("wandb")))
        run.tracker_runs["wandb"] = callbacks[-1].run
    if "swanlab" in loggers:
        callbacks.append(cb.SwanLabLogger(args.wandb_project, name, config, tracker_ids.get("swanlab")))
        run.tracker_runs["swanlab"] = callbacks[-1].run
    return callbacks


def train_epoch(run: RunContext) -> str:
    """Train from the cursor to the end of the epoch; returns 'completed', 'stopped' or 'rolled back'."""
    args, n = run.args, len(run.dataset)
    if hasattr(run.dataset, "set_epoch"):  # per-sample augmentations are drawn per (seed, epoch, index)
        run.dataset.set_epoch(run.epoch)
    sampler = SkipBatchSampler(epoch_order(args.seed, run.epoch, n), run.samples_consumed, run.global_batch,
                               args.batch_size, run.dist.rank, run.dist.world_size)
    # The loader gets its own generator: otherwise each iter() draws a worker seed from the global
    # torch RNG, and a resumed run (one iter() more than an uninterrupted one) would drift from it.
    loader = DataLoader(IndexedDataset(run.dataset), batch_sampler=sampler, num_workers=args.num_workers,
                        pin_memory=run.dist.device.type == "cuda",
                        generator=torch.Generator().manual_seed(args.seed * 1_000_003 + run.epoch))
    batches = iter(loader)
    run.callbacks.fire("on_epoch_begin", run, run.epoch)
    for step_in_call in range(sampler.num_steps()):
        window = len(sampler.step_window(step_in_call))
        micro_batches = [next(batches) for _ in range(sampler.micro_steps_per_step(step_in_call))]
        run.callbacks.fire("on_step_begin", run, run.global_step + 1)
        if run.guard.should_skip(run.epoch, run.samples_consumed):
            result = skip_window(run, micro_batches)
        else:
            result = train_step(run, micro_batches, window)
        if result.save_failed:
            finish_saves(run.saver)  # raises on every rank, rank 0 with the writer's error
        if result.action == StepAction.ROLLBACK:
            roll_back(run, result.anomaly)
            return "rolled back"
        if result.action == StepAction.STOP:
            raise AnomalyStop(result.anomaly)
        run.meter["tokens"] = run.meter.get("tokens", 0) + result.tokens
        run.samples_consumed += window
        run.global_step += 1
        run.steps_this_invocation += 1
        run.callbacks.fire("on_step_end", run, result.record)
        epoch_done = run.samples_consumed == n
        if epoch_done:
            run.epoch, run.samples_consumed = run.epoch + 1, 0
        last_step = run.epoch == args.epochs
        if run.global_step % args.log_interval == 0 or epoch_done:
            log_metrics(run, result.record)
        if run.val_dataset is not None and (run.global_step % args.eval_interval == 0 or last_step):
            run_validation(run)
        stop = result.stop_requested or (args.max_steps is not None and run.steps_this_invocation >= args.max_steps)
        if stop or epoch_done or run.global_step % args.save_interval == 0:
            save_checkpoint(run, lr=result.record["lr"])
        if stop:
            return "stopped"
    run.callbacks.fire("on_epoch_end", run, run.epoch - 1)
    return "completed"


def train_step(run: RunContext, micro_batches: list, window: int) -> StepResult:
    """One optimizer step over this rank's micro-batches.

    One host-device synchronisation per step: the step's numbers (global loss, grad norm, the
    stop flag) travel to the host together, once, because the anomaly guard must judge them
    before the optimizer may touch the weights. Everything else stays on the device.
    """
    model, args, device = run.model, run.args, run.dist.device
    step = run.global_step + 1
    # The LR at the position this step reaches, so the first step already trains.
    lr = get_lr(run.progress(window), args.learning_rate, args.warmup_ratio) * run.guard.lr_scale
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    batches = [(indices, x.to(device, non_blocking=True), y.to(device, non_blocking=True))
               for indices, x, y in micro_batches]
    # Tokens that carry loss in the whole global batch (all ranks): the loss denominator, kept on the device.
    global_tokens = sum((labels[:, 1:] != -100).sum() for _, _, labels in batches).double()
    local_tokens = global_tokens.clone()
    if dist.is_initialized():
        dist.all_reduce(global_tokens)
    # DDP averages gradients over ranks, so scale by world_size to get a sum over all tokens / total.
    loss_scale = run.dist.world_size / global_tokens.clamp(min=1.0)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, (_, input_ids, labels) in enumerate(batches):
        is_last = i == len(batches) - 1
        # Only the last micro-step needs the gradient all-reduce; the others just accumulate.
        sync = nullcontext() if is_last or not isinstance(model, DistributedDataParallel) else model.no_sync()
        with sync:
            with run.autocast:
                out = model(input_ids, labels=labels, loss_reduction="sum")
                loss = out.loss * loss_scale + out.aux_loss / len(batches)
            run.scaler.scale(loss).backward()
        loss_sum += out.loss.detach().double()
    run.scaler.unscale_(run.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    # One small all-reduce: the global loss sum, whether any rank was asked to stop, input tokens.
    input_tokens = sum(x.numel() for _, x, _ in batches)
    save_failed = run.saver is not None and run.saver.failed
    flags = torch.tensor([float(run.stop_signal is not None), float(input_tokens), float(save_failed)],
                         dtype=torch.float64)
    shared = torch.cat([loss_sum.view(1), flags.to(device, non_blocking=True)])  # a copy: loss_sum stays local
    if dist.is_initialized():
        dist.all_reduce(shared)
    numbers = torch.cat([shared, global_tokens.view(1), loss_sum.view(1), local_tokens.view(1),
                         grad_norm.detach().double().view(1)]).tolist()  # the step's one device sync
    loss_total, stop_flag, tokens, save_failed_flag, total_tokens, local_loss, local_count, grad_norm_value = numbers
    global_loss = loss_total / max(total_tokens, 1.0)
    action, reason = run.guard.verdict(step, global_loss, grad_norm_value, not run.scaler.is_enabled())
    if reason:
        run.log(f"anomaly: {reason} (--on_anomaly {args.on_anomaly}: {action.value})")
        run.callbacks.fire("on_anomaly", run, step, reason)
    if action == StepAction.APPLY:
        run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    trained = [int(i) for indices, _, _ in micro_batches for i in indices if i >= 0]
    record = {"step": step, "epoch": run.epoch, "rank": run.dist.rank, "world_size": run.dist.world_size,
              "samples": trained if action == StepAction.APPLY else [], "loss": local_loss / max(local_count, 1.0),
              "loss_sum": local_loss, "local_tokens": int(local_count), "global_loss": global_loss,
              "grad_norm": grad_norm_value, "lr": lr}
    if action != StepAction.APPLY:
        record.update(skipped=True, skipped_samples=trained, anomaly=reason)
    return StepResult(action, record, int(tokens), stop_flag > 0, save_failed_flag > 0, reason)


def skip_window(run: RunContext, micro_batches: list) -> StepResult:
    """A batch window stepped over after a rollback: nothing is trained, the trace says what was skipped."""
    run.log(f"skipping the batch window at sample {run.samples_consumed} of epoch {run.epoch + 1} (it caused an "
            f"anomaly before the rollback)")
    record = {"step": run.global_step + 1, "epoch": run.epoch, "rank": run.dist.rank,
              "world_size": run.dist.world_size, "samples": [], "skipped": True,
              "skipped_samples": [int(i) for indices, _, _ in micro_batches for i in indices if i >= 0],
              "loss": float("nan"), "global_loss": float("nan"), "grad_norm": float("nan"), "lr": 0.0}
    return StepResult(StepAction.SKIP, record, stop_requested=run.stop_signal is not None)


def roll_back(run: RunContext, reason: str) -> None:
    """Return to the newest good checkpoint and arrange to step over the window that went wrong."""
    bad_epoch, bad_window_start = run.epoch, run.samples_consumed
    finish_saves(run.saver)  # the newest checkpoint must be complete before we look for it
    state = load_checkpoint_state(run)
    if state is None:
        raise AnomalyStop(f"{reason}; no checkpoint to roll back to yet (lower --save_interval)")
    run.guard.plan_rollback(bad_epoch, bad_window_start)
    restore_training_state(run, state)
    run.log(f"rollback {run.guard.rollbacks}/{run.guard.max_rollbacks}: back to step {run.global_step} "
            f"({state['resumed_from']}); will skip the batch window at sample {bad_window_start} of epoch "
            f"{bad_epoch + 1}; lr scale now {run.guard.lr_scale:g}")
    run.callbacks.fire("on_rollback", run, run.global_step)


def log_metrics(run: RunContext, record: dict) -> None:
    """Metrics of the latest step and the throughput since the previous log (no extra collective)."""
    now = time.perf_counter()
    since = now - run.meter.get("last_log", run.meter["start"])
    steps = run.global_step - run.meter.get("last_log_step", run.global_step - run.steps_this_invocation)
    tokens = run.meter.pop("tokens", 0)
    run.meter.update(last_log=now, last_log_step=run.global_step)
    metrics = {"step": record["step"], "epoch": record["epoch"], "samples_consumed": run.samples_consumed,
               "loss": record["global_loss"], "lr": record["lr"], "grad_norm": record["grad_norm"],
               "tokens_per_s": tokens / max(since, 1e-9), "step_time_s": since / max(steps, 1),
               "save_blocked_s": run.meter.get("save_blocked_s", 0.0),
               "eta_s": run.steps_remaining() * (now - run.meter["start"]) / max(run.steps_this_invocation, 1)}
    if run.dist.device.type == "cuda":
        metrics["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        peak = peak_flops(run.dist.device)
        if peak is not None:
            cfg = run.lm_config
            per_token = flops_per_token(unwrap(run.model).num_parameters(), cfg.num_hidden_layers, cfg.hidden_size,
                                        run.args.max_seq_len)
            metrics["mfu"] = per_token * metrics["tokens_per_s"] / (peak * run.dist.world_size)
    if run.dist.is_main:
        run.callbacks.fire("on_log", run, metrics)


def run_validation(run: RunContext) -> None:
    loss = validation_loss(unwrap(run.model), run.val_dataset, run.args.batch_size, run.dist.device, run.autocast)
    if run.dist.is_main:
        run.callbacks.fire("on_validation_end", run, {"step": run.global_step, "val/loss": loss})


def save_checkpoint(run: RunContext, lr: float) -> None:
    """Save at this step boundary; only the time it blocks training is counted (the write may go on)."""
    started = time.perf_counter()
    lm_checkpoint(run.lm_config, weight=run.args.save_weight, model=run.model, optimizer=run.optimizer,
                  epoch=run.epoch, step=step_in_epoch(len(run.dataset), run.samples_consumed, run.global_batch),
                  wandb=run.tracker_runs.get("wandb"), save_dir=run.args.save_dir,
                  checkpoint_dir=run.args.checkpoint_dir, samples_consumed=run.samples_consumed,
                  global_step=run.global_step, scaler=run.scaler, lr=lr, train_args=run.train_args(),
                  data_fingerprint=run.fingerprint, anomaly_state=run.guard.state_dict(),
                  keep_last=run.args.keep_last, swanlab=run.tracker_runs.get("swanlab"), saver=run.saver)
    run.meter["save_blocked_s"] = run.meter.get("save_blocked_s", 0.0) + time.perf_counter() - started
    run.meter["saves"] = run.meter.get("saves", 0) + 1
    if run.args.save_hf and run.dist.is_main:
        hf_dir = Path(run.args.save_dir) / f"{run_name(run.args.save_weight, run.lm_config)}_hf"
        export_hf(unwrap(run.model).state_dict(), run.lm_config, hf_dir, run.args.tokenizer_path)
    run.callbacks.fire("on_checkpoint_saved", run, str(run.args.checkpoint_dir))

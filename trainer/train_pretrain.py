"""Pretraining: teach a fresh model to continue text (next-token prediction on plain text).

Run it from a plain clone, from any directory:

    python trainer/train_pretrain.py                                # one process (CPU or one GPU)
    torchrun --nproc_per_node 2 trainer/train_pretrain.py           # 2 GPUs (or 2 CPU ranks) on one node
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8 \\
        --rdzv_backend c10d --rdzv_endpoint HOST:29500 trainer/train_pretrain.py   # node 0 of 2
    ... --from_resume 1                                             # continue, also on another GPU count
    ... --parallel fsdp                                             # each GPU keeps a slice: bigger models

Writes out/pretrain_{hidden}.pth (FP16, for inference and SFT) and checkpoints/ (the resume state).
The whole training is in this file, in numbered sections; trainer/trainer_utils.py holds what it
calls (the sampler, the LR, lm_checkpoint). train_full_sft.py is this file with the lines marked
`# stage` changed, and a test holds the two to that.
"""

import argparse
import sys
import time
from contextlib import nullcontext
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from dataset.lm_dataset import PackedPretrainDataset, PretrainDataset  # stage
from model.hf import export_hf
from model.tokenizer import load_tokenizer
from trainer.hardening.anomaly import AnomalyGuard, AnomalyStop, install_debug_injection
from trainer.hardening.background_save import BackgroundSaver, finish_saves
from trainer.hardening.operator_flags import add_operator_flags
from trainer.hardening.resume_checks import data_fingerprint, resume_settings
from trainer.hardening.run_lock import claim_run_directories
from trainer.hardening.sharding import no_sync, shard_model
from trainer.hardening.step_numbers import StepNumbers, step_unless_refused
from trainer.hardening.stopping import StopRequest, continue_command
from trainer.hardening.tracking import Tracker, flops_per_token, validation_loss
from trainer.trainer_utils import (REPO_ROOT, IndexedDataset, SkipBatchSampler, capture_rng_state,
                                   cleanup_distributed, epoch_order, get_lr, given_sizes, init_distributed, init_model,
                                   lm_checkpoint, model_config, rank0_logger, resolve_accumulation,
                                   restore_training_state, run_name, run_script, setup_seed, step_in_epoch, steps_left,
                                   unwrap)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = parser.add_argument
    a("--data_path", default=str(REPO_ROOT / "dataset" / "pretrain_demo.jsonl"), help="JSONL training data")  # stage
    a("--save_dir", default=str(REPO_ROOT / "out"), help="where the FP16 inference weights go")
    a("--checkpoint_dir", default=str(REPO_ROOT / "checkpoints"), help="where the resume state goes")
    a("--save_weight", default="pretrain", help="name prefix of the saved files")  # stage
    a("--from_weight", default="none", help="'none' or a weight name in --save_dir to start from")  # stage
    a("--from_resume", type=int, default=0, choices=(0, 1), help="1: continue from the newest good checkpoint")
    a("--epochs", type=int, default=1)  # stage
    a("--batch_size", type=int, default=32, help="micro-batch per rank")
    a("--accumulation_steps", type=int, default=1)
    a("--global_batch_size", type=int, default=None,
      help="samples per optimizer step; derives accumulation_steps and keeps steps identical on any GPU count")
    a("--learning_rate", type=float, default=5e-4)  # stage
    a("--warmup_ratio", type=float, default=0.01)
    a("--max_seq_len", type=int, default=340)
    a("--pack", type=int, default=0, choices=(0, 1),  # stage
      help="1: join texts into full max_seq_len windows, no padding")  # stage
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
    a("--use_compile", type=int, default=None, choices=(0, 1), help="torch.compile (default: 1 on CUDA, 0 on CPU)")
    a("--parallel", default="ddp", choices=("ddp", "fsdp"), help="fsdp: each GPU keeps a slice of the model")
    add_operator_flags(parser)  # trackers, kept checkpoints, background saves, metrics, validation, anomaly policy
    return parser.parse_args()


def main() -> None:
    # ---- 1. Flags ------------------------------------------------------------------------------
    args = parse_args()

    # ---- 2. Distributed init: one process, or one per GPU (or CPU rank) under torchrun -----------
    dist_info = init_distributed(args.device)
    rank, world_size, device = dist_info.rank, dist_info.world_size, dist_info.device
    log = rank0_logger(dist_info.is_main)
    setup_seed(args.seed)  # identical initial weights on every rank

    # ---- 3. Data and batch geometry: the files are indexed and checked before any training ------
    tokenizer = load_tokenizer(args.tokenizer_path)
    text_dataset = PackedPretrainDataset if args.pack else PretrainDataset  # stage: --pack 1 fills every position
    train_ds = text_dataset(args.data_path, tokenizer, args.max_seq_len)  # stage
    val_ds = text_dataset(args.val_data, tokenizer, args.max_seq_len) if args.val_data else None  # stage
    n = len(train_ds)
    accumulation, global_batch = resolve_accumulation(args.batch_size, world_size, args.accumulation_steps,
                                                      args.global_batch_size)
    fingerprint, settings = data_fingerprint(train_ds.source), resume_settings(args, accumulation, world_size)

    # ---- 4. Model and optimizer: weights from the checkpoint to resume, from --from_weight, or random -
    lm_config = model_config(args, tokenizer.get_vocab_size())
    claim_run_directories(args, run_name(args.save_weight, lm_config), log)  # one trainer per directory
    resuming = bool(args.from_resume or args.resume_path)

    def newest_checkpoint(resume_path: str | None = None) -> dict | None:  # for --from_resume and rollbacks
        return lm_checkpoint(lm_config, weight=args.save_weight, checkpoint_dir=args.checkpoint_dir,
                             resume_path=resume_path, num_samples=n, global_batch=global_batch,
                             data_fingerprint=fingerprint, train_args=settings, given_sizes=given_sizes(args), log=log)

    state = newest_checkpoint(args.resume_path) if resuming else None  # None: start fresh
    if resuming and state is None:
        log(f"--from_resume 1: no checkpoint of {run_name(args.save_weight, lm_config)} yet; starting fresh")
    model, lm_config = init_model(args, lm_config, log, resume_state=state)  # weights: section 5, --from_weight
    use_cuda, dtype = device.type == "cuda", getattr(torch, args.dtype)
    if args.use_compile is None:  # where it pays: 2.5x on an H100; on a CPU compiling costs more than it saves
        args.use_compile = int(use_cuda)
        log(f"torch.compile {'on' if use_cuda else 'off'} by default on {device.type} (--use_compile 0/1 to choose)")
    # FP32 master weights, bf16 (or fp16 + GradScaler) autocast on CUDA; fsdp: a slice per rank (sharding.py)
    model = shard_model(model, device, dtype, args) if args.parallel == "fsdp" else model.to(device)
    # fused: one kernel for all parameters, and it can skip a refused step on the device (step_numbers.py)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01, fused=True)
    autocast = torch.autocast("cuda", dtype=dtype) if use_cuda and dtype != torch.float32 else nullcontext()
    scaler = torch.amp.GradScaler("cuda", enabled=use_cuda and dtype == torch.float16)
    guard = AnomalyGuard(args.on_anomaly, args.patience, args.max_rollbacks, args.rollback_lr_factor)

    # ---- 5. Resume: weights, optimizer, RNG and the data position (lm_checkpoint checked the rest) -
    setup_seed(args.seed + rank)  # ranks differ in dropout noise; a resume on the same world size restores it
    epoch, samples_consumed, global_step = 0, 0, 0
    if state is not None:
        restore_training_state(state, model, optimizer, scaler, rank, world_size)
        guard.load_state_dict(state["anomaly"])  # its history, rollbacks and windows to step over
        epoch, samples_consumed, global_step = state["epoch"], state["samples_consumed"], state["global_step"]
    install_debug_injection(model, args.debug_inject, current_step=lambda: global_step + 1)  # --debug_inject only

    def total_steps() -> int:  # the step the run will end at, from the position in the data
        return global_step + steps_left(n, samples_consumed, global_batch) + (
            args.epochs - epoch - 1) * steps_left(n, 0, global_batch)

    log(f"{lm_config.hidden_size}x{lm_config.num_hidden_layers} model, {model.num_parameters() / 1e6:.2f}M "
        f"params; {n} samples; global batch {global_batch} = {args.batch_size} x {world_size} ranks x "
        f"{accumulation} accumulation; {total_steps() - global_step} steps")

    # ---- 6. Compile and DDP (after loading, so state_dict keys carry no wrapper prefixes); outputs --
    if args.use_compile and args.parallel == "ddp":  # (FSDP compiled each layer as it sharded it)
        model = torch.compile(model, backend=args.compile_backend)
    if world_size > 1 and args.parallel == "ddp":
        model = DistributedDataParallel(model, device_ids=[dist_info.local_rank] if use_cuda else None)
    tracker = Tracker(args, args.run_name or run_name(args.save_weight, lm_config), dist_info.is_main, device,
                      start_step=global_step, total_steps=total_steps(),
                      tracker_ids=state["tracker_ids"] if state else {},
                      model_flops_per_token=flops_per_token(unwrap(model).num_parameters(), lm_config.num_hidden_layers,
                                                            lm_config.hidden_size, args.max_seq_len))
    saver = BackgroundSaver(background=bool(args.async_save), pin_memory=use_cuda)  # rank 0 writes (fsdp: all)
    stop = StopRequest()  # SIGTERM / Ctrl-C: finish the step, save, exit 0

    def judge(p: dict) -> None:  # the guard's verdict on step p, from its numbers (read here, once)
        p["numbers"] = numbers = p["pending"].read()  # waits only if the device is not there yet
        if numbers["save_failed"]:
            finish_saves(saver)  # raises on every rank, rank 0 with the writer's error
        if p["action"] is None:  # (a window stepped over after a rollback has its verdict already)
            device_refused = None if args.judge_before_step else numbers["refused"]  # the two must agree
            p["action"], p["reason"] = guard.verdict(p["step"], numbers["loss"], numbers["grad_norm"],
                                                     not scaler.is_enabled(), device_refused)
            if p["reason"]:
                log(f"anomaly: {p['reason']} (--on_anomaly {args.on_anomaly}: {p['action']})")
                tracker.anomaly(p["step"], p["reason"])

    def finish(p: dict, rng: dict) -> str | None:  # after step p: trace, logs, validation, save. Or a rollback.
        nonlocal epoch, samples_consumed, global_step, steps_this_run
        if "numbers" not in p:
            judge(p)
        numbers, action, reason = p["numbers"], p["action"], p["reason"]
        if action == "stop":
            raise AnomalyStop(f"{reason}. The newest checkpoint in {args.checkpoint_dir} is from before it.")
        if action == "rollback":  # back to the newest checkpoint; this window is stepped over next time
            finish_saves(saver)  # the newest checkpoint must be complete before we look for it
            state = newest_checkpoint()
            if state is None:
                raise AnomalyStop(f"{reason}; no checkpoint to roll back to yet (lower --save_interval)")
            guard.plan_rollback(p["epoch"], p["start"])
            log(f"rollback {guard.rollbacks}/{guard.max_rollbacks}: back to step {state['global_step']}; the window at "
                f"sample {p['start']} of epoch {p['epoch'] + 1} will be stepped over; lr scale now {guard.lr_scale:g}")
            restore_training_state(state, model, optimizer, scaler, rank, world_size)
            epoch, samples_consumed, global_step = state["epoch"], state["samples_consumed"], state["global_step"]
            steps_this_run -= 1  # a step rolled back does not count towards --max_steps
            tracker.rollback(global_step, total_steps())
            return "rollback"  # the while loop starts the restored epoch at the restored position
        record = {"step": p["step"], "epoch": p["epoch"], "rank": rank, "world_size": world_size,
                  "samples": p["samples"] if action == "apply" else [],
                  "loss": numbers["local_loss_sum"] / max(numbers["local_tokens"], 1),
                  "loss_sum": numbers["local_loss_sum"], "local_tokens": numbers["local_tokens"],
                  "global_loss": numbers["loss"], "grad_norm": numbers["grad_norm"], "lr": p["lr"]}
        if action != "apply":
            record.update(skipped=True, skipped_samples=p["samples"], anomaly=reason)
        tracker.step(record, numbers["input_tokens"])
        at_epoch, at_sample, at_step = p["after"]  # the position after step p (the loop may be one step ahead)
        epoch_done = at_sample == 0
        if at_step % args.log_interval == 0 or epoch_done:
            tracker.log({"epoch": p["epoch"], "samples_consumed": at_sample, "loss": numbers["loss"], "lr": p["lr"],
                         "grad_norm": numbers["grad_norm"]}, at_step, total_steps())
        if val_ds is not None and (at_step % args.eval_interval == 0 or at_epoch == args.epochs):
            tracker.validation(at_step, validation_loss(unwrap(model), val_ds, args.batch_size, device, autocast))
        stopping = numbers["stop"] or p["last"]
        if stopping or epoch_done or at_step % args.save_interval == 0:
            started = time.perf_counter()
            kept = lm_checkpoint(lm_config, args.save_weight, model, optimizer, at_epoch,
                                 step_in_epoch(n, at_sample, global_batch), tracker.runs.get("wandb"),
                                 args.save_dir, args.checkpoint_dir, samples_consumed=at_sample,
                                 global_step=at_step, scaler=scaler, lr=p["lr"], train_args=settings,
                                 data_fingerprint=fingerprint, anomaly_state=guard.state_dict(), rng_state=rng,
                                 keep_last=args.keep_last, swanlab=tracker.runs.get("swanlab"), saver=saver,
                                 gather_weights=bool(args.gather_weights))
            tracker.saved(at_step, kept, time.perf_counter() - started)  # only the time it blocked training
            if args.save_hf and dist_info.is_main:
                hf_dir = Path(args.save_dir) / f"{run_name(args.save_weight, lm_config)}_hf"
                export_hf(unwrap(model).state_dict(), lm_config, hf_dir, args.tokenizer_path)
        if stopping:
            epoch, samples_consumed, global_step = p["after"]  # a step launched after p is dropped
            return "stop"
        return None

    # ---- 7. Train, epoch by epoch, from the resumed position ------------------------------------
    # The host runs one step ahead of its verdicts: step N is judged while the device computes step
    # N+1, before N+1 may change the weights (trainer/hardening/step_numbers.py says why and how).
    status, steps_this_run = "completed", 0
    with tracker, saver:  # on an error: the save in flight completes and the status file says "failed"
        while epoch < args.epochs and status == "completed":
            sampler = SkipBatchSampler(epoch_order(args.seed, epoch, n), samples_consumed, global_batch,
                                       args.batch_size, rank, world_size)
            # Its own generator: iter() on a loader draws a seed from the global torch RNG, and a
            # resumed run (one iter() more than an uninterrupted one) would drift from it.
            batches = iter(DataLoader(IndexedDataset(train_ds), batch_sampler=sampler, num_workers=args.num_workers,
                                      pin_memory=use_cuda,
                                      generator=torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)))
            previous, outcome = None, None  # previous: the step whose verdict is still on its way
            for s in range(sampler.num_steps()):
                rng = capture_rng_state()  # as it is after the previous step: a save of that step stores it
                # ---- one optimizer step: the next global batch, split over ranks and micro-steps ----
                window = len(sampler.step_window(s))
                micro_batches = [next(batches) for _ in range(sampler.micro_steps_per_step(s))]
                current = {"step": global_step + 1, "epoch": epoch, "start": samples_consumed, "action": None,
                           "samples": [int(i) for indices, _, _ in micro_batches for i in indices if i >= 0]}
                if guard.should_skip(epoch, samples_consumed):  # it went wrong before a rollback: step over it
                    reason = "stepped over: this window caused an anomaly before a rollback"
                    log(f"{reason} (sample {samples_consumed} of epoch {epoch + 1})")
                    current.update(lr=0.0, action="skip", reason=reason, pending=StepNumbers.nothing_trained(
                        device, current["step"], stop=stop.signal is not None, save_failed=saver.failed))
                else:
                    # The LR at the position this step reaches, so the first step already trains.
                    progress = (epoch * n + samples_consumed + window) / (args.epochs * n)
                    current["lr"] = lr = get_lr(progress, args.learning_rate, args.warmup_ratio) * guard.lr_scale
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    on_device = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                                 for _, x, y in micro_batches]
                    # The loss is a sum over tokens divided by the tokens with a label in the WHOLE global
                    # batch (all ranks, all micro-steps), so the gradient does not depend on the split.
                    global_tokens = sum((y[:, 1:] != -100).sum() for _, y in on_device).double()
                    local_tokens = global_tokens.clone()
                    if dist.is_initialized():
                        dist.all_reduce(global_tokens)
                    loss_scale = world_size / global_tokens.clamp(min=1.0)  # x world_size: DDP averages over ranks
                    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
                    for i, (input_ids, labels) in enumerate(on_device):
                        # Only the last micro-step all-reduces the gradients; the others just accumulate.
                        is_last = i == len(on_device) - 1
                        with nullcontext() if is_last or world_size == 1 else no_sync(model):
                            with autocast:
                                out = model(input_ids, labels=labels, loss_reduction="sum")
                                loss = out.loss * loss_scale + out.aux_loss / len(on_device)
                            scaler.scale(loss).backward()
                        loss_sum += out.loss.detach().double()
                    scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
                    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                    # Loss, grad norm and whether any rank must stop: reduced, and sent to the host unread.
                    current["pending"] = StepNumbers(loss_sum, global_tokens, local_tokens, grad_norm,
                                                     step=current["step"],
                                                     input_tokens=sum(x.numel() for x, _ in on_device),
                                                     stop=stop.signal is not None, save_failed=saver.failed)
                # ---- the previous step's verdict and the rest of it, while the device computes this one ----
                if previous is not None and (outcome := finish(previous, rng)):
                    optimizer.zero_grad(set_to_none=True)  # this step is dropped: a rollback or a stop came first
                    previous = None
                    break
                if current["action"] is None:  # the optimizer step, unless the guard's rule refuses it
                    pending = current["pending"]
                    if args.judge_before_step:  # the reference timing: the host waits for the numbers and judges
                        judge(current)
                        refusal = torch.tensor(float(current["action"] != "apply"), device=device)
                    else:  # the same rule on the device, with the limits of the steps judged so far
                        refusal = guard.refusal(pending.loss, pending.grad_norm, not scaler.is_enabled())
                    pending.send(refusal)
                    step_unless_refused(optimizer, scaler, refusal)  # AdamW, or nothing where refusal is 1
                    optimizer.zero_grad(set_to_none=True)
                else:
                    current["pending"].send()
                saver.state_ready()  # a save copies the state from here (also a rollback's) while the next step runs
                samples_consumed, global_step = samples_consumed + window, global_step + 1
                steps_this_run += 1
                if samples_consumed == n:
                    epoch, samples_consumed = epoch + 1, 0
                current.update(after=(epoch, samples_consumed, global_step),
                               last=args.max_steps is not None and steps_this_run >= args.max_steps)
                previous = current
                if current["last"]:
                    break
            if previous is not None:  # the epoch's (or this run's) last step: judged before anything goes on
                outcome = finish(previous, capture_rng_state())
            if outcome == "stop":
                status = "stopped"
        finish_saves(saver)  # the last save is on disk before the run reports its end
        tracker.finish(status)

    # ---- 8. Cleanup ------------------------------------------------------------------------------
    if status == "stopped":
        reason = stop.signal or f"--max_steps {args.max_steps} reached"
        log(f"stopped at step {global_step} ({reason}); checkpoint saved. To continue: "
            f"{continue_command(sys.argv, world_size)}")
    else:
        log(f"training finished at step {global_step}; weights in {args.save_dir}")
    del model, optimizer  # the DDP wrapper goes while the process group still exists
    cleanup_distributed()


if __name__ == "__main__":
    run_script(main)

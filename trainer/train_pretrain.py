"""Pretraining: teach a fresh model to continue text (next-token prediction on plain text).

Run it from a plain clone, from any directory:

    python trainer/train_pretrain.py                                # one process (CPU or one GPU)
    torchrun --nproc_per_node 2 trainer/train_pretrain.py           # 2 GPUs (or 2 CPU ranks) on one node
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8 \\
        --rdzv_backend c10d --rdzv_endpoint HOST:29500 trainer/train_pretrain.py   # node 0 of 2
    ... --from_resume 1                                             # continue, also on another GPU count
    ... --parallel fsdp                                             # each GPU keeps a slice: bigger models

Writes out/pretrain_{hidden}[_moe].pth (FP16, for inference and SFT) and checkpoints/ (the resume state).
The whole training is in this file, in numbered sections; trainer/trainer_utils.py holds what it
calls (the sampler, the LR, lm_checkpoint). train_full_sft.py is this file with the lines marked
`# stage` changed, and a test holds the two to that.
"""

import argparse
import sys
import time
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from dataset.indexed import IndexedDataset, trained_samples  # the loader's (index, x, y) rows
from dataset.lm_dataset import PackedPretrainDataset, PretrainDataset  # stage
from model.model import LMConfig
from model.tokenizer import load_tokenizer
from trainer.hardening.anomaly import install_debug_injection
from trainer.hardening.anomaly_policy import AnomalyPolicy, Rollback
from trainer.hardening.background_save import BackgroundSaver, finish_saves
from trainer.hardening.flag_checks import check_flags
from trainer.hardening.from_weight import given_sizes, init_model
from trainer.hardening.operator_flags import add_operator_flags
from trainer.hardening.process_exit import cleanup_distributed, run_script
from trainer.hardening.process_group import init_distributed
from trainer.hardening.resume_checks import data_fingerprint, resume_settings
from trainer.hardening.run_lock import claim_run_directories
from trainer.hardening.sharding import shard_model
from trainer.hardening.stopping import StopRequest, end_of_run, loader_worker_ignores_stops
from trainer.hardening.tracking import Tracker, flops_per_token, validation_loss
from trainer.trainer_utils import (REPO_ROOT, Position, RunSpec, SkipBatchSampler, Step, epoch_order,
                                   get_lr, lm_checkpoint, load_checkpoint, make_optimizer,
                                   model_config, no_sync, optimizer_step, rank0_logger, read_on_host,
                                   resolve_accumulation, restore_training_state, run_name, setup_seed,
                                   sum_over_ranks, total_steps, unwrap)


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
    a("--accumulation_steps", type=int, default=1, help="micro-batches per optimizer step (or --global_batch_size)")
    a("--global_batch_size", type=int, default=None,
      help="samples per optimizer step; derives accumulation_steps and keeps steps identical on any GPU count")
    a("--learning_rate", type=float, default=5e-4)  # stage
    a("--warmup_ratio", type=float, default=0.01)
    a("--max_seq_len", type=int, default=340)
    a("--pack", type=int, default=0, choices=(0, 1),  # stage
      help="1: join texts into full max_seq_len windows, no padding")  # stage
    a("--hidden_size", type=int, default=512)
    a("--num_hidden_layers", type=int, default=None, help="default: from --from_weight, else 8")
    a("--num_attention_heads", type=int, default=None, help="default: from --from_weight, else 8")
    a("--num_key_value_heads", type=int, default=None, help="default: from --from_weight, else 4")
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
    a("--optimizer", default="adamw", choices=("adamw", "muon"), help="muon: Muon for the hidden matrices")
    a("--weight_decay", type=float, default=0.01, help="AdamW's decoupled weight decay")
    a("--muon_learning_rate", type=float, default=None, help="Muon's peak LR, same schedule (default: --learning_rate)")
    a("--muon_weight_decay", type=float, default=0.01, help="Muon's decoupled weight decay")
    add_operator_flags(parser)  # trackers, kept checkpoints, background saves, metrics, validation, anomaly policy
    return check_flags(parser.parse_args())  # every value in its range, every path of its kind (exit 2)


class Data(NamedTuple):
    """What a step draws its batches from and sends them to: the dataset, this rank's share, the device."""
    dataset: Dataset
    global_batch: int  # samples per optimizer step, all ranks and micro-steps together (an epoch's last: fewer)
    rank: int
    world_size: int
    device: torch.device  # where the batches go (and, on CUDA, bf16 or fp16 autocast)


class Between(NamedTuple):
    """What train_epoch calls between steps (stop, anomaly, log, validation, save): only a rollback changes numbers."""
    stop: StopRequest  # a signal (SIGTERM, Ctrl-C) on any rank, or a failed background save
    stop_at: float  # --max_steps, as the global step to stop after
    policy: AnomalyPolicy  # each step's verdict; after a rollback: LR x --rollback_lr_factor, a window left out
    tracker: Tracker  # the log line, the debug trace, the status and metrics files, tokens/s
    val_ds: Dataset | None  # --val_data's dataset
    saver: BackgroundSaver  # lm_checkpoint's file writes (on a thread: --async_save, 1 by default)
    run: RunSpec  # what a checkpoint records and a resume checks: settings, data fingerprint
    lm_config: LMConfig  # the model's shape, saved beside its weights


def train_epoch(args, at: Position, model, optimizer, scaler, data: Data, between: Between) -> tuple[Position, bool]:
    """Train from `at` to the epoch's end (False), a stop, --max_steps or the run's end (True); a rollback raises."""
    train_ds, global_batch, device = data.dataset, data.global_batch, data.device
    rank, world_size, n = data.rank, data.world_size, len(data.dataset)  # n: samples in an epoch
    stop, policy, tracker, saver = between.stop, between.policy, between.tracker, between.saver
    epoch, last_step = at.epoch, total_steps(at, n, global_batch, args.epochs, policy.left_out)
    # As given, unless a rollback happened: then the LR is x --rollback_lr_factor and the bad windows are left out
    base_lr, left_out = args.learning_rate * policy.lr_scale, policy.left_out_of(epoch)
    sampler = SkipBatchSampler(epoch_order(args.seed, epoch, n), at.samples_consumed, global_batch,
                               args.batch_size, rank, world_size, left_out)
    # Its own generator: iter() draws a seed from the global RNG, which a resumed run would then not match.
    batches = iter(DataLoader(IndexedDataset(train_ds), batch_sampler=sampler, num_workers=args.num_workers,
                              pin_memory=device.type == "cuda", worker_init_fn=loader_worker_ignores_stops,
                              generator=torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)))
    # On CUDA the matmuls run in bf16 (or fp16, with the scaler) over the FP32 weights; the CPU trains in float32
    autocast = torch.autocast(device.type, dtype=getattr(torch, args.dtype),
                              enabled=device.type == "cuda" and args.dtype != "float32")
    taken = []  # the steps not yet read by the host: (Step, its numbers, still on the device)
    for s in range(sampler.num_steps()):
        # ---- step N: the next global batch, split over ranks and micro-steps -------------------------
        micro_batches = [next(batches) for _ in range(sampler.micro_steps_per_step(s))]
        end = sampler.step_end(s)  # the data position once this step is taken
        # The LR at the position this step reaches, so the first step already trains.
        lr = get_lr((epoch * n + end) / (args.epochs * n), base_lr, args.warmup_ratio)
        on_device = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                     for _, x, y in micro_batches]
        # The loss is a sum over tokens divided by the tokens with a label in the WHOLE global batch (all ranks, all
        # micro-steps), so the gradient does not depend on the batch's split (but for rounding; MoE aside: below).
        local_tokens = sum((y[:, 1:] != -100).sum() for _, y in on_device).double()
        global_tokens = sum_over_ranks(local_tokens.clone())  # ranks exchange one number (the gradients: below)
        loss_scale = world_size / global_tokens.clamp(min=1.0)  # x world_size: DDP averages over ranks
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, (input_ids, labels) in enumerate(on_device):
            # Only the last micro-step all-reduces the gradients; the others just accumulate.
            with no_sync(model, accumulate_only=(i < len(on_device) - 1)):
                with autocast:
                    out = model(input_ids, labels=labels, loss_reduction="sum")
                    loss = out.loss * loss_scale + out.aux_loss / len(on_device)  # MoE balance: a micro-batch mean
                scaler.scale(loss).backward()
            loss_sum += out.loss.detach().double()
        scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_ratio", 1.0)  # Muon's group (--optimizer muon): its own peak LR
        # The optimizer's step: skipped where a gradient is not finite, on the device with no wait (AdamW)
        optimizer_step(optimizer, scaler, grad_norm)
        optimizer.zero_grad(set_to_none=True)
        # Step N's loss is loss_sum added over the ranks, divided by global_tokens (read_on_host does that later):
        # its numbers stay on the device until the host reads them below, as `.item()` here would make the host wait.
        samples, input_tokens = trained_samples(micro_batches)  # this rank's sample indices, its input tokens
        taken.append((Step(number=at.global_step + 1, epoch=epoch, start=at.samples_consumed, end=end, lr=lr,
                           samples=samples, input_tokens=input_tokens),
                      [loss_sum, local_tokens, global_tokens, grad_norm]))
        at = at.after(end, n)  # the position moves past this step's samples, skipped or not
        tracker.step_taken(at.global_step)  # the first prints "first step taken": a sign of life on a slow machine
        # ---- step N's log line, validation and save, at their intervals: nothing here changes step N ---------
        # The stop vote changes no number: it asks whether a signal (SIGTERM, Ctrl-C) reached any rank (a failed
        # background save raises on all ranks). On several ranks: an all-reduce of two numbers (gloo: no GPU wait).
        last = stop.vote(saver) or at.global_step >= between.stop_at or at.epoch == args.epochs  # or the end
        log_now = at.global_step % args.log_interval == 0 or at.samples_consumed == 0 or last
        validate = between.val_ds is not None and (at.global_step % args.eval_interval == 0 or last)
        save_now = at.global_step % args.save_interval == 0 or at.samples_consumed == 0 or last
        if not (log_now or validate or save_now):
            continue  # no wait for the device: step N+1 is queued behind N (MoE: per expert and layer; Muon: each step)
        read, taken = read_on_host(taken), []  # the wait, as minimind's loss.item(): all steps since the last
        for step, numbers in read:
            verdict = policy.judge(step, numbers)  # bad: --on_anomaly warn (default) logs; stop, rollback raise
            tracker.step(step, numbers, verdict)  # its trace line (--save_debug_train_output), tokens/s
        step, numbers = read[-1]  # step N, as the host now knows it: its LR, its loss over the global batch
        if log_now:  # one line: epoch, step, steps to go, step N's loss (no mean), lr, grad_norm, tokens/s, ETA
            tracker.log({"epoch": step.epoch, "samples_consumed": at.samples_consumed, "loss": numbers.loss,
                         "lr": step.lr, "grad_norm": numbers.grad_norm},
                        at.global_step, last_step)
        if validate:  # the mean loss per token over all of --val_data (eval mode, no grad), and its bits per byte
            tracker.validation(at.global_step, validation_loss(unwrap(model), between.val_ds, args.batch_size,
                                                               device, autocast))
        if save_now:
            started = time.perf_counter()
            kept = lm_checkpoint(between.lm_config, args.save_weight, model, optimizer, position=at, run=between.run,
                                 save_dir=args.save_dir, checkpoint_dir=args.checkpoint_dir, scaler=scaler,
                                 anomaly_state=policy.state_dict(), trackers=tracker.runs, saver=saver)
            tracker.saved(at.global_step, kept, time.perf_counter() - started, saver.pop_blocked())  # its waits
        if last:
            return at, True
    return Position(epoch + 1, 0, at.global_step), False  # = `at` after a last step


def main() -> None:
    # ---- 1. Flags ------------------------------------------------------------------------------
    args = parse_args()

    # ---- 2. Distributed init: one process, or one per GPU (or CPU rank) under torchrun -----------
    dist_info = init_distributed(args.device)
    rank, world_size, device = dist_info.rank, dist_info.world_size, dist_info.device
    log = rank0_logger(dist_info.is_main)
    setup_seed(args.seed)  # the same random weights on every rank (FSDP needs it; DDP also broadcasts rank 0's)

    # ---- 3. Data and batch geometry: the files are indexed and checked before any training ------
    tokenizer = load_tokenizer(args.tokenizer_path)
    text_dataset = PackedPretrainDataset if args.pack else PretrainDataset  # stage: --pack 1 fills every position
    train_ds = text_dataset(args.data_path, tokenizer, args.max_seq_len)  # stage
    val_ds = text_dataset(args.val_data, tokenizer, args.max_seq_len) if args.val_data else None  # stage
    n = len(train_ds)
    accumulation, global_batch = resolve_accumulation(args.batch_size, world_size, args.accumulation_steps,
                                                      args.global_batch_size)
    data = Data(train_ds, global_batch, rank, world_size, device)  # what train_epoch draws each step from
    run = RunSpec(resume_settings(args, accumulation, world_size), data_fingerprint(train_ds.source), n,
                  global_batch, given_sizes(args), args.resume_path)

    # ---- 4. Model and optimizer: weights from the checkpoint to resume, from --from_weight, or random -
    lm_config = model_config(args, tokenizer.get_vocab_size())
    claim_run_directories(args, run_name(args.save_weight, lm_config), log)  # one trainer per directory
    resume = bool(args.from_resume or args.resume_path)
    state = load_checkpoint(lm_config, args.save_weight, args.checkpoint_dir, run) if resume else None
    model, lm_config = init_model(args, lm_config, log, resume_state=state)  # weights: section 5, --from_weight
    use_cuda, dtype = device.type == "cuda", getattr(torch, args.dtype)
    # FP32 master weights, bf16 (or fp16 + GradScaler, not under fsdp) autocast on CUDA; fsdp: a slice per rank
    model = shard_model(model, device, dtype, args) if args.parallel == "fsdp" else model.to(device)
    optimizer = make_optimizer(model, args)  # AdamW (fused: it can skip a step on the device); --optimizer muon
    scaler = torch.amp.GradScaler("cuda", enabled=use_cuda and dtype == torch.float16)

    # ---- 5. Resume: weights, optimizer, RNG and the data position (load_checkpoint checked the rest)
    setup_seed(args.seed + rank)  # a random stream per rank (dropout is 0: the step draws nothing from it)
    at = Position()  # epoch 0, no sample consumed, no step taken
    if state is not None:
        restore_training_state(state, model, optimizer, scaler, rank, world_size)
        at = Position(state["epoch"], state["samples_consumed"], state["global_step"])
    log(f"{model.num_parameters() / 1e6:.2f}M params; {n} samples; global batch {global_batch} = {args.batch_size} x "
        f"{world_size} ranks x {accumulation} accumulation; to step {total_steps(at, n, global_batch, args.epochs)}")

    # ---- 6. Outputs, the guard, then compile and DDP (after loading: state_dict keys carry no prefixes) --
    tracker = Tracker(args, args.run_name or run_name(args.save_weight, lm_config), dist_info.is_main, device,
                      start_step=at.global_step, total_steps=total_steps(at, n, global_batch, args.epochs),
                      tracker_ids=state["tracker_ids"] if state else {},  # a resume continues its wandb/SwanLab runs
                      model_flops_per_token=flops_per_token(unwrap(model).num_parameters(), lm_config.num_hidden_layers,
                                                            lm_config.hidden_size, args.max_seq_len))
    saver = BackgroundSaver(bool(args.async_save), use_cuda, args.keep_last, bool(args.gather_weights),
                            args.tokenizer_path if args.save_hf else None, optimizer)  # rank 0 writes (fsdp: all)
    stop = StopRequest()  # SIGTERM / Ctrl-C: the step in progress finishes, is saved, and the run exits 0
    policy = AnomalyPolicy(args, tracker, not scaler.is_enabled(), state["anomaly"] if state else {}, log)
    install_debug_injection(model, args.debug_inject, current_step=tracker.step_in_progress)  # --debug_inject only
    if args.use_compile and args.parallel == "ddp":  # (FSDP compiled each layer as it sharded it)
        model = torch.compile(model, backend=args.compile_backend)
    if world_size > 1 and args.parallel == "ddp":
        model = DistributedDataParallel(model, device_ids=[dist_info.local_rank] if use_cuda else None)

    # ---- 7. Train, epoch by epoch, from the resumed position, to the end, a stop or --max_steps -----
    stop_at, stopped = at.global_step + (args.max_steps or float("inf")), False  # --max_steps: of this invocation
    with tracker, saver:  # on an error: the save in flight completes and the status file says "failed"
        while at.epoch < args.epochs and not stopped:
            try:
                between = Between(stop, stop_at, policy, tracker, val_ds, saver, run, lm_config)
                at, stopped = train_epoch(args, at, model, optimizer, scaler, data, between)
            except Rollback as rollback:  # back to the newest checkpoint; the bad window is left out from now on
                optimizer.zero_grad(set_to_none=True)
                finish_saves(saver)  # the newest checkpoint must be complete before we look for it
                state = load_checkpoint(lm_config, args.save_weight, args.checkpoint_dir, run)
                at = Position(*policy.rolled_back(rollback, state))  # no checkpoint yet: AnomalyStop
                # --max_steps counts steps taken: those retrained from the checkpoint count again, the bad one
                stop_at -= rollback.step.number - 1 - at.global_step  # and any queued after it do not
                restore_training_state(state, model, optimizer, scaler, rank, world_size)
                tracker.rollback(at.global_step, total_steps(at, n, global_batch, args.epochs, policy.left_out))
        # ---- 8. The end: the last save on disk, then the run's status ------------------------------
        finish_saves(saver)
        tracker.finish("stopped" if at.epoch < args.epochs else "completed")

    # ---- 9. Cleanup ------------------------------------------------------------------------------
    log(end_of_run(at, args, stop.signal, world_size))
    del model, optimizer  # the DDP wrapper goes while the process group still exists
    cleanup_distributed()


if __name__ == "__main__":
    run_script(main)

"""Direct preference optimisation (DPO): teach a fine-tuned model to prefer the chosen answer of each pair.

For each pair of answers to one prompt, the policy (the model trained) and a frozen copy of where it started
(the reference) give each answer's log-probability, summed over the answer's tokens; the loss
-log sigmoid(beta * ((pi_chosen - ref_chosen) - (pi_rejected - ref_rejected))) rewards the policy for raising
the chosen answer more than the rejected one, relative to the reference (dpo_loss). Starts from
out/full_sft_{hidden}.pth by default: the policy's start and the reference are that file. Run it from a plain clone:

    python trainer/train_dpo.py                                     # one process (CPU or one GPU)
    torchrun --nproc_per_node 2 trainer/train_dpo.py                # 2 GPUs (or 2 CPU ranks) on one node
    ... --from_resume 1                                             # continue, also on another GPU count
    ... --parallel fsdp                                             # the reference model is sharded too

Writes out/dpo_{hidden}[_moe].pth and checkpoints/ (the reference named by its hash: a resume refuses a changed one).
What changes from train_full_sft.py: the lines marked `# dpo` (`SFTDataset` is DPODataset's); SFT's two augmentation
flags and `set_epoch` are gone, and the `--optimizer`, `--weight_decay`, `--muon_` flags (DPO trains with AdamW).
"""

import argparse
import math  # dpo
import sys
import time
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist  # dpo
import torch.nn.functional as F  # dpo
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from dataset.dpo_dataset import DPODataset  # dpo
from dataset.indexed import IndexedDataset, trained_samples  # the loader's (index, x, y) rows
from model.model import LMConfig
from model.tokenizer import load_tokenizer
from trainer.hardening.anomaly import install_debug_injection
from trainer.hardening.anomaly_policy import AnomalyPolicy, Rollback
from trainer.hardening.background_save import BackgroundSaver, finish_saves
from trainer.hardening.flag_checks import check_flags
from trainer.hardening.from_weight import frozen_model, given_sizes, init_model  # dpo
from trainer.hardening.operator_flags import add_operator_flags
from trainer.hardening.process_exit import cleanup_distributed, run_script
from trainer.hardening.process_group import init_distributed
from trainer.hardening.resume_checks import data_fingerprint, resume_settings
from trainer.hardening.run_lock import claim_run_directories
from trainer.hardening.sharding import shard_model
from trainer.hardening.stopping import StopRequest, end_of_run, loader_worker_ignores_stops
from trainer.hardening.tracking import Tracker, flops_per_token  # dpo: (its own validation, below)
from trainer.trainer_utils import (REPO_ROOT, Position, RunSpec, SkipBatchSampler, Step, epoch_order,
                                   get_lr, lm_checkpoint, load_checkpoint, make_optimizer,
                                   model_config, no_sync, optimizer_step, rank0_logger, read_on_host,
                                   resolve_accumulation, restore_training_state, run_name, setup_seed,
                                   sum_over_ranks, total_steps, unwrap)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = parser.add_argument
    a("--data_path", default=str(REPO_ROOT / "dataset" / "dpo_demo.jsonl"), help="JSONL of answer pairs")  # dpo
    a("--save_dir", default=str(REPO_ROOT / "out"), help="where the FP16 inference weights go")
    a("--checkpoint_dir", default=str(REPO_ROOT / "checkpoints"), help="where the resume state goes")
    a("--save_weight", default="dpo", help="name prefix of the saved files")  # dpo
    a("--from_weight", default="full_sft", help="the weights in --save_dir to start from, and the reference")  # dpo
    a("--from_resume", type=int, default=0, choices=(0, 1), help="1: continue from the newest good checkpoint")
    a("--epochs", type=int, default=1)  # dpo
    a("--batch_size", type=int, default=4, help="pairs per micro-batch per rank (2 rows each)")  # dpo
    a("--accumulation_steps", type=int, default=1, help="micro-batches per optimizer step (or --global_batch_size)")
    a("--global_batch_size", type=int, default=None,
      help="samples per optimizer step; derives accumulation_steps and keeps steps identical on any GPU count")
    a("--learning_rate", type=float, default=1e-6)  # dpo: small, as DPO moves a model already trained
    a("--warmup_ratio", type=float, default=0.01)
    a("--max_seq_len", type=int, default=340)
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
    a("--beta", type=float, default=0.1, help="how far from the reference the policy may move: higher, nearer")  # dpo
    add_operator_flags(parser)  # trackers, kept checkpoints, background saves, metrics, validation, anomaly policy
    return check_flags(parser.parse_args())  # every value in its range, every path of its kind (exit 2)


def dpo_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor, beta: float):  # dpo
    """Per pair, from the answers' log-probabilities [pairs, 2] (chosen, rejected): DPO's loss and its margin.
    The implicit reward of an answer is beta * (pi - ref); the loss pushes the chosen one's above the other's."""
    chosen_reward = beta * (policy_logps[:, 0] - reference_logps[:, 0])
    rejected_reward = beta * (policy_logps[:, 1] - reference_logps[:, 1])
    return -F.logsigmoid(chosen_reward - rejected_reward), chosen_reward - rejected_reward


def real_pairs(labels: torch.Tensor) -> torch.Tensor:  # dpo
    """[pairs]: True where both answers have a label to predict; the loader's placeholder has none."""
    return (labels[:, :, 1:] != -100).any(dim=2).all(dim=1)  # (position 0 is never predicted)


def pair_losses(model, ref_model, input_ids: torch.Tensor, labels: torch.Tensor, beta: float):  # dpo
    """DPO's loss per pair of a micro-batch ([pairs, 2, T]: one forward over chosen and rejected rows), 0 for a
    pair without labels; the margins; the policy's MoE aux loss. Log-probabilities: summed over the answer."""
    rows, targets = input_ids.flatten(0, 1), labels.flatten(0, 1)  # chosen, rejected, chosen, ...
    out = model(rows, labels=targets, loss_reduction="none")  # per token -log p, 0 where not labelled
    with torch.no_grad():  # the reference is not trained
        reference = -ref_model(rows, labels=targets, loss_reduction="none").loss.sum(dim=1).view(-1, 2)
    losses, margins = dpo_loss(-out.loss.sum(dim=1).view(-1, 2), reference, beta)
    return torch.where(real_pairs(labels), losses, 0.0), margins, out.aux_loss


@torch.no_grad()  # dpo
def preference_validation(model, ref_model, dataset, batch_size: int, device, autocast, beta: float):  # dpo
    """DPO's loss and the share of held-out pairs whose implicit reward prefers the chosen answer (each rank
    every world_size-th pair; as many batches on every rank, as FSDP needs). Returns (loss, accuracy, pairs)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, pairs preferred, pairs
    indices = list(range(rank, len(dataset), world_size))
    for start in range(0, math.ceil(math.ceil(len(dataset) / world_size) / batch_size) * batch_size, batch_size):
        rows = [dataset[i] for i in indices[start:start + batch_size]]
        rows = rows or [(dataset[0][0], torch.full_like(dataset[0][1], -100))]  # a pair that adds nothing
        input_ids, labels = (torch.stack(column).to(device) for column in zip(*rows))
        with autocast:
            losses, margins, _ = pair_losses(model, ref_model, input_ids, labels, beta)
        real = real_pairs(labels)
        totals += torch.stack([losses.sum(), (real & (margins > 0)).sum(), real.sum()]).double()
    model.train()
    loss_sum, preferred, pairs = sum_over_ranks(totals).tolist()
    return loss_sum / max(pairs, 1), preferred / max(pairs, 1), int(pairs)


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


def train_epoch(args, at: Position, model, optimizer, scaler, data: Data, between: Between,  # dpo
                ref_model: torch.nn.Module) -> tuple[Position, bool]:  # dpo: the frozen reference
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
        # The loss is a sum over pairs divided by the real pairs in the WHOLE global batch (all ranks, all  # dpo
        # micro-steps), so the gradient does not depend on the batch's split (but for rounding; MoE aside: below).
        local_pairs = sum(real_pairs(y).sum() for _, y in on_device).double()  # dpo
        global_pairs = sum_over_ranks(local_pairs.clone())  # dpo
        loss_scale = world_size / global_pairs.clamp(min=1.0)  # dpo: x world_size, as DDP averages over ranks
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, (input_ids, labels) in enumerate(on_device):
            # Only the last micro-step all-reduces the gradients; the others just accumulate.
            with no_sync(model, accumulate_only=(i < len(on_device) - 1)):
                with autocast:
                    losses, _, aux_loss = pair_losses(model, ref_model, input_ids, labels, args.beta)  # dpo
                    loss = losses.sum() * loss_scale + aux_loss / len(on_device)  # dpo: MoE's, per micro-batch
                scaler.scale(loss).backward()
            loss_sum += losses.detach().sum().double()  # dpo
        scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_ratio", 1.0)  # Muon's group (--optimizer muon): its own peak LR
        # The optimizer's step: skipped where a gradient is not finite, on the device with no wait (AdamW)
        optimizer_step(optimizer, scaler, grad_norm)
        optimizer.zero_grad(set_to_none=True)
        # Step N's loss is loss_sum added over the ranks, divided by global_pairs (read_on_host does that):  # dpo
        # its numbers stay on the device until the host reads them below, as `.item()` here would make the host wait.
        samples, input_tokens = trained_samples(micro_batches)  # this rank's sample indices, its input tokens
        taken.append((Step(number=at.global_step + 1, epoch=epoch, start=at.samples_consumed, end=end, lr=lr,
                           samples=samples, input_tokens=input_tokens),
                      [loss_sum, local_pairs, global_pairs, grad_norm]))  # dpo
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
                         "lr": step.lr, "grad_norm": numbers.grad_norm,  # dpo: and this step's pairs that train nothing
                         "pairs_beyond_max_seq_len": train_ds.count_beyond(sampler.step_window(s))},  # dpo
                        at.global_step, last_step)
        if validate:  # dpo: the DPO loss over all of --val_data's pairs (eval mode, no grad), and their accuracy
            tracker.preference_validation(at.global_step, *preference_validation(  # dpo: the DPO validation_loss(
                unwrap(model), ref_model, between.val_ds, args.batch_size, device, autocast,  # dpo
                args.beta))  # dpo
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
    train_ds = DPODataset(args.data_path, tokenizer, args.max_seq_len, log)  # dpo: says pairs beyond max_seq_len
    val_ds = DPODataset(args.val_data, tokenizer, args.max_seq_len, log) if args.val_data else None  # dpo
    n = len(train_ds)
    accumulation, global_batch = resolve_accumulation(args.batch_size, world_size, args.accumulation_steps,
                                                      args.global_batch_size)
    data = Data(train_ds, global_batch, rank, world_size, device)  # what train_epoch draws each step from
    # The reference: --from_weight's model, frozen; the checkpoint names its file by hash (a resume compares it)  # dpo
    ref_model, base_identity = frozen_model(args, model_config(args, tokenizer.get_vocab_size()), log)  # dpo
    run = RunSpec({**resume_settings(args, accumulation, world_size), **base_identity},  # dpo
                  data_fingerprint(train_ds.source), n, global_batch, given_sizes(args), args.resume_path)  # dpo

    # ---- 4. Model and optimizer: weights from the checkpoint to resume, from --from_weight, or random -
    lm_config = model_config(args, tokenizer.get_vocab_size())
    claim_run_directories(args, run_name(args.save_weight, lm_config), log)  # one trainer per directory
    resume = bool(args.from_resume or args.resume_path)
    state = load_checkpoint(lm_config, args.save_weight, args.checkpoint_dir, run) if resume else None
    model, lm_config = init_model(args, lm_config, log, resume_state=state)  # weights: section 5, --from_weight
    use_cuda, dtype = device.type == "cuda", getattr(torch, args.dtype)
    # FP32 master weights, bf16 (or fp16 + GradScaler, not under fsdp) autocast on CUDA; fsdp: a slice per rank
    model = shard_model(model, device, dtype, args) if args.parallel == "fsdp" else model.to(device)
    ref_model = shard_model(ref_model, device, dtype, args) if args.parallel == "fsdp" else ref_model.to(device)  # dpo
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
        ref_model = torch.compile(ref_model, backend=args.compile_backend)  # dpo
    if world_size > 1 and args.parallel == "ddp":
        model = DistributedDataParallel(model, device_ids=[dist_info.local_rank] if use_cuda else None)

    # ---- 7. Train, epoch by epoch, from the resumed position, to the end, a stop or --max_steps -----
    stop_at, stopped = at.global_step + (args.max_steps or float("inf")), False  # --max_steps: of this invocation
    with tracker, saver:  # on an error: the save in flight completes and the status file says "failed"
        while at.epoch < args.epochs and not stopped:
            try:
                between = Between(stop, stop_at, policy, tracker, val_ds, saver, run, lm_config)
                at, stopped = train_epoch(args, at, model, optimizer, scaler, data, between, ref_model)  # dpo
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

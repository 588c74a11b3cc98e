"""Group relative policy optimisation (GRPO): reinforce the answers of a fine-tuned model that a reward prefers.

Per prompt, G completions sampled by the policy (seeded by seed, epoch and prompt: a resume samples them alike),
scored by Python rewards (dataset/rewards.py); an advantage is a reward against its group's, (r - mean) / (std + eps);
the loss per token: PPO's clipped policy gradient + beta x KL to the frozen reference (out/full_sft_*.pth, named by
hash as DPO's), over the global batch's completion tokens (--loss_type: TRL's dapo; grpo, cispo). A step samples
one batch of rollouts and trains --num_iterations (mu) updates on it, the ratio pi / pi_old moving from the second
on; a save, a stop and the log fall between steps only, so a resume is exact with nothing of the rollouts saved.
Writes out/grpo_{hidden}[_moe].pth. Run it as SFT's script:
    python trainer/train_grpo.py  |  torchrun --nproc_per_node 2 trainer/train_grpo.py  |  ... --from_resume 1
--max_turns N > 1: the tools a prompt offers run between N model turns, results masked (dataset/tool_rollouts.py).
What changes from train_full_sft.py: the lines marked `# grpo`; gone: `--system_prompt_ratio`,
`--drop_empty_think_ratio`, `train_ds.set_epoch`, `local_tokens = sum(` (counted in step_rollouts), and the
`--optimizer`, `--weight_decay`, `--muon_` flags (GRPO trains with AdamW)."""

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

from dataset.grpo_dataset import GRPODataset, sample_rollouts  # grpo
from dataset.indexed import IndexedDataset, trained_samples  # the loader's (index, x, y) rows
from dataset.rewards import reward_functions, score_groups  # grpo
from model.model import LMConfig
from model.tokenizer import load_tokenizer
from trainer.hardening.anomaly import install_debug_injection
from trainer.hardening.anomaly_policy import AnomalyPolicy, Rollback
from trainer.hardening.background_save import BackgroundSaver, finish_saves
from trainer.hardening.flag_checks import check_flags
from trainer.hardening.from_weight import frozen_model, given_sizes, init_model  # grpo
from trainer.hardening.operator_flags import add_operator_flags
from trainer.hardening.process_exit import cleanup_distributed, run_script
from trainer.hardening.process_group import init_distributed
from trainer.hardening.resume_checks import data_fingerprint, resume_settings
from trainer.hardening.run_lock import claim_run_directories
from trainer.hardening.sharding import shard_model
from trainer.hardening.stopping import StopRequest, end_of_run, loader_worker_ignores_stops
from trainer.hardening.tracking import Tracker, flops_per_token, validation_loss, watched_metrics  # grpo
from trainer.trainer_utils import (REPO_ROOT, Position, RunSpec, SkipBatchSampler, Step, epoch_order,
                                   get_lr, lm_checkpoint, load_checkpoint, make_optimizer,
                                   model_config, no_sync, optimizer_step, rank0_logger, read_on_host,
                                   resolve_accumulation, restore_training_state, run_name, setup_seed,
                                   sum_over_ranks, total_steps, unwrap)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = parser.add_argument
    a("--data_path", default=str(REPO_ROOT / "dataset" / "grpo_demo.jsonl"), help="JSONL of prompts, answers")  # grpo
    a("--save_dir", default=str(REPO_ROOT / "out"), help="where the FP16 inference weights go")
    a("--checkpoint_dir", default=str(REPO_ROOT / "checkpoints"), help="where the resume state goes")
    a("--save_weight", default="grpo", help="name prefix of the saved files")  # grpo
    a("--from_weight", default="full_sft", help="the weights in --save_dir to start from, and the reference")  # grpo
    a("--from_resume", type=int, default=0, choices=(0, 1), help="1: continue from the newest good checkpoint")
    a("--epochs", type=int, default=1)  # grpo
    a("--batch_size", type=int, default=4, help="prompts per micro-batch per rank (each sampled G times)")  # grpo
    a("--accumulation_steps", type=int, default=1, help="micro-batches per optimizer step (or --global_batch_size)")
    a("--global_batch_size", type=int, default=None,
      help="samples per optimizer step; derives accumulation_steps and keeps steps identical on any GPU count")
    a("--learning_rate", type=float, default=1e-6)  # grpo: small, as GRPO moves a model already trained
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
    a("--beta", type=float, default=0.04, help="weight of the KL to the reference: higher, nearer")  # grpo
    a("--num_generations", type=int, default=4, help="G: completions sampled per prompt, one group")  # grpo
    a("--max_completion_len", type=int, default=64, help="new tokens per rollout, at most (model + tool)")  # grpo
    a("--logps_chunk", type=int, default=4096, help="positions whose log-softmax is taken at once")  # grpo: x vocab
    a("--max_turns", type=int, default=1, help="model turns per rollout; tools run between them (1: none)")  # grpo
    a("--temperature", type=float, default=1.0, help="sampling temperature of the completions")  # grpo
    a("--clip_eps", type=float, default=0.2,  # grpo: PPO's clip, which acts from a batch's second update on
      help="PPO's clip of pi / pi_old to [1 - eps, 1 + eps] (cispo: the IS weight's cap, 1 + eps)")  # grpo
    a("--num_iterations", type=int, default=1, help="mu (DeepSeekMath's): updates on a step's rollouts; "  # grpo
      "--max_steps, --save_interval and the log count steps: a checkpoint only falls between two batches")  # grpo
    a("--loss_type", default="dapo", choices=("dapo", "grpo", "cispo"), help="TRL's names: see grpo_loss")  # grpo
    a("--rewards", default="answer,format", help="reward functions of dataset/rewards.py, added")  # grpo
    add_operator_flags(parser)  # trackers, kept checkpoints, background saves, metrics, validation, anomaly policy
    return check_flags(parser.parse_args())  # every value in its range, every path of its kind (exit 2)


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:  # grpo
    """[prompts, G] rewards -> each completion's advantage against its own group: (r - mean) / (std + eps). A group
    all right or all wrong gives 0 everywhere: no signal, its completions only feel the KL term."""
    return (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + eps)


def grpo_loss(logps, old_logps, ref_logps, advantages, beta: float, clip_eps: float, loss_type="dapo"):  # grpo
    """Per completion token ([rows, T] log-probabilities; advantages [rows]): PPO's clipped policy-gradient term
    (cispo: the IS weight min(pi / pi_old, 1 + eps), a constant, x A x log pi) plus beta x the k3 estimate of
    KL(pi || ref); also each token's KL and whether the clip cut its ratio (cispo: capped its weight)."""
    ratio, a = torch.exp(logps - old_logps), advantages[:, None]  # pi / pi_old: 1 at the sampling policy
    if loss_type == "cispo":  # the weight has no gradient, so a capped token still trains (PPO's clip drops it)
        policy_term, clipped = -ratio.clamp(max=1 + clip_eps).detach() * a * logps, ratio > 1 + clip_eps
    else:
        policy_term = -torch.min(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
        clipped = ((ratio < 1 - clip_eps) & (a < 0)) | ((ratio > 1 + clip_eps) & (a > 0))  # where the clip cut
    kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1  # >= 0; its mean under pi is the KL
    return policy_term + beta * kl, kl, clipped


def step_rollouts(model, micro_batches, train_ds, args, epoch: int, autocast, device):  # grpo
    """The step's rollouts before any loss (it divides by their tokens): per micro-batch, all rows decoded together
    (model/rollout.py), (input_ids, labels: the sampled ids, advantages); its tokens; what a user watches."""
    done, watched, G = [], torch.zeros(5, dtype=torch.float64), args.num_generations
    for batch in micro_batches:  # (indices, prompts, their labels) as the loader gives them
        input_ids, labels, texts, rollouts = sample_rollouts(model, batch, train_ds, G, args.max_completion_len,
                                                             args.temperature, args.seed * 1_000_003 + epoch, autocast,
                                                             args.max_turns)  # rollouts: what each did with tools
        scores, counts = score_groups(train_ds.rewards, texts, [*map(train_ds.answer, batch[0].tolist())], G, rollouts)
        done.append((input_ids, labels, group_advantages(scores).flatten().float().to(device)))
        watched += counts
    local_tokens = sum((labels[:, 1:] != -100).sum() for _, labels, _ in done).double()
    return done, local_tokens, torch.cat([watched.to(device), local_tokens[None], local_tokens.new_zeros(2)])


def completion_losses(model, ref_model, input_ids, labels, advantages, args, watch, old=None, ref=None):  # grpo
    """GRPO's loss per completion token, weighted (0 elsewhere), the aux loss; adds the KL sum, clipped tokens to
    watch[-2:]. old, ref: pi_old's and the reference's log-probabilities (sampling_logps); None: computed here."""
    T = args.temperature  # the log-probabilities of the distribution the rollouts were sampled from, at T
    out = model(input_ids, labels=labels, loss_reduction="none", temperature=T, chunk_tokens=args.logps_chunk)
    ref_logps = -ref_model(input_ids, labels=labels, loss_reduction="none", temperature=T,  # loss at t: -log p of
                           chunk_tokens=args.logps_chunk).loss if ref is None else ref  # token t + 1, as out.loss
    mask = torch.nn.functional.pad(labels[:, 1:] != -100, (0, 1)).float()  # the completion's tokens, as out.loss
    old = -out.loss.detach() if old is None else old  # one update: the sampling policy is this one
    losses, kl, clipped = grpo_loss(-out.loss, old, ref_logps, advantages, args.beta, args.clip_eps, args.loss_type)
    watch[-2:] += torch.stack([(kl * mask).sum(), (clipped * mask).sum()]).detach().double()
    return losses * token_weights(mask, args.loss_type), out.aux_loss


def token_weights(mask: torch.Tensor, loss_type: str) -> torch.Tensor:  # grpo
    """Each token's weight in the loss sum: its mask (dapo, cispo), or the mask over its completion's length (grpo:
    each completion's mean over its tokens; loss_denominator then counts completions)."""
    return mask / mask.sum(dim=1, keepdim=True).clamp(min=1.0) if loss_type == "grpo" else mask


def sampling_logps(model, ref_model, rollouts, args, autocast) -> list:  # grpo
    """Per micro-batch (pi_old's, the reference's) log-probabilities, before the first update, once for all mu, with
    no graph. One update: (None, None): completion_losses takes them, the same values, one forward less."""
    if args.num_iterations == 1:
        return [(None, None)] * len(rollouts)
    with torch.no_grad(), autocast:
        return [(-model(input_ids, labels=labels, loss_reduction="none", temperature=args.temperature,
                        chunk_tokens=args.logps_chunk).loss,
                 -ref_model(input_ids, labels=labels, loss_reduction="none", temperature=args.temperature,
                            chunk_tokens=args.logps_chunk).loss) for input_ids, labels, _ in rollouts]


def loss_denominator(rollouts, local_tokens: torch.Tensor, loss_type: str) -> torch.Tensor:  # grpo
    """This rank's share of what the loss sum is divided by: its completion tokens (dapo, cispo: DAPO's token mean),
    or its completions (grpo: the mean of each one's token mean; a placeholder's rows, with no token, are none)."""
    if loss_type != "grpo":
        return local_tokens.clone()
    return sum((labels[:, 1:] != -100).any(dim=1).sum() for _, labels, _ in rollouts).double()


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


def train_epoch(args, at: Position, model, optimizer, scaler, data: Data, between: Between,  # grpo
                ref_model: torch.nn.Module) -> tuple[Position, bool]:  # grpo: the frozen reference
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
        on_device, local_tokens, watch = step_rollouts(  # grpo: the rollouts sampled, their token count, metrics
            unwrap(model), micro_batches, train_ds, args, epoch, autocast, device)  # grpo
        # The loss is a sum over completion tokens divided by those of the WHOLE global batch (grpo: its  # grpo
        # completions; all ranks, all micro-steps): the gradient does not depend on the split (but rounding).  # grpo
        global_tokens = sum_over_ranks(loss_denominator(on_device, local_tokens, args.loss_type))  # grpo
        loss_scale = world_size / global_tokens.clamp(min=1.0)  # x world_size: DDP averages over ranks
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        before, norms = sampling_logps(unwrap(model), ref_model, on_device, args, autocast), []  # grpo: pi_old, ref
        for _ in range(args.num_iterations):  # grpo: mu updates on these rollouts; pi moves away from pi_old
            for i, rollout in enumerate(on_device):  # grpo: (input_ids, labels, advantages)
                # Only the last micro-step all-reduces the gradients; the others just accumulate.  # grpo
                with no_sync(model, accumulate_only=(i < len(on_device) - 1)):  # grpo
                    with autocast:  # grpo
                        losses, aux_loss = completion_losses(model, ref_model, *rollout, args, watch,  # grpo
                                                             *before[i])  # grpo: pi_old's, the reference's
                        loss = losses.sum() * loss_scale + aux_loss / len(on_device)  # grpo: MoE's, per micro-batch
                    scaler.scale(loss).backward()  # grpo
                loss_sum += losses.detach().sum().double()  # grpo
            scaler.unscale_(optimizer)  # grpo: clip the true gradients, not the fp16-scaled ones
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))  # grpo
            for group in optimizer.param_groups:  # grpo
                group["lr"] = lr * group.get("lr_ratio", 1.0)  # grpo
            # The optimizer's step: skipped where a gradient is not finite, on the device with no wait (AdamW)  # grpo
            optimizer_step(optimizer, scaler, norms[-1])  # grpo
            optimizer.zero_grad(set_to_none=True)  # grpo
        watch[-2:] /= args.num_iterations  # grpo: the KL and clip_fraction over all mu updates' tokens
        # Step N's loss is its first number added over the ranks, / global_tokens (read_on_host does that):  # grpo
        # its numbers stay on the device until the host reads them below, as `.item()` here would make the host wait.
        samples, input_tokens = trained_samples(micro_batches)  # this rank's sample indices, its input tokens
        taken.append((Step(number=at.global_step + 1, epoch=epoch, start=at.samples_consumed, end=end, lr=lr,
                           samples=samples, input_tokens=input_tokens),
                      [loss_sum / args.num_iterations, local_tokens, global_tokens,  # grpo: the mean update's loss,
                       torch.stack(norms).max()]))  # grpo: the largest grad norm (NaN if any: the guard sees it)
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
                         "lr": step.lr, "grad_norm": numbers.grad_norm,  # grpo: what a user watches, prompts cut
                         **watched_metrics(watch, args.num_generations, tools=args.max_turns > 1),  # grpo
                         "prompts_cut": train_ds.count_cut(sampler.step_window(s))},  # grpo
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
    train_ds = GRPODataset(args.data_path, tokenizer, args.max_seq_len - args.max_completion_len,  # grpo: says cuts
                           reward_functions(args.rewards), log, args.max_turns > 1)  # grpo: a bad name, tool: exit 2
    val_ds = None  # grpo: no validation loss (flag_checks.check_grpo_flags refuses --val_data)
    n = len(train_ds)
    accumulation, global_batch = resolve_accumulation(args.batch_size, world_size, args.accumulation_steps,
                                                      args.global_batch_size)
    data = Data(train_ds, global_batch, rank, world_size, device)  # what train_epoch draws each step from
    ref_model, base_identity = frozen_model(args, model_config(args, tokenizer.get_vocab_size()), log)  # grpo: frozen
    run = RunSpec({**resume_settings(args, accumulation, world_size), **base_identity},  # grpo
                  data_fingerprint(train_ds.source), n, global_batch, given_sizes(args), args.resume_path)  # grpo

    # ---- 4. Model and optimizer: weights from the checkpoint to resume, from --from_weight, or random -
    lm_config = model_config(args, tokenizer.get_vocab_size())
    claim_run_directories(args, run_name(args.save_weight, lm_config), log)  # one trainer per directory
    resume = bool(args.from_resume or args.resume_path)
    state = load_checkpoint(lm_config, args.save_weight, args.checkpoint_dir, run) if resume else None
    model, lm_config = init_model(args, lm_config, log, resume_state=state)  # weights: section 5, --from_weight
    use_cuda, dtype = device.type == "cuda", getattr(torch, args.dtype)
    # FP32 master weights, bf16 (or fp16 + GradScaler, not under fsdp) autocast on CUDA; fsdp: a slice per rank
    model = shard_model(model, device, dtype, args) if args.parallel == "fsdp" else model.to(device)
    ref_model = ref_model.to(device)  # grpo
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
                at, stopped = train_epoch(args, at, model, optimizer, scaler, data, between, ref_model)  # grpo
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

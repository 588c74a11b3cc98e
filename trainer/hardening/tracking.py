"""Where a run's numbers go (console, metrics/status files, wandb, SwanLab, the debug trace), and the
validation loss and bits per byte.

The loop calls one object, `Tracker`: `step_taken` as each optimizer step is taken, `step` for each step
once its numbers are read (at the next log line, validation or save), `log` at log steps, and
`validation`, `anomaly`, `rollback`, `saved`, `finish` when those happen. Rank 0 fans each call out to
the --logger backends; every rank writes its own lines of the --save_debug_train_output trace (a run
with --from_resume 1 first cuts it back to the step it starts from, as the metrics file is; a fresh run
writes only a file it creates, and no run writes into a file that is not a trace of this trainer). Every
metric is logged against the optimizer step, so a resumed run's curves continue where they stopped.

With the file logger on, a daemon thread on rank 0 rewrites the status file every
TRAINER_HEARTBEAT_S seconds (trainer/hardening/run_lock.py reads it; default 15) with a heartbeat and the last
finished step, so scripts/watch_run.py can tell a slow run from a stuck or a dead one between log steps.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from model.tokenizer import token_byte_lengths
from output_paths import open_to_append, output_problem
from trainer.hardening.checkpoint_io import atomic_write_text
from trainer.hardening.metrics_files import MetricsFileWriter
from trainer.hardening.resume_checks import ConfigError
from trainer.hardening.run_lock import HEARTBEAT_S, LOCK_NAME, lock_lost

# Dense bf16 peak of common GPUs (TFLOPS), for MFU = achieved / peak model FLOPs.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "4090": 165.0, "A10": 125.0}


# What GRPO's log line adds (trainer/train_grpo.py: watched_metrics), in this order.
# What a save blocks training on, as the save line names it (metrics records: save_wait_s, save_copy_s, ...).
SAVE_PARTS = {"wait_s": "waiting for the previous write", "copy_s": "copying to CPU memory", "write_s": "writing",
              "other_s": "the state and the ranks' RNG"}
RL_METRICS = ("reward", "reward_std", "no_signal", "completion_len", "tool_calls", "kl", "clip_fraction")
WATCHED = ("ce", *RL_METRICS)  # what a stage adds to its log line: GRPO's; distillation's ce and kl (loss_parts)


def watched_metrics(watch: torch.Tensor, group_size: int, tools: bool = False) -> dict:
    """What a user watches of a step, over all ranks (a collective: every rank logs the same steps): the mean
    reward, the reward's std within a group, the share of groups without signal (all alike), the completion
    length in tokens, with `tools` the tool calls run per completion, the KL to the reference per token and the
    share of tokens whose ratio was clipped."""
    reward_sum, std_sum, no_signal, groups, ran, tokens, kl_sum, clipped = summed(watch)
    groups, completions = max(groups, 1.0), max(groups * group_size, 1.0)
    return {"reward": reward_sum / completions, "reward_std": std_sum / groups, "no_signal": no_signal / groups,
            "completion_len": tokens / completions, **({"tool_calls": ran / completions} if tools else {}),
            "kl": kl_sum / max(tokens, 1.0), "clip_fraction": clipped / max(tokens, 1.0)}


def loss_parts(parts: torch.Tensor, local_tokens: torch.Tensor) -> dict:
    """Distillation's loss in its two parts, over all ranks (a collective, as watched_metrics): the cross-entropy
    ("ce") and the KL at the temperature ("kl"), each summed over the global batch's labelled tokens and divided
    by their count, as the loss is: loss = alpha * ce + (1 - alpha) * T^2 * kl."""
    ce_sum, kl_sum, tokens = summed(torch.cat([parts, local_tokens.reshape(1)]))
    return {"ce": ce_sum / max(tokens, 1.0), "kl": kl_sum / max(tokens, 1.0)}


def summed(tensor: torch.Tensor) -> list[float]:
    """`tensor` added over every rank (a copy; one process: as it is), read on the host."""
    tensor = tensor.clone()
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()


def peak_flops(device: torch.device) -> float | None:
    """The GPU's dense bf16 peak in FLOP/s if it is a known model, else None (MFU is then not logged)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """FLOPs of one forward + backward per token (the usual estimate, as in PaLM's appendix B).

    6 * params: a multiply-add (2 FLOPs) per weight and token forward, two backward; the tied embedding
    counts once (its lookup is free, its lm_head matmul is not). 12 * layers * hidden * seq: Q K^T and
    A V, 2 * seq * hidden FLOPs each forward, x3 with backward, over the full square as is usual
    (causal attention could skip half).
    """
    return 6 * num_params + 12 * num_layers * hidden_size * seq_len


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


class Validation(NamedTuple):
    """One pass over the whole validation file (all ranks)."""
    loss: float  # mean loss per target token, in nats
    bpb: float  # bits per UTF-8 byte of the text those tokens stand for (NaN: no byte of text among them)
    tokens: int  # target tokens (labels other than -100)
    text_bytes: int  # the bytes of text they stand for


@torch.no_grad()
def validation_loss(model: torch.nn.Module, dataset, batch_size: int, device: torch.device, autocast) -> Validation:
    """The loss per token and the bits per byte over the whole validation file; each rank takes every
    world_size-th sample. `dataset.tokenizer` is the tokenizer its ids come from.

    Bits per byte (nanochat's val_bpb): the nats of the target tokens that stand for text / ln 2 / the bytes
    of that text (model/tokenizer.py: token_byte_lengths). However a tokenizer cuts a text, its bytes and the
    information in them are the same, so runs with different tokenizers compare on it, as they cannot on the
    loss per token. The structure tokens (<|im_start|>, <|im_end|>, padding: 0 bytes) count in the loss
    and not in the bits per byte, as in nanochat.
    """
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    was_training = model.training
    model.eval()
    token_bytes = torch.tensor(token_byte_lengths(dataset.tokenizer), device=device)  # counted on the device
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, tokens, text's loss sum, text's bytes
    indices = list(range(rank, len(dataset), world_size))
    batches = math.ceil(math.ceil(len(dataset) / world_size) / batch_size)  # the same on every rank: FSDP needs it
    for start in range(0, batches * batch_size, batch_size):
        rows = [dataset[i] for i in indices[start:start + batch_size]]
        if not rows:  # this rank's share ran out: one row whose labels are all ignored adds nothing
            rows = [(dataset[0][0], torch.full_like(dataset[0][1], -100))]
        labels = torch.stack([r[1] for r in rows]).to(device)
        with autocast:  # position t's loss is that of predicting labels[:, t + 1]; the last predicts nothing
            losses = model(torch.stack([r[0] for r in rows]).to(device), labels=labels,
                           loss_reduction="none").loss[:, :-1].double()
        targets = labels[:, 1:]
        counted = targets != -100
        nbytes = torch.where(counted, token_bytes[targets.clamp(min=0)], 0)  # (clamp: -100 is no index)
        # torch.where, not a boolean index: that would wait for the device to count the rows it keeps.
        totals += torch.stack([losses.sum(), counted.sum().double(), torch.where(nbytes > 0, losses, 0.0).sum(),
                               nbytes.sum().double()])
    if dist.is_initialized():
        dist.all_reduce(totals)
    model.train(was_training)  # eval_model.py scores a model in eval mode and keeps it so
    loss_sum, tokens, text_loss_sum, text_bytes = totals.tolist()  # the one wait for the device
    bpb = text_loss_sum / math.log(2) / text_bytes if text_bytes else math.nan
    return Validation(loss_sum / max(tokens, 1), bpb, int(tokens), int(text_bytes))


def is_trace_record(record) -> bool:
    """A line of a --save_debug_train_output trace (the loop writes step, rank, samples and more)."""
    return (isinstance(record, dict) and isinstance(record.get("step"), int) and isinstance(record.get("rank"), int)
            and isinstance(record.get("samples"), list))


def trace_problem(path: Path, resuming: bool) -> str | None:
    """Why this run may not write its --save_debug_train_output trace to `path` (None: it may), before
    it writes anything. Nothing a run did not create is appended to: a fresh run takes only a path with
    nothing there (or an empty file), as another run's trace there would get two runs' steps mixed. A
    resumed run continues the file only if it is a trace of this trainer (the first line says so here;
    cut_trace_back checks every line before it changes one)."""
    flag = f"--save_debug_train_output {path}"
    problem = output_problem(path, appended=True)  # lstat first: a FIFO opened to read it would wait for a writer
    if problem is not None:
        return f"{flag} {problem}: give the path of a regular file (or of none yet); it was left as it is"
    if not path.is_file() or path.stat().st_size == 0:  # nothing there yet
        return None
    # O_NONBLOCK | O_NOFOLLOW: a FIFO or link swapped in since the lstat neither blocks nor is followed here.
    with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK | os.O_NOFOLLOW)) as f:
        first = f.readline(1 << 20)  # a trace line is short; a data file's line may be long: no need to read it all
    try:
        is_trace = is_trace_record(json.loads(first))
    except ValueError:  # not JSON, not UTF-8, or a line cut short
        is_trace = False
    if resuming and (is_trace or not first.endswith(b"\n")):  # the only line, cut short by a kill: dropped on cut
        return None
    if resuming:
        return (f"{flag} is not a trace of this trainer (line 1 has no step, rank and samples); --from_resume 1 "
                f"continues only the run's own trace, and left this file untouched: give that trace, or a new path")
    if is_trace:
        return (f"{flag} already holds the trace of an earlier run, and a fresh run appends to no other run's trace; "
                f"it left the file untouched: delete it or give a new path, or continue that run with --from_resume 1")
    return (f"{flag} already exists and is not a trace of this trainer; a fresh run left it untouched: give a path "
            f"where no file is yet")


def cut_trace_back(path: Path, step: int) -> None:
    """Keep only the trace records of steps up to `step`, the checkpoint a run resumes from (0: a fresh start).

    The steps after it were trained by a run that died before saving them; this run trains them again,
    so their records go, as their lines in the metrics file do. So does a line that is not JSON (a write
    cut short by a kill). Rank 0 calls it before any rank appends; it says what it removed. A line that
    is JSON but no trace record raises ConfigError before anything is changed.
    """
    if not path.is_file():
        return
    kept, dropped = [], 0
    for number, line in enumerate(path.read_bytes().splitlines(keepends=True), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # cut short (or not UTF-8)
            dropped += 1
            continue
        if not is_trace_record(record):
            raise ConfigError(f"--save_debug_train_output {path}, line {number}: not a trace record of this trainer "
                              f"(no step, rank and samples); the file was left untouched: give the run's own "
                              f"trace, or a new path")
        if record["step"] <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_text(path, b"".join(kept).decode("utf-8"))  # lines that parsed as JSON are UTF-8
        print(f"{path}: removed {dropped} trace records after step {step}, where this run starts "
              f"(those steps are trained again)", flush=True)


def refuse_on_every_rank(problem: str | None) -> None:
    """Raise one ConfigError on every rank if any rank has a `problem` (None: it has none), so none waits in a
    collective for a rank that left. Every rank must call it. Also a barrier."""
    problems = [problem]
    if dist.is_initialized():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    problems = list(dict.fromkeys(p for p in problems if p))  # ranks sharing a filesystem see the same problem
    if problems:
        raise ConfigError("; ".join(problems))


def open_trace(path: Path, resuming: bool, start_step: int, is_main: bool) -> int:
    """The file descriptor every rank appends its trace lines to, once every rank has checked `path`
    (trace_problem) and rank 0 has cut a resumed run's trace back to `start_step`. A problem on any rank
    is raised as one ConfigError on every rank, so none waits in a collective for the others."""
    problem = None
    try:
        problem = trace_problem(path, resuming)
        if problem is None and resuming and is_main:  # as the metrics file: cut back to the resumed step
            cut_trace_back(path, start_step)
    except ConfigError as error:
        problem = str(error)
    refuse_on_every_rank(problem)  # also the barrier: no rank appends before rank 0 has cut the file
    path.parent.mkdir(parents=True, exist_ok=True)
    # Ranks append to one file with single write() calls of whole lines (O_APPEND keeps them intact).
    return open_to_append(path)


class Tracker:
    """One run's outputs. `runs` holds the wandb/SwanLab run objects (their ids go into checkpoints)."""

    def __init__(self, args, name: str, is_main: bool, device: torch.device, *, start_step: int,
                 total_steps: int, tracker_ids: dict, model_flops_per_token: float):
        loggers = set(args.logger.split(",")) if is_main else set()
        loggers |= {"wandb"} if is_main and args.use_wandb else set()
        loggers |= {"swanlab"} if is_main and args.use_swanlab else set()
        self.is_main, self.device, self.epochs, self.console = is_main, device, args.epochs, "console" in loggers
        self.files = MetricsFileWriter(args.metrics_dir or args.save_dir, name, heartbeat_interval_s=HEARTBEAT_S,
                                       lock_file=str(Path(args.checkpoint_dir).resolve() / LOCK_NAME)
                                       ) if "file" in loggers else None
        # Before anything is written or a backend starts: rank 0's metrics and status paths, agreed by every rank.
        refuse_on_every_rank(self.files.path_problem() if self.files is not None else None)
        self.runs = {}
        for backend in ("wandb", "swanlab"):  # the two clients share this API: init, log(dict, step=), finish
            if backend in loggers:
                client, run_id = importlib.import_module(backend), tracker_ids.get(backend)
                self.runs[backend] = client.init(project=args.wandb_project, name=name, config=dict(vars(args)),
                                                 id=run_id, resume="allow" if run_id else None)
        self.trace = None
        if args.save_debug_train_output:
            self.trace = open_trace(Path(args.save_debug_train_output), bool(args.from_resume or args.resume_path),
                                    start_step, is_main)
        self.peak, self.flops_per_token = peak_flops(device), model_flops_per_token
        self.started = self.last_log = time.perf_counter()
        self.current_step = self.last_log_step = self.last_taken = start_step
        self.steps_done, self.tokens, self.saves, self.save_blocked_s = 0, 0, 0, 0.0
        self.save_parts_s: dict[str, float] = {}  # the blocked time by part, summed over this run's saves
        self.log_interval, self.async_save, self.first_taken = args.log_interval, bool(args.async_save), False
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.last_finished = (None, None)  # (step, Unix time): one tuple, so the heartbeat never reads half
        self.stop_beating, self.heartbeat = threading.Event(), None
        if self.files is not None:
            self.files.begin(start_step, total_steps)
            # A daemon thread: it never keeps a finished or crashed process alive.
            self.heartbeat = threading.Thread(target=self._beat, name="status-heartbeat", daemon=True)
            self.heartbeat.start()

    def _beat(self) -> None:
        """The heartbeat thread: Python values only, so it never waits on (or syncs with) the device."""
        while not self.stop_beating.wait(HEARTBEAT_S):
            try:
                self.files.beat(*self.last_finished)
            except OSError as error:  # a full disk must not end the heartbeat: say so, the next beat tries again
                print(f"WARNING: could not write the heartbeat to {self.files.status_file}: {error}", flush=True)

    def _stop_heartbeat(self) -> None:
        self.stop_beating.set()
        if self.heartbeat is not None:
            self.heartbeat.join(timeout=2 * HEARTBEAT_S)  # a beat mid-write finishes; a hung disk is not waited on
            self.heartbeat = None

    def step_taken(self, step: int) -> None:
        """Optimizer step `step` is taken (on a GPU: queued, its numbers still on the device). After this invocation's
        first: "first step taken", the first sign of life a slow machine's user gets."""
        if self.is_main and not self.first_taken:
            print(f"first step taken after {time.perf_counter() - self.started:.1f} s (step {step}; "
                  f"a log line every {self.log_interval} steps)", flush=True)
        self.first_taken, self.last_taken = True, step

    def step_in_progress(self) -> int:
        """The number of the step whose forward and backward run now (--debug_inject reads it)."""
        return self.last_taken + 1

    def step(self, step, numbers, verdict: tuple[str, str]) -> None:
        """Every optimizer step, once the host has read its numbers (trainer_utils.Step, StepNumbers) and the
        anomaly policy its `verdict`, on every rank: its trace line, and its tokens (of all ranks) for tokens/s."""
        action, reason = verdict
        if self.trace is not None and lock_lost() is None:  # once another run holds the directory, its trace too
            record = {"step": step.number, "epoch": step.epoch, "rank": self.rank, "world_size": self.world_size,
                      "samples": step.samples if action == "apply" else [],
                      "loss": numbers.loss_sum / max(numbers.local_tokens, 1), "loss_sum": numbers.loss_sum,
                      "local_tokens": numbers.local_tokens, "global_loss": numbers.loss, "grad_norm": numbers.grad_norm,
                      "lr": step.lr}
            if action != "apply":
                record.update(skipped=True, skipped_samples=step.samples, anomaly=reason)
            os.write(self.trace, (json.dumps(record) + "\n").encode("utf-8"))
        self.last_finished = (step.number, time.time())
        self.current_step, self.steps_done = step.number, self.steps_done + 1
        self.tokens += numbers.all_input_tokens

    def log(self, metrics: dict, step: int, total_steps: int) -> None:
        """Training metrics of `step`, plus the throughput since the previous log (rank 0 sends them)."""
        now = time.perf_counter()
        since, steps = now - self.last_log, max(step - self.last_log_step, 1)
        metrics = {"step": step, **metrics, "tokens_per_s": self.tokens / max(since, 1e-9),
                   "step_time_s": since / steps, "save_blocked_s": self.save_blocked_s,
                   **{f"save_{part}": seconds for part, seconds in self.save_parts_s.items()},
                   "eta_s": (total_steps - step) * (now - self.started) / max(self.steps_done, 1)}
        if self.device.type == "cuda":
            metrics["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30
            if self.peak is not None:
                world_size = dist.get_world_size() if dist.is_initialized() else 1
                metrics["mfu"] = self.flops_per_token * metrics["tokens_per_s"] / (self.peak * world_size)
        self.last_log, self.last_log_step, self.tokens = now, step, 0
        if self.console:
            watched = "".join(f" {name} {metrics[name]:.4g}" for name in WATCHED if name in metrics)  # a stage's own
            print(f"epoch {metrics['epoch'] + 1}/{self.epochs} step {step} ({total_steps - step} to go) "
                  f"loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} grad_norm {metrics['grad_norm']:.3f}{watched} "
                  f"{metrics['tokens_per_s']:.0f} tok/s ETA {format_duration(metrics['eta_s'])}", flush=True)
        if self.files is not None:
            self.files.log(metrics, total_steps)
        for run in self.runs.values():
            run.log({f"train/{k}": v for k, v in metrics.items() if k != "step"}, step=step)

    def validation(self, step: int, result: Validation) -> None:
        """`result` of validation_loss at `step`: the loss per token and the bits per byte."""
        if self.console:
            print(f"validation at step {step}: val/loss {result.loss:.4f} val/bpb {result.bpb:.4f} "
                  f"({result.tokens} tokens, {result.text_bytes} bytes of text)", flush=True)
        if self.files is not None:
            self.files.validation(step, result.loss, result.bpb)
        for run in self.runs.values():
            run.log({"val/loss": result.loss, "val/bpb": result.bpb}, step=step)

    def preference_validation(self, step: int, loss: float, accuracy: float, pairs: int) -> None:
        """DPO's validation at `step`: its loss on the held-out pairs, and the share whose implicit reward prefers
        the chosen answer."""
        if self.console:
            print(f"validation at step {step}: val/loss {loss:.4f} val/accuracy {accuracy:.4f} ({pairs} pairs)",
                  flush=True)
        if self.files is not None:
            self.files.validation(step, loss, accuracy=accuracy)
        for run in self.runs.values():
            run.log({"val/loss": loss, "val/accuracy": accuracy}, step=step)

    def anomaly(self, step: int, reason: str) -> None:
        if self.files is not None:
            self.files.anomaly(step, reason)

    def rollback(self, step: int, total_steps: int) -> None:
        """Back at checkpoint `step`: the steps after it will be logged again."""
        self.current_step = self.last_taken = step
        if self.files is not None:
            self.files.rollback(step, total_steps)

    def saved(self, step: int, path: str | Path, blocked_s: float, parts: dict[str, float]) -> None:
        """The checkpoint of `step` (its kept file `path`) blocked training for `blocked_s`, of which `parts`
        (BackgroundSaver.pop_blocked: waiting for the previous write, the copy, the write); the rest is building
        the state, the ranks' exchange of RNG states and --save_hf's export. The metrics records sum them up."""
        parts = {**parts, "other_s": max(blocked_s - sum(parts.values()), 0.0)}
        self.saves, self.save_blocked_s = self.saves + 1, self.save_blocked_s + blocked_s
        for part, seconds in parts.items():
            self.save_parts_s[part] = self.save_parts_s.get(part, 0.0) + seconds
        if self.is_main:
            spent = ", ".join(f"{SAVE_PARTS[part]} {seconds:.2f} s" for part, seconds in parts.items())
            print(f"saved step {step} to {path}: training blocked {blocked_s:.2f} s ({spent})"
                  + ("; the write goes on in the background" if self.async_save else ""), flush=True)

    def finish(self, status: str) -> None:
        """`status`: completed, stopped or failed. Closes every backend."""
        self._stop_heartbeat()  # before the last write: no beat lands after it
        if self.is_main and status != "failed":
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            print(f"{self.saves} saves blocked training for {self.save_blocked_s:.3f} s "
                  f"({100 * self.save_blocked_s / elapsed:.2f}% of this run's time)", flush=True)
        if self.files is not None:
            self.files.beat(*self.last_finished)  # the last step, also of a run shorter than one beat
            self.files.finish(status, self.current_step)
        for backend, run in self.runs.items():
            run.finish(**({"exit_code": 0 if status != "failed" else 1} if backend == "wandb" else {}))
        self.runs = {}
        if self.trace is not None:
            os.close(self.trace)
            self.trace = None

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error is not None:  # the status file and the tracker runs say the run failed
            self.finish("failed")
        self._stop_heartbeat()

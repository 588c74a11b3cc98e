"""The anomaly guard's verdicts, reached where the host waits for the device anyway.

On a GPU the host runs ahead: it queues a step's kernels and goes on while the GPU works through
them. Reading a number (`.item()`, `.tolist()`) makes the host wait until the GPU gets there. So the
loop reads its steps' numbers only where a learner sees it wait, as minimind reads `loss.item()` at
its log interval: a log line, a validation, a save, and the run's last step.

    every step:  judge.add(step, loss_sum, ...)   after the optimizer step: the numbers stay on the
                                                  device, nothing waits
    at a wait:   judge.settle()                   one copy to the host of every step since the last wait,
                                                  judged one by one in step order: the trace and metrics
                                                  records, then Rollback or AnomalyStop for a bad step

A non-finite step needs no verdict first: the optimizer skips it on the device
(trainer_utils.optimizer_step). A spike is applied, and judged at the next wait, which always comes
before a save: so no checkpoint holds a step the guard rejects. Under --on_anomaly stop the run ends
there, its newest checkpoint from before the spike; under rollback it goes back to that checkpoint and
steps over the window that went wrong. The verdicts do not depend on how often the host waits: the same
numbers, in the same order, against the same history (tests/test_wait_points.py holds the log interval
to that).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from trainer.hardening.anomaly import NOT_TRAINING, AnomalyGuard, AnomalyStop
from trainer.hardening.background_save import BackgroundSaver, finish_saves
from trainer.hardening.stopping import StopRequest


STEPPED_OVER = "stepped over: this window caused an anomaly before a rollback"


def stop_message(reason: str) -> str:
    """What a stop says: a bad step stops the run before any save holds it. A run of skipped steps held nothing
    either (no skipped step changed a weight); its reason says what to try instead."""
    return reason if reason.startswith(NOT_TRAINING) else f"{reason}. The newest checkpoint is from before it."


class Step(NamedTuple):
    """What the loop knows of an optimizer step on the host, without asking the device."""
    number: int  # the global step this is (1 for the first step of a run)
    epoch: int
    start: int  # samples_consumed at the window's start
    samples_after: int  # samples_consumed once it is taken (0: it ended the epoch)
    lr: float
    samples: list[int]  # the sample indices this rank trains in it
    input_tokens: int  # this rank's tokens, for tokens/s


class Rollback(Exception):
    """An anomaly under --on_anomaly rollback: the epoch loop goes back to the newest checkpoint."""

    def __init__(self, step: Step, reason: str):
        super().__init__(reason)
        self.step, self.reason = step, reason


class StepJudge:
    """Keeps each step's numbers on the device until the next wait, then judges them in order."""

    def __init__(self, args, tracker, saver: BackgroundSaver, gradients_finite_expected: bool, dist_info,
                 start_step: int, guard_state: dict, log: Callable[[str], None]):
        """`start_step`, `guard_state`: where a resumed run starts, and its guard's memory ({} for a new run)."""
        self.guard = AnomalyGuard(args.on_anomaly, args.patience, args.max_rollbacks, args.rollback_lr_factor,
                                  args.max_skipped_steps)
        self.guard.load_state_dict(guard_state)  # its history, rollbacks and the windows to step over
        self.stop = StopRequest()  # SIGTERM / Ctrl-C: finish the step, save, exit 0
        self.tracker, self.saver, self.device, self.log = tracker, saver, dist_info.device, log
        self.finite_expected, self.policy = gradients_finite_expected, args.on_anomaly
        self.rank, self.world_size = dist_info.rank, dist_info.world_size
        self.pending: list[tuple[Step, torch.Tensor, bool]] = []  # taken since the last wait, not judged yet
        self.steps_run = 0  # optimizer steps of this invocation, less those rolled back (--max_steps)
        self.next_step = start_step + 1  # the step the device computes next (--debug_inject reads it)
        self.stopped = False  # the step taken last was this invocation's last (a stop, or --max_steps)
        self.first_taken = False
        self.metrics: dict | None = None  # the log line of the newest step judged

    def step_in_progress(self) -> int:
        """The number of the step whose forward and backward run now."""
        return self.next_step

    @property
    def lr_scale(self) -> float:
        """The LR multiplier after rollbacks (--rollback_lr_factor)."""
        return self.guard.lr_scale

    def steps_over(self, epoch: int, start: int) -> bool:
        """True for the window at sample `start` of `epoch` if it went wrong before a rollback: it is trained
        (the same samples and RNG draws as before), and its update is not applied."""
        stepped_over = self.guard.should_skip(epoch, start)
        if stepped_over:
            self.log(f"{STEPPED_OVER} (sample {start} of epoch {epoch + 1})")
        return stepped_over

    def add(self, step: Step, loss_sum: torch.Tensor, local_tokens: torch.Tensor, global_tokens: torch.Tensor,
            grad_norm: torch.Tensor, stepped_over: bool) -> None:
        """Keep a step's numbers (device tensors) for the next `settle`; nothing waits for the device."""
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor, the norm of all slices, the same on every rank
            grad_norm = grad_norm.full_tensor()
        numbers = torch.stack([loss_sum, local_tokens, global_tokens, grad_norm.detach().double()])
        self.pending.append((step, numbers, stepped_over))
        self.steps_run, self.next_step = self.steps_run + 1, step.number + 1
        if not self.first_taken:  # the first sign of life a slow machine's user gets
            self.first_taken = True
            self.tracker.first_step(step.number)

    def last_step(self, max_steps: int | None) -> bool:
        """True if the step just taken is this invocation's last: a stop (SIGTERM, Ctrl-C) reached a rank, and
        every rank agrees on this step; or --max_steps steps were taken. Raises on every rank if a rank's
        background save failed or its directory lock was lost (the saver's `failed` says both)."""
        stop, save_failed = self.stop.agreed(self.saver.failed)
        if save_failed:
            finish_saves(self.saver)  # raises on every rank: the writer's error, or LockLost (run_lock.py)
        self.stopped = stop or (max_steps is not None and self.steps_run >= max_steps)
        return self.stopped

    def settle(self) -> dict:
        """Wait for the device: every step since the last wait, judged in step order. Returns the newest
        step's log line; raises Rollback or AnomalyStop at the first bad step (the later ones are dropped)."""
        if not self.pending:
            return self.metrics
        steps, rows, stepped = zip(*self.pending)
        self.pending = []
        local = torch.stack(rows)  # per step: loss_sum, local_tokens, global_tokens, grad_norm (this rank's)
        shared = torch.stack([local[:, 0], torch.tensor([float(s.input_tokens) for s in steps], dtype=torch.float64,
                                                        device=self.device)], dim=1)
        if dist.is_initialized():  # summed in rank order: the same sums however many steps a wait covers
            gathered = [torch.empty_like(shared) for _ in range(self.world_size)]
            dist.all_gather(gathered, shared)
            shared = gathered[0]
            for other in gathered[1:]:
                shared = shared + other
        values = torch.cat([local, shared], dim=1).tolist()  # the one wait for the device
        for step, (loss_sum, local_tokens, global_tokens, grad_norm, all_loss, all_input), stepped_over in zip(
                steps, values, stepped):
            loss = all_loss / max(global_tokens, 1.0)
            if stepped_over:  # it went wrong before a rollback: not applied this time, and not judged again
                action, reason = "skip", STEPPED_OVER
            else:
                action, reason = self._verdict(step, loss, grad_norm)
            if action == "stop":
                raise AnomalyStop(stop_message(reason))
            if action == "rollback":
                raise Rollback(step, reason)
            lr = 0.0 if stepped_over else step.lr
            record = {"step": step.number, "epoch": step.epoch, "rank": self.rank, "world_size": self.world_size,
                      "samples": step.samples if action == "apply" else [], "loss": loss_sum / max(local_tokens, 1),
                      "loss_sum": loss_sum, "local_tokens": int(local_tokens), "global_loss": loss,
                      "grad_norm": grad_norm, "lr": lr}
            if action != "apply":
                record.update(skipped=True, skipped_samples=step.samples, anomaly=reason)
            self.tracker.step(record, int(all_input))  # the trace line (every rank) and tokens/s
            self.metrics = {"epoch": step.epoch, "samples_consumed": step.samples_after, "loss": loss, "lr": lr,
                            "grad_norm": grad_norm}
        return self.metrics

    def rolled_back(self, rollback: Rollback, state: dict | None) -> tuple[int, int, int]:
        """After a Rollback: `state` is the newest checkpoint (None: there is none). The window that went
        wrong will be stepped over, and the LR scaled. Returns the position to go on from."""
        if state is None:
            raise AnomalyStop(f"{rollback.reason}; no checkpoint to roll back to yet (lower --save_interval)")
        step = rollback.step
        self.guard.plan_rollback(step.epoch, step.start)
        # The bad step and those taken after it before this wait do not count for --max_steps.
        self.pending, self.steps_run = [], self.steps_run - (self.next_step - step.number)
        self.next_step, self.stopped = state["global_step"] + 1, False
        self.log(f"rollback {self.guard.rollbacks}/{self.guard.max_rollbacks}: back to step {state['global_step']}; "
                 f"the window at sample {step.start} of epoch {step.epoch + 1} will be stepped over; lr scale now "
                 f"{self.guard.lr_scale:g}")
        return state["epoch"], state["samples_consumed"], state["global_step"]

    def _verdict(self, step: Step, loss: float, grad_norm: float) -> tuple[str, str]:
        action, reason = self.guard.verdict(step.number, loss, grad_norm, self.finite_expected)
        if reason:
            self.log(f"anomaly: {reason} (--on_anomaly {self.policy}: {action})")
            self.tracker.anomaly(step.number, reason)
        return action, reason

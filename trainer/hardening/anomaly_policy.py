"""The anomaly policy, --on_anomaly warn | stop | rollback: what the run does about a bad step. It acts between
steps, never inside one: the step's math (loss, gradient, clip, update) is the same with or without it, and a
first reading skips it. Until a rollback it changes no number; after one (--on_anomaly rollback only) the steps
that follow run at the LR x --rollback_lr_factor (1 by default: the same LR), and the window that went wrong is
never trained again. The script meets it at three places, none of them in the step itself:

    policy.lr_scale, policy.left_out_of(epoch)   at the start of train_epoch (and again after a rollback): the
                                                 LR multiplier (x --rollback_lr_factor after each rollback)
                                                 and the windows of the epoch's order that a rollback left out,
                                                 which SkipBatchSampler never hands out
    policy.judge(step, numbers)                  where the host has read step N's numbers (the log line, a
                                                 validation, a save): the verdict (anomaly.py); a bad step
                                                 raises AnomalyStop (stop) or Rollback (rollback)
    policy.rolled_back(rollback, state)          section 7, after a Rollback: the window to leave out from now
                                                 on, and the position of the checkpoint to go back to

It reads the numbers the loop keeps (trainer_utils.read_on_host); it does not own them. A non-finite step
needs no verdict first: the optimizer skips it on the device (trainer_utils.optimizer_step). A spike is
applied, and judged at the next wait, which always comes before a save: so no checkpoint holds a step the
policy rejects. Under stop the run ends there, its newest checkpoint from before the spike; under rollback
train_epoch is left by the exception, the checkpoint loaded, and the epoch's loop entered again at its position
with a sampler that leaves the window that went wrong out (as PaLM's restarts skip the batches around a spike).
The verdicts do not depend on how often the host waits: the same numbers, in the same order, against the same
history (tests/test_wait_points.py). Its memory (history, rollbacks, windows left out) is saved in every
checkpoint (`state_dict`).
"""

from __future__ import annotations

import math

from typing import Callable

from trainer.hardening.anomaly import NOT_TRAINING, AnomalyGuard, AnomalyStop


def stop_message(reason: str) -> str:
    """What a stop says: a bad step stops the run before any save holds it. A run of skipped steps held nothing
    either (no skipped step changed a weight); its reason says what to try instead."""
    return reason if reason.startswith(NOT_TRAINING) else f"{reason}. The newest checkpoint is from before it."


class Rollback(Exception):
    """An anomaly under --on_anomaly rollback: the epoch loop goes back to the newest checkpoint."""

    def __init__(self, step, reason: str):
        super().__init__(reason)
        self.step, self.reason = step, reason  # step: trainer_utils.Step, the bad one


class AnomalyPolicy:
    """--on_anomaly applied to each step read from the device, in step order, and the windows left out."""

    def __init__(self, args, tracker, gradients_finite_expected: bool, guard_state: dict,
                 log: Callable[[str], None]):
        """`gradients_finite_expected`: False under fp16 GradScaler, where an inf gradient is routine.
        `guard_state`: a resumed run's memory ({} for a new run)."""
        # GRPO's loss (train_grpo.py, the one stage with --num_generations) is no falling curve: about 0, of either
        # sign, on fresh completions each step, so a "spike" above its recent mean is no sign of trouble. It keeps
        # the other rules (non-finite loss or gradients, grad-norm explosion, plateau with --patience).
        spike_factor = math.inf if getattr(args, "num_generations", None) is not None else 3.0
        self.guard = AnomalyGuard(args.on_anomaly, args.patience, args.max_rollbacks, args.rollback_lr_factor,
                                  args.max_skipped_steps, spike_factor)
        self.guard.load_state_dict(guard_state)  # its history, rollbacks and the windows left out
        self.tracker, self.log, self.policy = tracker, log, args.on_anomaly
        self.finite_expected = gradients_finite_expected

    @property
    def lr_scale(self) -> float:
        """The LR multiplier: 1, times --rollback_lr_factor for each rollback so far."""
        return self.guard.lr_scale

    @property
    def left_out(self) -> list[tuple[int, int, int]]:
        """The windows rollbacks left out: (epoch, start, end), spans of that epoch's order (trainer_utils)."""
        return self.guard.left_out

    def left_out_of(self, epoch: int) -> list[tuple[int, int]]:
        """The (start, end) spans of `epoch`'s order left out (SkipBatchSampler's `left_out`)."""
        return [(start, end) for e, start, end in self.guard.left_out if e == epoch]

    def judge(self, step, numbers) -> tuple[str, str]:
        """(action, reason) for one step read from the device (trainer_utils.Step, StepNumbers): "apply", or
        "skip" (non-finite under warn: its update was not applied). A bad step under stop or rollback raises
        AnomalyStop or Rollback; the steps read after it are dropped."""
        action, reason = self.guard.verdict(step.number, numbers.loss, numbers.grad_norm, self.finite_expected)
        if reason:
            self.log(f"anomaly: {reason} (--on_anomaly {self.policy}: {action})")
            self.tracker.anomaly(step.number, reason)
        if action == "stop":
            raise AnomalyStop(stop_message(reason))
        if action == "rollback":
            raise Rollback(step, reason)
        return action, reason

    def rolled_back(self, rollback: Rollback, state: dict | None) -> tuple[int, int, int]:
        """After a Rollback: `state` is the newest checkpoint (None: there is none). The window that went
        wrong will be left out, and the LR scaled. Returns the position to go on from."""
        if state is None:
            raise AnomalyStop(f"{rollback.reason}; no checkpoint to roll back to yet (lower --save_interval)")
        step = rollback.step
        self.guard.plan_rollback(step.epoch, step.start, step.end)
        self.log(f"rollback {self.guard.rollbacks}/{self.guard.max_rollbacks}: back to step {state['global_step']}; "
                 f"samples {step.start} to {step.end - 1} of epoch {step.epoch + 1}'s order will be left out; lr "
                 f"scale now {self.guard.lr_scale:g}")
        return state["epoch"], state["samples_consumed"], state["global_step"]

    def state_dict(self) -> dict:
        """The memory a checkpoint keeps (`anomaly` in `_resume.pth`)."""
        return self.guard.state_dict()


# What a rollback leaves out, as the sampler (trainer_utils.SkipBatchSampler) and the step count (total_steps)
# read it: with nothing left out, [samples_consumed, num_samples) whole.

def kept_spans(samples_consumed: int, num_samples: int, left_out=()) -> list[tuple[int, int]]:
    """[samples_consumed, num_samples) of the epoch's order less the (start, end) spans a rollback `left_out`."""
    spans, cursor = [], samples_consumed
    for start, end in sorted(left_out):
        if start > cursor:
            spans.append((cursor, start))
        cursor = max(cursor, end)
    return spans + [(cursor, num_samples)] if cursor < num_samples else spans


def cursor_after(spans: list[tuple[int, int]], trained: int, num_samples: int) -> int:
    """The position in the order once `trained` samples of `spans` are trained (all of them: the epoch's end)."""
    for start, end in spans:
        if trained < end - start:
            return start + trained
        trained -= end - start
    return num_samples


def steps_left(num_samples: int, samples_consumed: int, global_batch: int, left_out=()) -> int:
    """Optimizer steps still to take in an epoch (the last one may be a short window)."""
    kept = sum(end - start for start, end in kept_spans(samples_consumed, num_samples, left_out))
    return math.ceil(kept / global_batch)

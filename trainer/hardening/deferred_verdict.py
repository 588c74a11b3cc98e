"""The anomaly guard's verdict on each step, one step late, so the host never waits for the device.

On a GPU the host runs ahead of the device: it queues kernels, and the GPU works through them. Reading
a step's loss right after its backward would make the host wait for the GPU, and then the GPU wait for
the host. So the training loop hands each step to `DeferredVerdict.hand_in` right after its backward
and clip, and gets back the step *before* it, judged:

    step N:   forward, backward, clip     (queued on the device)
              hand_in(step N)             step N's numbers start their way to the host (StepNumbers);
                                          step N-1's arrived long ago: it is judged now, nothing waits
              log and save step N-1       the weights are still step N-1's: step N has not changed them
              step_unless_refused(...)    step N's update, refused on the device if the guard's rule
                                          says so (its limits come from the steps judged so far)

The host later reaches the same verdict from the same numbers and says why (a disagreement is a bug
and raises). A bad step leaves the loop as an exception: `Rollback`, or `AnomalyStop`. After a
rollback the window that went wrong is stepped over: it runs, and its update is refused. The last step
of a run has no step after it: `settle` judges it. `--judge_before_step 1` makes the host wait for
each step's numbers and judge the step before its update (the reference the tests hold this to).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from trainer.hardening.anomaly import AnomalyGuard, AnomalyStop
from trainer.hardening.background_save import BackgroundSaver, finish_saves
from trainer.hardening.step_numbers import StepNumbers
from trainer.hardening.stopping import StopRequest


class Step(NamedTuple):
    """What the loop knows of an optimizer step when it hands it in."""
    number: int  # the global step this is (1 for the first step of a run)
    epoch: int
    start: int  # samples_consumed at the window's start
    after: tuple[int, int, int]  # (epoch, samples_consumed, global_step) once this step is taken
    lr: float
    samples: list[int]  # the sample indices this rank trains in it
    input_tokens: int
    rng: dict  # the RNG state before this step: a save of the step before stores it


@dataclass
class Judged:
    """A step with its verdict, and what a save of it stores besides the weights."""
    step: Step
    loss: float
    grad_norm: float
    lr: float  # 0.0 for a window stepped over: it trained nothing
    stop: bool  # a rank was asked to stop (SIGTERM, Ctrl-C): save this step, then stop
    rng_after: dict  # the RNG state right after this step
    anomaly_state: dict  # the guard's memory right after this step's verdict

    @property
    def number(self) -> int:
        return self.step.number

    @property
    def epoch_ended(self) -> bool:
        return self.step.after[1] == 0

    @property
    def metrics(self) -> dict:
        """What the log line of this step shows."""
        return {"epoch": self.step.epoch, "samples_consumed": self.step.after[1], "loss": self.loss,
                "lr": self.lr, "grad_norm": self.grad_norm}


class Rollback(Exception):
    """An anomaly under --on_anomaly rollback: the epoch loop goes back to the newest checkpoint."""

    def __init__(self, step: Step, reason: str):
        super().__init__(reason)
        self.step, self.reason = step, reason


class StopRequested(Exception):
    """SIGTERM or Ctrl-C reached a rank: the run stops after the step judged last (`settle` hands it back)."""


class DeferredVerdict:
    """Takes each step's numbers as the loop hands it in, and hands back the step before it, judged."""

    def __init__(self, args, tracker, saver: BackgroundSaver, gradients_finite_expected: bool, dist_info,
                 start_step: int, guard_state: dict, log: Callable[[str], None]):
        """`start_step`, `guard_state`: where a resumed run starts, and its guard's memory ({} for a new run)."""
        self.guard = AnomalyGuard(args.on_anomaly, args.patience, args.max_rollbacks, args.rollback_lr_factor)
        self.guard.load_state_dict(guard_state)  # its history, rollbacks and the windows to step over
        self.stop = StopRequest()  # SIGTERM / Ctrl-C: finish the step, save, exit 0
        self.tracker, self.saver, self.device, self.log = tracker, saver, dist_info.device, log
        self.finite_expected, self.before_step = gradients_finite_expected, bool(args.judge_before_step)
        self.policy, self.rank, self.world_size = args.on_anomaly, dist_info.rank, dist_info.world_size
        self.pending: tuple[Step, StepNumbers, tuple | None, bool] | None = None  # handed in, not judged yet
        self.steps_run = 0  # optimizer steps of this invocation, less those rolled back (--max_steps)
        self.next_step = start_step + 1  # the step the device is computing now (--debug_inject reads it)
        self.stopped: Judged | None = None  # after a stop request: the step to save before the run stops

    def step_in_progress(self) -> int:
        """The number of the step whose forward and backward run now."""
        return self.next_step

    def stopping(self, max_steps: int | None) -> bool:
        """True once a stop request was seen, or --max_steps steps were taken."""
        return self.stopped is not None or (max_steps is not None and self.steps_run >= max_steps)

    @property
    def lr_scale(self) -> float:
        """The LR multiplier after rollbacks (--rollback_lr_factor)."""
        return self.guard.lr_scale

    def hand_in(self, step: Step, loss_sum: torch.Tensor, local_tokens: torch.Tensor, global_tokens: torch.Tensor,
                grad_norm: torch.Tensor) -> tuple[Judged | None, torch.Tensor]:
        """Hand in `step` (its backward and clip are queued); get back the step before it, judged (None for
        the first), and `step`'s refusal for step_unless_refused (a 0/1 tensor on the device).
        Raises Rollback or AnomalyStop for a bad step before it, StopRequested if a rank was asked to stop
        (then `step` is dropped, and `settle` hands back the step before it), the save's error if a rank's save
        failed, LockLost if a rank found the directory lock lost (the saver's `failed` says both)."""
        numbers = StepNumbers(loss_sum, global_tokens, local_tokens, grad_norm, input_tokens=step.input_tokens,
                              stop=self.stop.signal is not None, save_failed=self.saver.failed, step=step.number)
        done = self._judge_pending(step.rng)
        if done is not None and done.stop:
            self.stopped = done
            raise StopRequested(self.stop.signal or "a stop request on another rank")
        preset, stepped_over = None, self.guard.should_skip(step.epoch, step.start)
        if stepped_over:  # it went wrong before a rollback: refused this time
            reason = "stepped over: this window caused an anomaly before a rollback"
            self.log(f"{reason} (sample {step.start} of epoch {step.epoch + 1})")
            preset, refusal = ("skip", reason), torch.ones((), device=self.device)
        elif self.before_step:  # the reference timing: the host waits for this step's numbers and judges it
            preset = self._verdict(step, numbers.read(), device_refused=None)
            refusal = torch.tensor(float(preset[0] != "apply"), device=self.device)
        else:  # the guard's rule on the device, with the limits of the steps judged so far
            refusal = self.guard.refusal(numbers.loss, numbers.grad_norm, self.finite_expected)
        numbers.send(refusal)  # on its way to the host, read when the next step is handed in
        self.pending = (step, numbers, preset, stepped_over)
        self.steps_run, self.next_step = self.steps_run + 1, step.number + 1
        return done, refusal

    def settle(self, rng_after: dict) -> Judged | None:
        """The run's last step, judged now (the host waits for it); after a stop request, the step before it."""
        return self.stopped or self._judge_pending(rng_after)

    def rolled_back(self, rollback: Rollback, state: dict | None) -> tuple[int, int, int]:
        """After a Rollback: `state` is the newest checkpoint (None: there is none). The window that went
        wrong will be stepped over, and the LR scaled. Returns the position to go on from."""
        if state is None:
            raise AnomalyStop(f"{rollback.reason}; no checkpoint to roll back to yet (lower --save_interval)")
        step = rollback.step
        self.guard.plan_rollback(step.epoch, step.start)
        self.pending, self.steps_run = None, self.steps_run - 1  # a step rolled back does not count for --max_steps
        self.next_step = state["global_step"] + 1
        self.log(f"rollback {self.guard.rollbacks}/{self.guard.max_rollbacks}: back to step {state['global_step']}; "
                 f"the window at sample {step.start} of epoch {step.epoch + 1} will be stepped over; lr scale now "
                 f"{self.guard.lr_scale:g}")
        return state["epoch"], state["samples_consumed"], state["global_step"]

    def _judge_pending(self, rng_after: dict) -> Judged | None:
        if self.pending is None:
            return None
        step, numbers, preset, stepped_over = self.pending
        self.pending = None
        values = numbers.read()  # waits only if the device is not there yet
        if values["save_failed"]:
            finish_saves(self.saver)  # raises on every rank: the writer's error, or LockLost (run_lock.py)
        device_refused = None if self.before_step else values["refused"]  # the two rules must agree
        action, reason = preset or self._verdict(step, values, device_refused)
        if action == "stop":
            raise AnomalyStop(f"{reason}. The newest checkpoint is from before it.")
        if action == "rollback":
            raise Rollback(step, reason)
        lr = 0.0 if stepped_over else step.lr
        self._record(step, values, action, reason, lr)
        return Judged(step, values["loss"], values["grad_norm"], lr, values["stop"], rng_after, self.guard.state_dict())

    def _verdict(self, step: Step, values: dict, device_refused: bool | None) -> tuple[str, str]:
        action, reason = self.guard.verdict(step.number, values["loss"], values["grad_norm"], self.finite_expected,
                                            device_refused)
        if reason:
            self.log(f"anomaly: {reason} (--on_anomaly {self.policy}: {action})")
            self.tracker.anomaly(step.number, reason)
        return action, reason

    def _record(self, step: Step, values: dict, action: str, reason: str, lr: float) -> None:
        """The step's line in the debug trace and the metrics files (every rank its own samples)."""
        record = {"step": step.number, "epoch": step.epoch, "rank": self.rank, "world_size": self.world_size,
                  "samples": step.samples if action == "apply" else [],
                  "loss": values["local_loss_sum"] / max(values["local_tokens"], 1),
                  "loss_sum": values["local_loss_sum"], "local_tokens": values["local_tokens"],
                  "global_loss": values["loss"], "grad_norm": values["grad_norm"],
                  "lr": lr}
        if action != "apply":
            record.update(skipped=True, skipped_samples=step.samples, anomaly=reason)
        self.tracker.step(record, values["input_tokens"])

"""Spotting a bad step, and deciding what to do about it.

`AnomalyDetector` is pure arithmetic on (step, loss, grad norm): it says *that* a step looks wrong and
why. `AnomalyGuard` applies the --on_anomaly policy to that verdict, every step. All ranks see the same
loss (reduced over ranks) and grad norm (of synchronized gradients), so they reach the same action
without talking:

    "apply"     the step is fine (or only worth a warning): its update stands
    "skip"      non-finite under --on_anomaly warn: its update was skipped on the device; keep training,
                unless --max_skipped_steps steps in a row were skipped: then "stop", as the run no longer trains;
                under fp16, a step GradScaler skipped (inf gradients, a finite loss): routine, no warning, no count
    "stop"      --on_anomaly stop: exit non-zero with the reason, before any save holds the step
    "rollback"  --on_anomaly rollback: reload the last good checkpoint (from before the step), and leave
                this batch window out of the epoch: the steps after the checkpoint train the samples around it

When: a step whose gradients are not finite is skipped on the device before any verdict
(trainer_utils.optimizer_step); the others are applied. The host judges every step later, in step
order, where it waits for the device anyway (anomaly_policy.py): a log line, a validation, a save, the run's
end. So a spike under `stop` ends the run before anything holds it, and under `rollback` the run goes
back to a checkpoint from before it. A non-finite step is never applied. The guard's memory (history,
rollbacks, windows left out) is saved in every checkpoint, so a resume keeps it. `--debug_inject` shows
the policy at work.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch


class AnomalyStop(RuntimeError):
    """Training stopped on an anomaly (--on_anomaly stop, rollbacks exhausted, or every recent step skipped)."""


NOT_TRAINING = "not training"  # the start of the reason a run of skipped steps stops with


class AnomalyDetector:
    """Flags steps whose loss or gradient norm looks wrong, with a reason in words. Rules, in order:

    1. Non-finite loss or grad norm: always reported (NaN spreads into every weight at the next step).
    2. Loss spike: loss > mean + spike_factor * std of the last `window` accepted losses (after
       `min_history` of them). The std has a floor of max(5% of |mean|, 1e-3), or on a very smooth
       curve a harmless wiggle would count as "many sigmas".
    3. Grad-norm explosion: grad_norm > grad_explosion_factor * median of recent accepted norms
       (the median is not dragged up by the occasional large norm).
    4. Plateau (if patience > 0): no relative 1e-3 improvement of the best loss for `patience` accepted
       checks; the counter then restarts, so a long plateau is reported every `patience` checks.

    Only values that pass rules 1-3 enter the history, so a spike cannot raise the mean and std that
    judge the next values: a loss that stays high keeps being reported, since it did not recover.
    """

    def __init__(self, spike_factor: float = 3.0, window: int = 20, min_history: int = 5,
                 grad_explosion_factor: float = 10.0, patience: int = 0):
        if window < 2 or min_history < 2 or min_history > window:
            raise ValueError(f"need 2 <= min_history <= window, got min_history={min_history} window={window}")
        self.spike_factor, self.window, self.min_history = spike_factor, window, min_history
        self.grad_explosion_factor, self.patience = grad_explosion_factor, patience
        self.losses: deque[float] = deque(maxlen=window)
        self.grad_norms: deque[float] = deque(maxlen=window)
        self.best_loss: float | None = None
        self.best_step: int | None = None
        self.checks_since_best = 0

    def check(self, step: int, loss: float, grad_norm: float) -> str | None:
        """A reason if this step looks anomalous, else None (and the values join the history)."""
        loss, grad_norm = float(loss), float(grad_norm)
        if not math.isfinite(loss):
            return f"non-finite loss {loss} at step {step}"
        if not math.isfinite(grad_norm):
            return f"non-finite grad norm {grad_norm} at step {step}"
        loss_limit, grad_limit = self.limits()
        reason = self._spike(step, loss, loss_limit) or self._explosion(step, grad_norm, grad_limit)
        if reason:
            return reason
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        return self._plateau(step, loss)

    def limits(self) -> tuple[float, float]:
        """(loss limit, grad-norm limit) for the next step: rules 2 and 3 flag a value above them
        (inf: not enough history yet)."""
        loss_limit = grad_limit = math.inf
        if len(self.losses) >= self.min_history:
            mean = statistics.fmean(self.losses)
            loss_limit = mean + self.spike_factor * max(statistics.pstdev(self.losses), 0.05 * abs(mean), 1e-3)
        if len(self.grad_norms) >= self.min_history and statistics.median(self.grad_norms) > 0:
            grad_limit = self.grad_explosion_factor * statistics.median(self.grad_norms)
        return loss_limit, grad_limit

    def _spike(self, step: int, loss: float, limit: float) -> str | None:
        if loss <= limit:
            return None
        mean = statistics.fmean(self.losses)
        return (f"loss spike at step {step}: {loss:.4f} > {limit:.4f} = mean {mean:.4f} + "
                f"{self.spike_factor:g} x std {(limit - mean) / self.spike_factor:.4f} of the last "
                f"{len(self.losses)} steps")

    def _explosion(self, step: int, grad_norm: float, limit: float) -> str | None:
        if grad_norm <= limit:
            return None
        median = limit / self.grad_explosion_factor
        return (f"grad norm explosion at step {step}: {grad_norm:.4g} is {grad_norm / median:.1f}x the "
                f"median {median:.4g} of the last {len(self.grad_norms)} steps "
                f"(limit {self.grad_explosion_factor:g}x)")

    def _plateau(self, step: int, loss: float) -> str | None:
        if self.patience <= 0:
            return None
        if self.best_loss is None or loss < self.best_loss - 1e-3 * abs(self.best_loss):
            self.best_loss, self.best_step, self.checks_since_best = loss, step, 0
            return None
        self.checks_since_best += 1
        if self.checks_since_best < self.patience:
            return None
        self.checks_since_best = 0
        return (f"plateau at step {step}: best loss {self.best_loss:.4f} (step {self.best_step}) has not "
                f"improved by 0.1% for {self.patience} checks")

    def state_dict(self) -> dict:
        """Plain lists and numbers, so it fits in a `weights_only=True` checkpoint."""
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms), "best_loss": self.best_loss,
                "best_step": self.best_step, "checks_since_best": self.checks_since_best}

    def load_state_dict(self, state: dict) -> None:
        """Restore the history of a resumed run (clipped to this detector's window)."""
        self.losses = deque((float(x) for x in state["losses"]), maxlen=self.window)
        self.grad_norms = deque((float(x) for x in state["grad_norms"]), maxlen=self.window)
        self.best_loss, self.best_step = state["best_loss"], state["best_step"]
        self.checks_since_best = int(state["checks_since_best"])


def parse_injection(spec: str | None) -> dict[int, str]:
    """`--debug_inject nan:K,spike:J` -> {K: "nan", J: "spike"}: make those steps' loss NaN or huge."""
    injections = {}
    for item in (spec or "").split(","):
        if not item:
            continue
        kind, _, step = item.partition(":")
        if kind not in ("nan", "spike") or not step.isdigit():
            raise ValueError(f"--debug_inject {spec!r}: expected nan:STEP or spike:STEP (comma-separated), e.g. nan:12")
        injections[int(step)] = kind
    return injections


def install_debug_injection(model: torch.nn.Module, spec: str | None, current_step) -> None:
    """--debug_inject: multiply the loss of the chosen steps by NaN or 1e4 (each fires once per process).
    A forward hook on the plain model (`current_step()` is the step being run): the loop has no test code,
    and the faulty loss flows into the gradients as a real blow-up would. It fires in the first forward of the
    step that builds a graph in training mode, so in what the stage trains on: the loss where the model computes
    it (pretraining, SFT, LoRA, DPO, GRPO pass labels), else the logits the stage's loss is computed from
    (distillation), never a rollout's sampling (generate runs in eval mode) nor a pass without gradients."""
    injections = parse_injection(spec)
    if not injections:
        return

    @torch.compiler.disable  # runs as plain Python under torch.compile: the step number is no graph constant
    def inject(module, inputs, output):
        if not (module.training and torch.is_grad_enabled()):
            return output
        kind = injections.pop(current_step(), None)
        if kind is None:
            return output
        factor = math.nan if kind == "nan" else 1e4
        if output.loss is None:  # the stage computes its loss from the logits: x 1e4 logits give a huge loss too
            return output._replace(logits=output.logits * factor)
        return output._replace(loss=output.loss * factor)

    model.register_forward_hook(inject)


class AnomalyGuard:
    """Applies the --on_anomaly policy to each step, and remembers which windows a rollback left out."""

    def __init__(self, policy: str, patience: int, max_rollbacks: int, lr_factor: float, max_skipped: int,
                 spike_factor: float = 3.0):
        self.policy, self.max_rollbacks, self.lr_factor = policy, max_rollbacks, lr_factor
        self.max_skipped = max_skipped  # --max_skipped_steps
        self.detector = AnomalyDetector(spike_factor=spike_factor, patience=patience)
        self.rollbacks, self.lr_scale = 0, 1.0
        self.skipped_in_a_row = 0  # non-finite steps skipped under warn since the last one applied
        self.left_out: list[tuple[int, int, int]] = []  # (epoch, start, end): spans of that epoch's order

    def verdict(self, step: int, loss: float, grad_norm: float, gradients_finite_expected: bool) -> tuple[str, str]:
        """(action, reason). `gradients_finite_expected` is False under fp16 GradScaler, where an
        inf gradient is routine (the scaler skips that step and lowers its scale by itself)."""
        if not gradients_finite_expected and math.isfinite(loss) and not math.isfinite(grad_norm):
            return "skip", ""  # GradScaler skipped it (no warning, not counted: it lowers its scale until they fit)
        reason = self.detector.check(step, loss, grad_norm)
        if self.policy == "warn" and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return self._skip(step, reason)
        self.skipped_in_a_row = 0  # a step applied (or a stop, a rollback): a run of skipped steps ends
        if reason is None:
            return "apply", ""
        if self.policy == "warn":
            return "apply", reason
        if self.policy == "rollback" and reason.startswith("plateau"):
            return "stop", reason + " (rolling back cannot cure a plateau)"
        if self.policy == "rollback" and self.rollbacks >= self.max_rollbacks:
            return "stop", f"{reason}; giving up after {self.rollbacks} rollbacks (--max_rollbacks)"
        return self.policy, reason  # "stop" or "rollback"

    def _skip(self, step: int, reason: str) -> tuple[str, str]:
        """A non-finite step under warn is skipped; so many in a row that the weights no longer change stop the run:
        it would go on to its end and exit 0, having learnt nothing."""
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row < self.max_skipped:
            return "skip", reason
        first = step - self.skipped_in_a_row + 1
        return "stop", (f"{NOT_TRAINING}: the last {self.skipped_in_a_row} steps ({first} to {step}) were all "
                        f"non-finite and skipped under --on_anomaly warn (--max_skipped_steps {self.max_skipped}), so "
                        f"the weights have not changed since step {first - 1}; the latest: {reason}. Try a lower "
                        f"--learning_rate, look for broken samples in the data, or on a GPU --dtype float32")

    def plan_rollback(self, epoch: int, start: int, end: int) -> None:
        """The LR lower from now on, and the window [start, end) of the epoch's order left out of training."""
        self.rollbacks += 1
        self.lr_scale *= self.lr_factor
        self.left_out = sorted({*self.left_out, (epoch, start, end)})

    def state_dict(self) -> dict:
        """Plain types, so it fits in a `weights_only=True` checkpoint."""
        return {"detector": self.detector.state_dict(), "rollbacks": self.rollbacks, "lr_scale": self.lr_scale,
                "left_out": [list(w) for w in self.left_out], "skipped_in_a_row": self.skipped_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        """Continue with a resumed run's memory; an older checkpoint without it starts afresh."""
        if not state:
            return
        self.detector.load_state_dict(state["detector"])
        self.rollbacks, self.lr_scale = int(state["rollbacks"]), float(state["lr_scale"])
        self.left_out = [(int(epoch), int(start), int(end)) for epoch, start, end in state["left_out"]]
        # A checkpoint of a version before --max_skipped_steps did not count: its run starts counting afresh.
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))

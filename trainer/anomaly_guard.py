"""Deciding what to do with a bad step, and measuring validation loss.

Every step, before the optimizer touches the weights, the loop asks `AnomalyGuard.verdict` about
the step's global loss and grad norm. All ranks see the same two numbers (the loss is reduced
over ranks, the gradient is already synchronized), so all ranks reach the same verdict without
talking to each other:

    "apply"    the step is fine (or only worth a warning): take it
    "skip"     non-finite under --on_anomaly warn: drop this update, keep training
    "stop"     --on_anomaly stop: drop the update, exit non-zero with the reason
    "rollback" --on_anomaly rollback: drop the update, reload the last good checkpoint, and
               step over this batch window when training reaches it again

A non-finite step is never applied, whatever the policy.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from trainer.monitor import AnomalyDetector


class AnomalyStop(RuntimeError):
    """Training stopped on an anomaly (--on_anomaly stop, or rollbacks exhausted)."""


def parse_injection(spec: str | None) -> dict[int, str]:
    """`--debug_inject nan:K,spike:J` -> {K: "nan", J: "spike"}: make those steps' loss NaN or huge."""
    injections = {}
    for item in (spec or "").split(","):
        if not item:
            continue
        kind, _, step = item.partition(":")
        if kind not in ("nan", "spike") or not step.isdigit():
            raise ValueError(f"--debug_inject {spec!r}: expected nan:STEP or spike:STEP (comma-separated), "
                             f"e.g. nan:12")
        injections[int(step)] = kind
    return injections


class AnomalyGuard:
    """Applies the --on_anomaly policy to each step, and remembers which windows to step over."""

    def __init__(self, policy: str, patience: int, max_rollbacks: int, lr_factor: float, inject: str | None):
        self.policy = policy
        self.detector = AnomalyDetector(patience=patience)
        self.max_rollbacks = max_rollbacks
        self.lr_factor = lr_factor
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.skip_windows: set[tuple[int, int]] = set()  # (epoch, cursor at the window's start)
        self.injection = parse_injection(inject)

    def injected_loss_factor(self, step: int) -> float:
        """1.0 normally; NaN or 1e4 at an injected step (each fires once per process)."""
        kind = self.injection.pop(step, None)
        if kind is None:
            return 1.0
        return math.nan if kind == "nan" else 1e4

    def verdict(self, step: int, loss: float, grad_norm: float, gradients_finite_expected: bool) -> tuple[str, str]:
        """(action, reason). `gradients_finite_expected` is False under fp16 GradScaler, where an
        inf gradient is routine (the scaler skips that step and lowers its scale by itself)."""
        if not gradients_finite_expected and math.isfinite(loss) and not math.isfinite(grad_norm):
            return "apply", ""
        reason = self.detector.check(step, loss, grad_norm)
        if reason is None:
            return "apply", ""
        non_finite = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if self.policy == "warn":
            return ("skip" if non_finite else "apply"), reason
        if self.policy == "rollback" and reason.startswith("plateau"):
            return "stop", reason + " (rolling back cannot cure a plateau)"
        if self.policy == "rollback" and self.rollbacks >= self.max_rollbacks:
            return "stop", f"{reason}; giving up after {self.rollbacks} rollbacks (--max_rollbacks)"
        return self.policy, reason

    def plan_rollback(self, epoch: int, window_start: int) -> None:
        self.rollbacks += 1
        self.lr_scale *= self.lr_factor
        self.skip_windows.add((epoch, window_start))

    def should_skip(self, epoch: int, window_start: int) -> bool:
        return (epoch, window_start) in self.skip_windows


@torch.no_grad()
def validation_loss(model: torch.nn.Module, dataset, batch_size: int, device: torch.device, autocast) -> float:
    """Mean loss per token over the whole validation file; each rank takes every world_size-th sample."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
    indices = list(range(rank, len(dataset), world_size))
    for start in range(0, len(indices), batch_size):
        rows = [dataset[i] for i in indices[start:start + batch_size]]
        input_ids = torch.stack([r[0] for r in rows]).to(device)
        labels = torch.stack([r[1] for r in rows]).to(device)
        with autocast:
            out = model(input_ids, labels=labels, loss_reduction="sum")
        totals[0] += out.loss.double()
        totals[1] += (labels[:, 1:] != -100).sum()
    if dist.is_initialized():
        dist.all_reduce(totals)
    model.train(was_training)
    return (totals[0] / totals[1].clamp(min=1)).item()

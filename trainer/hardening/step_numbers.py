"""A step's numbers on their way to the host, and an optimizer step the device may refuse.

On a GPU the host runs ahead: it queues kernels and the GPU works through them. Reading a number
(`.item()`, `.tolist()`) makes the host wait until the GPU gets there, and then the GPU waits while
the host decides, logs and queues the next step. So the loop never reads a step's numbers right away:

    step N:   forward, backward, clip -> StepNumbers(...)   reduce over ranks, start the copy to the host
              judge step N-1            its numbers arrived long ago: nothing to wait for
              step_unless_refused(...)  AdamW runs, or skips on the device if the guard's rule says so

`StepNumbers` reduces the numbers over ranks in one small all-reduce and copies them into page-locked
("pinned") host memory with `non_blocking=True`: the copy is queued like a kernel, and `read()` waits
only for it (by then usually long done). The refusal is a 0/1 tensor computed on the device
(AnomalyGuard.refusal); fused AdamW takes it as `found_inf` and leaves weights, moments and step count
untouched where it is 1, the mechanism GradScaler uses to skip fp16 steps with inf gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# The order of the values in the reduced and copied vector.
FIELDS = ("loss_sum", "stop", "input_tokens", "save_failed", "tokens", "local_loss_sum", "local_tokens",
          "grad_norm", "refused")


class StepNumbers:
    """One optimizer step's numbers, reduced over ranks and on their way to pinned host memory."""

    _slots: dict[tuple, list[torch.Tensor]] = {}  # two pinned vectors per device: this step's, the last one's

    def __init__(self, loss_sum: torch.Tensor, global_tokens: torch.Tensor, local_tokens: torch.Tensor,
                 grad_norm: torch.Tensor, *, input_tokens: int, stop: bool, save_failed: bool, step: int):
        device = loss_sum.device
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor, the norm of all slices, the same on every rank
            grad_norm = grad_norm.full_tensor()
        flags = torch.tensor([float(stop), float(input_tokens), float(save_failed)], dtype=torch.float64)
        shared = torch.cat([loss_sum.view(1), flags.to(device, non_blocking=True)])  # a copy: loss_sum stays local
        if dist.is_initialized():
            dist.all_reduce(shared)  # loss, stop and failure flags, tokens: the same sums on every rank
        # float64 throughout: the device's refusal and the host's verdict compare the very same values.
        self.values = torch.cat([shared, global_tokens.view(1), loss_sum.view(1), local_tokens.view(1),
                                 grad_norm.detach().double().view(1), torch.zeros(1, dtype=torch.float64,
                                                                                  device=device)])
        self.loss = self.values[0] / self.values[4].clamp(min=1.0)  # the global mean loss, on the device
        self.grad_norm = self.values[7]
        self.device, self.step, self.host = device, step, None

    @classmethod
    def nothing_trained(cls, device: torch.device, step: int, *, stop: bool, save_failed: bool) -> "StepNumbers":
        """The numbers of a step that trained nothing (a window stepped over): NaN loss and norm, but the
        stop and failure flags still go through the all-reduce, so every rank agrees on them."""
        zero, nan = (torch.tensor(value, dtype=torch.float64, device=device) for value in (0.0, float("nan")))
        return cls(nan, zero, zero, nan, input_tokens=0, stop=stop, save_failed=save_failed, step=step)

    def send(self, refusal: torch.Tensor | None = None) -> None:
        """Start the copy to the host (with the device's refusal of this step, if there is one)."""
        if refusal is not None:
            self.values[8] = refusal
        if self.device.type != "cuda":
            self.host = self.values  # already host memory
            return
        key = (self.device.type, self.device.index)
        slots = StepNumbers._slots.setdefault(key, [torch.empty(len(FIELDS), dtype=torch.float64, pin_memory=True)
                                                    for _ in range(2)])
        self.host = slots[self.step % 2].copy_(self.values, non_blocking=True)  # at most two steps in flight
        self.copied = torch.cuda.Event()
        self.copied.record()

    def read(self) -> dict:
        """The numbers as Python values; waits only until the copy has landed."""
        if self.host is None:
            self.send()
        if self.device.type == "cuda":
            self.copied.synchronize()
        v = dict(zip(FIELDS, self.host.tolist()))
        return {"loss": v["loss_sum"] / max(v["tokens"], 1.0), "grad_norm": v["grad_norm"], "stop": v["stop"] > 0,
                "save_failed": v["save_failed"] > 0, "input_tokens": int(v["input_tokens"]),
                "local_loss_sum": v["local_loss_sum"], "local_tokens": int(v["local_tokens"]),
                "refused": v["refused"] > 0}


def step_unless_refused(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, refusal: torch.Tensor) -> None:
    """optimizer.step(), skipped on the device where `refusal` (a 0/1 float tensor) is 1; then the
    scaler's update. Needs an optimizer that reads `found_inf`, as fused AdamW does; no host sync."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise ValueError("step_unless_refused needs an optimizer that can skip on the device (AdamW(fused=True))")
    if scaler.is_enabled():
        # fp16: GradScaler hands its own inf flag to the fused optimizer as found_inf; ours joins it. The
        # scale then backs off on a refused step too, which only a run that stops or rolls back sees.
        for found_inf in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            torch.maximum(found_inf, refusal.to(found_inf.device), out=found_inf)
        scaler.step(optimizer)
    else:
        optimizer.found_inf = refusal.float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    scaler.update()

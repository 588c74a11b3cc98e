"""Saving without stopping: copy the training state to CPU memory, write the files in a thread.

A step takes milliseconds on a GPU, a checkpoint write seconds. So a save is split: the copy blocks
training (into CPU buffers allocated once and reused, pinned on CUDA for full PCIe speed; after it,
training may change the weights in place), the write does not (a thread runs the same function as a
synchronous save, so the format and checkpoint_io's kill -9 guarantees are one piece of code).
At most one save is in flight: the next save and every exit path wait for it. A failed write is kept
and re-raised by `wait()`; the loop checks `failed` at every step so all ranks stop together.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
import torch.distributed as dist

from trainer.checkpoint_io import CheckpointError


class BackgroundSaver:
    """Copies a state to reused CPU buffers, then writes it: in a thread when `background`, else at once."""

    def __init__(self, background: bool, pin_memory: bool):
        self.background, self.pin_memory = background, pin_memory
        self.buffers: dict[str, torch.Tensor] = {}
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def submit(self, state: dict, write: Callable[[dict], None]) -> None:
        """Copy `state` to CPU memory, then `write(copy)` (in the background, after the previous write)."""
        self.wait()  # at most one save in flight: its buffers are about to be reused
        copy = self.snapshot(state)
        if not self.background:
            write(copy)
            return
        self.thread = threading.Thread(target=self._run, args=(write, copy), name="checkpoint-writer", daemon=True)
        self.thread.start()

    def wait(self, raise_error: bool = True) -> None:
        """Block until no write is in flight; raise the error of a write that failed (if `raise_error`)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None and raise_error:
            raise self.error

    def __enter__(self) -> "BackgroundSaver":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error is not None:  # let the write in flight complete; the error at hand is what we report
            self.wait(raise_error=False)

    def _run(self, write: Callable[[dict], None], copy: dict) -> None:
        try:
            write(copy)
        except BaseException as error:  # kept for wait(); the training thread decides what happens
            self.error = error

    def snapshot(self, state):
        """A copy of `state` whose tensors live in this saver's CPU buffers. Tensors that share storage
        (the tied embedding and lm_head) stay shared, so the files still hold them once."""
        copies: dict[tuple, torch.Tensor] = {}
        saw_cuda = [False]

        def copy(value, path: str):
            if isinstance(value, torch.Tensor):
                key = (value.data_ptr(), value.dtype, tuple(value.shape), value.device)
                if key not in copies:
                    saw_cuda[0] |= value.is_cuda
                    copies[key] = self._buffer(path, value).copy_(value.detach(), non_blocking=True)
                return copies[key]
            if isinstance(value, dict):
                return {k: copy(v, f"{path}/{k}") for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(copy(v, f"{path}/{i}") for i, v in enumerate(value))
            return value

        snapshot = copy(state, "")
        if saw_cuda[0]:
            torch.cuda.synchronize()  # the non-blocking copies must land before the writer reads them
        return snapshot

    def _buffer(self, path: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            pinned = self.pin_memory and like.is_cuda
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned)
            self.buffers[path] = buffer
        return buffer


def finish_saves(saver: BackgroundSaver) -> None:
    """Wait for the save in flight; if it failed, every rank raises (rank 0 with the writer's error).
    Call it on every rank: only rank 0 writes, the others learn from it whether that worked."""
    error = None
    try:
        saver.wait()
    except Exception as caught:  # re-raised below, after the other ranks know
        error = caught
    failed = [error is not None]
    if dist.is_initialized():
        dist.broadcast_object_list(failed, src=0)
    if error is not None:
        raise error
    if failed[0]:
        raise CheckpointError("rank 0 could not write the checkpoint (see its error); the previous one is intact")

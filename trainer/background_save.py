"""Saving without stopping: copy the training state to CPU memory, write the files in a thread.

On a GPU a step takes milliseconds and writing a checkpoint takes seconds (hundreds of MB through
torch.save, fsync, hashing). So a save is split in two:

1. `StateSnapshot.take` (blocks training): copy every tensor of the resume state into CPU buffers
   that are allocated once and reused, pinned on CUDA so the copies run at full PCIe speed. After
   it returns, training may change the weights and optimizer moments in place: the copy is ours.
2. `BackgroundSaver.submit` (does not block): a thread writes the files from the copy with the same
   function the synchronous path uses, so the file format and the durability protocol of
   checkpoint_io (temp file, fsync, rename, manifest, link, rotation) are one piece of code.

At most one save is in flight: the next save, the end of training, a stop, a rollback and every
exit path call `wait()` first. `kill -9` during a background write is the same as during a
synchronous one: the new checkpoint is either complete and manifested, or invisible to resume.
A failed write is kept in `error` and re-raised by `wait()`; the loop also checks `failed` at every
step boundary so all ranks stop together with the message.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
import torch.distributed as dist

from trainer.checkpoint_io import CheckpointError


class StateSnapshot:
    """CPU copies of a nested state (dicts, lists, tensors, plain values), reused between saves."""

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, state):
        """A copy of `state` whose tensors live in this snapshot's CPU buffers.

        Tensors that share storage (the tied embedding and lm_head) stay shared in the copy, so the
        files still hold them once.
        """
        copies: dict[tuple, torch.Tensor] = {}
        snapshot = self._copy(state, "", copies)
        if any(key[3].type == "cuda" for key in copies):
            torch.cuda.synchronize()  # the non-blocking copies must land before the writer reads them
        return snapshot

    def _copy(self, value, path: str, copies: dict):
        if isinstance(value, torch.Tensor):
            key = (value.data_ptr(), value.dtype, tuple(value.shape), value.device)
            if key not in copies:
                copies[key] = self._buffer(path, value).copy_(value.detach(), non_blocking=True)
            return copies[key]
        if isinstance(value, dict):
            return {k: self._copy(v, f"{path}/{k}", copies) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(v, f"{path}/{i}", copies) for i, v in enumerate(value))
        return value

    def _buffer(self, path: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu",
                                 pin_memory=self.pin_memory and like.is_cuda)
            self.buffers[path] = buffer
        return buffer


class BackgroundSaver:
    """Runs one write job at a time in a thread; remembers the first failure."""

    def __init__(self, pin_memory: bool):
        self.snapshot = StateSnapshot(pin_memory)  # the CPU buffers the next save copies into
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def submit(self, write: Callable[[], None]) -> None:
        """Start `write()` in the background, after the previous one has finished."""
        self.wait()
        self.thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-writer", daemon=True)
        self.thread.start()

    def wait(self, raise_error: bool = True) -> None:
        """Block until no write is in flight; raise the error of a write that failed (if `raise_error`)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None and raise_error:
            raise self.error

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as error:  # kept for wait(); the training thread decides what happens
            self.error = error


def finish_saves(saver: BackgroundSaver | None) -> None:
    """Wait for the save in flight; if it failed, every rank raises (rank 0 with the writer's error).

    Call it on every rank (`saver` is None except on rank 0 with background saves).
    """
    error = None
    if saver is not None:
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

"""Saving without stopping: copy the training state to CPU memory, write the files in a thread.

A step takes milliseconds on a GPU, a checkpoint write seconds. So a save is split: the copy (into
CPU buffers allocated at the first save and reused, pinned on CUDA for full PCIe speed), then the
write (a thread runs the same function as a synchronous save, so the format and checkpoint_io's
kill -9 guarantees are one piece of code). On CUDA the copy does not stop the host either: it runs on
a side stream from the point the save is called (right after the step it saves), in parallel with the
next step's forward and backward, and the GPU makes the next optimizer step wait for it (an event, on
the device, through a step pre-hook on the optimizer) so no weight changes under the copy.
At most one save is in flight: the next save and every exit path wait for it. A failed write is kept
and re-raised by `wait()`; the loop checks `failed` at every step so all ranks stop together. A run that
lost its directory lock to another run (run_lock.py) fails the same way, with LockLost: it may save no more,
and `wait()` does not wait for a write in flight then (a sharded one may wait for a peer that has left: the
thread is abandoned; it commits nothing, as it checks the lock before every commit).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from trainer.hardening.checkpoint_io import CheckpointError
from trainer.hardening.run_lock import LockLost, lock_lost, lost_on_another_rank

WRITER_GRACE_S = 5.0  # once the lock is lost, how long wait() lets the writer end on its own (it should at once)


class BackgroundSaver:
    """Copies a state to reused CPU buffers, then writes it: in a thread when `background`, else at once.
    It also carries how lm_checkpoint writes: `keep_last` verified checkpoints, `gather_weights` (FSDP:
    write the FP16 out/ file), `hf_tokenizer` (export an HF folder with this tokenizer at every save)."""

    def __init__(self, background: bool, pin_memory: bool, keep_last: int = 2, gather_weights: bool = True,
                 hf_tokenizer: str | None = None, optimizer: torch.optim.Optimizer | None = None):
        self.background, self.pin_memory = background, pin_memory
        self.keep_last, self.gather_weights, self.hf_tokenizer = keep_last, gather_weights, hf_tokenizer
        self.buffers: dict[str, torch.Tensor] = {}
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.copy_stream = torch.cuda.Stream() if pin_memory else None  # the side stream of the copies
        self.copied: torch.cuda.Event | None = None
        # What the save in progress blocked training on so far, in seconds (pop_blocked hands it to the tracker).
        self.blocked: dict[str, float] = {}
        if self.copy_stream is not None and optimizer is not None:
            optimizer.register_step_pre_hook(self._update_waits_for_copies)

    def _update_waits_for_copies(self, optimizer, args, kwargs) -> None:
        if self.copied is not None:  # the GPU waits, not the host; a copy long done costs nothing
            torch.cuda.current_stream().wait_event(self.copied)

    @property
    def failed(self) -> bool:
        """A write failed, or this run lost its directory lock (no file read on most steps: run_lock.py)."""
        if self.error is None:
            self.error = lock_lost()
        return self.error is not None

    def copy(self, state: dict) -> dict:
        """`state` with every tensor copied into this saver's CPU buffers, as it is now (on CUDA: queued on the
        side stream; the next optimizer step waits for it). First waits for the write in flight: its buffers are
        about to be reused (at most one save in flight)."""
        started = time.perf_counter()
        self.wait()
        waited = time.perf_counter()
        snapshot = self.snapshot(state)
        self.blocked.update(wait_s=waited - started, copy_s=time.perf_counter() - waited)
        return snapshot

    def write(self, function: Callable[..., None], *args) -> None:
        """`function(*args)`, a write of what `copy` returned, once the copies have landed: in a thread when
        `background`, else now."""
        started = time.perf_counter()
        self.run(lambda: (self._copies_landed(), function(*args)))
        self.blocked["write_s"] = time.perf_counter() - started  # the whole write, or starting its thread

    def pop_blocked(self) -> dict[str, float]:
        """What the last save blocked training on: waiting for the write before it (`wait_s`), copying the state
        to CPU memory (`copy_s`), writing it now or starting the writer thread (`write_s`); {} for a sharded save."""
        blocked, self.blocked = self.blocked, {}
        return blocked

    def run(self, job: Callable[[], None]) -> None:
        """Run `job`, a write whose data is copied already: in a thread when `background`, else now."""
        self.wait()
        if not self.background:
            job()
            return
        self.thread = threading.Thread(target=self._run, args=(job,), name="checkpoint-writer", daemon=True)
        self.thread.start()

    def wait(self, raise_error: bool = True) -> None:
        """Block until no write is in flight, or until the lock is lost (the write is then abandoned); raise the
        error of a write that failed (if `raise_error`)."""
        lost_at = None
        while self.thread is not None and self.thread.is_alive():
            self.thread.join(0.1)
            if lost_at is None and lock_lost() is not None:
                lost_at = time.monotonic()
            if lost_at is not None and time.monotonic() - lost_at > WRITER_GRACE_S:
                # Its thread may wait in a collective for a rank that has stopped (sharding._seal): a daemon
                # thread, it ends with the process, which exits 4 at once (process_exit.run_script).
                self.error = self.error or lock_lost()
                break
        self.thread = None
        if raise_error and self.failed:
            raise self.error

    def __enter__(self) -> "BackgroundSaver":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error is not None:  # let the write in flight complete; the error at hand is what we report
            self.wait(raise_error=False)

    def _copies_landed(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()  # the host waits for the copies; the training stream did not

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as error:  # kept for wait(); the training thread decides what happens
            # A write that failed because the directory is another run's now (its cleanup removed our temp file:
            # "No such file") says that, not the error it met.
            self.error = error if isinstance(error, LockLost) else lock_lost(read=True) or error

    def snapshot(self, state):
        """A copy of `state` whose tensors live in this saver's CPU buffers. Tensors that share storage
        (the tied embedding and lm_head) stay shared, so the files still hold them once."""
        copies: dict[tuple, torch.Tensor] = {}

        def copy(value, path: str):
            if isinstance(value, torch.Tensor):
                key = (value.data_ptr(), value.dtype, tuple(value.shape), value.device)
                if key not in copies:
                    copies[key] = self._buffer(path, value).copy_(value.detach(), non_blocking=True)
                return copies[key]
            if isinstance(value, dict):
                return {k: copy(v, f"{path}/{k}") for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(copy(v, f"{path}/{i}") for i, v in enumerate(value))
            return value

        if self.copy_stream is None:  # CPU tensors: plain copies, done when copy() returns
            return copy(state, "")
        self.copy_stream.wait_stream(torch.cuda.current_stream())  # the state as the work queued so far leaves it
        with torch.cuda.stream(self.copy_stream):
            snapshot = copy(state, "")
        self.copied = torch.cuda.Event()
        self.copied.record(self.copy_stream)  # the next optimizer step waits for it (_update_waits_for_copies)
        return snapshot

    def _buffer(self, path: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            pinned = self.pin_memory and like.is_cuda
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned)
            self.buffers[path] = buffer
        return buffer


def finish_saves(saver: BackgroundSaver) -> None:
    """Wait for the save in flight; if it failed on any rank, every rank raises (that rank with the writer's
    error; every rank LockLost if a rank lost the directory lock). Call it on every rank: rank 0 writes (every
    rank, for a sharded checkpoint), all learn the outcome."""
    error = None
    try:
        saver.wait()
    except Exception as caught:  # re-raised below, after the other ranks know
        error = caught
    outcome = [(error is not None, isinstance(error, LockLost))]  # (failed, lost the lock)
    if dist.is_initialized():
        outcome = [None] * dist.get_world_size()
        dist.all_gather_object(outcome, (error is not None, isinstance(error, LockLost)))
    lost = [rank for rank, (_, lock_lost_there) in enumerate(outcome) if lock_lost_there]
    if lost and not isinstance(error, LockLost):  # the directory is another run's: every rank stops alike (exit 4)
        raise lost_on_another_rank(lost[0])
    if error is not None:
        raise error
    failed = [rank for rank, (failed_there, _) in enumerate(outcome) if failed_there]
    if failed:
        raise CheckpointError(f"rank {failed[0]} could not write the checkpoint (see its error); the "
                              f"previous one is intact")

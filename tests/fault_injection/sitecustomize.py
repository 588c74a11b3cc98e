"""Slow a training process down from the outside, so a test can signal or kill it at a chosen moment.

The library has no test hooks: a test (or benchmarks/soak_kill.py) puts this directory on the child's
PYTHONPATH, and Python imports `sitecustomize` at start-up. With the variables unset it does nothing.

    FAULT_STEP_DELAY_S  sleep in each optimizer step, once it is taken (`Tracker.step_taken`)
    FAULT_SIGNAL_AT_STEP  SIGTERM to the training process itself once that step is taken, as a scheduler
                        would send it at that moment (once per process)
    FAULT_SIGNAL_RANK   with the above, only this rank signals itself (the others learn it from the vote)
    FAULT_SAVE_DELAY_S  sleep at each stage of a checkpoint save: before the bytes of a file are
                        written (a kill leaves an empty temp file), before a manifest or pointer is
                        written (a history file without manifest), before the written file is checked (no link yet)
    FAULT_DISK_FULL_AT_STEP  writing the history file of that step fails with ENOSPC, as on a full disk: the
                        `.pth`, or DCP's `.distcp` files in a sharded save's `.dcp` folder
    FAULT_DISK_FULL_RANK     with the above, only this rank's writes fail (a sharded save: one node's disk)

The patches are applied when the trainer's modules are imported (the scripts make the repository
importable only after start-up), through an import hook that runs the module, then wraps its functions.
"""

import errno
import functools
import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time

STEP_DELAY = float(os.environ.get("FAULT_STEP_DELAY_S", "0") or 0)
SAVE_DELAY = float(os.environ.get("FAULT_SAVE_DELAY_S", "0") or 0)
DISK_FULL_AT_STEP = os.environ.get("FAULT_DISK_FULL_AT_STEP")
DISK_FULL_RANK = os.environ.get("FAULT_DISK_FULL_RANK")
SIGNAL_AT_STEP = int(os.environ.get("FAULT_SIGNAL_AT_STEP", "0") or 0)
SIGNAL_HERE = os.environ.get("FAULT_SIGNAL_RANK") in (None, os.environ.get("RANK", "0"))


def sleep_before(function, seconds: float):
    @functools.wraps(function)
    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return function(*args, **kwargs)
    return slowed


def sleep_after(function, seconds: float):
    @functools.wraps(function)
    def slowed(*args, **kwargs):
        result = function(*args, **kwargs)
        time.sleep(seconds)
        return result
    return slowed


def patch_tracking(module) -> None:
    step_taken = sleep_after(module.Tracker.step_taken, STEP_DELAY)
    signalled = []

    @functools.wraps(step_taken)
    def step_taken_then_signal(tracker, step, *args, **kwargs):
        step_taken(tracker, step, *args, **kwargs)
        if step == SIGNAL_AT_STEP and SIGNAL_HERE and not signalled:  # before the stop vote of that step
            signalled.append(step)
            os.kill(os.getpid(), signal.SIGTERM)

    module.Tracker.step_taken = step_taken_then_signal


STAGE = SAVE_DELAY / 4
FULL_DISK_NAME = f"step_{int(DISK_FULL_AT_STEP):08d}.pth" if DISK_FULL_AT_STEP else None
FULL_DISK_FOLDER = f"step_{int(DISK_FULL_AT_STEP):08d}.dcp" if DISK_FULL_AT_STEP else None
DISK_IS_FULL_HERE = DISK_FULL_RANK in (None, os.environ.get("RANK", "0"))


def disk_full(file):
    file.write(b"x" * 100)  # some bytes land, then the disk is full
    raise OSError(errno.ENOSPC, "No space left on device (injected)")


def patch_output_paths(module) -> None:
    """Every module that imports atomic_write imports it after this ran: they all get the slowed one."""
    atomic_write = module.atomic_write

    @functools.wraps(atomic_write)
    def slow_atomic_write(path, write, before_rename=None):
        if path.name == FULL_DISK_NAME and DISK_IS_FULL_HERE:
            write = disk_full
        return atomic_write(path, sleep_before(write, STAGE), before_rename)  # the temp file is open and still empty

    module.atomic_write = slow_atomic_write
    module.atomic_write_text = sleep_before(module.atomic_write_text, STAGE)


def patch_checkpoint_io(module) -> None:
    module.check_written = sleep_before(module.check_written, STAGE)


def patch_dcp_files(module) -> None:
    """DCP writes each tensor of a `.distcp` file with `_write_item(transforms, stream, ...)`."""
    write_item = module._write_item

    @functools.wraps(write_item)
    def write_item_on_a_full_disk(transforms, stream, *args, **kwargs):
        if os.path.basename(os.path.dirname(stream.name)) == FULL_DISK_FOLDER and DISK_IS_FULL_HERE:
            disk_full(stream)
        return write_item(transforms, stream, *args, **kwargs)

    module._write_item = write_item_on_a_full_disk


PATCHES = {}
if STEP_DELAY > 0 or SIGNAL_AT_STEP:
    PATCHES["trainer.hardening.tracking"] = patch_tracking
if SAVE_DELAY > 0 or DISK_FULL_AT_STEP:
    PATCHES["output_paths"] = patch_output_paths  # where atomic_write lives (trainer and exports share it)
    PATCHES["trainer.hardening.checkpoint_io"] = patch_checkpoint_io
if DISK_FULL_AT_STEP:
    PATCHES["torch.distributed.checkpoint.filesystem"] = patch_dcp_files


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the modules in PATCHES with the normal finders, and patches them once they have run."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


if PATCHES:
    sys.meta_path.insert(0, PatchAfterImport())

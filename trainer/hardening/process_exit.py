"""How a training process ends: an expected error is one line and exit 2, an anomaly stop exits 3, a
run whose directories another run took over exits 4; under torchrun the process group is torn down
first, and every rank leaves together. Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from dataset.jsonl_file import DataFileError
from output_paths import OutputPathError
from trainer.hardening.anomaly import AnomalyStop
from trainer.hardening.durable_files import CheckpointError
from trainer.hardening.elastic_store import GroupSetupError, setup_failed, setup_lost_its_store
from trainer.hardening.resume_checks import ConfigError
from trainer.hardening.run_lock import LockLost, lock_lost, release_held

# What a user can cause and fix (bad data, a missing file, flags or a checkpoint that do not fit):
# one message and exit code 2, not a traceback. Anything else is a bug and keeps its traceback.
EXPECTED_ERRORS = (FileNotFoundError, DataFileError, ConfigError, CheckpointError, OutputPathError, GroupSetupError)


def run_script(main: Callable[[], None]) -> None:
    """Run `main`; an expected error exits 2 with one line, a stop on an anomaly exits 3, a run whose
    directories another run took over (run_lock.LockLost) exits 4."""
    try:
        main()
        return
    except AnomalyStop as error:
        message, code = f"stopping on anomaly: {error}", 3
    except LockLost as error:
        message, code = f"stopping: {error}", 4
    except EXPECTED_ERRORS as error:
        message, code = f"error: {error}", 2
    except RuntimeError as error:  # a collective broken by a peer that left: because this run lost its lock?
        lost = lock_lost(read=True) if dist.is_initialized() else None
        if lost is None and not setup_lost_its_store(error):
            raise
        message, code = (f"stopping: {lost}", 4) if lost else (f"error: {setup_failed(error)}", 2)
    # Here, outside the except blocks, the traceback (and the DDP model in main's frame) is gone.
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stdout if code == 3 else sys.stderr, flush=True)
    report_to_torchrun(message)
    if code == 2 and dist.is_initialized():  # other ranks may wait in a collective: leave at once
        sys.stdout.flush()
        release_held()  # os._exit skips atexit, where the directory lock is released otherwise
        os._exit(2)
    # An anomaly stop, a lost lock: agreed by all ranks, who leave together. A lost lock may have left a peer
    # waiting where this rank never comes (a save's collective): it is waited for a few seconds only.
    cleanup_distributed(exit_code=code, barrier_timeout_s=LOST_LOCK_BARRIER_S if code == 4 else None)
    sys.exit(code)


def report_to_torchrun(message: str) -> None:
    """Under torchrun, the line goes into this worker's error file too: torchrun's failure summary then shows it
    for each rank that failed, where it said "error_file: <N/A>". Only rank 0 prints it (every rank usually
    meets the same error), so this is where an error that rank 0 did not meet shows its line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torchrun for each worker, per attempt
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)


LOST_LOCK_BARRIER_S = 10.0  # peers that stop on a lost lock arrive within a second or two


def cleanup_distributed(exit_code: int = 0, barrier_timeout_s: float | None = None) -> None:
    """Tear the process group down; under torchrun, then end the process at once with `exit_code`.

    The DDP wrapper must be collected first: its reducer holds gloo/nccl work that aborts the process
    if destroyed after the group. And gloo's C++ threads can abort the interpreter at exit ("terminate
    called without an active exception") after a good run; past the barrier nothing is left to clean.
    """
    gc.collect()
    if not dist.is_initialized():
        return
    met = True
    if barrier_timeout_s is None:
        dist.barrier()
    else:
        try:
            dist.barrier(async_op=True).wait(timeout=timedelta(seconds=barrier_timeout_s))
        except RuntimeError:  # a peer did not come in time, or left: nothing more to agree on with it
            met = False
    if met:  # tearing the group down after a barrier that timed out could wait on the barrier's work
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    release_held()  # the directory lock; os._exit skips atexit
    os._exit(exit_code)

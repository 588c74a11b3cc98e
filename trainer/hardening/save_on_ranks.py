"""Saving on every rank together: what lm_checkpoint (trainer_utils.py) asks of all ranks, before and after.

`gather_rng_states`: every rank's RNG state, in rank order (a resume on the same world size restores each rank's
own: `restore_rng_state`); and whether this run still owns its directories (run_lock.py). `raise_on_every_rank`: a
rank that could not save makes every rank raise, so no rank waits in a collective for a peer that has left.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from trainer.hardening.checkpoint_io import CheckpointError
from trainer.hardening.run_lock import LockLost, lock_lost, lost_on_another_rank


def capture_rng_state() -> dict:
    """Every global RNG of this process (dropout if any; the loader, augmentations have their own): weights_only."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                      "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
            "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64),
                       "gauss_next": py_gauss}}


def restore_rng_state(rng: dict) -> None:
    """Every RNG as capture_rng_state saved it (trainer_utils.restore_training_state, on the same world size)."""
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    n, py = rng["numpy"], rng["python"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))


def gather_rng_states(global_step: int) -> list[dict]:
    """Every rank's RNG state (capture_rng_state), in rank order. Every rank must be saving the same step, and this
    run must still own its directories (each rank reads the lock file it holds or watches now): else every rank
    raises, and nothing is written."""
    lost, rng_state = lock_lost(read=True), capture_rng_state()  # a takeover may be moments old: read it now
    if not dist.is_initialized():
        if lost is not None:
            raise lost
        return [rng_state]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (global_step, rng_state, lost is not None))
    lost_on = [rank for rank, (_, _, lost_there) in enumerate(gathered) if lost_there]
    if lost_on:
        raise lost or lost_on_another_rank(lost_on[0])
    if len({step_of_rank for step_of_rank, _, _ in gathered}) > 1:
        raise CheckpointError(f"the ranks are saving different steps {[s for s, _, _ in gathered]}: a bug; "
                              f"nothing was written (rank {dist.get_rank()} is at {global_step})")
    return [rng for _, rng, _ in gathered]


def raise_on_every_rank(error: BaseException | None) -> None:
    """Every rank stops together if a rank could not save (every rank with LockLost if a rank lost the lock)."""
    if dist.is_initialized():
        outcome = [None] * dist.get_world_size()
        dist.all_gather_object(outcome, (error is not None, isinstance(error, LockLost)))  # (failed, lost the lock)
        lost = [rank for rank, (_, lock_lost_there) in enumerate(outcome) if lock_lost_there]
        if lost and not isinstance(error, LockLost):  # the directory is another run's: every rank stops alike
            raise lost_on_another_rank(lost[0])
        failed = [rank for rank, (failed_there, _) in enumerate(outcome) if failed_there]
        if failed and error is None:
            raise CheckpointError(f"rank {failed[0]} could not save the checkpoint (see its error)")
    if error is not None:
        raise error

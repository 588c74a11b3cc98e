"""Saving on every rank together: lm_checkpoint's save in three calls.

`gather_rng_states`: every rank's RNG state, in rank order (a resume on the same world size restores
each rank's own). `write_checkpoint`: the state handed to the saver, as one file through checkpoint_io,
or, for a sharded (FSDP) model, every rank's slices. `raise_on_every_rank`: a rank that could not save
makes every rank raise, so no rank waits in a collective for a peer that has left.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from trainer.hardening import checkpoint_io, sharding
from trainer.hardening.background_save import BackgroundSaver
from trainer.hardening.checkpoint_io import CheckpointError, RunFiles


def gather_rng_states(global_step: int, rng_state: dict) -> list[dict]:
    """Every rank's RNG state, in rank order; every rank must be saving the same step."""
    if not dist.is_initialized():
        return [rng_state]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (global_step, rng_state))
    if len({step_of_rank for step_of_rank, _ in gathered}) > 1:
        raise CheckpointError(f"the ranks are saving different steps {[s for s, _ in gathered]}: a bug; "
                              f"nothing was written (rank {dist.get_rank()} is at {global_step})")
    return [rng for _, rng in gathered]


def write_checkpoint(files: RunFiles, state: dict, model, optimizer, out_path: Path, info: dict,
                     saver: BackgroundSaver) -> Path:
    """Hand the state to the saver: one file through checkpoint_io, or, for FSDP, every rank's slices."""
    if sharding.is_sharded(model):  # every rank writes its slices, rank 0 the rest (sharding.py)
        return sharding.save_sharded(files, state, model, optimizer, out_path, saver.keep_last, info, saver,
                                     saver.gather_weights)
    saver.submit(state, lambda copy: checkpoint_io.write_checkpoint_files(files, out_path, copy, saver.keep_last,
                                                                         info))
    return files.history_file(info["global_step"])


def raise_on_every_rank(error: BaseException | None) -> None:
    """Every rank stops together if a rank could not save."""
    if dist.is_initialized():
        failed = [None] * dist.get_world_size()
        dist.all_gather_object(failed, error is not None)
        if any(failed) and error is None:
            raise CheckpointError(f"rank {failed.index(True)} could not save the checkpoint (see its error)")
    if error is not None:
        raise error

"""Joining the process group: one process (`python`), or one of many under torchrun, which sets RANK,
LOCAL_RANK and WORLD_SIZE. nccl between GPUs, gloo between CPU ranks; the store is narrowed to this start of
the group (elastic_store.py), so a group restarted by torchrun never reads what the one before it left."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from trainer.hardening.elastic_store import attempt_store, setup_timeout
from trainer.hardening.launcher_watch import exit_with_the_launcher


class DistInfo(NamedTuple):
    """Where this process stands in the run: its rank, its GPU on the node, the number of ranks, its device."""
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_flag: str) -> DistInfo:
    """One process (`python`) or one of many (`torchrun` sets RANK/WORLD_SIZE): nccl on CUDA, gloo on CPU."""
    if "RANK" not in os.environ:
        return DistInfo(0, 0, 1, torch.device(device_flag))
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    exit_with_the_launcher()  # a worker outliving a killed torchrun would hold the run's directories
    # torchrun hands a restarted group the store of the group before it: keys of this attempt only.
    store = attempt_store(rank, world_size, timeout=setup_timeout())
    if device_flag.startswith("cuda"):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return DistInfo(rank, local_rank, world_size, device)

"""Each start of the worker group gets keys of its own in torchrun's store, so a group restarted by
`torchrun --max-restarts N` never reads what the group before it left there.

torchrun keeps one TCPStore for the life of the launcher (`--standalone`, `--rdzv-backend c10d`, and
`--master_addr/--master_port` alike) and hands it to every group it starts, and `init_process_group`
writes each rank's gloo address (or NCCL id) under the same keys every time. A restarted rank that
reads its peer's entry before the peer rewrote it gets the dead group's address: gloo then fails with
"connectFullMesh ... Connection refused", or both ranks wait in gloo's connect for good (a process
group timeout of 10 s did not end it; it was still waiting at 50 s). TORCHELASTIC_RESTART_COUNT cannot
name the attempt: every node's launcher counts only its own restarts, and a node restarted because
another node's worker died does not count it (pytorch/pytorch#108158, #135712).

So rank 0 names this attempt with a random token and publishes it; every other rank proves that the
token it read is the current one by a round trip with the rank 0 that wrote it (a dead rank 0 never
answers), and every rank then keeps its keys under that token. This relies on what torchrun does on
one node and with the c10d rendezvous on many: every worker of the old group is stopped before any
worker of the new group starts. (With --master_addr/--master_port on several nodes, each node restarts
on its own; use the c10d rendezvous there.)
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from datetime import timedelta

import torch.distributed as dist

ATTEMPT_KEY = "tiny_llm/attempt"  # rank 0's token of the current attempt (an older one until it writes)
ANSWER_WAIT_S = 2.0  # how long a rank waits for rank 0's answer before it reads the token again


class GroupSetupError(RuntimeError):
    """The ranks did not find each other in time: torchrun's store is gone (its launcher was killed) or a rank
    never came. One line naming the rank (exit 2, process_exit.py), not a traceback."""


def setup_timeout() -> timedelta:
    """How long a starting rank waits for torchrun's store and for the other ranks: 10 minutes, or
    TRAINER_SETUP_TIMEOUT_S seconds (the tests use a few)."""
    return timedelta(seconds=float(os.environ.get("TRAINER_SETUP_TIMEOUT_S", 600)))


def attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The store that `init_process_group` would use (MASTER_ADDR/MASTER_PORT), narrowed to this attempt's keys.

    Raises GroupSetupError, in one line, when the ranks have not found each other within `timeout`.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # else this rank serves the store
        wait_for_store(rank, deadline)
    try:
        return _attempt_store(rank, world_size, deadline)
    except dist.DistError as error:  # the store went away, or an answer did not come within the deadline
        raise setup_failed(error) from None


def setup_lost_its_store(error: BaseException) -> bool:
    """Whether `error` is torchrun's store lost while the process group was being set up (init_process_group
    reads the peers' addresses there): a DistNetworkError before the group exists."""
    return isinstance(error, dist.DistNetworkError) and not dist.is_initialized()


def setup_failed(error: BaseException) -> GroupSetupError:
    """The one line for a store error while setting up the group, naming this rank."""
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return GroupSetupError(f"rank {os.environ.get('RANK', 0)}: gave up setting up the process group: {cause} (was "
                           f"torchrun killed? this process is left without its launcher)")


def wait_for_store(rank: int, deadline: float) -> None:
    """Wait until torchrun's store (MASTER_ADDR:MASTER_PORT) takes a connection, or raise GroupSetupError at
    `deadline`. torch's own client would wait twice its timeout where nobody listens (it tries again once:
    20 minutes for 10) and print a C++ stack each time; a worker whose torchrun was killed ends here instead."""
    address = (os.environ.get("MASTER_ADDR", "localhost"), int(os.environ.get("MASTER_PORT", 29500)))
    while True:
        try:
            socket.create_connection(address, timeout=1.0).close()
            return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise GroupSetupError(f"rank {rank}: torchrun's store at {address[0]}:{address[1]} did not answer "
                                      f"({error.strerror or error}); stopping (was torchrun killed? this process is "
                                      f"left without its launcher)") from None
            time.sleep(0.5)


def _attempt_store(rank: int, world_size: int, deadline: float) -> dist.Store:
    timeout = timedelta(seconds=max(deadline - time.monotonic(), 1.0))
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    if rank == 0:
        attempt = secrets.token_hex(8)
        store.set(ATTEMPT_KEY, attempt)
        for other in range(1, world_size):  # answer each rank with the nonce it sent under this token
            hello = f"{attempt}/hello/{other}"
            store.wait([hello], timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
            store.set(f"{attempt}/welcome/{other}", store.get(hello))
        return dist.PrefixStore(attempt, store)
    nonce = secrets.token_hex(8).encode()  # this process's own: no older process can have been answered with it
    while True:
        attempt = store.get(ATTEMPT_KEY).decode()  # waits for the key; may be a dead group's token
        store.set(f"{attempt}/hello/{rank}", nonce)
        welcome, answer_by = f"{attempt}/welcome/{rank}", time.monotonic() + ANSWER_WAIT_S
        while time.monotonic() < answer_by:
            if store.check([welcome]) and store.get(welcome) == nonce:
                return dist.PrefixStore(attempt, store)
            time.sleep(0.05)
        if time.monotonic() > deadline:
            raise GroupSetupError(f"rank {rank}: rank 0 did not answer before the setup timeout (last token read: "
                                  f"{attempt}); is rank 0 running?")

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

import secrets
import time
from datetime import timedelta

import torch.distributed as dist

ATTEMPT_KEY = "tiny_llm/attempt"  # rank 0's token of the current attempt (an older one until it writes)
ANSWER_WAIT_S = 2.0  # how long a rank waits for rank 0's answer before it reads the token again


def attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The store that `init_process_group` would use (MASTER_ADDR/MASTER_PORT), narrowed to this attempt's keys.

    Raises TimeoutError when the ranks have not found each other within `timeout`.
    """
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    deadline = time.monotonic() + timeout.total_seconds()
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
            raise TimeoutError(f"rank {rank}: rank 0 did not answer within {timeout.total_seconds():.0f} s "
                               f"(last token read: {attempt}); is rank 0 running?")

"""A torchrun worker whose torchrun is gone exits within a second, saving nothing.

torchrun killed alone (kill -9, an OOM killer, a lost terminal of a foreground job) left its workers training on:
their gloo/nccl links need no launcher once the group is up. Nobody would ever collect their exit codes, and they
held the run's directories (run_lock.py, writer_lock.py) for as long as they lived. So under torchrun a thread
compares the process's parent with the one it started under: once torchrun has died, the worker has a new parent
(init, or a subreaper), and it leaves with os._exit. Nothing is saved: the newest checkpoint on disk is complete
(checkpoints are written to a temp file and renamed), a save in flight leaves only a temp file, removed by the next
start, and `--from_resume 1` continues from that checkpoint.

Why polling getppid, and not prctl(PR_SET_PDEATHSIG): that signal fires when the parent *thread* that forked the
worker ends, not its process, so a launcher that starts workers from a short-lived thread would kill them at
once; it is Linux only; and it cannot be set before the fork from inside the worker, so a launcher dying first is
missed anyway (then getppid must be checked all the same). PyTorch's own DataLoader workers watch their parent
the same way (torch.utils.data._utils.worker.ManagerWatchdog).
"""

from __future__ import annotations

import os
import sys
import threading
import time

POLL_S = 0.5  # how often the parent is looked at: a system call, twice a second
LAUNCHER_GONE_EXIT = 1


def exit_with_the_launcher() -> None:
    """Under torchrun (which sets TORCHELASTIC_RUN_ID for its workers), leave once torchrun is gone. A run started
    with plain `python` is left alone: it may outlive its shell on purpose (nohup, a detached job)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()
    threading.Thread(target=_watch, args=(launcher,), name="launcher-watch", daemon=True).start()


def _watch(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(POLL_S)
    rank = os.environ.get("RANK", "?")
    print(f"stopping: rank {rank}: torchrun (pid {launcher}) is gone; this worker exits without saving; the newest "
          f"checkpoint is complete: continue with --from_resume 1", file=sys.stderr, flush=True)
    # os._exit, from this thread: the main thread may wait in a collective for a peer that will never come. The
    # directory lock is not released here (its file would have to be read, on a filesystem that may hang): the next
    # run takes it over, its holder being gone, once no process of this run holds its kernel lock.
    os._exit(LAUNCHER_GONE_EXIT)

"""Every process of a run holds a shared kernel lock in each directory the run writes, for as long as it lives:

    {checkpoint_dir}/trainer.writers.lock    (and in --save_dir / --metrics_dir: wherever run_lock.py locks)

The lock file (run_lock.py) names one process, rank 0; a run has more. When torchrun alone was killed, rank 0 could
be gone while rank 1 still wrote, and a new run took the directory over from the dead pid. So each rank also takes
a shared lock here, and a starter that would take over a lock whose holder is gone first asks the kernel for this
one exclusively: while any process of the old run lives, it is refused; once the last one ended, the kernel has
dropped its lock (kill -9 included), so nothing here is ever stale.

POSIX record locks (fcntl.lockf), not flock: they belong to the process, so the DataLoader workers and other
children a rank forks do not hold them after it died (flock's belong to the open file, which a fork shares), and
they are the locks NFS carries between nodes. The file is empty and stays: removing it while a starter has it
open would let two runs lock two different files of one name.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path

from trainer.hardening.resume_checks import ConfigError

WRITERS_NAME = "trainer.writers.lock"
# What a filesystem without locks answers (some network filesystems): said once, never taken for "free".
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
SHARE_WAIT_S = 10.0  # the longest a rank waits for a starter's exclusive check to end


class WritersLock:
    """This process's shared lock on `{directory}/trainer.writers.lock`, held until `close` (or the process ends)."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / WRITERS_NAME
        self.unsupported: str | None = None  # why this filesystem takes no lock, once seen
        # O_NOFOLLOW: never through a link; O_NONBLOCK: a FIFO there is not waited on (then refused below)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            self.close()
            raise ConfigError(f"{self.path} is not a regular file, not a lock file of this trainer; move it away")

    def only_we_hold_it(self) -> bool:
        """Take the lock exclusively if no other process holds it (True), else False. A filesystem without locks
        gives True, and `unsupported` says why (the caller logs it)."""
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EAGAIN):  # POSIX allows either for "held by another process"
                return False
            if error.errno not in NO_LOCKS:
                raise
            self.unsupported = f"{self.path}: this filesystem takes no lock ({os.strerror(error.errno)})"
            return True

    def share(self) -> None:
        """Hold the lock shared from now on (an exclusive one of ours becomes shared at once)."""
        deadline = time.monotonic() + SHARE_WAIT_S
        while True:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except OSError as error:
                if error.errno in (errno.EACCES, errno.EAGAIN) and time.monotonic() < deadline:
                    time.sleep(0.05)  # only a starter's check holds it exclusively, for a moment: not a blocking
                    continue          # lockf, which would wait for ever on a starter frozen in that moment
                if error.errno in (errno.EACCES, errno.EAGAIN):
                    raise ConfigError(f"{self.path} is held exclusively by another trainer starting now; start this "
                                      f"one again once that one has started or given up") from None
                if error.errno not in NO_LOCKS:
                    raise
                self.unsupported = f"{self.path}: this filesystem takes no lock ({os.strerror(error.errno)})"
                return

    def close(self) -> None:
        """Drop the lock (closing the file does: POSIX locks go with the process's last close of the file)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

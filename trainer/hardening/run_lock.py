"""One run owns its directories: a lock file with a heartbeat, taken over only from a holder that is gone.

    {checkpoint_dir}/trainer.lock    (and in --save_dir / --metrics_dir when those are other directories)
    {"host": ..., "pid": ..., "pid_start": ..., "started": ..., "command": ..., "job_id": ...,
     "heartbeat": ..., "token": ...}

Rank 0 creates the lock with O_CREAT | O_EXCL, so of two trainers started at once exactly one gets it; the
other is refused with one line naming the holder. A lock left behind (kill -9, a crashed node) is taken over,
and the log says so, only when its holder is provably gone:

- on this host, its pid is not alive (or is alive with another start time: the pid was reused), as after
  a torchrun restart or a Ctrl-C'd run's crash;
- on another host (a requeue on a new node), it carries the same job identity (--run_id, SLURM_JOB_ID or
  torchrun's --rdzv-id) and its heartbeat is stale. A fresh heartbeat with our job id is waited out, up to
  STALE_AFTER_S: the previous attempt died moments ago.

The lock file names rank 0 only; every process of the run also holds a shared kernel lock in each directory
(writer_lock.py), so a holder "gone" on this host is taken over only once no process of its run is left (torchrun
killed alone left rank 1 writing while its rank 0 was gone), and a lock file removed while such a process lives
does not let a second run in either. A thread rewrites the heartbeat every HEARTBEAT_S seconds; the lock is
released at exit. Holding it, rank 0 clears
killed writes' temp files and checks nothing obstructs the checkpoint paths; every rank checks it sees that lock
(all nodes must share the checkpoint directory).

A run can lose its lock: paused (SIGSTOP, a frozen node) until its heartbeat went stale, and its job requeued
meanwhile took the directory over; or the file was removed by hand. From the moment it sees that (`lock_lost`),
it writes nothing more there: the saver refuses (background_save.py) and a save in flight commits nothing, the
metrics and status files and the trace are left alone, and every rank raises LockLost at the same step; the run
exits 4 with one line naming the new holder. The lock is checked before every write, and costs one `os.stat`:
the lock file's identity (device, inode, mtime, size) is compared with the one this run last read and found its
own. A removed lock is seen at once (a second run may take the directory at once: it needs no stale heartbeat),
and so is a replaced or rewritten one (a takeover links a new file; then the file is read). The file is also read
once the last heartbeat seen is half STALE_AFTER_S old (a network filesystem may cache what stat says), and by
a save, right before each step of its commit (out/ file, manifest, latest pointer).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shlex
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from output_paths import OutputPathError, create_new, output_problem
from trainer.hardening.checkpoint_io import CheckpointError, RunFiles, atomic_write_text
from trainer.hardening.directory_checks import check_no_obstructions, remove_stale_temp_files, set_aside_earlier_run
from trainer.hardening.resume_checks import ConfigError
from trainer.hardening.writer_lock import WritersLock

LOCK_NAME = "trainer.lock"
HEARTBEAT_S = float(os.environ.get("TRAINER_HEARTBEAT_S", 15))  # tests shorten it
STALE_AFTER_S = 4 * HEARTBEAT_S  # four missed beats: the holder is gone (or frozen)
OWN_TEMP = re.compile(r"^(trainer\.lock|.+_status\.json|.+_metrics\.jsonl)\.partial-.+\.tmp$")  # killed writes


def read_lock(path: Path) -> dict | None:
    """The holder's record, or None when there is no lock. A lock that is not ours to parse is an error."""
    return read_lock_and_identity(path)[0]


def identity(status: os.stat_result) -> tuple:
    """What changes when a file is removed and created again, replaced, or rewritten in place."""
    return status.st_dev, status.st_ino, status.st_mtime_ns, status.st_size


def read_lock_and_identity(path: Path) -> tuple[dict | None, tuple | None]:
    """read_lock, and the identity of the very file read (fstat of the open file: no race with a rename)."""
    problem = output_problem(Path(path), appended=False)  # lstat first: reading a FIFO would wait for a writer
    if problem is not None:
        raise ConfigError(f"{path} {problem}, not a lock file of this trainer; move it away")
    try:
        with open(path, encoding="utf-8") as f:
            seen, text = identity(os.fstat(f.fileno())), f.read()
    except FileNotFoundError:
        return None, None
    try:
        holder = json.loads(text)
        if not isinstance(holder, dict) or not {"host", "pid", "token"} <= set(holder):
            raise ValueError("missing host, pid or token")
    except ValueError as error:
        raise ConfigError(f"{path} is not a lock file of this trainer ({error}); if no trainer uses this "
                          f"directory, remove it") from error
    return holder, seen


def process_start(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (/proc/PID/stat field 22), None without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # after "pid (comm)": state is field 3, starttime field 22


def pid_alive(pid: int, pid_start: str | None) -> bool:
    """Is the process `pid` of this host still the one that wrote the lock?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): os.kill is all we know
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie: dead, not yet reaped
        return False
    return pid_start is None or fields[19] == pid_start


def describe(holder: dict) -> str:
    beat = holder.get("heartbeat")
    age = f"{time.time() - beat:.0f} s ago" if isinstance(beat, (int, float)) else "never"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return (f"pid {holder['pid']} on {holder['host']}, started {started}, last heartbeat {age}, "
            f"job id {holder.get('job_id')}, command: {holder.get('command', '?')}")


def job_identity(run_id: str | None) -> str | None:
    """What names this job across restarts and requeues; None when nothing does."""
    if run_id:
        return f"run:{run_id}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{os.environ['SLURM_JOB_ID']}"
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"torchrun:{rdzv}" if rdzv and rdzv != "none" else None  # "none": torchrun's default, names nothing


class LockLost(Exception):
    """This run's directory lock now names another run, or is gone: the run writes nothing more there and exits
    4 (trainer_utils.run_script), every rank at the same step."""


class DirectoryLock:
    """The lock of one directory, held by this process until `release` (or watched: see claim_run_directories)."""

    def __init__(self, directory: Path, job_id: str | None, log: Callable[[str], None]):
        self.path, self.log = Path(directory) / LOCK_NAME, log
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": process_start(os.getpid()),
                       "started": time.time(), "command": shlex.join(sys.argv), "job_id": job_id,
                       "heartbeat": time.time(), "token": secrets.token_hex(8)}
        self.held = False
        self.fresh_until = 0.0  # read the file again from this time on, whatever stat says (module docstring)
        self.seen: tuple | None = None  # the identity of the lock file last read and found ours
        self.why_lost: str | None = None  # once the lock is seen lost: the line that says so
        self._beat_or_release = threading.Lock()  # else a beat could write the lock back after the release
        self.writers: WritersLock | None = None  # this process's shared kernel lock in the directory, once acquired
        self.took_over_remote = False  # from a frozen node (same job id, stale heartbeat): it may still hold one

    def acquire(self) -> None:
        self.writers = WritersLock(self.path.parent)
        try:
            self._acquire()
            self.writers.share()
        except BaseException:
            self.release()  # the lock file, if this process made it, and the kernel lock
            raise
        if self.writers.unsupported:
            self.log(f"WARNING: {self.writers.unsupported}: a second trainer is refused only while this run's rank 0 "
                     f"lives, not while its other ranks do")

    def _acquire(self) -> None:
        deadline = time.monotonic() + STALE_AFTER_S + 2 * HEARTBEAT_S  # the longest we wait for a stale beat
        while True:
            if time.monotonic() > deadline:  # other starters kept winning or moving it: do not loop for ever
                raise ConfigError(f"could not take {self.path} within {STALE_AFTER_S + 2 * HEARTBEAT_S:.0f} s; "
                                  f"is another trainer starting on {self.path.parent}?")
            # The record goes into a temp file first and is then linked to the lock's name: os.link fails if
            # the name exists (like O_EXCL), and a kill at any instant leaves no empty, unreadable lock.
            tmp = self.path.with_name(f"{LOCK_NAME}.partial-{self.record['host']}-{os.getpid()}.tmp")
            self.record["heartbeat"] = time.time()  # not the time we began waiting: a fresh lock from the start
            tmp.unlink(missing_ok=True)  # our name (host, pid): only a killed process that had our pid leaves one
            with open(create_new(tmp), "w", encoding="utf-8") as f:
                f.write(json.dumps(self.record) + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                tmp.unlink()
                holder = read_lock(self.path)
                if holder is None:
                    continue  # released between our two calls: try again
                wait = self._why_gone(holder)
                if wait is None:
                    raise ConfigError(f"{self.path.parent} is in use by another trainer ({describe(holder)}). "
                                      f"Use another --checkpoint_dir/--save_dir, or stop that run first")
                if wait > 0:
                    if time.monotonic() + wait > deadline:
                        raise ConfigError(f"{self.path.parent}: the lock of this job's previous attempt "
                                          f"({describe(holder)}) is still beating; is it still running?")
                    self.log(f"{self.path}: waiting {wait:.0f} s for the heartbeat of this job's previous "
                             f"attempt ({describe(holder)}) to go stale")
                    time.sleep(wait)
                    continue
                self._remove_if_unchanged(holder)
                continue
            tmp.unlink()
            if not self.took_over_remote and not self.writers.only_we_hold_it():  # the lock file was removed
                self.path.unlink()  # ours, made a moment ago: nothing watches it yet
                raise ConfigError(self._still_written(None))
            self.held = True
            self._still_ours()  # its identity, for `lost`
            return

    def _why_gone(self, holder: dict) -> float | None:
        """0: the holder is gone, take over; > 0: seconds to wait for its heartbeat to go stale; None: refuse."""
        if holder["host"] == self.record["host"]:
            if not pid_alive(int(holder["pid"]), holder.get("pid_start")):
                if not self.writers.only_we_hold_it():  # rank 0 is gone, not every process of its run
                    raise ConfigError(self._still_written(holder))
                self.log(f"taking over {self.path}: its holder is gone ({describe(holder)}; not alive on this host)")
                return 0.0
            return None
        if self.record["job_id"] is not None and holder.get("job_id") == self.record["job_id"]:
            age = time.time() - float(holder.get("heartbeat", 0))
            if age >= STALE_AFTER_S:
                self.log(f"taking over {self.path}: same job id, heartbeat stale ({describe(holder)})")
                self.took_over_remote = True  # a frozen holder's ranks may hold their kernel lock: it stops at a step
                return 0.0
            return STALE_AFTER_S - age + 0.1
        return None

    def _still_written(self, holder: dict | None) -> str:
        gone = f"the lock's holder is gone ({describe(holder)}), but " if holder else ""
        return (f"{self.path.parent} is in use by another trainer: {gone}a process of that run still holds "
                f"{self.writers.path} (a rank whose torchrun was killed exits within seconds). Start this run once it "
                f"has exited (fuser -v {self.writers.path} names it), or use another --checkpoint_dir/--save_dir")

    def _remove_if_unchanged(self, holder: dict) -> None:
        """Remove the lock we judged, not a newer one another starter wrote in the meantime."""
        aside = self.path.with_name(f"{LOCK_NAME}.partial-takeover-{self.record['token']}.tmp")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else removed it first; the O_EXCL create decides who gets it
        moved = read_lock(aside)
        if moved is not None and moved["token"] != holder["token"]:  # a fresh lock: put it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass  # a third starter created one meanwhile; theirs stands, the create below fails
        aside.unlink()

    def beat(self) -> None:
        """Rewrite the heartbeat while the lock is ours; once it is not, write nothing (`lost` says why)."""
        with self._beat_or_release:
            if self.why_lost is not None or not self.held:
                return
            record = {**self.record, "heartbeat": time.time()}
            if not self._still_ours():
                return
            # No compare-and-swap on files: the rename checks that the file is still the one just read (a pause
            # there, then a takeover, must not write over the new holder's lock); a takeover within the
            # microseconds between that check and the rename is written over, and its holder then stops.
            try:
                atomic_write_text(self.path, json.dumps(record) + "\n", self._raise_if_changed)
            except LockLost:
                self._still_ours()  # says whose it is now
                return
            self.record = record
            self._still_ours()  # the new file's identity (a step may read it first: then it is already known)

    def _raise_if_changed(self) -> None:
        try:
            now = identity(os.stat(self.path))
        except FileNotFoundError:
            now = None
        if now != self.seen:
            raise LockLost(f"{self.path} changed")

    def lost(self, read: bool = False) -> str | None:
        """None while the lock is this run's; else the line that says whose it is now. One os.stat: the file is
        read only when it is gone or changed since last read, with `read`, or once the last heartbeat seen is
        half STALE_AFTER_S old."""
        if self.why_lost is not None:
            return self.why_lost
        try:
            changed = read or time.time() >= self.fresh_until or identity(os.stat(self.path)) != self.seen
        except FileNotFoundError:
            changed = True  # removed: no stale heartbeat is needed for another run to create it anew
        except OSError:  # unreadable for now (a network filesystem's hiccup) is no sign of a takeover
            changed = False
        if changed:
            try:
                self._still_ours()
            except OSError:
                pass
        return self.why_lost

    def _still_ours(self) -> bool:
        """Read the lock file: True if it still carries our token (then no takeover is possible until its
        heartbeat ages); else remember that the lock is lost, and why, for good."""
        directory = self.path.parent
        try:
            holder, seen = read_lock_and_identity(self.path)
        except ConfigError as error:
            self.why_lost = f"lost {directory}: {error}"
        else:
            if holder is not None and holder["token"] == self.record["token"]:
                self.seen, self.fresh_until = seen, float(holder.get("heartbeat", 0)) + STALE_AFTER_S / 2
                return True
            self.why_lost = (
                f"lost {directory}: {self.path} was removed while this run held it; this run wrote nothing more "
                f"there. If no other trainer uses {directory}, continue with --from_resume 1" if holder is None else
                f"lost {directory}: {self.path} now names another trainer ({describe(holder)}), which took the "
                f"directory over after this run's heartbeat went stale (a paused process, a frozen node) or the "
                f"lock was removed. This run wrote nothing more there")
        self.held = False
        return False

    def release(self) -> None:
        with self._beat_or_release:
            if self.held:
                self.held = False
                holder = read_lock(self.path)
                if holder is not None and holder["token"] == self.record["token"]:
                    self.path.unlink()
            if self.writers is not None:  # after the lock file: a starter then finds neither
                self.writers.close()


_held: list[DirectoryLock] = []  # rank 0's locks: beaten by a thread, released at exit
_watched: list[DirectoryLock] = []  # on the other ranks, rank 0's lock of the checkpoint directory: only read
_sharing: list[WritersLock] = []  # on the other ranks, their shared kernel lock in each directory (writer_lock.py)
_stop_beating = threading.Event()


def lock_lost(read: bool = False) -> LockLost | None:
    """LockLost, saying whose the directory is now, if this run lost a lock it holds or watches; else None.
    Cheap enough for every write: an os.stat per lock; a file is read with `read` or as DirectoryLock.lost says."""
    for lock in _held + _watched:
        why = lock.lost(read)
        if why is not None:
            return LockLost(why)
    return None


def raise_if_lock_lost(read: bool = True) -> None:
    """Right before a save commits a file (an out/ file, a manifest, the latest pointer): the lock file is read.
    Without `read`, one os.stat (lock_lost): before the status file's rename, at every step and beat."""
    lost = lock_lost(read)
    if lost is not None:
        raise lost


def lost_on_another_rank(rank: int) -> LockLost:
    """What a rank raises when rank `rank` lost the lock: its own reading if it sees that too (rank 0's names
    the new holder), else a line naming that rank."""
    return lock_lost(read=True) or LockLost(f"rank {rank} found this run's directory lock taken over or removed")


def release_held() -> None:
    """Release this process's locks (at exit; also called before os._exit, which skips atexit)."""
    _stop_beating.set()
    _watched.clear()
    while _sharing:
        _sharing.pop().close()
    while _held:
        _held.pop().release()


atexit.register(release_held)


def _heartbeat_loop() -> None:
    while not _stop_beating.wait(HEARTBEAT_S):
        for lock in list(_held):
            try:
                lock.beat()
            except OSError as error:  # a full disk: say so, the next beat tries again
                lock.log(f"WARNING: could not write the heartbeat of {lock.path}: {error}")


def claim_run_directories(args, run_name: str, log: Callable[[str], None]) -> None:
    """Rank 0 locks the run's directories (checkpoint dir first), clears killed writes' temp files and checks
    the checkpoint paths; then every rank checks that it sees rank 0's lock. Raises ConfigError on every rank."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    directories = [args.checkpoint_dir, args.save_dir, args.metrics_dir or args.save_dir]
    unique = list(dict.fromkeys(Path(d).resolve() for d in directories))
    outcome = [None, None]  # rank 0's error, or the token of its lock
    if rank == 0:
        try:
            for directory in unique:
                directory.mkdir(parents=True, exist_ok=True)
                lock = DirectoryLock(directory, job_identity(args.run_id), log)
                lock.acquire()
                _held.append(lock)
            files, out_path = RunFiles(unique[0], run_name), Path(args.save_dir) / f"{run_name}.pth"
            remove_stale_temp_files(files, out_path.parent, log)  # holding the lock: no writer is mid-write
            for directory in unique:  # and the lock's and the status files' own temp files
                for leftover in directory.glob("*.partial-*.tmp"):
                    if OWN_TEMP.match(leftover.name):
                        leftover.unlink()
                        log(f"removed {leftover}, left by a write that was killed")
            if not (args.from_resume or getattr(args, "resume_path", None)):
                set_aside_earlier_run(files, log)  # their saves would overwrite its files; its resume, continue it
            check_no_obstructions(files, out_path)
            outcome[1] = _held[0].record["token"]
            _stop_beating.clear()  # set by an earlier release in this process, if any
            threading.Thread(target=_heartbeat_loop, name="lock-heartbeat", daemon=True).start()
        except (ConfigError, CheckpointError, OutputPathError, OSError) as error:
            release_held()
            outcome[0] = f"cannot claim {unique[0]}: {error}" if isinstance(error, OSError) else str(error)
    if world_size > 1:  # every rank learns rank 0's outcome, so none waits for a collective that never comes
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise ConfigError(outcome[0])
    seen = read_lock_or_none(unique[0] / LOCK_NAME)
    if world_size > 1:
        everyone = [None] * world_size
        dist.all_gather_object(everyone, (seen is not None and seen["token"] == outcome[1], socket.gethostname()))
        blind = [f"rank {r} on {host}" for r, (sees, host) in enumerate(everyone) if not sees]
        if blind:
            raise ConfigError(f"{', '.join(blind)} cannot see the lock rank 0 wrote in {unique[0]}: every node "
                              f"must see the same checkpoint directory (a shared filesystem such as NFS)")
    if rank != 0:  # rank 0 holds the lock; this rank watches it, so it too stops writing once it is lost
        watched = DirectoryLock(unique[0], None, log)
        watched.record = seen
        watched._still_ours()  # the identity of the file it watches
        _watched.append(watched)
        for directory in unique:  # a writer too: while it lives, no other run takes these directories
            _sharing.append(WritersLock(directory))
            _sharing[-1].share()


def read_lock_or_none(path: Path) -> dict | None:
    try:
        return read_lock(path)
    except (ConfigError, OSError):
        return None

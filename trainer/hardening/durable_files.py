"""Durable files, one at a time: the primitives every checkpoint is built from.

A file is written under a temp name of its own (`NAME.partial-HOST-PID-TID.tmp`), flushed, fsynced, renamed
over its real name and its directory fsynced, hashing the bytes as they pass: a kill at any instant leaves
either the old file or the new one, never half of one. A manifest (JSON beside the checkpoint, named after
it: `step_00000300.pth.json`) records the size and SHA-256 of those bytes; a hash is remembered per process
by (path, inode, size, mtime_ns), so a kept file is read once, not at every save. Loading is torch.load
with weights_only=True, always.

Every path the trainer writes is looked at (lstat) before it is opened (output_problem): a folder, FIFO or
device there is refused in one line (exit 2), and so is a symbolic link where a file is appended to (the
metrics file, the trace: open_to_append); a file replaced by a rename replaces a link, never follows it.

checkpoint_io.py (single-file checkpoints, rotation, fallback) and sharded_checkpoint.py (the folders of
--parallel fsdp) build on this module; it imports nothing of theirs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import socket
import stat
import threading
from pathlib import Path
from typing import Any, Callable

import torch

TEMP_TAIL = r"(?:\.partial-[A-Za-z0-9._-]+)?\.tmp"  # see temp_path; a bare `NAME.tmp` is an earlier version's

hashes_computed = 0  # files read in full to hash them, in this process: tests check rotation does not repeat it
_known_hashes: dict[str, tuple[tuple[int, int, int], str]] = {}  # path -> ((inode, size, mtime_ns), sha256)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none could be trusted for loading."""


class OutputPathError(CheckpointError):
    """Something other than a file of this run stands where the trainer writes one (one line, exit 2)."""


def output_problem(path: Path, appended: bool) -> str | None:
    """What stands at `path` that the trainer must not write into, in words ("is a FIFO"), or None: nothing, or a
    regular file. A symbolic link is a problem only for a file the trainer appends to (`appended`): a write
    through it would land in the file it points to. A file replaced atomically (atomic_write) may be a link:
    the rename replaces the link itself and never follows it. lstat, not open: a FIFO is never opened here,
    so the check cannot block."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode) or (stat.S_ISLNK(mode) and not appended):
        return None
    if stat.S_ISLNK(mode):
        return f"is a symbolic link (to {os.readlink(path)}): appending through it would write into that file"
    return ("is a directory" if stat.S_ISDIR(mode) else "is a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "is a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "is a socket" if stat.S_ISSOCK(mode)
            else "is not a regular file")


def refusal(path: Path, problem: str) -> str:
    """The one line that refuses to write `path` because it `problem` (output_problem's words)."""
    return f"{path} {problem}; this run writes a file of its own there, and left this as it is: move it away or " \
           f"give another path"


def check_output(path: Path, appended: bool) -> None:
    """Raise OutputPathError (one line) if output_problem finds something at `path` the trainer must not write."""
    problem = output_problem(path, appended)
    if problem is not None:
        raise OutputPathError(refusal(path, problem))


def open_to_append(path: Path, truncate: bool = False) -> int:
    """A file descriptor that appends to the regular file `path` (made if missing; emptied first with
    `truncate`), after check_output. The open itself refuses what may have appeared since the check:
    O_NOFOLLOW fails on a link, O_NONBLOCK makes a FIFO fail (no reader) or open at once (then fstat refuses
    it), so nothing is written through a link and nothing waits for a reader."""
    check_output(path, appended=True)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | (os.O_TRUNC if truncate else 0), 0o644)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, a FIFO, a folder put there since
            check_output(path, appended=True)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)  # nothing was written: a device or FIFO swapped in after the check
        raise OutputPathError(refusal(path, output_problem(path, appended=True) or "is not a regular file"))
    os.set_blocking(fd, True)  # back to plain writes (O_NONBLOCK was for the open)
    return fd


def one_line(error: BaseException) -> str:
    """An error in one line: `Type: the first line of its message`. For DCP's CheckpointException, whose message
    is every failed rank's traceback, the error of the first rank that failed, named."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        cause = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]  # (error, its stack)
        return f"rank {rank}: {one_line(cause)}"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def manifest_path(checkpoint: Path) -> Path:
    """Where the manifest of `checkpoint` is written: its full name plus `.json` (`step_00000300.pth.json`),
    so a step saved both as a file and as a sharded folder (`.dcp`) has two manifests, one each."""
    return checkpoint.with_name(checkpoint.name + ".json")


# The kept checkpoints, the only files an earlier version wrote a `step_00000300.json` manifest for.
HISTORY_FILE = re.compile(r"^step_\d{8}\.(?:pth|dcp)$")


def earlier_manifest(checkpoint: Path) -> Path | None:
    """The `step_00000300.json` that versions before the two-part manifest name wrote, if it describes
    `checkpoint`: it does unless its "file" names a checkpoint of the other kind (`.dcp` for a `.pth`, or
    back). One that cannot be read is taken as this checkpoint's: verify then says what is wrong with it."""
    earlier = checkpoint.with_suffix(".json")
    if not HISTORY_FILE.match(checkpoint.name) or not earlier.is_file():  # out/{run}.json is the weights' settings
        return None
    try:
        named = json.loads(earlier.read_text())["file"]
    except (OSError, ValueError, KeyError, TypeError):
        return earlier
    return None if isinstance(named, str) and Path(named).suffix != checkpoint.suffix else earlier


def manifest_of(checkpoint: Path) -> Path:
    """The manifest that describes `checkpoint`: its own, or else an earlier version's (earlier_manifest);
    manifest_path when there is neither. Everything that reads or moves a manifest asks here."""
    own = manifest_path(checkpoint)
    return own if os.path.lexists(own) else earlier_manifest(checkpoint) or own


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable (the rename lives in the directory's own data)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A write-only file object that hashes what passes through, so no second read is needed."""

    def __init__(self, file):
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error  # torch.save hides it (see atomic_write); keep it for the caller
            raise

    def flush(self) -> None:
        self.file.flush()


def temp_path(path: Path) -> Path:
    """The name `path` is written under until it is complete: unique to this host, process and thread, so
    two writers never share one (a killed write's leftover is removed at start: remove_stale_temp_files)."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:32]
    return path.with_name(f"{path.name}.partial-{host}-{os.getpid()}-{threading.get_native_id()}.tmp")


def create_new(path: str | Path) -> int:
    """A file descriptor of a new file at `path`, for writing. O_EXCL | O_NOFOLLOW: never a file, or a link,
    already there (put at a temp name between two runs, or since). Mode 0o666 less the umask, as open() makes
    it: the file's mode follows the umask like any other file's."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


def atomic_write(path: Path, write: Callable[[Any], None],
                 before_rename: Callable[[], None] | None = None) -> tuple[int, str]:
    """Write `path` through a temp file, fsync, rename, fsync the directory; returns (size, sha256). A symbolic
    link at `path` is replaced by the file, never written through; a folder, FIFO or device there is refused
    (OutputPathError), not replaced. `before_rename` may raise to stop the write there (a save checks that its
    run still holds the directory)."""
    check_output(path, appended=False)
    tmp = temp_path(path)
    raw = open(tmp, "wb", opener=lambda name, flags: create_new(name))  # before `try`: a name not ours stays
    writer = None
    try:
        with raw:
            writer = _HashingWriter(raw)
            write(writer)
            raw.flush()
            os.fsync(raw.fileno())  # the bytes must be on disk before the name points at them
        if before_rename is not None:
            before_rename()  # last, right before the name points at the new bytes
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        # torch.save turns an OSError from our write() (a full disk: ENOSPC) into a bare
        # RuntimeError "unexpected pos ..."; re-raise the real cause so callers see an OSError.
        if writer is not None and writer.error is not None and error is not writer.error:
            raise writer.error from error
        raise
    return writer.size, writer.sha256.hexdigest()


def atomic_write_text(path: Path, text: str, before_rename: Callable[[], None] | None = None) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")), before_rename)


def sha256_of(path: Path, cached: bool = False) -> str:
    """The file's SHA-256. With `cached`, the one this process last computed or wrote for the same
    (path, inode, size, mtime_ns), without reading the file again. Resume never passes `cached`: a same-size
    rewrite in place within one tick of the filesystem clock keeps all four, and only a full hash sees it."""
    global hashes_computed
    with open(path, "rb") as f:  # opened even when cached: a file that became unreadable fails here
        st = os.fstat(f.fileno())
        identity, known = (st.st_ino, st.st_size, st.st_mtime_ns), _known_hashes.get(os.path.abspath(path))
        if cached and known is not None and known[0] == identity:
            return known[1]
        digest = hashlib.sha256()
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    hashes_computed += 1
    _known_hashes[os.path.abspath(path)] = (identity, digest.hexdigest())
    return digest.hexdigest()


def remember_hash(path: Path, sha256: str) -> None:
    """Let sha256_of(path, cached=True) return `sha256` (computed while writing, or by the rank that wrote
    the file) for as long as the file keeps its inode, size and mtime."""
    st = os.stat(path)
    _known_hashes[os.path.abspath(path)] = ((st.st_ino, st.st_size, st.st_mtime_ns), sha256)


def forget_hash(path: Path) -> None:
    """Drop what this process remembers of `path` (deleted, or moved away)."""
    _known_hashes.pop(os.path.abspath(path), None)


def load_file_trusted(path: Path) -> dict:
    """torch.load of one file with weights_only=True: tensors and plain types only, never code from a pickle.
    Raises CheckpointError, in one line, for anything that is not such a dict."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's own message goes on to explain how to load the file unsafely; we never do that.
        raise CheckpointError(f"{path} is refused: it holds objects other than tensors and plain types, "
                              f"and unpickling them could run code (weights_only=True)") from error
    except Exception as error:  # zip errors, EOF, bad magic: all mean "do not trust this file"
        raise CheckpointError(f"{path} cannot be loaded safely: {one_line(error)}") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint dict")
    return state

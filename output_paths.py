"""The output-path rules of every program here that writes a file: the trainer, the exports, the tools.

    no overwrite without asking, never through a link, never onto a FIFO, a temp file then a rename

Every path is looked at (lstat) before it is opened (output_problem): a folder, FIFO or device there is refused
in one line, and so is a symbolic link where a file is appended to (open_to_append); a file replaced by a rename
(atomic_write) replaces a link, never follows it. A program that writes a file the user named (the exports)
also refuses an existing file unless asked to overwrite it (--force), and never writes over its own input
(check_user_output).

This module sits below everything else (it imports only the standard library), so model/, trainer/ and
scripts/ all take their rules from here: model/ may not import trainer/.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

TEMP_TAIL = r"(?:\.partial-[A-Za-z0-9._-]+)?\.tmp"  # see temp_path; a bare `NAME.tmp` is an earlier version's


class OutputPathError(RuntimeError):
    """Something stands where a program writes a file, or the file may not be written there (one line, exit 2)."""


def output_problem(path: Path, appended: bool) -> str | None:
    """What stands at `path` that must not be written into, in words ("is a FIFO"), or None: nothing, or a
    regular file. A symbolic link is a problem only for a file that is appended to (`appended`): a write
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
    """Raise OutputPathError (one line) if output_problem finds something at `path` that must not be written."""
    problem = output_problem(path, appended)
    if problem is not None:
        raise OutputPathError(refusal(path, problem))


def check_user_output(path: Path, force: bool, inputs: Iterable[Path] = (), flag: str = "--force") -> None:
    """For a file a program writes where the user said (an export): raise OutputPathError, in one line, if a
    folder, FIFO or device stands at `path`, if a file (or a link) is there and `force` is not given, or if
    `path` is one of the program's own `inputs` (the same file, by any name), `force` or not. lstat first:
    nothing is opened, so a FIFO cannot block the check."""
    path = Path(path)
    problem = output_problem(path, appended=False)
    if problem is not None:
        raise OutputPathError(f"{path} {problem}; nothing was written: give a file name that is free")
    if not os.path.lexists(path):
        return
    for source in inputs:
        if _same_file(path, Path(source)):
            raise OutputPathError(f"{path} is this program's input ({source}); writing it would destroy what it "
                                  f"reads, so it was left as it is: give another output name")
    if not force:
        raise OutputPathError(f"{path} exists: pass {flag} to replace it, or give another name (it was left as "
                              f"it is)")


def check_output_folder(out_dir: Path, names: Iterable[str], overwrite: bool, inputs: Iterable[Path] = ()) -> None:
    """Raise OutputPathError, in one line, before anything is written, unless `out_dir` can take the files
    `names`: a folder (or nothing yet) where each name is free, or a file (a link too) that `overwrite` allows;
    never a folder or FIFO where a file goes, never one of `inputs` (check_user_output)."""
    inputs = list(inputs)
    if os.path.lexists(out_dir) and not out_dir.is_dir():  # is_dir follows a link: a link to a folder is a folder
        raise OutputPathError(f"{out_dir} is a file, not a folder: the export writes a folder of files there; "
                              f"give a folder name")
    for name in names:
        check_user_output(out_dir / name, overwrite, inputs)


def _same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name one file: the same path (a link counts as what it points to) or the same inode."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is missing or a broken link: compare the names themselves
        return os.path.abspath(a) == os.path.abspath(b)


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
            os.fsync(raw.fileno())  # on disk before the name points at them (a power cut; kill -9: the rename)
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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


@contextmanager
def written_by_name(path: Path) -> Iterator[Path]:
    """For a library that opens the file it writes by name itself (gguf's writer): a path to hand it, in a
    folder made for this write (mkdtemp: new, private to this user), so no link planted in advance at a
    predictable name can be followed. When the block ends, the file is fsynced and renamed over `path` (a link
    there is replaced, not followed; a folder or FIFO refused first); on an error it is removed, `path` kept."""
    check_output(path, appended=False)
    folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        tmp = folder / path.name
        yield tmp
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # only the folder made above: empty after the rename


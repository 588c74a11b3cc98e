"""Durable files, one at a time: the primitives every checkpoint is built from.

A file is written under a temp name of its own (`NAME.partial-HOST-PID-TID.tmp`), flushed, fsynced, renamed
over its real name and its directory fsynced, hashing the bytes as they pass: a kill at any instant leaves
either the old file or the new one, never half of one. A manifest (JSON beside the checkpoint, named after
it: `step_00000300.pth.json`) records the size and SHA-256 of those bytes; a hash is remembered per process
by (path, inode, size, mtime_ns), so a kept file is read once, not at every save. Loading is torch.load
with weights_only=True, always.

The writing itself (atomic_write, open_to_append) and the rules every written path follows (a folder, FIFO
or device there is refused in one line, exit 2; a link is replaced, never written through) are in the
top-level output_paths.py, which the exports share: model/ may not import trainer/.

checkpoint_io.py (single-file checkpoints, rotation, fallback) and sharded_checkpoint.py (the folders of
--parallel fsdp) build on this module; it imports nothing of theirs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from pathlib import Path

import torch

hashes_computed = 0  # files read in full to hash them, in this process: tests check rotation does not repeat it
_known_hashes: dict[str, tuple[tuple[int, int, int], str]] = {}  # path -> ((inode, size, mtime_ns), sha256)


def no_check() -> None:
    """The `still_held` of a write whose directory no lock guards (tools, tests): it never raises."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none could be trusted for loading."""


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

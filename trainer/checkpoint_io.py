"""Checkpoint files that survive `kill -9` at any instant.

Layout for a run named R (e.g. `pretrain_512`) in the checkpoint directory:

    checkpoints/
      R_resume.pth              the newest verified state (a hard link to the newest history file)
      R_latest.txt              the name of that history file, written atomically
      R_history/
        step_00000200.pth       older verified states, `--keep_last` of them
        step_00000200.json      manifest: size, sha256, epoch, step, samples consumed
        step_00000300.pth
        step_00000300.json

A save never touches a good file: it writes a new history file and its manifest atomically (temp name,
fsync, rename, fsync of the directory), hashing while writing, and only then moves the resume link and
the latest pointer and deletes old entries. A crash leaves the previous checkpoint intact; a failed save
removes its own files. Resume takes the newest history file that matches its manifest (weights_only).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

HISTORY_NAME = re.compile(r"^step_(\d{8})\.pth$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none could be trusted for loading."""


@dataclass
class RunFiles:
    """Where the files of one run live (`name` is `{weight}_{hidden}[_moe]`)."""

    checkpoint_dir: Path
    name: str

    def __post_init__(self):
        self.resume_link = self.checkpoint_dir / f"{self.name}_resume.pth"
        self.latest_pointer = self.checkpoint_dir / f"{self.name}_latest.txt"
        self.history_dir = self.checkpoint_dir / f"{self.name}_history"

    def history_file(self, step: int) -> Path:
        return self.history_dir / f"step_{step:08d}.pth"

    def history(self) -> list[Path]:
        """Kept checkpoint files, newest (highest step) first."""
        if not self.history_dir.is_dir():
            return []
        return sorted((p for p in self.history_dir.iterdir() if HISTORY_NAME.match(p.name)),
                      key=lambda p: p.name, reverse=True)


def manifest_path(checkpoint: Path) -> Path:
    return checkpoint.with_suffix(".json")


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


def atomic_write(path: Path, write: Callable[[Any], None]) -> tuple[int, str]:
    """Write `path` through a temp file, fsync, rename, fsync the directory; returns (size, sha256)."""
    tmp = path.with_name(path.name + ".tmp")  # fixed (one writer per path): a killed write's leftover is reused
    writer = None
    try:
        with open(tmp, "wb") as raw:
            writer = _HashingWriter(raw)
            write(writer)
            raw.flush()
            os.fsync(raw.fileno())  # the bytes must be on disk before the name points at them
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


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_verified(files: RunFiles, state: dict, step: int, keep_last: int, info: dict) -> Path:
    """Write `state` as the run's newest checkpoint, with `info` (epoch, samples...) in its manifest,
    then rotate old ones away. Raises CheckpointError (older checkpoints untouched) if anything fails."""
    path = files.history_file(step)
    written = False  # True while `path` holds this save's bytes but nothing points at them yet
    try:
        files.history_dir.mkdir(parents=True, exist_ok=True)
        for leftover in files.history_dir.glob("*.tmp"):  # from a save that was killed
            leftover.unlink()
        size, sha = atomic_write(path, lambda f: torch.save(state, f))
        written = True
        manifest = {"file": path.name, "size": size, "sha256": sha, "step": step, **info}
        atomic_write_text(manifest_path(path), json.dumps(manifest, indent=1) + "\n")
        check_written(path, size)
        aside = set_aside_unmanaged_resume_file(files)
        if aside is not None:
            print(f"kept {files.resume_link.name}, which this project's checkpoints do not account for, as "
                  f"{aside} (this save writes {files.resume_link.name})", flush=True)
        link_tmp = files.resume_link.with_name(files.resume_link.name + ".tmp")
        link_tmp.unlink(missing_ok=True)
        os.link(path, link_tmp)  # no second copy on disk: both names share the same bytes
        os.replace(link_tmp, files.resume_link)
        written = False  # the resume link names it now: it is the newest checkpoint, keep it
        atomic_write_text(files.latest_pointer, f"{files.history_dir.name}/{path.name}\n")
    except (OSError, CheckpointError) as error:
        if written:  # a half-finished save: give its space back and leave no unverifiable newest file
            for leftover in (path, manifest_path(path)):
                with contextlib.suppress(OSError):  # best effort; the error below is what matters
                    leftover.unlink(missing_ok=True)
        raise CheckpointError(
            f"could not write checkpoint {path}: {error}. Older checkpoints in {files.history_dir} "
            f"are untouched; free space or fix permissions, then resume with --from_resume 1") from error
    try:
        rotate(files, keep_last)
    except OSError as error:
        raise CheckpointError(f"checkpoint {path} is saved and verified, but older ones in {files.history_dir} "
                              f"could not be deleted: {error}") from error
    return path


def check_written(path: Path, size: int) -> None:
    """After the rename: is the file there with every byte we wrote? No read-back hash: the manifest's
    was taken from the very bytes written, and re-reading would only hash the page cache; the full hash
    is checked on load. The size check is free and catches a file replaced or truncated behind our back."""
    actual = path.stat().st_size
    if actual != size:
        raise CheckpointError(f"{path} has {actual} bytes right after writing {size}")


def rotate(files: RunFiles, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (not re-hashed); called only after the newest was
    verified. A file without a manifest, older than a kept one, is debris of a killed save and goes too."""
    with_manifest = [p for p in files.history() if manifest_path(p).is_file()]
    keep = set(with_manifest[:max(keep_last, 1)])
    oldest_kept = min(p.name for p in keep) if keep else None
    removed = []
    for path in files.history():
        if path in keep or (oldest_kept and path.name > oldest_kept):
            continue
        manifest_path(path).unlink(missing_ok=True)
        path.unlink()
        removed.append(path)
    return removed


def verify(path: Path, manifest_file: Path | None = None) -> str | None:
    """None if `path` matches its manifest (size and SHA-256), else what is wrong.
    The manifest is the one beside `path`, or `manifest_file` for a copy that lives elsewhere."""
    manifest_file = manifest_path(path) if manifest_file is None else manifest_file
    if not path.is_file():
        return "file is missing"
    if not manifest_file.is_file():
        return f"no manifest {manifest_file.name} (the save was interrupted)"
    try:
        manifest = json.loads(manifest_file.read_text())
        expected_size, expected_sha = int(manifest["size"]), str(manifest["sha256"])
    except (ValueError, KeyError, TypeError) as error:
        return f"manifest {manifest_file.name} is unreadable ({error})"
    actual_size = path.stat().st_size
    if actual_size != expected_size:
        return f"size is {actual_size} bytes, manifest says {expected_size} (truncated?)"
    if sha256_of(path) != expected_sha:
        return "SHA-256 does not match the manifest (corrupted bytes)"
    return None


def load_trusted(path: Path) -> dict:
    """torch.load with weights_only=True: tensors and plain types only, never code from a pickle."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's own message goes on to explain how to load the file unsafely; we never do that.
        raise CheckpointError(f"{path} is refused: it holds objects other than tensors and plain types, "
                              f"and unpickling them could run code (weights_only=True)") from error
    except Exception as error:  # zip errors, EOF, bad magic: all mean "do not trust this file"
        raise CheckpointError(f"{path} cannot be loaded safely: {type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint dict")
    return state


def is_managed(files: RunFiles, path: Path) -> bool:
    """True if `path` is one of the run's history files that has a manifest (the resume link is one)."""
    return any(manifest_path(p).is_file() and os.path.samefile(p, path) for p in files.history())


def set_aside_unmanaged_resume_file(files: RunFiles) -> Path | None:
    """Rename a `{run}_resume.pth` that no manifest accounts for (the user's: copied in, or minimind's),
    so the next save's link cannot overwrite it. Returns the new path, or None if there was nothing to do."""
    link = files.resume_link
    if not link.is_file() or is_managed(files, link):
        return None
    aside = link.with_name(f"{files.name}_resume.unmanaged_{time.strftime('%Y%m%d-%H%M%S')}.pth")
    os.replace(link, aside)
    fsync_dir(link.parent)
    return aside


def newest_good_checkpoint(files: RunFiles, log: Callable[[str], None]) -> tuple[Path, dict] | None:
    """The newest history file that verifies and loads, with its state; None if there is no history.
    If none is good, raises with what was tried: a damaged run never silently restarts from scratch."""
    candidates = files.history()
    if not candidates:
        return None
    if not files.resume_link.exists() and not any(manifest_path(p).is_file() for p in candidates):
        # No save ever completed here: debris of a killed first save. Starting fresh loses nothing;
        # refusing would leave the run stuck.
        log(f"ignoring {', '.join(p.name for p in candidates)} in {files.history_dir}: no manifest, "
            f"the first save was interrupted before it completed")
        return None
    tried = []
    for path in candidates:
        problem = verify(path)
        if problem is None:
            try:
                state = load_trusted(path)
            except CheckpointError as error:
                problem = str(error)
        if problem is None:
            if tried:
                log(f"using older checkpoint {path} instead")
            return path, state
        tried.append(f"{path}: {problem}")
        log(f"skipping checkpoint {path}: {problem}")
    raise CheckpointError("no usable checkpoint; tried:\n  " + "\n  ".join(tried))


# ---- what lm_checkpoint calls ------------------------------------------------------------------

def cast_state_dict(state_dict: dict, dtype: torch.dtype) -> dict:
    """CPU copies in `dtype` that keep tied tensors tied (embedding = lm_head), so files hold them once."""
    converted = {}
    return {name: converted.setdefault(t.data_ptr(), t.detach().to("cpu", dtype)) for name, t in state_dict.items()}


def write_checkpoint_files(files: RunFiles, out_path: Path, state: dict, keep_last: int, info: dict) -> None:
    """Write `out/{run}.pth` (FP16 weights) and the verified resume checkpoint, from a CPU copy of the state."""
    weights = cast_state_dict(state["model"], torch.float16)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(out_path, lambda f: torch.save(weights, f))
    except OSError as error:
        raise CheckpointError(f"could not write {out_path}: {error}") from error
    save_verified(files, state, info["global_step"], keep_last, info)


def load_newest(files: RunFiles, resume_path: str | None, log: Callable[[str], None]) -> dict | None:
    """The state of the newest good checkpoint (or `resume_path`'s); None when the run has none.
    Rank 0 picks and verifies the file and shares its choice; every rank then loads that file."""
    choice, state = [None], None
    if not dist.is_initialized() or dist.get_rank() == 0:
        choice[0], state = _choose_checkpoint(files, resume_path, log)
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    if state is None:  # the other ranks read the file rank 0 chose and verified
        state = load_trusted(Path(choice[0]))
    state["resumed_from"] = choice[0]
    return state


def _choose_checkpoint(files: RunFiles, resume_path: str | None, log) -> tuple[str | None, dict | None]:
    """(path, loaded state) of the checkpoint to resume; (None, None) when there is nothing."""
    if resume_path is None:
        found = newest_good_checkpoint(files, log)
        if found is None and files.resume_link.is_file():  # a lone file: copied here, or minimind's
            log(f"{files.resume_link} has no manifest, so its bytes could not be checksum-verified; "
                f"loading it with weights_only=True")
            return str(files.resume_link), load_trusted(files.resume_link)
        return (None, None) if found is None else (str(found[0]), found[1])
    path = Path(resume_path)
    problem = verify(path)
    if problem:
        raise CheckpointError(f"--resume_path {path} cannot be trusted: {problem}")
    newer = [p for p in files.history() if p.name > path.name]
    if newer and path.parent.resolve() == files.history_dir.resolve():
        # Set newer checkpoints aside (not deleted), or a later --from_resume 1 would jump back to them.
        aside = files.history_dir / f"discarded_after_{path.stem}"
        aside.mkdir(exist_ok=True)
        for p in newer:
            for f in (p, manifest_path(p)):
                if f.exists():
                    os.replace(f, aside / f.name)
        log(f"resuming from {path}; moved the newer checkpoints {', '.join(p.name for p in newer)} to {aside}")
    return str(path), load_trusted(path)

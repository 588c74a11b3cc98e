"""Checkpoint files that survive `kill -9` at any instant: the save (`save_verified`), then the resume's choice of
file (`load_newest`), then what both call. trainer_utils.lm_checkpoint says what a checkpoint holds.

    checkpoints/
      R_resume.pth              a hard link to the newest history file (R: the run, e.g. `pretrain_512`)
      R_latest.txt              the name of that history file
      R_history/
        step_00000300.pth       a saved state; the newest `--keep_last` that verify are kept
        step_00000300.pth.json  its manifest: size, sha256, epoch, step, samples consumed
        failed_verification/    files that failed their manifest check or to load: moved here, logged, kept

Why a kill at any instant tears no checkpoint (a resume continues from the newest save that completed; steps after
it are trained again, as is one whose write a background save had not finished):
  1. Every file is written under a temp name of its own, fsynced and renamed over its real name
     (output_paths.atomic_write): a name holds the old bytes or the new ones, never half of them.
  2. A save writes a new file (step_N.pth), then its manifest, and only then moves the link and the pointer and
     removes old ones: a kill before the manifest leaves a file that is not a checkpoint, and the one before intact.
  3. A resume takes the newest history file whose size and SHA-256 match its manifest and that loads
     (torch.load, weights_only); newer ones that fail are moved aside, one line each; none good is an error,
     never a silent fresh start.
A save never overwrites a good checkpoint (rotation removes those past --keep_last; a fresh run moves an earlier
run's aside at start: directory_checks.set_aside_earlier_run; out/{run}.pth, written first, may be newer than the
checkpoint a run resumes from after a failed save). A sharded checkpoint is a folder
(sharded_checkpoint.py reads it, sharding.py writes it); the temp files of killed writes are removed at start
(directory_checks.py), holding the directory lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

# The file primitives; TEMP_TAIL, CheckpointError and atomic_write_text are imported from here by run_lock.py,
# tracking.py and the scripts too.
from output_paths import (TEMP_TAIL, OutputPathError, atomic_write, atomic_write_text, check_output, fsync_dir,
                          temp_path)
from trainer.hardening.durable_files import (CheckpointError, earlier_manifest, forget_hash, load_file_trusted,
                                             manifest_of, manifest_path, no_check, remember_hash, sha256_of)

HISTORY_NAME = re.compile(r"^step_(\d{8})\.(?:pth|dcp)$")  # .dcp: a sharded checkpoint's folder
# What a save writes into the history folder, as files: checkpoints and manifests (`.json` alone: earlier versions').
STEP_FILE_NAME = re.compile(r"^step_\d{8}\.(?:pth|json|pth\.json|dcp\.json)$")


@dataclass
class RunFiles:
    """Where the files of one run live (`name` is `{weight}_{hidden}[_moe]`)."""

    checkpoint_dir: Path
    name: str

    def __post_init__(self):
        self.resume_link = self.checkpoint_dir / f"{self.name}_resume.pth"
        self.latest_pointer = self.checkpoint_dir / f"{self.name}_latest.txt"
        self.history_dir = self.checkpoint_dir / f"{self.name}_history"
        self.failed_dir = self.history_dir / "failed_verification"

    def history_file(self, step: int) -> Path:
        return self.history_dir / f"step_{step:08d}.pth"

    def history(self) -> list[Path]:
        """Kept checkpoints, newest first: highest step, then, for a step saved both as a file and as a sharded
        folder (a run switched between DDP and FSDP and saved that step again), the one written last."""
        if not self.history_dir.is_dir():
            return []
        found = [p for p in self.history_dir.iterdir() if HISTORY_NAME.match(p.name)]
        # The stem is `step_` and 8 digits: its order is the steps'. The name last keeps a tie in one order.
        return sorted(found, key=lambda p: (p.stem, _written_at(p), p.name), reverse=True)


def _written_at(path: Path) -> int:
    """When a checkpoint was last written (a folder's time is that of its last file added), in ns; 0 if gone."""
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return 0


# ---- the save ------------------------------------------------------------------------------------

def save_verified(files: RunFiles, state: dict, step: int, keep_last: int, info: dict,
                  still_held: Callable[[], None] = no_check) -> Path:
    """Write `state` as the run's newest checkpoint, with `info` (epoch, samples...) in its manifest,
    then rotate old ones away. Raises CheckpointError (older checkpoints untouched) if anything fails. `still_held`
    raises (run_lock.LockLost) once the run lost the directory: called before each rename, link and removal."""
    path = files.history_file(step)
    written = False  # True while `path` holds this save's bytes but nothing points at them yet
    try:
        files.history_dir.mkdir(parents=True, exist_ok=True)
        size, sha = atomic_write(path, lambda f: torch.save(state, f), still_held)
        written = True
        remember_hash(path, sha)  # the hash just computed while writing: rotation need not read the file back
        manifest = {"file": path.name, "size": size, "sha256": sha, "step": step, **info}
        atomic_write_text(manifest_path(path), json.dumps(manifest, indent=1) + "\n", still_held)
        remove_earlier_manifest(path)
        check_written(path, size)
        still_held()
        aside = set_aside_unmanaged_resume_file(files)
        if aside is not None:
            print(f"kept {files.resume_link.name}, which this project's checkpoints do not account for, as "
                  f"{aside} (this save writes {files.resume_link.name})", flush=True)
        point_resume_at(files, path, still_held)
        written = False  # the resume link names it now: it is the newest checkpoint, keep it
    except (OSError, CheckpointError, OutputPathError) as error:
        if written:  # a half-finished save: give its space back and leave no unverifiable newest file
            for leftover in (path, manifest_path(path)):
                with contextlib.suppress(OSError):  # best effort; the error below is what matters
                    leftover.unlink(missing_ok=True)
        raise CheckpointError(
            f"could not write checkpoint {path}: {error}. Older checkpoints in {files.history_dir} "
            f"are untouched; free space or fix permissions, then resume with --from_resume 1") from error
    still_held()  # rotation deletes: not in a directory that is another run's now
    rotate_after_save(files, keep_last, path)
    return path


# ---- the resume: the newest checkpoint that verifies and loads ------------------------------------

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
    history = [p.name for p in files.history()]
    newer = history[:history.index(path.name)] if path.name in history else []
    if newer and path.parent.resolve() == files.history_dir.resolve():
        # Set newer checkpoints aside (not deleted), or a later --from_resume 1 would jump back to them.
        aside = files.history_dir / f"discarded_after_{path.stem}"
        aside.mkdir(exist_ok=True)
        for p in (files.history_dir / name for name in newer):
            for f in (p, manifest_of(p)):
                if f.exists():
                    os.replace(f, aside / f.name)
        log(f"resuming from {path}; moved the newer checkpoints {', '.join(newer)} to {aside}")
    return str(path), load_to_resume(path)


def newest_good_checkpoint(files: RunFiles, log: Callable[[str], None]) -> tuple[Path, dict] | None:
    """The newest history file that verifies (hashed in full) and loads, with its state; None if there is no
    history. Newer ones that failed are then moved into failed_verification/ (rank 0 only: it moves files).
    If none is good, raises with what was tried: a damaged run never silently restarts from scratch."""
    candidates = files.history()
    if not candidates:
        return None
    if not files.resume_link.exists() and not any(manifest_of(p).is_file() for p in candidates):
        # No save ever completed here: debris of a killed first save. Starting fresh loses nothing;
        # refusing would leave the run stuck.
        log(f"ignoring {', '.join(p.name for p in candidates)} in {files.history_dir}: no manifest, "
            f"the first save was interrupted before it completed")
        return None
    failed = []
    for path in candidates:
        problem = verify(path)
        if problem is None:
            try:
                state = load_to_resume(path)
            except CheckpointError as error:
                problem = str(error)
        if problem is None:
            if failed:
                _set_aside_failed(files, path, failed, log)
            return path, state
        failed.append((path, problem))
    raise CheckpointError("no usable checkpoint; tried:\n  " + "\n  ".join(f"{p}: {why}" for p, why in failed))


def _set_aside_failed(files: RunFiles, good: Path, failed: list[tuple[Path, str]], log) -> None:
    """Move the checkpoints newer than `good` that failed out of the history, one line each. The resume link,
    if it named one of them, names `good` first: a kill in between leaves it on a good file."""
    try:
        link = files.resume_link
        if good.is_dir() or link.is_file() and is_managed(files, link) and not os.path.samefile(link, good):
            point_resume_at(files, good)
        for path, problem in failed:
            if not manifest_of(path).is_file():  # a save killed before its manifest: its space is given back
                remove_checkpoint(path)
                log(f"skipping checkpoint {path}: {problem}; removed it")
            else:
                log(f"skipping checkpoint {path}: {problem}; moved it to {move_aside(files, path)}")
    except OSError as error:
        raise CheckpointError(f"could not move a failed checkpoint out of {files.history_dir}: {error}; "
                              f"fix the folder's permissions, then run again") from error
    log(f"using older checkpoint {good} instead")


# ---- what save_verified and the resume above call: the link, rotation, verification, files set aside -------

def rotate_after_save(files: RunFiles, keep_last: int, newest: Path) -> None:
    """`rotate`, after `newest` was saved and linked: a failure is a CheckpointError that says so."""
    try:
        rotate(files, keep_last, newest)
    except OSError as error:
        raise CheckpointError(f"checkpoint {newest} is saved and verified, but older ones in {files.history_dir} "
                              f"could not be deleted or moved aside: {error}") from error


def check_written(path: Path, size: int) -> None:
    """After the rename: is the file there with every byte we wrote? No read-back hash: the manifest's
    was taken from the very bytes written, and re-reading would only hash the page cache; the full hash
    is checked on load. The size check is free and catches a file replaced or truncated behind our back."""
    actual = path.stat().st_size
    if actual != size:
        raise CheckpointError(f"{path} has {actual} bytes right after writing {size}")


def point_resume_at(files: RunFiles, path: Path, still_held: Callable[[], None] = no_check) -> None:
    """Make `path` the newest checkpoint: the resume link (a file) and the latest pointer name it. A sharded
    checkpoint (a folder) has no single file to link: a link to an older checkpoint of ours is removed."""
    still_held()
    if path.is_dir():
        if files.resume_link.is_file() and is_managed(files, files.resume_link):
            files.resume_link.unlink()  # a second name of a kept history file: no bytes are lost
    else:
        link_resume_to(files, path)
    atomic_write_text(files.latest_pointer, f"{files.history_dir.name}/{path.name}\n", still_held)


def remove_checkpoint(path: Path) -> None:
    """Delete a history entry: a file, or a sharded checkpoint's folder."""
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def link_resume_to(files: RunFiles, path: Path) -> None:
    """Point `{run}_resume.pth` at `path`: a hard link (no second copy on disk) made under a temp name and
    renamed over the old one, so the name always holds a complete checkpoint."""
    check_output(files.resume_link, appended=False)  # a folder or FIFO there is refused; a link is replaced
    tmp = temp_path(files.resume_link)
    os.link(path, tmp)
    try:
        os.replace(tmp, files.resume_link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_earlier_manifest(path: Path) -> None:
    """After writing the manifest of `path`: an earlier version's manifest of the bytes it replaced goes."""
    earlier = earlier_manifest(path)
    if earlier is not None:
        earlier.unlink()


def rotate(files: RunFiles, keep_last: int, newest: Path) -> list[Path]:
    """Keep `newest` (just written) and the newest checkpoints below it that verify (remembered hashes: a
    file is read once per process), `keep_last` in all; delete older ones. One that fails verification is
    moved into failed_verification/, not counted. Good ones above `newest` (put there by hand) are left."""
    kept, removed, below_newest = 1, [], False
    for path in files.history():
        if path == newest:
            below_newest = True
            continue
        problem = verify(path, cached=True)
        if not manifest_of(path).is_file():  # a save killed before its manifest: never was a checkpoint
            remove_checkpoint(path)
            print(f"removed {path}: its save was interrupted before the manifest was written", flush=True)
        elif problem is not None:
            print(f"checkpoint {path} fails verification ({problem}): moved to {move_aside(files, path)}", flush=True)
        elif below_newest and kept < keep_last:
            kept += 1
        elif below_newest:
            manifest_of(path).unlink()
            remove_checkpoint(path)
            forget_hash(path)
            removed.append(path)
    return removed


def move_aside(files: RunFiles, path: Path) -> Path:
    """Move a checkpoint that failed verification or loading, with its manifest, into failed_verification/
    under a name not taken there (`step_N.2.pth` for a second one of step N); returns where it went."""
    files.failed_dir.mkdir(exist_ok=True)
    target, n = files.failed_dir / path.name, 1
    while os.path.lexists(target) or os.path.lexists(manifest_path(target)):
        n += 1
        target = files.failed_dir / f"{path.stem}.{n}{path.suffix}"
    manifest = manifest_of(path)
    os.replace(path, target)  # data first: a kill before the manifest follows leaves only a stray manifest
    if os.path.lexists(manifest):
        os.replace(manifest, manifest_path(target))  # named after `target` there, whatever its name was
    fsync_dir(files.history_dir)
    fsync_dir(files.failed_dir)
    forget_hash(path)
    return target


def verify(path: Path, manifest_file: Path | None = None, cached: bool = False) -> str | None:
    """None if `path` matches its manifest (size and SHA-256), else what is wrong; a file or manifest
    that cannot be read is one more thing wrong. The manifest is the one beside `path` (manifest_of), or
    `manifest_file` for a copy that lives elsewhere. `cached`: trust a hash this process already has (sha256_of)."""
    manifest_file = manifest_of(path) if manifest_file is None else manifest_file
    try:
        sharded = path.is_dir() and HISTORY_NAME.match(path.name) and path.suffix == ".dcp"
        if not sharded and not path.is_file():
            return "not a regular file" if os.path.lexists(path) else "file is missing"
        if not manifest_file.is_file():
            return f"no manifest {manifest_file.name} (the save was interrupted)"
        try:
            manifest = json.loads(manifest_file.read_text())
            if sharded:  # a folder of files (sharded_checkpoint.py), each with its size and hash
                from trainer.hardening.sharded_checkpoint import verify_folder  # here: see load_trusted
                return verify_folder(path, manifest, cached)
            expected_size, expected_sha = int(manifest["size"]), str(manifest["sha256"])
        except (ValueError, KeyError, TypeError) as error:
            return f"manifest {manifest_file.name} is unreadable ({error})"
        actual_size = path.stat().st_size
        if actual_size != expected_size:
            return f"size is {actual_size} bytes, manifest says {expected_size} (truncated?)"
        if sha256_of(path, cached) != expected_sha:
            return "SHA-256 does not match the manifest (corrupted bytes)"
    except OSError as error:  # EACCES, EIO...: a file we cannot read is no more usable than a corrupt one
        return f"cannot be read ({error})"
    return None


def load_trusted(path: Path) -> dict:
    """torch.load with weights_only=True: tensors and plain types only, never code from a pickle. A sharded
    checkpoint's folder gives its train_state.pth, with `sharded_dir` naming the folder (the tensors stay there)."""
    if path.is_dir():
        # Imported here, not at the top: it imports DCP (almost a second), which a DDP run never needs.
        from trainer.hardening.sharded_checkpoint import load_train_state
        return load_train_state(path)
    return load_file_trusted(path)


def load_to_resume(path: Path) -> dict:
    """load_trusted, and for a sharded checkpoint every tensor read once as well (read_every_tensor), so that
    one with a damaged shard is set aside like a damaged file, and an older checkpoint resumes."""
    state = load_trusted(path)
    if path.is_dir():
        from trainer.hardening.sharded_checkpoint import read_every_tensor  # here: see load_trusted
        read_every_tensor(path)
    return state


def is_managed(files: RunFiles, path: Path) -> bool:
    """True if `path` is one of the run's history files that has a manifest (the resume link is one)."""
    return any(manifest_of(p).is_file() and os.path.samefile(p, path) for p in files.history())


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

"""What a run checks in its directories at start, holding their lock (run_lock.claim_run_directories): the temp
files that killed writes of this run left, an earlier run's checkpoints where a fresh run of the same name would
save, and anything that stands where a save must write."""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path
from typing import Callable

from output_paths import fsync_dir
from trainer.hardening.checkpoint_io import (HISTORY_NAME, STEP_FILE_NAME, TEMP_TAIL, CheckpointError, RunFiles,
                                             is_managed)
from trainer.hardening.durable_files import manifest_of


def set_aside_earlier_run(files: RunFiles, log: Callable[[str], None]) -> Path | None:
    """A fresh run (no --from_resume) whose checkpoint folder holds an earlier run's checkpoints of the same name: the
    history, the latest pointer and the resume link (where it is one of the history's files) move, whole, into
    `{name}_earlier_{time}/` beside them, so that this run's saves overwrite none of them and a later --from_resume 1
    continues this run, not that one. Returns that folder, or None where there was nothing. Holding the lock."""
    has_history = files.history_dir.is_dir() and any(files.history_dir.iterdir())
    managed_link = files.resume_link.is_file() and is_managed(files, files.resume_link)
    earlier = [files.history_dir] * has_history + [files.resume_link] * managed_link + \
        [files.latest_pointer] * os.path.lexists(files.latest_pointer)
    if not earlier:
        return None
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    aside = files.checkpoint_dir / f"{files.name}_earlier_{stamp}"
    while os.path.lexists(aside):
        n += 1
        aside = files.checkpoint_dir / f"{files.name}_earlier_{stamp}.{n}"
    steps = [int(HISTORY_NAME.match(p.name).group(1)) for p in files.history() if manifest_of(p).is_file()]
    aside.mkdir()
    for path in earlier:
        os.replace(path, aside / path.name)
    fsync_dir(aside)
    fsync_dir(files.checkpoint_dir)
    newest = f"newest step {max(steps)}" if steps else "none complete"
    log(f"a fresh run (no --from_resume 1): the earlier run's checkpoints of {files.name} ({newest}) were moved, "
        f"whole, to {aside}; --from_resume 1 continues this run from now on")
    return aside


def find_obstructions(files: RunFiles, out_path: Path) -> list[str]:
    """What stands where a save must write, one entry per path: a folder, fifo or broken link where a file
    goes (history step files, the resume link, the latest pointer, the out/ file), a file where a folder goes."""
    wanted = [(files.checkpoint_dir, True), (files.resume_link, False), (files.latest_pointer, False),
              (files.history_dir, True), (files.failed_dir, True), (out_path.parent, True), (out_path, False)]
    if files.history_dir.is_dir():
        wanted += [(p, False) for p in sorted(files.history_dir.iterdir()) if STEP_FILE_NAME.match(p.name)]
    found = []
    for path, folder in wanted:
        try:
            mode = os.stat(path).st_mode  # follows links: a link to the right kind of thing is fine
        except OSError as error:  # absent (or below a file, which is reported itself) is fine
            if os.path.lexists(path):
                found.append(f"{path} is a broken link" if isinstance(error, FileNotFoundError)
                             else f"{path} cannot be examined ({error.strerror})")
            continue
        if not (stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode)):
            kind = "a folder" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode) else "not a regular file"
            found.append(f"{path} is {kind}, where this run needs a {'folder' if folder else 'file'}")
    return found


def check_no_obstructions(files: RunFiles, out_path: Path) -> None:
    """Raise CheckpointError naming every obstruction (see find_obstructions): before training, not after."""
    found = find_obstructions(files, out_path)
    if found:
        raise CheckpointError(f"cannot save checkpoints of {files.name}: {'; '.join(found)}. Move them out of the "
                              f"way (they were left as they are) or use another --checkpoint_dir/--save_dir, then "
                              f"run again")


def remove_stale_temp_files(files: RunFiles, out_dir: Path, log: Callable[[str], None]) -> list[Path]:
    """Remove the temp files of killed writes of this run: `NAME.partial-HOST-PID-TID.tmp` (and earlier
    versions' `NAME.tmp`) for the names a save writes, in the checkpoint, history and out folders. Only
    those: a user's file, or another run's, is never touched. Call it holding the directory lock."""
    own_names = [(files.checkpoint_dir, f"{re.escape(files.resume_link.name)}|{re.escape(files.latest_pointer.name)}"),
                 (files.history_dir, r"step_\d{8}\.(?:pth|json|pth\.json|dcp\.json)"),
                 (Path(out_dir), f"{re.escape(files.name)}\\.(?:pth|json)")]  # the FP16 weights and their sidecar
    removed = []
    for directory, names in own_names:
        pattern = re.compile(f"^(?:{names}){TEMP_TAIL}$")
        for entry in sorted(directory.iterdir()) if directory.is_dir() else []:
            if pattern.match(entry.name) and entry.is_file() and not entry.is_symlink():
                entry.unlink()
                log(f"removed {entry}, left by a write that was killed")
                removed.append(entry)
    return removed

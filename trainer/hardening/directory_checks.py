"""What a run checks in its directories at start, holding their lock (run_lock.claim_run_directories): the temp
files that killed writes of this run left, and anything that stands where a save must write."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Callable

from trainer.hardening.checkpoint_io import STEP_FILE_NAME, TEMP_TAIL, CheckpointError, RunFiles

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

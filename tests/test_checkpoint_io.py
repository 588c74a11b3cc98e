"""Checkpoint files that survive truncation, flipped bits, hostile pickles, a full disk and debris.

Direct calls of trainer/checkpoint_io.py on small states; the kill -9 tests with real torchrun
jobs are in test_fault_injection.py.
"""

from __future__ import annotations

import errno
import functools
import os
import pickle
from pathlib import Path

import pytest
import torch

from trainer import checkpoint_io as cio
from trainer.checkpoint_io import CheckpointError, RunFiles


def small_state(step: int) -> dict:
    """A checkpoint-shaped dict: tensors, nested dicts, plain numbers."""
    generator = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 16, generator=generator), "b": torch.full((16,), float(step))},
            "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 1e-3}]},
            "step": step, "epoch": 0}


def save(files: RunFiles, step: int, keep_last: int = 2) -> Path:
    return cio.save_verified(files, small_state(step), step, keep_last, {"epoch": 0, "samples_consumed": 4 * step})


@pytest.fixture
def files(tmp_path) -> RunFiles:
    return RunFiles(tmp_path / "ckpt", "pretrain_32")


class Lines(list):
    """A `log` callable that keeps what it was told."""

    def __call__(self, line: str) -> None:
        self.append(line)


def names(directory: Path, pattern: str) -> list[str]:
    return sorted(p.name for p in directory.glob(pattern))


def assert_newest_is(files: RunFiles, path: Path) -> None:
    assert os.path.samefile(files.resume_link, path), "_resume.pth is not the newest history file"
    assert files.latest_pointer.read_text().strip() == f"{files.history_dir.name}/{path.name}"


def flip_byte_in_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ---- a normal save ----------------------------------------------------------------------------

def test_save_writes_history_manifest_resume_link_and_latest_pointer(files):
    path = save(files, 2)
    assert path == files.history_file(2) and cio.manifest_path(path).is_file()
    assert cio.verify(path) is None
    assert_newest_is(files, path)
    loaded = cio.load_trusted(files.resume_link)
    assert torch.equal(loaded["model"]["w"], small_state(2)["model"]["w"]) and loaded["step"] == 2


def test_rotation_keeps_exactly_the_newest_keep_last_and_links_the_newest(files):
    for step in range(1, 6):
        save(files, step, keep_last=2)
    assert names(files.history_dir, "*.pth") == ["step_00000004.pth", "step_00000005.pth"]
    assert names(files.history_dir, "*.json") == ["step_00000004.json", "step_00000005.json"]
    assert all(cio.verify(p) is None for p in files.history())
    assert files.resume_link.stat().st_ino == files.history_file(5).stat().st_ino
    assert_newest_is(files, files.history_file(5))


# ---- damaged files are detected and skipped ----------------------------------------------------

@pytest.mark.parametrize("damage,reason", [
    (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "truncated"),
    (flip_byte_in_middle, "SHA-256 does not match"),
])
def test_damaged_newest_is_detected_and_the_previous_one_is_used(files, damage, reason):
    older, newest = save(files, 2), save(files, 4)
    damage(newest)
    assert reason in cio.verify(newest)
    log = Lines()
    path, state = cio.newest_good_checkpoint(files, log)
    assert path == older and state["step"] == 2
    skipped = [line for line in log if line.startswith("skipping")]
    assert len(skipped) == 1 and newest.name in skipped[0] and reason in skipped[0]


def test_when_every_file_is_bad_the_error_lists_each_file_tried(files):
    paths = [save(files, step, keep_last=3) for step in (2, 4, 6)]
    for path in paths:
        flip_byte_in_middle(path)
    with pytest.raises(CheckpointError) as caught:
        cio.newest_good_checkpoint(files, Lines())
    for path in paths:
        assert str(path) in str(caught.value)


# ---- a hostile pickle never runs --------------------------------------------------------------

class RunsCodeWhenUnpickled:
    """Unpickling this calls os.system; a `weights_only=True` load must refuse it before that."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_with_manifest(files: RunFiles, step: int, write) -> Path:
    """Write a file under a history name with a manifest that matches it, so integrity passes."""
    path = files.history_file(step)
    size, sha = cio.atomic_write(path, write)
    cio.atomic_write_text(cio.manifest_path(path), f'{{"size": {size}, "sha256": "{sha}"}}\n')
    return path


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_malicious_pickle_with_matching_manifest_is_refused_and_never_runs(files, tmp_path, writer):
    marker = tmp_path / "code_ran"
    payload = {"model": RunsCodeWhenUnpickled(marker)}
    dump = torch.save if writer == "torch.save" else functools.partial(pickle.dump, protocol=2)
    good = save(files, 2)
    evil = plant_with_manifest(files, 4, lambda f: dump(payload, f))
    assert cio.verify(evil) is None  # the bytes are exactly what the manifest says
    with pytest.raises(CheckpointError, match="is refused: .* could run code"):
        cio.load_trusted(evil)
    log = Lines()
    path, _ = cio.newest_good_checkpoint(files, log)
    assert path == good and any(evil.name in line and "is refused" in line for line in log)
    assert not marker.exists(), "unpickling ran code"


# ---- a failing disk leaves the previous checkpoint in charge -----------------------------------

class FullDisk:
    """A real file that accepts `budget` bytes, then fails like a full disk (ENOSPC) does."""

    def __init__(self, file, budget: int):
        self.file, self.budget = file, budget

    def write(self, data) -> int:
        room = max(self.budget, 0)
        self.budget -= len(data)
        if self.budget < 0:
            self.file.write(bytes(data)[:room])  # a real disk keeps what fitted, then says no
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def fill_disk_after(monkeypatch, budget: int, only_suffix: str) -> None:
    # We cannot fill the test machine's disk, so we fail at the OS boundary instead: checkpoint_io's
    # `open` returns a file whose write() raises ENOSPC once `budget` bytes are in, for temp files of
    # one kind (".pth.tmp": the checkpoint data; ".json.tmp": its manifest). Everything above the
    # write (torch.save, hashing, cleanup, error reporting) runs for real.
    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)
        return FullDisk(file, budget) if str(path).endswith(only_suffix) else file
    monkeypatch.setattr(cio, "open", open_on_a_full_disk, raising=False)


def assert_previous_still_in_charge(files: RunFiles, previous: Path) -> None:
    assert cio.verify(previous) is None and cio.load_trusted(previous)["step"] == 2
    assert_newest_is(files, previous)
    assert names(files.checkpoint_dir, "**/*.tmp") == []
    log = Lines()
    assert cio.newest_good_checkpoint(files, log)[0] == previous and log == []


@pytest.mark.parametrize("budget,suffix", [(0, ".pth.tmp"), (3000, ".pth.tmp"), (10, ".json.tmp")])
def test_disk_full_during_save_raises_and_leaves_the_previous_checkpoint_in_charge(files, monkeypatch,
                                                                                  budget, suffix):
    previous = save(files, 2)
    fill_disk_after(monkeypatch, budget, suffix)
    with pytest.raises(CheckpointError) as caught:
        save(files, 4)
    message = str(caught.value)
    assert str(files.history_file(4)) in message and "untouched" in message and "No space left" in message
    # The half-written step 4 is gone too: a full disk gets its space back, no orphan remains.
    assert [p.name for p in files.history()] == [previous.name]
    assert_previous_still_in_charge(files, previous)


def test_disk_full_at_fsync_raises_and_leaves_the_previous_checkpoint_in_charge(files, monkeypatch):
    previous = save(files, 2)

    def fsync_on_a_full_disk(fd):  # delayed allocation: some filesystems report ENOSPC only here
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", fsync_on_a_full_disk)
    with pytest.raises(CheckpointError, match="untouched"):
        save(files, 4)
    monkeypatch.undo()
    assert_previous_still_in_charge(files, previous)


def test_read_only_checkpoint_dir_raises_a_checkpoint_error_naming_the_file(files):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions, so a read-only directory cannot fail a write")
    previous = save(files, 2)
    files.history_dir.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match="untouched") as caught:
            save(files, 4)
        assert str(files.history_file(4)) in str(caught.value)
    finally:
        files.history_dir.chmod(0o700)
    assert_previous_still_in_charge(files, previous)


# ---- debris of a killed save -------------------------------------------------------------------

def test_debris_of_a_killed_save_is_cleaned_by_the_next_save(files):
    save(files, 2)
    save(files, 4)
    orphan = files.history_file(3)  # killed after its data was renamed, before its manifest
    orphan.write_bytes(b"half a checkpoint")
    (files.history_dir / "step_00000006.pth.tmp").write_bytes(b"killed while writing")
    save(files, 6)
    assert [p.name for p in files.history()] == ["step_00000006.pth", "step_00000004.pth"]
    assert names(files.history_dir, "*.tmp") == []


def test_a_newer_file_without_manifest_is_skipped_as_an_interrupted_save(files):
    good = save(files, 2)
    interrupted = files.history_file(4)
    interrupted.write_bytes(b"killed before the manifest was written")
    log = Lines()
    path, _ = cio.newest_good_checkpoint(files, log)
    assert path == good
    assert any(interrupted.name in line and "interrupted" in line for line in log)


def test_only_interrupted_saves_means_start_fresh_not_a_stuck_run(files):
    # A job killed inside its very first save leaves a data file but no manifest: nothing was
    # ever checkpointed, so resume must start fresh rather than refuse forever.
    files.history_dir.mkdir(parents=True)
    files.history_file(2).write_bytes(b"killed before the manifest was written")
    log = Lines()
    assert cio.newest_good_checkpoint(files, log) is None
    assert len(log) == 1 and "step_00000002.pth" in log[0] and "interrupted" in log[0]
    save(files, 2)
    assert cio.newest_good_checkpoint(files, Lines())[0] == files.history_file(2)


def test_files_without_manifests_after_a_completed_save_are_refused_not_ignored(files):
    # A resume link shows a save did complete once: losing every manifest is damage, not a killed
    # first save, so resume must stop and say so instead of quietly starting over.
    save(files, 2)
    save(files, 4)
    for path in files.history():
        cio.manifest_path(path).unlink()
    with pytest.raises(CheckpointError, match="no usable checkpoint") as caught:
        cio.newest_good_checkpoint(files, Lines())
    assert "step_00000004.pth" in str(caught.value) and "step_00000002.pth" in str(caught.value)

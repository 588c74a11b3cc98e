"""Checkpoint files that survive truncation, flipped bits, hostile pickles, a full disk, unreadable
files, obstructions and debris.

Direct calls of trainer/hardening/checkpoint_io.py on small states, and at the end two real training processes
(a resume past a damaged checkpoint, an obstruction found at start); the kill -9 tests with real torchrun
jobs are in test_fault_injection.py.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from conftest import PRETRAIN_RUN, REPO, Lines, assert_exit_code, child_env, run_args, save, small_state, train
import output_paths
from trainer.hardening import checkpoint_io as cio, durable_files
from trainer.hardening.checkpoint_io import CheckpointError, RunFiles
from trainer.hardening.out_weights import write_out_weights
from trainer.trainer_utils import write_checkpoint_files


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
    assert names(files.history_dir, "*.json") == ["step_00000004.pth.json", "step_00000005.pth.json"]
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
    # Moved out of the history with its manifest, and the line says where; the resume link names the one used.
    assert str(files.failed_dir / newest.name) in skipped[0] and not newest.exists()
    assert (files.failed_dir / "step_00000004.pth.json").is_file()
    assert_newest_is(files, older)


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
    assert (files.failed_dir / evil.name).is_file() and not evil.exists()  # a file that fails to load goes too


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


def fill_disk_after(monkeypatch, budget: int, only_kind: str) -> None:
    # We cannot fill the test machine's disk, so we fail at the OS boundary instead: the `open` of
    # output_paths (where atomic_write opens its temp file) returns a file whose write() raises ENOSPC
    # once `budget` bytes are in, for temp files of one kind ("NAME.pth.partial-...": the checkpoint
    # data; "NAME.json.partial-...": its manifest).
    # Everything above the write (torch.save, hashing, cleanup, error reporting) runs for real.
    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)
        return FullDisk(file, budget) if f"{only_kind}.partial-" in Path(path).name else file
    monkeypatch.setattr(output_paths, "open", open_on_a_full_disk, raising=False)


def assert_previous_still_in_charge(files: RunFiles, previous: Path) -> None:
    assert cio.verify(previous) is None and cio.load_trusted(previous)["step"] == 2
    assert_newest_is(files, previous)
    assert names(files.checkpoint_dir, "**/*.tmp") == []
    log = Lines()
    assert cio.newest_good_checkpoint(files, log)[0] == previous and log == []


@pytest.mark.parametrize("budget,kind", [(0, ".pth"), (3000, ".pth"), (10, ".json")])
def test_disk_full_during_save_raises_and_leaves_the_previous_checkpoint_in_charge(files, monkeypatch,
                                                                                  budget, kind):
    previous = save(files, 2)
    fill_disk_after(monkeypatch, budget, kind)
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

def test_debris_of_a_killed_save_leaves_the_history_and_another_writers_temp_file_is_left_alone(files):
    save(files, 2)
    save(files, 4)
    orphan = files.history_file(3)  # killed after its data was renamed, before its manifest
    orphan.write_bytes(b"half a checkpoint")
    in_flight = files.history_dir / "step_00000006.pth.partial-otherhost-7-7.tmp"  # not this save's to touch
    in_flight.write_bytes(b"another writer's bytes")
    save(files, 6)
    assert [p.name for p in files.history()] == ["step_00000006.pth", "step_00000004.pth"]
    assert not orphan.exists() and not files.failed_dir.exists()  # never a checkpoint: its space is given back
    assert in_flight.exists()


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


# ---- rotation counts only checkpoints that verify ----------------------------------------------

def replace_with_flipped(path: Path) -> None:
    """Damage a file the way a copy or a bad sync does: new bytes under the same name (a new inode)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.with_name("damaged").write_bytes(bytes(data))
    os.replace(path.with_name("damaged"), path)


def test_after_resuming_past_a_damaged_newest_rotation_keeps_keep_last_good_ones(files):
    # A run saved steps 3, 6 and 9; step 9 was damaged; resume went on from 6 and saved 7 with keep_last 2.
    # Counting the damaged 9 as one of the two would have deleted the good 6.
    for step in (3, 6, 9):
        save(files, step, keep_last=3)
    flip_byte_in_middle(files.history_file(9))
    log = Lines()
    assert cio.newest_good_checkpoint(files, log)[0] == files.history_file(6)
    save(files, 7, keep_last=2)
    assert [p.name for p in files.history()] == ["step_00000007.pth", "step_00000006.pth"]
    assert all(cio.verify(p) is None for p in files.history())
    assert names(files.failed_dir, "*") == ["step_00000009.pth", "step_00000009.pth.json"]
    assert any(str(files.failed_dir / "step_00000009.pth") in line for line in log)
    assert_newest_is(files, files.history_file(7))
    assert names(files.checkpoint_dir, "*unmanaged*") == []  # the link named 6 after the resume: ours, replaced


def test_rotation_moves_a_damaged_older_checkpoint_aside_and_keeps_keep_last_good_ones(files, capsys):
    for step in (1, 2, 3):
        save(files, step, keep_last=3)
    replace_with_flipped(files.history_file(2))
    save(files, 4, keep_last=3)
    assert [p.name for p in files.history()] == ["step_00000004.pth", "step_00000003.pth", "step_00000001.pth"]
    assert names(files.failed_dir, "*") == ["step_00000002.pth", "step_00000002.pth.json"]
    assert "SHA-256 does not match" in capsys.readouterr().out
    # A second damaged file of the same step is moved aside too, never over the first one.
    save(files, 2, keep_last=4)
    replace_with_flipped(files.history_file(2))
    save(files, 5, keep_last=4)
    assert names(files.failed_dir, "*.pth") == ["step_00000002.2.pth", "step_00000002.pth"]
    assert "SHA-256 does not match" in cio.verify(files.failed_dir / "step_00000002.2.pth")


def test_rotation_hashes_each_kept_file_once_per_process_not_at_every_save(files):
    for step in (1, 2, 3):
        save(files, step, keep_last=3)
    before = durable_files.hashes_computed
    for step in (4, 5, 6):  # each file was hashed while it was written: rotation reads none back
        save(files, step, keep_last=3)
    assert durable_files.hashes_computed == before
    durable_files._known_hashes.clear()  # as in a new process after a restart: nothing is known yet
    save(files, 7, keep_last=3)  # verifies 6 and 5 (kept) and 4 (rotated away), once each
    assert durable_files.hashes_computed == before + 3
    save(files, 8, keep_last=3)
    save(files, 9, keep_last=3)
    assert durable_files.hashes_computed == before + 3
    replace_with_flipped(files.history_file(8))  # a changed file (new inode) is hashed again, and caught
    save(files, 10, keep_last=3)
    assert durable_files.hashes_computed == before + 4 and (files.failed_dir / "step_00000008.pth").is_file()
    assert [p.name for p in files.history()] == ["step_00000010.pth", "step_00000009.pth", "step_00000007.pth"]


# ---- one manifest per checkpoint, and an earlier version's manifest name still read ------------

def as_earlier_version_wrote_it(path: Path) -> Path:
    """Give the manifest of `path` the name versions before the two-part name wrote: `step_N.json`."""
    earlier = path.with_suffix(".json")
    os.replace(cio.manifest_path(path), earlier)
    return earlier


def test_a_checkpoint_whose_manifest_has_the_earlier_name_verifies_loads_falls_back_and_rotates(files):
    older, newest = save(files, 2, keep_last=3), save(files, 4, keep_last=3)
    for path in (older, newest):
        as_earlier_version_wrote_it(path)
        assert cio.verify(path) is None
    assert cio.newest_good_checkpoint(files, Lines())[0] == newest
    flip_byte_in_middle(newest)
    log = Lines()
    assert cio.newest_good_checkpoint(files, log)[0] == older
    assert any("SHA-256 does not match" in line for line in log)
    assert names(files.failed_dir, "*") == ["step_00000004.pth", "step_00000004.pth.json"]  # renamed on the way
    save(files, 2, keep_last=3)  # step 2 again: its earlier manifest described the bytes now replaced, and goes
    assert names(files.history_dir, "step_*") == ["step_00000002.pth", "step_00000002.pth.json"]
    as_earlier_version_wrote_it(older)
    save(files, 5, keep_last=1)  # rotation deletes step 2 with its manifest of the earlier name
    assert names(files.history_dir, "step_*") == ["step_00000005.pth", "step_00000005.pth.json"]


def test_an_earlier_manifest_of_a_sharded_checkpoint_is_not_taken_for_a_file_of_the_same_step(files):
    # Before manifests had two-part names, a step saved as step_N.pth and then as step_N.dcp shared
    # step_N.json: the second save's manifest replaced the first's. The file has no manifest now.
    path = save(files, 4)
    earlier = as_earlier_version_wrote_it(path)
    earlier.write_text(json.dumps({**json.loads(earlier.read_text()), "file": "step_00000004.dcp"}))
    assert cio.verify(path) == "no manifest step_00000004.pth.json (the save was interrupted)"
    assert cio.manifest_of(files.history_dir / "step_00000004.dcp") == earlier


def test_a_step_saved_as_a_file_and_as_a_folder_is_newest_in_the_order_they_were_written(files):
    file = save(files, 4)
    folder = files.history_dir / "step_00000004.dcp"
    folder.mkdir()
    os.utime(file, ns=(1_000_000_000, 1_000_000_000))
    assert files.history()[:2] == [folder, file]
    os.utime(folder, ns=(500_000_000, 500_000_000))
    assert files.history()[:2] == [file, folder]


# ---- an unreadable checkpoint is skipped like a corrupt one ------------------------------------

RESUME_AS_ANOTHER_USER = """
import io, json, os, pathlib, pwd, sys
sys.path.insert(0, sys.argv[1])
import torch
from trainer.hardening import checkpoint_io as cio, run_lock
buffer = io.BytesIO()
torch.save({"x": torch.zeros(1)}, buffer)
torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)  # torch's lazy imports, while they are readable
if os.geteuid() == 0:  # root reads every file: run as `nobody`, who owns the folder but may not read one file
    nobody = pwd.getpwnam("nobody")
    os.setgroups([])
    os.setgid(nobody.pw_gid)
    os.setuid(nobody.pw_uid)
lines = []
path, state = cio.newest_good_checkpoint(cio.RunFiles(pathlib.Path(sys.argv[2]), "pretrain_32"), lines.append)
print(json.dumps({"path": str(path), "step": state["step"], "log": lines}))
"""


@pytest.mark.parametrize("unreadable", [".pth", ".pth.json"])
def test_an_unreadable_newest_checkpoint_or_manifest_is_skipped_and_the_older_one_used(unreadable):
    if os.geteuid() == 0:
        try:
            import pwd
            nobody = pwd.getpwnam("nobody")
        except KeyError:
            pytest.skip("running as root without a `nobody` user to drop privileges to")
    # Not under pytest's tmp_path: its parents are private to the user running the tests.
    checkpoint_dir = Path(tempfile.mkdtemp(prefix="unreadable-"))
    try:
        files = RunFiles(checkpoint_dir, "pretrain_32")
        older, newest = save(files, 2), save(files, 4)
        if os.geteuid() == 0:
            for path in [checkpoint_dir, *checkpoint_dir.rglob("*")]:
                os.chown(path, nobody.pw_uid, nobody.pw_gid, follow_symlinks=False)
        newest.with_name(newest.stem + unreadable).chmod(0o000)  # the checkpoint, or its manifest
        result = subprocess.run([sys.executable, "-c", RESUME_AS_ANOTHER_USER, str(REPO), str(checkpoint_dir)],
                                capture_output=True, text=True, timeout=120, env=child_env())
        assert_exit_code(result)
        resumed = json.loads(result.stdout.splitlines()[-1])
        assert resumed["path"] == str(older) and resumed["step"] == 2
        skipped = [line for line in resumed["log"] if line.startswith("skipping")]
        assert len(skipped) == 1 and newest.name in skipped[0] and "cannot be read" in skipped[0]
        assert "Permission denied" in skipped[0] and str(files.failed_dir / newest.name) in skipped[0]
    finally:
        shutil.rmtree(checkpoint_dir)


# ---- temp files are the writer's own -----------------------------------------------------------

def test_two_writers_of_one_file_use_two_temp_names_and_leave_none(tmp_path):
    target, both_writing = tmp_path / "step_00000001.pth", threading.Barrier(2, timeout=30)
    temps_seen, errors = [], []

    def write(content: bytes):
        def slow_write(f):
            f.write(content)
            both_writing.wait()  # each writer's temp file exists now, under its own name
            temps_seen.append(sorted(p.name for p in tmp_path.glob("*.tmp")))
            both_writing.wait()
        try:
            cio.atomic_write(target, slow_write)
        except Exception as error:  # reported by the assertion below
            errors.append(error)

    writers = [threading.Thread(target=write, args=(content,)) for content in (b"first", b"second")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
    assert errors == [] and len(temps_seen) == 2 and len(set(temps_seen[0])) == 2
    assert all(f"-{os.getpid()}-" in name and name.startswith("step_00000001.pth.partial-") for name in temps_seen[0])
    assert target.read_bytes() in (b"first", b"second") and list(tmp_path.glob("*.tmp")) == []


# ---- files are made like any other file --------------------------------------------------------

@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_checkpoint_files_get_the_mode_the_umask_gives(files, tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        out_path = tmp_path / "out" / "pretrain_32.pth"
        write_checkpoint_files(files, out_path, {**small_state(2), "train_args": {}}, {"epoch": 0, "global_step": 2}, 2)
    finally:
        os.umask(previous)
    path = files.history_file(2)
    for written in (path, cio.manifest_path(path), files.latest_pointer, files.resume_link, out_path):
        assert written.stat().st_mode & 0o777 == mode, written


# ---- end to end: real training processes -------------------------------------------------------

def test_resume_past_a_damaged_newest_checkpoint_keeps_the_good_older_one(tmp_path, pretrain_data):
    files = RunFiles(tmp_path / "ckpt", PRETRAIN_RUN)
    args = run_args(tmp_path, pretrain_data, "--batch_size", "2", "--epochs", "1")
    train("train_pretrain.py", None, [*args, "--save_interval", "2", "--max_steps", "4", "--keep_last", "3"],
          cwd=tmp_path)
    assert [p.name for p in files.history()] == ["step_00000004.pth", "step_00000002.pth"]
    flip_byte_in_middle(files.history_file(4))
    # Resumes from step 2 and saves step 3: counting the damaged 4 among two would delete the good 2.
    result = train("train_pretrain.py", None, [*args, "--from_resume", "1", "--max_steps", "1", "--keep_last", "2"],
                   cwd=tmp_path)
    assert [p.name for p in files.history()] == ["step_00000003.pth", "step_00000002.pth"]
    assert all(cio.verify(p) is None for p in files.history())
    assert names(files.failed_dir, "*") == ["step_00000004.pth", "step_00000004.pth.json"]
    assert str(files.failed_dir / "step_00000004.pth") in result.stdout + result.stderr
    assert_newest_is(files, files.history_file(3))


def test_the_settings_beside_an_out_file_are_not_taken_for_an_earlier_manifest(tmp_path):
    out = tmp_path / "out" / "full_sft_32.pth"
    write_out_weights(out, small_state(1)["model"], {"max_seq_len": 48})
    assert (tmp_path / "out" / "full_sft_32.json").is_file()  # {"max_seq_len": 48}: no size, no hash
    assert durable_files.manifest_of(out) == cio.manifest_path(out)  # so: no manifest (full_sft_32.pth.json)
    kept = tmp_path / "ckpt" / "step_00000001.pth"
    kept.parent.mkdir()
    kept.write_bytes(b"x")
    (tmp_path / "ckpt" / "step_00000001.json").write_text("{}")  # an earlier version's name: still read
    assert durable_files.manifest_of(kept) == tmp_path / "ckpt" / "step_00000001.json"


def test_a_fresh_run_moves_an_earlier_runs_checkpoints_aside_whole_and_a_resume_continues_the_fresh_one(
        tmp_path, pretrain_data):
    """Its saves would have replaced the earlier run's step files of the same names, and a later --from_resume 1
    would have continued the earlier run from its newest step: its checkpoints move, byte for byte, into a folder
    of their own, and the fresh run's history holds its own files only."""
    args = ["--data_path", str(pretrain_data), "--save_dir", str(tmp_path / "out"),
            "--checkpoint_dir", str(tmp_path / "ckpt"), "--batch_size", "4", "--save_interval", "2", "--log_interval", "2"]
    train("train_pretrain.py", None, [*args, "--max_steps", "4"], tmp_path)
    history = tmp_path / "ckpt" / f"{PRETRAIN_RUN}_history"
    earlier = {p.name: p.read_bytes() for p in history.iterdir() if p.is_file()}
    assert sorted(earlier) == ["step_00000002.pth", "step_00000002.pth.json", "step_00000004.pth",
                               "step_00000004.pth.json"]

    fresh = train("train_pretrain.py", None, [*args, "--max_steps", "2", "--seed", "7"], tmp_path)
    aside = [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(f"{PRETRAIN_RUN}_earlier_")]
    assert len(aside) == 1 and f"(newest step 4) were moved, whole, to {aside[0]}" in fresh.stdout
    assert {p.name: p.read_bytes() for p in (aside[0] / history.name).iterdir() if p.is_file()} == earlier
    assert sorted(p.name for p in aside[0].iterdir()) == [f"{PRETRAIN_RUN}_history", f"{PRETRAIN_RUN}_latest.txt",
                                                         f"{PRETRAIN_RUN}_resume.pth"]
    assert sorted(p.name for p in history.iterdir()) == ["step_00000002.pth", "step_00000002.pth.json"]

    resumed = train("train_pretrain.py", None, [*args, "--max_steps", "2", "--seed", "7", "--from_resume", "1"],
                    tmp_path)
    assert f"{history / 'step_00000002.pth'} saved at step 2" in resumed.stdout
    state = torch.load(tmp_path / "ckpt" / f"{PRETRAIN_RUN}_resume.pth", weights_only=True)
    assert state["global_step"] == 4 and state["train_args"]["seed"] == 7

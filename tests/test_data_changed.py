"""A data file changed under a running trainer (dataset/jsonl_file.py).

The index of line offsets is only true of the file it was built from. A record read at training time
that no longer matches (the file's size, modification time or change time changed, the bytes at an offset
are not that whole line, or they no longer parse) ends the run with one line naming the file and what to do, exit 2,
from a DataLoader worker (--num_workers 1, the default) as from the main process; the checkpoints
saved before the change stay intact, and a resume over the restored file goes on.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from conftest import TINY_MODEL, launch_command, run_args, slowed_env, train, wait_until
from dataset.jsonl_file import DataFileError, JsonlFile
from trainer.hardening.checkpoint_io import RunFiles, verify


def same_length_edit(data: Path) -> None:
    """Every record's "text" key becomes "texx": the same bytes count, lines where they were."""
    data.write_bytes(data.read_bytes().replace(b'"text"', b'"texx"'))


def valid_edit_with_its_time_put_back(data: Path) -> None:
    """Every "o" of the texts becomes "0" in place, and the modification time is put back (as `touch -r` does):
    every record still reads and validates, where it was, so only the change time tells."""
    rewrite_keeping_time(data, data.read_bytes().replace(b"o", b"0"))


def truncate(data: Path) -> None:
    os.truncate(data, data.stat().st_size // 2)


@pytest.mark.parametrize("change", [same_length_edit, valid_edit_with_its_time_put_back, truncate],
                         ids=["same_length_edit", "edit_with_its_time_put_back", "truncation"])
def test_data_changed_mid_run_exits_2_in_one_line_and_keeps_the_checkpoints(tmp_path, pretrain_data, change):
    original = pretrain_data.read_bytes()
    args = run_args(tmp_path, pretrain_data, "--batch_size", "2", "--epochs", "2", "--save_interval", "2",
                    "--num_workers", "1")  # after TINY_MODEL's 0: the default, one DataLoader worker
    job = subprocess.Popen(launch_command("train_pretrain.py", None, [*TINY_MODEL, *args]), cwd=tmp_path,
                           env=slowed_env(step_delay_s=0.3), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    files = RunFiles(tmp_path / "ckpt", "pretrain_32")
    try:
        wait_until(lambda: files.history_dir.is_dir() and any(files.history_dir.glob("*.json")), job)  # one saved
        saved = sorted(path for path in files.history_dir.glob("*.pth") if verify(path) is None)
        change(pretrain_data)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    output = stdout + stderr
    assert job.returncode == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    assert errors[0].startswith(f"error: {pretrain_data} changed since this run indexed it ("), errors
    assert "Restore the file" in errors[0] and "--from_resume 1" in errors[0], errors
    assert saved and all(verify(path) is None for path in saved)  # those saved before the change
    [newest] = [path for path in files.history_dir.glob("*.pth") if path.samefile(files.resume_link)]
    assert verify(newest) is None  # and the one a resume would load, saved before or after the change

    pretrain_data.write_bytes(original)  # as the line says: restore it, then resume
    train("train_pretrain.py", None, [*args, "--from_resume", "1"], tmp_path)


@pytest.fixture
def indexed(tmp_path, pretrain_data) -> tuple[JsonlFile, Path]:
    return JsonlFile(pretrain_data, validate=lambda record: None), pretrain_data


def rewrite_keeping_time(path: Path, data: bytes) -> None:
    """Change the bytes but not the size or the modification time (the change time moves: no user can set it)."""
    before = path.stat()
    assert len(data) == before.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_an_edit_in_place_with_its_time_put_back_is_found_by_the_change_time(indexed):
    source, path = indexed
    first = source.read(0)  # the file is open, as in a DataLoader worker mid-epoch
    valid_edit_with_its_time_put_back(path)
    assert JsonlFile(path, validate=lambda record: None).read(0) != first  # it reads, and reads otherwise
    with pytest.raises(DataFileError) as error:
        source.read(0)
    assert str(error.value).startswith(f"{path} changed since this run indexed it (its inode changed at "), error.value
    assert "keeping its size and modification time: an edit whose time was put back" in str(error.value)


def seen_after_the_edit(source: JsonlFile) -> JsonlFile:
    """The same index on a rank that took its view of the file's times after the edit (another node's copy,
    looked at once rank 0's index arrived): there only what is read can tell."""
    return JsonlFile.from_index(source.path, source.file_size, source.offsets, source.line_numbers, source.sha256,
                                source.validate)


def test_a_line_moved_within_the_same_size_and_time_is_found_by_what_is_read(indexed):
    source, path = indexed
    data = bytearray(path.read_bytes())
    end_of_line_3 = source.offsets[3] - 1  # the newline that ends line 3
    data[end_of_line_3], data[end_of_line_3 + 5] = ord(" "), ord("\n")  # line 3 gets longer, line 4 shorter
    rewrite_keeping_time(path, bytes(data))
    source = seen_after_the_edit(source)
    assert source.read(1) == source.read(1)  # untouched lines still read
    for record, problem in ((2, "line 3 is not where the index put it"), (3, "line 4 is not where the index put it")):
        with pytest.raises(DataFileError) as error:
            source.read(record)
        assert str(error.value).startswith(f"{path} changed since this run indexed it ({problem}; its size and "
                                           f"times are as they were)")


def test_a_record_that_no_longer_parses_is_reported_as_changed_not_as_invalid_json(indexed):
    source, path = indexed
    data = path.read_bytes()
    rewrite_keeping_time(path, data[:source.offsets[5]] + b"[" + data[source.offsets[5] + 1:])
    source = seen_after_the_edit(source)
    with pytest.raises(DataFileError, match=r"changed since this run indexed it \(line 6 no longer parses"):
        source.read(5)


def test_an_error_raised_in_a_dataloader_worker_reaches_the_main_process_as_its_one_line(indexed):
    source, path = indexed
    os.truncate(path, 100)
    loader = DataLoader(range(len(source)), batch_size=2, num_workers=1, collate_fn=lambda batch: [source.read(i)
                                                                                                   for i in batch])
    with pytest.raises(DataFileError) as error:
        next(iter(loader))
    message = str(error.value)  # rebuilt from the worker's text, traceback included: only the line is kept
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(f"{path} changed since this run indexed it (it had {source.file_size} bytes and has 100)")

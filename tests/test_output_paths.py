"""Every path the trainer writes is looked at (lstat) before it is opened (output_paths.py):
a FIFO, a device, a folder, or, for a file the trainer appends to (metrics, trace), a symbolic link is one
line and exit 2, with nothing written through it and nothing waiting for a reader. A file replaced atomically
(checkpoints, manifests, the status file, the out/ weights) may be a link: the rename replaces the link,
and the file it points to keeps every byte."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from conftest import PRETRAIN_RUN, run_args, train
from output_paths import OutputPathError, atomic_write_text, open_to_append, output_problem, temp_path
from trainer.hardening.resume_checks import ConfigError
from trainer.hardening.run_lock import read_lock
from trainer.hardening.tracking import trace_problem

USER_BYTES = b"the user's own notes\n"


@contextlib.contextmanager
def fails_after(seconds: float):
    """Raise TimeoutError in the test if the block is still running after `seconds` (a blocked open of a FIFO)."""
    def timed_out(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")
    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def things(tmp_path) -> dict[str, Path]:
    """A FIFO, a folder, a device, a link to a user's file (and that file), a regular file, a missing path."""
    (tmp_path / "user.txt").write_bytes(USER_BYTES)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "user.txt")
    (tmp_path / "plain").write_text("x")
    return {"fifo": tmp_path / "fifo", "folder": tmp_path / "folder", "device": Path("/dev/null"),
            "link": tmp_path / "link", "user": tmp_path / "user.txt", "plain": tmp_path / "plain",
            "missing": tmp_path / "missing"}


def test_output_problem_names_what_stands_there_without_opening_it(things):
    with fails_after(10):
        assert output_problem(things["fifo"], appended=True) == "is a FIFO (named pipe)"
        assert output_problem(things["fifo"], appended=False) == "is a FIFO (named pipe)"
    assert output_problem(things["folder"], appended=False) == "is a directory"
    assert output_problem(things["device"], appended=True) == "is a device"
    assert output_problem(things["link"], appended=True).startswith(f"is a symbolic link (to {things['user']})")
    assert output_problem(things["link"], appended=False) is None  # replaced by the rename, never followed
    for path in (things["plain"], things["missing"]):
        assert output_problem(path, appended=True) is None and output_problem(path, appended=False) is None


@pytest.mark.parametrize("kind", ["fifo", "folder", "device", "link"])
def test_open_to_append_refuses_at_once_and_writes_nothing_through(things, kind):
    with fails_after(10), pytest.raises(OutputPathError, match=f"^{things[kind]} is a"):
        open_to_append(things[kind])
    assert things["user"].read_bytes() == USER_BYTES


def test_an_atomic_write_replaces_a_link_at_its_destination_and_the_linked_file_keeps_its_bytes(things):
    atomic_write_text(things["link"], "the trainer's status\n")
    assert not things["link"].is_symlink() and things["link"].read_text() == "the trainer's status\n"
    assert things["user"].read_bytes() == USER_BYTES


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_an_atomic_write_refuses_a_fifo_or_folder_at_its_destination_and_leaves_it(things, kind):
    with fails_after(10), pytest.raises(OutputPathError, match=f"^{things[kind]} is a"):
        atomic_write_text(things[kind], "{}\n")
    assert output_problem(things[kind], appended=False) is not None  # still there, not replaced by a file


def test_an_atomic_write_never_writes_through_a_link_at_its_temp_name(things):
    destination = things["plain"].with_name("status.json")
    temp_path(destination).symlink_to(things["user"])  # the temp name is predictable: host, pid, thread
    with pytest.raises(FileExistsError):
        atomic_write_text(destination, "{}\n")
    assert things["user"].read_bytes() == USER_BYTES and not destination.exists()


def test_a_fifo_is_no_trace_and_no_lock_file_and_neither_check_waits_for_a_writer(things):
    with fails_after(10):
        assert "is a FIFO" in trace_problem(things["fifo"], resuming=True)
        with pytest.raises(ConfigError, match="is a FIFO"):
            read_lock(things["fifo"])
    assert "is a symbolic link" in trace_problem(things["link"], resuming=True)
    assert "is a device" in trace_problem(things["device"], resuming=False)


def expect_refused_in_one_line(result, path: Path, problem: str) -> None:
    """Exit 2 and stderr one line naming `path` and what is there."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: ") and str(path) in result.stderr and problem in result.stderr


def test_a_fifo_as_the_trace_path_is_refused_in_one_line_at_once(tmp_path, pretrain_data):
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    args = [*run_args(tmp_path, pretrain_data, "--max_steps", "1"), "--save_debug_train_output", str(fifo)]
    result = train("train_pretrain.py", None, args, tmp_path, check=False, timeout=120)  # a hang fails here
    expect_refused_in_one_line(result, fifo, "is a FIFO")


def test_a_link_planted_at_the_metrics_file_is_refused_and_the_linked_file_keeps_its_bytes(tmp_path, pretrain_data):
    user_file = tmp_path / "notes.jsonl"
    user_file.write_bytes(USER_BYTES)
    link = tmp_path / "out" / f"{PRETRAIN_RUN}_metrics.jsonl"  # no --metrics_dir: the metrics go to --save_dir
    link.parent.mkdir()
    link.symlink_to(user_file)
    args = run_args(tmp_path, pretrain_data, "--max_steps", "1")
    at = args.index("--metrics_dir")
    result = train("train_pretrain.py", None, [*args[:at], *args[at + 2:]], tmp_path, check=False, timeout=120)
    expect_refused_in_one_line(result, link, "is a symbolic link")
    assert user_file.read_bytes() == USER_BYTES and link.is_symlink()


# ---- no stage writes over a file it reads (hardening/flag_checks.py: check_outputs_are_not_inputs) ---------------

@pytest.mark.parametrize("script,flags,refused", [
    ("train_full_sft", ["--from_weight", "full_sft"], "--from_weight {out}/full_sft_32.pth: this run writes its weights"),
    ("train_lora", ["--from_weight", "lora_demo", "--lora_name", "demo"], "--from_weight {out}/lora_demo_32.pth: this "
                                                                          "run writes its weights"),
    ("train_pretrain", ["--save_debug_train_output", "{data}"], "--data_path {data}: this run writes its trace"),
    ("train_pretrain", ["--tokenizer_path", "{out}/pretrain_32_hf/tokenizer.json"],
     "--tokenizer_path {out}/pretrain_32_hf/tokenizer.json: this run writes its Hugging Face export (--save_hf)"),
    ("train_dpo", ["--val_data", "{out}/dpo_32_metrics.jsonl"], "--val_data {out}/dpo_32_metrics.jsonl: this run "
                                                                 "writes its metrics"),
], ids=["sft_from_its_own_weights", "lora_from_its_own_adapter", "trace_over_the_data",
        "tokenizer_in_the_hf_export", "validation_data_as_the_metrics_file"])
def test_no_stage_may_write_over_a_file_it_reads(monkeypatch, tmp_path, script, flags, refused):
    import importlib
    out, data = tmp_path / "out", tmp_path / "data.jsonl"
    out.mkdir()
    data.write_text('{"text": "hello"}\n')
    (out / "pretrain_32_hf").mkdir()
    for name in ("full_sft_32.pth", "lora_demo_32.pth", "pretrain_32_hf/tokenizer.json", "dpo_32_metrics.jsonl"):
        (out / name).write_text("{}\n")  # what they hold does not matter: their names are checked
    paths = {"out": out, "data": data}
    argv = ["--data_path", str(data), "--save_dir", str(out), "--checkpoint_dir", str(tmp_path / "ckpt"),
            "--hidden_size", "32", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--device", "cpu",
            *(flag.format(**paths) for flag in flags)]
    monkeypatch.setattr("sys.argv", [f"{script}.py", *argv])
    with pytest.raises(ConfigError) as raised:
        importlib.import_module(f"trainer.{script}").parse_args()
    assert str(raised.value).startswith(refused.format(**paths)) and "\n" not in str(raised.value), raised.value
    assert not (tmp_path / "ckpt").exists()

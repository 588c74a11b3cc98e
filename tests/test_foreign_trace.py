"""--save_debug_train_output writes into no file the run did not create (trainer/hardening/tracking.py).

A fresh run refuses any file already at that path, another run's trace included, before it writes
a byte: one line naming the flag, the path and what to do, exit 2, and the file byte for byte as it
was. A resumed run (--from_resume 1) continues only a trace of this trainer. Under torchrun every rank
comes to the same verdict, so none waits in a collective for a rank that left.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import REPO, our_traceback_lines, run_args, trace_of, train
from trainer.hardening.tracking import trace_problem


def job_args(run_dir: Path, data: Path, trace: Path, *extra: str) -> list[str]:
    """run_args with the trace at `trace`: 37 samples, batch 2, 19 steps."""
    return [*run_args(run_dir, data, "--batch_size", "2", "--epochs", "1", *extra), "--save_debug_train_output",
            str(trace)]


def assert_refused_in_one_line(result, trace: Path, *words: str) -> None:
    """Exit 2 (torchrun: 1, each worker 2), no traceback from the trainer (torchrun prints its own when a
    worker fails), and one error line naming the flag and the file."""
    output = result.stdout + result.stderr
    assert result.returncode in (1, 2) and not our_traceback_lines(output), output
    errors = [line for line in output.splitlines() if line.startswith("error: --save_debug_train_output")]
    assert len(errors) == 1 and str(trace) in errors[0], output
    for word in words:
        assert word in errors[0], errors[0]


@pytest.mark.parametrize("nproc", [None, 2], ids=["python", "torchrun2"])
def test_a_fresh_run_refuses_a_foreign_file_at_the_trace_path_and_leaves_it_byte_identical(
        tmp_path, pretrain_data, nproc):
    foreign = tmp_path / "copy_of_the_data.jsonl"
    foreign.write_bytes(pretrain_data.read_bytes())
    result = train("train_pretrain.py", nproc, job_args(tmp_path, pretrain_data, foreign), tmp_path, check=False)
    assert_refused_in_one_line(result, foreign, "not a trace of this trainer", "give a path where no file is yet")
    if nproc is None:
        assert result.returncode == 2
    else:  # torchrun exits 1 and reports each worker's exit code: every rank refused, with 2
        worker_exits = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", result.stderr)
        assert sorted(set(worker_exits)) == [("0", "2"), ("1", "2")], result.stderr
    assert foreign.read_bytes() == pretrain_data.read_bytes()


def test_a_fresh_run_refuses_the_trace_of_an_earlier_run_and_a_resume_continues_it(tmp_path, pretrain_data):
    trace = tmp_path / "trace.jsonl"
    train("train_pretrain.py", None, job_args(tmp_path, pretrain_data, trace, "--max_steps", "6"), tmp_path)
    before = trace.read_bytes()

    again = train("train_pretrain.py", None, job_args(tmp_path, pretrain_data, trace), tmp_path, check=False)
    assert again.returncode == 2
    assert_refused_in_one_line(again, trace, "the trace of an earlier run", "delete it or give a new path",
                               "--from_resume 1")
    assert trace.read_bytes() == before

    train("train_pretrain.py", None, job_args(tmp_path, pretrain_data, trace, "--from_resume", "1"), tmp_path)
    assert trace.read_bytes().startswith(before)  # its own trace, continued
    assert [r["step"] for r in trace_of(tmp_path)] == list(range(1, 20))


def test_a_resume_refuses_a_file_that_is_not_a_trace_of_this_trainer(tmp_path, pretrain_data):
    train("train_pretrain.py", None, job_args(tmp_path, pretrain_data, tmp_path / "trace.jsonl", "--max_steps", "4"),
          tmp_path)
    metrics = tmp_path / "metrics" / "pretrain_32_metrics.jsonl"  # JSON lines with a step, but no trace
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_bytes(metrics.read_bytes())
    result = train("train_pretrain.py", None, job_args(tmp_path, pretrain_data, foreign, "--from_resume", "1"),
                   tmp_path, check=False)
    assert result.returncode == 2
    assert_refused_in_one_line(result, foreign, "not a trace of this trainer", "give that trace, or a new path")
    assert foreign.read_bytes() == metrics.read_bytes()


def test_what_each_kind_of_run_may_write_into(tmp_path):
    trace_line = json.dumps({"step": 1, "epoch": 0, "rank": 0, "world_size": 1, "samples": [3, 5], "loss": 7.0})
    nothing, empty, trace, cut_short, text = (tmp_path / name for name in ("none", "empty", "trace", "cut", "text"))
    empty.write_text("")
    trace.write_text(trace_line + "\n")
    cut_short.write_text(trace_line[:20])  # killed in its first write
    text.write_text("hello\n")
    for path in (nothing, empty):  # nothing to lose: either run takes it
        assert trace_problem(path, resuming=False) is None and trace_problem(path, resuming=True) is None
    for path in (trace, cut_short):
        assert trace_problem(path, resuming=True) is None
        assert "already" in trace_problem(path, resuming=False)
    assert "not a trace of this trainer" in trace_problem(text, resuming=True)
    assert "is a directory" in trace_problem(tmp_path, resuming=False)

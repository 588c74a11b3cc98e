"""Ctrl-C under torchrun, as the READMEs tell it beside their torchrun line: the ranks save, rank 0 prints that it
stopped and the command that continues, then torchrun prints its own SignalException traceback and exits 1. The
fast test holds the READMEs to saying so; the slow one (TRAINER_SLOW_TESTS=1) sends a terminal's Ctrl-C to a real
2-rank torchrun (a terminal's SIGINT reaches torchrun alone: it starts its workers in sessions of their own) and
finds in its output, in that order, every line the README quotes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, TINY_MODEL, launch_command, run_args, slowed_env, wait_until
from test_readme_first_steps import bullet

NOTE = {"README.md": ("## Resume, and more GPUs", "**Ctrl-C under torchrun**"),
        "README_zh.md": ("## 续训，以及更多 GPU", "**torchrun 下按 Ctrl-C**")}


def quoted_lines(readme: str) -> list[str]:
    """The output lines the README's note quotes (in backticks, in its order), as patterns: N and PID any number."""
    said = bullet(readme, *NOTE[readme])
    quoted = [q for q in re.findall(r"`([^`]+)`", said) if not q.startswith(("python", "torchrun"))]
    return [re.sub(r"\b(?:N|PID)\b", r"\\d+", re.escape(q)) for q in dict.fromkeys(quoted)]  # each once, in order


@pytest.mark.parametrize("readme", NOTE)
def test_the_readme_says_what_a_ctrl_c_under_torchrun_prints_and_that_the_checkpoint_is_whole(readme):
    """Before: nothing was said, and a new user read torchrun's traceback after "checkpoint saved" as a crash."""
    patterns = quoted_lines(readme)
    assert len(patterns) == 3 and "SignalException" in patterns[-1] and "To" in patterns[1], patterns
    assert quoted_lines("README.md") == patterns  # the two READMEs quote the same lines


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="a 2-rank torchrun run stopped by SIGINT (~20 s on two CPU cores); set TRAINER_SLOW_TESTS=1")
def test_a_ctrl_c_to_torchrun_prints_what_the_readme_quotes_in_its_order(tmp_path, pretrain_data):
    args = run_args(tmp_path, pretrain_data, "--batch_size", "1", "--epochs", "1", "--num_workers", "0")
    job = subprocess.Popen(launch_command("train_pretrain.py", 2, [*TINY_MODEL, *args]), cwd=REPO,
                           env=slowed_env(step_delay_s=0.2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    trace = Path(tmp_path / "trace.jsonl")
    wait_until(lambda: trace.exists() and trace.read_text().count("\n") >= 2, job)
    os.kill(job.pid, signal.SIGINT)  # a terminal's Ctrl-C: torchrun forwards it to its workers
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 1, output
    at = 0
    for pattern in quoted_lines("README.md"):  # each quoted line, after the one before it
        found = re.compile(pattern).search(output, at)
        assert found, f"{pattern!r} not found after position {at} of:\n{output}"
        at = found.end()
    traceback = output[output.index("Traceback"):]
    assert 10 <= traceback.count("\n") <= 30, traceback  # "some 20 lines"
    assert (tmp_path / "ckpt").is_dir() and list((tmp_path / "ckpt").rglob("*_resume.pth"))

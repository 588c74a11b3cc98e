""".ci/run's second command runs the slow tests of the files it names, not again the fast tests of those files that
the README's command has just run: TRAINER_SLOW_ONLY=1 (conftest.pytest_collection_modifyitems) keeps a test only
where its skipif names TRAINER_SLOW_TESTS."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

FILES = ["tests/test_after_sft_commands.py", "tests/test_anomaly.py"]


def collected(**env: str) -> list[str]:
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *FILES],
                            cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_slow_only_collects_the_slow_tests_of_the_files_named_and_none_of_their_fast_ones():
    everything = collected(TRAINER_SLOW_TESTS="1", TRAINER_SLOW_ONLY="0")
    slow = collected(TRAINER_SLOW_TESTS="1", TRAINER_SLOW_ONLY="1")
    assert slow and set(slow) < set(everything)
    assert any(test.startswith("tests/test_after_sft_commands.py::test_every_after_sft_command_runs_as_printed_after_"
                               "the_demo_and_the_demos_files_stay") for test in slow)
    assert "tests/test_after_sft_commands.py::test_the_training_commands_as_printed_take_the_demos_sft_model_and_" \
           "leave_the_demos_files" in set(everything) - set(slow)  # the fast one: the README's command runs it
    assert "tests/test_anomaly.py::test_an_injected_nan_is_seen_by_the_anomaly_policy_in_every_stage[pretrain]" in slow


def test_ci_runs_its_slow_list_with_slow_only():
    slow_line = next(line for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
                     if "TRAINER_SLOW_TESTS=1" in line and "pytest" in line)
    assert "TRAINER_SLOW_ONLY=1" in slow_line

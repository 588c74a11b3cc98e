"""Under torch.compile the guarantees hold: a rollback, background saves and a bit-identical resume.

--use_compile is on by default on CUDA. Compiled code may sum in another order than eager code, so a
compiled run is compared with a compiled run. With `--compile_backend aot_eager`, dynamo and
AOTAutograd trace the model into graphs as with the default backend, but no kernels are generated:
seconds instead of half a minute. The run with inductor, the default backend, takes about 70 s on two
CPU cores (compiling C++ kernels), so it runs when TRAINER_SLOW_TESTS=1.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import (TINY_MODEL, assert_exit_code, assert_states_equal, child_env, events_of, launch_command,
                      resume_file, run_args, trace_of, train)

INDUCTOR = pytest.param("inductor", marks=[
    pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                       reason="about 70 s on two CPU cores; set TRAINER_SLOW_TESTS=1 to run it"),
    pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                       reason="inductor on the CPU needs a C++ compiler")])


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_compiled_run_rolls_back_saves_in_the_background_and_resumes_bit_identically(tmp_path, pretrain_data,
                                                                                      backend):
    common = ["--batch_size", "2", "--epochs", "1", "--use_compile", "1", "--compile_backend", backend,
              "--on_anomaly", "rollback", "--save_interval", "2", "--async_save", "1", "--debug_inject", "nan:6"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    # The straight run and the split run's first part are independent: side by side on two cores.
    first_part_args = [*TINY_MODEL, *run_args(split, pretrain_data, *common, "--max_steps", "3")]
    first_part = subprocess.Popen(launch_command("train_pretrain.py", None, first_part_args), cwd=tmp_path,
                                  env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    train("train_pretrain.py", None, run_args(straight, pretrain_data, *common, "--max_steps", "10"), tmp_path)
    stdout, stderr = first_part.communicate(timeout=300)
    assert_exit_code(subprocess.CompletedProcess(first_part.args, first_part.returncode, stdout, stderr))
    train("train_pretrain.py", None, run_args(split, pretrain_data, *common, "--max_steps", "7", "--from_resume", "1"),
          tmp_path)

    assert events_of(straight) == [("anomaly", 6), ("rollback", 4)]
    assert events_of(split) == [("resume", 3), ("anomaly", 6), ("rollback", 4)]
    assert_states_equal(resume_file(straight), resume_file(split))
    losses = [(r["step"], r["loss"]) for r in trace_of(straight)]
    assert losses == [(r["step"], r["loss"]) for r in trace_of(split)]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9]  # step 6 after the rollback: the window after the bad one

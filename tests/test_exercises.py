"""Exercises of the README's tour that need a run stopped half-way, so a learner can look at its files.

Run them from the repository root with a folder of their own, and each test's files stay in
.exercise4/<test name, cut to 30 characters>0/ after it ends (see README.md, "Read the code, then break it"):

    python -m pytest -q tests/test_exercises.py --basetemp .exercise4
    python -m scripts.inspect_checkpoint .exercise4/test_kill*0/ckpt --run pretrain_32

pytest deletes the --basetemp folder when a run starts, so it is one of the exercises' own, inside the clone
(and in .gitignore: .exercise*/), never a folder that holds anything else.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import time

from conftest import PRETRAIN_RUN, TINY_MODEL, launch_command, run_args, slowed_env
from scripts import inspect_checkpoint
from benchmarks.soak_kill import kill_job
from trainer.hardening.checkpoint_io import RunFiles, manifest_path, verify


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_in_charge(tmp_path, pretrain_data):
    files = RunFiles(tmp_path / "ckpt", PRETRAIN_RUN)
    in_flight = files.history_file(4)
    # --log_interval 1000: the slowed writes would slow each step's status file too.
    args = run_args(tmp_path, pretrain_data, "--batch_size", "2", "--epochs", "1", "--save_interval", "2",
                    "--log_interval", "1000")
    # Each save is slowed from outside (tests/fault_injection): 0.5 s before the bytes, 0.5 s before the manifest.
    job = subprocess.Popen(launch_command("train_pretrain.py", 2, [*TINY_MODEL, *args]), cwd=tmp_path,
                           env=slowed_env(step_delay_s=0.05, save_delay_s=2.0), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (in_flight.exists() and not manifest_path(in_flight).exists()):  # step 4's save, half done
            assert job.poll() is None, f"the job ended (exit {job.returncode}) before step 4's save"
            assert time.time() < deadline, "timed out waiting for step 4's save"
            time.sleep(0.02)
    finally:
        kill_job(job)  # SIGKILL to the launcher and both ranks at once

    # The survivor: step 2, complete and verified, still named by the resume link.
    assert verify(in_flight) == "no manifest step_00000004.pth.json (the save was interrupted)"
    assert verify(files.history_file(2)) is None
    assert files.resume_link.samefile(files.history_file(2))

    # What `python -m scripts.inspect_checkpoint DIR/ckpt --run pretrain_32` prints.
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert inspect_checkpoint.main([str(tmp_path / "ckpt"), "--run", PRETRAIN_RUN]) == 0
    lines = {line.split()[0]: line for line in printed.getvalue().splitlines()[1:]}
    assert "PROBLEM: no manifest" in lines["step_00000004.pth"]
    assert "OK" in lines["step_00000002.pth"] and lines["step_00000002.pth"].endswith("<- resume link")

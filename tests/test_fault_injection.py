"""kill -9 at random moments, some inside a checkpoint save: the run still ends exactly where an
uninterrupted one does, having trained every sample once per epoch.

The kill loop lives in benchmarks/soak_kill.py (the long soak runs it 50 times); here it runs a few
times on a real 2-process torchrun/gloo job on the CPU, and the test then reads the two runs'
files itself: the killed run's trace and both final resume files.

Pretraining, and distillation (a student with a frozen teacher beside it, the same guarantees): about 40 s and
65 s on two CPU cores, so they run when TRAINER_SLOW_TESTS=1 (CI's 15 minutes are full). The
suite still kills at chosen moments: mid-save with a restart that must end as an uninterrupted run
(test_self_healing.py), a background write (test_async_save.py), a save (test_exercises.py).
"""

from __future__ import annotations

import os

import pytest

from conftest import (PRETRAIN_RUN, REPO, TINY_MODEL, assert_each_sample_once, assert_states_equal, child_env,
                      last_record_per_step_and_rank, launch_command, resume_file, slice_jsonl, trace_of)
from benchmarks.soak_kill import soak
from test_distillation_runs import write_teacher

KILLS = 3  # the third waits for a save to begin and strikes inside it (soak_kill's kill_in_save_every)
EPOCHS, NUM_SAMPLES = 2, 37


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="about 40 s (distillation: 65 s) on two CPU cores; set TRAINER_SLOW_TESTS=1 to run it")
@pytest.mark.parametrize("script, run, data_file", [("train_pretrain.py", PRETRAIN_RUN, "pretrain_demo.jsonl"),
                                                    ("train_distillation.py", "distill_32", "sft_demo.jsonl")])
def test_sigkill_at_random_moments_then_resume_matches_an_uninterrupted_run(tmp_path, script, run, data_file):
    data = slice_jsonl(REPO / "dataset" / data_file, tmp_path / data_file, NUM_SAMPLES)
    for run_dir in ("reference", "killed") if script == "train_distillation.py" else ():
        write_teacher(tmp_path / run_dir / "out")  # the teacher, in each run's out/
    lines = []
    result = soak(lambda flags: launch_command(script, 2, [*TINY_MODEL, *flags]), tmp_path,
                  data, kills=KILLS, seed=1, epochs=EPOCHS, num_samples=NUM_SAMPLES, batch_size=2,
                  save_interval=2, max_wait_s=2.5, save_delay_s=0.4, step_delay_s=0.05, base_env=child_env(),
                  report=lines.append, run=run)
    story = "\n".join(lines) + "\n" + result.summary()
    assert len(result.kills) == KILLS, f"the job finished before it was killed {KILLS} times:\n{story}"
    assert any(kill.phase.startswith("saving") for kill in result.kills), f"no kill landed in a save:\n{story}"
    assert result.resumes >= 1 and not result.launch_failures, story
    assert result.exactly_once and result.final_equal, story

    # The same verdicts, from the files: steps replayed after a kill count once (their later record).
    assert_each_sample_once(last_record_per_step_and_rank(trace_of(tmp_path / "killed")), NUM_SAMPLES, EPOCHS)
    assert_states_equal(resume_file(tmp_path / "killed", run), resume_file(tmp_path / "reference", run))

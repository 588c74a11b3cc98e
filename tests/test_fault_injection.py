"""kill -9 at random moments, some inside a checkpoint save: the run still ends exactly where an
uninterrupted one does, having trained every sample once per epoch.

The kill loop lives in scripts/soak_kill.py (the long soak runs it 50 times); here it runs a few
times on a real 2-process torchrun/gloo job on the CPU.
"""

from __future__ import annotations

from conftest import TINY_MODEL, child_env, launch_command

from scripts.soak_kill import soak

KILLS = 4


def test_sigkill_at_random_moments_then_resume_matches_an_uninterrupted_run(tmp_path, pretrain_data):
    lines = []
    result = soak(lambda flags: launch_command("train_pretrain.py", 2, [*TINY_MODEL, *flags]), tmp_path,
                  pretrain_data, kills=KILLS, seed=1, epochs=2, num_samples=37, batch_size=2, save_interval=2,
                  max_wait_s=2.5, save_delay_s=0.4, step_delay_s=0.05, base_env=child_env(), report=lines.append)
    story = "\n".join(lines) + "\n" + result.summary()
    assert len(result.kills) == KILLS, f"the job finished before it was killed {KILLS} times:\n{story}"
    assert any(kill.phase.startswith("saving") for kill in result.kills), f"no kill landed in a save:\n{story}"
    assert result.resumes >= 1 and not result.launch_failures, story
    assert result.exactly_once, story
    assert result.final_equal, story

"""scripts/draw_resume.py: the picture of a 2 -> 3 rank resume draws what the trainer's sampler does."""

from __future__ import annotations

import pytest

from scripts.draw_resume import draw_resume, geometry, resume_assignment, step_in_epoch, trained_count
from trainer.trainer_utils import PLACEHOLDER_INDEX

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUM_SAMPLES, STOP_STEP = 23, 2  # 23 = 3 full steps of 6 and a short one of 5 (or 2 of 8 and 7 left)


def shares(step: list) -> list[list[int]]:
    """Each rank's trained samples in a step, placeholders left out."""
    return [[i for micro in micro_batches for i in micro if i != PLACEHOLDER_INDEX] for micro_batches in step]


@pytest.mark.parametrize("global_batch_size, batch_sizes", [(6, (3, 1)), (None, (4, 4))],
                         ids=["fixed_global_batch", "global_batch_follows_world_size"])
def test_drawn_resume_trains_each_sample_once_from_the_cursor(global_batch_size, batch_sizes):
    before, after = geometry(2, batch_sizes[0], 1, global_batch_size), geometry(3, batch_sizes[1], 1, global_batch_size)
    plan = resume_assignment(NUM_SAMPLES, 42, STOP_STEP, before, after)
    order, consumed = plan["order"], plan["samples_consumed"]

    trained = [i for phase in ("before", "after") for step in plan[phase] for share in shares(step) for i in share]
    assert sorted(trained) == list(range(NUM_SAMPLES))  # none twice, none skipped
    assert consumed == STOP_STEP * before.global_batch
    assert sorted(i for step in plan["before"] for share in shares(step) for i in share) == sorted(order[:consumed])

    cursor = consumed  # the second launch starts at the stop's cursor and takes global batches in order
    for step in plan["after"]:
        window = order[cursor:cursor + after.global_batch]
        assert [set(share) for share in shares(step)] == [set(window[r::3]) for r in range(3)]  # rank r: window[r::3]
        assert trained_count(step) == len(window)
        cursor += len(window)
    assert cursor == NUM_SAMPLES

    for phase, g in (("before", before), ("after", after)):  # shares within a step do not overlap
        for step in plan[phase]:
            flat = [i for share in shares(step) for i in share]
            assert len(flat) == len(set(flat))
            assert len(step) == g.world_size

    assert plan["stop_label"] == step_in_epoch(NUM_SAMPLES, consumed, before.global_batch) == STOP_STEP
    assert plan["resume_label"] == step_in_epoch(NUM_SAMPLES, consumed, after.global_batch)


def test_rescaled_step_label_of_the_worked_example():
    """Global batch 8 -> 12 (no --global_batch_size): stopped after step 3 at sample 24, resumes at step 2."""
    plan = resume_assignment(55, 42, 3, geometry(2, 4, 1, None), geometry(3, 4, 1, None))
    assert (plan["samples_consumed"], plan["stop_label"], plan["resume_label"]) == (24, 3, 2)
    assert len(plan["after"]) == 3  # 31 samples left: 12, 12 and a short 7


def test_short_last_step_gives_a_rank_without_data_a_placeholder():
    plan = resume_assignment(NUM_SAMPLES, 42, STOP_STEP, geometry(2, 3, 1, 6), geometry(3, 1, 2, 6))
    last = plan["after"][-1]  # 5 samples on 3 ranks x 2 micro-steps: rank 2 has 1, its second slot is empty
    assert [len(micro_batches) for micro_batches in last] == [2, 2, 2]
    assert last[2][1] == [PLACEHOLDER_INDEX]


def test_drawing_writes_a_png(tmp_path):
    before, after = geometry(2, 3, 1, 6), geometry(3, 1, 1, 6)
    plan = resume_assignment(NUM_SAMPLES, 42, STOP_STEP, before, after)
    out = draw_resume(plan, before, after, tmp_path / "resume.png")
    assert out.read_bytes()[:8] == PNG_MAGIC

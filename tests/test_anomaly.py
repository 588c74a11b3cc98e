"""What the loop does with a bad step (--on_anomaly warn/stop/rollback), on real CPU runs.

`--debug_inject nan:K` makes step K's loss NaN and `spike:K` makes it 1e4 times larger, so each
policy can be watched on a real `python` or `torchrun` (gloo) process. The 37-sample file with
batch 2 gives 19 steps on one process and 10 steps (global batch 4) on two ranks.
"""

from __future__ import annotations

import collections
import math
import os
import re

import pytest
import torch

from conftest import (events_of, history_file, last_record_per_step_and_rank, read_trace, resume_file, run_args,
                      status_of, trace_of, train)
from model.model import LMConfig
from trainer.hardening.resume_checks import checked_for_resume
from trainer.trainer_utils import RunSpec, epoch_order


SLOW = pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                          reason="covered by a faster test; set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")


def job_args(tmp_path, data, *extra) -> list[str]:
    return run_args(tmp_path, data, "--batch_size", "2", "--epochs", "1", *extra)


def assert_all_finite(state: dict) -> None:
    """Every model weight and every AdamW moment: a NaN update would poison both."""
    for key, tensor in state["model"].items():
        assert torch.isfinite(tensor).all(), f"model tensor {key} is not finite"
    for index, moments in state["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.isfinite(torch.as_tensor(value)).all(), f"optimizer state {index}.{key} is not finite"


@pytest.mark.parametrize("nproc", [None, 2], ids=["python", "torchrun2"])
def test_nan_under_stop_exits_3_names_the_reason_and_keeps_the_last_good_checkpoint(tmp_path, pretrain_data, nproc):
    bad_step = 5 if nproc is None else 4
    result = train("train_pretrain.py", nproc, job_args(tmp_path, pretrain_data, "--on_anomaly", "stop",
                                                        "--save_interval", "2", "--debug_inject", f"nan:{bad_step}"),
                   tmp_path, check=False)
    output = result.stdout + result.stderr
    if nproc is None:
        assert result.returncode == 3, output
    else:  # torchrun itself exits 1 and reports each worker's own exit code, rank by rank
        assert result.returncode != 0, output
        worker_exits = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", result.stderr)
        assert sorted(worker_exits) == [("0", "3"), ("1", "3")], output

    status = status_of(tmp_path)
    assert status["status"] == "failed" and status["anomaly_detected"] is True
    assert status["anomaly_reason"] == f"non-finite loss nan at step {bad_step}"
    assert events_of(tmp_path) == [("anomaly", bad_step)]

    newest = resume_file(tmp_path)
    assert newest["global_step"] == bad_step - 1 - (bad_step - 1) % 2  # the last save (every 2 steps) before it
    assert_all_finite(newest)

    trace = trace_of(tmp_path)
    assert not [r for r in trace if r["step"] == bad_step and r["samples"]], "the bad step was applied"
    assert max(r["step"] for r in trace) == bad_step - 1  # a stop leaves no record of the bad step


def test_nan_under_warn_is_skipped_and_never_reaches_the_weights(tmp_path, pretrain_data):
    train("train_pretrain.py", None,
          job_args(tmp_path, pretrain_data, "--on_anomaly", "warn", "--debug_inject", "nan:5"), tmp_path)
    status = status_of(tmp_path)
    assert (status["status"], status["current_step"], status["anomaly_reason"]) == (
        "completed", 19, "non-finite loss nan at step 5")
    final = resume_file(tmp_path)
    assert (final["epoch"], final["global_step"]) == (1, 19)
    assert_all_finite(final)

    [record] = [r for r in trace_of(tmp_path) if r["step"] == 5]
    assert record["skipped"] is True and record["samples"] == [] and len(record["skipped_samples"]) == 2
    assert record["anomaly"] == "non-finite loss nan at step 5"


def test_rollback_reloads_the_checkpoint_leaves_the_bad_window_out_and_trains_the_rest_once(tmp_path, pretrain_data):
    # Two ranks, global batch 4, a save every 2 steps: step 4 goes bad, the run returns to the
    # step-2 checkpoint, trains step 3 again, and leaves step 4's window out of the epoch.
    train("train_pretrain.py", 2, job_args(tmp_path, pretrain_data, "--on_anomaly", "rollback", "--save_interval", "2",
                                           "--debug_inject", "nan:4"), tmp_path)
    assert events_of(tmp_path) == [("anomaly", 4), ("rollback", 2)]
    status = status_of(tmp_path)
    assert (status["status"], status["current_step"]) == ("completed", 9)  # 33 samples left: one step fewer

    trace = trace_of(tmp_path)
    retrained = collections.defaultdict(list)
    for record in trace:
        if record["step"] == 3:
            retrained[record["rank"]].append(record)
    assert sorted(retrained) == [0, 1]
    for rank, (before, after) in retrained.items():  # the rollback restored weights and RNG exactly
        assert before["samples"] == after["samples"] and before["loss"] == after["loss"], f"rank {rank}"

    final_records = last_record_per_step_and_rank(trace)
    assert not any(r.get("skipped") for r in final_records)  # nothing trained at LR 0: the window is not trained
    bad_window = set(epoch_order(seed=42, epoch=0, num_samples=37)[12:16].tolist())  # step 4's: samples 12-15
    trained = collections.Counter(i for r in final_records for i in r["samples"])
    assert set(trained) == set(range(37)) - bad_window
    assert set(trained.values()) == {1}, "a sample was trained twice"
    final = resume_file(tmp_path)
    assert (final["epoch"], final["samples_consumed"], final["global_step"]) == (1, 0, 9)
    assert final["anomaly"]["rollbacks"] == 1 and final["anomaly"]["left_out"] == [[0, 12, 16]]
    assert_all_finite(final)


def test_an_older_checkpoints_window_stepped_over_is_left_out_on_resume(tmp_path, pretrain_data):
    # Before windows were left out, a checkpoint named each bad window by its start: (epoch, cursor), one global
    # batch long. A resume reads it as the span of that run's global batch (here 2 samples a step).
    train("train_pretrain.py", None, job_args(tmp_path, pretrain_data, "--max_steps", "2"), tmp_path)
    state = resume_file(tmp_path)
    state["anomaly"] = {**{k: v for k, v in state["anomaly"].items() if k != "left_out"}, "skip_windows": [[0, 10]]}
    run = RunSpec(state["train_args"], state["data_fingerprint"], 37, 2, {})
    checked = checked_for_resume({**state, "resumed_from": "step_2.pth"}, LMConfig.from_dict(state["lm_config"]),
                                 run, lambda message: None)
    assert checked["anomaly"]["left_out"] == [[0, 10, 12]] and "skip_windows" not in checked["anomaly"]


def test_resume_keeps_the_rollback_count_and_still_leaves_the_bad_window_out(tmp_path, pretrain_data):
    # One process, 2 samples a step, a save every 2 steps. Step 6 goes bad: back to step 4, step 5
    # trained again, then --max_steps 6 (steps 1-5 and the retrained 5) stops the run before it
    # reaches the bad window again. The resumed run, without --debug_inject, must leave it out.
    args = job_args(tmp_path, pretrain_data, "--on_anomaly", "rollback", "--save_interval", "2")
    train("train_pretrain.py", None, [*args, "--debug_inject", "nan:6", "--max_steps", "6"], tmp_path)
    first_trace = trace_of(tmp_path)
    assert [r["step"] for r in first_trace] == [1, 2, 3, 4, 5, 5]  # step 6 rolled back before it was recorded
    bad_window = epoch_order(seed=42, epoch=0, num_samples=37)[10:12].tolist()  # step 6 of 2 samples
    saved = resume_file(tmp_path)
    assert (saved["global_step"], saved["samples_consumed"]) == (5, 12)  # the cursor already past the bad window
    guard = saved["anomaly"]
    assert guard["rollbacks"] == 1 and guard["lr_scale"] == 1.0
    assert guard["left_out"] == [[0, 10, 12]]  # epoch 0, samples 10-11 of its order (step 6's window)
    retrained_step_5 = [r for r in first_trace if r["step"] == 5][-1]
    assert guard["detector"]["losses"][-1] == retrained_step_5["global_loss"]  # the detector's history came along

    resumed_trace = tmp_path / "resumed_trace.jsonl"
    train("train_pretrain.py", None, [*args, "--from_resume", "1", "--save_debug_train_output", str(resumed_trace)],
          tmp_path)
    resumed = read_trace(resumed_trace)
    next_window = epoch_order(seed=42, epoch=0, num_samples=37)[12:14].tolist()
    assert resumed[0]["step"] == 6 and resumed[0]["samples"] == next_window  # the samples after the bad window
    assert [r["step"] for r in resumed] == list(range(6, 19)) and not any(r.get("skipped") for r in resumed)

    final_records = last_record_per_step_and_rank(first_trace + resumed)
    trained = collections.Counter(i for r in final_records for i in r["samples"])
    assert set(trained) == set(range(37)) - set(bad_window)
    assert set(trained.values()) == {1}, "a sample was trained twice"
    assert events_of(tmp_path) == [("anomaly", 6), ("rollback", 4), ("resume", 5)]
    status = status_of(tmp_path)
    assert (status["status"], status["current_step"], status["anomaly_detected"]) == ("completed", 18, True)  # 35 samples left
    assert resume_file(tmp_path)["anomaly"]["rollbacks"] == 1


def test_rollbacks_are_bounded_by_max_rollbacks(tmp_path, pretrain_data):
    result = train("train_pretrain.py", None, job_args(tmp_path, pretrain_data, "--on_anomaly", "rollback",
                                                       "--max_rollbacks", "1", "--save_interval", "2",
                                                       "--debug_inject", "nan:5,nan:9"), tmp_path, check=False)
    assert result.returncode == 3, result.stdout + result.stderr
    assert events_of(tmp_path) == [("anomaly", 5), ("rollback", 4), ("anomaly", 9)]
    status = status_of(tmp_path)
    assert status["status"] == "failed"
    assert status["anomaly_reason"] == "non-finite loss nan at step 9; giving up after 1 rollbacks (--max_rollbacks)"
    newest = resume_file(tmp_path)
    assert newest["global_step"] == 8 and newest["anomaly"]["rollbacks"] == 1
    assert_all_finite(newest)


def test_injected_spike_is_reported_under_warn_and_the_run_finishes(tmp_path, pretrain_data):
    # The detector needs 5 normal steps of history before it can call anything a spike.
    train("train_pretrain.py", None, job_args(tmp_path, pretrain_data, "--on_anomaly", "warn", "--debug_inject",
                                              "spike:8"), tmp_path)
    status = status_of(tmp_path)
    assert (status["status"], status["current_step"]) == ("completed", 19)
    assert re.match(r"(loss spike|grad norm explosion) at step 8\b", status["anomaly_reason"]), status
    assert events_of(tmp_path) == [("anomaly", 8)]
    trace = trace_of(tmp_path)
    [spiked] = [r for r in trace if r["step"] == 8]
    assert spiked["samples"] and "skipped" not in spiked  # finite, so warn applies it (clipped)
    others = sorted(r["grad_norm"] for r in trace if r["step"] != 8)
    assert spiked["grad_norm"] > 100 * others[len(others) // 2]  # the norm before clipping to --grad_clip
    assert all(math.isfinite(r["loss"]) for r in trace)


# ---- a run whose every step is skipped ------------------------------------------------------------

def test_under_warn_skipped_steps_in_a_row_stop_the_run_and_an_applied_step_starts_the_count_again():
    from trainer.hardening.anomaly import AnomalyGuard
    guard = AnomalyGuard("warn", patience=0, max_rollbacks=3, lr_factor=1.0, max_skipped=3)
    nan = float("nan")
    verdicts = [guard.verdict(step, loss, 1.0, True)[0] for step, loss in enumerate([2.0, nan, nan, 2.0, nan], 1)]
    assert verdicts == ["apply", "skip", "skip", "apply", "skip"]  # step 4 was applied: the count starts again
    restored = AnomalyGuard("warn", patience=0, max_rollbacks=3, lr_factor=1.0, max_skipped=3)
    restored.load_state_dict(guard.state_dict())  # a resume keeps the count, as an uninterrupted run would
    assert restored.verdict(6, 1.0, float("inf"), True)[0] == "skip"
    action, reason = restored.verdict(7, nan, nan, True)
    assert action == "stop"
    assert reason.startswith("not training: the last 3 steps (5 to 7) were all non-finite and skipped"), reason
    assert "weights have not changed since step 4" in reason and "--learning_rate" in reason


def test_under_fp16_a_step_the_gradient_scaler_skipped_is_a_skip_without_a_warning_or_a_count():
    from trainer.hardening.anomaly import AnomalyGuard
    guard = AnomalyGuard("warn", patience=0, max_rollbacks=3, lr_factor=1.0, max_skipped=2)
    # GradScaler found an inf gradient and skipped the step (the loss finite): routine, its scale goes down
    assert [guard.verdict(step, 2.0, float("inf"), False) for step in (1, 2, 3)] == [("skip", "")] * 3
    assert guard.skipped_in_a_row == 0  # three in a row, max_skipped 2: not a run that stopped training
    assert guard.verdict(4, float("nan"), float("nan"), False)[0] == "skip"  # a non-finite loss is an anomaly
    assert guard.skipped_in_a_row == 1


def test_a_learning_rate_that_makes_every_step_non_finite_stops_the_run_with_exit_3_and_what_to_try(
        tmp_path, pretrain_data):
    # --learning_rate 1e30 is finite, so the flag check lets it through; step 1 is applied, and every step after it
    # is non-finite and skipped. Batch 1: 37 steps, and the default --max_skipped_steps 20 stops the run at step 21.
    result = train("train_pretrain.py", None, run_args(tmp_path, pretrain_data, "--batch_size", "1",
                                                       "--learning_rate", "1e30", "--save_interval", "10"),
                   tmp_path, check=False)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]  # it was 0, after 37 useless steps
    [line] = [line for line in result.stdout.splitlines() if line.startswith("stopping on anomaly:")]
    assert line.startswith("stopping on anomaly: not training: the last 20 steps (2 to 21) were all non-finite"), line
    assert "Try a lower --learning_rate" in line and "Traceback" not in result.stderr
    status = status_of(tmp_path)
    assert (status["status"], status["anomaly_step"]) == ("failed", 21)
    trace = trace_of(tmp_path)
    assert [r["step"] for r in trace if r.get("skipped")] == list(range(2, 21))  # step 21 stopped the run unrecorded
    # The saves at steps 10 and 20 hold the same weights: no skipped step changed them.
    assert resume_file(tmp_path)["global_step"] == 20
    at_10, at_20 = history_file(tmp_path, 10)["model"], history_file(tmp_path, 20)["model"]
    assert all(torch.equal(at_10[key], at_20[key]) for key in at_10)


# ---- every stage: the injection reaches what the stage's loss is computed from ----------------------

def stage_run(stage: str, run_dir, request) -> tuple[str, str, list[str]]:
    """(script, run name, flags) of a tiny run of `stage` under `run_dir`, its start weights written to its out/."""
    from test_distillation_runs import distill_args
    from test_dpo import sum_pairs, write_jsonl
    from test_dpo_runs import dpo_args
    from test_grpo import sum_questions
    from test_grpo_runs import grpo_args
    from lora_files import tiny_config, write_base
    if stage == "pretrain":
        return "train_pretrain.py", "pretrain_32", run_args(run_dir, request.getfixturevalue("pretrain_data"))
    if stage == "sft":
        return "train_full_sft.py", "full_sft_32", run_args(run_dir, request.getfixturevalue("sft_data"),
                                                            "--from_weight", "none")
    if stage == "lora":
        write_base(run_dir / "out", tiny_config())
        return "train_lora.py", "lora_demo_32", run_args(run_dir, request.getfixturevalue("sft_data"))
    if stage == "dpo":
        return "train_dpo.py", "dpo_32", dpo_args(run_dir, write_jsonl(run_dir.parent / "pairs.jsonl", sum_pairs(11)))
    if stage == "grpo":
        return "train_grpo.py", "grpo_32", grpo_args(run_dir, write_jsonl(run_dir.parent / "prompts.jsonl",
                                                                         sum_questions(11)))
    return "train_distillation.py", "distill_32", distill_args(run_dir, request.getfixturevalue("sft_data"))


# Pretraining and LoRA meet an injected NaN in the default run too (above; tests/test_lora.py): theirs here are slow.
@pytest.mark.parametrize("stage", [pytest.param("pretrain", marks=SLOW), "sft", pytest.param("lora", marks=SLOW), "dpo",
                                   "grpo", "distillation"])
def test_an_injected_nan_is_seen_by_the_anomaly_policy_in_every_stage(tmp_path, request, stage):
    """Distillation's loss is computed from the logits, outside the model: the injection scaled a loss that is None
    there, and step 2 trained as if nothing were injected. Now it stops every stage, before any save holds it."""
    script, name, flags = stage_run(stage, tmp_path / "run", request)
    result = train(script, None, [*flags, "--batch_size", "2", "--on_anomaly", "stop", "--debug_inject", "nan:2",
                                  "--max_steps", "3"], tmp_path, check=False)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    status = status_of(tmp_path / "run", name)
    assert (status["status"], status["anomaly_reason"]) == ("failed", "non-finite loss nan at step 2"), status
    assert [r["step"] for r in trace_of(tmp_path / "run")] == [1]  # step 1 trained; step 2 stopped the run

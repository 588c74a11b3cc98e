"""What the loop does with a bad step (--on_anomaly warn/stop/rollback), on real CPU runs.

`--debug_inject nan:K` makes step K's loss NaN and `spike:K` makes it 1e4 times larger, so each
policy can be watched on a real `python` or `torchrun` (gloo) process. The 37-sample file with
batch 2 gives 19 steps on one process and 10 steps (global batch 4) on two ranks.
"""

from __future__ import annotations

import collections
import math
import re

import pytest
import torch

from conftest import read_trace, train

from trainer.metrics_files import read_status, status_path


def run_args(tmp_path, data, *extra) -> list[str]:
    return ["--data_path", str(data), "--save_dir", str(tmp_path / "out"), "--checkpoint_dir",
            str(tmp_path / "ckpt"), "--metrics_dir", str(tmp_path / "metrics"), "--save_debug_train_output",
            str(tmp_path / "trace.jsonl"), "--batch_size", "2", "--epochs", "1", "--log_interval", "1", *extra]


def resume_file(tmp_path) -> dict:
    return torch.load(tmp_path / "ckpt" / "pretrain_32_resume.pth", weights_only=True)


def assert_all_finite(state: dict) -> None:
    """Every model weight and every AdamW moment: a NaN update would poison both."""
    for key, tensor in state["model"].items():
        assert torch.isfinite(tensor).all(), f"model tensor {key} is not finite"
    for index, moments in state["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.isfinite(torch.as_tensor(value)).all(), f"optimizer state {index}.{key} is not finite"


def last_record_per_step_and_rank(trace: list[dict]) -> list[dict]:
    """A rollback retrains steps, so they appear twice in the trace; the later record is the one that counts."""
    last = {}
    for record in trace:
        last[record["step"], record["rank"]] = record
    return list(last.values())


@pytest.mark.parametrize("nproc", [None, 2], ids=["python", "torchrun2"])
def test_nan_under_stop_exits_3_names_the_reason_and_keeps_the_last_good_checkpoint(tmp_path, pretrain_data, nproc):
    bad_step = 5 if nproc is None else 4
    result = train("train_pretrain.py", nproc, run_args(tmp_path, pretrain_data, "--on_anomaly", "stop",
                                                        "--save_interval", "2", "--debug_inject", f"nan:{bad_step}"),
                   tmp_path, check=False)
    output = result.stdout + result.stderr
    if nproc is None:
        assert result.returncode == 3, output
    else:  # torchrun itself exits 1 and reports each worker's own exit code, rank by rank
        assert result.returncode != 0, output
        worker_exits = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", result.stderr)
        assert sorted(worker_exits) == [("0", "3"), ("1", "3")], output
    assert f"non-finite loss nan at step {bad_step}" in result.stdout
    assert "stopping on anomaly" in result.stdout

    status = read_status(status_path(tmp_path / "metrics", "pretrain_32"))
    assert status["state"] == "failed"
    assert f"non-finite loss nan at step {bad_step}" in status["anomaly"]["reason"]

    newest = resume_file(tmp_path)
    assert newest["global_step"] == bad_step - 1 - (bad_step - 1) % 2  # the last save (every 2 steps) before it
    assert_all_finite(newest)

    trace = read_trace(tmp_path / "trace.jsonl")
    assert not [r for r in trace if r["step"] == bad_step and r["samples"]], "the bad step was applied"
    assert max(r["step"] for r in trace) == bad_step - 1


def test_nan_under_warn_is_skipped_and_never_reaches_the_weights(tmp_path, pretrain_data):
    result = train("train_pretrain.py", None, run_args(tmp_path, pretrain_data, "--on_anomaly", "warn",
                                                       "--debug_inject", "nan:5"), tmp_path)
    assert "anomaly: non-finite loss nan at step 5 (--on_anomaly warn: skip)" in result.stdout
    assert "training finished at step 19" in result.stdout
    final = resume_file(tmp_path)
    assert (final["epoch"], final["global_step"]) == (1, 19)
    assert_all_finite(final)

    [record] = [r for r in read_trace(tmp_path / "trace.jsonl") if r["step"] == 5]
    assert record["skipped"] is True and record["samples"] == []
    assert len(record["skipped_samples"]) == 2


def test_rollback_reloads_the_checkpoint_skips_the_bad_window_and_trains_the_rest_once(tmp_path, pretrain_data):
    # Two ranks, global batch 4, a save every 2 steps: step 4 goes bad, the run returns to the
    # step-2 checkpoint, trains step 3 again, and steps over step 4's window.
    result = train("train_pretrain.py", 2, run_args(tmp_path, pretrain_data, "--on_anomaly", "rollback",
                                                    "--save_interval", "2", "--debug_inject", "nan:4"), tmp_path)
    assert "rollback 1/3: back to step 2" in result.stdout
    assert "training finished at step 10" in result.stdout

    trace = read_trace(tmp_path / "trace.jsonl")
    retrained = collections.defaultdict(list)
    for record in trace:
        if record["step"] == 3:
            retrained[record["rank"]].append(record)
    for rank, (before, after) in retrained.items():  # the rollback restored weights and RNG exactly
        assert before["samples"] == after["samples"] and before["loss"] == after["loss"], f"rank {rank}"

    final_records = last_record_per_step_and_rank(trace)
    skipped = [r for r in final_records if r.get("skipped")]
    assert {r["step"] for r in skipped} == {4} and len(skipped) == 2  # one record per rank
    skipped_samples = {i for r in skipped for i in r["skipped_samples"]}
    assert len(skipped_samples) == 4 and all(r["samples"] == [] for r in skipped)

    trained = collections.Counter(i for r in final_records for i in r["samples"])
    assert set(trained) == set(range(37)) - skipped_samples
    assert set(trained.values()) == {1}, "a sample was trained twice"
    final = resume_file(tmp_path)
    assert (final["epoch"], final["samples_consumed"]) == (1, 0)
    assert_all_finite(final)


def test_rollbacks_are_bounded_by_max_rollbacks(tmp_path, pretrain_data):
    result = train("train_pretrain.py", None, run_args(tmp_path, pretrain_data, "--on_anomaly", "rollback",
                                                       "--max_rollbacks", "1", "--save_interval", "2",
                                                       "--debug_inject", "nan:5,nan:9"), tmp_path, check=False)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "rollback 1/1: back to step 4" in result.stdout
    assert "non-finite loss nan at step 9; giving up after 1 rollbacks" in result.stdout
    assert read_status(status_path(tmp_path / "metrics", "pretrain_32"))["state"] == "failed"
    newest = resume_file(tmp_path)
    assert newest["global_step"] == 8
    assert_all_finite(newest)


def test_injected_spike_is_reported_under_warn_and_the_run_finishes(tmp_path, pretrain_data):
    # The detector needs 5 normal steps of history before it can call anything a spike.
    result = train("train_pretrain.py", None, run_args(tmp_path, pretrain_data, "--on_anomaly", "warn",
                                                       "--debug_inject", "spike:8"), tmp_path)
    assert re.search(r"anomaly: (loss spike|grad norm explosion) at step 8\b", result.stdout), result.stdout
    assert "training finished at step 19" in result.stdout
    status = read_status(status_path(tmp_path / "metrics", "pretrain_32"))
    assert status["state"] == "completed" and "at step 8" in status["anomaly"]["reason"]
    trace = read_trace(tmp_path / "trace.jsonl")
    [spiked] = [r for r in trace if r["step"] == 8]
    assert spiked["samples"] and "skipped" not in spiked  # finite, so warn applies it (clipped)
    assert all(math.isfinite(r["loss"]) for r in trace)

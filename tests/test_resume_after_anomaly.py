"""A run that logged a non-finite number resumes, and every reader of its files copes with it.

JSON has no NaN or infinity: the metrics and status files write them as "NaN", "Infinity" and
"-Infinity" (trainer/hardening/metrics_files.py) and the readers turn them back into floats. A resume
reads the metrics file to cut it back to its checkpoint; a NaN loss or an inf grad norm must not stop
it. The 37-sample file with batch 2 gives 19 steps per epoch, 38 over the two epochs here (37 after a
rollback, which leaves the bad window's 2 samples out).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import metrics_of, run_args, status_of, train
from scripts.compare_runs import compare_traces
from scripts.plot_metrics import plot_metrics
from scripts.run_files import read_status
from scripts.watch_run import render_summary
from trainer.hardening.metrics_files import MetricsFileWriter, is_train_record, read_metrics, status_path

TOTAL_STEPS = {"nan_loss": 38, "inf_grad_norm": 38, "rollback": 37}

# Loaded at start-up by the first invocation of the inf case (its folder goes on PYTHONPATH): the grad
# norm of one optimizer step comes back inf, as after an overflow. The guard skips that step (warn).
INF_GRAD_NORM_SITECUSTOMIZE = '''
import os
import torch

at_step, calls, clip = int(os.environ["INF_GRAD_NORM_AT_STEP"]), [0], torch.nn.utils.clip_grad_norm_


def clip_with_overflow(*args, **kwargs):
    norm = clip(*args, **kwargs)
    calls[0] += 1  # one call per optimizer step, from step 1
    return torch.full_like(norm, float("inf")) if calls[0] == at_step else norm


torch.nn.utils.clip_grad_norm_ = clip_with_overflow
'''

CASES = {  # flags of both invocations, the anomaly it reports, the numbers logged not finite at a step
    "nan_loss": (["--debug_inject", "nan:10"], "non-finite loss nan at step 10", {10: ("loss", "grad_norm")}),
    "inf_grad_norm": ([], "non-finite grad norm inf at step 10", {10: ("grad_norm",)}),
    # The NaN step itself is cut back by the rollback, and its window left out: every number logged is finite.
    "rollback": (["--on_anomaly", "rollback", "--save_interval", "4", "--debug_inject", "nan:6"],
                 "non-finite loss nan at step 6", {}),
}


def reject_bare_constant(name: str):
    raise ValueError(f"bare {name} in the file: not JSON")


def assert_strict_json_to_the_end(path: Path) -> None:
    """Every line of the metrics file `path` is JSON a strict reader (jq, a browser) accepts, the last one whole."""
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    for number, line in enumerate(text.splitlines(), 1):
        assert isinstance(json.loads(line, parse_constant=reject_bare_constant), dict), f"{path}, line {number}"


def assert_strict_json(path: Path) -> None:
    """The status file `path` is one JSON object a strict reader accepts."""
    assert isinstance(json.loads(path.read_text(encoding="utf-8"), parse_constant=reject_bare_constant), dict)


@pytest.mark.parametrize("case", CASES)
def test_a_run_resumes_after_a_non_finite_step_and_its_metrics_read_to_the_end(tmp_path, pretrain_data, case):
    flags, reason, non_finite = CASES[case]
    args = run_args(tmp_path, pretrain_data, "--batch_size", "2", "--epochs", "2", *flags)
    env = {}
    if case == "inf_grad_norm":
        (tmp_path / "overflow").mkdir()
        (tmp_path / "overflow" / "sitecustomize.py").write_text(INF_GRAD_NORM_SITECUSTOMIZE)
        env = {"PYTHONPATH": tmp_path / "overflow", "INF_GRAD_NORM_AT_STEP": 10}
    train("train_pretrain.py", None, [*args, "--max_steps", "12"], tmp_path, **env)
    assert status_of(tmp_path)["anomaly_reason"] == reason

    train("train_pretrain.py", None, [*args, "--from_resume", "1"], tmp_path)  # it exits 0

    metrics_file = tmp_path / "metrics" / "pretrain_32_metrics.jsonl"
    assert_strict_json_to_the_end(metrics_file)
    assert_strict_json(status_path(tmp_path / "metrics", "pretrain_32"))
    records = metrics_of(tmp_path)
    assert len(records) == len(metrics_file.read_text().splitlines())  # no line skipped as unreadable
    train_records = [r for r in records if is_train_record(r)]
    assert [r["step"] for r in train_records] == list(range(1, TOTAL_STEPS[case] + 1))
    for record in train_records:  # the non-finite numbers read back as floats, the others are finite
        for key in ("loss", "grad_norm"):
            assert isinstance(record[key], float), (record["step"], key, record[key])
            assert math.isfinite(record[key]) == (key not in non_finite.get(record["step"], ())), record
    if case == "inf_grad_norm":
        assert train_records[9]["grad_norm"] == math.inf
    status = status_of(tmp_path)
    assert (status["status"], status["current_step"], status["anomaly_reason"]) == ("completed", TOTAL_STEPS[case], reason)
    assert math.isfinite(status["best_loss"])

    summary = render_summary(status, records)  # scripts/watch_run.py
    assert f"step {TOTAL_STEPS[case]}/{TOTAL_STEPS[case]}" in summary and reason in summary
    assert plot_metrics(read_metrics(metrics_file), tmp_path / "curves.png").stat().st_size > 1000


def test_a_metrics_file_of_an_older_version_with_null_losses_resumes(tmp_path):
    """Older versions wrote a NaN or inf as null: a resume over such a file must not fail on it either."""
    (tmp_path / "run_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "epoch": 0, "loss": 3.0, "grad_norm": 1.0, "timestamp": 1.0},
        {"event": "anomaly", "step": 2, "reason": "non-finite loss nan at step 2", "timestamp": 2.0},
        {"step": 2, "epoch": 0, "loss": None, "grad_norm": None, "timestamp": 2.1},
        {"step": 3, "epoch": 0, "loss": 2.5, "grad_norm": 1.0, "timestamp": 3.0},
        {"step": 4, "epoch": 0, "loss": None, "grad_norm": None, "timestamp": 4.0}]))
    writer = MetricsFileWriter(str(tmp_path), "run")
    writer.begin(start_step=4, total_steps=10)
    writer.finish("stopped", 4)
    status = read_status(tmp_path / "run_status.json")
    assert (status["best_loss"], status["best_step"]) == (2.5, 3)
    assert status["latest_metrics"]["loss"] is None  # kept as it was written
    assert "best loss 2.5000 at step 3" in render_summary(status, read_metrics(tmp_path / "run_metrics.jsonl"))


def test_non_finite_numbers_round_trip_through_the_metrics_and_status_files(tmp_path):
    writer = MetricsFileWriter(str(tmp_path), "run")
    writer.begin(start_step=0, total_steps=10)
    numbers = {1: (3.0, 1.0), 2: (math.nan, math.nan), 3: (math.inf, -math.inf), 4: (2.0, math.inf)}
    for step, (loss, grad_norm) in numbers.items():
        writer.log({"step": step, "epoch": 0, "loss": loss, "grad_norm": grad_norm, "lr": 1e-3}, total_steps=10)
    writer.validation(4, math.nan)
    writer.finish("stopped", 4)
    assert_strict_json_to_the_end(tmp_path / "run_metrics.jsonl")
    assert_strict_json(tmp_path / "run_status.json")
    records = read_metrics(tmp_path / "run_metrics.jsonl")
    read_back = {r["step"]: (r["loss"], r["grad_norm"]) for r in records if is_train_record(r)}
    assert {step: tuple(map(repr, pair)) for step, pair in read_back.items()} == \
        {step: tuple(map(repr, pair)) for step, pair in numbers.items()}  # repr: NaN equals itself only so
    assert math.isnan(records[-1]["val/loss"])
    status = read_status(tmp_path / "run_status.json")
    assert status["latest_metrics"]["grad_norm"] == math.inf and math.isnan(status["latest_val"]["val/loss"])
    assert (status["best_loss"], status["best_step"]) == (2.0, 4)

    resumed = MetricsFileWriter(str(tmp_path), "run")  # the resume reads all of it back and cuts it at step 3
    resumed.begin(start_step=3, total_steps=10)
    kept = read_metrics(tmp_path / "run_metrics.jsonl")
    assert [r["step"] for r in kept if is_train_record(r)] == [1, 2, 3] and kept[-1]["event"] == "resume"
    assert kept[2]["loss"] == math.inf and kept[2]["grad_norm"] == -math.inf
    assert_strict_json_to_the_end(tmp_path / "run_metrics.jsonl")
    text = render_summary(read_status(tmp_path / "run_status.json"), kept)
    assert "loss inf" in text and "best loss 3.0000 at step 1" in text


def test_traces_that_both_skipped_a_step_compare_equal():
    """A NaN step (skipped by the guard) is NaN in both traces of two identical runs: that is agreement."""
    def trace(loss_at_2: float) -> dict:
        return {(step, 0): {"step": step, "rank": 0, "world_size": 1, "epoch": 0, "samples": [step],
                            "loss": loss, "loss_sum": loss, "local_tokens": 1}
                for step, loss in ((1, 3.0), (2, loss_at_2), (3, math.inf))}
    assert compare_traces(trace(math.nan), trace(math.nan))[0]
    assert compare_traces(trace(math.nan), trace(math.nan), atol=1e-6)[0]
    same, line = compare_traces(trace(math.nan), trace(2.0))
    assert not same and "step 2" in line

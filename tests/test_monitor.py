"""The anomaly detector and guard on constructed curves, and the metrics/status files of MetricsFileWriter."""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time
from types import SimpleNamespace

import pytest

from trainer.hardening.anomaly import AnomalyDetector, AnomalyGuard
from scripts.run_files import STATUS_FIELDS, read_status
from trainer.hardening.metrics_files import MetricsFileWriter, is_train_record, read_metrics


# ---- AnomalyDetector ----

def feed(detector: AnomalyDetector, losses: list[float], grad_norm: float = 1.0, first_step: int = 1) -> list:
    return [detector.check(first_step + i, loss, grad_norm) for i, loss in enumerate(losses)]


def test_spike_is_flagged_and_the_next_normal_step_is_not():
    detector = AnomalyDetector()
    assert feed(detector, [2.0, 2.02, 1.98, 2.01, 1.99, 2.0, 2.01, 1.99]) == [None] * 8
    reason = detector.check(9, 5.0, 1.0)
    assert reason is not None and "spike" in reason and "step 9" in reason and "5.0000" in reason
    assert detector.check(10, 2.0, 1.0) is None  # the spike did not enter the statistics


def test_noisy_decreasing_curve_gives_no_false_positives():
    rng = random.Random(0)
    detector = AnomalyDetector()
    for step in range(1, 201):
        loss = 1.5 + 4.0 * math.exp(-step / 40) + rng.gauss(0, 0.03)
        grad_norm = 1.0 * math.exp(rng.gauss(0, 0.3))
        assert detector.check(step, loss, grad_norm) is None, f"false positive at step {step}"


@pytest.mark.parametrize("loss, grad_norm, words", [
    (float("nan"), 1.0, "non-finite loss nan at step 12"),
    (float("inf"), 1.0, "non-finite loss inf at step 12"),
    (2.0, float("nan"), "non-finite grad norm nan at step 12"),
    (2.0, float("inf"), "non-finite grad norm inf at step 12"),
])
def test_non_finite_values_are_flagged_even_without_history(loss, grad_norm, words):
    assert AnomalyDetector().check(12, loss, grad_norm) == words


def test_grad_norm_explosion_is_flagged():
    detector = AnomalyDetector()
    for step, norm in enumerate([0.9, 1.1, 1.0, 0.95, 1.05, 1.0], start=1):
        assert detector.check(step, 2.0, norm) is None
    assert detector.check(7, 2.0, 9.0) is None  # 9x the median: large, but under the 10x limit
    reason = detector.check(8, 2.0, 50.0)
    assert reason is not None and "explosion" in reason and "step 8" in reason
    assert detector.check(9, 2.0, 1.0) is None


def test_plateau_is_flagged_after_exactly_patience_flat_steps():
    detector = AnomalyDetector(patience=4)
    assert detector.check(1, 2.0, 1.0) is None  # sets the best
    # 0.05% better is below the 0.1% bar, so these count as not improving
    results = feed(detector, [2.0, 1.999, 2.0005, 2.0], first_step=2)
    assert results[:3] == [None, None, None]
    assert results[3] is not None and "plateau" in results[3] and "step 5" in results[3]
    # the counter restarts: the next report comes another `patience` checks later
    assert feed(detector, [2.0, 2.0, 2.0], first_step=6) == [None] * 3
    assert detector.check(9, 2.0, 1.0) is not None


def test_no_plateau_while_the_loss_keeps_improving():
    detector = AnomalyDetector(patience=3)
    assert feed(detector, [3.0 * 0.99 ** i for i in range(50)]) == [None] * 50


def test_no_plateau_check_when_patience_is_zero():
    assert feed(AnomalyDetector(), [2.0] * 100) == [None] * 100


def test_state_dict_round_trip_keeps_the_statistics():
    detector = AnomalyDetector(patience=5)
    feed(detector, [2.0, 2.02, 1.98, 2.01, 1.99, 2.0])
    state = json.loads(json.dumps(detector.state_dict()))  # plain types only
    restored = AnomalyDetector(patience=5)
    restored.load_state_dict(state)
    assert restored.state_dict() == detector.state_dict()
    assert "spike" in restored.check(7, 5.0, 1.0)


def test_guard_state_round_trip_keeps_rollbacks_lr_scale_and_the_windows_left_out():
    guard = AnomalyGuard("rollback", patience=0, max_rollbacks=2, lr_factor=0.5, max_skipped=20)
    for step, loss in enumerate([2.0, 2.02, 1.98, 2.01, 1.99, 2.0], start=1):
        assert guard.verdict(step, loss, 1.0, True) == ("apply", "")
    action, reason = guard.verdict(7, float("nan"), 1.0, True)
    assert action == "rollback" and "non-finite loss nan at step 7" in reason
    guard.plan_rollback(epoch=0, start=24, end=28)

    restored = AnomalyGuard("rollback", patience=0, max_rollbacks=2, lr_factor=0.5, max_skipped=20)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))  # plain types only
    assert (restored.rollbacks, restored.lr_scale) == (1, 0.5)
    assert restored.left_out == [(0, 24, 28)]
    assert "spike" in restored.verdict(8, 5.0, 1.0, True)[1]  # the detector's history came along
    guard.plan_rollback(epoch=1, start=8, end=12)
    restored.plan_rollback(epoch=1, start=8, end=12)
    assert restored.left_out == guard.left_out == [(0, 24, 28), (1, 8, 12)]
    # the rollback budget continues where it was: the third bad step stops the run
    assert restored.verdict(9, float("nan"), 1.0, True)[0] == "stop"


# ---- MetricsFileWriter ----

def fake_run(global_step: int, total: int = 20) -> SimpleNamespace:
    """The loop's position: the step, and the steps it has left to the run's end."""
    run = SimpleNamespace(global_step=global_step)
    run.steps_remaining = lambda: total - run.global_step
    return run


def metrics_at(step: int, loss: float | None = None) -> dict:
    return {"step": step, "epoch": 0, "samples_consumed": 8 * step, "loss": 3.0 - 0.1 * step if loss is None else loss,
            "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0, "eta_s": 10.0}


def log_steps(writer: MetricsFileWriter, run: SimpleNamespace, steps: range) -> None:
    for step in steps:
        run.global_step = step
        writer.log(metrics_at(step), total_steps=run.global_step + run.steps_remaining())


def test_fresh_run_writes_one_line_per_log_and_a_status_with_the_spec_fields(tmp_path):
    writer, run = MetricsFileWriter(str(tmp_path / "metrics"), "pretrain_32"), fake_run(0)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "pretrain_32_metrics.jsonl").write_text('{"step": 99, "loss": 1}\n')  # an older run
    writer.begin(run.global_step, run.global_step + run.steps_remaining())
    status = read_status(tmp_path / "metrics" / "pretrain_32_status.json")
    assert set(STATUS_FIELDS) <= set(status)
    assert (status["status"], status["current_step"], status["total_steps"]) == ("running", 0, 20)
    assert status["latest_metrics"] == {} and status["anomaly_detected"] is False and status["anomaly_reason"] is None
    assert re.fullmatch(r"pretrain_32-\d{8}-\d{6}", status["job_id"])
    log_steps(writer, run, range(1, 6))
    writer.validation(5, 2.7)

    records = read_metrics(tmp_path / "metrics" / "pretrain_32_metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 5]
    timestamps = [r["timestamp"] for r in records]
    assert timestamps == sorted(timestamps) and status["started"] <= timestamps[0]
    assert records[-1]["val/loss"] == 2.7
    assert records[0]["loss"] == pytest.approx(2.9) and records[0]["samples_consumed"] == 8
    status = read_status(tmp_path / "metrics" / "pretrain_32_status.json")
    assert (status["current_step"], status["total_steps"], status["epoch"]) == (5, 20, 0)
    assert status["latest_metrics"] == records[4]  # the last training line, timestamp included
    assert status["best_loss"] == pytest.approx(2.5) and status["best_step"] == 5
    assert status["latest_val"]["val/loss"] == 2.7 and status["anomaly_detected"] is False
    assert status["updated"] >= status["started"]


def test_resume_cuts_the_file_back_so_every_step_appears_once_and_keeps_the_job_id(tmp_path):
    first = MetricsFileWriter(str(tmp_path), "run")
    run = fake_run(0)
    first.begin(run.global_step, run.global_step + run.steps_remaining())
    log_steps(first, run, range(1, 11))
    first.finish("stopped", run.global_step)  # killed at 10, last checkpoint at step 6
    job_id = read_status(tmp_path / "run_status.json")["job_id"]

    second = MetricsFileWriter(str(tmp_path), "run")
    second.begin(start_step=6, total_steps=20)
    run = fake_run(6)
    log_steps(second, run, range(7, 13))

    records = read_metrics(tmp_path / "run_metrics.jsonl")
    train_steps = [r["step"] for r in records if "event" not in r]
    assert train_steps == list(range(1, 13))
    resumes = [r for r in records if r.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 6 and "timestamp" in resumes[0]
    assert [r["step"] for r in records].index(6) + 1 == records.index(resumes[0])  # right after step 6
    status = read_status(tmp_path / "run_status.json")
    assert status["resumed_from"] == 6 and status["current_step"] == 12 and status["job_id"] == job_id
    assert status["best_step"] == 12  # best recomputed from the kept steps, then updated

    MetricsFileWriter(str(tmp_path), "run").begin(start_step=0, total_steps=20)  # a fresh run of the same name
    assert read_status(tmp_path / "run_status.json")["resumed_from"] is None
    assert read_metrics(tmp_path / "run_metrics.jsonl") == []


def test_a_fresh_run_gets_a_new_job_id(tmp_path, monkeypatch):
    clock = [1_700_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    MetricsFileWriter(str(tmp_path), "run").begin(start_step=0, total_steps=20)
    assert read_status(tmp_path / "run_status.json")["job_id"] == "run-20231114-221320"
    clock[0] += 61
    MetricsFileWriter(str(tmp_path), "run").begin(start_step=0, total_steps=20)
    assert read_status(tmp_path / "run_status.json")["job_id"] == "run-20231114-221421"


def test_status_goes_running_then_completed_and_records_anomalies(tmp_path):
    writer, run = MetricsFileWriter(str(tmp_path), "run"), fake_run(0, total=3)
    writer.begin(run.global_step, run.global_step + run.steps_remaining())
    assert read_status(tmp_path / "run_status.json")["status"] == "running"
    log_steps(writer, run, range(1, 3))
    reason = "loss spike at step 2: 9.0 > 3.1"
    writer.anomaly(2, reason)
    status = read_status(tmp_path / "run_status.json")
    assert status["status"] == "running"
    assert (status["anomaly_detected"], status["anomaly_reason"], status["anomaly_step"]) == (True, reason, 2)
    log_steps(writer, run, range(3, 4))
    writer.finish("completed", run.global_step)
    status = read_status(tmp_path / "run_status.json")
    assert (status["status"], status["current_step"], status["total_steps"]) == ("completed", 3, 3)
    assert status["anomaly_detected"] is True  # still known at the end of the run
    [event] = [r for r in read_metrics(tmp_path / "run_metrics.jsonl") if "event" in r]
    assert (event["event"], event["step"], event["reason"]) == ("anomaly", 2, reason) and "timestamp" in event


def test_a_resumed_run_still_reports_the_anomaly_of_an_earlier_invocation(tmp_path):
    writer, run = MetricsFileWriter(str(tmp_path), "run"), fake_run(0)
    writer.begin(run.global_step, run.global_step + run.steps_remaining())
    log_steps(writer, run, range(1, 5))
    writer.anomaly(3, "loss spike at step 3")
    writer.finish("stopped", run.global_step)
    MetricsFileWriter(str(tmp_path), "run").begin(start_step=4, total_steps=20)
    status = read_status(tmp_path / "run_status.json")
    assert (status["anomaly_detected"], status["anomaly_reason"], status["anomaly_step"]) == (
        True, "loss spike at step 3", 3)


def test_unknown_end_status_is_refused(tmp_path):
    writer, run = MetricsFileWriter(str(tmp_path), "run"), fake_run(0)
    writer.begin(run.global_step, run.global_step + run.steps_remaining())
    with pytest.raises(ValueError, match="unknown run status"):
        writer.finish("finished", run.global_step)


def test_a_status_file_without_the_spec_fields_is_refused_naming_them(tmp_path):
    old = tmp_path / "run_status.json"
    old.write_text(json.dumps({"run_name": "run", "state": "running", "step": 3, "total_steps": 10, "latest": {}}))
    with pytest.raises(ValueError, match=r"run_status\.json: not a status file of this trainer, missing job_id, "
                                         r"status, current_step, anomaly_detected, anomaly_reason, latest_metrics"):
        read_status(old)


def test_status_file_is_always_valid_json_while_being_rewritten(tmp_path):
    """A reader polling the status file while the writer rewrites it never sees a partial file."""
    writer, run = MetricsFileWriter(str(tmp_path), "run"), fake_run(0, total=10_000)
    writer.begin(run.global_step, run.global_step + run.steps_remaining())
    path, stop, reads, problems = tmp_path / "run_status.json", threading.Event(), [0], []

    def poll() -> None:
        while not stop.is_set():
            try:
                json.loads(path.read_text())
                reads[0] += 1
            except (ValueError, OSError) as error:
                problems.append(repr(error))

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        log_steps(writer, run, range(1, 101))
    finally:
        stop.set()
        reader.join()
    assert problems == [] and reads[0] > 0
    assert not list(tmp_path.glob("*.tmp"))


def test_rollback_cuts_back_the_metrics_but_keeps_the_anomaly_that_caused_it(tmp_path):
    writer, run = MetricsFileWriter(str(tmp_path), "run"), fake_run(0)
    writer.begin(run.global_step, run.global_step + run.steps_remaining())
    log_steps(writer, run, range(1, 7))
    writer.anomaly(7, "non-finite loss nan at step 7")
    run.global_step = 4  # the checkpoint the loop rolled back to
    writer.rollback(4, total_steps=4 + run.steps_remaining())
    assert read_status(tmp_path / "run_status.json")["current_step"] == 4
    log_steps(writer, run, range(5, 9))
    records = read_metrics(tmp_path / "run_metrics.jsonl")
    steps = [r["step"] for r in records if is_train_record(r)]
    assert steps == list(range(1, 9))  # steps 5 and 6 were logged twice, kept once
    events = [(r["event"], r["step"]) for r in records if "event" in r]
    assert events == [("anomaly", 7), ("rollback", 4)]
    status = read_status(tmp_path / "run_status.json")
    assert status["anomaly_step"] == 7 and status["anomaly_reason"] == "non-finite loss nan at step 7"
    writer.log(metrics_at(9, loss=float("nan")), total_steps=20)  # written as "NaN": strict JSON stays valid
    assert json.loads((tmp_path / "run_metrics.jsonl").read_text().splitlines()[-1])["loss"] == "NaN"
    assert math.isnan(read_status(tmp_path / "run_status.json")["latest_metrics"]["loss"])

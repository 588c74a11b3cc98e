"""scripts/watch_run.py and scripts/plot_metrics.py on metrics files written by MetricsFileWriter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, child_env
from scripts.plot_metrics import REWARD_WINDOW, metrics_figure, plot_metrics, trailing_mean
from scripts.watch_run import render_summary
from scripts.run_files import STATUS_FIELDS
from trainer.hardening.metrics_files import MetricsFileWriter, read_metrics
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(metrics_dir: Path, name: str, resume_at: int | None = None, last_step: int = 12) -> None:
    """A run through the real writer: logs every step, validates every 4, optionally resumes once."""
    writer = MetricsFileWriter(str(metrics_dir), name)
    writer.begin(start_step=0, total_steps=40)
    for step in range(1, last_step + 1):
        if step == resume_at:  # the first invocation died; a new one starts from the checkpoint before it
            writer.finish("failed", step - 1)
            writer = MetricsFileWriter(str(metrics_dir), name)
            writer.begin(start_step=step - 1, total_steps=40)
        writer.log({"step": step, "epoch": 0, "samples_consumed": 4 * step, "loss": 4.0 / step ** 0.5,
                    "lr": 1e-3 * min(step / 4, 1.0), "grad_norm": 1.0 + 0.1 * step,
                    "tokens_per_s": 2500.0, "eta_s": 75.0}, total_steps=40)
        if step % 4 == 0:
            writer.validation(step, 4.2 / step ** 0.5)


def run_script(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m scripts.x ...` from the repository root, as the README shows."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=60)


def run_script_by_path(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python /path/to/scripts/x.py ...` from any directory, with nothing installed or on PYTHONPATH."""
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], cwd=cwd, env=child_env(),
                          capture_output=True, text=True, timeout=60)


def full_status(**fields) -> dict:
    """A status object with every field of the spec, as MetricsFileWriter writes it."""
    return {"job_id": "r-20260101-000000", "run_name": "r", "status": "running", "current_step": 3,
            "total_steps": 10, "anomaly_detected": False, "anomaly_reason": None, "latest_metrics": {},
            "updated": 0.0, **fields}


def test_render_summary_shows_the_key_numbers():
    status = full_status(job_id="pretrain_512-20260101-120000", run_name="pretrain_512", current_step=250,
                         total_steps=1000, epoch=1,
                         latest_metrics={"step": 250, "epoch": 1, "loss": 2.3456, "lr": 3e-4, "grad_norm": 0.812,
                                         "tokens_per_s": 12345.0, "eta_s": 3725.0, "mfu": 0.41, "timestamp": 999.0},
                         best_loss=2.2101, best_step=240, anomaly_detected=True,
                         anomaly_reason="loss spike at step 230", anomaly_step=230, updated=1000.0, started=0.0)
    assert set(STATUS_FIELDS) <= set(status)
    records = [{"step": 100, "event": "resume", "timestamp": 1.0}, {"step": 200, "val/loss": 2.5432, "timestamp": 2.0}]
    text = render_summary(status, records, now=1012.0)
    for expected in ("pretrain_512", "running", "job pretrain_512-20260101-120000", "250/1000", "25.0%", "epoch 2",
                     "ETA 1h02m05s", "2.3456", "3.00e-04", "0.812", "12345", "mfu 0.41",
                     "best loss 2.2101 at step 240", "val/loss 2.5432 at step 200", "resumes: 1 (at steps 100)",
                     "anomaly at step 230: loss spike at step 230", "0h00m12s ago"):
        assert expected in text, f"{expected!r} missing from:\n{text}"
    assert "WARNING" not in text


def test_render_summary_warns_when_a_running_job_goes_quiet():
    status = full_status()
    assert "WARNING: no update for 0h10m00s" in render_summary(status, [], now=600.0)
    finished = dict(status, status="completed")
    assert "WARNING" not in render_summary(finished, [], now=600.0)
    assert "anomaly: none" in render_summary(status, [], now=600.0)


def test_render_summary_shows_a_nan_loss_logged_as_null():
    status = full_status(latest_metrics={"step": 3, "loss": None, "lr": 1e-3, "grad_norm": None, "timestamp": 1.0})
    text = render_summary(status, [dict(status["latest_metrics"])], now=1.0)
    assert "latest (step 3): lr 1.00e-03" in text and "best loss -" in text


def test_watch_once_prints_the_run_by_module_and_by_path(tmp_path):
    write_run(tmp_path, "pretrain_32", resume_at=7)
    for result in (run_script("scripts.watch_run", str(tmp_path), "--once"),
                   run_script_by_path("watch_run.py", str(tmp_path), "--once", cwd=tmp_path)):
        assert result.returncode == 0, result.stderr
        assert "run pretrain_32: running" in result.stdout and "12/40" in result.stdout
        assert "resumes: 1 (at steps 6)" in result.stdout
        assert "\033[2J" not in result.stdout  # --once output is plain, fit for ssh and logs


def test_watch_refuses_a_status_file_without_the_spec_fields(tmp_path):
    (tmp_path / "old_status.json").write_text(json.dumps({"run_name": "old", "state": "running", "step": 3}))
    result = run_script("scripts.watch_run", str(tmp_path), "--once")
    assert result.returncode == 1
    assert "old_status.json: not a status file of this trainer, missing job_id, status" in result.stderr


@pytest.mark.parametrize("text, problem", [('{"job_id": "r", "status": "run', "it is not JSON (Unterminated string"),
                                           ('["job_id", "status"]', "it holds a JSON list, not an object")],
                         ids=["cut-short", "a-list"])
def test_watch_names_the_file_of_a_broken_status_file(tmp_path, text, problem):
    broken = tmp_path / "broken_status.json"
    broken.write_text(text)
    result = run_script("scripts.watch_run", str(tmp_path), "--once")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"error: {broken}: not a status file of this trainer, {problem}"), result.stderr


def test_watch_without_run_name_shows_the_newest_run_and_names_the_others(tmp_path):
    # The demo's out/: pretraining, then SFT; a third run whose status file was written first.
    for name, written_at in (("full_sft_32", 3_000), ("pretrain_32", 2_000), ("old_64", 1_000)):
        write_run(tmp_path, name)
        os.utime(tmp_path / f"{name}_status.json", (written_at, written_at))
    result = run_script("scripts.watch_run", str(tmp_path), "--once")
    assert result.returncode == 0, result.stderr
    first, rest = result.stdout.split("\n", 1)
    assert first == (f"{tmp_path} holds 3 runs; showing the newest, full_sft_32. Also there: old_64, pretrain_32 "
                     f"(pick one with --run_name NAME)")
    assert rest.startswith("run full_sft_32: running")
    os.utime(tmp_path / "pretrain_32_status.json", (4_000, 4_000))  # as a heartbeat of a resumed pretraining would
    assert "run pretrain_32: running" in run_script("scripts.watch_run", str(tmp_path), "--once").stdout
    chosen = run_script("scripts.watch_run", str(tmp_path), "--once", "--run_name", "old_64")
    assert chosen.returncode == 0 and chosen.stdout.startswith("run old_64: running")  # no line about the others
    missing = run_script("scripts.watch_run", str(tmp_path), "--once", "--run_name", "sft")
    assert missing.returncode == 1 and "runs there: full_sft_32, old_64, pretrain_32" in missing.stderr


def test_watch_on_a_directory_without_runs_says_so(tmp_path):
    result = run_script("scripts.watch_run", str(tmp_path), "--once")
    assert result.returncode != 0 and "no *_status.json" in result.stderr


def test_watch_stops_by_itself_when_the_run_has_ended(tmp_path):
    write_run(tmp_path, "done")
    (tmp_path / "done_status.json").write_text(json.dumps(full_status(run_name="done", status="completed",
                                                                      current_step=12, total_steps=12)))
    result = run_script("scripts.watch_run", str(tmp_path), "--interval", "0.1")  # no --once
    assert result.returncode == 0 and "run done: completed" in result.stdout


def test_plot_script_writes_a_png_with_resumes_and_validation(tmp_path):
    write_run(tmp_path, "pretrain_32", resume_at=7)
    records = read_metrics(tmp_path / "pretrain_32_metrics.jsonl")
    assert any(r.get("event") == "resume" for r in records) and any("val/loss" in r for r in records)
    assert all("step" in r and "timestamp" in r for r in records)
    out = tmp_path / "plots" / "curves.png"
    result = run_script("scripts.plot_metrics", str(tmp_path / "pretrain_32_metrics.jsonl"), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 1000 and out.read_bytes()[:8] == PNG_MAGIC
    by_path = run_script_by_path("plot_metrics.py", "pretrain_32_metrics.jsonl", cwd=tmp_path)  # default: beside it
    assert by_path.returncode == 0, by_path.stderr
    assert (tmp_path / "pretrain_32_metrics.png").read_bytes()[:8] == PNG_MAGIC


def test_plot_draws_val_bits_per_byte_in_a_panel_beside_the_loss_when_the_file_has_them(tmp_path):
    writer = MetricsFileWriter(str(tmp_path), "run")
    writer.begin(start_step=0, total_steps=8)
    for step in range(1, 9):
        writer.log({"step": step, "epoch": 0, "loss": 4.0 / step, "lr": 1e-3, "grad_norm": 1.0}, total_steps=8)
        if step % 4 == 0:
            writer.validation(step, 3.0 / step, 1.5 / step)
    records = read_metrics(tmp_path / "run_metrics.jsonl")
    loss_ax, bpb_ax, *_ = metrics_figure(records).axes
    assert bpb_ax.get_ylabel() == "val bits per byte" and len(metrics_figure(records).axes) == 4
    (line,) = bpb_ax.get_lines()
    assert list(line.get_xdata()) == [4, 8] and list(line.get_ydata()) == [1.5 / 4, 1.5 / 8]
    assert [label.get_text() for label in loss_ax.get_legend().get_texts()] == ["train loss", "val/loss"]
    older = [{k: v for k, v in r.items() if k != "val/bpb"} for r in records]  # a file written before val/bpb
    assert [ax.get_ylabel() for ax in metrics_figure(older).axes] == ["loss (nats per token)", "learning rate",
                                                                     "grad norm"]


def test_plot_draws_a_run_whose_loss_went_nan(tmp_path):
    records = [{"step": s, "loss": 2.0 / s, "lr": 1e-3, "grad_norm": 1.0, "timestamp": float(s)} for s in range(1, 6)]
    records[2].update(loss=None, grad_norm=None)  # a NaN step, as the writer stores it
    records.append({"event": "anomaly", "step": 3, "reason": "non-finite loss nan at step 3", "timestamp": 3.5})
    out = plot_metrics(records, tmp_path / "nan.png", "nan_run")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_a_grpo_runs_reward_is_drawn_as_logged_and_as_a_trailing_mean_over_its_finite_points():
    nan = float("nan")
    assert trailing_mean([1.0, nan, 3.0, 5.0, nan], 2) == [1.0, 1.0, 3.0, 4.0, 5.0]
    assert all(x != x for x in trailing_mean([nan, nan], 3))  # nothing finite in the window: a gap
    rewards = [0.2 * (step % 2) + step / 100 for step in range(1, 31)]  # a zigzag that rises
    records = [{"step": step, "loss": 0.0, "lr": 1e-4, "grad_norm": 1.0, "reward": reward, "no_signal": 0.5}
               for step, reward in zip(range(1, 31), rewards)]
    reward_ax = next(ax for ax in metrics_figure(records).axes if ax.get_ylabel() == "reward")
    lines = {line.get_label(): list(line.get_ydata()) for line in reward_ax.get_lines()}
    assert lines["reward"] == rewards
    mean = lines[f"reward, mean of the last {REWARD_WINDOW} points"]
    assert mean[9] == pytest.approx(sum(rewards[:10]) / 10) and mean[29] == pytest.approx(sum(rewards[20:]) / 10)


def test_plot_refuses_a_file_without_training_records(tmp_path):
    with pytest.raises(ValueError, match="no training records"):
        plot_metrics([{"event": "resume", "step": 5}], tmp_path / "x.png")
    empty = tmp_path / "empty_metrics.jsonl"
    empty.write_text("")
    result = run_script("scripts.plot_metrics", str(empty), "-o", str(tmp_path / "x.png"))
    assert result.returncode == 1 and "no training records" in result.stderr
    assert not (tmp_path / "x.png").exists()

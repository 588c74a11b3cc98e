"""Every logged step reaches each tracker exactly once, across ranks, crashes and resumes.

Real `python` / `torchrun` (gloo) runs on the CPU. The metrics file is read with the writer's own
reader (trainer/hardening/metrics_files.py); wandb and SwanLab run offline, and their run files are read back directly: both are
LevelDB-style logs of protobuf records (https://github.com/google/leveldb/blob/main/doc/log_format.md).
"""

from __future__ import annotations

import collections
import struct
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (TINY_MODEL, events_of, launch_command, metrics_of, resume_file, run_args, slice_jsonl,
                      slowed_env, status_of, trace_of, train)
from benchmarks.soak_kill import kill_job
from trainer.hardening.metrics_files import is_train_record


def job_args(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    return run_args(tmp_path, data, "--batch_size", "2", "--epochs", "1", *extra)


def train_records(tmp_path: Path) -> list[dict]:
    return [r for r in metrics_of(tmp_path) if is_train_record(r)]


# ---- the metrics file on two ranks ----

def test_two_rank_run_logs_each_step_once_with_the_global_loss(tmp_path, pretrain_data):
    train("train_pretrain.py", 2, job_args(tmp_path, pretrain_data), tmp_path)
    records = train_records(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 11))  # 37 samples / global batch 4, rank 0 writes
    sums, tokens = collections.Counter(), collections.Counter()
    for r in trace_of(tmp_path):
        sums[r["step"]] += r["loss_sum"]
        tokens[r["step"]] += r["local_tokens"]
    for r in records:  # the loss of the whole global batch, not rank 0's half of it
        assert r["loss"] == pytest.approx(sums[r["step"]] / tokens[r["step"]], rel=1e-12)
    timestamps = [r["timestamp"] for r in metrics_of(tmp_path)]
    assert len(timestamps) == len(records) and timestamps == sorted(timestamps)
    status = status_of(tmp_path)
    assert status["status"] == "completed" and status["job_id"].startswith("pretrain_32-")
    assert (status["current_step"], status["total_steps"], status["latest_metrics"]) == (10, 10, records[-1])
    assert status["anomaly_detected"] is False and status["anomaly_reason"] is None
    assert status["resumed_from"] is None


def test_metrics_after_sigkill_and_resume_have_each_step_once_and_a_resume_event(tmp_path, pretrain_data):
    args = job_args(tmp_path, pretrain_data, "--save_interval", "2")
    with open(tmp_path / "killed_run.log", "w") as log:
        job = subprocess.Popen(launch_command("train_pretrain.py", 2, [*TINY_MODEL, *args]), cwd=tmp_path,
                               env=slowed_env(step_delay_s=0.3), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        deadline = time.time() + 120
        while len(train_records(tmp_path)) < 5 and job.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        kill_job(job)  # SIGKILL the launcher and both workers, like a machine losing power
    logged_before_kill = [r["step"] for r in train_records(tmp_path)]
    saved_step = resume_file(tmp_path)["global_step"]
    assert 2 <= saved_step < max(logged_before_kill) < 10, (
        f"the kill must land after a logged but unsaved step: saved {saved_step}, logged {logged_before_kill}")

    job_id = status_of(tmp_path)["job_id"]
    train("train_pretrain.py", 2, [*args, "--from_resume", "1"], tmp_path)
    assert [r["step"] for r in train_records(tmp_path)] == list(range(1, 11))
    assert events_of(tmp_path) == [("resume", saved_step)]
    status = status_of(tmp_path)
    assert (status["status"], status["current_step"], status["resumed_from"]) == ("completed", 10, saved_step)
    assert status["job_id"] == job_id  # the same job, continued


# ---- wandb and SwanLab, offline ----

def leveldb_log_records(path: Path, header: bytes) -> list[bytes]:
    """The records of a LevelDB log file after its 7-byte file header (wandb and SwanLab both use one).

    32 KiB blocks; each chunk is crc32 (4 bytes), length (2), type (1: full, 2: first, 3: middle,
    4: last), then data; a block tail shorter than a chunk header is zero padding.
    """
    data = path.read_bytes()
    assert data[:4] == header, f"{path} does not start with {header!r}"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def wandb_offline_run(run_dir: Path, key: str = "train/loss") -> tuple[str, dict[int, float]]:
    """(run id, {step: value of `key`}) from an offline run's `run-ID.wandb` file."""
    from wandb.proto.wandb_internal_pb2 import Record
    run_id, losses = None, {}
    [store] = run_dir.glob("run-*.wandb")
    for raw in leveldb_log_records(store, b":W&B"):
        record = Record.FromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            for item in record.history.item:
                if (item.key or "/".join(item.nested_key)) == key:
                    losses[record.history.step.num] = float(item.value_json)
    return run_id, losses


def swanlab_offline_run(run_dir: Path, key: str = "train/loss") -> tuple[str, dict[int, float]]:
    """(run id, {step: value of `key`}) from an offline run's `run-ID.swanlab` file."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    run_id, losses = None, {}
    [store] = run_dir.glob("run-*.swanlab")
    for raw in leveldb_log_records(store, b":SWL"):
        record = Record.FromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "start":
            run_id = record.start.id
        elif kind == "scalar" and record.scalar.key == key:
            losses[record.scalar.step] = record.scalar.value.number
    return run_id, losses


def offline_runs(pattern_dir: Path, pattern: str, read) -> list[tuple[str, str, dict[int, float]]]:
    """(id suffix of the directory name, run id inside the file, losses) per invocation, oldest first."""
    return [(d.name.rsplit("-", 1)[1], *read(d)) for d in sorted(pattern_dir.glob(pattern))]


def test_wandb_and_swanlab_offline_get_the_metrics_file_steps_and_keep_their_run_ids_on_resume(
        tmp_path, pretrain_data):
    val = slice_jsonl(pretrain_data, tmp_path / "val.jsonl", 3)
    args = job_args(tmp_path, pretrain_data, "--logger", "console,file,wandb,swanlab", "--save_interval", "2",
                    "--val_data", str(val), "--eval_interval", "3")
    env = dict(WANDB_DIR=tmp_path, SWANLAB_LOGDIR=tmp_path / "swanlog")
    train("train_pretrain.py", None, [*args, "--max_steps", "4"], tmp_path, **env)
    first_ids = resume_file(tmp_path)["tracker_ids"]
    train("train_pretrain.py", None, [*args, "--from_resume", "1"], tmp_path, **env)

    file_losses = {r["step"]: r["loss"] for r in train_records(tmp_path)}
    assert sorted(file_losses) == list(range(1, 20))
    wandb_runs = offline_runs(tmp_path / "wandb", "offline-run-*", wandb_offline_run)
    swanlab_runs = offline_runs(tmp_path / "swanlog", "run-*", swanlab_offline_run)
    ids = resume_file(tmp_path)["tracker_ids"]
    assert ids == first_ids and ids["wandb"] and ids["swanlab"]
    for name, runs in (("wandb", wandb_runs), ("swanlab", swanlab_runs)):
        assert len(runs) == 2, f"{name}: expected one offline run per invocation, got {len(runs)}"
        assert {(dir_id, file_id) for dir_id, file_id, _ in runs} == {(ids[name], ids[name])}, name
        first, resumed = runs[0][2], runs[1][2]
        assert sorted(first) == [1, 2, 3, 4] and sorted(resumed) == list(range(5, 20)), name
        assert {**first, **resumed} == file_losses, name
    # The validation's bits per byte reach both trackers too (each invocation's last step is validated)
    file_bpb = {r["step"]: r["val/bpb"] for r in metrics_of(tmp_path) if "val/bpb" in r}
    assert sorted(file_bpb) == [3, 4, 6, 9, 12, 15, 18, 19]
    for name, read, runs_dir, pattern in (("wandb", wandb_offline_run, tmp_path / "wandb", "offline-run-*"),
                                          ("swanlab", swanlab_offline_run, tmp_path / "swanlog", "run-*")):
        logged = {}
        for run_dir in sorted(runs_dir.glob(pattern)):
            logged.update(read(run_dir, "val/bpb")[1])
        assert logged == pytest.approx(file_bpb), name


def test_swanlab_logger_starts_when_the_script_is_run_by_path(tmp_path, pretrain_data):
    # Running trainer/x.py puts trainer/ first on sys.path: no module there may shadow a package
    # a tracker imports (a trainer/watchdog.py once hid the `watchdog` package SwanLab needs).
    result = train("train_pretrain.py", None, job_args(tmp_path, pretrain_data, "--logger", "file,swanlab",
                                                       "--max_steps", "1"),
                   tmp_path, check=False, SWANLAB_LOGDIR=tmp_path / "swanlog")
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((tmp_path / "swanlog").glob("run-*/run-*.swanlab"))

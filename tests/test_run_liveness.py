"""A run you can trust from the outside: the status file's heartbeat, and the watcher's verdict on it.

A real training process (slowed from outside by tests/fault_injection) shows the heartbeat moving while
no step finishes, and logs its first step and each save. The watcher's verdicts (alive, slow, stuck,
dead) are checked on status objects built here, against real lock files in trainer/hardening/run_lock.py's format
naming a live process, a dead one and one on another host.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from conftest import TINY_MODEL, launch_command, run_args, slowed_env
from benchmarks.soak_kill import kill_job
from scripts.watch_run import render_summary
from trainer.hardening.metrics_files import MetricsFileWriter, read_metrics, status_path
from trainer.hardening.run_lock import LOCK_NAME, process_start
from trainer.hardening.tracking import Tracker

NOW = 1_800_000_000.0
BEAT_S = 15.0


# ---- a real process ----

def test_heartbeat_moves_while_a_slow_step_has_not_finished_and_the_first_step_and_saves_are_logged(
        tmp_path, pretrain_data):
    args = run_args(tmp_path, pretrain_data, "--batch_size", "4", "--max_steps", "2", "--save_interval", "1")
    env = {**slowed_env(step_delay_s=2.0), "TRAINER_HEARTBEAT_S": "0.3"}  # each step takes 2 s; a beat every 0.3 s
    path = status_path(tmp_path / "metrics", "pretrain_32")
    beats: dict = {}  # last_step -> the distinct heartbeats seen while it was the last finished step
    verdicts = []
    with open(tmp_path / "run.log", "w") as log:
        job = subprocess.Popen(launch_command("train_pretrain.py", None, [*TINY_MODEL, *args]), cwd=tmp_path, env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 120
            while job.poll() is None and time.time() < deadline:
                if path.is_file():
                    status = json.loads(path.read_text())  # replaced atomically: always whole
                    if status["status"] == "running":
                        beats.setdefault(status["last_step"], set()).add(status["heartbeat"])
                        verdicts.append(render_summary(status, [], now=time.time()).splitlines()[-1])
                time.sleep(0.05)
        finally:
            if job.poll() is None:  # past the deadline: leave nothing running
                kill_job(job)
    output = (tmp_path / "run.log").read_text()
    assert job.returncode == 0, output[-4000:]
    # The heartbeat moved at least three times while the same step stayed the last one finished.
    assert max(len(seen) for seen in beats.values()) >= 3, f"heartbeats per last step: {beats}"
    assert {None, 1} & set(beats), beats  # seen before the first step finished, or between steps 1 and 2
    assert verdicts and all(v.startswith("alive: heartbeat") for v in verdicts), set(verdicts)

    status = json.loads(path.read_text())
    assert status["status"] == "stopped" and status["heartbeat_interval_s"] == 0.3  # --max_steps: stopped
    assert status["last_step"] == 2 and status["last_step_at"] <= status["heartbeat"] <= status["updated"]
    assert (status["pid"], status["host"]) == (job.pid, socket.gethostname())
    assert status["lock_file"] == str((tmp_path / "ckpt").resolve() / LOCK_NAME)

    assert "first step taken after " in output and "s (step 1; a log line every 1 steps)" in output
    for step in (1, 2):  # --async_save 1 is the default: the write goes on after training continues
        kept = tmp_path / "ckpt" / "pretrain_32_history" / f"step_{step:08d}.pth"
        assert f"saved step {step} to {kept}: training blocked " in output, output[-4000:]
    assert output.count("; the write goes on in the background") == 2


# ---- the writer and the tracker in this process ----

def test_heartbeat_and_log_writes_never_mix_and_no_beat_lands_after_the_end(tmp_path):
    writer = MetricsFileWriter(str(tmp_path), "run", heartbeat_interval_s=0.01, lock_file=None)
    writer.begin(start_step=0, total_steps=50)
    stop, errors = threading.Event(), []

    def beat() -> None:
        while not stop.is_set():
            try:
                writer.beat(7, 123.0)
            except Exception as error:  # a mixed write would show up here: a dict changing size mid-dump
                errors.append(repr(error))
                return

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        for step in range(1, 51):
            writer.log({"step": step, "epoch": 0, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0}, total_steps=50)
    finally:
        stop.set()
        beater.join()
    assert errors == []
    writer.finish("completed", 50)
    writer.beat(8, 456.0)  # a beat racing the end changes nothing
    status = json.loads((tmp_path / "run_status.json").read_text())
    assert (status["status"], status["current_step"], status["last_step"]) == ("completed", 50, 7)
    assert [r["step"] for r in read_metrics(tmp_path / "run_metrics.jsonl")] == list(range(1, 51))


def tracker_args(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(logger="file", use_wandb=False, use_swanlab=False, epochs=1, metrics_dir=str(tmp_path),
                           save_dir=str(tmp_path), checkpoint_dir=str(tmp_path / "ckpt"), save_debug_train_output=None,
                           log_interval=10, async_save=0, wandb_project="p")


def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "status-heartbeat"]


def test_the_heartbeat_thread_is_a_daemon_and_stops_when_the_run_ends_or_fails(tmp_path):
    for ending in ("finish", "error"):
        tracker = Tracker(tracker_args(tmp_path), "run", True, torch.device("cpu"), start_step=0, total_steps=5,
                          tracker_ids={}, model_flops_per_token=1.0)
        [thread] = heartbeat_threads()
        assert thread.daemon  # it never keeps a crashed process alive
        try:
            with tracker:
                if ending == "error":
                    raise RuntimeError("boom")
                tracker.finish("completed")
        except RuntimeError:
            pass
        assert heartbeat_threads() == [], ending
        status = json.loads((tmp_path / "run_status.json").read_text())
        assert status["status"] == ("completed" if ending == "finish" else "failed")


# ---- the watcher's verdicts ----

def beating(**fields) -> dict:
    """A running job's status, its latest heartbeat 5 s before NOW, a typical step of 2 s."""
    return {"job_id": "r-1", "run_name": "r", "status": "running", "current_step": 40, "total_steps": 100,
            "anomaly_detected": False, "anomaly_reason": None,
            "latest_metrics": {"step": 40, "loss": 2.0, "step_time_s": 2.0, "timestamp": NOW - 60},
            "started": NOW - 3600, "updated": NOW - 5, "heartbeat": NOW - 5, "heartbeat_interval_s": BEAT_S,
            "last_step": 40, "last_step_at": NOW - 6, "pid": os.getpid(), "host": socket.gethostname(),
            "lock_file": None, **fields}


def verdict(status: dict) -> str:
    """The lines after `last update`: what the watcher says about the process."""
    lines = render_summary(status, [], now=NOW).splitlines()
    [at] = [i for i, line in enumerate(lines) if line.startswith("last update")]
    return "\n".join(lines[at + 1:])


def test_watch_calls_a_run_alive_when_steps_finish_at_their_usual_pace():
    text = verdict(beating())
    assert text.startswith("alive: heartbeat 5.0 s ago; step 40 finished 1.0 s before that beat"), text


def test_watch_calls_a_run_slow_when_the_last_step_is_older_than_three_typical_steps():
    text = verdict(beating(last_step_at=NOW - 5 - 10))  # 10 s without a step, 5 typical steps
    assert text.startswith("slow: heartbeat 5.0 s ago, step 40 finished 10.0 s before that beat: 5x a typical"), text
    assert "WARNING" not in text and "--from_resume" not in text
    # Long steps of a big model: 400 s without a step is slow, not stuck, when a step takes 60 s.
    long_steps = beating(last_step_at=NOW - 5 - 400)
    long_steps["latest_metrics"]["step_time_s"] = 60.0
    assert verdict(long_steps).startswith("slow:")


def test_watch_calls_a_run_stuck_when_it_beats_but_no_step_finishes():
    text = verdict(beating(last_step_at=NOW - 5 - 400))  # 400 s > max(300 s, 10 x 2 s)
    assert text.startswith("WARNING: stuck: the process is alive (heartbeat 5.0 s ago) but step 40 finished "
                           "0h06m40s before that beat (a typical step takes 2 s)"), text
    assert f"py-spy dump --pid {os.getpid()}" in text and "Do not start a second trainer" in text
    before_first = verdict(beating(last_step=None, last_step_at=None, latest_metrics={}, started=NOW - 5 - 400))
    assert before_first.startswith("WARNING: stuck: the process is alive (heartbeat 5.0 s ago) but no step has "
                                   "finished in the 0h06m40s since this invocation started"), before_first
    assert "torch.compile" in before_first


def write_lock(directory: Path, host: str, pid: int, pid_start: str | None) -> str:
    """A lock file in trainer/hardening/run_lock.py's format."""
    directory.mkdir(parents=True, exist_ok=True)
    record = {"host": host, "pid": pid, "pid_start": pid_start, "started": NOW - 3600, "command": "train_pretrain.py",
              "job_id": None, "heartbeat": NOW - 100, "token": "0123456789abcdef"}
    (directory / LOCK_NAME).write_text(json.dumps(record) + "\n")
    return str(directory / LOCK_NAME)


def dead(**fields) -> dict:
    return beating(heartbeat=NOW - 100, updated=NOW - 100, **fields)  # 100 s > 4 beats of 15 s


def test_watch_on_a_dead_heartbeat_whose_process_is_alive_says_do_not_start_another(tmp_path):
    lock = write_lock(tmp_path / "ckpt", socket.gethostname(), os.getpid(), process_start(os.getpid()))
    text = verdict(dead(lock_file=lock))
    assert text.startswith("WARNING: dead or frozen: no heartbeat for 0h01m40s (it beats every 15 s)"), text
    assert "alive but not beating" in text and f"ps -o stat {os.getpid()}" in text
    assert "Do not start another trainer" in text and "--from_resume" not in text


def test_watch_on_a_dead_heartbeat_whose_process_is_gone_says_restart(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = process_start(child.pid)  # its start time: a reused pid is not mistaken for it
    child.kill()
    child.wait()  # reaped: the pid names no process (or another one)
    lock = write_lock(tmp_path / "ckpt", socket.gethostname(), child.pid, started)
    text = verdict(dead(lock_file=lock, pid=child.pid))
    assert f"The trainer is gone: pid {child.pid} no longer runs on this host" in text, text
    assert "Restart with --from_resume 1: the new run takes the lock over" in text


def test_watch_on_a_dead_heartbeat_of_another_host_names_the_holder_and_the_job_id_rule(tmp_path):
    lock = write_lock(tmp_path / "ckpt", "gpu-node-7", 4242, "123")
    text = verdict(dead(lock_file=lock, pid=4242, host="gpu-node-7"))
    assert "is held by pid 4242 on gpu-node-7" in text, text
    assert "only with the same job id (SLURM_JOB_ID, torchrun --rdzv-id, or --run_id)" in text
    assert "check gpu-node-7 first" in text and "--from_resume" not in text


def test_watch_on_a_dead_heartbeat_without_a_lock_or_without_sight_of_it(tmp_path):
    (tmp_path / "ckpt").mkdir()
    released = verdict(dead(lock_file=str(tmp_path / "ckpt" / LOCK_NAME)))
    assert "No trainer holds" in released and "Restart with --from_resume 1" in released, released
    elsewhere = verdict(dead(lock_file=str(tmp_path / "not-mounted-here" / LOCK_NAME)))
    assert "is not visible from here" in elsewhere and "--from_resume" not in elsewhere, elsewhere


def test_watch_on_an_older_status_without_heartbeat_suggests_a_restart_only_without_a_lock(tmp_path):
    old = {k: v for k, v in beating(updated=NOW - 600).items()
           if k not in ("heartbeat", "heartbeat_interval_s", "last_step", "last_step_at", "pid", "host", "lock_file")}
    text = verdict(old)
    assert text.startswith("WARNING: no update for 0h10m00s") and "--from_resume" not in text, text
    (tmp_path / "ckpt").mkdir()
    unlocked = verdict({**old, "lock_file": str(tmp_path / "ckpt" / LOCK_NAME)})
    assert "no trainer holds" in unlocked and "restart with --from_resume 1" in unlocked, unlocked

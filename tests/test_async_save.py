"""Background saves keep every checkpoint guarantee of the synchronous path.

The writer thread is slowed (or made to fail) from outside the library by
tests/fault_injection/sitecustomize.py, so a test can act while a save is in flight.
"""

from __future__ import annotations

import collections
import json
import re
import signal
import subprocess
from pathlib import Path

import torch

from conftest import (FAULT_INJECTION_DIR, TINY_MODEL, assert_exit_code, child_env, launch_command, read_trace, run_args,
                      slowed_env, train, wait_until, with_loader_workers)
from benchmarks.soak_kill import kill_job
from trainer.hardening.checkpoint_io import RunFiles, manifest_path, verify
from trainer.hardening.metrics_files import read_metrics


def job_args(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    # The trace has a record per step whatever --log_interval is; a metrics line every step would also
    # rewrite the status file every step, and the slowed writes would slow each step as much as a save stage.
    return ["--data_path", str(data), "--save_dir", str(tmp_path / "out"), "--checkpoint_dir", str(tmp_path / "ckpt"),
            "--save_debug_train_output", str(tmp_path / "trace.jsonl"), "--log_interval", "1000", "--batch_size", "2",
            *extra]


def fault_env(**faults) -> dict:
    return child_env(PYTHONPATH=FAULT_INJECTION_DIR, **faults)


def history(tmp_path: Path) -> RunFiles:
    return RunFiles(tmp_path / "ckpt", "pretrain_32")


def steps_in_trace(tmp_path: Path) -> set[int]:
    trace = tmp_path / "trace.jsonl"
    return {r["step"] for r in read_trace(trace)} if trace.exists() else set()


def samples_trained_once_per_epoch(trace: list[dict]) -> dict[int, collections.Counter]:
    """Samples per epoch, from the last record of each (step, rank): replays after a kill count once."""
    last = {(r["step"], r["rank"]): r for r in trace}
    counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for record in last.values():
        counts[record["epoch"]].update(record["samples"])
    return counts


def test_training_goes_on_while_a_save_is_written_and_sigkill_then_resumes_from_the_previous_checkpoint(
        tmp_path, pretrain_data):
    files = history(tmp_path)
    in_flight = files.history_file(4)
    args = job_args(tmp_path, pretrain_data, "--save_interval", "2", "--epochs", "1")
    job = subprocess.Popen(launch_command("train_pretrain.py", 2, [*TINY_MODEL, *args]), cwd=tmp_path,
                           env=fault_env(FAULT_SAVE_DELAY_S=2.0, FAULT_STEP_DELAY_S=0.05),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # Step 6 trained while step 4's checkpoint still has no manifest: the save runs in the background.
        wait_until(lambda: 6 in steps_in_trace(tmp_path), job)
        assert not manifest_path(in_flight).exists()
    finally:
        kill_job(job)
    assert verify(files.history_file(2)) is None
    assert files.resume_link.samefile(files.history_file(2))

    result = train("train_pretrain.py", 2, [*args, "--from_resume", "1"], tmp_path)
    assert "step_00000002.pth" in result.stdout  # resumed from the checkpoint before the one in flight
    counts = samples_trained_once_per_epoch(read_trace(tmp_path / "trace.jsonl"))
    assert counts[0] == collections.Counter(range(37))


def test_a_failing_background_write_stops_every_rank_and_keeps_the_previous_checkpoint(tmp_path, pretrain_data):
    files = history(tmp_path)
    args = job_args(tmp_path, pretrain_data, "--save_interval", "2", "--epochs", "1")
    result = train("train_pretrain.py", 2, args, tmp_path, check=False, **{
        "PYTHONPATH": FAULT_INJECTION_DIR, "FAULT_DISK_FULL_AT_STEP": 4})
    assert result.returncode != 0
    assert "No space left on device (injected)" in result.stdout + result.stderr
    assert [p.name for p in files.history()] == ["step_00000002.pth"]
    assert verify(files.history_file(2)) is None and files.resume_link.samefile(files.history_file(2))
    # Every rank stopped within a step of the failure: no rank trained far beyond it.
    assert max(steps_in_trace(tmp_path)) <= 6


def test_sigterm_while_a_save_is_in_flight_exits_zero_with_that_save_and_the_final_one_complete(
        tmp_path, pretrain_data):
    files = history(tmp_path)
    # keep_last 5: the stop lands a step or two after the signal, and an interval save may come first.
    args = job_args(tmp_path, pretrain_data, "--save_interval", "2", "--epochs", "1", "--keep_last", "5")
    job = subprocess.Popen(launch_command("train_pretrain.py", None, [*with_loader_workers(1), *args]), cwd=tmp_path,
                           env=fault_env(FAULT_SAVE_DELAY_S=1.5, FAULT_STEP_DELAY_S=0.05),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_until(lambda: files.history_dir.is_dir() and any(files.history_dir.glob("step_00000002.pth*")), job)
    assert not manifest_path(files.history_file(2)).exists()  # the save of step 2 is in flight
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 0, output
    assert verify(files.history_file(2)) is None
    last = files.history()[0]
    assert verify(last) is None and files.resume_link.samefile(last)
    assert json.loads(manifest_path(last).read_text())["global_step"] == max(steps_in_trace(tmp_path))


def test_background_and_synchronous_saves_write_the_same_state(tmp_path, pretrain_data):
    jobs, states = {}, {}
    for mode in ("0", "1"):  # two independent runs, side by side
        args = job_args(tmp_path / f"async_{mode}", pretrain_data, "--save_interval", "3", "--max_steps", "7",
                        "--async_save", mode)
        jobs[mode] = subprocess.Popen(launch_command("train_pretrain.py", 2, [*TINY_MODEL, *args]), cwd=tmp_path,
                                      env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for mode, job in jobs.items():
        stdout, stderr = job.communicate(timeout=300)
        assert_exit_code(subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr))
        run_dir = tmp_path / f"async_{mode}"
        states[mode] = torch.load(history(run_dir).resume_link, map_location="cpu", weights_only=True)
        states[mode]["fp16"] = torch.load(run_dir / "out" / "pretrain_32.pth", map_location="cpu", weights_only=True)
    sync, background = states["0"], states["1"]
    assert sync.keys() == background.keys()
    for name in ("model", "fp16"):
        assert sync[name].keys() == background[name].keys()
        assert all(torch.equal(sync[name][k], background[name][k]) for k in sync[name])
    assert len(sync["optimizer"]["state"]) == len(background["optimizer"]["state"]) > 0
    for index, moments in sync["optimizer"]["state"].items():
        assert all(torch.equal(moments[k], background["optimizer"]["state"][index][k]) for k in moments)
    for key in ("epoch", "global_step", "samples_consumed", "world_size", "anomaly"):
        assert sync[key] == background[key]


def test_the_save_line_and_the_metrics_say_what_a_save_blocked_training_on(tmp_path, pretrain_data):
    # Writes slowed to about a second, a background save after every step: from the second save on, training waits
    # for the write before it (one save in flight at most), and the save line and the metrics records say so.
    run_dir = tmp_path / "run"
    args = run_args(run_dir, pretrain_data, "--batch_size", "2", "--max_steps", "3", "--save_interval", "1",
                    "--async_save", "1")
    result = subprocess.run(launch_command("train_pretrain.py", None, [*TINY_MODEL, *args]), cwd=tmp_path,
                            env=slowed_env(save_delay_s=1.0), capture_output=True, text=True, timeout=300)
    assert_exit_code(result)
    lines = [line for line in result.stdout.splitlines() if line.startswith("saved step ")]
    assert len(lines) == 3 and all("copying to CPU memory" in line for line in lines), result.stdout[-3000:]
    waits = [float(re.search(r"waiting for the previous write ([\d.]+) s", line).group(1)) for line in lines]
    assert waits[0] < 0.2 < 0.3 < min(waits[1:]), lines
    logged = [r for r in read_metrics(next((run_dir / "metrics").glob("*_metrics.jsonl"))) if r.get("save_blocked_s")]
    last = logged[-1]  # step 3's line, logged before its own save: the saves of steps 1 and 2 summed
    parts = [last[f"save_{part}"] for part in ("wait_s", "copy_s", "write_s", "other_s")]
    assert abs(sum(parts) - last["save_blocked_s"]) < 1e-9 and last["save_wait_s"] > 0.3, last

"""Stopping on a signal: under torchrun, what the workers, the checkpoint and torchrun itself end with;
in scripts/run_demo.sh, that one Ctrl-C ends the demo.

The workers run under tests/record_worker.py, which keeps each worker's exit status and output apart
from torchrun's; tests/fault_injection/sitecustomize.py slows steps and saves so the test can signal
them at a chosen moment.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import (REPO, child_env, child_pids, free_port, read_trace, resume_file, run_args, slowed_env, status_of,
                      wait_until, with_loader_workers)
from scripts.run_files import read_status
from trainer.hardening.checkpoint_io import RunFiles, verify


def start_recorded_job(run_dir: Path, args: list[str], env: dict, *torchrun_flags: str) -> subprocess.Popen:
    """A 2-rank torchrun job of TINY_MODEL, each rank with a DataLoader worker (the default --num_workers 1),
    whose ranks record their output and exit status in run_dir."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), *torchrun_flags, str(REPO / "tests" / "record_worker.py"), str(run_dir),
               str(REPO / "trainer" / "train_pretrain.py"), *with_loader_workers(1), *args]
    return subprocess.Popen(command, cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_sigterm_to_torchrun_and_workers_twice_is_one_stop_whose_save_completes_on_every_rank(
        tmp_path, pretrain_data):
    # As Slurm's scancel does: SIGTERM to torchrun and to every worker at once, so each worker gets it twice
    # (torchrun sends its own copy to each worker's whole process group, the DataLoader worker included, which
    # must outlive it); then all of it again while the stop-save is written.
    args = run_args(tmp_path, pretrain_data, "--batch_size", "1", "--epochs", "1", "--save_interval", "1000",
                    "--log_interval", "1000")  # the slowed writes would slow each step's status file too
    job = start_recorded_job(tmp_path, args, slowed_env(step_delay_s=0.2, save_delay_s=4.0))
    files = RunFiles(tmp_path / "ckpt", "pretrain_32")
    trace = tmp_path / "trace.jsonl"
    rank0_log = tmp_path / "rank0.log"  # (the trace is written at log lines and saves: none before the stop)
    wait_until(lambda: rank0_log.exists() and "first step taken" in rank0_log.read_text(), job)
    time.sleep(0.4)  # two more steps of 0.2 s
    workers = [pid for recorder in child_pids(job.pid) for pid in child_pids(recorder)]
    assert len(workers) == 2, "expected one worker under each of the two recorders"
    assert all(len(child_pids(pid)) == 1 for pid in workers), "expected a DataLoader worker under each rank"
    for pid in [job.pid, *workers]:
        os.kill(pid, signal.SIGTERM)
    first = time.time()
    wait_until(lambda: files.history_dir.is_dir() and any(files.history_dir.iterdir()), job)
    time.sleep(max(0.0, first + 1.5 - time.time()))  # later than StopRequest.SAME_REQUEST_WITHIN_S: a new request
    save_in_flight = not list(files.history_dir.glob("*.json"))  # its history file begun, no manifest yet
    for pid in [job.pid, *workers]:
        os.kill(pid, signal.SIGTERM)
    output, _ = job.communicate(timeout=120)

    logs = [(tmp_path / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert [(tmp_path / f"rank{rank}.exit").read_text().strip() for rank in (0, 1)] == ["0", "0"], logs
    assert not any("Traceback" in log or "killed by signal" in log for log in logs), logs
    stopped_at = resume_file(tmp_path)["global_step"]
    assert stopped_at == max(record["step"] for record in read_trace(trace))  # the step the stop finished
    assert f"stopped at step {stopped_at} (SIGTERM); checkpoint saved" in logs[0]
    # The second round reached the workers during the save, and rank 0 alone said what is under way.
    assert save_in_flight and logs[0].count("stop under way") == 1 and "stop under way" not in logs[1], logs
    assert verify(files.history_file(stopped_at)) is None and files.resume_link.samefile(files.history_file(stopped_at))
    assert (status_of(tmp_path)["status"], status_of(tmp_path)["current_step"]) == ("stopped", stopped_at)
    # torchrun itself, signalled, exits 1 with its SignalException traceback (the README says so).
    assert job.returncode == 1 and "SignalException" in output, output


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="about 30 s on two CPU cores; set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")
def test_torchrun_kills_a_stop_save_longer_than_its_shutdown_timeout_and_the_previous_checkpoint_stays(
        tmp_path, pretrain_data):
    # Saves take over 5 s, torchrun waits 2 s for its workers: longer than a step, shorter than the stop-save.
    args = run_args(tmp_path, pretrain_data, "--batch_size", "1", "--epochs", "1", "--save_interval", "3",
                    "--log_interval", "1000")
    job = start_recorded_job(tmp_path, args, slowed_env(step_delay_s=0.2, save_delay_s=5.0),
                             "--shutdown-timeout", "2")
    files = RunFiles(tmp_path / "ckpt", "pretrain_32")
    step_3_saved = "pretrain_32_history/step_00000003.pth\n"  # the pointer is the save's last write
    wait_until(lambda: files.latest_pointer.exists() and files.latest_pointer.read_text() == step_3_saved, job)
    os.kill(job.pid, signal.SIGINT)  # Ctrl-C at the terminal reaches torchrun only; it forwards it
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 1 and "forcefully exiting via 9" in output, output
    assert verify(files.history_file(3)) is None and files.resume_link.samefile(files.history_file(3))
    # The stop-save was cut short: its temp file is left (the next start removes it), and no newer history file.
    assert list(tmp_path.rglob("*.partial-*.tmp"))
    assert [p.name for p in files.history_dir.glob("*.pth")] == ["step_00000003.pth"]


def test_ctrl_c_twice_in_a_terminal_stops_once_and_names_the_process_to_kill(tmp_path, pretrain_data):
    # A terminal's Ctrl-C reaches the whole foreground group: the trainer and its DataLoader worker, which
    # inherits the handler when it is forked and must stay silent.
    model = with_loader_workers(1)
    args = run_args(tmp_path, pretrain_data, "--batch_size", "1", "--epochs", "1")  # a trace line at every step
    job = subprocess.Popen([sys.executable, str(REPO / "trainer" / "train_pretrain.py"), *model, *args], cwd=tmp_path,
                           env=slowed_env(step_delay_s=0.2, save_delay_s=3.0), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    trace = tmp_path / "trace.jsonl"
    wait_until(lambda: trace.exists() and len(read_trace(trace)) >= 3, job)
    os.killpg(job.pid, signal.SIGINT)
    time.sleep(1.5)  # a person pressing again
    os.killpg(job.pid, signal.SIGINT)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 0 and "Traceback" not in output, output
    assert re.findall(r"stop under way .* To abort without saving: (.*)", output) == [f"kill -9 {job.pid}"], output
    stopped_at = resume_file(tmp_path)["global_step"]
    assert f"stopped at step {stopped_at} (SIGINT)" in output and stopped_at == len(read_trace(trace))


def test_one_ctrl_c_stops_the_demo_after_pretraining_saves(tmp_path):
    # The real script in a copy of the project (it writes out/, checkpoints/ and the demo data where it lives).
    for name in ("model", "dataset", "trainer", "scripts"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "output_paths.py", tmp_path)  # the output-path rules, below model/ and trainer/
    demo = subprocess.Popen(["bash", str(tmp_path / "scripts" / "run_demo.sh")], cwd=tmp_path, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(demo.stdout), daemon=True)
    reader.start()
    wait_until(lambda: any(line.startswith("first step taken") for line in lines), demo)  # pretraining trains
    os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C at a terminal: the whole foreground process group
    try:
        demo.wait(timeout=120)
    except subprocess.TimeoutExpired:  # say where it hung, then leave nothing running
        tree = subprocess.run(["ps", "-o", "pid,stat,etime,args", "-g", str(demo.pid)], capture_output=True, text=True)
        os.killpg(demo.pid, signal.SIGKILL)
        raise AssertionError(f"the demo did not end 120 s after Ctrl-C; its processes:\n{tree.stdout}\n"
                             f"its output:\n{''.join(lines)}") from None
    reader.join(timeout=60)
    output = "".join(lines)
    assert demo.returncode == 130, output
    assert re.search(r"stopped at step \d+ \(SIGINT\); checkpoint saved", output), output
    assert output.rstrip().endswith("the demo stops here, before the next stage (a training stage that was "
                                    "running saved a checkpoint; its \"To continue:\" line above resumes it)")
    assert "== 3." not in output and not (tmp_path / "out" / "full_sft_128.pth").exists()
    assert read_status(tmp_path / "out" / "pretrain_128_status.json")["status"] == "stopped"

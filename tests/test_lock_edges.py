"""The lock's edges (trainer/hardening/run_lock.py): a run paused mid-save whose lock file is removed, and whose
directory a second run takes over at once (or, as a requeued job does, once the paused run's heartbeat is stale).
Resumed, the first run writes nothing more there (no metrics line in
the second run's file, no commit of its in-flight save: out/ file, manifest, latest pointer) and exits 4 with the
lost-lock line on every rank, within seconds: also mid a sharded (FSDP) background save, whose writer thread
must not wait for a peer that will not come.

Each test runs two 2-rank torchrun jobs, about 30 s on two CPU cores (90 s for the three), so they run when
TRAINER_SLOW_TESTS=1 (CI's 15 minutes are full). tests/test_lock_lost.py keeps the fast checks in the suite.
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import PRETRAIN_RUN, TINY_MODEL, launch_command, slowed_env, wait_until
from test_lock_lost import every_file, newest_step, signal_job
from trainer.hardening import run_lock, writer_lock
from trainer.hardening.checkpoint_io import RunFiles
from scripts.run_files import read_status
from trainer.hardening.metrics_files import metrics_path, status_path

pytestmark = pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                                reason="about 30 s each on two CPU cores; set TRAINER_SLOW_TESTS=1 to run them")


HEARTBEAT_S = 0.5  # the runs' TRAINER_HEARTBEAT_S: a paused run's heartbeat is stale after 2 s


def flags(run, data, *extra: str) -> list[str]:
    """One directory for everything (checkpoints, out/ file, metrics): one lock. The same command for both runs,
    as a requeued job runs it: the same --run_id, so the second may take over a stale lock of the first."""
    return [*TINY_MODEL, "--data_path", str(data), "--save_dir", str(run), "--checkpoint_dir", str(run),
            "--metrics_dir", str(run), "--log_interval", "1", "--batch_size", "2", "--epochs", "1",
            "--save_interval", "3", "--async_save", "1", "--run_id", "job-7", *extra]


def env(**delays: float) -> dict:
    return dict(slowed_env(**delays), TRAINER_HEARTBEAT_S=str(HEARTBEAT_S))


def start(args: list[str], cwd, log_name: str, env: dict) -> subprocess.Popen:
    with open(cwd / log_name, "w") as log:  # a file: a pipe nobody reads would block the job
        return subprocess.Popen(launch_command("train_pretrain.py", 2, args), cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, text=True)


def let_a_second_run_take_over(tmp_path, run, data, how: str, extra: list[str]) -> dict:
    """With the first run paused mid-save: remove its lock (`how` "lock_removed") or make it look as if written
    on another node ("heartbeat_stale": the second run waits for its heartbeat to go stale), start a second run
    on the same directory, let it save step 3, pause it. Returns every file of the directory then, and the second
    run, left paused (killed at the end)."""
    first_pid = read_status(status_path(run, PRETRAIN_RUN))["pid"]
    lock = run / run_lock.LOCK_NAME
    if how == "lock_removed":
        lock.unlink()
    else:  # seen from another node, only the job id and a stale heartbeat let a run take over (run_lock._why_gone)
        lock.write_text(json.dumps({**run_lock.read_lock(lock), "host": "frozen-node"}))
    # Each process of the first run still holds its kernel lock (writer_lock.py), which refuses a second run while
    # any of them lives (tests/test_run_lock.py). Where that lock is not shared (removed by hand with the lock file,
    # a filesystem that takes no lock, another node's frozen lease), the second run takes over: the first must then
    # write nothing more, which is what these tests prove.
    (run / writer_lock.WRITERS_NAME).unlink()
    second = start(flags(run, data, *extra), tmp_path, "second.log", env(step_delay_s=0.3))

    def second_saved_step_3() -> bool:  # its own checkpoint, where the first run's in-flight save was going
        status = read_status(status_path(run, PRETRAIN_RUN)) or {}
        return status.get("pid") not in (None, first_pid) and newest_step(RunFiles(run, PRETRAIN_RUN)) >= 3

    try:
        wait_until(second_saved_step_3, second, 120)
    except AssertionError:
        signal_job(second, signal.SIGKILL)
        raise AssertionError((tmp_path / "second.log").read_text())
    assert run_lock.read_lock(run / run_lock.LOCK_NAME)["pid"] != first_pid
    signal_job(second, signal.SIGSTOP)  # held still: whatever changes from here is the first run's doing
    return {"second": second, "files": every_file(run)}


def resume_and_check_it_stops_without_writing(tmp_path, run, first, taken: dict) -> None:
    second, before = taken["second"], taken["files"]
    try:
        signal_job(first, signal.SIGCONT)
        resumed = time.monotonic()
        try:
            first.wait(timeout=120)  # a hang fails the test, not CI
        except subprocess.TimeoutExpired:
            pytest.fail(f"the first run did not exit within 120 s of its resume (a hang):\n"
                        f"{(tmp_path / 'first.log').read_text()}")
        output = (tmp_path / "first.log").read_text()
        assert time.monotonic() - resumed < 30, output  # within seconds (a loaded 2-core machine is slow to start)
        worker_exits = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", output)
        assert sorted(worker_exits) == [("0", "4"), ("1", "4")], output
        said = [line for line in output.splitlines() if line.startswith("stopping: lost ")]
        assert len(said) == 1 and "wrote nothing more there" in said[0].lower(), output
        # torchrun prints its own traceback when a worker fails; the workers print none of the trainer's frames
        assert "trainer/" not in "".join(line for line in output.splitlines() if line.strip().startswith("File "))
        after = every_file(run)
        files = RunFiles(run, PRETRAIN_RUN)
        for name in (files.latest_pointer, run / f"{PRETRAIN_RUN}.pth", metrics_path(run, PRETRAIN_RUN)):
            key = str(name.relative_to(run))
            assert after.get(key) == before.get(key), f"the first run changed {key} after the takeover"
        assert after.keys() == before.keys(), sorted(after.keys() ^ before.keys())
        changed = [name for name in before if after[name] != before[name]]
        assert changed == [], {name: (before[name][0][-300:], after[name][0][-300:]) for name in changed}
    finally:
        for job in (first, second):
            if job.poll() is None:
                signal_job(job, signal.SIGKILL)
                job.wait()


def in_flight(run, pattern: str):
    return lambda: any(re.fullmatch(pattern, p.name) for p in run.rglob("*"))


def test_a_run_paused_mid_save_whose_lock_was_removed_and_taken_writes_nothing_more_and_exits_4(
        tmp_path, pretrain_data):
    run = tmp_path / "run"
    # Each save sleeps at each stage (fault_injection/sitecustomize.py): the first is paused while its out/ file
    # is being written, before the manifest and the latest pointer.
    first = start(flags(run, pretrain_data), tmp_path, "first.log", env(step_delay_s=0.3, save_delay_s=4))
    wait_until(in_flight(run, rf"{PRETRAIN_RUN}\.pth\.partial-.+\.tmp"), first, 120)
    signal_job(first, signal.SIGSTOP)
    taken = let_a_second_run_take_over(tmp_path, run, pretrain_data, "lock_removed", [])
    resume_and_check_it_stops_without_writing(tmp_path, run, first, taken)


@pytest.mark.parametrize("how", ["lock_removed", "heartbeat_stale"])
def test_an_fsdp_run_paused_mid_background_save_whose_lock_was_taken_exits_4_on_every_rank(tmp_path, pretrain_data,
                                                                                           how):
    run = tmp_path / "run"
    fsdp = ["--parallel", "fsdp"]
    first = start(flags(run, pretrain_data, *fsdp), tmp_path, "first.log", env(step_delay_s=0.3, save_delay_s=4))
    wait_until(in_flight(run, r"step_00000003\.dcp"), first, 120)  # the sharded save's folder: being written
    signal_job(first, signal.SIGSTOP)
    taken = let_a_second_run_take_over(tmp_path, run, pretrain_data, how, fsdp)
    resume_and_check_it_stops_without_writing(tmp_path, run, first, taken)


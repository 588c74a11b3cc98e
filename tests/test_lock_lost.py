"""A run that has lost its directory lock (trainer/hardening/run_lock.py) stops writing there: no checkpoint, no
out/ file, no metrics, status or trace line over the new holder's; it says so in one line naming the new holder
and exits 4, on every rank. Its lock is lost when its heartbeat went stale (a paused process, a frozen node) and
the same job, requeued, took the directory over; or when the lock file was removed by hand."""

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest

from benchmarks.soak_kill import descendants
from conftest import (PRETRAIN_RUN, TINY_MODEL, Lines, launch_command, run_args, slowed_env, status_of,
                      wait_until)
from trainer.hardening import checkpoint_io as cio, run_lock
from trainer.hardening.background_save import BackgroundSaver
from trainer.hardening.checkpoint_io import RunFiles
from trainer.hardening.metrics_files import MetricsFileWriter, metrics_path, status_path
from trainer.hardening.save_on_ranks import gather_rng_states

HEARTBEAT_S = 0.5  # the runs' TRAINER_HEARTBEAT_S: stale after 2 s


def start(flags: list[str], cwd, log_name: str) -> subprocess.Popen:
    """A slowed 2-rank torchrun job, its output in a file (a pipe nobody reads would block it)."""
    env = dict(slowed_env(step_delay_s=0.4), TRAINER_HEARTBEAT_S=str(HEARTBEAT_S))
    with open(cwd / log_name, "w") as log:
        return subprocess.Popen(launch_command("train_pretrain.py", 2, [*TINY_MODEL, *flags]), cwd=cwd, env=env,
                                stdout=log, stderr=subprocess.STDOUT, text=True)


def signal_job(job: subprocess.Popen, signum: int) -> None:
    """`signum` to torchrun's workers (each in a session of its own), then to torchrun."""
    for pid in [*descendants(job.pid), job.pid]:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # it exited meanwhile
            pass


def newest_step(files: RunFiles) -> int:
    """The step the latest pointer names (it is written last, once the checkpoint is complete); 0 if none yet."""
    try:
        return int(re.search(r"step_(\d+)", files.latest_pointer.read_text()).group(1))
    except (OSError, AttributeError):
        return 0


def every_file(run) -> dict[str, tuple[bytes, int]]:
    """Every file under the run's directory: its bytes and modification time."""
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*"))
            if p.is_file()}


def test_a_paused_run_whose_directory_was_taken_over_stops_without_writing_and_exits_4(tmp_path, pretrain_data):
    run, files = tmp_path / "run", RunFiles(tmp_path / "run" / "ckpt", PRETRAIN_RUN)
    # The same command twice, as a requeued job runs it: the same --run_id, resuming what is there.
    flags = run_args(run, pretrain_data, "--batch_size", "2", "--epochs", "1", "--save_interval", "3",
                     "--from_resume", "1", "--run_id", "job-7")  # 10 steps of 4 samples, a save every 3
    first = start(flags, tmp_path, "first.log")
    second = None
    try:
        wait_until(lambda: newest_step(files) >= 3, first, 90)
        signal_job(first, signal.SIGSTOP)  # frozen between two saves: it learns of the takeover at a step
        # Its node seen from another one: the lock's host is not ours, so only the job id and a stale heartbeat
        # let the requeued run take the directories over (run_lock._why_gone).
        locks = sorted(run.rglob(run_lock.LOCK_NAME))
        assert len(locks) == 3  # ckpt/, out/ and metrics/
        for lock in locks:
            lock.write_text(json.dumps({**run_lock.read_lock(lock), "host": "frozen-node"}))
        second = start(flags, tmp_path, "second.log")
        wait_until(lambda: newest_step(files) >= 6, second, 90)  # the new holder saved its own checkpoint
        signal_job(second, signal.SIGSTOP)  # held still while the first run wakes up: whatever changes is its doing
        new_holder = run_lock.read_lock(files.checkpoint_dir / run_lock.LOCK_NAME)
        assert new_holder["host"] == socket.gethostname() and new_holder["job_id"] == "run:job-7"
        before = every_file(run)

        signal_job(first, signal.SIGCONT)
        first.wait(timeout=60)
        output = (tmp_path / "first.log").read_text()
        worker_exits = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", output)
        assert sorted(worker_exits) == [("0", "4"), ("1", "4")], output
        said = [line for line in output.splitlines() if line.startswith("stopping: lost ")]
        assert len(said) == 1, output
        assert f"now names another trainer (pid {new_holder['pid']} on {socket.gethostname()}" in said[0]
        assert "job id run:job-7" in said[0] and "This run wrote nothing more there" in said[0]
        assert "trainer/" not in "".join(line for line in output.splitlines() if line.strip().startswith("File "))
        after = every_file(run)
        assert after.keys() == before.keys()
        assert [name for name in before if after[name] != before[name]] == []  # no byte, no mtime changed

        signal_job(second, signal.SIGCONT)
        assert second.wait(timeout=120) == 0, (tmp_path / "second.log").read_text()
    finally:
        for job in (first, second):
            if job is not None and job.poll() is None:
                signal_job(job, signal.SIGKILL)
                job.wait()
    assert "same job id, heartbeat stale" in (tmp_path / "second.log").read_text()
    status = status_of(run)
    assert (status["status"], status["current_step"]) == ("completed", 10)
    assert cio.verify(files.history_file(10)) is None
    assert not (files.checkpoint_dir / run_lock.LOCK_NAME).exists()  # the new holder released it at its end


def test_a_lock_removed_by_hand_is_lost_and_not_written_again(tmp_path, monkeypatch):
    lock = run_lock.DirectoryLock(tmp_path, None, Lines())
    lock.acquire()
    monkeypatch.setattr(run_lock, "_held", [lock])  # as claim_run_directories leaves it on rank 0
    writer = MetricsFileWriter(str(tmp_path), PRETRAIN_RUN, heartbeat_interval_s=HEARTBEAT_S)
    writer.begin(0, 10)
    files_before = [path.read_bytes() for path in (metrics_path(tmp_path, PRETRAIN_RUN),
                                                   status_path(tmp_path, PRETRAIN_RUN))]
    lock.path.unlink()
    # Seen at the next write, though its own heartbeat is fresh: another run may create the lock at once.
    assert "was removed while this run held it" in lock.lost()
    lock.beat()  # the heartbeat thread's next beat does not write it again
    assert not lock.path.exists()
    assert str(run_lock.lock_lost()).startswith(f"lost {tmp_path}: {lock.path} was removed")

    saver = BackgroundSaver(background=False, pin_memory=False)  # the saver refuses: each step learns it so
    assert saver.failed and isinstance(saver.error, run_lock.LockLost)
    with pytest.raises(run_lock.LockLost):  # and a save, first thing, before anything is written
        gather_rng_states(3)
    writer.log({"step": 1, "loss": 1.0}, 10)
    writer.beat(1, time.time())
    writer.finish("failed", 1)  # the exit path
    assert [path.read_bytes() for path in (metrics_path(tmp_path, PRETRAIN_RUN),
                                           status_path(tmp_path, PRETRAIN_RUN))] == files_before
    lock.release()
    assert not lock.path.exists()


def test_a_run_that_lost_its_lock_leaves_the_new_holders_lock_in_place(tmp_path):
    lock = run_lock.DirectoryLock(tmp_path, "run:job-7", Lines())
    lock.acquire()
    newer = {**run_lock.read_lock(lock.path), "pid": 4242, "host": "gpu-node-7", "token": "e" * 16,
             "heartbeat": time.time()}
    lock.path.write_text(json.dumps(newer))
    # Seen at the next write, though its own beat is fresh: the file is not the one it last read (os.stat)
    assert "now names another trainer (pid 4242 on gpu-node-7" in lock.lost()
    lock.beat()
    lock.release()
    assert run_lock.read_lock(lock.path) == newer


def test_a_heartbeat_in_flight_when_the_run_releases_its_lock_does_not_write_the_lock_back(tmp_path, monkeypatch):
    # Seen once under load: a run ended cleanly and its checkpoint directory kept its lock, rewritten by a beat
    # that had read the file (still ours) just before the release removed it.
    lock = run_lock.DirectoryLock(tmp_path, None, Lines())
    lock.acquire()
    beat_read_the_file, write_now = threading.Event(), threading.Event()
    write = run_lock.atomic_write_text

    def paused_write(path, text, before_rename=None):
        beat_read_the_file.set()
        assert write_now.wait(30)
        write(path, text, before_rename)

    monkeypatch.setattr(run_lock, "atomic_write_text", paused_write)
    beat = threading.Thread(target=lock.beat)
    beat.start()
    assert beat_read_the_file.wait(30)
    release = threading.Thread(target=lock.release)
    release.start()
    release.join(0.5)  # unguarded, the release removed the file here, and the beat below wrote it back
    write_now.set()
    beat.join(30)
    release.join(30)
    assert not beat.is_alive() and not release.is_alive()
    assert not lock.path.exists()


def test_the_lock_is_read_only_when_its_file_changed_and_a_replaced_lock_is_seen_at_once(tmp_path, monkeypatch):
    lock = run_lock.DirectoryLock(tmp_path, None, Lines())
    lock.acquire()
    reads = []
    read = run_lock.read_lock_and_identity
    monkeypatch.setattr(run_lock, "read_lock_and_identity", lambda path: reads.append(path) or read(path))
    for _ in range(100):  # as on every metrics line: an os.stat, no read
        assert lock.lost() is None
    assert reads == []
    lock.beat()  # the heartbeat reads the file before replacing it, and the new one after: then known again
    assert lock.lost() is None and len(reads) == 2
    # A takeover after a removal: another run's lock under the same name, written within the same second
    os.unlink(lock.path)
    lock.path.write_text(json.dumps({"host": "h", "pid": 1, "token": "f" * 16, "heartbeat": time.time()}))
    assert "now names another trainer (pid 1 on h" in lock.lost()

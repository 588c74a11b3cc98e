"""One run owns its directories (trainer/hardening/run_lock.py): a second trainer is refused, naming the holder; a
lock is taken over only from a holder that is provably gone; every rank must see rank 0's directory; holding
the lock, the start removes the temp files of killed writes and finds whatever stands where a save writes."""

import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import (PRETRAIN_RUN, REPO, TINY_MODEL, Lines, assert_exit_code, child_env, child_pids, events_of,
                      free_port, launch_command, read_trace, resume_file, run_args, save, slowed_env, train, wait_until)
from trainer.hardening import checkpoint_io as cio, directory_checks, run_lock
from trainer.hardening.checkpoint_io import CheckpointError, RunFiles
from trainer.hardening.resume_checks import ConfigError
from trainer.hardening.writer_lock import WRITERS_NAME, WritersLock

SLOW = pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                          reason="a 2-rank torchrun, then two runs; set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")


def foreign_lock(directory, **fields) -> dict:
    """A lock file as another trainer would have left it."""
    record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": run_lock.process_start(os.getpid()),
              "started": time.time() - 100, "command": "python trainer/train_pretrain.py", "job_id": None,
              "heartbeat": time.time(), "token": "f" * 16, **fields}
    (directory / run_lock.LOCK_NAME).write_text(json.dumps(record))
    return record


def lock_of(directory, job_id=None, log=None) -> run_lock.DirectoryLock:
    return run_lock.DirectoryLock(directory, job_id, log or (lambda message: None))


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_live_holder_on_this_host_is_refused_by_name(tmp_path):
    foreign_lock(tmp_path)  # our own pid: alive
    with pytest.raises(ConfigError, match=f"in use by another trainer \\(pid {os.getpid()} on "):
        lock_of(tmp_path).acquire()


def test_a_dead_or_reused_pid_is_taken_over_and_logged(tmp_path):
    for holder in ({"pid": dead_pid()}, {"pid_start": "1"}):  # gone; our pid, but another process's start time
        foreign_lock(tmp_path, **holder)
        lines = []
        lock = lock_of(tmp_path, log=lines.append)
        lock.acquire()
        assert lock.held and run_lock.read_lock(lock.path)["token"] == lock.record["token"]
        assert len(lines) == 1 and lines[0].startswith(f"taking over {lock.path}: its holder is gone")
        lock.release()
        assert not lock.path.exists()


def test_another_host_is_taken_over_only_with_the_same_job_id_and_a_stale_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "STALE_AFTER_S", 0.5)
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.2)
    stale = time.time() - 10
    foreign_lock(tmp_path, host="other-node", job_id="slurm:77", heartbeat=stale)
    for job_id in (None, "slurm:78"):  # no identity, or another job's: never taken over
        with pytest.raises(ConfigError, match="in use by another trainer .* on other-node"):
            lock_of(tmp_path, job_id).acquire()
    lines = []
    lock = lock_of(tmp_path, "slurm:77", lines.append)
    lock.acquire()
    assert lock.held and "same job id, heartbeat stale" in lines[0]
    lock.release()

    # A fresh heartbeat of the same job (its previous attempt died moments ago) is waited out, with a bound.
    foreign_lock(tmp_path, host="other-node", job_id="slurm:77", heartbeat=time.time())
    started, lines = time.monotonic(), []
    lock = lock_of(tmp_path, "slurm:77", lines.append)
    lock.acquire()
    assert lock.held and "waiting" in lines[0] and 0.4 < time.monotonic() - started < 5
    lock.release()


def test_a_lock_that_is_not_ours_is_an_error_not_a_silent_takeover(tmp_path):
    (tmp_path / run_lock.LOCK_NAME).write_text("my notes\n")
    with pytest.raises(ConfigError, match="is not a lock file of this trainer"):
        lock_of(tmp_path).acquire()
    assert (tmp_path / run_lock.LOCK_NAME).read_text() == "my notes\n"


def _take(directory, results):
    lock = lock_of(directory)
    try:
        lock.acquire()
        results.put(lock.record["token"])
        time.sleep(2)  # hold it while the others try
    except ConfigError:
        results.put(None)


def test_of_several_starters_on_a_stale_lock_exactly_one_wins(tmp_path):
    foreign_lock(tmp_path, pid=dead_pid())
    context = multiprocessing.get_context("fork")  # the starters need only this module, already imported
    results = context.Queue()
    starters = [context.Process(target=_take, args=(tmp_path, results)) for _ in range(4)]
    for p in starters:
        p.start()
    for p in starters:
        p.join(60)
    tokens = [results.get(timeout=5) for _ in starters]
    assert sum(t is not None for t in tokens) == 1, tokens


def _hold_as_another_rank(directory, ready, done):
    """A process of a run other than its rank 0: it holds its kernel lock in the directory until `done`."""
    writers = WritersLock(directory)
    writers.share()
    ready.set()
    done.wait(60)


def test_a_gone_holder_is_not_taken_over_while_another_process_of_its_run_lives(tmp_path):
    """Rank 0 gone, rank 1 still writing (its torchrun was killed): the dead pid in the lock file was taken over."""
    holder = foreign_lock(tmp_path, pid=dead_pid())
    context = multiprocessing.get_context("fork")  # the rank needs only this module, already imported
    ready, done = context.Event(), context.Event()
    rank_1 = context.Process(target=_hold_as_another_rank, args=(tmp_path, ready, done))
    rank_1.start()
    try:
        assert ready.wait(30)
        with pytest.raises(ConfigError) as refused:
            lock_of(tmp_path).acquire()
        line = str(refused.value)
        assert line.startswith(f"{tmp_path} is in use by another trainer: the lock's holder is gone (pid "
                               f"{holder['pid']} on ") and "\n" not in line, line
        assert f"a process of that run still holds {tmp_path / WRITERS_NAME}" in line
        assert run_lock.read_lock(tmp_path / run_lock.LOCK_NAME)["token"] == holder["token"]  # left as it was
        (tmp_path / run_lock.LOCK_NAME).unlink()  # removed by hand: still refused, and nothing left behind
        with pytest.raises(ConfigError, match="in use by another trainer: a process of that run still holds"):
            lock_of(tmp_path).acquire()
        assert not (tmp_path / run_lock.LOCK_NAME).exists()
    finally:
        done.set()
        rank_1.join(30)
    lock = lock_of(tmp_path)  # its last process gone, the kernel dropped its lock: the directory is free
    lock.acquire()
    assert lock.held
    lock.release()


def rank_of(pid: int) -> int:
    environ = dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\0") if "=" in item)
    return int(environ["RANK"])


def wait_gone(pid: int, timeout: float = 60) -> bool:
    """Whether `pid` ended (a zombie no one reaps counts as ended) within `timeout` seconds."""
    deadline = time.time() + timeout
    while run_lock.pid_alive(pid, None):
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


@SLOW
def test_torchrun_killed_alone_its_workers_exit_and_no_run_takes_the_directories_while_one_lives(tmp_path,
                                                                                                  pretrain_data):
    """Before: SIGKILL to torchrun alone left both workers training for over a minute, and a new run took the same
    directories from the dead rank 0 meanwhile. Rank 1 is paused here (SIGSTOP) so that it outlives its rank 0."""
    run = tmp_path / "run"
    flags = run_args(run, pretrain_data, "--batch_size", "2", "--epochs", "50", "--save_interval", "2",
                     "--from_resume", "1")
    launcher = subprocess.Popen(launch_command("train_pretrain.py", 2, [*TINY_MODEL, *flags]), cwd=tmp_path,
                                env=slowed_env(step_delay_s=0.2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    workers = []
    try:
        wait_until(lambda: (run / "ckpt" / f"{PRETRAIN_RUN}_latest.txt").is_file(), launcher, 120)  # a checkpoint
        workers = sorted(child_pids(launcher.pid), key=rank_of)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGSTOP)
        launcher.kill()  # torchrun alone
        launcher.wait(30)
        assert wait_gone(workers[0]), "rank 0 outlived its torchrun"

        second = train("train_pretrain.py", None, flags, tmp_path, check=False)  # rank 1 lives (paused)
        assert_exit_code(second, 2)
        assert second.stderr.strip().splitlines() == [second.stderr.strip()], second.stderr  # one line
        assert "is in use by another trainer: the lock's holder is gone (pid " in second.stderr
        assert "a process of that run still holds" in second.stderr

        os.kill(workers[1], signal.SIGCONT)
        assert wait_gone(workers[1]), "rank 1 outlived its torchrun"
    finally:
        for pid in workers:
            if run_lock.pid_alive(pid, None):
                os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.communicate()
    saved = int(re.search(r"step_(\d+)", (run / "ckpt" / f"{PRETRAIN_RUN}_latest.txt").read_text()).group(1))
    third = train("train_pretrain.py", None, [*flags, "--max_steps", "1"], tmp_path)  # once no process of it is left
    assert f"taking over {run / 'ckpt' / run_lock.LOCK_NAME}: its holder is gone" in third.stdout, third.stdout[-3000:]
    assert events_of(run)[-1] == ("resume", saved) and resume_file(run)["global_step"] == saved + 1


def test_a_second_trainer_is_refused_and_a_killed_ones_lock_is_taken_over(tmp_path, pretrain_data):
    run = tmp_path / "run"
    flags = run_args(run, pretrain_data, "--batch_size", "4", "--epochs", "4", "--from_resume", "1")
    args = [*TINY_MODEL, *flags, "--save_interval", "1"]
    first = subprocess.Popen(launch_command("train_pretrain.py", None, args), cwd=tmp_path,
                             env=slowed_env(step_delay_s=0.5), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        lock_file = run / "ckpt" / run_lock.LOCK_NAME
        wait_until(lambda: (run / "ckpt" / f"{PRETRAIN_RUN}_history").is_dir(), first, 60)  # past start-up
        assert lock_file.is_file() and run_lock.read_lock(lock_file)["pid"] == first.pid
        second = train("train_pretrain.py", None, flags, tmp_path, check=False)
        assert_exit_code(second, 2)
        assert second.stderr.strip().splitlines() == [second.stderr.strip()], second.stderr  # one line
        assert f"in use by another trainer (pid {first.pid} on {socket.gethostname()}" in second.stderr
        assert "command: " in second.stderr and "last heartbeat" in second.stderr
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.communicate()
    third = train("train_pretrain.py", None, flags, tmp_path)
    assert f"taking over {lock_file}: its holder is gone (pid {first.pid}" in third.stdout
    assert not lock_file.exists()  # released at the end


def test_a_rank_that_cannot_see_rank_0s_directory_fails_fast(tmp_path, pretrain_data):
    # Two "nodes" whose checkpoint directories are not shared: each rank gets its own local directory.
    script = REPO / "trainer" / "train_pretrain.py"
    flags = " ".join([*TINY_MODEL, "--data_path", str(pretrain_data), "--save_dir", str(tmp_path / "out"),
                      "--max_steps", "1"])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "--no-python", "sh", "-c",
               f"exec {sys.executable} {script} {flags} --checkpoint_dir {tmp_path}/node$RANK/ckpt"]
    result = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "rank 1 on " in result.stderr and "cannot see the lock rank 0 wrote in" in result.stderr
    assert "every node must see the same checkpoint directory" in result.stderr
    assert "trainer/" not in "".join(l for l in result.stderr.splitlines() if l.strip().startswith("File "))
    assert not (tmp_path / "node0" / "ckpt" / f"{PRETRAIN_RUN}_history").exists()  # no step was trained


# ---- at start, holding the lock: obstructions and the temp files of killed writes ---------------------------------------------

def test_every_obstruction_is_named_in_one_line_and_nothing_is_changed(files, tmp_path):
    save(files, 2)
    out_path = tmp_path / "out" / "pretrain_32.pth"
    assert directory_checks.find_obstructions(files, out_path) == []
    files.failed_dir.write_text("a file where the folder for failed checkpoints goes")
    folders = [files.history_file(3), files.history_dir / "step_00000003.pth.json", files.latest_pointer, out_path]
    files.latest_pointer.unlink()
    for folder in folders:
        folder.mkdir(parents=True)
    os.mkfifo(files.history_file(4))  # reading it would wait forever
    (files.history_dir / "step_00000005.pth").symlink_to(tmp_path / "nowhere")
    files.resume_link.unlink()
    files.resume_link.mkdir()
    (files.history_dir / "notes").mkdir()  # not a name a save writes: not in the way
    found = directory_checks.find_obstructions(files, out_path)
    expected = [*folders, files.resume_link, files.failed_dir, files.history_file(4), files.history_file(5)]
    assert len(found) == len(expected)
    for path in expected:
        assert sum(line.startswith(f"{path} is ") for line in found) == 1, (path, found)
    with pytest.raises(CheckpointError) as caught:
        directory_checks.check_no_obstructions(files, out_path)
    message = str(caught.value)
    assert "\n" not in message and all(str(path) in message for path in expected)
    assert "Move them out of the way" in message
    assert all(path.is_dir() for path in folders) and files.failed_dir.is_file()


def test_a_history_folder_that_is_a_file_is_an_obstruction(files, tmp_path):
    files.checkpoint_dir.mkdir()
    files.history_dir.write_text("not a folder")
    assert directory_checks.find_obstructions(files, tmp_path / "out" / "pretrain_32.pth") == [
        f"{files.history_dir} is a file, where this run needs a folder"]


def test_stale_temp_files_of_the_run_are_removed_and_nothing_else(files, tmp_path):
    out_dir = tmp_path / "out"
    save(files, 2)
    ours = [files.history_dir / "step_00000004.pth.tmp",  # an earlier version's fixed name
            files.history_dir / "step_00000004.pth.partial-node1-123-456.tmp",
            files.history_dir / "step_00000004.pth.json.partial-node1-123-456.tmp",
            files.history_dir / "step_00000004.dcp.json.partial-node1-123-456.tmp",
            files.history_dir / "step_00000004.json.partial-node1-123-456.tmp",  # an earlier version's manifest
            files.checkpoint_dir / "pretrain_32_resume.pth.partial-node1-123-456.tmp",
            files.checkpoint_dir / "pretrain_32_latest.txt.tmp", out_dir / "pretrain_32.pth.partial-node2-9-9.tmp",
            out_dir / "pretrain_32.json.partial-node2-9-9.tmp"]  # the out/ file's sidecar (max_seq_len, tokenizer)
    not_ours = [files.history_dir / "notes.tmp", files.checkpoint_dir / "full_sft_32_resume.pth.partial-n-1-1.tmp",
                out_dir / "pretrain_32.pth.partial-n-1-1.tmp.bak", out_dir / "mine.tmp",
                out_dir / "trainer.lock.partial-n-1.tmp", files.checkpoint_dir / "pretrain_32_resume.pth.old.tmp",
                out_dir / "pretrain_32.jsonl.partial-n-1-1.tmp", out_dir / "pretrain_32.txt.partial-n-1-1.tmp"]
    out_dir.mkdir()
    for path in ours + not_ours:
        path.write_bytes(b"x")
    (files.history_dir / "step_00000005.pth.tmp").mkdir()  # not a file a write leaves: left alone
    log = Lines()
    removed = directory_checks.remove_stale_temp_files(files, out_dir, log)
    assert sorted(removed) == sorted(ours) and not any(path.exists() for path in ours)
    assert all(path.exists() for path in not_ours) and (files.history_dir / "step_00000005.pth.tmp").is_dir()
    assert len(log) == len(ours) and all(any(str(path) in line for line in log) for path in ours)
    assert cio.verify(files.history_file(2)) is None


def test_a_folder_where_the_next_checkpoint_goes_stops_the_run_before_training(tmp_path, pretrain_data):
    files = RunFiles(tmp_path / "ckpt", PRETRAIN_RUN)
    args = run_args(tmp_path, pretrain_data, "--batch_size", "2", "--epochs", "1", "--save_interval", "1")
    train("train_pretrain.py", None, [*args, "--max_steps", "1"], cwd=tmp_path)
    files.history_file(2).mkdir()  # where the resumed run's first save would go
    steps_before = len(read_trace(tmp_path / "trace.jsonl"))
    result = train("train_pretrain.py", None, [*args, "--from_resume", "1", "--max_steps", "1"], cwd=tmp_path,
                   check=False)
    assert_exit_code(result, 2)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if str(files.history_file(2)) in line]
    assert len(errors) == 1 and "is a folder" in errors[0] and "Traceback" not in result.stderr
    assert len(read_trace(tmp_path / "trace.jsonl")) == steps_before  # not a step trained
    assert files.history_file(2).is_dir() and cio.verify(files.history_file(1)) is None

"""Self-healing: `torchrun --max-restarts 1 ... --from_resume 1` outlives the death of a worker on its own.

A 2-rank CPU/gloo job loses a process mid-run — a training rank mid-training, the rank that writes
mid-save, a DataLoader worker — launched with `--standalone`, with `--master_addr/--master_port`, and
as two one-rank "nodes" meeting through the c10d rendezvous (there the two launchers count the restart
differently: TORCHELASTIC_RESTART_COUNT is 1 on one node and 0 on the other). torchrun restarts the
group, which resumes from the newest good checkpoint and finishes with exit 0 within TIMEOUT_S: the
trace holds each (step, rank) once (a resume cuts it back to its checkpoint, as the metrics file is) and
each sample once per epoch, and the final state equals an uninterrupted run's bit for bit. An error a
restart cannot fix (exit 2) costs max-restarts quick attempts, then torchrun gives up.

tests/fault_injection/sitecustomize.py slows steps and saves so the kill lands where each case wants it.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (REPO, TINY_MODEL, assert_each_sample_once, assert_states_equal, child_env, events_of,
                      free_port, resume_file, run_args, slice_jsonl, slowed_env, trace_of)
from benchmarks.soak_kill import descendants, kill_job

NUM_SAMPLES, EPOCHS = 37, 2  # 10 steps of 4 samples an epoch (the last one takes 1), 20 in all
JOB = ["--batch_size", "2", "--epochs", str(EPOCHS), "--save_interval", "3", "--from_resume", "1"]
TIMEOUT_S = 120  # from launch to torchrun's exit, restart included (about 15 s on 2 idle cores)


def torchrun(rendezvous: str, max_restarts: int, args: list[str]) -> list[list[str]]:
    """The torchrun command(s) of a 2-rank train_pretrain.py job with --max-restarts: one launcher with
    'standalone' or 'static' (--master_addr/--master_port), one per "node" with 'c10d-2-nodes'."""
    script, port = [str(REPO / "trainer" / "train_pretrain.py"), *TINY_MODEL, *args], str(free_port())
    common = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", str(max_restarts)]
    if rendezvous == "c10d-2-nodes":
        return [[*common, "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1", "--rdzv-backend",
                 "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "self-healing", *script]
                for node in (0, 1)]
    launcher = ["--standalone"] if rendezvous == "standalone" else ["--master_addr", "127.0.0.1", "--master_port", port]
    return [[*common, *launcher, "--nproc_per_node", "2", *script]]


def environment_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def first_attempt_worker(launchers: list[subprocess.Popen], rank: int) -> int | None:
    """The pid of training rank `rank` of the first worker group (a launcher's own child), if running."""
    for launcher in launchers:
        for pid in descendants(launcher.pid):
            try:
                env = environment_of(pid)
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):  # it exited while we looked
                continue
            if parent == launcher.pid and (env.get("RANK"), env.get("TORCHELASTIC_RESTART_COUNT")) == (str(rank), "0"):
                return pid
    return None


def wait_for(condition, launchers: list[subprocess.Popen], what: str, timeout: float = 60):
    """condition()'s first truthy value; fails if a launcher ends or `timeout` passes first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = condition()
        if found:
            return found
        ended = [launcher.returncode for launcher in launchers if launcher.poll() is not None]
        assert not ended, f"the job ended (exit {ended}) before {what}"
        time.sleep(0.01)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def trace_lines(run_dir: Path) -> int:
    """Whole lines in the trace so far (one per step and rank)."""
    trace = run_dir / "trace.jsonl"
    return trace.read_bytes().count(b"\n") if trace.exists() else 0


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return slice_jsonl(REPO / "dataset" / "pretrain_demo.jsonl", tmp_path_factory.mktemp("data") / "data.jsonl",
                       NUM_SAMPLES)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data) -> Path:
    """The same job with nothing killed: its final state is what every healed run must end with."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    [command] = torchrun("standalone", 0, run_args(run_dir, data, *JOB))
    result = subprocess.run(command, cwd=run_dir, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def kill_rank_1_mid_training(launchers: list[subprocess.Popen], run_dir: Path) -> None:
    rank_1 = wait_for(lambda: first_attempt_worker(launchers, 1), launchers, "rank 1's pid")
    wait_for(lambda: trace_lines(run_dir) >= 10, launchers, "step 5")
    os.kill(rank_1, signal.SIGKILL)


def kill_rank_0_mid_save(launchers: list[subprocess.Popen], run_dir: Path) -> None:
    # Rank 0 writes the checkpoints. Strike while step 6's is a temp file: step 3's is the newest good one.
    rank_0 = wait_for(lambda: first_attempt_worker(launchers, 0), launchers, "rank 0's pid")
    history = run_dir / "ckpt" / "pretrain_32_history"
    wait_for(lambda: list(history.glob("step_00000006.pth*.tmp")), launchers, "the save of step 6")
    os.kill(rank_0, signal.SIGKILL)


def kill_a_dataloader_worker_of_rank_1(launchers: list[subprocess.Popen], run_dir: Path) -> None:
    rank_1 = wait_for(lambda: first_attempt_worker(launchers, 1), launchers, "rank 1's pid")
    wait_for(lambda: trace_lines(run_dir) >= 10, launchers, "step 5")
    loader_worker = wait_for(lambda: descendants(rank_1)[:1], launchers, "rank 1's DataLoader worker")[0]
    os.kill(loader_worker, signal.SIGKILL)


CASES = {  # rendezvous, what dies, extra flags, slowdown (step delay, save delay)
    "standalone-rank1-training": ("standalone", kill_rank_1_mid_training, [], (0.1, 0.0)),
    # --log_interval 1000: the slowed writes would slow each step's status file too.
    "static-rank0-saving": ("static", kill_rank_0_mid_save, ["--log_interval", "1000"], (0.1, 0.4)),
    "static-dataloader-worker": ("static", kill_a_dataloader_worker_of_rank_1, ["--num_workers", "1"], (0.1, 0.0)),
    "c10d-2-nodes-rank1-training": ("c10d-2-nodes", kill_rank_1_mid_training, [], (0.1, 0.0)),
}


# Two of the cases (about 55 s together on two CPU cores) run with TRAINER_SLOW_TESTS=1, as .ci/run does.
SLOW_CASES = ("static-dataloader-worker", "c10d-2-nodes-rank1-training")
SLOW = pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1", reason="set TRAINER_SLOW_TESTS=1 to run it")


@pytest.mark.parametrize("case", [pytest.param(case, marks=SLOW) if case in SLOW_CASES else case for case in CASES])
def test_a_killed_process_restarts_the_group_which_resumes_and_ends_as_an_uninterrupted_run(
        case, tmp_path, data, uninterrupted):
    rendezvous, kill, extra, (step_delay_s, save_delay_s) = CASES[case]
    started, launchers, logs = time.time(), [], []
    for number, command in enumerate(torchrun(rendezvous, 1, run_args(tmp_path, data, *JOB, *extra))):
        logs.append(tmp_path / f"torchrun_{number}.log")
        with open(logs[-1], "w") as log:
            launchers.append(subprocess.Popen(command, cwd=tmp_path, env=slowed_env(step_delay_s, save_delay_s),
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        kill(launchers, tmp_path)
        for launcher in launchers:
            launcher.wait(timeout=max(TIMEOUT_S - (time.time() - started), 1))
    except BaseException as error:  # a hang, or the job ended before the kill: leave nothing running, show the log
        for launcher in launchers:
            kill_job(launcher)
        raise AssertionError(f"{case}: {error}\n{logs[0].read_text()[-5000:]}") from error
    output = "".join(log.read_text() for log in logs)
    codes = [launcher.returncode for launcher in launchers]
    assert set(codes) == {0}, f"{case}: torchrun exited {codes}\n{output[-5000:]}"

    # Healed once: one resume (from a checkpoint, not from scratch), logged by the restarted group.
    resumes = [step for event, step in events_of(tmp_path) if event == "resume"]
    assert len(resumes) == 1 and resumes[0] > 0, f"{case}: resume events {resumes}\n{output[-5000:]}"
    assert output.count("training finished at step 20") == 1

    # Exactly once: one record per (step, rank), each sample once per epoch; then bit-identical.
    trace = trace_of(tmp_path)
    counts = collections.Counter((r["step"], r["rank"]) for r in trace)
    assert sorted(counts) == [(step, rank) for step in range(1, 21) for rank in (0, 1)]
    assert set(counts.values()) == {1}, f"{case}: steps recorded twice: {[k for k, n in counts.items() if n > 1]}"
    assert_each_sample_once(trace, NUM_SAMPLES, EPOCHS)
    assert_states_equal(resume_file(tmp_path), resume_file(uninterrupted))


def test_an_expected_error_is_retried_max_restarts_times_each_failing_fast_then_torchrun_gives_up(tmp_path):
    # A restart cannot fix a bad file or a refused resume, but torchrun restarts on any non-zero exit.
    # What bounds it: max-restarts, and each attempt failing in its first seconds with the same line.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    started = time.time()
    [command] = torchrun("standalone", 2, run_args(tmp_path, empty, *JOB))
    result = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    seconds = time.time() - started
    assert result.returncode == 1  # torchrun's own code for "a worker group failed"; the workers' was 2
    said = [line for line in result.stderr.splitlines() if line.startswith(f"error: {empty}: no records")]
    assert len(said) == 3  # rank 0's line, once per attempt
    # torchrun's summary of the last attempt shows it for each rank, from the workers' error files.
    assert result.stderr.count(f"traceback : error: {empty}: no records") == 2, result.stderr[-3000:]
    assert result.stderr.count("(exitcode: 2)") == 3
    assert seconds < 60, f"3 attempts took {seconds:.0f} s"


def alive(pid: int) -> bool:
    """Whether `pid` runs (an exited child not yet reaped by its dead parent's heir is a zombie: not alive)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_whose_torchrun_was_killed_at_start_give_up_at_the_setup_timeout_in_one_line_each(tmp_path, data):
    # kill -9 of torchrun alone leaves its workers running (each in a session of its own), with no store to meet
    # in. They must end at the setup timeout (10 minutes; TRAINER_SETUP_TIMEOUT_S here), each with one line naming
    # its rank. Before: torch's store client tried twice (20 minutes), then a C++ stack and a Python traceback.
    timeout_s = 3
    [command] = torchrun("standalone", 0, run_args(tmp_path, data, *JOB))
    with open(tmp_path / "output.txt", "w") as output:  # the workers keep the launcher's stdout: a file, not a pipe
        launcher = subprocess.Popen(command, cwd=tmp_path, env=child_env(TRAINER_SETUP_TIMEOUT_S=timeout_s),
                                    stdout=output, stderr=subprocess.STDOUT)

        def both_workers() -> list[int] | None:
            pids = [first_attempt_worker([launcher], rank) for rank in (0, 1)]
            return pids if all(pids) else None

        workers = wait_for(both_workers, [launcher], "two workers started")
        launcher.kill()  # before the workers, still importing torch, reach the store it served
        launcher.wait()
        orphaned = time.time()
        while any(alive(pid) for pid in workers) and time.time() - orphaned < 90:
            time.sleep(0.2)
    seconds, survivors = time.time() - orphaned, [pid for pid in workers if alive(pid)]
    for pid in survivors:  # a failed test leaves no orphan behind
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "the orphaned workers were still running after 90 s"
    text = (tmp_path / "output.txt").read_text()
    assert seconds < timeout_s + 45, f"the orphaned workers took {seconds:.0f} s to give up"  # start-up on a busy machine
    for rank in (0, 1):
        assert f"error: rank {rank}: torchrun's store at " in text, text[-3000:]
    assert "Traceback" not in text and "frame #" not in text, text[-3000:]


def test_a_store_lost_while_the_group_is_set_up_is_one_line_naming_the_rank(monkeypatch, capsys):
    # torchrun killed after its workers reached the store, before init_process_group read the peers' addresses
    # there: the store client's DistNetworkError (here: nobody serves the port) was a traceback.
    import torch.distributed as dist
    from datetime import timedelta
    from trainer.hardening.process_exit import run_script
    monkeypatch.setenv("RANK", "1")

    def main() -> None:
        dist.TCPStore("127.0.0.1", free_port(), 2, False, timedelta(seconds=1))

    with pytest.raises(SystemExit) as exited:
        run_script(main)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: rank 1: gave up setting up the process group: "), err

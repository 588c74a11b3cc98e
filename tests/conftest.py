"""Shared helpers: tiny data files, real `python` / `torchrun` training processes on the CPU, and
the readers and comparisons the tests use to check what those processes left on disk.

A test's run lives in one directory (`run_dir`): `out/` (FP16 weights), `ckpt/` (resume state),
`metrics/` (metrics and status files) and `trace.jsonl` (one record per optimizer step and rank).
Tests assert on those files, not on the wording of log lines, wherever a file records the fact.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from scripts.run_files import TRAINING_STATE_FIELDS, state_differences
from trainer.hardening import checkpoint_io as cio
from trainer.hardening.checkpoint_io import RunFiles

REPO = Path(__file__).resolve().parent.parent


def is_slow(item) -> bool:
    """A test that runs only when TRAINER_SLOW_TESTS=1: its skipif says so."""
    return any("TRAINER_SLOW_TESTS" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    """TRAINER_SLOW_ONLY=1 (.ci/run's second command, after the README's): the slow tests of the files and ids it
    names, without the others of those files, which the README's command has just run."""
    if os.environ.get("TRAINER_SLOW_ONLY") == "1":
        config.hook.pytest_deselected(items=[item for item in items if not is_slow(item)])
        items[:] = [item for item in items if is_slow(item)]
FAULT_INJECTION_DIR = REPO / "tests" / "fault_injection"
# The project's own Python files: the folders of the layout and the top-level modules, never a venv made in the
# clone (the README's install line puts one at .venv) nor a tool's cache.
PROJECT_FOLDERS = ("model", "trainer", "dataset", "scripts", "tests", "benchmarks")
PRETRAIN_RUN = "pretrain_32"  # {save_weight}_{hidden_size} of TINY_MODEL

# A model small enough that a 2-process gloo run takes seconds on 2 CPU cores.
TINY_MODEL = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "4",
              "--num_key_value_heads", "2", "--max_seq_len", "48", "--num_workers", "0", "--device", "cpu"]


def with_loader_workers(count: int) -> list[str]:
    """TINY_MODEL whose batches come from `count` DataLoader worker processes, as by default (--num_workers 1):
    the stop tests need them, as a signal to a process group reaches the workers too."""
    at = TINY_MODEL.index("--num_workers")
    return [*TINY_MODEL[:at + 1], str(count), *TINY_MODEL[at + 2:]]


# ---- launching training processes -------------------------------------------------------------

def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (under torchrun: its workers; under a worker: its DataLoader workers)."""
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def project_python_files() -> list[Path]:
    """Every .py file of this project (see PROJECT_FOLDERS)."""
    return [*REPO.glob("*.py"), *(path for folder in PROJECT_FOLDERS for path in (REPO / folder).rglob("*.py"))]


def our_traceback_lines(output: str) -> list[str]:
    """The traceback frames in `output` that name a file of this project: a frame of a package in a venv made
    inside the clone (torchrun's own traceback, from .venv/lib/.../torch) is not one."""
    venv = f'File "{Path(sys.prefix).resolve()}'
    return [line for line in output.splitlines() if f'File "{REPO}' in line and venv not in line]


def child_env(**extra) -> dict:
    """The environment of a training child: one thread per rank, trackers offline, nothing on PYTHONPATH
    (the scripts must find the repository by themselves, as after a plain clone)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", SWANLAB_MODE="offline",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def slowed_env(step_delay_s: float = 0.0, save_delay_s: float = 0.0) -> dict:
    """child_env for a job slowed from outside (tests/fault_injection/sitecustomize.py), so a test can
    signal or kill it mid-run."""
    return child_env(PYTHONPATH=FAULT_INJECTION_DIR, FAULT_STEP_DELAY_S=step_delay_s, FAULT_SAVE_DELAY_S=save_delay_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(script: str, nproc: int | None, args: list[str]) -> list[str]:
    """`python trainer/script` when nproc is None, else `torchrun --nproc_per_node nproc trainer/script`."""
    path = str(REPO / "trainer" / script)
    if nproc is None:
        return [sys.executable, path, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port()), path, *args]


def assert_exit_code(result: subprocess.CompletedProcess, expected: int = 0) -> None:
    """Fail with the end of the process's output when it did not exit with `expected`."""
    if result.returncode != expected:
        raise AssertionError(f"exit code {result.returncode}, expected {expected}\n"
                             f"STDOUT:\n{result.stdout[-6000:]}\nSTDERR:\n{result.stderr[-6000:]}")


def train(script: str, nproc: int | None, args: list[str], cwd: Path, check: bool = True, timeout: int = 300,
          **env) -> subprocess.CompletedProcess:
    """Run one training invocation of TINY_MODEL to completion; with `check`, it must exit 0."""
    result = subprocess.run(launch_command(script, nproc, [*TINY_MODEL, *args]), cwd=cwd, env=child_env(**env),
                            capture_output=True, text=True, timeout=timeout)
    if check:
        assert_exit_code(result)
    return result


def wait_until(condition, job: subprocess.Popen, timeout: float = 120) -> None:
    """Poll `condition` until it holds; fail if `job` ends first or `timeout` seconds pass."""
    deadline = time.time() + timeout
    while not condition():
        assert job.poll() is None, f"the job ended (exit {job.returncode}) before the moment the test waits for"
        assert time.time() < deadline, "timed out waiting for the job"
        time.sleep(0.05)


def wait_for_server(server: subprocess.Popen, base: str, log: Path, timeout: float = 60) -> None:
    """Until the server at `base` answers GET /v1/models; it exiting first, or `timeout` seconds, fail with its log."""
    deadline = time.time() + timeout
    while True:
        assert server.poll() is None, f"the server exited {server.returncode}:\n{log.read_text()}"
        assert time.time() < deadline, f"the server did not answer in {timeout:.0f} s:\n{log.read_text()}"
        try:
            urllib.request.urlopen(f"{base}/v1/models", timeout=2).close()
            return
        except OSError:
            time.sleep(0.2)


def run_args(run_dir: Path, data: Path, *extra: str) -> list[str]:
    """Flags that put every file of a run under `run_dir` (see the module docstring), logging every step."""
    return ["--data_path", str(data), "--save_dir", str(run_dir / "out"), "--checkpoint_dir", str(run_dir / "ckpt"),
            "--metrics_dir", str(run_dir / "metrics"), "--save_debug_train_output", str(run_dir / "trace.jsonl"),
            "--log_interval", "1", *extra]


# ---- checkpoints made in-process --------------------------------------------------------------

def small_state(step: int) -> dict:
    """A checkpoint-shaped dict: tensors, nested dicts, plain numbers."""
    generator = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 16, generator=generator), "b": torch.full((16,), float(step))},
            "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 1e-3}]},
            "step": step, "epoch": 0}


def save(files: RunFiles, step: int, keep_last: int = 2) -> Path:
    return cio.save_verified(files, small_state(step), step, keep_last, {"epoch": 0, "samples_consumed": 4 * step})


@pytest.fixture
def files(tmp_path) -> RunFiles:
    """The checkpoint files of a run named like TINY_MODEL's pretraining, under tmp_path/ckpt."""
    return RunFiles(tmp_path / "ckpt", "pretrain_32")


class Lines(list):
    """A `log` callable that keeps what it was told."""

    def __call__(self, line: str) -> None:
        self.append(line)


# ---- reading what a run left ------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_trace(path: Path) -> list[dict]:
    """The --save_debug_train_output records, in the order they were written."""
    return read_jsonl(path)


def trace_of(run_dir: Path) -> list[dict]:
    return read_trace(run_dir / "trace.jsonl")


def resume_file(run_dir: Path, name: str = PRETRAIN_RUN) -> dict:
    """The newest resume state of run `name` under `run_dir` (what `--from_resume 1` would load)."""
    return torch.load(run_dir / "ckpt" / f"{name}_resume.pth", weights_only=True)


def history_file(run_dir: Path, step: int, name: str = PRETRAIN_RUN) -> dict:
    """The kept checkpoint of global step `step`."""
    return torch.load(run_dir / "ckpt" / f"{name}_history" / f"step_{step:08d}.pth", weights_only=True)


def status_of(run_dir: Path, name: str = PRETRAIN_RUN) -> dict:
    """The run's `{name}_status.json` under `run_dir/metrics`."""
    from scripts.run_files import read_status
    from trainer.hardening.metrics_files import status_path
    return read_status(status_path(run_dir / "metrics", name))


def metrics_of(run_dir: Path, name: str = PRETRAIN_RUN) -> list[dict]:
    """Every record of the run's `{name}_metrics.jsonl` under `run_dir/metrics`, in file order."""
    from trainer.hardening.metrics_files import metrics_path, read_metrics
    return read_metrics(metrics_path(run_dir / "metrics", name))


def events_of(run_dir: Path, name: str = PRETRAIN_RUN) -> list[tuple[str, int]]:
    """(event, step) of the resume / anomaly / rollback events in the metrics file, in order."""
    return [(r["event"], r["step"]) for r in metrics_of(run_dir, name) if "event" in r]


def last_record_per_step_and_rank(trace: list[dict]) -> list[dict]:
    """A step trained again after a rollback appears twice in the trace (a resume cuts the trace back to its
    checkpoint, so a kill leaves one record per step); the later record counts."""
    last = {}
    for record in trace:
        last[record["step"], record["rank"]] = record
    return list(last.values())


def samples_per_epoch(records: list[dict]) -> dict[int, dict[int, int]]:
    """{epoch: {sample index: times trained}} over the given trace records."""
    seen: dict[int, dict[int, int]] = {}
    for record in records:
        counts = seen.setdefault(record["epoch"], {})
        for index in record["samples"]:
            counts[index] = counts.get(index, 0) + 1
    return seen


def assert_each_sample_once(records: list[dict], num_samples: int, epochs: int) -> None:
    """Every epoch trained each of its `num_samples` samples exactly once."""
    seen = samples_per_epoch(records)
    for epoch in range(epochs):
        counts = seen.get(epoch, {})
        missing = sorted(set(range(num_samples)) - set(counts))
        repeated = sorted(i for i, n in counts.items() if n > 1)
        assert not missing and not repeated, f"epoch {epoch}: missing {missing}, trained twice {repeated}"


def sigterm_two_ranks_then_resume(script: str, run: str, args: list[str], run_dir: Path) -> None:
    """A 2-rank run of 11 samples x 2 epochs (batch 1), SIGTERM to every training process after 4 trace lines: it
    saves, exits 0 and says stopped; the resume on 2 ranks completes and trains each sample once per epoch."""
    trace = run_dir / "trace.jsonl"
    launcher = subprocess.Popen(launch_command(script, 2, [*with_loader_workers(1), *args]), cwd=run_dir,
                                env=slowed_env(step_delay_s=0.2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    deadline = time.time() + 120
    while (not trace.exists() or len(read_trace(trace)) < 4) and time.time() < deadline:
        time.sleep(0.2)
    workers = child_pids(launcher.pid)
    assert len(workers) == 2, "expected two worker processes under torchrun"
    for pid in workers + [loader for worker in workers for loader in child_pids(worker)]:
        # as a preempted machine signals every training process; a worker's child may be a tool's call (agentic
        # GRPO), which can end in between
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0 and "(SIGTERM)" in output, output[-3000:]
    stopped_at = resume_file(run_dir, run)["global_step"]
    assert 2 <= stopped_at < 12 and status_of(run_dir, run)["status"] == "stopped"
    train(script, 2, [*args, "--from_resume", "1"], run_dir)
    assert events_of(run_dir, run) == [("resume", stopped_at)] and status_of(run_dir, run)["status"] == "completed"
    assert_each_sample_once(trace_of(run_dir), num_samples=11, epochs=2)


# ---- comparing resume states ------------------------------------------------------------------

# What the next optimizer step depends on: two runs that agree on these continue identically.
def assert_states_equal(a: dict, b: dict, fields: tuple[str, ...] = TRAINING_STATE_FIELDS) -> None:
    """Two resume states hold the same `fields`, bit for bit: weights, optimizer state and param
    groups, scaler, every rank's RNG, and the data position."""
    differences = [d for name in fields for d in state_differences({name: a[name]}, {name: b[name]})]
    assert not differences, "resume states differ:\n  " + "\n  ".join(differences[:20])


# ---- data ---------------------------------------------------------------------------------------

def slice_jsonl(source: Path, target: Path, count: int) -> Path:
    """The first `count` non-empty lines of `source`, written to `target`."""
    lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()][:count]
    target.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return target


@pytest.fixture
def pretrain_data(tmp_path) -> Path:
    """37 real demo lines: a prime, so no world size or batch divides the epoch."""
    return slice_jsonl(REPO / "dataset" / "pretrain_demo.jsonl", tmp_path / "pretrain.jsonl", 37)


@pytest.fixture
def sft_data(tmp_path) -> Path:
    return slice_jsonl(REPO / "dataset" / "sft_demo.jsonl", tmp_path / "sft.jsonl", 29)

"""Shared helpers: tiny data files, and real `python` / `torchrun` training processes on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A model small enough that a 2-process gloo run takes seconds on 2 CPU cores.
TINY_MODEL = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "4",
              "--num_key_value_heads", "2", "--max_seq_len", "48", "--num_workers", "0", "--device", "cpu"]


FAULT_INJECTION_DIR = REPO / "tests" / "fault_injection"


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


def launch_command(script: str, nproc: int | None, args: list[str]) -> list[str]:
    """`python script` when nproc is None, else `torchrun --nproc_per_node nproc script`."""
    path = str(REPO / "trainer" / script)
    if nproc is None:
        return [sys.executable, path, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port()), path, *args]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(script: str, nproc: int | None, args: list[str], cwd: Path, check: bool = True, timeout: int = 300,
          **env) -> subprocess.CompletedProcess:
    """Run one training invocation to completion; on failure show its output."""
    result = subprocess.run(launch_command(script, nproc, [*TINY_MODEL, *args]), cwd=cwd, env=child_env(**env),
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"exit code {result.returncode}\nSTDOUT:\n{result.stdout[-6000:]}\n"
                             f"STDERR:\n{result.stderr[-6000:]}")
    return result


def read_trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def slice_jsonl(source: Path, target: Path, count: int) -> Path:
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

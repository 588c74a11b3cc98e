"""What the training loop costs the host per step, apart from the model's own work.

At a tiny shape on the CPU the model's forward, backward and AdamW take about a millisecond, so what the
trainer adds to each step -- the sampler and DataLoader, the loss normalisation over ranks, the stop vote,
keeping the step's numbers, the log line, the metrics and trace files -- is most of its step time. This
prints, in milliseconds per step, the bare step (benchmarks/bench.py's `train_step`, in this process) and
the real trainer (trainer/train_pretrain.py, as a subprocess, no saves) under `python`, `torchrun` with one
rank and `torchrun` with two gloo ranks, each at one thread per rank:

    python benchmarks/host_overhead.py                 # about a minute on 2 cores
    python benchmarks/host_overhead.py --steps 600 --repeat 3

The trainer's figure is the median of its logged `step_time_s` (the metrics file), the first interval
(start-up) left out; "host ms" is the trainer's step less the bare step's. On a GPU the same difference is
what the loop adds where the host cannot run ahead of the device. Two ranks on two cores also pay the
gradient all-reduce, which one rank does not: compare them with each other, not with the bare step alone.
On a busy machine the figures move; `--repeat` runs each trainer several times and prints the median.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from benchmarks.bench import train_step, write_full_rows
from model.model import CausalLM, LMConfig
from model.tokenizer import load_tokenizer
from trainer.hardening.metrics_files import read_metrics
from trainer.trainer_utils import REPO_ROOT

SHAPE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
LAUNCHERS = {"python": None, "torchrun, 1 rank": 1, "torchrun, 2 ranks": 2}


def bare_step_ms(vocab_size: int, batch_size: int, seq_len: int, steps: int) -> float:
    """The model's own work per step: forward, backward, clip and AdamW on one fixed batch, in this process."""
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab_size=vocab_size, **SHAPE))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len))
    for _ in range(10):  # the optimizer's lazy state, the allocator
        train_step(model, optimizer, input_ids, nullcontext(), batch_size * (seq_len - 1))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps // 5):
            train_step(model, optimizer, input_ids, nullcontext(), batch_size * (seq_len - 1))
        times.append((time.perf_counter() - start) / (steps // 5))
    return 1000 * statistics.median(times)


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def trainer_step_ms(nproc: int | None, workdir: Path, args: argparse.Namespace) -> float:
    """The real trainer's median step time, in ms, its first logged interval left out."""
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    script = str(REPO_ROOT / "trainer" / "train_pretrain.py")
    launcher = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", free_port()]
    flags = [f for name, value in SHAPE.items() for f in (f"--{name}", str(value))]
    # The global batch stays batch_size on any rank count, so each rank's model work shrinks with more ranks.
    command = [*launcher, script, *flags, "--data_path", str(workdir / "data.jsonl"),
               "--save_dir", str(run_dir / "out"), "--checkpoint_dir", str(run_dir / "ckpt"),
               "--metrics_dir", str(run_dir / "metrics"), "--logger", "file", "--device", "cpu",
               "--max_seq_len", str(args.seq_len), "--batch_size", str(args.batch_size // (nproc or 1)),
               "--log_interval", str(args.log_interval), "--max_steps", str(args.steps),
               "--save_interval", str(10**9), "--num_workers", str(args.num_workers), "--epochs", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", SWANLAB_MODE="offline")
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the trainer failed (exit {done.returncode}): {' '.join(command)}\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    records = [r for r in read_metrics(next((run_dir / "metrics").glob("*_metrics.jsonl"))) if "step_time_s" in r]
    steady = records[1:] or records  # the first interval holds start-up
    return 1000 * statistics.median(r["step_time_s"] for r in steady)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of each trainer run")
    parser.add_argument("--log_interval", type=int, default=50)
    parser.add_argument("--batch_size", type=int, default=4, help="the global batch (split over ranks)")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--num_workers", type=int, default=1, help="DataLoader workers, as the trainer's default")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each trainer; the median is printed")
    parser.add_argument("--workdir", default=None, help="where the runs write (default: a temporary folder)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as each trainer rank runs (OMP_NUM_THREADS=1)
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(args.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        tokenizer_path = REPO_ROOT / "model" / "tokenizer.json"
        write_full_rows(workdir / "data.jsonl", args.batch_size * (args.steps + 2), args.seq_len, tokenizer_path)
        vocab_size = load_tokenizer(tokenizer_path).get_vocab_size()
        bare = bare_step_ms(vocab_size, args.batch_size, args.seq_len, args.steps)
        print(json.dumps({"measure": "bare step", "ms_per_step": round(bare, 3), "batch": args.batch_size,
                          "seq": args.seq_len, **SHAPE, "vocab": vocab_size}), flush=True)
        rows = []
        for label, nproc in LAUNCHERS.items():
            runs = [trainer_step_ms(nproc, workdir, args) for _ in range(args.repeat)]
            ms = statistics.median(runs)
            rows.append((label, ms))
            print(json.dumps({"measure": "trainer", "launcher": label, "ms_per_step": round(ms, 3),
                              "runs_ms": [round(r, 3) for r in runs], "host_ms": round(ms - bare, 3)}), flush=True)
    print(f"\n| {torch.__version__}, CPU, {SHAPE['hidden_size']} x {SHAPE['num_hidden_layers']}, global batch "
          f"{args.batch_size} x seq {args.seq_len} | ms per step | host ms per step (less the bare step) |")
    print("|---|---|---|")
    print(f"| bare step (model, clip, AdamW) | {bare:.2f} | - |")
    for label, ms in rows:
        print(f"| trainer, {label} | {ms:.2f} | {ms - bare:.2f} |")


if __name__ == "__main__":
    main()

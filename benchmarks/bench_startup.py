"""Start-up cost of a realistic pretraining file: time to the first optimizer step, and peak memory.

minimind's recommended pretrain file is 1.2 GB / 1.27 M lines of `{"text": ...}` (its full one
10 GB). This script writes a file of that shape (deterministic, mostly Chinese, some English,
a few hundred characters a line) into --workdir, re-using it when it is already there, then:

1. indexes it in a fresh Python process with `JsonlFile` (read, decode, parse,
   validate, index), printing the time of each stage and the peak RSS: the cost that grows
   with the file;
2. launches the real trainer with a tiny model and times, from launch, the first "step N" log
   line (the first optimizer step is done) while polling the peak RSS (VmHWM) of every process
   it starts: 1 rank (`python`), 2 ranks (`torchrun --nproc_per_node 2`, rank 0 indexes and
   shares the index) and `--from_resume 1` after the 1-rank run saved.

    python benchmarks/bench_startup.py --size_mb 100            # quick, while developing
    python benchmarks/bench_startup.py                          # 1.2 GB / ~1.27 M lines (~40 s to write)
    python benchmarks/bench_startup.py --skip_training          # only the indexing figures

Timings depend on what else runs on the machine; the load average is printed with each run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from trainer.trainer_utils import REPO_ROOT

BYTES_PER_LINE = 945  # 1.2 GB / 1.27 M lines, as in minimind's pretrain_hq.jsonl
TINY_MODEL = ["--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4",
              "--num_key_value_heads", "2", "--max_seq_len", "128", "--batch_size", "8", "--device", "cpu",
              "--num_workers", "1", "--max_steps", "2", "--log_interval", "1"]
STEP_LINE = re.compile(r"\bstep (\d+) \(")  # the console logger's "epoch 1/1 step 1 (... to go)"


# ---- 1. the data file -----------------------------------------------------------------------

ENGLISH_WORDS = ("the model learns to predict the next word from the text before it and a large corpus "
                 "of books news articles code and conversations gives it knowledge about the world").split()


def sentence_pool(rng: random.Random, count: int) -> list[str]:
    """Sentences to build lines from: 9 in 10 Chinese (from 3,500 CJK characters), 1 in 10 English."""
    characters = [chr(rng.randrange(0x4E00, 0x4E00 + 3500)) for _ in range(2500)]
    words = ["".join(rng.choices(characters, k=rng.randint(1, 4))) for _ in range(6000)]
    pool = []
    for _ in range(count):
        if rng.random() < 0.9:
            clauses = ["".join(rng.choices(words, k=rng.randint(3, 9))) for _ in range(rng.randint(1, 3))]
            pool.append("，".join(clauses) + rng.choice("。。。！？"))
        else:
            pool.append(" ".join(rng.choices(ENGLISH_WORDS, k=rng.randint(6, 20))).capitalize() + ". ")
    return pool


def generate_pretrain_jsonl(path: Path, size_mb: int, seed: int) -> None:
    """Write about `size_mb` MB of `{"text": ...}` lines; the same arguments give the same bytes."""
    rng = random.Random(seed)
    pool = sentence_pool(rng, 20_000)
    target_bytes = size_mb * 1_000_000
    written = 0
    temp = path.with_suffix(".partial")
    with open(temp, "w", encoding="utf-8") as f:
        while written < target_bytes:
            lines = []
            for _ in range(1000):
                # ~300 characters on average (~945 UTF-8 bytes), spread like real documents
                sentences = rng.choices(pool, k=rng.randint(2, 18))
                text = "<|im_start|>" + "".join(sentences) + "<|im_end|>"
                lines.append(json.dumps({"text": text}, ensure_ascii=False))
            block = "\n".join(lines) + "\n"
            f.write(block)
            written += len(block.encode("utf-8"))
    os.replace(temp, path)  # only a complete file is ever re-used


def data_file(workdir: Path, size_mb: int, seed: int) -> Path:
    path = workdir / f"pretrain_{size_mb}mb_seed{seed}.jsonl"
    if path.exists():
        print(f"re-using {path} ({path.stat().st_size / 1e6:.0f} MB)", flush=True)
    else:
        print(f"writing {path} ...", flush=True)
        started = time.perf_counter()
        generate_pretrain_jsonl(path, size_mb, seed)
        print(f"  written in {time.perf_counter() - started:.1f} s", flush=True)
    return path


# ---- 2. indexing alone, in a fresh process --------------------------------------------------

def measure_indexing(path: Path) -> dict:
    """Time each stage of indexing `path` (this process must be fresh for the RSS to mean anything)."""
    import numpy as np

    from dataset.jsonl_file import BLOCK_BYTES, JsonlFile
    from dataset.lm_dataset import _check_pretrain_record

    baseline_kb = read_status_kb(os.getpid(), "VmRSS")
    stages = {}

    def timed(name, work):
        started = time.perf_counter()
        result = work()
        stages[name] = time.perf_counter() - started
        return result

    def read_blocks(then=lambda block: None):
        with open(path, "rb") as f:
            while block := f.read(BLOCK_BYTES) + f.readline():  # whole lines, as JsonlFile reads them
                then(block)

    def decode_and_split(block):
        return block.decode("utf-8", errors="replace").split("\n")

    def parse_lines(block):
        for line in decode_and_split(block):
            if line:
                json.loads(line)

    timed("read the file in blocks", read_blocks)
    timed("+ find newlines (numpy)", lambda: read_blocks(lambda b: np.flatnonzero(np.frombuffer(b, np.uint8) == 10)))
    timed("+ decode UTF-8, split lines", lambda: read_blocks(decode_and_split))
    timed("+ json.loads every line", lambda: read_blocks(parse_lines))
    rss_before_index_kb = read_status_kb(os.getpid(), "VmRSS")
    source = timed("JsonlFile (all of it, validated)", lambda: JsonlFile(path, validate=_check_pretrain_record))
    return {"stages_s": stages, "records": len(source), "bytes": source.file_size,
            "index_bytes": source.offsets.nbytes + source.line_numbers.nbytes,
            "rss_after_imports_mb": baseline_kb / 1024, "rss_before_index_mb": rss_before_index_kb / 1024,
            "peak_rss_mb": read_status_kb(os.getpid(), "VmHWM") / 1024}


def print_indexing(result: dict) -> None:
    size_gb = result["bytes"] / 1e9
    print(f"\nindexing {result['records']:,} lines, {size_gb:.2f} GB, in one fresh process "
          f"(load average {os.getloadavg()[0]:.1f}):")
    for name, seconds in result["stages_s"].items():
        print(f"  {name:<36} {seconds:7.2f} s  {result['bytes'] / 1e6 / seconds:6.0f} MB/s")
    total = result["stages_s"]["JsonlFile (all of it, validated)"]
    print(f"  index: {result['index_bytes'] / 1e6:.1f} MB (2 x int64 per line); process RSS "
          f"{result['rss_before_index_mb']:.0f} MB before, peak {result['peak_rss_mb']:.0f} MB "
          f"(torch and numpy imports alone: {result['rss_after_imports_mb']:.0f} MB)")
    scale = 10 / size_gb
    print(f"  linear extrapolation to a 10 GB file: indexing ~{total * scale:.0f} s, index "
          f"~{result['index_bytes'] * scale / 1e6:.0f} MB (the read buffers do not grow)")


# ---- 3. real training runs ------------------------------------------------------------------

def read_status_kb(pid: int, field: str) -> int:
    """A `kB` field of /proc/<pid>/status, e.g. VmHWM (peak resident set size)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"/proc/{pid}/status has no {field} line")


def child_pids(pid: int) -> list[int]:
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(p) for p in f.read().split()]
    return children


class TreeMemoryPoller:
    """Polls the peak RSS (VmHWM) of a process and all its descendants until it exits.

    VmHWM is a high-water mark kept by the kernel, so the poll interval only has to be short
    enough to see each process once before it ends.
    """

    def __init__(self, root: int, interval_s: float = 0.05):
        self.root, self.interval_s = root, interval_s
        self.peak_kb: dict[int, int] = {}
        self.depth: dict[int, int] = {root: 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll(self.root, 0)
            time.sleep(self.interval_s)

    def _poll(self, pid: int, depth: int) -> None:
        try:
            self.peak_kb[pid] = max(self.peak_kb.get(pid, 0), read_status_kb(pid, "VmHWM"))
            children = child_pids(pid)
        except (FileNotFoundError, ProcessLookupError, KeyError):
            return  # the process just ended (or is a zombie without memory): its last reading stands
        for child in children:
            self.depth.setdefault(child, depth + 1)
            self._poll(child, depth + 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peaks_mb_at_depth(self, depth: int) -> list[float]:
        return [self.peak_kb[p] / 1024 for p, d in sorted(self.depth.items()) if d == depth and p in self.peak_kb]


def run_trainer(name: str, command: list[str], rank_depth: int) -> dict:
    """Launch `command`; time the first step line; return timings and peak RSS of ranks and workers."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", SWANLAB_MODE="offline",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    load = os.getloadavg()[0]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               cwd=REPO_ROOT)
    poller = TreeMemoryPoller(process.pid)
    first_step_s, first_step, output = None, None, []
    for line in process.stdout:
        output.append(line)
        match = STEP_LINE.search(line)
        if match and first_step_s is None:
            first_step_s, first_step = time.perf_counter() - started, int(match.group(1))
    process.wait()
    total_s = time.perf_counter() - started
    poller.stop()
    if process.returncode != 0 or first_step_s is None:
        raise SystemExit(f"{name}: the trainer failed (exit code {process.returncode}); its output:\n"
                         + "".join(output[-40:]))
    return {"name": name, "first_step": first_step, "first_step_s": first_step_s, "total_s": total_s, "load": load,
            "ranks_mb": poller.peaks_mb_at_depth(rank_depth), "workers_mb": poller.peaks_mb_at_depth(rank_depth + 1)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def training_runs(path: Path, workdir: Path) -> list[dict]:
    script = str(REPO_ROOT / "trainer" / "train_pretrain.py")

    def args(tag: str) -> list[str]:
        return [*TINY_MODEL, "--data_path", str(path), "--save_dir", str(workdir / f"out_{tag}"),
                "--checkpoint_dir", str(workdir / f"checkpoints_{tag}"), "--from_resume", "0"]

    for tag in ("1rank", "2ranks"):  # outputs of an earlier benchmark: every run starts as described
        for folder in (workdir / f"out_{tag}", workdir / f"checkpoints_{tag}"):
            shutil.rmtree(folder, ignore_errors=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    resumed = args("1rank")
    resumed[resumed.index("--from_resume") + 1] = "1"
    runs = [("1 rank (python)", [sys.executable, script, *args("1rank")], 0),
            ("--from_resume 1, 1 rank", [sys.executable, script, *resumed], 0),
            ("2 ranks (torchrun)", [*torchrun, script, *args("2ranks")], 1)]
    results = []
    for name, command, rank_depth in runs:
        print(f"running: {name}: {' '.join(command)}", flush=True)
        results.append(run_trainer(name, command, rank_depth))
    return results


def print_training(results: list[dict], path: Path) -> None:
    print(f"\nstart-up on {path.name} ({path.stat().st_size / 1e9:.2f} GB), tiny model, from launch:")
    print("| run | first step | launch → first step | whole run | peak RSS per rank | "
          "DataLoader worker | load avg |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        ranks = ", ".join(f"{mb:.0f} MB" for mb in r["ranks_mb"])
        workers = ", ".join(f"{mb:.0f} MB" for mb in r["workers_mb"])
        print(f"| {r['name']} | {r['first_step']} | {r['first_step_s']:.1f} s | {r['total_s']:.1f} s | {ranks} | "
              f"{workers} | {r['load']:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/bench_startup", help="data file and run outputs (re-used)")
    p.add_argument("--size_mb", type=int, default=1200, help="size of the generated file (MB, 10^6 bytes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip_training", action="store_true", help="only measure indexing")
    p.add_argument("--measure_index", default=None, help=argparse.SUPPRESS)  # the fresh child process
    args = p.parse_args()
    if args.measure_index:
        print(json.dumps(measure_indexing(Path(args.measure_index))))
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = data_file(workdir, args.size_mb, args.seed)
    child = subprocess.run([sys.executable, __file__, "--measure_index", str(path)], check=True,
                           stdout=subprocess.PIPE, text=True)
    print_indexing(json.loads(child.stdout))
    if not args.skip_training:
        print_training(training_runs(path, workdir), path)


if __name__ == "__main__":
    main()

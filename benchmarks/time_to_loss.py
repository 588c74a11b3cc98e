"""Time to a target loss: AdamW against Muon (--optimizer muon) on the demo's pretraining shape.

    python benchmarks/time_to_loss.py                                  # the demo's shape, AdamW 2e-3, Muon at 3 LRs
    python benchmarks/time_to_loss.py --runs adamw:2e-3 muon:4e-3 --seeds 1 2 3 --train_lines 10000

Each run is trainer/train_pretrain.py, one process, on the first --train_lines records of the demo's pretraining
file (the whole schedule, warmup and cosine, over them), validated on dataset/val_demo.jsonl every
--eval_interval steps. The runs are interleaved (seed by seed, every optimizer at each seed), so a change in the
machine's load falls on both alike. Reported, per optimizer and LR: the final validation loss; the steps (and
tokens: steps x batch x max_seq_len) and the wall time until validation first reaches the target, AdamW's mean
final validation loss. Steps and tokens do not depend on the machine's load; wall time includes each run's start
(the same for every run) and Muon's own cost (its Newton-Schulz iterations: float32 on a CPU, bfloat16 on a GPU,
trainer_utils.Muon). The raw curves go to --out as JSON; --table reads one or more such files (runs of AdamW and
of Muon made apart are tabled together: steps and tokens compare, wall times only from the same machine and load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_SHAPE = ["--hidden_size", "128", "--num_hidden_layers", "4", "--num_attention_heads", "4",
              "--num_key_value_heads", "2", "--max_seq_len", "128", "--batch_size", "32"]  # scripts/run_demo.sh


def run_once(optimizer: str, lr: float, seed: int, data: Path, args, work: Path) -> dict:
    """One pretraining run: its validation curve as (step, seconds since launch, val loss)."""
    name = f"{optimizer}_{lr:g}_seed{seed}"
    lr_flags = ["--learning_rate", str(args.adamw_lr)]  # the schedule's base, and AdamW's (embedding, norms)
    if optimizer == "muon":
        lr_flags += ["--optimizer", "muon", "--muon_learning_rate", str(lr)]
    else:
        lr_flags = ["--learning_rate", str(lr)]
    command = [sys.executable, str(REPO / "trainer" / "train_pretrain.py"), *DEMO_SHAPE, *args.shape, *lr_flags,
               "--data_path", str(data), "--val_data", str(REPO / "dataset" / "val_demo.jsonl"),
               "--epochs", str(args.epochs), "--eval_interval", str(args.eval_interval), "--log_interval", "1000",
               "--save_interval", "100000", "--seed", str(seed), "--save_dir", str(work / name),
               "--checkpoint_dir", str(work / name / "ck"), "--run_name", name]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    started = time.time()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, cwd=REPO)
    lines = [json.loads(line) for line in (work / name / f"{name}_metrics.jsonl").read_text().splitlines()]
    curve = [(m["step"], m["timestamp"] - started, m["val/loss"]) for m in lines if "val/loss" in m]
    print(f"{name}: final val loss {curve[-1][2]:.4f} after {curve[-1][1]:.0f} s", flush=True)
    return {"optimizer": optimizer, "lr": lr, "seed": seed, "curve": curve}


def reached(curve: list, target: float) -> tuple[int, float] | None:
    """(step, seconds) of the first validation at or below `target`, or None."""
    return next(((step, seconds) for step, seconds, loss in curve if loss <= target), None)


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.4g} ± {statistics.stdev(values):.2g}" if len(values) > 1 else f"{values[0]:.4g}"


def table(runs: list[dict], tokens_per_step: int = 32 * 128) -> list[str]:
    """The markdown table: per optimizer and LR, mean ± standard deviation over seeds. The target is AdamW's mean
    final validation loss; AdamW's own time to it is its whole run (its final loss, by definition)."""
    adamw = [r for r in runs if r["optimizer"] == "adamw"]
    target = statistics.mean(r["curve"][-1][2] for r in adamw)
    adamw_seconds = statistics.mean(r["curve"][-1][1] for r in adamw)
    rows = [f"target: AdamW's mean final validation loss {target:.4f} (tokens: steps x {tokens_per_step})",
            "| optimizer | LR | seeds | final val loss | steps to target | tokens to target | seconds to target | "
            "time vs AdamW |", "|---|---|---|---|---|---|---|---|"]
    for opt, lr in dict.fromkeys((r["optimizer"], r["lr"]) for r in runs):
        group = [r for r in runs if (r["optimizer"], r["lr"]) == (opt, lr)]
        hits = [r["curve"][-1][:2] if opt == "adamw" else reached(r["curve"], target) for r in group]
        finals = spread([r["curve"][-1][2] for r in group])
        if not all(hits):
            rows.append(f"| {opt} | {lr:g} | {len(group)} | {finals} | not reached by {sum(not h for h in hits)} "
                        f"of {len(hits)} seeds | | | |")
            continue
        seconds = [h[1] for h in hits]
        rows.append(f"| {opt} | {lr:g} | {len(group)} | {finals} | {spread([h[0] for h in hits])} | "
                    f"{spread([h[0] * tokens_per_step for h in hits])} | {spread(seconds)} | "
                    f"{statistics.mean(seconds) / adamw_seconds:.2f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["adamw:2e-3", "muon:2e-3", "muon:4e-3", "muon:8e-3"],
                        help="optimizer:LR; the demo's AdamW LR is 2e-3")
    parser.add_argument("--adamw_lr", type=float, default=2e-3, help="AdamW's LR in a Muon run (embedding, norms)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--train_lines", type=int, default=10000, help="the first N records of pretrain_demo.jsonl")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--eval_interval", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--shape", nargs=argparse.REMAINDER, default=[], help="flags after the demo's shape")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "time_to_loss.json"))
    parser.add_argument("--table", nargs="+", default=None, help="only print the table of these earlier --out files")
    args = parser.parse_args()
    if args.table:
        print("\n".join(table([run for file in args.table for run in json.loads(Path(file).read_text())["runs"]])))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        records = (REPO / "dataset" / "pretrain_demo.jsonl").read_text(encoding="utf-8").splitlines()
        data = work / "pretrain.jsonl"
        data.write_text("\n".join(records[:args.train_lines]) + "\n", encoding="utf-8")
        runs = []
        for seed in args.seeds:
            for opt, lr in (run.split(":") for run in args.runs):
                runs.append(run_once(opt, float(lr), seed, data, args, work))
                save(args.out, runs)  # after each run: a long measurement stopped early keeps what it measured
    rows = table(runs) if any(run["optimizer"] == "adamw" for run in runs) else None  # (the target is AdamW's)
    print("\n".join(rows or ["no AdamW run: --table this file with one of AdamW's for the table"]))
    save(args.out, runs, rows)


def save(out: str, runs: list[dict], rows: list[str] | None = None) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"command": sys.argv, "runs": runs, "table": rows}, indent=1) + "\n",
                         encoding="utf-8")


if __name__ == "__main__":
    main()

"""Follow a training run from its metrics directory: one screen, refreshed until the run ends.

It reads only the two files `MetricsFileWriter` leaves (`{run}_status.json`, `{run}_metrics.jsonl`;
their fields are described in trainer/metrics_files.py), so it needs no access to the training
process and works wherever the files are visible:

    python scripts/watch_run.py out                         # the only run in out/ (the default --metrics_dir)
    python scripts/watch_run.py out --run_name pretrain_512 --interval 5
    python scripts/watch_run.py out --once                  # print once and exit
    ssh gpu-box "python tiny-llm/scripts/watch_run.py tiny-llm/out --once"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from trainer.tracking import format_duration
from scripts.run_files import list_runs, read_status
from trainer.metrics_files import is_train_record, metrics_path, read_metrics, status_path

STALE_AFTER_S = 300  # a running job that has not written for this long may be dead or hung
BAR_WIDTH = 30
CLEAR_SCREEN = "\033[2J\033[H"  # ANSI: clear, then cursor to the top-left corner
# (key in the metrics record, label on screen, format); the last three are logged on CUDA only
LATEST_FIELDS = [("loss", "loss", ".4f"), ("lr", "lr", ".2e"), ("grad_norm", "grad_norm", ".3f"),
                 ("tokens_per_s", "tok/s", ".0f"), ("step_time_s", "step_time_s", ".3g"),
                 ("peak_mem_GiB", "peak_mem_GiB", ".3g"), ("mfu", "mfu", ".3g")]


def progress_bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    fraction = min(max(done / total, 0.0), 1.0) if total > 0 else 0.0
    filled = int(round(fraction * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {100 * fraction:5.1f}%"


def render_summary(status: dict, records: list[dict], now: float | None = None) -> str:
    """The one-screen summary of a run, from its status object and its metrics records.

    `status` must have the fields of `STATUS_FIELDS` (`read_status` checks that); the others
    (epoch, best loss, anomaly step, updated) are shown when present.
    """
    now = time.time() if now is None else now
    latest = status["latest_metrics"] or {}
    train = [r for r in records if is_train_record(r)]
    state = status["status"]
    step, total = status["current_step"], status["total_steps"]
    lines = [f"run {status.get('run_name', '?')}: {state}   (job {status['job_id']})",
             f"step {step}/{total} {progress_bar(step, total)}"]

    epoch = status.get("epoch")
    eta = latest.get("eta_s")
    lines.append(f"epoch {epoch + 1 if epoch is not None else '-'}"  # 0-based in the files, 1-based on screen
                 f"   ETA {format_duration(eta) if eta is not None and state == 'running' else '-'}")

    if latest:
        numbers = [f"{label} {latest[key]:{spec}}" for key, label, spec in LATEST_FIELDS
                   if latest.get(key) is not None]  # a NaN loss is written as null
        lines.append(f"latest (step {latest['step']}): " + "  ".join(numbers))
    else:
        lines.append("latest: nothing logged yet")

    best_loss, best_step = status.get("best_loss"), status.get("best_step")
    if best_loss is None and train:  # a status file without best_loss: work it out from the records
        best = min((r for r in train if r["loss"] is not None), key=lambda r: r["loss"], default=None)
        best_loss, best_step = (best["loss"], best["step"]) if best else (None, None)
    lines.append(f"best loss {best_loss:.4f} at step {best_step}" if best_loss is not None else "best loss -")

    val = [r for r in records if "val/loss" in r]
    lines.append(f"val/loss {val[-1]['val/loss']:.4f} at step {val[-1]['step']}" if val else "val/loss -")

    resumes = [r["step"] for r in records if r.get("event") == "resume"]
    lines.append(f"resumes: {len(resumes)}" + (f" (at steps {', '.join(map(str, resumes))})" if resumes else ""))

    if status["anomaly_detected"]:
        where = f" at step {status['anomaly_step']}" if status.get("anomaly_step") is not None else ""
        lines.append(f"anomaly{where}: {status['anomaly_reason']}")
    else:
        lines.append("anomaly: none")

    updated = status.get("updated")
    if updated is not None:
        age = now - updated
        lines.append(f"last update {format_duration(age)} ago")
        if state == "running" and age > STALE_AFTER_S:
            lines.append(f"WARNING: no update for {format_duration(age)} while the status is 'running': the "
                         f"process may have died or hung. Check it (ps, nvidia-smi, its log); if it is gone, "
                         f"restart with --from_resume 1.")
    return "\n".join(lines)


def choose_run(metrics_dir: Path, run_name: str | None) -> str:
    """The run to watch; exits with a message saying what to pass when that is not clear."""
    runs = list_runs(metrics_dir)
    if run_name is not None:
        if run_name not in runs:
            available = ", ".join(runs) if runs else "none"
            sys.exit(f"error: no {status_path(metrics_dir, run_name).name} in {metrics_dir} "
                     f"(runs there: {available})")
        return run_name
    if not runs:
        sys.exit(f"error: no *_status.json in {metrics_dir}. Is this the metrics directory of a run, "
                 f"and has the run started?")
    if len(runs) > 1:
        print(f"error: {metrics_dir} holds {len(runs)} runs: {', '.join(runs)}\n"
              f"choose one with --run_name, e.g. --run_name {runs[0]}", file=sys.stderr)
        sys.exit(2)
    return runs[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Summarise a training run from its metrics directory.")
    parser.add_argument("metrics_dir", type=Path)
    parser.add_argument("--run_name", default=None, help="needed when the directory holds several runs")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print the summary once and exit")
    args = parser.parse_args(argv)
    if not args.metrics_dir.is_dir():
        sys.exit(f"error: {args.metrics_dir} is not a directory")

    name = choose_run(args.metrics_dir, args.run_name)
    try:
        while True:
            try:
                status = read_status(status_path(args.metrics_dir, name))
            except ValueError as error:  # not this trainer's status file: say which file and what is missing
                print(f"error: {error}", file=sys.stderr)
                return 1
            summary = render_summary(status, read_metrics(metrics_path(args.metrics_dir, name)))
            print(summary if args.once else CLEAR_SCREEN + summary, flush=True)
            if args.once or status["status"] != "running":
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:  # Ctrl-C is how one stops watching: no traceback
        return 0


if __name__ == "__main__":
    sys.exit(main())

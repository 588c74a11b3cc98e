"""Follow a training run from its metrics directory: one screen, refreshed until the run ends.

It reads only the two files `MetricsFileWriter` leaves (`{run}_status.json`, `{run}_metrics.jsonl`;
their fields are described in trainer/hardening/metrics_files.py), so it needs no access to the training
process and works wherever the files are visible:

    python scripts/watch_run.py out                         # the newest run in out/ (the default --metrics_dir)
    python scripts/watch_run.py out --run_name pretrain_128 --interval 5   # one run by name
    python scripts/watch_run.py out --once                  # print once and exit
    ssh gpu-box "python tiny-llm/scripts/watch_run.py tiny-llm/out --once"

A running job's status file carries a heartbeat, rewritten every few seconds by a thread of the
trainer, and the time of its last finished step. From the two the watcher tells

    slow    steps still finish, but the last one is older than 3 typical steps (a save, a validation,
            a busy machine): wait
    stuck   the heartbeat moves, no step has finished for max(5 min, 10 typical steps): a hang in a
            collective, the data loader or I/O; look at the process before stopping it
    dead    no heartbeat for 4 intervals: the process is gone or frozen. The run's lock file
            ({checkpoint_dir}/trainer.lock) says whether it is, and whether a restart may take over

It never suggests a restart while the lock says the trainer may still be alive: two trainers on one
checkpoint directory would overwrite each other's saves.

Without --run_name, a directory holding several runs (after the demo, out/ holds pretrain_128 and
full_sft_128) shows the run whose status file was written last, and one line names the others.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from trainer.hardening.tracking import format_duration
from scripts.run_files import list_runs, read_status
from trainer.hardening.metrics_files import is_finite_number, is_train_record, metrics_path, read_metrics, status_path
from trainer.hardening.resume_checks import ConfigError
from trainer.hardening.run_lock import describe, pid_alive, read_lock

STALE_AFTER_S = 300  # a status file without a heartbeat: not written for this long, the job may be dead or hung
DEAD_AFTER_BEATS = 4  # missed heartbeats after which the process is gone or frozen (as trainer/hardening/run_lock.py judges)
STUCK_AFTER_S, STUCK_AFTER_STEPS = 300, 10  # no step for max(this, this many typical steps): stuck
SLOW_AFTER_STEPS = 3  # the last step older than this many typical steps: slow
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
                 f"   ETA {format_duration(eta) if is_finite_number(eta) and state == 'running' else '-'}")

    if latest:
        numbers = [f"{label} {latest[key]:{spec}}" for key, label, spec in LATEST_FIELDS  # a NaN shows as nan
                   if latest.get(key) is not None]  # null: an older file's NaN or inf, left out
        lines.append(f"latest (step {latest['step']}): " + "  ".join(numbers))
    else:
        lines.append("latest: nothing logged yet")

    best_loss, best_step = status.get("best_loss"), status.get("best_step")
    if best_loss is None and train:  # a status file without best_loss: work it out from the records
        best = min((r for r in train if is_finite_number(r["loss"])), key=lambda r: r["loss"], default=None)
        best_loss, best_step = (best["loss"], best["step"]) if best else (None, None)
    lines.append(f"best loss {best_loss:.4f} at step {best_step}" if best_loss is not None else "best loss -")

    val = [r for r in records if "val/loss" in r]
    if val:  # null: an older file's NaN or inf
        loss = val[-1]["val/loss"]
        lines.append(f"val/loss {'null' if loss is None else format(loss, '.4f')} at step {val[-1]['step']}")
    else:
        lines.append("val/loss -")

    resumes = [r["step"] for r in records if r.get("event") == "resume"]
    lines.append(f"resumes: {len(resumes)}" + (f" (at steps {', '.join(map(str, resumes))})" if resumes else ""))

    if status["anomaly_detected"]:
        where = f" at step {status['anomaly_step']}" if status.get("anomaly_step") is not None else ""
        lines.append(f"anomaly{where}: {status['anomaly_reason']}")
    else:
        lines.append("anomaly: none")

    updated = status.get("updated")
    if updated is not None:
        lines.append(f"last update {format_duration(now - updated)} ago")
    if state == "running":
        lines.extend(liveness(status, now) if status.get("heartbeat") is not None else no_heartbeat(status, now))
    return "\n".join(lines)


def span(seconds: float) -> str:
    """A duration, to the tenth of a second when short (a step can take less than one)."""
    return f"{seconds:.1f} s" if seconds < 60 else format_duration(seconds)


def liveness(status: dict, now: float) -> list[str]:
    """Slow, stuck or dead, from a running job's heartbeat and the time of its last finished step."""
    beat, interval = status["heartbeat"], status["heartbeat_interval_s"]
    beat_age = now - beat
    if beat_age > DEAD_AFTER_BEATS * interval:
        return [f"WARNING: dead or frozen: no heartbeat for {format_duration(beat_age)} (it beats every "
                f"{interval:g} s) while the status is 'running'.", *lock_verdict(status)]
    typical = (status["latest_metrics"] or {}).get("step_time_s")
    typical = typical if is_finite_number(typical) else None
    last_step, last_at = status.get("last_step"), status.get("last_step_at")
    # Measured at the latest beat, not now: the file knows nothing later, so a fast run read
    # between two beats does not look slow.
    quiet = beat - (last_at if last_at is not None else status["started"])
    pulse = f"heartbeat {span(beat_age)} ago"
    if last_at is not None:
        last = f"step {last_step} finished {span(quiet)} before that beat"
    else:
        last = f"no step has finished in the {span(quiet)} since this invocation started"
    if quiet > max(STUCK_AFTER_S, STUCK_AFTER_STEPS * (typical or 0)):
        pid, host = status.get("pid", "?"), status.get("host", "?")
        typical_text = f"a typical step takes {typical:.3g} s" if typical else "no step time logged yet"
        first = "" if last_at is not None else "; a first torch.compile can take minutes"
        return [f"WARNING: stuck: the process is alive ({pulse}) but {last} ({typical_text}{first}). It may "
                f"hang in a collective (did another rank die?), the data loader or I/O: look at pid {pid} on "
                f"{host} (e.g. py-spy dump --pid {pid}). Do not start a second trainer while it holds the lock: "
                f"stop it first, then restart with --from_resume 1."]
    if last_at is not None and typical and quiet > SLOW_AFTER_STEPS * typical:
        return [f"slow: {pulse}, {last}: {quiet / typical:.0f}x a typical step ({typical:.3g} s). A save, a "
                f"validation or a busy machine; the process is alive, wait."]
    return [f"alive: {pulse}; {last}"]


def lock_verdict(status: dict) -> list[str]:
    """For a job that stopped beating: what its lock file says about the process, and what to do."""
    pid, host = status.get("pid"), status.get("host")
    if not status.get("lock_file"):
        return [f"The status names no lock file: check pid {pid} on {host} (ps) before restarting anything."]
    path = Path(status["lock_file"])
    if not path.parent.is_dir():
        return [f"{path} is not visible from here: check pid {pid} on {host} before restarting (two trainers on one "
                f"checkpoint directory would overwrite each other's saves)."]
    try:
        holder = read_lock(path)
    except ConfigError as error:
        return [f"{error}"]
    if holder is None:
        return [f"No trainer holds {path}: the trainer is gone. Restart with --from_resume 1."]
    if (holder["host"], holder["pid"]) != (host, pid):
        return [f"{path} is now held by another trainer ({describe(holder)}): this status file's process (pid "
                f"{pid} on {host}) is gone, and the checkpoints belong to that trainer; do not start another."]
    if holder["host"] == socket.gethostname():
        if pid_alive(int(holder["pid"]), holder.get("pid_start")):
            return [f"The trainer holding {path} is alive but not beating: suspended or frozen? See "
                    f"`ps -o stat {pid}` (T: stopped, `kill -CONT {pid}` resumes it; D: waiting on a disk). Do not "
                    f"start another trainer."]
        return [f"The trainer is gone: pid {pid} no longer runs on this host ({describe(holder)}). Restart with "
                f"--from_resume 1: the new run takes the lock over and says so."]
    return [f"{path} is held by pid {pid} on {holder['host']} ({describe(holder)}). A restart on another host takes "
            f"it over only with the same job id (SLURM_JOB_ID, torchrun --rdzv-id, or --run_id) once its heartbeat "
            f"is stale; otherwise check {holder['host']} first (is pid {pid} still running there?)."]


def no_heartbeat(status: dict, now: float) -> list[str]:
    """An older run's status file, without a heartbeat: only its last write tells anything."""
    updated = status.get("updated")
    if updated is None or now - updated <= STALE_AFTER_S:
        return []
    age = format_duration(now - updated)
    warning = (f"WARNING: no update for {age} while the status is 'running': the process may have died or hung, "
               f"or may just be between two log steps (this status file has no heartbeat). Check it (ps, "
               f"nvidia-smi, its log)")
    lock = status.get("lock_file")
    if lock and Path(lock).parent.is_dir() and not Path(lock).exists():
        return [f"{warning}; no trainer holds {lock}, so if it is gone, restart with --from_resume 1."]
    return [f"{warning} before starting anything: a second trainer on the same checkpoints would overwrite "
            f"the first one's saves."]


def choose_run(metrics_dir: Path, run_name: str | None) -> tuple[str, list[str]]:
    """The run to watch, and the other runs it was chosen among; exits with a message when there is none.

    Without `run_name` it is the run whose status file was written last: a running job rewrites its
    own at every heartbeat, so that is the run in progress when there is one (a job killed without
    a word leaves "running" in its file, so the status field alone would pick a dead run), else the
    one that ended last, as the SFT after the demo's pretraining.
    """
    runs = list_runs(metrics_dir)
    if run_name is not None:
        if run_name not in runs:
            available = ", ".join(runs) if runs else "none"
            sys.exit(f"error: no {status_path(metrics_dir, run_name).name} in {metrics_dir} "
                     f"(runs there: {available})")
        return run_name, []
    if not runs:
        sys.exit(f"error: no *_status.json in {metrics_dir}. Is this the metrics directory of a run, "
                 f"and has the run started?")
    newest = max(runs, key=lambda name: (status_path(metrics_dir, name).stat().st_mtime_ns, name))
    return newest, [name for name in runs if name != newest]


def others_line(metrics_dir: Path, chosen: str, others: list[str]) -> str:
    """The line above the summary when the watcher chose among several runs: which, and how to pick another."""
    return (f"{metrics_dir} holds {len(others) + 1} runs; showing the newest, {chosen}. Also there: "
            f"{', '.join(others)} (pick one with --run_name NAME)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Summarise a training run from its metrics directory.")
    parser.add_argument("metrics_dir", type=Path)
    parser.add_argument("--run_name", default=None,
                        help="the run to watch (default: the one whose status file was written last)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print the summary once and exit")
    args = parser.parse_args(argv)
    if not args.metrics_dir.is_dir():
        sys.exit(f"error: {args.metrics_dir} is not a directory")

    name, others = choose_run(args.metrics_dir, args.run_name)
    # On every screen: a refresh clears the one before.
    note = others_line(args.metrics_dir, name, others) + "\n" if others else ""
    try:
        while True:
            try:
                status = read_status(status_path(args.metrics_dir, name))
            except (OSError, ValueError) as error:  # unreadable, or not this trainer's status file: which file, what is wrong
                print(f"error: {error}", file=sys.stderr)
                return 1
            summary = note + render_summary(status, read_metrics(metrics_path(args.metrics_dir, name)))
            print(summary if args.once else CLEAR_SCREEN + summary, flush=True)
            if args.once or status["status"] != "running":
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:  # Ctrl-C is how one stops watching: no traceback
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""Watching a run from outside: two plain files per run, readable by anything (`scripts/watch_run.py`
over ssh, a plot script, `tail -f`, `jq`), with no server or account.

    {metrics_dir}/{run}_metrics.jsonl   one JSON line per log step, validation and event
    {metrics_dir}/{run}_status.json     one small JSON object: status, progress, latest numbers

Every metrics line has `step` (the optimizer step) and `timestamp` (Unix seconds); a training line
adds loss, lr, grad_norm, tokens_per_s...; a validation line `val/loss` (nats per token) and `val/bpb`
(bits per byte of the text scored, comparable across tokenizers; trainer/hardening/tracking.py:
validation_loss); an event line `event` = "resume", "anomaly" (with `reason`) or "rollback". The status
file has job_id (`{run}-{UTC start of the first invocation, YYYYmmdd-HHMMSS}`, kept on resume as the
wandb/SwanLab id is), status (in RUN_STATES), current_step (the last logged, or the checkpoint's after a
resume or rollback), total_steps,
anomaly_detected (in any invocation), anomaly_reason and anomaly_step (the latest), latest_metrics (the
latest training line), run_name, epoch, best_loss, best_step, latest_val, resumed_from (this
invocation's checkpoint step, or null), started (this invocation's start), updated (the latest write),
pid and host (of the rank-0 process writing it), lock_file (the absolute path of the run's
{checkpoint_dir}/trainer.lock, or null). A run with a heartbeat (the Tracker starts one whenever the file
logger is on) adds heartbeat (Unix time of the latest beat: a thread rewrites the file every
heartbeat_interval_s seconds, even while no step finishes), heartbeat_interval_s, and last_step /
last_step_at (the number and Unix time of the last finished optimizer step as of that beat; null before
this invocation's first step). Tools may rely on these names; more may come.

JSON has no NaN or infinity, and strict readers (jq, browsers) reject the bare `NaN` Python would write,
so a non-finite number (a NaN loss, an inf grad norm) is written as the string "NaN", "Infinity" or
"-Infinity"; `read_metrics` and `read_json` turn it back into the float. Files of older versions hold
null there instead: readers take null as "not a finite number" too.

On resume the metrics file is cut back to the checkpoint's step: those steps are trained again, and
two losses for one step would draw a zigzag. A run that lost its directory lock to another run
(trainer/hardening/run_lock.py) writes neither file again: they are the new holder's.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import IO

RUN_STATES = ("running", "completed", "stopped", "failed")


def metrics_path(metrics_dir: str | Path, run_name: str) -> Path:
    return Path(metrics_dir) / f"{run_name}_metrics.jsonl"


def status_path(metrics_dir: str | Path, run_name: str) -> Path:
    return Path(metrics_dir) / f"{run_name}_status.json"


# How a non-finite float is spelled in the files (the spellings JavaScript and Python's float() read).
NON_FINITE_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def non_finite_as_text(value):
    """`value` with every NaN/inf float (at any depth) replaced by its NON_FINITE_TEXT string."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: non_finite_as_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [non_finite_as_text(v) for v in value]
    return value


def non_finite_from_text(value):
    """The inverse of non_finite_as_text: "NaN", "Infinity", "-Infinity" back to floats, at any depth."""
    if isinstance(value, str):
        return NON_FINITE_TEXT.get(value, value)
    if isinstance(value, dict):
        return {k: non_finite_from_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [non_finite_from_text(v) for v in value]
    return value


def json_text(value, indent: int | None = None) -> str:
    """Strict JSON (no bare NaN or Infinity), as every file here is written."""
    return json.dumps(non_finite_as_text(value), indent=indent, allow_nan=False)


def read_json(text: str):
    """A value written by json_text, non-finite numbers restored; raises ValueError if it is not JSON."""
    return non_finite_from_text(json.loads(text))


def is_finite_number(value) -> bool:
    """A number that can be compared and averaged: not null (older files' NaN/inf), not NaN, not inf."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics file, in file order; [] if there is none yet. A line that is not JSON
    is skipped: only a write cut short (killed, or read mid-write) makes one, and it is the last line."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = read_json(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def is_train_record(record: dict) -> bool:
    """A training log line (not a validation result or an event such as a resume)."""
    return "event" not in record and "loss" in record and "step" in record


class MetricsFileWriter:
    """Writes the two files of `run_name` under `metrics_dir`; made on rank 0 only, by tracking.Tracker."""

    def __init__(self, metrics_dir: str, run_name: str, *, heartbeat_interval_s: float | None = None,
                 lock_file: str | None = None):
        """`heartbeat_interval_s`: the caller calls `beat` that often (None: no heartbeat fields)."""
        self.run_name = run_name
        self.metrics_file = metrics_path(metrics_dir, run_name)
        self.status_file = status_path(metrics_dir, run_name)
        self.heartbeat_interval_s, self.lock_file = heartbeat_interval_s, lock_file
        self.file: IO[str] | None = None
        self.status: dict = {}
        # The heartbeat thread and the loop both update and rewrite the status: one at a time, so no
        # write sees the dict half-updated (or changing size mid-dump) and no older snapshot lands last.
        self.lock = threading.Lock()

    def begin(self, start_step: int, total_steps: int) -> None:
        """A fresh run starts fresh files; a resumed one cuts its metrics back to `start_step`."""
        from output_paths import OutputPathError  # see _write_status for why it is here
        problem = self.path_problem()
        if problem is not None:
            raise OutputPathError(problem)
        self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        now, kept, job_id = time.time(), [], None
        if start_step > 0:
            kept = self._cut_back_to(start_step)
            if self.status_file.is_file():  # a resume keeps the job id (None if the file has none)
                job_id = read_json(self.status_file.read_text(encoding="utf-8")).get("job_id")
        train = [r for r in kept if is_train_record(r)]
        best = min((r for r in train if is_finite_number(r["loss"])), key=lambda r: r["loss"], default=None)
        val = [r for r in kept if "val/loss" in r]
        anomalies = [r for r in kept if r.get("event") == "anomaly"]
        self.status = {
            "job_id": job_id or f"{self.run_name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}",
            "run_name": self.run_name, "status": "running", "current_step": start_step, "total_steps": total_steps,
            "epoch": train[-1]["epoch"] if train else None, "anomaly_detected": bool(anomalies),
            "anomaly_reason": anomalies[-1]["reason"] if anomalies else None,
            "anomaly_step": anomalies[-1]["step"] if anomalies else None,
            "latest_metrics": train[-1] if train else {},
            "best_loss": best["loss"] if best else None, "best_step": best["step"] if best else None,
            "latest_val": val[-1] if val else None, "resumed_from": start_step if start_step > 0 else None,
            "started": now, "updated": now, "pid": os.getpid(), "host": socket.gethostname(),
            "lock_file": self.lock_file,
        }
        if self.heartbeat_interval_s is not None:
            self.status.update(heartbeat=now, heartbeat_interval_s=self.heartbeat_interval_s,
                               last_step=None, last_step_at=None)
        self.file = self._open_metrics(truncate=start_step == 0)  # a fresh run starts a fresh file
        if start_step > 0:
            self._append({"event": "resume", "step": start_step, "timestamp": now})
        self._update_status()

    def log(self, metrics: dict, total_steps: int) -> None:
        record = {**metrics, "timestamp": time.time()}
        self._append(record)
        loss, best = metrics.get("loss"), self.status.get("best_loss")
        if is_finite_number(loss) and (best is None or loss < best):
            self.status["best_loss"], self.status["best_step"] = loss, metrics["step"]
        self._update_status(current_step=metrics["step"], epoch=metrics.get("epoch"), latest_metrics=record,
                            total_steps=total_steps)

    def validation(self, step: int, loss: float, bpb: float | None = None, **more: float) -> None:
        """The loss per token and, if given, the bits per byte (`val/bpb`) of a validation at `step`; `more`:
        other numbers of it, as `val/{name}` (DPO's accuracy)."""
        record = {"step": step, "val/loss": loss, **({"val/bpb": bpb} if bpb is not None else {}),
                  **{f"val/{name}": value for name, value in more.items()}, "timestamp": time.time()}
        self._append(record)
        self._update_status(latest_val=record)

    def anomaly(self, step: int, reason: str) -> None:
        self._append({"event": "anomaly", "step": step, "reason": reason, "timestamp": time.time()})
        self._update_status(anomaly_detected=True, anomaly_reason=reason, anomaly_step=step)

    def rollback(self, step: int, total_steps: int) -> None:
        """Back at checkpoint `step`: later records will be logged again, but the anomaly stays."""
        self._cut_back_to(step)
        self.file.close()
        self.file = self._open_metrics()
        self._append({"event": "rollback", "step": step, "timestamp": time.time()})
        self._update_status(current_step=step, total_steps=total_steps)

    def finish(self, status: str, step: int) -> None:
        if status not in RUN_STATES:
            raise ValueError(f"unknown run status {status!r}; expected one of {RUN_STATES}")
        self._update_status(status=status, current_step=step)
        if self.file is not None:
            self.file.close()
            self.file = None

    def beat(self, last_step: int | None, last_step_at: float | None) -> None:
        """The heartbeat (from the Tracker's thread): the process is alive; the last step finished then."""
        with self.lock:
            if self.status.get("status") != "running":  # a beat racing the end must not look like life after it
                return
            self.status.update(heartbeat=time.time(), last_step=last_step, last_step_at=last_step_at)
            self._write_status()

    def path_problem(self) -> str | None:
        """The one line refusing the metrics or status file's path (a link, FIFO, device or folder there for the
        metrics file, which is appended to; a FIFO, device or folder for the status file, which is replaced), or
        None. Checked before either file is opened."""
        from output_paths import output_problem, refusal  # see _write_status for why
        for path, appended in ((self.metrics_file, True), (self.status_file, False)):
            problem = output_problem(path, appended)
            if problem is not None:
                return refusal(path, problem)
        return None

    def _open_metrics(self, truncate: bool = False) -> IO[str]:
        from output_paths import open_to_append  # see _write_status for why it is here
        return os.fdopen(open_to_append(self.metrics_file, truncate), "a", encoding="utf-8")

    def _cut_back_to(self, step: int) -> list[dict]:
        """Keep only records up to `step` (and anomaly events, which explain the rollback after them),
        rewritten atomically; returns what was kept."""
        kept = [r for r in read_metrics(self.metrics_file)
                if r.get("step", 0) <= step or r.get("event") == "anomaly"]
        if not self._lock_lost():
            self._write_unless_lock_lost(self.metrics_file, "".join(json_text(r) + "\n" for r in kept))
        return kept

    def _append(self, record: dict) -> None:
        if self._lock_lost():
            return
        # One write of a whole line, then flush: a reader sees whole lines (a cut last one is skipped).
        self.file.write(json_text(record) + "\n")
        self.file.flush()

    @staticmethod
    def _lock_lost() -> bool:
        """True once another run holds this run's directories: every write is skipped from then on."""
        from trainer.hardening.run_lock import lock_lost  # see _write_unless_lock_lost for why it is imported here
        return lock_lost() is not None

    def _update_status(self, **fields) -> None:
        with self.lock:
            self.status.update(fields)
            self._write_status()

    def _write_status(self) -> None:
        """Call with self.lock held."""
        if self._lock_lost():  # e.g. the exit path's "failed": the file now tells of the new holder's run
            return
        self.status["updated"] = time.time()
        self._write_unless_lock_lost(self.status_file, json_text(self.status, indent=1) + "\n")

    @staticmethod
    def _write_unless_lock_lost(path: Path, text: str) -> None:
        """Write `path`, checking the lock again right before the rename: this thread may have been paused (SIGSTOP)
        after the caller's check, and the directory taken over meanwhile."""
        # Imported here so the readers above (watch and plot scripts) work on a machine without torch.
        from trainer.hardening.checkpoint_io import atomic_write_text
        from trainer.hardening.run_lock import LockLost, raise_if_lock_lost
        try:
            atomic_write_text(path, text, lambda: raise_if_lock_lost(read=False))
        except LockLost:
            pass  # the file is the new holder's now; the run stops at its next step

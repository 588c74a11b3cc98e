"""Watching a run from outside: a metrics file, a status file, and an anomaly detector.

`MetricsFileWriter` is a callback that leaves two plain files per run in a metrics directory:

    {metrics_dir}/{run}_metrics.jsonl   one JSON line per log step, validation and event
    {metrics_dir}/{run}_status.json     one small JSON object: state, progress, latest numbers

Anything that can read a file can follow the run: `scripts/watch_run.py` over ssh, a plot script,
`tail -f`, `jq`. No server, no account, nothing to install on the training machine.

On resume the metrics file is cut back to the checkpoint's step first: the steps logged after the
last save are trained again, and a file with two losses for one step would draw a zigzag.

`AnomalyDetector` is pure arithmetic on (step, loss, grad norm). It says *that* something looks
wrong and why, in words; what to do about it (warn, stop, roll back) is the training loop's call.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import deque
from pathlib import Path
from typing import IO

from trainer.callbacks import TrainerCallback

RUN_STATES = ("running", "completed", "stopped", "failed")


# ---- file names and readers (used by the writer, the watch script and the plot script) ----

def metrics_path(metrics_dir: str | Path, run_name: str) -> Path:
    return Path(metrics_dir) / f"{run_name}_metrics.jsonl"


def status_path(metrics_dir: str | Path, run_name: str) -> Path:
    return Path(metrics_dir) / f"{run_name}_status.json"


def list_runs(metrics_dir: str | Path) -> list[str]:
    """Names of the runs that have a status file in `metrics_dir`, sorted."""
    suffix = "_status.json"
    return sorted(p.name[:-len(suffix)] for p in Path(metrics_dir).glob(f"*{suffix}"))


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics file, in file order; [] if the file does not exist yet.

    A line that is not valid JSON is skipped: the only way to get one is a process killed in the
    middle of a write (or a reader that arrives mid-write), and it is always the last line.
    """
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_status(path: str | Path) -> dict:
    """The status object; the file is replaced atomically, so a read never sees half of it."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def is_train_record(record: dict) -> bool:
    """A training log line (not a validation result or an event such as a resume)."""
    return "event" not in record and "loss" in record and "step" in record


# ---- the callback ----

def finite_or_null(value):
    """NaN/inf as null: strict JSON readers (jq, browsers) reject Python's NaN literal."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_null(v) for v in value]
    return value


class MetricsFileWriter(TrainerCallback):
    """Writes `{run_name}_metrics.jsonl` and `{run_name}_status.json` under `metrics_dir`.

    Add it on rank 0 only: one writer per file. From the run it reads `run.global_step` and
    `run.steps_remaining()`; everything else comes from the metrics dicts the loop passes.
    """

    def __init__(self, metrics_dir: str, run_name: str):
        self.run_name = run_name
        self.metrics_file = metrics_path(metrics_dir, run_name)
        self.status_file = status_path(metrics_dir, run_name)
        self.file: IO[str] | None = None
        self.status: dict = {}

    # -- events --

    def on_train_begin(self, run) -> None:
        self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        start_step = run.global_step
        kept: list[dict] = []
        if start_step > 0:
            kept = self._cut_back_to(start_step)
        else:
            self.metrics_file.write_text("", encoding="utf-8")  # a fresh run starts a fresh file
        now = time.time()
        train = [r for r in kept if is_train_record(r)]
        best = min(train, key=lambda r: r["loss"], default=None)
        val = [r for r in kept if "val/loss" in r]
        self.status = {
            "run_name": self.run_name, "state": "running", "step": start_step,
            "total_steps": start_step + run.steps_remaining(),
            "epoch": train[-1]["epoch"] if train else None,
            "latest": train[-1] if train else {},
            "best_loss": best["loss"] if best else None, "best_step": best["step"] if best else None,
            "latest_val": val[-1] if val else None,
            "anomaly": None, "resumed_from": start_step if start_step > 0 else None,
            "started": now, "updated": now,
        }
        self.file = open(self.metrics_file, "a", encoding="utf-8")
        if start_step > 0:
            self._append({"event": "resume", "step": start_step, "time": now})
        self._write_status()

    def on_log(self, run, metrics: dict) -> None:
        record = {**metrics, "time": time.time()}
        self._append(record)
        loss = metrics.get("loss")
        best = self.status.get("best_loss")
        if loss is not None and math.isfinite(loss) and (best is None or loss < best):
            self.status["best_loss"], self.status["best_step"] = loss, metrics["step"]
        self.status.update(step=metrics["step"], epoch=metrics.get("epoch"), latest=record,
                           total_steps=run.global_step + run.steps_remaining())
        self._write_status()

    def on_validation_end(self, run, metrics: dict) -> None:
        record = {"step": metrics["step"], "val/loss": metrics["val/loss"], "time": time.time()}
        self._append(record)
        self.status["latest_val"] = record
        self._write_status()

    def on_anomaly(self, run, step: int, reason: str) -> None:
        self.status["anomaly"] = {"step": step, "reason": reason}
        self._append({"event": "anomaly", "step": step, "reason": reason, "time": time.time()})
        self._write_status()

    def on_rollback(self, run, step: int) -> None:
        """Back at checkpoint `step`: later records will be logged again, but the anomaly stays."""
        self._cut_back_to(step)
        self.file.close()
        self.file = open(self.metrics_file, "a", encoding="utf-8")
        self._append({"event": "rollback", "step": step, "time": time.time()})
        self.status.update(step=step, total_steps=step + run.steps_remaining())
        self._write_status()

    def on_train_end(self, run, status: str) -> None:
        if status not in RUN_STATES:
            raise ValueError(f"unknown run status {status!r}; expected one of {RUN_STATES}")
        self.status.update(state=status, step=run.global_step)
        self._write_status()
        if self.file is not None:
            self.file.close()
            self.file = None

    # -- helpers --

    def _cut_back_to(self, step: int) -> list[dict]:
        """Keep only records up to `step` (the checkpoint we resume from); returns what was kept.

        The rewrite is atomic, so a crash during it leaves either the old file or the new one.
        """
        from trainer.checkpoint_io import atomic_write_text  # see _write_status for why it is here
        # Anomaly events stay: they explain the rollback that follows them.
        kept = [r for r in read_metrics(self.metrics_file)
                if r.get("step", 0) <= step or r.get("event") == "anomaly"]
        atomic_write_text(self.metrics_file, "".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def _append(self, record: dict) -> None:
        # One write of a whole line, then flush: a reader (or a crash) sees whole lines only,
        # except possibly a last partial one, which read_metrics skips.
        self.file.write(json.dumps(finite_or_null(record)) + "\n")
        self.file.flush()

    def _write_status(self) -> None:
        # Imported here, not at the top, so the readers above (used by the watch and plot
        # scripts) work on a machine that has the files but not torch.
        from trainer.checkpoint_io import atomic_write_text
        self.status["updated"] = time.time()
        atomic_write_text(self.status_file, json.dumps(finite_or_null(self.status), indent=1) + "\n")


# ---- the anomaly detector ----

class AnomalyDetector:
    """Flags training steps whose loss or gradient norm looks wrong, with a reason in words.

    Rules, checked in this order on every `check(step, loss, grad_norm)`:

    1. Non-finite: a NaN or inf loss or grad norm. Nothing after it can be trusted (NaN spreads
       into every weight at the next optimizer step), so it is always reported.
    2. Loss spike: loss > mean + spike_factor * std of the last `window` accepted losses. The std
       has a floor of max(5% of |mean|, 1e-3): on a very smooth curve the std is tiny and a harmless
       wiggle would otherwise count as "many sigmas". Needs `min_history` values first.
    3. Grad-norm explosion: grad_norm > grad_explosion_factor * median of recent accepted norms.
       The median, unlike the mean, is not dragged up by the occasional large norm.
    4. Plateau (only if patience > 0): the best loss has not improved by a relative 1e-3 for
       `patience` consecutive accepted checks. The counter then restarts, so a long plateau is
       reported every `patience` checks rather than on every step.

    Only values that pass rules 1-3 enter the history. A spike therefore cannot raise the mean
    and std that judge the next values: the next normal step is not flagged, and a loss that stays
    high keeps being reported, which is right, since it did not recover.
    """

    def __init__(self, spike_factor: float = 3.0, window: int = 20, min_history: int = 5,
                 grad_explosion_factor: float = 10.0, patience: int = 0):
        if window < 2 or min_history < 2 or min_history > window:
            raise ValueError(f"need 2 <= min_history <= window, got min_history={min_history} window={window}")
        self.spike_factor = spike_factor
        self.window = window
        self.min_history = min_history
        self.grad_explosion_factor = grad_explosion_factor
        self.patience = patience
        self.losses: deque[float] = deque(maxlen=window)
        self.grad_norms: deque[float] = deque(maxlen=window)
        self.best_loss: float | None = None
        self.best_step: int | None = None
        self.checks_since_best = 0

    def check(self, step: int, loss: float, grad_norm: float) -> str | None:
        """A reason if this step looks anomalous, else None (and the values join the history)."""
        loss, grad_norm = float(loss), float(grad_norm)
        if not math.isfinite(loss):
            return f"non-finite loss {loss} at step {step}"
        if not math.isfinite(grad_norm):
            return f"non-finite grad norm {grad_norm} at step {step}"
        reason = self._spike(step, loss) or self._explosion(step, grad_norm)
        if reason:
            return reason
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        return self._plateau(step, loss)

    def _spike(self, step: int, loss: float) -> str | None:
        if len(self.losses) < self.min_history:
            return None
        mean = statistics.fmean(self.losses)
        std = max(statistics.pstdev(self.losses), 0.05 * abs(mean), 1e-3)
        limit = mean + self.spike_factor * std
        if loss <= limit:
            return None
        return (f"loss spike at step {step}: {loss:.4f} > {limit:.4f} = mean {mean:.4f} + "
                f"{self.spike_factor:g} x std {std:.4f} of the last {len(self.losses)} steps")

    def _explosion(self, step: int, grad_norm: float) -> str | None:
        if len(self.grad_norms) < self.min_history:
            return None
        median = statistics.median(self.grad_norms)
        if median <= 0 or grad_norm <= self.grad_explosion_factor * median:
            return None
        return (f"grad norm explosion at step {step}: {grad_norm:.4g} is {grad_norm / median:.1f}x the "
                f"median {median:.4g} of the last {len(self.grad_norms)} steps "
                f"(limit {self.grad_explosion_factor:g}x)")

    def _plateau(self, step: int, loss: float) -> str | None:
        if self.patience <= 0:
            return None
        if self.best_loss is None or loss < self.best_loss - 1e-3 * abs(self.best_loss):
            self.best_loss, self.best_step, self.checks_since_best = loss, step, 0
            return None
        self.checks_since_best += 1
        if self.checks_since_best < self.patience:
            return None
        self.checks_since_best = 0
        return (f"plateau at step {step}: best loss {self.best_loss:.4f} (step {self.best_step}) has not "
                f"improved by 0.1% for {self.patience} checks")

    def state_dict(self) -> dict:
        """Plain lists and numbers, so it fits in a `weights_only=True` checkpoint."""
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms),
                "best_loss": self.best_loss, "best_step": self.best_step,
                "checks_since_best": self.checks_since_best}

    def load_state_dict(self, state: dict) -> None:
        """Restore the history of a resumed run (clipped to this detector's window)."""
        self.losses = deque((float(x) for x in state["losses"]), maxlen=self.window)
        self.grad_norms = deque((float(x) for x in state["grad_norms"]), maxlen=self.window)
        self.best_loss, self.best_step = state["best_loss"], state["best_step"]
        self.checks_since_best = int(state["checks_since_best"])

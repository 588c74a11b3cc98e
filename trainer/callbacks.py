"""Callbacks: everything that watches a run without changing how it trains.

The training loop fires events; loggers and trace writers listen. Adding a tracker is one class.
Every metric is logged against `step` = the optimizer step, the same number on every tracker,
so curves of a resumed run continue where they stopped instead of overlapping.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class TrainerCallback:
    """Base class: override the events you need. `run` is the loop's RunContext."""

    def on_train_begin(self, run) -> None: ...
    def on_epoch_begin(self, run, epoch: int) -> None: ...
    def on_step_begin(self, run, step: int) -> None: ...
    def on_step_end(self, run, record: dict) -> None: ...        # every step, every rank
    def on_log(self, run, metrics: dict) -> None: ...            # every log_interval, rank 0
    def on_validation_end(self, run, metrics: dict) -> None: ...
    def on_checkpoint_saved(self, run, path: str) -> None: ...
    def on_anomaly(self, run, step: int, reason: str) -> None: ...
    def on_rollback(self, run, step: int) -> None: ...          # back at checkpoint `step`
    def on_epoch_end(self, run, epoch: int) -> None: ...
    def on_train_end(self, run, status: str) -> None: ...


class CallbackList:
    """Fires an event on every callback, in order."""

    def __init__(self, callbacks: list[TrainerCallback]):
        self.callbacks = callbacks

    def fire(self, event: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, event)(*args)


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


class ConsoleLogger(TrainerCallback):
    """One line a person can act on every log_interval steps."""

    def on_log(self, run, m: dict) -> None:
        print(f"epoch {m['epoch'] + 1}/{run.args.epochs} step {m['step']} ({run.steps_remaining()} to go) "
              f"loss {m['loss']:.4f} lr {m['lr']:.2e} grad_norm {m['grad_norm']:.3f} "
              f"{m['tokens_per_s']:.0f} tok/s ETA {format_duration(m['eta_s'])}", flush=True)

    def on_validation_end(self, run, m: dict) -> None:
        print(f"validation at step {m['step']}: val/loss {m['val/loss']:.4f}", flush=True)


class TrackerLogger(TrainerCallback):
    """Sends metrics to a tracker run (wandb and SwanLab share this API: `log(dict, step=)`)."""

    run = None

    def on_log(self, run, metrics: dict) -> None:
        self.run.log({f"train/{k}": v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def on_validation_end(self, run, metrics: dict) -> None:
        self.run.log({"val/loss": metrics["val/loss"]}, step=metrics["step"])


class WandbLogger(TrackerLogger):
    """Logs to Weights & Biases; resumes the same run id after --from_resume."""

    def __init__(self, project: str, name: str, config: dict, run_id: str | None):
        import wandb
        self.run = wandb.init(project=project, name=name, config=config, id=run_id,
                              resume="allow" if run_id else None)

    def on_train_end(self, run, status: str) -> None:
        self.run.finish(exit_code=0 if status in ("completed", "stopped") else 1)


class SwanLabLogger(TrackerLogger):
    """Logs to SwanLab; resumes the same experiment id after --from_resume."""

    def __init__(self, project: str, name: str, config: dict, run_id: str | None):
        import swanlab
        self.run = swanlab.init(project=project, name=name, config=config, id=run_id,
                                resume="allow" if run_id else None)

    def on_train_end(self, run, status: str) -> None:
        self.run.finish()


class DebugTraceWriter(TrainerCallback):
    """`--save_debug_train_output`: one JSONL record per optimizer step and rank.

    Each record says which samples this rank trained on in that step, so a person (or a test)
    can see exactly what a resume did. Ranks append to the same file with single `write` calls
    of whole lines in O_APPEND mode, which the OS keeps intact.
    """

    def __init__(self, path: str):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def on_step_end(self, run, record: dict) -> None:
        os.write(self.fd, (json.dumps(record) + "\n").encode("utf-8"))

    def on_train_end(self, run, status: str) -> None:
        os.close(self.fd)

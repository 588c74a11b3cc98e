"""Draw a run's curves from its metrics file into a PNG: loss, bits per byte, (GRPO) reward, LR, gradient norm.

The panels share the step axis. Validation loss (if any) is drawn over the training loss, and the
validation's bits per byte (`val/bpb`, comparable across tokenizers) in a panel of its own below it
(a file without them, from an older version, gets no such panel);
dashed vertical lines mark where the run was resumed, dotted red ones where an anomaly was seen.
Uses matplotlib's Agg renderer, so it works on a machine without a display (over ssh, in CI).
The file's fields are described in trainer/hardening/metrics_files.py; a non-finite value (NaN or inf,
or null in an older file) is drawn as a gap.

    python scripts/plot_metrics.py out/pretrain_512_metrics.jsonl -o curves.png
    python scripts/plot_metrics.py out/pretrain_512_metrics.jsonl   # -> out/pretrain_512_metrics.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from trainer.hardening.metrics_files import is_finite_number, is_train_record, read_metrics

METRICS_SUFFIX = "_metrics.jsonl"
REWARD_WINDOW = 10  # GRPO's reward is drawn as logged and as this many log points' trailing mean


def run_name_from_path(path: Path) -> str:
    """`out/metrics/pretrain_512_metrics.jsonl` -> `pretrain_512`."""
    name = path.name
    return name[:-len(METRICS_SUFFIX)] if name.endswith(METRICS_SUFFIX) else path.stem


def values(records: list[dict], key: str) -> list[float]:
    """`key` of each record as floats; NaN (a gap in the line) where it is not finite or absent."""
    return [r[key] if is_finite_number(r.get(key)) else float("nan") for r in records]


def trailing_mean(points: list[float], window: int) -> list[float]:
    """Each point's mean with the window - 1 before it (fewer at the start), over its finite values (NaN if none)."""
    means = []
    for i in range(len(points)):
        finite = [p for p in points[max(0, i - window + 1):i + 1] if is_finite_number(p)]
        means.append(sum(finite) / len(finite) if finite else float("nan"))
    return means


def plot_metrics(records: list[dict], out_path: str | Path, run_name: str = "") -> Path:
    """Write the figure of `records` (as read from a metrics file) to `out_path`."""
    figure = metrics_figure(records, run_name)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=110)
    return out_path


def metrics_figure(records: list[dict], run_name: str = "") -> Figure:
    """The figure of `records`: loss, val bits per byte (if the file has them), LR and grad norm over the steps."""
    train = sorted((r for r in records if is_train_record(r)), key=lambda r: r["step"])
    if not train:
        raise ValueError("no training records (lines with 'step' and 'loss') to plot; "
                         "has the run logged its first log_interval yet?")
    val = sorted((r for r in records if "val/loss" in r), key=lambda r: r["step"])
    resumes = [r["step"] for r in records if r.get("event") == "resume"]
    anomalies = [r["step"] for r in records if r.get("event") == "anomaly"]
    bpb = [r for r in val if "val/bpb" in r]  # older files have none
    rewards = all("reward" in r for r in train)  # a GRPO run (trainer/train_grpo.py)
    steps = [r["step"] for r in train]

    # A Figure with its own Agg canvas, not pyplot: no global state, no display needed.
    figure = Figure(figsize=(9, 8 + 2 * bool(bpb) + 2 * rewards), layout="constrained")
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(3 + bool(bpb) + rewards, 1, sharex=True))
    loss_ax, *rest = axes
    bpb_ax = rest.pop(0) if bpb else None
    reward_ax = rest.pop(0) if rewards else None
    lr_ax, grad_ax = rest

    loss_ax.plot(steps, values(train, "loss"), label="train loss")
    if val:
        loss_ax.plot([r["step"] for r in val], values(val, "val/loss"), "o-", label="val/loss")
    loss_ax.set_ylabel("loss (nats per token)")
    if bpb:  # the number to compare with a run of another tokenizer: the loss per token is not
        bpb_ax.plot([r["step"] for r in bpb], values(bpb, "val/bpb"), "o-", color="tab:orange", label="val/bpb")
        bpb_ax.set_ylabel("val bits per byte")

    if reward_ax is not None:  # GRPO: the mean reward, and the share of groups whose rewards were all alike
        rewards_logged = values(train, "reward")  # each step's own: a few groups, so it jumps from step to step
        reward_ax.plot(steps, rewards_logged, color="tab:red", alpha=0.35, label="reward")
        reward_ax.plot(steps, trailing_mean(rewards_logged, REWARD_WINDOW), color="tab:red",
                       label=f"reward, mean of the last {REWARD_WINDOW} points")
        reward_ax.plot(steps, values(train, "no_signal"), color="tab:gray", linestyle="--", linewidth=1,
                       label="groups without signal")
        reward_ax.set_ylabel("reward")
        reward_ax.legend(loc="upper left")

    lr_ax.plot(steps, values(train, "lr"), color="tab:green")
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))

    grad_norms = values(train, "grad_norm")
    grad_ax.plot(steps, grad_norms, color="tab:purple")
    grad_ax.set_ylabel("grad norm")
    finite = [g for g in grad_norms if is_finite_number(g)]
    # A log scale keeps one explosion from flattening the rest; on a narrow range it only hurts.
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        grad_ax.set_yscale("log")
    grad_ax.set_xlabel("step (optimizer steps)")

    mark_events(axes, resumes, anomalies)
    loss_ax.legend(loc="upper right")

    title = run_name or "training run"
    figure.suptitle(f"{title}: {len(train)} log points up to step {steps[-1]}"
                    + (f", {len(resumes)} resume(s)" if resumes else ""))
    return figure


def mark_events(axes: list, resumes: list[int], anomalies: list[int]) -> None:
    """Dashed gray lines at the resumes, dotted red ones at the anomalies, on every panel (labelled on the first)."""
    for ax in axes:
        for i, step in enumerate(resumes):
            ax.axvline(step, color="gray", linestyle="--", linewidth=1,
                       label="resume" if ax is axes[0] and i == 0 else None)
        for i, step in enumerate(anomalies):
            ax.axvline(step, color="red", linestyle=":", linewidth=1,
                       label="anomaly" if ax is axes[0] and i == 0 else None)
        ax.grid(alpha=0.3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot loss, val bits per byte, lr and grad norm from a metrics "
                                                 "JSONL file.")
    parser.add_argument("metrics_jsonl", type=Path)
    parser.add_argument("-o", "--out", type=Path, default=None, help="PNG to write (default: beside the input)")
    args = parser.parse_args(argv)
    if not args.metrics_jsonl.is_file():
        sys.exit(f"error: {args.metrics_jsonl} does not exist")
    out = args.out or args.metrics_jsonl.with_suffix(".png")
    try:
        written = plot_metrics(read_metrics(args.metrics_jsonl), out, run_name_from_path(args.metrics_jsonl))
    except ValueError as error:
        sys.exit(f"error: {args.metrics_jsonl}: {error}")
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

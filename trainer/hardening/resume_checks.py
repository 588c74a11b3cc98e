"""Refusing a resume that would not continue the run, and reading minimind's resume files.

A resume continues the run exactly only if the model config, the data file, the tokenizer and the settings that
decide which samples form a step and the LR curve are unchanged. `check_resume_compatible` refuses a change of any
of them with a diff naming each field (FIXED_TRAINING_ARGS lists the settings; --dtype, the intervals and the
operator flags may change: they change how the run is computed or watched, not what it trains on). Called once,
from trainer_utils.load_checkpoint (checked_for_resume), with the GPU-count rule (gpu_count_rule: what another
world size may change).
"""

from __future__ import annotations

import hashlib
import math

from model.tokenizer import vocab_sha256

# Settings that decide which samples form a step or the LR curve: refused when they differ on resume
# (world size may change; batch geometry is checked separately).
FIXED_TRAINING_ARGS = ("epochs", "seed", "max_seq_len", "pack", "learning_rate", "warmup_ratio", "grad_clip",
                       "system_prompt_ratio", "drop_empty_think_ratio",  # pack: pretraining only; these two: SFT's
                       "lora_rank", "lora_alpha", "lora_targets",  # LoRA's adapter
                       "beta",  # DPO's (and GRPO's)
                       "num_generations", "max_completion_len", "temperature", "clip_eps", "rewards",  # GRPO's
                       "max_turns",  # agentic GRPO's
                       "num_iterations", "loss_type",  # GRPO's too: how often, and by which loss, a batch trains
                       "base_sha256",  # LoRA's frozen base, DPO's reference: the hash of --from_weight's file
                       "alpha", "teacher_sha256",  # distillation's: the CE's share, the hash of the teacher's file
                       "optimizer", "weight_decay", "muon_learning_rate", "muon_weight_decay")  # make_optimizer
# The value of a setting a run without its flag trains with: SFT and checkpoints written before
# --pack existed have no "pack", and they trained unpacked; GRPO's before --max_turns, --num_iterations and
# --loss_type, one turn, one update per batch of rollouts, by DAPO's loss; every stage before --optimizer, AdamW.
SETTING_DEFAULTS = {"pack": 0, "max_turns": 1, "num_iterations": 1, "loss_type": "dapo",
                    "optimizer": "adamw", "weight_decay": 0.01, "muon_weight_decay": 0.01}  # before --optimizer


class ConfigError(ValueError):
    """A flag, weights file or checkpoint that does not fit this run: the user's to fix, no traceback."""


class ResumeMismatch(ConfigError):
    """The checkpoint was made for another model, data file or training setup."""


def resume_settings(args, accumulation: int, world_size: int) -> dict:
    """The settings a checkpoint records and a resume compares (`train_args` in `_resume.pth`); also the
    tokenizer's identity, which out/{run}.json keeps beside the weights (a later stage checks it: from_weight.py)."""
    tokenizer = getattr(args, "tokenizer_path", None)
    return {"batch_size": args.batch_size, "accumulation_steps": accumulation,
            "global_batch_size": args.global_batch_size, "world_size": world_size,
            **{k: getattr(args, k, SETTING_DEFAULTS.get(k)) for k in FIXED_TRAINING_ARGS},
            "tokenizer_vocab_sha256": vocab_sha256(tokenizer) if tokenizer else None}


def plain(value):
    """Settings as plain types for the checkpoint (weights_only loading accepts only those)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def data_fingerprint(source, sampled_lines: int = 64) -> dict:
    """Identify the dataset's indexed JSONL file: size, record count, the SHA-256 of the whole file (made
    while indexing, which reads every byte anyway) and, for checkpoints written before that hash, the hash
    of `sampled_lines` evenly spaced records. The path is recorded for the reader but not compared: a moved
    file is the same data."""
    count = len(source)
    digest = hashlib.sha256()
    for i in sorted({(k * count) // sampled_lines for k in range(min(sampled_lines, count))}):
        digest.update(source.raw_line(i))
    return {"path": str(source.path), "size": int(source.file_size), "lines": count, "sha256": source.sha256,
            "sample_sha256": digest.hexdigest()}


def _diff(kind: str, saved: dict, current: dict, keys) -> list[str]:
    return [f"  {kind}.{key}: checkpoint has {saved.get(key)!r}, this run has {current.get(key)!r}"
            for key in keys if saved.get(key) != current.get(key)]


def check_resume_compatible(saved: dict, lm_config: dict, fingerprint: dict, train_args: dict) -> list[str]:
    """Raise ResumeMismatch listing every field that differs; return notes on what was adapted.
    `train_args` is the current run's `resume_settings` (global_batch_size: the requested one, or None)."""
    problems = _diff("model", saved["lm_config"], lm_config, sorted(set(saved["lm_config"]) | set(lm_config)))
    problems += _diff("data", saved["data_fingerprint"], fingerprint, ("size", "lines", "sample_sha256"))
    notes = []
    if "sha256" in saved["data_fingerprint"]:
        problems += _diff("data", saved["data_fingerprint"], fingerprint, ("sha256",))
    else:  # written before the whole-file hash: what it has is compared, and the log says what that misses
        notes.append("the checkpoint has no hash of the whole data file (written by an earlier version): its "
                     "size, record count and 64 evenly spaced records were compared; an edit of the same length "
                     "elsewhere would go unnoticed")
    old = saved["train_args"]
    # A setting missing on either side (an older checkpoint, a caller without the flag) had its default.
    problems += _diff("args", {**SETTING_DEFAULTS, **old}, {**SETTING_DEFAULTS, **train_args}, FIXED_TRAINING_ARGS)
    # The tokenizer: the same data file read by another one of the same size is other ids, which nothing above shows
    if old.get("tokenizer_vocab_sha256") is not None:
        problems += _diff("args", old, train_args, ("tokenizer_vocab_sha256",))
    elif train_args.get("tokenizer_vocab_sha256") is not None:
        notes.append("the checkpoint has no record of its tokenizer (written by an earlier version): one of the same "
                     "size with other tokens would go unnoticed")
    refuse(problems)
    return notes


def refuse(problems: list[str]) -> None:
    """ResumeMismatch listing the `problems` (each field that differs, with both values), if there are any."""
    if problems:
        raise ResumeMismatch(
            "cannot resume: the checkpoint was made with other settings:\n" + "\n".join(problems) +
            "\nRun with the checkpoint's settings, or start a new run (another --save_weight or "
            "--checkpoint_dir) instead of --from_resume 1.")


def refuse_or_note(problems: list[str], notes: list[str], log) -> None:
    """refuse(problems); then each note logged (what the resume adapted)."""
    refuse(problems)
    for note in notes:
        log(f"resume: {note}")


def checked_for_resume(state: dict, lm_config, run, log) -> dict:
    """The state a resume continues from, checked against this run (`run`: trainer_utils.RunSpec): a minimind
    file converted first (from_minimind_layout), sizes no flag gives taken from the checkpoint, then
    check_resume_compatible and gpu_count_rule (problems: exit 2); logs what was adapted and where training
    continues."""
    if is_minimind_layout(state):
        state = from_minimind_layout(state, lm_config, run, log)
    anomaly, old = state.get("anomaly") or {}, state.get("train_args") or {}
    if "skip_windows" in anomaly:  # an older version's rollbacks: (epoch, start) of a window of its global batch
        size = old["batch_size"] * old["world_size"] * old["accumulation_steps"]
        anomaly["left_out"] = [[epoch, start, min(start + size, run.num_samples)]
                               for epoch, start in anomaly.pop("skip_windows")]
    try:  # sizes no flag gives are the checkpoint's own, as with --from_weight's file
        lm_config = type(lm_config).from_dict({**state["lm_config"], **run.given_sizes})
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{state['resumed_from']}: its model config does not fit this version ({error})")
    for note in check_resume_compatible(state, lm_config.to_dict(), run.data_fingerprint, run.settings):
        log(f"resume: {note}")
    refuse_or_note(*gpu_count_rule(state["train_args"], run.settings), log)
    log(resume_summary(state, run.settings["world_size"], run.global_batch))
    return state


# ---- minimind's resume files ----------------------------------------------------------------
#
# minimind's train_epoch counts `step` over its loader, one micro-batch of batch_size per rank
# (`enumerate(loader, start=start_step + 1)`), and saves it with the epoch. Its loader resumes by
# skipping `step` micro-batches on each rank, and its lm_checkpoint, loading on another GPU count,
# rescales `step * saved_ws // current_ws`: both keep step x batch_size x world_size samples consumed.

MINIMIND_KEYS = {"model", "optimizer", "epoch", "step", "world_size"}


def is_minimind_layout(state: dict) -> bool:
    """minimind's `lm_checkpoint` writes model (fp16), optimizer, epoch, step, world_size, wandb_id."""
    return MINIMIND_KEYS <= set(state) and "samples_consumed" not in state


def from_minimind_layout(raw: dict, lm_config, run, log) -> dict:
    """This project's resume state from a minimind one: weights, optimizer, epoch and position kept. Samples
    consumed = step x batch_size (this run's: minimind does not save its own) x the saved world size, as
    minimind's own resume skips; the global step counts this run's steps up to there. The log says what is lost."""
    batch_size, n, global_batch = run.settings["batch_size"], run.num_samples, run.global_batch
    samples = min(int(raw["step"]) * batch_size * int(raw["world_size"]), n)
    log(f"resume: {raw['resumed_from']} is a minimind resume file: weights (fp16 -> fp32), optimizer, epoch "
        f"{int(raw['epoch']) + 1} and {samples} samples consumed (step {raw['step']} x batch_size "
        f"{batch_size} x world size {raw['world_size']}) are restored. Not restored: the exact sample "
        f"cursor (minimind's data order differs, so which samples of this epoch were trained is unknown), the "
        f"RNG states, and the checks of model config, data and settings (the weights still load strictly)")
    steps_per_epoch = math.ceil(n / global_batch)  # minimind's file does not count the steps of earlier epochs
    return {
        "model": {name: t.float() for name, t in raw["model"].items()},
        "optimizer": raw["optimizer"], "scaler": raw.get("scaler"),
        "epoch": int(raw["epoch"]), "samples_consumed": samples,
        "global_step": int(raw["epoch"]) * steps_per_epoch + steps_per_epoch - math.ceil((n - samples) / global_batch),
        "world_size": int(raw["world_size"]), "rng": [],  # no RNG states: every rank keeps its fresh seed
        "lm_config": lm_config.to_dict(), "data_fingerprint": run.data_fingerprint, "train_args": run.settings,
        "tracker_ids": {"wandb": raw.get("wandb_id"), "swanlab": None}, "resumed_from": raw["resumed_from"],
        "anomaly": {}, "from_minimind": True,
    }


def resume_summary(state: dict, world_size: int, global_batch: int) -> str:
    """The log line of a resume, counted in global steps as every log line, the metrics file and the trackers
    are: the step the checkpoint was saved at (the next one trained is that + 1), the sample it continues
    from, and what changed with the world size."""
    old_ws, minimind = state["world_size"], state.get("from_minimind", False)
    changes = [f"world size {old_ws} -> {world_size}"] if old_ws != world_size else []
    if not minimind:  # minimind's file does not record its batch geometry
        old = state["train_args"]
        old_batch = old["batch_size"] * old["world_size"] * old["accumulation_steps"]
        if old_batch != global_batch:
            changes.append(f"global batch {old_batch} -> {global_batch}: the steps left are counted in the new "
                           f"global batch")
    exact = "the count only: minimind's order differs" if minimind else "the exact data position"
    rng = "RNG restored" if len(state["rng"]) == world_size else (
        "RNG reseeded" + ("" if minimind else " for the new world size"))
    changed = ", ".join(changes) + "; " if changes else ""
    return (f"resumed from {state['resumed_from']} saved at step {state['global_step']}: training continues from "
            f"sample {state['samples_consumed']} of epoch {state['epoch'] + 1} ({changed}{exact}, {rng})")


def gpu_count_rule(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """What a resume on another GPU count may change (`old`, `new`: the checkpoint's train_args and this run's):
    with --global_batch_size G, any split of the same G trains the same steps' samples (summed in another order: not
    bit for bit); without, G moves with the GPUs."""
    split = [tuple(s[key] for key in ("batch_size", "world_size", "accumulation_steps")) for s in (old, new)]
    g_old, g_new = (s["global_batch_size"] or math.prod(parts) for s, parts in zip((old, new), split))
    fixed = old["global_batch_size"] is not None or new["global_batch_size"] is not None
    if fixed and g_old != g_new:
        return [f"  args.global_batch_size: checkpoint has {old['global_batch_size']!r} ({g_old} samples a step), "
                f"this run has {new['global_batch_size']!r} ({g_new})"], []
    problems = [f"  args.{key}: checkpoint has {old[key]!r}, this run has {new[key]!r}"
                for key in ("batch_size", "accumulation_steps") if not fixed and old[key] != new[key]]
    if split[0] == split[1]:
        return problems, []
    what = f"global batch {g_new} kept" if fixed else "global batch moves with the GPUs (--global_batch_size fixes it)"
    return problems, [f"{what}: batch_size x world_size x accumulation {'x'.join(map(str, split[0]))} -> "
                      f"{'x'.join(map(str, split[1]))}"]

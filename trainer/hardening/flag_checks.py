"""The flags both scripts take, checked before anything starts: a value out of its range, or a path of
the wrong kind, is one line naming the flag, the value and what is allowed (exit 2), not a traceback
later or a run that trains silently wrong. Defaults that depend on other flags are filled in here too.

It runs in parse_args, before the process group exists: under torchrun every rank meets the same bad
flag and prints its own line (run_script), and no rank is left waiting for another in a collective.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

from model.model import LMConfig
from trainer.hardening.anomaly import parse_injection
from trainer.hardening.checkpoint_io import HISTORY_NAME
from trainer.hardening.resume_checks import ConfigError

MAX_POSITIONS = LMConfig.max_position_embeddings  # the rotary table's length: no window may be longer

# What each numeric flag may be: the words a refusal prints, and the test. A flag left out (None) passes;
# the tests say what IS allowed, so NaN, for which every comparison is False, fails each of them.
# A flag one script lacks (--pack, the SFT ratios) is skipped there.
RANGES = {
    "epochs": ("an integer >= 1", lambda v: v >= 1),
    "batch_size": ("an integer >= 1 (the micro-batch per rank)", lambda v: v >= 1),
    "accumulation_steps": ("an integer >= 1 (micro-batches per optimizer step)", lambda v: v >= 1),
    "global_batch_size": ("an integer >= 1 (samples per optimizer step, all ranks together)", lambda v: v >= 1),
    "learning_rate": ("a finite number >= 0 (the peak LR; 0 leaves the weights as they are)",
                      lambda v: 0 <= v < math.inf),
    "warmup_ratio": ("in [0, 1) (the share of the run the LR warms up over)", lambda v: 0 <= v < 1),
    "max_seq_len": (f"an integer in [2, {MAX_POSITIONS}] (n tokens give n - 1 next-token targets; the model's "
                    f"rotary table holds {MAX_POSITIONS} positions)", lambda v: 2 <= v <= MAX_POSITIONS),
    "hidden_size": ("an integer >= 1", lambda v: v >= 1),
    "num_hidden_layers": ("an integer >= 1", lambda v: v >= 1),
    "num_attention_heads": ("an integer >= 1", lambda v: v >= 1),
    "num_key_value_heads": ("an integer >= 1", lambda v: v >= 1),
    "intermediate_size": ("an integer >= 1", lambda v: v >= 1),
    "num_experts": ("an integer >= 1", lambda v: v >= 1),
    "num_experts_per_tok": ("an integer >= 1", lambda v: v >= 1),
    "num_workers": ("an integer >= 0 (0 loads the data in the training process)", lambda v: v >= 0),
    "grad_clip": ("a number > 0 (the largest gradient norm kept; inf turns clipping off)", lambda v: v > 0),
    "log_interval": ("an integer >= 1 (optimizer steps between log lines)", lambda v: v >= 1),
    "save_interval": ("an integer >= 1 (optimizer steps between checkpoints)", lambda v: v >= 1),
    "eval_interval": ("an integer >= 1 (optimizer steps between validations)", lambda v: v >= 1),
    "max_steps": ("an integer >= 1 (leave it out to train every epoch)", lambda v: v >= 1),
    # NumPy takes seeds below 2**32, and each rank seeds with seed + rank.
    "seed": ("an integer in [0, 2147483647]", lambda v: 0 <= v <= 2**31 - 1),
    "keep_last": ("an integer >= 1 (the newest checkpoint is always kept)", lambda v: v >= 1),
    "patience": ("an integer >= 0 (0: no plateau check)", lambda v: v >= 0),
    "max_rollbacks": ("an integer >= 0 (rollbacks before --on_anomaly rollback stops)", lambda v: v >= 0),
    "rollback_lr_factor": ("in (0, 1] (the LR is multiplied by it after each rollback; 1 keeps it)",
                           lambda v: 0 < v <= 1),
    "system_prompt_ratio": ("in [0, 1] (a share of the samples)", lambda v: 0 <= v <= 1),
    "drop_empty_think_ratio": ("in [0, 1] (a share of the samples)", lambda v: 0 <= v <= 1),
}
LOGGERS = ("console", "file", "wandb", "swanlab")


def check_flags(args: argparse.Namespace) -> argparse.Namespace:
    """`args`, checked, with the defaults that depend on other flags filled in. A bad flag: ConfigError."""
    for flag, (allowed, ok) in RANGES.items():
        value = getattr(args, flag, None)
        if value is not None and not ok(value):
            raise ConfigError(f"--{flag} {value}: must be {allowed}")
    check_model_shape(args)
    check_paths(args)
    check_device(args.device)
    unknown = [name for name in args.logger.split(",") if name and name not in LOGGERS]
    if unknown:  # a typo would silently drop that output
        raise ConfigError(f"--logger {args.logger}: {', '.join(unknown)} is none of {', '.join(LOGGERS)}")
    try:
        parse_injection(args.debug_inject)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if args.use_compile is None:  # where it pays: 2.5x on an H100; on a CPU compiling costs more than it saves
        args.use_compile = int(args.device.startswith("cuda"))
    return args


def check_model_shape(args: argparse.Namespace) -> None:
    """The size flags fit together (LMConfig checks the same, but with a traceback)."""
    hidden, heads, kv_heads = args.hidden_size, args.num_attention_heads, args.num_key_value_heads
    if hidden % heads:
        raise ConfigError(f"--hidden_size {hidden}: must be a multiple of --num_attention_heads {heads} "
                          f"(each head gets hidden_size / heads dimensions)")
    if (hidden // heads) % 2:
        raise ConfigError(f"--hidden_size {hidden} / --num_attention_heads {heads} = {hidden // heads}: a head's "
                          f"width must be even (rotary embeddings turn pairs of dimensions)")
    if heads % kv_heads:
        raise ConfigError(f"--num_key_value_heads {kv_heads}: must divide --num_attention_heads {heads} "
                          f"(each key/value head serves the same number of query heads)")
    experts = LMConfig.num_experts if args.num_experts is None else args.num_experts
    if args.use_moe and args.num_experts_per_tok is not None and args.num_experts_per_tok > experts:
        raise ConfigError(f"--num_experts_per_tok {args.num_experts_per_tok}: must be at most --num_experts "
                          f"{experts} (each token is routed to that many of the experts)")


def check_paths(args: argparse.Namespace) -> None:
    """Inputs are files that exist; outputs are directories, or paths where one can be made."""
    for flag, what in (("data_path", "a JSONL file of training data"), ("val_data", "a JSONL validation file"),
                       ("tokenizer_path", "a tokenizer.json file (trainer/train_tokenizer.py makes one)")):
        path = getattr(args, flag)
        if path is not None and not Path(path).is_file():
            kind = ("is a directory" if Path(path).is_dir() else "is not a regular file" if os.path.lexists(path)
                    else "does not exist")
            raise ConfigError(f"--{flag} {path} {kind}: give {what}")
    if args.resume_path is not None:
        path = Path(args.resume_path)
        sharded = path.is_dir() and HISTORY_NAME.match(path.name) and path.suffix == ".dcp"
        if not (path.is_file() or sharded):
            kind = ("is a directory" if path.is_dir() else "is not a regular file" if os.path.lexists(path)
                    else "does not exist")
            raise ConfigError(f"--resume_path {args.resume_path} {kind}: give a checkpoint file, or the "
                              f"step_N.dcp folder of a sharded one")
    for flag in ("save_dir", "checkpoint_dir", "metrics_dir"):
        if getattr(args, flag) is not None:
            check_can_be_made(flag, getattr(args, flag), Path(getattr(args, flag)))
    if args.save_debug_train_output is not None:
        path = Path(args.save_debug_train_output)
        if path.is_dir():
            raise ConfigError(f"--save_debug_train_output {path} is a directory: give the path of a file")
        check_can_be_made("save_debug_train_output", path, path.parent)


def check_can_be_made(flag: str, value: str | Path, directory: Path) -> None:
    """`directory` exists, or can be made: the nearest of it and its parents that exists is a directory."""
    for part in (directory, *directory.absolute().parents):
        if part.is_dir():
            return
        if os.path.lexists(part):
            where = ("is not a directory: give a folder (a missing one is made)" if part == Path(value)
                     else f"cannot be made: {part} is not a directory")
            raise ConfigError(f"--{flag} {value} {where}")


def check_device(device_flag: str) -> None:
    """--device names a device this machine has (under torchrun each rank takes cuda:LOCAL_RANK)."""
    try:
        device = torch.device(device_flag)
    except RuntimeError:
        raise ConfigError(f"--device {device_flag}: must be cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ConfigError(f"--device {device_flag}: this machine has no CUDA device that PyTorch can use "
                              f"(torch.cuda.is_available() is False); train with --device cpu")
        index = int(os.environ.get("LOCAL_RANK", 0)) if "RANK" in os.environ else device.index  # as init_distributed
        if index is not None and index >= count:
            raise ConfigError(f"--device {device_flag}: cuda:{index} does not exist, this machine has {count} "
                              f"GPU{'s' if count > 1 else ''} (cuda:0 to cuda:{count - 1}); under torchrun rank "
                              f"LOCAL_RANK takes cuda:LOCAL_RANK, so start at most {count} per node")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {device_flag}: MPS is not available on this machine; train with --device cpu")
    elif device.type not in ("cpu", "mps"):
        raise ConfigError(f"--device {device_flag}: must be cpu, cuda, cuda:N or mps")

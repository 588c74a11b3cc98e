"""The command-line flags both training scripts share (users and tests rely on their names), and the
model config they describe. Each script passes only its own defaults, so the two cannot drift apart.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from model.hf import load_project_weights
from model.model import LMConfig
from trainer.trainer_utils import REPO_ROOT, ConfigError


def build_arg_parser(description: str, *, save_weight: str, from_weight: str, data_path: str,
                     learning_rate: float, epochs: int) -> argparse.ArgumentParser:
    """The flags common to both scripts; the script passes its own defaults."""
    p = argparse.ArgumentParser(description=description)
    a = p.add_argument
    a("--data_path", default=str(REPO_ROOT / data_path), help="JSONL training data")
    a("--tokenizer_path", default=str(REPO_ROOT / "model" / "tokenizer.json"))
    a("--save_dir", default=str(REPO_ROOT / "out"), help="where FP16 inference weights go")
    a("--checkpoint_dir", default=str(REPO_ROOT / "checkpoints"), help="where resume state goes")
    a("--save_weight", default=save_weight, help="name prefix of the saved files")
    a("--from_weight", default=from_weight, help="'none' or a weight name in --save_dir to start from")
    a("--from_resume", type=int, default=0, choices=(0, 1), help="1: continue from the newest good checkpoint")
    a("--resume_path", default=None, help="resume from this kept checkpoint file instead of the newest")
    a("--keep_last", type=int, default=2, help="verified checkpoints to keep")
    a("--async_save", type=int, default=1, choices=(0, 1),
      help="1: copy the state to CPU memory and write it in a background thread; 0: write before continuing")
    a("--epochs", type=int, default=epochs)
    a("--batch_size", type=int, default=32, help="micro-batch per rank")
    a("--accumulation_steps", type=int, default=1)
    a("--global_batch_size", type=int, default=None,
      help="samples per optimizer step; derives accumulation_steps and keeps steps identical on any GPU count")
    a("--learning_rate", type=float, default=learning_rate)
    a("--warmup_ratio", type=float, default=0.01)
    a("--max_seq_len", type=int, default=340)
    a("--hidden_size", type=int, default=512)
    a("--num_hidden_layers", type=int, default=8)
    a("--num_attention_heads", type=int, default=8)
    a("--num_key_value_heads", type=int, default=4)
    a("--use_moe", type=int, default=0, choices=(0, 1))
    a("--intermediate_size", type=int, default=None,
      help="SwiGLU width (default: from --from_weight, else the model's)")
    a("--num_experts", type=int, default=None, help="MoE experts (default: from --from_weight, else the model's)")
    a("--num_experts_per_tok", type=int, default=None, help="MoE top-k (default: the model's)")
    a("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
      help="autocast dtype on CUDA (CPU always trains in float32)")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a("--num_workers", type=int, default=1)
    a("--grad_clip", type=float, default=1.0)
    a("--log_interval", type=int, default=10, help="optimizer steps between log lines")
    a("--save_interval", type=int, default=100, help="optimizer steps between checkpoints")
    a("--max_steps", type=int, default=None, help="stop (and save) after this many steps of this invocation")
    a("--seed", type=int, default=42)
    a("--use_compile", type=int, default=0, choices=(0, 1))
    a("--use_wandb", action="store_true")
    a("--use_swanlab", action="store_true")
    a("--wandb_project", default="tiny-llm-trainer")
    a("--save_debug_train_output", default=None,
      help="JSONL path: one record per optimizer step and rank (sample indices, loss, lr)")
    a("--save_hf", type=int, default=0, choices=(0, 1), help="1: also write a Hugging Face export at each save")
    # Watching the run: metrics files, trackers, validation.
    a("--logger", default="console,file", help="any of console,file,wandb,swanlab, comma-separated")
    a("--metrics_dir", default=None, help="where {run_name}_metrics.jsonl and _status.json go (default --save_dir)")
    a("--run_name", default=None, help="name of the metrics files and tracker run (default {weight}_{hidden})")
    a("--val_data", default=None, help="JSONL validation file in the training format")
    a("--eval_interval", type=int, default=100, help="optimizer steps between validations")
    # Anomalies: what to do when a step looks wrong.
    a("--on_anomaly", default="warn", choices=("warn", "stop", "rollback"))
    a("--patience", type=int, default=0, help="steps without loss improvement that count as a plateau (0: off)")
    a("--max_rollbacks", type=int, default=3)
    a("--rollback_lr_factor", type=float, default=1.0, help="multiply the LR by this after each rollback")
    a("--debug_inject", default=None,
      help="try the anomaly policy on purpose: nan:K or spike:K makes step K's loss NaN or 1e4x (comma-separated)")
    return p


# The flags that shape the model; None means "not given" (the model's default applies).
SIZE_FLAGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "use_moe",
              "intermediate_size", "num_experts", "num_experts_per_tok")


def lm_config_from_args(args, vocab_size: int) -> LMConfig:
    """The model config the size flags describe, for a tokenizer of `vocab_size` tokens."""
    sizes = {name: getattr(args, name) for name in SIZE_FLAGS if getattr(args, name) is not None}
    sizes["use_moe"] = bool(sizes.get("use_moe", 0))
    return LMConfig(vocab_size=vocab_size, **sizes)


def model_config_and_weights(args, vocab_size: int, log, fresh: bool) -> tuple[LMConfig, dict | None]:
    """The model to build, and on a fresh start with --from_weight the weights it begins from.

    With a weights file the sizes are read from its tensors, so minimind's files (or ours of any
    shape) need no size flags; size flags given are checked against the file, and a mismatch names
    both shapes. Without one (or when resuming, where the checkpoint decides) the flags describe it.
    """
    if not fresh or args.from_weight == "none":
        return lm_config_from_args(args, vocab_size), None
    path = initial_weights_path(args)
    if not path.is_file():
        raise FileNotFoundError(f"--from_weight {args.from_weight}: {path} does not exist. Train that stage first "
                                f"(e.g. trainer/train_pretrain.py with the same --hidden_size), or pass "
                                f"--from_weight none to start from random weights")
    try:
        weights, lm_config = load_project_weights(path, {name: getattr(args, name) for name in SIZE_FLAGS}, vocab_size)
    except ValueError as error:  # the file does not fit the flags or the tokenizer: the message says how
        raise ConfigError(f"--from_weight {args.from_weight}: {error}") from None
    log(f"initial weights: {path} ({lm_config.hidden_size}x{lm_config.num_hidden_layers}, "
        f"intermediate {lm_config.intermediate_size}{', MoE' if lm_config.use_moe else ''})")
    return lm_config, weights


def initial_weights_path(args) -> Path:
    """`{save_dir}/{from_weight}_{hidden}[_moe].pth`: the FP16 file the previous stage wrote."""
    return Path(args.save_dir) / f"{args.from_weight}_{args.hidden_size}{'_moe' if args.use_moe else ''}.pth"

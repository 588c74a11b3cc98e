"""The flags for running in production that a first reading can skip; both scripts add them with one call.

The flags a learner needs (data, sizes, batch, LR, saving, resuming) are written in each script.
"""

from __future__ import annotations

import argparse

from model.tokenizer import DEFAULT_TOKENIZER


def add_operator_flags(parser: argparse.ArgumentParser) -> None:
    """Flags for running in production that a first reading can skip (both scripts share them)."""
    a = parser.add_argument
    a("--tokenizer_path", default=str(DEFAULT_TOKENIZER))
    a("--use_wandb", action="store_true")
    a("--use_swanlab", action="store_true")
    a("--wandb_project", default="tiny-llm-trainer")
    a("--resume_path", default=None, help="resume from this kept checkpoint file instead of the newest")
    a("--keep_last", type=int, default=2, help="verified checkpoints to keep")
    a("--async_save", type=int, default=1, choices=(0, 1),
      help="1: copy the state to CPU memory and write it in a background thread; 0: write before continuing")
    a("--intermediate_size", type=int, default=None,
      help="SwiGLU width (default: from --from_weight, else the model's)")
    a("--num_experts", type=int, default=None, help="MoE experts (default: from --from_weight, else the model's)")
    a("--num_experts_per_tok", type=int, default=None, help="MoE top-k (default: the model's)")
    a("--save_debug_train_output", default=None,
      help="JSONL path: one record per optimizer step and rank (sample indices, loss, lr)")
    a("--save_hf", type=int, default=0, choices=(0, 1), help="1: also write a Hugging Face export at each save")
    a("--gather_weights", type=int, default=1, choices=(0, 1),
      help="--parallel fsdp: 1 gathers the weights to rank 0 at each save for the FP16 out/ file; 0 skips that for "
           "a model too big to gather (scripts/consolidate_checkpoint.py writes it from the checkpoint later)")
    a("--logger", default="console,file", help="any of console,file,wandb,swanlab, comma-separated")
    a("--metrics_dir", default=None, help="where {run_name}_metrics.jsonl and _status.json go (default --save_dir)")
    a("--run_name", default=None, help="name of the metrics files and tracker run (default {weight}_{hidden})")
    a("--run_id", default=None,
      help="names this job across restarts and requeues (default: $SLURM_JOB_ID, or torchrun's --rdzv-id); "
           "a directory lock left on another host by this id is taken over once its heartbeat is stale")
    a("--val_data", default=None, help="JSONL validation file in the training format")
    a("--eval_interval", type=int, default=100, help="optimizer steps between validations")
    a("--on_anomaly", default="warn", choices=("warn", "stop", "rollback"), help="what a bad step does")
    a("--patience", type=int, default=0, help="steps without loss improvement that count as a plateau (0: off)")
    a("--max_rollbacks", type=int, default=3)
    a("--rollback_lr_factor", type=float, default=1.0, help="multiply the LR by this after each rollback")
    a("--max_skipped_steps", type=int, default=20,
      help="--on_anomaly warn: this many non-finite (skipped) steps in a row stop the run, which no longer trains")
    a("--compile_backend", default="inductor",
      help="torch.compile's backend with --use_compile 1; aot_eager traces the same graphs without generating "
           "kernels (to tell a compiler fault from a model fault; the tests use it for speed)")
    a("--debug_inject", default=None,
      help="try the anomaly policy on purpose: nan:K or spike:K makes step K's loss NaN or 1e4x (comma-separated)")

"""Time this project's training step on random tokens: tokens/s, achieved TFLOP/s, peak memory.

The step is the trainer's: forward with labels (summed loss scaled by 1 / token count), backward,
gradient clipping at 1.0, AdamW (weight decay 0.01). Precision follows the trainer too: bf16
autocast and fused AdamW on CUDA, plain fp32 on the CPU. Run from the repository root:

    python -m scripts.bench --hidden_size 512 --num_hidden_layers 8 --batch_size 32 --max_seq_len 512
    python -m scripts.bench --hidden_size 512 --num_hidden_layers 8 --batch_size 32 --max_seq_len 512 --use_compile 1
    python -m scripts.bench --hidden_size 32 --num_hidden_layers 2 --batch_size 2 --max_seq_len 32 --device cpu

It prints one JSON line, so results of several runs (or of other implementations printing the
same keys) can be collected with `>> results.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext

import torch

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from model.model import CausalLM, LMConfig


def training_flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """FLOPs of one forward + backward per token (the usual estimate, as in PaLM's appendix B).

    6 * params: every weight does one multiply-add (2 FLOPs) per token forward and two backward.
    The tied embedding counts once: its lookup is free, its use as lm_head is a real matmul.
    12 * layers * hidden * seq: attention scores (Q K^T) and the weighted sum (A V), 2 * seq * hidden
    FLOPs each per token forward, times 3 for forward + backward. Counted for the full square even
    though causal attention could skip half of it, which is the common convention.
    """
    return 6 * num_params + 12 * num_layers * hidden_size * seq_len


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor,
               autocast, num_tokens: int) -> None:
    """One optimizer step exactly as the trainer takes it (one micro-batch, one rank)."""
    with autocast:
        out = model(input_ids, labels=input_ids, loss_reduction="sum")
        loss = out.loss / num_tokens + out.aux_loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def synchronize(device: torch.device) -> None:
    # CUDA kernels run asynchronously: without this the clock stops before the GPU has finished.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_benchmark(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    use_cuda = device.type == "cuda"
    torch.manual_seed(0)
    config = LMConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                      num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
                      num_key_value_heads=args.num_key_value_heads)
    model = CausalLM(config).to(device)
    num_params = model.num_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=use_cuda)
    step_model = torch.compile(model) if args.use_compile else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if use_cuda else nullcontext()

    # One fixed random batch: data loading is not what is measured here.
    input_ids = torch.randint(0, args.vocab_size, (args.batch_size, args.max_seq_len), device=device)
    num_tokens = args.batch_size * (args.max_seq_len - 1)  # positions that carry a label after the shift

    # Warmup covers torch.compile, cuDNN/cuBLAS heuristics and the optimizer's lazy state allocation.
    for _ in range(args.warmup):
        train_step(step_model, optimizer, input_ids, autocast, num_tokens)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step(step_model, optimizer, input_ids, autocast, num_tokens)
    synchronize(device)
    seconds = time.perf_counter() - start

    tokens_per_s = args.steps * args.batch_size * args.max_seq_len / seconds
    flops = training_flops_per_token(num_params, args.num_hidden_layers, args.hidden_size, args.max_seq_len)
    return {
        "impl": "tiny-llm-trainer",
        "hidden": args.hidden_size,
        "layers": args.num_hidden_layers,
        "params_M": round(num_params / 1e6, 3),
        "batch": args.batch_size,
        "seq": args.max_seq_len,
        "compile": bool(args.use_compile),
        "tokens_per_s": round(tokens_per_s, 1),
        "tflops": round(flops * tokens_per_s / 1e12, 4),
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if use_cuda else 0.0,
        "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
    }


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark the training step on random tokens")
    a = p.add_argument
    a("--hidden_size", type=int, default=512)
    a("--num_hidden_layers", type=int, default=8)
    a("--num_attention_heads", type=int, default=8)
    a("--num_key_value_heads", type=int, default=4)
    a("--vocab_size", type=int, default=6400)
    a("--batch_size", type=int, default=32)
    a("--max_seq_len", type=int, default=512)
    a("--use_compile", type=int, default=0, choices=(0, 1))
    a("--steps", type=int, default=20, help="timed optimizer steps")
    a("--warmup", type=int, default=5, help="untimed steps first (compilation, allocator warmup)")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    if args.steps < 1 or args.max_seq_len < 2:
        raise SystemExit("error: --steps must be >= 1 and --max_seq_len >= 2 (a label needs a next token)")
    print(json.dumps(run_benchmark(args)), flush=True)


if __name__ == "__main__":
    main()

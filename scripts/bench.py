"""Time training: the bare step on random tokens, or the real training loop with and without saves.

`--mode step` (default) times this project's training step alone: forward with labels (summed
loss scaled by 1 / token count), backward, gradient clipping at 1.0, AdamW (weight decay 0.01).
Precision follows the trainer: bf16 autocast and fused AdamW on CUDA, plain fp32 on the CPU.

`--mode loop` runs the real trainer (trainer/train_pretrain.py, one process) on generated text that
fills every row, three times: no saves, saves every --save_interval steps in the background
(--async_save 1), and synchronous saves (--async_save 0). It reports the loop's tokens/s as a
fraction of the bare step's, and the time saves blocked training (the trainer measures it).

    python scripts/bench.py --hidden_size 512 --num_hidden_layers 8 --batch_size 32 --max_seq_len 512
    python scripts/bench.py --hidden_size 768 --num_hidden_layers 8 --batch_size 32 --max_seq_len 340 --use_compile 1
    python scripts/bench.py --mode loop --hidden_size 768 --num_hidden_layers 8 --batch_size 2 --max_seq_len 128 \\
        --steps 20 --save_interval 5 --device cpu

It prints JSON lines, so results of several runs can be collected with `>> results.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from contextlib import nullcontext

import torch

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from model.model import CausalLM, LMConfig
from model.tokenizer import SPECIAL_TOKENS, load_tokenizer
from trainer.metrics_files import read_metrics
from trainer.tracking import flops_per_token
from trainer.trainer_utils import REPO_ROOT


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
    flops = flops_per_token(num_params, args.num_hidden_layers, args.hidden_size, args.max_seq_len)
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


def write_full_rows(path: Path, lines: int, seq_len: int, tokenizer_path: Path, seed: int = 0) -> Path:
    """A pretrain JSONL whose every line encodes to more than `seq_len` tokens, so no row is padded."""
    tokenizer = load_tokenizer(tokenizer_path)
    generator = torch.Generator().manual_seed(seed)
    first_plain_id = max(SPECIAL_TOKENS.values()) + 1
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(lines):
            ids = torch.randint(first_plain_id, tokenizer.get_vocab_size(), (2 * seq_len,), generator=generator)
            f.write(json.dumps({"text": tokenizer.decode(ids.tolist())}, ensure_ascii=False) + "\n")
    return path


def run_loop(args: argparse.Namespace, workdir: Path, save_interval: int, async_save: int) -> dict:
    """One real training run; its throughput and save stall, read from its metrics file."""
    run_dir = workdir / f"saves_{save_interval}_async_{async_save}"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, str(REPO_ROOT / "trainer" / "train_pretrain.py"),
               "--data_path", str(workdir / "data.jsonl"), "--save_dir", str(run_dir), "--checkpoint_dir",
               str(run_dir / "ckpt"), "--logger", "file", "--log_interval", str(args.log_interval),
               "--max_steps", str(args.steps), "--save_interval", str(save_interval),
               "--async_save", str(async_save), "--device", args.device, "--num_workers", str(args.num_workers),
               *model_flags(args)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    records = [r for r in read_metrics(next(run_dir.glob("*_metrics.jsonl"))) if "tokens_per_s" in r]
    # The first logged interval holds start-up (allocator, compilation): leave it out of the rate.
    steady = records[1:] or records
    train_s = sum(r["step_time_s"] * args.log_interval for r in records)
    blocked = records[-1]["save_blocked_s"]
    saves = args.steps // save_interval if save_interval <= args.steps else 0
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady), "train_s": round(train_s, 2),
            "saves": saves, "blocked_s": round(blocked, 3), "blocked_pct": round(100 * blocked / train_s, 3),
            "blocked_per_save_s": round(blocked / saves, 3) if saves else 0.0,
            "step_time_s": round(train_s / args.steps, 4)}


def model_flags(args: argparse.Namespace) -> list[str]:
    names = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "batch_size",
             "max_seq_len", "use_compile")
    return [item for name in names for item in (f"--{name}", str(getattr(args, name)))]


def run_loop_benchmark(args: argparse.Namespace) -> list[dict]:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    lines = args.batch_size * (args.steps + 2)
    write_full_rows(workdir / "data.jsonl", lines, args.max_seq_len, REPO_ROOT / "model" / "tokenizer.json")
    args.vocab_size = load_tokenizer(REPO_ROOT / "model" / "tokenizer.json").get_vocab_size()  # as the loop's model
    bare = run_benchmark(args)
    results = []
    for label, interval, async_save in (("no saves", 10**9, 1), ("background saves", args.save_interval, 1),
                                        ("synchronous saves", args.save_interval, 0)):
        loop = run_loop(args, workdir, interval, async_save)
        loop.update(mode=label, fraction_of_bare_step=round(loop["tokens_per_s"] / bare["tokens_per_s"], 3),
                    bare_tokens_per_s=bare["tokens_per_s"], device=bare["device"],
                    # What saving every 100 steps (the default) costs at this step time.
                    blocked_pct_at_default_interval=round(
                        100 * loop["blocked_per_save_s"] / (100 * loop["step_time_s"]), 3) if loop["saves"] else 0.0)
        results.append(loop)
    return results


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark the training step, or the training loop and its saves")
    a = p.add_argument
    a("--mode", choices=("step", "loop"), default="step")
    a("--save_interval", type=int, default=5, help="loop mode: steps between saves")
    a("--log_interval", type=int, default=5, help="loop mode: steps between metrics records")
    a("--workdir", default="/tmp/bench_loop", help="loop mode: data, checkpoints and metrics go here")
    a("--num_workers", type=int, default=1, help="loop mode: DataLoader workers of the trainer")
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
    results = run_loop_benchmark(args) if args.mode == "loop" else [run_benchmark(args)]
    for result in results:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Time training: the bare step on random tokens, the real training loop with and without saves, or
both at the shapes of the speed targets (`--suite gpu`).

The figures of the README's speed section come from one command on one GPU (roughly 10 minutes on an
H100, estimated: four compilations, eight trainer runs of 300 steps):

    python benchmarks/bench.py --suite gpu > bench_gpu.txt

`--suite gpu` runs, at minimind's default shape (hidden 768 x 8 layers, seq 340) and at 768 x 16
layers / seq 1024, both at batch 32, vocab --vocab_size (6400), 8 heads, 4 KV heads:
  1. the bare step, eager and compiled: tokens/s, MFU, peak memory (torch.cuda.max_memory_allocated);
  2. the real trainer (trainer/train_pretrain.py as a subprocess, --use_compile always passed), eager
     and compiled, with no saves and with background saves every 100 steps: its tokens/s / the bare
     step's of the same compile setting, and the save stall (the time saves blocked training, as the
     trainer logs it in its metrics file), per save and as a share of 100 steps without saves.
It prints one JSON line per measurement, then a markdown table naming the GPU, to paste into README.md.
Compiled runs are skipped off CUDA (torch.compile on the CPU needs a C++ compiler and minutes per
shape). A check of the suite on any machine, at a tiny shape, in about half a minute:

    python benchmarks/bench.py --suite gpu --tiny --device cpu

MFU (model FLOPs utilisation) = FLOPs per token x tokens/s / --peak_flops, where FLOPs per token =
6 * N + 12 * layers * hidden * seq (N: parameters, the tied embedding counted once; the second term
is attention's Q K^T and A V, forward and backward; trainer/hardening/tracking.py's flops_per_token, which the
trainer's own MFU also uses). --peak_flops defaults to 989e12, the dense bf16 peak of an H100 SXM.

`--mode step` (default) times this project's training step alone: forward with labels (summed
loss scaled by 1 / token count), backward, gradient clipping at 1.0, AdamW (weight decay 0.01).
Precision follows the trainer: bf16 autocast and fused AdamW on CUDA, plain fp32 on the CPU.
Warmup steps (compilation, allocator, the optimizer's lazy state) are not timed, and the clock is
read only after the GPU has finished (synchronize).

`--mode loop` runs the real trainer (one process) on generated text that fills every row, three
times: no saves, saves every --save_interval steps in the background (--async_save 1), and
synchronous saves (--async_save 0). The trainer's tokenizer is padded with unused tokens to
--vocab_size, so the loop's model has the bare step's shape. The first logged interval (start-up,
compilation) is left out of the loop's rate.

    python benchmarks/bench.py --hidden_size 512 --num_hidden_layers 8 --batch_size 32 --max_seq_len 512
    python benchmarks/bench.py --hidden_size 768 --num_hidden_layers 8 --batch_size 32 --max_seq_len 340 --use_compile 1
    python benchmarks/bench.py --mode loop --hidden_size 768 --num_hidden_layers 8 --batch_size 2 --max_seq_len 128 \\
        --steps 20 --save_interval 5 --device cpu

It prints JSON lines, so results of several runs can be collected with `>> results.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import time
from contextlib import nullcontext

import torch

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from tokenizers import AddedToken

from model.model import CausalLM, LMConfig
from model.tokenizer import SPECIAL_TOKENS, load_tokenizer
from trainer.hardening.metrics_files import read_metrics
from trainer.hardening.tracking import flops_per_token
from trainer.trainer_utils import REPO_ROOT

H100_SXM_BF16_FLOPS = 989e12  # dense, no sparsity
# (hidden, layers, seq) of the suite, and the compiled tokens/s each should reach on an H100.
SUITE_SHAPES = {(768, 8, 340): 860e3, (768, 16, 1024): 460e3}
TINY_SHAPES = {(64, 2, 32): None, (64, 2, 64): None}
LOOP_TARGET = 0.95  # loop tokens/s as a fraction of the bare step's
SAVE_EVERY = 100  # the trainer's default --save_interval: the stall is also given as a share at this interval


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
    if use_cuda:
        torch.cuda.reset_peak_memory_stats(device)  # the suite runs several models in this process

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
    result = {
        "impl": "tiny-llm-trainer",
        "hidden": args.hidden_size,
        "layers": args.num_hidden_layers,
        "vocab": args.vocab_size,
        "heads": args.num_attention_heads,
        "kv_heads": args.num_key_value_heads,
        "params_M": round(num_params / 1e6, 3),
        "batch": args.batch_size,
        "seq": args.max_seq_len,
        "compile": bool(args.use_compile),
        "tokens_per_s": round(tokens_per_s, 1),
        "tflops": round(flops * tokens_per_s / 1e12, 4),
        "mfu": float(f"{flops * tokens_per_s / args.peak_flops:.4g}"),
        "peak_tflops": args.peak_flops / 1e12,  # what the MFU is a fraction of
        # GPU memory only; on the CPU the process's peak resident memory, which no run resets.
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if use_cuda else None,
        **({} if use_cuda else {"cpu_max_rss_GiB_of_process": round(resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}),  # Linux reports kB
        "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
    }
    del step_model, model, optimizer
    if use_cuda:
        torch.cuda.empty_cache()
    if args.use_compile:
        torch._dynamo.reset()  # the next shape compiles afresh, not as a recompilation of this one
    return result


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


def padded_tokenizer(vocab_size: int, path: Path) -> Path:
    """The demo tokenizer with unused special tokens up to `vocab_size`: the trainer sizes its model's
    embedding and lm_head from the tokenizer, and the bare step's model has `vocab_size` rows."""
    tokenizer = load_tokenizer(REPO_ROOT / "model" / "tokenizer.json")
    base = tokenizer.get_vocab_size()
    if vocab_size < base:
        raise SystemExit(f"error: --vocab_size {vocab_size} is below the demo tokenizer's {base} tokens; the "
                         f"loop's model needs at least that many. Pass --vocab_size {base} or more.")
    tokenizer.add_special_tokens([AddedToken(f"<|unused_{i}|>", special=True) for i in range(base, vocab_size)])
    tokenizer.save(str(path))
    return path


def run_loop(args: argparse.Namespace, workdir: Path, save_interval: int, async_save: int) -> dict:
    """One real training run; its steady throughput and save stall, read from its metrics file."""
    run_dir = workdir / f"compile_{args.use_compile}_saves_{save_interval}_async_{async_save}"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, str(REPO_ROOT / "trainer" / "train_pretrain.py"),
               "--data_path", str(workdir / "data.jsonl"), "--tokenizer_path", str(workdir / "tokenizer.json"),
               "--save_dir", str(run_dir), "--checkpoint_dir", str(run_dir / "ckpt"), "--logger", "file",
               "--log_interval", str(args.log_interval), "--max_steps", str(args.steps),
               "--save_interval", str(save_interval), "--async_save", str(async_save), "--device", args.device,
               "--num_workers", str(args.num_workers), "--dtype", "bfloat16", *model_flags(args)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the trainer failed (exit {done.returncode}): {' '.join(command)}\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    records = [r for r in read_metrics(next(run_dir.glob("*_metrics.jsonl"))) if "tokens_per_s" in r]
    # The first logged interval holds start-up (allocator, compilation): leave it out of the rate.
    steady = records[1:] or records
    blocked = records[-1]["save_blocked_s"]  # the total so far, logged before that step's own save
    saves = (records[-1]["step"] - 1) // save_interval  # the saves before the last log step
    peaks = [r["peak_mem_GiB"] for r in records if "peak_mem_GiB" in r]
    return {"tokens_per_s": round(sum(r["tokens_per_s"] for r in steady) / len(steady), 1),
            "step_time_s": round(sum(r["step_time_s"] for r in steady) / len(steady), 5),
            "saves": saves, "blocked_s": round(blocked, 3),
            "blocked_per_save_s": round(blocked / saves, 3) if saves else 0.0,
            # What it blocked on, summed over those saves (tracking.SAVE_PARTS): the previous write, the copy, ...
            "blocked_by_s": {part: round(records[-1].get(f"save_{part}", 0.0), 3)
                             for part in ("wait_s", "copy_s", "write_s", "other_s")},
            "peak_mem_GiB": round(max(peaks), 3) if peaks else None}


def model_flags(args: argparse.Namespace) -> list[str]:
    # --use_compile is always passed: the trainer's default may change, the benchmark's must not.
    names = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "batch_size",
             "max_seq_len", "use_compile")
    return [item for name in names for item in (f"--{name}", str(getattr(args, name)))]


def prepare_loop_data(args: argparse.Namespace, workdir: Path) -> None:
    """data.jsonl (enough full rows for the run) and tokenizer.json (padded to --vocab_size) in `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    write_full_rows(workdir / "data.jsonl", args.batch_size * (args.steps + 2), args.max_seq_len,
                    REPO_ROOT / "model" / "tokenizer.json")
    padded_tokenizer(args.vocab_size, workdir / "tokenizer.json")


def compare_loops(args: argparse.Namespace, workdir: Path, bare: dict, runs: tuple) -> list[dict]:
    """Each (label, save_interval, async_save) of `runs` as a real training run, against the bare step.
    The first run must be the one without saves: its step time prices the others' stall."""
    results = []
    for label, interval, async_save in runs:
        loop = {"measure": "loop", "mode": label, **run_loop(args, workdir, interval, async_save)}
        step_time = results[0]["step_time_s"] if results else loop["step_time_s"]
        loop.update(save_interval=interval if loop["saves"] else None, hidden=args.hidden_size,
                    layers=args.num_hidden_layers, seq=args.max_seq_len, batch=args.batch_size,
                    compile=bool(args.use_compile), bare_tokens_per_s=bare["tokens_per_s"], device=bare["device"],
                    fraction_of_bare_step=round(loop["tokens_per_s"] / bare["tokens_per_s"], 3),
                    # What a save every 100 steps (the trainer's default) costs: its stall over 100 steps' time.
                    blocked_pct_at_default_interval=round(
                        100 * loop["blocked_per_save_s"] / (SAVE_EVERY * step_time), 3) if loop["saves"] else 0.0)
        results.append(loop)
    return results


def run_loop_benchmark(args: argparse.Namespace) -> list[dict]:
    workdir = Path(args.workdir)
    prepare_loop_data(args, workdir)
    return compare_loops(args, workdir, run_benchmark(args), (
        ("no saves", 10**9, 1), ("background saves", args.save_interval, 1),
        ("synchronous saves", args.save_interval, 0)))


def run_suite(args: argparse.Namespace) -> list[dict]:
    """`--suite gpu`: every shape at batch 32, bare step and real loop, eager and compiled (CUDA only)."""
    shapes = TINY_SHAPES if args.tiny else SUITE_SHAPES
    if args.shapes == "minimind":  # its default shape alone: half the suite's time
        shapes = dict(list(shapes.items())[:1])
    # (bare warmup, bare timed steps, loop steps, log interval, save interval, DataLoader workers)
    warmup, steps, loop_steps, log_interval, save_interval, workers = (
        (2, 5, 12, 4, 4, 1) if args.tiny else (10, 50, 300, 50, SAVE_EVERY, 4))
    compiles = (0, 1) if args.device.startswith("cuda") else (0,)
    results = []
    if 1 not in compiles:
        results.append({"measure": "step and loop", "compile": True, "skipped": "compiled runs need CUDA here: "
                        "torch.compile on the CPU needs a C++ compiler and takes minutes per shape"})
        print(json.dumps(results[-1]), flush=True)
    for (hidden, layers, seq), target in shapes.items():
        shape = argparse.Namespace(**{**vars(args), "hidden_size": hidden, "num_hidden_layers": layers,
                                      "max_seq_len": seq, "batch_size": 4 if args.tiny else 32, "warmup": warmup,
                                      "steps": steps, "num_workers": workers, "log_interval": log_interval})
        workdir = Path(args.workdir) / f"{hidden}x{layers}_seq{seq}"
        prepare_loop_data(argparse.Namespace(**{**vars(shape), "steps": loop_steps}), workdir)
        for use_compile in compiles:
            shape.use_compile, shape.steps = use_compile, steps
            bare = {"measure": "step", **run_benchmark(shape), "target_tokens_per_s": target if use_compile else None}
            print(json.dumps(bare), flush=True)
            shape.steps = loop_steps
            loops = compare_loops(shape, workdir, bare, (("no saves", 10**9, 1),
                                                         ("background saves", save_interval, 1)))
            for loop in loops:
                print(json.dumps(loop), flush=True)
            results += [bare, *loops]
    return results


def markdown_table(results: list[dict], peak_flops: float, command: str) -> str:
    """The suite's results as the README's speed table: one row per shape and compile setting."""
    steps = [r for r in results if r.get("measure") == "step"]
    loops = {(r["hidden"], r["layers"], r["seq"], r["compile"], r["mode"]): r
             for r in results if r.get("measure") == "loop"}
    first = steps[0]  # the suite always runs the eager step
    every = next((r["save_interval"] for r in loops.values() if r["save_interval"]), SAVE_EVERY)
    lines = [f"Measured on {first['device']} (torch {torch.__version__}, "
             f"{'fp32' if first['device'] == 'cpu' else 'bf16'}, vocab {first['vocab']}, {first['heads']} heads / "
             f"{first['kv_heads']} KV heads; "
             f"MFU against {peak_flops / 1e12:g} TFLOP/s) with `{command}`:", "",
             "| shape | step | tokens/s | target | MFU | peak memory | loop ÷ bare step, no saves | same, background "
             f"saves every {every} steps | stall per save | stall share, a save every {SAVE_EVERY} steps |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in steps:
        key = (s["hidden"], s["layers"], s["seq"], s["compile"])
        plain, saving = loops.get((*key, "no saves"), {}), loops.get((*key, "background saves"), {})
        target = s.get("target_tokens_per_s")
        verdict = f"≥ {target / 1e3:.0f}k: {'met' if s['tokens_per_s'] >= target else 'not met'}" if target else "–"
        memory = f"{s['peak_mem_GiB']:.1f} GiB" if s["peak_mem_GiB"] is not None else "n/a (CPU)"
        fractions = [f"{r['fraction_of_bare_step']:.2f}" if r else "–" for r in (plain, saving)]
        lines.append(f"| {s['hidden']}×{s['layers']}, seq {s['seq']}, batch {s['batch']} | "
                     f"{'compiled' if s['compile'] else 'eager'} | {s['tokens_per_s'] / 1e3:,.1f}k | {verdict} | "
                     f"{100 * s['mfu']:.1f} % | {memory} | {fractions[0]} | {fractions[1]} | "
                     f"{saving.get('blocked_per_save_s', 0):.2f} s | "
                     f"{saving.get('blocked_pct_at_default_interval', 0):.1f} % |")
    lines += ["", f"Loop ÷ bare step target: ≥ {LOOP_TARGET}. Compiled rows appear only on CUDA."]
    return "\n".join(lines)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark the training step, or the training loop and its saves")
    a = p.add_argument
    a("--mode", choices=("step", "loop"), default="step")
    a("--suite", choices=("gpu",), default=None,
      help="the speed targets' shapes, bare step and real loop, eager and compiled; overrides sizes and steps")
    a("--shapes", choices=("all", "minimind"), default="all",
      help="--suite at both shapes, or at minimind's default shape (768x8, seq 340) alone")
    a("--tiny", action="store_true", help="--suite at a tiny shape and few steps (checks the suite on a CPU)")
    a("--peak_flops", type=float, default=H100_SXM_BF16_FLOPS, help="FLOP/s that MFU is a fraction of")
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
    argv = sys.argv[1:] if argv is None else argv
    args = build_arg_parser().parse_args(argv)
    if args.steps < 1 or args.max_seq_len < 2:
        raise SystemExit("error: --steps must be >= 1 and --max_seq_len >= 2 (a label needs a next token)")
    if args.suite:  # prints each measurement as it is taken: a long suite shows progress
        command = " ".join(["python benchmarks/bench.py", *argv])
        print(markdown_table(run_suite(args), args.peak_flops, command), flush=True)
        return
    results = run_loop_benchmark(args) if args.mode == "loop" else [run_benchmark(args)]
    for result in results:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

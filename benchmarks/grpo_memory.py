"""Peak memory of a GRPO step at minimind's shape and its issue #827's case, phase by phase.

The case (minimind's train_grpo.py defaults then): a 64M model (hidden 768, 8 layers, 8 heads, 4 key/value heads,
vocabulary 6,400), 2 prompts of 768 tokens a micro-batch x 6 completions of 1,024 tokens: 12 rows of 1,792 tokens.
minimind's maintainer measured its step there on a GPU in bfloat16 at about 23.4 GB: 14.8 GB of attention (padding
turns SDPA's fused kernels off, so the [12, 8, 1792, 1792] scores are kept per layer), 4.1 GB of RMSNorm, 3.1 GB of
MLP, 1.3 GB of logits and log_softmax (https://github.com/jingyaogong/minimind/issues/827).

Here each phase runs in its own process, on this project's code:

    rollout  model/rollout.py samples the 12 rows, every row to its 1,024th token (no end-of-text drawn)
    loss     train_grpo.completion_losses on the 12 rows (the policy's forward with its graph, the reference's
             without), the backward and AdamW's step; once per --logps_chunk (0: the whole micro-batch's
             log-softmax at once, as before the chunks)

Reported: the peak memory of the phase above what the process held before it (the policy and its gradients,
AdamW's moments, the reference, the batch): on a GPU torch.cuda.max_memory_allocated in bfloat16 autocast; on the CPU the resident memory sampled every
2 ms, in float32 (twice bfloat16's bytes for every activation).

    python benchmarks/grpo_memory.py                        # on 2 CPU cores: some minutes a phase
    python benchmarks/grpo_memory.py --phases loss --logps_chunk 0 4096 --prompts 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, vocab_size=6400)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """The peak above the memory held at entry: CUDA's allocator's own count, or the CPU's resident memory sampled."""

    def __init__(self, device):
        self.device, self.peak, self.done = device, 0, threading.Event()

    def __enter__(self):
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            self.start = self.peak = resident_bytes()
            self.sampler = threading.Thread(target=self.sample, daemon=True)
            self.sampler.start()
        return self

    def sample(self):
        while not self.done.wait(0.002):
            self.peak = max(self.peak, resident_bytes())

    def __exit__(self, *exc):
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.done.set()
            self.sampler.join()
            self.peak = max(self.peak, resident_bytes())
        self.above = self.peak - self.start


def phase(name: str, chunk: int, args) -> dict:
    """One phase, in this process: its peak above the models' and the batch's memory, and its seconds."""
    sys.path.insert(0, str(REPO))
    import torch
    from model.model import CausalLM, LMConfig
    from model.rollout import rollout
    from trainer.train_grpo import completion_losses
    from trainer.trainer_utils import make_optimizer
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = LMConfig(**SHAPE)
    policy, reference = CausalLM(config).to(device), CausalLM(config).to(device).requires_grad_(False)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else nullcontext()
    rows, width = args.prompts * args.group, args.prompt_len + args.completion_len
    prompts = [torch.randint(1, config.vocab_size, (args.prompt_len,), device=device) for _ in range(args.prompts)]
    input_ids = torch.randint(1, config.vocab_size, (rows, width), device=device)
    labels = input_ids.clone()
    labels[:, :args.prompt_len] = -100  # the prompt trains nothing
    advantages = torch.randn(rows, device=device)
    optimizer = make_optimizer(policy, SimpleNamespace(learning_rate=1e-6, weight_decay=0.0))
    for p in policy.parameters():  # the gradients and AdamW's moments exist before the phase (a run's later steps):
        p.grad = torch.zeros_like(p)  # what the phase adds is the batch's (the flag check counts the model's part)
    optimizer.step()  # zero gradients, no decay: nothing moves
    started = time.time()
    with PeakMemory(device) as memory, autocast:
        if name == "rollout":
            rollout(policy, prompts, args.group, args.completion_len, 1.0, list(range(args.prompts)), eos_id=-1)
        else:
            grpo = SimpleNamespace(beta=0.1, clip_eps=0.2, loss_type="dapo", temperature=1.0, logps_chunk=chunk)
            watch = torch.zeros(2, dtype=torch.float64, device=device)
            losses, aux_loss = completion_losses(policy, reference, input_ids, labels, advantages, grpo, watch)
            (losses.sum() / (labels != -100).sum() + aux_loss).backward()
            optimizer.step()
    return {"phase": name, "logps_chunk": chunk if name == "loss" else None, "device": device.type,
            "rows": rows, "tokens": width, "peak_above_gib": round(memory.above / 2**30, 2),
            "seconds": round(time.time() - started, 1), "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", nargs="+", default=["rollout", "loss"], choices=("rollout", "loss"))
    parser.add_argument("--logps_chunk", type=int, nargs="+", default=[0, 4096], help="0: the whole micro-batch")
    parser.add_argument("--prompts", type=int, default=2, help="prompts a micro-batch (minimind's --batch_size)")
    parser.add_argument("--group", type=int, default=6, help="completions a prompt (--num_generations)")
    parser.add_argument("--prompt_len", type=int, default=768)
    parser.add_argument("--completion_len", type=int, default=1024)
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument("--one", nargs=2, metavar=("PHASE", "CHUNK"), help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(phase(args.one[0], int(args.one[1]), args)))
        return
    shape = ["--prompts", str(args.prompts), "--group", str(args.group), "--prompt_len", str(args.prompt_len),
             "--completion_len", str(args.completion_len)]
    rows = []
    for name in args.phases:
        for chunk in (args.logps_chunk if name == "loss" else [0]):
            child = subprocess.run([sys.executable, __file__, *shape, "--one", name, str(chunk)], check=True,
                                   capture_output=True, text=True)
            rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print("| phase | --logps_chunk | device | rows x tokens | peak above the models | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        chunk = "" if r["logps_chunk"] is None else (r["logps_chunk"] or "0 (whole)")
        print(f"| {r['phase']} | {chunk} | {r['device']} | {r['rows']} x {r['tokens']} | {r['peak_above_gib']} GiB | "
              f"{r['seconds']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

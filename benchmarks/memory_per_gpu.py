"""Training memory per GPU under DDP and FSDP, counted from the tensors each rank holds (no GPU needed).

    torchrun --nproc_per_node 4 benchmarks/memory_per_gpu.py --hidden_size 512 --num_hidden_layers 8
    torchrun --nproc_per_node 4 benchmarks/memory_per_gpu.py --hidden_size 2048 --num_hidden_layers 24 --meta 1

Each rank builds the model as the training scripts do (the project's tokenizer size), sharded with
trainer/hardening/sharding.py for FSDP, then takes one real AdamW step on the CPU and adds up the bytes of what it
holds: weights, gradients and AdamW moments (the local slices of DTensors). With --meta 1 the model lives
on PyTorch's meta device (shapes, no memory) so a model far bigger than this machine can be counted: the
slices are the ones FSDP gives each rank; gradients and moments are counted from them (fp32 gradients the
size of the weights, two fp32 moments), as the real step shows they are. Not counted: activations (they
depend on batch and sequence length, the same in both modes), DDP's gradient buckets (another 4 bytes a
parameter with PyTorch's defaults) and FSDP's transient full copy of the layer being computed (listed).
"""

import argparse
import sys
from argparse import Namespace
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python scripts/x.py): make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from model.model import CausalLM, LMConfig
from model.tokenizer import load_tokenizer
from trainer.hardening.sharding import shard_model
from trainer.hardening.process_exit import cleanup_distributed

GiB = 1024 ** 3


def held_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def account(config: LMConfig, mode: str, meta: bool) -> dict:
    """Bytes this rank holds for weights, gradients and AdamW moments after one step."""
    with torch.device("meta" if meta else "cpu"):
        torch.manual_seed(0)
        model = CausalLM(config)
    if mode == "fsdp":
        model = shard_model(model, torch.device("cpu"), torch.float32, Namespace(save_hf=0, use_compile=0))
    weights = sum(held_bytes(p) for p in model.parameters())
    if meta:  # what the real step below holds: fp32 gradients like the weights, exp_avg and exp_avg_sq
        return {"weights": weights, "gradients": weights, "moments": 2 * weights}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, config.vocab_size, (1, 16))
    model(ids, labels=ids).loss.backward()
    if mode == "ddp" and dist.get_world_size() > 1:  # what DDP's all-reduce does to the gradients
        for p in model.parameters():
            dist.all_reduce(p.grad)
    optimizer.step()
    return {"weights": weights, "gradients": sum(held_bytes(p.grad) for p in model.parameters()),
            "moments": sum(held_bytes(v) for s in optimizer.state.values() for k, v in s.items() if k != "step")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden_size", type=int, default=512)
    parser.add_argument("--num_hidden_layers", type=int, default=8)
    parser.add_argument("--num_attention_heads", type=int, default=8)
    parser.add_argument("--num_key_value_heads", type=int, default=4)
    parser.add_argument("--meta", type=int, default=0, choices=(0, 1), help="1: count shapes only (big models)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    config = LMConfig(vocab_size=load_tokenizer().get_vocab_size(), hidden_size=args.hidden_size,
                      num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
                      num_key_value_heads=args.num_key_value_heads)
    rows = []
    for mode in ("ddp", "fsdp"):
        mine = torch.tensor(list(account(config, mode, bool(args.meta)).values()), dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the fullest rank is the one that runs out
        rows.append((mode, *mine.tolist()))
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in CausalLM(config).to("meta").parameters())
        layer = sum(p.numel() for p in CausalLM(config).to("meta").model.layers[0].parameters())
        world = dist.get_world_size()
        print(f"{args.hidden_size}x{args.num_hidden_layers}: {params / 1e6:.1f}M parameters, {world} ranks "
              f"({'shapes on the meta device' if args.meta else 'one real AdamW step on the CPU'})")
        print("| mode | weights GiB | gradients GiB | AdamW moments GiB | total GiB per GPU |")
        print("|---|---|---|---|---|")
        for mode, weights, gradients, moments in rows:
            print(f"| {mode} | {weights / GiB:.3f} | {gradients / GiB:.3f} | {moments / GiB:.3f} | "
                  f"{(weights + gradients + moments) / GiB:.3f} |")
        print(f"FSDP also holds one layer's full weights while it computes: {2 * layer / GiB:.3f} GiB in bf16 "
              f"(two with prefetching)")
    cleanup_distributed()  # (gloo's threads can abort an interpreter that exits on its own)


if __name__ == "__main__":
    main()

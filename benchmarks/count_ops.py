"""Count the ATen operations one decoder block dispatches: forward + backward under bf16 autocast.

Every kernel launch on a GPU is one dispatched ATen op, and each reads and writes its tensors in
memory, so the count (and the bytes the ops write) says how much work a block does beside its
matrix multiplies. View ops (view, transpose, expand, ...) copy nothing and launch nothing, so
they are not counted.

    python benchmarks/count_ops.py                      # this project's block at 768 hidden, seq 340
    python benchmarks/count_ops.py --by_op              # and the count of each op
    python benchmarks/count_ops.py --batch 2 --seq 64   # smaller tensors, same count

It runs on the CPU: autocast to bfloat16 dispatches the same ops as on CUDA, with two exceptions.
The attention kernel has another name. And `F.rms_norm` is one fused kernel each way on CUDA
(aten::_fused_rms_norm and its backward, when input and weight share a dtype), while this CPU build
has no such kernel and dispatches its decomposition (pow, mean, rsqrt, ...). By default each
rms_norm call counts as the one kernel pair CUDA runs; `--as_dispatched` counts what this build ran.
The bytes are those of every op's outputs, per token per hidden unit.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from model.model import Decoder, DecoderLayer, LMConfig


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it (views left out) and the bytes their outputs hold."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.bytes_written = 0
        self.paused = False  # inside a stand-in for a fused kernel: its parts are not counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # _unsafe_view is a view that autograd does not track as one; detach only drops the graph.
        if not self.paused and not func.is_view and func.overloadpacket.__name__ not in ("_unsafe_view", "detach"):
            self.record(func.overloadpacket.__name__, out)
        return out

    def record(self, name: str, out) -> None:
        self.ops[name] += 1
        self.bytes_written += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                                  if isinstance(t, torch.Tensor))


class FusedRMSNorm(TorchFunctionMode):
    """Counts each F.rms_norm as CUDA runs it: one `_fused_rms_norm` forward, one backward kernel.
    The numbers are still computed, by the decomposition, with the counter paused."""

    def __init__(self, counter: OpCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in (torch.nn.functional.rms_norm, torch.rms_norm):
            return func(*args, **(kwargs or {}))
        counter = self.counter
        call = inspect.signature(torch.nn.functional.rms_norm).bind(*args, **(kwargs or {})).arguments
        shape, eps = call["normalized_shape"], call.get("eps")

        class Kernel(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, weight):
                with torch.enable_grad():
                    x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
                    counter.paused = True
                    out = torch.nn.functional.rms_norm(x_, shape, w_, eps)
                    counter.paused = False
                ctx.graph = (x_, w_, out)
                counter.record("_fused_rms_norm", out)
                return out.detach()

            @staticmethod
            def backward(ctx, grad):
                x_, w_, out = ctx.graph
                counter.paused = True
                grads = torch.autograd.grad(out, (x_, w_), grad)
                counter.paused = False
                counter.record("_fused_rms_norm_backward", grads)
                return grads

        return Kernel.apply(call["input"], call["weight"])


def count_block(config: LMConfig, batch: int, seq: int, dtype: torch.dtype = torch.bfloat16,
                as_dispatched: bool = False) -> OpCounter:
    """Forward and backward of one decoder block on random activations, under autocast to `dtype`."""
    torch.manual_seed(0)
    block = DecoderLayer(config)
    x = torch.randn(batch, seq, config.hidden_size, requires_grad=True)
    tables = Decoder(LMConfig(**{**config.to_dict(), "max_position_embeddings": seq}))
    # The rotary tables as the decoder hands them to every block: sliced and cast once per forward.
    cos, sin = (t[:, None].to(dtype) for t in (tables.rope_cos, tables.rope_signed_sin))
    grad_out = torch.randn(batch, seq, config.hidden_size)  # made outside the count: the next block's gift
    with torch.autocast("cpu", dtype=dtype):  # warm-up: lazily built things (caches) are not counted
        block(x, cos, sin)[0].backward(grad_out)
    counter = OpCounter()
    with counter, nullcontext() if as_dispatched else FusedRMSNorm(counter), torch.autocast("cpu", dtype=dtype):
        block(x, cos, sin)[0].backward(grad_out)
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden_size", type=int, default=768)
    parser.add_argument("--num_attention_heads", type=int, default=8)
    parser.add_argument("--num_key_value_heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=340)
    parser.add_argument("--by_op", action="store_true", help="print the count of each op")
    parser.add_argument("--as_dispatched", action="store_true",
                        help="count rms_norm's decomposition, as this CPU build runs it, not CUDA's fused kernel")
    args = parser.parse_args()
    config = LMConfig(hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                      num_key_value_heads=args.num_key_value_heads, num_hidden_layers=1)
    counter = count_block(config, args.batch, args.seq, as_dispatched=args.as_dispatched)
    tokens = args.batch * args.seq
    counted = "as dispatched on this build" if args.as_dispatched else "rms_norm as CUDA's fused kernel"
    print(f"ops per block (forward + backward, bf16 autocast, views not counted, {counted}): "
          f"{sum(counter.ops.values())}")
    print(f"bytes written per token per hidden unit: {counter.bytes_written / tokens / args.hidden_size:.0f}")
    if args.by_op:
        for name, count in counter.ops.most_common():
            print(f"  {count:4d}  {name}")


if __name__ == "__main__":
    main()

"""Load a checkpoint into a model sharded over this torchrun's ranks, then write what every parameter and
AdamW moment holds, gathered into one `_resume.pth`-shaped file (model, optimizer keyed by parameter number):

    torchrun --nproc_per_node 3 tests/fsdp_worker.py CHECKPOINT OUT.pth [CHECKPOINT OUT.pth ...]

Each CHECKPOINT (a sharded checkpoint's folder or a single `_resume.pth`) is loaded into a fresh model. A test
compares each OUT.pth with its checkpoint: what FSDP holds after loading must be exactly what was saved, on any
rank count.
"""

import sys
from argparse import Namespace
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not tests/, goes first

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from model.model import CausalLM, LMConfig
from trainer.hardening import sharding
from trainer.hardening.checkpoint_io import load_trusted

dist.init_process_group("gloo")
for checkpoint, out in zip(map(Path, sys.argv[1::2]), map(Path, sys.argv[2::2])):
    state = load_trusted(checkpoint)
    model = sharding.shard_model(CausalLM(LMConfig.from_dict(state["lm_config"])), torch.device("cpu"),
                                 torch.float32, Namespace(save_hf=0, use_compile=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.01, fused=True)
    sharding.restore(state, model, optimizer)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=full)
    optim = get_optimizer_state_dict(model, optimizer, options=full)
    if dist.get_rank() == 0:
        number = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        torch.save({"model": weights,
                    "optimizer": {"state": {number[name]: s for name, s in optim["state"].items()},
                                  "param_groups": [{**g, "params": [number[n] for n in g["params"]]}
                                                   for g in optim["param_groups"]]}}, out)
    dist.barrier()
dist.destroy_process_group()

"""FSDP2 (--parallel fsdp): each GPU keeps a slice of the weights, the gradients and the AdamW moments.

How FSDP2 works. DDP keeps all of them whole on every GPU: with AdamW in fp32 that is 16 bytes per
parameter per GPU (weights 4, gradients 4, two moments 8), whatever the GPU count. `fully_shard(module)`
replaces each parameter of `module` by a DTensor, of which every rank keeps 1/world_size (a block of rows).
Just before the module's forward, and again before its backward, the ranks all-gather its full weights
(in bf16 on CUDA: the fp32 slices stay the master weights); right after, the full copy is freed. After
the backward, gradients are reduce-scattered: each rank gets the mean gradient of its own slice only, and
AdamW updates that slice with moments of that slice. So those 16 bytes per parameter are divided by the
GPU count, plus one layer's full weights at a time; the price is an all-gather per layer in forward and
backward instead of one all-reduce. Each decoder layer is sharded on its own, then the root (embedding,
which lm_head shares, and the final norm), so only one layer's full weights exist at a time.

Saving and loading a sharded model: DCP (see sharded_checkpoint.py) writes and reads each rank's slices.
`restore` also loads a single `_resume.pth` into a sharded model (every rank keeps its slice of the full
tensors) and a sharded checkpoint into a plain (DDP) model (consolidated first), so a run can switch.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from trainer.hardening.background_save import finish_saves
from trainer.hardening.checkpoint_io import RunFiles
from trainer.hardening.resume_checks import ConfigError

# FSDP, DTensor and DCP take almost a second to import, in every process: a DDP run never imports them.
# Each function that needs them imports them, from here:


def _fsdp():
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as state_dict
    import torch.distributed.fsdp as fsdp

    from trainer.hardening import sharded_checkpoint
    return fsdp, state_dict, dcp, sharded_checkpoint


def shard_model(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, args) -> torch.nn.Module:
    """Shard `model` (still on the CPU) over all ranks onto `device`: each decoder layer, then the root.
    With --use_compile 1, each layer is compiled first, in place (parameter names stay the same)."""
    if args.save_hf:
        raise ConfigError("--save_hf 1 needs the whole model on rank 0: with --parallel fsdp, export later with "
                          "scripts/consolidate_checkpoint.py and scripts/export_hf.py")
    on_cuda = device.type == "cuda"
    if on_cuda and dtype == torch.float16:
        raise ConfigError("--parallel fsdp trains in bfloat16 or float32: pass --dtype bfloat16 (float16 needs "
                          "a sharded loss scaler, which this trainer does not have yet)")
    if not dist.is_initialized():
        raise ConfigError("--parallel fsdp shards over the ranks torchrun starts: launch with "
                          "torchrun --nproc_per_node N (N may be 1), or train with --parallel ddp")
    fsdp, _, _, _ = _fsdp()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    precision = fsdp.MixedPrecisionPolicy()  # fp32 throughout: on the CPU
    if on_cuda:  # bf16: layers compute with bf16 copies of the gathered weights; gradients are reduced in fp32
        precision = fsdp.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        if args.use_compile:
            layer.compile(backend=args.compile_backend)
        fsdp.fully_shard(layer, mesh=mesh, mp_policy=precision)  # moves the layer to `device`, keeps a slice
    fsdp.fully_shard(model, mesh=mesh, mp_policy=precision)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing was sharded in this process
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


@contextmanager
def no_sync(model: torch.nn.Module) -> Iterator[None]:
    """A micro-step whose gradients are only accumulated, not yet reduced: DDP's no_sync, or FSDP's switch."""
    if not is_sharded(model):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _sharded_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's slices of the weights and AdamW's state, keyed by parameter name (the tied lm_head once:
    as the embedding). On a fresh optimizer, torch first creates its state with a zero-LR step."""
    _, state_dict, _, _ = _fsdp()
    weights = state_dict.get_model_state_dict(model)
    if model.lm_head.weight is model.model.embed_tokens.weight:
        del weights["lm_head.weight"]
    return {"model": weights, "optimizer": state_dict.get_optimizer_state_dict(model, optimizer)["state"]}


def save_sharded(files: RunFiles, state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 out_path: Path, keep_last: int, info: dict, saver, gather_weights: bool) -> Path:
    """lm_checkpoint's save on a sharded model, on every rank: `state` (the `_resume.pth` dict) with its
    model and optimizer written as slices by DCP and the rest once by rank 0 (sharded_checkpoint.py)."""
    _, state_dict, _, sharded_checkpoint = _fsdp()
    finish_saves(saver)  # one save at a time: the last one's thread is done with the save group, on every rank
    del state["model"], state["optimizer"]  # these are sharded: written from _sharded_tensors instead
    tensors = _sharded_tensors(model, optimizer)
    state["optimizer_param_groups"] = state_dict.get_optimizer_state_dict(model, optimizer)["param_groups"]
    weights = None
    if gather_weights:  # collective: every rank sends its slices, rank 0 receives the full CPU tensors
        full = state_dict.StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = state_dict.get_model_state_dict(model, options=full)
        if weights and model.lm_head.weight is model.model.embed_tokens.weight:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # the file holds it once
    return sharded_checkpoint.save(files, info["global_step"], tensors, state, weights, out_path, info, keep_last,
                                   saver.background, saver.run)


def restore(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Weights and AdamW state from `state` (a sharded checkpoint's, or a full `_resume.pth`) into `model`
    (sharded or plain)."""
    _, state_dict, dcp, sharded_checkpoint = _fsdp()
    if not is_sharded(model):  # DDP or one process: the whole state on every rank, as from a `_resume.pth`
        full = sharded_checkpoint.consolidate(Path(state["sharded_dir"]))
        model.load_state_dict(full["model"], strict=True)
        optimizer.load_state_dict(full["optimizer"])
        return
    if "sharded_dir" in state:  # each rank reads the blocks of the files that overlap its own slices
        tensors = _sharded_tensors(model, optimizer)
        dcp.load(tensors, storage_reader=sharded_checkpoint.SafeReader(state["sharded_dir"]))
        weights = tensors["model"]
        if model.lm_head.weight is model.model.embed_tokens.weight:  # the tied head is loaded with the embedding
            weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
        state_dict.set_model_state_dict(model, weights)
        state_dict.set_optimizer_state_dict(model, optimizer, {"state": tensors["optimizer"],
                                                               "param_groups": state["optimizer_param_groups"]})
        return
    # A single `_resume.pth` (from a DDP run): every rank holds the full tensors and keeps its slice. The
    # optimizer's state is keyed by parameter number there; the number is the position in parameters().
    names = [name for name, _ in model.named_parameters()]
    full = state_dict.StateDictOptions(full_state_dict=True)
    state_dict.set_model_state_dict(model, state["model"], options=full)
    saved = state["optimizer"]
    state_dict.set_optimizer_state_dict(model, optimizer, {
        "state": {names[number]: value for number, value in saved["state"].items()},
        "param_groups": [{**group, "params": [names[n] for n in group["params"]]} for group in saved["param_groups"]]},
        options=full)

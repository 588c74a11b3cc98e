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

Saving and loading a sharded model: DCP writes and reads each rank's slices (sharded_checkpoint.py: the folder
and how it is read). `restore` also loads a single `_resume.pth` into a sharded model (every rank keeps its
slice of the full tensors) and a sharded checkpoint into a plain (DDP) model (consolidated first), so a run
can switch.

The save protocol, kill -9-safe like checkpoint_io's: all ranks agree on the step (lm_checkpoint gathers it),
a folder left by a killed save of that step is removed, every rank writes and fsyncs its files (in the
background with --async_save 1, through DCP's own CPU staging) and hashes them; the hashes are gathered and
rank 0 writes the manifest last. A folder without a valid manifest is never loaded (checkpoint_io.verify),
so a kill at any instant leaves the previous checkpoint as the newest. A write that fails on any rank (a
full disk) is one CheckpointError line on every rank, and the half-written folder is removed.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from output_paths import atomic_write, atomic_write_text, fsync_dir
from trainer.hardening.background_save import finish_saves
from trainer.hardening.checkpoint_io import (RunFiles, move_aside, point_resume_at, remove_earlier_manifest,
                                             rotate_after_save, set_aside_unmanaged_resume_file)
from trainer.hardening.out_weights import cast_state_dict, write_out_weights
from trainer.hardening.durable_files import (CheckpointError, manifest_of, manifest_path, one_line, remember_hash,
                                             sha256_of)
from trainer.hardening.resume_checks import ConfigError
from trainer.hardening.run_lock import LockLost, lock_lost, lost_on_another_rank, raise_if_lock_lost

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


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: FSDP's grad norm is a DTensor (the norm of all slices, the same on every rank)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


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
    return _write_sharded(files, info["global_step"], tensors, state, weights, out_path, info, keep_last,
                          saver.background, saver.run)


# ---- the sharded save: every rank its slices, rank 0 the rest and the manifest, last --------------------

_save_group = None


def save_group() -> dist.ProcessGroup:
    """A gloo group of all ranks for the saves' own collectives: a background save talks on it from its
    thread while training talks on the default group (also NCCL's)."""
    global _save_group
    if _save_group is None:
        _save_group = dist.new_group(backend="gloo")
    return _save_group


def _write_sharded(files: RunFiles, step: int, tensors: dict, train_state: dict, weights: dict | None,
                   out_path: Path, info: dict, keep_last: int, background: bool,
                   run: Callable[[Callable[[], None]], None]) -> Path:
    """Every rank: write this rank's slices of `tensors` into the history folder of `step`; rank 0 also
    `train_state`, the FP16 `weights` into `out_path` (when gathered) and, last, the manifest. The files are
    written through `run` (the saver: now, or in its thread after DCP's staging). Returns the folder."""
    _, _, dcp, sharded_checkpoint = _fsdp()
    group, rank = save_group(), dist.get_rank()
    directory = files.history_dir / f"step_{step:08d}.dcp"
    if rank == 0:
        files.history_dir.mkdir(parents=True, exist_ok=True)
        _clear_for_save(files, directory)
    dist.barrier(group=group)
    writer = sharded_checkpoint.checked_writer(directory, raise_if_lock_lost)  # fsyncs; the folder: below
    if background:  # DCP copies the tensors to CPU memory now and writes them from its own thread
        try:
            write_slices = dcp.async_save(tensors, storage_writer=writer, process_group=group).result
        except (Exception, dcp.CheckpointException) as error:  # the copy failed; DCP's error is not an Exception
            raise CheckpointError(f"could not copy the sharded checkpoint of step {step} to CPU memory: "
                                  f"{one_line(error)}; nothing was written") from error
    else:  # written in _seal, where a failure (a full disk) is gathered and reported like any other
        write_slices = lambda: dcp.save(tensors, storage_writer=writer, process_group=group)  # noqa: E731
    train_state_file = directory / sharded_checkpoint.TRAIN_STATE
    run(lambda: _seal(files, directory, write_slices, train_state, train_state_file, weights, out_path, info,
                      keep_last, group))
    return directory


def _clear_for_save(files: RunFiles, directory: Path) -> None:
    """Rank 0, before a save of this step: a folder without a manifest is a killed save's, removed; one with
    a manifest (saved before, then resumed from an older checkpoint) is moved aside, never deleted."""
    if not directory.exists():
        return
    if manifest_of(directory).is_file():
        print(f"{directory} exists from an earlier save of this step: moved to {move_aside(files, directory)}",
              flush=True)
    else:
        shutil.rmtree(directory)


def _seal(files: RunFiles, directory: Path, write_slices: Callable[[], object], train_state: dict,
          train_state_file: Path, weights: dict | None, out_path: Path, info: dict, keep_last: int, group) -> None:
    """Each rank: write (or wait for) its DCP files, hash them; rank 0 writes the rest, then the manifest, and
    rotates. If any rank failed, every rank raises the same one-line CheckpointError and the folder is removed."""
    _, _, dcp, _ = _fsdp()
    rank, mine, problem = dist.get_rank(), {}, None
    try:
        write_slices()  # this rank's .distcp files are written and fsynced; rank 0's .metadata too
        names = [p.name for p in directory.glob(f"__{rank}_*.distcp")] + ([".metadata"] if rank == 0 else [])
        if rank == 0:
            atomic_write(train_state_file, lambda f: torch.save(train_state, f), raise_if_lock_lost)
            names.append(train_state_file.name)
            if weights is not None:
                write_out_weights(out_path, cast_state_dict(weights, torch.float16), train_state.get("train_args", {}),
                                  raise_if_lock_lost)
        fsync_dir(directory)  # the names of this rank's files are durable too
        mine = {name: {"size": (directory / name).stat().st_size, "sha256": sha256_of(directory / name)}
                for name in names}
    except LockLost:  # from a check right before a commit: the gather below says it to every rank
        problem = None
    except (Exception, dcp.CheckpointException) as error:  # every rank must reach the gather below, or the
        # others would wait on it. DCP's CheckpointException names the rank that failed; it reaches every rank.
        problem = one_line(error) if isinstance(error, dcp.CheckpointException) else f"rank {rank}: {one_line(error)}"
    # Whether this rank still holds the directory goes into the gather, so every rank that reaches it stops alike.
    # A rank whose peer will not come (stopped, or its writer stuck) is not waited for: the lost lock is seen by
    # every training thread, which then stops waiting for this one (BackgroundSaver.wait).
    lost = lock_lost(read=problem is not None)  # a failure may be the new holder's cleanup: read the file
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (mine, problem, lost is not None), group=group)
    lost_on = [r for r, (_, _, lost_there) in enumerate(everyone) if lost_there]
    if lost_on:  # the folder may be the new holder's by now: not ours to remove or to finish
        raise lost or lost_on_another_rank(lost_on[0])
    problems = list(dict.fromkeys(p for _, p, _ in everyone if p))  # DCP's failure: the same line from every rank
    if problems:
        if rank == 0:  # a half-written folder: its space back (a full disk), and a save of this step finds none
            shutil.rmtree(directory, ignore_errors=True)
        raise CheckpointError(f"could not write sharded checkpoint {directory}: {'; '.join(problems)}. Older "
                              f"checkpoints in {files.history_dir} are untouched; free space or fix the cause, then "
                              f"resume with --from_resume 1")
    if rank != 0:
        return
    try:
        listed = {name: entry for files_of_rank, _, _ in everyone for name, entry in files_of_rank.items()}
        for name, entry in listed.items():  # the other ranks' hashes: rotation need not read their files here
            remember_hash(directory / name, entry["sha256"])
        manifest = {"file": directory.name, "format": "dcp", "torch": torch.__version__,
                    "world_size": len(everyone), "step": info["global_step"], **info, "files": listed}
        atomic_write_text(manifest_path(directory), json.dumps(manifest, indent=1) + "\n", raise_if_lock_lost)  # last
        remove_earlier_manifest(directory)
        aside = set_aside_unmanaged_resume_file(files)
        if aside is not None:
            print(f"kept {files.resume_link.name}, which this project's checkpoints do not account for, as {aside}",
                  flush=True)
        point_resume_at(files, directory, raise_if_lock_lost)
    except OSError as error:
        raise CheckpointError(f"could not write the manifest of {directory}: {error}. Older checkpoints in "
                              f"{files.history_dir} are untouched; free space or fix permissions, then resume "
                              f"with --from_resume 1") from error
    raise_if_lock_lost()  # rotation deletes: not in a directory that is another run's now
    rotate_after_save(files, keep_last, directory)


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
        try:  # seldom fails: rank 0 read every tensor when it chose this checkpoint (checkpoint_io.load_to_resume)
            dcp.load(tensors, storage_reader=sharded_checkpoint.SafeReader(state["sharded_dir"]))
        except (Exception, dcp.CheckpointException) as error:  # DCP's error reaches every rank
            raise CheckpointError(f"{state['sharded_dir']} could not be loaded ({one_line(error)}); resume from an "
                                  f"older checkpoint with --resume_path") from error
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

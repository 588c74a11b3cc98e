"""Sharded checkpoints (--parallel fsdp): every rank writes its own slices, in the kill -9-safe protocol.

How DCP (torch.distributed.checkpoint) works: `dcp.save(tensors)` runs on every rank. The ranks agree on
a plan (each rank writes the slices it holds of each DTensor; a tensor every rank holds whole is written
once), each writes `__{rank}_{i}.distcp`, and rank 0 then writes `.metadata`: for every tensor, its full
shape and which byte range of which file holds which block of it. `dcp.load(template)` reads that map,
and each rank reads just the blocks that overlap the slices it holds now. That is why a checkpoint of 2
ranks loads on 3 or on 1: no file is keyed by the world size that wrote it.

One folder per save, in the history folder of checkpoint_io.py, beside single-file checkpoints:

    R_history/step_00000300.dcp/   __0_0.distcp  __1_0.distcp  .metadata   weights and AdamW moments (DCP)
                                   train_state.pth                         the rest: cursor, epoch, every
                                        rank's RNG, config, data fingerprint, guard memory, tracker ids, the
                                        optimizer's settings; plain values, loadable with weights_only=True
    R_history/step_00000300.json   manifest: size and SHA-256 of every file above, the torch version

The protocol: all ranks agree on the step (lm_checkpoint gathers it), a folder left by a killed save of
that step is removed, every rank writes and fsyncs its files (in the background with --async_save 1,
through DCP's own CPU staging) and hashes them; the hashes are gathered and rank 0 writes the manifest
last. A folder without a valid manifest is never loaded (checkpoint_io.verify), so a kill at any instant
leaves the previous checkpoint as the newest. Fallback, rotation, keep-last and the lock are checkpoint_io's.

A manifest is integrity, not trust. DCP reads `.metadata` with pickle.load and non-tensor entries with
torch.load(weights_only=False): a planted file would run code. Here `.metadata` goes through an unpickler
that admits DCP's metadata classes and plain values only, and a checkpoint with non-tensor entries is
refused (this project writes none: what is not a tensor goes to train_state.pth).
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from trainer.hardening import checkpoint_io as cio
from trainer.hardening.checkpoint_io import CheckpointError, RunFiles

TRAIN_STATE = "train_state.pth"


# ---- reading: a restricted unpickler for .metadata, a reader that uses it, the folder check ---------

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata types, torch dtypes and plain values; anything else (a function that would run)
    is refused before it is looked up."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a type of DCP's metadata")


def read_metadata(directory: Path) -> Metadata:
    """The `.metadata` of a sharded checkpoint, read safely; raises CheckpointError on anything else."""
    path = Path(directory) / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as error:
        raise CheckpointError(f"{path} is refused: {error} (only DCP's own metadata types are read; "
                              f"nothing in it is run)") from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    pickled = [key for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, BytesStorageMetadata)]
    if pickled:  # DCP would torch.load them with weights_only=False; this project never writes any
        raise CheckpointError(f"{path} is refused: it has non-tensor entries ({', '.join(pickled[:3])}), which "
                              f"loading would unpickle")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by read_metadata above."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def verify_folder(directory: Path, manifest: dict, cached: bool) -> str | None:
    """None if the folder holds exactly the manifest's files with their sizes and SHA-256, else what is wrong."""
    expected = manifest.get("files")
    if not isinstance(expected, dict) or ".metadata" not in expected or TRAIN_STATE not in expected:
        return "manifest lists no sharded checkpoint files"
    present = {p.name for p in directory.iterdir()}
    if set(expected) - present:
        return f"missing {', '.join(sorted(set(expected) - present))}"
    if present - set(expected):
        return f"files the manifest does not list: {', '.join(sorted(present - set(expected)))}"
    for name, entry in sorted(expected.items()):
        actual = (directory / name).stat().st_size
        if actual != entry["size"]:
            return f"{name} is {actual} bytes, manifest says {entry['size']} (truncated?)"
        if cio.sha256_of(directory / name, cached) != entry["sha256"]:
            return f"SHA-256 of {name} does not match the manifest (corrupted bytes)"
    return None


def load_train_state(directory: Path) -> dict:
    """What is not tensors (weights_only=True), after checking that `.metadata` is safe to read; the tensors
    are loaded into the model later (sharding.restore), from `state["sharded_dir"]`."""
    read_metadata(directory)
    state = cio.load_trusted(directory / TRAIN_STATE)
    state["sharded_dir"] = str(directory)
    return state


def consolidate(directory: Path) -> dict:
    """A sharded checkpoint as one `_resume.pth` state, without a process group: full weights (the head
    tied to the embedding again) and the optimizer state keyed by parameter number, as optimizer.state_dict()."""
    directory = Path(directory)
    state = load_train_state(directory)
    template = {"model": {}, "optimizer": {}}
    for key, entry in read_metadata(directory).state_dict_metadata.items():  # DCP's keys: nested keys joined by "."
        empty = torch.empty(entry.size, dtype=entry.properties.dtype)
        part, rest = key.split(".", 1)
        if part == "model":
            template["model"][rest] = empty
        else:  # "optimizer.{parameter name}.{exp_avg, exp_avg_sq or step}"
            name, field = rest.rsplit(".", 1)
            template["optimizer"].setdefault(name, {})[field] = empty
    dcp.load(template, storage_reader=SafeReader(directory), no_dist=True)
    weights = template["model"]
    if state["lm_config"].get("tie_word_embeddings", True):  # saved once, as the embedding
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # one tensor, as in the model
    groups = state.pop("optimizer_param_groups")
    number = {name: i for i, name in enumerate(name for group in groups for name in group["params"])}
    state["optimizer"] = {"state": {number[name]: s for name, s in template["optimizer"].items()},
                          "param_groups": [{**g, "params": [number[n] for n in g["params"]]} for g in groups]}
    state["model"] = weights
    del state["sharded_dir"]
    return state


# ---- writing ------------------------------------------------------------------------------------

_save_group = None


def save_group() -> dist.ProcessGroup:
    """A gloo group of all ranks for the saves' own collectives: a background save talks on it from its
    thread while training talks on the default group (also NCCL's)."""
    global _save_group
    if _save_group is None:
        _save_group = dist.new_group(backend="gloo")
    return _save_group


def save(files: RunFiles, step: int, tensors: dict, train_state: dict, weights: dict | None, out_path: Path,
         info: dict, keep_last: int, background: bool, run: Callable[[Callable[[], None]], None]) -> Path:
    """Every rank: write this rank's slices of `tensors` into the history folder of `step`; rank 0 also
    `train_state`, the FP16 `weights` into `out_path` (when gathered) and, last, the manifest. The files are
    written through `run` (the saver: now, or in its thread after DCP's staging). Returns the folder."""
    group, rank = save_group(), dist.get_rank()
    directory = files.history_dir / f"step_{step:08d}.dcp"
    if rank == 0:
        files.history_dir.mkdir(parents=True, exist_ok=True)
        _clear_for_save(files, directory)
    dist.barrier(group=group)
    writer = FileSystemWriter(directory, sync_files=True)  # fsync of every file; the folder's own below
    if background:  # DCP copies the tensors to CPU memory now and writes them from its own thread
        written = dcp.async_save(tensors, storage_writer=writer, process_group=group)
        wait = written.result
    else:
        dcp.save(tensors, storage_writer=writer, process_group=group)
        wait = lambda: None  # noqa: E731
    run(lambda: _seal(files, directory, wait, train_state, weights, out_path, info, keep_last, group))
    return directory


def _clear_for_save(files: RunFiles, directory: Path) -> None:
    """Rank 0, before a save of this step: a folder without a manifest is a killed save's, removed; one with
    a manifest (saved before, then resumed from an older checkpoint) is moved aside, never deleted."""
    if not directory.exists():
        return
    if cio.manifest_path(directory).is_file():
        print(f"{directory} exists from an earlier save of this step: moved to {cio.move_aside(files, directory)}",
              flush=True)
    else:
        shutil.rmtree(directory)


def _seal(files: RunFiles, directory: Path, wait: Callable[[], object], train_state: dict, weights: dict | None,
          out_path: Path, info: dict, keep_last: int, group) -> None:
    """Each rank: wait for its DCP files, hash them; rank 0 writes the rest, then the manifest, and rotates."""
    rank, mine, problem = dist.get_rank(), {}, None
    try:
        wait()  # this rank's .distcp files are written and fsynced; rank 0's .metadata too
        names = [p.name for p in directory.glob(f"__{rank}_*.distcp")] + ([".metadata"] if rank == 0 else [])
        if rank == 0:
            cio.atomic_write(directory / TRAIN_STATE, lambda f: torch.save(train_state, f))
            names.append(TRAIN_STATE)
            if weights is not None:
                out_path.parent.mkdir(parents=True, exist_ok=True)
                cio.atomic_write(out_path, lambda f: torch.save(cio.cast_state_dict(weights, torch.float16), f))
        cio.fsync_dir(directory)  # the names of this rank's files are durable too
        mine = {name: {"size": (directory / name).stat().st_size, "sha256": cio.sha256_of(directory / name)}
                for name in names}
    except Exception as error:  # every rank must reach the gather below, or the others would wait on it
        problem = f"rank {rank}: {type(error).__name__}: {error}"
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (mine, problem), group=group)
    problems = [p for _, p in everyone if p]
    if problems:
        raise CheckpointError(f"could not write sharded checkpoint {directory}: {'; '.join(problems)}. Older "
                              f"checkpoints in {files.history_dir} are untouched; fix the cause, then resume "
                              f"with --from_resume 1")
    if rank != 0:
        return
    try:
        listed = {name: entry for files_of_rank, _ in everyone for name, entry in files_of_rank.items()}
        for name, entry in listed.items():  # the other ranks' hashes: rotation need not read their files here
            cio.remember_hash(directory / name, entry["sha256"])
        manifest = {"file": directory.name, "format": "dcp", "torch": torch.__version__,
                    "world_size": len(everyone), "step": info["global_step"], **info, "files": listed}
        cio.atomic_write_text(cio.manifest_path(directory), json.dumps(manifest, indent=1) + "\n")  # last
        aside = cio.set_aside_unmanaged_resume_file(files)
        if aside is not None:
            print(f"kept {files.resume_link.name}, which this project's checkpoints do not account for, as {aside}",
                  flush=True)
        cio.point_resume_at(files, directory)
    except OSError as error:
        raise CheckpointError(f"could not write the manifest of {directory}: {error}. Older checkpoints in "
                              f"{files.history_dir} are untouched; free space or fix permissions, then resume "
                              f"with --from_resume 1") from error
    try:
        cio.rotate(files, keep_last, directory)
    except OSError as error:
        raise CheckpointError(f"checkpoint {directory} is saved and verified, but older ones in "
                              f"{files.history_dir} could not be deleted or moved aside: {error}") from error

"""Sharded checkpoints (--parallel fsdp) on disk: the folder, its manifest check, and reading it safely.

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
    R_history/step_00000300.dcp.json   manifest: size and SHA-256 of every file above, the torch version

sharding.py writes the folder, in the kill -9-safe protocol (the manifest last); a folder without a valid
manifest is never loaded (checkpoint_io.verify, which calls verify_folder here). Fallback, rotation,
keep-last and the lock are checkpoint_io's. This module builds on durable_files.py only.

A manifest is integrity, not trust. DCP reads `.metadata` with pickle.load and non-tensor entries with
torch.load(weights_only=False): a planted file would run code. Here `.metadata` goes through an unpickler
that admits DCP's metadata classes and plain values only, and a checkpoint with non-tensor entries is
refused (this project writes none: what is not a tensor goes to train_state.pth).
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from trainer.hardening.durable_files import CheckpointError, load_file_trusted, one_line, sha256_of

TRAIN_STATE = "train_state.pth"


# ---- a restricted unpickler for .metadata, a reader that uses it, the folder check -------------------

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


class _CheckedFileSystem(FileSystem):
    """DCP's file system, calling `before_write` before it creates a file or renames one."""

    def __init__(self, before_write: Callable[[], None]):
        super().__init__()
        self.before_write = before_write

    def create_stream(self, path, mode):
        if "r" not in mode:
            self.before_write()
        return super().create_stream(path, mode)

    def rename(self, path, new_path) -> None:
        self.before_write()
        super().rename(path, new_path)


def checked_writer(directory: Path, before_write: Callable[[], None]) -> FileSystemWriter:
    """DCP's writer of `directory` (with fsync) that calls `before_write` before each file it creates or renames: a
    run that lost its directory lock (run_lock.py) raises there, and DCP writes no file into another run's folder."""
    writer = FileSystemWriter(directory, sync_files=True)
    writer.fs = _CheckedFileSystem(before_write)
    return writer


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
        if sha256_of(directory / name, cached) != entry["sha256"]:
            return f"SHA-256 of {name} does not match the manifest (corrupted bytes)"
    return None


def load_train_state(directory: Path) -> dict:
    """What is not tensors (weights_only=True), after checking that `.metadata` is safe to read; the tensors
    are loaded into the model later (sharding.restore), from `state["sharded_dir"]`."""
    read_metadata(directory)
    state = load_file_trusted(directory / TRAIN_STATE)
    state["sharded_dir"] = str(directory)
    return state


def read_every_tensor(directory: Path, batch_bytes: int = 1 << 28) -> None:
    """Read every tensor of the checkpoint once, in this one process, about `batch_bytes` at a time, as the ranks
    will when they load their slices. A `.distcp` damaged under a manifest that matches it (forged, or written
    by a faulty disk or copy) raises CheckpointError here, while an older checkpoint can still be chosen; in
    every rank's load it could only stop the run. The price is one more read of the files, as for a `.pth`."""
    batch, size = {}, 0
    for key, entry in read_metadata(directory).state_dict_metadata.items():
        batch[key] = torch.empty(entry.size, dtype=entry.properties.dtype)  # DCP's flat key: "model.{name}"...
        size += batch[key].nbytes
        if size >= batch_bytes:
            read_into(directory, batch)
            batch, size = {}, 0
    if batch:
        read_into(directory, batch)


def read_into(directory: Path, tensors: dict) -> None:
    """dcp.load of `tensors` (full-size templates) from the checkpoint, here, without a process group; a file
    that cannot be read is one CheckpointError naming the first thing wrong."""
    try:
        dcp.load(tensors, storage_reader=SafeReader(directory), no_dist=True)
    except (Exception, CheckpointException) as error:  # DCP's CheckpointException is not an Exception
        raise CheckpointError(f"{directory} cannot be loaded: a shard is damaged or unreadable "
                              f"({one_line(error)})") from error


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
    read_into(directory, template)
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

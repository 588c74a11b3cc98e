"""A `_resume.pth` the user brings (copied from another machine, or minimind's) is used or refused, never lost.

Such a file has no manifest: nothing in the checkpoint directory accounts for it. With
`--from_resume 1` it is loaded with `weights_only=True` and resumed from; our first save then
keeps the user's bytes under another name instead of replacing them. A file that would run code
when unpickled is refused before anything in it runs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from conftest import read_trace, train
from trainer.hardening.checkpoint_io import RunFiles, is_managed

RUN = "pretrain_32"


def job_args(run_dir: Path, data: Path, *extra: str) -> list[str]:
    return ["--data_path", str(data), "--save_dir", str(run_dir / "out"), "--checkpoint_dir", str(run_dir / "ckpt"),
            "--save_debug_train_output", str(run_dir / "trace.jsonl"), "--batch_size", "2", "--log_interval", "1",
            "--save_interval", "1000", *extra]


def plant(run_dir: Path, write) -> Path:
    """A lone `{run}_resume.pth` in an otherwise empty checkpoint directory."""
    path = run_dir / "ckpt" / f"{RUN}_resume.pth"
    path.parent.mkdir(parents=True)
    write(path)
    return path


def kept_copies(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "ckpt").glob(f"{RUN}_resume.unmanaged_*.pth"))


def test_a_lone_resume_file_of_this_project_is_resumed_with_a_note_and_kept(tmp_path, pretrain_data):
    source = tmp_path / "elsewhere"
    train("train_pretrain.py", None, job_args(source, pretrain_data, "--max_steps", "4"), tmp_path)
    brought = tmp_path / "brought"
    planted = plant(brought, lambda path: shutil.copyfile(RunFiles(source / "ckpt", RUN).resume_link, path))
    original_bytes = planted.read_bytes()

    result = train("train_pretrain.py", None, job_args(brought, pretrain_data, "--max_steps", "2", "--from_resume",
                                                          "1"), tmp_path)
    assert "has no manifest, so its bytes could not be checksum-verified" in result.stdout
    assert [r["step"] for r in read_trace(brought / "trace.jsonl")] == [5, 6]  # continued, not restarted
    [kept] = kept_copies(brought)
    assert kept.read_bytes() == original_bytes
    files = RunFiles(brought / "ckpt", RUN)
    assert is_managed(files, files.resume_link)  # the name now holds this run's own verified checkpoint
    resumed = torch.load(files.resume_link, map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 6 and resumed["samples_consumed"] == 12


def test_a_minimind_resume_file_restores_weights_optimizer_and_position_and_says_what_it_could_not(
        tmp_path, pretrain_data):
    source = tmp_path / "elsewhere"
    train("train_pretrain.py", None, job_args(source, pretrain_data, "--max_steps", "3"), tmp_path)
    ours = torch.load(RunFiles(source / "ckpt", RUN).resume_link, map_location="cpu", weights_only=True)
    # minimind's lm_checkpoint: fp16 weights, the optimizer, epoch, step (micro-batches per rank), world size.
    minimind = {"model": {k: v.half() for k, v in ours["model"].items()}, "optimizer": ours["optimizer"],
                "epoch": 0, "step": 3, "world_size": 2, "wandb_id": "mm-run-7"}
    brought = tmp_path / "brought"
    planted = plant(brought, lambda path: torch.save(minimind, path))
    original_bytes = planted.read_bytes()

    result = train("train_pretrain.py", None, job_args(brought, pretrain_data, "--max_steps", "1", "--from_resume",
                                                          "1"), tmp_path)
    assert "is a minimind resume file" in result.stdout and "Not restored: the exact sample cursor" in result.stdout
    # Its step counted in this run's global batch: 12 samples at 2 a step.
    assert ("saved at step 6: training continues from sample 12 of epoch 1 (world size 2 -> 1; the count only: "
            "minimind's order differs, RNG reseeded)" in result.stdout)
    resumed = torch.load(RunFiles(brought / "ckpt", RUN).resume_link, map_location="cpu", weights_only=True)
    # 3 micro-batches x batch 2 x 2 ranks = 12 samples consumed, then one step of 2.
    assert resumed["epoch"] == 0 and resumed["samples_consumed"] == 14
    steps_before = [int(s["step"]) for s in ours["optimizer"]["state"].values()]
    steps_after = [int(s["step"]) for s in resumed["optimizer"]["state"].values()]
    assert steps_after == [s + 1 for s in steps_before]  # the optimizer's moments continued
    [kept] = kept_copies(brought)
    assert kept.read_bytes() == original_bytes


class RunsCodeWhenUnpickled:
    """Unpickling this calls os.system; a `weights_only=True` load must refuse it before that."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_lone_resume_file_that_would_run_code_is_refused_and_nothing_runs(tmp_path, pretrain_data):
    marker = tmp_path / "code_ran"
    brought = tmp_path / "brought"
    planted = plant(brought, lambda path: torch.save({"model": RunsCodeWhenUnpickled(marker)}, path))
    original_bytes = planted.read_bytes()
    result = train("train_pretrain.py", None, job_args(brought, pretrain_data, "--max_steps", "1", "--from_resume",
                                                          "1"), tmp_path, check=False)
    assert result.returncode == 2
    assert "is refused: it holds objects other than tensors and plain types" in result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists(), "unpickling ran code"
    assert planted.read_bytes() == original_bytes and not kept_copies(brought)

"""--parallel fsdp: FSDP2 training and sharded checkpoints, with real torchrun/gloo processes on the CPU.

What is proven: the same losses as DDP; a bit-identical resume on the same rank count; a checkpoint of 2
ranks loaded on 3 holds exactly what was saved, and a run resumed on 3 then 1 trains each sample once with
a continuous LR; a `_resume.pth` loads into FSDP and a sharded checkpoint into DDP; the files are verified,
fall back, rotate and refuse a planted `.metadata`; the consolidation script gives the run's own FP16 file.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import (FAULT_INJECTION_DIR, PRETRAIN_RUN, REPO, Lines, assert_each_sample_once, assert_states_equal,
                      child_env, events_of, free_port, metrics_of, resume_file, run_args, slice_jsonl, trace_of, train)
from scripts import consolidate_checkpoint
from trainer.hardening import checkpoint_io as cio
from trainer.hardening.checkpoint_io import CheckpointError, RunFiles
from trainer.hardening.sharded_checkpoint import consolidate, read_metadata
from trainer.trainer_utils import get_lr

FSDP = ["--parallel", "fsdp"]
WEIGHTS_AND_OPTIMIZER = ("model", "optimizer")


def history(run_dir: Path) -> Path:
    return run_dir / "ckpt" / f"{PRETRAIN_RUN}_history"


def newest_state(run_dir: Path) -> dict:
    """The newest checkpoint of the run as one `_resume.pth` state, whether it is sharded or not."""
    latest = run_dir / "ckpt" / (run_dir / "ckpt" / f"{PRETRAIN_RUN}_latest.txt").read_text().strip()
    return consolidate(latest) if latest.suffix == ".dcp" else torch.load(latest, weights_only=True)


def loaded_on_fsdp(checkpoints: list[Path], nproc: int, tmp_path: Path) -> list[dict]:
    """What a model sharded over `nproc` ranks holds after loading each checkpoint (tests/fsdp_worker.py)."""
    outs = [tmp_path / f"loaded_{i}.pth" for i in range(len(checkpoints))]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), str(REPO / "tests" / "fsdp_worker.py"),
               *(str(path) for pair in zip(checkpoints, outs) for path in pair)]
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    return [torch.load(out, weights_only=True) for out in outs]


def by_step(trace: list[dict], field: str) -> dict[int, float]:
    return {r["step"]: r[field] for r in trace if r["rank"] == 0}


def assert_lr_follows_the_data_position(trace: list[dict], num_samples: int, epochs: int) -> None:
    """Each step's LR is the schedule's value at the position its window reaches, whatever the rank count."""
    position, lrs = 0, by_step(trace, "lr")
    for step in sorted(lrs):
        position += sum(len(r["samples"]) for r in trace if r["step"] == step)
        assert lrs[step] == pytest.approx(get_lr(position / (epochs * num_samples), 5e-4, 0.01), rel=1e-12), step


def test_fsdp_gives_ddp_losses_and_resumes_bit_identically(tmp_path, pretrain_data):
    # 37 samples, 1 x 2 ranks x 2 accumulation = 4 a step: 10 steps an epoch, 20 in two, the last one short.
    # A low clip keeps clipping active, so the sharded norm is checked too.
    common = ["--batch_size", "1", "--accumulation_steps", "2", "--epochs", "2", "--grad_clip", "0.5"]
    runs = {name: tmp_path / name for name in ("ddp", "fsdp", "split")}
    train("train_pretrain.py", 2, run_args(runs["ddp"], pretrain_data, *common), tmp_path)
    train("train_pretrain.py", 2, run_args(runs["fsdp"], pretrain_data, *common, *FSDP), tmp_path)
    train("train_pretrain.py", 2, run_args(runs["split"], pretrain_data, *common, *FSDP, "--max_steps", "9",
                                           "--async_save", "0", "--gather_weights", "0"), tmp_path)
    assert not (runs["split"] / "out" / f"{PRETRAIN_RUN}.pth").exists()  # not gathered, as asked
    train("train_pretrain.py", 2, run_args(runs["split"], pretrain_data, *common, *FSDP, "--from_resume", "1"),
          tmp_path)

    ddp, fsdp = trace_of(runs["ddp"]), trace_of(runs["fsdp"])
    assert sorted(by_step(fsdp, "loss")) == list(range(1, 21))
    for field in ("global_loss", "grad_norm"):
        for step, value in by_step(ddp, field).items():
            assert by_step(fsdp, field)[step] == pytest.approx(value, rel=1e-5), (field, step)
    for name, tensor in resume_file(runs["ddp"])["model"].items():  # and where the weights end up
        assert torch.allclose(newest_state(runs["fsdp"])["model"][name], tensor, rtol=1e-4, atol=1e-6), name

    # Same rank count: the resumed run continues exactly, to the bit.
    assert by_step(trace_of(runs["split"]), "global_loss") == by_step(fsdp, "global_loss")
    assert events_of(runs["split"]) == [("resume", 9)]
    assert_states_equal(newest_state(runs["split"]), newest_state(runs["fsdp"]))


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="about 110 s on two CPU cores (9 sharded runs); set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")
def test_checkpoints_reshard_two_three_one_and_switch_between_ddp_and_fsdp_exactly(tmp_path, pretrain_data):
    common = run_args(tmp_path, pretrain_data, "--batch_size", "2", "--epochs", "2", *FSDP)
    train("train_pretrain.py", 2, [*common, "--max_steps", "5"], tmp_path)
    saved = history(tmp_path) / "step_00000005.dcp"
    manifest = json.loads(cio.manifest_path(saved).read_text())
    assert set(manifest["files"]) == {p.name for p in saved.iterdir()} == {
        "__0_0.distcp", "__1_0.distcp", ".metadata", "train_state.pth"}
    assert manifest["torch"] == torch.__version__ and manifest["world_size"] == 2
    shutil.copytree(tmp_path / "ckpt", tmp_path / "to_ddp" / "ckpt")  # the same checkpoint, resumed by DDP below
    to_fsdp = run_args(tmp_path / "to_fsdp", pretrain_data, "--batch_size", "2", "--epochs", "1")
    train("train_pretrain.py", 2, [*to_fsdp, "--max_steps", "4"], tmp_path)  # DDP: a single _resume.pth
    single = tmp_path / "to_fsdp" / "ckpt" / f"{PRETRAIN_RUN}_resume.pth"

    # Loaded on 3 ranks (a vocabulary that 3 does not divide), FSDP holds exactly what 2 ranks saved: the
    # sharded folder, and the DDP run's single file.
    from_folder, from_file = loaded_on_fsdp([saved, single], 3, tmp_path)
    assert_states_equal(from_folder, consolidate(saved), WEIGHTS_AND_OPTIMIZER)
    assert_states_equal(from_file, torch.load(single, weights_only=True), WEIGHTS_AND_OPTIMIZER)

    # FSDP 2 -> 3 -> 1 ranks.
    on_three = train("train_pretrain.py", 3, [*common, "--max_steps", "5", "--from_resume", "1"], tmp_path)
    assert ("saved at step 5: training continues from sample 20 of epoch 1 (world size 2 -> 3, global batch 4 -> 6: "
            "the steps left are counted in the new global batch; the exact data position," in on_three.stdout)
    on_one = train("train_pretrain.py", 1, [*common, "--from_resume", "1"], tmp_path)
    assert ("saved at step 10: training continues from sample 12 of epoch 2 (world size 3 -> 1, global batch 6 -> 2: "
            "the steps left are counted in the new global batch; the exact data position," in on_one.stdout)
    trace = trace_of(tmp_path)
    sizes = {r["step"]: r["world_size"] for r in trace}
    assert sizes == {s: 2 if s <= 5 else 3 if s <= 10 else 1 for s in range(1, 24)}
    assert_each_sample_once(trace, num_samples=37, epochs=2)
    assert_lr_follows_the_data_position(trace, num_samples=37, epochs=2)
    final = newest_state(tmp_path)
    assert (final["epoch"], final["samples_consumed"], final["global_step"]) == (2, 0, 23)

    # DDP on 2 ranks -> FSDP on 3: the single `_resume.pth` is sliced into the shards.
    train("train_pretrain.py", 3, [*to_fsdp, *FSDP, "--from_resume", "1"], tmp_path)
    assert_each_sample_once(trace_of(tmp_path / "to_fsdp"), num_samples=37, epochs=1)
    assert not single.exists()  # the newest checkpoint is a folder now; the link to the older file is gone
    assert sorted(p.name for p in history(tmp_path / "to_fsdp").iterdir()) == [
        "step_00000004.pth", "step_00000004.pth.json", "step_00000008.dcp", "step_00000008.dcp.json"]  # 16 + 3 x 6 + 3

    # FSDP on 2 ranks -> DDP on 3: the shards are put together on every rank.
    to_ddp = run_args(tmp_path / "to_ddp", pretrain_data, "--batch_size", "2", "--epochs", "2")
    (tmp_path / "to_ddp" / "trace.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in trace if r["step"] <= 5))  # the trace of the steps it resumes after
    resumed = train("train_pretrain.py", 3, [*to_ddp, "--from_resume", "1"], tmp_path)
    assert "step_00000005.dcp saved at step 5: training continues from sample 20 of epoch 1 (world size 2 -> 3," in (
        resumed.stdout)
    assert_each_sample_once(trace_of(tmp_path / "to_ddp"), num_samples=37, epochs=2)
    assert resume_file(tmp_path / "to_ddp")["global_step"] == 5 + 3 + 7  # 17 left in epoch 1, 37 in 2: steps of 6
    assert (tmp_path / "to_ddp" / "out" / f"{PRETRAIN_RUN}.pth").is_file()


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="about 40 s on two CPU cores; set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")
def test_one_step_saved_by_ddp_then_fsdp_then_ddp_keeps_a_manifest_each_and_the_newest_loads(tmp_path,
                                                                                             pretrain_data):
    files = RunFiles(tmp_path / "ckpt", PRETRAIN_RUN)
    args = run_args(tmp_path, pretrain_data, "--batch_size", "2", "--epochs", "1", "--save_interval", "2",
                    "--keep_last", "3")
    train("train_pretrain.py", 2, [*args, "--max_steps", "4"], tmp_path)  # DDP: steps 2 and 4, as files
    # Resumed from a copy of step 2 kept elsewhere: nothing in the history is set aside, so each run below
    # saves step 4 again beside the earlier ones (a step_4.json of the earlier name would have been shared).
    older = tmp_path / "kept" / "step_00000002.pth"
    older.parent.mkdir()
    for path in (files.history_file(2), cio.manifest_path(files.history_file(2))):
        shutil.copy(path, older.parent / path.name)
    for parallel, saved in (("fsdp", "step_00000004.dcp"), ("ddp", "step_00000004.pth")):
        train("train_pretrain.py", 2, [*args, "--parallel", parallel, "--resume_path", str(older), "--max_steps",
                                       "2"], tmp_path)
        assert {p.name for p in files.history()} == {"step_00000002.pth", "step_00000004.pth", "step_00000004.dcp"}
        for path in files.history():
            assert cio.manifest_of(path) == cio.manifest_path(path) and cio.verify(path) is None, path
        assert json.loads(cio.manifest_path(files.history_dir / saved).read_text())["file"] == saved
        assert files.history()[0].name == saved  # the step saved last is the newest; resume takes it
        state = cio.load_newest(files, None, Lines())
        assert state["resumed_from"] == str(files.history_dir / saved) and state["global_step"] == 4
    assert not list(files.history_dir.glob("step_*[0-9].json"))  # no manifest of the earlier, shared name


# ---- the files of a sharded checkpoint, made once by a real 2-rank run ------------------------------

@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """A 2-rank FSDP run of 6 steps saving every 2 in the background (kept: steps 2, 4 and 6). Step 3's loss is
    made NaN: the run rolls back to step 2 and leaves that window out. 5 validation samples, 3 on rank 0."""
    run_dir = tmp_path_factory.mktemp("sharded")
    data = slice_jsonl(REPO / "dataset" / "pretrain_demo.jsonl", run_dir / "pretrain.jsonl", 37)
    val = slice_jsonl(REPO / "dataset" / "val_demo.jsonl", run_dir / "val.jsonl", 5)
    train("train_pretrain.py", 2, run_args(run_dir, data, "--batch_size", "2", *FSDP, "--max_steps", "6",
                                           "--save_interval", "2", "--keep_last", "3", "--val_data", str(val),
                                           "--eval_interval", "2", "--debug_inject", "nan:3",
                                           "--on_anomaly", "rollback"), run_dir)
    return run_dir


@pytest.fixture
def run_copy(sharded_run, tmp_path) -> Path:
    shutil.copytree(sharded_run, tmp_path / "run")
    return tmp_path / "run"


def test_a_sharded_run_rolls_back_to_its_checkpoint_and_validates_on_uneven_shares(sharded_run):
    assert events_of(sharded_run) == [("anomaly", 3), ("rollback", 2)]
    trace = trace_of(sharded_run)
    assert not any(r.get("skipped") for r in trace)  # step 3's window left out, not trained at LR 0
    assert newest_state(sharded_run)["anomaly"]["left_out"] == [[0, 8, 12]]  # step 3's: 8-11 of the epoch's order
    validations = [r["step"] for r in metrics_of(sharded_run) if "val/loss" in r]
    assert validations == [2, 4, 6]


def test_sharded_checkpoints_rotate_and_the_newest_is_named_by_the_latest_pointer(run_copy):
    names = sorted(p.name for p in history(run_copy).iterdir())
    assert names == [f"step_0000000{s}.{kind}" for s in (2, 4, 6) for kind in ("dcp", "dcp.json")]
    assert (run_copy / "ckpt" / f"{PRETRAIN_RUN}_latest.txt").read_text() == \
        f"{PRETRAIN_RUN}_history/step_00000006.dcp\n"
    assert not (run_copy / "ckpt" / f"{PRETRAIN_RUN}_resume.pth").exists()
    for step in (2, 4, 6):
        assert cio.verify(history(run_copy) / f"step_0000000{step}.dcp") is None
    # What a save with --keep_last 2 does after writing step 6: the oldest folder goes, with its manifest.
    removed = cio.rotate(RunFiles(run_copy / "ckpt", PRETRAIN_RUN), 2, history(run_copy) / "step_00000006.dcp")
    assert removed == [history(run_copy) / "step_00000002.dcp"]
    assert sorted(p.name for p in history(run_copy).iterdir()) == names[2:]


def test_a_damaged_shard_or_a_missing_manifest_falls_back_to_the_older_checkpoint(run_copy):
    files, log = RunFiles(run_copy / "ckpt", PRETRAIN_RUN), Lines()
    shard = history(run_copy) / "step_00000006.dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    cio.manifest_path(history(run_copy) / "step_00000004.dcp").unlink()  # as if killed before its manifest
    state = cio.load_newest(files, None, log)
    assert state["global_step"] == 2 and state["sharded_dir"].endswith("step_00000002.dcp")
    assert any("SHA-256 of __1_0.distcp does not match" in line for line in log)
    assert (files.failed_dir / "step_00000006.dcp").is_dir()  # moved aside with its manifest, not deleted
    assert not (history(run_copy) / "step_00000004.dcp").exists()  # never a checkpoint: its space given back
    assert (run_copy / "ckpt" / f"{PRETRAIN_RUN}_latest.txt").read_text().strip().endswith("step_00000002.dcp")


def forge_manifest(folder: Path) -> None:
    """Rewrite the manifest of a sharded checkpoint to match its files as they are now: integrity passes."""
    manifest_file = cio.manifest_path(folder)
    manifest = json.loads(manifest_file.read_text())
    manifest["files"] = {name: {"size": (folder / name).stat().st_size, "sha256": cio.sha256_of(folder / name)}
                         for name in manifest["files"]}
    manifest_file.write_text(json.dumps(manifest))


def test_a_damaged_shard_under_a_forged_manifest_is_set_aside_and_the_run_resumes_from_the_older_one(run_copy):
    newest = history(run_copy) / "step_00000006.dcp"
    shard = newest / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2] + bytes(len(data) - len(data) // 2))  # the second half zeroed
    forge_manifest(newest)
    assert cio.verify(newest) is None  # the manifest check cannot see it: loading does

    resumed = train("train_pretrain.py", 2, run_args(run_copy, run_copy / "pretrain.jsonl", "--batch_size", "2",
                                                     *FSDP, "--from_resume", "1", "--max_steps", "1"), run_copy)
    skipped = [line for line in resumed.stdout.splitlines() if line.startswith("skipping checkpoint")]
    assert len(skipped) == 1 and f"{newest} cannot be loaded: a shard is damaged or unreadable (" in skipped[0]
    assert f"moved it to {RunFiles(run_copy / 'ckpt', PRETRAIN_RUN).failed_dir / newest.name}" in skipped[0]
    assert f"using older checkpoint {history(run_copy) / 'step_00000004.dcp'} instead" in resumed.stdout
    assert events_of(run_copy)[-1] == ("resume", 4)
    newest_now = RunFiles(run_copy / "ckpt", PRETRAIN_RUN).history()[0]
    assert newest_now.name == "step_00000005.dcp" and cio.verify(newest_now) is None


@pytest.mark.parametrize("async_save", ["1", "0"], ids=["background_save", "synchronous_save"])
def test_a_full_disk_during_a_sharded_save_is_one_line_on_every_rank_and_the_previous_checkpoint_stays(
        tmp_path, pretrain_data, async_save):
    files = RunFiles(tmp_path / "ckpt", PRETRAIN_RUN)
    args = run_args(tmp_path, pretrain_data, "--batch_size", "2", *FSDP, "--save_interval", "2", "--max_steps", "6",
                    "--async_save", async_save)
    # tests/fault_injection: rank 1's writes of step 4's .distcp files fail with ENOSPC, as on a full disk.
    result = train("train_pretrain.py", 2, args, tmp_path, check=False, PYTHONPATH=FAULT_INJECTION_DIR,
                   FAULT_DISK_FULL_AT_STEP=4, FAULT_DISK_FULL_RANK=1)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "(exitcode: 2)" in result.stderr, output[-4000:]  # torchrun's 1; the ranks' 2
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-4000:]
    assert errors[0].startswith(f"error: could not write sharded checkpoint {files.history_dir / 'step_00000004.dcp'}"
                                f": rank 1: OSError: [Errno 28] No space left on device (injected). Older "
                                f"checkpoints in {files.history_dir} are untouched"), errors[0]
    quoted = output.count(f"traceback : {errors[0]}")  # torchrun's summary quotes the line for each rank
    assert quoted == 2 and output.count("No space left on device") == 1 + quoted  # no Python traceback says it
    assert [p.name for p in files.history()] == ["step_00000002.dcp"]  # the half-written step 4 is gone
    assert cio.verify(files.history()[0]) is None
    assert files.latest_pointer.read_text().strip() == f"{files.history_dir.name}/step_00000002.dcp"


class RunsCode:
    """A pickle that would create a file when unpickled by a plain pickle.load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_metadata_under_a_forged_manifest_is_refused_without_running_it(run_copy):
    newest, marker = history(run_copy) / "step_00000006.dcp", run_copy / "code_ran"
    (newest / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    manifest_file = cio.manifest_path(newest)
    manifest = json.loads(manifest_file.read_text())  # forged: the manifest says the planted file is right
    manifest["files"][".metadata"] = {"size": (newest / ".metadata").stat().st_size,
                                      "sha256": cio.sha256_of(newest / ".metadata")}
    manifest_file.write_text(json.dumps(manifest))
    assert cio.verify(newest) is None

    with pytest.raises(CheckpointError, match=r"posix\.system is not a type of DCP's metadata|nothing in it is run"):
        consolidate(newest)
    log = Lines()
    state = cio.load_newest(RunFiles(run_copy / "ckpt", PRETRAIN_RUN), None, log)
    assert state["global_step"] == 4  # the planted one is moved aside; the older one is used
    assert any("step_00000006.dcp" in line and "is refused" in line for line in log)
    assert not marker.exists()


def test_a_checkpoint_with_pickled_non_tensor_entries_is_refused(tmp_path):
    folder = tmp_path / "step_00000001.dcp"
    dcp.save({"model": {"w": torch.ones(2)}, "note": {"any": "object"}}, checkpoint_id=folder, no_dist=True)
    with pytest.raises(CheckpointError, match="non-tensor entries"):
        read_metadata(folder)


def test_consolidation_writes_the_runs_own_fp16_file_and_a_resume_file(sharded_run, tmp_path, capsys):
    newest = history(sharded_run) / "step_00000006.dcp"
    out, resume = tmp_path / "weights.pth", tmp_path / "from_fsdp_resume.pth"
    command = [str(newest), "--out", str(out), "--resume_out", str(resume)]
    assert consolidate_checkpoint.main(command) == 0
    written = torch.load(out, weights_only=True)
    gathered = torch.load(sharded_run / "out" / f"{PRETRAIN_RUN}.pth", weights_only=True)  # rank 0's, at step 6
    assert written.keys() == gathered.keys()
    assert all(torch.equal(written[k], gathered[k]) and written[k].dtype == torch.float16 for k in written)
    assert written["lm_head.weight"].data_ptr() == written["model.embed_tokens.weight"].data_ptr()  # tied
    assert cio.verify(resume) is None
    assert_states_equal(torch.load(resume, weights_only=True), consolidate(newest))

    assert consolidate_checkpoint.main(command) == 2
    assert "exists; it is left as it is" in capsys.readouterr().err


def test_fsdp_refuses_what_it_cannot_do_with_one_line_each():
    from argparse import Namespace

    from model.model import CausalLM, LMConfig
    from trainer.hardening.resume_checks import ConfigError
    from trainer.hardening.sharding import shard_model
    model = CausalLM(LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2))
    flags = Namespace(save_hf=0, use_compile=0)
    with pytest.raises(ConfigError, match="--save_hf 1 needs the whole model on rank 0"):
        shard_model(model, torch.device("cpu"), torch.float32, Namespace(save_hf=1, use_compile=0))
    with pytest.raises(ConfigError, match="pass --dtype bfloat16"):
        shard_model(model, torch.device("cuda"), torch.float16, flags)  # refused before anything touches a GPU
    with pytest.raises(ConfigError, match="launch with torchrun --nproc_per_node N"):
        shard_model(model, torch.device("cpu"), torch.float32, flags)  # no process group: plain `python`

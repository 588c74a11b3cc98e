"""Resume that loses nothing, proven with real torchrun/gloo processes on the CPU."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time

import pytest
import torch

from conftest import TINY_MODEL, child_env, launch_command, read_trace, slowed_env, train


def run_args(tmp_path, data, trace, *extra) -> list[str]:
    return ["--data_path", str(data), "--save_dir", str(tmp_path / "out"), "--checkpoint_dir",
            str(tmp_path / "ckpt"), "--save_debug_train_output", str(trace), "--log_interval", "1",
            "--save_interval", "1000", *extra]


def resume_file(tmp_path, name="pretrain_32") -> dict:
    return torch.load(tmp_path / "ckpt" / f"{name}_resume.pth", weights_only=True)


def losses_by_step(trace: list[dict]) -> dict[int, list[float]]:
    by_step = collections.defaultdict(list)
    for record in sorted(trace, key=lambda r: (r["step"], r["rank"])):
        by_step[record["step"]].append(record["loss"])
    return dict(by_step)


def samples_per_epoch(trace: list[dict]) -> dict[int, collections.Counter]:
    seen = collections.defaultdict(collections.Counter)
    for record in trace:
        seen[record["epoch"]].update(record["samples"])
    return seen


def assert_states_equal(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), f"model tensor {key} differs"
    for pa, pb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        for key in pa:
            assert torch.equal(torch.as_tensor(pa[key]), torch.as_tensor(pb[key])), f"optimizer {key} differs"
    assert a["samples_consumed"] == b["samples_consumed"] and a["epoch"] == b["epoch"]


@pytest.mark.parametrize("script,data_fixture,name", [
    ("train_pretrain.py", "pretrain_data", "pretrain_32"),
    ("train_full_sft.py", "sft_data", "full_sft_32"),
])
def test_resume_on_same_world_size_is_bit_identical(tmp_path, request, script, data_fixture, name):
    data = request.getfixturevalue(data_fixture)
    common = ["--batch_size", "2", "--accumulation_steps", "2", "--epochs", "1", "--from_weight", "none"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(script, 2, run_args(straight, data, straight / "trace.jsonl", *common, "--max_steps", "7"), tmp_path)
    train(script, 2, run_args(split, data, split / "trace.jsonl", *common, "--max_steps", "3"), tmp_path)
    result = train(script, 2, run_args(split, data, split / "trace.jsonl", *common, "--max_steps", "4",
                                       "--from_resume", "1"), tmp_path)
    assert "resuming at sample 24 of epoch 1 (exact" in result.stdout
    assert_states_equal(resume_file(straight, name), resume_file(split, name))
    assert losses_by_step(read_trace(straight / "trace.jsonl")) == losses_by_step(read_trace(split / "trace.jsonl"))


def test_resume_on_two_then_three_then_one_rank_trains_each_sample_once(tmp_path, pretrain_data):
    # 37 samples, batch 2: global batches 4, 6 and 2; stops mid-epoch and across the epoch boundary.
    trace = tmp_path / "trace.jsonl"
    common = ["--batch_size", "2", "--epochs", "2"]
    train("train_pretrain.py", 2, run_args(tmp_path, pretrain_data, trace, *common, "--max_steps", "5"), tmp_path)
    result = train("train_pretrain.py", 3, run_args(tmp_path, pretrain_data, trace, *common, "--max_steps", "5",
                                                     "--from_resume", "1"), tmp_path)
    assert "world size 2 -> 3" in result.stdout and "resuming at sample 20 of epoch 1" in result.stdout
    result = train("train_pretrain.py", None, run_args(tmp_path, pretrain_data, trace, *common,
                                                        "--from_resume", "1"), tmp_path)
    assert "world size 3 -> 1" in result.stdout and "resuming at sample 12 of epoch 2" in result.stdout
    seen = samples_per_epoch(read_trace(trace))
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == list(range(37)), f"epoch {epoch} missed samples"
        assert set(seen[epoch].values()) == {1}, f"epoch {epoch} repeated samples"
    final = resume_file(tmp_path)
    assert (final["epoch"], final["samples_consumed"]) == (2, 0)


def test_fixed_global_batch_gives_same_loss_curve_on_two_and_four_ranks(tmp_path, pretrain_data):
    common = ["--batch_size", "1", "--global_batch_size", "8", "--epochs", "1"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train("train_pretrain.py", 2, run_args(straight, pretrain_data, straight / "t.jsonl", *common), tmp_path)
    train("train_pretrain.py", 2, run_args(split, pretrain_data, split / "t.jsonl", *common, "--max_steps", "2"),
          tmp_path)
    result = train("train_pretrain.py", 4, run_args(split, pretrain_data, split / "t.jsonl", *common,
                                                    "--from_resume", "1"), tmp_path)
    assert "global batch 8 kept" in result.stdout

    def global_losses(trace):
        sums, tokens = collections.Counter(), collections.Counter()
        for r in read_trace(trace):
            sums[r["step"]] += r["loss_sum"]
            tokens[r["step"]] += r["local_tokens"]
        return [sums[s] / tokens[s] for s in sorted(sums)]

    a, b = global_losses(straight / "t.jsonl"), global_losses(split / "t.jsonl")
    assert len(a) == len(b) == 5
    assert a[:2] == b[:2]  # same ranks, same order: identical before the switch
    # After the switch only the summation order differs: float32 reduction noise (measured ~1e-7).
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_python_and_torchrun_one_rank_use_the_same_sample_order(tmp_path, pretrain_data):
    common = ["--batch_size", "4", "--epochs", "1", "--max_steps", "6"]
    train("train_pretrain.py", None, run_args(tmp_path / "py", pretrain_data, tmp_path / "py.jsonl", *common), tmp_path)
    train("train_pretrain.py", 1, run_args(tmp_path / "tr", pretrain_data, tmp_path / "tr.jsonl", *common), tmp_path)
    py, tr = read_trace(tmp_path / "py.jsonl"), read_trace(tmp_path / "tr.jsonl")
    assert [r["samples"] for r in py] == [r["samples"] for r in tr]
    assert [r["loss"] for r in py] == [r["loss"] for r in tr]


def test_sigterm_saves_exits_zero_and_resume_keeps_each_sample_once(tmp_path, pretrain_data):
    trace = tmp_path / "trace.jsonl"
    args = run_args(tmp_path, pretrain_data, trace, "--batch_size", "1", "--epochs", "1")
    launcher = subprocess.Popen(launch_command("train_pretrain.py", 2, [*TINY_MODEL, *args]), cwd=tmp_path,
                                env=slowed_env(step_delay_s=0.2), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while (not trace.exists() or len(read_trace(trace)) < 6) and time.time() < deadline:
        time.sleep(0.2)
    workers = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                                    text=True).stdout.split()]
    assert len(workers) == 2, "expected two worker processes under torchrun"
    for pid in workers:  # a preempted cloud machine signals every training process
        os.kill(pid, signal.SIGTERM)
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, output
    assert "SIGTERM" in output and "--from_resume 1" in output
    stopped_at = resume_file(tmp_path)["global_step"]
    assert 3 <= stopped_at < 18
    train("train_pretrain.py", 2, [*args, "--from_resume", "1"], tmp_path)
    seen = samples_per_epoch(read_trace(trace))[0]
    assert sorted(seen) == list(range(37)) and set(seen.values()) == {1}


@pytest.mark.parametrize("flag,value,field", [
    ("--hidden_size", "64", "model.hidden_size"),
    ("--batch_size", "3", "args.batch_size"),
    ("--data_path", None, "data.lines"),
])
def test_resume_refuses_a_changed_setting_naming_the_field(tmp_path, pretrain_data, flag, value, field):
    args = run_args(tmp_path, pretrain_data, tmp_path / "t.jsonl", "--batch_size", "2", "--max_steps", "2")
    train("train_pretrain.py", None, args, tmp_path)
    if flag == "--data_path":
        other = tmp_path / "other.jsonl"
        other.write_text("\n".join(pretrain_data.read_text().splitlines()[:20]) + "\n")
        value = str(other)
    changed = [*args, flag, value, "--from_resume", "1"]
    if flag == "--hidden_size":  # a new hidden size is another run name: point it at the old file
        changed += ["--resume_path", str(tmp_path / "ckpt" / "pretrain_32_history" / "step_00000002.pth")]
    result = train("train_pretrain.py", None, changed, tmp_path, check=False)
    assert result.returncode != 0
    assert field in result.stderr and "cannot resume" in result.stderr


def test_from_resume_with_nothing_to_resume_says_so_and_starts_fresh(tmp_path, pretrain_data):
    args = run_args(tmp_path, pretrain_data, tmp_path / "t.jsonl", "--max_steps", "1", "--from_resume", "1")
    result = train("train_pretrain.py", None, args, tmp_path)
    assert "no checkpoint of pretrain_32" in result.stdout and "starting fresh" in result.stdout
    assert resume_file(tmp_path)["global_step"] == 1

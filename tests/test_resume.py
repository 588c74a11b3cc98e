"""Resume that loses nothing, proven with real torchrun/gloo processes on the CPU.

Each test reads what the runs left on disk: the resume files (weights, optimizer, RNG, cursor),
the trace (which samples each rank trained at each step, on which world size) and the metrics
file (where a resume happened).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time

import pytest
import torch

from conftest import (assert_each_sample_once, assert_states_equal, child_pids, events_of, history_file,
                      launch_command, read_trace, resume_file, run_args, slowed_env, status_of, trace_of, train,
                      with_loader_workers)
from benchmarks.soak_kill import how_it_resumed
from model.model import CausalLM, LMConfig
from trainer.hardening.resume_checks import gpu_count_rule


def losses_by_step(trace: list[dict]) -> dict[int, list[float]]:
    by_step = collections.defaultdict(list)
    for record in sorted(trace, key=lambda r: (r["step"], r["rank"])):
        by_step[record["step"]].append(record["loss"])
    return dict(by_step)


def world_size_by_step(trace: list[dict]) -> dict[int, int]:
    return {r["step"]: r["world_size"] for r in trace}


def small_training_state() -> dict:
    """A resume-like state of a real model after one AdamW step."""
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": None,
            "rng": [{"torch": torch.get_rng_state()}], "epoch": 0, "step": 1, "global_step": 1, "samples_consumed": 2}


def test_state_comparison_catches_a_truncated_optimizer_state():
    state = small_training_state()
    assert_states_equal(state, small_training_state())  # the same seed gives the same state, bit for bit

    truncated = small_training_state()
    del truncated["optimizer"]["state"][max(truncated["optimizer"]["state"])]  # the last parameter's moments
    with pytest.raises(AssertionError, match=r"optimizer\.state: keys differ"):
        assert_states_equal(state, truncated)

    fewer_params = small_training_state()
    fewer_params["optimizer"]["param_groups"][0]["params"].pop()
    with pytest.raises(AssertionError, match=r"optimizer\.param_groups\[0\]\.params: length"):
        assert_states_equal(state, fewer_params)

    no_rank = small_training_state()
    no_rank["rng"] = []
    with pytest.raises(AssertionError, match=r"rng: length 1 vs 0"):
        assert_states_equal(state, no_rank)


@pytest.mark.parametrize("script,data_fixture,name", [
    ("train_pretrain.py", "pretrain_data", "pretrain_32"),
    ("train_full_sft.py", "sft_data", "full_sft_32"),
])
def test_resume_on_same_world_size_is_bit_identical(tmp_path, request, script, data_fixture, name):
    data = request.getfixturevalue(data_fixture)
    common = ["--batch_size", "2", "--accumulation_steps", "2", "--epochs", "1", "--from_weight", "none"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(script, 2, run_args(straight, data, *common, "--max_steps", "7"), tmp_path)
    train(script, 2, run_args(split, data, *common, "--max_steps", "3"), tmp_path)
    train(script, 2, run_args(split, data, *common, "--max_steps", "4", "--from_resume", "1"), tmp_path)

    # The second invocation started from step 3, i.e. sample 3 x 8 = 24 of the epoch.
    assert events_of(split, name) == [("resume", 3)]
    assert history_file(split, 3, name)["samples_consumed"] == 24
    assert_states_equal(resume_file(straight, name), resume_file(split, name))
    assert losses_by_step(trace_of(straight)) == losses_by_step(trace_of(split))
    step_ranks = [(r["step"], r["rank"]) for r in trace_of(split)]
    assert len(step_ranks) == len(set(step_ranks)), "a step was trained twice"


def test_resume_on_two_then_three_then_one_rank_trains_each_sample_once(tmp_path, pretrain_data):
    # 37 samples, batch 2: global batches 4, 6 and 2; stops mid-epoch and across the epoch boundary.
    common = run_args(tmp_path, pretrain_data, "--batch_size", "2", "--epochs", "2")
    train("train_pretrain.py", 2, [*common, "--max_steps", "5"], tmp_path)
    first = resume_file(tmp_path)
    assert (first["world_size"], first["epoch"], first["samples_consumed"]) == (2, 0, 20)  # 5 steps x 4
    on_three = train("train_pretrain.py", 3, [*common, "--max_steps", "5", "--from_resume", "1"], tmp_path)
    # One step numbering: the checkpoint's global step, then the data position and what changed.
    assert ("saved at step 5: training continues from sample 20 of epoch 1 (world size 2 -> 3, global batch 4 -> 6: "
            "the steps left are counted in the new global batch; the exact data position, RNG reseeded for the new "
            "world size)"
            in on_three.stdout)
    assert how_it_resumed(on_three.stdout) == ("step 5", False)  # what the soak reads from the line
    second = resume_file(tmp_path)
    # From sample 20: 17 left in epoch 0 (steps of 6, 6, 5), then 2 steps of 6 into epoch 1.
    assert (second["world_size"], second["epoch"], second["samples_consumed"]) == (3, 1, 12)
    on_one = train("train_pretrain.py", None, [*common, "--from_resume", "1"], tmp_path)
    assert ("saved at step 10: training continues from sample 12 of epoch 2 (world size 3 -> 1, global batch 6 -> 2: "
            "the steps left are counted in the new global batch; the exact data position," in on_one.stdout)

    trace = trace_of(tmp_path)
    sizes = world_size_by_step(trace)
    last_step = max(sizes)
    assert sizes == {s: 2 if s <= 5 else 3 if s <= 10 else 1 for s in range(1, last_step + 1)}
    assert last_step == 10 + 13  # 25 samples left in epoch 1 at 2 per step
    assert_each_sample_once(trace, num_samples=37, epochs=2)
    final = resume_file(tmp_path)
    assert (final["epoch"], final["samples_consumed"], final["global_step"]) == (2, 0, last_step)


def test_one_micro_batch_of_eight_and_eight_of_one_take_the_same_steps(tmp_path, pretrain_data):
    # One process, the global batch 8 taken whole or as 8 accumulated micro-batches of 1 sample: the loss is
    # divided by the tokens of the whole global batch, so the gradient is the same either way. The epoch's last
    # window holds 5 samples (37 = 4 x 8 + 5); the samples hold different numbers of tokens.
    whole, split = tmp_path / "whole", tmp_path / "split"
    train("train_pretrain.py", None, run_args(whole, pretrain_data, "--batch_size", "8", "--epochs", "1"), tmp_path)
    train("train_pretrain.py", None, run_args(split, pretrain_data, "--batch_size", "1", "--accumulation_steps", "8",
                                              "--epochs", "1"), tmp_path)
    norms = [[r["grad_norm"] for r in sorted(trace_of(run), key=lambda r: r["step"])] for run in (whole, split)]
    assert len(norms[0]) == len(norms[1]) == 5
    # Only the summation order differs (float32 noise); a loss averaged per micro-batch misses by 1 % at step 2.
    assert max(abs(x - y) / x for x, y in zip(*norms)) < 1e-5, norms


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="about 40 s on two CPU cores (6 ranks in all); set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")
def test_fixed_global_batch_gives_same_loss_curve_on_two_and_four_ranks(tmp_path, pretrain_data):
    common = ["--batch_size", "1", "--global_batch_size", "8", "--epochs", "1"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train("train_pretrain.py", 2, run_args(straight, pretrain_data, *common), tmp_path)
    train("train_pretrain.py", 2, run_args(split, pretrain_data, *common, "--max_steps", "2"), tmp_path)
    train("train_pretrain.py", 4, run_args(split, pretrain_data, *common, "--from_resume", "1"), tmp_path)
    # The resumed run kept G = 8 by deriving accumulation 8 / (1 x 4) = 2 (it was 4 on 2 ranks).
    saved = resume_file(split)["train_args"]
    assert (saved["global_batch_size"], saved["world_size"], saved["accumulation_steps"]) == (8, 4, 2)
    assert world_size_by_step(trace_of(split)) == {1: 2, 2: 2, 3: 4, 4: 4, 5: 4}

    def global_losses(trace):
        sums, tokens = collections.Counter(), collections.Counter()
        for r in trace:
            sums[r["step"]] += r["loss_sum"]
            tokens[r["step"]] += r["local_tokens"]
        return [sums[s] / tokens[s] for s in sorted(sums)]

    def grad_norms(trace):  # the global norm, the same on every rank
        return [r["grad_norm"] for r in sorted(trace, key=lambda r: r["step"]) if r["rank"] == 0]

    a, b = global_losses(trace_of(straight)), global_losses(trace_of(split))
    assert len(a) == len(b) == 5
    assert a[:2] == b[:2]  # same ranks, same order: identical before the switch
    # After the switch only the summation order differs: float32 reduction noise (measured ~1e-7).
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    # The gradient itself, which the losses barely show over 5 small steps: its norm agrees to float32
    # noise (measured equal). A loss normalised per rank moves it by 2e-4 (step 3) to 0.8 % (step 5);
    # one normalised per micro-batch by 25 % at step 5, the epoch's short last window.
    norms_a, norms_b = grad_norms(trace_of(straight)), grad_norms(trace_of(split))
    assert len(norms_a) == len(norms_b) == 5
    assert max(abs(x - y) / x for x, y in zip(norms_a, norms_b)) < 1e-5, (norms_a, norms_b)


def test_python_and_torchrun_one_rank_use_the_same_sample_order(tmp_path, pretrain_data):
    common = ["--batch_size", "4", "--epochs", "1", "--max_steps", "6"]
    train("train_pretrain.py", None, run_args(tmp_path / "py", pretrain_data, *common), tmp_path)
    train("train_pretrain.py", 1, run_args(tmp_path / "tr", pretrain_data, *common), tmp_path)
    py, tr = trace_of(tmp_path / "py"), trace_of(tmp_path / "tr")
    assert len(py) == len(tr) == 6
    assert [r["samples"] for r in py] == [r["samples"] for r in tr]
    assert [r["loss"] for r in py] == [r["loss"] for r in tr]


def test_sigterm_saves_exits_zero_and_resume_keeps_each_sample_once(tmp_path, pretrain_data):
    args = run_args(tmp_path, pretrain_data, "--batch_size", "1", "--epochs", "1")
    trace = tmp_path / "trace.jsonl"
    launcher = subprocess.Popen(launch_command("train_pretrain.py", 2, [*with_loader_workers(1), *args]), cwd=tmp_path,
                                env=slowed_env(step_delay_s=0.2), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while (not trace.exists() or len(read_trace(trace)) < 6) and time.time() < deadline:
        time.sleep(0.2)
    workers = child_pids(launcher.pid)
    assert len(workers) == 2, "expected two worker processes under torchrun"
    loaders = [pid for worker in workers for pid in child_pids(worker)]
    assert len(loaders) == 2, "expected a DataLoader worker under each rank"
    for pid in workers + loaders:  # a preempted cloud machine signals every training process
        os.kill(pid, signal.SIGTERM)
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, output
    assert "(SIGTERM)" in output  # only the log says why it stopped
    stopped_at = resume_file(tmp_path)["global_step"]
    assert 3 <= stopped_at < 18  # signalled after 3 steps at the earliest, long before the end (18 steps)
    status = status_of(tmp_path)
    assert (status["status"], status["current_step"]) == ("stopped", stopped_at)

    train("train_pretrain.py", 2, [*args, "--from_resume", "1"], tmp_path)
    assert events_of(tmp_path) == [("resume", stopped_at)]
    assert_each_sample_once(trace_of(tmp_path), num_samples=37, epochs=1)
    assert status_of(tmp_path)["status"] == "completed"


def test_resume_with_nothing_to_resume_starts_fresh_and_one_with_a_changed_setting_is_refused_naming_it(
        tmp_path, pretrain_data):
    args = run_args(tmp_path, pretrain_data, "--batch_size", "2", "--max_steps", "2", "--from_resume", "1")
    result = train("train_pretrain.py", None, args, tmp_path)
    assert "no checkpoint of pretrain_32" in result.stdout and "starting fresh" in result.stdout
    assert events_of(tmp_path) == [] and status_of(tmp_path)["resumed_from"] is None

    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(pretrain_data.read_text().splitlines()[:20]) + "\n")
    # A new hidden size is another run name: --resume_path points it at the old file.
    old_file = ["--resume_path", str(tmp_path / "ckpt" / "pretrain_32_history" / "step_00000002.pth")]
    for changed, field in [(["--hidden_size", "64", *old_file], "model.hidden_size"),
                           (["--batch_size", "3"], "args.batch_size"),
                           (["--data_path", str(other)], "data.lines"),
                           (["--seed", "7"], "args.seed: checkpoint has 42, this run has 7")]:
        result = train("train_pretrain.py", None, [*args, *changed], tmp_path, check=False)
        assert result.returncode == 2 and field in result.stderr and "cannot resume" in result.stderr, field
        assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr  # one message
        assert resume_file(tmp_path)["global_step"] == 2  # nothing was trained or saved after the refusal
        assert len(trace_of(tmp_path)) == 2


def test_resume_takes_the_sizes_no_flag_gives_from_the_checkpoint(tmp_path, pretrain_data, sft_data):
    # SFT starts from weights of a non-default SwiGLU width, read from the file; the continue command
    # it prints has no --intermediate_size, and must resume the run, as a --from_weight start would.
    train("train_pretrain.py", None, run_args(tmp_path / "pre", pretrain_data, "--max_steps", "1", "--save_dir",
                                              str(tmp_path / "out"), "--intermediate_size", "96"), tmp_path)
    sft = run_args(tmp_path, sft_data, "--batch_size", "4", "--max_steps", "2")
    train("train_full_sft.py", None, sft, tmp_path)
    train("train_full_sft.py", None, [*sft, "--from_resume", "1"], tmp_path)
    state = resume_file(tmp_path, "full_sft_32")
    assert state["global_step"] == 4 and state["lm_config"]["intermediate_size"] == 96
    # A size flag that is given is still checked against the checkpoint.
    result = train("train_full_sft.py", None, [*sft, "--from_resume", "1", "--intermediate_size", "128"], tmp_path,
                   check=False)
    assert result.returncode == 2 and "model.intermediate_size: checkpoint has 96, this run has 128" in result.stderr


def test_the_gpu_count_rule_keeps_the_global_batch_or_says_it_moved_and_refuses_what_would_not_continue():
    def settings(batch, world, accumulation, global_batch=None):
        return {"batch_size": batch, "world_size": world, "accumulation_steps": accumulation,
                "global_batch_size": global_batch}
    assert gpu_count_rule(settings(4, 2, 2, 16), settings(4, 2, 2, 16)) == ([], [])
    problems, notes = gpu_count_rule(settings(4, 2, 2, 16), settings(2, 4, 2, 16))  # the same 16, split anew
    assert problems == [] and notes == ["global batch 16 kept: batch_size x world_size x accumulation 4x2x2 -> 2x4x2"]
    # A run started without --global_batch_size (G = 4 x 2 x 2 = 16) continues exactly under --global_batch_size 16.
    assert gpu_count_rule(settings(4, 2, 2), settings(4, 4, 1, 16))[0] == []
    problems, _ = gpu_count_rule(settings(4, 2, 2), settings(4, 4, 1, 32))
    assert problems == ["  args.global_batch_size: checkpoint has None (16 samples a step), this run has 32 (32)"]
    problems, notes = gpu_count_rule(settings(4, 2, 2), settings(4, 3, 2))  # no fixed G: it moves, and says so
    assert problems == [] and notes[0].startswith("global batch moves with the GPUs")
    assert gpu_count_rule(settings(4, 2, 2), settings(8, 2, 2))[0] == [
        "  args.batch_size: checkpoint has 4, this run has 8"]

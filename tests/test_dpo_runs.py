"""trainer/train_dpo.py keeps every guarantee of the SFT stage, proven with real python/torchrun gloo processes
at the TINY_MODEL size: the same gradient however the global batch is split, under python or torchrun, DDP-free or
FSDP (the reference sharded too), across a resume; one-line errors for bad flags and data. Behind
TRAINER_SLOW_TESTS=1: a resume on the same rank count bit-identical, under DDP and FSDP, with the anomaly guard,
validation, the metrics and status files, rotated checkpoints and the tracker run id carried over, and a changed
reference file refused; a resume on 2 -> 3 -> 1 ranks training each pair once; a SIGTERM that saves.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import (assert_each_sample_once, assert_states_equal, events_of, history_file, metrics_of, resume_file,
                      run_args, sigterm_two_ranks_then_resume, status_of, trace_of, train)
from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from test_dpo import sum_pairs, write_jsonl, write_reference
from trainer.hardening import checkpoint_io as cio
from trainer.hardening.durable_files import sha256_of
from trainer.hardening.sharded_checkpoint import consolidate

SCRIPT, RUN = "train_dpo.py", "dpo_32"
SLOW = pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                          reason="several multi-process runs; set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")


@pytest.fixture
def dpo_data(tmp_path) -> Path:
    """11 pairs: a prime, so no world size or batch divides the epoch."""
    return write_jsonl(tmp_path / "pairs.jsonl", sum_pairs(11))


def dpo_args(run_dir: Path, data: Path, *extra: str, seed: int = 0) -> list[str]:
    """run_args for a DPO run under `run_dir`, whose out/ gets a reference (full_sft_32.pth) if it has none."""
    if not (run_dir / "out" / "full_sft_32.pth").exists():
        write_reference(run_dir / "out", load_tokenizer(DEFAULT_TOKENIZER).get_vocab_size(), seed=seed)
    return run_args(run_dir, data, "--learning_rate", "1e-3", *extra)


def newest_state(run_dir: Path) -> dict:
    """The newest checkpoint of the DPO run as one `_resume.pth` state, sharded or not."""
    latest = run_dir / "ckpt" / (run_dir / "ckpt" / f"{RUN}_latest.txt").read_text().strip()
    return consolidate(latest) if latest.suffix == ".dcp" else torch.load(latest, weights_only=True)


def by_step(trace: list[dict], field: str) -> dict[int, list]:
    return {step: [r[field] for r in sorted(trace, key=lambda r: r["rank"]) if r["step"] == step]
            for step in sorted({r["step"] for r in trace})}


def test_one_rank_two_micro_steps_and_two_sharded_ranks_one_give_the_same_gradient_across_a_resume(tmp_path):
    # 5 pairs, a global batch of 4: step 2 has one pair, so on 2 ranks rank 1 trains the loader's placeholder. The
    # 2-rank run is FSDP (the reference sharded too), stopped after step 1 and resumed.
    data = write_jsonl(tmp_path / "five.jsonl", sum_pairs(5))
    common = ["--epochs", "1", "--grad_clip", "inf", "--save_interval", "1", "--keep_last", "2", "--batch_size", "2"]
    one, two = tmp_path / "one", tmp_path / "two"
    unrecorded = train(SCRIPT, None, dpo_args(one, data, *common, "--accumulation_steps", "2"), tmp_path)
    # write_reference's file has no .json beside it: said once, though it is loaded as the policy and the reference
    assert unrecorded.stdout.count("has no record of the tokenizer it was trained with") == 1, unrecorded.stdout
    sharded = dpo_args(two, data, *common, "--accumulation_steps", "1", "--parallel", "fsdp")
    train(SCRIPT, 2, [*sharded, "--max_steps", "1"], tmp_path)
    train(SCRIPT, 2, [*sharded, "--from_resume", "1"], tmp_path)
    assert events_of(two, RUN) == [("resume", 1)]
    assert by_step(trace_of(two), "samples")[2][1] == []  # rank 1's share of step 2: the placeholder
    files = cio.RunFiles(two / "ckpt", RUN)
    for step in (1, 2):
        # AdamW's first moment after step 1 is 0.1 x the gradient, after step 2 0.09 x the first + 0.1 x the second.
        a = history_file(one, step, RUN)["optimizer"]["state"]
        b = consolidate(files.history_dir / f"step_{step:08d}.dcp")["optimizer"]["state"]
        assert a.keys() == b.keys() and len(a) > 0
        for number in a:  # float32 summation order only: measured at most 1e-6 of each tensor's norm
            difference = (a[number]["exp_avg"] - b[number]["exp_avg"]).norm() / a[number]["exp_avg"].norm()
            assert difference < 1e-5, (step, number, float(difference))
    losses = {run: [r["global_loss"] for r in trace_of(run) if r["rank"] == 0] for run in (one, two)}
    assert losses[one] == pytest.approx(losses[two], rel=1e-6) and len(losses[one]) == 2


@SLOW
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_a_resume_on_the_same_rank_count_is_bit_identical_and_a_changed_reference_is_refused(
        tmp_path, dpo_data, parallel):
    # 11 pairs on 2 ranks of 1: 6 steps, the last short. Step 2's loss is NaN (skipped under warn); saves every 2
    # steps, 2 kept; validation every 3 steps and at each invocation's end.
    val = write_jsonl(tmp_path / "val.jsonl", sum_pairs(13)[10:])
    common = ["--batch_size", "1", "--epochs", "1", "--parallel", parallel, "--debug_inject", "nan:2", "--on_anomaly",
              "warn", "--save_interval", "2", "--val_data", str(val), "--eval_interval", "3"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    wandb = ["--logger", "console,file,wandb"]  # the interrupted run only: a tracker changes nothing it trains
    train(SCRIPT, 2, dpo_args(straight, dpo_data, *common), tmp_path)
    train(SCRIPT, 2, dpo_args(split, dpo_data, *common, *wandb, "--max_steps", "3"), tmp_path, WANDB_DIR=tmp_path)
    first = newest_state(split)
    train(SCRIPT, 2, dpo_args(split, dpo_data, *common, *wandb, "--from_resume", "1"), tmp_path, WANDB_DIR=tmp_path)

    final = newest_state(split)
    assert_states_equal(newest_state(straight), final)
    assert (final["epoch"], final["samples_consumed"], final["global_step"]) == (1, 0, 6)
    assert by_step(trace_of(split), "loss") == by_step(trace_of(straight), "loss")
    assert [r["step"] for r in trace_of(split) if r.get("skipped")] == [2, 2]  # on both ranks, never applied
    assert events_of(split, RUN) == [("anomaly", 2), ("resume", 3)] and status_of(split, RUN)["status"] == "completed"
    validations = [(r["step"], r["val/loss"], r["val/accuracy"]) for r in metrics_of(split, RUN) if "val/loss" in r]
    assert validations == [(r["step"], r["val/loss"], r["val/accuracy"]) for r in metrics_of(straight, RUN)
                           if "val/loss" in r] and [v[0] for v in validations] == [3, 6]
    assert final["tracker_ids"] == first["tracker_ids"] and final["tracker_ids"]["wandb"]  # the same wandb run
    history = cio.RunFiles(split / "ckpt", RUN).history()
    assert [int(p.name[5:13]) for p in history] == [6, 4] and all(cio.verify(p) is None for p in history)
    # The checkpoint names the frozen reference by file and hash, not by a copy of its weights.
    reference = split / "out" / "full_sft_32.pth"
    assert (final["train_args"]["base_file"], final["train_args"]["base_sha256"], final["train_args"]["beta"]) == (
        str(reference), sha256_of(reference), 0.1)

    write_reference(split / "out", load_tokenizer(DEFAULT_TOKENIZER).get_vocab_size(), seed=1)  # another reference
    refused = train(SCRIPT, None, dpo_args(split, dpo_data, *common[:4], "--from_resume", "1"), tmp_path, check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert errors == ["error: cannot resume: the checkpoint was made with other settings:"] and (
        f"args.base_sha256: checkpoint has '{final['train_args']['base_sha256']}', this run has "
        f"'{sha256_of(reference)}'") in refused.stderr


def test_bad_flags_and_data_are_one_line_each_with_exit_2(tmp_path, dpo_data):
    bad = write_jsonl(tmp_path / "bad.jsonl", [*sum_pairs(2), {"chosen": sum_pairs(1)[0]["chosen"]}])
    for extra, line in [(["--beta", "0"], "error: --beta 0.0: must be a finite number > 0"),
                        (["--data_path", str(bad)], f'error: {bad}, line 3: no "rejected": each line is')]:
        result = train(SCRIPT, None, [*dpo_args(tmp_path, dpo_data), *extra], tmp_path, check=False)
        assert result.returncode == 2 and result.stderr.startswith(line), (extra, result.stderr[-2000:])
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "ckpt").exists()  # refused before anything was trained or saved


def test_a_save_weight_equal_to_from_weight_is_refused_before_the_reference_can_be_overwritten(tmp_path, dpo_data):
    # --save_weight full_sft --from_weight full_sft: the first save replaced the SFT model that is both the start and
    # the reference (before: exit 0, full_sft_32.pth rewritten, and the printed "To continue" command refused).
    args = dpo_args(tmp_path, dpo_data, "--save_weight", "full_sft", "--max_steps", "1")
    reference = tmp_path / "out" / "full_sft_32.pth"
    before = sha256_of(reference)
    result = train(SCRIPT, None, args, tmp_path, check=False)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr == (f"error: --from_weight {reference}: this run writes its weights at {reference}, over a "
                             f"file it reads; choose another --save_weight (or --save_dir, --checkpoint_dir, "
                             f"--metrics_dir) than --from_weight full_sft\n"), result.stderr
    assert sha256_of(reference) == before and not (tmp_path / "ckpt").exists()


@SLOW
def test_a_resume_on_two_then_three_then_one_rank_trains_each_pair_once(tmp_path, dpo_data):
    # 11 pairs, batch 1: global batches 2, 3 and 1, over 2 epochs.
    common = dpo_args(tmp_path, dpo_data, "--batch_size", "1", "--epochs", "2")
    train(SCRIPT, 2, [*common, "--max_steps", "3"], tmp_path)
    on_three = train(SCRIPT, 3, [*common, "--max_steps", "3", "--from_resume", "1"], tmp_path)
    assert "saved at step 3: training continues from sample 6 of epoch 1 (world size 2 -> 3, global batch 2 -> 3" \
        in on_three.stdout
    on_one = train(SCRIPT, None, [*common, "--from_resume", "1"], tmp_path)
    assert "saved at step 6: training continues from sample 3 of epoch 2 (world size 3 -> 1, global batch 3 -> 1" \
        in on_one.stdout
    trace = trace_of(tmp_path)
    # 3 steps of 2 pairs; then 3, 2 (the end of epoch 1) and 3 pairs; then the 8 left of epoch 2, one a step.
    assert {r["step"]: r["world_size"] for r in trace} == {s: 2 if s <= 3 else 3 if s <= 6 else 1 for s in range(1, 15)}
    assert_each_sample_once(trace, num_samples=11, epochs=2)
    final = resume_file(tmp_path, RUN)
    assert (final["epoch"], final["samples_consumed"], final["global_step"]) == (2, 0, 14)


@SLOW
def test_sigterm_saves_exits_zero_and_the_resume_trains_each_pair_once(tmp_path, dpo_data):
    args = dpo_args(tmp_path, dpo_data, "--batch_size", "1", "--epochs", "2")
    sigterm_two_ranks_then_resume(SCRIPT, RUN, args, tmp_path)

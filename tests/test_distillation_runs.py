"""trainer/train_distillation.py keeps every guarantee of the SFT stage, proven with real python/torchrun gloo
processes at the TINY_MODEL size (a 3-layer teacher, a 2-layer student): one-line errors for a bad flag, a
missing teacher or one with another vocabulary; the teacher's file never an output. Behind TRAINER_SLOW_TESTS=1:
the same gradient however the global batch is split, under python or torchrun, FSDP (the teacher sharded too),
across a resume; a resume on the same rank count bit-identical, with the metrics and status files and validation
carried over, and a changed teacher refused; a resume on 2 -> 3 -> 1 ranks training each conversation
once; a SIGTERM that saves.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import (assert_each_sample_once, assert_states_equal, events_of, history_file, metrics_of, resume_file,
                      run_args, sigterm_two_ranks_then_resume, status_of, trace_of, train)
from model.model import CausalLM, LMConfig
from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer, vocab_sha256
from test_dpo import TINY
from test_dpo_runs import by_step
from trainer.hardening import checkpoint_io as cio
from trainer.hardening.durable_files import sha256_of
from trainer.hardening.sharded_checkpoint import consolidate

SCRIPT, RUN = "train_distillation.py", "distill_32"
SLOW = pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                          reason="several multi-process runs; set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")


def write_teacher(out_dir: Path, seed: int = 0, vocab_size: int | None = None) -> Path:
    """A random 3-layer TINY model's FP16 weights as out/full_sft_32.pth: a teacher one layer deeper than the student."""
    torch.manual_seed(seed)
    vocab_size = vocab_size or load_tokenizer(DEFAULT_TOKENIZER).get_vocab_size()
    model = CausalLM(LMConfig(vocab_size=vocab_size, **{**TINY, "num_hidden_layers": 3}))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "full_sft_32.pth"
    torch.save({name: tensor.half() for name, tensor in model.state_dict().items()}, path)
    return path


def distill_args(run_dir: Path, data: Path, *extra: str) -> list[str]:
    """run_args for a distillation run under `run_dir`, whose out/ gets a teacher if it has none."""
    if not (run_dir / "out" / "full_sft_32.pth").exists():
        write_teacher(run_dir / "out")
    return run_args(run_dir, data, "--learning_rate", "1e-3", "--alpha", "0.3", "--temperature", "2", *extra)


@SLOW
def test_one_rank_two_micro_steps_and_two_sharded_ranks_one_give_the_same_gradient_across_a_resume(tmp_path, sft_data):
    # 29 conversations, a global batch of 16: step 2 has 13. The 2-rank run is FSDP (the teacher sharded too),
    # stopped after step 1 and resumed.
    common = ["--epochs", "1", "--grad_clip", "inf", "--save_interval", "1", "--keep_last", "2", "--batch_size", "8"]
    one, two = tmp_path / "one", tmp_path / "two"
    train(SCRIPT, None, distill_args(one, sft_data, *common, "--accumulation_steps", "2"), tmp_path)
    sharded = distill_args(two, sft_data, *common, "--accumulation_steps", "1", "--parallel", "fsdp")
    train(SCRIPT, 2, [*sharded, "--max_steps", "1"], tmp_path)
    train(SCRIPT, 2, [*sharded, "--from_resume", "1"], tmp_path)
    assert events_of(two, RUN) == [("resume", 1)]
    files = cio.RunFiles(two / "ckpt", RUN)
    for step in (1, 2):
        # AdamW's first moment after step 1 is 0.1 x the gradient, after step 2 0.09 x the first + 0.1 x the second.
        a = history_file(one, step, RUN)["optimizer"]["state"]
        b = consolidate(files.history_dir / f"step_{step:08d}.dcp")["optimizer"]["state"]
        assert a.keys() == b.keys() and len(a) > 0
        for number in a:  # float32 summation order only
            difference = (a[number]["exp_avg"] - b[number]["exp_avg"]).norm() / a[number]["exp_avg"].norm()
            assert difference < 1e-5, (step, number, float(difference))
    losses = {run: [r["global_loss"] for r in trace_of(run) if r["rank"] == 0] for run in (one, two)}
    assert losses[one] == pytest.approx(losses[two], rel=1e-6) and len(losses[one]) == 2


def test_bad_flags_a_missing_teacher_and_one_with_another_vocabulary_are_one_line_each_with_exit_2(tmp_path, sft_data):
    other, vocab = tmp_path / "other", load_tokenizer(DEFAULT_TOKENIZER).get_vocab_size()
    write_teacher(other / "out", vocab_size=vocab + 1)  # a teacher of another tokenizer, one token longer
    teacher = other / "out" / "full_sft_32.pth"
    cases = [(distill_args(tmp_path, sft_data, "--alpha", "1.5"), "error: --alpha 1.5: must be in [0, 1]"),
             (distill_args(tmp_path, sft_data, "--temperature", "0"), "error: --temperature 0.0: must be a finite"),
             (distill_args(tmp_path, sft_data, "--teacher_weight", "nothing"),
              f"error: --teacher_weight nothing: {tmp_path / 'out' / 'nothing_32.pth'} does not exist. Train the "
              f"teacher first"),
             (distill_args(other, sft_data), f"error: --teacher_weight full_sft: {teacher} has {vocab + 1} embedding "
                                             f"rows, the student's tokenizer {vocab} tokens")]
    for args, line in cases:
        result = train(SCRIPT, None, args, tmp_path, check=False)
        assert result.returncode == 2 and result.stderr.startswith(line), (line, result.stderr[-2000:])
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "ckpt").exists() and not (other / "ckpt").exists()  # refused before anything was saved


def test_a_teacher_or_from_weight_trained_with_another_tokenizer_of_the_same_size_is_one_line_with_exit_2(
        tmp_path, sft_data):
    # The teacher's out/full_sft_32.json as training writes it (the student's, at the end, proves it)
    teacher, recorded = write_teacher(tmp_path / "out"), tmp_path / "out" / "full_sft_32.json"
    recorded.write_text(json.dumps({"max_seq_len": 48, "tokenizer_vocab_sha256": vocab_sha256(DEFAULT_TOKENIZER)}))
    # Another tokenizer of the same size: two tokens trade ids, so the same ids stand for other text.
    config = json.loads(DEFAULT_TOKENIZER.read_text(encoding="utf-8"))
    vocab = config["model"]["vocab"]
    first, second = list(vocab)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    other = tmp_path / "other_tokenizer.json"
    other.write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    assert load_tokenizer(other).get_vocab_size() == load_tokenizer(DEFAULT_TOKENIZER).get_vocab_size()
    for script, flag, args in [(SCRIPT, "--teacher_weight full_sft", distill_args(tmp_path, sft_data)),
                               ("train_full_sft.py", "--from_weight full_sft",
                                run_args(tmp_path, sft_data, "--from_weight", "full_sft", "--num_hidden_layers", "3",
                                         "--save_weight", "more"))]:
        result = train(script, None, [*args, "--tokenizer_path", str(other)], tmp_path, check=False)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert result.stderr == (
            f"error: {flag}: {teacher} was trained with another tokenizer than --tokenizer_path {other}: {recorded} "
            f"records vocabulary hash {vocab_sha256(DEFAULT_TOKENIZER)[:12]}..., {other} has "
            f"{vocab_sha256(other)[:12]}...; the same token ids would stand for other text. Pass the tokenizer it "
            f"was trained with as --tokenizer_path\n"), result.stderr
    # A copy of the tokenizer it was trained with is the same tokenizer: the student trains, and records it.
    copy = shutil.copy(DEFAULT_TOKENIZER, tmp_path / "copy_of_tokenizer.json")
    done = train(SCRIPT, None, [*distill_args(tmp_path, sft_data, "--max_steps", "1"), "--tokenizer_path", copy],
                 tmp_path)
    assert "note:" not in done.stdout, done.stdout
    assert json.loads((tmp_path / "out" / "distill_32.json").read_text()) == {
        "max_seq_len": 48, "tokenizer_vocab_sha256": vocab_sha256(DEFAULT_TOKENIZER)}


def test_the_log_line_and_metrics_split_the_loss_into_its_cross_entropy_and_kl_on_two_ranks(tmp_path, sft_data):
    # write_teacher's file has no .json beside it (as an earlier version's, or minimind's): a note, not a refusal
    result = train(SCRIPT, 2, distill_args(tmp_path, sft_data, "--batch_size", "2", "--max_steps", "3"), tmp_path)
    notes = [line for line in result.stdout.splitlines() if line.startswith("note: --teacher_weight")]
    assert notes == [f"note: --teacher_weight full_sft: {tmp_path / 'out' / 'full_sft_32.pth'} has no record of the "
                     f"tokenizer it was trained with (no tokenizer_vocab_sha256 in full_sft_32.json: an earlier "
                     f"version's or minimind's file); that it is --tokenizer_path's is not checked"], result.stdout
    logged = [r for r in metrics_of(tmp_path, RUN) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3]
    for record in logged:  # per labelled token of the global batch, as the loss: alpha 0.3, temperature 2
        assert record["ce"] > 0 and record["kl"] > 0, record
        assert record["loss"] == pytest.approx(0.3 * record["ce"] + 0.7 * 2 ** 2 * record["kl"], rel=1e-6), record
        assert f"loss {record['loss']:.4f} " in result.stdout
        assert f" ce {record['ce']:.4g} kl {record['kl']:.4g} " in result.stdout, result.stdout


def test_a_save_weight_that_names_the_teachers_file_is_refused_before_it_can_be_overwritten(tmp_path, sft_data):
    # The student at the teacher's hidden size, saved as full_sft, would replace the teacher's file at its first save.
    args = distill_args(tmp_path, sft_data, "--save_weight", "full_sft", "--max_steps", "1")
    teacher = tmp_path / "out" / "full_sft_32.pth"
    before = sha256_of(teacher)
    result = train(SCRIPT, None, args, tmp_path, check=False)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr == (f"error: --teacher_weight {teacher}: this run writes its weights at {teacher}, over a "
                             f"file it reads; choose another --save_weight (or --save_dir, --checkpoint_dir, "
                             f"--metrics_dir) than --teacher_weight full_sft\n"), result.stderr
    assert sha256_of(teacher) == before and not (tmp_path / "ckpt").exists()


@SLOW
def test_a_resume_on_the_same_rank_count_is_bit_identical_and_a_changed_teacher_is_refused(tmp_path, sft_data):
    # 29 conversations on 2 ranks of 2: 8 steps, the last short; saves every 2 steps; validation every 3 steps.
    val = tmp_path / "val.jsonl"
    val.write_text("".join(sft_data.read_text().splitlines(keepends=True)[:5]))
    common = ["--batch_size", "2", "--epochs", "1", "--save_interval", "2", "--val_data", str(val),
              "--eval_interval", "3"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(SCRIPT, 2, distill_args(straight, sft_data, *common), tmp_path)
    train(SCRIPT, 2, distill_args(split, sft_data, *common, "--max_steps", "3"), tmp_path)
    train(SCRIPT, 2, distill_args(split, sft_data, *common, "--from_resume", "1"), tmp_path)

    final = resume_file(split, RUN)
    assert_states_equal(resume_file(straight, RUN), final)
    assert (final["epoch"], final["samples_consumed"], final["global_step"]) == (1, 0, 8)
    assert by_step(trace_of(split), "loss") == by_step(trace_of(straight), "loss")
    assert events_of(split, RUN) == [("resume", 3)] and status_of(split, RUN)["status"] == "completed"
    validations = [(r["step"], r["val/loss"]) for r in metrics_of(split, RUN) if "val/loss" in r]
    assert validations == [(r["step"], r["val/loss"]) for r in metrics_of(straight, RUN) if "val/loss" in r]
    assert [v[0] for v in validations] == [3, 6, 8]
    # The checkpoint names the frozen teacher by file and hash, not by a copy of its weights.
    teacher = split / "out" / "full_sft_32.pth"
    settings = final["train_args"]
    assert (settings["teacher_file"], settings["teacher_sha256"], settings["alpha"], settings["temperature"]) == (
        str(teacher), sha256_of(teacher), 0.3, 2.0)

    write_teacher(split / "out", seed=1)  # another teacher
    refused = train(SCRIPT, None, distill_args(split, sft_data, *common[:4], "--from_resume", "1"), tmp_path,
                    check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert (f"args.teacher_sha256: checkpoint has '{settings['teacher_sha256']}', this run has "
            f"'{sha256_of(teacher)}'") in refused.stderr


@SLOW
def test_a_resume_on_two_then_three_then_one_rank_trains_each_conversation_once(tmp_path, sft_data):
    # 29 conversations, batch 1: global batches 2, 3 and 1, over 2 epochs.
    common = distill_args(tmp_path, sft_data, "--batch_size", "1", "--epochs", "2")
    train(SCRIPT, 2, [*common, "--max_steps", "3"], tmp_path)
    on_three = train(SCRIPT, 3, [*common, "--max_steps", "3", "--from_resume", "1"], tmp_path)
    assert "saved at step 3: training continues from sample 6 of epoch 1 (world size 2 -> 3, global batch 2 -> 3" \
        in on_three.stdout
    train(SCRIPT, None, [*common, "--from_resume", "1"], tmp_path)
    trace = trace_of(tmp_path)
    # 3 steps of 2; 3 of 3; then the 14 left of epoch 1 and the 29 of epoch 2, one a step.
    assert {r["step"]: r["world_size"] for r in trace} == {s: 2 if s <= 3 else 3 if s <= 6 else 1 for s in range(1, 50)}
    assert_each_sample_once(trace, num_samples=29, epochs=2)
    final = resume_file(tmp_path, RUN)
    assert (final["epoch"], final["samples_consumed"], final["global_step"]) == (2, 0, 49)


@SLOW
def test_sigterm_saves_exits_zero_and_the_resume_trains_each_conversation_once(tmp_path):
    data = tmp_path / "eleven.jsonl"  # sigterm_two_ranks_then_resume counts 11 samples
    data.write_text("".join((Path(__file__).parent.parent / "dataset" / "sft_demo.jsonl").read_text(
        encoding="utf-8").splitlines(keepends=True)[:11]), encoding="utf-8")
    args = distill_args(tmp_path, data, "--batch_size", "1", "--epochs", "2")
    sigterm_two_ranks_then_resume(SCRIPT, RUN, args, tmp_path)

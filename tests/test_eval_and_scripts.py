"""eval_model.py and the scripts/ tools, on small real artifacts of the real trainer.

Two identical 3-step pretraining runs (CPU, tiny model) are made once for the whole module; the
tests then read their FP16 weights, resume checkpoints and debug traces. The exact-match eval is
also run on a tiny model trained until it knows its answers, so its score is known in advance.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eval_model
from conftest import (REPO, TINY_MODEL, assert_exit_code, child_env, launch_command, read_trace, run_args, slice_jsonl,
                      train)
from model.tokenizer import load_tokenizer
from benchmarks import bench
from scripts import compare_runs, inspect_checkpoint
from trainer.hardening.checkpoint_io import CheckpointError

# The size flags of TINY_MODEL, for the tools that rebuild a model from an out/ file.
SIZE_FLAGS = TINY_MODEL[:TINY_MODEL.index("--max_seq_len")]
NUM_SAMPLES, STEPS, BATCH = 40, 3, 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two identical runs, A and B: 3 optimizer steps of 4 samples on 40 demo lines."""
    root = tmp_path_factory.mktemp("runs")
    data = slice_jsonl(REPO / "dataset" / "pretrain_demo.jsonl", root / "pretrain.jsonl", NUM_SAMPLES)
    made = {"root": root, "data": data, "a": root / "a", "b": root / "b"}
    jobs = []
    for name in ("a", "b"):  # two independent one-process runs, side by side on two cores
        args = run_args(made[name], data, "--batch_size", str(BATCH), "--max_steps", str(STEPS), "--save_interval", "2")
        jobs.append(subprocess.Popen(launch_command("train_pretrain.py", None, [*TINY_MODEL, *args]), cwd=root,
                                     env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for job in jobs:
        stdout, stderr = job.communicate(timeout=300)
        assert_exit_code(subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr))
    return made


def resume_path(run_dir: Path) -> Path:
    return run_dir / "ckpt" / "pretrain_32_resume.pth"


def eval_args(run_dir: Path, weight: str, *extra: str) -> list[str]:
    return ["--weight", weight, *SIZE_FLAGS, "--save_dir", str(run_dir / "out"), "--device", "cpu", *extra]


# ---- eval_model.py ----------------------------------------------------------------------------

def test_answers_match_ignores_surrounding_whitespace_only():
    assert eval_model.answers_match(" 87\n", "87")
    assert eval_model.answers_match("", "  ")
    assert not eval_model.answers_match("8 7", "87")
    assert not eval_model.answers_match("87.", "87")


def test_eval_prompt_continues_text_from_the_command_line(runs):
    result = subprocess.run([sys.executable, str(REPO / "eval_model.py"),
                             *eval_args(runs["a"], "pretrain", "--prompt", "Once upon", "--max_new_tokens", "8")],
                            cwd=runs["root"], env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # A pretrained model continues the raw text: the prompt, then its own greedy continuation.
    args = eval_model.build_arg_parser().parse_args(eval_args(runs["a"], "pretrain"))
    tokenizer = load_tokenizer(args.tokenizer_path)
    model = eval_model.load_model(args, tokenizer, torch.device("cpu"))
    continuation = eval_model.generate_text(model, tokenizer, eval_model.raw_prompt_ids(tokenizer, "Once upon"), 8)
    assert result.stdout == f"Once upon{continuation}\n"


def test_eval_names_the_file_it_loaded_and_the_model_sizes_on_stderr(runs, capsys):
    argv = eval_args(runs["a"], "pretrain", "--prompt", "Once", "--max_new_tokens", "1")
    assert eval_model.main(argv) == 0
    captured = capsys.readouterr()
    args = eval_model.build_arg_parser().parse_args(argv)
    model = eval_model.load_model(args, load_tokenizer(args.tokenizer_path), torch.device("cpu"))
    assert captured.err == (f"loaded {runs['a'] / 'out' / 'pretrain_32.pth'}: hidden 32, 2 layers, 4 heads, "
                            f"2 kv heads, vocab {model.config.vocab_size}, "
                            f"{model.num_parameters() / 1e6:.2f}M params\n")
    assert captured.out.startswith("Once")  # stdout holds the answer alone


def test_eval_applies_a_lora_adapter_on_top_of_the_weight_and_refuses_a_missing_one_in_one_line(tmp_path, capsys):
    from lora_files import base_model, tiny_config, write_adapter, write_base
    from model.lora import load_lora
    config = tiny_config()
    base_file = write_base(tmp_path, config)
    adapter_file = write_adapter(tmp_path, config, base=base_file)
    argv = ["--weight", "full_sft", "--save_dir", str(tmp_path), "--device", "cpu"]
    args = eval_model.build_arg_parser().parse_args([*argv, "--lora", "demo"])
    lines = []
    model = eval_model.load_model(args, load_tokenizer(args.tokenizer_path), torch.device("cpu"), log=lines.append)
    assert lines[1:] == [f"applied {adapter_file}: rank 4, alpha 6, in q_proj,v_proj,o_proj,down_proj"]
    expected = base_model(base_file)
    ids = torch.randint(3, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = expected(ids).logits
        load_lora(expected, adapter_file)
        assert torch.equal(model(ids).logits, expected(ids).logits) and not torch.allclose(plain, expected(ids).logits)

    assert eval_model.main([*argv, "--lora", "demo", "--prompt", "hi", "--max_new_tokens", "2"]) == 0
    write_base(tmp_path, config, seed=1)  # the same shapes, other weights: said, not refused
    assert eval_model.main([*argv, "--lora", "demo", "--prompt", "hi", "--max_new_tokens", "2"]) == 0
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"warning: the adapter was trained on {base_file} "
                                                               f"(SHA-256 ")
    assert eval_model.main([*argv, "--lora", "medical", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"error: --lora medical: no lora_medical_32.pth in {tmp_path} (there: full_sft_32.pth, "
                              f"lora_demo_32.pth)")


def test_evaluate_exact_match_counts_the_models_own_greedy_answers_as_correct(runs):
    shutil.copy(runs["a"] / "out" / "pretrain_32.pth", runs["a"] / "out" / "chat_32.pth")
    args = eval_model.build_arg_parser().parse_args(eval_args(runs["a"], "chat"))
    tokenizer = load_tokenizer(args.tokenizer_path)
    model = eval_model.load_model(args, tokenizer, torch.device("cpu"))
    questions = [[{"role": "user", "content": "What is 2 plus 3?"}],
                 [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Next after 8?"}]]
    # Greedy decoding is deterministic, so the model's own answers are references it must match.
    own = [eval_model.generate_text(model, tokenizer, eval_model.chat_prompt_ids(tokenizer, q), 8)
           for q in questions]
    records = [{"conversations": q + [{"role": "assistant", "content": f"  {a}\n"}]} for q, a in zip(questions, own)]
    records.append({"conversations": questions[0] + [{"role": "assistant", "content": "surely not this"}]})
    mistakes: list[str] = []
    assert eval_model.evaluate_exact_match(model, tokenizer, records, 8, log=mistakes.append) == (2, 3)
    assert len(mistakes) == 1 and "surely not this" in mistakes[0]


def test_eval_file_scores_a_model_that_learned_its_questions_and_counts_a_wrong_reference(tmp_path, capsys):
    # Four demo questions of four kinds, eight copies each: SFT from random weights learns them in
    # 160 steps (loss ~0.003 on every seed tried), so each greedy answer must be the reference.
    demo = [json.loads(line) for line in (REPO / "dataset" / "sft_demo_eval.jsonl").read_text(encoding="utf-8")
            .splitlines()[:5]]
    questions = [demo[i] for i in (0, 1, 3, 4)]  # next number, opposite (zh), animal sound (zh), addition
    assert len({q["conversations"][-1]["content"] for q in questions}) == 4
    learned = tmp_path / "learned.jsonl"
    learned.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in questions * 8), encoding="utf-8")
    train("train_full_sft.py", None, run_args(tmp_path, learned, "--from_weight", "none", "--batch_size", "8",
                                              "--epochs", "40", "--learning_rate", "1e-2", "--warmup_ratio", "0",
                                              "--log_interval", "40", "--save_interval", "1000"), tmp_path)
    first = questions[0]["conversations"]
    wrong = {"conversations": [*first[:-1], {"role": "assistant", "content": "38"}]}  # the answer is 37
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in [*questions, wrong]),
                         encoding="utf-8")
    assert first[-1]["content"] == "37"

    assert eval_model.main(["--weight", "full_sft", "--save_dir", str(tmp_path / "out"), "--device", "cpu",
                            "--eval", str(eval_file), "--verbose", "--max_new_tokens", "16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2:] == [f"#5: {first[0]['content']!r} -> got '37', expected '38'",
                          "exact-match accuracy: 4/5 = 80.0%"]


def test_eval_cuts_a_prompt_of_megabytes_at_the_trained_length_and_counts_it(tmp_path, capsys):
    """Before: the 6 MB prompt was tokenized whole and handed to the model: a traceback, "6000008 positions
    exceed max_position_embeddings"."""
    from lora_files import tiny_config, write_base

    write_base(tmp_path, tiny_config())
    (tmp_path / "full_sft_32.json").write_text('{"max_seq_len": 48}')  # as training writes it beside the weights
    tokenizer = load_tokenizer()
    question = "The sky is blue today. " * 270_000 + "What is 2+3?"  # 6.2 MB
    records = [{"conversations": [{"role": "user", "content": text}, {"role": "assistant", "content": "5"}]}
               for text in ("What is 2+3?", question, "What is 3+4?")]
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    assert eval_model.main(["--weight", "full_sft", "--save_dir", str(tmp_path), "--device", "cpu",
                            "--eval", str(eval_file), "--max_new_tokens", "2"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert "note: 1 of 3 prompts are longer than the 48 tokens the model reads: each lost its start" \
        in captured.out, captured.out
    assert "exact-match accuracy: " in captured.out
    # Its texts were cut before the prompt was tokenized, and the ids kept are those of the whole prompt.
    messages = [{"role": "user", "content": "Once upon a time 木 " * 10_000 + "What is 2+3?"}]
    whole = eval_model.chat_prompt_ids(tokenizer, messages)
    assert eval_model.chat_prompt_ids_within(tokenizer, messages, 48) == (whole[-48:], True)
    short = [{"role": "user", "content": "What is 2+3?"}]
    assert eval_model.chat_prompt_ids_within(tokenizer, short, 48) == (eval_model.chat_prompt_ids(tokenizer, short),
                                                                       False)


class Recorded:
    """The real tokenizer (or the chat encoder's copy of it), recording how many characters each text it is handed
    to encode has."""

    def __init__(self, tokenizer, lengths: list[int]):
        self.tokenizer, self.lengths = tokenizer, lengths

    def encode(self, text, *args, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, *args, **kwargs)

    def encode_batch(self, texts, *args, **kwargs):
        self.lengths.extend(len(text) for text in texts)
        return self.tokenizer.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_every_path_that_writes_cuts_a_prompt_of_megabytes_to_the_positions_of_weights_without_a_json(
        tmp_path, monkeypatch, capsys):
    """minimind's weights have no out/{weight}.json: --eval handed the model a prompt filling all 32768 positions
    ("32769 positions exceed max_position_embeddings" at the first new token), --prompt and the chat tokenized 6 MB
    whole first. Each prompt now keeps its end, leaving --max_new_tokens their positions, cut before it is
    tokenized. The model answers at once here: a forward over 32k tokens takes a minute on a CPU."""
    import dataset.chat_format as chat_format
    from lora_files import tiny_config, write_base
    from model.model import CausalLM
    from model.tokenizer import EOS_ID, chars_for_tokens, text_only_copy

    for name in ("full_sft", "pretrain"):
        write_base(tmp_path, tiny_config(), name=name)  # and no .json beside them
    lengths, prompts, real_load = [], [], eval_model.load_tokenizer
    monkeypatch.setattr(eval_model, "load_tokenizer", lambda path: Recorded(real_load(path), lengths))
    monkeypatch.setattr(chat_format, "text_only_copy", lambda t: Recorded(text_only_copy(t), lengths))

    def answer_at_once(model, input_ids, max_new_tokens, **kwargs):
        assert input_ids.shape[1] + max_new_tokens <= model.config.max_position_embeddings, input_ids.shape
        prompts.append(input_ids.shape[1])
        return torch.cat([input_ids, torch.tensor([[5, EOS_ID]])], dim=1)

    monkeypatch.setattr(CausalLM, "generate", answer_at_once)
    text = "The sky is blue today. " * 110_000 + "What is 2+3?"  # 2.5 MB
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"conversations": [{"role": "user", "content": text},
                                                       {"role": "assistant", "content": "5"}]}) + "\n")
    common = ["--save_dir", str(tmp_path), "--device", "cpu", "--max_new_tokens", "64"]
    for weight, how in [("full_sft", ["--eval", str(eval_file)]), ("full_sft", ["--prompt", text]),
                        ("pretrain", ["--prompt", text]), ("full_sft", [])]:
        monkeypatch.setattr(sys, "stdin", io.StringIO(text + "\n\n"))  # the chat: one turn, then an empty line
        assert eval_model.main(["--weight", weight, *common, *how]) == 0
        captured = capsys.readouterr()
        assert "Traceback" not in captured.out + captured.err
        assert ("texts are cut at its 32768 positions" in captured.err) == bool(how and how[0] == "--eval")
        assert "the 32704 tokens the model" in captured.out + captured.err, (how, captured.out, captured.err)
    assert prompts == [32768 - 64] * 4  # each filled what is left of the positions, and no more
    tokenizer = load_tokenizer()
    assert max(lengths) <= chars_for_tokens(32768, tokenizer) + 100 < len(text) / 2, max(lengths)


def test_interactive_loop_keeps_going_until_an_empty_line(runs, monkeypatch, capsys):
    shutil.copy(runs["a"] / "out" / "pretrain_32.pth", runs["a"] / "out" / "full_sft_32.pth")
    stdin = io.StringIO("hello\n/reset\nhi again\n\nnever read\n")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert eval_model.main(eval_args(runs["a"], "full_sft", "--max_new_tokens", "3")) == 0
    assert "(history cleared)" in capsys.readouterr().out
    assert stdin.read() == "never read\n"  # the empty line ended the session


def test_eval_with_wrong_size_flags_names_the_file_and_the_right_flags(runs, capsys):
    args = eval_args(runs["a"], "pretrain", "--prompt", "x")
    args[args.index("--num_hidden_layers") + 1] = "3"
    assert eval_model.main(args) == 2  # an expected error, as in the training scripts
    err = capsys.readouterr().err
    assert "pretrain_32.pth does not fit" in err and "--num_hidden_layers 2" in err


# ---- benchmarks/bench.py -------------------------------------------------------------------------

def test_bench_prints_one_json_line_with_every_key(capsys):
    bench.main(["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "4",
                "--num_key_value_heads", "2", "--vocab_size", "256", "--batch_size", "2", "--max_seq_len", "16",
                "--steps", "2", "--warmup", "1", "--device", "cpu"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    keys = {"impl", "hidden", "layers", "params_M", "batch", "seq", "compile", "tokens_per_s", "tflops", "mfu",
            "peak_mem_GiB"}
    assert keys <= set(result)
    assert result["impl"] == "tiny-llm-trainer" and result["hidden"] == 32 and result["seq"] == 16
    assert result["tokens_per_s"] > 0 and result["tflops"] >= 0 and result["peak_mem_GiB"] is None  # no GPU memory
    assert result["mfu"] == pytest.approx(result["tflops"] / 989, abs=1e-7)  # of 989 TFLOP/s; tflops is rounded


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="about 60 s on two CPU cores (a benchmark's own check); set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")
def test_bench_gpu_suite_runs_at_a_tiny_size_on_the_cpu(capsys, tmp_path):
    """The suite a GPU owner runs, shrunk: both shapes, bare step and real loop; compiled runs skipped off CUDA."""
    bench.main(["--suite", "gpu", "--tiny", "--device", "cpu", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert "skipped" in records[0] and records[0]["compile"] is True
    steps = [r for r in records if r.get("measure") == "step"]
    loops = [r for r in records if r.get("measure") == "loop"]
    assert [(r["seq"], r["compile"]) for r in steps] == [(32, False), (64, False)]
    assert [r["mode"] for r in loops] == ["no saves", "background saves"] * 2
    assert all(r["fraction_of_bare_step"] > 0 for r in loops)
    saving = loops[1]
    assert saving["saves"] == 2 and saving["blocked_s"] > 0 and saving["blocked_pct_at_default_interval"] > 0
    assert "| 64×2, seq 32, batch 4 | eager |" in out and "python benchmarks/bench.py --suite gpu --tiny" in out


# ---- scripts/inspect_checkpoint.py ------------------------------------------------------------

def test_inspect_resume_file_shows_position_and_verifies_it(runs):
    text = inspect_checkpoint.describe_checkpoint(resume_path(runs["a"]))
    assert "resume checkpoint" in text
    assert re.search(r"integrity: +OK, verified against manifest pretrain_32_history/step_00000003\.pth\.json", text)
    assert re.search(r"global step: +3\n", text)
    assert re.search(rf"samples consumed: +{STEPS * BATCH} of {NUM_SAMPLES} samples", text)
    assert re.search(r"world size: +1\n", text) and "GradScaler scale: not used" in text
    model = torch.load(resume_path(runs["a"]), weights_only=True)["model"]
    unique = sum(t.numel() for n, t in model.items() if n != "lm_head.weight")  # lm_head is tied
    assert re.search(rf"parameters: +{unique:,}\n", text)


def test_inspect_weights_file_infers_the_size_flags(runs):
    text = inspect_checkpoint.describe_checkpoint(runs["a"] / "out" / "pretrain_32.pth")
    assert "inference weights" in text and "float16" in text
    assert "--hidden_size 32 --num_hidden_layers 2 --num_attention_heads 4 --num_key_value_heads 2 --use_moe 0" in text


def test_inspect_reports_truncated_and_corrupted_copies(runs, tmp_path, capsys):
    history = runs["a"] / "ckpt" / "pretrain_32_history"
    for name in ("step_00000003.pth", "step_00000003.pth.json"):
        shutil.copy(history / name, tmp_path / name)
    copy = tmp_path / "step_00000003.pth"
    data = copy.read_bytes()

    copy.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        inspect_checkpoint.describe_checkpoint(copy)
    assert inspect_checkpoint.main([str(copy)]) == 1
    assert capsys.readouterr().err.startswith("error: ")

    # One flipped byte still loads, which is exactly why the manifest check matters.
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(flipped))
    assert "PROBLEM: SHA-256 does not match" in inspect_checkpoint.describe_checkpoint(copy)


class _Payload:
    def __reduce__(self):
        return (os.getpid, ())


def test_inspect_refuses_a_pickle_that_is_not_plain_data(tmp_path, capsys):
    path = tmp_path / "untrusted.pth"
    torch.save({"model": _Payload()}, path)
    assert inspect_checkpoint.main([str(path)]) == 1
    assert "refused" in capsys.readouterr().err


def test_inspect_directory_lists_the_kept_history(runs):
    text = inspect_checkpoint.describe_history(runs["a"] / "ckpt", "pretrain_32")
    assert "step_00000003.pth" in text and "step_00000002.pth" in text and "<- resume link" in text
    assert "PROBLEM" not in text


# ---- scripts/compare_runs.py ------------------------------------------------------------------

def test_compare_trace_with_itself_is_identical_and_each_sample_trained_once(runs):
    trace = runs["a"] / "trace.jsonl"
    code, report = compare_runs.compare_paths(trace, trace)
    assert code == 0 and report.startswith(f"identical: {STEPS} steps x 1 ranks")
    assert f"{STEPS * BATCH} distinct samples, each exactly once" in report


def test_compare_reports_the_first_step_whose_loss_differs(runs, tmp_path):
    records = read_trace(runs["a"] / "trace.jsonl")
    records[1]["loss"] += 1e-3
    changed = tmp_path / "changed.jsonl"
    changed.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, report = compare_runs.compare_paths(runs["a"] / "trace.jsonl", changed)
    assert code == 1 and report.startswith("first difference at step 2 rank 0: loss")
    assert compare_runs.compare_paths(runs["a"] / "trace.jsonl", changed, atol=1e-2)[0] == 0


def test_compare_reports_repeated_samples_in_an_epoch():
    trace = {(1, 0): {"epoch": 0, "samples": [3, 1]}, (2, 0): {"epoch": 0, "samples": [1, 2]}}
    [line] = compare_runs.epoch_coverage(trace, num_samples=4)
    assert "1 trained more than once: 1 (x2)" in line and "1 of 4 never trained" in line


def test_compare_resume_files_of_identical_runs_from_the_command_line(runs):
    command = [sys.executable, "-m", "scripts.compare_runs", str(resume_path(runs["a"])), str(resume_path(runs["b"]))]
    result = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("identical:")


def test_compare_resume_files_names_the_first_differing_tensor(runs):
    older = runs["a"] / "ckpt" / "pretrain_32_history" / "step_00000002.pth"
    code, report = compare_runs.compare_paths(resume_path(runs["a"]), older)
    assert code == 1
    assert "global_step: 3 vs 2" in report and "first differing tensor: model.embed_tokens.weight" in report

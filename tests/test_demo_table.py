"""scripts/demo_table.py: its random row holds the weights pretraining starts from, and each row scores its own
model on the files it was given.

One real pretraining run of one step at learning rate 0 (which leaves the weights as they are) saves the
initial weights of a tiny model; the tests compare the table's random weights and numbers with it.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

import eval_model
import eval_tools
from conftest import REPO, TINY_MODEL, assert_exit_code, child_env, launch_command, run_args, slice_jsonl
from dataset.dpo_dataset import DPODataset
from eval_choices import choice_loglikelihoods, pair_logprobs, read_choice_items, score_choices, score_pairs
from lora_files import tiny_config, write_adapter
from model.tokenizer import load_tokenizer
from scripts import demo_table

SIZE_FLAGS = TINY_MODEL[:TINY_MODEL.index("--max_seq_len")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """out/pretrain_32.pth after one step at LR 0 (the initial weights, in FP16), copied as full_sft_32.pth."""
    root = tmp_path_factory.mktemp("run")
    data = slice_jsonl(REPO / "dataset" / "pretrain_demo.jsonl", root / "pretrain.jsonl", 8)
    args = run_args(root, data, "--batch_size", "4", "--max_steps", "1", "--learning_rate", "0")
    result = subprocess.run(launch_command("train_pretrain.py", None, [*TINY_MODEL, *args]), cwd=root,
                            env=child_env(), capture_output=True, text=True, timeout=300)
    assert_exit_code(result)
    for stage in ("full_sft", "dpo"):  # the same file under the later stages' names
        shutil.copy(root / "out" / "pretrain_32.pth", root / "out" / f"{stage}_32.pth")
    write_adapter(root / "out", tiny_config(), base=root / "out" / "full_sft_32.pth")  # lora_demo_32.pth
    # A real GRPO step from full_sft_32.pth (brevity: a random model's answers differ in length, never in being
    # right), its status file beside its weights as in the demo
    prompts = slice_jsonl(REPO / "dataset" / "grpo_demo.jsonl", root / "prompts.jsonl", 4)
    args = run_args(root, prompts, "--batch_size", "4", "--max_steps", "1", "--num_generations", "2",
                    "--max_completion_len", "8", "--rewards", "brevity", "--learning_rate", "1e-2")
    args[args.index("--metrics_dir") + 1] = str(root / "out")
    args[args.index("--save_debug_train_output") + 1] = str(root / "grpo_trace.jsonl")
    result = subprocess.run(launch_command("train_grpo.py", None, [*TINY_MODEL, *args]), cwd=root,
                            env=child_env(), capture_output=True, text=True, timeout=300)
    assert_exit_code(result)
    # The two students, one layer to the teacher's two: a real step of SFT alone and of distillation from full_sft_32
    conversations = slice_jsonl(REPO / "dataset" / "sft_demo.jsonl", root / "sft.jsonl", 4)
    student = [*TINY_MODEL[:TINY_MODEL.index("--num_hidden_layers") + 1], "1",
               *TINY_MODEL[TINY_MODEL.index("--num_hidden_layers") + 2:]]
    # and tool use: a real step of SFT on the tool conversations from full_sft_32 (960 tokens hold them, as in the demo)
    tool_conversations = slice_jsonl(REPO / "dataset" / "tool_sft_demo.jsonl", root / "tool_sft.jsonl", 2)
    tool_prompts = slice_jsonl(REPO / "dataset" / "tool_grpo_demo.jsonl", root / "tool_grpo.jsonl", 2)
    for script, weight, data, size, start in (
            ("train_full_sft.py", "student_sft", conversations, student, "none"),
            ("train_distillation.py", "student_distill", conversations, student, "none"),
            ("train_full_sft.py", "tool_sft", tool_conversations, [*TINY_MODEL, "--max_seq_len", "960"], "full_sft"),
            # and agentic GRPO from it: a real step, the tools offered, two turns (the demo's flags, smaller)
            ("train_grpo.py", "tool_grpo", tool_prompts, [*TINY_MODEL, "--max_seq_len", "640", "--max_turns", "2",
                                                          "--num_generations", "2", "--max_completion_len", "32",
                                                          "--rewards", "brevity", "--learning_rate", "1e-2"],
             "tool_sft")):
        args = run_args(root, data, "--batch_size", "2", "--max_steps", "1", "--from_weight", start,
                        "--save_weight", weight)
        args[args.index("--metrics_dir") + 1] = str(root / "out")
        args[args.index("--save_debug_train_output") + 1] = str(root / f"{weight}_trace.jsonl")
        result = subprocess.run(launch_command(script, None, [*size, *args]), cwd=root, env=child_env(),
                                capture_output=True, text=True, timeout=300)
        assert_exit_code(result)
    return root


def before_the_tool_table(out: str) -> list[str]:
    """The lines printed before the tool-use table, which comes last."""
    return out.split("\n\n| tool use |")[0].splitlines()


def load(root, weight: str):
    args = eval_model.build_arg_parser().parse_args(["--weight", weight, *SIZE_FLAGS, "--save_dir", str(root / "out"),
                                                     "--device", "cpu"])
    return eval_model.load_model(args, load_tokenizer(args.tokenizer_path), torch.device("cpu"))


def test_the_random_weights_are_those_the_trainer_started_from(run):
    pretrained = load(run, "pretrain")
    saved = torch.load(run / "out" / "pretrain_32.pth", weights_only=True)
    initial = demo_table.initial_model(pretrained, seed=42).state_dict()
    assert saved.keys() == initial.keys()
    for name, tensor in saved.items():  # the trainer saves FP16
        assert torch.equal(initial[name].to(torch.float16), tensor), name
    other_seed = demo_table.initial_model(pretrained, seed=43).state_dict()
    assert not torch.equal(other_seed["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])


def test_the_table_has_one_row_per_model_with_its_scores_on_the_given_files(run, tmp_path, capsys):
    val = slice_jsonl(REPO / "dataset" / "val_demo.jsonl", tmp_path / "val.jsonl", 3)
    mc = slice_jsonl(REPO / "dataset" / "mc_demo.jsonl", tmp_path / "mc.jsonl", 6)
    em = slice_jsonl(REPO / "dataset" / "sft_demo_eval.jsonl", tmp_path / "eval.jsonl", 2)
    domain = slice_jsonl(REPO / "dataset" / "lora_demo_eval.jsonl", tmp_path / "domain.jsonl", 2)
    pairs = slice_jsonl(REPO / "dataset" / "dpo_demo_eval.jsonl", tmp_path / "pairs.jsonl", 5)
    argv = [*SIZE_FLAGS, "--save_dir", str(run / "out"), "--device", "cpu", "--val_data", str(val),
            "--mc_data", str(mc), "--eval_data", str(em), "--lora_eval_data", str(domain), "--pairs_data", str(pairs),
            "--max_new_tokens", "4", "--tool_data", str(tool_items(tmp_path))]
    assert demo_table.main(argv) == 0
    lines = before_the_tool_table(capsys.readouterr().out)
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| weights")]
    assert [row.split(" | ")[0] for row in rows] == ["| random weights", "| after pretraining", "| after SFT",
                                                     "| SFT + LoRA", "| after DPO (from SFT)", "| after GRPO (from SFT)",
                                                     "| student, 1 layer, SFT alone",
                                                     "| student, 1 layer, distilled from SFT"]
    assert rows[6].split(" | ")[1] != rows[7].split(" | ")[1]  # two runs, two students
    assert rows[1].split(" | ")[1:] == rows[2].split(" | ")[1:] == rows[4].split(" | ")[1:]  # one file, three names
    assert rows[3].split(" | ")[1] != rows[2].split(" | ")[1]  # the adapter (random B) moves the bits per byte

    model, tokenizer = load(run, "pretrain"), load_tokenizer(REPO / "model" / "tokenizer.json")
    bpb = eval_model.file_loss(model, tokenizer, val, 128).bpb
    items = read_choice_items(mc)
    lls = choice_loglikelihoods(model, lambda text: tokenizer.encode(text).ids, items, 10_000, progress=False)
    scores = score_choices(items, lls)
    correct, _ = eval_model.evaluate_exact_match(model, tokenizer, eval_model.read_jsonl(em), max_new_tokens=4)
    domain_correct, _ = eval_model.evaluate_exact_match(model, tokenizer, eval_model.read_jsonl(domain),
                                                        max_new_tokens=4)
    prefers = score_pairs(pair_logprobs(model, DPODataset(pairs, tokenizer, 128)), None)["accuracy"]
    assert rows[1] == (f"| after pretraining | {bpb:.3f} | {100 * scores['acc']:.1f} % | "
                       f"{scores['acc_centred']:+.3f} | {correct}/2 = {50.0 * correct:.1f} % | "
                       f"{domain_correct}/2 = {50.0 * domain_correct:.1f} % | {100 * prefers:.1f} % |")
    assert lines[-2] == "(after DPO: its implicit reward against the SFT model prefers the right answer on 0.0 % of " \
        "the held-out pairs)"  # the same weights as SFT's: every reward is 0, and a tie is no preference
    assert lines[-3].startswith("(the students: SFT alone 1 step in ") and ", distilled 1 step in " in lines[-3]
    assert lines[-4] == ("(multiple choice: 6 items, chance 25.0 %; exact match: 2 held-out chat questions; "
                         "LoRA's domain: 2 translations in an unseen phrasing; prefers right: 5 held-out pairs)")


def test_grpos_line_gives_its_run_and_how_often_sampled_answers_are_right_before_and_after(run, tmp_path, capsys):
    """Below the table: the GRPO run's steps and time, read from its status file, and the share of answers sampled
    at temperature 1 that the answer reward scores right, for the SFT and the GRPO weights on the eval's questions."""
    em = slice_jsonl(REPO / "dataset" / "sft_demo_eval.jsonl", tmp_path / "eval.jsonl", 6)
    status = json.loads((run / "out" / "grpo_32_status.json").read_text())
    tokenizer = load_tokenizer(REPO / "model" / "tokenizer.json")
    sft, grpo = load(run, "full_sft"), load(run, "grpo")
    assert any(not torch.equal(a, b) for a, b in zip(sft.state_dict().values(), grpo.state_dict().values()))
    right = [demo_table.sampled_right(model, tokenizer, str(em), 4, 4, seed=42) for model in (sft, grpo)]
    assert all(0 <= r <= 1 and (r * 24).is_integer() for r in right)  # 6 questions x 4 answers
    # the draws are the seed's: the same again
    assert demo_table.sampled_right(sft, tokenizer, str(em), 4, 4, seed=42) == right[0]
    assert demo_table.main([*SIZE_FLAGS, "--save_dir", str(run / "out"), "--device", "cpu", "--eval_data", str(em),
                            "--max_new_tokens", "4", "--samples", "4", *small_files(tmp_path)]) == 0
    seconds = status["updated"] - status["started"]
    assert before_the_tool_table(capsys.readouterr().out)[-1] == (
        f"(after GRPO, 1 step in {seconds:.0f} s: answers sampled at temperature 1, 4 per held-out question, are "
        f"right {100 * right[1]:.1f} % of the time, against {100 * right[0]:.1f} % after SFT)")


def small_files(tmp_path) -> list[str]:
    """The table's other files, a few lines each."""
    files = {"--val_data": "val_demo.jsonl", "--mc_data": "mc_demo.jsonl", "--lora_eval_data": "lora_demo_eval.jsonl",
             "--pairs_data": "dpo_demo_eval.jsonl"}
    return [part for flag, name in files.items()
            for part in (flag, str(slice_jsonl(REPO / "dataset" / name, tmp_path / name, 2)))] + \
        ["--tool_data", str(tool_items(tmp_path))]


def tool_items(tmp_path):
    """Three of the tool-use eval's items: one of each kind (a calculation, a temperature, no tool needed)."""
    lines = (REPO / "dataset" / "tool_demo_eval.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    path = tmp_path / "tool_items.jsonl"
    path.write_text("".join(lines[::16]), encoding="utf-8")
    return path


def test_the_tool_use_table_gives_eval_tools_totals_for_sft_the_tool_sft_model_and_agentic_grpo_with_their_runs(
        run, tmp_path, capsys):
    """Last, a table of eval_tools.py's totals for the SFT model, then for out/tool_sft_*.pth (trained from it), then for
    out/tool_grpo_*.pth (from that), named with the run's steps and time from its status file; the same totals
    eval_tools.py prints for each model."""
    items = tool_items(tmp_path)
    em = slice_jsonl(REPO / "dataset" / "sft_demo_eval.jsonl", tmp_path / "eval.jsonl", 2)  # (not the table here)
    assert demo_table.main([*SIZE_FLAGS, "--save_dir", str(run / "out"), "--device", "cpu", "--max_new_tokens", "4",
                            "--samples", "2", "--eval_data", str(em), *small_files(tmp_path)]) == 0
    table = capsys.readouterr().out.split("\n\n| tool use |")[1].splitlines()
    status = json.loads((run / "out" / "tool_sft_32_status.json").read_text())
    model, tokenizer = load(run, "tool_sft"), load_tokenizer(REPO / "model" / "tokenizer.json")
    assert any(not torch.equal(a, b) for a, b in zip(load(run, "full_sft").state_dict().values(),
                                                     model.state_dict().values()))  # a step was trained
    before, after = (eval_tools.totals(eval_tools.score_model(m, tokenizer, eval_tools.read_items(items)))
                     for m in (load(run, "full_sft"), model))
    assert table[0] == " all right | right tool | valid arguments | no call where none is needed | right answer |"
    assert table[2] == "| after SFT (no tool data) | " + " | ".join(before.values()) + " |"
    assert table[3] == (f"| after tool SFT (from SFT), 1 step in {status['updated'] - status['started']:.0f} s | "
                        + " | ".join(after.values()) + " |")
    status = json.loads((run / "out" / "tool_grpo_32_status.json").read_text())
    grpo = load(run, "tool_grpo")
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), grpo.state_dict().values()))
    last = eval_tools.totals(eval_tools.score_model(grpo, tokenizer, eval_tools.read_items(items)))
    assert table[4] == (f"| after agentic GRPO (from tool SFT), 1 step in {status['updated'] - status['started']:.0f} s"
                        f" | " + " | ".join(last.values()) + " |")
    assert table[5] == "(3 held-out questions, offered both tools: 2 need a call, the others none)"


def test_a_missing_stage_is_named_with_what_to_run(tmp_path, capsys):
    assert demo_table.main(["--save_dir", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no pretrain_*[_moe].pth in" in err and "bash scripts/run_demo.sh" in err

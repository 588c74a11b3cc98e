"""scripts/demo_table.py: its random row holds the weights pretraining starts from, and each row scores its own
model on the files it was given.

One real pretraining run of one step at learning rate 0 (which leaves the weights as they are) saves the
initial weights of a tiny model; the tests compare the table's random weights and numbers with it.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

import eval_model
from conftest import REPO, TINY_MODEL, assert_exit_code, child_env, launch_command, run_args, slice_jsonl
from eval_choices import choice_loglikelihoods, read_choice_items, score_choices
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
    shutil.copy(root / "out" / "pretrain_32.pth", root / "out" / "full_sft_32.pth")
    return root


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
    argv = [*SIZE_FLAGS, "--save_dir", str(run / "out"), "--device", "cpu", "--val_data", str(val),
            "--mc_data", str(mc), "--eval_data", str(em), "--max_new_tokens", "4"]
    assert demo_table.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| weights")]
    assert [row.split(" | ")[0] for row in rows] == ["| random weights", "| after pretraining", "| after SFT"]
    assert rows[1].split(" | ")[1:] == rows[2].split(" | ")[1:]  # the same file under both names

    model, tokenizer = load(run, "pretrain"), load_tokenizer(REPO / "model" / "tokenizer.json")
    bpb = eval_model.file_loss(model, tokenizer, val, 128).bpb
    items = read_choice_items(mc)
    lls = choice_loglikelihoods(model, lambda text: tokenizer.encode(text).ids, items, 10_000, progress=False)
    scores = score_choices(items, lls)
    correct, _ = eval_model.evaluate_exact_match(model, tokenizer, eval_model.read_jsonl(em), max_new_tokens=4)
    assert rows[1] == (f"| after pretraining | {bpb:.3f} | {100 * scores['acc']:.1f} % | "
                       f"{scores['acc_centred']:+.3f} | {correct}/2 = {50.0 * correct:.1f} % |")
    assert lines[-1] == "(multiple choice: 6 items, chance 25.0 %; exact match: 2 held-out chat questions)"


def test_a_missing_stage_is_named_with_what_to_run(tmp_path, capsys):
    assert demo_table.main(["--save_dir", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no pretrain_*[_moe].pth in" in err and "bash scripts/run_demo.sh" in err

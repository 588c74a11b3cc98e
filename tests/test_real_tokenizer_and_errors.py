"""Any tokenizer.json with the three ChatML specials works end to end; a user's mistake is one line, exit 2.

The tokenizer here is built like minimind's: a byte-level BPE with 6,400 tokens, the ChatML tokens at
0, 1, 2, the chat tags and more special tokens after them. Pretrain, SFT from the pretrained weights,
chat with eval_model.py and the Hugging Face export all run on it, as real processes.
"""

from __future__ import annotations

import os

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conftest import REPO, child_env, free_port, train
from model.chat_template import TAGS
from model.tokenizer import SPECIAL_TOKENS

VOCAB = 6400


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory) -> Path:
    """6,400 tokens: BPE on the demo text, then reserved special tokens up to the size, as real ones carry."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [*sorted(SPECIAL_TOKENS, key=SPECIAL_TOKENS.get), *TAGS, "<|fim_prefix|>", "<|fim_suffix|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = (REPO / "dataset" / "pretrain_demo.jsonl").read_text(encoding="utf-8").splitlines()[:3000]
    tokenizer.train_from_iterator((json.loads(line)["text"] for line in lines), trainer=trainer)
    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB - tokenizer.get_vocab_size())]
    tokenizer.add_special_tokens(reserved)
    assert tokenizer.get_vocab_size() == VOCAB
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def run(command: list, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command}\nSTDOUT:\n{result.stdout[-3000:]}\nSTDERR:\n{result.stderr[-3000:]}"
    return result


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="about 35 s on two CPU cores; set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")
def test_a_6400_token_tokenizer_with_extra_specials_trains_chats_and_exports(tmp_path, big_tokenizer, pretrain_data,
                                                                              sft_data):
    common = ["--tokenizer_path", str(big_tokenizer), "--save_dir", str(tmp_path / "out"), "--checkpoint_dir",
              str(tmp_path / "ckpt"), "--batch_size", "4", "--max_steps", "3"]
    train("train_pretrain.py", None, [*common, "--data_path", str(pretrain_data)], tmp_path)
    sft = train("train_full_sft.py", None, [*common, "--data_path", str(sft_data)], tmp_path)
    assert "initial weights: " in sft.stdout
    weights = tmp_path / "out" / "full_sft_32.pth"

    evaluation = run([sys.executable, str(REPO / "eval_model.py"), "--weight", "full_sft", "--save_dir",
                      str(tmp_path / "out"), "--tokenizer_path", str(big_tokenizer), "--device", "cpu",
                      "--eval", str(sft_data), "--max_new_tokens", "4"], tmp_path)
    assert f"/{len(sft_data.read_text().splitlines())} " in evaluation.stdout  # every question was asked

    hf_dir = tmp_path / "hf"
    run([sys.executable, str(REPO / "scripts" / "export_hf.py"), str(weights), "-o", str(hf_dir), "--tokenizer",
         str(big_tokenizer)], tmp_path)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    hf_tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert model.config.vocab_size == VOCAB and len(hf_tokenizer) == VOCAB
    assert hf_tokenizer.convert_tokens_to_ids("<think>") == big_tokenizer_id(big_tokenizer, "<think>")


def big_tokenizer_id(path: Path, token: str) -> int:
    return Tokenizer.from_file(str(path)).token_to_id(token)


def test_the_names_minimind_readers_look_for_live_in_trainer_utils():
    from trainer.trainer_utils import SkipBatchSampler, lm_checkpoint
    assert SkipBatchSampler.__module__ == lm_checkpoint.__module__ == "trainer.trainer_utils"


# ---- a user's mistake: one message, exit code 2, no traceback -------------------------------------

def expect_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ")  # the message alone, first line first
    for fragment in fragments:
        assert fragment in result.stderr


@pytest.mark.parametrize("nproc", [None, 2], ids=["python", "torchrun2"])
def test_a_bad_data_line_is_one_message_naming_file_and_line(tmp_path, pretrain_data, nproc):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(pretrain_data.read_text(encoding="utf-8") + '{"txt": "typo"}\n', encoding="utf-8")
    result = train("train_pretrain.py", nproc, ["--data_path", str(bad), "--save_dir", str(tmp_path / "out")],
                   tmp_path, check=False)
    message = f"{bad}, line 38: expected a string field \"text\""
    if nproc is None:
        expect_user_error(result, message)
    else:  # every rank stops with the message; the traceback torchrun prints is its own, not ours
        assert result.returncode != 0 and message in result.stderr
        assert f"traceback : error: {message}" in result.stderr  # torchrun's summary names it too
        assert "trainer_utils.py" not in result.stderr and "jsonl_file.py" not in result.stderr


# A worker whose rank 1 alone meets an expected error (say, a data file that differs on its node); rank 0
# waits for it in a collective. Only rank 0 prints expected errors, so rank 1's line reaches the user
# through torchrun's failure summary (process_exit.report_to_torchrun).
RANK_1_ALONE = """
import sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from dataset.jsonl_file import DataFileError
from trainer.hardening.process_exit import run_script


def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise DataFileError("data.jsonl, line 7: changed on this node only")
    dist.barrier()


run_script(main)
"""


def test_an_expected_error_on_one_rank_alone_is_shown_in_torchruns_summary(tmp_path):
    script = tmp_path / "rank_1_alone.py"
    script.write_text(RANK_1_ALONE)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(script), str(REPO)]
    result = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr  # torchrun's code for a failed worker group
    assert "exitcode  : 2" in result.stderr
    assert "traceback : error: data.jsonl, line 7: changed on this node only" in result.stderr, result.stderr


@pytest.mark.parametrize("content", ["", "\n  \n\n"], ids=["empty", "blank_lines"])
def test_a_data_file_without_records_is_one_message_not_an_endless_epoch(tmp_path, content):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content, encoding="utf-8")
    result = train("train_pretrain.py", None, ["--data_path", str(empty), "--save_dir", str(tmp_path / "out")],
                   tmp_path, check=False, timeout=120)
    expect_user_error(result, f"{empty}: no records: the file is empty or holds only blank lines")

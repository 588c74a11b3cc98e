"""Text that parses but cannot be used is refused when the file is indexed, in one line naming file and line.

A lone surrogate escape ("\\ud800", half of a UTF-16 pair) parses as a Python str that has no UTF-8 bytes: the
tokenizer refuses it, and did so at whatever step first drew the record, in a DataLoader worker. A line nested
100,000 deep ends json.loads in a RecursionError. Every reader of a data file goes through one index
(dataset/jsonl_file.py), so every stage, and each of eval_model.py's data flags, is tried here with both.
Also: what eval_model.py says of a path that is a FIFO or a folder, and of bytes that are not UTF-8.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

import eval_model
from conftest import REPO, train
from dataset.dpo_dataset import DPODataset
from dataset.jsonl_file import DataFileError, JsonlFile
from dataset.lm_dataset import PackedPretrainDataset, PretrainDataset, SFTDataset
from eval_choices import read_choice_items
from lora_files import tiny_config, write_base
from model.tokenizer import load_tokenizer
from test_real_tokenizer_and_errors import expect_user_error

SURROGATE = "a \\ud800 b"  # as it stands in the file: JSON's escape of a lone high surrogate
NESTED = "[" * 100_000 + "]" * 100_000


def chat(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def line_with(kind: str, text: str) -> str:
    """One JSONL line of `kind` whose text (used by that reader) is `text`, written into the JSON as is."""
    good = {"text": chat("q", "a"), "sft": chat("q", "a")}
    if kind == "text":
        return '{"text": "%s"}' % text
    if kind == "sft":
        return '{"conversations": [{"role": "user", "content": "%s"}, {"role": "assistant", "content": "a"}]}' % text
    if kind == "pair":
        return ('{"chosen": %s, "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": '
                '"%s"}]}' % (json.dumps(good["sft"]), text))
    return '{"question": "%s", "choices": ["x", "y"], "answer": 0}' % text  # a multiple-choice item


GOOD = {"text": '{"text": "fine"}', "sft": json.dumps({"conversations": chat("q", "a")}),
        "pair": json.dumps({"chosen": chat("q", "a"), "rejected": chat("q", "b")}),
        "choice": '{"question": "q?", "choices": ["x", "y"], "answer": 0}'}

# Each reader of a data file: pretraining (and its --val_data), packed pretraining, SFT (LoRA's data and the
# --val_data of both), DPO (and eval_model.py --pairs_data), eval_model.py --mc_data and --eval.
READERS = {
    "pretrain": ("text", lambda path, tok: PretrainDataset(path, tok, 16)),
    "pretrain-packed": ("text", lambda path, tok: PackedPretrainDataset(path, tok, 4)),
    "sft-lora": ("sft", lambda path, tok: SFTDataset(path, tok, 16)),
    "dpo": ("pair", lambda path, tok: DPODataset(path, tok, 16)),
    "mc_data": ("choice", lambda path, tok: read_choice_items(path)),
    "eval": ("sft", lambda path, tok: eval_model.read_jsonl(path)),
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("text, problem", [
    (SURROGATE, "holds a lone surrogate escape (\\ud800)"),
    ("\\\\ud800 \\ud83d\\ude00", None),  # an escaped backslash, and a whole pair (an emoji): both fine
], ids=["lone-surrogate", "pair-and-backslash"])
def test_a_lone_surrogate_is_refused_at_indexing_naming_file_line_and_field(tmp_path, tokenizer, reader, text,
                                                                            problem):
    kind, read = READERS[reader]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([GOOD[kind], "", line_with(kind, text), GOOD[kind]]) + "\n", encoding="utf-8")
    if problem is None:
        read(path, tokenizer)
        return
    with pytest.raises(DataFileError) as refused:
        read(path, tokenizer)
    message = str(refused.value)
    assert message.startswith(f"{path}, line 3: ") and problem in message and "\n" not in message, message
    assert message.endswith("Fix or delete this line, then start again.")


@pytest.mark.parametrize("reader", READERS)
def test_a_line_nested_100000_deep_is_refused_not_a_recursion_error(tmp_path, tokenizer, reader):
    kind, read = READERS[reader]
    path = tmp_path / "data.jsonl"
    path.write_text(f'{GOOD[kind]}\n{{"x": {NESTED}}}\n', encoding="utf-8")
    with pytest.raises(DataFileError) as refused:
        read(path, tokenizer)
    assert str(refused.value).startswith(f"{path}, line 2: nested too deeply for Python's JSON parser")


@pytest.mark.parametrize("field", ["tools", "tool_calls"])
def test_a_lone_surrogate_inside_the_json_a_string_holds_is_refused(tmp_path, tokenizer, field):
    """minimind stores tools and tool calls as JSON strings: their text is tokenized once parsed."""
    message = {"role": "system", "content": "", "tools": '[{"name": "\\ud800"}]'} if field == "tools" else \
        {"role": "assistant", "content": "", "tool_calls": '[{"name": "f\\udc00", "arguments": {}}]'}
    conversation = [message, *chat("q", "a")] if field == "tools" else [*chat("q", "a"), message]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"conversations": conversation}) + "\n", encoding="utf-8")
    with pytest.raises(DataFileError) as refused:
        SFTDataset(path, tokenizer, 16)
    assert f"{path}, line 1: message " in str(refused.value)
    assert f"{field}[0].name holds a lone surrogate escape" in str(refused.value)


@pytest.mark.parametrize("problem", ["surrogate", "nested"])
def test_a_training_run_refuses_such_a_line_in_one_line_and_exits_2(tmp_path, problem):
    data = tmp_path / "data.jsonl"
    lines = (REPO / "dataset" / "pretrain_demo.jsonl").read_text(encoding="utf-8").splitlines()[:20]
    bad = line_with("text", SURROGATE) if problem == "surrogate" else '{"text": "x", "meta": %s}' % NESTED
    data.write_text("\n".join([*lines[:9], bad, *lines[9:]]) + "\n", encoding="utf-8")
    result = train("train_pretrain.py", None, ["--data_path", str(data), "--save_dir", str(tmp_path / "out")],
                   tmp_path, check=False, timeout=120)
    expect_user_error(result, f"{data}, line 10: ")
    assert result.stderr.count("\n") == 1, result.stderr


# ---- eval_model.py: what a data path is, and text that is not UTF-8 ------------------------------------

@pytest.fixture
def models(tmp_path) -> Path:
    """out/ with a random tiny pretrain and full_sft model."""
    for name in ("pretrain", "full_sft"):
        write_base(tmp_path / "out", tiny_config(), name=name)
    return tmp_path / "out"


def fifo_unblocked_after(fifo: Path, seconds: float) -> threading.Event:
    """After `seconds`, open `fifo` for writing and close it, so a reader waiting on it gets an end of file and
    the test fails rather than hangs; the event is set if that was needed."""
    unblocked = threading.Event()

    def unblock() -> None:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # fails (ENXIO) when no one reads it
            unblocked.set()
        except OSError:
            pass

    timer = threading.Timer(seconds, unblock)
    timer.daemon = True
    timer.start()
    return unblocked


@pytest.mark.parametrize("flag", ["--bpb_data", "--mc_data", "--pairs_data", "--eval"])
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_eval_model_says_a_data_path_is_a_fifo_or_a_folder_and_never_waits(tmp_path, models, capsys, flag, kind):
    path = tmp_path / "data.jsonl"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    unblocked = fifo_unblocked_after(path, 20) if kind == "fifo" else threading.Event()
    weight = ["--weight", "pretrain"] if flag == "--bpb_data" else []
    status = eval_model.main([flag, str(path), *weight, "--save_dir", str(models), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert not unblocked.is_set(), "eval_model.py waited on the FIFO"
    assert status == 2 and len(err) == 1, err
    assert str(path) in err[0] and ("a FIFO (named pipe)" if kind == "fifo" else "a folder") in err[0], err
    assert "no such file" not in err[0]


@pytest.mark.parametrize("flag", ["--bpb_data", "--mc_data", "--pairs_data", "--eval"])
@pytest.mark.parametrize("bad_line", [1, 2])
def test_eval_model_names_the_file_and_line_that_is_not_utf8(tmp_path, models, capsys, flag, bad_line):
    kind = {"--bpb_data": "text", "--mc_data": "choice", "--pairs_data": "pair", "--eval": "sft"}[flag]
    path = tmp_path / "data.jsonl"
    lines = [GOOD[kind].encode(), GOOD[kind].encode()]
    lines[bad_line - 1] = line_with(kind, "caf\xe9").encode("latin-1")  # "café" in Latin-1: 0xE9 is no UTF-8
    path.write_bytes(b"\n".join(lines) + b"\n")
    weight = ["--weight", "pretrain"] if flag == "--bpb_data" else []
    status = eval_model.main([flag, str(path), *weight, "--save_dir", str(models), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err[-1].startswith(f"error: {path}, line {bad_line}: the line is not valid UTF-8"), err


def test_a_pretraining_text_is_checked_as_it_is_read_again(tmp_path):
    """The check runs on every read too (a record re-validated): a file rewritten in place with the same size
    and a lone surrogate is refused there as well, never handed to the tokenizer."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a \\u00e9 b"}\n', encoding="utf-8")
    source = JsonlFile(path)
    stat = path.stat()
    path.write_text('{"text": "a \\ud800 b"}\n', encoding="utf-8")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the same size and modification time
    # seen by a rank that looked at the file's times after the edit (its change time tells the others): only
    # the read can tell
    source = JsonlFile.from_index(path, source.file_size, source.offsets, source.line_numbers, source.sha256)
    with pytest.raises(DataFileError, match="line 1 no longer parses as a JSON object"):
        source.read(0)

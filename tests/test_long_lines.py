"""Lines longer than training can use: cut before they are tokenized, and DPO pairs the cut leaves without an
answer said at start and counted in the metrics.

A text is cut to max_seq_len tokens. Tokenizing a 60 MB line whole to keep its first few hundred tokens took
minutes for every step that drew it; model/tokenizer.text_for_tokens keeps only what those tokens need, and
the items are those of the whole text tokenized. A DPO pair whose prompt fills max_seq_len keeps no answer
token, so the loss leaves it out: DPODataset finds such pairs when the file is opened and says so in one line.
A GRPO prompt keeps its end (ChatEncoder.encode_end tokenizes only what that end needs); GRPODataset says at start
which prompts are cut, and refuses a room that every prompt is longer than.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, metrics_of, run_args, train
from dataset.chat_format import ChatEncoder, render_segments
from dataset.dpo_dataset import DPODataset
from dataset.grpo_dataset import GRPODataset
from dataset.jsonl_file import DataFileError
from dataset.lm_dataset import IGNORE_INDEX, PretrainDataset, SFTDataset, _pad
from dataset.rewards import reward_functions
from model.tokenizer import (BOS_ID, DEFAULT_TOKENIZER, EOS_ID, chars_for_tokens, load_tokenizer, longest_token_chars,
                             text_for_tokens, text_only_copy)
from test_dpo import pair, sum_pairs, write_jsonl, write_reference
from test_grpo import question, sum_questions

DEMO_TEXT = " ".join(json.loads(line)["text"] for line in
                     (REPO / "dataset" / "pretrain_demo.jsonl").read_text(encoding="utf-8").splitlines())


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def chat(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def record_with(kind: str, text: str) -> dict:
    """A record of `kind` whose long part is `text`: the text, the user's question, or the chosen answer."""
    if kind == "pretrain":
        return {"text": text}
    if kind == "sft":
        return {"conversations": chat(text, "a")}
    return pair("q", text, "b")


def whole_text_item(kind: str, record: dict, tokenizer, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The item the dataset gives, computed the old way: every text tokenized whole, then cut and padded."""
    if kind == "pretrain":
        ids = [BOS_ID] + tokenizer.encode(record["text"]).ids + [EOS_ID]
        return _pad(ids, list(ids), max_seq_len)
    encoder = ChatEncoder(tokenizer)
    if kind == "sft":
        ids, trained = encoder.encode(render_segments(record["conversations"]))
        return _pad(ids, [t if keep else IGNORE_INDEX for t, keep in zip(ids, trained)], max_seq_len)
    rows = []
    for side in ("chosen", "rejected"):
        segments = render_segments(record[side])
        prompt = len(render_segments(record[side][:-1]))
        ids, trained = encoder.encode([s._replace(trained=False) for s in segments[:prompt]] + segments[prompt:])
        rows.append(_pad(ids, [t if keep else IGNORE_INDEX for t, keep in zip(ids, trained)], max_seq_len))
    return torch.stack([rows[0][0], rows[1][0]]), torch.stack([rows[0][1], rows[1][1]])


DATASETS = {"pretrain": PretrainDataset, "sft": SFTDataset, "dpo": DPODataset}
# Each longer than the cut (some 4,600 characters at max_seq_len 16 with the demo tokenizer, 6,100 at 64).
LONG_TEXTS = {"demo-text": DEMO_TEXT[:40_000], "one-letter": "a" * 40_000, "cjk-and-emoji": "猫😀 " * 10_000,
              "newlines": "x\n" * 20_000}


@pytest.mark.parametrize("kind", DATASETS)
@pytest.mark.parametrize("text", LONG_TEXTS)
def test_a_long_line_gives_the_items_of_its_whole_text_tokenized(tmp_path, tokenizer, kind, text):
    records = [record_with(kind, "short one"), record_with(kind, LONG_TEXTS[text])]
    path = write_jsonl(tmp_path / "data.jsonl", records)
    for max_seq_len in (16, 64):
        assert len(LONG_TEXTS[text]) > len(text_for_tokens(LONG_TEXTS[text], max_seq_len, tokenizer))  # it is cut
        dataset = DATASETS[kind](path, tokenizer, max_seq_len)
        for i, record in enumerate(records):
            for got, expected in zip(dataset[i], whole_text_item(kind, record, tokenizer, max_seq_len)):
                assert torch.equal(got, expected)


def test_a_text_is_cut_only_past_twice_what_its_tokens_can_hold(tokenizer):
    keep = 2 * 340 * longest_token_chars(tokenizer) + 4096
    assert text_for_tokens("b" * keep, 340, tokenizer) == "b" * keep  # every line of a usual file: as it is
    assert text_for_tokens("b" * (keep + 1), 340, tokenizer) == "b" * keep


@pytest.mark.parametrize("kind", DATASETS)
def test_a_10_mb_line_is_cut_before_it_is_tokenized(tmp_path, tokenizer, kind):
    """Tokenized whole, this line took 34 s for every step that drew it (a 60 MB one, minutes), measured on a
    2-core machine; cut, the time is that of reading and parsing it, a fraction of a second."""
    text = (DEMO_TEXT * (10_000_000 // len(DEMO_TEXT) + 1))[:10_000_000]
    path = write_jsonl(tmp_path / "data.jsonl", [record_with(kind, "short one"), record_with(kind, text)])
    dataset = DATASETS[kind](path, tokenizer, 64)
    start = time.perf_counter()
    input_ids, _ = dataset[1]
    assert time.perf_counter() - start < 4
    assert (input_ids.view(-1, 64)[0] != 0).all()  # a full window, nothing padded (DPO: the chosen row)


# ---- DPO: pairs whose answers the cut leaves out ---------------------------------------------------

def pairs_with_long_prompts(path: Path) -> Path:
    """11 pairs; those on lines 2, 5 and 9 have a prompt of 120 tokens, the others of some 20."""
    records = sum_pairs(11)
    for line in (2, 5, 9):
        records[line - 1] = pair("What is " + " plus ".join(str(n) for n in range(30)) + "?", "435", "436")
    return write_jsonl(path, records)


def test_dpo_says_at_start_how_many_pairs_train_nothing_and_where(tmp_path, tokenizer):
    path = pairs_with_long_prompts(tmp_path / "pairs.jsonl")
    notes = []
    dataset = DPODataset(path, tokenizer, 40, log=notes.append)
    no_answer = [i for i in range(len(dataset)) if not (dataset[i][1][:, 1:] != IGNORE_INDEX).any(dim=1).all()]
    assert dataset.beyond_max_seq_len.tolist() == no_answer == [1, 4, 8]
    assert notes == [f"note: 3 of 11 pairs in {path} (lines 2, 5, 9) have a prompt of --max_seq_len 40 tokens or "
                     f"more: cut there, their answers keep no token, so the loss leaves them out. Raise "
                     f"--max_seq_len, or shorten or remove those pairs"]
    notes.clear()
    assert DPODataset(path, tokenizer, 200, log=notes.append).beyond_max_seq_len.tolist() == [] and notes == []


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="a DPO training run (about 11 s); set TRAINER_SLOW_TESTS=1 to run it")
def test_a_dpo_run_logs_the_note_and_counts_such_pairs_in_its_metrics(tmp_path):
    data = pairs_with_long_prompts(tmp_path / "pairs.jsonl")
    write_reference(tmp_path / "out", load_tokenizer(DEFAULT_TOKENIZER).get_vocab_size())
    result = train("train_dpo.py", None, run_args(tmp_path, data, "--max_seq_len", "40", "--batch_size", "4",
                                                  "--num_workers", "0"), tmp_path)
    assert f"note: 3 of 11 pairs in {data} (lines 2, 5, 9)" in result.stdout + result.stderr
    steps = [r for r in metrics_of(tmp_path, "dpo_32") if "pairs_beyond_max_seq_len" in r]
    assert len(steps) == 3 and sum(r["pairs_beyond_max_seq_len"] for r in steps) == 3  # 11 pairs, 4 a step


# ---- GRPO: a prompt keeps its end, and only the text that end needs is tokenized ---------------------

def whole_prompt_end(messages: list[dict], tokenizer, max_prompt_len: int) -> list[int]:
    """The prompt's ids computed the old way: rendered, tokenized whole, then its last max_prompt_len kept."""
    ids, _ = ChatEncoder(tokenizer).encode(render_segments(messages, add_generation_prompt=True))
    return ids[-max_prompt_len:]


@pytest.mark.parametrize("text", [name for name in LONG_TEXTS if name != "one-letter"])  # (one word: cut inside it)
def test_a_long_grpo_prompt_keeps_the_end_of_its_whole_text_tokenized(tmp_path, tokenizer, text):
    long_system = [{"role": "system", "content": LONG_TEXTS[text]}]  # a long start, cut away, before the question
    records = [question("short one", "a"), question(LONG_TEXTS[text], "a"), question("3+4?", "7", long_system),
               question(LONG_TEXTS[text][:5000] + " 3+4?", "7", long_system)]
    path = write_jsonl(tmp_path / "prompts.jsonl", records)
    for max_prompt_len in (16, 64):
        dataset = GRPODataset(path, tokenizer, max_prompt_len, reward_functions("answer"))
        for i, record in enumerate(records):
            ids = whole_prompt_end(record["conversations"][:-1], tokenizer, max_prompt_len)
            assert all(torch.equal(got, expected) for got, expected in zip(dataset[i], _pad(ids, ids, max_prompt_len)))
        assert dataset.cut.tolist() == [1, 2, 3]  # (the note's count)


class Recording:
    """The real tokenizer, recording how many characters each text it is handed to encode has."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def encode_batch(self, texts, *args, **kwargs):
        self.lengths += [len(text) for text in texts]
        return self.tokenizer.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_10_mb_grpo_prompt_hands_the_tokenizer_only_the_end_it_keeps(tmp_path, tokenizer, monkeypatch):
    """Tokenized whole, a 52 MB prompt took 185 s for every step that drew it: the prompt is rendered, and its
    end, some 6,000 characters at 64 tokens, is all the tokenizer sees, when the file is opened and when read."""
    import dataset.chat_format as chat_format
    recorders = []
    monkeypatch.setattr(chat_format, "text_only_copy", lambda t: recorders.append(Recording(text_only_copy(t))) or
                        recorders[-1])
    text = (DEMO_TEXT * (10_000_000 // len(DEMO_TEXT) + 1))[:10_000_000] + " What is 3+4?"
    path = write_jsonl(tmp_path / "prompts.jsonl", [question("short one", "a"), question(text, "7")])
    dataset = GRPODataset(path, tokenizer, 64, reward_functions("answer"))
    input_ids, labels = dataset[1]
    assert (labels != IGNORE_INDEX).all()  # the window is full: nothing padded
    assert dataset.encoder.decode(input_ids.tolist()).endswith("What is 3+4?\nassistant\n")
    (recorder,) = recorders
    assert recorder.lengths and max(recorder.lengths) <= chars_for_tokens(65, tokenizer) < 7000  # (65: the scan)


def long_prompts(path: Path) -> Path:
    """11 prompts; those on lines 2, 5 and 9 have 120 tokens or so, the others some 15."""
    records = sum_questions(11)
    for line in (2, 5, 9):
        records[line - 1] = question("What is " + " plus ".join(str(n) for n in range(30)) + "?", "435")
    return write_jsonl(path, records)


def test_grpo_says_at_start_how_many_prompts_are_cut_and_where(tmp_path, tokenizer):
    path = long_prompts(tmp_path / "prompts.jsonl")
    notes = []
    dataset = GRPODataset(path, tokenizer, 40, reward_functions("answer"), log=notes.append)
    assert dataset.cut.tolist() == [1, 4, 8] and dataset.count_cut(torch.tensor([0, 1, 8, 9])) == 2
    assert notes == [f"note: 3 of 11 prompts in {path} (lines 2, 5, 9) are longer than the 40 tokens --max_seq_len "
                     f"leaves beside --max_completion_len: cut from the left, each keeps its end (the question and "
                     f"the generation header). Raise --max_seq_len, lower --max_completion_len, or shorten those "
                     f"prompts"]
    notes.clear()
    assert GRPODataset(path, tokenizer, 200, reward_functions("answer"), log=notes.append).cut.tolist() == []
    assert notes == []


def test_a_room_every_grpo_prompt_is_longer_than_is_refused_naming_the_shortest(tmp_path, tokenizer):
    """--max_completion_len 63 beside --max_seq_len 64 cut every prompt to its last token ("\\n"), and the run
    trained on nothing it was asked, exit 0."""
    path = long_prompts(tmp_path / "prompts.jsonl")
    shortest = min(len(whole_prompt_end(r["conversations"][:-1], tokenizer, 10**6)) for r in sum_questions(11))
    with pytest.raises(DataFileError) as refused:
        GRPODataset(path, tokenizer, 1, reward_functions("answer"))
    assert str(refused.value) == (
        f"{path}: each of its 11 prompts is longer than the 1 token --max_seq_len leaves beside --max_completion_len "
        f"(the shortest, line 1, has {shortest}): each would be cut to its end, and the run would train on nothing "
        f"it was asked. Make --max_seq_len at least {shortest} more than --max_completion_len")
    assert 0 not in GRPODataset(path, tokenizer, shortest, reward_functions("answer")).cut  # as the line says: it fits

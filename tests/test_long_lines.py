"""Lines longer than training can use: cut before they are tokenized, and DPO pairs the cut leaves without an
answer said at start and counted in the metrics.

A text is cut to max_seq_len tokens. Tokenizing a 60 MB line whole to keep its first few hundred tokens took
minutes for every step that drew it; model/tokenizer.text_for_tokens keeps only what those tokens need, and
the items are those of the whole text tokenized. A DPO pair whose prompt fills max_seq_len keeps no answer
token, so the loss leaves it out: DPODataset finds such pairs when the file is opened and says so in one line.
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
from dataset.lm_dataset import IGNORE_INDEX, PretrainDataset, SFTDataset, _pad
from model.tokenizer import BOS_ID, DEFAULT_TOKENIZER, EOS_ID, load_tokenizer, longest_token_chars, text_for_tokens
from test_dpo import pair, sum_pairs, write_jsonl, write_reference

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

"""Bits per byte: validation's number that compares across tokenizers (trainer/hardening/tracking.py:
validation_loss, model/tokenizer.py: token_byte_lengths), in the trainer's files and in eval_model.py.

Two "models" here are constructions with a known loss, not language models: ByteOracle gives each next
token the probability a fixed byte distribution gives its bytes, so the nats of a text are the same
however a tokenizer cuts it.
"""

from __future__ import annotations

import json
import math
import random
import re
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import eval_model
from conftest import REPO, TINY_MODEL, metrics_of, resume_file, run_args, train
from dataset.chat_format import render_segments
from dataset.lm_dataset import PretrainDataset, SFTDataset
from model.model import CausalLM, LMConfig
from model.tokenizer import BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN, SPECIAL_TOKENS, load_tokenizer, token_byte_lengths
from trainer.hardening.tracking import validation_loss
from trainer.train_tokenizer import train_tokenizer

CPU = torch.device("cpu")


def byte_of_character() -> dict[str, int]:
    """GPT-2's ByteLevel alphabet, read backwards: the byte each of its 256 characters stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


class ByteOracle(torch.nn.Module):
    """Gives the token at each next position probability `prob[token]` and spreads the rest over the other
    tokens. It reads the next input to do so (in pretraining the labels are the inputs): not a model that
    could generate, but one whose loss on each token is known, -ln prob[token]."""

    def __init__(self, prob: torch.Tensor):
        super().__init__()
        self.register_buffer("log_prob", prob.double().log())

    def forward(self, input_ids, labels=None, loss_reduction="mean"):
        upcoming = F.pad(input_ids[:, 1:], (0, 1))  # the token position t's prediction is scored on
        chosen = self.log_prob[upcoming]
        others = torch.log1p(-chosen.exp()) - math.log(self.log_prob.numel() - 1)
        logits = others.unsqueeze(-1).repeat(1, 1, self.log_prob.numel())
        logits.scatter_(-1, upcoming.unsqueeze(-1), chosen.unsqueeze(-1))  # softmax: exactly prob at the token
        targets = F.pad(labels[:, 1:], (0, 1), value=-100).flatten()
        loss = F.cross_entropy(logits.flatten(0, 1), targets, reduction="none").view(labels.shape)
        assert loss_reduction == "none"  # what validation_loss asks for
        return SimpleNamespace(loss=loss)


def write_texts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return path


def test_token_bytes_and_bits_per_byte_by_hand_on_a_tiny_text(tmp_path):
    # A byte-level BPE with one merge, Ã + © -> "é" (2 bytes): "héé" is h, é, é = 1 + 2 + 2 bytes.
    alphabet = sorted(byte_of_character())
    vocab = {**SPECIAL_TOKENS, **{c: 3 + i for i, c in enumerate(alphabet)}, "Ã©": 3 + len(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab, [("Ã", "©")]))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.add_tokens(["<think>"])  # a chat tag: it stands for its 7 bytes of text
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    h, e, think = tokenizer.token_to_id("h"), tokenizer.token_to_id("Ã©"), tokenizer.token_to_id("<think>")
    assert tokenizer.encode("héé").ids == [h, e, e]
    lengths = token_byte_lengths(tokenizer)
    assert (lengths[h], lengths[e], lengths[think], lengths[BOS_ID], lengths[EOS_ID]) == (1, 2, 7, 0, 0)
    assert lengths[tokenizer.token_to_id("Ã")] == 1  # half of "é": one byte, though it decodes alone to U+FFFD

    # The model gives h 1/2, é 1/4, EOS 1/8: 1 + 2 + 2 + 3 bits over the 4 targets (BOS is only an input).
    prob = torch.full((tokenizer.get_vocab_size(),), 1e-3)
    prob[h], prob[e], prob[EOS_ID] = 1 / 2, 1 / 4, 1 / 8
    dataset = PretrainDataset(write_texts(tmp_path / "tiny.jsonl", ["héé"]), tokenizer, max_seq_len=8)
    result = validation_loss(ByteOracle(prob), dataset, 4, CPU, nullcontext())
    assert (result.tokens, result.text_bytes) == (4, 5)
    assert result.loss == pytest.approx(8 * math.log(2) / 4)  # all 4 targets: 8 bits, in nats, per token
    assert result.bpb == pytest.approx((1 + 2 + 2) / 5)  # EOS is no text: its 3 bits are left out


def test_two_tokenizers_give_far_apart_losses_per_token_and_the_same_bits_per_byte(tmp_path):
    rng = random.Random(0)
    letters, weights = ["a", "b", "c", " ", "é", "中"], [8, 4, 2, 3, 2, 1]
    texts = ["".join(rng.choices(letters, weights, k=60)) for _ in range(30)]
    data = write_texts(tmp_path / "text.jsonl", texts)
    raw = "".join(texts).encode("utf-8")
    p = {b: raw.count(b) / len(raw) for b in set(raw)}  # the text's own byte distribution
    bits_of_text = -sum(math.log2(p[b]) for b in raw) / len(raw)  # what any tokenization must give

    results = {}
    for name, vocab_size in (("bytes", 11 + 256), ("merged", 700)):  # no merge at all; hundreds of merges
        path = tmp_path / f"{name}.json"
        train_tokenizer([data], vocab_size, split_chinese_chars=False).save(str(path))
        tokenizer = load_tokenizer(path)
        byte, added = byte_of_character(), tokenizer.get_added_tokens_decoder()
        prob = torch.full((tokenizer.get_vocab_size(),), 1e-9)  # (tokens of bytes the text lacks never come)
        for token, token_id in tokenizer.get_vocab().items():  # a token's probability: that of its bytes
            if token_id not in added and all(byte[c] in p for c in token):
                prob[token_id] = math.prod(p[byte[c]] for c in token)
        prob[EOS_ID] = 0.5
        dataset = PretrainDataset(data, tokenizer, max_seq_len=256)
        results[name] = validation_loss(ByteOracle(prob), dataset, 8, CPU, nullcontext())
        assert results[name].text_bytes == len(raw)  # every byte counted, once: no text cut at max_seq_len

    bytes_, merged = results["bytes"], results["merged"]
    print(f"loss per token: {bytes_.loss:.4f} (bytes, {bytes_.tokens} tokens), {merged.loss:.4f} (merged, "
          f"{merged.tokens} tokens); bits per byte: {bytes_.bpb:.6f}, {merged.bpb:.6f}; the text's {bits_of_text:.6f}")
    assert bytes_.tokens > 2 * merged.tokens and merged.loss > 2 * bytes_.loss  # far apart
    assert bytes_.bpb == pytest.approx(bits_of_text, rel=1e-6) and merged.bpb == pytest.approx(bits_of_text, rel=1e-6)


def test_sft_bits_per_byte_count_the_answers_and_tags_not_the_chatml_tokens(tmp_path):
    records = [json.loads(line) for line in (REPO / "dataset" / "sft_demo.jsonl").read_text(encoding="utf-8")
               .splitlines()[:6]]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    model = CausalLM(LMConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                              vocab_size=tokenizer.get_vocab_size()))
    result = validation_loss(model, SFTDataset(path, tokenizer, 512), 4, CPU, nullcontext())
    # The answers' text as rendered (think blocks and their tags included), without <|im_end|>
    answers = [s.text for r in records for s in render_segments(r["conversations"])
               if s.trained and s.text not in (BOS_TOKEN, EOS_TOKEN)]
    assert "<think>" in answers and result.text_bytes == sum(len(t.encode("utf-8")) for t in answers)
    assert math.isfinite(result.bpb) and result.bpb > 0 and model.training  # left in the mode it was in


def nats(model: CausalLM, ids: list[int], score_eos: bool) -> float:
    """The summed loss of `model` on the tokens after the first of `ids`, the last (EOS) only if `score_eos`."""
    labels = torch.tensor([ids if score_eos else [*ids[:-1], -100]])
    with torch.no_grad():
        return model(torch.tensor([ids]), labels=labels, loss_reduction="sum").loss.item()


def expected_numbers(model: CausalLM, tokenizer: Tokenizer, texts: list[str]) -> tuple[float, float]:
    """(loss per token, bits per byte) of `model` on pretraining `texts`, from each text's UTF-8 bytes."""
    documents = [[BOS_ID, *tokenizer.encode(t).ids, EOS_ID] for t in texts]
    loss = sum(nats(model, d, True) for d in documents) / sum(len(d) - 1 for d in documents)
    bits = sum(nats(model, d, False) for d in documents) / math.log(2)
    return loss, bits / sum(len(t.encode("utf-8")) for t in texts)


def test_trainer_and_eval_model_report_the_loss_sum_over_ln2_over_the_bytes(tmp_path, pretrain_data, capsys):
    tokenizer = load_tokenizer()
    lines = pretrain_data.read_text(encoding="utf-8").splitlines()
    texts = [t for t in (json.loads(line)["text"] for line in lines) if len(tokenizer.encode(t).ids) + 2 <= 48][:5]
    assert len(texts) == 5  # short enough for TINY_MODEL's --max_seq_len 48: no text is cut
    val = write_texts(tmp_path / "val.jsonl", texts)
    train("train_pretrain.py", None, run_args(tmp_path, pretrain_data, "--batch_size", "4", "--max_steps", "2",
                                              "--val_data", str(val), "--eval_interval", "1"), tmp_path)
    validations = [r for r in metrics_of(tmp_path) if "val/loss" in r]
    assert [r["step"] for r in validations] == [1, 2] and all("val/bpb" in r for r in validations)

    argv = ["--weight", "pretrain", *TINY_MODEL[:TINY_MODEL.index("--max_seq_len")], "--save_dir",
            str(tmp_path / "out"), "--device", "cpu", "--max_seq_len", "48"]
    model = eval_model.load_model(eval_model.build_arg_parser().parse_args(argv), tokenizer, CPU)  # FP16 file
    fp16_loss, fp16_bpb = expected_numbers(model, tokenizer, texts)
    model.load_state_dict(resume_file(tmp_path)["model"])  # the FP32 weights the trainer validated at step 2
    loss, bpb = expected_numbers(model, tokenizer, texts)
    assert validations[-1]["val/loss"] == pytest.approx(loss, rel=1e-5)
    assert validations[-1]["val/bpb"] == pytest.approx(bpb, rel=1e-5) and bpb != pytest.approx(loss / math.log(2))

    assert eval_model.main([*argv, "--bpb_data", str(val)]) == 0
    printed = re.search(r": (\S+) bits per byte \((\d+) bytes of text\), loss (\S+) per token",
                        capsys.readouterr().out)
    assert float(printed[1]) == pytest.approx(fp16_bpb, abs=1e-4) and float(printed[3]) == pytest.approx(
        fp16_loss, abs=1e-4)
    assert int(printed[2]) == sum(len(t.encode("utf-8")) for t in texts)
    assert eval_model.main([*argv, "--bpb_data", str(tmp_path / "missing.jsonl")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [f"error: --bpb_data {tmp_path / 'missing.jsonl'}: no such file"]

"""The committed tokenizer and the script that trains it."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dataset.chat_format import render_chat_text
from model.tokenizer import QWEN2_PATTERN, SPECIAL_TOKENS, load_tokenizer

from conftest import REPO
TOKENIZER_PATH = REPO / "model" / "tokenizer.json"


def test_committed_tokenizer_has_special_tokens_at_fixed_ids():
    tokenizer = load_tokenizer(TOKENIZER_PATH)
    for token, token_id in SPECIAL_TOKENS.items():
        assert tokenizer.token_to_id(token) == token_id
    assert tokenizer.get_vocab_size() <= 6400


@pytest.mark.parametrize("text", [
    "Hello, world! The capital of Peru is Lima.",
    "秘鲁的首都是利马。你好，世界！",
    "mixed 中英 text with emoji 🙂🚀 and  two spaces\n\tand a tab",
    "  leading spaces, unseen characters: ß, Ω, 鬱, 𝔘",
])
def test_any_text_round_trips(text):
    tokenizer = load_tokenizer(TOKENIZER_PATH)
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_no_special_tokens_are_added_automatically():
    tokenizer = load_tokenizer(TOKENIZER_PATH)
    ids = tokenizer.encode("hello").ids
    assert not set(ids) & set(SPECIAL_TOKENS.values())


def test_chinese_characters_are_not_merged_into_phrases():
    tokenizer = load_tokenizer(TOKENIZER_PATH)
    assert len(tokenizer.encode("秘鲁的首都是哪里").ids) == 8


def test_load_tokenizer_names_a_missing_special_token(tmp_path):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(["some text to learn from"], trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    with pytest.raises(ValueError, match=r"<\|im_end\|>") as excinfo:
        load_tokenizer(path)
    assert str(path) in str(excinfo.value)
    assert "expected id 2" in str(excinfo.value)


def run_train_tokenizer(corpus: Path, out: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "trainer" / "train_tokenizer.py"),
                    "--data", str(corpus), "--vocab_size", "300", "--out", str(out)],
                   check=True, capture_output=True, cwd=out.parent)


def test_train_tokenizer_script_writes_the_same_loadable_tokenizer_every_time(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"Line {i}: the cat says meow. 猫的叫声是喵喵。"},
                               ensure_ascii=False) + "\n")
        f.write(json.dumps({"conversations": [{"role": "user", "content": "2+2?"},
                                              {"role": "assistant", "content": "4"}]}) + "\n")
    run_train_tokenizer(corpus, tmp_path / "first.json")
    run_train_tokenizer(corpus, tmp_path / "second.json")
    tokenizer = load_tokenizer(tmp_path / "first.json")
    assert 259 <= tokenizer.get_vocab_size() <= 300  # 256 bytes + 3 special tokens + merges
    assert tokenizer.decode(tokenizer.encode("the cat 猫").ids) == "the cat 猫"
    assert (tmp_path / "first.json").read_bytes() == (tmp_path / "second.json").read_bytes()


def demo_texts() -> list[str]:
    """Every text of the committed demo data, as the trainers feed it to the tokenizer."""
    texts = []
    for path in sorted((REPO / "dataset").glob("*_demo*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if "text" in record:
                texts.append(record["text"])
            for key in ("conversations", "chosen", "rejected"):
                if key in record:
                    texts.append(render_chat_text(record[key]))
    return texts


def test_the_committed_tokenizer_splits_with_qwen2s_regex_alone_and_keeps_each_chinese_character_one_token():
    # The file's pre-tokenizer must be exactly Qwen2's (the one llama.cpp runs for tokenizer.ggml.pre
    # "qwen2"); the Chinese-character split used while learning must not be saved with it.
    config = json.loads(TOKENIZER_PATH.read_text(encoding="utf-8"))
    assert config["pre_tokenizer"] == {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    # ...and yet, since BPE learned no merge across two Chinese characters, every Chinese character of
    # the demo data is still a token of its own, and no token holds a Chinese character and anything else.
    tokenizer = load_tokenizer(TOKENIZER_PATH)
    texts = demo_texts()
    assert len(texts) > 10_000
    han = re.compile("[\u3400-\u9fff]")  # the CJK ideograph blocks, which hold every Chinese character here
    for text in texts:
        pieces = [tokenizer.decode([i]) for i in tokenizer.encode(text).ids]
        chinese = [piece for piece in pieces if han.search(piece)]
        assert all(len(piece) == 1 for piece in chinese), (text, chinese)
        assert len(chinese) == len(han.findall(text)), text
    # Qwen2's rules: one token per digit, "\n\n" kept whole before Chinese and after a chat tag.
    assert tokenizer.encode("2024").tokens == ["2", "0", "2", "4"]
    assert tokenizer.encode("<think>\n\n</think>\n\n巴黎").tokens == ["<think>", "ĊĊ", "</think>", "ĊĊ", "å·´", "é»İ"]

"""Train the byte-level BPE tokenizer (model/tokenizer.json) on JSONL data.

    python trainer/train_tokenizer.py
    python trainer/train_tokenizer.py --data dataset/pretrain_demo.jsonl dataset/sft_demo.jsonl \
        --vocab_size 6400 --out model/tokenizer.json

Byte-level means the base alphabet is the 256 byte values, so any UTF-8 text
(Chinese, emoji, code) can be encoded and decodes back to exactly the same string;
merges learned from the data make frequent byte sequences single tokens.

The vocabulary holds at most --vocab_size tokens: BPE stops early when the data has no
pair left to merge (the demo corpus is a small closed world), and the model's
vocab_size only has to be at least the tokenizer's.

Text is split before BPE with Qwen2's pre-tokenizer regex (words, single digits, punctuation,
whitespace), which llama.cpp implements exactly under the name "qwen2": a GGUF of the model
(scripts/export_gguf.py) then tokenizes every text with the same ids as training.

Chinese: by default (--split_chinese_chars 1) every Chinese character is a token of its
own, which suits the tiny demo world. For a real Chinese corpus pass --split_chinese_chars 0:
BPE then merges frequent character sequences (words, common phrases) into single tokens,
as minimind's tokenizer does, so the same text takes fewer tokens. Either way the saved file
splits text with Qwen2's regex alone (see train_tokenizer below).

The special tokens get the first ids, in this order: <|endoftext|>=0 (padding),
<|im_start|>=1 (begin of text / of a chat message), <|im_end|>=2 (end of both), then the chat
format's tags (<think>, </think>, <tool_call>, ...; see dataset/chat_format.py).
No post-processor adds them: the datasets insert them explicitly where they belong.

Training is deterministic: the same data and vocab size give the same file.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Iterator

import sys

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from dataset.chat_format import TAGS, render_chat_text
from model.tokenizer import QWEN2_PATTERN, SPECIAL_TOKENS as CHATML_IDS
from trainer.trainer_utils import REPO_ROOT

CHATML_TOKENS = sorted(CHATML_IDS, key=CHATML_IDS.get)

# The list order defines the ids: the three ChatML tokens first (model/tokenizer.py checks them when
# loading), then the chat format's tags, so "<think>" or "<tool_call>" costs one token, as in minimind.
SPECIAL_TOKENS = [*CHATML_TOKENS, *TAGS]
SPECIAL_TOKEN = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))


def iter_texts(paths: list[Path]) -> Iterator[str]:
    """Yield the text of pretrain lines ("text") and of SFT messages ("conversations")."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if "text" in record:
                    yield from SPECIAL_TOKEN.split(record["text"])
                elif "conversations" in record:
                    # The text of the turns as training renders them, cut at the tags and ChatML tokens:
                    # BPE learning does not split them out by itself, and "<think>\n\n" learned as one
                    # piece would never merge the "\n\n" that encoding, which does split them, sees.
                    yield from SPECIAL_TOKEN.split(render_chat_text(record["conversations"]))
                else:
                    raise ValueError(f'{path}, line {line_number}: no "text" or "conversations" field')


def train_tokenizer(paths: list[Path], vocab_size: int, split_chinese_chars: bool = True) -> Tokenizer:
    """Learn a byte-level BPE vocabulary of at most ``vocab_size`` tokens from the given files.

    With ``split_chinese_chars`` no token spans two Chinese characters; without it BPE may
    merge frequent Chinese character sequences into one token.
    """
    tokenizer = Tokenizer(models.BPE())
    # Qwen2's split, then bytes mapped to printable symbols (the regex already split, so ByteLevel's own
    # GPT-2 regex is off). add_prefix_space=False keeps decode(encode(s)) == s exactly.
    qwen2_split = [pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    if split_chinese_chars:
        # While learning only: Chinese has no spaces, so Qwen2's regex keeps a clause such as
        # "秘鲁的首都是哪里" one pre-token, and on a small corpus BPE would merge it into a single
        # token that hides its words from the model. Seeing each Chinese character alone, BPE learns
        # no merge across two of them, so the saved tokenizer, splitting with Qwen2's regex alone
        # (what llama.cpp runs), still gives every Chinese character a token of its own.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{Han}"), behavior="isolated"), *qwen2_split])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(qwen2_split)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_texts(paths), trainer=trainer)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(qwen2_split)  # the file's split is exactly Qwen2's
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise RuntimeError(f"{token} got id {tokenizer.token_to_id(token)}, expected {expected_id}")
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, nargs="+",
                        default=[REPO_ROOT / "dataset/pretrain_demo.jsonl",
                                 REPO_ROOT / "dataset/sft_demo.jsonl"],
                        help="JSONL files with pretrain and/or SFT lines")
    parser.add_argument("--vocab_size", type=int, default=6400)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "model/tokenizer.json")
    parser.add_argument("--split_chinese_chars", type=int, default=1, choices=(0, 1),
                        help="1: one token per Chinese character (the demo); 0: BPE may merge Chinese "
                             "characters into words, for a real Chinese corpus")
    args = parser.parse_args()

    tokenizer = train_tokenizer(args.data, args.vocab_size, split_chinese_chars=bool(args.split_chinese_chars))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out))
    sample = "Hello, 世界! 1+2=3 🙂"
    ids = tokenizer.encode(sample).ids
    print(f"saved {args.out}: vocab {tokenizer.get_vocab_size()}, "
          f"{sample!r} -> {len(ids)} tokens, round trip ok: {tokenizer.decode(ids) == sample}")


if __name__ == "__main__":
    main()

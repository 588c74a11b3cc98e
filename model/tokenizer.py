"""The tokenizer contract: three ChatML special tokens at fixed ids, checked when a file is loaded.

Any byte-level `tokenizer.json` works (the demo one from trainer/train_tokenizer.py, minimind's,
one with extra special tokens) as long as it has

    <|endoftext|> = 0   padding, and the end of a pretraining text's window
    <|im_start|>  = 1   the start of a text / of a chat message
    <|im_end|>    = 2   the end of both

The model config (eos/pad ids), the datasets and the Hugging Face export all read these ids from
here, so they are defined once. `text_only_copy` gives the datasets a copy that reads those
tokens' text, written inside the data, as ordinary characters. `token_byte_lengths` says how many
bytes of text each token stands for (validation's bits per byte divides by them).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from tokenizers import Tokenizer, pre_tokenizers

SPECIAL_TOKENS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
PAD_ID, BOS_ID, EOS_ID = (SPECIAL_TOKENS[t] for t in (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN))
DEFAULT_TOKENIZER = Path(__file__).resolve().with_name("tokenizer.json")
CUT_MARGIN_CHARS = 4096  # text_for_tokens keeps this many characters more than twice what its tokens can hold
# Qwen2's pre-tokenizer regex (its tokenizer.json), which trainer/train_tokenizer.py splits text with.
# llama.cpp runs the same regex for a GGUF whose tokenizer.ggml.pre is "qwen2" (src/llama-vocab.cpp,
# with the case-insensitive group spelled out), so scripts/export_gguf.py can promise the same ids.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def check_special_tokens(tokenizer: Tokenizer, path: str | os.PathLike) -> None:
    """Raise ValueError naming `path` unless the three special tokens sit at their ids."""
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for token, expected_id in SPECIAL_TOKENS.items():
        if token not in specials:
            raise ValueError(f"{path}: special token {token!r} is missing (expected id {expected_id}). "
                             "Retrain the tokenizer with trainer/train_tokenizer.py.")
        if specials[token] != expected_id:
            raise ValueError(f"{path}: special token {token!r} has id {specials[token]}, expected "
                             f"{expected_id}. Retrain the tokenizer with trainer/train_tokenizer.py.")


def load_tokenizer(path: str | os.PathLike = DEFAULT_TOKENIZER) -> Tokenizer:
    """Load a `tokenizer.json` and check it has our special tokens at our ids."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"tokenizer not found: {path}. Pass --tokenizer_path, or train one with "
                                f"trainer/train_tokenizer.py")
    tokenizer = Tokenizer.from_file(str(path))
    check_special_tokens(tokenizer, path)
    return tokenizer


def vocab_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of the tokenizer's vocabulary, each token's text in id order (added tokens included): what a
    model's embedding rows and logits mean. Unlike the file's hash it stays the same when the file is re-saved in
    another layout or by another version of the tokenizers library, and a copy has it too."""
    vocab = load_tokenizer(path).get_vocab(with_added_tokens=True)
    by_id = sorted((token_id, token) for token, token_id in vocab.items())
    return hashlib.sha256(json.dumps(by_id, ensure_ascii=False).encode("utf-8")).hexdigest()


def text_only_copy(tokenizer: Tokenizer) -> Tokenizer:
    """A copy that reads every added token's text inside data ("<|im_end|>", "<think>") as characters."""
    config = json.loads(tokenizer.to_str())
    # `encode_special_tokens` only splits tokens marked special; minimind's `<think>` is an unmarked one.
    for added in config["added_tokens"]:
        added["special"] = True
    copy = Tokenizer.from_str(json.dumps(config))
    copy.encode_special_tokens = True
    return copy


@functools.lru_cache(maxsize=4)
def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters of text one token of `tokenizer` stands for: a vocabulary token's length in the
    ByteLevel alphabet (one character a byte, and a character is at least a byte), an added token's content."""
    return max(len(token) for token in tokenizer.get_vocab(with_added_tokens=True))


def text_for_tokens(text: str, max_tokens: int, tokenizer: Tokenizer) -> str:
    """`text`, or as much of its start as its first `max_tokens` tokens need, so that a 60 MB line, cut to a few
    hundred tokens anyway, is not tokenized whole first (minutes for each step that draws it).

    Those tokens stand for at most max_tokens * longest_token_chars characters. Twice that is kept, plus
    CUT_MARGIN_CHARS: a cut changes only the tokens near it (the word it falls in), so the first `max_tokens`
    are those of the whole text, and there are more than `max_tokens` tokens after it (each stands for no more
    than the longest), so what a caller appends after the text (EOS) is cut away as it was. A text shorter
    than that is returned as it is: every line a dataset meets in practice gives exactly the ids it gave before.
    """
    keep = chars_for_tokens(max_tokens, tokenizer)
    return text if len(text) <= keep else text[:keep]


def chars_for_tokens(max_tokens: int, tokenizer: Tokenizer) -> int:
    """How many characters text_for_tokens keeps for `max_tokens` tokens; the same holds of a text's end (a cut
    on the left changes only the tokens near it too), which text_end_for_tokens and ChatEncoder.encode_end keep."""
    return 2 * max_tokens * longest_token_chars(tokenizer) + CUT_MARGIN_CHARS


def text_end_for_tokens(text: str, max_tokens: int, tokenizer: Tokenizer) -> str:
    """`text`, or as much of its end as its last `max_tokens` tokens need: text_for_tokens from the other end,
    for a text cut at the left (a multiple-choice question, an eval prompt, as lm-eval cuts a context). The
    same length is kept, for the same reason: a cut changes only the tokens of the word it falls in."""
    keep = chars_for_tokens(max_tokens, tokenizer)
    return text if len(text) <= keep else text[len(text) - keep:]


@functools.lru_cache(maxsize=4)
def token_byte_lengths(tokenizer: Tokenizer) -> tuple[int, ...]:
    """For each token id, how many bytes of UTF-8 text the token stands for.

    A vocabulary token of a byte-level tokenizer is written in the ByteLevel alphabet, one character per
    byte (GPT-2's mapping of the 256 bytes to printable characters), so its length in characters is its
    length in bytes, also for a token that holds part of a character ("中" is 3 bytes, maybe 3 tokens);
    decoding it alone would not do: the decoder turns a partial character into U+FFFD, 3 bytes. An added
    token (a chat tag such as <think>) stands for its text, as written in the rendered chat: the bytes of
    its content, as a tokenizer without that token would spell it. The three ChatML tokens count 0: they
    mark where a text or a message starts and ends (every tokenizer here has them, at the same places),
    they are not text of the file. Raises ValueError for a tokenizer that is not byte-level.
    """
    config = json.loads(tokenizer.to_str())
    if (config.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError("bits per byte needs a byte-level tokenizer (its decoder is ByteLevel, as "
                         "trainer/train_tokenizer.py makes it); this one has decoder "
                         f"{(config.get('decoder') or {}).get('type')}")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab, added = tokenizer.get_vocab(with_added_tokens=True), tokenizer.get_added_tokens_decoder()
    lengths = [0] * (max(vocab.values()) + 1)
    for token, token_id in vocab.items():
        if token_id in added:
            lengths[token_id] = 0 if token in SPECIAL_TOKENS else len(token.encode("utf-8"))
        elif set(token) <= alphabet:
            lengths[token_id] = len(token)
        else:
            raise ValueError(f"token {token_id} ({token!r}) is not written in the ByteLevel alphabet; bits per "
                             f"byte needs a byte-level tokenizer")
    return tuple(lengths)

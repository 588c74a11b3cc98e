"""The tokenizer contract: three ChatML special tokens at fixed ids, checked when a file is loaded.

Any byte-level `tokenizer.json` works (the demo one from trainer/train_tokenizer.py, minimind's,
one with extra special tokens) as long as it has

    <|endoftext|> = 0   padding, and the end of a pretraining text's window
    <|im_start|>  = 1   the start of a text / of a chat message
    <|im_end|>    = 2   the end of both

The model config (eos/pad ids), the datasets and the Hugging Face export all read these ids from
here, so they are defined once. `text_only_copy` gives the datasets a copy that reads those
tokens' text, written inside the data, as ordinary characters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer

SPECIAL_TOKENS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
PAD_ID, BOS_ID, EOS_ID = (SPECIAL_TOKENS[t] for t in (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN))
DEFAULT_TOKENIZER = Path(__file__).resolve().with_name("tokenizer.json")


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


def text_only_copy(tokenizer: Tokenizer) -> Tokenizer:
    """A copy that reads every added token's text inside data ("<|im_end|>", "<think>") as characters."""
    config = json.loads(tokenizer.to_str())
    # `encode_special_tokens` only splits tokens marked special; minimind's `<think>` is an unmarked one.
    for added in config["added_tokens"]:
        added["special"] = True
    copy = Tokenizer.from_str(json.dumps(config))
    copy.encode_special_tokens = True
    return copy

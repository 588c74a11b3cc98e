"""JSONL datasets for pretraining and supervised fine-tuning (SFT).

Data formats, one JSON object per line:

    pretrain: {"text": "..."}
    SFT:      {"conversations": [{"role": "user", "content": "..."},
                                 {"role": "assistant", "content": "..."}]}

Every item is a pair ``(input_ids, labels)`` of length ``max_seq_len``. Labels are
aligned with the inputs (the model shifts them by one internally) and are -100
wherever no loss should be taken: padding, and for SFT everything that is not an
assistant answer.

Files are indexed by byte offset and parsed lazily, so memory does not grow with the
amount of text; every line is still checked once up front, so a broken line stops a
run before training starts rather than hours into it.
"""

from __future__ import annotations

import json
import os
from array import array
from typing import Any, Callable

import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

SPECIAL_TOKENS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
PAD_ID = SPECIAL_TOKENS["<|endoftext|>"]
BOS_ID = SPECIAL_TOKENS["<|im_start|>"]
EOS_ID = SPECIAL_TOKENS["<|im_end|>"]
IGNORE_INDEX = -100  # the default ignore_index of torch.nn.functional.cross_entropy
CHAT_ROLES = ("system", "user", "assistant")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a ``tokenizer.json`` and check it has our special tokens at our ids."""
    tokenizer = Tokenizer.from_file(str(path))
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for token, expected_id in SPECIAL_TOKENS.items():
        if token not in specials:
            raise ValueError(
                f"{path}: special token {token!r} is missing (expected id {expected_id}). "
                "Retrain the tokenizer with trainer/train_tokenizer.py."
            )
        if specials[token] != expected_id:
            raise ValueError(
                f"{path}: special token {token!r} has id {specials[token]}, expected "
                f"{expected_id}. Retrain the tokenizer with trainer/train_tokenizer.py."
            )
    return tokenizer


def format_chatml(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render messages as ChatML text, optionally opening an assistant turn at the end."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    if add_generation_prompt:
        text += "<|im_start|>assistant\n"
    return text


class JsonlFile:
    """Random access to the non-empty lines of a JSONL file, each parsed on demand.

    Construction reads the file once: it records where each non-empty line starts,
    checks that it is a JSON object and, if given, runs ``validate(record)``, which
    should raise ValueError describing the problem. Only two int64 arrays are kept.
    """

    def __init__(self, path: str | os.PathLike, validate: Callable[[dict], None] | None = None):
        self.path = str(path)
        self.file_size = os.path.getsize(self.path)
        self._offsets = array("q")
        self._line_numbers = array("q")
        with open(self.path, "rb") as f:
            offset = 0
            for line_number, line in enumerate(f, start=1):
                if line.strip():
                    record = self._parse(line, line_number)
                    if validate is not None:
                        try:
                            validate(record)
                        except ValueError as e:
                            raise self._error(line_number, str(e)) from None
                    self._offsets.append(offset)
                    self._line_numbers.append(line_number)
                offset += len(line)
        self._handle = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return len(self._offsets)

    def line_number(self, i: int) -> int:
        """The 1-based line number in the file of record ``i``."""
        return self._line_numbers[i]

    def raw_line(self, i: int) -> bytes:
        """The bytes of record ``i`` as stored, without the trailing newline."""
        # A handle opened by a parent process shares its file position with the
        # children after fork, so each process opens its own.
        if self._handle is None or self._pid != os.getpid():
            self._handle = open(self.path, "rb")
            self._pid = os.getpid()
        self._handle.seek(self._offsets[i])
        return self._handle.readline().rstrip(b"\r\n")

    def read(self, i: int) -> dict[str, Any]:
        """Parse record ``i``."""
        return self._parse(self.raw_line(i), self.line_number(i))

    def __getstate__(self) -> dict[str, Any]:
        # Open files cannot be pickled (DataLoader workers under spawn); reopen lazily.
        state = self.__dict__.copy()
        state["_handle"], state["_pid"] = None, None
        return state

    def _parse(self, line: bytes, line_number: int) -> dict[str, Any]:
        try:
            record = json.loads(line)
        except ValueError as e:  # also covers bytes that are not valid UTF-8
            raise self._error(line_number, f"invalid JSON ({e})") from None
        if not isinstance(record, dict):
            raise self._error(line_number, f"expected a JSON object, got {type(record).__name__}")
        return record

    def _error(self, line_number: int, problem: str) -> ValueError:
        return ValueError(
            f"{self.path}, line {line_number}: {problem}. "
            "Fix or delete this line, then start again."
        )


def _check_pretrain_record(record: dict) -> None:
    if not isinstance(record.get("text"), str):
        raise ValueError('expected a string field "text", e.g. {"text": "..."}')


def _check_sft_record(record: dict) -> None:
    conversation = record.get("conversations")
    if not isinstance(conversation, list):
        raise ValueError('expected a list field "conversations" of {"role", "content"} messages')
    for n, message in enumerate(conversation, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f'message {n} needs string fields "role" and "content"')
        if message["role"] not in CHAT_ROLES:
            raise ValueError(f"message {n} has unknown role {message['role']!r}; "
                             f"allowed roles are {', '.join(CHAT_ROLES)}")
    if not any(m["role"] == "assistant" for m in conversation):
        raise ValueError("the conversation has no assistant message, so nothing to learn from")


def _text_only_copy(tokenizer: Tokenizer) -> Tokenizer:
    """A copy that reads "<|im_end|>" inside data as plain characters, not as a special token.

    Datasets insert special ids themselves, so text that happens to contain such a
    string cannot break the ChatML structure or the loss mask.
    """
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = True
    return copy


def _pad(ids: list[int], labels: list[int], max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut to max_seq_len, then pad; padding is PAD_ID in the inputs and ignored in the labels."""
    ids, labels = ids[:max_seq_len], labels[:max_seq_len]
    n_pad = max_seq_len - len(ids)
    return (torch.tensor(ids + [PAD_ID] * n_pad, dtype=torch.long),
            torch.tensor(labels + [IGNORE_INDEX] * n_pad, dtype=torch.long))


class PretrainDataset(Dataset):
    """Plain text: ``[BOS] + tokens + [EOS]``, cut to ``max_seq_len`` and padded.

    A text longer than ``max_seq_len`` loses its end, EOS included: the model should
    not learn that text stops wherever the window happens to end.
    """

    def __init__(self, data_path: str | os.PathLike, tokenizer: Tokenizer, max_seq_len: int):
        self.source = JsonlFile(data_path, validate=_check_pretrain_record)
        self.tokenizer = _text_only_copy(tokenizer)
        self.max_seq_len = max_seq_len

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        text = self.source.read(i)["text"]
        ids = [BOS_ID] + self.tokenizer.encode(text).ids + [EOS_ID]
        return _pad(ids, list(ids), self.max_seq_len)


class SFTDataset(Dataset):
    """Conversations rendered as ChatML; the loss is taken only on what the assistant says.

    Each message becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. The ids are
    built piece by piece so we know exactly which positions belong to assistant
    content: those and the assistant's ``<|im_end|>`` (so the model learns to stop)
    get labels; headers, system and user messages, the trailing newline and padding
    get -100.
    """

    def __init__(self, data_path: str | os.PathLike, tokenizer: Tokenizer, max_seq_len: int):
        self.source = JsonlFile(data_path, validate=_check_sft_record)
        self.tokenizer = _text_only_copy(tokenizer)
        self.max_seq_len = max_seq_len
        self._newline_ids = self.tokenizer.encode("\n").ids
        self._header_ids = {role: [BOS_ID] + self.tokenizer.encode(f"{role}\n").ids
                            for role in CHAT_ROLES}

    def __len__(self) -> int:
        return len(self.source)

    def encode_conversation(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """Token ids and labels (not cut or padded) for one conversation."""
        ids: list[int] = []
        labels: list[int] = []
        for message in messages:
            header = self._header_ids[message["role"]]
            body = self.tokenizer.encode(message["content"]).ids + [EOS_ID]
            ids += header + body + self._newline_ids
            labels += [IGNORE_INDEX] * len(header)
            labels += body if message["role"] == "assistant" else [IGNORE_INDEX] * len(body)
            labels += [IGNORE_INDEX] * len(self._newline_ids)
        return ids, labels

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels = self.encode_conversation(self.source.read(i)["conversations"])
        return _pad(ids, labels, self.max_seq_len)

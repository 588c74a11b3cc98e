"""JSONL datasets for pretraining and supervised fine-tuning (SFT).

Data formats, one JSON object per line:

    pretrain: {"text": "..."}
    SFT:      {"conversations": [{"role": "user", "content": "..."},
                                 {"role": "assistant", "content": "..."}]}
              (minimind's full schema: system tools, reasoning_content, tool_calls and the
              tool role are described in dataset/chat_format.py)

Every item is a pair ``(input_ids, labels)`` of length ``max_seq_len``. Labels are
aligned with the inputs (the model shifts them by one internally) and are -100
wherever no loss should be taken: padding, and for SFT everything that is not an
assistant answer.

PackedPretrainDataset (``--pack 1``) joins the texts into one stream and cuts it into full
windows instead: no padding, every position carries loss.

Files are indexed by byte offset and parsed lazily, so memory does not grow with the
amount of text; every line is still checked once up front, so a broken line stops a
run before training starts rather than hours into it. Each read checks the record again
against the index (dataset/jsonl_file.py), so a file edited under a running trainer stops
it with a line saying so, not with a KeyError from a record that changed.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from dataset.chat_format import ChatEncoder, parse_conversation, render_segments
from dataset.jsonl_file import DataFileError, JsonlFile, collective_device

from model.tokenizer import BOS_ID, EOS_ID, PAD_ID, text_for_tokens, text_only_copy

IGNORE_INDEX = -100  # the default ignore_index of torch.nn.functional.cross_entropy
# For SFTDataset's optional system-prompt augmentation (minimind adds one to some conversations
# so that the model answers the same with or without a system message).
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a small language model. Answer accurately and briefly.",
    "You are a friendly assistant. Read the question carefully, then answer it.",
    "You are a knowledgeable assistant; give correct and useful answers.",
    "Answer the user's question as well as you can.",
    "你是一个乐于助人的助手。",
    "你是一个小型语言模型，请准确、简洁地回答。",
    "你是一个友好的助手，请认真读题后再回答。",
    "你是一个知识丰富的助手，请给出正确而有用的回答。",
    "请尽力回答用户的问题。",
)


def _check_pretrain_record(record: dict) -> None:
    if not isinstance(record.get("text"), str):
        raise ValueError('expected a string field "text", e.g. {"text": "..."}')


def _check_sft_record(record: dict) -> None:
    """The checks of dataset/chat_format.parse_conversation, and at least one assistant turn."""
    conversation = parse_conversation(record.get("conversations"))
    if not any(m["role"] == "assistant" for m in conversation.messages):
        raise ValueError("the conversation has no assistant message, so nothing to learn from")


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
        self.source = JsonlFile.shared(data_path, validate=_check_pretrain_record)
        self.tokenizer = text_only_copy(tokenizer)
        self.max_seq_len = max_seq_len

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Only as much text as max_seq_len tokens need is tokenized: the same ids, also for a 60 MB line.
        text = text_for_tokens(self.source.read(i)["text"], self.max_seq_len, self.tokenizer)
        ids = [BOS_ID] + self.tokenizer.encode(text).ids + [EOS_ID]
        return _pad(ids, list(ids), self.max_seq_len)


class PackedPretrainDataset(Dataset):
    """Plain text packed: ``[BOS] doc0 [EOS] [BOS] doc1 [EOS] ...`` cut into full ``max_seq_len`` windows.

    Sample ``i`` is positions ``[i * max_seq_len, (i + 1) * max_seq_len)`` of that stream, with
    labels equal to the inputs everywhere: no padding, so every position carries loss (the model
    also learns that [BOS] follows [EOS]). A window may start or end inside a document, and
    attention is not masked at document boundaries, as in GPT-2/nanoGPT-style packing. The tail
    of the stream that does not fill a window is dropped (fewer than ``max_seq_len`` tokens).

    Construction tokenizes every record once and keeps only ``starts``, where each document
    begins in the stream: one int64 per record (8 bytes; the JsonlFile index adds 16), not the
    tokens. ``__getitem__`` re-tokenizes just the documents that overlap window ``i``. The
    windows therefore depend only on the file, the tokenizer and ``max_seq_len``; ``len()`` is
    the number of windows, so the sampler, the data cursor and resume work as for the unpacked
    dataset. The ranks share this pass: each tokenizes its slice of the records, and one all-reduce
    gives every rank all the lengths.
    """

    ENCODE_BATCH = 1024  # records tokenized together in the up-front pass (encode_batch runs them in parallel)

    def __init__(self, data_path: str | os.PathLike, tokenizer: Tokenizer, max_seq_len: int):
        self.source = JsonlFile.shared(data_path, validate=_check_pretrain_record)
        self.tokenizer = text_only_copy(tokenizer)
        self.max_seq_len = max_seq_len
        lengths = self._document_lengths()  # tokens per document, BOS and EOS included
        self.starts = np.concatenate(([0], np.cumsum(lengths)))  # document k is stream[starts[k]:starts[k + 1]]
        self.total_tokens = int(self.starts[-1])
        self.num_windows = self.total_tokens // max_seq_len
        if self.num_windows == 0:
            raise DataFileError(f"{self.source.path}: --pack 1 needs at least --max_seq_len {max_seq_len} tokens "
                                f"for one window, and the file's {len(self.source)} records make {self.total_tokens}. "
                                f"Add text, lower --max_seq_len, or train with --pack 0.")

    def _document_lengths(self) -> np.ndarray:
        """Each rank tokenizes its share of the records (a contiguous slice); one all-reduce (a sum:
        the other ranks' slots are 0) gives every rank all the lengths."""
        count = len(self.source)
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mine = range(rank * count // world_size, (rank + 1) * count // world_size)
        lengths = np.zeros(count, dtype=np.int64)
        for first in range(mine.start, mine.stop, self.ENCODE_BATCH):
            texts = [self.source.read(k)["text"] for k in range(first, min(first + self.ENCODE_BATCH, mine.stop))]
            lengths[first:first + len(texts)] = [len(e.ids) + 2 for e in self.tokenizer.encode_batch(texts)]
        if world_size > 1:
            shared = torch.from_numpy(lengths).to(collective_device())
            dist.all_reduce(shared)
            lengths = shared.cpu().numpy()
        return lengths

    def __len__(self) -> int:
        return self.num_windows

    def document(self, k: int) -> list[int]:
        """Document ``k`` as it appears in the stream: ``[BOS] + tokens + [EOS]``."""
        return [BOS_ID] + self.tokenizer.encode(self.source.read(k)["text"]).ids + [EOS_ID]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.num_windows:
            raise IndexError(f"window {i} of {self.num_windows}")
        begin, end = i * self.max_seq_len, (i + 1) * self.max_seq_len
        # The documents overlapping [begin, end): the one holding `begin` up to the one holding `end - 1`.
        first = int(np.searchsorted(self.starts, begin, side="right")) - 1
        last = int(np.searchsorted(self.starts, end - 1, side="right")) - 1
        ids = [token for k in range(first, last + 1) for token in self.document(k)]
        offset = begin - int(self.starts[first])
        window = torch.tensor(ids[offset:offset + self.max_seq_len], dtype=torch.long)
        return window, window.clone()


class SFTDataset(Dataset):
    """Conversations in minimind's chat format; the loss is taken only on what the assistant writes.

    dataset/chat_format.py renders a conversation as segments and ChatEncoder turns them into
    ids, so the labels cover exactly each assistant turn after its ``<|im_start|>assistant\\n``
    header (think block, answer, tool calls, ``<|im_end|>\\n``); system, user and tool turns,
    headers and padding get -100.

    Two augmentations of minimind's, off by default. Each is drawn from a generator seeded by
    (seed, epoch, sample index), so a resumed run, on any number of ranks, sees the same items:

    - ``system_prompt_ratio``: that share of the conversations without a system message (and
      without tools) gets one of SYSTEM_PROMPTS (minimind uses 0.2);
    - ``drop_empty_think_ratio``: in that share of the conversations, think blocks without
      reasoning are left out, so the model also sees answers without one (minimind uses 0.8).
    """

    def __init__(self, data_path: str | os.PathLike, tokenizer: Tokenizer, max_seq_len: int, *,
                 system_prompt_ratio: float = 0.0, drop_empty_think_ratio: float = 0.0, seed: int = 0):
        for name, ratio in (("system_prompt_ratio", system_prompt_ratio),
                            ("drop_empty_think_ratio", drop_empty_think_ratio)):
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(f"{name} is {ratio}; it is a probability, between 0 and 1")
        self.source = JsonlFile.shared(data_path, validate=_check_sft_record)
        self.tokenizer = tokenizer  # the tokenizer of its ids (validation counts the bytes its tokens stand for)
        self.encoder = ChatEncoder(tokenizer)
        self.max_seq_len = max_seq_len
        self.system_prompt_ratio = system_prompt_ratio
        self.drop_empty_think_ratio = drop_empty_think_ratio
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.source)

    def set_epoch(self, epoch: int) -> None:
        """The augmentations change with the epoch: call this before each epoch's DataLoader is made."""
        self.epoch = epoch

    def augment(self, messages: list[dict], index: int) -> tuple[list[dict], bool]:
        """(messages, drop_empty_think) for sample `index` in this epoch; unchanged when the ratios are 0."""
        # A string seed is hashed with SHA-512, so the draw is the same in every process and run.
        rng = random.Random(f"sft-augment/{self.seed}/{self.epoch}/{index}")
        has_tools = any(m.get("tools") for m in messages)
        if messages[0].get("role") != "system" and not has_tools and rng.random() < self.system_prompt_ratio:
            messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + messages
        return messages, rng.random() < self.drop_empty_think_ratio

    def encode_conversation(self, messages: list[dict],
                            drop_empty_think: bool = False) -> tuple[list[int], list[int]]:
        """Token ids and labels (not padded) for one conversation, at least its first max_seq_len."""
        ids, trained = self.encoder.encode(render_segments(messages, drop_empty_think=drop_empty_think),
                                           max_tokens=self.max_seq_len)
        return ids, [token if is_trained else IGNORE_INDEX for token, is_trained in zip(ids, trained)]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        messages, drop_empty_think = self.augment(self.source.read(i)["conversations"], i)
        ids, labels = self.encode_conversation(messages, drop_empty_think)
        return _pad(ids, labels, self.max_seq_len)

"""Prompts for GRPO (trainer/train_grpo.py), in the SFT schema, one JSON object per line:

    {"conversations": [{"role": "user", "content": "3+4?"}, {"role": "assistant", "content": "7"}]}

The prompt is every message before the last assistant message, rendered with the chat template and its
generation header (`<|im_start|>assistant\\n`), as the model will be asked; that last assistant message is the
reference answer the answer reward compares with. minimind's rlaif.jsonl lines drop in: a line that ends with
a user message, or whose last assistant message is empty, has no answer, which a reward that needs one
(dataset/rewards.py: NEEDS_ANSWER) refuses before training, naming the file and line.

Item i is (input_ids, labels), each [max_prompt_len]: the prompt's ids, right-padded; labels mark the prompt's
tokens (-100 on padding), so the loop reads the prompt's length from them and the loader's placeholder (all
-100) has none. A prompt longer than max_prompt_len keeps its end: the question and the generation header.
"""

from __future__ import annotations

import os
from functools import partial

import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from dataset.chat_format import ChatEncoder, parse_conversation, render_segments
from dataset.jsonl_file import JsonlFile
from dataset.lm_dataset import _pad

EXAMPLE = '{"conversations": [{"role": "user", "content": "3+4?"}, {"role": "assistant", "content": "7"}]}'


def split_prompt(messages: list) -> tuple[list, str | None]:
    """(the prompt's messages, the reference answer or None): the answer is the last message if it is an
    assistant's with content; the messages are checked first (ValueError names the message and the problem)."""
    parse_conversation(messages)
    if messages[-1]["role"] == "assistant":
        answer = messages[-1].get("content") or None
        return messages[:-1], answer
    return messages, None


def check_prompt(record: dict, needs_answer: bool) -> None:
    """The check of each line: a conversation with a prompt, and an answer when a reward compares with one."""
    prompt, answer = split_prompt(record.get("conversations"))
    if not any(m["role"] == "user" for m in prompt):
        raise ValueError(f"no user message before the answer, so nothing to ask: each line is {EXAMPLE}")
    if needs_answer and answer is None:
        raise ValueError("no reference answer (a last assistant message with content), which the answer "
                         "reward compares with: add it, or leave 'answer' out of --rewards")


class GRPODataset(Dataset):
    """Prompts with their reference answers: item i is (input_ids, labels), the prompt, [max_prompt_len]."""

    def __init__(self, data_path: str | os.PathLike, tokenizer: Tokenizer, max_prompt_len: int,
                 needs_answer: bool = True):
        self.source = JsonlFile.shared(data_path, validate=partial(check_prompt, needs_answer=needs_answer))  # checked before training
        self.encoder = ChatEncoder(tokenizer)  # the SFT stage's encoder: tags by their ids, text as text
        self.max_prompt_len = max_prompt_len

    def __len__(self) -> int:
        return len(self.source)

    def answer(self, i: int) -> str | None:
        """The reference answer of prompt i (None: the line has none)."""
        return split_prompt(self.source.read(i)["conversations"])[1]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        prompt, _ = split_prompt(self.source.read(i)["conversations"])
        ids, _ = self.encoder.encode(render_segments(prompt, add_generation_prompt=True))
        ids = ids[-self.max_prompt_len:]  # too long: its end stays, where the question and the header are
        return _pad(ids, ids, self.max_prompt_len)


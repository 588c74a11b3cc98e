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
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from dataset.chat_format import ChatEncoder, parse_conversation, render_segments
from dataset.jsonl_file import JsonlFile
from dataset.lm_dataset import IGNORE_INDEX, _pad
from dataset.rewards import NEEDS_ANSWER
from model.tokenizer import EOS_ID, PAD_ID

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
    """Prompts with their reference answers, and the rewards that score completions of them: item i is
    (input_ids, labels), the prompt, [max_prompt_len]."""

    def __init__(self, data_path: str | os.PathLike, tokenizer: Tokenizer, max_prompt_len: int, rewards: dict):
        self.rewards = rewards  # {name: function} (dataset/rewards.py: reward_functions) that score the completions
        # Every line checked before training; its answer too, where a reward compares with it
        needs_answer = bool(NEEDS_ANSWER & set(rewards))
        self.source = JsonlFile.shared(data_path, validate=partial(check_prompt, needs_answer=needs_answer))
        self.encoder = ChatEncoder(tokenizer)  # the SFT stage's encoder: tags by their ids, text as text
        self.max_prompt_len = max_prompt_len

    def __len__(self) -> int:
        return len(self.source)

    def answer(self, i: int) -> str | None:
        """The reference answer of prompt i (None: the line has none, or i is the loader's placeholder, -1)."""
        return None if i < 0 else split_prompt(self.source.read(i)["conversations"])[1]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        prompt, _ = split_prompt(self.source.read(i)["conversations"])
        ids, _ = self.encoder.encode(render_segments(prompt, add_generation_prompt=True))
        ids = ids[-self.max_prompt_len:]  # too long: its end stays, where the question and the header are
        return _pad(ids, ids, self.max_prompt_len)



@torch.no_grad()
def sample_groups(model, micro_batch: list[torch.Tensor], encoder: ChatEncoder, group_size: int,
                  max_new_tokens: int, temperature: float, seed: int, autocast) -> tuple:
    """G completions of each prompt of a micro-batch ((indices, input_ids, labels) as the loader gives them), with
    the model's KV-cache generation, the G of a prompt in one batch, drawn with a generator seeded by
    (seed, the prompt's index): the same completions on any rank, after any resume. Returns input_ids and
    labels [prompts x G, T] on the model's device (prompt + completion, right-padded; the labels cover the
    completion through its end of text) and each prompt's G decoded completions (None for the loader's
    placeholder, whose rows add nothing)."""
    device = next(model.parameters()).device
    indices, prompts, prompt_labels = micro_batch[0], micro_batch[1].to(device), micro_batch[2].to(device)
    rows, texts = [], []
    for index, ids, labels in zip(indices.tolist(), prompts, prompt_labels):
        prompt = ids[labels != IGNORE_INDEX]  # empty: the placeholder
        completion = torch.full((group_size, 1), PAD_ID, device=ids.device)
        if len(prompt):
            # (modulo 2**63: a generator's seed is 64 bits; --seed up to 2**31 times the epoch factor exceeds it)
            generator = torch.Generator(ids.device).manual_seed((seed * 1_000_003 + index) % 2**63)
            with autocast:
                completion = model.generate(prompt.repeat(group_size, 1), max_new_tokens, temperature,
                                            eos_token_id=EOS_ID, generator=generator)[:, len(prompt):]
        is_end = completion == EOS_ID
        kept = ((is_end.cumsum(dim=1) - is_end.long()) == 0) & bool(len(prompt))  # through the first end of text
        texts.append([encoder.decode(row[keep].tolist()) for row, keep in zip(completion, kept)] if len(prompt)
                     else None)
        rows += [(torch.cat([prompt, row]), F.pad(row.masked_fill(~keep, IGNORE_INDEX), (len(prompt), 0),
                                                  value=IGNORE_INDEX)) for row, keep in zip(completion, kept)]
    width = max(len(row) for row, _ in rows)  # right padding: a causal model's earlier positions never see it
    input_ids = torch.stack([F.pad(row, (0, width - len(row)), value=PAD_ID) for row, _ in rows])
    labels = torch.stack([F.pad(label, (0, width - len(label)), value=IGNORE_INDEX) for _, label in rows])
    return input_ids, labels, texts

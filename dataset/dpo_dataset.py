"""Preference pairs for DPO, in minimind's dpo.jsonl format, one JSON object per line:

    {"chosen":   [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}],
     "rejected": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "6"}]}

Both sides are conversations in the SFT schema (dataset/chat_format.py), rendered with the SFT stage's
chat template. The prompt, every message before the last assistant turn, must be the same on both sides:
only the answers differ. The labels cover the last assistant turn only (after its
`<|im_start|>assistant\\n` header, through `<|im_end|>\\n`), so an answer's log-probability is summed over
its own tokens. Item i is (input_ids, labels), each [2, max_seq_len]: row 0 chosen, row 1 rejected, so the
loop runs one forward over both. A bad line stops the run before training, naming the file and line. A pair
whose answer lies wholly beyond max_seq_len keeps no label, and the loss counts it as no pair (train_dpo.real_pairs),
as it does the loader's placeholder. Such pairs are found when the file is opened (`beyond_max_seq_len`) and said
in one line (how many, their first line numbers); train_dpo.py counts those of each logged step in its metrics.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from dataset.chat_format import ChatEncoder, parse_conversation, render_segments
from dataset.jsonl_file import JsonlFile, each_record_on_its_rank
from dataset.lm_dataset import IGNORE_INDEX, _pad

EXAMPLE = '{"chosen": [{"role": "user", ...}, {"role": "assistant", ...}], "rejected": [...]}'


def answer_index(messages: list) -> int:
    """Where the answer, the last assistant message, is; the messages before it are the prompt. The
    conversation is checked first (ValueError names the message and the problem)."""
    roles = [m["role"] for m in parse_conversation(messages).messages]
    if "assistant" not in roles:
        raise ValueError("has no assistant message, so there is no answer to prefer")
    return len(roles) - 1 - roles[::-1].index("assistant")


def check_pair(record: dict) -> None:
    """Both sides parse as conversations with an answer, after the same prompt; ValueError says what is wrong."""
    prompts = []
    for side in ("chosen", "rejected"):
        if side not in record:
            raise ValueError(f'no "{side}": each line is {EXAMPLE}')
        if not isinstance(record[side], list) or not record[side]:
            raise ValueError(f'"{side}" must be a non-empty list of {{"role", "content"}} messages: {EXAMPLE}')
        try:
            last = answer_index(record[side])
        except ValueError as error:
            raise ValueError(f'"{side}": {error}') from None
        prompts.append(parse_conversation(record[side][:last]) if last else None)  # as rendered: tools and all
    if prompts[0] != prompts[1]:
        raise ValueError('"chosen" and "rejected" have different prompts (the messages before the last assistant '
                         'answer); a pair compares two answers to the same prompt')


class DPODataset(Dataset):
    """Pairs of answers to one prompt: item i is (input_ids, labels), [2, max_seq_len], chosen then rejected."""

    def __init__(self, data_path: str | os.PathLike, tokenizer: Tokenizer, max_seq_len: int,
                 log: Callable[[str], None] | None = None):
        self.source = JsonlFile.shared(data_path, validate=check_pair)  # every line checked before training
        self.tokenizer = tokenizer
        self.encoder = ChatEncoder(tokenizer)  # the SFT stage's encoder: tags by their ids, text as text
        self.max_seq_len = max_seq_len
        self.beyond_max_seq_len = self._pairs_beyond_max_seq_len()  # sorted indices of the pairs that train nothing
        beyond = self.beyond_max_seq_len
        if len(beyond) and log is not None:
            lines = ", ".join([str(self.source.line_number(i)) for i in beyond[:5]] + ["..."] * (len(beyond) > 5))
            log(f"note: {len(beyond)} of {len(self)} pairs in {self.source.path} (line{'s' if len(beyond) > 1 else ''} "
                f"{lines}) have a prompt of --max_seq_len {max_seq_len} tokens or more: cut there, their answers keep "
                f"no token, so the loss leaves them out. Raise --max_seq_len, or shorten or remove those pairs")

    def __len__(self) -> int:
        return len(self.source)

    def count_beyond(self, indices: torch.Tensor) -> int:
        """How many of the pairs `indices` are among those that train nothing (`beyond_max_seq_len`)."""
        return int(np.isin(indices.numpy(), self.beyond_max_seq_len).sum()) if len(self.beyond_max_seq_len) else 0

    def _pairs_beyond_max_seq_len(self) -> np.ndarray:
        """The pairs whose prompt (through the answer's `<|im_start|>assistant\\n`) fills max_seq_len tokens: their
        answers start where the cut is. Both sides share the prompt, so "chosen" tells. Some 50 microseconds a pair
        of the demo's, on one core; the ranks share the work, as PackedPretrainDataset's lengths."""
        return np.flatnonzero(each_record_on_its_rank(len(self.source), self._beyond_max_seq_len))

    def _beyond_max_seq_len(self, i: int) -> bool:
        messages = self.source.read(i)["chosen"]
        last = answer_index(messages)
        prompt = render_segments(messages[:last], add_generation_prompt=True) if last else []
        # A token stands for a byte at least: a prompt of fewer bytes fits without tokenizing it.
        if sum(len(segment.text.encode("utf-8")) for segment in prompt) < self.max_seq_len:
            return False
        return len(self.encoder.encode(prompt, max_tokens=self.max_seq_len)[0]) >= self.max_seq_len

    def encode_answer(self, messages: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids and labels of one side, the labels on the last assistant turn only, cut and padded."""
        last = answer_index(messages)
        segments = render_segments(messages)
        # Rendering a prefix of the messages gives a prefix of the segments: the prompt's are not trained.
        in_prompt = len(render_segments(messages[:last])) if last else 0
        segments = [s._replace(trained=False) for s in segments[:in_prompt]] + segments[in_prompt:]
        ids, trained = self.encoder.encode(segments, max_tokens=self.max_seq_len)  # a 60 MB answer: only its start
        return _pad(ids, [token if t else IGNORE_INDEX for token, t in zip(ids, trained)], self.max_seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        record = self.source.read(i)
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = (
            self.encode_answer(record[side]) for side in ("chosen", "rejected"))
        return torch.stack([chosen_ids, rejected_ids]), torch.stack([chosen_labels, rejected_labels])

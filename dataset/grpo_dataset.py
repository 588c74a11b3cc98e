"""Prompts for GRPO (trainer/train_grpo.py), in the SFT schema, one JSON object per line:

    {"conversations": [{"role": "user", "content": "3+4?"}, {"role": "assistant", "content": "7"}]}

The prompt is every message before the last assistant message, rendered with the chat template and its
generation header (`<|im_start|>assistant\\n`), as the model will be asked; that last assistant message is the
reference answer the answer reward compares with. minimind's rlaif.jsonl lines drop in: a line that ends with
a user message, or whose last assistant message is empty, has no answer, which a reward that needs one
(dataset/rewards.py: NEEDS_ANSWER) refuses before training, naming the file and line. With tools (--max_turns 2 or
more: dataset/tool_rollouts.py) the tools a prompt offers are its first system message's "tools" (function specs),
run by name from dataset/tools.py's DEMO_TOOLS; a spec naming another tool, or showing parameters other than the
tool's own, is refused the same way. A tool spec holding NaN or Infinity (Python's json reads them; they are not
JSON, and the prompt would show them) is refused with any --max_turns.

Item i is (input_ids, labels), each [max_prompt_len]: the prompt's ids, right-padded; labels mark the prompt's
tokens (-100 on padding), so the loop reads the prompt's length from them and the loader's placeholder (all
-100) has none. A prompt longer than max_prompt_len (what --max_seq_len leaves beside --max_completion_len) keeps
its end, the question and the generation header, and only the text that end needs is tokenized (a 52 MB prompt
was tokenized whole for every step that drew it). Such prompts are found when the file is opened (`cut`) and
said in one line (how many, their first line numbers); train_grpo.py counts those of each logged step in its
metrics. A room that every prompt is longer than is refused (DataFileError: the run would train on none of them).
"""

from __future__ import annotations

import json
import math
import os
from functools import partial
from typing import Callable

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from dataset.chat_format import ChatEncoder, Segment, parse_conversation, render_segments
from dataset.jsonl_file import DataFileError, JsonlFile, each_record_on_its_rank
from dataset.lm_dataset import IGNORE_INDEX, _pad
from dataset.rewards import NEEDS_ANSWER
from dataset.tool_rollouts import sample_tool_groups
from dataset.tools import DEMO_TOOLS, Tool
from model.model import LMConfig
from model.rollout import rollout, trained_batch
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


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def schema_difference(shown, real, where: str = "parameters") -> str | None:
    """The first place where a prompt's `shown` schema differs from the `real` one a tool runs with, in words, or
    None when they are the same JSON (1 and 1.0, or true and 1, differ: the model reads them as written)."""
    if isinstance(shown, dict) and isinstance(real, dict):
        for key in [*real, *(key for key in shown if key not in real)]:
            if key not in shown:
                return f"{where}.{key} is missing (the tool's: {_shown(real[key])})"
            if key not in real:
                return f"{where}.{key} is not in the tool's schema"
            difference = schema_difference(shown[key], real[key], f"{where}.{key}")
            if difference is not None:
                return difference
        return None
    if isinstance(shown, list) and isinstance(real, list) and len(shown) == len(real):
        for n, (item, real_item) in enumerate(zip(shown, real)):
            difference = schema_difference(item, real_item, f"{where}[{n}]")
            if difference is not None:
                return difference
        return None
    if type(shown) is type(real) and shown == real:
        return None
    return f"{where} is {_shown(shown)} here, {_shown(real)} in the tool's schema"


def non_finite_number(value, where: str) -> str | None:
    """Where in parsed JSON a NaN or an infinity is (Python's json reads NaN and Infinity, which are not JSON), or
    None. (The value is nested no deeper than chat_format's check allows.)"""
    if isinstance(value, float) and not math.isfinite(value):
        return where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = non_finite_number(item, f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]")
        if found is not None:
            return found
    return None


def offered_tools(messages: list, tools: dict[str, Tool] = DEMO_TOOLS) -> dict[str, Tool]:
    """The tools the first system message's "tools" offer, by name from `tools`; ValueError naming one not there, or
    one whose spec shows parameters other than those it runs with."""
    offered = {}
    for spec in parse_conversation(messages).tools:
        function = spec.get("function") if isinstance(spec.get("function"), dict) else spec
        name = function.get("name")
        if name not in tools:
            raise ValueError(f'"tools" offers {name!r}, which is not a tool this trainer runs (dataset/tools.py\'s '
                             f'DEMO_TOOLS: {", ".join(tools)}): offer only those, or add yours there')
        # Refused, not run with what the prompt shows: the function takes the arguments its own schema lists, so a
        # prompt showing other parameters would teach calls that fail, or are checked against rules the model was
        # not shown. The format carries a spec because the model must be shown one; the trainer runs its own tools
        # by name, so the two must be the same.
        difference = schema_difference(function.get("parameters"), tools[name].spec["function"].get("parameters"))
        if difference is not None:
            raise ValueError(f'"tools" offers {name!r} with other parameters than it runs with (dataset/tools.py): '
                             f'{difference}; show its spec as DEMO_TOOLS[{name!r}].spec writes it')
        offered[name] = tools[name]
    return offered


def check_prompt(record: dict, needs_answer: bool, runs_tools: bool = False) -> None:
    """The check of each line: a conversation with a prompt, an answer when a reward compares with one, tool specs
    that are JSON, and tools that run when the rollouts call them."""
    prompt, answer = split_prompt(record.get("conversations"))
    for n, spec in enumerate(parse_conversation(prompt).tools):
        where = non_finite_number(spec, f'"tools"[{n}]')
        if where is not None:  # shown to the model as NaN or Infinity, which no JSON parser reads back
            raise ValueError(f"{where} is NaN or an infinity, which JSON has no number for: write a number, or "
                             f"leave the keyword out")
    if runs_tools:
        offered_tools(prompt)
    if not any(m["role"] == "user" for m in prompt):
        raise ValueError(f"no user message before the answer, so nothing to ask: each line is {EXAMPLE}")
    if needs_answer and answer is None:
        raise ValueError("no reference answer (a last assistant message with content), which the answer "
                         "reward compares with: add it, or leave 'answer' out of --rewards")


class GRPODataset(Dataset):
    """Prompts with their reference answers, and the rewards that score completions of them: item i is
    (input_ids, labels), the prompt, [max_prompt_len]."""

    def __init__(self, data_path: str | os.PathLike, tokenizer: Tokenizer, max_prompt_len: int, rewards: dict,
                 log: Callable[[str], None] | None = None, runs_tools: bool = False):
        self.rewards = rewards  # {name: function} (dataset/rewards.py: reward_functions) that score the completions
        # Every line checked before training; its answer too, where a reward compares with it; its tools, if they run
        needs_answer = bool(NEEDS_ANSWER & set(rewards))
        self.source = JsonlFile.shared(data_path, validate=partial(check_prompt, needs_answer=needs_answer,
                                                                   runs_tools=runs_tools))
        self.encoder = ChatEncoder(tokenizer)  # the SFT stage's encoder: tags by their ids, text as text
        self.max_prompt_len = max_prompt_len
        # The prompts longer than max_prompt_len (sorted indices), cut from the left: said here, counted in the metrics
        self.cut = np.flatnonzero(each_record_on_its_rank(len(self), self._is_cut))
        if len(self.cut) == len(self) > 0:
            self._refuse_the_room()
        if len(self.cut) and log is not None:
            cut = self.cut
            lines = ", ".join([str(self.source.line_number(i)) for i in cut[:5]] + ["..."] * (len(cut) > 5))
            log(f"note: {len(cut)} of {len(self)} prompts in {self.source.path} (line{'s' if len(cut) > 1 else ''} "
                f"{lines}) are longer than the {max_prompt_len} tokens --max_seq_len leaves beside "
                f"--max_completion_len: cut from the left, each keeps its end (the question and the generation "
                f"header). Raise --max_seq_len, lower --max_completion_len, or shorten those prompts")

    def __len__(self) -> int:
        return len(self.source)

    def prompt(self, i: int) -> list[Segment]:
        """Prompt i as the model is asked: the messages before the answer, with the generation header."""
        return render_segments(split_prompt(self.source.read(i)["conversations"])[0], add_generation_prompt=True)

    def answer(self, i: int) -> str | None:
        """The reference answer of prompt i (None: the line has none, or i is the loader's placeholder, -1)."""
        return None if i < 0 else split_prompt(self.source.read(i)["conversations"])[1]

    def tools(self, i: int) -> dict[str, Tool]:
        """The tools prompt i offers (its first system message's "tools"), as dataset/tools.py runs them."""
        return offered_tools(split_prompt(self.source.read(i)["conversations"])[0])

    def count_cut(self, indices: torch.Tensor) -> int:
        """How many of the prompts `indices` are among those cut (`cut`)."""
        return int(np.isin(indices.numpy(), self.cut).sum()) if len(self.cut) else 0

    def _is_cut(self, i: int) -> bool:
        segments = self.prompt(i)
        # A token stands for a byte at least: a prompt of no more bytes fits without tokenizing it.
        if sum(len(segment.text.encode("utf-8")) for segment in segments) <= self.max_prompt_len:
            return False
        return len(self.encoder.encode_end(segments, self.max_prompt_len + 1)) > self.max_prompt_len

    def _refuse_the_room(self) -> None:
        """Every prompt is longer than max_prompt_len: DataFileError naming the shortest, and the room it needs."""
        limit = LMConfig.max_position_embeddings  # (no window is longer: the rotary table's length)
        lengths = each_record_on_its_rank(len(self), lambda i: len(self.encoder.encode_end(self.prompt(i), limit)))
        shortest = int(lengths.argmin())
        tokens = f"{lengths[shortest]}{' or more' if lengths[shortest] >= limit else ''}"
        room = self.max_prompt_len
        raise DataFileError(f"{self.source.path}: each of its {len(self)} prompts is longer than the {room} "
                            f"token{'s' if room > 1 else ''} --max_seq_len leaves beside "
                            f"--max_completion_len (the shortest, line {self.source.line_number(shortest)}, has "
                            f"{tokens}): each would be cut to its end, and the run would train on nothing it was "
                            f"asked. Make --max_seq_len at least {lengths[shortest]} more than --max_completion_len")

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Too long: its end stays, where the question and the header are; only the text that end needs is tokenized
        ids = self.encoder.encode_end(self.prompt(i), self.max_prompt_len)
        return _pad(ids, ids, self.max_prompt_len)


@torch.no_grad()
def sample_groups(model, micro_batch: list[torch.Tensor], encoder: ChatEncoder, group_size: int,
                  max_new_tokens: int, temperature: float, seed: int, autocast) -> tuple:
    """G completions of each prompt of a micro-batch ((indices, input_ids, labels) as the loader gives them), all
    decoded together by model/rollout.py (each prompt read once for its G rows), row g of a prompt drawn with its own
    generator seeded by (seed, the prompt's index, g): the same completions on any rank, after any resume, beside any
    other prompts. Returns input_ids and labels [prompts x G, T] on the model's device (prompt + completion,
    right-padded; the labels are the sampled ids, through the end of text) and each prompt's G decoded completions
    (None for the loader's placeholder, whose rows add nothing)."""
    device = next(model.parameters()).device
    indices, prompts, prompt_labels = micro_batch[0].tolist(), micro_batch[1].to(device), micro_batch[2].to(device)
    asked = [ids[labels != IGNORE_INDEX] for ids, labels in zip(prompts, prompt_labels)]  # empty: the placeholder
    # (modulo 2**63: a generator's seed is 64 bits; --seed up to 2**31 times the epoch factor exceeds it)
    with autocast:
        completions = rollout(model, asked, group_size, max_new_tokens, temperature,
                              [(seed * 1_000_003 + index) % 2**63 for index in indices], EOS_ID)
    input_ids, labels = trained_batch(asked, completions, PAD_ID, IGNORE_INDEX)
    texts = [[encoder.decode(c.ids.tolist()) for c in completions[p * group_size:(p + 1) * group_size]]
             if len(prompt) else None for p, prompt in enumerate(asked)]
    return input_ids, labels, texts


def sample_rollouts(model, micro_batch: list[torch.Tensor], dataset: GRPODataset, group_size: int, max_new_tokens: int,
                    temperature: float, seed: int, autocast, max_turns: int) -> tuple:
    """The step's rollouts of a micro-batch: (input_ids, labels, each prompt's G final answers, each prompt's G
    Rollouts or None). One turn: sample_groups, no tool runs (no Rollouts); more: dataset/tool_rollouts.py."""
    if max_turns == 1:
        return (*sample_groups(model, micro_batch, dataset.encoder, group_size, max_new_tokens, temperature, seed,
                               autocast), None)
    return sample_tool_groups(model, micro_batch, dataset, group_size, max_new_tokens, temperature, seed, autocast,
                              max_turns)

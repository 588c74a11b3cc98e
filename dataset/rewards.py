"""Rewards for the GRPO stage (trainer/train_grpo.py): plain Python functions, nothing to download.

A reward function takes the group's completions (decoded text) and each one's reference answer (the prompt's
last assistant message in the data, None where a line has none) and returns one float per completion:

    def my_reward(completions: list[str], answers: list[str | None]) -> list[float]: ...

Add yours to REWARDS and name it with --rewards (e.g. `--rewards answer,format,my_reward`); the rewards named
are added up. With tools (train_grpo.py --max_turns N > 1) a completion is the rollout's FINAL turn, so the rewards
above score its final answer unchanged; a reward that reads the whole rollout is also named in NEEDS_ROLLOUTS and is
called with a third argument, `rollouts`: per completion a dataset/tool_rollouts.Rollout (the model's text of each
turn, and each call it made with the problem that kept it from validating, or None):

    def my_tool_reward(completions: list[str], answers: list[str | None], rollouts: list[Rollout]) -> list[float]: ...

`score` calls them and refuses, in one line naming the function, one that raises, returns a value that is not a
finite number, or the wrong count: the step is not applied (the loop stops before it).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Callable

import torch
import torch.distributed as dist

from dataset.jsonl_file import DataFileError, collective_device

THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
# The layout the chat template gives an answer: a think block, a blank line, then the answer itself.
ANSWER_LAYOUT = re.compile(r"\s*<think>\n.*?\n</think>\n\n\S.*", re.DOTALL)


class RewardError(DataFileError):
    """A reward function that failed or a --rewards name that is none: the user's to fix (exit 2, one line)."""


def final_answer(completion: str) -> str:
    """The completion without its think block (and anything up to it) and surrounding whitespace."""
    return THINK_BLOCK.split(completion)[-1].strip()


# A number as an answer is written: a sign, ASCII digits, a point and more digits. A comma is a thousands separator
# only where it groups three digits after a first group of one to three ("1,234", "12,345.5"); "1,2", ",5" or "1,2345"
# are text, compared as text. No exponent: "1e999999999" would be a number of a billion digits to build.
NUMBER = re.compile(r"[+-]?(?:(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]*)?|\.[0-9]+)")


def as_number(text: str) -> Decimal | None:
    """`text` as an exact number ("42", "-3.5", "1,000", ".5"), else None. Decimal, not float: a float has 53 bits,
    so "12345678901234567890" and "...891" were equal; a Decimal keeps every digit, and "0.5", "0.50" and ".5" are
    equal (the same value), as are "12" and "12.0"."""
    return Decimal(text.replace(",", "")) if NUMBER.fullmatch(text) else None


def answer_reward(completions: list[str], answers: list[str | None]) -> list[float]:
    """1.0 where the completion's final answer is the reference answer: the same text once the think block and
    whitespace are stripped, or the same number exactly (as_number: "12" and "12.0", "1,234" and "1234"); else 0.0."""
    rewards = []
    for completion, answer in zip(completions, answers, strict=True):
        got, want = final_answer(completion), final_answer(answer or "")
        same_number = as_number(got) is not None and as_number(got) == as_number(want)
        rewards.append(1.0 if got == want or same_number else 0.0)
    return rewards


def format_reward(completions: list[str], answers: list[str | None]) -> list[float]:
    """0.5 where the completion keeps the think/answer layout (`<think>\\n...\\n</think>\\n\\nanswer`), else 0.0."""
    return [0.5 if ANSWER_LAYOUT.fullmatch(completion) else 0.0 for completion in completions]


def brevity_reward(completions: list[str], answers: list[str | None]) -> list[float]:
    """1.0 for an empty final answer, down to 0.0 at 200 characters or more: short answers (minimind's GRPO has a
    length rule too). A random model's completions already differ in it, so a run has signal from its first step."""
    return [1.0 - min(len(final_answer(completion)), 200) / 200 for completion in completions]


def tool_reward(completions: list[str], answers: list[str | None], rollouts: list) -> list[float]:
    """The share of a rollout's calls that validate: well-formed, naming an offered tool, with arguments that fit its
    schema, and (where it ran) answered by the tool; a malformed call or a failed run counts 0. No call: 0.0."""
    return [sum(call.problem is None for call in rollout.calls) / len(rollout.calls) if rollout.calls else 0.0
            for rollout in rollouts]


def call_reward(completions: list[str], answers: list[str | None], rollouts: list) -> list[float]:
    """1.0 where a call of the rollout ran and its result holds the reference answer's number (a calculator's
    {"result": 6762} for "6762", a weather tool's {"temperature_c": 8, ...} for "8°C"): the right tool with the right
    arguments, whether or not the final answer then copied it. 0.0 otherwise, and where the answer has no number.
    The answer reward pays only a rollout right end to end, which a small tool model rarely samples; this one pays
    the step before, the call, so that a group's rollouts differ more often."""
    rewards = []
    for answer, rollout in zip(answers, rollouts, strict=True):
        wanted = {as_number(n) for n in NUMBER.findall(final_answer(answer or ""))}
        held = [{as_number(n) for n in NUMBER.findall(call.result)} for call in rollout.calls if call.result]
        rewards.append(1.0 if len(wanted) == 1 and any(wanted <= numbers for numbers in held) else 0.0)
    return rewards


REWARDS: dict[str, Callable[..., list[float]]] = {"answer": answer_reward, "format": format_reward,
                                                  "brevity": brevity_reward, "tool": tool_reward, "call": call_reward}
NEEDS_ANSWER = {"answer", "call"}  # the rewards that compare with the reference answer: a line must have one
NEEDS_ROLLOUTS = {"tool", "call"}  # the rewards called with the rollouts too (train_grpo.py --max_turns 2 or more)


def reward_functions(names: str) -> dict[str, Callable]:
    """The functions --rewards names (comma-separated), or RewardError naming the unknown one."""
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in REWARDS]
    if unknown or not chosen:
        raise RewardError(f"--rewards {names}: {', '.join(unknown) or 'nothing'} is none of {', '.join(REWARDS)} "
                          f"(add a function to REWARDS in dataset/rewards.py to use your own)")
    return {name: REWARDS[name] for name in chosen}


def score(functions: dict[str, Callable], completions: list[str], answers: list[str | None],
          rollouts: list | None = None) -> list[float]:
    """Each completion's reward: the named functions' values added up (those in NEEDS_ROLLOUTS also given
    `rollouts`). A function that raises, or returns other than one finite number per completion: RewardError
    naming it."""
    totals = [0.0] * len(completions)
    for name, function in functions.items():
        where = f"reward {name!r} ({function.__module__}.{function.__qualname__})"
        extra = (rollouts,) if name in NEEDS_ROLLOUTS else ()  # the rollouts, to the functions that read them
        try:
            values = list(function(completions, answers, *extra))
        except Exception as error:  # a user's function: whatever it raises, one line that names it
            raise RewardError(f"{where} raised {type(error).__name__}: {error}") from None
        if len(values) != len(completions):
            raise RewardError(f"{where} returned {len(values)} values for {len(completions)} completions")
        bad = [v for v in values if not isinstance(v, (int, float)) or not math.isfinite(v)]
        if bad:
            raise RewardError(f"{where} returned {bad[0]!r}: each reward must be a finite number")
        totals = [total + float(v) for total, v in zip(totals, values)]
    return totals


def score_groups(functions: dict[str, Callable], groups: list[list[str] | None], answers: list[str | None],
                 group_size: int, rollouts: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[prompts, G] rewards of each prompt's group of completions (None: the loader's placeholder, zeros; `rollouts`:
    each group's Rollouts, with tools), and what a user watches of them: [reward sum, in-group std sum, groups
    without signal (all alike), groups, tool calls that ran]. Every rank calls it once per micro-step (as many on
    each), so a reward that fails on one rank stops them all here."""
    error, scores = None, torch.zeros(len(groups), group_size, dtype=torch.float64)
    try:
        rollouts = rollouts or [None] * len(groups)
        scores = torch.tensor([score(functions, group, [answer] * group_size, rollout) if group is not None else
                               [0.0] * group_size for group, answer, rollout in zip(groups, answers, rollouts)],
                              dtype=torch.float64)
    except RewardError as caught:
        error = caught
    raise_on_every_rank(error)
    real = torch.tensor([group is not None for group in groups])
    std = scores.std(dim=1)
    ran = sum(rollout.ran for group in rollouts if group is not None for rollout in group)  # one turn: no Rollouts
    return scores, torch.tensor([scores[real].sum(), std[real].sum(), (std[real] == 0).sum(), real.sum(), ran],
                                dtype=torch.float64)


def raise_on_every_rank(error: RewardError | None) -> None:
    """Every rank raises where a reward failed on any rank (the others would wait for it in the step's all-reduce),
    with the failing rank's message, which rank 0 prints. A 1-number all-reduce; the messages only on failure."""
    if dist.is_initialized():
        failed = torch.tensor([float(error is not None)], device=collective_device())
        dist.all_reduce(failed)
        if failed.item():
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, None if error is None else str(error))
            rank, message = next((rank, message) for rank, message in enumerate(messages) if message is not None)
            raise RewardError(f"on rank {rank}: {message}")
    if error is not None:
        raise error

"""Agentic GRPO's rollouts (trainer/train_grpo.py --max_turns N > 1): the model answers, the tools it calls run, their
results are appended as the chat template renders them, and the model goes on, up to N model turns.

    prompt | turn 1: <think>..</think>\\n\\n<tool_call>{..}</tool_call><|im_end|>
           | \\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
           | turn 2: ...the answer<|im_end|>

Only the model's own tokens are trained (each turn through its end of text); the tool results and the template's
text around them are labels -100. A rollout goes on after a turn that ended (its end of text) with well-formed calls
(dataset/tool_calls.py) while turns are left; a malformed call ends it there, its text the final answer.
--max_completion_len bounds the whole rollout after the prompt, the model's and the tools' tokens together (so a
rollout fits --max_seq_len as a single completion does): a tool turn that would leave no room for one more model
token is not appended, and the rollout ends with its calls.

The tools a prompt offers are its first system message's "tools" (function specs), run by name from dataset/tools.py's
DEMO_TOOLS (GRPODataset refuses a name that is not there, or a spec whose parameters are not the tool's, when it
indexes the file). Each call runs in a child process (run_tool: bounded in time, memory and output); nothing the
model wrote is evaluated.

A call that fails (the tool raised, hung past its time limit, or returned what is not JSON): training goes on; the
model reads {"error": "..."} as that call's result, and the tool reward scores the call 0. A malformed call, one
naming a tool not offered, or arguments that do not fit the schema are scored 0 as well (the model reads the
error run_tool answers for the last two).

All rows of a micro-batch's groups decode together (model/rollout.py): a row whose turn ends with calls gets the
results as forced tokens, read into its own KV cache, while the other rows go on; nothing is read again from the
start. Seeding: row g of a prompt's group draws from its own generator, seeded by (seed, epoch, prompt, g), carried
across its turns, whatever else is in the batch. Tools that are plain functions of their arguments (the demo's are)
give the same results every time, so a resume and any rank count sample the same rollouts. The one thing that can
differ between a run and its resume is a call that hits its time limit on one machine and not on the other.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dataset.chat_format import ChatEncoder, Segment, render_segments, template_segments
from dataset.lm_dataset import IGNORE_INDEX
from dataset.rewards import final_answer
from dataset.tool_calls import parse_tool_calls
from dataset.tools import TIME_LIMIT_S, Tool, argument_problem, error_text, run_tool
from model.rollout import rollout, trained_batch
from model.tokenizer import EOS_ID, PAD_ID


class ToolCall(NamedTuple):
    """One call of a rollout; `problem` None: it validates (well-formed, an offered tool, arguments that fit the
    schema) and, if it ran, the tool answered."""
    name: str | None  # None: a malformed call
    arguments: dict | None
    problem: str | None
    result: str | None = None  # the tool's JSON text the model read, where the call ran and the tool answered


class Rollout(NamedTuple):
    """What a rollout did, for the rewards that read more than its final answer (dataset/rewards.py: tool)."""
    turns: list[str]  # the model's text of each turn; the last is the completion the other rewards score
    calls: list[ToolCall]
    ran: int  # how many of its calls ran (the log line's tool_calls); those of turn --max_turns never run


def tool_turn(results: list[str]) -> list[Segment]:
    """What the chat template writes after a model turn with calls: the newline after its <|im_end|>, the results
    in one user turn of <tool_response> blocks, and the next assistant header. None of it is trained."""
    return template_segments("\n") + render_segments([{"role": "tool", "content": text} for text in results],
                                                     add_generation_prompt=True)


def check_calls(text: str, offered: dict[str, Tool]) -> tuple[list[ToolCall], bool]:
    """The calls of a turn's text, each checked against the offered tools, and whether they are well-formed."""
    try:
        _, calls = parse_tool_calls(final_answer(text))
    except ValueError as error:
        return [ToolCall(None, None, f"malformed: {error}")], False
    checked = []
    for call in calls:
        name, arguments = call["name"], call["arguments"]
        problem = (f"no tool named {name!r} is offered" if name not in offered
                   else argument_problem(offered[name], arguments))
        checked.append(ToolCall(name, arguments, problem))
    return checked, True


def run_calls(calls: list[ToolCall], offered: dict[str, Tool], time_limit_s: float) -> tuple[list[str], list]:
    """Each call run (run_tool answers an error for a name not offered or arguments that do not fit): the results
    the model reads, and the calls with a failed run's problem set (the model reads {"error": why})."""
    results, checked = [], []
    for call in calls:
        result = run_tool(call.name, call.arguments, offered, time_limit_s)
        results.append(result.text if result.failure is None else error_text(result.failure))  # both bounded
        checked.append(call._replace(problem=call.problem or result.failure,
                                     result=result.text if result.failure is None else None))
    return results, checked


class ToolTurns:
    """What happens when a rollout's turn ends (model/rollout.py's after_turn), for the rows of a micro-batch's groups:
    the turn's text and calls are kept; after a turn that ended (its end of text) with well-formed calls, while
    turns are left, the calls run and the tool turn's ids (tool_turn) are handed back, to be read as forced tokens.
    `rollouts()` then gives each prompt's G Rollouts."""

    def __init__(self, offered: list[dict | None], group_size: int, encoder: ChatEncoder, max_turns: int,
                 time_limit_s: float):
        self.offered, self.group_size, self.encoder = offered, group_size, encoder  # offered: per prompt, its tools
        self.max_turns, self.time_limit_s = max_turns, time_limit_s
        self.turns = [[] for _ in range(len(offered) * group_size)]  # per row: the model's text of each turn
        self.calls = [[] for _ in self.turns]
        self.ran = [0] * len(self.turns)

    def after_turn(self, row: int, turn: list[int], ended: bool) -> list[int] | None:
        """The ids to read after this turn (the tools' results in the template), or None: the rollout ends."""
        offered = self.offered[row // self.group_size]
        self.turns[row].append(self.encoder.decode(turn))
        made, well_formed = check_calls(self.turns[row][-1], offered)
        self.calls[row] += made
        if not (ended and made and well_formed) or len(self.turns[row]) == self.max_turns:
            return None
        results, checked = run_calls(made, offered, self.time_limit_s)
        self.calls[row][-len(made):], self.ran[row] = checked, self.ran[row] + len(made)  # a failed run: scores 0
        # (the engine reads them only if one more model token fits after them in --max_completion_len)
        return self.encoder.encode(tool_turn(results))[0]

    def rollouts(self) -> list[list[Rollout] | None]:
        """Each prompt's G Rollouts (None for the loader's placeholder)."""
        rows = [Rollout(*done) for done in zip(self.turns, self.calls, self.ran)]
        return [rows[p * self.group_size:(p + 1) * self.group_size] if offered is not None else None
                for p, offered in enumerate(self.offered)]


@torch.no_grad()
def sample_tool_groups(model, micro_batch: list[torch.Tensor], dataset, group_size: int, max_new_tokens: int,
                       temperature: float, seed: int, autocast, max_turns: int,
                       time_limit_s: float = TIME_LIMIT_S) -> tuple:
    """grpo_dataset.sample_groups with tools: G rollouts of up to `max_turns` model turns for each prompt of a
    micro-batch, `max_new_tokens` for the whole rollout, all decoded together (model/rollout.py). Returns input_ids
    and labels [prompts x G, T] (right-padded; labels on the model's tokens only), each prompt's G final answers (the
    last turn's text) and its G Rollouts (None for the loader's placeholder)."""
    device = next(model.parameters()).device
    indices, prompts, prompt_labels = micro_batch[0].tolist(), micro_batch[1].to(device), micro_batch[2].to(device)
    asked = [ids[labels != IGNORE_INDEX] for ids, labels in zip(prompts, prompt_labels)]  # empty: the placeholder
    offered = [dataset.tools(index) if len(prompt) else None for index, prompt in zip(indices, asked)]
    turns = ToolTurns(offered, group_size, dataset.encoder, max_turns, time_limit_s)
    with autocast:  # seeded as sample_groups seeds: (seed, the prompt's index), modulo a generator's 64 bits
        completions = rollout(model, asked, group_size, max_new_tokens, temperature,
                              [(seed * 1_000_003 + index) % 2**63 for index in indices], EOS_ID, turns.after_turn)
    input_ids, labels = trained_batch(asked, completions, PAD_ID, IGNORE_INDEX)
    rollouts = turns.rollouts()
    texts = [[rollout.turns[-1] for rollout in group] if group is not None else None for group in rollouts]
    return input_ids, labels, texts, rollouts

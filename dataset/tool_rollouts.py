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

Seeding: each prompt's group is drawn with one generator seeded by (seed, epoch, prompt), carried across its turns:
turn 1 for the G completions together, then each completion's later turns in order. Tools that are plain functions
of their arguments (the demo's are) give the same results every time, so a resume and any rank count sample the
same rollouts. The one thing that can differ between a run and its resume is a call that hits its time limit on
one machine and not on the other.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dataset.chat_format import ChatEncoder, Segment, render_segments, template_segments
from dataset.lm_dataset import IGNORE_INDEX
from dataset.rewards import final_answer
from dataset.tool_calls import parse_tool_calls
from dataset.tools import TIME_LIMIT_S, Tool, argument_problem, error_text, run_tool
from model.tokenizer import EOS_ID, PAD_ID


class ToolCall(NamedTuple):
    """One call of a rollout; `problem` None: it validates (well-formed, an offered tool, arguments that fit the
    schema) and, if it ran, the tool answered."""
    name: str | None  # None: a malformed call
    arguments: dict | None
    problem: str | None


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
        checked.append(call._replace(problem=call.problem or result.failure))
    return results, checked


def continue_rollout(model, prompt: torch.Tensor, first: torch.Tensor, encoder: ChatEncoder, offered: dict,
                     max_new_tokens: int, max_turns: int, temperature: float, generator, autocast,
                     time_limit_s: float) -> tuple[torch.Tensor, torch.Tensor, Rollout]:
    """One completion's rollout from its first turn `first` (tokens after the prompt, as generate gave them): the
    ids after the prompt, their labels (-100 on tool turns), and what it did."""
    ids, labels, turns, calls, turn, ran = [], [], [], [], first, 0
    while True:
        ended = (turn == EOS_ID).nonzero()
        kept = turn[:int(ended[0]) + 1] if len(ended) else turn  # through its end of text; the rest is padding
        ids.append(kept)
        labels.append(kept)
        turns.append(encoder.decode(kept.tolist()))
        made, well_formed = check_calls(turns[-1], offered)
        calls += made
        if not (len(ended) and made and well_formed) or len(turns) == max_turns:
            break
        results, checked = run_calls(made, offered, time_limit_s)
        calls[-len(made):], ran = checked, ran + len(made)  # a failed run: that call scores 0
        tool_ids = torch.tensor(encoder.encode(tool_turn(results))[0], device=prompt.device)
        room = max_new_tokens - sum(len(part) for part in ids) - len(tool_ids)
        if room < 1:  # no room for a model token after the results: the rollout ends with its calls
            break
        ids.append(tool_ids)
        labels.append(torch.full_like(tool_ids, IGNORE_INDEX))  # the tools' text and the template's: not trained
        so_far = torch.cat([prompt, *ids])
        with autocast:  # the same generator, carried on: the next turn is drawn alike after a resume
            turn = model.generate(so_far[None], room, temperature, eos_token_id=EOS_ID,
                                  generator=generator)[0, len(so_far):]
    return torch.cat(ids), torch.cat(labels), Rollout(turns, calls, ran)


@torch.no_grad()
def sample_tool_groups(model, micro_batch: list[torch.Tensor], dataset, group_size: int, max_new_tokens: int,
                       temperature: float, seed: int, autocast, max_turns: int,
                       time_limit_s: float = TIME_LIMIT_S) -> tuple:
    """grpo_dataset.sample_groups with tools: G rollouts of up to `max_turns` model turns for each prompt of a
    micro-batch, `max_new_tokens` for the whole rollout. Returns input_ids and labels [prompts x G, T] (right-padded;
    labels on the model's tokens only), each prompt's G final answers (the last turn's text) and its G Rollouts
    (None for the loader's placeholder)."""
    device = next(model.parameters()).device
    indices, prompts, prompt_labels = micro_batch[0], micro_batch[1].to(device), micro_batch[2].to(device)
    rows, texts, rollouts = [], [], []
    for index, ids, labels in zip(indices.tolist(), prompts, prompt_labels):
        prompt = ids[labels != IGNORE_INDEX]
        if not len(prompt):  # the placeholder: one padding token a row, nothing trained
            rows += [(torch.full((1,), PAD_ID, device=device), torch.full((1,), IGNORE_INDEX, device=device))] * \
                group_size
            texts.append(None)
            rollouts.append(None)
            continue
        # seeded as sample_groups seeds: (seed, the prompt's index), modulo a generator's 64 bits
        generator = torch.Generator(device).manual_seed((seed * 1_000_003 + index) % 2**63)
        with autocast:
            first = model.generate(prompt.repeat(group_size, 1), max_new_tokens, temperature, eos_token_id=EOS_ID,
                                   generator=generator)[:, len(prompt):]
        offered, group = dataset.tools(index), []
        for turn in first:
            new_ids, new_labels, rollout = continue_rollout(model, prompt, turn, dataset.encoder, offered,
                                                            max_new_tokens, max_turns, temperature, generator,
                                                            autocast, time_limit_s)
            rows.append((torch.cat([prompt, new_ids]), F.pad(new_labels, (len(prompt), 0), value=IGNORE_INDEX)))
            group.append(rollout)
        texts.append([rollout.turns[-1] for rollout in group])
        rollouts.append(group)
    width = max(len(row) for row, _ in rows)
    input_ids = torch.stack([F.pad(row, (0, width - len(row)), value=PAD_ID) for row, _ in rows])
    labels = torch.stack([F.pad(label, (0, width - len(label)), value=IGNORE_INDEX) for _, label in rows])
    return input_ids, labels, texts, rollouts

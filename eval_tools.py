"""The tool-use score: on held-out questions, does the model call the right tool, with arguments that fit its
schema, answer right after the tool's result, and answer without a call where none is needed?

    python eval_tools.py --weight full_sft                                   # dataset/tool_demo_eval.jsonl
    python eval_tools.py --weight full_sft --data my_tools.jsonl --max_calls 2

Each line of --data (dataset/make_stage_data.py writes the demo's):

    {"conversations": [{"role": "user", "content": "What is 208 * 95?"}],   the prompt
     "tools": ["calculator", "get_weather"],      offered: names of dataset/tools.py's DEMO_TOOLS
     "tool": "calculator",                        the tool the question needs; null: none
     "answer": "19760"}                           the final answer, compared exactly (after the think block)

An item: the model answers greedily; each call it writes is checked against the tool's JSON schema and run
(dataset/tools.run_tool: a child process, bounded in time, memory and output), its result appended as the chat template
renders it, and the model answers again, up to --max_calls rounds of calls. A line per item, then the totals:
right tool (of the items that need one), valid arguments (of the calls made), no call (of the items that need
none), right answer and all right (of all items). Greedy decoding and tools that are plain functions: the same
model scores the same, every run.

A failed call (a tool that raised, hung, ran out of memory, or returned what is not JSON, or too much) fails its
item, with a line naming the tool and what happened; the run goes on to the next item. A malformed call in the
model's text (not JSON, not closed) is read as its answer, which is then wrong.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NamedTuple

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from dataset.json_text import not_a_data_file
from dataset.jsonl_file import JsonlFile
from dataset.tool_calls import parse_tool_calls
from dataset.tools import DEMO_TOOLS, TIME_LIMIT_S, Tool, argument_problem, run_tool
from eval_model import add_model_flags, answer_from_generation, chat_prompt_ids, generate_text, load_model
from model.model import CausalLM
from model.tokenizer import load_tokenizer
from trainer.trainer_utils import REPO_ROOT

Answer = Callable[[list[dict], list[dict]], str]  # (messages, tool specs) -> what the model writes


class ItemScore(NamedTuple):
    needs_call: bool
    right_tool: bool  # the calls all name the tool the item needs; or no call, where it needs none
    calls: int
    valid_calls: int  # calls whose arguments fit the tool's schema
    right_answer: bool
    answer: str  # the final answer ("" when a failed call ended the item)
    notes: list[str]  # failed calls, malformed calls, a model that does not stop calling

    @property
    def all_right(self) -> bool:
        return self.right_tool and self.valid_calls == self.calls and self.right_answer


def check_record(record: dict, tools: dict[str, Tool] = DEMO_TOOLS) -> None:
    """Raises ValueError saying what a --data line lacks (JsonlFile names the file and the line)."""
    if not (isinstance(record.get("conversations"), list) and record["conversations"]):
        raise ValueError('needs "conversations": the prompt, a non-empty list of messages')
    offered = record.get("tools")
    if not (isinstance(offered, list) and offered and all(name in tools for name in offered)):
        raise ValueError(f'needs "tools": a list of the tools offered, among {", ".join(tools)}')
    if record.get("tool") is not None and record["tool"] not in offered:
        raise ValueError(f'"tool" {record["tool"]!r} is not among the "tools" offered; null for no call')
    if not isinstance(record.get("answer"), str):
        raise ValueError('needs "answer": the final answer, a string')


def read_items(path: str) -> list[dict]:
    """The items of a --data file, each checked (check_record): a DataFileError (a ValueError) names the file and
    the line of the first bad one."""
    source = JsonlFile(path, validate=check_record)
    return [source.read(i) for i in range(len(source))]


def score_item(answer: Answer, record: dict, tools: dict[str, Tool] = DEMO_TOOLS, max_calls: int = 3,
               time_limit_s: float = TIME_LIMIT_S) -> ItemScore:
    """Ask, run the calls, ask again, up to `max_calls` rounds of calls; score what happened."""
    offered = {name: tools[name] for name in record["tools"]}
    specs = [tool.spec for tool in offered.values()]
    messages, called, valid, notes, final, failed = list(record["conversations"]), [], 0, [], "", False
    for round_ in range(max_calls + 1):
        text = answer_from_generation(answer(messages, specs))
        try:
            content, calls = parse_tool_calls(text)
        except ValueError as error:
            notes.append(f"malformed tool call, read as the answer: {error}")
            final = text
            break
        if not calls:
            final = content
            break
        if round_ == max_calls:
            notes.append(f"still calling tools after {max_calls} rounds (--max_calls)")
            break
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        results = []
        for call in calls:
            called.append(call["name"])
            valid += call["name"] in offered and argument_problem(offered[call["name"]], call["arguments"]) is None
            results.append(run_tool(call["name"], call["arguments"], offered, time_limit_s))
        failures = [result.failure for result in results if result.failure]
        if failures:  # a failed call fails the item: the model never gets a result to answer from
            notes += failures
            failed = True
            break
        messages += [{"role": "tool", "content": result.text} for result in results]
    needed = record.get("tool")
    right_tool = set(called) == {needed} if needed is not None else not called
    right_answer = not failed and final.strip() == record["answer"].strip()
    return ItemScore(needed is not None, right_tool, len(called), valid, right_answer, final.strip(), notes)


def item_line(n: int, record: dict, score: ItemScore) -> str:
    question = record["conversations"][-1].get("content", "")
    call = f"calls {score.calls} ({score.valid_calls} valid)" if score.calls else "no call"
    verdict = "right" if score.all_right else "WRONG"
    return (f"#{n} {question!r} [{record.get('tool') or 'no tool'}]: {call}, answer {score.answer!r} "
            f"(expected {record['answer'].strip()!r}): {verdict}" + "".join(f"\n    {note}" for note in score.notes))


def totals(scores: list[ItemScore]) -> dict[str, str]:
    """Each total as "count/total = pct%", by its name: all right, right tool (of the items that need a call),
    valid arguments (of the calls), no call (of the items that need none), right answer."""
    def share(count: int, total: int) -> str:
        return f"{count}/{total} = {100.0 * count / total:.1f}%" if total else "0/0"

    needing = [s for s in scores if s.needs_call]
    free = [s for s in scores if not s.needs_call]
    return {"all right": share(sum(s.all_right for s in scores), len(scores)),
            "right tool": share(sum(s.right_tool for s in needing), len(needing)),
            "valid arguments": share(sum(s.valid_calls for s in scores), sum(s.calls for s in scores)),
            "no call where none is needed": share(sum(s.right_tool for s in free), len(free)),
            "right answer": share(sum(s.right_answer for s in scores), len(scores))}


def totals_line(scores: list[ItemScore]) -> str:
    return "tool-use score: " + " | ".join(f"{name} {share}" + " of calls" * (name == "valid arguments")
                                           for name, share in totals(scores).items())


def score_model(model: CausalLM, tokenizer: Tokenizer, records: list[dict], max_new_tokens: int = 96,
                max_calls: int = 3, time_limit_s: float = TIME_LIMIT_S,
                show: Callable[[str], None] | None = None) -> list[ItemScore]:
    """Each record scored (score_item) with the model answering greedily; `show` gets each item's line."""
    positions = model.config.max_position_embeddings

    def answer(messages: list[dict], specs: list[dict]) -> str:
        prompt_ids = chat_prompt_ids(tokenizer, messages, specs)
        room = positions - len(prompt_ids)
        return generate_text(model, tokenizer, prompt_ids, min(max_new_tokens, room)) if room > 0 else ""

    scores = []
    for n, record in enumerate(tqdm(records, desc="tool use", unit="item", file=sys.stderr, disable=show is None),
                               start=1):
        scores.append(score_item(answer, record, DEMO_TOOLS, max_calls, time_limit_s))
        if show is not None:
            show(item_line(n, record, scores[-1]))
    return scores


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The tool-use score of a model saved in out/")
    add_model_flags(p)
    p.add_argument("--data", default=str(REPO_ROOT / "dataset" / "tool_demo_eval.jsonl"))
    p.add_argument("--max_new_tokens", type=int, default=96, help="per answer")
    p.add_argument("--max_calls", type=int, default=3, help="rounds of tool calls an item may take")
    p.add_argument("--tool_time_limit", type=float, default=TIME_LIMIT_S, help="seconds a tool call may take")
    args = p.parse_args(argv)
    problem = not_a_data_file(args.data)
    try:
        if problem:
            raise ValueError(f"--data {args.data}: {problem}")
        records = read_items(args.data)  # a bad line is said before a model is loaded
        tokenizer = load_tokenizer(args.tokenizer_path)
        model = load_model(args, tokenizer, torch.device(args.device), log=lambda line: print(line, file=sys.stderr))
    except (OSError, ValueError, RuntimeError) as error:  # a DataFileError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2  # an expected error exits 2, as in eval_model.py
    scores = score_model(model, tokenizer, records, args.max_new_tokens, args.max_calls, args.tool_time_limit,
                         show=lambda line: tqdm.write(line, file=sys.stdout))
    print(totals_line(scores), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

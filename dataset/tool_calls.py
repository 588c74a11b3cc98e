r"""A model's tool calls read back out of its answer, the text after its think block, as the chat template
writes them (model/chat_template.py):

    {content}\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>
    \n<tool_call>\n{...}\n</tool_call>

A reply holds calls when every `<tool_call>` block in it is closed, holds a JSON object with a string "name" and an
object "arguments", and nothing but whitespace stands between or after the blocks. Anything else is malformed:
parse_tool_calls says what, and the caller keeps the reply as text (the server) or scores it (eval_tools.py).
"""

from __future__ import annotations

import json
import re

from dataset.json_text import parse_json_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def parse_tool_calls(answer: str) -> tuple[str, list[dict]]:
    """(content, calls) of an answer: the text before the first call (without the newline the template puts
    between them) and each call as {"name": str, "arguments": dict}. An answer without `<tool_call>` is all
    content, no calls. Raises ValueError saying what is malformed."""
    start = answer.find(OPEN)
    if start < 0:
        return answer, []
    content, rest = answer[:start], answer[start:]
    calls, end = [], 0
    for n, block in enumerate(_BLOCK.finditer(rest), start=1):
        if rest[end:block.start()].strip():
            raise ValueError(f"text between tool calls {n - 1} and {n}: {rest[end:block.start()].strip()[:40]!r}")
        calls.append(_read_call(block.group(1), n))
        end = block.end()
    if OPEN in rest[end:]:
        raise ValueError(f"tool call {len(calls) + 1} is not closed by {CLOSE}")
    if rest[end:].strip():
        raise ValueError(f"text after the last tool call: {rest[end:].strip()[:40]!r}")
    return content.removesuffix("\n"), calls


def _read_call(text: str, n: int) -> dict:
    try:
        call = parse_json_text(text.strip())  # as any JSON this project reads: not nested past its limit
    except ValueError as error:
        raise ValueError(f"tool call {n} is not JSON ({error})") from None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]
            and isinstance(call.get("arguments"), dict) and set(call) == {"name", "arguments"}):
        raise ValueError(f'tool call {n} is not {{"name": "...", "arguments": {{...}}}}: {text.strip()[:60]!r}')
    return {"name": call["name"], "arguments": call["arguments"]}


def visible_content(answer: str) -> str:
    """The part of an answer still being written that is content whatever follows: up to a `<tool_call>`,
    without a tail that may yet become one, nor the newline that would then go before it."""
    cut = answer.find(OPEN)
    if cut >= 0:
        answer = answer[:cut]
    else:
        for k in range(len(OPEN) - 1, 0, -1):  # "...<tool_c": it may be a call opening
            if answer.endswith(OPEN[:k]):
                answer = answer[:-k]
                break
    return answer.rstrip()

"""OpenAI's chat messages and tools, in the project's chat schema and back, for scripts/serve_openai_api.py.

A request's `tools` (function specs) are offered in the chat template's system turn, as
`apply_chat_template(messages, tools=tools)` offers them. `tool_choice`:

    "auto" (the default)   the model calls a tool or answers, as it likes
    "none"                 the tools are not offered; the reply is text, whatever it holds
    "required"             the reply is started for the model: an empty think block, then "<tool_call>\\n"
    {"type": "function", "function": {"name": "f"}}
                           started further, up to '{"name": "f", "arguments": ', so the model writes the arguments

The model's `<tool_call>` blocks (dataset/tool_calls.py) come back as OpenAI's `tool_calls` (an id each, the name,
the arguments as a JSON string) with finish_reason "tool_calls". A reply whose calls are malformed (not JSON, not
closed, a tool the request does not offer) is returned as the text the model wrote. The next request may hold the
assistant message (content null, its tool_calls) and a `role: "tool"` message per call, whose `tool_call_id`
must name a call of the assistant message before it; the results are rendered in the order given.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tokenizers import Tokenizer

from dataset.chat_format import template_segments
from dataset.tool_calls import parse_tool_calls
from eval_model import chat_encoder

EMPTY_THINK = "<think>\n\n</think>\n\n"  # what the chat template writes for a turn without reasoning


class BadRequest(Exception):
    """A request refused with a 400 in OpenAI's shape: the message, and the field it names (or None)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class Function(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule; it also keeps tags out of the prompt
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: Function


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str


class NamedChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionName


# As the request holds it; tool_setup reads it (a union left to pydantic would name its members in the 400).
ToolChoice = str | dict


class ToolSetup(NamedTuple):
    """What a request's tools make of its prompt and its reply."""
    specs: list[dict] | None  # offered in the system turn; None: no tools offered
    reply_start: str  # the reply's first text, written for the model (tool_choice "required" or a named function)
    names: frozenset[str]  # the tools a call may name; empty: the reply is read as text only


def tool_setup(tools: list[ToolSpec] | None, tool_choice: ToolChoice | None) -> ToolSetup:
    """The tools of a request; BadRequest names a tool_choice that does not fit them."""
    if not tools:
        if tool_choice is not None:
            raise BadRequest("tool_choice: given without tools; offer the functions in `tools`", "tool_choice")
        return ToolSetup(None, "", frozenset())
    names = [tool.function.name for tool in tools]
    for name in names:
        if names.count(name) > 1:
            raise BadRequest(f"tools: two functions are named {name!r}; give each a name of its own", "tools")
    if tool_choice == "none":
        return ToolSetup(None, "", frozenset())
    specs = [tool.model_dump(exclude_none=True) for tool in tools]
    if isinstance(tool_choice, dict):
        try:
            name = NamedChoice.model_validate(tool_choice).function.name
        except ValidationError:
            raise BadRequest('tool_choice: expected "auto", "none", "required" or {"type": "function", "function": '
                             '{"name": "..."}}', "tool_choice") from None
        if name not in names:
            raise BadRequest(f"tool_choice.function.name: {name!r} is not a function of `tools` "
                             f"({', '.join(names)})", "tool_choice")
        return ToolSetup(specs, f'{EMPTY_THINK}<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
                         frozenset(names))
    if tool_choice not in (None, "auto", "required"):
        raise BadRequest(f'tool_choice: {tool_choice!r}; expected "auto", "none", "required" or {{"type": "function", '
                         f'"function": {{"name": "..."}}}}', "tool_choice")
    return ToolSetup(specs, f"{EMPTY_THINK}<tool_call>\n" if tool_choice == "required" else "", frozenset(names))


def reply_start_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of a reply's start written for the model: its tags as tag tokens, as training writes them."""
    return chat_encoder(tokenizer).encode(template_segments(text))[0]


def plain_messages(messages: list[dict]) -> list[dict]:
    """OpenAI's messages in the schema dataset/chat_format.py checks: a content given as a list of text parts
    becomes their texts joined by newlines; `name` (the writer's name) and null fields are left out, as the chat
    template has no place for them; an assistant's null content beside its tool_calls is "". A tool message's
    tool_call_id is checked against the calls before it, then left out (results are rendered in order). Raises
    ValueError naming the message and what is wrong."""
    plain, call_ids = [], set()
    for n, message in enumerate(messages, start=1):
        if isinstance(message, dict):  # anything else is named by chat_format's check
            message = {key: value for key, value in message.items() if key != "name" and value is not None}
            if message.get("role") == "assistant" and "tool_calls" in message:
                message.setdefault("content", "")
                call_ids = {call.get("id") for call in message["tool_calls"] if isinstance(call, dict)} \
                    if isinstance(message["tool_calls"], list) else set()
            if message.get("role") == "tool":
                call_id = message.pop("tool_call_id", None)
                if not isinstance(call_id, str) or call_id not in call_ids:
                    raise ValueError(f"message {n}: tool_call_id {call_id!r} names no call of the assistant "
                                     f"message before it ({', '.join(sorted(map(str, call_ids))) or 'none'})")
            if isinstance(message.get("content"), list):
                for k, part in enumerate(message["content"], start=1):
                    if not (isinstance(part, dict) and part.get("type") == "text"
                            and isinstance(part.get("text"), str)):
                        raise ValueError(f'message {n}: content part {k} is not {{"type": "text", "text": "..."}}; '
                                         f"this model reads text only")
                message["content"] = "\n".join(part["text"] for part in message["content"])
        plain.append(message)
    return plain


def read_answer(answer: str, setup: ToolSetup) -> tuple[str, list[dict], str | None]:
    """(content, OpenAI tool_calls, why the calls were read as text or None) of a reply's answer."""
    if not setup.names:
        return answer, [], None
    try:
        content, calls = parse_tool_calls(answer)
        for n, call in enumerate(calls, start=1):
            if call["name"] not in setup.names:
                raise ValueError(f"tool call {n} names {call['name']!r}, not a function of the request's tools")
    except ValueError as error:
        return answer, [], str(error)
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
                     for call in calls], None


def tool_call_deltas(calls: list[dict]) -> list[dict]:
    """The stream deltas of whole calls, as OpenAI sends them: the id, type and name with empty arguments, then the
    arguments (OpenAI sends them in pieces; here a call is sent once it is whole, as it may turn out malformed)."""
    deltas = []
    for index, call in enumerate(calls):
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]})
    return deltas

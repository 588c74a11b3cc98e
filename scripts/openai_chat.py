"""OpenAI's chat requests, messages and tools, in the project's chat schema and back, for
scripts/serve_openai_api.py: read_chat_request reads and checks a request's body.

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
assistant message (content null, its tool_calls) and, right after it, one `role: "tool"` message per call, whose
`tool_call_id` names the call; the results are rendered in the order given. As OpenAI's API, a call left unanswered,
two calls of one id, arguments that are not a JSON object and a field of the wrong JSON type are refused with a 400
naming the field (messages[1].tool_calls[0].id).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tokenizers import Tokenizer

from dataset.chat_format import template_segments
from dataset.json_text import parse_json_text
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


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat request read here; others ("model", "stop", ...) are ignored."""
    # Strict, as OpenAI's API is: "max_tokens": "5", "stream": "yes" or "temperature": "0.5" get a 400 naming
    # the field rather than a guess at what was meant; bool is no int ("max_tokens": true); a float field
    # takes a whole number ("temperature": 1).
    model_config = ConfigDict(strict=True)
    messages: list[dict] = Field(min_length=1)  # each checked by dataset/chat_format.py as the prompt is built
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)  # 0 = greedy, as in eval_model.py (and under 1e-5)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = 1  # choices: one per request is served, other values are refused rather than ignored
    stream: bool = False
    tools: list[ToolSpec] | None = None  # scripts/openai_chat.py: offered in the chat template's system turn
    tool_choice: ToolChoice | None = None


def read_chat_request(body: bytes, max_tokens_limit: int) -> tuple[ChatRequest, ToolSetup, list[dict]]:
    """The request a body holds, what its tools make of the prompt, and its messages in the project's schema;
    BadRequest says what is wrong (it is run in a thread: a body of a million elements takes a tenth of a second)."""
    try:  # invalid JSON, too deeply nested, a lone surrogate, a NaN or Infinity (JSON has none; OpenAI refuses them)
        value = parse_json_text(body.decode("utf-8"), allow_nan=False)
    except UnicodeDecodeError as error:
        raise BadRequest(f"the request body is not UTF-8 text ({error.reason} at byte {error.start + 1})") from None
    except ValueError as error:  # "messages[0].content holds a lone surrogate ...": that field is named
        top = re.match(r"\w*", str(error))[0]
        raise BadRequest(f"the request body holds {error}" if str(error).startswith("invalid JSON") else str(error),
                         top if top in ChatRequest.model_fields else None) from None
    if not isinstance(value, dict):
        raise BadRequest(f'the request body must be a JSON object {{"messages": [...], ...}}, not '
                         f"{type(value).__name__}")
    try:
        request = ChatRequest.model_validate(value)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        raise BadRequest(f"{field or 'the request body'}: {first['msg']}", field) from None
    if request.n != 1:
        raise BadRequest(f"n: {request.n} asked; this server writes one choice per request (n=1): for several "
                         f"answers, send several requests", "n")
    if (request.max_tokens or 0) > max_tokens_limit:
        raise BadRequest(f"max_tokens: {request.max_tokens} asked; this server writes at most {max_tokens_limit} "
                         f"tokens per reply (--max_tokens_limit)", "max_tokens")
    # the tools offered and how the reply starts; the messages with OpenAI's fields checked and taken off
    return request, tool_setup(request.tools, request.tool_choice), plain_messages(request.messages)


def reply_start_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of a reply's start written for the model: its tags as tag tokens, as training writes them."""
    return chat_encoder(tokenizer).encode(template_segments(text))[0]


# The JSON type of each field of an OpenAI message read here (a null field is taken for one not given); the
# other fields are named by dataset/chat_format.py's check.
MESSAGE_FIELDS = {"role": str, "content": (str, list), "name": str, "reasoning_content": str, "tool_calls": list,
                  "tool_call_id": str}
JSON_TYPES = ((str, "a string"), (list, "an array"), (dict, "an object"), (bool, "a boolean"), ((int, float), "a number"))


def json_type(value: object) -> str:
    """`value`'s type as JSON names it ("an array"), for a message saying what was expected instead."""
    return next((name for kind, name in JSON_TYPES if isinstance(value, kind)), "null")


def expect(value: object, kind: type | tuple[type, ...], where: str) -> None:
    """BadRequest naming `where`, as OpenAI's ("messages[1].tool_calls[0].id: expected a string, got an array"),
    unless `value` is of `kind`."""
    if not isinstance(value, kind):
        wanted = " or ".join(name for types, name in JSON_TYPES if types in (kind if isinstance(kind, tuple) else (kind,)))
        raise BadRequest(f"{where}: expected {wanted}, got {json_type(value)}", where)


def tool_call_ids(calls: list, where: str) -> list[str]:
    """The ids of an assistant message's `tool_calls` (at `where`), each call checked: OpenAI's
    {"id", "type": "function", "function": {"name", "arguments"}}, the arguments a string holding a JSON object."""
    ids: list[str] = []
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        expect(call, dict, at)
        expect(call.get("id"), str, f"{at}.id")
        if call["id"] in ids:
            raise BadRequest(f"{at}.id: {call['id']!r} is also the id of {where}[{ids.index(call['id'])}]; give each "
                             f"call an id of its own (its tool message names it)", f"{at}.id")
        if call.get("type") != "function":
            raise BadRequest(f'{at}.type: expected "function"', f"{at}.type")
        expect(call.get("function"), dict, f"{at}.function")
        expect(call["function"].get("name"), str, f"{at}.function.name")
        expect(call["function"].get("arguments"), str, f"{at}.function.arguments")
        try:
            arguments = parse_json_text(call["function"]["arguments"], allow_nan=False)
        except ValueError as error:
            raise BadRequest(f"{at}.function.arguments: {error}", f"{at}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise BadRequest(f"{at}.function.arguments: holds {json_type(arguments)}; expected a JSON object of the "
                             f"arguments by name, e.g. '{{\"city\": \"Lima\"}}'", f"{at}.function.arguments")
        ids.append(call["id"])
    return ids


def plain_text(content: list, where: str) -> str:
    """A content given as a list of text parts: their texts joined by newlines."""
    for k, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise BadRequest(f'{where}[{k}]: expected {{"type": "text", "text": "..."}}; this model reads text only',
                             f"{where}[{k}]")
    return "\n".join(part["text"] for part in content)


def plain_message(message: dict, i: int) -> dict:
    """messages[i] with each field of its JSON type, nulls and `name` (the writer's name, which the chat template has
    no place for) left out, a content of text parts joined by newlines, an assistant's null content beside its
    tool_calls ""."""
    message = {key: value for key, value in message.items() if value is not None}
    for field, kind in MESSAGE_FIELDS.items():
        if field in message:
            expect(message[field], kind, f"messages[{i}].{field}")
    if message.get("role") == "tool":
        expect(message.get("tool_call_id"), str, f"messages[{i}].tool_call_id")  # the call it answers
    if message.get("role") == "assistant" and "tool_calls" in message:
        message.setdefault("content", "")
    if isinstance(message.get("content"), list):
        message["content"] = plain_text(message["content"], f"messages[{i}].content")
    message.pop("name", None)
    return message


def plain_messages(messages: list) -> list[dict]:
    """OpenAI's messages in the schema dataset/chat_format.py checks (plain_message). Each call of an assistant
    message must be answered by one `role: "tool"` message right after it, naming it by tool_call_id, as OpenAI's
    API requires; then the ids are left out (results are rendered in order). BadRequest names the field, as
    OpenAI's API does (messages[1].tool_calls[0].id)."""
    plain: list = []
    calls: list[str] = []  # the ids of the last assistant message's calls, while tool messages answer them
    answered: dict[str, int] = {}  # those answered: the index of the tool message that answers each
    asked_at = 0  # the index of that assistant message
    for i, message in enumerate(messages):
        if not isinstance(message, dict):  # named by chat_format's check
            plain.append(message)
            continue
        message = plain_message(message, i)
        if message.get("role") == "tool":
            call_id = message.pop("tool_call_id")
            if call_id in answered:
                raise BadRequest(f"messages[{i}].tool_call_id: {call_id!r} is answered already, by messages"
                                 f"[{answered[call_id]}]; send one tool message per call", f"messages[{i}].tool_call_id")
            if call_id not in calls:
                raise BadRequest(f"messages[{i}].tool_call_id: {call_id!r} names no call of the assistant message "
                                 f"before it ({', '.join(calls) or 'none'})", f"messages[{i}].tool_call_id")
            answered[call_id] = i
        else:
            unanswered = [call_id for call_id in calls if call_id not in answered]
            if unanswered:
                raise BadRequest(f"messages[{i}].role: an assistant message with tool_calls (messages[{asked_at}]) "
                                 f"must be followed by a tool message answering each call; not answered: "
                                 f"{', '.join(unanswered)}", f"messages[{i}].role")
            calls, answered, asked_at = [], {}, i
            if message.get("role") == "assistant" and "tool_calls" in message:
                calls = tool_call_ids(message["tool_calls"], f"messages[{i}].tool_calls")
        plain.append(message)
    unanswered = [call_id for call_id in calls if call_id not in answered]
    if unanswered:  # OpenAI's API refuses it too: a call the conversation goes on from must have its result
        raise BadRequest(f"messages[{asked_at}].tool_calls: not answered: {', '.join(unanswered)}; give a tool message "
                         f"with the result of each call after it", f"messages[{asked_at}].tool_calls")
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

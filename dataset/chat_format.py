r"""minimind's chat format (Qwen3 style): one renderer for training, evaluation and the export.

A conversation is a list of messages in minimind's SFT schema:

    {"role": "system", "content": "...", "tools": "[{...function spec...}]"}      tools optional
    {"role": "user", "content": "..."}
    {"role": "assistant", "content": "...", "reasoning_content": "...",
     "tool_calls": "[{\"name\": \"...\", \"arguments\": {...}}]"}                  both optional
    {"role": "tool", "content": "...the result of a call..."}

`tools` and `tool_calls` may be JSON strings (as minimind stores them) or already parsed lists.
It renders as (the system turn only when there is a system message or tools):

    <|im_start|>system\n{system}\n\n# Tools ... <tools>\n{spec as JSON}\n</tools> ...<|im_end|>\n
    <|im_start|>user\n{content}<|im_end|>\n
    <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}
        \n<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response>\n<tool_response>...<|im_end|>\n

Consecutive `tool` messages share one `user` turn. Every assistant turn has a think block (empty
when there is no reasoning), so a model learns to open one; eval reads the answer after it.

The renderer produces *segments* rather than one string, so the dataset knows, token by token,
what is template and what is data, and what the loss covers: each assistant turn after its
`<|im_start|>assistant\n` header — think block, answer, tool calls, `<|im_end|>` and the newline
after it (as in minimind, whose mask ends after `<|im_end|>\n`) — and nothing else.
`CHAT_TEMPLATE` renders the same text in Jinja for `transformers`' `apply_chat_template`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby
from typing import Any, Iterable, NamedTuple

from tokenizers import Tokenizer

from model.tokenizer import BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Tags of the format. A tokenizer that has one of them as a token of its own (minimind's has the
# think, tool_call and tool_response ones) gets that token; otherwise the tag is ordinary text.
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>",
        "<tool_response>", "</tool_response>", "<tools>", "</tools>")
GENERATION_PROMPT = f"{BOS_TOKEN}assistant\n"
TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_TAG_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in (BOS_TOKEN, EOS_TOKEN, *TAGS)) + ")")


class Segment(NamedTuple):
    """A piece of rendered text: a tag (`<|im_start|>`, `<think>`, ...) or text; trained or not."""
    text: str
    is_tag: bool
    trained: bool


# ---- the schema: parse and check one conversation -------------------------------------------

@dataclass(frozen=True)
class Message:
    """One checked message. `content` has any inline `<think>...</think>` block moved to `reasoning`."""
    role: str
    content: str
    reasoning: str = ""
    tool_calls: tuple[str, ...] = ()  # each call as the JSON text that goes between the tool_call tags


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    tools: tuple[str, ...]  # each function spec as one JSON line; empty: no tools section


def _to_json(value: Any) -> str:
    """JSON as the prompt shows it: json.dumps defaults, non-ASCII kept, keys in their order."""
    return json.dumps(value, ensure_ascii=False)


def _parsed(value: Any, field: str) -> Any:
    """`value` itself, or the JSON it holds when it is a string (minimind stores lists as strings)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise ValueError(f'"{field}" is not valid JSON ({e})') from None


def _parse_tools(value: Any) -> tuple[str, ...]:
    tools = _parsed(value, "tools")
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ValueError('"tools" must be a list of function specs (JSON objects), '
                         'e.g. [{"type": "function", "function": {"name": "...", "parameters": {...}}}]')
    return tuple(_to_json(tool) for tool in tools)


def _parse_tool_call(entry: Any, n: int) -> str:
    """The JSON text of one call: {"name": ..., "arguments": ...}; OpenAI's {"function": {...}} is unwrapped."""
    if isinstance(entry, dict) and isinstance(entry.get("function"), dict):
        entry = entry["function"]
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
        raise ValueError(f'"tool_calls" entry {n} needs a string "name", e.g. {{"name": "get_weather", '
                         f'"arguments": {{"city": "Lima"}}}}')
    arguments = entry.get("arguments")
    if isinstance(arguments, str):
        # Written as given (minimind does the same), so it has to be JSON already.
        _parsed(arguments, f"tool_calls entry {n} arguments")
    elif isinstance(arguments, dict):
        arguments = _to_json(arguments)
    else:
        raise ValueError(f'"tool_calls" entry {n} needs "arguments": a JSON object, or a string holding one')
    return f'{{"name": {_to_json(entry["name"])}, "arguments": {arguments}}}'


def _parse_tool_calls(value: Any) -> tuple[str, ...]:
    calls = _parsed(value, "tool_calls")
    if not isinstance(calls, list):
        raise ValueError('"tool_calls" must be a list of calls, e.g. [{"name": "...", "arguments": {...}}]')
    return tuple(_parse_tool_call(entry, n) for n, entry in enumerate(calls, start=1))


def _split_inline_think(content: str) -> tuple[str, str]:
    """(reasoning, answer) of content written as "<think>...</think>answer" (minimind's reasoning data)."""
    if "</think>" not in content:
        return "", content
    parts = content.split("</think>")
    return parts[0].rstrip("\n").split("<think>")[-1].lstrip("\n"), parts[-1].lstrip("\n")


def _is_given(value: Any) -> bool:
    """minimind's loader fills absent fields with null, and writes "" for none: both mean not given."""
    return value is not None and value != ""


def _parse_message(message: Any, is_first: bool) -> tuple[Message, tuple[str, ...]]:
    """One checked message, and the tools it carries (only the first, system message may)."""
    if not isinstance(message, dict):
        raise ValueError(f'is {type(message).__name__}, expected an object with "role" and "content"')
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError('needs string fields "role" and "content" (use "" for no content)')
    if role not in CHAT_ROLES:
        raise ValueError(f"unknown role {role!r}; allowed roles are {', '.join(CHAT_ROLES)}")
    unknown = sorted(set(message) - {"role", "content", "reasoning_content", "tool_calls", "tools"})
    if unknown:
        raise ValueError(f"fields this trainer does not read: {', '.join(unknown)}. Remove them; the schema "
                         "has role, content, reasoning_content and tool_calls (assistant), tools (first, "
                         "system message)")
    for field, allowed in (("reasoning_content", role == "assistant"), ("tool_calls", role == "assistant"),
                           ("tools", role == "system" and is_first)):
        if _is_given(message.get(field)) and not allowed:
            where = "the first message, a system one" if field == "tools" else "assistant messages"
            raise ValueError(f'a {role} message has "{field}", which belongs to {where}')
    tools = _parse_tools(message["tools"]) if _is_given(message.get("tools")) else ()
    if role != "assistant":
        return Message(role, content), tools
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning, content = _split_inline_think(content)
    elif not isinstance(reasoning, str):
        raise ValueError(f'"reasoning_content" is {type(reasoning).__name__}, expected a string')
    calls = _parse_tool_calls(message["tool_calls"]) if _is_given(message.get("tool_calls")) else ()
    return Message(role, content, reasoning, calls), tools


def parse_conversation(messages: Any) -> Conversation:
    """Check `messages` against the schema; raises ValueError naming the message and the problem."""
    if not isinstance(messages, list) or not messages:
        raise ValueError('expected a non-empty list "conversations" of {"role", "content"} messages')
    parsed, tools = [], ()
    for n, message in enumerate(messages, start=1):
        try:
            checked, message_tools = _parse_message(message, is_first=n == 1)
        except ValueError as e:
            raise ValueError(f"message {n}: {e}") from None
        parsed.append(checked)
        tools = tools or message_tools
    return Conversation(tuple(parsed), tools)


# ---- rendering ------------------------------------------------------------------------------

@lru_cache(maxsize=None)  # only the template's own, fixed strings come here
def _template_parts(text: str) -> tuple[tuple[str, bool], ...]:
    """`text` cut at its tags: (part, is_tag) pairs."""
    return tuple((part, _TAG_SPLIT.fullmatch(part) is not None) for part in _TAG_SPLIT.split(text) if part)


class _Writer:
    """Collects segments: template text is split at its tags, data text never is."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def template(self, text: str, trained: bool = False) -> None:
        self.segments += [Segment(part, is_tag, trained) for part, is_tag in _template_parts(text)]

    def data(self, text: str, trained: bool = False) -> None:
        if text:
            self.segments.append(Segment(text, False, trained))


def _write_system_turn(conversation: Conversation, out: _Writer) -> None:
    first = conversation.messages[0]
    if conversation.tools:
        out.template(f"{BOS_TOKEN}system\n")
        if first.role == "system":
            out.data(first.content)
            out.template("\n\n")
        out.template(TOOLS_INTRO)
        for spec in conversation.tools:
            out.template("\n")
            out.data(spec)
        out.template(f"{TOOLS_OUTRO}{EOS_TOKEN}\n")
    elif first.role == "system":
        out.template(f"{BOS_TOKEN}system\n")
        out.data(first.content)
        out.template(f"{EOS_TOKEN}\n")


def _write_assistant_turn(message: Message, out: _Writer, drop_empty_think: bool) -> None:
    out.template(f"{BOS_TOKEN}assistant\n")
    reasoning = message.reasoning.strip("\n")
    if reasoning or not drop_empty_think:
        out.template("<think>\n", trained=True)
        out.data(reasoning, trained=True)
        out.template("\n</think>\n\n", trained=True)
    out.data(message.content.lstrip("\n"), trained=True)
    for n, call in enumerate(message.tool_calls):
        if n > 0 or message.content:  # a newline between calls, and after the answer text if any
            out.template("\n", trained=True)
        out.template("<tool_call>\n", trained=True)
        out.data(call, trained=True)
        out.template("\n</tool_call>", trained=True)
    out.template(f"{EOS_TOKEN}\n", trained=True)


def render_segments(messages: Any, add_generation_prompt: bool = False,
                    drop_empty_think: bool = False) -> list[Segment]:
    """The conversation as segments; `drop_empty_think` leaves out think blocks with no reasoning."""
    conversation = parse_conversation(messages)
    out = _Writer()
    _write_system_turn(conversation, out)
    turns = conversation.messages
    for i, message in enumerate(turns):
        if message.role == "assistant":
            _write_assistant_turn(message, out, drop_empty_think)
        elif message.role == "tool":
            if i == 0 or turns[i - 1].role != "tool":
                out.template(f"{BOS_TOKEN}user")
            out.template("\n<tool_response>\n")
            out.data(message.content)
            out.template("\n</tool_response>")
            if i == len(turns) - 1 or turns[i + 1].role != "tool":
                out.template(f"{EOS_TOKEN}\n")
        elif i > 0 or message.role == "user":  # a first system message is the system turn above
            out.template(f"{BOS_TOKEN}{message.role}\n")
            out.data(message.content)
            out.template(f"{EOS_TOKEN}\n")
    if add_generation_prompt:
        out.template(GENERATION_PROMPT)
    return out.segments


def render_chat_text(messages: Any, add_generation_prompt: bool = False) -> str:
    """The conversation as one string, exactly as CHAT_TEMPLATE renders it."""
    return "".join(segment.text for segment in render_segments(messages, add_generation_prompt))


def to_template_inputs(messages: Any) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for `apply_chat_template(messages, tools=tools)`: the JSON strings parsed.

    Jinja cannot parse JSON, so minimind's `tools` / `tool_calls` strings are decoded here; the
    system message's `tools` becomes the `tools` argument, as transformers expects.
    """
    parse_conversation(messages)  # the same checks as training, with the same messages
    converted, tools = [], None
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        specs = message.pop("tools", None)
        if _is_given(specs):
            tools = _parsed(specs, "tools")
        if _is_given(message.get("tool_calls")):
            message["tool_calls"] = _parsed(message["tool_calls"], "tool_calls")
        else:
            message.pop("tool_calls", None)
        converted.append(message)
    return converted, tools or None


# The same format for transformers' apply_chat_template (`tools=` argument, `add_generation_prompt`).
# transformers' `tojson` is json.dumps with ensure_ascii=False, like _to_json above.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '" + TOOLS_INTRO.replace("\n", "\\n") + "' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '" + TOOLS_OUTRO.replace("\n", "\\n") + "<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}"
    "{%- if message.reasoning_content is not string and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}"
    "{%- if message.tool_calls is string %}"
    "{{- raise_exception('tool_calls must be a parsed list; see dataset/chat_format.to_template_inputs') }}"
    "{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if not loop.first or content %}{{- '\\n' }}{%- endif %}"
    "{%- if call.function is mapping %}{%- set call = call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' }}"
    "{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ---- token ids and the loss mask ------------------------------------------------------------

def text_only_copy(tokenizer: Tokenizer) -> Tokenizer:
    """A copy that reads every added token's text inside data ("<|im_end|>", "<think>") as characters.

    Tags and ChatML tokens are inserted by id, so text that happens to contain them cannot break
    the structure or the loss mask. `encode_special_tokens` only splits tokens marked special, so
    the copy marks every added token special first (minimind's `<think>` is an unmarked one).
    """
    config = json.loads(tokenizer.to_str())
    for added in config["added_tokens"]:
        added["special"] = True
    copy = Tokenizer.from_str(json.dumps(config))
    copy.encode_special_tokens = True
    return copy


class ChatEncoder:
    """Turns segments into token ids and, for each id, whether the loss covers it."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.text_tokenizer = text_only_copy(tokenizer)
        added = {token.content: i for i, token in tokenizer.get_added_tokens_decoder().items()}
        self.tag_ids = {tag: added[tag] for tag in TAGS if tag in added}
        self.tag_ids.update({BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID})
        # Special tokens that are not tags (<|im_start|>, ...) are hidden when decoding; tags stay visible.
        self._hidden_ids = {i for i, token in tokenizer.get_added_tokens_decoder().items()
                            if token.special and token.content not in TAGS}

    def encode(self, segments: Iterable[Segment]) -> tuple[list[int], list[bool]]:
        """(ids, trained): tags the tokenizer has become their id; neighbouring text is encoded together."""
        # A tag without its own token is text; joining it with its neighbours keeps the ids equal to
        # those of encoding the whole rendered string, except where the loss mask starts or ends.
        pieces = [(self.tag_ids.get(s.text) if s.is_tag else None, s.text, s.trained) for s in segments]
        ids: list[int] = []
        trained: list[bool] = []
        for (is_text, is_trained), group in groupby(pieces, key=lambda p: (p[0] is None, p[2])):
            group = list(group)
            if is_text:
                new_ids = self.text_tokenizer.encode("".join(text for _, text, _ in group)).ids
            else:
                new_ids = [token_id for token_id, _, _ in group]
            ids += new_ids
            trained += [is_trained] * len(new_ids)
        return ids, trained

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, with the chat tags kept and other special tokens left out."""
        return self.tokenizer.decode([i for i in ids if i not in self._hidden_ids], skip_special_tokens=False)

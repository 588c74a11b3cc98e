r"""Conversations in minimind's SFT schema, checked, rendered and encoded for training.

    {"role": "system", "content": "...", "tools": "[{...function spec...}]"}      tools optional
    {"role": "user", "content": "..."}
    {"role": "assistant", "content": "...", "reasoning_content": "...",
     "tool_calls": "[{\"name\": \"...\", \"arguments\": {...}}]"}                  both optional
    {"role": "tool", "content": "...the result of a call..."}

`tools` and `tool_calls` may be JSON strings (as minimind stores them) or lists. The text is the one
model/chat_template.py's Jinja template renders (tests/test_sft_schema.py holds the two equal); it is
written here again, as segments, so that each tag is inserted by its id: text inside the data never
becomes a special token. The loss covers each assistant turn after its `<|im_start|>assistant\n`
header, through `<|im_end|>\n` (as in minimind).
"""

from __future__ import annotations

import json
import re
from itertools import groupby
from typing import Any, Iterable, NamedTuple

from tokenizers import Tokenizer

from dataset.json_text import unusable_text
from model.chat_template import TAGS, TOOLS_INTRO, TOOLS_OUTRO
from model.tokenizer import BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN, chars_for_tokens, text_for_tokens, text_only_copy

CHAT_ROLES = ("system", "user", "assistant", "tool")
_TAG_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in (BOS_TOKEN, EOS_TOKEN, *TAGS)) + ")")


class Conversation(NamedTuple):
    """A checked conversation, as `apply_chat_template(messages, tools=tools)` takes it."""
    messages: list[dict]  # assistants' always have reasoning_content and tool_calls ([] for none)
    tools: list[dict]


class Segment(NamedTuple):
    """A piece of rendered text: a tag (`<|im_start|>`, `<think>`, ...) or text; trained or not."""
    text: str
    is_tag: bool
    trained: bool


# ---- the schema: check one conversation -----------------------------------------------------

def _to_json(value: Any) -> str:
    """JSON as the prompt shows it: json.dumps defaults, non-ASCII kept, keys in their order."""
    return json.dumps(value, ensure_ascii=False)


def _from_json(value: Any, field: str) -> Any:
    """`value` itself, or the JSON it holds when it is a string (minimind stores lists as strings). Either way it
    is written back as JSON and tokenized, so it may not nest deeper than MAX_NESTING nor hold a lone surrogate."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f'"{field}" is not valid JSON ({e})') from None
        except RecursionError:
            raise ValueError(f'"{field}" is nested too deeply for Python\'s JSON parser') from None
    problem = unusable_text(value, field)  # nested deeper than MAX_NESTING, or a lone surrogate: where
    if problem is not None:
        raise ValueError(problem)
    return value


def _check_tool_call(call: Any, n: int) -> dict:
    """{"name", "arguments"} of one call; OpenAI's {"function": {...}} wrapper is taken off."""
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        call = call["function"]
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise ValueError(f'"tool_calls" entry {n} needs a string "name", e.g. {{"name": "get_weather", '
                         f'"arguments": {{"city": "Lima"}}}}')
    if isinstance(call.get("arguments"), str):
        _from_json(call["arguments"], f"tool_calls entry {n} arguments")  # written as given: must be JSON
    elif not isinstance(call.get("arguments"), dict):
        raise ValueError(f'"tool_calls" entry {n} needs "arguments": a JSON object, or a string holding one')
    return {"name": call["name"], "arguments": call["arguments"]}


def check_tools(tools: Any) -> list[dict]:
    """The function specs of a "tools" field (a list, or a JSON string holding one); raises ValueError."""
    tools = _from_json(tools, "tools")
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ValueError('"tools" must be a list of function specs (JSON objects), e.g. '
                         '[{"type": "function", "function": {"name": "...", "parameters": {...}}}]')
    return tools


def _check_message(message: Any, is_first: bool) -> dict:
    """The message as CHAT_TEMPLATE reads it; a first system message also carries its parsed "tools"."""
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
    # minimind's loader fills absent fields with null, and writes "" for none: both mean not given.
    given = {field for field in ("reasoning_content", "tool_calls", "tools") if message.get(field) not in (None, "")}
    allowed = {"assistant": {"reasoning_content", "tool_calls"}, "system": {"tools"} if is_first else set()}
    for field in sorted(given - allowed.get(role, set())):
        where = "the first message, a system one" if field == "tools" else "assistant messages"
        raise ValueError(f'a {role} message has "{field}", which belongs to {where}')
    if role == "system" and "tools" in given:
        return {"role": role, "content": content, "tools": check_tools(message["tools"])}  # taken out by the caller
    if role != "assistant":
        return {"role": role, "content": content}
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f'"reasoning_content" is {type(reasoning).__name__}, expected a string')
    if reasoning is None and "</think>" in content:  # minimind's reasoning data: "<think>...</think>answer"
        parts = content.split("</think>")
        reasoning, content = parts[0].rstrip("\n").split("<think>")[-1].lstrip("\n"), parts[-1].lstrip("\n")
    calls = _from_json(message["tool_calls"], "tool_calls") if "tool_calls" in given else []
    if not isinstance(calls, list):
        raise ValueError('"tool_calls" must be a list of calls, e.g. [{"name": "...", "arguments": {...}}]')
    return {"role": role, "content": content, "reasoning_content": reasoning or "",
            "tool_calls": [_check_tool_call(call, n) for n, call in enumerate(calls, start=1)]}


def parse_conversation(messages: Any) -> Conversation:
    """Check `messages` against the schema; raises ValueError naming the message and the problem."""
    if not isinstance(messages, list) or not messages:
        raise ValueError('expected a non-empty list "conversations" of {"role", "content"} messages')
    checked = []
    for n, message in enumerate(messages, start=1):
        try:
            checked.append(_check_message(message, is_first=n == 1))
        except ValueError as e:
            raise ValueError(f"message {n}: {e}") from None
    return Conversation(checked, checked[0].pop("tools", []))


# ---- rendering: the text of model/chat_template.py, as segments ------------------------------

def template_segments(text: str, trained: bool = False) -> list[Segment]:
    """The format's own text (not data) as segments: each tag in it is cut out as a tag."""
    return [Segment(part, _TAG_SPLIT.fullmatch(part) is not None, trained) for part in _TAG_SPLIT.split(text) if part]


def render_segments(messages: Any, add_generation_prompt: bool = False, drop_empty_think: bool = False,
                    tools: Any = None) -> list[Segment]:
    """The conversation as segments; `drop_empty_think` leaves out think blocks with no reasoning. `tools` (as
    `apply_chat_template(messages, tools=tools)` takes them) are offered in the system turn, as a first system
    message's "tools" are: one or the other."""
    turns, tools_in_messages = parse_conversation(messages)
    if tools is not None and tools_in_messages:
        raise ValueError('tools are given both apart and in the first message\'s "tools"; give them once')
    tools = check_tools(tools) if tools is not None else tools_in_messages
    out: list[Segment] = []

    def template(text: str, trained: bool = False) -> None:  # the format's own text: its tags are cut out
        out.extend(template_segments(text, trained))

    def data(text: str, trained: bool = False) -> None:  # never cut: a tag written in the data is text
        if text:
            out.append(Segment(text, False, trained))

    # The same steps as CHAT_TEMPLATE, in the same order.
    has_system = turns[0]["role"] == "system"
    if tools:
        template(f"{BOS_TOKEN}system\n")
        if has_system:
            data(turns[0]["content"])
            template("\n\n")
        template(TOOLS_INTRO)
        for tool in tools:
            template("\n")
            data(_to_json(tool))
        template(f"{TOOLS_OUTRO}{EOS_TOKEN}\n")
    elif has_system:
        template(f"{BOS_TOKEN}system\n")
        data(turns[0]["content"])
        template(f"{EOS_TOKEN}\n")
    for i, message in enumerate(turns):
        role, content = message["role"], message["content"]
        if role == "assistant":
            template(f"{BOS_TOKEN}assistant\n")
            reasoning = message["reasoning_content"].strip("\n")
            if reasoning or not drop_empty_think:
                template("<think>\n", trained=True)
                data(reasoning, trained=True)
                template("\n</think>\n\n", trained=True)
            data(content.lstrip("\n"), trained=True)
            for n, call in enumerate(message["tool_calls"]):
                arguments = call["arguments"] if isinstance(call["arguments"], str) else _to_json(call["arguments"])
                # A newline between calls, and between the answer and the first call when there is an answer.
                template("\n<tool_call>\n" if n > 0 or content else "<tool_call>\n", trained=True)
                data(f'{{"name": {_to_json(call["name"])}, "arguments": {arguments}}}', trained=True)
                template("\n</tool_call>", trained=True)
            template(f"{EOS_TOKEN}\n", trained=True)
        elif role == "tool":  # consecutive tool results share one user turn
            if i == 0 or turns[i - 1]["role"] != "tool":
                template(f"{BOS_TOKEN}user")
            template("\n<tool_response>\n")
            data(content)
            template("\n</tool_response>")
            if i == len(turns) - 1 or turns[i + 1]["role"] != "tool":
                template(f"{EOS_TOKEN}\n")
        elif i > 0 or role == "user":  # a first system message is the system turn above
            template(f"{BOS_TOKEN}{role}\n")
            data(content)
            template(f"{EOS_TOKEN}\n")
    if add_generation_prompt:
        template(f"{BOS_TOKEN}assistant\n")
    return out


def render_chat_text(messages: Any, add_generation_prompt: bool = False, tools: Any = None) -> str:
    """The conversation as one string, exactly as model/chat_template.py's CHAT_TEMPLATE renders it."""
    return "".join(segment.text for segment in render_segments(messages, add_generation_prompt, tools=tools))


# ---- token ids and the loss mask ------------------------------------------------------------

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

    def encode(self, segments: Iterable[Segment], max_tokens: int | None = None) -> tuple[list[int], list[bool]]:
        """(ids, trained): each tag the tokenizer has becomes its id; the text between is encoded in one go. With
        `max_tokens`, the ids start as they would without it, and only what the first `max_tokens` need is
        tokenized (model/tokenizer.text_for_tokens): a caller that cuts there gets the same ids, sooner."""
        ids: list[int] = []
        trained: list[bool] = []
        # Text is joined with its neighbours (tags without a token of their own included), so the ids are
        # those of encoding the whole rendered string, except where the loss mask starts or ends.
        pieces = [(self.tag_ids.get(s.text) if s.is_tag else None, s.trained, s.text) for s in segments]
        for (tag_id, is_trained), run in groupby(pieces, key=lambda piece: piece[:2]):
            if max_tokens is not None and len(ids) >= max_tokens:
                break  # the rest would be cut away
            texts = [text for _, _, text in run]
            text = "".join(texts) if max_tokens is None else \
                text_for_tokens("".join(texts), max_tokens - len(ids), self.text_tokenizer)
            # encode_batch, not encode: the same ids, but it lets other threads run meanwhile (encode holds
            # the GIL), so a server tokenizing a long prompt in a thread keeps answering its other clients.
            new_ids = [tag_id] * len(texts) if tag_id is not None else self.text_tokenizer.encode_batch([text])[0].ids
            ids += new_ids
            trained += [is_trained] * len(new_ids)
        return ids, trained

    def encode_end(self, segments: list[Segment], max_tokens: int) -> list[int]:
        """The last `max_tokens` ids of `segments`, those of encoding them whole, with only the text they need
        tokenized (a prompt cut from the left keeps its question): the segments from the end until they hold
        chars_for_tokens characters, the earliest of those cut to its end, the ones before it left out. The cut
        starts at a word (a piece of the tokenizer's pre-tokenizer): a word's tokens depend on where it begins. A
        single word longer than all that is cut inside it, and its last tokens may differ from the whole's."""
        keep, kept = chars_for_tokens(max_tokens, self.text_tokenizer), []
        for segment in reversed(segments):
            if keep <= 0:
                break
            if len(segment.text) > keep:  # cut: what is left of a tag is plain text
                text = segment.text[-keep:]
                words = self.text_tokenizer.pre_tokenizer.pre_tokenize_str(text)
                segment = Segment(text[words[1][1][0]:] if len(words) > 1 else text, False, segment.trained)
                keep = 0  # (the text before the cut: left out)
            kept.append(segment)
            keep -= len(segment.text)
        return self.encode(kept[::-1])[0][-max_tokens:]

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, with the chat tags kept and other special tokens left out."""
        return self.tokenizer.decode([i for i in ids if i not in self._hidden_ids], skip_special_tokens=False)

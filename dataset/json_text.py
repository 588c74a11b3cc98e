"""JSON text a user brought, parsed and checked for what no stage can use, and what a path that is no file is.

Text can parse as JSON yet be unusable: the escape of half a UTF-16 surrogate pair ("\\ud800") alone becomes a
Python str that is no Unicode text (it has no UTF-8 bytes, and the tokenizer refuses it with a TypeError, at
whatever step first draws the record), and a line nested 100,000 deep ends json.loads in a RecursionError.
dataset/jsonl_file.py parses every record of a data file with `parse_json_text`, dataset/chat_format.py checks
the JSON it parses out of strings (tools, tool calls) with `unusable_text`, and scripts/serve_openai_api.py
parses a request's body with the first.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any

# A surrogate's escape as JSON writes it; those of a pair ("\ud83d\ude00", an emoji) match too, and decode to one
# character: the walk (unusable_text) tells a lone one apart. Nesting: json.loads stops at about 1,000 levels with
# a RecursionError; what is written back as JSON (a tool's spec, dataset/chat_format.py) is held to MAX_NESTING
# levels, as json.dumps fails sooner, the deeper the stack it is called from.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")  # \ud800-\udfff, as JSON writes it
SURROGATE = re.compile("[\ud800-\udfff]")
MAX_NESTING = 100


def parse_json_text(text: str, allow_nan: bool = True) -> Any:
    """`json.loads(text)` for text a user brought; ValueError says what is wrong: invalid JSON, nested deeper
    than json.loads goes, or a string holding a lone surrogate (see SURROGATE_ESCAPE), naming where. With
    `allow_nan=False`, also a NaN, an Infinity or a number beyond a double's range (as json.dumps's allow_nan):
    Python's json reads them, though JSON has no such numbers (RFC 8259) and other readers refuse them."""
    non_finite = []

    def number(literal: str) -> float:  # json.loads hands this every float literal, and NaN, Infinity, -Infinity
        value = float(literal)
        if not math.isfinite(value):
            non_finite.append(literal)
        return value

    try:
        value = json.loads(text) if allow_nan else json.loads(text, parse_float=number, parse_constant=number)
    except ValueError as e:
        raise ValueError(f"invalid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"nested too deeply for Python's JSON parser (about 1,000 levels of [ and {{); no record "
                         f"needs more than {MAX_NESTING}") from None
    # The walk runs only where the text holds such an escape (a search costs some 7% of the parse).
    if SURROGATE_ESCAPE.search(text):
        problem = unusable_text(value)
        if problem is not None:
            raise ValueError(problem)
    if non_finite:
        raise ValueError(non_finite_number(value))
    return value


def non_finite_number(value: Any, name: str = "") -> str | None:
    """Where in a parsed JSON `value` (called `name`) a number is NaN or infinite, and what to do, or None."""
    stack = [(value, name)]
    while stack:  # a stack, not recursion: the value may nest as deep as json.loads goes
        item, where = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            shown = "NaN" if math.isnan(item) else \
                f"{'' if item > 0 else '-'}Infinity (or a number beyond a double's range, 1.8e308)"
            return f"{where or 'the value'} is {shown}, which JSON has no number for; write a finite number"
        if isinstance(item, dict):
            stack.extend((child, f"{where}.{key}" if where else key) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{n}]") for n, child in reversed(list(enumerate(item))))
    return None


def unusable_text(value: Any, name: str = "") -> str | None:
    """What in a parsed JSON `value` (called `name`) no stage can use, naming where (`conversations[1].content`),
    or None."""
    stack = [(value, name, 0)]
    while stack:
        item, where, depth = stack.pop()
        if depth > MAX_NESTING:
            field = re.split(r"[.\[]", where, maxsplit=1)[0]  # the top field: the full path would be as deep
            return f"{field or 'the value'} is nested more than {MAX_NESTING} levels deep; flatten it"
        if isinstance(item, str) and not item.isascii() and SURROGATE.search(item):
            return (f"{where or 'the value'} holds a lone surrogate escape (\\u{ord(SURROGATE.search(item)[0]):x}), "
                    f"half of a UTF-16 pair and no character, so it cannot be tokenized; write the character itself "
                    f"or both halves of its pair")
        if isinstance(item, dict):
            for key, child in reversed(item.items()):  # reversed: the first problem in the text is found first
                if not key.isascii() and SURROGATE.search(key):
                    return f"a key in {where or 'the object'} holds a lone surrogate escape; write it as text"
                stack.append((child, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{n}]", depth + 1) for n, child in reversed(list(enumerate(item))))
    return None


def kind_of_file(mode: int) -> str:
    """What a path that is not a regular file is, in words ("a folder", "a FIFO (named pipe)", ...)."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def not_a_data_file(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be read as a data file ("no such file", "a folder, not a file", ...), or None."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        return "no such file" if isinstance(error, FileNotFoundError) else error.strerror
    return None if stat.S_ISREG(mode) else f"{kind_of_file(mode)}, not a file: give a JSONL file"

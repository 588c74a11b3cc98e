"""The tools a model may call (the tool-use score, agentic RL, the demo): plain Python functions over arguments
checked against each tool's JSON schema. Nothing here runs model text: no eval, no exec, no shell.

    calculator   {"expression": "17 * 23"}  -> {"result": 391}
    get_weather  {"city": "Lima"}           -> {"city": "Lima", "temperature_c": 19, "condition": "cloudy"}

The calculator reads arithmetic with Python's parser (ast.parse builds a tree and runs nothing) and walks the
tree itself: numbers, + - * / // % ** and parentheses, nothing else (a name, a call, an attribute is refused), with
bounded sizes and exponents. The weather is a fixed table over the demo world's capitals, so every answer is
reproducible.

run_tool runs one call. Arguments are checked first, in the calling process: at most MAX_ARGUMENT_CHARS as JSON
(measured before the schema is, so a giant argument costs one pass over it), then against the schema, which
refuses an argument it does not list (a function is called with them as keywords). A call whose arguments do
not fit, or that the tool refuses (ToolRefusal: "not arithmetic", "no weather for ..."), gets an {"error": ...}
result the model reads, as a tool would answer. A tool that raises anything else, hangs, goes past its memory,
or returns what is not JSON (or too much of it) is a failed call: one line naming the tool and what happened;
the caller decides what a failed call costs (eval_tools.py scores the item as failed and goes on; agentic GRPO's
model reads it as {"error": that line}: error_text).

What bounds a tool, yours too: Tool(spec, function) in the `tools` given to run_tool (eval_tools.py and agentic
GRPO run DEMO_TOOLS: add it there), its function called in a child process forked from the caller, with
- time: TIME_LIMIT_S, then its process group is killed;
- memory: on Linux, MEMORY_LIMIT_BYTES of address space beyond what its process held when it started
  (RLIMIT_AS: an allocation past it raises MemoryError, or ends the process; a process it starts inherits the
  same limit); elsewhere there is none, and run_tool warns so (once from each line that calls it);
- processes: the call runs in its own session and process group, and the whole group is killed when the call
  ends, answered or not, so a process the tool started dies with it (one that leaves the group, by setsid or as
  a daemon, is not followed);
- output: every answer the model reads of a call, a result, a refusal, a schema error, a failed call's line,
  the answer to an unknown tool's name, is at most MAX_RESULT_CHARS characters as JSON (a longer message keeps
  its start and its end and says how much was cut; a longer result is a failed call). One function gives them
  all: _answer.
"""

from __future__ import annotations

import ast
import json
import math
import multiprocessing
import operator
import os
import resource
import signal
import sys
import warnings
from typing import Any, Callable, NamedTuple

import jsonschema

from dataset.make_demo_data import COUNTRIES

TIME_LIMIT_S = 2.0  # a call that has not answered by then is stopped (its process group killed)
MAX_RESULT_CHARS = 2000  # what the model reads of a call, as JSON text, on every path; a longer result fails the call
MAX_ARGUMENT_CHARS = 20_000  # a call's arguments as JSON text: more is refused before the schema is checked
MEMORY_LIMIT_BYTES = 512 * 2 ** 20  # address space a call may add to what its process held at its start (Linux)
MAX_EXPRESSION_CHARS = 200
MAX_NUMBER = 10 ** 30  # any number the calculator reads or makes, in absolute value
MAX_EXPONENT = 64


class ToolRefusal(ValueError):
    """A tool's answer to arguments it cannot serve: the model reads it as {"error": message}."""


class Tool(NamedTuple):
    spec: dict  # OpenAI's {"type": "function", "function": {"name", "description", "parameters"}}
    function: Callable[..., Any]  # called with the checked arguments as keywords; returns JSON-able data


class ToolResult(NamedTuple):
    """One call's outcome: the JSON text the model reads next, or `failure` (then text is "")."""
    text: str
    failure: str | None = None


# ---- the calculator: arithmetic read by a tree walk ------------------------------------------------

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_NUMBER:
        raise ToolRefusal(f"a number beyond {MAX_NUMBER:.0e}")
    return value


def _walk(node: ast.AST) -> int | float:
    """The value of an arithmetic tree; anything but numbers, operators and parentheses is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # bool is an int subclass: not taken
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
        return _SIGNS[type(node.op)](_walk(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            # checked before computing: 9**9**9 would take the process's memory and minutes
            raise ToolRefusal(f"an exponent beyond {MAX_EXPONENT}")
        try:
            return _bounded(_OPERATORS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolRefusal("division by zero") from None
        except OverflowError:
            raise ToolRefusal(f"a number beyond {MAX_NUMBER:.0e}") from None
    raise ToolRefusal(f"{type(node).__name__} is not arithmetic: use numbers, + - * / // % ** and parentheses")


def calculator(expression: str) -> dict:
    """{"result": the value of `expression`}; a whole float is written as an integer (6/3 -> 2)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolRefusal(f"an expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")  # parses only: nothing in the text runs
    except SyntaxError:
        raise ToolRefusal(f"{expression!r} is not an arithmetic expression") from None
    value = _walk(tree.body)
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ToolRefusal("the result is not a real number")
    return {"result": int(value) if isinstance(value, float) and value.is_integer() else value}


# ---- the weather: a fixed table over the demo world's capitals -------------------------------------

_CONDITIONS = ("sunny", "cloudy", "rainy", "windy")
WEATHER = {capital: (8 + 11 * n % 23, _CONDITIONS[n % len(_CONDITIONS)])
           for n, (_, _, capital, _) in enumerate(COUNTRIES)}


def get_weather(city: str) -> dict:
    if city not in WEATHER:
        raise ToolRefusal(f"no weather for {city!r}; known cities: {', '.join(WEATHER)}")
    temperature, condition = WEATHER[city]
    return {"city": city, "temperature_c": temperature, "condition": condition}


def _spec(name: str, description: str, parameter: str) -> dict:
    # Short: the project's tokenizer spends a token on most characters of JSON, and each prompt holds the specs.
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {parameter: {"type": "string"}}, "required": [parameter]}}}


DEMO_TOOLS = {
    "calculator": Tool(_spec("calculator", "Arithmetic: + - * / // % ** ( )", "expression"), calculator),
    "get_weather": Tool(_spec("get_weather", "The weather in a city", "city"), get_weather),
}


# ---- checking and running a call ------------------------------------------------------------------

def argument_problem(tool: Tool, arguments: Any) -> str | None:
    """What makes `arguments` not fit the tool's JSON schema, in one line, or None when they fit. The size first:
    the schema check's cost and what its message echoes grow with the arguments."""
    try:
        size = len(json.dumps(arguments, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        return f"arguments: {type(arguments).__name__} holding what is not JSON"
    if size > MAX_ARGUMENT_CHARS:
        return f"arguments: {size} characters as JSON, over the {MAX_ARGUMENT_CHARS} a call may pass"
    schema = tool.spec["function"].get("parameters") or {"type": "object"}
    # The function is called with the arguments as keywords, and takes none it does not name: one the schema does not
    # list is refused here, named, rather than crashing the call. Added to the check only, not to the spec the model
    # is shown: its "properties" already list what the tool takes, and the demo's tool data holds the spec byte for
    # byte (a key more would change every prompt tool SFT trains on). A schema that says otherwise is kept.
    if isinstance(schema, dict) and "additionalProperties" not in schema:
        schema = {**schema, "additionalProperties": False}
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(arguments))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    return f"arguments{'/' + where if where else ''}: {error.message}"


def result_text(value: Any) -> str:
    """A tool's result as the model reads it: JSON, non-ASCII kept (the demo's tool-use data writes it the same
    way). Raises TypeError or ValueError for what is not JSON."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _fitted(message: str, max_chars: int) -> str:
    """`message` on one line, so that {"error": it} is at most `max_chars` characters of JSON: a longer one keeps its
    start and its end (what was asked, and what is wrong with it: "... is not of type 'string'") and says how
    much of the middle was cut."""
    message = " ".join(message.splitlines())
    if len(message) <= max_chars and len(json.dumps({"error": message}, ensure_ascii=False)) <= max_chars:
        return message

    def kept(count: int) -> str:  # `count` characters of the message, half from each end
        return f"{message[:count - count // 2]} [...{len(message) - count} characters cut...] " \
               f"{message[len(message) - count // 2:]}"

    fits, too_long = 0, min(len(message), max_chars) + 1  # (escapes only lengthen: no more characters fit)
    while too_long - fits > 1:  # the most that fits: bisected, as JSON's escapes lengthen some characters
        middle = (fits + too_long) // 2
        if len(json.dumps({"error": kept(middle)}, ensure_ascii=False)) <= max_chars:
            fits = middle
        else:
            too_long = middle
    return kept(fits)


def error_text(message: str, max_chars: int = MAX_RESULT_CHARS) -> str:
    """{"error": message} as the model reads it, at most `max_chars` characters (a longer message is cut)."""
    return json.dumps({"error": _fitted(message, max_chars)}, ensure_ascii=False)


def _answer(name: str, kind: str, text: str, max_chars: int) -> ToolResult:
    """The one place a call's outcome becomes what its caller and the model read, within `max_chars`: kind "ok" (the
    result's JSON text: too long, a failed call), "error" (a message the model reads as {"error": ...}) or "failed"
    (a line naming the tool and what happened, cut so that {"error": line} fits too)."""
    if kind == "ok" and len(text) > max_chars:
        kind, text = "failed", f"returned {len(text)} characters of JSON, over the {max_chars} allowed"
    if kind == "ok":
        return ToolResult(text)
    if kind == "error":
        return ToolResult(error_text(text, max_chars))
    return ToolResult("", _fitted(f"tool {name}: {text}", max_chars))


def _limit_memory(extra_bytes: int) -> None:
    """In the child: its address space bounded to what it holds now plus `extra_bytes` (Linux: /proc and RLIMIT_AS).
    What it holds now, not a fixed size: a child forked from a trainer holds the trainer's mappings."""
    with open("/proc/self/statm") as statm:  # its first field: the address space, in pages
        held = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = held + extra_bytes if hard == resource.RLIM_INFINITY else min(held + extra_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # the hard limit too: the tool cannot raise it back


def _call_in_child(connection, name: str, function: Callable[..., Any], arguments: dict, max_chars: int,
                   memory_limit_bytes: int) -> None:
    """In the child process: call, and send back _answer's ToolResult (so the pipe carries no more than it)."""
    os.setsid()  # its own session and process group: the parent kills the group, and with it what the tool started
    if sys.platform.startswith("linux"):
        _limit_memory(memory_limit_bytes)
    out_of_memory = (f"ran out of memory: a call may take {memory_limit_bytes // 2 ** 20} MiB more than its process "
                     f"held at its start (dataset/tools.py: MEMORY_LIMIT_BYTES)")
    try:
        value = function(**arguments)
    except ToolRefusal as refusal:
        outcome = ("error", str(refusal))
    except MemoryError:  # what the allocation asked for was not taken: there is room to say so
        outcome = ("failed", out_of_memory)
    except Exception as error:  # anything else the tool raised: the parent names it in one line
        outcome = ("failed", f"raised {type(error).__name__}: {error}")
    else:
        try:
            outcome = ("ok", result_text(value))
        except (TypeError, ValueError, RecursionError) as error:
            outcome = ("failed", f"returned {type(value).__name__}, which is not JSON ({error})")
        except MemoryError:
            outcome = ("failed", out_of_memory)
    connection.send(_answer(name, *outcome, max_chars))


def _stop(child: multiprocessing.Process) -> None:
    """Kill the child's process group (the child and whatever the tool started), then the child, and reap it. The
    group is killed before the child is reaped, so its id (the child's pid) cannot yet name another group."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:  # no such group: the child had not yet made it (os.setsid), or all in it had ended
        pass
    child.kill()  # a child stopped before its os.setsid is not in the group
    child.join()


def run_tool(name: str, arguments: Any, tools: dict[str, Tool] = DEMO_TOOLS, time_limit_s: float = TIME_LIMIT_S,
             max_chars: int = MAX_RESULT_CHARS, memory_limit_bytes: int = MEMORY_LIMIT_BYTES) -> ToolResult:
    """Call `tools[name]` with `arguments` (a model's, checked against the schema first) in a child process, bounded
    in time, memory, processes and output (the module's docstring); every answer goes through _answer."""
    if max_chars < 100:
        raise ValueError(f"max_chars {max_chars}: at least 100, to say what went wrong within it")
    if name not in tools:  # (a model's name may be as long as its text: _answer cuts it)
        return _answer(name, "error", f"no tool named {name!r}; the tools are {', '.join(tools)}", max_chars)
    problem = argument_problem(tools[name], arguments)
    if problem is not None:
        return _answer(name, "error", problem, max_chars)
    if not sys.platform.startswith("linux"):  # (a warning is shown once for each line that calls run_tool)
        warnings.warn(f"tool calls run without a memory bound on {sys.platform}: dataset/tools.py bounds them with "
                      f"/proc and RLIMIT_AS, on Linux only; they are still bounded in time and output", stacklevel=2)
    # A process, not a thread: a thread that hangs cannot be stopped. fork starts it in milliseconds (the tool
    # is a function of this process, whatever module defines it); elsewhere spawn, which imports it afresh.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_call_in_child, daemon=True,
                            args=(send, name, tools[name].function, arguments, max_chars, memory_limit_bytes))
    child.start()
    send.close()  # the child holds its own end: a child that dies without a word makes recv raise EOFError
    answered, result = False, None
    try:
        answered = receive.poll(time_limit_s)
        result = receive.recv() if answered else None  # the child's _answer
    except EOFError:  # (a signal, os._exit, an allocation in C code past the memory bound end a process without a word)
        pass
    finally:
        receive.close()
        _stop(child)
    if not answered:
        return _answer(name, "failed", f"no result in {time_limit_s:g} s; stopped", max_chars)
    if result is None:
        return _answer(name, "failed", f"its process ended without a result (exit {child.exitcode})", max_chars)
    return result

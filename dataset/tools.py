"""The tools a model may call (the tool-use score, agentic RL, the demo): plain Python functions over arguments
checked against each tool's JSON schema. Nothing here runs model text: no eval, no exec, no shell.

    calculator   {"expression": "17 * 23"}  -> {"result": 391}
    get_weather  {"city": "Lima"}           -> {"city": "Lima", "temperature_c": 19, "condition": "cloudy"}

The calculator reads arithmetic with Python's parser (ast.parse builds a tree and runs nothing) and walks the
tree itself: numbers, + - * / // % ** and parentheses, nothing else (a name, a call, an attribute is refused), with
bounded sizes and exponents. The weather is a fixed table over the demo world's capitals, so every answer is
reproducible.

run_tool runs one call in a child process with a time bound and an output bound. A call whose arguments do not
fit the schema, or that the tool refuses (ToolRefusal: "not arithmetic", "no weather for ..."), gets an
{"error": ...} result the model reads, as a tool would answer. A tool that raises anything else, hangs, or returns
what is not JSON (or too much of it) is a failed call: one line naming the tool and what happened; the caller
decides what a failed call costs (eval_tools.py scores the item as failed and goes on).
"""

from __future__ import annotations

import ast
import json
import math
import multiprocessing
import operator
from typing import Any, Callable, NamedTuple

import jsonschema

from dataset.make_demo_data import COUNTRIES

TIME_LIMIT_S = 2.0  # a call that has not answered by then is stopped (its process killed)
MAX_RESULT_CHARS = 2000  # a result longer than this (as JSON text) is a failed call
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
    """What makes `arguments` not fit the tool's JSON schema, in one line, or None when they fit."""
    schema = tool.spec["function"].get("parameters") or {"type": "object"}
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(arguments))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    return f"arguments{'/' + where if where else ''}: {error.message}"


def result_text(value: Any) -> str:
    """A tool's result as the model reads it: JSON, non-ASCII kept (the demo's tool-use data writes it the same
    way). Raises TypeError or ValueError for what is not JSON."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _call_in_child(connection, function: Callable[..., Any], arguments: dict, max_chars: int) -> None:
    """In the child process: call, and send back ("ok", JSON text), ("refused", message) or ("failed", why)."""
    try:
        value = function(**arguments)
    except ToolRefusal as refusal:
        connection.send(("refused", str(refusal)))
        return
    except Exception as error:  # anything else the tool raised: the parent names it in one line
        connection.send(("failed", f"raised {type(error).__name__}: {error}"))
        return
    try:
        text = result_text(value)
    except (TypeError, ValueError) as error:
        connection.send(("failed", f"returned {type(value).__name__}, which is not JSON ({error})"))
        return
    if len(text) > max_chars:  # said, not sent: the pipe would carry all of it
        connection.send(("failed", f"returned {len(text)} characters of JSON, over the {max_chars} allowed"))
        return
    connection.send(("ok", text))


def run_tool(name: str, arguments: Any, tools: dict[str, Tool] = DEMO_TOOLS, time_limit_s: float = TIME_LIMIT_S,
             max_chars: int = MAX_RESULT_CHARS) -> ToolResult:
    """Call `tools[name]` with `arguments` (a model's, checked against the schema first) in a child process."""
    if name not in tools:
        return ToolResult(json.dumps({"error": f"no tool named {name!r}; the tools are {', '.join(tools)}"}))
    problem = argument_problem(tools[name], arguments)
    if problem is not None:
        return ToolResult(json.dumps({"error": problem}, ensure_ascii=False))
    # A process, not a thread: a thread that hangs cannot be stopped. fork starts it in milliseconds (the tool
    # is a function of this process, whatever module defines it); elsewhere spawn, which imports it afresh.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_call_in_child, args=(send, tools[name].function, arguments, max_chars),
                            daemon=True)
    child.start()
    send.close()  # the child holds its own end: a child that dies without a word makes recv raise EOFError
    try:
        if not receive.poll(time_limit_s):
            return ToolResult("", f"tool {name}: no result in {time_limit_s:g} s; stopped")
        status, text = receive.recv()
    except EOFError:
        return ToolResult("", f"tool {name}: its process ended without a result (exit {child.exitcode})")
    finally:
        receive.close()
        if child.is_alive():
            child.kill()
        child.join()
    if status == "failed":
        return ToolResult("", f"tool {name}: {text}")
    return ToolResult(text if status == "ok" else json.dumps({"error": text}, ensure_ascii=False))

"""Tools that run no model text (dataset/tools.py), tool calls read out of a model's text (dataset/tool_calls.py),
and the tool-use score (eval_tools.py): its scoring on written model text, and its command on a random tiny model.
The server's side is in tests/test_serve_tools.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import eval_tools
from dataset.tool_calls import parse_tool_calls, visible_content
from dataset.tools import DEMO_TOOLS, MAX_RESULT_CHARS, Tool, calculator, error_text, run_tool

SPEC = DEMO_TOOLS["calculator"].spec


def call_text(name: str, arguments: dict, content: str = "") -> str:
    """A reply as the chat template writes a call."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<think>\n\n</think>\n\n{content + chr(10) if content else ''}<tool_call>\n{call}\n</tool_call>"


# ---- the calculator reads arithmetic itself --------------------------------------------------------

def test_the_calculator_computes_arithmetic_and_refuses_anything_else_or_too_large():
    assert calculator("17 * 23") == {"result": 391} and calculator("(2 + 3) ** 2 - 7 // 2") == {"result": 22}
    assert calculator("6 / 3") == {"result": 2} and calculator("-7 / 2") == {"result": -3.5}
    for expression, words in [("9 ** 9 ** 9", "exponent beyond 64"), ("10 ** 20 * 10 ** 20", "beyond 1e+30"),
                              ("1 / 0", "division by zero"), ("x + 1", "Name is not arithmetic"),
                              ("True + 1", "Constant is not arithmetic"), ("'a' * 3", "Constant is not arithmetic"),
                              ("1 +", "not an arithmetic expression"), ("1" * 201, "longer than 200"),
                              ("(-8) ** 0.5", "not a real number")]:
        result = run_tool("calculator", {"expression": expression})
        assert result.failure is None and words in json.loads(result.text)["error"], (expression, result)


def test_a_payload_planted_in_a_models_tool_arguments_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    payloads = [f"__import__('os').system('touch {marker}')", f"open('{marker}', 'w')",
                f"().__class__.__base__.__subclasses__()", f"[x for x in ()] or open('{marker}', 'w')"]
    for payload in payloads:
        # as a model writes it, scored as eval_tools.py scores it: the call is made, the tool refuses it
        record = {"conversations": [{"role": "user", "content": "What is 1 + 1?"}], "tools": ["calculator"],
                  "tool": "calculator", "answer": "2"}
        replies = iter([call_text("calculator", {"expression": payload}), "<think>\n\n</think>\n\n2"])
        seen = []

        def model(messages, specs):
            seen.append(messages)
            return next(replies)

        score = eval_tools.score_item(model, record)
        assert score.calls == 1 and score.valid_calls == 1  # a string: it fits the schema; the calculator refuses it
        assert "is not arithmetic" in json.loads(seen[-1][-1]["content"])["error"], seen[-1][-1]
    assert not marker.exists()


# ---- each call bounded in time and output; a broken tool is one line ----------------------------------

def raises(x: str):
    raise KeyError(x)


def hangs(x: str):
    while True:
        pass


def not_json(x: str):
    return {x}


def too_long(x: str):
    return x * 5000


def user_tool(function, name: str | None = None, parameters: dict | None = None) -> Tool:
    """A tool of one's own, as a user registers it: a spec and a function, in the `tools` given to run_tool."""
    parameters = parameters or {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    return Tool({"type": "function", "function": {"name": name or function.__name__, "parameters": parameters}},
                function)


BROKEN = {f.__name__: user_tool(f) for f in (raises, hangs, not_json, too_long)}


@pytest.mark.parametrize("name, words", [("raises", "tool raises: raised KeyError: 'a'"),
                                         ("hangs", "tool hangs: no result in 0.5 s; stopped"),
                                         ("not_json", "tool not_json: returned set, which is not JSON"),
                                         ("too_long", "tool too_long: returned 5002 characters of JSON, over the "
                                                      "2000 allowed")])
def test_a_tool_that_raises_hangs_or_returns_no_json_is_one_line_naming_it(name, words):
    start = time.monotonic()
    result = run_tool(name, {"x": "a"}, BROKEN, time_limit_s=0.5)
    assert result == (result.text, result.failure) and result.text == "" and result.failure.startswith(words)
    assert "\n" not in result.failure and time.monotonic() - start < 5


def raises_at_length(x: str):
    raise KeyError(x * 100_000)


def raises_lines(x: str):
    raise ValueError("first line\nsecond line")


def exits(x: str):
    os._exit(3)


LONG = "n" * 5000  # a tool's name, as long as a user may make it
LOUD = {"raises_at_length": user_tool(raises_at_length), "raises_lines": user_tool(raises_lines),
        "hangs_" + LONG: user_tool(hangs, "hangs_" + LONG), "exits_" + LONG: user_tool(exits, "exits_" + LONG),
        **DEMO_TOOLS}


@pytest.mark.parametrize("name, arguments, start, end", [
    ("x" * 200_000, {}, "no tool named 'xxx", "nnn, calculator, get_weather"),  # (LOUD's names last)
    ("get_weather", {"city": "y" * 200_000}, "arguments: 200012 characters as JSON, over the 20000 a call may pass",
     "may pass"),
    ("calculator", {"expression": ["1"] * 3000}, "arguments/expression: ['1', '1', ", "'1'] is not of type 'string'"),
    ("get_weather", {"city": "y" * 10_000}, "no weather for 'yyy", "known cities: Paris, Berlin, Rome, Madrid, Tokyo, "
                                                                   "Beijing, Moscow, Cairo, Ottawa, Brasilia, New "
                                                                   "Delhi, Bangkok, Seoul, Athens, Lima, Nairobi"),
    ("raises_at_length", {"x": "a"}, "tool raises_at_length: raised KeyError: 'aaa", "aaa'"),
    ("raises_lines", {"x": "a"}, "tool raises_lines: raised ValueError: first line second line", "second line"),
    ("hangs_" + LONG, {"x": "a"}, "tool hangs_nnn", "nnn: no result in 0.5 s; stopped"),
    ("exits_" + LONG, {"x": "a"}, "tool exits_nnn", "nnn: its process ended without a result (exit 3)"),
], ids=["unknown_name", "arguments_over_their_bound", "schema_error", "refusal", "crash", "crash_on_two_lines",
        "timeout", "process_died"])
def test_every_answer_the_model_reads_of_a_call_is_bounded_however_long_what_it_echoes(name, arguments, start, end):
    """An unknown name, arguments over their bound, a schema error, a refusal, a tool's crash, a timeout, a process
    that died: each echoes what the model or a tool made, and each is cut to MAX_RESULT_CHARS, one line, its start and
    its end kept."""
    result = run_tool(name, arguments, LOUD, time_limit_s=0.5)
    read = result.text if result.failure is None else error_text(result.failure)  # as agentic GRPO's model reads it
    message = json.loads(read)["error"]
    assert len(read) <= MAX_RESULT_CHARS and message.startswith(start) and message.endswith(end), (len(read), read)
    assert result.failure is None or (result.failure == message and "\n" not in message)


def test_arguments_that_do_not_fit_the_schema_get_an_error_result_the_model_reads():
    assert json.loads(run_tool("calculator", {"expr": "1"}).text) == \
        {"error": "arguments: 'expression' is a required property"}
    assert "is not of type 'string'" in json.loads(run_tool("get_weather", {"city": 5}).text)["error"]
    assert "no tool named 'shell'" in json.loads(run_tool("shell", {"cmd": "ls"}).text)["error"]


def takes_any(x: str, **more):
    return {"x": x, "more": sorted(more)}


def test_an_argument_the_schema_does_not_list_is_an_error_naming_it_not_a_crashed_call():
    # (before: it passed the schema and the function raised TypeError: a failed call, the item lost)
    result = run_tool("calculator", {"expression": "17 * 23", "precision": 2})
    assert result.failure is None and json.loads(result.text) == \
        {"error": "arguments: Additional properties are not allowed ('precision' was unexpected)"}
    # The spec the model is shown is as it was (the demo's tool data holds it); a schema that takes more still does
    assert "additionalProperties" not in DEMO_TOOLS["calculator"].spec["function"]["parameters"]
    open_schema = {"type": "object", "properties": {"x": {"type": "string"}}, "additionalProperties": True}
    assert run_tool("takes_any", {"x": "a", "y": 1}, {"takes_any": user_tool(takes_any, parameters=open_schema)}) \
        == ('{"x": "a", "more": ["y"]}', None)


# ---- a tool of one's own: bounded in memory, and what it starts dies with the call ------------------------

def allocates_4_gib(x: str):
    return {"bytes": len(bytes(4 * 2 ** 30))}  # zeroed pages, untouched: without a bound it costs nothing real


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the memory bound is Linux's (RLIMIT_AS)")
def test_a_tool_that_allocates_past_its_memory_bound_is_a_failed_call_and_the_next_call_runs():
    result = run_tool("allocates_4_gib", {"x": "a"}, {"allocates_4_gib": user_tool(allocates_4_gib)})
    assert result == ("", "tool allocates_4_gib: ran out of memory: a call may take 512 MiB more than its process "
                          "held at its start (dataset/tools.py: MEMORY_LIMIT_BYTES)")
    assert run_tool("calculator", {"expression": "17 * 23"}) == ('{"result": 391}', None)


def starts_a_sleeper(x: str) -> dict:
    """Starts `sleep 60`, writes its pid in the file `x`, and returns."""
    sleeper = subprocess.Popen(["sleep", "60"])
    Path(x).write_text(str(sleeper.pid))
    return {"pid": sleeper.pid}


def starts_a_sleeper_and_hangs(x: str):
    starts_a_sleeper(x)
    while True:
        time.sleep(0.05)


def running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes' states in /proc")
@pytest.mark.parametrize("function", [starts_a_sleeper, starts_a_sleeper_and_hangs])
def test_a_process_a_tool_started_dies_with_the_call_answered_or_stopped(tmp_path, function):
    pid_file = tmp_path / "pid"
    result = run_tool(function.__name__, {"x": str(pid_file)}, {function.__name__: user_tool(function)},
                      time_limit_s=1.0)
    pid = int(pid_file.read_text())
    try:
        assert result.failure is None if function is starts_a_sleeper else "no result in 1 s" in result.failure
        deadline = time.monotonic() + 10  # SIGKILL is sent when run_tool returns; the end is the kernel's to finish
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not running(pid), f"the tool's child {pid} outlived the call"
    finally:
        if running(pid):  # (before: it slept on, its 60 s, after the call)
            os.kill(pid, signal.SIGKILL)


# ---- a model's text read as calls ---------------------------------------------------------------

def test_tool_calls_are_read_out_of_the_text_the_chat_template_writes():
    assert parse_tool_calls("Paris") == ("Paris", [])
    one = call_text("get_weather", {"city": "Lima"}, content="Let me look.").split("</think>\n\n")[1]
    assert parse_tool_calls(one) == ("Let me look.", [{"name": "get_weather", "arguments": {"city": "Lima"}}])
    two = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": ' \
          '{"a": 1}}\n</tool_call>'
    assert parse_tool_calls(two) == ("", [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"a": 1}}])


@pytest.mark.parametrize("text, words", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', "tool call 1 is not JSON"),
    ('<tool_call>\n{"name": "f", "arguments": {}}', "tool call 1 is not closed"),
    ('<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>', "tool call 1 is not {"),
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> and more', "text after the last tool call"),
    ('<tool_call>\n["f"]\n</tool_call>', "tool call 1 is not {"),
])
def test_a_malformed_call_is_said_not_guessed(text, words):
    with pytest.raises(ValueError, match=words.replace("{", r"\{")):
        parse_tool_calls(text)


def test_a_stream_shows_only_what_stays_content_whatever_follows():
    assert visible_content("It is") == "It is" and visible_content("It is\n") == "It is"
    assert visible_content("It is <tool_c") == "It is" and visible_content("<tool_call>\n{") == ""
    assert visible_content("a <b> c") == "a <b> c"


# ---- the score, item by item --------------------------------------------------------------------

def scripted(*replies: str):
    """A model that writes `replies` in turn, as answers after an empty think block."""
    texts = iter(replies)
    return lambda messages, specs: "<think>\n\n</think>\n\n" + next(texts)


ITEM = {"conversations": [{"role": "user", "content": "What is 17 * 23?"}], "tools": ["calculator", "get_weather"],
        "tool": "calculator", "answer": "391"}
CALL = call_text("calculator", {"expression": "17 * 23"}).split("</think>\n\n")[1]


def test_an_item_scores_the_tool_the_arguments_the_answer_and_no_call_where_none_is_needed():
    assert eval_tools.score_item(scripted(CALL, "391"), ITEM).all_right
    wrong_tool = eval_tools.score_item(scripted(CALL.replace("calculator", "get_weather"), "391"), ITEM)
    assert (wrong_tool.right_tool, wrong_tool.valid_calls, wrong_tool.calls) == (False, 0, 1)
    bad_arguments = eval_tools.score_item(scripted(CALL.replace('"expression"', '"expr"'), "391"), ITEM)
    assert bad_arguments.right_tool and bad_arguments.valid_calls == 0 and not bad_arguments.all_right
    assert not eval_tools.score_item(scripted(CALL, "390"), ITEM).right_answer
    assert not eval_tools.score_item(scripted("391"), ITEM).right_tool  # answered without the call it needed
    free = {**ITEM, "tool": None, "answer": "Paris"}
    assert eval_tools.score_item(scripted("Paris"), free).all_right
    assert not eval_tools.score_item(scripted(CALL, "Paris"), free).right_tool
    endless = eval_tools.score_item(scripted(CALL, CALL, CALL), ITEM, max_calls=2)
    assert endless.notes == ["still calling tools after 2 rounds (--max_calls)"] and not endless.right_answer


def test_a_failed_call_fails_its_item_with_the_line_and_the_next_item_is_scored(capsys):
    broken = {"raises": BROKEN["raises"], **DEMO_TOOLS}
    item = {**ITEM, "tools": ["raises", "calculator"], "tool": "raises", "answer": "x"}
    score = eval_tools.score_item(scripted(call_text("raises", {"x": "a"}).split("</think>\n\n")[1], "x"), item,
                                  broken)
    assert not score.right_answer and score.notes == ["tool raises: raised KeyError: 'a'"]
    line = eval_tools.item_line(1, item, score)
    assert line.endswith("WRONG\n    tool raises: raised KeyError: 'a'")
    assert eval_tools.score_item(scripted(CALL, "391"), ITEM, broken).all_right


def test_the_command_scores_each_item_and_the_total_the_same_every_run(tmp_path, capsys):
    from lora_files import tiny_config, write_base

    write_base(tmp_path, tiny_config())
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(line for line in open(eval_tools.REPO_ROOT / "dataset" / "tool_demo_eval.jsonl",
                                                  encoding="utf-8").readlines()[::16]), encoding="utf-8")
    argv = ["--weight", "full_sft", "--save_dir", str(tmp_path), "--device", "cpu", "--data", str(data),
            "--max_new_tokens", "8"]
    assert eval_tools.main(argv) == 0
    first = capsys.readouterr()
    assert eval_tools.main(argv) == 0
    assert capsys.readouterr().out == first.out
    lines = first.out.splitlines()
    assert [line.split(" ", 1)[0] for line in lines[:-1] if line.startswith("#")] == ["#1", "#2", "#3"]
    assert lines[-1].startswith("tool-use score: all right ") and "right tool 0/2" in lines[-1]
    assert "tool use: 100%" in first.err  # the progress bar


def test_a_broken_data_line_is_one_line_naming_it_before_a_model_is_loaded(tmp_path, capsys):
    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps({**ITEM, "tools": ["shell"]}) + "\n", encoding="utf-8")
    assert eval_tools.main(["--weight", "none_such", "--save_dir", str(tmp_path), "--data", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(data) in err and "line 1" in err and '"tools"' in err
    assert len(err.splitlines()) == 1

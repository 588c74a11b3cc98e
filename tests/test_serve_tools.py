"""scripts/serve_openai_api.py speaks tools as OpenAI's API does (scripts/openai_chat.py).

In this process, on a random tiny model (FastAPI's test client, as tests/test_serve_openai_api.py's flag tests):
the tools are rendered into the prompt, tool_choice starts the reply, OpenAI's tool round trip is read, bad
tools are refused naming the field, and a malformed call comes back as text. With TRAINER_SLOW_TESTS=1, a real
server on a tiny model fine-tuned on one tool conversation (~30 s on the CPU, so that it writes the call greedily)
is taken through the whole loop by the official `openai` client, whole and streamed: call, tool result, answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from conftest import REPO, child_env, free_port, run_args, train, wait_for_server
from dataset.tools import DEMO_TOOLS, run_tool
from eval_model import chat_prompt_ids
from model.tokenizer import load_tokenizer
from scripts.openai_chat import EMPTY_THINK, reply_start_ids
from test_serve_openai_api import openai_refusal, tiny_server

WEATHER = DEMO_TOOLS["get_weather"].spec
QUESTION = [{"role": "user", "content": "What is the temperature in Lima?"}]
CALL_ID = "call_abc"
HISTORY = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
    {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
           {"role": "tool", "tool_call_id": CALL_ID, "content": run_tool("get_weather", {"city": "Lima"}).text}]


def prompt_tokens(http, **body) -> int:
    response = http.post("/v1/chat/completions", json={"max_tokens": 1, **body})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_tools_and_tool_choice_make_the_prompt_the_chat_template_renders(tmp_path, monkeypatch):
    status, http = tiny_server(tmp_path, monkeypatch)
    assert status == 0
    tokenizer = load_tokenizer()
    offered = len(chat_prompt_ids(tokenizer, QUESTION, [WEATHER]))
    assert offered > len(chat_prompt_ids(tokenizer, QUESTION)) + 100  # the tools are in it
    assert prompt_tokens(http, messages=QUESTION, tools=[WEATHER]) == offered
    assert prompt_tokens(http, messages=QUESTION, tools=[WEATHER], tool_choice="auto") == offered
    assert prompt_tokens(http, messages=QUESTION, tools=[WEATHER], tool_choice="none") == \
        len(chat_prompt_ids(tokenizer, QUESTION))
    named = {"type": "function", "function": {"name": "get_weather"}}
    start = reply_start_ids(tokenizer, f'{EMPTY_THINK}<tool_call>\n{{"name": "get_weather", "arguments": ')
    assert prompt_tokens(http, messages=QUESTION, tools=[WEATHER], tool_choice=named) == offered + len(start)
    # OpenAI's round trip: the assistant's null content and tool_calls, the tool's result naming its call
    schema = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"name": "get_weather", "arguments": '{"city": "Lima"}'}]}, {"role": "tool", "content": HISTORY[-1]["content"]}]
    assert prompt_tokens(http, messages=HISTORY, tools=[WEATHER]) == len(chat_prompt_ids(tokenizer, schema, [WEATHER]))


def test_a_malformed_call_comes_back_as_the_text_the_model_wrote(tmp_path, monkeypatch):
    status, http = tiny_server(tmp_path, monkeypatch)
    named = {"type": "function", "function": {"name": "get_weather"}}
    # A random model, started on the call: what it writes after "arguments": is no JSON object.
    for stream in (False, True):
        response = http.post("/v1/chat/completions", json={"messages": QUESTION, "tools": [WEATHER], "max_tokens": 6,
                                                            "tool_choice": named, "stream": stream})
        assert response.status_code == 200, response.text
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                      if line.startswith("data: {")]
            content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            message = response.json()["choices"][0]["message"]
            content, finish = message["content"], response.json()["choices"][0]["finish_reason"]
            assert "tool_calls" not in message
        assert content.startswith('<tool_call>\n{"name": "get_weather", "arguments": ') and finish == "length"


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "should match"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools.0.type", "'function'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}, "tools.0.function.params",
     "Extra inputs"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two functions are named 'get_weather'"),
    ({"tool_choice": "auto"}, "tool_choice", "given without tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'sometimes'; expected \"auto\", \"none\""),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", 'expected "auto", "none"'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "shell"}}}, "tool_choice",
     "'shell' is not a function of `tools` (get_weather)"),
    ({"messages": [*HISTORY[:2], {**HISTORY[2], "tool_call_id": "call_other"}]}, "messages[2].tool_call_id",
     "messages[2].tool_call_id: 'call_other' names no call of the assistant message before it (call_abc)"),
    ({"messages": [*QUESTION, {"role": "tool", "content": "18"}]}, "messages[1].tool_call_id",
     "messages[1].tool_call_id: expected a string, got null"),
])
def test_bad_tools_are_refused_naming_the_field(tmp_path, monkeypatch, body, param, words):
    status, http = tiny_server(tmp_path, monkeypatch)
    code, got_param, message = openai_refusal(http.post("/v1/chat/completions",
                                                        json={"messages": QUESTION, "max_tokens": 1, **body}))
    assert (code, got_param) == (400, param) and words in message, message


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    """One test client for the many refusals below (a server each would load a model each)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        status, client = tiny_server(tmp_path_factory.mktemp("tiny"), monkeypatch)
        assert status == 0
        yield client


ASKED = HISTORY[1]  # the assistant message with its one call
CALL = ASKED["tool_calls"][0]


def calling(**change) -> list[dict]:
    """HISTORY with a field of the call changed (a key of CALL, or of CALL["function"] as "function.KEY")."""
    call = {**CALL, "function": dict(CALL["function"])}
    for key, value in change.items():
        (call["function"] if key.startswith("function_") else call)[key.removeprefix("function_")] = value
    return [*QUESTION, {**ASKED, "tool_calls": [call]}, HISTORY[2]]


@pytest.mark.parametrize("messages, param, words", [
    # before: a 500, TypeError: unhashable type: 'list' (the ids were put in a set)
    (calling(id=["x"]), "messages[1].tool_calls[0].id", "expected a string, got an array"),
    (calling(id={"x": 1}), "messages[1].tool_calls[0].id", "expected a string, got an object"),
    ([*HISTORY[:2], {**HISTORY[2], "tool_call_id": ["call_abc"]}], "messages[2].tool_call_id", "got an array"),
    (calling(type="fn"), "messages[1].tool_calls[0].type", 'expected "function"'),
    (calling(function_name=7), "messages[1].tool_calls[0].function.name", "expected a string, got a number"),
    (calling(function_arguments={"city": "Lima"}), "messages[1].tool_calls[0].function.arguments",
     "expected a string, got an object"),
    (calling(function_arguments="[1, 2]"), "messages[1].tool_calls[0].function.arguments",
     "holds an array; expected a JSON object of the arguments by name"),
    (calling(function_arguments="3"), "messages[1].tool_calls[0].function.arguments", "holds a number; expected"),
    (calling(function_arguments='{"city": NaN}'), "messages[1].tool_calls[0].function.arguments", "city is NaN"),
    ([{"role": "user", "content": 5}], "messages[0].content", "expected a string or an array, got a number"),
    ([{"role": "user", "content": "hi", "name": ["ana"]}], "messages[0].name", "expected a string, got an array"),
    ([{"role": ["user"], "content": "hi"}], "messages[0].role", "expected a string, got an array"),
    ([*QUESTION, {"role": "assistant", "content": "", "reasoning_content": 1}], "messages[1].reasoning_content",
     "expected a string, got a number"),
    # the same call twice, or one call answered twice
    ([*QUESTION, {**ASKED, "tool_calls": [CALL, CALL]}, HISTORY[2], HISTORY[2]], "messages[1].tool_calls[1].id",
     "'call_abc' is also the id of messages[1].tool_calls[0]"),
    ([*HISTORY, HISTORY[2]], "messages[3].tool_call_id", "'call_abc' is answered already, by messages[2]"),
    # a call no tool message answers, as the conversation goes on or ends (OpenAI's API refuses both)
    ([*HISTORY[:2], {"role": "user", "content": "And in Quito?"}], "messages[2].role",
     "an assistant message with tool_calls (messages[1]) must be followed by a tool message answering each call; "
     "not answered: call_abc"),
    ([*QUESTION, {**ASKED, "tool_calls": [CALL, {**CALL, "id": "call_b"}]}, HISTORY[2]], "messages[1].tool_calls",
     "not answered: call_b"),
    ([*HISTORY, {"role": "user", "content": "Thanks"}, HISTORY[2]], "messages[4].tool_call_id",
     "'call_abc' names no call of the assistant message before it (none)"),
], ids=["id-array", "id-object", "tool_call_id-array", "type", "name-number", "arguments-object", "arguments-array",
        "arguments-number", "arguments-nan", "content-number", "name-array", "role-array", "reasoning-number",
        "two-calls-one-id", "answered-twice", "unanswered-then-user", "unanswered-at-end", "answer-after-user"])
def test_messages_openai_refuses_get_a_400_naming_the_field(http, messages, param, words):
    code, got_param, message = openai_refusal(http.post("/v1/chat/completions", json={
        "messages": messages, "tools": [WEATHER], "max_tokens": 1}))
    assert (code, got_param) == (400, param) and message.startswith(f"{param}: ") and words in message, message
    assert prompt_tokens(http, messages=HISTORY, tools=[WEATHER]) > 0  # the round trip done right is served


SCHEMA_TEXT = json.dumps({"messages": QUESTION, "max_tokens": 1, "tools": [WEATHER]})


@pytest.mark.parametrize("text, param, words", [
    (SCHEMA_TEXT.replace('"required"', '"maxLength": Infinity, "required"'), "tools",
     "tools[0].function.parameters.maxLength is Infinity"),
    (SCHEMA_TEXT.replace('{"type": "string"}', '{"type": "number", "minimum": -Infinity}'), "tools",
     "tools[0].function.parameters.properties.city.minimum is -Infinity"),
    (SCHEMA_TEXT.replace('{"type": "string"}', '{"type": "number", "maximum": 1e999}'), "tools",
     "city.maximum is Infinity (or a number beyond a double's range"),
    (SCHEMA_TEXT.replace('"max_tokens": 1', '"max_tokens": 1, "temperature": NaN'), "temperature",
     "temperature is NaN, which JSON has no number for"),
], ids=["infinity", "minus-infinity", "1e999", "nan-temperature"])
def test_nan_and_infinity_which_json_has_not_are_refused_naming_the_field(http, text, param, words):
    """Python's json reads them (the schema went into the prompt as `Infinity`); OpenAI's API refuses them."""
    code, got_param, message = openai_refusal(http.post("/v1/chat/completions", content=text))
    assert (code, got_param) == (400, param) and words in message, message
    assert http.post("/v1/chat/completions", content=SCHEMA_TEXT).status_code == 200


# ---- the whole loop, with the official client, on a model that calls the tool (slow) ----------------------

SLOW = pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                          reason="trains a model for ~30 s; set TRAINER_SLOW_TESTS=1 (.ci/run does)")
ANSWER = "24°C"


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """The base URL of a server whose model calls get_weather for QUESTION, then answers ANSWER from its result."""
    root = tmp_path_factory.mktemp("serve_tools")
    conversation = [{"role": "system", "content": "", "tools": [WEATHER]}, *QUESTION,
                    {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather",
                                                                          "arguments": {"city": "Lima"}}]},
                    {"role": "tool", "content": HISTORY[-1]["content"]}, {"role": "assistant", "content": ANSWER}]
    data = root / "tools.jsonl"
    data.write_text((json.dumps({"conversations": conversation}, ensure_ascii=False) + "\n") * 8, encoding="utf-8")
    train("train_full_sft.py", None, run_args(root, data, "--from_weight", "none", "--batch_size", "8", "--epochs",
                                              "100", "--learning_rate", "1e-2", "--warmup_ratio", "0",
                                              "--max_seq_len", "512"), root)
    port = free_port()
    log = open(root / "server.log", "w+")
    server = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve_openai_api.py"), "--weight", "full_sft",
                               "--save_dir", str(root / "out"), "--device", "cpu", "--port", str(port)],
                              cwd=root, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(server, base, Path(log.name))
        yield base
    finally:
        server.terminate()
        server.wait(timeout=15)
        log.close()


def turn(client: OpenAI, messages: list, stream: bool) -> tuple[str | None, list[dict], str]:
    """(content, tool_calls as dicts, finish_reason) of one reply, whole or with the stream's deltas joined."""
    if not stream:
        reply = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=64)
        message = reply.choices[0].message
        return message.content, [call.model_dump() for call in message.tool_calls or []], reply.choices[0].finish_reason
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=64,
                                                stream=True):
        delta = chunk.choices[0].delta
        content = (content or "") + delta.content if delta.content is not None else content
        for piece in delta.tool_calls or []:  # pieced together by index, as OpenAI's own clients do
            call = calls.setdefault(piece.index, {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            call["id"] = piece.id or call["id"]
            call["function"]["name"] += piece.function.name or ""
            call["function"]["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@SLOW
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_official_client_takes_a_tool_call_round_trip_to_the_answer(tool_server, stream):
    client = OpenAI(base_url=f"{tool_server}/v1", api_key="not-checked", max_retries=0, timeout=60)
    messages = list(QUESTION)
    content, calls, finish = turn(client, messages, stream)
    assert finish == "tool_calls" and not content
    [call] = calls
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}
    result = run_tool(call["function"]["name"], json.loads(call["function"]["arguments"]))
    messages += [{"role": "assistant", "content": None, "tool_calls": calls},
                 {"role": "tool", "tool_call_id": call["id"], "content": result.text}]
    assert turn(client, messages, stream) == (ANSWER, [], "stop")

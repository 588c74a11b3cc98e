"""scripts/serve_openai_api.py, run as a real process on a loopback port and asked by the official
`openai` client (and, for the bad requests, by plain HTTP).

The served model is a tiny one fine-tuned for 50 steps on four demo questions and one whose think block
is a run of newlines longer than the trained length (a few seconds on the CPU): it answers the frog
question properly, after an empty think block, writes stray tags for others, and answers some after an
empty think block with newlines that never end, so both readings of a reply, the time limit and a stream
with nothing to show are exercised. Greedy decoding makes every answer reproducible,
so the server's answers are compared with eval_model.py's, computed in this process. The model was
trained at --max_seq_len 48 (TINY_MODEL), so a longer prompt is refused; the server runs with a 4 s
time limit per request, which the tests that ask for long replies reach.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from openai import BadRequestError, OpenAI

import eval_model
from conftest import REPO, child_env, free_port, run_args, train, wait_for_server
from model.tokenizer import load_tokenizer
from scripts.serve_openai_api import held_back, split_reply

QUESTIONS = [json.loads(line)["conversations"] for line in
             (REPO / "dataset" / "sft_demo_eval.jsonl").read_text(encoding="utf-8").splitlines()[:5]]
LEARNED = [QUESTIONS[i] for i in (0, 1, 3, 4)]  # next number, opposite (zh), animal sound (zh), addition
FROG = [{"role": "user", "content": "青蛙怎么叫？"}]  # answered properly: "<think>\n\n</think>\n\n" + answer
MAX_TOKENS = 24
ENDLESS = [{"role": "user", "content": "What is the capital of France?"}]  # an empty think block, then newlines only
# Its newlines run past --max_seq_len, so the model learns newlines that do not end (the chat template strips
# newlines at the ends of a think block or an answer, not inside one).
NEWLINES = [{"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "reasoning_content": "add" + "\n" * 80 + "done", "content": "5"}]
TIME_LIMIT_S = 4  # --request_time_limit: longer than any reply but the ENDLESS ones; the model writes ~200 tokens/s


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, eval_model args) of a server on a free 127.0.0.1 port; it is terminated at the end."""
    root = tmp_path_factory.mktemp("serve")
    data = root / "learned.jsonl"
    data.write_text("".join(json.dumps({"conversations": c}, ensure_ascii=False) + "\n"
                            for c in [*LEARNED, NEWLINES] * 8),
                    encoding="utf-8")
    train("train_full_sft.py", None, run_args(root, data, "--from_weight", "none", "--batch_size", "8", "--epochs",
                                              "10", "--learning_rate", "1e-2", "--warmup_ratio", "0"), root)
    model_flags = ["--weight", "full_sft", "--save_dir", str(root / "out"), "--device", "cpu"]
    port = free_port()
    log = open(root / "server.log", "w+")
    server = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve_openai_api.py"), *model_flags,
                               "--port", str(port), "--max_tokens_limit", "30000", "--request_time_limit",
                               str(TIME_LIMIT_S)], cwd=root, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(server, base, Path(log.name))
        yield base, eval_model.build_arg_parser().parse_args(model_flags)
    finally:
        server.terminate()
        try:  # uvicorn shuts down, then dies of the SIGTERM it caught, so that its parent knows why it ended
            assert server.wait(timeout=15) == -signal.SIGTERM
            assert "Finished server process" in Path(log.name).read_text()
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(timeout=15)
            log.close()


def client(base: str, timeout: float = 60) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="not-checked", max_retries=0, timeout=timeout)


def ask(base: str, messages: list[dict]) -> tuple[str, str | None, str, dict]:
    """(content, reasoning_content, finish_reason, usage) of one reply, whole."""
    reply = client(base).chat.completions.create(model="full_sft", messages=messages, temperature=0,
                                                 max_tokens=MAX_TOKENS)
    message = reply.choices[0].message
    return message.content, getattr(message, "reasoning_content", None), reply.choices[0].finish_reason, \
        reply.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})


def ask_streaming(base: str, messages: list[dict]) -> tuple[str, str | None, str, dict]:
    """The same, streamed: the deltas joined."""
    content, reasoning, finish_reason, usage = "", None, None, None
    for chunk in client(base).chat.completions.create(model="full_sft", messages=messages, temperature=0,
                                                      max_tokens=MAX_TOKENS, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        if getattr(delta, "reasoning_content", None):
            reasoning = (reasoning or "") + delta.reasoning_content
        finish_reason = chunk.choices[0].finish_reason or finish_reason
        usage = chunk.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) \
            if chunk.usage else usage
    return content, reasoning, finish_reason, usage


def post(base: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


# ---- what the openai client sees ------------------------------------------------------------------

def test_the_openai_client_lists_the_one_served_model(served):
    base, _ = served
    assert [m.id for m in client(base).models.list()] == ["full_sft_32"]


def test_whole_and_streamed_replies_are_eval_models_greedy_answer(served):
    base, args = served
    tokenizer = load_tokenizer(args.tokenizer_path)
    model = eval_model.load_model(args, tokenizer, torch.device("cpu"))
    prompt_ids = eval_model.chat_prompt_ids(tokenizer, FROG)
    generated = eval_model.generate_ids(model, prompt_ids, MAX_TOKENS)
    text = eval_model.generate_text(model, tokenizer, prompt_ids, MAX_TOKENS)
    assert text.startswith("<think>") and text.count("</think>") == 1, f"not a trained reply: {text!r}"
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(generated),
             "total_tokens": len(prompt_ids) + len(generated)}
    expected = (eval_model.answer_from_generation(text), None, "stop", usage)
    assert expected[0]  # an answer, after an empty think block (so no reasoning_content)
    assert ask(base, FROG) == expected
    assert ask_streaming(base, FROG) == expected


def test_a_stream_equals_the_whole_reply_also_when_the_model_writes_stray_tags(served):
    base, _ = served
    conversations = [[{"role": "user", "content": "Hello there"}],
                     [*FROG, {"role": "assistant", "content": "呱呱"}, *LEARNED[0][:1]],
                     [{"role": "system", "content": "Answer briefly."}, *LEARNED[3][:1]]]
    for messages in conversations:
        assert ask_streaming(base, messages) == ask(base, messages), messages


def test_think_text_is_kept_apart_from_the_answer():
    assert split_reply("<think>\nadd them\n</think>\n\n7") == ("add them", "7")
    assert split_reply("<think>\n\n</think>\n\nParis") == ("", "Paris")
    assert split_reply("<think>\nstill thinking") == ("still thinking", "")  # cut off by max_tokens
    assert split_reply("7") == ("", "7")
    # Tags after the think block stay in the answer: a stream cannot take back what it sent.
    assert split_reply("<think>\n\n</think>\n\n</think>7") == ("", "</think>7")


# ---- bad requests, and a client that leaves ----------------------------------------------------

@pytest.mark.parametrize("body, param, words", [
    (b'{"messages": [', None, "holds invalid JSON"),
    (b'{"messages": []}', "messages", "at least 1 item"),
    (b'{"messages": [{"role": "robot", "content": "hi"}]}', "messages", "unknown role 'robot'"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "warm"}', "temperature", "valid number"),
    (json.dumps({"messages": [{"role": "user", "content": "ab " * 40000}]}).encode(), "messages", "positions"),
])
def test_a_bad_request_gets_an_openai_error_naming_the_field_and_the_server_keeps_serving(served, body, param,
                                                                                           words):
    base, _ = served
    status, answer = post(base, body)
    assert status == 400
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["code"] is None
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer
    assert post(base, json.dumps({"messages": FROG, "max_tokens": 2}).encode())[0] == 200


def test_a_client_that_leaves_mid_stream_stops_its_generation(served):
    base, _ = served
    # The model never stops on this question (it writes newlines): unstopped, 30,000 tokens would hold
    # the model for minutes, and the next request would wait for them.
    body = json.dumps({"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 30000,
                       "stream": True}).encode()
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:  # up to the first text the model wrote: generation has started
            if b'"delta": {"content"' in line or b'"delta": {"reasoning_content"' in line:
                break
        else:
            raise AssertionError("the stream ended before the model wrote anything")
    start = time.time()
    assert post(base, json.dumps({"messages": FROG, "max_tokens": 2}).encode())[0] == 200
    assert time.time() - start < TIME_LIMIT_S - 1  # sooner than the time limit would have freed the model


# ---- what the server holds to, whatever a request asks ---------------------------------------------

def refusal(error: BadRequestError) -> tuple[str, str]:
    """(param, message) of the OpenAI error in a 400 the client raised."""
    return error.body["param"], error.body["message"]


def test_a_tiny_temperature_is_greedy_and_no_sampling_setting_fails(served):
    base, _ = served
    tiny = client(base).chat.completions.create(model="full_sft", messages=FROG, temperature=1e-300,
                                                max_tokens=MAX_TOKENS)
    assert tiny.choices[0].message.content == ask(base, FROG)[0]
    for temperature, top_p in [(1e-30, 1.0), (2.0, 1e-300), (2.0, 1.0)]:
        reply = client(base).chat.completions.create(model="full_sft", messages=FROG, temperature=temperature,
                                                     top_p=top_p, max_tokens=MAX_TOKENS)
        assert reply.choices[0].finish_reason in ("stop", "length")


def test_more_than_one_choice_is_refused_naming_n(served):
    base, _ = served
    with pytest.raises(BadRequestError) as refused:
        client(base).chat.completions.create(model="full_sft", messages=FROG, n=3, max_tokens=2)
    param, message = refusal(refused.value)
    assert param == "n" and "one choice per request" in message
    assert len(client(base).chat.completions.create(model="full_sft", messages=FROG, n=1, max_tokens=2).choices) == 1


def test_the_limits_are_listed_and_max_tokens_above_the_ceiling_is_refused(served):
    base, _ = served
    [listed] = client(base).models.list().data
    assert listed.model_extra == {"max_tokens_default": 512, "max_tokens_limit": 30000,
                                  "request_time_limit_s": TIME_LIMIT_S, "trained_max_seq_len": 48,
                                  "long_prompts": "refuse", "max_request_bytes": 2**20}
    with pytest.raises(BadRequestError) as refused:
        client(base).chat.completions.create(model="full_sft", messages=FROG, max_tokens=30001)
    param, message = refusal(refused.value)
    assert param == "max_tokens" and "at most 30000" in message


def test_a_request_past_the_time_limit_ends_with_length_and_frees_the_model(served):
    base, _ = served
    start = time.time()
    # Unlimited, these 30,000 tokens would hold the model for minutes (and the 20 s client timeout would end it).
    reply = client(base, timeout=20).chat.completions.create(model="full_sft", messages=ENDLESS, max_tokens=30000)
    assert reply.choices[0].finish_reason == "length"
    assert 0 < reply.usage.completion_tokens < 30000
    assert TIME_LIMIT_S <= time.time() - start < TIME_LIMIT_S + 6
    assert ask(base, FROG)[2] == "stop"  # the model is free again


def test_the_model_list_answers_while_a_long_prompt_is_tokenized_and_a_reply_generated(served):
    base, _ = served
    models = client(base)
    for body in ({"messages": [{"role": "user", "content": "ab " * 300_000}]},  # ~1 s of tokenizing, then a 400
                 {"messages": ENDLESS, "max_tokens": 30000}):  # generation, up to the time limit
        finished = {}

        def send() -> None:
            start = time.time()
            finished["status"] = post(base, json.dumps(body).encode())[0]
            finished["seconds"] = time.time() - start

        sender = threading.Thread(target=send)
        sender.start()
        waits = []
        while sender.is_alive():
            start = time.time()
            models.models.list()
            waits.append(time.time() - start)
            time.sleep(0.05)
        sender.join()
        assert finished["status"] == (400 if "max_tokens" not in body else 200)
        # Blocked, one list would have waited for most of the request.
        assert len(waits) >= 3 and max(waits) < finished["seconds"] / 3, (waits, finished)


def test_a_stream_that_has_nothing_to_show_yet_still_reaches_a_client_with_a_read_timeout(served):
    base, _ = served
    # The reply's answer is newlines only, which the whole reply drops too: nothing to send but that it goes on.
    stream = client(base, timeout=2.5).chat.completions.create(model="full_sft", messages=ENDLESS, max_tokens=30000,
                                                               stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stream_holds_back_only_what_may_still_open_a_think_block():
    assert held_back("") and held_back("\n\n") and held_back(" \n<thi") and held_back("<think")
    assert held_back("caf\ufffd")  # the rest of a character's bytes is still to come
    assert not held_back("\n\nHello") and not held_back(" <b") and not held_back("\n<think>\n")


def test_a_prompt_longer_than_the_trained_length_is_refused_naming_it(served):
    base, args = served
    assert json.loads((Path(args.save_dir) / "full_sft_32.json").read_text())["max_seq_len"] == 48
    long_question = [{"role": "user", "content": "Tell me a long story about " + "a red fox and " * 8}]  # 70 tokens
    with pytest.raises(BadRequestError) as refused:
        client(base).chat.completions.create(model="full_sft", messages=long_question, max_tokens=2)
    param, message = refusal(refused.value)
    assert param == "messages" and "70 tokens, longer than the 48 the model was trained at" in message


def test_text_parts_and_a_name_are_read_as_openai_sends_them(served):
    base, _ = served
    parts = [{"role": "user", "name": "ana", "content": [{"type": "text", "text": FROG[0]["content"]}]}]
    assert ask(base, parts) == ask(base, FROG)
    two_parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    assert ask(base, two_parts) == ask(base, [{"role": "user", "content": "Hello\nthere"}])
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(BadRequestError) as refused:
        client(base).chat.completions.create(model="full_sft", messages=image, max_tokens=2)
    param, message = refusal(refused.value)
    assert param == "messages[0].content[0]" and message.startswith('messages[0].content[0]: expected {"type": "text"')


def test_lora_serves_the_adapted_model_under_its_own_name(tmp_path, monkeypatch):
    """--lora NAME: the adapter goes on top of --weight as in eval_model.py (main is run here, its uvicorn.run
    replaced by a note of the app, which FastAPI's test client then asks)."""
    from fastapi.testclient import TestClient

    import scripts.serve_openai_api as serve
    from lora_files import tiny_config, write_adapter, write_base

    config = tiny_config()
    write_base(tmp_path, config)
    write_adapter(tmp_path, config)
    apps = []
    monkeypatch.setattr(serve.uvicorn, "run", lambda app, **_: apps.append(app))
    argv = ["--weight", "full_sft", "--save_dir", str(tmp_path), "--device", "cpu", "--lora", "demo"]
    assert serve.main(argv) == 0
    http = TestClient(apps[0], base_url="http://127.0.0.1:8998")  # a name the server answers to
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["full_sft_32+lora_demo"]
    reply = http.post("/v1/chat/completions", json={"messages": FROG, "max_tokens": 6}).json()

    args = eval_model.build_arg_parser().parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer_path)
    adapted = eval_model.load_model(args, tokenizer, torch.device("cpu"))
    text = eval_model.generate_text(adapted, tokenizer, eval_model.chat_prompt_ids(tokenizer, FROG), 6)
    plain = eval_model.load_model(eval_model.build_arg_parser().parse_args(argv[:-2]), tokenizer, torch.device("cpu"))
    assert text != eval_model.generate_text(plain, tokenizer, eval_model.chat_prompt_ids(tokenizer, FROG), 6)
    assert reply["choices"][0]["message"]["content"] == eval_model.answer_from_generation(text)
    assert serve.main([*argv[:-1], "medical"]) == 2  # no such adapter: one line, exit 2, as eval_model.py


# ---- what a request may hold, and the flags that bound it (a random tiny model, asked in this process) ------

def tiny_server(tmp_path: Path, monkeypatch, *flags: str, api_key_variable: str | None = None):
    """(exit status, FastAPI test client or None) of main() on a random tiny full_sft in `tmp_path`; its uvicorn.run
    is replaced by a note of the app. `api_key_variable`: the environment's TRAINER_API_KEY (none by default)."""
    from fastapi.testclient import TestClient

    import scripts.serve_openai_api as serve
    from lora_files import tiny_config, write_base

    if not (tmp_path / "full_sft_32.pth").exists():
        write_base(tmp_path, tiny_config())
    apps = []
    monkeypatch.setattr(serve.uvicorn, "run", lambda app, **_: apps.append(app))
    monkeypatch.delenv("TRAINER_API_KEY", raising=False)  # a key of the shell running the tests is not the test's
    if api_key_variable is not None:
        monkeypatch.setenv("TRAINER_API_KEY", api_key_variable)
    status = serve.main(["--weight", "full_sft", "--save_dir", str(tmp_path), "--device", "cpu", *flags])
    # Asked as a client on this machine asks, by a name the server answers to, with the JSON content type
    return status, TestClient(apps[0], base_url="http://127.0.0.1:8998",
                              headers={"Content-Type": "application/json"}) if apps else None


def openai_refusal(response) -> tuple[int, str | None, str]:
    """(status, param, message) of an answer that must be an error in OpenAI's shape."""
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return response.status_code, error["param"], error["message"]


NESTED = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("body, param, words", [
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages", "messages[0].content holds a lone "
                                                                                "surrogate escape (\\ud800)"),
    (json.dumps({"messages": [{"role": "system", "content": "", "tools": '[{"name": "\\udfff"}]'},
                              {"role": "user", "content": "hi"}]}).encode(), "messages", "tools[0].name holds a lone"),
    (NESTED, None, "nested too deeply"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', None, "not UTF-8 text (invalid continuation byte"),
    (b'[{"role": "user", "content": "hi"}]', None, "must be a JSON object"),
], ids=["lone-surrogate", "surrogate-in-tools", "nested-100000-deep", "latin-1", "not-an-object"])
def test_text_that_cannot_be_read_or_tokenized_gets_a_400_in_openai_shape(tmp_path, monkeypatch, body, param, words):
    status, http = tiny_server(tmp_path, monkeypatch)
    assert status == 0
    code, got_param, message = openai_refusal(http.post("/v1/chat/completions", content=body))
    assert (code, got_param) == (400, param) and words in message, message
    assert http.post("/v1/chat/completions", json={"messages": FROG, "max_tokens": 2}).status_code == 200


def test_fields_of_the_wrong_json_type_get_a_400_naming_the_field_as_openai_gives(tmp_path, monkeypatch):
    """Before, pydantic's lax mode took "5" for 5, true for 1 and "yes" for true, where OpenAI's API refuses them."""
    status, http = tiny_server(tmp_path, monkeypatch)
    assert status == 0
    for field, value, words in (("max_tokens", "5", "valid integer"), ("max_tokens", True, "valid integer"),
                                ("stream", "yes", "valid boolean"), ("temperature", "0.5", "valid number")):
        response = http.post("/v1/chat/completions", json={"messages": FROG, field: value})
        code, param, message = openai_refusal(response)
        assert (code, param) == (400, field) and message.startswith(f"{field}: ") and words in message, message
    # a whole number is a number: "temperature": 1 (as OpenAI's clients may send it) is served
    answer = http.post("/v1/chat/completions", json={"messages": FROG, "max_tokens": 2, "temperature": 1})
    assert answer.status_code == 200, answer.text


def test_a_body_over_max_request_bytes_gets_a_413_naming_the_limit_unread(tmp_path, monkeypatch):
    status, http = tiny_server(tmp_path, monkeypatch, "--max_request_bytes", "4000")
    assert status == 0 and http.get("/v1/models").json()["data"][0]["max_request_bytes"] == 4000
    # Two million elements: parsed, they held the event loop (and every other client) for seconds.
    huge = json.dumps({"messages": FROG, "x": [0] * 2_000_000}).encode()
    code, param, message = openai_refusal(http.post("/v1/chat/completions", content=huge))
    assert code == 413 and param is None and "4000 bytes (--max_request_bytes)" in message
    fits = json.dumps({"messages": FROG, "max_tokens": 2, "x": "a" * 3000}).encode()
    assert http.post("/v1/chat/completions", content=fits).status_code == 200
    assert http.post("/v1/chat/completions", content=fits + b" " * 1000).status_code == 413


@pytest.mark.parametrize("flags, words", [
    (["--request_time_limit", "nan"], "--request_time_limit nan: give a number of seconds above 0"),
    (["--request_time_limit", "inf"], "--request_time_limit inf: give a number of seconds above 0"),
    (["--request_time_limit", "-1"], "--request_time_limit -1.0: give a number of seconds above 0"),
    (["--max_request_bytes", "0"], "--max_request_bytes 0: give a number of bytes above 0"),
])
def test_a_time_or_size_limit_that_limits_nothing_is_refused_in_one_line(tmp_path, monkeypatch, capsys, flags, words):
    status, http = tiny_server(tmp_path, monkeypatch, *flags)
    err = capsys.readouterr().err.strip()
    assert status == 2 and http is None and err == f"error: {words} (default {'120' if 'time' in words else 2**20})"


@pytest.mark.parametrize("length", ["-5", "0", "true", "48.5", '"48"'])
def test_a_trained_length_file_without_a_positive_length_is_refused_in_one_line(tmp_path, monkeypatch, capsys,
                                                                                length):
    from lora_files import tiny_config, write_base

    write_base(tmp_path, tiny_config())
    (tmp_path / "full_sft_32.json").write_text(f'{{"max_seq_len": {length}}}', encoding="utf-8")
    status, http = tiny_server(tmp_path, monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and http is None
    sidecar = tmp_path / "full_sft_32.json"
    assert err.startswith(f'error: {sidecar} holds "max_seq_len": ') and "positive whole number" in err, err


def test_yarn_moves_the_length_refusal_to_the_trained_length_times_the_factor(tmp_path, monkeypatch, capsys):
    from lora_files import tiny_config, write_base

    write_base(tmp_path, tiny_config())
    (tmp_path / "full_sft_32.json").write_text('{"max_seq_len": 16}', encoding="utf-8")
    question = [{"role": "user", "content": "a red fox and " * 3}]  # 27 tokens: past 16, within 16 x 2
    status, plain = tiny_server(tmp_path, monkeypatch)
    assert status == 0 and openai_refusal(plain.post("/v1/chat/completions", json={"messages": question}))[0] == 400
    status, scaled = tiny_server(tmp_path, monkeypatch, "--rope_scaling", "yarn", "--rope_factor", "2")
    assert status == 0 and scaled.get("/v1/models").json()["data"][0]["trained_max_seq_len"] == 32
    reply = scaled.post("/v1/chat/completions", json={"messages": question, "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == 27
    status, param, message = openai_refusal(scaled.post("/v1/chat/completions", json={"messages": question * 2}))
    assert status == 400 and param == "messages" and "longer than the 32 the model reads (yarn x2)" in message
    assert "rope scaling: yarn x2, reads 32 tokens" in capsys.readouterr().err
    assert tiny_server(tmp_path, monkeypatch, "--rope_scaling", "yarn")[0] == 2  # no factor: one line, exit 2
    assert capsys.readouterr().err.strip().endswith("needs --rope_factor: how many times the trained length to reach")

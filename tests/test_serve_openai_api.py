"""scripts/serve_openai_api.py, run as a real process on a loopback port and asked by the official
`openai` client (and, for the bad requests, by plain HTTP).

The served model is a tiny one fine-tuned for 40 steps on four demo questions (a few seconds on the
CPU): it answers one of them properly, after an empty think block, and writes stray tags for
others, so both readings of a reply are exercised. Greedy decoding makes every answer reproducible,
so the server's answers are compared with eval_model.py's, computed in this process.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from openai import OpenAI

import eval_model
from conftest import REPO, child_env, free_port, run_args, train
from model.tokenizer import load_tokenizer
from scripts.serve_openai_api import split_reply

QUESTIONS = [json.loads(line)["conversations"] for line in
             (REPO / "dataset" / "sft_demo_eval.jsonl").read_text(encoding="utf-8").splitlines()[:5]]
LEARNED = [QUESTIONS[i] for i in (0, 1, 3, 4)]  # next number, opposite (zh), animal sound (zh), addition
FROG = [{"role": "user", "content": "青蛙怎么叫？"}]  # answered properly: "<think>\n\n</think>\n\n" + answer
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, eval_model args) of a server on a free 127.0.0.1 port; it is terminated at the end."""
    root = tmp_path_factory.mktemp("serve")
    data = root / "learned.jsonl"
    data.write_text("".join(json.dumps({"conversations": c}, ensure_ascii=False) + "\n" for c in LEARNED * 8),
                    encoding="utf-8")
    train("train_full_sft.py", None, run_args(root, data, "--from_weight", "none", "--batch_size", "8", "--epochs",
                                              "10", "--learning_rate", "1e-2", "--warmup_ratio", "0"), root)
    model_flags = ["--weight", "full_sft", "--save_dir", str(root / "out"), "--device", "cpu"]
    port = free_port()
    log = open(root / "server.log", "w+")
    server = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve_openai_api.py"), *model_flags,
                               "--port", str(port)], cwd=root, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert server.poll() is None, f"the server exited {server.returncode}:\n{Path(log.name).read_text()}"
            assert time.time() < deadline, f"the server did not answer in 60 s:\n{Path(log.name).read_text()}"
            try:
                urllib.request.urlopen(f"{base}/v1/models", timeout=2).close()
                break
            except OSError:
                time.sleep(0.2)
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


def client(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="not-checked", max_retries=0, timeout=60)


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
    (b'{"messages": [', None, "not valid JSON"),
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
    assert time.time() - start < 20

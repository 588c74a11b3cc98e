"""Serve a model from out/ over the OpenAI chat API, for the clients people already have.

The model is chosen with eval_model.py's flags (sizes read off the weights) and answers as eval_model.py
does: the same prompt (the chat template training uses), the same KV-cache generation, the answer after
the think block as `content`; the think text, if any, is kept apart as `reasoning_content`. A request's
temperature and top_p default to eval_model.py's (greedy), its max_tokens to --max_new_tokens. A request's
`tools` and `tool_choice` are OpenAI's, and the model's tool calls come back as `tool_calls` (scripts/openai_chat.py).

    python scripts/serve_openai_api.py --weight full_sft            # on 127.0.0.1:8998, this machine only
    python scripts/serve_openai_api.py --weight full_sft --lora demo   # with a LoRA adapter (train_lora.py)
    curl -s http://127.0.0.1:8998/v1/chat/completions -H "Content-Type: application/json" \\
         -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}]}'

Requests are served one at a time (one model, one lock); a client that disconnects stops its generation.
So that no request holds the model for long, max_tokens may not exceed --max_tokens_limit (default 2048)
and a reply ends, finish_reason "length", after --request_time_limit seconds (default 120) with the model.
A prompt longer than the model was trained at (the max_seq_len in out/{weight}.json, which training writes
beside the weights) is refused, or served with a warning in the log under --long_prompts warn: the model
has not learned such positions. GET /v1/models states these limits.
A bad request gets a 400 in OpenAI's error shape, naming the field; a body over --max_request_bytes (default
1 MiB) a 413. The body is parsed and checked in a thread, so a large one does not hold up the other clients.
A chat page over the same API is served at / (scripts/web/: open http://127.0.0.1:8998/); --no_web leaves it out.

Only the server's user may use it, not a web page they visit (scripts/request_guard.py): a request's Host must name
localhost, 127.0.0.1, [::1], --host or one of --allowed_hosts (else a 421), a POST must be application/json (else a
415); with --api_key KEY, or better TRAINER_API_KEY=KEY in the environment (`ps` shows a command line to every user),
each API request needs "Authorization: Bearer KEY" (else a 401): OpenAI(api_key=KEY) sends it, the page asks for it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import queue
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable, NamedTuple

if __package__ in (None, ""):  # run as a file (python scripts/x.py): make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from tokenizers import Tokenizer

from dataset.tool_calls import visible_content
from eval_model import add_model_flags, chat_encoder, chat_prompt_ids, find_weight_file, generate_ids, load_model, \
    readable_length
from model.model import CausalLM
from model.tokenizer import load_tokenizer
from scripts.openai_chat import BadRequest, read_answer, read_chat_request, reply_start_ids, tool_call_deltas
from scripts.request_guard import API_KEY_VARIABLE, api_key_problem, guarded, host_names, openai_error
from scripts.web import add_chat_page


class Limits(NamedTuple):
    """What one request may ask of the server; GET /v1/models lists them."""
    max_tokens_default: int  # --max_new_tokens: max_tokens of a request that gives none
    max_tokens_limit: int  # --max_tokens_limit: a larger max_tokens gets a 400
    request_time_limit_s: float  # --request_time_limit: seconds of generation, then finish_reason "length"
    trained_max_seq_len: int | None  # out/{weight}.json's max_seq_len (x --rope_factor under --rope_scaling); None: not
    # recorded (minimind's weights)
    long_prompts: str  # --long_prompts: "refuse" or "warn" a prompt longer than trained_max_seq_len
    max_request_bytes: int  # --max_request_bytes: a larger body gets a 413


async def read_body(request: Request, max_bytes: int) -> bytes | None:
    """The request's body, or None once it is found to be longer than `max_bytes` (the rest is not read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            return None
    return bytes(body)


# ---- generation, token by token -----------------------------------------------------------------

class ClientGone(Exception):
    """Raised inside generate once the client has disconnected: it ends the generation there."""


class TimeUp(Exception):
    """Raised inside generate once the request has had the model for --request_time_limit seconds."""


def generate_reply(model: CausalLM, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                   top_p: float, on_token: Callable[[int], None]) -> list[int]:
    """eval_model.generate_ids (CausalLM.generate, with its KV cache), telling `on_token` each token as it
    is picked; returns the ids. generate feeds every token it picks back into the model but the last; a
    hook hears them."""
    heard: list[int] = []

    def hook(module, args, kwargs):
        if kwargs.get("past_key_values") is not None:  # not the prompt: the one token just picked
            heard.append(int(args[0][0, -1]))
            on_token(heard[-1])

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        ids = generate_ids(model, prompt_ids, max_new_tokens, temperature, top_p)
    finally:
        handle.remove()
    for token in ids[len(heard):]:  # the last one (<|im_end|> is not in `ids`)
        on_token(token)
    return ids


async def reply_tokens(request: Request, lock: threading.Lock, model: CausalLM, prompt_ids: list[int],
                       max_new_tokens: int, temperature: float, top_p: float,
                       time_limit_s: float) -> AsyncIterator[tuple[list[int], str | None]]:
    """The reply as generate_reply writes it, in a thread that holds `lock`: (the ids picked since the last
    yield, None) at least once a second (an empty list while another request has the model), then
    ([], finish reason). The thread stops at its next token once the client has gone or the time is up."""
    tokens: queue.Queue = queue.Queue()  # ids, then the finish reason or the exception that ended generation
    stop = threading.Event()

    def work() -> None:
        try:
            with lock:
                deadline = time.monotonic() + time_limit_s  # counted from here: the limit is on holding the model

                def on_token(token: int) -> None:
                    if stop.is_set():
                        raise ClientGone
                    tokens.put(token)
                    if time.monotonic() > deadline:
                        raise TimeUp

                ids = generate_reply(model, prompt_ids, max_new_tokens, temperature, top_p, on_token)
            # <|im_end|> is not in `ids`: fewer than allowed means the model wrote it
            tokens.put("length" if len(ids) == max_new_tokens else "stop")
        except TimeUp:
            tokens.put("length")
        except Exception as error:  # ClientGone too, though no one reads it then
            tokens.put(error)

    threading.Thread(target=work, daemon=True).start()
    try:
        while not await request.is_disconnected():
            items = []
            try:  # wake each second to look at the connection, also while another request has the model
                items.append(await asyncio.to_thread(tokens.get, timeout=1.0))
                while True:  # and take all that came meanwhile: one decode for them, one chunk
                    items.append(tokens.get_nowait())
            except queue.Empty:
                pass
            end = items.pop() if items and not isinstance(items[-1], int) else None
            if isinstance(end, Exception):
                raise end
            yield items, end
            if end is not None:
                return
    finally:  # finished, disconnected, or cancelled by the server when the client left a stream
        stop.set()


def split_reply(text: str) -> tuple[str, str]:
    """(reasoning, answer). A reply that opens with <think> thinks up to the first </think> and answers after
    it; any other reply is all answer. On the replies the chat template trains (one think block, then the
    answer) this is eval_model.answer_from_generation's answer. Tags after the think block stay in the
    answer, where eval_model.py reads after the last </think>: a stream cannot take back what it sent."""
    body = text.lstrip()
    if not body.startswith("<think>"):
        return "", text
    thought, _, answer = body[len("<think>"):].partition("</think>")
    return thought.strip("\n"), answer.lstrip("\n")


def held_back(text: str) -> bool:
    """Whether a stream waits before sending `text`, the reply so far: it ends inside a character (not all of
    its bytes written yet), or it is whitespace and the start of "<think>", which may still open a think block
    (split_reply reads such a reply apart). Whitespace followed by anything else is sent at once."""
    return text.endswith("\ufffd") or "<think>".startswith(text.lstrip())


def grown(parts: tuple[str, str], sent: tuple[str, str]) -> dict[str, str]:
    """A stream chunk's delta: what each part of the reply, (reasoning, answer), added to what was sent."""
    return {name: new[len(old):] for name, new, old in zip(("reasoning_content", "content"), parts, sent)
            if len(new) > len(old)}


# ---- the app ------------------------------------------------------------------------------------

def create_app(model: CausalLM, tokenizer: Tokenizer, model_id: str, limits: Limits) -> FastAPI:
    app = FastAPI(title=model_id, docs_url=None, redoc_url=None, openapi_url=None)  # their pages load a CDN's script
    lock = threading.Lock()  # one model: one generation at a time, the others wait their turn
    positions = model.config.max_position_embeddings
    scaled = model.config.rope_scaling  # --rope_scaling: the length limit is the trained length x the factor
    reads = f"model reads ({scaled['rope_type']} x{scaled['factor']:g})" if scaled else "model was trained at"
    decode = chat_encoder(tokenizer).decode

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "local",
                                            **limits._asdict()}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        raw = await read_body(request, limits.max_request_bytes)
        if raw is None:
            return openai_error(413, f"the request body is longer than this server reads, {limits.max_request_bytes} "
                                     f"bytes (--max_request_bytes)", None)
        try:  # in a thread: the event loop goes on answering the other clients meanwhile
            body, tools, messages = await asyncio.to_thread(read_chat_request, raw, limits.max_tokens_limit)
        except BadRequest as error:
            return openai_error(400, error.message, error.param)
        try:  # the project's one chat template, as in training and eval_model.py; in a thread, as a long
            # prompt takes seconds to tokenize and the other clients are answered meanwhile
            prompt_ids = await asyncio.to_thread(lambda: chat_prompt_ids(tokenizer, messages, tools.specs)
                                                 + reply_start_ids(tokenizer, tools.reply_start))
        except ValueError as error:
            return openai_error(400, f"messages: {error}", "messages")
        if len(prompt_ids) >= positions:
            return openai_error(400, f"messages: the prompt is {len(prompt_ids)} tokens and the model has "
                                     f"{positions} positions; shorten the conversation", "messages")
        trained = limits.trained_max_seq_len
        if trained is not None and len(prompt_ids) > trained:
            if limits.long_prompts == "refuse":
                return openai_error(400, f"messages: the prompt is {len(prompt_ids)} tokens, longer than the "
                                         f"{trained} the {reads}; shorten the conversation (or start "
                                         f"the server with --long_prompts warn)", "messages")
            print(f"warning: a prompt of {len(prompt_ids)} tokens, longer than the {trained} the model was trained "
                  f"at: its answer may be poor", file=sys.stderr, flush=True)
        max_new_tokens = min(body.max_tokens or limits.max_tokens_default, positions - len(prompt_ids))
        reply = reply_tokens(request, lock, model, prompt_ids, max_new_tokens, body.temperature, body.top_p,
                             limits.request_time_limit_s)
        ids: list[int] = []
        finish_reason = None  # stays None only for a client that left before the end
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_id}

        def usage() -> dict:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                    "total_tokens": len(prompt_ids) + len(ids)}

        def shown(text: str) -> tuple[str, str]:
            """(reasoning, answer) of the reply so far, as far as a stream may send them: with tools offered, the
            answer up to a tool call (sent once whole, at the end)."""
            reasoning, answer = split_reply(text)
            return reasoning, visible_content(answer) if tools.names else answer

        def final() -> tuple[str, str, list[dict]]:
            """(reasoning, content, OpenAI tool_calls) of the whole reply; malformed calls stay text, and a line
            in the log says why."""
            reasoning, answer = split_reply(tools.reply_start + decode(ids))
            content, calls, malformed = read_answer(answer, tools)
            if malformed:
                print(f"note: a reply's tool call is malformed ({malformed}): sent as text", file=sys.stderr,
                      flush=True)
            return reasoning, content, calls

        if not body.stream:
            async for new, finish_reason in reply:
                ids.extend(new)
            reasoning, content, calls = final()
            message = {"role": "assistant", "content": content or None if calls else content}  # as OpenAI's
            if calls:
                message["tool_calls"], finish_reason = calls, "tool_calls"
            if reasoning:
                message["reasoning_content"] = reasoning
            return {**head, "object": "chat.completion", "usage": usage(),
                    "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}]}

        def chunk(delta: dict, reason: str | None = None, **extra) -> str:
            data = {**head, "object": "chat.completion.chunk", **extra,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        async def events() -> AsyncIterator[str]:  # server-sent events, in OpenAI's chunk format
            yield chunk({"role": "assistant", "content": ""})
            sent, written_at, finish_reason = ("", ""), time.monotonic(), None
            async for new, finish_reason in reply:
                ids.extend(new)
                text = tools.reply_start + decode(ids)
                if not held_back(text) and (delta := grown(shown(text), sent)):
                    yield chunk(delta)
                    sent, written_at = shown(text), time.monotonic()
                elif time.monotonic() - written_at >= 1.0:
                    # Nothing to show yet (held back, whitespace the reply drops, or the model is busy): an SSE
                    # comment, which clients skip, tells a client with a read timeout that the reply goes on.
                    yield ": writing\n\n"
                    written_at = time.monotonic()
            reasoning, content, calls = final()
            if delta := grown((reasoning, content), sent):  # what was held back at the end
                yield chunk(delta)
            for delta in tool_call_deltas(calls):
                yield chunk(delta)
            yield chunk({}, "tool_calls" if calls else finish_reason, usage=usage())
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


# ---- command line -------------------------------------------------------------------------------

def flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the limits given on the command line, in one line, or None."""
    if not 1 <= args.max_new_tokens <= args.max_tokens_limit:
        return f"need 1 <= --max_new_tokens ({args.max_new_tokens}) <= --max_tokens_limit ({args.max_tokens_limit})"
    # nan compares false with everything, so `<= 0` alone would take it for no limit at all; inf is none either
    if not (math.isfinite(args.request_time_limit) and args.request_time_limit > 0):
        return f"--request_time_limit {args.request_time_limit}: give a number of seconds above 0 (default 120)"
    if args.max_request_bytes < 1:
        return f"--max_request_bytes {args.max_request_bytes}: give a number of bytes above 0 (default {2**20})"
    if args.api_key is not None and (why := api_key_problem(args.api_key)):  # the key itself is not shown
        return f"--api_key (or {API_KEY_VARIABLE}): {why}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve a model from out/ over the OpenAI chat API")
    add_model_flags(p)  # --weight, --save_dir, --tokenizer_path, the size flags, --device: as eval_model.py
    p.add_argument("--lora", default=None, help="NAME: serve --weight with the adapter out/lora_{NAME}_{hidden}.pth")
    p.add_argument("--host", default="127.0.0.1",
                   help="127.0.0.1: this machine only; 0.0.0.0 with --allowed_hosts: the network too")
    p.add_argument("--allowed_hosts", nargs="+", default=[], metavar="NAME",
                   help="names clients reach the server by, besides localhost, 127.0.0.1, [::1] and --host: a request "
                        "whose Host header names another gets a 421 (a web page on another domain may not use it)")
    p.add_argument("--api_key", default=os.environ.get(API_KEY_VARIABLE), metavar="KEY",
                   help=f"every API request must send \"Authorization: Bearer KEY\" (else a 401); the chat page asks "
                        f"for it. Better: set {API_KEY_VARIABLE}=KEY, which `ps` does not show")
    p.add_argument("--port", type=int, default=8998)
    p.add_argument("--max_new_tokens", type=int, default=512, help="max_tokens of a request that gives none")
    p.add_argument("--max_tokens_limit", type=int, default=2048, help="the largest max_tokens a request may ask")
    p.add_argument("--request_time_limit", type=float, default=120.0,
                   help="seconds a request may generate; then its reply ends, finish_reason length")
    p.add_argument("--max_request_bytes", type=int, default=2**20,
                   help="the longest request body read (default 1 MiB); a longer one gets a 413")
    p.add_argument("--long_prompts", choices=("refuse", "warn"), default="refuse",
                   help="a prompt longer than the model was trained at (out/{weight}.json): refuse it (400) or "
                        "serve it with a warning in the log")
    p.add_argument("--no_web", action="store_true", help="serve the API only, without the chat page at /")
    args = p.parse_args(argv)
    problem = flag_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2  # an expected error exits 2, as in eval_model.py
    tokenizer = load_tokenizer(args.tokenizer_path)
    try:
        path = find_weight_file(Path(args.save_dir), args.weight, args.hidden_size, args.use_moe)
        model = load_model(args, tokenizer, torch.device(args.device), log=lambda line: print(line, file=sys.stderr))
        trained = readable_length(args, path)  # out/{weight}.json's length, x --rope_factor under --rope_scaling
    except (FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2  # an expected error exits 2, as in eval_model.py
    limits = Limits(args.max_new_tokens, args.max_tokens_limit, args.request_time_limit, trained, args.long_prompts,
                    args.max_request_bytes)
    if trained is None:
        print(f"note: no {path.with_suffix('.json').name} beside the weights tells the length the model was trained "
              f"at: prompts are limited only by its {model.config.max_position_embeddings} positions", file=sys.stderr)
    print(f"limits: {limits._asdict()}", file=sys.stderr)
    name = f"{path.stem}+lora_{args.lora}" if args.lora else path.stem  # the "model" that /v1/models lists
    app = create_app(model, tokenizer, name, limits)
    if not args.no_web:
        add_chat_page(app)
        print(f"chat page: http://{args.host}:{args.port}/", file=sys.stderr)
    names = host_names(args.host, args.allowed_hosts)
    print(f"answers to Host: {', '.join(sorted(names))} (--allowed_hosts); API key: "
          f"{'required' if args.api_key else f'none (--api_key or {API_KEY_VARIABLE})'}", file=sys.stderr)
    uvicorn.run(guarded(app, names, args.api_key), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())

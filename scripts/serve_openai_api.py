"""Serve a model from out/ over the OpenAI chat API, for the clients people already have.

The model is chosen with eval_model.py's flags (sizes read off the weights) and answers as eval_model.py
does: the same prompt (the chat template training uses), the same KV-cache generation, the answer after
the think block as `content`; the think text, if any, is kept apart as `reasoning_content`. A request's
temperature and top_p default to eval_model.py's (greedy), its max_tokens to --max_new_tokens.

    python scripts/serve_openai_api.py --weight full_sft            # on 127.0.0.1:8998, this machine only
    curl -s http://127.0.0.1:8998/v1/chat/completions -H "Content-Type: application/json" \\
         -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}]}'

Requests are served one at a time (one model, one lock); a client that disconnects stops its generation.
A bad request gets a 400 in OpenAI's error shape, naming the field.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable

if __package__ in (None, ""):  # run as a file (python scripts/x.py): make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from tokenizers import Tokenizer

from eval_model import add_model_flags, chat_encoder, chat_prompt_ids, find_weight_file, generate_ids, load_model
from model.model import CausalLM
from model.tokenizer import load_tokenizer


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat request read here; others ("model", "n", ...) are ignored."""
    messages: list[dict] = Field(min_length=1)  # each checked by dataset/chat_format.py as the prompt is built
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)  # 0 = greedy, as in eval_model.py
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False


def openai_error(status: int, message: str, param: str | None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=status)


# ---- generation, token by token -----------------------------------------------------------------

class ClientGone(Exception):
    """Raised inside generate once the client has disconnected: it ends the generation there."""


def generate_reply(model: CausalLM, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                   top_p: float, on_token: Callable[[int], None]) -> None:
    """eval_model.generate_ids (CausalLM.generate, with its KV cache), telling `on_token` each token as it
    is picked. generate feeds every token it picks back into the model but the last; a hook hears them."""
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


async def reply_tokens(request: Request, lock: threading.Lock, model: CausalLM, prompt_ids: list[int],
                       max_new_tokens: int, temperature: float, top_p: float) -> AsyncIterator[int]:
    """The reply's ids as generate_reply picks them, in a thread that holds `lock`; the thread stops at its
    next token once the client has gone."""
    tokens: queue.Queue = queue.Queue()  # ids, then None (done) or the exception that ended generation
    stop = threading.Event()

    def on_token(token: int) -> None:
        if stop.is_set():
            raise ClientGone
        tokens.put(token)

    def work() -> None:
        try:
            with lock:
                generate_reply(model, prompt_ids, max_new_tokens, temperature, top_p, on_token)
            tokens.put(None)
        except Exception as error:  # ClientGone too, though no one reads it then
            tokens.put(error)

    threading.Thread(target=work, daemon=True).start()
    try:
        while not await request.is_disconnected():
            try:  # wake each second to look at the connection, also while another request has the model
                item = await asyncio.to_thread(tokens.get, timeout=1.0)
            except queue.Empty:
                continue
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item
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


def grown(parts: tuple[str, str], sent: tuple[str, str]) -> dict[str, str]:
    """A stream chunk's delta: what each part of the reply, (reasoning, answer), added to what was sent."""
    return {name: new[len(old):] for name, new, old in zip(("reasoning_content", "content"), parts, sent)
            if len(new) > len(old)}


# ---- the app ------------------------------------------------------------------------------------

def create_app(model: CausalLM, tokenizer: Tokenizer, model_id: str, default_max_tokens: int) -> FastAPI:
    app = FastAPI(title=model_id)
    lock = threading.Lock()  # one model: one generation at a time, the others wait their turn
    positions = model.config.max_position_embeddings
    decode = chat_encoder(tokenizer).decode

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            return openai_error(400, f"the request body is not valid JSON ({first['ctx']['error']})", None)
        field = ".".join(str(part) for part in first["loc"][1:]) or None  # loc starts with "body"
        return openai_error(400, f"{field or 'the request body'}: {first['msg']}", field)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "local"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        try:  # the project's one chat template, as in training and eval_model.py
            prompt_ids = chat_prompt_ids(tokenizer, body.messages)
        except ValueError as error:
            return openai_error(400, f"messages: {error}", "messages")
        if len(prompt_ids) >= positions:
            return openai_error(400, f"messages: the prompt is {len(prompt_ids)} tokens and the model has "
                                     f"{positions} positions; shorten the conversation", "messages")
        max_new_tokens = min(body.max_tokens or default_max_tokens, positions - len(prompt_ids))
        tokens = reply_tokens(request, lock, model, prompt_ids, max_new_tokens, body.temperature, body.top_p)
        ids: list[int] = []
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_id}

        def usage() -> dict:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                    "total_tokens": len(prompt_ids) + len(ids)}

        def finish_reason() -> str:  # <|im_end|> is not in `ids`: fewer than allowed means the model wrote it
            return "length" if len(ids) == max_new_tokens else "stop"

        if not body.stream:
            async for token in tokens:
                ids.append(token)
            reasoning, content = split_reply(decode(ids))
            message = {"role": "assistant", "content": content}
            if reasoning:
                message["reasoning_content"] = reasoning
            return {**head, "object": "chat.completion", "usage": usage(),
                    "choices": [{"index": 0, "message": message, "finish_reason": finish_reason()}]}

        def chunk(delta: dict, reason: str | None = None, **extra) -> str:
            data = {**head, "object": "chat.completion.chunk", **extra,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        async def events() -> AsyncIterator[str]:  # server-sent events, in OpenAI's chunk format
            yield chunk({"role": "assistant", "content": ""})
            sent = ("", "")
            async for token in tokens:
                ids.append(token)
                text = decode(ids)
                # Held back: a character whose bytes are not all out yet, a reply that may still open <think>.
                if not (text.endswith("\ufffd") or "<think>".startswith(text.lstrip())):
                    if delta := grown(split_reply(text), sent):
                        yield chunk(delta)
                        sent = split_reply(text)
            if delta := grown(split_reply(decode(ids)), sent):  # what was held back at the end
                yield chunk(delta)
            yield chunk({}, finish_reason(), usage=usage())
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


# ---- command line -------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve a model from out/ over the OpenAI chat API")
    add_model_flags(p)  # --weight, --save_dir, --tokenizer_path, the size flags, --device: as eval_model.py
    p.add_argument("--host", default="127.0.0.1", help="127.0.0.1: this machine only; 0.0.0.0: the network too")
    p.add_argument("--port", type=int, default=8998)
    p.add_argument("--max_new_tokens", type=int, default=512, help="max_tokens of a request that gives none")
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer_path)
    try:
        path = find_weight_file(Path(args.save_dir), args.weight, args.hidden_size, args.use_moe)
        model = load_model(args, tokenizer, torch.device(args.device), log=lambda line: print(line, file=sys.stderr))
    except (FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2  # an expected error exits 2, as in eval_model.py
    uvicorn.run(create_app(model, tokenizer, path.stem, args.max_new_tokens), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())

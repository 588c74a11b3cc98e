"""Who may use scripts/serve_openai_api.py: what a request must show before any route runs, and the headers on
every response.

A server on 127.0.0.1 is out of the network's reach, but not of the web pages its user visits: a page's script
may POST to http://127.0.0.1:8998 without asking (a "simple" cross-origin request: text/plain, a form, a bare Blob),
and a page whose domain's DNS is switched to 127.0.0.1 ("DNS rebinding") is same-origin with the server and reads
its answers. So each request is checked, in this order:

    Host            its name must be one the server was started for: localhost, 127.0.0.1, [::1], the --host
                    value and --allowed_hosts, with any port or none (an ssh tunnel's port is not the server's);
                    else a 421. A rebound domain sends its own name.
    API key         with --api_key KEY (or the environment variable TRAINER_API_KEY, which `ps` does not show),
                    every request but the chat page's own files needs "Authorization: Bearer KEY"; else a 401.
    Content-Type    a POST must be application/json; else a 415. A page on another site may send JSON only after
                    a CORS preflight, which this server never answers yes to.

Every response, errors too, says X-Content-Type-Options: nosniff and Referrer-Policy: no-referrer.
"""

from __future__ import annotations

import hmac
import re

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")
API_KEY_VARIABLE = "TRAINER_API_KEY"
SAFE_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer")]
HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^:\[\]]+)(:[0-9]*)?")  # a name or [IPv6 address], then maybe a port


def openai_error(status: int, message: str, param: str | None, code: str | None = None) -> JSONResponse:
    """A response in OpenAI's error shape, which its clients read (openai.BadRequestError's .body)."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": code}}, status_code=status)


def host_names(host: str, allowed: list[str]) -> frozenset[str]:
    """The names a request's Host header may give: the local ones, --host's and --allowed_hosts', lower case; an
    IPv6 address in brackets, as a Host header writes it."""
    names = {*LOCAL_NAMES, host, *allowed}
    return frozenset(f"[{name}]" if ":" in name and not name.startswith("[") else name.lower() for name in names)


def api_key_problem(key: str) -> str | None:
    """What keeps `key` from being sent in an HTTP header, or None."""
    if not re.fullmatch(r"[\x21-\x7e]+", key):
        return "give a key of visible ASCII characters without spaces (it travels in an HTTP header)"
    return None


def refusal(scope: Scope, names: frozenset[str], api_key: str | None) -> JSONResponse | None:
    """The answer to a request that may not be served (see the module docstring), or None."""
    headers = Headers(scope=scope)
    host = headers.get("host", "")
    name = HOST.fullmatch(host)
    if not name or name[1].lower() not in names:
        shown = f"Host {host[:100]!r}" if host else "no Host header"
        return openai_error(421, f"{shown}: this server answers only to {', '.join(sorted(names))} (a page on "
                                 f"another domain may not use it); start it with --allowed_hosts NAME for a name "
                                 f"its clients reach it by", None)
    page_file = scope["path"] == "/" or scope["path"].startswith("/web/")  # no data in them: the page asks the key
    if api_key is not None and not page_file:
        scheme, _, given = headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of a guess was right
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            return openai_error(401, "this server needs its API key (--api_key) in the header \"Authorization: "
                                     "Bearer KEY\"; the one given is wrong or missing", None, "invalid_api_key")
    if scope["method"] not in ("GET", "HEAD"):
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            return openai_error(415, f"Content-Type {media_type or '(none)'}: the API reads JSON; send "
                                     f"\"Content-Type: application/json\"", None)
    return None


def guarded(app: ASGIApp, names: frozenset[str], api_key: str | None) -> ASGIApp:
    """`app` answering only requests refusal() lets through, with SAFE_HEADERS on every response. It wraps the
    whole app, outside FastAPI's own error handling, so that a 500 carries the headers too."""

    async def guard(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # the lifespan (start and shutdown) goes to the app as it is
            await app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SAFE_HEADERS]
            await send(message)

        refused = refusal(scope, names, api_key)
        await (app if refused is None else refused)(scope, receive, send_with_headers)

    return guard

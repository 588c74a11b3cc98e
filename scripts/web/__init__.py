"""The chat page scripts/serve_openai_api.py serves at / (unless --no_web): chat.html, chat.js, markdown.js and
chat.css, plain files that talk to the server's own /v1/chat/completions. No build step, nothing fetched from
elsewhere, so the page works offline as the server does."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse

WEB_DIR = Path(__file__).resolve().parent
# The page runs only its own files: no inline script, no event-handler attribute, nothing from elsewhere. Its
# renderer never makes HTML of the model's text (markdown.js builds text nodes); this is a second lock on that door.
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
FILES = ("chat.js", "markdown.js", "chat.css")  # what /web/ serves: the page's files, not this module


def add_chat_page(app: FastAPI) -> None:
    """The chat page at / and its files at /web/NAME."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(WEB_DIR / "chat.html", headers={"Content-Security-Policy": PAGE_POLICY})

    @app.get("/web/{name}", include_in_schema=False)
    async def page_file(name: str) -> FileResponse:
        if name not in FILES:
            raise HTTPException(404)
        return FileResponse(WEB_DIR / name)  # nosniff, as every response: scripts/request_guard.py

"""scripts/request_guard.py: scripts/serve_openai_api.py answers its user, not a web page its user visits.

In this process, on a random tiny model (FastAPI's test client, as tests/test_serve_openai_api.py's flag tests): the
Host names, the JSON content type, the API key and the headers on every response. tests/test_chat_page.py asks a
real server, its key in TRAINER_API_KEY, with the official `openai` client, plain HTTP and the page.
"""

from __future__ import annotations

import json

import pytest

from test_serve_openai_api import FROG, openai_refusal, tiny_server

QUESTION = json.dumps({"messages": FROG, "max_tokens": 2})
KEY = "sk-local-7f3a"


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    """One test client (no key) for the tests below that need no flags."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        status, client = tiny_server(tmp_path_factory.mktemp("tiny"), monkeypatch)
        assert status == 0
        yield client


def status_of(http, path: str = "/v1/models", **headers) -> int:
    return (http.post(path, content=QUESTION, headers=headers) if path.endswith("completions")
            else http.get(path, headers=headers)).status_code


def test_a_host_the_server_was_not_started_for_gets_a_421_and_its_own_names_are_served(tmp_path, monkeypatch):
    """DNS rebinding: a page on evil.example whose name now points at 127.0.0.1 sends Host: evil.example."""
    status, http = tiny_server(tmp_path, monkeypatch)
    assert status == 0
    for path in ("/", "/web/chat.js", "/v1/models", "/v1/chat/completions"):
        for host in ("evil.example", "evil.example:8998", "localhost.evil.example", "127.0.0.1.nip.io:8998",
                     "[::2]:8998", "localhost:8998@evil.example", "localhost:port"):
            response = http.get(path, headers={"Host": host}) if "completions" not in path else \
                http.post(path, content=QUESTION, headers={"Host": host})
            code, param, message = openai_refusal(response)
            assert code == 421 and param is None, (path, host, response.text)
            assert message.startswith(f"Host {host!r}: this server answers only to 127.0.0.1, [::1], localhost")
            assert "--allowed_hosts" in message
        for host in ("localhost", "localhost:8998", "LocalHost:1234", "127.0.0.1", "[::1]:8998"):  # any port: a tunnel's
            assert status_of(http, path, Host=host) == 200, (path, host)
    status, http = tiny_server(tmp_path, monkeypatch, "--host", "10.1.2.3", "--allowed_hosts", "box.lan", "fe80::1")
    assert status == 0
    for host in ("10.1.2.3:8998", "box.lan", "BOX.lan:80", "[fe80::1]:8998", "localhost"):
        assert status_of(http, Host=host) == 200, host
    assert status_of(http, Host="evil.example") == 421


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/jsonx"])
def test_a_post_that_is_not_json_gets_a_415_so_a_foreign_pages_simple_request_makes_nothing(http, content_type):
    """A page on another site may POST a body with these types (or none) without asking; the body is JSON all the
    same, as an attacker would write it."""
    request = http.build_request("POST", "/v1/chat/completions", content=QUESTION)
    if content_type is None:
        del request.headers["Content-Type"]
    else:
        request.headers["Content-Type"] = content_type
    code, param, message = openai_refusal(http.send(request))
    expected = (content_type or "(none)").partition(";")[0].lower()
    assert (code, param) == (415, None) and message.startswith(f"Content-Type {expected}: the API reads JSON"), message
    answered = http.post("/v1/chat/completions", content=QUESTION,
                         headers={"Content-Type": "application/json; charset=utf-8"})
    assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] > 0


def test_no_api_docs_are_served_as_they_would_fetch_a_cdns_script(http):
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert http.get(path).status_code == 404, path


def test_with_a_key_every_api_request_needs_it_and_the_page_asks_for_it(tmp_path, monkeypatch):
    for flags, variable in ((["--api_key", KEY], None), ([], KEY)):  # the flag, or the environment (`ps` shows no key)
        status, http = tiny_server(tmp_path, monkeypatch, *flags, api_key_variable=variable)
        assert status == 0
        for headers in ({}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"},
                        {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
            for path in ("/v1/models", "/v1/chat/completions", "/v1/nothing", "/docs"):
                code, param, message = openai_refusal(http.post(path, content=QUESTION, headers=headers)
                                                      if "completions" in path else http.get(path, headers=headers))
                assert code == 401 and "Authorization: Bearer KEY" in message and KEY not in message, (path, headers)
        for scheme in ("Bearer", "bearer"):
            assert status_of(http, Authorization=f"{scheme} {KEY}") == 200
            assert status_of(http, "/v1/chat/completions", Authorization=f"{scheme} {KEY}") == 200
        assert http.get("/").status_code == 200 and http.get("/web/chat.js").status_code == 200  # they ask for it


@pytest.mark.parametrize("flags, variable", [(["--api_key", ""], None), (["--api_key", "my key"], None),
                                             ([], ""), ([], "clé")])
def test_a_key_that_cannot_travel_in_a_header_is_refused_in_one_line(tmp_path, monkeypatch, capsys, flags, variable):
    status, http = tiny_server(tmp_path, monkeypatch, *flags, api_key_variable=variable)
    err = capsys.readouterr().err.strip()
    assert status == 2 and http is None
    assert err == "error: --api_key (or TRAINER_API_KEY): give a key of visible ASCII characters without spaces (it " \
                  "travels in an HTTP header)"


def test_every_response_says_nosniff_and_no_referrer_errors_too(tmp_path, monkeypatch):
    status, http = tiny_server(tmp_path, monkeypatch, "--api_key", KEY)
    key = {"Authorization": f"Bearer {KEY}"}
    responses = [http.get("/"), http.get("/web/chat.css"), http.get("/web/nothing.js"), http.get("/v1/models"),
                 http.get("/v1/models", headers=key), http.get("/v1/models", headers={**key, "Host": "evil.example"}),
                 http.post("/v1/chat/completions", content=QUESTION, headers=key),
                 http.post("/v1/chat/completions", content=b"{", headers=key),
                 http.post("/v1/chat/completions", content=QUESTION, headers={**key, "Content-Type": "text/plain"}),
                 http.post("/v1/chat/completions", content=QUESTION, headers={**key, "Content-Length": "9999999"}),
                 http.get("/v1/nothing", headers=key), http.delete("/v1/models", headers=key)]
    assert [r.status_code for r in responses] == [200, 200, 404, 401, 200, 421, 200, 400, 415, 413, 404, 405]
    for response in responses:
        assert response.headers["x-content-type-options"] == "nosniff", response.request
        assert response.headers["referrer-policy"] == "no-referrer", response.request

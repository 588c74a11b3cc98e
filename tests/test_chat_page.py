"""The chat page scripts/serve_openai_api.py serves at /, driven in a real headless Chromium (Debian's chromium and
chromium-driver, through selenium) against a served model; and the page's files and --no_web, over plain HTTP.

The model is a tiny one fine-tuned for 180 steps (seconds on the CPU) on the conversations below: it answers "Paris"
and "巴黎", thinks before it says how to print (a code block and a list; also after "巴黎"), writes markup when
asked, and sings "la"
without end (that reply runs past the trained length, so no end was learned), which Stop and the server's time limit
end. Greedy decoding makes every reply reproducible. The server runs with a 4 s time limit and 2000-byte requests.

Install the browser once (.ci/run does it):   apt-get install -y chromium chromium-driver
Without it the browser tests skip, or fail when CI=true (as in CI). TRAINER_UPDATE_SCREENSHOT=1 also writes the
page as the first test leaves it to docs/chat_page.png, the README's picture.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, child_env, free_port, run_args, train, wait_for_server
from eval_model import chat_prompt_ids
from model.tokenizer import load_tokenizer
from test_serve_openai_api import tiny_server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INSTALL = "apt-get install -y chromium chromium-driver"
FRANCE, FRANCE_ZH = "What is the capital of France?", "法国的首都是哪里？"
MARKUP = "<img src=x onerror=ran=1><script>ran=2</script> **safe**"
PRINT_ANSWER = "Use `print`:\n```\nprint(1)\n```\n- one\n- two"
CONVERSATIONS = [[{"role": "user", "content": FRANCE}, {"role": "assistant", "content": "Paris"}],
                 [{"role": "user", "content": FRANCE_ZH}, {"role": "assistant", "content": "巴黎"}],
                 [{"role": "user", "content": "Sing."}, {"role": "assistant", "content": "la " * 80}],
                 [{"role": "user", "content": "Show markup."}, {"role": "assistant", "content": MARKUP}],
                 [{"role": "user", "content": "How do I print?"},
                  {"role": "assistant", "reasoning_content": "Python.", "content": PRINT_ANSWER}]]
CONVERSATIONS.append([*CONVERSATIONS[1], *CONVERSATIONS[4]])  # a second turn: the tiny model learns no other
TIME_LIMIT_S, MAX_REQUEST_BYTES = 4, 2000
KEY = "sk-page-4c1e"  # the keyed server's TRAINER_API_KEY


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium under selenium, or a skip (a failure under CI=true) naming what to install."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    missing = [name for name, there in (("selenium (pip install -r requirements.txt)", webdriver),
                                         (f"{CHROMIUM} and {CHROMEDRIVER} ({INSTALL})",
                                          Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists())) if not there]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the browser test cannot run: install {' and '.join(missing)}")
        pytest.skip(f"no browser to test the chat page in: install {' and '.join(missing)}")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # Debian's build, never one downloaded
    for flag in ("--headless=new", "--no-sandbox", "--window-size=1000,800", "--lang=en-US"):
        options.add_argument(flag)  # --no-sandbox: Chromium's sandbox refuses to run as root (CI's containers)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The out/ folder of the tiny model trained on CONVERSATIONS."""
    root = tmp_path_factory.mktemp("chat_page")
    data = root / "page.jsonl"
    data.write_text("".join(json.dumps({"conversations": c}, ensure_ascii=False) + "\n" for c in CONVERSATIONS * 8),
                    encoding="utf-8")
    train("train_full_sft.py", None, run_args(root, data, "--from_weight", "none", "--batch_size", "8", "--epochs",
                                              "30", "--learning_rate", "1e-2", "--warmup_ratio", "0",
                                              "--max_seq_len", "96"), root)
    return root / "out"


def start_server(out: Path, port: int, time_limit_s: float, **env: str) -> subprocess.Popen:
    """The server on the tiny model, on 127.0.0.1:`port`, its log in out/server_PORT.log."""
    return subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve_openai_api.py"), "--weight", "full_sft",
                             "--save_dir", str(out), "--device", "cpu", "--port", str(port), "--max_tokens_limit",
                             "30000", "--request_time_limit", str(time_limit_s), "--max_request_bytes",
                             str(MAX_REQUEST_BYTES)], cwd=out, env=child_env(**env),
                            stdout=open(out / f"server_{port}.log", "w"), stderr=subprocess.STDOUT)


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=15)
    server.stdout and server.stdout.close()


@pytest.fixture(scope="module")
def served(trained):
    """The base URL of the server on the tiny model, on a free 127.0.0.1 port; terminated at the end."""
    port = free_port()
    server = start_server(trained, port, TIME_LIMIT_S)
    try:
        wait_for_server(server, f"http://127.0.0.1:{port}", trained / f"server_{port}.log")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def keyed(trained):
    """(base URL, port) of a second server on the tiny model, its key KEY in TRAINER_API_KEY and its time limit an
    hour (so that only Stop can end a long reply there); terminated at the end."""
    port = free_port()
    server = start_server(trained, port, 3600, TRAINER_API_KEY=KEY)
    try:
        deadline = time.time() + 60
        while status_at(port, "localhost") is None:  # any answer (a 401: no key is sent) says it is up
            log = (trained / f"server_{port}.log").read_text()
            assert server.poll() is None, f"the server exited {server.returncode}:\n{log}"
            assert time.time() < deadline, f"the server did not answer in 60 s:\n{log}"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", port
    finally:
        stop_server(server)


def status_at(port: int, host: str, **headers: str) -> int | None:
    """The status of GET /v1/models sent to 127.0.0.1:`port` with the Host header `host`; None if none answers."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/v1/models", headers={"Host": host, **headers})
        with connection.getresponse() as response:
            return response.status
    except OSError:
        return None
    finally:
        connection.close()


# ---- driving the page -----------------------------------------------------------------------------

def wait_for(driver, condition, timeout: float = 15):
    """What `condition(driver)` returns once it is truthy; a failure naming the page's messages after `timeout`."""
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)
    except Exception as error:
        raise AssertionError(f"the page did not get there in {timeout} s; it shows:\n{messages(driver)}") from error


def by(css: str):
    from selenium.webdriver.common.by import By

    return By.CSS_SELECTOR, css


def messages(driver) -> list[str]:
    """The text of each message on the page, in order."""
    return [node.text for node in driver.find_elements(*by("#messages .message"))]


def open_page(driver, base: str, lang: str = "en", key: str | None = None) -> None:
    """The page at `base`, once it shows the model's name; `key` typed in if the page asks for one."""
    driver.get(f"{base}/?lang={lang}")
    if key is not None:  # asked for once: the page keeps it for the tab (sessionStorage)
        wait_for(driver, lambda d: d.find_element(*by("#model")).text == "full_sft_32"
                 or d.find_element(*by("#key-form")).is_displayed())
        if driver.find_element(*by("#key-form")).is_displayed():
            enter_key(driver, key)
    wait_for(driver, lambda d: d.find_element(*by("#model")).text == "full_sft_32")


def enter_key(driver, key: str) -> None:
    from selenium.webdriver.common.keys import Keys

    driver.find_element(*by("#api-key")).send_keys(key, Keys.ENTER)


def ask(driver, text: str) -> None:
    """Types `text` into the page (set at once: key by key is slow for long texts) and presses Enter."""
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(*by("#input"))
    driver.execute_script("arguments[0].value = arguments[1]", box, text)
    box.send_keys(Keys.ENTER)


def reply_done(driver, count: int):
    """The `count`-th reply's element once it has ended (the Send button is back), else None; read in one step, as
    the page may change between two reads."""
    return driver.execute_script("""
        const replies = document.querySelectorAll("#messages .message.assistant, #messages .message.error");
        return !document.getElementById("send").hidden && replies.length >= arguments[0] ? replies[arguments[0] - 1]
                                                                                         : null;""", count)


def set_setting(driver, field: str, value: str) -> None:
    settings = driver.find_element(*by("#settings"))
    if not settings.get_attribute("open"):
        settings.find_element(*by("summary")).click()
    box = driver.find_element(*by(f"#{field}"))
    box.clear()
    box.send_keys(value)


def prompt_tokens(*turns: str) -> int:
    """The prompt length, in tokens, of a conversation of these user and assistant turns, as the server counts it."""
    roles = ["user", "assistant"] * len(turns)
    return len(chat_prompt_ids(load_tokenizer(), [{"role": r, "content": c} for r, c in zip(roles, turns)]))


# ---- the page in the browser ----------------------------------------------------------------------

def test_a_question_streams_in_the_next_turn_carries_the_conversation_and_the_think_text_is_folded(browser,
                                                                                                   served):
    open_page(browser, served, "zh")
    assert browser.find_element(*by("#send")).text == "发送"
    browser.find_element(*by("#language")).click()  # to English
    assert browser.find_element(*by("#send")).text == "Send" and browser.find_element(*by("#stop")).text == ""
    ask(browser, FRANCE)
    assert wait_for(browser, lambda d: reply_done(d, 1)).find_element(*by(".answer")).text == "Paris"
    browser.find_element(*by("#new-chat")).click()
    assert messages(browser) == []
    ask(browser, FRANCE_ZH)
    first = wait_for(browser, lambda d: reply_done(d, 1))
    assert first.find_element(*by(".answer")).text == "巴黎"
    assert first.find_element(*by(".usage")).text.startswith(f"{prompt_tokens(FRANCE_ZH)} prompt")  # a new chat
    ask(browser, "How do I print?")
    reply = wait_for(browser, lambda d: reply_done(d, 2))
    # The second request carried the first turn: its prompt is the whole conversation.
    assert reply.find_element(*by(".usage")).text.startswith(f"{prompt_tokens(FRANCE_ZH, '巴黎', 'How do I print?')} "
                                                             f"prompt")
    think = reply.find_element(*by("details.think"))
    assert think.is_displayed() and not think.get_attribute("open")  # folded
    assert think.find_element(*by("summary")).text == "Thinking"
    assert think.find_element(*by(".text")).get_attribute("textContent") == "Python."
    answer = reply.find_element(*by(".answer"))
    assert answer.find_element(*by("pre code")).text == "print(1)"
    assert [li.text for li in answer.find_elements(*by("ul li"))] == ["one", "two"]
    assert answer.find_element(*by("p code")).text == "print"
    if os.environ.get("TRAINER_UPDATE_SCREENSHOT") == "1":  # Chinese shows in it with a CJK font (fonts-wqy-microhei)
        think.find_element(*by("summary")).click()
        browser.save_screenshot(str(REPO / "docs" / "chat_page.png"))


def test_the_send_button_stays_on_one_line_in_chinese_and_chinese_is_drawn_in_a_font_the_page_names(browser, served):
    """Before, 发送 broke between its two characters (a flex item shrinks to its narrowest, and Chinese may break
    anywhere), a button two lines high even 1,100 px wide. Chinese shows as empty boxes without a CJK font: the
    font that draws it must be one chat.css names (Debian's fonts-noto-cjk or fonts-wqy-microhei)."""
    browser.set_window_size(1100, 800)
    try:
        open_page(browser, served, "zh")
        send = browser.find_element(*by("#send"))
        assert send.text == "发送"
        lines = browser.execute_script("""
            const style = getComputedStyle(arguments[0]), px = (name) => parseFloat(style[name]);
            const text = arguments[0].getBoundingClientRect().height - px("paddingTop") - px("paddingBottom")
                - px("borderTopWidth") - px("borderBottomWidth");
            return text / px("lineHeight");""", send)
        assert round(lines, 2) == 1, lines
    finally:
        browser.set_window_size(1000, 800)
    browser.execute_cdp_cmd("DOM.enable", {})
    browser.execute_cdp_cmd("CSS.enable", {})
    root = browser.execute_cdp_cmd("DOM.getDocument", {})["root"]["nodeId"]
    node = browser.execute_cdp_cmd("DOM.querySelector", {"nodeId": root, "selector": "#send"})["nodeId"]
    drawn = browser.execute_cdp_cmd("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]  # what drew 发送
    named = [name.strip(' "') for name in
             browser.execute_script("return getComputedStyle(arguments[0]).fontFamily", send).split(",")]
    # a CJK font installed (fonts-noto-cjk or fonts-wqy-microhei) and named by chat.css drew both characters
    assert sum(font["glyphCount"] for font in drawn) == 2 and all(font["familyName"] in named for font in drawn), drawn


def test_stop_ends_a_long_reply_streaming_in_and_frees_the_model(browser, keyed):
    """On the server whose time limit is an hour: unstopped, the 30,000 tokens of "la" would hold the model for
    minutes (the next question waiting behind them), so only Stop can have freed it."""
    open_page(browser, keyed[0], key=KEY)
    set_setting(browser, "max_tokens", "30000")
    ask(browser, "Sing.")
    answer = wait_for(browser, lambda d: d.find_elements(*by(".message.assistant .answer")))[0]
    lengths = [len(wait_for(browser, lambda d: answer.text))]
    while len(lengths) < 3:  # the reply grows as it streams in
        lengths.append(wait_for(browser, lambda d: len(answer.text) > lengths[-1] and len(answer.text)))
    assert answer.text.startswith("la la")
    browser.find_element(*by("#stop")).click()
    reply = wait_for(browser, lambda d: reply_done(d, 1))
    assert reply.find_element(*by(".note")).text == "Stopped."
    shown = browser.execute_script("window.stoppedAnswer = arguments[0]; return arguments[0].textContent", answer)
    set_setting(browser, "max_tokens", "")
    browser.find_element(*by("#new-chat")).click()  # takes the stopped reply off the page (the script still has it)
    ask(browser, FRANCE)
    assert wait_for(browser, lambda d: reply_done(d, 1)).find_element(*by(".answer")).text == "Paris"  # freed
    assert browser.execute_script("return window.stoppedAnswer.textContent") == shown  # and it grew no more


def test_the_page_asks_for_the_servers_key_once_and_sends_it(browser, keyed):
    base, port = keyed
    browser.get(f"{base}/?lang=en")
    browser.execute_script("sessionStorage.clear()")  # as a new tab: an earlier test may have given the key
    browser.get(f"{base}/?lang=en")
    label = wait_for(browser, lambda d: d.find_element(*by("#key-form")).is_displayed()
                     and d.find_element(*by("#key-label")))
    assert label.text == "This server asks for its API key (--api_key):"
    assert browser.find_element(*by("#model")).text == "connecting…" and messages(browser) == []
    enter_key(browser, "sk-guess")
    wait_for(browser, lambda d: d.find_element(*by("#key-form")).is_displayed() and "did not take" in label.text)
    enter_key(browser, KEY)
    wait_for(browser, lambda d: d.find_element(*by("#model")).text == "full_sft_32")
    assert not browser.find_element(*by("#key-form")).is_displayed()
    ask(browser, FRANCE)
    assert wait_for(browser, lambda d: reply_done(d, 1)).find_element(*by(".answer")).text == "Paris"
    open_page(browser, base)  # reloaded: the key is kept for the tab, not asked again
    assert not browser.find_element(*by("#key-form")).is_displayed()


def test_the_official_client_is_served_with_the_key_and_a_foreign_host_is_refused(keyed):
    """Plain HTTP and the `openai` client against the real server (uvicorn), its key in TRAINER_API_KEY."""
    import openai

    base, port = keyed
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["full_sft_32"]
    reply = client.chat.completions.create(model="full_sft_32", messages=CONVERSATIONS[0][:1])
    assert reply.choices[0].message.content == "Paris"
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=f"{base}/v1", api_key="sk-guess", max_retries=0, timeout=60).models.list()
    assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
    key = {"Authorization": f"Bearer {KEY}"}
    assert status_at(port, f"localhost:{port}", **key) == 200 and status_at(port, f"[::1]:{port}", **key) == 200
    assert status_at(port, f"rebound.example:{port}", **key) == 421  # a page whose DNS now says 127.0.0.1: even with the key


def test_the_time_limit_and_refused_requests_are_shown_as_messages_and_not_kept(browser, served):
    open_page(browser, served)
    set_setting(browser, "max_tokens", "30000")
    ask(browser, "Sing.")
    reply = wait_for(browser, lambda d: reply_done(d, 1), timeout=TIME_LIMIT_S + 10)
    assert reply.find_element(*by(".note")).text.startswith(f"Cut off by the server: a reply may take {TIME_LIMIT_S} s")
    set_setting(browser, "max_tokens", "")
    browser.find_element(*by("#new-chat")).click()
    ask(browser, "word " * 90)  # within the positions, but longer than the 96 tokens it was trained at
    refused = wait_for(browser, lambda d: reply_done(d, 1))
    assert refused.get_attribute("class") == "message error"
    assert refused.text.startswith("The server refused the request (400): messages: the prompt is")
    assert "longer than the 96 the model was trained at" in refused.text
    ask(browser, "x" * 300_000)  # far over: the server answers without reading it all
    too_long = wait_for(browser, lambda d: reply_done(d, 2))
    assert too_long.text.startswith("The server refused the request (413)") and "--max_request_bytes" in too_long.text
    set_setting(browser, "temperature", "5")
    ask(browser, FRANCE)
    assert "(400): temperature:" in wait_for(browser, lambda d: reply_done(d, 3)).text
    set_setting(browser, "temperature", "0")
    ask(browser, FRANCE)
    answered = wait_for(browser, lambda d: reply_done(d, 4))
    assert answered.find_element(*by(".answer")).text == "Paris"
    # The refused questions were not kept: the prompt is this question alone.
    assert answered.find_element(*by(".usage")).text.startswith(f"{prompt_tokens(FRANCE)} prompt")


def test_markup_in_a_reply_shows_as_text_and_runs_nothing(browser, served):
    open_page(browser, served)
    ask(browser, "Show markup.")
    answer = wait_for(browser, lambda d: reply_done(d, 1)).find_element(*by(".answer"))
    assert answer.text == "<img src=x onerror=ran=1><script>ran=2</script> safe"
    assert answer.find_element(*by("strong")).text == "safe"
    assert browser.find_elements(*by("#messages img, #messages script")) == []
    assert browser.execute_script("return typeof window.ran") == "undefined"
    # The renderer itself, on what a model might write: markup in every place Markdown puts text.
    rendered = browser.execute_script("""
        const box = document.createElement("div");
        renderMarkdown(box, arguments[0]);
        return [box.querySelectorAll("*:not(p):not(pre):not(code):not(ul):not(li):not(strong):not(h3):not(a)").length,
                [...box.querySelectorAll("a")].map((a) => a.getAttribute("href")), box.textContent];""",
                                      '# <svg onload=ran=3>\n- <iframe src="javascript:ran=4">\n`<b>`\n'
                                      '[x](javascript:ran=5) [y](https://example.org/) **<img src=x onerror=ran=6>**\n'
                                      '```\n<script>ran=7</script>\n```')
    assert rendered[0] == 0 and rendered[1] == ["https://example.org/"], rendered
    assert "<svg onload=ran=3>" in rendered[2] and "[x](javascript:ran=5)" in rendered[2]
    assert browser.execute_script("return typeof window.ran") == "undefined"


def test_a_tool_call_in_a_streamed_delta_is_shown_folded(browser, served):
    open_page(browser, served)
    browser.execute_script("""
        const view = replyView();
        applyDelta(view, {tool_calls: [{index: 0, id: "call_1", type: "function",
                                        function: {name: "get_weather", arguments: '{"city": '}}]});
        applyDelta(view, {tool_calls: [{index: 0, function: {arguments: '"<b>Paris</b>"}'}}]});""")
    call = browser.find_element(*by("details.tool-call"))
    assert not call.get_attribute("open") and call.find_element(*by("summary")).text == "Tool call: get_weather"
    assert call.find_element(*by("pre")).get_attribute("textContent") == '{"city": "<b>Paris</b>"}'


# ---- the page's files, and --no_web (plain HTTP, no browser) ---------------------------------------

def test_the_page_and_its_files_are_served_and_no_web_leaves_them_out(tmp_path, monkeypatch):
    status, http = tiny_server(tmp_path, monkeypatch)
    assert status == 0
    page = http.get("/")
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    for name in ("chat.js", "markdown.js", "chat.css"):
        assert f'web/{name}"' in page.text and http.get(f"/web/{name}").status_code == 200
    assert http.get("/web/__init__.py").status_code == 404
    status, http = tiny_server(tmp_path, monkeypatch, "--no_web")
    assert status == 0 and http.get("/").status_code == 404 and http.get("/web/chat.js").status_code == 404
    assert http.get("/v1/models").status_code == 200

"""The READMEs' tool-call round trip ("Tool calls from your own client") is the code a user runs: its tool specs are
dataset/tools.py's, the two the demo's tool model was trained on, in the order the training data offers them; its
tool returns the shape dataset/tools.py returns; and, with TRAINER_SLOW_TESTS=1, the snippet as printed takes the
official `openai` client through call, tool result and answer against a real server whose model was trained, as
the demo's tool SFT stage trains, on a conversation that offers both tools (~20 s of CPU).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, child_env, free_port, run_args, train, wait_for_server
from dataset.tools import DEMO_TOOLS, run_tool

READMES = ("README.md", "README_zh.md")
SERVED_AT = "http://127.0.0.1:8998"  # where the snippet's client looks: the README's server line
QUESTION = "What is the temperature in Lima?"


def tool_snippet(readme: str) -> str:
    """The README's one ```python block that sends `tools`."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / readme).read_text(encoding="utf-8"), re.S)
    found = [block for block in blocks if "tools=" in block]
    assert len(found) == 1, f"{readme}: {len(found)} python blocks send tools, expected one"
    return found[0]


def definitions(snippet: str) -> dict:
    """The names the snippet defines before its first request: its functions and `tools` (the client not made)."""
    tree = ast.parse(snippet)
    kept = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef))
            or isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["tools"]]
    namespace: dict = {}
    exec(compile(ast.Module(body=kept, type_ignores=[]), "<README snippet>", "exec"), namespace)  # our own text
    return namespace


@pytest.mark.parametrize("readme", READMES)
def test_the_snippet_offers_the_demos_two_tools_and_returns_their_result_shape(readme):
    snippet = tool_snippet(readme)
    # the two READMEs print the same code (their comments in their own language)
    assert ast.dump(ast.parse(snippet)) == ast.dump(ast.parse(tool_snippet("README.md")))
    defined = definitions(snippet)
    trained_offer = json.loads((REPO / "dataset" / "tool_sft_demo.jsonl").open(encoding="utf-8").readline())
    assert defined["tools"] == trained_offer["conversations"][0]["tools"]  # the specs and order tool SFT saw
    assert defined["tools"] == [DEMO_TOOLS["calculator"].spec, DEMO_TOOLS["get_weather"].spec]
    assert defined["get_weather"]("Lima") == json.loads(run_tool("get_weather", {"city": "Lima"}).text)
    assert f'"content": "{QUESTION}"' in snippet and SERVED_AT in snippet


# ---- the snippet as printed, against a server (slow) -------------------------------------------------------------

SLOW = pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                          reason="trains a model for ~30 s; set TRAINER_SLOW_TESTS=1 (.ci/run does)")


@pytest.fixture(scope="module")
def tool_model_server(tmp_path_factory):
    """The base URL of a server whose model, offered the demo's two tools as tool SFT offers them, calls
    get_weather for QUESTION and then answers from its result as the demo's data does ("24°C")."""
    root = tmp_path_factory.mktemp("readme_tools")
    result = run_tool("get_weather", {"city": "Lima"}).text
    conversation = [{"role": "system", "content": "", "tools": [DEMO_TOOLS[n].spec for n in ("calculator", "get_weather")]},
                    {"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather",
                                                                          "arguments": {"city": "Lima"}}]},
                    {"role": "tool", "content": result},
                    {"role": "assistant", "content": f"{json.loads(result)['temperature_c']}°C"}]
    data = root / "tools.jsonl"
    data.write_text(json.dumps({"conversations": conversation}, ensure_ascii=False) + "\n", encoding="utf-8")
    # 100 steps on the one conversation; 64 wide, as 32 did not learn the call behind the two specs' 535 tokens.
    train("train_full_sft.py", None, run_args(root, data, "--hidden_size", "64", "--from_weight", "none",
                                              "--batch_size", "1", "--epochs", "100", "--learning_rate", "1e-2",
                                              "--warmup_ratio", "0", "--log_interval", "50",
                                              "--max_seq_len", "704"), root)  # the answer's prompt: 642 tokens
    port = free_port()
    log_path = root / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve_openai_api.py"), "--weight",
                                   "full_sft", "--save_dir", str(root / "out"), "--device", "cpu", "--port", str(port)],
                                  cwd=root, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_server(server, f"http://127.0.0.1:{port}", log_path)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.terminate()
            server.wait(timeout=15)


@SLOW
def test_the_readmes_round_trip_as_printed_ends_in_the_answer_from_the_tools_result(tool_model_server, tmp_path):
    # The snippet, its address moved to this server's port, run as a user runs it: a file of its own.
    script = tmp_path / "round_trip.py"
    script.write_text(tool_snippet("README.md").replace(SERVED_AT, tool_model_server), encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "24°C\n"  # the printed comment's answer, read from the tool's result
    assert "print(reply.choices[0].message.content)  # 24°C" in tool_snippet("README.md")

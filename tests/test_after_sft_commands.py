"""The README's "After SFT" commands, as printed, after the demo: they take the demo's SFT model with only
--hidden_size typed (the other sizes read from the file), write under names of their own, and the commands after
each read those names; the demo's files stay byte for byte as they were.

The demo's files are made at the demo's exact sizes, read from scripts/run_demo.sh itself (the demo run with a
`python` that only writes its arguments down), so the test cannot drift from the demo. Everything runs in a copy
of the repository under tmp_path: the scripts write to their own out/ and checkpoints/, as after a clone.
The fast case trains each stage once from a written SFT file; the slow one (TRAINER_SLOW_TESTS=1) makes the
demo's files with the demo's own stage commands, for --quick and the full demo, then runs every command.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, child_env, free_port
from lora_files import write_adapter, write_base
from model.model import LMConfig
from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from test_readme_commands import bash_lines

SLOW = pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                          reason="about a minute each on two CPU cores; set TRAINER_SLOW_TESTS=1 (.ci/run does)")
STEP = ["--max_steps", "1"]  # each training command trains one step: what is tested is that it runs, and where


def after_sft_commands() -> list[list[str]]:
    """The commands of README.md's "After SFT" block, split as a shell splits them."""
    return [shlex.split(line) for line in bash_lines("README.md", "## After SFT: LoRA, DPO, GRPO, distillation, tool use")]


def demo_stages(tmp_path: Path, *demo_args: str) -> dict[str, list[str]]:
    """{script: flags} of each training stage `bash scripts/run_demo.sh DEMO_ARGS` runs, in its order: the demo
    run in an empty folder with a `python` on PATH that writes its arguments down and does nothing else."""
    folder, record = tmp_path / "demo_calls", tmp_path / "demo_calls" / "calls"
    (folder / "scripts").mkdir(parents=True)
    (folder / "bin").mkdir()
    shutil.copy(REPO / "scripts" / "run_demo.sh", folder / "scripts" / "run_demo.sh")
    (folder / "bin" / "python").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\037" "$a"; done >> "$RECORD"\n'
                                           'echo >> "$RECORD"\n')
    (folder / "bin" / "python").chmod(0o755)
    env = child_env(RECORD=record, PATH=f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}", DEMO_CORES=2,
                    DEMO_LOADAVG=0)
    result = subprocess.run(["bash", "scripts/run_demo.sh", *demo_args], cwd=folder, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = [line.split("\037")[:-1] for line in record.read_text().splitlines()]
    stages = {}
    for call in calls:  # the first run of each script (SFT's second, a student's, trains the distillation stage's twin)
        if call[0].startswith("trainer/train_"):
            stages.setdefault(call[0], call[1:])
    assert list(stages) == [f"trainer/train_{s}.py" for s in ("pretrain", "full_sft", "lora", "dpo", "grpo",
                                                               "distillation")], calls
    return stages


def size_of(flags: list[str]) -> dict[str, int]:
    """The size flags among `flags`, as LMConfig's fields."""
    names = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    return {name: int(flags[flags.index(f"--{name}") + 1]) for name in names}


def clone(tmp_path: Path) -> Path:
    """The repository's code and data under tmp_path/clone, with empty out/ and checkpoints/."""
    root = tmp_path / "clone"
    for folder in ("trainer", "model", "dataset", "scripts"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for script in REPO.glob("*.py"):
        shutil.copy(script, root / script.name)
    (root / "out").mkdir()
    (root / "checkpoints").mkdir()
    return root


def run(root: Path, argv: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """`argv` (`python SCRIPT ...`) run in `root`, as a user at the root of the clone runs it; it must succeed."""
    assert argv[0] == "python", argv
    result = subprocess.run([sys.executable, *argv[1:]], cwd=root, env=child_env(), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{' '.join(argv)}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
    return result


def hashes(root: Path) -> dict[str, str]:
    """SHA-256 of every file under out/ and checkpoints/."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in ("out", "checkpoints") for p in sorted((root / folder).rglob("*")) if p.is_file()}


def assert_demo_files_untouched(before: dict[str, str], root: Path) -> None:
    after = hashes(root)
    changed = sorted(name for name, digest in before.items() if after.get(name) != digest)
    assert not changed, f"the README's commands replaced or removed the demo's files: {changed}"


def test_the_training_commands_as_printed_take_the_demos_sft_model_and_leave_the_demos_files(tmp_path):
    """Before: `train_lora.py --hidden_size 128` refused the demo's out/full_sft_128.pth, checking the 8 layers,
    8 heads and 4 key/value heads it defaults to, never typed, against the file's 4, 4 and 2; and with the
    demo's names the commands replaced the demo's adapter and its DPO and GRPO models. Distillation's student
    starts from random weights at the sizes typed, its teacher the demo's SFT model. (Agentic GRPO, from the tool SFT
    command's model, runs its tools in the rollouts of a step: the slow case runs it, with the rest, as printed.)"""
    stages = demo_stages(tmp_path)
    root = clone(tmp_path)
    config = LMConfig(vocab_size=load_tokenizer(DEFAULT_TOKENIZER).get_vocab_size(),
                      **size_of(stages["trainer/train_full_sft.py"]))
    assert config.num_hidden_layers != LMConfig.num_hidden_layers  # else the sizes not typed would fit by chance
    base = write_base(root / "out", config)
    for name in ("dpo", "grpo", "student_distill", "tool_sft", "tool_grpo"):  # the demo's later stages' files
        write_base(root / "out", config, seed=1, name=name)
    write_adapter(root / "out", config, base=base)
    before = hashes(root)
    trained = [argv for argv in after_sft_commands() if argv[1].startswith("trainer/train_")]
    assert [argv[1] for argv in trained] == [f"trainer/train_{s}.py" for s in ("lora", "dpo", "grpo", "distillation",
                                                                              "full_sft", "grpo")]
    from_files = [argv for argv in trained if argv[1] != "trainer/train_distillation.py"]
    assert all("--num_hidden_layers" not in argv for argv in from_files)  # the sizes come from the file
    assert trained[-1][trained[-1].index("--from_weight") + 1] == "my_tool_sft"  # agentic GRPO: from tool SFT's
    for argv in trained[:-1]:
        # Distillation and tool SFT on 2 conversations a step (their 32 of 192 tokens and 8 of 960, each with a
        # second model's forward or long sequences, add seconds): what is tested is which files they read and write.
        later = argv[1] == "trainer/train_distillation.py" or "my_tool_sft" in argv
        result = run(root, argv + STEP + (["--batch_size", "2"] if later else []))
        starts_from = "teacher" if argv[1] == "trainer/train_distillation.py" else "initial weights"
        assert f"{starts_from}: {base} (128x{config.num_hidden_layers}" in result.stderr + result.stdout
    assert_demo_files_untouched(before, root)


def served_models(root: Path, argv: list[str]) -> list[str]:
    """The models the README's server command serves: started on a free port, asked GET /v1/models, stopped."""
    port = free_port()
    server = subprocess.Popen([sys.executable, *argv[1:], "--port", str(port)], cwd=root, env=child_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
                    return [model["id"] for model in json.load(response)["data"]]
            except OSError:
                time.sleep(0.5)
        raise AssertionError("the server did not answer within 120 s")
    finally:
        server.terminate()
        server.wait(timeout=30)


@SLOW
@pytest.mark.parametrize("demo_args", [("--quick",), ()], ids=["quick", "full"])
def test_every_after_sft_command_runs_as_printed_after_the_demo_and_the_demos_files_stay(tmp_path, demo_args):
    root = clone(tmp_path)
    for script, flags in demo_stages(tmp_path, *demo_args).items():  # the demo's own stages, one step each
        run(root, ["python", script, *flags, *STEP])
    before = hashes(root)
    assert {"out/full_sft_128.pth", "out/lora_demo_128.pth", "out/dpo_128.pth", "out/grpo_128.pth"} <= set(before)
    for argv in after_sft_commands():
        if argv[1] == "scripts/serve_openai_api.py":
            assert served_models(root, argv) == ["full_sft_128+lora_my"]
            continue
        # An eval or export of a name no command above wrote fails: the demo's files stay as they were (below)
        run(root, argv + STEP if argv[1].startswith("trainer/train_") else argv)
    assert_demo_files_untouched(before, root)
    assert {f"out/{name}_128.pth" for name in ("lora_my", "my_dpo", "my_grpo", "my_student", "my_tool_sft",
                                                "my_tool_grpo")} <= set(hashes(root))

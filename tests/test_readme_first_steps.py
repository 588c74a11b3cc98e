"""What a new user meets first in the READMEs holds on a fresh clone: the short path names the demo's machine check
and, beside it, the very line that check advises; a command that keeps the terminal (a server, an interactive chat,
a live watcher) ends its block, so a pasted block never stops half-way; the resume block trains the demo's model in
directories of its own; the "After SFT" block has a command for every stage the demo trains after SFT; what the text
says of GRPO's logged reward and of the LoRA command's size is what the scripts' defaults make; and the packages the
README names for the chat page's browser are the ones .ci/run installs, with a font for its Chinese.

(The commands' flags pass their scripts' checks: tests/test_readme_commands.py; the tool-call snippet:
tests/test_readme_tool_call.py; torchrun's Ctrl-C: tests/test_readme_torchrun_stop.py.)
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, child_env
from dataset.rewards import reward_functions, score
from test_readme_commands import bash_lines

READMES = ("README.md", "README_zh.md")
START = {"README.md": "## Start here", "README_zh.md": "## 从这里开始"}
AFTER_SFT = {"README.md": "## After SFT: LoRA, DPO, GRPO, distillation, tool use",
             "README_zh.md": "## SFT 之后：LoRA、DPO、GRPO、蒸馏、工具调用"}
RESUME = "## Resume, and more GPUs"


def section(readme: str, heading: str) -> str:
    text = (REPO / readme).read_text(encoding="utf-8")
    assert f"\n{heading}\n" in text, f"{readme} has no section {heading!r}"
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def check_machine(tmp_path, **machine) -> str:
    """What `bash scripts/run_demo.sh --check_machine` prints with DEMO_LOADAVG / DEMO_CORES standing in for the
    machine's numbers (OMP_NUM_THREADS unset, as in a new user's shell); the script copied alone into tmp_path."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(REPO / "scripts" / "run_demo.sh", tmp_path / "scripts" / "run_demo.sh")
    env = child_env(**machine)
    del env["OMP_NUM_THREADS"]
    done = subprocess.run(["bash", "scripts/run_demo.sh", "--check_machine"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return done.stdout


@pytest.mark.parametrize("readme", READMES)
def test_the_short_path_names_the_machine_check_and_the_run_it_advises(tmp_path, readme):
    shown = bash_lines(readme, START[readme])
    assert shown[:2] == ["python -m venv .venv && . .venv/bin/activate",
                         "pip install torch==2.13.0 -r requirements.txt"]  # install first
    assert "bash scripts/run_demo.sh --check_machine" in shown
    # A busy 2-core machine: the one line names a command; the short path shows that very command.
    busy = check_machine(tmp_path, DEMO_LOADAVG="3.00", DEMO_CORES=2)
    advised = re.fullmatch(r"== busy or small machine .*; faster: (.+?) \(.*\)\n", busy)
    assert advised and advised.group(1) in shown, (busy, shown)
    # A quiet one: nothing printed, and the short path's other run is the full demo.
    assert check_machine(tmp_path, DEMO_LOADAVG="0.10", DEMO_CORES=2) == ""
    assert "bash scripts/run_demo.sh" in shown
    # then the model: asked, served
    assert any(line.startswith("python eval_model.py --weight full_sft") for line in shown)
    assert shown[-1].startswith("python scripts/serve_openai_api.py --weight full_sft")


def keeps_the_terminal(command: str) -> bool:
    """A command that runs until its user stops it: a server, an interactive chat, a live watcher."""
    words = shlex.split(command)
    if not words:
        return False
    if words[0] in ("llama-server", "llama-cli", "ollama"):
        return True
    script = words[1] if words[0] == "python" and len(words) > 1 else ""
    one_shot = {"--prompt", "--eval", "--mc_data", "--pairs_data", "--bpb_data", "--help"}
    return (script == "scripts/serve_openai_api.py"
            or script == "scripts/watch_run.py" and "--once" not in words
            or script == "eval_model.py" and not one_shot & set(words))


def bash_blocks(readme: str) -> list[list[str]]:
    """Each ```bash block of the README as its commands (continuations joined, comments left out)."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / readme).read_text(encoding="utf-8"), re.S)
    return [[re.sub(r"\s+", " ", re.sub(r"\s+#.*$", "", line)).strip()
             for line in block.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]
            for block in blocks]


@pytest.mark.parametrize("readme", READMES)
def test_a_command_that_keeps_the_terminal_ends_its_block(readme):
    """Before: the "After SFT" block had its server in the middle, the chat block a curl after its server and the
    interactive chat first: a block pasted whole stopped at that line, or fed the next lines to the chat."""
    blocks = bash_blocks(readme)
    assert sum(keeps_the_terminal(c) for block in blocks for c in block) >= 3  # the servers and the chat are found
    stuck = [(block, command) for block in blocks for command in block[:-1] if keeps_the_terminal(command)]
    assert not stuck, stuck


# Each command's parsed flags, through its script's own parse_args, as JSON (one interpreter for all).
PARSED = """
import json, runpy, sys
for script, *flags in json.loads(sys.argv[1]):
    sys.argv = [script, *flags]
    args = runpy.run_path(script, run_name="flags_only")["parse_args"]()
    print(json.dumps({k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))}))
"""


def parsed(commands: list[list[str]]) -> list[dict]:
    """The namespaces the scripts' parse_args make of `commands` ([script, flags...]), run from the clone's root."""
    done = subprocess.run([sys.executable, "-c", PARSED, json.dumps(commands)], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def training_commands(lines: list[str], script: str) -> list[list[str]]:
    """[script, flags...] of each `python SCRIPT` or `torchrun ... SCRIPT` line among `lines`."""
    found = []
    for line in lines:
        words = shlex.split(line)
        if script in words:
            found.append(words[words.index(script):])
    return found


def demo_calls(tmp_path, *demo_args: str) -> list[list[str]]:
    """Every `python ...` scripts/run_demo.sh runs, as argv lists: the demo run in an empty folder with a `python`
    on PATH that only writes its arguments down."""
    folder, record = tmp_path / "demo_calls", tmp_path / "demo_calls" / "calls"
    (folder / "scripts").mkdir(parents=True)
    (folder / "bin").mkdir()
    shutil.copy(REPO / "scripts" / "run_demo.sh", folder / "scripts" / "run_demo.sh")
    (folder / "bin" / "python").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\037" "$a"; done >> "$RECORD"\n'
                                           'echo >> "$RECORD"\n')
    (folder / "bin" / "python").chmod(0o755)
    env = child_env(RECORD=record, PATH=f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}", DEMO_CORES=2,
                    DEMO_LOADAVG=0)
    done = subprocess.run(["bash", "scripts/run_demo.sh", *demo_args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [line.split("\037")[:-1] for line in record.read_text().splitlines()]


SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def test_the_resume_block_trains_the_demos_model_in_directories_of_its_own(tmp_path):
    """Before: "the demo's width" built the default 8-layer model (1.76M parameters, not the demo's 0.97M), and in
    the demo's out/ and checkpoints/, whose lock refuses it while the demo runs."""
    [demo_pretrain] = [call for call in demo_calls(tmp_path) if call[0] == "trainer/train_pretrain.py"]
    lines = bash_lines("README.md", RESUME)
    commands = [c for c in training_commands(lines, "trainer/train_pretrain.py") if "--hidden_size" in c]
    assert len(commands) == 3, commands  # start, resume, resume on 2 GPUs
    demo, *shown = parsed([demo_pretrain, *commands])
    defaults = parsed([["trainer/train_pretrain.py"]])[0]
    for args in shown:
        assert {k: args[k] for k in SIZES} == {k: demo[k] for k in SIZES}
        assert args["save_dir"] != defaults["save_dir"] and args["checkpoint_dir"] != defaults["checkpoint_dir"]
        assert (args["save_dir"], args["checkpoint_dir"]) == (shown[0]["save_dir"], shown[0]["checkpoint_dir"])
    assert [args["from_resume"] for args in shown] == [0, 1, 1]


def stage_of(command: list[str], defaults: dict[str, dict]) -> tuple[str, str]:
    """(script, the data it trains on) of a training command."""
    script = command[0]
    data = command[command.index("--data_path") + 1] if "--data_path" in command else defaults[script]["data_path"]
    return script, os.path.relpath(os.path.join(REPO, data), REPO)


@pytest.mark.parametrize("readme", READMES)
def test_after_sft_has_a_command_for_every_stage_the_demo_trains_after_sft(tmp_path, readme):
    """Before: LoRA, DPO and GRPO only; distillation, tool SFT and agentic GRPO had no command."""
    calls = [c for c in demo_calls(tmp_path) if c[0].startswith("trainer/train_")]
    # After pretraining and SFT; the student trained by SFT alone is the distilled one's baseline, not a stage.
    later = [c for c in calls[2:] if not (c[0] == "trainer/train_full_sft.py" and "none" in c)]
    shown = [words[i:] for words in map(shlex.split, bash_lines(readme, AFTER_SFT[readme]))
             for i, word in enumerate(words) if word.startswith("trainer/train_")]
    scripts = sorted({c[0] for c in later + shown})
    defaults = dict(zip(scripts, parsed([[s] for s in scripts])))
    demo_stages = [stage_of(c, defaults) for c in later]
    assert len(demo_stages) == 6, demo_stages
    assert set(demo_stages) <= {stage_of(c, defaults) for c in shown}


def bullet(readme: str, heading: str, starts: str) -> str:
    """The README's bullet that begins with `starts` in the section under `heading`, its lines joined."""
    text = section(readme, heading)
    found = re.search(rf"^- {re.escape(starts)}.*?(?=^- |\Z)", text, re.S | re.M)
    assert found, f"{readme}: no bullet starting {starts!r} under {heading}"
    return " ".join(found.group(0).split())


@pytest.mark.parametrize("readme, grpo, lora", [("README.md", "**GRPO**", "**LoRA**"),
                                                 ("README_zh.md", "**GRPO**", "**LoRA**")])
def test_what_the_readme_says_of_grpos_reward_and_loras_size_is_what_the_defaults_make(readme, grpo, lora):
    """Before: GRPO's logged reward was "the share of sampled answers that are right", and a user of the README's
    command (the default --rewards answer,format) saw 1.05."""
    lines = bash_lines(readme, AFTER_SFT[readme])
    [grpo_command] = [c for c in training_commands(lines, "trainer/train_grpo.py") if "--max_turns" not in c]
    [lora_command] = training_commands(lines, "trainer/train_lora.py")
    grpo_args, lora_args = parsed([grpo_command, lora_command])
    # The best a completion can get: the right answer in the chat template's think/answer layout.
    best = score(reward_functions(grpo_args["rewards"]), ["<think>\n\n</think>\n\nLima"], ["Lima"])[0]
    assert best > 1 and grpo_args["rewards"] == "answer,format"
    said = bullet(readme, AFTER_SFT[readme], grpo)
    assert f"`--rewards {grpo_args['rewards']}`" in said and (f"up to {best:g}" in said or f"最高 {best:g}" in said)
    said = bullet(readme, AFTER_SFT[readme], lora)
    assert f"rank {lora_args['lora_rank']}, {lora_args['epochs']} epochs" in said or \
        f"秩 {lora_args['lora_rank']}，{lora_args['epochs']} 个 epoch" in said, said


def apt_packages(text: str) -> set[str]:
    found = re.findall(r"apt-get install (?:-\S+ )*([a-z0-9 .+-]+)", text)
    assert found, "no apt-get install line"
    return {package for line in found for package in line.split() if not package.startswith("-")}


@pytest.mark.parametrize("readme", READMES)
def test_the_browser_packages_the_readme_names_are_those_ci_installs_with_a_font_for_chinese(readme):
    """Before: Debian's chromium and its driver alone, whose page showed its Chinese as empty boxes."""
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert apt_packages((REPO / readme).read_text(encoding="utf-8")) == apt_packages(ci)
    assert {"chromium", "chromium-driver", "fonts-noto-cjk"} <= apt_packages(ci)
    # CI installs them also where the browser is there and the font is not
    assert re.search(r"fc-list :lang=zh", ci), "CI does not check for a Chinese font before the browser tests"

"""The READMEs' commands run as written on a fresh clone: one style for running a script (`python scripts/X.py`,
never `python -m scripts.X`), every script a README runs answers `--help`, every training command shown passes its
script's flag checks, the two READMEs show the same commands, and the export commands, run as printed on small
weights under out/, write only under out/.

(tests/test_readme_points_at_the_code.py holds the paths and links; the demo itself: tests/test_run_demo.py.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, child_env
from lora_files import tiny_config, write_adapter, write_base

READMES = ("README.md", "README_zh.md")
PAGES = (*READMES, *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")))


def bash_lines(page: str, heading: str | None = None) -> list[str]:
    """The commands of the page's ```bash blocks (those of the section under `heading` when given), continuation
    lines joined, comments and prompts left out."""
    text = (REPO / page).read_text(encoding="utf-8")
    if heading is not None:
        text = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(re.sub(r"\s+", " ", line))
    return lines


def inline_commands(page: str) -> list[str]:
    """Commands written in the page's text as `python ...`."""
    text = (REPO / page).read_text(encoding="utf-8")
    return [re.sub(r"\s+", " ", c) for c in re.findall(r"`(python [^`]+)`", text)]


def test_scripts_run_in_one_style_as_files():
    mixed = {page: re.findall(r"python -m (?:scripts|trainer|benchmarks)\.\w+", (REPO / page).read_text(encoding="utf-8"))
             for page in PAGES}
    assert not any(mixed.values()), {page: found for page, found in mixed.items() if found}


def test_the_two_readmes_show_the_same_commands():
    english, chinese = bash_lines("README.md"), bash_lines("README_zh.md")
    assert len(english) >= 25 and english == chinese


def test_every_script_the_readmes_and_docs_run_answers_help():
    scripts = sorted({match for page in PAGES for line in bash_lines(page) + inline_commands(page)
                      for match in re.findall(r"(?:^|\s)python ((?:[\w-]+/)*[\w-]+\.py)\b", line)})
    assert len(scripts) >= 10 and all((REPO / s).is_file() for s in scripts), scripts
    # One interpreter for all of them (importing torch once): each runs as `python SCRIPT --help` would run it.
    program = ("import runpy, sys\n"
               "for script in sys.argv[1:]:\n"
               "    sys.argv = [script, '--help']\n"
               "    try:\n"
               "        runpy.run_path(script, run_name='__main__')\n"
               "    except SystemExit as stop:\n"
               "        assert stop.code in (0, None), (script, stop.code)\n"
               "    else:\n"
               "        raise AssertionError(f'{script} --help did not exit')\n"
               "    print('helped', script, file=sys.stderr)\n")
    result = subprocess.run([sys.executable, "-c", program, *scripts], cwd=REPO, env=child_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("helped ") == len(scripts)


# Each command's flags through its script's parse_args (the flag checks: ranges, combinations, paths), in one
# interpreter; prints "ok" or the one line the script would exit with.
CHECK_FLAGS = """
import json, runpy, sys
from trainer.hardening.resume_checks import ConfigError
for script, *flags in json.loads(sys.argv[1]):
    sys.argv = [script, *flags]
    try:
        runpy.run_path(script, run_name="flags_only")["parse_args"]()
        print("ok")
    except (ConfigError, SystemExit) as refused:
        print("refused:", refused)
"""
USER_FILES = ("--data_path", "--val_data", "--tokenizer_path")  # files a user brings (minimind's data, tokenizer)


def test_every_training_command_shown_passes_its_scripts_flag_checks(tmp_path):
    """A command shown with flags its script refuses (GRPO's --max_completion_len 64 left at its default beside
    --max_seq_len 64, say) fails for whoever copies it. The files a user brings, named by a path that is not in the
    clone (pretrain_hq.jsonl, minimind/model/tokenizer.json), are made empty under tmp_path in its place."""
    commands = {}
    for page in PAGES:
        for line in bash_lines(page) + inline_commands(page):
            for script, flags in re.findall(r"(?:python|torchrun(?: --\S+)*) (trainer/train_(?!tokenizer)\w+\.py)"
                                            r"((?: [^|;&`]*)?)", line):
                argv = flags.split()
                for i, flag in enumerate(argv[:-1]):
                    if flag in USER_FILES and not (REPO / argv[i + 1]).exists():
                        (tmp_path / argv[i + 1]).parent.mkdir(parents=True, exist_ok=True)
                        (tmp_path / argv[i + 1]).touch()
                        argv[i + 1] = str(tmp_path / argv[i + 1])
                commands.setdefault((script, *argv), page)
    assert {c[0] for c in commands} >= {f"trainer/train_{s}.py" for s in ("pretrain", "full_sft", "lora", "dpo", "grpo",
                                                                         "distillation")}
    result = subprocess.run([sys.executable, "-c", CHECK_FLAGS, json.dumps(list(commands))], cwd=REPO,
                            env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    verdicts = result.stdout.splitlines()
    refused = {f"{page}: {' '.join(command)}": verdict for (command, page), verdict in
               zip(commands.items(), verdicts) if verdict != "ok"}
    assert len(verdicts) == len(commands) and not refused, refused


def test_the_export_commands_as_printed_write_their_files_under_out(tmp_path):
    # A folder laid out as the clone after the demo and the README's LoRA command: the demo's weight names and the
    # README's adapter, lora_my (small weights), and the .json of the length training used beside the SFT model.
    config = tiny_config(hidden_size=128)
    base = write_base(tmp_path / "out", config)
    write_base(tmp_path / "out", config, name="pretrain")
    for name in ("demo", "my"):
        write_adapter(tmp_path / "out", config, base=base, name=name)
    (tmp_path / "out" / "full_sft_128.json").write_text('{"max_seq_len": 192}\n')
    before = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}

    commands = [c for page in ("README.md", "docs/elsewhere.md") for c in bash_lines(page) + inline_commands(page)
                if re.match(r"python scripts/export_(hf|gguf)\.py ", c)]
    commands = list(dict.fromkeys(commands))  # the same command on two pages runs once
    assert len(commands) >= 8, commands
    for command in sorted(commands, key=lambda c: "export_gguf" in c):  # the HF folders before the GGUFs made of them
        python, script, *args = command.split()
        result = subprocess.run([sys.executable, str(REPO / script), *args], cwd=tmp_path, env=child_env(),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{command}\n{result.stderr[-2000:]}"
    written = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")} - before
    assert written and all(p.parts[0] == "out" for p in written), sorted(map(str, written))
    assert (tmp_path / "out" / "full_sft_128.gguf").is_file() and (tmp_path / "out" / "hf_pretrain" / "config.json").is_file()


@pytest.mark.parametrize("readme", READMES)
def test_each_readme_is_at_most_300_lines(readme):
    lines = (REPO / readme).read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"{readme} has {len(lines)} lines; details belong in docs/"


def test_ci_installs_and_tests_with_the_readmes_own_lines_in_the_venv_it_makes_which_git_ignores():
    # .ci/run greps README.md for its venv, install and test lines: each pattern finds the line a user copies.
    patterns = re.findall(r"readme_line '([^']+)'", (REPO / ".ci" / "run").read_text(encoding="utf-8"))
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    found = [next((line for line in lines if re.search(pattern, line)), None) for pattern in patterns]
    assert found == [lines[lines.index("```bash", lines.index("## Start here")) + 1],
                     lines[lines.index("```bash", lines.index("## Start here")) + 2],
                     lines[lines.index("```bash", lines.index("## Run the tests")) + 1]], found
    venv = re.search(r"-m venv (\S+)", found[0]).group(1)
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{venv}/lib/site.py"], cwd=REPO)
    assert ignored.returncode == 0, f"git does not ignore the venv the README makes at {venv}"

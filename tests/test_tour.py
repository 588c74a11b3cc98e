"""The tour (docs/tour.md, docs/zh/tour.md) cannot drift from the code.

Each stop of "Read the code, then break it" (and its fast path) names a file, then what to look for in it, in the
file's order: every backticked fragment of code is in the last file named before it, verbatim, after the one
before it. Each exercise is one sentence of a fixed form,

    **Break it:** in `FILE`, replace `OLD` with `NEW`; then `python -m pytest -q ...` fails [with `MESSAGE`].
    **Break it:** in `FILE`, delete the line `OLD`; then `python -m pytest -q ...` fails [with `MESSAGE`].

(the Chinese tour: **弄坏它：** 在 `FILE` 中，把 `OLD` 换成 `NEW` / 删掉这一行 `OLD`；然后 `...` 失败[，输出 `MESSAGE`]),
and with TRAINER_SLOW_TESTS=1 each runs as printed in a scratch copy of the clone: it passes, then with the break
applied it fails (saying MESSAGE).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import REPO, project_python_files

TOURS = ("docs/tour.md", "docs/zh/tour.md")
SECTION = {"docs/tour.md": ("## Read the code", "**Exercises.**"), "docs/zh/tour.md": ("## 先读代码", "**练习。**")}
CODE = r"`([^`\n]+)`"  # one backticked fragment, on one line
EXERCISE = {
    "docs/tour.md": rf"\*\*Break it:\*\*\s+in\s+{CODE},\s+(?:replace\s+{CODE}\s+with\s+{CODE}|delete\s+the\s+line\s+"
                    rf"{CODE});\s+then\s+{CODE}\s+fails(?:\s+with\s+{CODE})?",
    "docs/zh/tour.md": rf"\*\*弄坏它：\*\*\s*在\s*{CODE}\s*中，\s*(?:把\s*{CODE}\s*换成\s*{CODE}|删掉这一行\s*{CODE})；"
                       rf"\s*然后\s*{CODE}\s*失败(?:，\s*输出\s*{CODE})?",
}


class Exercise(NamedTuple):
    file: str
    old: str
    new: str | None  # None: delete the line `old`
    command: str
    message: str | None  # what the failing run prints, if the tour says

    def broken(self, text: str) -> str:
        """`text` (the file) with the break applied; `old` must occur exactly once."""
        count = text.count(self.old)
        assert count == 1, f"`{self.old}` occurs {count} times in {self.file}, not once: the tour must quote more"
        if self.new is not None:
            return text.replace(self.old, self.new)
        lines = text.splitlines(keepends=True)
        [at] = [i for i, line in enumerate(lines) if self.old in line]
        assert lines[at].strip() == self.old, f"`{self.old}` is not a whole line of {self.file}: {lines[at]!r}"
        return "".join(lines[:at] + lines[at + 1:])


def tour_text(tour: str) -> str:
    text = (REPO / tour).read_text(encoding="utf-8")
    return text[text.index(SECTION[tour][0]):]


def exercises(tour: str) -> list[Exercise]:
    found = []
    for m in re.finditer(EXERCISE[tour], tour_text(tour)):
        file, old, new, deleted, command, message = m.groups()
        found.append(Exercise(file, old if deleted is None else deleted, new, command, message))
    return found


def stops(tour: str) -> list[str]:
    """The fast path and each numbered stop: the blocks before the exercises, each starting with a bold title."""
    text = tour_text(tour)
    text = text[:text.index(SECTION[tour][1])]
    blocks = re.split(r"\n(?=\d+\. \*\*|\*\*)", text)
    return [block for block in blocks if block.lstrip("0123456789. ").startswith("**")]


def resolve(name: str, folder: Path) -> Path:
    """A file a stop names: a path from the root, or a bare name in the folder named last, or the one file so named."""
    if "/" in name:
        assert (REPO / name).is_file(), f"the tour names {name}, which does not exist"
        return REPO / name
    if (folder / name).is_file():
        return folder / name
    same = [path for path in project_python_files() if path.name == name]
    assert len(same) == 1, f"the tour names {name}: {len(same)} files have that name, name one by its path"
    return same[0]


def quoted_code(block: str) -> list[tuple[str, str]]:
    """(file, fragment) for each fragment of code the block quotes, attributed to the last file named before it.
    Not code: a path or test id (the tour's other test checks they exist), a formula (written with · − α ρ π ...)."""
    quoted, file, folder = [], None, REPO
    for token in re.findall(CODE, block):
        if re.fullmatch(r"[\w/.-]+\.py", token):
            file = resolve(token, folder)
            folder = file.parent
        elif re.fullmatch(r"[\w/.-]+/", token) and (REPO / token).is_dir():
            folder = REPO / token
        elif "::" in token or not token.isascii() or re.fullmatch(r"[\w/.*{}-]+\.(pth|png|json|jsonl|md)|\S*/\S*",
                                                                    token):
            continue
        else:
            assert file is not None, f"`{token}` is quoted before the block names its file:\n{block}"
            quoted.append((file.relative_to(REPO).as_posix(), token))
    return quoted


def as_pattern(fragment: str) -> str:
    """`fragment` verbatim; a name is matched whole (`step` is not found inside `optimizer_step`)."""
    return (r"(?<!\w)" if fragment[0].isalnum() or fragment[0] == "_" else "") + re.escape(fragment) + (
        r"(?!\w)" if fragment[-1].isalnum() or fragment[-1] == "_" else "")


@pytest.mark.parametrize("tour", TOURS)
def test_every_fragment_a_stop_quotes_is_in_its_file_in_the_tours_order(tour):
    blocks = stops(tour)
    assert len(blocks) == 10, f"{tour}: the fast path and 9 stops, found {len(blocks)} blocks"
    problems = []
    for block in blocks:
        cursor = {}  # per file: where the previous fragment quoted from it ends
        for file, fragment in quoted_code(block):
            text = (REPO / file).read_text(encoding="utf-8")
            found = re.compile(as_pattern(fragment)).search(text, cursor.get(file, 0))
            if found:
                cursor[file] = found.end()
                continue
            anywhere = re.search(as_pattern(fragment), text)
            where = (f"only earlier, line {text.count(chr(10), 0, anywhere.start()) + 1}: list the names in the "
                     f"file's order" if anywhere else "nowhere in it")
            problems.append(f"{block.split('**')[1]}: `{fragment}` is {where} ({file})")
    assert not problems, f"{tour} quotes what its files do not hold where it says:\n" + "\n".join(problems)


def test_both_tours_quote_the_same_code_and_print_the_same_exercises():
    english, chinese = (exercises(tour) for tour in TOURS)
    assert len(english) == 9 and english == chinese, (english, chinese)
    assert len(re.findall(r"\*\*Break it:\*\*", tour_text(TOURS[0]))) == 9  # no sentence the form above misses
    assert len(re.findall(r"\*\*弄坏它：\*\*", tour_text(TOURS[1]))) == 9
    assert [quoted_code(block) for block in stops(TOURS[0])] == [quoted_code(block) for block in stops(TOURS[1])]


@pytest.mark.parametrize("number", range(1, 10))
def test_each_exercise_breaks_its_file_in_one_place_and_runs_a_test_a_default_run_runs(number):
    exercise = exercises(TOURS[0])[number - 1]
    exercise.broken((REPO / exercise.file).read_text(encoding="utf-8"))  # `old` once (a whole line, to delete)
    words = shlex.split(exercise.command)
    assert words[:4] == ["python", "-m", "pytest", "-q"], exercise.command
    for test_id in (word for word in words[4:] if "::" in word):
        path, _, name = test_id.partition("::")
        source = (REPO / path).read_text(encoding="utf-8")
        definition = re.search(rf"^def {re.escape(name.split('[')[0])}\(", source, re.M)
        assert definition, f"exercise {number} runs {test_id}, which does not exist"
        decorators = source[source.rfind("\n\n", 0, definition.start()):definition.start()]
        assert "TRAINER_SLOW_TESTS" not in decorators, f"exercise {number}: a default run skips {test_id}"


# ---- the slow part: each exercise as printed, in scratch copies of the clone --------------------------------

def scratch_copy(to: Path) -> Path:
    """The clone's tracked files as they are in the working tree (no venv, no run's outputs)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in (name for name in listed.split("\0") if name and (REPO / name).is_file()):
        (to / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, to / name)
    return to


def start(exercise: Exercise, clone: Path) -> subprocess.Popen:
    """The exercise's command as a learner types it in `clone`, its output in `clone`/../NAME.out: a default run
    (no TRAINER_SLOW_TESTS), with no variable of the pytest running this test."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTEST_") and k not in ("TRAINER_SLOW_TESTS", "TRAINER_SLOW_ONLY")}
    env.update(WANDB_MODE="offline", SWANLAB_MODE="offline", HF_HUB_OFFLINE="1")
    with open(clone.with_suffix(".out"), "w") as output:
        return subprocess.Popen([sys.executable, *shlex.split(exercise.command)[1:]], cwd=clone, env=env,
                                stdout=output, stderr=subprocess.STDOUT)


def finish(job: subprocess.Popen, clone: Path) -> tuple[int, str, str]:
    """(exit code, output, its last line: pytest's summary)."""
    code = job.wait(timeout=300)
    output = clone.with_suffix(".out").read_text()
    return code, output, (output.strip().splitlines() or [""])[-1]


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="each exercise's test twice, side by side: about 3 minutes for the nine with -n 2; "
                           "set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")
@pytest.mark.parametrize("number", range(1, 10))
def test_each_exercise_passes_as_printed_and_fails_once_broken(number, tmp_path):
    exercise = exercises(TOURS[0])[number - 1]
    intact, broken = scratch_copy(tmp_path / "intact"), scratch_copy(tmp_path / "broken")
    target = broken / exercise.file
    target.write_text(exercise.broken(target.read_text(encoding="utf-8")), encoding="utf-8")
    jobs = [start(exercise, intact), start(exercise, broken)]  # side by side
    try:
        code, output, summary = finish(jobs[0], intact)
        assert code == 0 and " passed" in summary and "skipped" not in summary, output[-3000:]
        # Exit 1: tests ran and failed (not 2, 4 or 5: an error, a usage error, nothing collected).
        code, output, summary = finish(jobs[1], broken)
        assert code == 1 and " failed" in summary, output[-3000:]
        assert exercise.message is None or exercise.message in output, output[-3000:]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()

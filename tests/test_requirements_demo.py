"""requirements-demo.txt holds what scripts/run_demo.sh needs: every stage the demo runs imports with only those
packages and what they require installed (the rest of this environment hidden, as a venv of them would be),
and each is in requirements.txt too, with the same pin."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO, child_env

# Run in a fresh interpreter: a finder first on sys.meta_path refuses every module whose distribution the
# lighter install would not have; then each script the demo runs is executed as a module (its imports, not main).
HIDE_AND_IMPORT = r"""
import importlib.abc, importlib.metadata as md, re, runpy, sys
from packaging.markers import default_environment
from packaging.requirements import Requirement

def name(text):
    return re.sub(r"[-_.]+", "-", text).lower()

# Each line stripped: packaging 26 refuses a requirement with its newline (older releases ignored it).
wanted = [Requirement(line.split("#")[0].strip()) for line in open("requirements-demo.txt") if line.split("#")[0].strip()]
allowed, todo = set(), [r.name for r in wanted]
while todo:  # the requirements and, recursively, what they require (not their extras)
    dist = name(todo.pop())
    if dist in allowed:
        continue
    allowed.add(dist)
    for spec in md.requires(dist) or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({**default_environment(), "extra": ""}):
            todo.append(req.name)
owners = {top: {name(d) for d in dists} for top, dists in md.packages_distributions().items()}

class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        dists = owners.get(fullname.split(".")[0], set())
        if dists and not dists & allowed:
            raise ModuleNotFoundError(f"No module named {fullname!r} (not in requirements-demo.txt)")
        return None

sys.meta_path.insert(0, Hidden())
for script in sys.argv[1:]:
    runpy.run_path(script, run_name="imported")
print("imported", len(sys.argv) - 1)
"""


def demo_scripts() -> list[str]:
    """The Python files scripts/run_demo.sh runs, in its order."""
    text = (REPO / "scripts" / "run_demo.sh").read_text(encoding="utf-8")
    return list(dict.fromkeys(re.findall(r"^\s*python ([\w/]+\.py)", text, re.M)))


def pins(path: str) -> dict[str, str]:
    lines = (REPO / path).read_text(encoding="utf-8").splitlines()
    found = [re.match(r"([A-Za-z0-9_.-]+)(\[[\w,]+\])?(\S*)", line.split("#")[0].strip()) for line in lines]
    return {m.group(1).lower(): m.group(3) for m in found if m}


def test_every_stage_of_the_demo_imports_with_only_the_demo_requirements():
    scripts = demo_scripts()
    assert len(scripts) == 12, scripts  # data (2), six training stages, the tool-use score, the table, chat, curves
    result = subprocess.run([sys.executable, "-c", HIDE_AND_IMPORT, *scripts], cwd=REPO, env=child_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith(f"imported {len(scripts)}")


def test_the_hiding_finder_does_hide_what_the_demo_does_not_need():
    # scripts/export_gguf.py needs gguf, which requirements-demo.txt leaves out: it must fail to import here.
    result = subprocess.run([sys.executable, "-c", HIDE_AND_IMPORT, "scripts/export_gguf.py"], cwd=REPO,
                            env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "No module named 'gguf' (not in requirements-demo.txt)" in result.stderr


def test_the_demo_requirements_are_in_requirements_txt_with_the_same_pins():
    demo, full = pins("requirements-demo.txt"), pins("requirements.txt")
    assert demo and {package: full.get(package) for package in demo} == demo

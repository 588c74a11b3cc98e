"""The READMEs and the design pages under docs/ point at files, tests, functions and sections that exist
where they say, and every link leads somewhere: a renamed function or a moved file fails here, not in a
learner's evening."""

from __future__ import annotations

import ast
import re

import pytest
import torch

from conftest import REPO, project_python_files

READMES = ("README.md", "README_zh.md")
PAGES = (*READMES, *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")))
FOLDERS = ("model", "dataset", "trainer", "scripts", "benchmarks", "tests", "docs")


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


TOURS = {"README.md": "docs/tour.md", "README_zh.md": "docs/zh/tour.md"}  # each README points at its tour


def tour(readme: str) -> str:
    """The reading tour and the exercises: the section "Read the code, then break it" of the README's tour page."""
    assert f"]({TOURS[readme]})" in (REPO / readme).read_text(encoding="utf-8"), f"{readme} does not link its tour"
    text = (REPO / TOURS[readme]).read_text(encoding="utf-8")
    start = text.index("## Read the code" if readme == "README.md" else "## 先读代码")
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def defined_names() -> set[str]:
    names = set()
    for path in project_python_files():  # top-level modules too (output_paths.py); never a venv in the clone
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):  # `name = ...`, and each name of `a, b = ...`
                names.update(t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name))
    return names


@pytest.mark.parametrize("readme", PAGES)
def test_every_file_and_test_the_readme_names_exists(readme):
    text = (REPO / readme).read_text(encoding="utf-8")
    missing = []
    for token in backticked(text):
        for path in re.findall(rf"\b(?:{'|'.join(FOLDERS)})/[\w./-]*\w(?:::\w+)?", token):
            file, _, test = path.partition("::")
            if "*" in file or not re.search(r"\.(py|sh|png|jsonl|json|sbatch)$", file):
                continue
            if not (REPO / file).exists():
                missing.append(file)
            elif test and not re.search(rf"^def {test}\(", (REPO / file).read_text(encoding="utf-8"), re.M):
                missing.append(path)
    assert not missing, f"{readme} names what does not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("readme", READMES)
def test_every_function_the_tour_and_exercises_name_exists(readme):
    names = defined_names()
    named = set()
    for token in backticked(tour(readme)):
        for name in re.findall(r"(?:^|[\s.(])([A-Za-z_]\w*)(?=\(|$)", token):
            code_like = "_" in name.strip("_") or re.match(r"[A-Z][a-z]+[A-Z]", name)  # snake_ or CamelCase
            torch_own = any(hasattr(owner, name) for owner in (torch, torch.nn.utils, torch.optim.Optimizer))
            if code_like and not re.search(r"\d", name) and not torch_own:
                named.add(name)
    assert len(named) >= 20, named  # the tour names the code it walks through
    assert not named - names, f"{readme}'s tour names code that does not exist: {sorted(named - names)}"


def test_the_sections_the_readme_counts_are_the_scripts_sections():
    text = (REPO / "trainer" / "train_pretrain.py").read_text(encoding="utf-8")
    sections = re.findall(r"# ---- (\d+)\. ", text)
    assert "sections 1–9" in " ".join(tour("README.md").split()) and "第 1–9 节" in tour("README_zh.md")
    assert sections == [str(i) for i in range(1, 10)], sections


@pytest.mark.parametrize("page", PAGES)
def test_every_link_of_the_page_leads_to_a_file(page):
    text = (REPO / page).read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]
    broken = [t for t in targets if not ((REPO / page).parent / t.split("#")[0]).exists()]
    assert targets and not broken, f"{page} links to what does not exist: {broken}"


@pytest.mark.parametrize("readme, folder", [("README.md", "docs"), ("README_zh.md", "docs/zh")])
def test_every_design_page_is_linked_from_its_readme(readme, folder):
    text = (REPO / readme).read_text(encoding="utf-8")
    pages = sorted(p.relative_to(REPO).as_posix() for p in (REPO / folder).glob("*.md"))
    assert len(pages) >= 8 and all(f"]({page})" in text for page in pages), pages

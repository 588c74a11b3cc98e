"""The shape a learner relies on: each script carries its whole loop, and the two differ only where
pretraining and SFT differ (the lines marked `# stage`); LoRA's, DPO's, GRPO's and distillation's are SFT's with
the lines marked `# lora`, `# dpo`, `# grpo` and `# distill` changed; imports point one way."""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import pytest
from conftest import REPO

SCRIPTS = ("train_pretrain.py", "train_full_sft.py")
# each later stage's script is held to train_full_sft.py
ALL_SCRIPTS = (*SCRIPTS, "train_lora.py", "train_dpo.py", "train_grpo.py", "train_distillation.py")
# nanoGPT's train.py is about 340 lines; the anomaly policy lives in hardening/anomaly_policy.py. The later stages'
# docstrings list what they change from SFT's; GRPO's carries its three loss types and the mu updates of a step.
# Each also declares `Data` and `Between`, the bundles train_epoch takes (what a step draws its batches from; what
# it calls between steps), field by field, and builds autocast where the step uses it.
MAX_LINES = {"train_pretrain.py": 292, "train_full_sft.py": 292, "train_lora.py": 313, "train_dpo.py": 343,
             "train_grpo.py": 381, "train_distillation.py": 328}


def common_text(script: str) -> list[str]:
    """The script without its module docstring and without the lines marked `# stage`."""
    source = (REPO / "trainer" / script).read_text(encoding="utf-8")
    docstring_end = ast.parse(source).body[0].end_lineno
    body = source.splitlines()[docstring_end:]
    return [line for line in body if not re.search(r"# stage\b", line)]


def test_the_two_scripts_are_identical_apart_from_the_lines_marked_stage():
    pretrain, sft = (common_text(script) for script in SCRIPTS)
    assert pretrain == sft, "\n".join(f"{a!r} != {b!r}" for a, b in zip(pretrain, sft) if a != b)[:3000]


def test_lora_is_sft_apart_from_the_lines_marked_lora_and_the_sft_lines_its_docstring_lists():
    """difflib between the two scripts (docstrings left out): every line LoRA adds or changes is marked `# lora`,
    and every line of train_full_sft.py it drops or changes contains one of the `fragments` its docstring's
    "What changes from train_full_sft.py" block lists, each of which names a line that is gone."""
    sft, lora = (body(script) for script in ("train_full_sft.py", "train_lora.py"))
    docstring = ast.get_docstring(ast.parse((REPO / "trainer" / "train_lora.py").read_text(encoding="utf-8")))
    fragments = re.findall(r"`([^`]+)`", docstring[docstring.index("What changes from train_full_sft.py"):])
    fragments.remove("# lora")
    added, dropped = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, sft, lora, autojunk=False).get_opcodes():
        if tag != "equal":
            added += lora[j1:j2]
            dropped += sft[i1:i2]
    unmarked = [line for line in added if not re.search(r"# lora\b", line)]
    assert not unmarked, "lines of train_lora.py that differ from train_full_sft.py without `# lora`:\n" + \
        "\n".join(unmarked)
    unlisted = [line for line in dropped if not any(fragment in line for fragment in fragments)]
    assert not unlisted, "lines of train_full_sft.py gone from train_lora.py, not listed in its docstring:\n" + \
        "\n".join(unlisted)
    stale = [fragment for fragment in fragments if not any(fragment in line for line in dropped)]
    assert not stale, f"the docstring lists lines that are not gone: {stale}"
    # (4 of them SFT's optimizer flags, --optimizer, its weight decays and Muon's LR: LoRA trains with AdamW)
    assert len(dropped) <= 16, f"{len(dropped)} lines of train_full_sft.py changed: LoRA should be SFT, adapted"
    assert len(added) - len(dropped) <= 20, "LoRA adds few lines to SFT"


def body(script: str) -> list[str]:
    """The script's lines after its module docstring."""
    source = (REPO / "trainer" / script).read_text(encoding="utf-8")
    return source.splitlines()[ast.parse(source).body[0].end_lineno:]


# Iteration N of train_epoch, in the order it happens: step N is taken (its numbers kept on the device), the stop
# vote, then the host reads step N's numbers, and step N's log line, validation and save follow.
STEP_N_IN_ORDER = ("get_lr(", "no_sync(model", ".backward()", "scaler.unscale_(",
                   "clip_grad_norm_(", "optimizer_step(", "zero_grad(", "taken.append(", "stop.vote(",
                   "read_on_host(", "policy.judge(", "tracker.log(", "validation_loss(", "lm_checkpoint(")
# The anomaly policy is entered from the loop by these lines only (and, in main, by creating it and a rollback):
# before the first step (the LR scale and the windows a rollback left out) and where the host reads the steps.
POLICY_IN_THE_LOOP = ("policy.left_out)", "policy.lr_scale", "policy.left_out_of(epoch)", "policy.judge(step, numbers)",
                      "policy.state_dict()")


def marked_lines(script: str = "train_dpo.py", mark: str = "dpo") -> list[tuple[str, bool]]:
    """`script` without its module docstring and blank lines: (line, marked), marked where the line says
    `# {mark}` or belongs to a function (or its decorator) that train_full_sft.py lacks and whose `def` line says
    it."""
    source = (REPO / "trainer" / script).read_text(encoding="utf-8")
    tree = ast.parse(source)
    lines = source.splitlines()
    sft_functions = {node.name for node in ast.parse((REPO / "trainer" / "train_full_sft.py").read_text(
        encoding="utf-8")).body if isinstance(node, ast.FunctionDef)}
    in_marked_function = set()
    for node in tree.body:
        if (isinstance(node, ast.FunctionDef) and node.name not in sft_functions
                and re.search(rf"# {mark}\b", lines[node.lineno - 1])):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            in_marked_function.update(range(first, node.end_lineno + 1))
    return [(line, number in in_marked_function or re.search(rf"# {mark}\b", line) is not None)
            for number, line in enumerate(lines, start=1) if number > tree.body[0].end_lineno and line.strip()]


@pytest.mark.parametrize("script, mark", [("train_dpo.py", "dpo"), ("train_grpo.py", "grpo"),
                                          ("train_distillation.py", "distill")])
def test_a_later_stage_is_train_full_sft_apart_from_its_marked_lines(script, mark):
    sft_source = (REPO / "trainer" / "train_full_sft.py").read_text(encoding="utf-8")
    sft = [line for line in sft_source.splitlines()[ast.parse(sft_source).body[0].end_lineno:] if line.strip()]
    stage = marked_lines(script, mark)
    unmarked_added, dropped = [], []
    matcher = difflib.SequenceMatcher(None, sft, [line for line, _ in stage], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        unmarked_added += [line for line, marked in stage[j1:j2] if not marked and tag != "equal"]
        dropped += sft[i1:i2] if tag == "delete" else []  # (a "replace" is SFT's lines changed into marked ones)
    assert not unmarked_added, f"lines of {script} that differ from train_full_sft.py without `# {mark}`:\n" + \
        "\n".join(unmarked_added)
    docstring = ast.get_docstring(ast.parse((REPO / "trainer" / script).read_text(encoding="utf-8")))
    listed = re.findall(r"`([^`]+)`", docstring[docstring.index("What changes from train_full_sft.py"):])
    unlisted = [line for line in dropped if not any(name in line for name in listed)]
    # at most 5 lines, and SFT's 4 optimizer flag lines (--optimizer, the weight decays, Muon's LR): AdamW here
    assert not unlisted and len(dropped) <= 9, f"SFT lines {script} drops, not in its docstring: {unlisted}"


def test_train_epoch_takes_what_the_step_needs_and_one_bundle_for_the_rest():
    """A signature a learner reads at a glance, the same in every stage: the flags, the position, the model, its
    optimizer and scaler, the data (Data) and what is not the step's math (Between); DPO and GRPO add their frozen
    reference, distillation its teacher. Each bundle is a NamedTuple declared in the script, field by field."""
    frozen = {"train_dpo.py": ["ref_model"], "train_grpo.py": ["ref_model"], "train_distillation.py": ["teacher"]}
    for script in ALL_SCRIPTS:
        tree = ast.parse((REPO / "trainer" / script).read_text(encoding="utf-8"))
        functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        parameters = [a.arg for a in functions["train_epoch"].args.args]
        assert parameters == ["args", "at", "model", "optimizer", "scaler", "data", "between",
                              *frozen.get(script, [])], (script, parameters)
        bundles = {node.name for node in tree.body if isinstance(node, ast.ClassDef)
                   and any(getattr(base, "id", "") == "NamedTuple" for base in node.bases)}
        assert {"Data", "Between"} <= bundles, (script, bundles)


def test_each_script_writes_out_the_step_the_save_and_the_sampler():
    for script in ALL_SCRIPTS:
        text = (REPO / "trainer" / script).read_text(encoding="utf-8")
        loop = text[text.index("def train_epoch("):text.index("def main(")]
        assert "SkipBatchSampler(" in loop, script
        places = [loop.find(piece) for piece in STEP_N_IN_ORDER]
        assert -1 not in places and places == sorted(places), dict(zip(STEP_N_IN_ORDER, places))
        assert all(loop.count(piece) == 1 for piece in STEP_N_IN_ORDER), "each happens once in an iteration"
        calls = re.findall(r"\bpolicy\.", loop)
        assert len(calls) == len(POLICY_IN_THE_LOOP) and all(p in loop for p in POLICY_IN_THE_LOOP), script
        step = loop[loop.index("# ---- step N:"):loop.index("# ---- step N's log line")]
        assert "policy" not in step, f"{script}: the anomaly policy acts between steps, never inside one"
        sections = re.findall(r"# ---- (\d+)\. ", text)
        assert sections == [str(i) for i in range(1, len(sections) + 1)] and len(sections) >= 8, sections
        assert len(text.splitlines()) <= MAX_LINES[script], f"{script} has {len(text.splitlines())} lines"
        tree = ast.parse(text)
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Nonlocal, ast.Global, ast.Lambda))], script
        nested = [inner.name for outer in ast.walk(tree) if isinstance(outer, ast.FunctionDef)
                  for inner in ast.walk(outer) if isinstance(inner, ast.FunctionDef) and inner is not outer]
        assert not nested, f"{script} defines closures {nested}"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_imports_point_one_way_scripts_then_trainer_utils_then_hardening_then_model_and_dataset():
    assert sorted(p.name for p in (REPO / "trainer").glob("*.py")) == sorted(
        [*ALL_SCRIPTS, "trainer_utils.py", "train_tokenizer.py", "__init__.py"]), "trainer/ holds what a learner reads"
    hardening = list((REPO / "trainer" / "hardening").glob("*.py"))
    for path in hardening:  # a hardening module is read on its own: it never reaches back up
        up = {m for m in imported_modules(path) if m in ("trainer.trainer_utils",
                                                        *(f"trainer.{s[:-3]}" for s in ALL_SCRIPTS))}
        assert not up, f"{path.name} imports {up}"
    for folder in ("model", "dataset"):
        for path in (REPO / folder).glob("*.py"):
            wrong = {m for m in imported_modules(path) if m.split(".")[0] in ("trainer", "scripts")}
            assert not wrong, f"{folder}/{path.name} imports {wrong}"
    for path in (REPO / "model").glob("*.py"):
        assert not {m for m in imported_modules(path) if m.startswith("dataset")}, f"model/{path.name} imports dataset/"
    # The output-path rules sit below everything, so model/, trainer/ and scripts/ may all import them.
    project = {"model", "dataset", "trainer", "scripts", "benchmarks", "eval_model", "eval_choices"}
    assert not {m for m in imported_modules(REPO / "output_paths.py") if m.split(".")[0] in project}


def hardening_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of trainer/hardening/ that `path` imports, at its top or inside a function, in any form:
    `from trainer.hardening import x`, `from trainer.hardening.x import y`, `import trainer.hardening.x`,
    `from . import x`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # a relative import (level 1) is one of trainer.hardening
            base = ".".join(filter(None, ["trainer.hardening" if node.level else "", node.module or ""]))
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(parts[2] for parts in (name.split(".") for name in names)
                     if parts[:2] == ["trainer", "hardening"] and len(parts) > 2 and parts[2] in modules)
    return found - {path.stem}


def test_the_hardening_modules_import_each_other_without_a_circle():
    paths = {p.stem: p for p in (REPO / "trainer" / "hardening").glob("*.py") if p.stem != "__init__"}
    imports = {name: hardening_imports(path, set(paths)) for name, path in paths.items()}
    assert imports["checkpoint_io"] >= {"durable_files"}, "the probe must see checkpoint_io's own imports"
    done: set[str] = set()

    def visit(name: str, chain: list[str]) -> None:  # depth first; meeting a module already on the chain is a circle
        if name in chain:
            raise AssertionError("import circle: " + " -> ".join(chain[chain.index(name):] + [name]))
        if name not in done:
            for imported in sorted(imports[name]):
                visit(imported, chain + [name])
            done.add(name)

    for name in sorted(imports):
        visit(name, [])


def test_the_loop_and_trainer_utils_read_as_simply_as_minimind():
    """Cognitive complexity (the complexipy package) of every function in the scripts and in trainer_utils.py
    stays at or below 30: minimind's train_epoch scores 29. trainer_utils.py stays within 450 lines."""
    import complexipy

    scores = {f"{script}:{f.name}": f.complexity for script in (*ALL_SCRIPTS, "trainer_utils.py")
              for f in complexipy.file_complexity(str(REPO / "trainer" / script)).functions}
    expected = {"train_pretrain.py:train_epoch", "train_lora.py:train_epoch", "train_dpo.py:train_epoch",
                "train_grpo.py:train_epoch", "train_grpo.py:step_rollouts", "train_distillation.py:train_epoch",
                "trainer_utils.py:lm_checkpoint", "trainer_utils.py:load_checkpoint", "trainer_utils.py:read_on_host"}
    assert expected <= set(scores), scores
    assert all(score <= 30 for score in scores.values()), scores
    assert len((REPO / "trainer" / "trainer_utils.py").read_text(encoding="utf-8").splitlines()) <= 450


def test_lm_checkpoint_only_saves_and_needs_the_position_by_name():
    """No minimind positional (epoch, step, wandb): a call in minimind's form, which would save sample 0 of the
    epoch as the position, is refused; loading is load_checkpoint's."""
    import inspect

    from trainer.trainer_utils import load_checkpoint, lm_checkpoint

    parameters = inspect.signature(lm_checkpoint).parameters
    assert list(parameters)[:4] == ["lm_config", "weight", "model", "optimizer"], list(parameters)
    assert not {"epoch", "step", "wandb"} & set(parameters), list(parameters)
    for required in ("position", "run"):
        assert parameters[required].kind is inspect.Parameter.KEYWORD_ONLY, required
        assert parameters[required].default is inspect.Parameter.empty, required
    assert list(inspect.signature(load_checkpoint).parameters) == ["lm_config", "weight", "checkpoint_dir", "run"]

"""The scripts work from a plain clone: nothing installed, nothing on PYTHONPATH, any directory.

Each test launches the commands a user types (minimind's `cd trainer && python train_full_sft.py`,
a script by its absolute path from elsewhere, `torchrun ... trainer/train_pretrain.py` from the
repository root) and then pastes the "To continue:" line a --max_steps stop prints into a shell,
in the same directory, to check it really resumes the run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import (PRETRAIN_RUN, REPO, TINY_MODEL, assert_exit_code, child_env, events_of, free_port,
                      run_args, status_of, trace_of)

PROJECT_PACKAGES = ("model", "dataset", "trainer", "scripts", "output_paths")


def run(command: list[str] | str, cwd: Path, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    """A command as a user runs it: a list, or a string for the shell; it must exit 0."""
    result = subprocess.run(command, cwd=cwd, env=child_env(**env), shell=isinstance(command, str),
                            capture_output=True, text=True, timeout=timeout)
    assert_exit_code(result)
    return result


def assert_project_not_installed(cwd: Path) -> None:
    """A bare interpreter outside the repository cannot import the project: nothing helps the scripts."""
    bare = subprocess.run([sys.executable, "-c", "import model"], cwd=cwd, env=child_env(), capture_output=True,
                          text=True, timeout=60)
    assert bare.returncode == 1 and "No module named 'model'" in bare.stderr, bare.stderr
    found = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                            f"print([m for m in {PROJECT_PACKAGES!r} if u.find_spec(m)])"],
                           cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == "[]", f"importable without the repository: {found.stdout}"


def continue_command(stdout: str) -> str:
    """The command after "To continue:" in a --max_steps stop's last lines."""
    match = re.search(r"To continue: (.+)$", stdout, re.MULTILINE)
    assert match, f"no 'To continue:' line in:\n{stdout[-3000:]}"
    return match.group(1)


def torchrun_launcher() -> str:
    """`torchrun` as a user types it. Where the environment has no `torchrun` on PATH (the
    console script is missing), the same launcher as `python -m torch.distributed.run`."""
    return "torchrun" if shutil.which("torchrun") else f"{sys.executable} -m torch.distributed.run"


def assert_steps_once(trace: list[dict], steps: range, ranks: int) -> None:
    step_ranks = sorted((r["step"], r["rank"]) for r in trace)
    assert step_ranks == [(s, rank) for s in steps for rank in range(ranks)], step_ranks


def test_sft_runs_from_inside_trainer_and_its_continue_command_resumes(tmp_path, sft_data):
    assert_project_not_installed(tmp_path)
    trainer_dir = REPO / "trainer"
    args = [*TINY_MODEL, *run_args(tmp_path, sft_data, "--batch_size", "4", "--from_weight", "none",
                                   "--max_steps", "2")]
    first = run([sys.executable, "train_full_sft.py", *args], cwd=trainer_dir)
    command = continue_command(first.stdout)
    assert command.startswith("python train_full_sft.py ") and command.endswith(" --from_resume 1")

    run(command, cwd=trainer_dir)  # pasted into a shell in the same directory
    assert events_of(tmp_path, "full_sft_32") == [("resume", 2)]
    assert_steps_once(trace_of(tmp_path), range(1, 5), ranks=1)  # --max_steps 2, twice
    status = status_of(tmp_path, "full_sft_32")
    assert (status["status"], status["current_step"], status["resumed_from"]) == ("stopped", 4, 2)


def test_pretrain_and_inspect_checkpoint_run_by_absolute_path_from_an_unrelated_directory(tmp_path, pretrain_data):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert_project_not_installed(elsewhere)
    run([sys.executable, str(REPO / "trainer" / "train_pretrain.py"), *TINY_MODEL,
         *run_args(tmp_path, pretrain_data, "--batch_size", "4", "--max_steps", "3")], cwd=elsewhere)
    assert_steps_once(trace_of(tmp_path), range(1, 4), ranks=1)
    assert (tmp_path / "out" / f"{PRETRAIN_RUN}.pth").is_file()
    assert list(elsewhere.iterdir()) == []  # every file went where the flags said

    resume = tmp_path / "ckpt" / f"{PRETRAIN_RUN}_resume.pth"
    inspected = run([sys.executable, str(REPO / "scripts" / "inspect_checkpoint.py"), str(resume)], cwd=elsewhere)
    assert re.search(r"global step: +3\n", inspected.stdout), inspected.stdout
    assert re.search(r"integrity: +OK", inspected.stdout), inspected.stdout


def test_torchrun_from_the_repository_root_and_its_continue_command_resumes(tmp_path, pretrain_data):
    assert_project_not_installed(tmp_path)
    launcher = torchrun_launcher()
    args = [*TINY_MODEL, *run_args(tmp_path, pretrain_data, "--batch_size", "2", "--max_steps", "2")]
    # PET_MASTER_PORT is torchrun's environment form of --master_port: a free port, so that tests
    # running at the same time do not meet on the default 29500; the pasted command stays as printed.
    first = run([*launcher.split(), "--nproc_per_node", "2", "trainer/train_pretrain.py", *args], cwd=REPO,
                PET_MASTER_PORT=free_port())
    command = continue_command(first.stdout)
    assert command.startswith("torchrun --nproc_per_node 2 trainer/train_pretrain.py ")
    assert command.endswith(" --from_resume 1")

    pasted = launcher + command[len("torchrun"):]
    run(pasted, cwd=REPO, PET_MASTER_PORT=free_port())
    assert events_of(tmp_path) == [("resume", 2)]
    trace = trace_of(tmp_path)
    assert_steps_once(trace, range(1, 5), ranks=2)
    assert {r["world_size"] for r in trace} == {2}
    status = status_of(tmp_path)
    assert (status["status"], status["current_step"], status["resumed_from"]) == ("stopped", 4, 2)

"""scripts/run_demo.sh's arguments, its look at the machine before the first stage and the order of its stages
(its Ctrl-C behaviour: tests/test_stopping.py).

Each run is the real script, copied alone into tmp_path: had it gone past the check, its first stage would
fail there instead of rewriting the repository's demo data.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, child_env

ORIGINAL_AFFINITY = os.sched_getaffinity(0)

HINT = "faster: OMP_NUM_THREADS=1 bash scripts/run_demo.sh --quick (one thread per process suffers least)"


def run_demo(tmp_path, *args: str, **machine) -> subprocess.CompletedProcess:
    """`bash scripts/run_demo.sh ARGS` with DEMO_LOADAVG / DEMO_CORES standing in for the machine's numbers
    (OMP_NUM_THREADS unset unless given: child_env sets it to 1 for training children)."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(REPO / "scripts" / "run_demo.sh", tmp_path / "scripts" / "run_demo.sh")
    env = child_env(**machine)
    if "OMP_NUM_THREADS" not in machine:
        del env["OMP_NUM_THREADS"]
    return subprocess.run(["bash", str(tmp_path / "scripts" / "run_demo.sh"), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("load, cores, says", [
    ("1.00", 2, "load average 1.00, 2 cores"),  # half the cores busy with other work
    ("6.50", 8, "load average 6.50, 8 cores"),
])
def test_a_busy_machine_gets_one_line_with_its_numbers_and_both_ways_to_go_faster_together(tmp_path, load, cores, says):
    result = run_demo(tmp_path, "--check_machine", DEMO_LOADAVG=load, DEMO_CORES=cores)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout == f"== busy or small machine ({says}): the demo will be slow; {HINT}\n"


@pytest.mark.parametrize("threads, args, advice", [
    ("1", (), "faster: OMP_NUM_THREADS=1 bash scripts/run_demo.sh --quick"),
    ("", ("--quick",), "faster: OMP_NUM_THREADS=1 bash scripts/run_demo.sh --quick (one thread per process suffers "
                       "least)"),
    ("1", ("--quick",), "it already runs as fast as it can here (one thread, --quick); the numbers will be the same, "
                        "only later"),
])
def test_the_advice_leaves_out_what_the_run_already_does(tmp_path, threads, args, advice):
    machine = {"OMP_NUM_THREADS": threads} if threads else {}
    result = run_demo(tmp_path, "--check_machine", *args, DEMO_LOADAVG="3.00", DEMO_CORES=2, **machine)
    assert result.stdout == f"== busy or small machine (load average 3.00, 2 cores): the demo will be slow; {advice}\n"


def test_one_core_is_slow_however_quiet_and_one_thread_is_not_advised_there(tmp_path):
    result = run_demo(tmp_path, "--check_machine", DEMO_LOADAVG="0.00", DEMO_CORES=1)
    assert result.stdout == ("== busy or small machine (load average 0.00, 1 core): the demo will be slow; faster: "
                             "bash scripts/run_demo.sh --quick\n")


@pytest.mark.parametrize("pin", [None, [0]])
def test_the_cores_counted_are_the_ones_the_process_may_use_not_omp_num_threads(tmp_path, pin):
    # With the advised OMP_NUM_THREADS=1, `nproc` alone prints 1: a 2-core machine looked like one core. Pinned to
    # one CPU (affinity, as a container's cpuset does), the demo has one core whatever the machine has.
    machine = os.sched_getaffinity(0) if pin is None else set(pin)
    if pin is not None:
        os.sched_setaffinity(0, machine)  # the child inherits it; restored below
    try:
        result = run_demo(tmp_path, "--check_machine", DEMO_LOADAVG="99", OMP_NUM_THREADS="1")
    finally:
        os.sched_setaffinity(0, ORIGINAL_AFFINITY)
    unit = "core" if len(machine) == 1 else "cores"
    assert f"(load average 99, {len(machine)} {unit})" in result.stdout, result.stdout


@pytest.mark.parametrize("load, cores", [("0.99", 2), ("0.00", 2), ("3.99", 8)])
def test_a_quiet_machine_with_two_cores_or_more_gets_no_line(tmp_path, load, cores):
    result = run_demo(tmp_path, "--check_machine", "--quick", DEMO_LOADAVG=load, DEMO_CORES=cores)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_an_unknown_argument_is_refused_with_the_usage_before_anything_runs(tmp_path):
    result = run_demo(tmp_path, "--quick", "--epochs", DEMO_LOADAVG="9", DEMO_CORES=2)
    assert result.returncode == 2 and result.stdout == ""  # not even the machine's line
    assert result.stderr == ("error: unknown argument '--epochs'; usage: bash scripts/run_demo.sh [--quick] "
                             "[--check_machine]\n")


@pytest.mark.parametrize("args, layers", [((), "4"), (("--quick",), "2")])
def test_the_stages_run_in_order_with_the_same_model_sizes_and_the_total_time_comes_last(tmp_path, args, layers):
    # A stand-in `python` first on the PATH writes down each command instead of training for minutes.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/commands\n')
    (tmp_path / "bin" / "python").chmod(0o755)
    result = run_demo(tmp_path, *args, DEMO_LOADAVG="0", DEMO_CORES=2,
                      PATH=f"{tmp_path / 'bin'}:{child_env()['PATH']}")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    scripts = [command.split()[0] for command in (tmp_path / "commands").read_text().splitlines()]
    assert scripts == ["dataset/make_demo_data.py", "dataset/make_stage_data.py", "trainer/train_pretrain.py",
                       "trainer/train_full_sft.py", "trainer/train_lora.py", "trainer/train_dpo.py",
                       "trainer/train_grpo.py", "trainer/train_full_sft.py", "trainer/train_distillation.py",
                       "trainer/train_full_sft.py", "eval_tools.py", "trainer/train_grpo.py", "eval_tools.py",
                       "scripts/demo_table.py", "eval_model.py", "eval_model.py",
                       "eval_model.py", "scripts/plot_metrics.py", "scripts/plot_metrics.py"]
    sizes = f"--hidden_size 128 --num_hidden_layers {layers} --num_attention_heads 4 --num_key_value_heads 2"
    commands = (tmp_path / "commands").read_text()
    assert f"scripts/demo_table.py {sizes}\n" in commands
    # tool use: from SFT's model, under a name of its own, scored under that name
    assert f"trainer/train_full_sft.py {sizes} --from_weight full_sft --save_weight tool_sft " in commands
    assert f"eval_tools.py --weight tool_sft {sizes}\n" in commands
    # agentic GRPO: from the tool model, with the tools running between two turns, scored under its own name
    assert re.search(f"trainer/train_grpo.py {sizes} --from_weight tool_sft --save_weight tool_grpo .*--max_turns 2 ",
                     commands)
    assert f"eval_tools.py --weight tool_grpo {sizes}\n" in commands
    stages = [line for line in result.stdout.splitlines() if line.startswith("== ")]
    assert [line.split(".")[0] for line in stages[:-1]] == [f"== {n}" for n in range(1, 13)]
    assert re.fullmatch(r"== done in 0 min \d+ s; the curves: out/pretrain_128_curves.png, out/grpo_128_curves.png",
                        stages[-1]), stages[-1]


def demo_environment(tmp_path) -> dict:
    """What scripts/run_demo.sh sets for its stages: a stand-in `python` writes down the numerics variables."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text(f'#!/bin/sh\necho "MKL_CBWR=$MKL_CBWR ATEN_CPU_CAPABILITY='
                                             f'$ATEN_CPU_CAPABILITY" > {tmp_path}/environment\n')
    (tmp_path / "bin" / "python").chmod(0o755)
    result = run_demo(tmp_path, "--quick", DEMO_LOADAVG="0", DEMO_CORES=2, PATH=f"{tmp_path / 'bin'}:{child_env()['PATH']}")
    assert result.returncode == 0, result.stderr
    return dict(pair.split("=", 1) for pair in (tmp_path / "environment").read_text().split())


def demo_sized_weights(run_dir, threads: int, **numerics) -> dict:
    """The FP32 weights after 4 pretraining steps of the demo's model on its data, on `threads` threads."""
    args = ["--hidden_size", "128", "--num_hidden_layers", "4", "--num_attention_heads", "4", "--num_key_value_heads",
            "2", "--max_seq_len", "128", "--batch_size", "32", "--learning_rate", "2e-3", "--optimizer", "muon",
            "--muon_learning_rate", "4e-3", "--max_steps", "4",
            "--num_workers", "0", "--device", "cpu", "--data_path", str(REPO / "dataset" / "pretrain_demo.jsonl"),
            "--save_dir", str(run_dir / "out"), "--checkpoint_dir", str(run_dir / "ckpt"),
            "--metrics_dir", str(run_dir / "metrics")]
    result = subprocess.run([sys.executable, str(REPO / "trainer" / "train_pretrain.py"), *args],
                            env=child_env(OMP_NUM_THREADS=threads, **numerics), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    [saved] = (run_dir / "ckpt").rglob("step_00000004.pth")
    return torch.load(saved, weights_only=True)["model"]


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="four demo-sized training runs (about a minute on 2 cores); set TRAINER_SLOW_TESTS=1")
def test_the_demos_numerics_make_one_and_two_threads_train_the_same_weights(tmp_path):
    numerics = demo_environment(tmp_path)
    assert numerics["MKL_CBWR"] == "AVX2,STRICT"
    same = [demo_sized_weights(tmp_path / f"pinned_{t}", t, **numerics) for t in (1, 2)]
    assert all(torch.equal(same[0][name], same[1][name]) for name in same[0])
    # Without the pinning, whether the thread count shows in these 4 steps is the CPU's: on the Intel machine the
    # demo was measured on it did (the last bits first), on an AMD EPYC 1 and 2 threads agreed. So no run without it
    # is asserted here: the pinning's promise is the equality above, on every machine.

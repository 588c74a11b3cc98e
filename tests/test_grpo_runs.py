"""trainer/train_grpo.py keeps every guarantee of the SFT stage, proven with real python/torchrun gloo processes
at the TINY_MODEL size: the same gradient however the global batch is split (rollouts included), under python or
torchrun, across a resume; a run that trains, logs what a user watches and saves; a resume in one process bit
for bit; one-line errors for a bad reward name, a line without an answer and a reward that fails mid-run (the
last checkpoint stays the newest); rollouts beyond memory and a room no prompt fits in refused in one line, and the
prompts cut said at start and counted in the metrics. Behind TRAINER_SLOW_TESTS=1, the first four also with tools
(--max_turns 2, from a tiny model taught to call the calculator, which runs in most rollouts: the metrics' tool_calls):
a resume in one process bit for bit (with tools only; without, above); a resume on 2 ranks bit-identical with the
metrics and status files, rotated checkpoints and the tracker run id carried over, and a changed reference refused;
a resume on 2 -> 3 -> 1 ranks training each prompt's group once; a SIGTERM that saves; then a reward that fails on
rank 1 only stopping both ranks with its line; two updates per batch of rollouts (--loss_type grpo, cispo) clipping
and resuming bit for bit between batches.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from conftest import (REPO, TINY_MODEL, assert_each_sample_once, assert_states_equal, events_of, history_file,
                      metrics_of, our_traceback_lines, resume_file, run_args, sigterm_two_ranks_then_resume, status_of,
                      trace_of, train)
from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from scripts.plot_metrics import metrics_figure
from test_dpo import write_jsonl, write_reference
from test_grpo import question, sum_questions
from test_grpo_tools import CALCULATOR, tool_questions, write_tool_caller
from trainer.hardening.durable_files import sha256_of
from trainer.hardening.process_exit import run_script
from trainer.hardening.run_lock import release_held

SCRIPT, RUN = "train_grpo.py", "grpo_32"
SLOW = pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                          reason="several multi-process runs; set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")
WATCHED = ("reward", "reward_std", "no_signal", "completion_len", "kl", "clip_fraction")


@pytest.fixture
def prompts(tmp_path) -> Path:
    """11 prompts: a prime, so no world size or batch divides the epoch."""
    return write_jsonl(tmp_path / "prompts.jsonl", sum_questions(11))


# --max_turns 2 on prompts offering the calculator (some 385 tokens), from the tool_caller fixture's weights: a call,
# its result and the answer take some 90 tokens (sampled at temperature 1); the tool reward among the rewards
WITH_TOOLS = ["--max_turns", "2", "--max_seq_len", "490", "--max_completion_len", "100", "--temperature", "1",
              "--rewards", "answer,brevity,tool", "--learning_rate", "1e-4"]


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory) -> Path:
    """Weights that call the calculator in most rollouts (test_grpo_tools.write_tool_caller), made once a module."""
    return write_tool_caller(tmp_path_factory.mktemp("tool_caller"))


def run_data(tmp_path: Path, prompts: Path, tools: bool, request) -> tuple[Path, list[str], Path | None]:
    """(data, flags, reference) of a run test: with tools, 11 prompts offering the calculator, WITH_TOOLS and the
    tool_caller fixture's weights (made at the first test that asks); else `prompts`, no flags and random weights."""
    if not tools:
        return prompts, [], None
    data = write_jsonl(tmp_path / "tools.jsonl", tool_questions(11, CALCULATOR))
    return data, WITH_TOOLS, request.getfixturevalue("tool_caller")


def assert_tools_ran_in_most_rollouts(run_dir: Path) -> None:
    """The calculator ran in most of the run's rollouts (the metrics' tool_calls, calls run per rollout, logged at
    every step), and in some rollouts of each invocation (the run from its start and from each resume)."""
    ran = {r["step"]: r["tool_calls"] for r in metrics_of(run_dir, RUN) if "tool_calls" in r}
    bounds = [0, *(step for event, step in events_of(run_dir, RUN) if event == "resume"), max(ran)]
    assert all(sum(ran[s] for s in range(a + 1, b + 1)) > 0 for a, b in zip(bounds, bounds[1:])), (bounds, ran)
    assert sum(ran.values()) / len(ran) > 0.5 and sorted(ran) == list(range(1, max(ran) + 1)), ran


def grpo_args(run_dir: Path, data: Path, *extra: str, seed: int = 0, reference: Path | None = None) -> list[str]:
    """run_args for a GRPO run under `run_dir`, whose out/ gets a reference (full_sft_32.pth) if it has none: a copy
    of `reference`, or random weights. The brevity reward gives a random model's groups signal from the first step;
    completions of 8 tokens, 3 a group."""
    if not (run_dir / "out" / "full_sft_32.pth").exists():
        if reference is None:
            write_reference(run_dir / "out", load_tokenizer(DEFAULT_TOKENIZER).get_vocab_size(), seed=seed)
        else:
            (run_dir / "out").mkdir(parents=True, exist_ok=True)
            shutil.copy(reference, run_dir / "out" / "full_sft_32.pth")
    return run_args(run_dir, data, "--learning_rate", "1e-3", "--rewards", "answer,brevity", "--max_completion_len",
                    "8", "--num_generations", "3", "--temperature", "1.5", *extra)


def by_step(trace: list[dict], field: str) -> dict[int, list]:
    return {step: [r[field] for r in sorted(trace, key=lambda r: r["rank"]) if r["step"] == step]
            for step in sorted({r["step"] for r in trace})}


@SLOW
def test_one_rank_two_micro_steps_and_two_ranks_one_give_the_same_gradient_across_a_resume(tmp_path):
    # 5 prompts, a global batch of 4: step 2 has one prompt, so on 2 ranks rank 1 trains the loader's placeholder.
    # The 2-rank run is stopped after step 1 and resumed. Each group is drawn by its prompt, not by its rank.
    data = write_jsonl(tmp_path / "five.jsonl", sum_questions(5))
    common = ["--epochs", "1", "--grad_clip", "inf", "--save_interval", "1", "--keep_last", "2", "--batch_size", "2"]
    one, two = tmp_path / "one", tmp_path / "two"
    train(SCRIPT, None, grpo_args(one, data, *common, "--accumulation_steps", "2"), tmp_path)
    split = grpo_args(two, data, *common, "--accumulation_steps", "1")
    train(SCRIPT, 2, [*split, "--max_steps", "1"], tmp_path)
    train(SCRIPT, 2, [*split, "--from_resume", "1"], tmp_path)
    assert events_of(two, RUN) == [("resume", 1)]
    assert by_step(trace_of(two), "samples")[2][1] == []  # rank 1's share of step 2: the placeholder
    for step in (1, 2):
        # AdamW's first moment after step 1 is 0.1 x the gradient, after step 2 0.09 x the first + 0.1 x the second.
        a, b = (history_file(run, step, RUN)["optimizer"]["state"] for run in (one, two))
        assert a.keys() == b.keys() and len(a) > 0
        assert any(float(a[number]["exp_avg"].norm()) > 0 for number in a)  # the rewards gave a gradient
        for number in a:  # float32 summation order only
            difference = (a[number]["exp_avg"] - b[number]["exp_avg"]).norm() / a[number]["exp_avg"].norm().clamp(
                min=1e-30)
            assert difference < 1e-5, (step, number, float(difference))
    losses = {run: [r["global_loss"] for r in trace_of(run) if r["rank"] == 0] for run in (one, two)}
    # (the loss of a step sampled from these very weights is about 0: ratio 1, the advantages of a group sum to 0)
    assert losses[one] == pytest.approx(losses[two], rel=1e-6, abs=1e-7) and len(losses[one]) == 2


def test_a_run_trains_logs_what_a_user_watches_saves_and_resumes_bit_identically_rollouts_included(tmp_path, prompts):
    common = ["--batch_size", "2", "--epochs", "1", "--save_interval", "2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    whole = train(SCRIPT, None, grpo_args(straight, prompts, *common, "--max_steps", "4"), tmp_path)
    metrics = [r for r in metrics_of(straight, RUN) if "loss" in r]
    assert [r["step"] for r in metrics] == [1, 2, 3, 4] and all(set(WATCHED) <= set(r) for r in metrics)
    assert "tool_calls" not in metrics[0]  # one turn (--max_turns 1): no tool runs, nothing to count
    assert 0 < metrics[0]["reward"] < 2 and metrics[0]["no_signal"] < 1 and metrics[0]["completion_len"] > 0
    assert metrics[0]["kl"] == 0 < metrics[1]["kl"]  # step 1 samples from the reference's own weights; then it moves
    assert "reward " in whole.stdout and " kl " in whole.stdout and "clip_fraction" in whole.stdout
    assert [ax.get_ylabel() for ax in metrics_figure(metrics_of(straight, RUN)).axes] == [
        "loss (nats per token)", "reward", "learning rate", "grad norm"]  # scripts/plot_metrics.py draws the reward
    weights = torch.load(straight / "out" / "grpo_32.pth", weights_only=True)  # the next stage's (FP16) weights
    assert all(t.dtype == torch.float16 for t in weights.values()) and status_of(straight, RUN)["status"] == "stopped"
    train(SCRIPT, None, grpo_args(split, prompts, *common, "--max_steps", "2"), tmp_path)
    train(SCRIPT, None, grpo_args(split, prompts, *common, "--max_steps", "2", "--from_resume", "1"), tmp_path)
    assert_states_equal(resume_file(straight, RUN), resume_file(split, RUN))
    assert by_step(trace_of(split), "loss") == by_step(trace_of(straight), "loss")
    assert [(r["step"], r["reward"]) for r in metrics_of(split, RUN) if "reward" in r] == [
        (r["step"], r["reward"]) for r in metrics_of(straight, RUN) if "reward" in r]  # the same completions


@SLOW
@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_two_updates_per_batch_of_rollouts_clip_and_resume_bit_identically_between_batches(tmp_path, prompts,
                                                                                         loss_type):
    """--num_iterations 2: each step's rollouts train two AdamW steps, the second one's ratio pi / pi_old away
    from 1, so the clip (cispo: the cap) acts; a run stopped after step 2 and resumed equals an unstopped one."""
    common = ["--batch_size", "2", "--epochs", "1", "--save_interval", "2", "--num_iterations", "2",
              "--loss_type", loss_type, "--clip_eps", "0.05"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(SCRIPT, None, grpo_args(straight, prompts, *common, "--max_steps", "4"), tmp_path)
    train(SCRIPT, None, grpo_args(split, prompts, *common, "--max_steps", "2"), tmp_path)
    train(SCRIPT, None, grpo_args(split, prompts, *common, "--max_steps", "2", "--from_resume", "1"), tmp_path)
    final = resume_file(straight, RUN)
    assert_states_equal(final, resume_file(split, RUN))
    assert by_step(trace_of(split), "loss") == by_step(trace_of(straight), "loss")
    assert {int(s["step"]) for s in final["optimizer"]["state"].values()} == {8}  # 4 steps x 2 AdamW updates
    metrics = [{k: r[k] for k in ("step", *WATCHED)} for r in metrics_of(straight, RUN) if "reward" in r]
    assert metrics == [{k: r[k] for k in ("step", *WATCHED)} for r in metrics_of(split, RUN) if "reward" in r]
    assert len(metrics) == 4
    # Over both updates' tokens: the first's ratio is 1, so at most half (a group without signal: none)
    assert metrics[0]["clip_fraction"] > 0 and all(r["clip_fraction"] <= 0.5 for r in metrics), metrics
    assert metrics[0]["kl"] > 0  # step 1's second update: the weights have left the reference


def test_grpo_raises_the_reward_it_is_given(tmp_path):
    """40 steps on 40 prompts with the brevity reward only (shorter answers score higher): the mean reward of the
    last 5 steps is well above that of the first 5, from a random reference's babble (measured: 0.77 -> 0.99)."""
    data = write_jsonl(tmp_path / "forty.jsonl", sum_questions(40))
    train(SCRIPT, None, grpo_args(tmp_path, data, "--batch_size", "4", "--epochs", "4", "--warmup_ratio", "0",
                                  "--save_interval", "100", "--rewards", "brevity", "--learning_rate", "3e-2",
                                  "--max_completion_len", "16", "--num_generations", "4", "--temperature", "1"),
          tmp_path)  # (the flags given last win over grpo_args' own)
    metrics = [r for r in metrics_of(tmp_path, RUN) if "reward" in r]
    rewards = [r["reward"] for r in metrics]
    assert len(rewards) == 40 and sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1, rewards


def test_a_bad_reward_name_and_a_line_without_an_answer_are_one_line_each_with_exit_2(tmp_path, prompts):
    prompt_only = write_jsonl(tmp_path / "rlaif.jsonl", [*sum_questions(2), question("3+3?", None)])
    for extra, line in [(["--rewards", "answer,typo"], "error: --rewards answer,typo: typo is none of answer,"),
                        (["--data_path", str(prompt_only)], f"error: {prompt_only}, line 3: no reference answer")]:
        result = train(SCRIPT, None, [*grpo_args(tmp_path, prompts), *extra], tmp_path, check=False)
        assert result.returncode == 2 and result.stderr.startswith(line), (extra, result.stderr[-2000:])
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "ckpt").exists()  # refused before anything was trained or saved


@pytest.mark.parametrize("flags, line", [
    # Before: 9.2 GB allocated at 100,000, then a traceback after 58 s
    (["--num_generations", "1000000", "--max_completion_len", "8"], r"--num_generations 1000000 x --batch_size 4 x "
     r"--max_seq_len 48: a micro-batch's rollouts, 4,000,000 completions, need at least [\d,.]+ GiB \(.*\) beside "
     r"the model's .* GiB, but this machine has .* GiB of memory available; lower --num_generations, --batch_size "
     r"or --max_seq_len$"),
    # Before: every prompt cut to its last token ("\n"), and a run that trained on nothing it was asked, exit 0
    (["--max_completion_len", "47"], r".*prompts.jsonl: each of its 11 prompts is longer than the 1 token "
     r"--max_seq_len leaves beside --max_completion_len \(the shortest, line 1, has \d+\): .* Make --max_seq_len "
     r"at least \d+ more than --max_completion_len$")], ids=["rollouts-beyond-memory", "no-room-for-any-prompt"])
def test_rollouts_beyond_memory_and_a_room_no_prompt_fits_are_one_line_each_with_exit_2(tmp_path, prompts, flags,
                                                                                         line):
    result = train(SCRIPT, None, run_args(tmp_path, prompts, *flags), tmp_path, check=False, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.splitlines()) == 1 and re.match(f"error: {line}", result.stderr), result.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "out").exists()  # before anything was made


def test_a_run_says_which_prompts_are_cut_and_counts_them_in_its_metrics(tmp_path):
    records = sum_questions(11)
    for line in (2, 5, 9):  # some 120 tokens, the others some 15: 40 - 8 = 32 are left for a prompt
        records[line - 1] = question("What is " + " plus ".join(str(n) for n in range(30)) + "?", "435")
    data = write_jsonl(tmp_path / "prompts.jsonl", records)
    result = train(SCRIPT, None, grpo_args(tmp_path, data, "--max_seq_len", "40", "--batch_size", "4"), tmp_path)
    assert f"note: 3 of 11 prompts in {data} (lines 2, 5, 9) are longer than the 32 tokens" in result.stdout
    steps = [r for r in metrics_of(tmp_path, RUN) if "prompts_cut" in r]
    assert len(steps) == 3 and sum(r["prompts_cut"] for r in steps) == 3  # 11 prompts, 4 a step


@SLOW
@pytest.mark.parametrize("tools", [False, True], ids=["one-turn", "with-tools"])
def test_a_resume_on_the_same_rank_count_is_bit_identical_and_a_changed_reference_is_refused(tmp_path, prompts, tools,
                                                                                            request):
    # 11 prompts on 2 ranks of 1: 6 steps, the last short; saves every 2 steps, 2 kept.
    data, flags, reference = run_data(tmp_path, prompts, tools, request)
    common = ["--batch_size", "1", "--epochs", "1", "--save_interval", "2", *flags]
    straight, split = tmp_path / "straight", tmp_path / "split"
    wandb = ["--logger", "console,file,wandb"]  # the interrupted run only: a tracker changes nothing it trains
    train(SCRIPT, 2, grpo_args(straight, data, *common, reference=reference), tmp_path)
    train(SCRIPT, 2, grpo_args(split, data, *common, *wandb, "--max_steps", "3", reference=reference), tmp_path,
          WANDB_DIR=tmp_path)
    first = resume_file(split, RUN)
    train(SCRIPT, 2, grpo_args(split, data, *common, *wandb, "--from_resume", "1"), tmp_path, WANDB_DIR=tmp_path)

    final = resume_file(split, RUN)
    assert_states_equal(resume_file(straight, RUN), final)
    assert (final["epoch"], final["samples_consumed"], final["global_step"]) == (1, 0, 6)
    assert by_step(trace_of(split), "loss") == by_step(trace_of(straight), "loss")
    assert events_of(split, RUN) == [("resume", 3)] and status_of(split, RUN)["status"] == "completed"
    watched = ("step", *WATCHED, *(["tool_calls"] if tools else []))
    assert [{k: r[k] for k in watched} for r in metrics_of(split, RUN) if "reward" in r] == [
        {k: r[k] for k in watched} for r in metrics_of(straight, RUN) if "reward" in r]
    if tools:  # before the resume and after it
        assert_tools_ran_in_most_rollouts(split)
    assert final["tracker_ids"] == first["tracker_ids"] and final["tracker_ids"]["wandb"]  # the same wandb run
    reference = split / "out" / "full_sft_32.pth"
    assert (final["train_args"]["base_sha256"], final["train_args"]["num_generations"],
            final["train_args"]["rewards"]) == (sha256_of(reference), 3, "answer,brevity" + ",tool" * tools)

    write_reference(split / "out", load_tokenizer(DEFAULT_TOKENIZER).get_vocab_size(), seed=1)  # another reference
    refused = train(SCRIPT, None, grpo_args(split, data, *common[:4], *flags, "--from_resume", "1"), tmp_path,
                    check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "args.base_sha256: checkpoint has" in refused.stderr


@SLOW
def test_with_tools_a_resume_in_one_process_is_bit_identical_rollouts_included(tmp_path, tool_caller):
    data = write_jsonl(tmp_path / "tools.jsonl", tool_questions(4, CALCULATOR))
    common = ["--batch_size", "2", "--epochs", "1", "--save_interval", "1", *WITH_TOOLS]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(SCRIPT, None, grpo_args(straight, data, *common, reference=tool_caller), tmp_path)
    train(SCRIPT, None, grpo_args(split, data, *common, "--max_steps", "1", reference=tool_caller), tmp_path)
    train(SCRIPT, None, grpo_args(split, data, *common, "--from_resume", "1"), tmp_path)
    assert_states_equal(resume_file(straight, RUN), resume_file(split, RUN))
    assert resume_file(split, RUN)["train_args"]["max_turns"] == 2
    assert by_step(trace_of(split), "loss") == by_step(trace_of(straight), "loss") and len(trace_of(straight)) == 2
    assert [(r["step"], r["reward"], r["tool_calls"]) for r in metrics_of(split, RUN) if "reward" in r] == [
        (r["step"], r["reward"], r["tool_calls"]) for r in metrics_of(straight, RUN) if "reward" in r]  # the same
    assert_tools_ran_in_most_rollouts(split)


@SLOW
@pytest.mark.parametrize("tools, updates", [(False, []), (True, []), (False, ["--num_iterations", "2"])],
                         ids=["one-turn", "with-tools", "two-updates-a-batch"])
def test_a_resume_on_two_then_three_then_one_rank_trains_each_prompts_group_once(tmp_path, prompts, tools, updates,
                                                                                 request):
    # 11 prompts, batch 1: global batches 2, 3 and 1, over 2 epochs; with tools: --max_turns 2, the calculator offered.
    data, flags, reference = run_data(tmp_path, prompts, tools, request)
    common = grpo_args(tmp_path, data, "--batch_size", "1", "--epochs", "2", *flags, *updates, reference=reference)
    train(SCRIPT, 2, [*common, "--max_steps", "3"], tmp_path)
    on_three = train(SCRIPT, 3, [*common, "--max_steps", "3", "--from_resume", "1"], tmp_path)
    assert "saved at step 3: training continues from sample 6 of epoch 1 (world size 2 -> 3, global batch 2 -> 3" \
        in on_three.stdout
    train(SCRIPT, None, [*common, "--from_resume", "1"], tmp_path)
    trace = trace_of(tmp_path)
    assert {r["step"]: r["world_size"] for r in trace} == {s: 2 if s <= 3 else 3 if s <= 6 else 1 for s in range(1, 15)}
    assert_each_sample_once(trace, num_samples=11, epochs=2)  # one sample = one prompt = its group of completions
    final = resume_file(tmp_path, RUN)
    assert (final["epoch"], final["samples_consumed"], final["global_step"]) == (2, 0, 14)
    if tools:  # the calculator ran on 2, on 3 and on 1 rank
        assert_tools_ran_in_most_rollouts(tmp_path)
    if updates:  # each step trained two updates on its rollouts, on 2, 3 and 1 rank: AdamW counted 28
        assert {int(state["step"]) for state in final["optimizer"]["state"].values()} == {28}


@SLOW
@pytest.mark.parametrize("tools", [False, True], ids=["one-turn", "with-tools"])
def test_sigterm_saves_exits_zero_and_the_resume_trains_each_prompt_once(tmp_path, prompts, tools, request):
    data, flags, reference = run_data(tmp_path, prompts, tools, request)
    args = grpo_args(tmp_path, data, "--batch_size", "1", "--epochs", "2", *flags, reference=reference)
    sigterm_two_ranks_then_resume(SCRIPT, RUN, args, tmp_path)
    if tools:  # before the stop and after the resume
        assert_tools_ran_in_most_rollouts(tmp_path)


def test_a_reward_that_fails_mid_run_is_one_line_exit_2_and_the_last_checkpoint_stays(tmp_path, prompts, monkeypatch,
                                                                                     capsys):
    """A user's reward raises at step 3 (in this process, as REWARDS is the registry a user adds to): the run stops
    with one line naming it before step 3 is applied, and step 2's checkpoint is the newest and verifies."""
    from dataset import rewards
    from trainer import train_grpo
    from trainer.hardening import checkpoint_io as cio

    calls = []

    def flaky(completions, answers):  # fine for the 4 groups of steps 1 and 2, then raises
        calls.append(len(completions))
        if len(calls) > 4:
            raise ZeroDivisionError("division by zero")
        return [0.0] * len(completions)

    monkeypatch.setitem(rewards.REWARDS, "flaky", flaky)
    args = [*grpo_args(tmp_path, prompts, "--batch_size", "2", "--save_interval", "1", "--async_save", "0"),
            "--rewards", "brevity,flaky"]  # (the flag given last wins)
    monkeypatch.setattr("sys.argv", ["train_grpo.py", *TINY_MODEL, *args])
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(SystemExit) as stopped:
            run_script(train_grpo.main)
    finally:  # what the run set up in this process, which a script's exit would have undone
        for number, handler in handlers.items():
            signal.signal(number, handler)
        release_held()
    error = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and error == (
        "error: reward 'flaky' (test_grpo_runs.test_a_reward_that_fails_mid_run_is_one_line_exit_2_and_the_last_"
        "checkpoint_stays.<locals>.flaky) raised ZeroDivisionError: division by zero"), error
    history = cio.RunFiles(tmp_path / "ckpt", RUN).history()
    assert [int(p.name[5:13]) for p in history][0] == 2 and cio.verify(history[0]) is None
    assert [r["step"] for r in trace_of(tmp_path) if "loss" in r] == [1, 2]  # step 3 never trained


FAILS_ON_RANK_1 = """
import os, sys
sys.path.insert(0, {repo!r})  # (the script puts the repository first on the path too)
from dataset import rewards


def fails_on_rank_1(completions, answers):
    if os.environ.get("RANK") == "1" and os.environ.get("GRPO_TEST_STEP_1_DONE"):
        raise ValueError("no score on rank 1")
    os.environ["GRPO_TEST_STEP_1_DONE"] = "1"
    return [0.0] * len(completions)


rewards.REWARDS["fails_on_rank_1"] = fails_on_rank_1
"""


@SLOW
def test_a_reward_that_fails_on_one_rank_stops_every_rank_with_its_line(tmp_path, prompts):
    """A user's reward (added to REWARDS from outside, by a sitecustomize) raises on rank 1 at its second call:
    rank 0, which would wait for rank 1 in the step's all-reduce, stops too, and prints rank 1's line."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAILS_ON_RANK_1.format(repo=str(REPO)), encoding="utf-8")
    args = [a if a != "answer,brevity" else "brevity,fails_on_rank_1" for a in grpo_args(tmp_path, prompts,
                                                                                         "--batch_size", "1")]
    result = train(SCRIPT, 2, args, tmp_path, check=False, PYTHONPATH=site)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and errors == [
        "error: on rank 1: reward 'fails_on_rank_1' (sitecustomize.fails_on_rank_1) raised ValueError: no score on "
        "rank 1"], result.stderr[-3000:]
    # The traceback torchrun prints is its own (no frame of ours); its summary names our line for each rank.
    assert not our_traceback_lines(result.stderr) and result.stderr.count("traceback : error: on rank 1: reward") == 2
    assert [r["step"] for r in trace_of(tmp_path)] == [1, 1]  # step 2 applied on no rank

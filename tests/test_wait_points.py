"""How often the host waits for the device changes nothing but when it waits.

The loop reads its steps' numbers only at a log line, a validation, a save and the run's last step
(trainer_utils.read_on_host; the anomaly policy judges them then); a non-finite step is skipped on the device
before anyone looks. So the same run with --log_interval 1 (the host waits after every step) and with --log_interval 5 (it waits at
every 5th step and at the saves of every 4th) must end in the same state, bit for bit: weights, AdamW
moments, every rank's RNG, the data position and the guard's memory; with the same trace, the same
events and the same exit code. Under NaN and spike schedules for each policy, and a stop by a signal.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from conftest import (FAULT_INJECTION_DIR, TINY_MODEL, assert_states_equal, child_env, events_of, launch_command,
                      resume_file, run_args, status_of, trace_of)
from trainer.hardening.anomaly_policy import steps_left
from trainer.trainer_utils import Position, SkipBatchSampler, optimizer_step, total_steps

# (policy flags, world size, extra environment): 14 of the 19 steps; every schedule has fired by then.
CASES = {
    "nan under warn": (("--on_anomaly", "warn", "--debug_inject", "nan:3,spike:9"), None, {}),
    "spike and nan under rollback": (("--on_anomaly", "rollback", "--debug_inject", "spike:10,nan:13"), None, {}),
    "spike under stop": (("--on_anomaly", "stop", "--debug_inject", "spike:7"), None, {}),
    # rank 1 alone gets SIGTERM once step 6 is taken: both ranks save step 6 and stop
    "signal stop on one of two ranks": ((), 2, {"PYTHONPATH": FAULT_INJECTION_DIR, "FAULT_SIGNAL_AT_STEP": 6,
                                               "FAULT_SIGNAL_RANK": 1}),
}
STATE = ("model", "optimizer", "rng", "epoch", "samples_consumed", "global_step", "anomaly")


def per_rank(trace: list[dict]) -> dict[int, list[dict]]:
    """Each rank's records in its own order (two ranks append to one file, interleaved as it happens)."""
    return {rank: [r for r in trace if r["rank"] == rank] for rank in sorted({r["rank"] for r in trace})}


@pytest.mark.parametrize("case", CASES)
def test_waiting_after_every_step_or_every_fifth_ends_in_the_same_state(tmp_path, pretrain_data, case):
    flags, nproc, env = CASES[case]
    jobs, runs, outputs = {}, {}, {}
    for interval in ("1", "5"):  # two independent runs, side by side on two cores
        run_dir = tmp_path / f"log_every_{interval}"
        args = run_args(run_dir, pretrain_data, "--batch_size", "2", "--epochs", "1", "--max_steps", "14",
                        "--save_interval", "4", *flags, "--log_interval", interval)
        jobs[interval] = subprocess.Popen(launch_command("train_pretrain.py", nproc, [*TINY_MODEL, *args]),
                                          cwd=tmp_path, env=child_env(**env), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT)
    for interval, job in jobs.items():
        outputs[interval] = job.communicate(timeout=300)[0].decode(errors="replace")[-3000:]
        run_dir = tmp_path / f"log_every_{interval}"
        runs[interval] = (job.returncode, per_rank(trace_of(run_dir)), events_of(run_dir), resume_file(run_dir),
                          status_of(run_dir))
    code_1, trace_1, events_1, final_1, status_1 = runs["1"]
    code_5, trace_5, events_5, final_5, status_5 = runs["5"]
    assert code_1 == code_5 == (3 if case == "spike under stop" else 0), outputs
    assert events_1 == events_5 and trace_1 == trace_5
    assert status_1["anomaly_reason"] == status_5["anomaly_reason"]
    assert_states_equal(final_1, final_5, fields=STATE)
    kinds = [kind for kind, _ in events_1]
    if case == "nan under warn":
        assert kinds == ["anomaly", "anomaly"] and final_1["global_step"] == 14
        [skipped] = [r for r in trace_1[0] if r["step"] == 3]
        assert skipped["skipped"] is True and skipped["samples"] == []
    elif case == "spike and nan under rollback":
        assert kinds == ["anomaly", "rollback", "anomaly", "rollback"], events_1
    elif case == "spike under stop":  # the spike was applied, and judged before the save of step 8
        assert kinds == ["anomaly"] and final_1["global_step"] == 4 and max(r["step"] for r in trace_1[0]) == 6
        assert not (tmp_path / "log_every_5" / "ckpt" / "pretrain_32_history" / "step_00000008.pth").exists()
    else:  # both ranks stopped after step 6 and saved it, whatever the log interval
        assert final_1["global_step"] == 6 and len(final_1["rng"]) == 2, outputs
        assert [max(r["step"] for r in records) for records in trace_5.values()] == [6, 6]
        assert "stopped at step 6 (" in outputs["5"] and status_5["status"] == "stopped", outputs["5"]


def fresh_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01, fused=True)


def take_step(model, optimizer, gradient_scale: float = 1.0) -> None:
    (model(torch.ones(2, 4)).sum() * gradient_scale).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer_step(optimizer, torch.amp.GradScaler("cpu", enabled=False), grad_norm)
    optimizer.zero_grad(set_to_none=True)


def state_of(model, optimizer) -> tuple:
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_step_with_a_non_finite_gradient_leaves_weights_moments_and_step_count_untouched(bad):
    model, optimizer = fresh_optimizer()
    take_step(model, optimizer)
    before = state_of(model, optimizer)
    take_step(model, optimizer, gradient_scale=bad)
    after = state_of(model, optimizer)
    assert all(torch.equal(v, before[0][k]) for k, v in after[0].items())
    assert all(torch.equal(v, old[k]) for new, old in zip(after[1], before[1]) for k, v in new.items())
    take_step(model, optimizer)  # and the next step is an ordinary one: as if the bad one never happened
    twin, twin_optimizer = fresh_optimizer()
    take_step(twin, twin_optimizer)
    take_step(twin, twin_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_window_left_out_after_a_rollback_is_never_handed_out_and_the_cursor_moves_past_it(world_size):
    # 10 samples, 2 a step; a rollback left out the window [4, 6) and the epoch's last window [9, 10).
    order, left_out = torch.arange(10).flip(0), [(4, 6), (9, 10)]
    sampler = SkipBatchSampler(order, 2, 2, 1, 0, world_size, left_out)
    windows = [sampler.step_window(s).tolist() for s in range(sampler.num_steps())]
    assert windows == [[7, 6], [3, 2], [1]]  # positions 2-3, 6-7, 8: 5, 4 and 0 (positions 4, 5 and 9) left out
    assert [sampler.step_end(s) for s in range(sampler.num_steps())] == [6, 8, 10]  # past what is left out
    assert steps_left(10, 2, 2, left_out) == 3 and steps_left(10, 2, 2) == 4
    # A resume from the cursor after the first step trains what the run would have trained next.
    resumed = SkipBatchSampler(order, 6, 2, 1, 0, world_size, left_out)
    assert [resumed.step_window(s).tolist() for s in range(resumed.num_steps())] == windows[1:]
    everything_left_out = SkipBatchSampler(order, 8, 2, 1, 0, world_size, [(8, 10)])
    assert everything_left_out.num_steps() == 0 and list(everything_left_out) == []


@pytest.mark.parametrize("world_size", [1, 3])
def test_with_nothing_left_out_the_sampler_slices_the_order_from_the_cursor_as_minimind_skips(world_size):
    """The common path: the rest of the order from the cursor, G a step, rank r every world_size-th sample; the
    cursor after step s is samples_consumed + (s + 1) x G, the last step's the epoch's end; nothing is copied."""
    order = torch.randperm(23, generator=torch.Generator().manual_seed(0))
    rank = world_size - 1
    sampler = SkipBatchSampler(order, 5, 6, 2, rank, world_size)  # (order, cursor, G, batch_size, rank, world_size)
    assert sampler.remaining.data_ptr() == order[5:].data_ptr() and torch.equal(sampler.remaining, order[5:])
    assert [sampler.step_window(s).tolist() for s in range(sampler.num_steps())] == [
        order[5:11].tolist(), order[11:17].tolist(), order[17:23].tolist()]
    assert [sampler.step_end(s) for s in range(sampler.num_steps())] == [11, 17, 23]
    shares = [index for batch in sampler for index in batch]
    assert shares == [i for s in range(3) for i in order[5 + 6 * s:11 + 6 * s][rank::world_size].tolist()]


def test_the_run_ends_a_step_earlier_for_each_window_left_out_in_the_epochs_ahead():
    at = Position(epoch=0, samples_consumed=4, global_step=2)  # 10 samples, 2 a step, 2 epochs: to step 10
    assert total_steps(at, 10, 2, 2) == 10
    assert total_steps(at, 10, 2, 2, [(0, 6, 8), (1, 0, 2), (0, 0, 2)]) == 8  # (0, 0, 2) is behind the cursor


def test_an_optimizer_that_cannot_skip_on_the_device_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="fused=True"):
        optimizer_step(torch.optim.AdamW(model.parameters(), fused=False), torch.amp.GradScaler("cpu", enabled=False),
                       torch.tensor(1.0))


def test_a_short_last_step_counts_the_samples_and_tokens_of_real_rows_only():
    """Rank 2 of 3 in a short window gets a placeholder micro-batch: it trains nothing, so it adds neither a sample
    to the trace nor tokens to tokens/s (its labels are all ignored; the rows beside it count in full)."""
    from torch.utils.data import DataLoader, Dataset

    from dataset.indexed import IndexedDataset, trained_samples

    class Rows(Dataset):  # sample i: 4 + i tokens, padded to 8
        def __len__(self):
            return 5

        def __getitem__(self, i):
            x = torch.zeros(8, dtype=torch.long)
            return x, torch.where(torch.arange(8) < 4 + i, 1, -100)

    order = torch.arange(5)
    sampler = SkipBatchSampler(order, 0, 6, 1, 2, 3)  # rank 2 of 3, batch 1, G 6: one step of 5 samples
    micro_batches = list(DataLoader(IndexedDataset(Rows()), batch_sampler=sampler))
    assert [indices.tolist() for indices, _, _ in micro_batches] == [[2], [-1]]  # sample 2, then the placeholder
    assert (micro_batches[1][2] == -100).all()
    assert trained_samples(micro_batches) == ([2], 8)  # 8: sample 2's row; the placeholder's 8 tokens are not counted

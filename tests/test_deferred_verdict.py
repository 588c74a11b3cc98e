"""The verdict on a step arrives one step late, and nothing else changes.

The loop judges step N while the device computes step N+1 (trainer/hardening/step_numbers.py); the update of a
bad step is refused on the device by the guard's own rule, before the host has seen its numbers.
`--judge_before_step 1` keeps the reference timing: the host waits for each step's numbers, judges,
then lets the optimizer step or not. With NaN and spike schedules under each policy, both timings must
give the same trace, the same events and the same final weights, bit for bit.
"""

from __future__ import annotations

import math
import subprocess

import pytest
import torch

from conftest import (TINY_MODEL, assert_states_equal, child_env, events_of, launch_command, resume_file, run_args,
                      status_of, trace_of)
from trainer.hardening.anomaly import AnomalyGuard
from trainer.hardening.step_numbers import StepNumbers, step_unless_refused

SCHEDULES = {
    "warn": ("--on_anomaly", "warn", "--debug_inject", "nan:3,spike:9"),  # skip, then a reported spike
    "rollback": ("--on_anomaly", "rollback", "--save_interval", "4", "--debug_inject", "spike:10,nan:13"),
    "stop": ("--on_anomaly", "stop", "--save_interval", "4", "--debug_inject", "spike:8"),
}
TIMING_FIELDS = ("time",)  # a trace record's fields that differ from run to run by nature


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]


@pytest.mark.parametrize("policy", SCHEDULES)
def test_deferred_verdict_gives_the_trace_and_weights_of_judging_before_the_step(tmp_path, pretrain_data, policy):
    jobs, runs = {}, {}
    for timing in ("deferred", "before"):  # two independent one-process runs, side by side on two cores
        run_dir = tmp_path / timing
        # 14 of the 19 steps: every schedule has fired by then, and --max_steps meets the rollbacks.
        args = run_args(run_dir, pretrain_data, "--batch_size", "2", "--epochs", "1", "--max_steps", "14",
                        *SCHEDULES[policy], "--judge_before_step", "1" if timing == "before" else "0")
        jobs[timing] = subprocess.Popen(launch_command("train_pretrain.py", None, [*TINY_MODEL, *args]), cwd=tmp_path,
                                        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    outputs = {}
    for timing, job in jobs.items():
        outputs[timing] = job.communicate(timeout=300)[0].decode(errors="replace")[-3000:]
        run_dir = tmp_path / timing
        runs[timing] = (job.returncode, comparable(trace_of(run_dir)), events_of(run_dir),
                        resume_file(run_dir), status_of(run_dir))
    (code_d, trace_d, events_d, final_d, status_d), (code_b, trace_b, events_b, final_b, status_b) = (
        runs["deferred"], runs["before"])
    assert (code_d, code_b) == ((3, 3) if policy == "stop" else (0, 0)), outputs
    assert events_d == events_b, events_d
    assert [kind for kind, _ in events_d] == {"warn": ["anomaly", "anomaly"], "stop": ["anomaly"],
                                              "rollback": ["anomaly", "rollback", "anomaly", "rollback"]}[policy]
    assert trace_d == trace_b
    assert status_d["anomaly_reason"] == status_b["anomaly_reason"]
    assert_states_equal(final_d, final_b, fields=("model", "optimizer", "rng", "epoch", "samples_consumed",
                                                  "global_step", "anomaly"))
    if policy == "warn":
        [skipped] = [r for r in trace_d if r["step"] == 3]
        assert skipped["skipped"] is True and skipped["samples"] == []


def fresh_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01, fused=True)
    return model, optimizer


def take_step(model, optimizer, refuse: float) -> None:
    model(torch.ones(2, 4)).sum().backward()
    step_unless_refused(optimizer, torch.amp.GradScaler("cpu", enabled=False), torch.tensor(refuse))
    optimizer.zero_grad(set_to_none=True)


def test_a_refused_step_leaves_weights_moments_and_step_count_untouched():
    model, optimizer = fresh_optimizer()
    take_step(model, optimizer, 0.0)
    before = ({k: v.clone() for k, v in model.state_dict().items()},
              {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())})
    take_step(model, optimizer, 1.0)
    assert all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())
    for i, state in enumerate(optimizer.state.values()):
        assert all(torch.equal(v, before[1][i][k]) for k, v in state.items()), state
    take_step(model, optimizer, 0.0)  # and the next accepted step is an ordinary one
    twin, twin_optimizer = fresh_optimizer()
    take_step(twin, twin_optimizer, 0.0)
    take_step(twin, twin_optimizer, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


def test_an_optimizer_that_cannot_skip_on_the_device_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="fused=True"):
        step_unless_refused(torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=False),
                            torch.tensor(0.0))


def guard_with_history(policy: str) -> AnomalyGuard:
    guard = AnomalyGuard(policy, patience=0, max_rollbacks=3, lr_factor=1.0)
    for step, loss in enumerate([2.0, 2.1, 1.9, 2.0, 2.05, 1.95], start=1):
        assert guard.verdict(step, loss, 1.0 + 0.1 * step, True) == ("apply", "")
    return guard


def device_refused(guard: AnomalyGuard, loss: float, grad_norm: float, finite_grads: bool = True) -> bool:
    values = torch.tensor([loss, grad_norm], dtype=torch.float64)
    return bool(guard.refusal(values[0], values[1], finite_grads))


@pytest.mark.parametrize("policy", ["warn", "stop", "rollback"])
def test_the_device_rule_agrees_with_the_verdict_at_and_around_the_limits(policy):
    loss_limit, grad_limit = guard_with_history(policy).detector.limits()
    cases = [(loss_limit, 1.0), (math.nextafter(loss_limit, math.inf), 1.0), (2.0, grad_limit),
             (2.0, math.nextafter(grad_limit, math.inf)), (math.nan, 1.0), (2.0, math.inf), (math.inf, 1.0),
             (2.0, 1.0)]
    for loss, grad_norm in cases:
        for finite_grads in (True, False):  # False: fp16, where an inf gradient is the scaler's business
            guard = guard_with_history(policy)
            refused = device_refused(guard, loss, grad_norm, finite_grads)
            action, _ = guard.verdict(7, loss, grad_norm, finite_grads, device_refused=refused)  # raises if apart
            assert refused == (action != "apply"), (loss, grad_norm, finite_grads, action)


def test_a_verdict_that_contradicts_the_device_is_an_error_not_a_silent_drift():
    guard = guard_with_history("stop")
    with pytest.raises(RuntimeError, match="the device applied the update, but the guard says 'stop'"):
        guard.verdict(7, 1e6, 1.0, True, device_refused=False)


def test_step_numbers_read_the_reduced_values_and_the_refusal():
    numbers = StepNumbers(torch.tensor(12.0, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64),
                          torch.tensor(4.0, dtype=torch.float64), torch.tensor(0.5), input_tokens=10, stop=True,
                          save_failed=False, step=1)
    assert numbers.loss.item() == 3.0 and numbers.grad_norm.dtype == torch.float64
    numbers.send(torch.tensor(1.0))
    assert numbers.read() == {"loss": 3.0, "grad_norm": 0.5, "stop": True, "save_failed": False, "input_tokens": 10,
                              "local_loss_sum": 12.0, "local_tokens": 4, "refused": True}

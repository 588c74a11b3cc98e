"""LoRA (model/lora.py, trainer/train_lora.py): the adapter's arithmetic in this process, then the guarantees of
the SFT stage on real `python` / `torchrun` gloo processes at TINY_MODEL's size. Each run starts from a base
made here (tests/lora_files.py) in its --save_dir, as out/full_sft_32.pth; it writes out/lora_demo_32.pth (the
adapter alone, FP16) and checkpoints/lora_demo_32_resume.pth (the adapter's FP32 weights and AdamW state).

The multi-rank proofs (2 -> 3 -> 1 ranks after a SIGTERM, bit-identical resume on 2 ranks) take about a
minute on two CPU cores and run when TRAINER_SLOW_TESTS=1 (as .ci/run's slow line does).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from conftest import (assert_each_sample_once, assert_states_equal, child_pids, events_of, launch_command, metrics_of,
                      read_trace, resume_file, run_args, slowed_env, status_of, trace_of, train, with_loader_workers)
from lora_files import tiny_config, write_adapter, write_base
from model.lora import LORA_TARGETS, LoRALinear, adapter_of, apply_lora, load_lora, merged_state_dict
from model.model import CausalLM
from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer, vocab_sha256
from scripts.inspect_checkpoint import describe_checkpoint
from test_tracking import offline_runs, wandb_offline_run
from trainer.hardening.checkpoint_io import RunFiles, verify
from trainer.hardening.durable_files import sha256_of
from trainer.hardening.resume_checks import ConfigError

NAME = "lora_demo_32"  # lora_{--lora_name}_{hidden}: the stem of every file of the run
SLOW = pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                          reason="about 30 s each on two CPU cores; set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")


# ---- the adapter, in this process -------------------------------------------------------------------

def test_a_fresh_adapter_leaves_the_logits_bit_identical_to_the_base():
    """The README's exercise: initialise B randomly instead of zero (LoRALinear) and this fails, since the
    adapter would then change the model before any training."""
    torch.manual_seed(0)
    model = CausalLM(tiny_config(vocab_size=64)).eval()
    ids = torch.randint(0, 64, (2, 12))
    before = model(ids).logits
    adapter = apply_lora(model, rank=8, alpha=16.0, targets=LORA_TARGETS)
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 2 * len(LORA_TARGETS)
    after = model(ids).logits
    moved = (after - before).abs().max().item()
    assert torch.equal(after, before), f"a fresh adapter moved the logits by up to {moved:.3g}: B must start at zero"
    # ... and it can learn: one step moves B off zero, and the logits with it.
    model(ids, labels=ids).loss.backward()
    torch.optim.SGD(adapter.parameters(), lr=1.0).step()
    assert not torch.equal(model(ids).logits, before)


def test_a_target_computes_w_x_plus_b_a_x_times_alpha_over_r_and_only_a_and_b_train():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(6, 5, bias=False), rank=2, alpha=3.0)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(4, 6)
    w, a, b = layer.weight, layer.lora_A.weight, layer.lora_B.weight
    assert (a.shape, b.shape) == ((2, 6), (5, 2))
    torch.testing.assert_close(layer(x), x @ w.T + x @ a.T @ b.T * (3.0 / 2), rtol=0, atol=1e-6)

    model = CausalLM(tiny_config(vocab_size=64))
    base_names = list(model.state_dict())
    adapter = apply_lora(model, 4, 8.0, ("q_proj", "down_proj"))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    expected = [f"model.layers.{i}.{where}.lora_{m}.weight" for i in range(2)
                for where in ("self_attn.q_proj", "mlp.down_proj") for m in "AB"]
    assert trainable == list(adapter.state_dict()) == expected  # the model's names; the base keeps its own
    assert [name for name in model.state_dict() if ".lora_" not in name] == base_names

    with torch.no_grad():  # merged: W + B A · α/r, a plain model that computes what the adapted one does
        for p in adapter.parameters():
            p.normal_(0.0, 0.3)
        merged = CausalLM(model.config)
        merged.load_state_dict(merged_state_dict(model), strict=True)
        ids = torch.randint(0, 64, (2, 12))
        assert not torch.allclose(merged(ids).logits, CausalLM(model.config)(ids).logits, atol=1e-3)
        torch.testing.assert_close(merged(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_an_adapter_is_refused_in_one_line_on_another_base_or_without_its_json(tmp_path):
    path = write_adapter(tmp_path, tiny_config(vocab_size=64))
    for other, detail in ((tiny_config(vocab_size=64, hidden_size=64),
                           "down_proj.lora_A.weight is [4, 128] in the file, [4, 192] in this model"),
                          (tiny_config(vocab_size=64, num_hidden_layers=3),
                           "model.layers.2.mlp.down_proj.lora_A.weight is absent in the file")):
        with pytest.raises(ValueError) as refused:
            load_lora(CausalLM(other), path)
        message = str(refused.value)
        assert "was trained on another base model" in message and detail in message and "\n" not in message
    load_lora(CausalLM(tiny_config(vocab_size=64)), path)  # its own base takes it
    path.with_suffix(".json").unlink()
    with pytest.raises(ValueError, match=r"lora_demo_32\.json .* has no lora_alpha"):
        load_lora(CausalLM(tiny_config(vocab_size=64)), path)


def test_the_adapter_log_line_shows_the_rank_applied_not_the_one_its_json_claims(tmp_path):
    import eval_model
    config = tiny_config()
    write_base(tmp_path, config)
    adapter_file = write_adapter(tmp_path, config, rank=4, targets=("q_proj", "v_proj"))
    sidecar = adapter_file.with_suffix(".json")
    claims = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**claims, "lora_rank": 64, "lora_targets": "q_proj,k_proj"}))  # edited by hand
    args = eval_model.build_arg_parser().parse_args(["--weight", "full_sft", "--save_dir", str(tmp_path),
                                                     "--device", "cpu", "--lora", "demo"])
    lines = []
    eval_model.load_model(args, load_tokenizer(args.tokenizer_path), torch.device("cpu"), log=lines.append)
    # Before: "rank 64, ... in q_proj,k_proj", what the .json said; the tensors put rank 4 on q_proj and v_proj.
    assert lines[1:] == [f"applied {adapter_file}: rank 4, alpha 6, in q_proj,v_proj"]


@pytest.mark.parametrize("flags,message", [
    (["--lora_rank", "0"], "--lora_rank 0: must be an integer >= 1"),
    (["--lora_alpha", "-1"], "--lora_alpha -1.0: must be a finite number > 0"),
    (["--lora_targets", "q_proj,qkv"], "--lora_targets q_proj,qkv: qkv is not a linear layer of the model; choose "
                                       "among q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
    (["--parallel", "fsdp"], "--parallel fsdp: train_lora.py trains with DDP only"),
    (["--save_hf", "1"], "--save_hf 1: train_lora.py saves the adapter alone; export it afterwards"),
    (["--lora_name", "a/b"], "--lora_name 'a/b': must be a plain file name"),
], ids=["rank_0", "negative_alpha", "unknown_target", "fsdp", "save_hf", "name_with_a_slash"])
def test_a_bad_lora_flag_is_refused_naming_it(monkeypatch, flags, message):
    from trainer import train_lora
    monkeypatch.setattr(sys, "argv", ["train_lora.py", *flags])
    with pytest.raises(ConfigError) as refused:
        train_lora.parse_args()
    assert str(refused.value).startswith(message)


def test_lora_flags_are_read_in_the_models_order_and_name_the_files(monkeypatch, tmp_path):
    from trainer import train_lora
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    monkeypatch.setattr(sys, "argv", ["train_lora.py", "--data_path", str(data), "--lora_targets", "down_proj, q_proj",
                                      "--lora_name", "medical"])
    args = train_lora.parse_args()
    assert (args.lora_targets, args.save_weight) == ("q_proj,down_proj", "lora_medical")


# ---- training processes -----------------------------------------------------------------------------

def test_a_missing_base_file_and_a_bad_lora_flag_stop_the_script_in_one_line(tmp_path, sft_data):
    for flags, expected in ((["--lora_rank", "0"], "error: --lora_rank 0: must be an integer >= 1"),
                            ([], f"error: --from_weight full_sft: {tmp_path / 'out' / 'full_sft_32.pth'} does not "
                                 f"exist")):
        result = train("train_lora.py", None, run_args(tmp_path, sft_data, *flags), tmp_path, check=False)
        assert result.returncode == 2 and result.stderr.startswith(expected), result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("lora_*"))


def losses(trace: list[dict]) -> dict[int, list[str]]:
    """{step: each rank's loss, as text}: a skipped step's NaN compares equal to itself."""
    by_step = collections.defaultdict(list)
    for record in sorted(trace, key=lambda r: (r["step"], r["rank"])):
        by_step[record["step"]].append(repr(record["loss"]))
    return dict(by_step)


# A few targets, so that the files' names say which; a high LR, so that 6 steps move B visibly.
LORA = ["--batch_size", "2", "--epochs", "1", "--save_interval", "2", "--keep_last", "2", "--lora_rank", "4",
        "--lora_targets", "v_proj,q_proj,down_proj", "--learning_rate", "1e-2", "--debug_inject", "nan:5"]


def test_lora_resumes_bit_identically_saves_the_adapter_alone_verified_and_refuses_another_base(tmp_path, sft_data):
    """One process: 7 steps straight, and 3 + 4 with a resume between them, both meeting an injected NaN at step
    5 (skipped by the anomaly guard) and the second logging to wandb offline. Then the same run refuses to
    resume on a base file that changed."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    for run in (straight, split):
        base = write_base(run / "out", tiny_config())
    base_sha256 = sha256_of(base)
    tracked, env = ["--logger", "console,file,wandb"], dict(WANDB_DIR=tmp_path)
    train("train_lora.py", None, run_args(straight, sft_data, *LORA, "--max_steps", "7"), tmp_path)
    train("train_lora.py", None, run_args(split, sft_data, *LORA, *tracked, "--max_steps", "3"), tmp_path, **env)
    first_ids = resume_file(split, NAME)["tracker_ids"]
    train("train_lora.py", None, run_args(split, sft_data, *LORA, *tracked, "--max_steps", "4", "--from_resume", "1"),
          tmp_path, **env)

    # Bit-identical: adapter weights, AdamW state, RNG, position; every step's loss; step 5 skipped in both.
    state = resume_file(split, NAME)
    assert_states_equal(resume_file(straight, NAME), state)
    assert losses(trace_of(straight)) == losses(trace_of(split)) and len(losses(trace_of(split))) == 7
    assert [r["step"] for r in trace_of(split) if r.get("skipped")] == [5]
    assert events_of(split, NAME) == [("resume", 3), ("anomaly", 5)]
    assert [r["step"] for r in metrics_of(split, NAME) if "loss" in r] == list(range(1, 8))
    assert (status_of(split, NAME)["status"], status_of(split, NAME)["current_step"]) == ("stopped", 7)

    # The adapter alone: FP32 with its AdamW state in the checkpoint, FP16 in out/; the base untouched.
    adapted = [f"model.layers.{i}.{where}.lora_{m}.weight" for i in range(2)
               for where in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj") for m in "AB"]
    assert sorted(state["model"]) == sorted(adapted) and {t.dtype for t in state["model"].values()} == {torch.float32}
    assert len(state["optimizer"]["state"]) == len(adapted)
    out = torch.load(split / "out" / f"{NAME}.pth", weights_only=True)
    assert out.keys() == state["model"].keys() and all(torch.equal(out[k], t.half()) for k, t in state["model"].items())
    assert any(t.abs().max() > 0 for k, t in state["model"].items() if "lora_B" in k), "B never left zero"
    assert json.loads((split / "out" / f"{NAME}.json").read_text()) == {
        "max_seq_len": 48, "lora_rank": 4, "lora_alpha": 16.0, "lora_targets": "q_proj,v_proj,down_proj",
        "base_file": str(base), "base_sha256": base_sha256, "tokenizer_vocab_sha256": vocab_sha256(DEFAULT_TOKENIZER)}
    assert sha256_of(base) == base_sha256

    # Verified and rotated: saves at 2, 3 (the first stop), 4, 6 and 7; the newest two are kept, and verify.
    kept = RunFiles(split / "ckpt", NAME).history()
    assert [p.name for p in kept] == ["step_00000007.pth", "step_00000006.pth"]
    assert [verify(p) for p in kept] == [None, None]
    resume_description = describe_checkpoint(split / "ckpt" / f"{NAME}_resume.pth")
    assert "integrity:        OK, verified against manifest lora_demo_32_history/step_00000007.pth.json" in \
        resume_description and "lora_targets=q_proj,v_proj,down_proj" in resume_description
    assert describe_checkpoint(split / "out" / f"{NAME}.pth").splitlines()[2:] == [  # its .json is no manifest
        "dtype:            float16", "parameters:       2,176",
        "LoRA adapter:     rank 4 in q_proj,v_proj,down_proj (alpha: the .json beside it); apply it with "
        "eval_model.py --lora, or merge it with scripts/export_hf.py --merge_lora"]

    # The tracker run goes on: one wandb run id, in both invocations' offline files.
    ids = state["tracker_ids"]
    assert ids == first_ids and ids["wandb"]
    runs = offline_runs(tmp_path / "wandb", "offline-run-*", wandb_offline_run)
    assert len(runs) == 2 and {(dir_id, file_id) for dir_id, file_id, _ in runs} == {(ids["wandb"], ids["wandb"])}

    write_base(split / "out", tiny_config(), seed=1)  # another base under the same name
    result = train("train_lora.py", None, run_args(split, sft_data, *LORA, "--from_resume", "1"), tmp_path,
                   check=False)
    assert result.returncode == 2 and "cannot resume" in result.stderr and "args.base_sha256: checkpoint has " \
        f"'{base_sha256}'" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert resume_file(split, NAME)["global_step"] == 7 and len(trace_of(split)) == 7


@SLOW
def test_lora_on_two_ranks_stopped_by_sigterm_then_resumed_on_three_then_one_trains_each_conversation_once(
        tmp_path, sft_data):
    write_base(tmp_path / "out", tiny_config())
    args = run_args(tmp_path, sft_data, "--batch_size", "1", "--epochs", "1")
    launcher = subprocess.Popen(launch_command("train_lora.py", 2, [*with_loader_workers(1), *args]), cwd=tmp_path,
                                env=slowed_env(step_delay_s=0.2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    trace, deadline = tmp_path / "trace.jsonl", time.time() + 120
    while (not trace.exists() or len(read_trace(trace)) < 6) and time.time() < deadline:
        time.sleep(0.2)
    workers = child_pids(launcher.pid)
    assert len(workers) == 2, "expected two worker processes under torchrun"
    for pid in workers + [pid for worker in workers for pid in child_pids(worker)]:  # the loaders too
        os.kill(pid, signal.SIGTERM)
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0 and "(SIGTERM)" in output, output
    stopped_at = resume_file(tmp_path, NAME)["global_step"]
    assert 3 <= stopped_at <= 10  # signalled after 3 steps at the earliest, long before the end (15 steps)
    assert (status_of(tmp_path, NAME)["status"], status_of(tmp_path, NAME)["current_step"]) == ("stopped", stopped_at)

    train("train_lora.py", 3, [*args, "--max_steps", "2", "--from_resume", "1"], tmp_path)
    train("train_lora.py", None, [*args, "--from_resume", "1"], tmp_path)
    records = trace_of(tmp_path)
    sizes = {r["step"]: r["world_size"] for r in records}
    consumed = 2 * stopped_at + 2 * 3  # then one conversation per step
    assert sizes == {s: 2 if s <= stopped_at else 3 if s <= stopped_at + 2 else 1
                     for s in range(1, stopped_at + 2 + 29 - consumed + 1)}
    assert_each_sample_once(records, num_samples=29, epochs=1)
    assert events_of(tmp_path, NAME) == [("resume", stopped_at), ("resume", stopped_at + 2)]
    assert status_of(tmp_path, NAME)["status"] == "completed"


@SLOW
def test_lora_resumed_on_two_ranks_is_bit_identical(tmp_path, sft_data):
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = [*LORA[:LORA.index("--debug_inject")], "--accumulation_steps", "2"]
    for run in (straight, split):
        write_base(run / "out", tiny_config())
    train("train_lora.py", 2, run_args(straight, sft_data, *common, "--max_steps", "3"), tmp_path)
    train("train_lora.py", 2, run_args(split, sft_data, *common, "--max_steps", "1"), tmp_path)
    train("train_lora.py", 2, run_args(split, sft_data, *common, "--max_steps", "2", "--from_resume", "1"), tmp_path)
    assert events_of(split, NAME) == [("resume", 1)]
    assert_states_equal(resume_file(straight, NAME), resume_file(split, NAME))
    assert losses(trace_of(straight)) == losses(trace_of(split)) and len(losses(trace_of(split))) == 3
    step_ranks = [(r["step"], r["rank"]) for r in trace_of(split)]
    assert len(step_ranks) == len(set(step_ranks)) == 6

"""End-to-end training with real processes: DDP pretraining, SFT from its weights, multi-node launch."""

from __future__ import annotations

import json
import subprocess

import torch

from conftest import REPO, TINY_MODEL, child_env, free_port, read_trace, train
from model.model import CausalLM, LMConfig
from trainer.trainer_utils import lm_checkpoint


def paths(tmp_path) -> list[str]:
    return ["--save_dir", str(tmp_path / "out"), "--checkpoint_dir", str(tmp_path / "ckpt"),
            "--metrics_dir", str(tmp_path / "out")]


def step_losses(trace_path) -> list[float]:
    """Global loss per step (the same number on every rank)."""
    by_step = {r["step"]: r["global_loss"] for r in read_trace(trace_path)}
    return [by_step[s] for s in sorted(by_step)]


def test_two_process_pretrain_loss_falls_and_writes_contract_files(tmp_path, pretrain_data):
    trace = tmp_path / "trace.jsonl"
    train("train_pretrain.py", 2, [*paths(tmp_path), "--data_path", str(pretrain_data), "--batch_size", "4",
                                   "--epochs", "6", "--learning_rate", "3e-3", "--save_debug_train_output",
                                   str(trace)], tmp_path)
    losses = step_losses(trace)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.0, f"loss did not fall: {first:.3f} -> {last:.3f}"
    weights = torch.load(tmp_path / "out" / "pretrain_32.pth", weights_only=True)
    assert all(t.dtype == torch.float16 for t in weights.values())
    state = torch.load(tmp_path / "ckpt" / "pretrain_32_resume.pth", weights_only=True)
    assert all(t.dtype == torch.float32 for t in state["model"].values())
    assert state["world_size"] == 2 and state["epoch"] == 6


def test_sft_starts_from_pretrain_weights_and_refuses_a_missing_file(tmp_path, pretrain_data, sft_data):
    result = train("train_full_sft.py", None, [*paths(tmp_path), "--data_path", str(sft_data)], tmp_path,
                   check=False)
    assert result.returncode != 0 and "pretrain_32.pth does not exist" in result.stderr
    train("train_pretrain.py", None, [*paths(tmp_path), "--data_path", str(pretrain_data), "--max_steps", "2"],
          tmp_path)
    trace = tmp_path / "sft_trace.jsonl"
    result = train("train_full_sft.py", None, [*paths(tmp_path), "--data_path", str(sft_data), "--batch_size", "4",
                                               "--save_debug_train_output", str(trace)], tmp_path)
    assert "loaded initial weights from" in result.stdout and "pretrain_32.pth" in result.stdout
    assert (tmp_path / "out" / "full_sft_32.pth").is_file()
    # SFT trains only on assistant tokens: every step had some, and fewer than the whole sequences.
    assert all(0 < r["local_tokens"] for r in read_trace(trace))


def test_sft_refuses_pretrain_weights_of_another_size(tmp_path, pretrain_data, sft_data):
    train("train_pretrain.py", None, [*paths(tmp_path), "--data_path", str(pretrain_data), "--max_steps", "1"],
          tmp_path)
    result = train("train_full_sft.py", None, [*paths(tmp_path), "--data_path", str(sft_data),
                                               "--num_hidden_layers", "3"], tmp_path, check=False)
    assert result.returncode != 0 and "does not fit the model built from the flags" in result.stderr


def test_lm_checkpoint_round_trip(tmp_path):
    config = LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2)
    model = CausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    optimizer.step()
    lm_checkpoint(config, weight="demo", model=model, optimizer=optimizer, epoch=1, step=5,
                  save_dir=str(tmp_path / "out"), checkpoint_dir=str(tmp_path / "ckpt"), samples_consumed=40,
                  global_step=17, train_args={"batch_size": 8}, data_fingerprint={"lines": 100})
    state = lm_checkpoint(config, weight="demo", checkpoint_dir=str(tmp_path / "ckpt"), log=lambda m: None)
    assert (state["epoch"], state["step"], state["global_step"], state["samples_consumed"]) == (1, 5, 17, 40)
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value)  # FP32 master weights, bit for bit
    restored = torch.optim.AdamW(CausalLM(config).parameters())
    restored.load_state_dict(state["optimizer"])
    assert torch.equal(restored.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    fp16 = torch.load(tmp_path / "out" / "demo_32.pth", weights_only=True)
    assert fp16["model.embed_tokens.weight"].dtype == torch.float16
    # With a different geometry the step is re-derived from the sample cursor: 40 of 100 at 16/step.
    rescaled = lm_checkpoint(config, weight="demo", checkpoint_dir=str(tmp_path / "ckpt"), num_samples=100,
                             global_batch=16, log=lambda m: None)
    # 100 samples at 16 per step: 7 steps an epoch, 4 left from sample 40, so this is step 3.
    assert rescaled["step"] == 3 and rescaled["samples_consumed"] == 40


def test_two_node_launch_on_loopback_trains(tmp_path, pretrain_data):
    """Two torchrun launchers (one per "node") meet through the c10d rendezvous on 127.0.0.1."""
    port = free_port()
    trace = tmp_path / "trace.jsonl"
    args = [*TINY_MODEL, *paths(tmp_path), "--data_path", str(pretrain_data), "--batch_size", "2",
            "--max_steps", "4", "--save_debug_train_output", str(trace)]
    launchers = [subprocess.Popen(
        ["python", "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "loopback-test",
         str(REPO / "trainer" / "train_pretrain.py"), *args],
        cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    outputs = [p.communicate(timeout=240)[0] for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(outputs)
    records = read_trace(trace)
    assert {r["world_size"] for r in records} == {2} and {r["rank"] for r in records} == {0, 1}
    assert max(r["step"] for r in records) == 4
    ranks_samples = [set(s for r in records if r["rank"] == rank for s in r["samples"]) for rank in (0, 1)]
    assert not ranks_samples[0] & ranks_samples[1], "the two nodes trained overlapping samples"


def test_validation_loss_is_logged_every_eval_interval_and_at_the_last_step(tmp_path, pretrain_data):
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(pretrain_data.read_text().splitlines()[:7]) + "\n")
    train("train_pretrain.py", 2, [*paths(tmp_path), "--data_path", str(pretrain_data), "--batch_size", "4",
                                   "--val_data", str(val), "--eval_interval", "2"], tmp_path)
    records = [json.loads(line) for line in (tmp_path / "out" / "pretrain_32_metrics.jsonl").read_text().splitlines()]
    val_steps = [r["step"] for r in records if "val/loss" in r]
    assert val_steps == [2, 4, 5]  # 37 samples / global batch 8 = 5 steps; the last one is always validated
    assert all(0 < r["val/loss"] < 20 for r in records if "val/loss" in r)


def test_save_hf_writes_a_transformers_directory_at_each_save(tmp_path, pretrain_data):
    train("train_pretrain.py", None, [*paths(tmp_path), "--data_path", str(pretrain_data), "--max_steps", "2",
                                      "--save_hf", "1"], tmp_path)
    hf_dir = tmp_path / "out" / "pretrain_32_hf"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in hf_dir.iterdir()}
    assert json.loads((hf_dir / "config.json").read_text())["hidden_size"] == 32

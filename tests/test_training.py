"""End-to-end training with real processes: DDP pretraining, SFT from its weights, multi-node launch."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from conftest import (REPO, TINY_MODEL, child_env, free_port, metrics_of, resume_file, run_args, trace_of, train)
from dataset.lm_dataset import SFTDataset
from model.model import CausalLM, LMConfig
from model.tokenizer import PAD_ID, load_tokenizer
from trainer.hardening.checkpoint_io import RunFiles, save_verified
from trainer.hardening.resume_checks import ConfigError
from trainer.trainer_utils import Position, RunSpec, epoch_order, lm_checkpoint, load_checkpoint


def step_losses(trace: list[dict]) -> list[float]:
    """Global loss per step (the same number on every rank)."""
    by_step = {r["step"]: r["global_loss"] for r in trace}
    return [by_step[s] for s in sorted(by_step)]


def test_two_process_pretrain_loss_falls_and_writes_contract_files(tmp_path, pretrain_data):
    train("train_pretrain.py", 2, run_args(tmp_path, pretrain_data, "--batch_size", "4", "--epochs", "6",
                                           "--learning_rate", "3e-3"), tmp_path)
    losses = step_losses(trace_of(tmp_path))
    assert len(losses) == 6 * 5  # 37 samples / global batch 8 = 5 steps an epoch
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.0, f"loss did not fall: {first:.3f} -> {last:.3f}"
    weights = torch.load(tmp_path / "out" / "pretrain_32.pth", weights_only=True)
    assert all(t.dtype == torch.float16 for t in weights.values())
    state = resume_file(tmp_path)
    assert all(t.dtype == torch.float32 for t in state["model"].values())
    assert state["model"].keys() == weights.keys()
    for key, master in state["model"].items():  # the FP16 file is the rounded FP32 master weights
        assert torch.equal(weights[key], master.half()), key
    assert (state["world_size"], state["epoch"], state["global_step"]) == (2, 6, 30)


def test_sft_refuses_a_missing_or_misfit_pretrain_file_then_starts_from_it(tmp_path, pretrain_data, sft_data):
    result = train("train_full_sft.py", None, run_args(tmp_path, sft_data), tmp_path, check=False)
    assert result.returncode != 0 and "pretrain_32.pth does not exist" in result.stderr
    train("train_pretrain.py", None, run_args(tmp_path / "pre", pretrain_data, "--max_steps", "2",
                                              "--save_dir", str(tmp_path / "out")), tmp_path)
    # Weights of another size: one message naming the file and both shapes, exit 2, nothing written.
    result = train("train_full_sft.py", None, run_args(tmp_path, sft_data, "--num_hidden_layers", "3"), tmp_path,
                   check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr and result.stderr.startswith("error: ")
    assert "pretrain_32.pth does not fit" in result.stderr
    assert "num_hidden_layers: file has 2" in result.stderr and "--num_hidden_layers asks 3" in result.stderr
    assert not (tmp_path / "out" / "full_sft_32.pth").exists()
    # With a learning rate of 0 the optimizer changes nothing, so the SFT weights are the weights it started from.
    train("train_full_sft.py", None, run_args(tmp_path, sft_data, "--batch_size", "4", "--max_steps", "2",
                                              "--learning_rate", "0"), tmp_path)
    pretrained = torch.load(tmp_path / "out" / "pretrain_32.pth", weights_only=True)
    fine_tuned = torch.load(tmp_path / "out" / "full_sft_32.pth", weights_only=True)
    assert pretrained.keys() == fine_tuned.keys()
    assert all(torch.equal(pretrained[k], fine_tuned[k]) for k in pretrained)


def test_sft_trains_only_on_the_assistant_tokens(tmp_path, sft_data):
    train("train_full_sft.py", None,
          run_args(tmp_path, sft_data, "--batch_size", "4", "--epochs", "1", "--from_weight", "none"), tmp_path)
    max_seq_len = int(TINY_MODEL[TINY_MODEL.index("--max_seq_len") + 1])
    dataset = SFTDataset(sft_data, load_tokenizer(), max_seq_len)
    trace = trace_of(tmp_path)
    assert sorted(i for r in trace for i in r["samples"]) == list(range(len(dataset)))
    for record in trace:  # the loss counts exactly the assistant's tokens, a part of each conversation
        rows = [dataset[i] for i in record["samples"]]
        assistant = sum(int((labels[1:] != -100).sum()) for _, labels in rows)
        text = sum(int((ids[1:] != PAD_ID).sum()) for ids, _ in rows)
        assert record["local_tokens"] == assistant, f"step {record['step']}"
        assert 0 < assistant < text, f"step {record['step']}: {assistant} loss tokens of {text}"


def test_lm_checkpoint_round_trip(tmp_path):
    config = LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2)
    model = CausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    optimizer.step()
    settings = {"batch_size": 8, "accumulation_steps": 1, "global_batch_size": None, "world_size": 1, "seed": 42}
    run = RunSpec(settings=settings, data_fingerprint={"lines": 100}, num_samples=100,
                  global_batch=8, given_sizes={})
    at = Position(epoch=1, samples_consumed=40, global_step=17)
    kept = lm_checkpoint(config, "demo", model, optimizer, position=at, run=run, save_dir=str(tmp_path / "out"),
                         checkpoint_dir=str(tmp_path / "ckpt"))
    state = load_checkpoint(config, "demo", str(tmp_path / "ckpt"), run)
    assert (state["epoch"], state["global_step"], state["samples_consumed"]) == (1, 17, 40) and "step" not in state
    assert state["train_args"] == run.settings and state["data_fingerprint"] == run.data_fingerprint
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value)  # FP32 master weights, bit for bit
    restored = torch.optim.AdamW(CausalLM(config).parameters())
    restored.load_state_dict(state["optimizer"])
    assert torch.equal(restored.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    fp16 = torch.load(tmp_path / "out" / "demo_32.pth", weights_only=True)
    assert fp16["model.embed_tokens.weight"].dtype == torch.float16
    # On another global batch the position is the same sample cursor: no step label is rescaled.
    other_batch = run._replace(global_batch=16)
    assert load_checkpoint(config, "demo", str(tmp_path / "ckpt"), other_batch)["samples_consumed"] == 40
    # A file of an earlier version also holds a "step" label (its steps into the epoch): it still resumes.
    earlier = {**torch.load(kept, weights_only=True), "step": 5, "global_step": 18}
    save_verified(RunFiles(tmp_path / "ckpt", "demo_32"), earlier, 18, 2, {"epoch": 1, "global_step": 18})
    assert load_checkpoint(config, "demo", str(tmp_path / "ckpt"), run)["global_step"] == 18
    # The epoch's order as the saving torch drew it: another torch.randperm would repeat and skip samples.
    assert state["order_head"] == epoch_order(42, 1, 100)[:8].tolist()
    other_torch = {**torch.load(kept, weights_only=True), "order_head": epoch_order(42, 1, 100)[8:16].tolist()}
    save_verified(RunFiles(tmp_path / "ckpt", "demo_32"), other_torch, 19, 2, {"epoch": 1, "global_step": 19})
    with pytest.raises(ConfigError, match="orders the epoch's samples otherwise than the torch that saved it"):
        load_checkpoint(config, "demo", str(tmp_path / "ckpt"), run)


def test_lm_checkpoint_refuses_minimind_positional_epoch_and_step(tmp_path):
    """minimind's call, lm_checkpoint(config, weight, model, optimizer, epoch, step, wandb, ...), would save no
    sample cursor (a resume would train the epoch again): the position is required, by name."""
    config = LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2)
    model = CausalLM(config)
    with pytest.raises(TypeError):
        lm_checkpoint(config, "demo", model, torch.optim.AdamW(model.parameters()), 1, 5, None,
                      str(tmp_path / "out"), str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_two_node_launch_on_loopback_trains(tmp_path, pretrain_data):
    """Two torchrun launchers (one per "node") meet through the c10d rendezvous on 127.0.0.1."""
    port = free_port()
    args = [*TINY_MODEL, *run_args(tmp_path, pretrain_data, "--batch_size", "2", "--max_steps", "4")]
    launchers = [subprocess.Popen(
        ["python", "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "loopback-test",
         str(REPO / "trainer" / "train_pretrain.py"), *args],
        cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    outputs = [p.communicate(timeout=240)[0] for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(outputs)
    records = trace_of(tmp_path)
    assert {r["world_size"] for r in records} == {2} and {r["rank"] for r in records} == {0, 1}
    assert max(r["step"] for r in records) == 4
    ranks_samples = [set(s for r in records if r["rank"] == rank for s in r["samples"]) for rank in (0, 1)]
    assert not ranks_samples[0] & ranks_samples[1], "the two nodes trained overlapping samples"


def test_validation_loss_is_logged_every_eval_interval_and_at_the_last_step(tmp_path, pretrain_data):
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(pretrain_data.read_text().splitlines()[:7]) + "\n")
    train("train_pretrain.py", 2, run_args(tmp_path, pretrain_data, "--batch_size", "4", "--val_data", str(val),
                                           "--eval_interval", "2"), tmp_path)
    records = metrics_of(tmp_path)
    val_steps = [r["step"] for r in records if "val/loss" in r]
    assert val_steps == [2, 4, 5]  # 37 samples / global batch 8 = 5 steps; the last one is always validated
    assert all(0 < r["val/loss"] < 20 for r in records if "val/loss" in r)


def test_save_hf_writes_a_transformers_directory_at_each_save(tmp_path, pretrain_data):
    train("train_pretrain.py", None, run_args(tmp_path, pretrain_data, "--max_steps", "2", "--save_hf", "1"), tmp_path)
    hf_dir = tmp_path / "out" / "pretrain_32_hf"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in hf_dir.iterdir()}
    assert json.loads((hf_dir / "config.json").read_text())["hidden_size"] == 32

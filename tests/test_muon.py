"""--optimizer muon (trainer_utils.make_optimizer): Muon for the attention and MLP projections, AdamW for the
embedding and norms; its state in `_resume.pth`, a bit-identical resume, a resume with the other optimizer and
--parallel fsdp refused in one line, a Muon-trained model loaded by LoRA, its memory counted."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from conftest import (assert_each_sample_once, assert_states_equal, resume_file, run_args, trace_of, train)

from model.model import CausalLM, LMConfig
from trainer.hardening.optimizer_checks import check_optimizer_flags, muon_matrix_parameters
from trainer.hardening.resume_checks import ConfigError
from trainer.trainer_utils import Muon, MuonAndAdamW, make_optimizer, newton_schulz

MUON = ["--optimizer", "muon", "--muon_learning_rate", "4e-3"]


def muon_args(**changed) -> argparse.Namespace:
    return argparse.Namespace(**{"optimizer": "muon", "learning_rate": 1e-3, "muon_learning_rate": 4e-3,
                                 "weight_decay": 0.01, "muon_weight_decay": 0.01, **changed})


@pytest.mark.parametrize("use_moe", [False, True])
def test_muon_takes_the_projections_adamw_the_embedding_norms_and_router_and_the_memory_check_counts_them(use_moe):
    config = LMConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=64, use_moe=use_moe, num_experts=2)
    model = CausalLM(config)
    optimizer = make_optimizer(model, muon_args())
    assert isinstance(optimizer, MuonAndAdamW)
    names = {id(p): name for name, p in model.named_parameters()}
    on_muon = sorted(names[id(p)] for group in optimizer.muon.param_groups for p in group["params"])
    on_adamw = sorted(names[id(p)] for group in optimizer.adamw.param_groups for p in group["params"])
    assert on_muon and all(name.endswith("_proj.weight") for name in on_muon)
    assert "model.embed_tokens.weight" in on_adamw and not any(name.endswith("_proj.weight") for name in on_adamw)
    assert any(name.endswith("mlp.gate.weight") for name in on_adamw) == use_moe  # the MoE router: AdamW's
    assert len(on_muon) + len(on_adamw) == len(names)  # every parameter once (the tied head is the embedding)
    # flag_checks.check_fits_in_memory: 4 bytes fewer for each parameter Muon trains, counted from the sizes
    assert muon_matrix_parameters(config, muon_args()) == sum(
        p.numel() for group in optimizer.muon.param_groups for p in group["params"])
    assert muon_matrix_parameters(config, muon_args(optimizer="adamw")) == 0

    for group in optimizer.param_groups:  # the scripts' line: one schedule, Muon's group scaled by 4e-3 / 1e-3
        group["lr"] = 5e-4 * group.get("lr_ratio", 1.0)
    assert [g["lr"] for g in optimizer.adamw.param_groups] == [5e-4]
    assert [g["lr"] for g in optimizer.muon.param_groups] == [pytest.approx(2e-3)]


@pytest.mark.parametrize("shape", [(32, 64), (64, 32)])
def test_muons_update_is_the_gradient_with_its_singular_values_brought_near_one(shape):
    torch.manual_seed(0)
    left, _ = torch.linalg.qr(torch.randn(shape[0], shape[0]))
    right, _ = torch.linalg.qr(torch.randn(shape[1], shape[1]))
    k = min(shape)
    gradient = left[:, :k] @ torch.diag(torch.logspace(0, -2, k)) @ right[:, :k].T  # singular values 1 .. 0.01
    weight = torch.nn.Parameter(torch.zeros(shape))
    weight.grad = gradient.clone()
    # the first step, from zero momentum and without decay: the momentum is a multiple of the gradient
    Muon([weight], lr=1e-2, weight_decay=0.0, adjust_lr_fn="match_rms_adamw").step()
    update = -weight.detach() / (1e-2 * 0.2 * max(shape) ** 0.5)  # match_rms_adamw: lr x 0.2 sqrt(max(A, B))
    torch.testing.assert_close(update, newton_schulz(gradient, 5, torch.float32))  # on a CPU: in float32
    singular = torch.linalg.svdvals(update)
    assert 0.6 < singular.min() and singular.max() < 1.2, singular  # 100x apart in the gradient, < 2x here
    in_the_gradients_basis = left[:, :k].T @ update @ right[:, :k]  # diagonal: the same singular vectors
    off_diagonal = in_the_gradients_basis - torch.diag(in_the_gradients_basis.diagonal())
    assert off_diagonal.abs().max() < 0.03 and 0.6 < in_the_gradients_basis.diagonal().min()


def muon_steps(optimizer_class, weights, gradients, **options) -> torch.optim.Optimizer:
    optimizer = optimizer_class(weights, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", **options)
    for step_gradients in gradients:
        for weight, gradient in zip(weights, step_gradients):
            weight.grad = gradient.clone()
        optimizer.step()
    return optimizer


def test_muons_step_is_torchs_op_for_op_with_newton_schulz_in_float32_on_a_cpu(monkeypatch):
    torch.manual_seed(0)
    start = [torch.randn(48, 16), torch.randn(16, 48), torch.randn(32, 32)]
    gradients = [[torch.randn_like(w) for w in start] for _ in range(3)]  # three steps: momentum, decay, Nesterov
    for nesterov in (True, False):
        theirs = [torch.nn.Parameter(w.clone()) for w in start]
        torchs = muon_steps(torch.optim.Muon, theirs, gradients, nesterov=nesterov)
        ours = [torch.nn.Parameter(w.clone()) for w in start]
        with monkeypatch.context() as patch:
            patch.setattr(Muon, "cpu_dtype", torch.bfloat16)  # Newton-Schulz in torch's dtype: the same bits
            muon_steps(Muon, ours, gradients, nesterov=nesterov)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
        in_float32 = [torch.nn.Parameter(w.clone()) for w in start]
        float32 = muon_steps(Muon, in_float32, gradients, nesterov=nesterov)
        moved = [(a - w).abs().max().item() for a, w in zip(in_float32, start)]
        off = [(a - b).abs().max().item() for a, b in zip(in_float32, theirs)]
        assert all(o < 0.03 * m for o, m in zip(off, moved)), (off, moved)  # bfloat16's rounding, no more
        assert all(o > 0 for o in off)  # (in float32 indeed)
        # the same state: a checkpoint of one resumes in the other
        torchs.load_state_dict(float32.state_dict())
        assert all(torch.equal(torchs.state[a]["momentum_buffer"], float32.state[b]["momentum_buffer"])
                   for a, b in zip(theirs, in_float32))


def test_muon_lowers_the_loss_and_a_non_finite_gradient_skips_both_optimizers():
    torch.manual_seed(0)
    model = CausalLM(LMConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              vocab_size=64))
    optimizer = make_optimizer(model, muon_args(learning_rate=3e-3, muon_learning_rate=3e-3))
    batch = torch.randint(0, 64, (4, 16))
    losses = []
    for _ in range(15):
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses

    # trainer_utils.optimizer_step sets found_inf where the gradient norm is not finite: neither optimizer steps
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = {k: v.clone() for k, v in optimizer.muon.state[model.model.layers[0].self_attn.q_proj.weight]
                    .items()}
    model(batch, labels=batch).loss.backward()
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    del optimizer.found_inf
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    after = optimizer.muon.state[model.model.layers[0].self_attn.q_proj.weight]
    assert all(torch.equal(state_before[k], after[k]) for k in state_before)


def test_muon_resumes_bit_identically_keeps_its_state_and_a_resume_with_adamw_is_refused_naming_both(
        tmp_path, pretrain_data):
    common = ["--batch_size", "2", "--accumulation_steps", "2", "--epochs", "1", *MUON]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train("train_pretrain.py", None, run_args(straight, pretrain_data, *common, "--max_steps", "5"), tmp_path)
    train("train_pretrain.py", None, run_args(split, pretrain_data, *common, "--max_steps", "2"), tmp_path)
    train("train_pretrain.py", None, run_args(split, pretrain_data, *common, "--max_steps", "3", "--from_resume", "1"),
          tmp_path)
    saved = resume_file(split)
    assert set(saved["optimizer"]) == {"adamw", "muon"}
    assert all(set(s) == {"momentum_buffer"} for s in saved["optimizer"]["muon"]["state"].values())
    assert_states_equal(resume_file(straight), saved)
    assert [r["loss"] for r in trace_of(straight)] == [r["loss"] for r in trace_of(split)]

    adamw = [arg for arg in common if arg not in MUON]
    refused = train("train_pretrain.py", None, run_args(split, pretrain_data, *adamw, "--from_resume", "1"),
                    tmp_path, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "args.optimizer: checkpoint has 'muon', this run has 'adamw'" in refused.stderr


def test_muon_under_fsdp_is_refused_in_one_line(tmp_path, pretrain_data):
    result = train("train_pretrain.py", None, run_args(tmp_path, pretrain_data, *MUON, "--parallel", "fsdp"),
                   tmp_path, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --optimizer muon with --parallel fsdp: Muon needs each matrix whole and an FSDP rank holds a slice; "
        "use --parallel ddp or --optimizer adamw"]


def test_muon_on_a_torch_without_it_is_refused_naming_the_version_that_has_it(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")  # torch before 2.9
    with pytest.raises(ConfigError, match=r"^--optimizer muon: needs torch.optim.Muon, in PyTorch >= 2.9 \(this is "):
        check_optimizer_flags(muon_args(parallel="ddp"))
    check_optimizer_flags(muon_args(optimizer="adamw", parallel="ddp"))  # AdamW runs on any torch


def test_muon_with_a_zero_learning_rate_is_refused_as_its_lr_is_a_multiple_of_it():
    with pytest.raises(ConfigError, match=r"^--optimizer muon with --learning_rate 0: Muon's LR follows the schedule"):
        check_optimizer_flags(muon_args(parallel="ddp", learning_rate=0.0))
    args = muon_args(parallel="ddp", muon_learning_rate=None)
    check_optimizer_flags(args)
    assert args.muon_learning_rate == args.learning_rate  # Muon's LR defaults to --learning_rate


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="two training runs; set TRAINER_SLOW_TESTS=1 to run it (.ci/run does)")
def test_a_model_fine_tuned_with_muon_loads_in_lora(tmp_path, sft_data):
    flags = ["--batch_size", "2", "--max_steps", "2"]
    train("train_full_sft.py", None, run_args(tmp_path / "sft", sft_data, *flags, *MUON, "--from_weight", "none"),
          tmp_path)
    lora = run_args(tmp_path / "lora", sft_data, *flags, "--save_dir", str(tmp_path / "sft" / "out"))
    result = train("train_lora.py", None, lora, tmp_path)
    assert (tmp_path / "sft" / "out" / "lora_demo_32.pth").exists(), result.stdout


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="about 70 s on two shared CPU cores (6 ranks in all); set TRAINER_SLOW_TESTS=1 to run it")
def test_muon_resumed_on_two_then_three_then_one_rank_trains_each_sample_once(tmp_path, pretrain_data):
    common = run_args(tmp_path, pretrain_data, "--batch_size", "2", "--epochs", "2", *MUON)
    train("train_pretrain.py", 2, [*common, "--max_steps", "5"], tmp_path)
    train("train_pretrain.py", 3, [*common, "--max_steps", "5", "--from_resume", "1"], tmp_path)
    train("train_pretrain.py", None, [*common, "--from_resume", "1"], tmp_path)
    assert_each_sample_once(trace_of(tmp_path), num_samples=37, epochs=2)
    final = resume_file(tmp_path)
    assert set(final["optimizer"]) == {"adamw", "muon"} and (final["epoch"], final["samples_consumed"]) == (2, 0)

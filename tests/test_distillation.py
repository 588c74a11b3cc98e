"""Distillation's loss in one process: alpha * CE + (1 - alpha) * T^2 * KL(teacher_T || student_T) on the labelled
tokens, against a computation by hand, torch.nn.functional.kl_div and TRL's GKD loss; its cross-entropy is SFT's;
the teacher frozen and its memory counted. The trainer's guarantees with real processes: test_distillation_runs.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from model.model import CausalLM, LMConfig
from trainer.hardening.flag_checks import check_fits_in_memory
from trainer.hardening.resume_checks import ConfigError
from trainer.train_distillation import distillation_loss

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def logits_and_labels(seed: int = 0, rows: int = 3, length: int = 6, vocab: int = 7):
    """float64 student and teacher logits [rows, length, vocab] and labels with -100 on about a third of them."""
    generator = torch.Generator().manual_seed(seed)
    student = 3 * torch.randn(rows, length, vocab, generator=generator, dtype=torch.float64)
    teacher = 3 * torch.randn(rows, length, vocab, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows, length), generator=generator)
    labels[torch.rand(rows, length, generator=generator) < 0.35] = -100
    labels[:, 1] = 0  # every row has a labelled token
    return student, teacher, labels


def by_hand(student, teacher, labels, alpha: float, temperature: float) -> float:
    """The loss with Python's floats, position by position: position t predicts labels[t + 1]."""
    def softmax(row, t):
        exps = [math.exp(v / t) for v in row]
        return [e / sum(exps) for e in exps]
    total = 0.0
    for r in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[r, t + 1])
            if target == -100:
                continue
            s, p = student[r, t].tolist(), teacher[r, t].tolist()
            cross_entropy = -math.log(softmax(s, 1.0)[target])
            p_t, q_t = softmax(p, temperature), softmax(s, temperature)
            kl = sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in zip(p_t, q_t))
            total += alpha * cross_entropy + (1 - alpha) * temperature ** 2 * kl
    return total


@pytest.mark.parametrize("alpha, temperature", [(0.5, 2.0), (0.0, 1.0), (1.0, 3.0), (0.2, 0.7)])
def test_the_loss_is_the_hand_computation_and_torchs_kl_div_on_the_labelled_tokens(alpha, temperature):
    student, teacher, labels = logits_and_labels()
    loss, (cross_entropy_part, kl_part) = distillation_loss(student, teacher, labels, alpha, temperature)
    ours = float(loss)
    assert abs(ours - by_hand(student, teacher, labels, alpha, temperature)) < 1e-12
    # torch: kl_div(input = the student's log q, target = the teacher's log p) is sum p (log p - log q) = KL(p || q)
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    kl = F.kl_div(F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1),
                  reduction="none", log_target=True).sum(-1)[targets != -100].sum()
    cross_entropy = F.cross_entropy(student.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    assert abs(ours - float(alpha * cross_entropy + (1 - alpha) * temperature ** 2 * kl)) < 1e-12
    # The parts the log line shows: the loss's cross-entropy and KL sums, unweighted
    assert abs(float(cross_entropy_part) - by_hand(student, teacher, labels, 1.0, temperature)) < 1e-12
    assert abs(float(kl_part) - by_hand(student, teacher, labels, 0.0, temperature) / temperature ** 2) < 1e-12


def test_a_teacher_equal_to_the_student_adds_no_kl_and_unlabelled_tokens_add_nothing():
    student, teacher, labels = logits_and_labels(seed=1)
    assert float(distillation_loss(student, student, labels, 0.0, 2.0)[0]) == pytest.approx(0.0, abs=1e-12)
    unlabelled = torch.full_like(labels, -100)
    loss, _ = distillation_loss(student.requires_grad_(), teacher, unlabelled, 0.5, 2.0)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(student.grad.abs().sum()) == 0.0


def test_with_alpha_one_it_is_sfts_summed_cross_entropy_and_the_teacher_gets_no_gradient():
    torch.manual_seed(0)
    student, teacher = CausalLM(LMConfig(vocab_size=50, **TINY)), CausalLM(LMConfig(vocab_size=50, **{**TINY,
                                                                                           "num_hidden_layers": 3}))
    teacher.requires_grad_(False)
    input_ids = torch.randint(0, 50, (2, 9))
    labels = input_ids.clone()
    labels[:, :4] = -100  # the prompt
    sft = student(input_ids, labels=labels, loss_reduction="sum").loss
    with torch.no_grad():
        target = teacher(input_ids).logits
    ours, _ = distillation_loss(student(input_ids).logits, target, labels, 1.0, 2.0)
    assert float(ours) == pytest.approx(float(sft), rel=1e-6)
    distillation_loss(student(input_ids).logits, target, labels, 0.5, 2.0)[0].backward()
    assert all(p.grad is None for p in teacher.parameters()) and all(p.grad is not None for p in student.parameters())


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="importing TRL (transformers' Trainer) takes about 14 s; set TRAINER_SLOW_TESTS=1 to run it")
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_kl_part_is_trls_gkd_loss_with_beta_0(temperature):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer  # trl==1.16.0 (requirements.txt)
    student, teacher, labels = logits_and_labels(seed=2, rows=4, length=8, vocab=11)
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # TRL's labels sit on the positions that predict them
    # beta = 0: TRL's generalized JSD is kl_div(student, teacher) = KL(teacher_T || student_T), per labelled token
    trl = GKDTrainer.generalized_jsd_loss(student, teacher, labels=targets, beta=0, temperature=temperature)
    ours = distillation_loss(student, teacher, labels, 0.0, temperature)[0] / temperature ** 2
    assert abs(float(ours / (targets != -100).sum()) - float(trl)) < 1e-12  # TRL means over its tokens
    # Normalised by a larger batch's token count (num_items_in_batch), as the loop divides by the global batch's
    trl_global = GKDTrainer.generalized_jsd_loss(student, teacher, labels=targets, beta=0, temperature=temperature,
                                                 num_items_in_batch=100)
    assert abs(float(ours / 100) - float(trl_global)) < 1e-12


def test_the_teachers_weights_and_logits_are_counted_in_the_memory_check(tmp_path):
    # A sparse file of 2**42 bytes: its fp32 weights (twice the fp16 file) fit no machine, while the student does.
    (tmp_path / "out").mkdir()
    with open(tmp_path / "out" / "huge_32.pth", "wb") as f:
        f.truncate(2**42)
    args = SimpleNamespace(device="cpu", parallel="ddp", batch_size=1, max_seq_len=8, teacher_weight="huge",
                           teacher_hidden_size=None, hidden_size=32, save_dir=str(tmp_path / "out"), lora_rank=None)
    config = LMConfig(vocab_size=50, **TINY)
    with pytest.raises(ConfigError, match=r"^--teacher_weight huge: the teacher .*huge_32\.pth needs at least "
                                          r"8,192\.0 GiB .* beside the student's"):
        check_fits_in_memory(config, args)
    check_fits_in_memory(config, SimpleNamespace(**{**vars(args), "teacher_weight": None}))  # the student alone fits
    Path(tmp_path / "out" / "huge_32.pth").unlink()
    check_fits_in_memory(config, args)  # a small teacher's logits fit too

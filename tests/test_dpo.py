"""DPO in one process: the pairs as the loop reads them, each bad line refused before training, the loss equal
to TRL's, a placeholder pair that adds nothing, and eval_model.py's pair scores. The trainer's guarantees
with real python/torchrun processes are in tests/test_dpo_runs.py.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import eval_model
from dataset.dpo_dataset import DPODataset
from dataset.jsonl_file import DataFileError
from dataset.lm_dataset import IGNORE_INDEX
from eval_choices import pair_logprobs, score_pairs
from model.model import CausalLM, LMConfig
from model.tokenizer import DEFAULT_TOKENIZER, PAD_ID, load_tokenizer
from trainer.train_dpo import dpo_loss, pair_losses, preference_validation, real_pairs

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n"
                            for r in records), encoding="utf-8")
    return path


def pair(question: str, chosen: str, rejected: str, before: list | None = None) -> dict:
    prompt = [*(before or []), {"role": "user", "content": question}]
    return {"chosen": prompt + [{"role": "assistant", "content": chosen}],
            "rejected": prompt + [{"role": "assistant", "content": rejected}]}


def sum_pairs(count: int) -> list[dict]:
    """`count` pairs: the right sum chosen, a wrong one rejected (every third with an earlier exchange)."""
    earlier = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    return [pair(f"{i}+{i + 1}?", str(2 * i + 1), str(2 * i + 3), earlier if i % 3 == 0 else None)
            for i in range(count)]


def write_reference(out_dir: Path, vocab_size: int, seed: int = 0, weight: str = "full_sft") -> Path:
    """A random TINY model's FP16 weights as `{weight}_32.pth`, as the SFT stage writes its out/ file."""
    torch.manual_seed(seed)
    model = CausalLM(LMConfig(vocab_size=vocab_size, **TINY))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{weight}_32.pth"
    torch.save({name: tensor.half() for name, tensor in model.state_dict().items()}, path)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_TOKENIZER)


# ---- the data --------------------------------------------------------------------------------

def test_a_pair_is_chosen_then_rejected_with_the_loss_on_the_last_answer_only(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "pairs.jsonl", [pair("3+4?", "7", "8", before=[
        {"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"}])])
    input_ids, labels = DPODataset(data, tokenizer, 96)[0]
    assert input_ids.shape == labels.shape == (2, 96)
    texts = []
    for row in range(2):
        trained = labels[row] != IGNORE_INDEX
        assert torch.equal(labels[row][trained], input_ids[row][trained])  # aligned: the model shifts them
        # One run of labels: the last answer, after its header; the earlier answer "2" is prompt.
        where = trained.nonzero().flatten()
        assert torch.equal(where, torch.arange(where[0], where[-1] + 1))
        texts.append(tokenizer.decode(input_ids[row][trained].tolist(), skip_special_tokens=False))
        prompt = tokenizer.decode(input_ids[row][:where[0]].tolist(), skip_special_tokens=False)
        assert prompt.endswith("<|im_start|>user\n3+4?<|im_end|>\n<|im_start|>assistant\n")
        assert "\n2<|im_end|>" in prompt
    assert texts == ["<think>\n\n</think>\n\n7<|im_end|>\n", "<think>\n\n</think>\n\n8<|im_end|>\n"]
    first_label = int((labels[0] != IGNORE_INDEX).nonzero()[0])
    assert torch.equal(input_ids[0][:first_label], input_ids[1][:first_label])  # the same prompt, token for token
    assert int((input_ids[0] != PAD_ID).sum()) == int((labels[0] != IGNORE_INDEX).nonzero()[-1]) + 1


BAD_LINES = [
    ({"rejected": []}, 'no "chosen": each line is {"chosen": [{"role": "user", ...}'),
    ({"chosen": pair("a", "b", "c")["chosen"]}, 'no "rejected"'),
    ({"chosen": pair("a", "b", "c")["chosen"], "rejected": "b"},
     '"rejected" must be a non-empty list of {"role", "content"} messages: {"chosen": [{"role": "user", ...}'),
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": pair("a", "b", "c")["rejected"]},
     '"chosen": has no assistant message, so there is no answer to prefer'),
    (pair("a", "b", "c") | {"rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "c"}]},
     '"chosen" and "rejected" have different prompts'),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 5}], "rejected": []},
     '"chosen": message 2: needs string fields "role" and "content"'),
]


@pytest.mark.parametrize("record,problem", BAD_LINES, ids=["no-chosen", "no-rejected", "rejected-not-messages",
                                                           "no-answer", "prompts-differ", "bad-message"])
def test_a_bad_pair_is_refused_at_indexing_naming_the_file_line_and_the_fix(tmp_path, tokenizer, record, problem):
    data = write_jsonl(tmp_path / "pairs.jsonl", [*sum_pairs(2), record])
    with pytest.raises(DataFileError) as caught:
        DPODataset(data, tokenizer, 48)
    message = str(caught.value)
    assert message.startswith(f"{data}, line 3: {problem}") and message.endswith("Fix or delete this line, then start "
                                                                                  "again.") and "\n" not in message


def test_dpo_starts_from_trained_weights_and_says_so():
    from argparse import Namespace

    from trainer.hardening.resume_checks import ConfigError
    from trainer.hardening.from_weight import frozen_model
    with pytest.raises(ConfigError, match="--from_weight none: this stage starts from trained weights; name them"):
        frozen_model(Namespace(from_weight="none"), None, print)


# ---- the loss --------------------------------------------------------------------------------

def trl_sigmoid_loss(chosen, rejected, ref_chosen, ref_rejected, beta):
    """TRL's published DPO loss (loss_type "sigmoid", trl/trainer/dpo_trainer.py), written out independently."""
    return -F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))


def random_logps(pairs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    policy, reference = (-30 * torch.rand(pairs, 2, generator=generator, dtype=torch.float64) for _ in range(2))
    return policy, reference


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_is_trls_sigmoid_loss(beta):
    policy, reference = random_logps(8, seed=1)
    losses, margins = dpo_loss(policy, reference, beta)
    expected = trl_sigmoid_loss(policy[:, 0], policy[:, 1], reference[:, 0], reference[:, 1], beta)
    assert torch.allclose(losses, expected, rtol=0, atol=1e-12)
    assert torch.equal(margins > 0, losses < torch.log(torch.tensor(2.0, dtype=torch.float64)))


class FusedOutput(SimpleNamespace):
    """What TRL's DPOTrainer reads of `model(..., fused_lm_head=True)`: per-token log-probs and statistics."""


class LogProbModel(torch.nn.Module):
    """A stand-in for TRL's model: its per-token log-probabilities are the given ones (rows chosen..., rejected...)."""

    def __init__(self, per_token_logps: torch.Tensor):
        super().__init__()
        self.per_token_logps = per_token_logps

    def forward(self, input_ids, labels, fused_lm_head, **kwargs):
        zeros = torch.zeros_like(self.per_token_logps)
        return FusedOutput(log_probs=self.per_token_logps, entropy=zeros, mean_logits=zeros,
                           is_top1=torch.zeros_like(zeros, dtype=torch.bool), aux_loss=torch.zeros(()))


class SameProcess:
    """The bits of accelerate's Accelerator DPOTrainer._compute_loss calls, in one process."""
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(tensor):
        return tensor

    gather = gather_for_metrics


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="importing TRL (transformers' Trainer) takes about 13 s; set TRAINER_SLOW_TESTS=1 to run it")
def test_dpo_loss_equals_trls_own_dpo_trainer_on_the_same_log_probabilities():
    from trl.trainer.dpo_trainer import DPOTrainer  # trl==1.16.0 (requirements.txt)
    pairs, length, beta = 6, 5, 0.1
    generator = torch.Generator().manual_seed(3)
    per_token = -5 * torch.rand(2 * pairs, length, generator=generator, dtype=torch.float64)  # chosen rows, rejected
    mask = (torch.rand(2 * pairs, length + 1, generator=generator) < 0.7).long()
    mask[:, 1] = 1  # every answer has a token
    per_token = per_token * mask[:, 1:]  # as TRL's fused head: 0 outside the completion
    reference = -5 * torch.rand(2 * pairs, generator=generator, dtype=torch.float64)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=SameProcess(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=["sigmoid"], loss_weights=[1.0],
        beta=beta, use_weighting=False, _tp_size=1, _total_train_tokens=0,
        _metrics={"train": __import__("collections").defaultdict(list)})
    inputs = {"input_ids": torch.zeros(2 * pairs, length + 1, dtype=torch.long), "attention_mask": mask,
              "completion_mask": mask, "ref_chosen_logps": reference[:pairs], "ref_rejected_logps": reference[pairs:]}
    trl_loss = DPOTrainer._compute_loss(trainer, LogProbModel(per_token), inputs, return_outputs=False)

    sums = per_token.sum(dim=1)
    ours, _ = dpo_loss(torch.stack([sums[:pairs], sums[pairs:]], dim=1),
                       torch.stack([reference[:pairs], reference[pairs:]], dim=1), beta)
    assert abs(float(ours.mean() - trl_loss)) < 1e-12  # TRL means over its pairs; the loop sums, then divides
    assert trainer._metrics["train"]["rewards/accuracies"]  # TRL's own metric code ran too


def test_a_placeholder_pair_adds_nothing_to_the_loss_or_the_gradient(tmp_path, tokenizer):
    dataset = DPODataset(write_jsonl(tmp_path / "pairs.jsonl", sum_pairs(3)), tokenizer, 48)
    torch.manual_seed(0)
    policy, reference = CausalLM(LMConfig(vocab_size=tokenizer.get_vocab_size(), **TINY)), None
    reference = CausalLM(LMConfig(vocab_size=tokenizer.get_vocab_size(), **TINY)).requires_grad_(False)
    input_ids, labels = (torch.stack(column) for column in zip(*(dataset[i] for i in range(3))))
    placeholder = torch.full_like(labels[:1], IGNORE_INDEX)  # dataset/indexed.py's IndexedDataset placeholder row

    gradients = []
    with_placeholder = (torch.cat([input_ids, input_ids[:1]]), torch.cat([labels, placeholder]))
    for ids, targets in ((input_ids, labels), with_placeholder):
        policy.zero_grad()
        losses, margins, _ = pair_losses(policy, reference, ids, targets, beta=0.1)
        losses.sum().backward()
        gradients.append([p.grad.clone() for p in policy.parameters()])
        assert real_pairs(targets).tolist() == [True] * 3 + [False] * (len(ids) - 3)
    assert losses[3] == 0 and margins[3] == 0
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(*gradients))
    assert any(g.abs().sum() > 0 for g in gradients[0])


# ---- scoring pairs (eval_model.py --pairs_data) ---------------------------------------------------

def test_pair_scores_count_the_pairs_whose_chosen_answer_is_likelier(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "pairs.jsonl", sum_pairs(5))
    dataset = DPODataset(data, tokenizer, 64)
    torch.manual_seed(0)
    model, reference = (CausalLM(LMConfig(vocab_size=tokenizer.get_vocab_size(), **TINY)).eval() for _ in range(2))
    logps = pair_logprobs(model, dataset, batch_size=2)
    for i in range(5):  # the sum of the log-probabilities of the answer's tokens, from the model's own loss
        input_ids, labels = dataset[i]
        with torch.no_grad():
            per_token = model(input_ids, labels=labels, loss_reduction="none").loss
        assert torch.allclose(logps[i], -per_token.sum(dim=1).double(), atol=1e-4)
    ref_logps = pair_logprobs(reference, dataset, batch_size=3)
    scores = score_pairs(logps, ref_logps)
    assert scores["pairs"] == 5
    assert scores["accuracy"] == float((logps[:, 0] > logps[:, 1]).double().mean())
    assert scores["reward_accuracy"] == float(((logps - ref_logps)[:, 0] > (logps - ref_logps)[:, 1]).double().mean())
    assert score_pairs(logps, logps)["reward_accuracy"] == 0.0  # the policy as its own reference: no reward
    # Swapping chosen and rejected swaps the answer on every pair whose log-probabilities differ.
    assert score_pairs(logps.flip(1), None)["accuracy"] == 1 - scores["accuracy"]


def test_the_trainers_validation_agrees_with_eval_models_pair_scores(tmp_path, tokenizer):
    dataset = DPODataset(write_jsonl(tmp_path / "pairs.jsonl", sum_pairs(7)), tokenizer, 64)
    torch.manual_seed(1)
    policy, reference = (CausalLM(LMConfig(vocab_size=tokenizer.get_vocab_size(), **TINY)) for _ in range(2))
    loss, accuracy, pairs = preference_validation(policy, reference.eval(), dataset, 3, torch.device("cpu"),
                                                  nullcontext(), beta=0.5)
    logps, ref_logps = (pair_logprobs(model.eval(), dataset, batch_size=4) for model in (policy, reference))
    assert pairs == 7 and accuracy == score_pairs(logps, ref_logps)["reward_accuracy"]
    assert 0 < accuracy < 1  # both outcomes occur, so the comparison is not vacuous
    losses, _ = dpo_loss(logps, ref_logps, beta=0.5)
    assert math.isclose(loss, float(losses.mean()), rel_tol=1e-5)


def test_eval_model_pairs_data_prints_the_accuracies_and_refuses_a_bad_line(tmp_path, tokenizer, capsys):
    out = tmp_path / "out"
    write_reference(out, tokenizer.get_vocab_size(), seed=0, weight="dpo")
    write_reference(out, tokenizer.get_vocab_size(), seed=1, weight="full_sft")
    data = write_jsonl(tmp_path / "pairs.jsonl", sum_pairs(4))
    common = ["--save_dir", str(out), "--device", "cpu", "--pairs_data", str(data)]
    assert eval_model.main(["--weight", "dpo", *common, "--ref_weight", "full_sft"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"{data}: 4 pairs, chosen answer likelier in ")
    assert "implicit reward (vs full_sft) higher in " in printed

    bad = write_jsonl(tmp_path / "bad.jsonl", [*sum_pairs(1), {"chosen": []}])
    assert eval_model.main(["--weight", "dpo", *common[:-1], str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f'error: {bad}, line 2: "chosen" must be a non-empty list')

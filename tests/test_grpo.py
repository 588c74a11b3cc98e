"""GRPO in one process: the loss on a hand-computed case and equal to TRL's GRPOTrainer loss on the same
log-probabilities, the group advantage, the gradient independent of how a step's rollouts are split into
micro-batches, the prompts and answers as the loop reads them, the rollouts drawn alike on a second draw, and the
rewards with their one-line errors. The trainer's guarantees with real python/torchrun processes are in
tests/test_grpo_runs.py.
"""

from __future__ import annotations

import math
import os
import sys
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from dataset.grpo_dataset import GRPODataset, sample_groups
from dataset.jsonl_file import DataFileError
from dataset.rewards import RewardError, answer_reward, format_reward, reward_functions, score, score_groups
from model.model import CausalLM, LMConfig
from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from test_dpo import TINY, write_jsonl
from trainer.hardening.resume_checks import ConfigError, ResumeMismatch, check_resume_compatible
from trainer.train_grpo import (completion_losses, group_advantages, grpo_loss, loss_denominator, parse_args,
                                 sampling_logps, token_weights)


def question(q: str, answer: str | None, before: list | None = None) -> dict:
    """A prompt line in the SFT schema; `answer` None: a prompt-only line (minimind's rlaif.jsonl)."""
    messages = [*(before or []), {"role": "user", "content": q}]
    return {"conversations": messages + ([{"role": "assistant", "content": answer}] if answer is not None else [])}


def sum_questions(count: int) -> list[dict]:
    """`count` prompts "i+(i+1)?" with their sums as the reference answers."""
    return [question(f"{i}+{i + 1}?", str(2 * i + 1)) for i in range(count)]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_TOKENIZER)


# ---- the loss and the advantage ----------------------------------------------------------------

def test_the_loss_of_two_tokens_computed_by_hand():
    # pi = 0.5, pi_old = 0.4 (ratio 1.25), ref = 0.25 on each token of a completion; its advantage +1, then -1.
    logps = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    old, ref = torch.log(torch.full_like(logps, 0.4)), torch.log(torch.full_like(logps, 0.25))
    losses, kl, clipped = grpo_loss(logps, old, ref, torch.tensor([1.0], dtype=torch.float64), 0.1, 0.2)
    k3 = 0.25 / 0.5 - math.log(0.25 / 0.5) - 1  # exp(ref - pi) - (ref - pi) - 1 = 0.5 + ln 2 - 1
    # A = +1: the ratio 1.25 is clipped to 1.2, and -min(1.25, 1.2) = -1.2
    assert losses[0, 0].item() == pytest.approx(-1.2 + 0.1 * k3, abs=1e-12)
    assert kl[0, 0].item() == pytest.approx(0.19314718055994531, abs=1e-12) and clipped.tolist() == [[True, True]]
    negative, _, clipped = grpo_loss(logps, old, ref, torch.tensor([-1.0], dtype=torch.float64), 0.1, 0.2)
    # A = -1: -min(-1.25, -1.2) = 1.25: a ratio above 1 + eps is not clipped where the advantage is negative
    assert negative[0, 0].item() == pytest.approx(1.25 + 0.1 * k3, abs=1e-12) and not clipped.any()
    # cispo (MiniMax-M1): the weight min(1.25, 1.2) = 1.2, a constant, x A x log pi; its gradient -1.2 x A, not 0
    pi = logps.clone().requires_grad_()
    cispo, _, clipped = grpo_loss(pi, old, ref, torch.tensor([-1.0], dtype=torch.float64), 0.1, 0.2, "cispo")
    assert cispo[0, 0].item() == pytest.approx(1.2 * math.log(0.5) + 0.1 * k3, abs=1e-12) and clipped.all()
    (gradient,) = torch.autograd.grad(cispo[0, 0], pi)
    assert gradient[0, 0].item() == pytest.approx(1.2 + 0.1 * (1 - 0.25 / 0.5), abs=1e-12)  # d k3 / d log pi


def test_grpos_loss_type_weighs_each_completion_by_its_length_and_counts_completions_not_placeholders():
    labels = torch.full((3, 5), -100)
    labels[0, 1:] = 7  # 4 completion tokens
    labels[1, 3:] = 7  # 2 completion tokens; row 2: a placeholder's, none
    mask = torch.nn.functional.pad(labels[:, 1:] != -100, (0, 1)).float()
    assert token_weights(mask, "dapo") is mask and token_weights(mask, "cispo") is mask
    assert token_weights(mask, "grpo").sum(dim=1).tolist() == [1.0, 1.0, 0.0]  # a mean over each one's tokens
    rollouts, tokens = [(None, labels, None)], mask.sum().double()
    assert loss_denominator(rollouts, tokens, "dapo") == 6 and loss_denominator(rollouts, tokens, "grpo") == 2


def test_the_group_advantage_is_the_reward_against_its_group_and_zero_without_signal():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    advantages = group_advantages(rewards)
    a = 0.5 / (math.sqrt(4 * 0.25 / 3) + 1e-4)  # (r - mean) / (std + eps), the unbiased std as TRL's rewards.std()
    assert advantages[0].tolist() == pytest.approx([a, -a, -a, a], abs=1e-12)
    assert advantages[1].tolist() == [0.0] * 4  # all alike: no signal, whatever the reward's level
    # Not normalised against the whole batch: the first group's advantages ignore the second group.
    assert torch.equal(group_advantages(rewards[:1]), advantages[:1])


class SameProcess:
    """The bits of accelerate's Accelerator that GRPOTrainer._compute_loss calls, in one process."""
    num_processes = 1

    @staticmethod
    def reduce(tensor, reduction="sum"):
        return tensor

    @staticmethod
    def gather(tensor):
        return tensor

    gather_for_metrics = gather


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="importing TRL (transformers' Trainer) takes about 13 s; set TRAINER_SLOW_TESTS=1 to run it")
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_grpo_loss_equals_trls_own_grpo_trainer_on_the_same_log_probabilities(loss_type):
    """TRL 1.16's GRPOTrainer._compute_loss with the same loss_type (dapo: a token sum over the generation batch's
    tokens; grpo: each completion's token mean, averaged; cispo: its epsilon_high is the cap, our 1 + clip_eps),
    the log-probabilities handed to it instead of a model's, pi_old another policy's, so the clip and cap act."""
    from trl.trainer.grpo_trainer import GRPOTrainer  # trl==1.16.0 (requirements.txt)
    rows, length, beta, eps = 6, 7, 0.04, 0.2
    generator = torch.Generator().manual_seed(5)
    logps = (-3 * torch.rand(rows, length, generator=generator, dtype=torch.float64)).requires_grad_()
    old = logps.detach() + 0.4 * (torch.rand(rows, length, generator=generator, dtype=torch.float64) - 0.5)
    ref = logps.detach() + 0.3 * torch.randn(rows, length, generator=generator, dtype=torch.float64)
    mask = (torch.rand(rows, length, generator=generator) < 0.8).long()
    mask[:, 0] = 1
    advantages = group_advantages(torch.rand(2, rows // 2, generator=generator, dtype=torch.float64)).flatten()
    high = 1 + eps if loss_type == "cispo" else eps
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=SameProcess(), aux_loss_enabled=False,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type=loss_type, epsilon_low=eps, epsilon_high=high, use_vllm=False, current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, torch.zeros_like(logps), None))
    inputs = {"prompt_ids": torch.zeros(rows, 2, dtype=torch.long),
              "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
              "completion_ids": torch.zeros(rows, length, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    trl_loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    (trl_gradient,) = torch.autograd.grad(trl_loss, logps)

    losses, _, clipped = grpo_loss(logps, old, ref, advantages, beta, eps, loss_type)
    labels = torch.nn.functional.pad(torch.where(mask.bool(), 1, -100), (1, 0), value=-100)  # as the loop's labels
    count = loss_denominator([(None, labels, None)], mask.sum().double(), loss_type)
    ours = (losses * token_weights(mask.double(), loss_type)).sum() / count  # the loop, one rank and micro-step
    (our_gradient,) = torch.autograd.grad(ours, logps)
    assert abs(float((ours - trl_loss).detach())) < 1e-12
    assert torch.allclose(our_gradient, trl_gradient, rtol=0, atol=1e-12)
    share = float(clipped[mask.bool()].float().mean())
    assert 0 < share < 1  # the case clips (caps) some tokens, not all
    if loss_type == "cispo":  # TRL counts the capped tokens of a positive advantage only; the cap acts on all
        metric, share = "cispo_clip_ratio", float((clipped & (advantages[:, None] > 0))[mask.bool()].float().mean())
    else:
        metric = "clip_ratio/region_mean"
    assert trainer._metrics["train"][metric][0] == pytest.approx(share, abs=1e-12)  # TRL's clip metric is ours


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_the_gradient_is_the_same_however_the_rollouts_are_split_into_micro_batches(loss_type):
    """One micro-batch of 4 prompts' rollouts, or two of 2 with other token counts: each part's loss sum divided by
    the step's completion tokens (grpo: completions) adds up to the same gradient (as the loop does on ranks and
    micro-steps), pi_old another policy's (a second update) so that the clip acts."""
    torch.manual_seed(0)
    model, ref_model = CausalLM(LMConfig(vocab_size=64, **TINY)), CausalLM(LMConfig(vocab_size=64, **TINY))
    ref_model.requires_grad_(False)
    input_ids = torch.randint(1, 64, (8, 10))
    labels = torch.full_like(input_ids, -100)
    for row, start in enumerate([3, 3, 5, 5, 2, 2, 6, 6]):  # completions of different lengths per group
        labels[row, start:] = input_ids[row, start:]
    advantages = group_advantages(torch.rand(4, 2, dtype=torch.float64)).flatten().float()
    args = SimpleNamespace(beta=0.1, clip_eps=0.2, loss_type=loss_type, temperature=1.0, logps_chunk=7)
    tokens = loss_denominator([(input_ids, labels, advantages)], (labels[:, 1:] != -100).sum().double(), loss_type)
    with torch.no_grad():  # pi_old: these weights' log-probabilities, moved
        old = -model(input_ids, labels=labels, loss_reduction="none").loss + 0.3 * torch.randn(8, 10)

    watch = torch.zeros(7, dtype=torch.float64)  # [-1]: the clipped tokens, over both calls

    def gradient(parts: list[slice]) -> list[torch.Tensor]:
        model.zero_grad()
        for part in parts:
            losses, _ = completion_losses(model, ref_model, input_ids[part], labels[part], advantages[part], args,
                                          watch, old[part])
            (losses.sum() / tokens).backward()
        return [p.grad.clone() for p in model.parameters()]

    whole, split = gradient([slice(0, 8)]), gradient([slice(0, 4), slice(4, 8)])
    assert watch[-1] > 0  # the clip acted (the last part's clipped tokens)
    assert any(g.abs().sum() > 0 for g in whole)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(whole, split))


@pytest.mark.parametrize("use_moe", [False, True])
def test_log_probabilities_taken_in_chunks_keep_no_batch_wide_vocabulary_tensor_and_give_the_same_numbers(use_moe):
    torch.manual_seed(0)
    vocab = 300
    model = CausalLM(LMConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              vocab_size=vocab, use_moe=use_moe, num_experts=2))
    input_ids = torch.randint(1, vocab, (6, 40))
    labels = input_ids.clone()
    labels[:, :12] = -100  # the prompts
    labels[3, 30:] = -100  # a completion that ended early

    def run(chunk: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Size]]:
        kept = []  # what autograd keeps for the backward (a checkpointed chunk keeps its inputs only)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t, lambda t: t):
            out = model(input_ids, labels=labels, loss_reduction="none", temperature=0.8, chunk_tokens=chunk)
        grads = torch.autograd.grad((out.loss * torch.rand(6, 40, generator=torch.Generator().manual_seed(1))).sum()
                                    + out.aux_loss, list(model.parameters()))
        return out.loss, grads, [shape for shape in kept if shape[-1:] == (vocab,) and shape.numel() > vocab]

    whole, whole_grads, whole_kept = run(0)
    chunked, chunked_grads, chunked_kept = run(7)
    assert whole_kept and not chunked_kept  # unchunked: (240, 300) logits and log-softmax kept; chunked: none
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    assert (chunked[labels.roll(-1, 1) == -100] == 0).all()  # a position without a next label: 0, as unchunked
    for a, b in zip(chunked_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # summed in another order: rounding only


def test_the_ratio_and_the_kl_take_the_log_probabilities_of_the_temperature_the_rollouts_were_sampled_at():
    """At --temperature T the rollouts are drawn from softmax(logits / T) (sample_next_token): the policy's and the
    reference's log-probabilities GRPO scores them by are that distribution's, not softmax(logits)'s."""
    torch.manual_seed(0)
    model, ref_model = CausalLM(LMConfig(vocab_size=64, **TINY)), CausalLM(LMConfig(vocab_size=64, **TINY))
    input_ids = torch.randint(1, 64, (4, 9))
    labels = torch.full_like(input_ids, -100)
    labels[:, 4:] = input_ids[:, 4:]
    rollouts = [(input_ids, labels, torch.zeros(4))]

    def drawn_at(m: CausalLM, temperature: float) -> torch.Tensor:
        """log softmax(logits / T) of each next token that has a label, 0 elsewhere, by hand."""
        with torch.no_grad():
            logps = torch.log_softmax(m(input_ids).logits / temperature, dim=-1)[:, :-1]
        picked = logps.gather(-1, input_ids[:, 1:, None]).squeeze(-1) * (labels[:, 1:] != -100)
        return torch.nn.functional.pad(picked, (0, 1))

    for temperature in (0.7, 1.0, 1.5):
        args = SimpleNamespace(num_iterations=2, temperature=temperature, logps_chunk=7)
        [(policy, reference)] = sampling_logps(model, ref_model, rollouts, args, nullcontext())
        assert torch.allclose(policy, drawn_at(model, temperature), atol=1e-5)
        assert torch.allclose(reference, drawn_at(ref_model, temperature), atol=1e-5)
    assert not torch.allclose(drawn_at(model, 1.5), drawn_at(model, 1.0), atol=1e-3)  # T changes them
    # One update: completion_losses takes them itself, at T: the KL it adds up is the one between those two
    watch = torch.zeros(7, dtype=torch.float64)
    args = SimpleNamespace(beta=0.1, clip_eps=0.2, loss_type="dapo", temperature=1.5, logps_chunk=7)
    completion_losses(model, ref_model, input_ids, labels, torch.ones(4), args, watch)
    difference = drawn_at(ref_model, 1.5) - drawn_at(model, 1.5)
    kl = (torch.exp(difference) - difference - 1) * torch.nn.functional.pad(labels[:, 1:] != -100, (0, 1))
    assert watch[-2].item() == pytest.approx(kl.sum().item(), rel=1e-4)


# ---- the prompts and the rollouts --------------------------------------------------------------

def test_a_prompt_is_the_conversation_before_the_last_answer_with_the_generation_header(tmp_path, tokenizer):
    earlier = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    data = write_jsonl(tmp_path / "prompts.jsonl", [question("3+4?", "7", earlier), question("5+5?", "10")])
    dataset = GRPODataset(data, tokenizer, 64, reward_functions("answer"))
    input_ids, labels = dataset[0]
    prompt = input_ids[labels != -100].tolist()
    text = dataset.encoder.decode(prompt)
    assert text.startswith("user\n1+1?") and text.endswith("user\n3+4?\nassistant\n"), text  # tags hidden
    assert (dataset.answer(0), dataset.answer(1), dataset.answer(-1)) == ("7", "10", None)
    room = int((dataset[1][1] != -100).sum())  # the second prompt's length: it fits, the first is cut
    cut = GRPODataset(data, tokenizer, room, reward_functions("answer"))[0][0]
    assert cut.tolist() == prompt[-room:] and len(prompt) > room  # a long prompt keeps its end: the question, header


def test_a_line_without_an_answer_is_refused_for_the_answer_reward_only(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "rlaif.jsonl", [question("2+2?", "4"), question("3+3?", None),
                                                  question("4+4?", "")])
    with pytest.raises(DataFileError) as refused:
        GRPODataset(data, tokenizer, 64, reward_functions("answer,format"))
    assert str(refused.value).startswith(f"{data}, line 2: no reference answer") and "\n" not in str(refused.value)
    prompts_only = GRPODataset(data, tokenizer, 64, reward_functions("format"))  # a format reward needs none
    assert len(prompts_only) == 3 and prompts_only.answer(1) is None and prompts_only.answer(2) is None


def test_the_groups_are_drawn_by_their_prompt_and_seed_not_by_the_batch_they_are_in(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "prompts.jsonl", sum_questions(3))
    dataset = GRPODataset(data, tokenizer, 32, reward_functions("answer"))
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab_size=tokenizer.get_vocab_size(), **TINY))

    def draw(indices: list[int], seed: int = 7):
        rows = [dataset[i] if i >= 0 else (dataset[0][0], torch.full_like(dataset[0][1], -100)) for i in indices]
        batch = [torch.tensor(indices), *(torch.stack(column) for column in zip(*rows))]
        return sample_groups(model, batch, dataset.encoder, 3, 12, 1.0, seed, nullcontext())

    together, (alone_ids, alone_labels, alone_texts) = draw([0, 2]), draw([2, -1])
    assert together[2][1] == alone_texts[0] and alone_texts[1] is None  # prompt 2's group, next to another or not
    assert (alone_labels[3:] == -100).all()  # the placeholder's rows: nothing to train
    trained = alone_labels[:3] != -100
    assert torch.equal(alone_ids[:3][trained], together[0][3:][together[1][3:] != -100])
    assert trained.any(dim=1).all()  # every completion has its tokens labelled
    assert draw([0, 2], seed=8)[2] != together[2]  # another seed (another epoch): other completions
    assert draw([2], seed=(2**31 - 1) * 1_000_003 + 5)[2][0]  # the largest --seed, a later epoch: still a seed


# ---- the rewards -------------------------------------------------------------------------------

def test_the_answer_reward_strips_the_think_block_and_compares_numbers_as_numbers():
    completions = ["<think>\n2+3 is 5\n</think>\n\n5", " 5.0 ", "<think>\n\n</think>\n\nfive", "15", "<think>x"]
    assert answer_reward(completions, ["5"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert answer_reward(["Paris ", "paris"], ["Paris", "Paris"]) == [1.0, 0.0]  # exact text otherwise
    assert format_reward(["<think>\nhm\n</think>\n\n5", "5", "<think>\n\n</think>\n\n"], [None] * 3) == [0.5, 0, 0]


@pytest.mark.parametrize("completion, answer, reward", [
    ("12", "1,2", 0.0), ("35", "3,5", 0.0), ("5", ",,5,", 0.0), ("12345", "1,2345", 0.0),  # a comma not grouping 3
    ("12345678901234567890", "12345678901234567891", 0.0),  # 20 digits: equal as floats, not as numbers
    ("0.1", "0.10000000000000001", 0.0),  # the same float too
    ("1234", "1,234", 1.0), ("-1234567.5", "-1,234,567.50", 1.0), ("0.5", ".5", 1.0), ("12", "+12.", 1.0),
    ("1,2", "1,2", 1.0), ("1e3", "1000", 0.0), ("inf", "inf", 1.0), ("nan", "NaN", 0.0)])  # the last three: text
def test_numbers_compare_exactly_and_a_comma_only_groups_three_digits(completion, answer, reward):
    assert answer_reward([completion], [answer]) == [reward]


def test_a_reward_that_raises_returns_nan_or_the_wrong_count_is_one_line_naming_it(monkeypatch):
    def raises(completions, answers):
        raise KeyError("score")

    def not_a_number(completions, answers):
        return [float("nan")] * len(completions)

    def one_short(completions, answers):
        return [1.0] * (len(completions) - 1)

    for function, problem in [(raises, "raised KeyError: 'score'"), (not_a_number, "returned nan: each reward"),
                              (one_short, "returned 1 values for 2 completions")]:
        with pytest.raises(RewardError) as failed:
            score({"answer": answer_reward, "mine": function}, ["a", "b"], ["a", "b"])
        message = str(failed.value)
        assert message.startswith(f"reward 'mine' (test_grpo.{function.__qualname__}) {problem}"), message
        assert "\n" not in message
    with pytest.raises(RewardError, match=r"^--rewards answer,typo: typo is none of answer, format, brevity"):
        reward_functions("answer,typo")


@pytest.mark.parametrize("flags, message", [
    (["--num_generations", "1"], "--num_generations 1: must be an integer >= 2"),
    (["--parallel", "fsdp"], "--parallel fsdp: GRPO samples with the model's own generation, whose number of"),
    (["--max_completion_len", "64", "--max_seq_len", "64"], "--max_completion_len 64: must be below --max_seq_len 64"),
    (["--val_data", "dataset/sft_demo_eval.jsonl"], "--val_data: GRPO has no validation loss"),
    (["--clip_eps", "1"], "--clip_eps 1.0: must be in (0, 1)"),
    (["--max_turns", "0"], "--max_turns 0: must be an integer >= 1"),
    (["--rewards", "answer,tool"], "--rewards answer,tool: the tool reward scores the calls of rollouts with tools; "
                                   "give --max_turns 2 or more"),
    (["--rewards", "answer,call"], "--rewards answer,call: the call reward scores the calls of rollouts with tools; "
                                   "give --max_turns 2 or more"),
    (["--clip_eps", "0", "--loss_type", "cispo"], "--clip_eps 0.0: must be a finite number > 0"),
    (["--num_iterations", "0"], "--num_iterations 0: must be an integer >= 1")])
def test_flags_grpo_cannot_use_are_refused_with_the_reason(monkeypatch, flags, message):
    monkeypatch.setattr(sys, "argv", ["train_grpo.py", "--device", "cpu", *flags])
    with pytest.raises(ConfigError) as refused:
        parse_args()
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_cispos_cap_may_pass_2_as_scalerl_recommends(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train_grpo.py", "--device", "cpu", "--loss_type", "cispo", "--clip_eps", "4"])
    assert parse_args().clip_eps == 4.0  # a weight capped at 5 (ScaleRL's epsilon_max); PPO's clip must stay below 1


def test_score_groups_counts_what_a_user_watches():
    scores, watched = score_groups(reward_functions("answer"), [["4", "5"], ["6", "6"], None], ["4", "6", None], 2)
    assert scores.tolist() == [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]  # the placeholder: zeros, advantages 0
    # reward sum 3, in-group std sum sqrt(0.5) + 0, one group of two without signal, two real groups, no tool ran
    assert watched.tolist() == pytest.approx([3.0, math.sqrt(0.5), 1.0, 2.0, 0.0])
    alone, _ = score_groups(reward_functions("answer"), [None], [None], 3)  # a rank's micro-batch of a placeholder
    assert alone.tolist() == [[0.0] * 3] and group_advantages(alone).tolist() == [[0.0] * 3]  # not NaN


def test_the_anomaly_policy_judges_no_loss_spike_in_grpo_but_still_a_grad_norm_explosion():
    """GRPO's loss is about 0 and of either sign, on fresh completions each step: a rise above its recent mean is
    no sign of trouble (a 2-rank run's step 10 of 0.16 after nine of about 0 was reported as a spike)."""
    from trainer.hardening.anomaly_policy import AnomalyPolicy

    flags = dict(on_anomaly="stop", patience=0, max_rollbacks=3, rollback_lr_factor=1.0, max_skipped_steps=20)
    for stage, expected in [({}, "loss spike"), ({"num_generations": 4}, None)]:
        detector = AnomalyPolicy(SimpleNamespace(**flags, **stage), None, True, {}, print).guard.detector
        for step, loss in enumerate([0.0, 1e-4, -1e-4, 0.0, 2e-4, -2e-4, 0.0, 1e-4, 0.0], start=1):
            assert detector.check(step, loss, 1.0) is None
        reason = detector.check(10, 0.1636, 1.0)
        assert (reason or "").startswith(expected or "") and (reason is None) == (expected is None), reason
        assert detector.check(11, 0.0, 50.0).startswith("grad norm explosion at step 11")


def test_a_grpo_checkpoint_from_before_tools_and_updates_per_batch_resumes_only_with_their_defaults():
    saved_args = {"batch_size": 4, "accumulation_steps": 1, "global_batch_size": None, "world_size": 1, "epochs": 1,
                  "seed": 42, "max_seq_len": 48, "num_generations": 4, "clip_eps": 0.2}  # no turns, updates, loss
    saved = {"lm_config": {"hidden_size": 32}, "data_fingerprint": {"sha256": "x"}, "train_args": saved_args}
    defaults = {**saved_args, "max_turns": 1, "num_iterations": 1, "loss_type": "dapo"}
    assert check_resume_compatible(saved, {"hidden_size": 32}, {"sha256": "x"}, defaults) == []
    for field, value, was in (("max_turns", 2, 1), ("num_iterations", 2, 1), ("loss_type", "cispo", "dapo")):
        with pytest.raises(ResumeMismatch, match=rf"args\.{field}: checkpoint has {was!r}, this run has {value!r}"):
            check_resume_compatible(saved, {"hidden_size": 32}, {"sha256": "x"}, {**defaults, field: value})

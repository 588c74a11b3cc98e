"""What the model promises: Qwen3 parameter names, causality, a correct KV cache, the loss contract."""

import pytest
import torch
import torch.nn.functional as F

from model.model import CausalLM, LMConfig, default_intermediate_size


def tiny_config(**overrides) -> LMConfig:
    settings = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    settings.update(overrides)
    return LMConfig(**settings)


def tiny_model(seed: int = 0, **overrides) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(tiny_config(**overrides)).eval()


def random_ids(batch: int, seq: int, vocab: int = 97, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_config_derives_head_dim_and_swiglu_size():
    config = LMConfig()
    assert config.head_dim == 64
    assert config.intermediate_size % 64 == 0 and config.intermediate_size >= 512 * 8 / 3
    assert config.moe_intermediate_size == config.intermediate_size


def test_default_swiglu_width_is_eight_thirds_of_hidden_rounded_up_to_64():
    # 8/3 * 768 = 2048 exactly; minimind's pi * 768 rounds up to 2432, which is passed explicitly.
    assert default_intermediate_size(768) == 2048 == LMConfig(hidden_size=768).intermediate_size
    assert default_intermediate_size(128) == 384  # the demo model: 8/3 * 128 = 341.3 -> 384
    config = LMConfig(hidden_size=768, intermediate_size=2432, use_moe=True)
    assert config.intermediate_size == config.moe_intermediate_size == 2432


def test_swiglu_width_flag_sets_the_mlp_and_every_expert_shape():
    dense = CausalLM(tiny_config(intermediate_size=80)).state_dict()
    assert dense["model.layers.0.mlp.gate_proj.weight"].shape == (80, 32)
    assert dense["model.layers.1.mlp.down_proj.weight"].shape == (32, 80)
    moe = CausalLM(tiny_config(intermediate_size=80, use_moe=True, num_experts=3)).state_dict()
    assert moe["model.layers.0.mlp.experts.2.up_proj.weight"].shape == (80, 32)


def test_moe_top_k_defaults_to_one_expert_per_token_as_in_minimind():
    model = tiny_model(use_moe=True, num_experts=4)
    assert model.config.num_experts_per_tok == 1
    moe = model.model.layers[0].mlp
    tokens = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, _ = moe(tokens[None])
        chosen = moe.gate(tokens).argmax(-1)
        # With one expert per token the renormalised router weight is 1: the output is that expert's.
        expected = torch.stack([moe.experts[int(j)](t) for j, t in zip(chosen, tokens)])
    torch.testing.assert_close(out[0], expected)


def test_config_round_trips_through_dict():
    config = tiny_config(use_moe=True, num_experts=3, num_experts_per_tok=1)
    assert LMConfig.from_dict(config.to_dict()) == config


def test_config_refuses_unknown_keys_by_name():
    with pytest.raises(ValueError, match="hidden_szie"):
        LMConfig.from_dict({**LMConfig().to_dict(), "hidden_szie": 64})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
        (dict(hidden_size=30, num_attention_heads=4), "divisible"),
        (dict(use_moe=True, num_experts=2, num_experts_per_tok=3), "num_experts_per_tok"),
        (dict(use_moe=True, num_experts=0), "num_experts"),
        (dict(intermediate_size=0), "intermediate_size must be a positive number"),
        (dict(num_hidden_layers=-1), "num_hidden_layers must be a positive number"),
    ],
)
def test_config_refuses_inconsistent_sizes(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_forward_returns_logits_for_every_position():
    model = tiny_model()
    out = model(random_ids(2, 7))
    assert out.logits.shape == (2, 7, 97)
    assert out.loss is None and out.past_key_values is None
    assert out.aux_loss.item() == 0.0


def test_dense_parameter_names_follow_qwen3_layout():
    names = set(tiny_model().state_dict())
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(2):
        p = f"model.layers.{i}."
        expected |= {p + f"self_attn.{m}_proj.weight" for m in "qkvo"}
        expected |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        expected |= {p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert names == expected


def test_moe_parameter_names_follow_qwen3_moe_layout():
    names = set(tiny_model(use_moe=True, num_experts=3).state_dict())
    mlp_names = {n.split("mlp.", 1)[1] for n in names if n.startswith("model.layers.0.mlp.")}
    expected = {"gate.weight"} | {f"experts.{j}.{m}_proj.weight" for j in range(3) for m in ("gate", "up", "down")}
    assert mlp_names == expected


def test_lm_head_is_tied_to_embedding_and_loads_strictly():
    model = tiny_model()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    other = tiny_model(seed=5)
    other.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(other.lm_head.weight, model.model.embed_tokens.weight)
    embedding_size = 97 * 32
    assert model.num_parameters() == sum(t.numel() for t in model.state_dict().values()) - embedding_size


def test_later_tokens_do_not_change_earlier_logits():
    model = tiny_model()
    ids = random_ids(1, 10)
    changed = ids.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % 97
    a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def greedy_without_cache(model: CausalLM, ids: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        next_token = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat((ids, next_token), dim=1)
    return ids


@pytest.mark.parametrize("use_moe", [False, True])
def test_cached_greedy_generation_matches_full_recompute(use_moe):
    model = tiny_model(use_moe=use_moe)
    prompt = random_ids(2, 5)
    cached = model.generate(prompt, max_new_tokens=12, temperature=0)
    assert torch.equal(cached, greedy_without_cache(model, prompt, 12))


def test_cached_logits_match_full_forward_for_single_tokens_and_chunks():
    model = tiny_model()
    ids = random_ids(2, 12)
    full = model(ids).logits
    # prefill 5 tokens, then one token, then a chunk of 4, then 2 more: each against the full pass.
    pieces, start, cache = [5, 1, 4, 2], 0, None
    for length in pieces:
        out = model(ids[:, start : start + length], past_key_values=cache, use_cache=True)
        torch.testing.assert_close(out.logits, full[:, start : start + length], atol=1e-5, rtol=1e-5)
        cache, start = out.past_key_values, start + length


def test_generation_stops_at_eos_and_returns_prompt_plus_new_tokens():
    model = tiny_model()
    prompt = random_ids(1, 4)
    first = model.generate(prompt, max_new_tokens=1, temperature=0)[0, -1].item()
    out = model.generate(prompt, max_new_tokens=10, temperature=0, eos_token_id=first)
    assert out.shape == (1, 5) and torch.equal(out[:, :4], prompt)


def test_sampling_with_top_k_one_is_greedy():
    model = tiny_model()
    prompt = random_ids(1, 4)
    greedy = model.generate(prompt, max_new_tokens=6, temperature=0)
    torch.manual_seed(0)
    sampled = model.generate(prompt, max_new_tokens=6, temperature=0.8, top_k=1, top_p=0.9)
    assert torch.equal(sampled, greedy)


def test_loss_is_shifted_cross_entropy_over_unmasked_labels():
    model = tiny_model()
    ids = random_ids(2, 9)
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    logits, targets = out.logits[:, :-1].reshape(-1, 97), labels[:, 1:].reshape(-1)
    expected = F.cross_entropy(logits, targets, ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    summed = model(ids, labels=labels, loss_reduction="sum").loss
    torch.testing.assert_close(summed, expected * (targets != -100).sum())
    each = model(ids, labels=labels, loss_reduction="none").loss  # position t's loss of predicting labels[t + 1]
    assert each.shape == ids.shape and not each[:, -1].any() and not each[0, :2].any()  # predicts nothing / -100
    torch.testing.assert_close(each[:, :-1].reshape(-1), F.cross_entropy(logits, targets, reduction="none"))


def test_sum_loss_of_fully_masked_batch_is_zero_not_nan():
    model = tiny_model()
    ids = random_ids(2, 6)
    labels = torch.full_like(ids, -100)
    for reduction in ("sum", "mean"):
        loss = model(ids, labels=labels, loss_reduction=reduction).loss
        assert torch.isfinite(loss) and loss.item() == 0.0


def test_moe_backward_reaches_every_expert_and_aux_loss_is_positive():
    # One token routed to 1 of 4 experts: three experts see no token at all, yet DDP needs a
    # gradient (zeros) for their weights too.
    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=1).train()
    ids = random_ids(1, 2)
    out = model(ids, labels=ids)
    assert out.aux_loss.item() > 0
    (out.loss + out.aux_loss).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []
    router_grad = model.model.layers[0].mlp.gate.weight.grad
    assert router_grad.abs().sum() > 0

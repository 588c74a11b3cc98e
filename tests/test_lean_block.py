"""The lean block computes what the textbook Qwen3 block computes.

`reference_forward` below is the block as Qwen3 (and this project, before it was made lean) writes
it: RMSNorm in five fp32 ops with the weight multiplied after the cast, rotate_half with cat/neg,
grouped-query attention by repeating key/value heads, rotary tables built per forward, logits sliced
before the loss. The model must give the same logits, loss and gradients in fp32; and the op count
of benchmarks/count_ops.py must stay within the budget the lean block was built for.
"""

import pytest
import torch
import torch.nn.functional as F

from model.model import CausalLM, LMConfig
from benchmarks.count_ops import count_block


def textbook_rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def textbook_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def reference_forward(model: CausalLM, ids: torch.Tensor, labels: torch.Tensor):
    """Logits and summed next-token loss, computed from `model`'s parameters the textbook way."""
    cfg, decoder = model.config, model.model
    batch, seq = ids.shape
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    angles = torch.arange(seq).float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    x = decoder.embed_tokens(ids)
    for layer in decoder.layers:
        attn = layer.self_attn
        h = textbook_rms_norm(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q = textbook_rms_norm(attn.q_proj(h).view(batch, seq, -1, cfg.head_dim), attn.q_norm.weight,
                              cfg.rms_norm_eps).transpose(1, 2)
        k = textbook_rms_norm(attn.k_proj(h).view(batch, seq, -1, cfg.head_dim), attn.k_norm.weight,
                              cfg.rms_norm_eps).transpose(1, 2)
        v = attn.v_proj(h).view(batch, seq, -1, cfg.head_dim).transpose(1, 2)
        q, k = textbook_rotary(q, cos, sin), textbook_rotary(k, cos, sin)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, -1)
        x = x + attn.o_proj(out)
        mlp = layer.mlp
        h = textbook_rms_norm(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
    logits = model.lm_head(textbook_rms_norm(x, decoder.norm.weight, cfg.rms_norm_eps))
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size).float(), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")
    return logits, loss


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # plain multi-head, grouped, and multi-query attention
def test_lean_block_matches_the_textbook_block_in_fp32(kv_heads):
    torch.manual_seed(0)
    config = LMConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_position_embeddings=64)
    model = CausalLM(config)
    for p in model.parameters():  # norms away from 1, so a misplaced weight would show
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    ids = torch.randint(0, 97, (3, 24))
    labels = ids.clone()
    labels[0, :5] = -100

    out = model(ids, labels=labels, loss_reduction="sum")
    out.loss.backward()
    ours = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    ref_logits, ref_loss = reference_forward(model, ids, labels)
    ref_loss.backward()

    torch.testing.assert_close(out.logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-6, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")


def test_rotary_tables_are_not_weights_and_positions_past_them_are_refused():
    config = LMConfig(vocab_size=97, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=16)
    model = CausalLM(config)
    assert not any("rope" in name for name in model.state_dict())  # the Qwen3 / minimind keys only
    with pytest.raises(ValueError, match="17 positions exceed max_position_embeddings \\(16\\)"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_queries_and_keys_stay_in_the_autocast_dtype():
    """The point of the lean norm: bf16 activations stay bf16 through q/k norm and rotation."""
    config = LMConfig(vocab_size=97, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    model = CausalLM(config)
    seen = {}
    model.model.layers[0].self_attn.q_norm.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o.dtype))
    model.model.layers[0].input_layernorm.register_forward_hook(lambda m, i, o: seen.__setitem__("h", o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.zeros(2, 8, dtype=torch.long))
    assert seen == {"q": torch.bfloat16, "h": torch.bfloat16}


def test_one_block_dispatches_at_most_100_ops_forward_and_backward():
    """benchmarks/count_ops.py's count at minimind's width (768, 8 heads, 4 kv heads), tiny tensors.
    It was 198 before the block was made lean; every op is a kernel launch and a trip through memory."""
    config = LMConfig(hidden_size=768, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=1,
                      max_position_embeddings=64)
    counter = count_block(config, batch=1, seq=16)
    assert sum(counter.ops.values()) <= 100, counter.ops
    assert counter.ops["_fused_rms_norm"] == 4 and counter.ops["_fused_rms_norm_backward"] == 4
    assert not {"repeat_interleave", "cat", "neg", "clone", "index_select"} & set(counter.ops), counter.ops

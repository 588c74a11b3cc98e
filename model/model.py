"""A small decoder-only language model in one file.

The architecture and the parameter names follow Hugging Face's Qwen3 (dense) and Qwen3-MoE, so a
state dict saved here loads into `transformers` unchanged (see model/hf.py):

    token ids -> embed_tokens -> N x [ x + attn(norm(x)) ; x + mlp(norm(x)) ] -> norm -> lm_head

- attention: grouped-query attention, per-head RMSNorm on queries and keys, rotary positions;
- mlp: SwiGLU, or a mixture of SwiGLU experts with top-k routing when `use_moe` is set;
- lm_head shares its weight with the token embedding (`tie_word_embeddings`).

minimind's model (its model/model_minimind.py) has the same parameter names and shapes, so its
weights load here unchanged; model/hf.py reads every size off a state dict. How our defaults
compare with minimind's, and why, is in LMConfig's docstring.
"""

import math
from dataclasses import asdict, dataclass, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from model.rope import check_rope_scaling, inverse_frequencies
from model.tokenizer import EOS_ID, PAD_ID

# A KV cache is one (keys, values) pair per layer, each shaped (batch, kv_heads, seq, head_dim).
KVCache = list[tuple[torch.Tensor, torch.Tensor]]


def default_intermediate_size(hidden_size: int) -> int:
    """The SwiGLU width used when none is given: 8/3 * hidden_size rounded up to a multiple of 64.

    SwiGLU has three matrices instead of two, so 8/3 * hidden keeps the parameter count of a
    classic 4 * hidden MLP; a multiple of 64 suits matrix kernels.
    """
    return 64 * math.ceil(hidden_size * 8 / 3 / 64)


@dataclass
class LMConfig:
    """Model hyper-parameters. `None` fields are derived in __post_init__.

    Compared with minimind's MiniMindConfig (same names): the SwiGLU width is the one default that
    differs. Ours is 64 * ceil(8/3 * hidden / 64) (2048 at hidden 768), minimind's
    64 * ceil(pi * hidden / 64) (2432); we keep 8/3 so the demo model keeps its shape, and a
    file's width is read from its weights whenever one is loaded (model/hf.py), so minimind's
    files need no flag. To train minimind's shape from scratch, pass intermediate_size=2432.
    The MoE top-k is 1 as in minimind: it is the one size a state dict cannot record, so the
    default is the one minimind's MoE files were trained with.
    """

    vocab_size: int = 6400
    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    intermediate_size: int | None = None  # None -> default_intermediate_size(hidden_size)
    max_position_embeddings: int = 32768
    rope_theta: float = 1e6
    rope_scaling: dict | None = None  # None, or HF's {"rope_type": "yarn"/"linear", "factor", ...}: model/rope.py
    rms_norm_eps: float = 1e-6
    dropout: float = 0.0
    use_moe: bool = False
    num_experts: int = 4
    num_experts_per_tok: int = 1  # top-k routing; minimind's default too
    moe_intermediate_size: int | None = None  # None -> intermediate_size (one expert = one dense MLP)
    aux_loss_coef: float = 0.01
    tie_word_embeddings: bool = True
    eos_token_id: int = EOS_ID  # <|im_end|>
    pad_token_id: int = PAD_ID  # <|endoftext|>

    def __post_init__(self) -> None:
        self._check_positive("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                             "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}), or set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: rotary embeddings rotate pairs")
        check_rope_scaling(self.rope_scaling)
        if self.intermediate_size is None:
            self.intermediate_size = default_intermediate_size(self.hidden_size)
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.use_moe and self.num_experts < 1:
            raise ValueError(f"num_experts ({self.num_experts}) must be at least 1 when use_moe is set")
        if self.use_moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_experts ({self.num_experts})"
            )

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive number, got {value}")

    def to_dict(self) -> dict:
        """A plain JSON-able dict; `LMConfig.from_dict(cfg.to_dict()) == cfg`."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LMConfig":
        """Build a config from a dict, refusing keys this class does not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown LMConfig keys: {', '.join(unknown)}")
        return cls(**d)


class CausalLMOutput(NamedTuple):
    logits: torch.Tensor | None  # (batch, seq, vocab); None where the loss was taken in chunks (chunk_tokens)
    loss: torch.Tensor | None  # language-model loss only, without aux_loss
    aux_loss: torch.Tensor  # MoE load-balancing loss, already scaled by aux_loss_coef; 0 when dense
    past_key_values: KVCache | None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op (float32 sums, x's dtype out). Qwen3 multiplies by the fp32 weight after the
        # cast back, turning bf16 q and k into fp32; here the weight takes x's dtype, and autocast keeps
        # out (it would run rms_norm in fp32). The result is cast once to the dtype the next matmuls run
        # in, where autocast would cast it for each of them (q, k and v; gate and up).
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps).to(dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                   scaling: dict | None = None):
    """cos and sin tables of shape (seq, head_dim) for the given absolute positions (model/rope.py: scaling)."""
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling)
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)  # "rotate_half" layout: pair i with i + head_dim/2
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + half]) of the last dimension by its angle.

    Qwen3's rotate_half is cat(-x2, x1); here it is roll(x) = cat(x2, x1), with the minus sign moved
    into the table (`signed_sin` = cat(-sin, sin)): four ops instead of five, and no copies of slices.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, past_kv=None, use_cache=False):
        batch, seq, _ = x.shape
        # Norm and rotation on contiguous (batch, seq, heads, head_dim) tensors, in the activation dtype;
        # only then are heads moved before seq (a view) for attention. cos/sin are (seq, 1, head_dim).
        q = apply_rotary(self.q_norm(self.q_proj(x).view(batch, seq, -1, self.head_dim)), cos, sin).transpose(1, 2)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(batch, seq, -1, self.head_dim)), cos, sin).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)

        if past_kv is not None:
            k = torch.cat((past_kv[0], k), dim=2)
            v = torch.cat((past_kv[1], v), dim=2)
        new_kv = (k, v) if use_cache else None  # (a layer's output only when asked: FSDP hooks every output)
        past_len = k.shape[2] - seq

        # Grouped-query attention: each key/value head serves num_heads / num_kv_heads query heads.
        # enable_gqa lets the attention kernel read the shared heads in place (no repeated copies).
        gqa = dict(dropout_p=self.dropout if self.training else 0.0, enable_gqa=self.num_heads != self.num_kv_heads)
        if past_len == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        elif seq == 1:
            # One new token may look at every cached position: no mask at all.
            out = F.scaled_dot_product_attention(q, k, v, **gqa)
        else:
            # A chunk after a cache: query i sits at position past_len + i and sees keys up to it.
            # (is_causal would align the triangle to the top-left corner, which is wrong here.)
            mask = torch.ones(seq, past_len + seq, dtype=torch.bool, device=x.device).tril(diagonal=past_len)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        return self.o_proj(out), new_kv


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEFeedForward(nn.Module):
    """Mixture of SwiGLU experts: each token goes to its top-k experts, weighted by the router."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            FeedForward(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the output and the (unscaled) load-balancing loss of this layer."""
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(tokens), dim=-1, dtype=torch.float32)  # (tokens, experts)
        top_weights, top_experts = probs.topk(self.top_k, dim=-1)  # (tokens, k)
        top_weights = (top_weights / top_weights.sum(-1, keepdim=True)).to(x.dtype)

        out = torch.zeros_like(tokens)
        for j, expert in enumerate(self.experts):
            token_idx, slot = torch.where(top_experts == j)
            # No "if token_idx.numel() == 0: continue": running an expert on an empty batch keeps it
            # in the autograd graph, so its weights get a gradient of zeros instead of None. DDP
            # (find_unused_parameters=False) needs every parameter to receive a gradient each step.
            expert_out = expert(tokens[token_idx]) * top_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, expert_out.to(out.dtype))

        # Switch-Transformer balance loss: num_experts * sum_j(share of routing slots sent to j *
        # mean router probability of j). It is 1.0 when routing is perfectly uniform.
        slot_share = F.one_hot(top_experts, self.num_experts).float().mean(dim=(0, 1))
        aux_loss = self.num_experts * (slot_share * probs.mean(0)).sum()
        return out.view_as(x), aux_loss


class DecoderLayer(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.use_moe = config.use_moe
        if config.use_moe:
            self.mlp = MoEFeedForward(config)
        else:
            self.mlp = FeedForward(config.hidden_size, config.intermediate_size)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, past_kv=None, use_cache=False):
        attn_out, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, past_kv, use_cache)
        x = x + self.resid_dropout(attn_out)
        if self.use_moe:
            mlp_out, aux_loss = self.mlp(self.post_attention_layernorm(x))
        else:
            mlp_out, aux_loss = self.mlp(self.post_attention_layernorm(x)), None  # dense: no balance loss
        x = x + self.resid_dropout(mlp_out)
        return x, new_kv, aux_loss


class Decoder(nn.Module):
    """Embedding, the stack of layers and the final norm (Qwen3's `model.` prefix)."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Rotary tables for every position, computed once in fp32. Not persistent: they are not
        # weights, so state_dict() keeps exactly Qwen3's and minimind's keys.
        cos, sin = rotary_cos_sin(torch.arange(config.max_position_embeddings), config.head_dim,
                                  config.rope_theta, torch.float32, config.rope_scaling)
        half = config.head_dim // 2
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_signed_sin", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1), persistent=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        x = self.embed_tokens(input_ids)
        past_len = past_key_values[0][0].shape[2] if past_key_values else 0
        end = past_len + input_ids.shape[1]
        if end > self.rope_cos.shape[0]:
            raise ValueError(f"{end} positions exceed max_position_embeddings ({self.rope_cos.shape[0]})")
        # The tables in the dtype attention runs in (bf16 under autocast), cast once for all layers,
        # shaped (seq, 1, head_dim) to broadcast over the heads of (batch, seq, heads, head_dim).
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        cos = self.rope_cos[past_len:end, None].to(dtype)
        sin = self.rope_signed_sin[past_len:end, None].to(dtype)
        new_cache, aux_loss = [], x.new_zeros((), dtype=torch.float32)
        for i, layer in enumerate(self.layers):
            x, kv, layer_aux = layer(x, cos, sin, past_key_values[i] if past_key_values else None, use_cache)
            new_cache.append(kv)
            if layer_aux is not None:
                aux_loss = aux_loss + layer_aux
        return self.norm(x), new_cache, aux_loss


class CausalLM(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_word_embeddings:
            # One tensor under two names: both appear in state_dict(), and loading either sets both.
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Number of trainable values; the tied embedding / lm_head matrix is counted once."""
        return sum(p.numel() for p in self.parameters())  # parameters() yields shared tensors once

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        loss_reduction: str = "mean",
        temperature: float = 1.0,
        chunk_tokens: int = 0,
    ) -> CausalLMOutput:
        """Logits for every position, and the next-token loss when `labels` are given.

        `labels` has the same shape as `input_ids` (position t holds the token itself); the shift by
        one happens here. Positions labelled -100 are ignored. `loss_reduction="mean"` averages over
        the counted tokens, `"sum"` adds them up (0.0 when none count), for callers that normalise
        by the token count of a larger batch; `"none"` gives each position's loss, (batch, seq), 0.0
        where ignored (validation weighs each by the bytes of its token: trainer/hardening/tracking.py).
        `temperature`: the loss under softmax(logits / temperature), the distribution sample_next_token draws
        from at that temperature (GRPO scores its rollouts by it); 1 leaves the logits as they are.
        `chunk_tokens` (with `loss_reduction="none"`): the head and the loss taken that many positions at a time and
        taken again in the backward, so a batch's (positions x vocab) float32 log-softmax is never whole in memory
        (GRPO's long rollouts); no logits are returned. Each position's loss is the one it has unchunked, up to rounding.
        """
        hidden, new_cache, aux_loss = self.model(input_ids, past_key_values, use_cache)
        aux_loss = self.config.aux_loss_coef * aux_loss if self.config.use_moe else aux_loss
        if chunk_tokens and labels is not None and loss_reduction == "none":
            targets = F.pad(labels[:, 1:], (0, 1), value=-100).flatten()  # position t predicts labels[t + 1]
            # checkpoint: the backward recomputes a chunk's logits instead of keeping every chunk's log-softmax
            pieces = [torch.utils.checkpoint.checkpoint(self.token_losses, h, t, temperature, use_reentrant=False)
                      for h, t in zip(hidden.flatten(0, 1).split(chunk_tokens), targets.split(chunk_tokens))]
            return CausalLMOutput(None, torch.cat(pieces).view(labels.shape), aux_loss, None)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            if loss_reduction not in ("mean", "sum", "none"):
                raise ValueError(f"loss_reduction must be 'mean', 'sum' or 'none', got {loss_reduction!r}")
            # Shift the labels, not the logits: position t predicts labels[t + 1], the last predicts
            # nothing (-100). Slicing the logits would copy all of them; flatten(0, 1) is a view.
            # (Under autocast, cross_entropy computes in fp32, as it must for a sum over many tokens.)
            targets = F.pad(labels[:, 1:], (0, 1), value=-100).flatten()
            scores = logits.flatten(0, 1) if temperature == 1.0 else logits.flatten(0, 1) / temperature
            loss = F.cross_entropy(scores, targets, ignore_index=-100,
                                   reduction="none" if loss_reduction == "none" else "sum")
            if loss_reduction == "none":
                loss = loss.view(labels.shape)
            elif loss_reduction == "mean":
                # clamp: a batch with no counted token gives 0 instead of 0/0 = NaN.
                loss = loss / (targets != -100).sum().clamp(min=1)
        return CausalLMOutput(logits=logits, loss=loss, aux_loss=aux_loss,
                              past_key_values=new_cache if use_cache else None)

    def token_losses(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """-log p(target) at each of `hidden`'s positions (positions, hidden_size), 0 where the target is -100."""
        scores = self.lm_head(hidden) if temperature == 1.0 else self.lm_head(hidden) / temperature
        return F.cross_entropy(scores, targets, ignore_index=-100, reduction="none")

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue `input_ids` (batch, seq) by up to `max_new_tokens`; returns prompt + new tokens.

        temperature < 1e-5 (0 included) means greedy; `generator` (on the model's device) draws the samples
        instead of the global RNG (drawn again alike after a resume). A sequence stops at `eos_token_id` (None:
        never stop early); in a batch, finished rows are padded with pad_token_id until all rows are done.
        """
        was_training = self.training
        self.eval()
        out = self(input_ids, use_cache=True)
        sequence = input_ids
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            next_token = sample_next_token(out.logits[:, -1].float(), temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                next_token = next_token.masked_fill(finished, self.config.pad_token_id)
                finished |= next_token == eos_token_id
            sequence = torch.cat((sequence, next_token[:, None]), dim=1)
            if finished.all() or step == max_new_tokens - 1:
                break
            out = self(next_token[:, None], past_key_values=out.past_key_values, use_cache=True)
        self.train(was_training)
        return sequence


def sample_next_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of `logits` (batch, vocab): greedy, or sampled after top-k / top-p."""
    # Below 1e-5 sampling is greedy anyway (a logit gap of 0.001 becomes 100 nats), and a far smaller
    # temperature would overflow the logits to inf, whose softmax is nan.
    if temperature < 1e-5:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k > 0:
        kth_best = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (the best one always stays).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator).squeeze(-1)

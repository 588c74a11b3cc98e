"""Rollouts for reinforcement learning (GRPO): many rows decoded together on the project's own model.

    prompts [P]  -> prefill each prompt once, copy its keys/values into its G rows of one preallocated cache
                 -> decode all P x G rows together, each from its own random stream
                 -> a row that ends a turn may get forced tokens (a tool's result in the chat template), read into
                    its own cache in one chunk while the other rows go on
                 -> per row: the ids after its prompt, and which of them were sampled (the others were forced)

How rows of different lengths share one cache: row r holds lengths[r] tokens at positions 0 .. lengths[r] - 1, and
its next token goes to position lengths[r] (its rotary angle too). A query sees the keys at positions up to its own
and nothing after, so what lies past a row's end (another row is longer) is never read: no left padding, no
position ids to shift. A finished row is left out of every later forward: it costs nothing more.

Token in, token out: the ids returned are the ids drawn (or forced), never text decoded and encoded again, so the
ids GRPO trains are exactly the ids sampled. Row g of a prompt draws from its own torch.Generator, seeded by the
prompt's seed and g: its sample does not depend on which other prompts share the batch (tests/test_rollout.py).
(On a GPU in bf16 a matrix product may round differently for another batch shape; the random stream stays the row's.)
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from model.model import CausalLM, apply_rotary, sample_next_token

# after_turn(row, the turn's ids, whether it ended with the end-of-text id) -> forced ids to append, or None: done
AfterTurn = Callable[[int, list[int], bool], list[int] | None]


class Completion(NamedTuple):
    """One row's rollout after its prompt."""
    ids: torch.Tensor  # (n,) long: sampled and forced tokens, in order
    sampled: torch.Tensor  # (n,) bool: True where the model drew the token, False where it was forced (a tool's)


def row_seed(prompt_seed: int, g: int) -> int:
    """The seed of row g of a prompt's group (modulo 2**63: a generator's seed is 64 bits)."""
    return (prompt_seed * 1_000_003 + g) % 2**63


def new_cache(model: CausalLM, rows: int, width: int, device: torch.device) -> list:
    """Keys and values of every layer for `rows` rows of `width` positions, allocated once: (rows, kv_heads, width,
    head_dim), in the dtype attention runs in (the autocast dtype when it is on)."""
    config = model.config
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else \
        model.lm_head.weight.dtype
    shape = (rows, config.num_key_value_heads, width, config.head_dim)
    # Zeros, not torch.empty: attention weighs the values past a row's end by exactly 0, and 0 x NaN garbage is NaN.
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_hidden_layers)]


def forward_rows(model: CausalLM, cache: list, rows: list[int], ids: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """Feed ids (b, s) to cache rows `rows`, row i's at positions starts[i] .. starts[i] + s - 1; their keys and
    values are written there. Returns the next-token logits after each row's last id, (b, vocab) in float32.

    The model's own layers (model/model.py), with two differences: each row has its own positions (rotary angles
    and where its keys go), and attention reads the cache with a mask (key position <= query position)."""
    decoder, device = model.model, ids.device
    b, s = ids.shape
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(s, device=device)  # (b, s)
    end = max(starts) + s  # the keys any of these queries may see
    if end > decoder.rope_cos.shape[0]:
        raise ValueError(f"{end} positions exceed max_position_embeddings ({decoder.rope_cos.shape[0]})")
    index = torch.tensor(rows, device=device)
    # Contiguous rows (all rows at the start, or one row): a view of the cache, not a copy.
    read = slice(rows[0], rows[0] + b) if rows == list(range(rows[0], rows[0] + b)) else index
    dtype = cache[0][0].dtype
    cos = decoder.rope_cos[positions][:, :, None].to(dtype)  # (b, s, 1, head_dim): each row its own angles
    sin = decoder.rope_signed_sin[positions][:, :, None].to(dtype)
    sees = (torch.arange(end, device=device) <= positions[:, :, None])[:, None]  # (b, 1, s, end)
    x = decoder.embed_tokens(ids)
    for layer, (keys, values) in zip(decoder.layers, cache):
        attention, h = layer.self_attn, layer.input_layernorm(x)
        q = apply_rotary(attention.q_norm(attention.q_proj(h).view(b, s, -1, attention.head_dim)), cos, sin)
        k = apply_rotary(attention.k_norm(attention.k_proj(h).view(b, s, -1, attention.head_dim)), cos, sin)
        # (rows (b, 1) and positions (b, s) pick (b, s) slots, each (kv_heads, head_dim): k's own layout)
        keys[index[:, None], :, positions] = k.to(dtype)
        values[index[:, None], :, positions] = attention.v_proj(h).view(b, s, -1, attention.head_dim).to(dtype)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys[read, :, :end], values[read, :, :end],
                                             attn_mask=sees, enable_gqa=attention.num_heads != attention.num_kv_heads)
        x = x + attention.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        mlp_out = layer.mlp(layer.post_attention_layernorm(x))
        x = x + (mlp_out[0] if layer.use_moe else mlp_out)  # (MoE: (out, balance loss); no loss to keep here)
    return model.lm_head(decoder.norm(x[:, -1])).float()


def draw(logits: torch.Tensor, live: list[int], temperature: float, generators: list) -> list[int]:
    """The next token of each live row: greedy below temperature 1e-5, else sampled with the row's own generator."""
    if temperature < 1e-5:
        return logits[live].argmax(dim=-1).tolist()
    drawn = [sample_next_token(logits[r:r + 1], temperature, 0, 1.0, generators[r]) for r in live]
    return torch.cat(drawn).tolist()  # one wait for the device, for all rows


def read_prompts(model: CausalLM, cache: list, prompts: list[torch.Tensor], group_size: int,
                 logits: torch.Tensor) -> list[int]:
    """Read each prompt once, into the first row of its group, and copy its keys and values (and its next-token
    logits) into the other G - 1 rows. Returns each row's length (0 for a prompt with no ids)."""
    lengths = []
    for p, prompt in enumerate(prompts):
        first, end = p * group_size, (p + 1) * group_size
        lengths += [len(prompt)] * group_size
        if not len(prompt):
            continue
        logits[first:end] = forward_rows(model, cache, [first], prompt[None], [0])
        for keys, values in cache:
            keys[first + 1:end, :, :len(prompt)] = keys[first:first + 1, :, :len(prompt)]
            values[first + 1:end, :, :len(prompt)] = values[first:first + 1, :, :len(prompt)]
    return lengths


def feed(model: CausalLM, cache: list, logits: torch.Tensor, lengths: list[int], decoding: list[tuple[int, list]],
         chunks: list[tuple[int, list]]) -> None:
    """Read each live row's new ids into its cache, after its `lengths[row]` ids, and put its next-token logits in
    `logits`: one forward for all rows that go on drawing (their drawn token), one per row that reads forced ids
    (its turn's end and those ids, in one chunk: nothing before them is read again)."""
    device = logits.device
    if decoding:
        rows = [r for r, _ in decoding]
        fed = torch.tensor([new for _, new in decoding], device=device)
        logits[rows] = forward_rows(model, cache, rows, fed, [lengths[r] for r in rows])
    for r, chunk in chunks:
        logits[r] = forward_rows(model, cache, [r], torch.tensor([chunk], device=device), [lengths[r]])[0]
    for r, new in decoding + chunks:
        lengths[r] += len(new)


@torch.no_grad()
def rollout(model: CausalLM, prompts: list[torch.Tensor], group_size: int, max_new_tokens: int, temperature: float,
            prompt_seeds: list[int], eos_id: int, after_turn: AfterTurn | None = None) -> list[Completion]:
    """G rollouts of each prompt (1-D ids on the model's device), rows ordered prompt by prompt: row p * G + g is
    prompt p's g-th. Each row draws until its end-of-text id or `max_new_tokens` tokens after its prompt (sampled
    and forced together); then `after_turn`, if given, may hand it forced ids to read before it draws again (None
    or no room left for one more drawn token: the row is done). A prompt with no ids (the loader's placeholder)
    gives G empty rows. Row g of prompt p draws from a generator seeded by row_seed(prompt_seeds[p], g)."""
    device, vocab = next(model.parameters()).device, model.config.vocab_size
    rows = len(prompts) * group_size
    was_training = model.training
    model.eval()
    cache = new_cache(model, rows, max(len(prompt) for prompt in prompts) + max_new_tokens, device)
    generators = [torch.Generator(device).manual_seed(row_seed(seed, g)) for seed in prompt_seeds
                  for g in range(group_size)]
    logits = torch.empty(rows, vocab, device=device)  # each live row's next-token logits
    lengths = read_prompts(model, cache, prompts, group_size, logits)  # how many ids each row's cache holds
    ids, sampled, turn_start = [[] for _ in range(rows)], [[] for _ in range(rows)], [0] * rows
    live = [r for r in range(rows) if lengths[r]]  # (a placeholder's rows draw nothing)
    while live:
        decoding, chunks = [], []  # rows fed their drawn token; rows fed it with forced ids after it
        for r, token in zip(live, draw(logits, live, temperature, generators)):
            ids[r].append(token)
            sampled[r].append(True)
            if token != eos_id and len(ids[r]) < max_new_tokens:
                decoding.append(r)
                continue
            forced = after_turn(r, ids[r][turn_start[r]:], token == eos_id) if after_turn else None
            if forced and len(ids[r]) + len(forced) < max_new_tokens:  # room for one more drawn token after them
                ids[r] += forced
                sampled[r] += [False] * len(forced)
                turn_start[r] = len(ids[r])
                chunks.append((r, [token, *forced]))
        feed(model, cache, logits, lengths, [(r, [ids[r][-1]]) for r in decoding], chunks)
        live = sorted(decoding + [r for r, _ in chunks])
    model.train(was_training)
    return [Completion(torch.tensor(row, dtype=torch.long, device=device),
                       torch.tensor(mask, dtype=torch.bool, device=device)) for row, mask in zip(ids, sampled)]


def trained_batch(prompts: list[torch.Tensor], completions: list[Completion], pad_id: int,
                  ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels [rows, T], right-padded (a causal model's earlier positions never see the padding): each
    row its prompt and completion; its labels the sampled ids, `ignore_index` on the prompt, forced ids, padding."""
    group_size = len(completions) // len(prompts)
    rows = [(torch.cat([prompts[r // group_size], c.ids]),
             F.pad(c.ids.masked_fill(~c.sampled, ignore_index), (len(prompts[r // group_size]), 0), value=ignore_index))
            for r, c in enumerate(completions)]
    width = max(1, max(len(row) for row, _ in rows))  # at least 1: a micro-batch of placeholders only
    input_ids = torch.stack([F.pad(row, (0, width - len(row)), value=pad_id) for row, _ in rows])
    labels = torch.stack([F.pad(label, (0, width - len(label)), value=ignore_index) for _, label in rows])
    return input_ids, labels

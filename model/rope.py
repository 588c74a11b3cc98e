"""Rotary position frequencies, and two ways to read texts longer than the model was trained at.

A rotary pair i of a head turns by position * inv_freq[i]. A model trained at N tokens has seen its slow
pairs turn only part of a circle: past N they reach angles it never saw, and its loss climbs. A
`rope_scaling` setting (its keys as Hugging Face's config.json spells them) maps longer texts back into
the angles it knows, by a factor s:

- "linear" (position interpolation): every frequency divided by s, so position p looks like p / s; nearby
  tokens then sit s times closer than in training.
- "yarn" (YaRN, arXiv 2309.00071): only the slow pairs are divided by s. Pairs that turn more than
  beta_fast (32) times within N positions keep their training frequency, pairs that turn fewer than
  beta_slow (1) times are divided by s, and a linear ramp joins the two. Attention is also sharpened:
  cos and sin are multiplied by 0.1 * ln(s) + 1 (about 1.28 at s = 16), which scales q.k by its square.

These are the numbers of transformers' _compute_linear_scaling_rope_parameters and
_compute_yarn_parameters (tests/test_long_context.py compares them) and of llama.cpp's rope.scaling keys
(scripts/export_gguf.py). What each buys on a small model is measured in docs/long_context.md.
"""

import argparse
import math

import torch

ROPE_TYPES = ("linear", "yarn")
YARN_KEYS = {"rope_type", "factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow"}


def check_rope_scaling(scaling: dict | None) -> None:
    """Raise ValueError, in one line, unless `scaling` is None or a setting this model computes."""
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: rope_type {kind!r} is not one this model computes ({', '.join(ROPE_TYPES)})")
    unknown = sorted(set(scaling) - (YARN_KEYS if kind == "yarn" else {"rope_type", "factor"}))
    if unknown:
        raise ValueError(f"rope_scaling: {kind} takes no {', '.join(unknown)}")
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor < math.inf:
        raise ValueError(f"rope_scaling: factor {factor!r} must be a number >= 1 (the longer length / the trained one)")
    if kind == "yarn":
        original = scaling.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ValueError(f"rope_scaling: yarn needs original_max_position_embeddings, the positive whole number "
                             f"of tokens the model was trained at (got {original!r})")


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq of the head_dim / 2 rotary pairs, the factor cos and sin are multiplied by)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if scaling is None:
        return inv_freq, 1.0
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor, 1.0
    trained = scaling["original_max_position_embeddings"]

    def pair_turning(turns: float) -> float:
        # The pair index i whose wavelength 2*pi*theta^(2i/head_dim) fits `turns` times in the trained length.
        return head_dim * math.log(trained / (turns * 2 * math.pi)) / (2 * math.log(theta))

    # Below `low` the pairs turned often enough in training to keep their frequency; from `high` on they are
    # divided by the factor. Rounded outwards and clamped as transformers does (its upper bound is head_dim - 1).
    low = max(math.floor(pair_turning(scaling.get("beta_fast") or 32)), 0)
    high = min(math.ceil(pair_turning(scaling.get("beta_slow") or 1)), head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float) - low) / (high - low or 0.001)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention_factor = scaling.get("attention_factor")  # given (minimind writes 1.0): used as it is, as transformers
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0  # YaRN's sqrt(1/t); 1.0 at factor 1
    return inv_freq, float(attention_factor)


def rope_scaling_of_config(config: dict, source: str) -> dict | None:
    """The rope_scaling setting a config.json describes: Hugging Face's (rope_parameters, or the older
    rope_scaling; rope_type, or the older type) or minimind's (rope_scaling, in force only where its
    inference_rope_scaling is true). ValueError in one line naming `source` for one this model cannot compute."""
    if config.get("inference_rope_scaling") is False:  # minimind writes its YaRN dict, then switches it off here
        return None
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{source}: rope_scaling holds {rope!r}, not an object of settings")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    scaling = {"rope_type": kind, **{key: value for key, value in rope.items()
                                     if key in YARN_KEYS - {"rope_type"} and value is not None}}
    if kind == "linear":
        scaling.pop("original_max_position_embeddings", None)  # transformers' linear takes only the factor
    try:
        check_rope_scaling(scaling)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    return scaling


# ---- the command line's setting ----------------------------------------------------------------------

def add_rope_scaling_flags(parser: argparse.ArgumentParser) -> None:
    """--rope_scaling, --rope_factor, --original_max_position_embeddings (eval_model.py, the server, the exports)."""
    a = parser.add_argument
    a("--rope_scaling", choices=ROPE_TYPES, default=None,
      help="read texts longer than the model was trained at: yarn or linear (docs/long_context.md); default off")
    a("--rope_factor", type=float, default=None,
      help="with --rope_scaling: how many times the trained length to reach (e.g. 4: a model trained at 512 "
           "tokens reads 2048)")
    a("--original_max_position_embeddings", type=int, default=None,
      help="with --rope_scaling: the length the model was trained at, for weights without an out/{weight}.json "
           "that records it (minimind's)")


def rope_scaling_of_flags(args: argparse.Namespace, recorded: int | None, source: str) -> dict | None:
    """The rope_scaling setting the flags ask for (None without --rope_scaling), with the trained length that
    `source`'s .json records (`recorded`) or --original_max_position_embeddings; ValueError in one line."""
    if args.rope_scaling is None:
        if args.rope_factor is not None or args.original_max_position_embeddings is not None:
            raise ValueError("--rope_factor and --original_max_position_embeddings are read only with --rope_scaling "
                             "yarn or linear")
        return None
    if args.rope_factor is None:
        raise ValueError(f"--rope_scaling {args.rope_scaling} needs --rope_factor: how many times the trained length "
                         f"to reach")
    flag = args.original_max_position_embeddings
    if flag is not None and recorded is not None and flag != recorded:
        raise ValueError(f"--original_max_position_embeddings {flag}, but {source} records {recorded}: the trained "
                         f"length is {recorded}; leave the flag out")
    trained = recorded if recorded is not None else flag
    if trained is None:
        raise ValueError(f"--rope_scaling needs the length the model was trained at, which {source} would record: "
                         f"pass --original_max_position_embeddings N")
    scaling = {"rope_type": args.rope_scaling, "factor": args.rope_factor}
    if args.rope_scaling == "yarn":
        scaling["original_max_position_embeddings"] = trained
    check_rope_scaling(scaling)
    return scaling

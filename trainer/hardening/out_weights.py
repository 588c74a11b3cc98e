"""The out/ file: `out/{run}.pth`, the FP16 weights a stage hands to inference and to the next stage, and beside it
`out/{run}.json`, what the weights cannot tell (the length trained at; a LoRA adapter's rank, alpha and base; the
tokenizer). Both are written atomically (output_paths.atomic_write: temp file, fsync, rename), the weights first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from output_paths import atomic_write, atomic_write_text
from trainer.hardening.durable_files import CheckpointError, no_check


def cast_state_dict(state_dict: dict, dtype: torch.dtype) -> dict:
    """CPU copies in `dtype` that keep tied tensors tied (embedding = lm_head), so files hold them once."""
    converted = {}
    return {name: converted.setdefault(t.data_ptr(), t.detach().to("cpu", dtype)) for name, t in state_dict.items()}


# What out/{run}.json holds, of the run's settings (those a run has: LoRA's are None elsewhere).
OUT_SIDECAR_KEYS = ("max_seq_len", "lora_rank", "lora_alpha", "lora_targets", "base_file", "base_sha256",
                    "tokenizer_vocab_sha256")


def write_out_weights(out_path: Path, weights: dict, train_args: dict,
                      still_held: Callable[[], None] = no_check) -> None:
    """`out/{run}.pth`, the FP16 state dict, and beside it `out/{run}.json`, {"max_seq_len": N}: the length the
    model was trained at, which its weights cannot tell (scripts/serve_openai_api.py refuses longer prompts);
    for a LoRA adapter also its "lora_rank", "lora_alpha", "lora_targets" and the base it was trained on,
    "base_file" and "base_sha256" (model/lora.py reads them); and the tokenizer's "tokenizer_vocab_sha256"
    (a stage that starts from the weights checks it: from_weight.py). The .pth stays a plain state dict, as
    minimind's loaders expect."""
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out_path, lambda f: torch.save(weights, f), still_held)
        if "max_seq_len" in train_args:  # absent only in a state made by hand (some tests)
            sidecar = {key: train_args[key] for key in OUT_SIDECAR_KEYS if train_args.get(key) is not None}
            atomic_write_text(out_path.with_suffix(".json"), json.dumps(sidecar) + "\n", still_held)
    except OSError as error:
        raise CheckpointError(f"could not write {out_path}: {error}") from error


def trained_length(weight_file: Path) -> int | None:
    """The max_seq_len the weights were trained at, from the .json write_out_weights writes beside them;
    None where there is none (minimind's weights, or older ones)."""
    sidecar = weight_file.with_suffix(".json")
    if not sidecar.is_file():
        return None
    try:
        length = json.loads(sidecar.read_text(encoding="utf-8"))["max_seq_len"]
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise RuntimeError(f'{sidecar} should hold {{"max_seq_len": N}} ({error!r}): fix or delete it') from None
    if type(length) is not int or length < 1:  # (bool is an int: true is no length)
        raise RuntimeError(f'{sidecar} holds "max_seq_len": {json.dumps(length)}; it should be the positive whole '
                           f"number of tokens the model was trained at: fix or delete it")
    return length

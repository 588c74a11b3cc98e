"""A base model's out/ file and an adapter for it, made in this process as trainer/train_lora.py would leave
them, for the tests of what reads them (tests/test_lora.py, test_export_hf.py, test_eval_and_scripts.py,
test_serve_openai_api.py). The adapter's B is random, not zero as after apply_lora: a trained adapter
changes the model, and a misplaced or mis-scaled tensor then shows in the logits."""

from __future__ import annotations

from pathlib import Path

import torch

from model.lora import adapter_of, apply_lora
from model.model import CausalLM, LMConfig
from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from trainer.hardening.out_weights import cast_state_dict, write_out_weights
from trainer.hardening.durable_files import sha256_of

TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")  # some of each block's, not all: targets are read back


def tiny_config(vocab_size: int | None = None, **sizes) -> LMConfig:
    """TINY_MODEL's sizes (tests/conftest.py), for the default tokenizer unless `vocab_size` is given."""
    vocab_size = vocab_size or load_tokenizer(DEFAULT_TOKENIZER).get_vocab_size()
    return LMConfig(vocab_size=vocab_size, **{"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                             "num_key_value_heads": 2, **sizes})


def write_base(out_dir: Path, config: LMConfig, seed: int = 0, name: str = "full_sft") -> Path:
    """out_dir/{name}_{hidden}.pth: random FP16 weights of `config`, as a stage's out/ file."""
    torch.manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}_{config.hidden_size}.pth"
    torch.save(cast_state_dict(CausalLM(config).state_dict(), torch.float16), path)
    return path


def write_adapter(out_dir: Path, config: LMConfig, rank: int = 4, alpha: float = 6.0, targets=TARGETS,
                  seed: int = 1, name: str = "demo", base: Path | None = None) -> Path:
    """out_dir/lora_{name}_{hidden}.pth and its .json: random A and B (FP16), as train_lora.py writes them; the
    .json names `base` (file and SHA-256) as the model it was trained on, when given."""
    torch.manual_seed(seed)
    model = CausalLM(config)
    adapter = apply_lora(model, rank, alpha, targets)
    with torch.no_grad():
        for parameter in adapter.parameters():
            parameter.normal_(0.0, 0.3)
    path = out_dir / f"lora_{name}_{config.hidden_size}.pth"
    base_identity = {"base_file": str(base), "base_sha256": sha256_of(base)} if base else {}
    write_out_weights(path, cast_state_dict(adapter_of(model).state_dict(), torch.float16),
                      {"max_seq_len": 48, "lora_rank": rank, "lora_alpha": alpha, "lora_targets": ",".join(targets),
                       **base_identity})
    return path


def base_model(path: Path) -> CausalLM:
    """The FP32 model of an out/ file written by write_base (every size read off the weights)."""
    from model.weights import load_project_weights
    weights, config = load_project_weights(path, {})
    model = CausalLM(config)
    model.load_state_dict(weights, strict=True)
    return model.eval()

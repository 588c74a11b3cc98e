"""Hugging Face export and import.

Our parameter names already follow Qwen3, so the export is mostly bookkeeping: a config.json that
describes the same architecture, the weights as safetensors, and the tokenizer with a ChatML chat
template. The result loads with plain `transformers`, no custom code:

    AutoModelForCausalLM.from_pretrained("hf_model"); AutoTokenizer.from_pretrained("hf_model")

Reading our own .pth files, and their sizes off the tensors, is model/weights.py.

`scripts/export_hf.py` is the command line over these functions; the trainer's `--save_hf` and
`eval_model.py` call them directly.
"""

import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from tokenizers import Tokenizer

from model.chat_template import CHAT_TEMPLATE  # the training format, for apply_chat_template
from model.model import LMConfig
from model.rope import rope_scaling_of_config
from model.tokenizer import BOS_ID, BOS_TOKEN, DEFAULT_TOKENIZER, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS
from model.weights import check_regular_file, check_state_dict
from output_paths import atomic_write_bytes, atomic_write_text, check_output_folder

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HF_FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json")
def check_tokenizer(tokenizer_path: Path, lm_config: LMConfig) -> None:
    """Raise ValueError unless the tokenizer's special-token ids and size fit the model."""
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as error:  # the tokenizers library raises a bare Exception for a file it cannot read
        raise ValueError(f"{tokenizer_path}: the tokenizers library cannot load it ({error})") from error
    wrong = [
        f"{token} is {tokenizer.token_to_id(token)}, expected {expected}"
        for token, expected in SPECIAL_TOKENS.items()
        if tokenizer.token_to_id(token) != expected
    ]
    if wrong:
        raise ValueError(f"{tokenizer_path}: special token ids differ from the model's: " + "; ".join(wrong))
    if tokenizer.get_vocab_size() > lm_config.vocab_size:
        raise ValueError(
            f"{tokenizer_path} has {tokenizer.get_vocab_size()} tokens, more than the model's "
            f"vocab_size {lm_config.vocab_size}"
        )


def hf_config(lm_config: LMConfig, dtype: torch.dtype) -> dict:
    """config.json contents for Qwen3ForCausalLM, or Qwen3MoeForCausalLM when use_moe."""
    dtype_name = str(dtype).removeprefix("torch.")
    scaling = lm_config.rope_scaling
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": lm_config.vocab_size,
        "hidden_size": lm_config.hidden_size,
        "intermediate_size": lm_config.intermediate_size,
        "num_hidden_layers": lm_config.num_hidden_layers,
        "num_attention_heads": lm_config.num_attention_heads,
        "num_key_value_heads": lm_config.num_key_value_heads,
        "head_dim": lm_config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": positions_of(lm_config),
        "rope_theta": lm_config.rope_theta,
        # "rope_scaling" with "rope_type": what transformers 4.x reads, and 5.x moves into rope_parameters.
        "rope_scaling": dict(scaling) if scaling else None,
        "rms_norm_eps": lm_config.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": 0.02,
        "tie_word_embeddings": lm_config.tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": lm_config.eos_token_id,
        "pad_token_id": lm_config.pad_token_id,
        # transformers 4.x reads "torch_dtype", 5.x reads "dtype".
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    if lm_config.use_moe:
        config.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=lm_config.num_experts,
            num_experts_per_tok=lm_config.num_experts_per_tok,
            moe_intermediate_size=lm_config.moe_intermediate_size,
            norm_topk_prob=True,  # we renormalise the top-k router weights
            decoder_sparse_step=1,  # every layer is MoE
            mlp_only_layers=[],
            router_aux_loss_coef=lm_config.aux_loss_coef,
            output_router_logits=False,
        )
    return config


def positions_of(lm_config: LMConfig) -> int:
    """max_position_embeddings as transformers reads it: under YaRN the scaled length, trained x factor
    (transformers warns when it is not); else the rotary table's length."""
    scaling = lm_config.rope_scaling
    if scaling and scaling["rope_type"] == "yarn":
        return math.ceil(scaling["original_max_position_embeddings"] * scaling["factor"])
    return lm_config.max_position_embeddings


def tokenizer_config(lm_config: LMConfig) -> dict:
    """tokenizer_config.json: a fast tokenizer over tokenizer.json, its special tokens, ChatML."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": PAD_TOKEN,
        "model_max_length": positions_of(lm_config),
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def export_hf(
    state_dict: dict[str, torch.Tensor],
    lm_config: LMConfig,
    out_dir: str | Path,
    tokenizer_path: str | Path = DEFAULT_TOKENIZER,
    dtype: torch.dtype = torch.float16,
    overwrite: bool = True,
) -> Path:
    """Write a Hugging Face model directory for `state_dict` (our names, any dtype); returns it. Each file goes
    through output_paths.atomic_write (a link there is replaced, never written through; a folder or FIFO there
    is refused); with `overwrite` False, a file already there is refused too, before anything is written."""
    check_state_dict(state_dict, lm_config)
    tokenizer_path = Path(tokenizer_path)
    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"tokenizer not found: {tokenizer_path} (train one or pass --tokenizer)")
    check_tokenizer(tokenizer_path, lm_config)
    out_dir = Path(out_dir)
    check_output_folder(out_dir, HF_FILES, overwrite, inputs=[tokenizer_path])
    tokenizer_bytes = tokenizer_path.read_bytes()
    out_dir.mkdir(parents=True, exist_ok=True)

    # safetensors refuses tensors that share memory. For a tied model transformers itself saves only
    # the embedding and re-ties lm_head to it on load, so we do the same.
    tensors = {
        name: t.detach().to(dtype).contiguous()
        for name, t in state_dict.items()
        if not (lm_config.tie_word_embeddings and name == "lm_head.weight")
    }
    # The bytes through our own temp file, as the other files: save_file writes a 0600 temp file and renames it,
    # so a team sharing the directory could read everything but the weights. Costs one copy of them in memory.
    atomic_write_bytes(out_dir / "model.safetensors", save(tensors, metadata={"format": "pt"}))

    generation = {
        "bos_token_id": BOS_ID,
        "eos_token_id": lm_config.eos_token_id,
        "pad_token_id": lm_config.pad_token_id,
    }
    write_json(out_dir / "config.json", hf_config(lm_config, dtype))
    write_json(out_dir / "generation_config.json", generation)
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(lm_config))
    atomic_write_bytes(out_dir / "tokenizer.json", tokenizer_bytes)
    return out_dir


def import_hf(hf_dir: str | Path) -> tuple[dict[str, torch.Tensor], LMConfig]:
    """Read a Qwen3 / Qwen3-MoE directory (single model.safetensors) back into our names and config. What is
    not such a folder is a ValueError (FileNotFoundError for a missing file) in one line naming the file."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ValueError(f"{hf_dir} is not a folder: --reverse imports a Hugging Face model folder (config.json, "
                         f"model.safetensors)")
    config_file = hf_dir / "config.json"
    check_regular_file(config_file, "a model's config.json")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as error:  # not JSON, not UTF-8, unreadable
        raise ValueError(f"{config_file}: not a readable JSON file ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: holds a JSON {type(config).__name__}, not an object of settings")
    try:
        lm_config = _lm_config_of(config, config_file)
    except KeyError as error:
        raise ValueError(f"{config_file} has no {error.args[0]!r}, which a Qwen3 config.json has; export the model "
                         f"again, or add the key") from None
    except (TypeError, ValueError, AttributeError) as error:  # a value of the wrong kind (a string for a size)
        raise ValueError(f"{config_file}: a setting has a value of the wrong kind ({error})") from None

    weights_file = hf_dir / "model.safetensors"
    if not os.path.lexists(weights_file):
        raise FileNotFoundError(f"{weights_file} not found (sharded checkpoints are not supported)")
    check_regular_file(weights_file, "safetensors weights")
    try:
        state_dict = load_file(weights_file)
    except Exception as error:  # safetensors raises its own SafetensorError (and OSError) for a file it cannot read
        raise ValueError(f"{weights_file}: not readable as safetensors ({error})") from None
    if lm_config.tie_word_embeddings and "model.embed_tokens.weight" in state_dict:
        state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    check_state_dict(state_dict, lm_config, str(weights_file))
    return state_dict, lm_config


def _lm_config_of(config: dict, config_file: Path) -> LMConfig:
    """The LMConfig a Qwen3 / Qwen3-MoE config.json describes (KeyError for a key it lacks)."""
    model_type = config.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"{config_file}: only qwen3 and qwen3_moe models can be imported, this one is {model_type!r}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_scaling = rope_scaling_of_config(config, str(config_file))  # None, yarn or linear; others: ValueError
    unsupported = {
        "attention_bias": config.get("attention_bias", False),
        "use_sliding_window": config.get("use_sliding_window", False),
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "mlp_only_layers": bool(config.get("mlp_only_layers")),
        "decoder_sparse_step": config.get("decoder_sparse_step", 1) != 1,
        "norm_topk_prob": model_type == "qwen3_moe" and not config.get("norm_topk_prob", False),
    }
    if any(unsupported.values()):
        lacking = ", ".join(name for name, used in unsupported.items() if used)
        raise ValueError(f"{config_file}: this model uses features our CausalLM lacks: {lacking}")

    fields = dict(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim"),
        intermediate_size=config["intermediate_size"],
        max_position_embeddings=config["max_position_embeddings"],
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 1e6)),
        rope_scaling=rope_scaling,
        rms_norm_eps=config["rms_norm_eps"],
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )
    if model_type == "qwen3_moe":
        fields.update(
            use_moe=True,
            num_experts=config["num_experts"],
            num_experts_per_tok=config["num_experts_per_tok"],
            moe_intermediate_size=config["moe_intermediate_size"],
            aux_loss_coef=config.get("router_aux_loss_coef", 0.01),
        )
    return LMConfig(**fields)


def write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")

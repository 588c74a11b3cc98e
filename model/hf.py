"""Hugging Face export and import, and reading a model's sizes off its weights.

Our parameter names already follow Qwen3, so the export is mostly bookkeeping: a config.json that
describes the same architecture, the weights as safetensors, and the tokenizer with a ChatML chat
template. The result loads with plain `transformers`, no custom code:

    AutoModelForCausalLM.from_pretrained("hf_model"); AutoTokenizer.from_pretrained("hf_model")

`scripts/export_hf.py` is the command line over these functions; the trainer's `--save_hf` and
`eval_model.py` call them directly.
"""

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from model.model import CausalLM, LMConfig
from model.tokenizer import BOS_ID, BOS_TOKEN, DEFAULT_TOKENIZER, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# ChatML: every message is "<|im_start|>{role}\n{content}<|im_end|>\n"; a generation prompt opens
# an assistant turn for the model to complete.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def check_state_dict(state_dict: dict[str, torch.Tensor], lm_config: LMConfig) -> None:
    """Raise ValueError unless `state_dict` has exactly the names and shapes of CausalLM(lm_config)."""
    with torch.device("meta"):  # shapes only, no memory
        expected = {name: t.shape for name, t in CausalLM(lm_config).state_dict().items()}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong_shape = [
        f"{name}: file {tuple(state_dict[name].shape)}, config {tuple(shape)}"
        for name, shape in expected.items()
        if name in state_dict and state_dict[name].shape != shape
    ]
    problems = []
    if missing:
        problems.append("missing keys: " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected keys: " + ", ".join(unexpected))
    if wrong_shape:
        problems.append("shape mismatches: " + "; ".join(wrong_shape))
    if problems:
        raise ValueError(
            "the weights do not fit the model config (are the size flags right?)\n  " + "\n  ".join(problems)
        )


def check_tokenizer(tokenizer_path: Path, lm_config: LMConfig) -> None:
    """Raise ValueError unless the tokenizer's special-token ids and size fit the model."""
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
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
        "max_position_embeddings": lm_config.max_position_embeddings,
        "rope_theta": lm_config.rope_theta,
        "rope_scaling": None,
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


def tokenizer_config(lm_config: LMConfig) -> dict:
    """tokenizer_config.json: a fast tokenizer over tokenizer.json, its special tokens, ChatML."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": PAD_TOKEN,
        "model_max_length": lm_config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def export_hf(
    state_dict: dict[str, torch.Tensor],
    lm_config: LMConfig,
    out_dir: str | Path,
    tokenizer_path: str | Path = DEFAULT_TOKENIZER,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write a Hugging Face model directory for `state_dict` (our names, any dtype); returns it."""
    check_state_dict(state_dict, lm_config)
    tokenizer_path = Path(tokenizer_path)
    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"tokenizer not found: {tokenizer_path} (train one or pass --tokenizer)")
    check_tokenizer(tokenizer_path, lm_config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # safetensors refuses tensors that share memory. For a tied model transformers itself saves only
    # the embedding and re-ties lm_head to it on load, so we do the same.
    tensors = {
        name: t.detach().to(dtype).contiguous()
        for name, t in state_dict.items()
        if not (lm_config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})

    generation = {
        "bos_token_id": BOS_ID,
        "eos_token_id": lm_config.eos_token_id,
        "pad_token_id": lm_config.pad_token_id,
    }
    write_json(out_dir / "config.json", hf_config(lm_config, dtype))
    write_json(out_dir / "generation_config.json", generation)
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(lm_config))
    shutil.copyfile(tokenizer_path, out_dir / "tokenizer.json")
    return out_dir


def import_hf(hf_dir: str | Path) -> tuple[dict[str, torch.Tensor], LMConfig]:
    """Read a Qwen3 / Qwen3-MoE directory (single model.safetensors) back into our names and config."""
    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"only qwen3 and qwen3_moe models can be imported, this one is {model_type!r}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    unsupported = {
        "attention_bias": config.get("attention_bias", False),
        "use_sliding_window": config.get("use_sliding_window", False),
        "rope type": rope.get("rope_type", "default") != "default",
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "mlp_only_layers": bool(config.get("mlp_only_layers")),
        "decoder_sparse_step": config.get("decoder_sparse_step", 1) != 1,
        "norm_topk_prob": model_type == "qwen3_moe" and not config.get("norm_topk_prob", False),
    }
    if any(unsupported.values()):
        lacking = ", ".join(name for name, used in unsupported.items() if used)
        raise ValueError(f"this model uses features our CausalLM lacks: {lacking}")

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
    lm_config = LMConfig(**fields)

    weights_file = hf_dir / "model.safetensors"
    if not weights_file.is_file():
        raise FileNotFoundError(f"{weights_file} not found (sharded checkpoints are not supported)")
    state_dict = load_file(weights_file)
    if lm_config.tie_word_embeddings:
        state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    check_state_dict(state_dict, lm_config)
    return state_dict, lm_config


def load_project_weights(path: str | Path, size_flags: dict) -> tuple[dict[str, torch.Tensor], LMConfig]:
    """Weights and config from an out/*.pth state dict (config from `size_flags`) or a resume file."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    given = {k: v for k, v in size_flags.items() if v is not None}
    if isinstance(saved.get("model"), dict) and "lm_config" in saved:
        lm_config = LMConfig.from_dict(saved["lm_config"])
        stored = lm_config.to_dict()
        conflicts = [f"--{k} {v} (file: {stored[k]})" for k, v in given.items() if stored[k] != v]
        if conflicts:
            raise ValueError(f"{path} is a resume file with its own config; flags that disagree: {', '.join(conflicts)}")
        return saved["model"], lm_config
    return saved, LMConfig(**given)


# The sizes an out/*.pth does not record; the training scripts take the same flags.
SIZE_FLAGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size", "use_moe")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")




# ---- sizes from weights ----

LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def infer_sizes(state_dict: dict[str, torch.Tensor]) -> dict[str, int]:
    """The size flags that rebuild this state dict, read off the tensor shapes."""
    embed = state_dict["model.embed_tokens.weight"]
    layers = {int(m.group(1)) for name in state_dict if (m := LAYER_KEY.match(name))}
    head_dim = state_dict["model.layers.0.self_attn.q_norm.weight"].shape[0]
    # "model.layers.0.mlp.experts.3.gate_proj.weight": the expert number is the sixth part.
    experts = {name.split(".")[5] for name in state_dict if name.startswith("model.layers.0.mlp.experts.")}
    sizes = {
        "vocab_size": embed.shape[0],
        "hidden_size": embed.shape[1],
        "num_hidden_layers": len(layers),
        "num_attention_heads": state_dict["model.layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
        "num_key_value_heads": state_dict["model.layers.0.self_attn.k_proj.weight"].shape[0] // head_dim,
        "use_moe": int(bool(experts)),
    }
    if experts:
        sizes["num_experts"] = len(experts)
    return sizes


def size_flags(sizes: dict[str, int]) -> str:
    """The command-line flags (of the trainers, eval_model.py, export_hf) for these sizes."""
    names = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "use_moe")
    return " ".join(f"--{name} {sizes[name]}" for name in names)

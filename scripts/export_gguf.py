"""Write a GGUF file (llama.cpp, ollama, LM Studio) from an out/*.pth file.

Prototype. The model is written as llama.cpp's `qwen3` architecture (our parameter names already
follow Qwen3, so this is a renaming), the tokenizer as a byte-level BPE (`tokenizer.ggml.model =
gpt2`) with the special tokens and the ChatML chat template.

llama.cpp does not read a tokenizer's pre-tokenizer from the file: it reads a name,
`tokenizer.ggml.pre`, and runs the regexes it has compiled in for that name (src/llama-vocab.cpp).
So the file can only promise the same token ids as training when the tokenizer's pre-tokenizer is
exactly one of those. This script recognises two and refuses the rest, naming the mismatch:

    qwen2  : Sequence[Split(QWEN2_PATTERN, Isolated), ByteLevel(use_regex=False)]  (Qwen2/Qwen3's own)
    gpt-2  : ByteLevel(use_regex=True) alone                                   (minimind's tokenizer)

    python scripts/export_gguf.py out/full_sft_768.pth --out model.gguf [--type f16|q8_0]
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402  (pip install gguf)

from model.chat_template import CHAT_TEMPLATE  # noqa: E402
from model.hf import check_tokenizer, load_project_weights  # noqa: E402
from model.tokenizer import BOS_ID, DEFAULT_TOKENIZER  # noqa: E402

# Qwen2's tokenizer.json pattern; llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 runs the same regex with the
# (?i:...) group spelled out case by case (src/llama-vocab.cpp, the llm_tokenizer_bpe constructor).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def llama_cpp_pre(pre_tokenizer: dict | None) -> str:
    """The tokenizer.ggml.pre name whose llama.cpp regexes equal this pre-tokenizer, or ValueError."""
    def byte_level(p, use_regex):
        return (p.get("type") == "ByteLevel" and p.get("use_regex", True) == use_regex
                and not p.get("add_prefix_space", False))

    if pre_tokenizer and byte_level(pre_tokenizer, True):
        return "gpt-2"
    if pre_tokenizer and pre_tokenizer.get("type") == "Sequence":
        steps = pre_tokenizer["pretokenizers"]
        if (len(steps) == 2 and steps[0].get("type") == "Split"
                and steps[0].get("pattern", {}).get("Regex") == QWEN2_PATTERN
                and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert", False)
                and byte_level(steps[1], False)):
            return "qwen2"
    raise ValueError(
        "the tokenizer's pre-tokenizer is not one llama.cpp implements exactly, so llama.cpp would split "
        f"text differently from training: {json.dumps(pre_tokenizer)}. Known here: 'qwen2' "
        "(Sequence[Split(QWEN2_PATTERN, Isolated), ByteLevel(use_regex=False)]) and 'gpt-2' (ByteLevel "
        "alone). Retrain the tokenizer with trainer/train_tokenizer.py --pre_tokenizer qwen2, or pass "
        "--force_pre NAME to write a file anyway, knowing its token ids may differ.")


def tokenizer_metadata(writer: "gguf.GGUFWriter", tokenizer_path: Path, vocab_size: int,
                       force_pre: str | None) -> str:
    data = json.loads(tokenizer_path.read_text(encoding="utf-8"))
    if data["model"]["type"] != "BPE" or data.get("normalizer"):
        raise ValueError(f"{tokenizer_path}: only a byte-level BPE without a normalizer is supported")
    pre = force_pre or llama_cpp_pre(data.get("pre_tokenizer"))
    id_to_token = {i: t for t, i in data["model"]["vocab"].items()}
    special = {}
    for added in data.get("added_tokens", []):
        id_to_token[added["id"]] = added["content"]
        special[added["id"]] = added["special"]
    tokens, types = [], []
    for i in range(vocab_size):  # the model may have more rows than the tokenizer has tokens
        if i in id_to_token:
            tokens.append(id_to_token[i])
            types.append(gguf.TokenType.CONTROL if special.get(i) else
                         gguf.TokenType.USER_DEFINED if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    return pre


def export_gguf(weights: Path, out: Path, tokenizer_path: Path, qtype: str = "f16",
                force_pre: str | None = None) -> None:
    state_dict, cfg = load_project_weights(weights, {})
    if cfg.use_moe:
        raise ValueError("MoE models are not supported by this prototype")
    check_tokenizer(tokenizer_path, cfg)
    writer = gguf.GGUFWriter(str(out), "qwen3")
    writer.add_name(weights.stem)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    ftype = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype]
    writer.add_file_type(ftype)

    pre = tokenizer_metadata(writer, tokenizer_path, cfg.vocab_size, force_pre)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    writer.add_add_bos_token(False)  # training never prepends <|im_start|> by itself
    writer.add_chat_template(CHAT_TEMPLATE)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in per_layer.items():
            names[f"model.layers.{i}.{ours}.weight"] = f"blk.{i}.{theirs}.weight"
    for name, tensor in state_dict.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # llama.cpp's qwen3 uses token_embd as the output when output.weight is absent
        gname = names[name]
        array = tensor.detach().float().numpy()
        if array.ndim == 1:  # norms stay F32, as llama.cpp's converter writes them
            writer.add_tensor(gname, array.astype(np.float32))
        elif qtype == "q8_0" and array.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(array.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gname, array.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {out} ({out.stat().st_size} bytes, {qtype}, tokenizer.ggml.pre={pre})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weights", type=Path, help="an out/*.pth state dict")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--type", choices=("f16", "q8_0"), default="f16")
    parser.add_argument("--force_pre", default=None,
                        help="write this tokenizer.ggml.pre name without checking the pre-tokenizer")
    args = parser.parse_args()
    try:
        export_gguf(args.weights, args.out, args.tokenizer, args.type, args.force_pre)
    except ValueError as error:
        sys.exit(f"export_gguf: {error}")


if __name__ == "__main__":
    main()

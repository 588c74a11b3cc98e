"""Write a GGUF file, the format of llama.cpp (and of ollama and LM Studio, which run it).

    python scripts/export_gguf.py out/full_sft_768.pth --out model.gguf            # FP16
    python scripts/export_gguf.py out/full_sft_768.pth --out model_q8.gguf --type q8_0
    python scripts/export_gguf.py hf_model --out model.gguf     # a folder scripts/export_hf.py wrote
    python scripts/export_gguf.py out/full_sft_768_moe.pth --out moe.gguf --num_experts_per_tok 2
    python scripts/export_gguf.py out/full_sft_768.pth --out long.gguf --rope_scaling yarn --rope_factor 4

The model is written as llama.cpp's `qwen3` architecture (`qwen3moe` with experts): our parameter
names already follow Qwen3, so the weights are only renamed. The tokenizer goes in as a byte-level
BPE (`tokenizer.ggml.model = gpt2`: its tokens, merges and special tokens), with the ChatML template.

llama.cpp does not read a pre-tokenizer (the regex that cuts text into words before BPE) from the
file. It reads a name, `tokenizer.ggml.pre`, and runs the regex it has compiled in for that name
(src/llama-vocab.cpp). The file can only promise the token ids of training when the tokenizer's
pre-tokenizer is exactly one of those, so this script recognises two and refuses the rest:

    qwen2 : Sequence[Split(QWEN2_PATTERN, Isolated), ByteLevel(use_regex=False)]  trainer/train_tokenizer.py's
    gpt-2 : ByteLevel(use_regex=True)                                             minimind's tokenizer

tests/test_gguf.py runs llama.cpp itself on the files: same token ids, same greedy tokens.
"""

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo's packages

import gguf  # noqa: E402  (pip install gguf: llama.cpp's own Python writer)

from model.chat_template import CHAT_TEMPLATE  # noqa: E402
from model.hf import check_tokenizer, import_hf  # noqa: E402
from model.weights import load_project_weights  # noqa: E402
from model.model import LMConfig  # noqa: E402
from model.rope import add_rope_scaling_flags, rope_scaling_of_flags  # noqa: E402
# QWEN2_PATTERN: Qwen2's regex, which llama.cpp runs for tokenizer.ggml.pre = qwen2
from model.tokenizer import BOS_ID, DEFAULT_TOKENIZER, QWEN2_PATTERN  # noqa: E402
from output_paths import OutputPathError, check_user_output, written_by_name  # noqa: E402
from trainer.hardening.out_weights import trained_length  # noqa: E402


def describe(pre: dict | None) -> str:
    """A pre-tokenizer's JSON in one short line, e.g. Sequence[Split('\\p{Han}', Isolated), ByteLevel(use_regex=True)]."""
    if not pre:
        return "none"
    kind = pre.get("type")
    if kind == "Sequence":
        return "Sequence[" + ", ".join(describe(p) for p in pre.get("pretokenizers", [])) + "]"
    if kind == "Split":
        pattern = pre.get("pattern", {}).get("Regex", pre.get("pattern", {}).get("String"))
        pattern = "QWEN2_PATTERN" if pattern == QWEN2_PATTERN else repr(pattern)
        return f"Split({pattern}, {pre.get('behavior')}{', invert' if pre.get('invert') else ''})"
    if kind == "ByteLevel":
        prefix = ", add_prefix_space" if pre.get("add_prefix_space") else ""
        return f"ByteLevel(use_regex={pre.get('use_regex', True)}{prefix})"
    return str(kind)


KNOWN_PRE = {"Sequence[Split(QWEN2_PATTERN, Isolated), ByteLevel(use_regex=False)]": "qwen2",
             "ByteLevel(use_regex=True)": "gpt-2"}


def llama_cpp_pre(tokenizer_path: Path, pre: dict | None) -> str:
    """The tokenizer.ggml.pre name whose llama.cpp regex equals this pre-tokenizer, else ValueError."""
    if describe(pre) in KNOWN_PRE:
        return KNOWN_PRE[describe(pre)]
    raise ValueError(
        f"{tokenizer_path}: its pre-tokenizer {describe(pre)} is not one llama.cpp implements, so llama.cpp "
        f"would cut text into other tokens than training did (it knows qwen2 = {next(iter(KNOWN_PRE))} and "
        "gpt-2 = ByteLevel(use_regex=True)). Retrain the tokenizer with trainer/train_tokenizer.py and the model "
        "with it, or pass --force_pre gpt-2 to write it anyway, knowing some ids will differ (with the old "
        "Split('\\p{Han}') recipe: where whitespace comes before a Chinese character)")


def read_tokenizer(path: Path) -> dict:
    """tokenizer.json as a dict, checked to be a byte-level BPE llama.cpp's `gpt2` model runs."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        model, decoder = data["model"], data.get("decoder") or {}
        model["vocab"], model["merges"]  # a BPE model has both
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a tokenizer.json ({error})") from None
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel" or data.get("normalizer"):
        raise ValueError(f"{path}: only a byte-level BPE without a normalizer can be written (this one: model "
                         f"{model.get('type')}, decoder {decoder.get('type')}, normalizer {data.get('normalizer')})")
    if model.get("ignore_merges") or model.get("byte_fallback"):
        raise ValueError(f"{path}: BPE with ignore_merges or byte_fallback is not what llama.cpp's gpt2 model runs")
    return data


def add_tokenizer(writer: gguf.GGUFWriter, data: dict, pre: str, vocab_size: int) -> None:
    """Tokens (one per embedding row), their types, merges, special ids and the chat template."""
    id_to_token = {i: t for t, i in data["model"]["vocab"].items()}
    special = {}  # id -> special? for every added token
    for added in data.get("added_tokens", []):
        id_to_token[added["id"]] = added["content"]
        special[added["id"]] = added["special"]
    tokens, types = [], []
    for i in range(vocab_size):  # the model may have more rows than the tokenizer has tokens
        tokens.append(id_to_token.get(i, f"[PAD{i}]"))
        if i not in id_to_token:
            types.append(gguf.TokenType.UNUSED)
        elif i in special:  # CONTROL: matched in text only when special tokens are parsed; USER_DEFINED: always
            types.append(gguf.TokenType.CONTROL if special[i] else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    writer.add_bos_token_id(BOS_ID)
    writer.add_add_bos_token(False)  # our texts start with <|im_start|> written in them, never added
    writer.add_chat_template(CHAT_TEMPLATE)


def add_hyperparameters(writer: gguf.GGUFWriter, cfg: LMConfig, trained: int | None) -> None:
    # llama.cpp reads {arch}.context_length as the length the model was trained at (n_ctx_train): its default
    # context, and the length past which it warns. The rotary table (max_position_embeddings, 32,768) is far longer
    # than anything the demo trained on, so the trained max_seq_len goes there where training recorded it.
    scaling = cfg.rope_scaling
    factor = scaling["factor"] if scaling else 1
    # Under --rope_scaling the length read is the trained one times the factor (llama.cpp warns past it).
    writer.add_context_length(math.ceil(trained * factor) if trained else cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)  # rotate-half RoPE: llama.cpp's NEOX, its qwen3 default
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if scaling:
        add_rope_scaling(writer, scaling)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    if cfg.use_moe:  # llama.cpp's qwen3moe: softmax router, top-k, the k weights renormalised, as MoEFeedForward
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def add_rope_scaling(writer: gguf.GGUFWriter, scaling: dict) -> None:
    """llama.cpp's rope.scaling keys for model/rope.py's setting: the same frequencies and attention factor."""
    factor = scaling["factor"]
    writer.add_rope_scaling_factor(factor)  # llama.cpp's freq_scale = 1 / factor
    if scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        return
    if (scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1) != (32, 1):
        raise ValueError(f"rope_scaling {scaling}: llama.cpp's qwen3 reads no beta_fast / beta_slow (it uses 32 and 1)")
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])  # the ramp's trained length
    # ggml multiplies cos and sin by 0.1 * ln(factor) + 1 itself (llama-context.cpp cancels any other YaRN factor
    # first), then by rope.scaling.attn_factor: 1.0 keeps YaRN's, and a config's own attention_factor (minimind's
    # 1.0) is written divided by it.
    yarn_mscale = 0.1 * math.log(factor) + 1.0
    writer.add_rope_scaling_attn_factors((scaling.get("attention_factor") or yarn_mscale) / yarn_mscale)


PER_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "mlp.gate": "ffn_gate_inp"}  # the MoE router


def gguf_tensors(state_dict: dict[str, torch.Tensor], cfg: LMConfig) -> dict[str, torch.Tensor]:
    """The weights under llama.cpp's names; each layer's experts stacked into one [experts, ...] tensor."""
    tensors = {"token_embd.weight": state_dict["model.embed_tokens.weight"],
               "output_norm.weight": state_dict["model.norm.weight"]}
    if not cfg.tie_word_embeddings:  # without output.weight llama.cpp's qwen3 reuses token_embd, as tied
        tensors["output.weight"] = state_dict["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in PER_LAYER.items():
            if f"model.layers.{i}.{ours}.weight" in state_dict:
                tensors[f"blk.{i}.{theirs}.weight"] = state_dict[f"model.layers.{i}.{ours}.weight"]
        if cfg.use_moe:
            for proj, theirs in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                tensors[f"blk.{i}.{theirs}.weight"] = torch.stack(
                    [state_dict[f"model.layers.{i}.mlp.experts.{j}.{proj}.weight"] for j in range(cfg.num_experts)])
    return tensors


def add_tensor(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, qtype: str) -> None:
    array = tensor.detach().float().numpy()
    # Norms and the router stay F32, as llama.cpp's convert_hf_to_gguf.py keeps them; under q8_0 every other
    # matrix is Q8_0 (token_embd too, as there) when its rows split into Q8_0's blocks of 32, else F16.
    if array.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == "q8_0" and array.shape[-1] % 32 == 0:
        q8 = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        writer.add_tensor(name, array.astype(np.float16))


def export_gguf(source: Path, out: Path, tokenizer_path: Path | None = None, qtype: str = "f16",
                force_pre: str | None = None, num_experts_per_tok: int | None = None,
                rope_flags: argparse.Namespace | None = None) -> str:
    """Write `source` (an out/*.pth or a Hugging Face folder) to `out`; returns the tokenizer.ggml.pre used.
    `rope_flags`: --rope_scaling, --rope_factor, --original_max_position_embeddings for an out/*.pth."""
    if source.is_dir():  # scripts/export_hf.py's folder: config.json, model.safetensors, tokenizer.json
        if not (source / "config.json").is_file():
            raise FileNotFoundError(f"{source} has no config.json: pass a folder scripts/export_hf.py wrote")
        state_dict, cfg = import_hf(source)
        tokenizer_path = tokenizer_path or source / "tokenizer.json"
        # An HF folder records no trained length, except as YaRN's original_max_position_embeddings.
        trained = (cfg.rope_scaling or {}).get("original_max_position_embeddings")
        if rope_flags is not None and rope_flags.rope_scaling:
            raise ValueError(f"{source}: a Hugging Face folder carries its rope_scaling in config.json; the "
                             f"--rope_scaling flags are for an out/*.pth")
    elif source.is_file():
        requested = {"num_experts_per_tok": num_experts_per_tok}  # the one size no tensor records
        state_dict, cfg = load_project_weights(source, requested)
        tokenizer_path = tokenizer_path or DEFAULT_TOKENIZER
        try:
            trained = trained_length(source)  # out/{run}.json beside the weights
        except RuntimeError as error:
            raise ValueError(str(error)) from None
        if rope_flags is not None:  # --rope_scaling: from out/{run}.json's length, or the flag's
            scaling = rope_scaling_of_flags(rope_flags, trained, str(source.with_suffix(".json")))
            trained = trained or rope_flags.original_max_position_embeddings
            cfg = dataclasses.replace(cfg, rope_scaling=scaling)
    elif source.exists():  # a FIFO or a device: named, never opened (a read would wait for a writer)
        raise ValueError(f"{source} is not a regular file: pass an out/*.pth file or a folder from scripts/export_hf.py")
    else:
        raise FileNotFoundError(f"{source} not found: pass an out/*.pth file or a folder from scripts/export_hf.py")
    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"tokenizer {tokenizer_path} not found: pass --tokenizer, the model's tokenizer.json")
    data = read_tokenizer(tokenizer_path)
    pre = force_pre or llama_cpp_pre(tokenizer_path, data.get("pre_tokenizer"))
    check_tokenizer(tokenizer_path, cfg)  # special-token ids and size fit the model

    out.parent.mkdir(parents=True, exist_ok=True)
    # Written whole in a folder made for it, then renamed: never a half file under `out`, and never a file opened
    # by a name known in advance (a link planted at `{out}.tmp` was followed: the GGUF went into the user's file).
    with written_by_name(out) as tmp:
        writer = gguf.GGUFWriter(str(tmp), "qwen3moe" if cfg.use_moe else "qwen3")
        writer.add_name(source.stem)
        writer.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
        add_hyperparameters(writer, cfg, trained)
        add_tokenizer(writer, data, pre, cfg.vocab_size)
        for name, tensor in gguf_tensors(state_dict, cfg).items():
            add_tensor(writer, name, tensor, qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return pre


def inputs_of(source: Path, tokenizer: Path | None) -> list[Path]:
    """Every file the export reads (a folder's config, weights and tokenizer): none may be written over."""
    files = [source / name for name in ("config.json", "model.safetensors", "tokenizer.json")] if source.is_dir() \
        else [source]
    return files + ([tokenizer] if tokenizer else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="an out/*.pth file, or a folder written by scripts/export_hf.py")
    parser.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    parser.add_argument("--type", choices=("f16", "q8_0"), default="f16", help="f16, or q8_0: 8-bit, ~half the size")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer.json (default: the folder's own, else model/tokenizer.json)")
    parser.add_argument("--force_pre", choices=("qwen2", "gpt-2"), default=None,
                        help="write this tokenizer.ggml.pre without checking the tokenizer's pre-tokenizer")
    parser.add_argument("--num_experts_per_tok", type=int, default=None,
                        help="MoE top-k of an out/*.pth (no tensor records it; default 1, as in training)")
    add_rope_scaling_flags(parser)  # llama.cpp's rope.scaling keys: the same numbers as eval_model.py's flags
    args = parser.parse_args()
    try:
        if args.out.is_dir():
            raise ValueError(f"--out {args.out} is a folder: give the file to write, e.g. {args.out / 'model.gguf'}")
        # Not over a file without --force, never over its own source (a FIFO or device there is refused at once).
        check_user_output(args.out, args.force, inputs_of(args.source, args.tokenizer))
        pre = export_gguf(args.source, args.out, args.tokenizer, args.type, args.force_pre, args.num_experts_per_tok,
                          args)
    except (ValueError, OSError, OutputPathError) as error:  # the user's input, not a bug: one line, no traceback
        message = "; ".join(line.strip() for line in str(error).splitlines()).replace(":; ", ": ")
        print(f"export_gguf: {message}", file=sys.stderr)
        sys.exit(2)
    size = args.out.stat().st_size
    print(f"wrote {args.out}: {size:,} bytes ({size / 2**20:.1f} MiB), {args.type}, tokenizer.ggml.pre={pre}")


if __name__ == "__main__":
    main()

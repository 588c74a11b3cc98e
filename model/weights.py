"""A model's weights as files hold them: read safely, checked against a config, sizes read off the tensors.

An out/*.pth file is a bare state dict (ours or minimind's: the names agree), so every size is read off its
tensors (`infer_sizes`, `config_from_weights`), and it loads with no size flags in eval_model.py, the trainers'
--from_weight and the exports; flags given are checked against the file (`load_project_weights`). A file is
opened only once it is known to be a regular file, and loaded with weights_only=True.
"""

import os
import pickle
import re
import stat
from pathlib import Path
from typing import NamedTuple

import torch

from model.model import CausalLM, LMConfig


GGUF_MAGIC = b"GGUF"  # the first four bytes of a llama.cpp file


def check_regular_file(path: Path, what: str) -> None:
    """Raise ValueError, in one line, unless `path` is a regular file (a link to one is): a folder or a FIFO is
    named, never opened (reading a FIFO waits for a writer)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: expected {what}") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"{path} is a folder, not {what}")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path} is not a regular file (a FIFO or a device), not {what}")

def check_state_dict(state_dict: dict[str, torch.Tensor], lm_config: LMConfig,
                     source: str = "the state dict") -> None:
    """Raise ValueError naming `source` unless `state_dict` has the names and shapes of CausalLM(lm_config)."""
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
        raise ValueError(f"{source} does not fit the model config:\n  " + "\n  ".join(problems))



# ---- sizes from weights -----------------------------------------------------------------------
#
# An out/*.pth file is a bare state dict (ours or minimind's: the names agree), so every size is
# read off the tensor shapes. Size flags are then only overrides, checked against the file. The
# one size no tensor records is the MoE top-k (num_experts_per_tok): it stays a flag.

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
# The sizes a caller may request (the size flags of the trainers, eval_model.py and export_hf).
SIZE_NAMES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "use_moe", "intermediate_size", "num_experts", "num_experts_per_tok")


class InferredSize(NamedTuple):
    value: int
    evidence: str  # where it was read, e.g. "model.layers.0.mlp.gate_proj.weight [2432, 768]"


def _read_sizes(state_dict: dict[str, torch.Tensor], source: str) -> dict[str, InferredSize]:
    """Every size of the model in `state_dict`, with the tensor each was read from."""

    def shape(name: str) -> list[int]:
        if name not in state_dict:
            raise ValueError(f"{source} has no {name}: not a state dict of this model layout "
                             f"(Qwen3 / minimind names such as {EMBED} are expected)")
        return list(state_dict[name].shape)

    def read(value: int, name: str, note: str = "") -> InferredSize:
        return InferredSize(value, f"{name} {shape(name)}{note}")

    vocab, hidden = shape(EMBED)
    shape(LM_HEAD)  # present in every state dict, tied or not (minimind's too)
    tied = torch.equal(state_dict[LM_HEAD], state_dict[EMBED])
    layers = sorted({int(m.group(1)) for name in state_dict if (m := LAYER_KEY.match(name))})
    if not layers or layers != list(range(len(layers))):
        raise ValueError(f"{source}: the layers are numbered {layers[:12]}, expected model.layers.0 to N-1")
    attn = "model.layers.0.self_attn."
    head_dim = shape(attn + "q_norm.weight")[0]
    heads, kv_heads = shape(attn + "q_proj.weight")[0], shape(attn + "k_proj.weight")[0]
    if heads % head_dim or kv_heads % head_dim:
        raise ValueError(f"{source}: q_proj ({heads} rows) and k_proj ({kv_heads} rows) are not whole "
                         f"heads of head_dim {head_dim} (the length of q_norm)")
    # "model.layers.0.mlp.experts.3.gate_proj.weight": the expert number is the sixth part.
    experts = {int(name.split(".")[5]) for name in state_dict if name.startswith("model.layers.0.mlp.experts.")}
    gate_proj = "model.layers.0.mlp.experts.0.gate_proj.weight" if experts else "model.layers.0.mlp.gate_proj.weight"
    width = read(shape(gate_proj)[0], gate_proj)
    sizes = {
        "vocab_size": read(vocab, EMBED),
        "hidden_size": read(hidden, EMBED),
        "num_hidden_layers": InferredSize(len(layers), f"model.layers.0 to model.layers.{len(layers) - 1}"),
        "num_attention_heads": read(heads // head_dim, attn + "q_proj.weight", f" / head_dim {head_dim}"),
        "num_key_value_heads": read(kv_heads // head_dim, attn + "k_proj.weight", f" / head_dim {head_dim}"),
        "head_dim": read(head_dim, attn + "q_norm.weight"),
        "use_moe": InferredSize(int(bool(experts)), f"{len(experts)} experts in model.layers.0.mlp"),
        # One flag, --intermediate_size, sets the width of the dense MLP or of every expert.
        "intermediate_size": width,
        "num_experts": InferredSize(len(experts), f"model.layers.0.mlp.experts.0 to .{len(experts) - 1}"
                                    if experts else "a dense MLP, no experts"),
        "tie_word_embeddings": InferredSize(int(tied), f"{LM_HEAD} {'equals' if tied else 'differs from'} {EMBED}"),
    }
    if experts:
        sizes["moe_intermediate_size"] = width
    return sizes


def infer_sizes(state_dict: dict[str, torch.Tensor], source: str = "the state dict") -> dict[str, int]:
    """Every size of the model in `state_dict`, read off the tensor shapes.

    vocab, hidden, layers, heads, kv heads, head_dim, the MLP width (gate_proj; an expert's with
    MoE), use_moe, num_experts and whether lm_head is tied. Not the MoE top-k: no tensor records
    it. Raises ValueError naming `source` when the state dict is not this model's layout.
    """
    return {name: size.value for name, size in _read_sizes(state_dict, source).items()}


def size_flags(sizes: dict[str, int]) -> str:
    """The command-line flags (of the trainers, eval_model.py, export_hf) for these sizes."""
    names = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "use_moe",
             "intermediate_size"] + (["num_experts"] if sizes["use_moe"] else [])
    return " ".join(f"--{name} {sizes[name]}" for name in names)


def config_from_weights(state_dict: dict[str, torch.Tensor], requested: dict,
                        tokenizer_vocab_size: int | None = None, source: str = "the state dict") -> LMConfig:
    """The model config of `state_dict`, its sizes read from the weights.

    `requested` maps size names (SIZE_NAMES) to what the user asked for, None for "not given".
    A given size must equal the file's, else ValueError naming both, e.g. "intermediate_size: file
    has 2432 (model.layers.0.mlp.gate_proj.weight [2432, 768]), --intermediate_size asks 2048".
    num_experts_per_tok is taken from `requested` (no tensor records it), else LMConfig's default.
    The tokenizer may be smaller than the embedding, never larger.
    """
    _check_size_names(requested)
    sizes = _read_sizes(state_dict, source)
    mismatches = [
        f"{name}: file has {sizes[name].value} ({sizes[name].evidence}), --{name} asks {int(asked)}"
        for name, asked in requested.items()
        if asked is not None and name in sizes and int(asked) != sizes[name].value
    ]
    if mismatches:
        values = {name: size.value for name, size in sizes.items()}
        raise ValueError(f"{source} does not fit the size flags:\n  " + "\n  ".join(mismatches) +
                         f"\nThe file's shapes say: {size_flags(values)}. Size flags are optional: "
                         f"leave them out to use the file's.")
    _check_tokenizer_fits(sizes["vocab_size"].value, tokenizer_vocab_size, source)
    fields = {name: size.value for name, size in sizes.items()}
    fields.update(use_moe=bool(fields["use_moe"]), tie_word_embeddings=bool(fields["tie_word_embeddings"]))
    if not fields["use_moe"]:
        del fields["num_experts"]  # 0 experts: keep LMConfig's default, unused by a dense model
    if requested.get("num_experts_per_tok") is not None:
        fields["num_experts_per_tok"] = requested["num_experts_per_tok"]
    lm_config = LMConfig(**fields)
    check_state_dict(state_dict, lm_config, source)  # every layer, not only the first one read above
    return lm_config


def load_project_weights(path: str | Path, requested: dict,
                         tokenizer_vocab_size: int | None = None) -> tuple[dict[str, torch.Tensor], LMConfig]:
    """Weights and config of an out/*.pth state dict (sizes from the weights) or of a resume file.

    `requested` and `tokenizer_vocab_size` are checked as in config_from_weights; a resume file's
    saved config (top-k included) is what they are checked against there.
    """
    _check_size_names(requested)
    saved = _load_weights_file(Path(path))
    if isinstance(saved, dict) and isinstance(saved.get("model"), dict) and "lm_config" in saved:
        lm_config = LMConfig.from_dict(saved["lm_config"])
        stored = lm_config.to_dict()
        mismatches = [f"{name}: file has {stored[name]} (its saved model config), --{name} asks {asked}"
                      for name, asked in requested.items() if asked is not None and stored[name] != asked]
        if mismatches:
            raise ValueError(f"{path} does not fit the size flags:\n  " + "\n  ".join(mismatches) +
                             "\nA resume file carries its config: leave the size flags out.")
        _check_tokenizer_fits(lm_config.vocab_size, tokenizer_vocab_size, str(path))
        check_state_dict(saved["model"], lm_config, str(path))
        return saved["model"], lm_config
    if isinstance(saved, dict) and saved and all(isinstance(t, torch.Tensor) for t in saved.values()):
        return saved, config_from_weights(saved, requested, tokenizer_vocab_size, str(path))
    keys = sorted(saved)[:8] if isinstance(saved, dict) else type(saved).__name__
    raise ValueError(f"{path} is neither a state dict of tensors nor a resume file (it holds {keys})")


def _load_weights_file(path: Path):
    """torch.load(path, weights_only=True), or a ValueError in one line naming the file and what it is instead: a
    folder, a FIFO (never opened), a GGUF file, text or any other bytes torch cannot read."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a weights file (an out/*.pth or *_resume.pth); a Hugging Face "
                         f"model folder is imported with scripts/export_hf.py --reverse")
    check_regular_file(path, "a weights file (an out/*.pth or *_resume.pth)")
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic == GGUF_MAGIC:
        raise ValueError(f"{path} is a GGUF file (llama.cpp's format), not PyTorch weights: give the out/*.pth or "
                         f"Hugging Face folder it was exported from")
    if not magic.startswith((b"PK\x03\x04", b"\x80")):  # torch.save's zip, or an old-style pickle (protocol >= 2)
        raise ValueError(f"{path} is not a PyTorch weights file (it starts with {magic!r}, not a zip or a pickle): "
                         f"give an out/*.pth or *_resume.pth")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # torch's message goes on to suggest loading it unsafely
        raise ValueError(f"{path} refused: it holds pickled objects other than tensors and plain types, so "
                         f"loading it could run code; export the weights as a plain state dict") from error
    except Exception as error:  # text, a truncated zip, other bytes: torch's KeyError / IndexError / RuntimeError
        lines = str(error).strip().splitlines()
        raise ValueError(f"{path} is not a PyTorch weights file torch.load can read ({type(error).__name__}"
                         f"{': ' + lines[0] if lines else ''})") from None


def _check_size_names(requested: dict) -> None:
    unknown = sorted(set(requested) - set(SIZE_NAMES))
    if unknown:
        raise ValueError(f"unknown size names {unknown}; known: {', '.join(SIZE_NAMES)}")


def _check_tokenizer_fits(vocab_size: int, tokenizer_vocab_size: int | None, source: str) -> None:
    if tokenizer_vocab_size is not None and tokenizer_vocab_size > vocab_size:
        raise ValueError(f"{source} has {vocab_size} embedding rows but the tokenizer has {tokenizer_vocab_size} "
                         f"tokens: use the tokenizer the model was trained with (--tokenizer_path)")

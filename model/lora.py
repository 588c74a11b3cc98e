"""LoRA: fine-tune a frozen model through small low-rank updates of chosen linear layers.

A linear layer computes W x. LoRA freezes W and learns two small matrices, A (rank x in) and B (out x rank):

    y = W x + B A x · α/r

With r (the rank) far below `in` and `out`, A and B hold a few % of W's numbers, so the optimizer keeps state
for those only. B starts at zero: before the first step the model computes exactly what the base model does
(tests/test_lora.py::test_a_fresh_adapter_leaves_the_logits_bit_identical_to_the_base). α/r scales the update,
so that a larger rank does not mean a larger step. After training, B A · α/r can be added into W
(`merged_state_dict`): a plain model again, as fast as the base.

An adapter file is the state dict of `adapter_of(model)`: only A and B, named as in the model, e.g.
`model.layers.0.self_attn.q_proj.lora_A.weight` (r, in) and `...q_proj.lora_B.weight` (out, r), which are the
names PEFT uses too (`export_peft` adds its prefix). The rank and the targets are read off those names and
shapes; α is in the `.json` beside the file (training writes it: hardening/out_weights.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import pickle
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save
from torch import nn

from output_paths import atomic_write_bytes, atomic_write_text, check_output_folder

# The linear layers of model.py's decoder layer: attention's four projections and SwiGLU's three.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")  # what export_peft writes


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update: y = W x + B A x · α/r."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        if base.bias is not None:
            raise ValueError("LoRALinear adapts linear layers without a bias (all of model.py's)")
        self.weight = base.weight  # W, frozen, under its own name: the model's state_dict keys stay the same
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)  # A: random (nn.Linear's init, as PEFT's)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)  # B: zero, so B A x starts at 0
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.lora_B(self.lora_A(x)) * self.scaling


def apply_lora(model: nn.Module, rank: int, alpha: float, targets) -> nn.Module:
    """Freeze every weight of `model`, put a LoRALinear around each linear layer named in `targets` (names of
    LORA_TARGETS), and return adapter_of(model): the trainable parameters, the only ones."""
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank, alpha))
    return adapter_of(model)


def adapter_of(model: nn.Module) -> nn.Module:
    """A module holding only `model`'s adapter parameters (shared, not copied), under the model's names: its
    state_dict is what an adapter file holds, and an optimizer over its parameters trains only them."""
    adapter = nn.Module()
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            parent = adapter
            for part in name.split("."):  # model -> layers -> 0 -> self_attn -> q_proj, as in the model
                if part not in dict(parent.named_children()):
                    parent.add_module(part, nn.Module())
                parent = parent.get_submodule(part)
            parent.lora_A, parent.lora_B = module.lora_A, module.lora_B
    return adapter


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapter added into its weight, W + B A · α/r: a plain model."""
    state = {name: t for name, t in model.state_dict().items() if ".lora_" not in name}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            state[f"{name}.weight"] = module.weight + module.lora_B.weight @ module.lora_A.weight * module.scaling
    return state


# ---- adapter files ------------------------------------------------------------------------------

def read_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, settings) of an adapter file: its state dict, and {"lora_rank", "lora_alpha", "lora_targets",
    ...} from the `.json` beside it. Raises ValueError naming the file and what is wrong, in one line."""
    path = Path(path)
    try:
        adapter = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{path} holds pickled objects other than tensors: not an adapter file") from None
    except (FileNotFoundError, IsADirectoryError):
        raise
    except Exception as error:  # text, a GGUF, a truncated file: torch's KeyError / IndexError / RuntimeError
        raise ValueError(f"{path} is not an adapter file torch.load can read ({type(error).__name__})") from None
    if not (isinstance(adapter, dict) and adapter and all(".lora_" in k for k in adapter)):
        raise ValueError(f"{path} is not a LoRA adapter (expected only '...lora_A.weight' and '...lora_B.weight' "
                         f"tensors, as trainer/train_lora.py writes)")
    sidecar = path.with_suffix(".json")
    try:
        settings = json.loads(sidecar.read_text(encoding="utf-8")) if sidecar.is_file() else {}
    except ValueError as error:
        raise ValueError(f"{sidecar} (the adapter's settings) is not JSON: {error}") from None
    if "lora_alpha" not in settings:
        raise ValueError(f"{sidecar} (written beside the adapter by trainer/train_lora.py) is missing or has no "
                         f"lora_alpha: the update's scale α/r cannot be known without it")
    return adapter, settings


def note_if_another_base(settings: dict, base_file: str | Path) -> str | None:
    """A warning when `base_file` is not the file the adapter was trained on (its SHA-256 is in the adapter's
    .json): same shapes, other weights, e.g. full_sft trained further after the adapter. None when it is."""
    trained_on = settings.get("base_sha256")
    if trained_on is None:
        return None
    digest = hashlib.sha256()
    with open(base_file, "rb") as f:
        for block in iter(functools.partial(f.read, 1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() == trained_on:
        return None
    return (f"warning: the adapter was trained on {settings.get('base_file', 'another file')} (SHA-256 "
            f"{trained_on[:12]}...), and {base_file} differs (SHA-256 {digest.hexdigest()[:12]}...): its answers "
            f"may be off; apply it to the weights it was trained on")


def adapter_shape(adapter: dict[str, torch.Tensor]) -> tuple[int, list[str]]:
    """(rank, targets) of an adapter state dict, read off its names and shapes."""
    # "model.layers.0.self_attn.q_proj.lora_A.weight": the layer's name is the third part from the end.
    names = {name.split(".")[-3] for name in adapter}
    targets = [t for t in LORA_TARGETS if t in names] + sorted(names - set(LORA_TARGETS))
    rank = next(t.shape[0] for name, t in adapter.items() if name.endswith("lora_A.weight"))
    return rank, targets


def load_lora(model: nn.Module, path: str | Path) -> dict:
    """Put the adapter file `path` onto `model` (a CausalLM); returns its settings, with the rank and targets
    applied (read off the tensors, whatever its .json says). An adapter trained on
    another base (another hidden size, another number of layers) is refused in one line (ValueError)."""
    adapter, settings = read_adapter(path)
    rank, targets = adapter_shape(adapter)
    if any(name not in LORA_TARGETS for name in targets):
        raise ValueError(f"{path}: adapts {targets}, which are not all among {', '.join(LORA_TARGETS)}")
    apply_lora(model, rank, settings["lora_alpha"], targets)
    expected = {name: tuple(t.shape) for name, t in adapter_of(model).state_dict().items()}
    found = {name: tuple(t.shape) for name, t in adapter.items()}
    if found != expected:
        layers = len({name.split(".")[2] for name in adapter})
        first = next(name for name in sorted(set(found) | set(expected)) if found.get(name) != expected.get(name))
        raise ValueError(f"{path} was trained on another base model: {first} is {_shape(found, first)} in the file, "
                         f"{_shape(expected, first)} in this model (the file adapts {layers} layers; this model has "
                         f"hidden_size {model.config.hidden_size} and {model.config.num_hidden_layers} layers); "
                         f"load it onto the weights it was trained from ({settings.get('base_file', 'see its .json')})")
    adapter_of(model).load_state_dict(adapter, strict=True)
    # What was applied, read off the tensors, over what the .json claims: a log line shows the rank in use.
    return {**settings, "lora_rank": rank, "lora_targets": ",".join(targets)}


def _shape(shapes: dict, name: str) -> str:
    return str(list(shapes[name])) if name in shapes else "absent"


def export_peft(adapter: dict[str, torch.Tensor], settings: dict, out_dir: str | Path,
                dtype: torch.dtype = torch.float16, overwrite: bool = True, inputs=()) -> Path:
    """Write the adapter as a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) for the
    Qwen3ForCausalLM that model/hf.py exports: `PeftModel.from_pretrained(AutoModelForCausalLM
    .from_pretrained(export_dir), out_dir)`. Our module names are transformers' own; PEFT adds a prefix.
    Written as model/hf.py's export_hf writes (output_paths.py's rules; `overwrite` False refuses a file there)."""
    rank, targets = adapter_shape(adapter)
    out_dir = Path(out_dir)
    check_output_folder(out_dir, PEFT_FILES, overwrite, inputs)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"base_model.model.{name}": t.detach().to(dtype).contiguous() for name, t in adapter.items()}
    atomic_write_bytes(out_dir / "adapter_model.safetensors", save(tensors, metadata={"format": "pt"}))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": settings["lora_alpha"],
              "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True,
              "base_model_name_or_path": None}
    atomic_write_text(out_dir / "adapter_config.json", json.dumps(config, indent=2) + "\n")
    return out_dir

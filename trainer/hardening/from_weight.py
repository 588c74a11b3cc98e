"""The model a run starts from (`init_model`): the checkpoint's on a resume, --from_weight's file, or the one the
size flags describe (trainer_utils.model_config) with random weights.

`load_from_weight` reads --from_weight's file and takes the sizes from its
tensors, so minimind's files (or ours of any shape) need no size flags; size flags given are checked against
it, and a mismatch names both. `frozen_model` is that model with every weight frozen: LoRA's base and DPO's
reference, named in a checkpoint by the file's hash instead of a copy of its weights. `frozen_teacher` is
distillation's teacher, --teacher_weight's file, frozen and named the same way. Each file is refused if the
`out/{run}.json` beside it records another tokenizer than --tokenizer_path (`check_tokenizer`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from model.weights import load_project_weights
from model.model import CausalLM, LMConfig
from model.tokenizer import vocab_sha256
from trainer.hardening.durable_files import sha256_of
from trainer.hardening.resume_checks import ConfigError

# The flags that shape the model; None means "not given" (the model's default applies).
SIZE_FLAGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "use_moe",
              "intermediate_size", "num_experts", "num_experts_per_tok")


def given_sizes(args) -> dict:
    """The size flags given on the command line (the others are None: the weights file's, or LMConfig's default)."""
    sizes = {name: getattr(args, name) for name in SIZE_FLAGS if getattr(args, name) is not None}
    return {**sizes, "use_moe": bool(sizes.get("use_moe", 0))}


def init_model(args, lm_config: LMConfig, log: Callable[[str], None],
               resume_state: dict | None = None) -> tuple[CausalLM, LMConfig]:
    """The model to train: the checkpoint's when resuming (weights restored in the script's section 5), else
    --from_weight's (its sizes read from the file: load_from_weight), or one of `lm_config` with random weights."""
    if resume_state is not None or args.from_weight == "none":  # (load_checkpoint checked the saved config)
        lm_config = LMConfig.from_dict(resume_state["lm_config"]) if resume_state is not None else lm_config
        return CausalLM(lm_config), lm_config
    model = load_from_weight(args, lm_config.vocab_size, log)
    return model, model.config


def from_weight_path(args) -> Path:
    """--from_weight's file: `{save_dir}/{from_weight}_{hidden}[_moe].pth`."""
    return Path(args.save_dir) / f"{args.from_weight}_{args.hidden_size}{'_moe' if args.use_moe else ''}.pth"


def teacher_path(args) -> Path:
    """--teacher_weight's file: `{save_dir}/{teacher_weight}_{teacher_hidden_size}.pth` (default: --hidden_size)."""
    return Path(args.save_dir) / f"{args.teacher_weight}_{args.teacher_hidden_size or args.hidden_size}.pth"


def load_from_weight(args, vocab_size: int, log: Callable[[str], None]) -> CausalLM:
    """--from_weight's model: the sizes read from the file's tensors, the size flags given checked against them."""
    path = from_weight_path(args)
    if not path.is_file():
        raise FileNotFoundError(f"--from_weight {args.from_weight}: {path} does not exist. Train that stage first "
                                f"(e.g. trainer/train_pretrain.py with the same --hidden_size), or pass "
                                f"--from_weight none to start from random weights")
    model = load_weights(f"--from_weight {args.from_weight}", path, {name: getattr(args, name) for name in SIZE_FLAGS},
                         vocab_size, "initial weights", log)
    check_tokenizer(f"--from_weight {args.from_weight}", path, args.tokenizer_path, log)
    return model


_NOTED: set[Path] = set()  # the files check_tokenizer has said it could not check


def check_tokenizer(flag: str, path: Path, tokenizer_path: str, log: Callable[[str], None]) -> None:
    """Refuse weights trained with another tokenizer than `tokenizer_path`: the same ids would stand for other
    text, which a vocabulary of the same size does not show. The .json beside them (out_weights.
    write_out_weights) records the tokenizer's model.tokenizer.vocab_sha256; without it (an earlier version's
    file, minimind's weights) a note says nothing was checked."""
    sidecar = path.with_suffix(".json")
    try:
        settings = json.loads(sidecar.read_text(encoding="utf-8")) if sidecar.is_file() else {}
    except (ValueError, RecursionError) as error:
        raise ConfigError(f"{flag}: {sidecar} (written beside {path.name} by the trainer) is not JSON ({error}): "
                          f"fix or delete it") from None
    recorded = settings.get("tokenizer_vocab_sha256") if isinstance(settings, dict) else None
    if recorded is None:
        if path in _NOTED:  # DPO and GRPO load --from_weight twice, as the policy and as the reference
            return
        _NOTED.add(path)
        log(f"note: {flag}: {path} has no record of the tokenizer it was trained with (no tokenizer_vocab_sha256 "
            f"in {sidecar.name}: an earlier version's or minimind's file); that it is --tokenizer_path's is not "
            f"checked")
        return
    ours = vocab_sha256(tokenizer_path)
    if recorded != ours:
        raise ConfigError(f"{flag}: {path} was trained with another tokenizer than --tokenizer_path "
                          f"{tokenizer_path}: {sidecar} records vocabulary hash {str(recorded)[:12]}..., "
                          f"{tokenizer_path} has {ours[:12]}...; the same token ids would stand for other text. "
                          f"Pass the tokenizer it was trained with as --tokenizer_path")


def load_weights(flag: str, path: Path, sizes: dict, vocab_size: int, what: str,
                 log: Callable[[str], None]) -> CausalLM:
    """The model in `path`, its sizes read from the file's tensors and checked against `sizes` (None: not given)."""
    try:
        weights, file_config = load_project_weights(path, sizes, vocab_size)
    except ValueError as error:  # the file does not fit the flags or the tokenizer: the message says how
        raise ConfigError(f"{flag}: {error}") from None
    log(f"{what}: {path} ({file_config.hidden_size}x{file_config.num_hidden_layers}, "
        f"intermediate {file_config.intermediate_size}{', MoE' if file_config.use_moe else ''})")
    model = CausalLM(file_config)
    model.load_state_dict(weights, strict=True)
    return model


def frozen_model(args, lm_config: LMConfig, log: Callable[[str], None]) -> tuple[CausalLM, dict]:
    """--from_weight's model with every weight frozen (LoRA's base, DPO's reference model), and the settings
    that name it: {"base_file", "base_sha256"}. A checkpoint records these instead of a copy of the weights,
    and a resume refuses a file whose hash changed (resume_checks compares "base_sha256")."""
    if args.from_weight == "none":
        raise ConfigError("--from_weight none: this stage starts from trained weights; name them, e.g. "
                          "--from_weight full_sft")
    model = load_from_weight(args, lm_config.vocab_size, log)
    path = from_weight_path(args)
    return model.requires_grad_(False).eval(), {"base_file": str(path), "base_sha256": sha256_of(path)}


def frozen_teacher(args, lm_config: LMConfig, log: Callable[[str], None]) -> tuple[CausalLM, dict]:
    """Distillation's teacher: --teacher_weight's model (any size: read from its tensors) with every weight frozen,
    and the settings that name it, {"teacher_file", "teacher_sha256"} (a resume refuses a changed file, as for
    "base_sha256"). Its vocabulary must be the student's token for token: the loss compares their distributions."""
    path, flag, vocab_size = teacher_path(args), f"--teacher_weight {args.teacher_weight}", lm_config.vocab_size
    if not path.is_file():
        raise FileNotFoundError(f"{flag}: {path} does not exist. Train the teacher first (e.g. "
                                f"trainer/train_full_sft.py), or name its file with --teacher_weight and "
                                f"--teacher_hidden_size")
    model = load_weights(flag, path, {"hidden_size": args.teacher_hidden_size or args.hidden_size}, vocab_size,
                         "teacher", log)
    if model.config.vocab_size != vocab_size:
        raise ConfigError(f"{flag}: {path} has {model.config.vocab_size} embedding rows, the student's tokenizer "
                          f"{vocab_size} tokens: the loss compares the two distributions token by token, so "
                          f"distill from a teacher trained with the student's tokenizer (--tokenizer_path)")
    check_tokenizer(flag, path, args.tokenizer_path, log)  # the same size, yet another tokenizer?
    return model.requires_grad_(False).eval(), {"teacher_file": str(path), "teacher_sha256": sha256_of(path)}

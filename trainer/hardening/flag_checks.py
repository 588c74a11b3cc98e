"""The flags both scripts take, checked before anything starts: a value out of its range, or a path of
the wrong kind, is one line naming the flag, the value and what is allowed (exit 2), not a traceback
later or a run that trains silently wrong. Defaults that depend on other flags are filled in here too.

It runs in parse_args, before the process group exists: under torchrun every rank meets the same bad
flag and prints its own line (run_script), and no rank is left waiting for another in a collective.
The names that become file names (--save_weight, --run_name, --from_weight) are plain names that fit
the file system, and no file the run writes is one it reads (check_outputs_are_not_inputs). One check runs
later, once the tokenizer gives the vocabulary: a model whose weights, gradients and AdamW state (a LoRA
stage's adapters included) cannot fit in the device's memory is refused (check_fits_in_memory, called by
trainer_utils.model_config), before anything is allocated; so are GRPO's rollouts and distillation's
teacher that cannot fit beside it.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from dataset.rewards import NEEDS_ROLLOUTS
from model.lora import LORA_TARGETS
from model.model import LMConfig, default_intermediate_size
from trainer.hardening.anomaly import parse_injection
from trainer.hardening.checkpoint_io import HISTORY_NAME, RunFiles
from trainer.hardening.from_weight import teacher_path
from trainer.hardening.metrics_files import metrics_path, status_path
from trainer.hardening.optimizer_checks import check_optimizer_flags, muon_matrix_parameters
from trainer.hardening.resume_checks import ConfigError

MAX_POSITIONS = LMConfig.max_position_embeddings  # the rotary table's length: no window may be longer

# A size above 2**40 is past any machine's memory: the cap keeps the memory estimate (check_fits_in_memory) and
# LMConfig's float arithmetic on the sizes away from overflowing; check_fits_in_memory refuses what is smaller.
MAX_SIZE = 2**40
SIZE = f"an integer >= 1, at most 2**40 = {MAX_SIZE}"

# What each numeric flag may be: the words a refusal prints, and the test. A flag left out (None) passes;
# the tests say what IS allowed, so NaN, for which every comparison is False, fails each of them.
# A flag one script lacks (--pack, the SFT ratios) is skipped there.
RANGES = {
    "epochs": ("an integer >= 1", lambda v: v >= 1),
    "batch_size": ("an integer >= 1 (the micro-batch per rank)", lambda v: v >= 1),
    "accumulation_steps": ("an integer >= 1 (micro-batches per optimizer step)", lambda v: v >= 1),
    "global_batch_size": ("an integer >= 1 (samples per optimizer step, all ranks together)", lambda v: v >= 1),
    "learning_rate": ("a finite number >= 0 (the peak LR; 0 leaves the weights as they are)",
                      lambda v: 0 <= v < math.inf),
    "muon_learning_rate": ("a finite number >= 0 (Muon's peak LR)", lambda v: 0 <= v < math.inf),
    "weight_decay": ("a finite number >= 0 (AdamW's decoupled weight decay)", lambda v: 0 <= v < math.inf),
    "muon_weight_decay": ("a finite number >= 0 (Muon's decoupled weight decay)", lambda v: 0 <= v < math.inf),
    "warmup_ratio": ("in [0, 1) (the share of the run the LR warms up over)", lambda v: 0 <= v < 1),
    "max_seq_len": (f"an integer in [2, {MAX_POSITIONS}] (n tokens give n - 1 next-token targets; the model's "
                    f"rotary table holds {MAX_POSITIONS} positions)", lambda v: 2 <= v <= MAX_POSITIONS),
    "hidden_size": (SIZE, lambda v: 1 <= v <= MAX_SIZE),
    "num_hidden_layers": (SIZE, lambda v: 1 <= v <= MAX_SIZE),
    "num_attention_heads": (SIZE, lambda v: 1 <= v <= MAX_SIZE),
    "num_key_value_heads": (SIZE, lambda v: 1 <= v <= MAX_SIZE),
    "intermediate_size": (SIZE, lambda v: 1 <= v <= MAX_SIZE),
    "num_experts": (SIZE, lambda v: 1 <= v <= MAX_SIZE),
    "num_experts_per_tok": (SIZE, lambda v: 1 <= v <= MAX_SIZE),
    "num_workers": ("an integer >= 0 (0 loads the data in the training process)", lambda v: v >= 0),
    "grad_clip": ("a number > 0 (the largest gradient norm kept; inf turns clipping off)", lambda v: v > 0),
    "log_interval": ("an integer >= 1 (optimizer steps between log lines)", lambda v: v >= 1),
    "save_interval": ("an integer >= 1 (optimizer steps between checkpoints)", lambda v: v >= 1),
    "eval_interval": ("an integer >= 1 (optimizer steps between validations)", lambda v: v >= 1),
    "max_steps": ("an integer >= 1 (leave it out to train every epoch)", lambda v: v >= 1),
    # NumPy takes seeds below 2**32, and each rank seeds with seed + rank.
    "seed": ("an integer in [0, 2147483647]", lambda v: 0 <= v <= 2**31 - 1),
    "keep_last": ("an integer >= 1 (the newest checkpoint is always kept)", lambda v: v >= 1),
    "patience": ("an integer >= 0 (0: no plateau check)", lambda v: v >= 0),
    "max_rollbacks": ("an integer >= 0 (rollbacks before --on_anomaly rollback stops)", lambda v: v >= 0),
    "rollback_lr_factor": ("in (0, 1] (the LR is multiplied by it after each rollback; 1 keeps it)",
                           lambda v: 0 < v <= 1),
    "max_skipped_steps": ("an integer >= 1 (non-finite steps in a row that --on_anomaly warn skips before it stops "
                          "the run)", lambda v: v >= 1),
    "system_prompt_ratio": ("in [0, 1] (a share of the samples)", lambda v: 0 <= v <= 1),
    "drop_empty_think_ratio": ("in [0, 1] (a share of the samples)", lambda v: 0 <= v <= 1),
    "lora_rank": ("an integer >= 1 (the rank r of each adapter's A and B)", lambda v: v >= 1),
    "lora_alpha": ("a finite number > 0 (the adapter's update is scaled by lora_alpha / lora_rank)",
                   lambda v: 0 < v < math.inf),
    "beta": ("a finite number > 0 (DPO, GRPO: how far the policy may move from the reference; 0.1 is usual)",
             lambda v: 0 < v < math.inf),
    "num_generations": ("an integer >= 2 (GRPO: a group compares its completions with each other)", lambda v: v >= 2),
    "max_completion_len": ("an integer >= 1 (new tokens per completion)", lambda v: v >= 1),
    "logps_chunk": ("an integer >= 1 (GRPO: positions whose log-softmax over the vocabulary is taken at once)",
                    lambda v: v >= 1),
    "max_turns": ("an integer >= 1 (GRPO: model turns per rollout; 1 runs no tool)", lambda v: v >= 1),
    "temperature": ("a finite number > 0 (GRPO samples its completions at it; distillation softens both models' "
                    "distributions with it)", lambda v: 0 < v < math.inf),
    "alpha": ("in [0, 1] (distillation: the cross-entropy's share of the loss, the KL to the teacher's the rest)",
              lambda v: 0 <= v <= 1),
    "teacher_hidden_size": (SIZE, lambda v: 1 <= v <= MAX_SIZE),
    "clip_eps": ("a finite number > 0 (GRPO's clip; below 1 but for --loss_type cispo: check_grpo_flags)",
                 lambda v: 0 < v < math.inf),
    "num_iterations": ("an integer >= 1 (GRPO: optimizer updates on each batch of rollouts)", lambda v: v >= 1),
}
LOGGERS = ("console", "file", "wandb", "swanlab")
# Distillation's --temperature T, a tighter range than GRPO's: the KL is scaled by T^2, so the teacher's gradient
# falls like T as T goes to 0 (at 0.05 it is a twentieth of its size at T = 1; at 1e-30 the teacher is silently
# gone), and above 20 both softened distributions are near uniform, where a larger T adds nothing to the logit
# matching it tends to but float32 rounding, amplified by T^2 (at 1e30, T^2 overflows: NaN at every step).
# Hinton et al. (2015) use 1 to 20.
DISTILLATION_TEMPERATURE = (0.05, 20.0)


def check_flags(args: argparse.Namespace) -> argparse.Namespace:
    """`args`, checked, with the defaults that depend on other flags filled in. A bad flag: ConfigError."""
    for flag, (allowed, ok) in RANGES.items():
        value = getattr(args, flag, None)
        if value is not None and not ok(value):
            raise ConfigError(f"--{flag} {value}: must be {allowed}")
    if args.global_batch_size is not None and args.accumulation_steps != 1:  # one would silently lose to the other
        raise ConfigError(f"--accumulation_steps {args.accumulation_steps} with --global_batch_size "
                          f"{args.global_batch_size}: the global batch derives the accumulation (global batch / "
                          f"(batch_size x ranks)); give one of the two")
    if getattr(args, "lora_name", None) is not None:  # trainer/train_lora.py
        check_lora_flags(args)
    if getattr(args, "num_generations", None) is not None:  # trainer/train_grpo.py
        check_grpo_flags(args)
    low, high = DISTILLATION_TEMPERATURE
    if getattr(args, "teacher_weight", None) is not None and not low < args.temperature <= high:  # distillation
        raise ConfigError(f"--temperature {args.temperature}: must be in ({low}, {high:g}] for distillation (the KL "
                          f"is scaled by T^2: below, the teacher's share of the gradient vanishes; above, both "
                          f"distributions are near uniform and T^2 amplifies float rounding, up to NaN)")
    check_optimizer_flags(args)  # --optimizer muon: a torch that has it, not under --parallel fsdp
    check_model_shape(args)
    check_paths(args)
    check_names(args)
    check_outputs_are_not_inputs(args)
    check_device(args.device)
    unknown = [name for name in args.logger.split(",") if name and name not in LOGGERS]
    if unknown:  # a typo would silently drop that output
        raise ConfigError(f"--logger {args.logger}: {', '.join(unknown)} is none of {', '.join(LOGGERS)}")
    try:
        parse_injection(args.debug_inject)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if args.use_compile is None:  # where it pays: 2.5x on an H100; on a CPU compiling costs more than it saves
        args.use_compile = int(args.device.startswith("cuda"))
    return args


def check_lora_flags(args: argparse.Namespace) -> None:
    """train_lora.py's flags: known target names (kept in model.py's order, so a resume compares them as one
    setting), a plain --lora_name, which names the files (`lora_{name}`: --save_weight), and what LoRA does not do."""
    names = [name.strip() for name in args.lora_targets.split(",") if name.strip()]
    unknown = [name for name in names if name not in LORA_TARGETS]
    if unknown or not names:
        raise ConfigError(f"--lora_targets {args.lora_targets}: {', '.join(unknown) or 'no name'} is not a linear "
                          f"layer of the model; choose among {','.join(LORA_TARGETS)}")
    args.lora_targets = ",".join(name for name in LORA_TARGETS if name in names)
    stem = f"{args.hidden_size}{'_moe' if args.use_moe else ''}"
    check_name("lora_name", args.lora_name, f"lora_{args.lora_name}_{stem}{LONGEST_TAIL}",
               (args.checkpoint_dir, args.save_dir, args.metrics_dir or args.save_dir))
    args.save_weight = f"lora_{args.lora_name}"
    if args.parallel == "fsdp":
        raise ConfigError("--parallel fsdp: train_lora.py trains with DDP only (the adapter is small, and the frozen "
                          "base is kept whole on each GPU); use --parallel ddp")
    if args.save_hf:
        raise ConfigError(f"--save_hf 1: train_lora.py saves the adapter alone; export it afterwards, merged or "
                          f"as a PEFT folder: python scripts/export_hf.py out/{args.from_weight}_{stem}.pth "
                          f"--merge_lora out/lora_{args.lora_name}_{stem}.pth -o hf_model (or --peft_adapter)")


def check_grpo_flags(args: argparse.Namespace) -> None:
    """What the GRPO stage does not do, and the room its completions need: ConfigError saying why."""
    if args.parallel == "fsdp":
        raise ConfigError("--parallel fsdp: GRPO samples with the model's own generation, whose number of forward "
                          "passes differs between ranks (each stops at its own end of text), while FSDP gathers the "
                          "weights in every forward on all ranks together; use --parallel ddp")
    if args.val_data:
        raise ConfigError("--val_data: GRPO has no validation loss on sampled completions; score held-out prompts "
                          "with eval_model.py")
    if args.clip_eps >= 1 and args.loss_type != "cispo":  # 1 - clip_eps would be no lower bound; cispo has none
        raise ConfigError(f"--clip_eps {args.clip_eps}: must be in (0, 1) (the ratio pi / pi_old is clipped to "
                          f"[1 - clip_eps, 1 + clip_eps]); only --loss_type cispo, which caps its weight at "
                          f"1 + clip_eps, takes more")
    if args.max_completion_len >= args.max_seq_len:
        raise ConfigError(f"--max_completion_len {args.max_completion_len}: must be below --max_seq_len "
                          f"{args.max_seq_len} (the prompt gets the rest)")
    on_calls = [name for name in (part.strip() for part in args.rewards.split(",")) if name in NEEDS_ROLLOUTS]
    if on_calls and args.max_turns == 1:
        raise ConfigError(f"--rewards {args.rewards}: the {on_calls[0]} reward scores the calls of rollouts with "
                          f"tools; give --max_turns 2 or more")


def check_model_shape(args: argparse.Namespace) -> None:
    """The size flags fit together (LMConfig checks the same, but with a traceback). A size not given is the
    model's default here; from --from_weight's file it is the file's, checked when the file is read."""
    hidden = args.hidden_size
    heads = LMConfig.num_attention_heads if args.num_attention_heads is None else args.num_attention_heads
    kv_heads = LMConfig.num_key_value_heads if args.num_key_value_heads is None else args.num_key_value_heads
    if hidden % heads:
        raise ConfigError(f"--hidden_size {hidden}: must be a multiple of --num_attention_heads {heads} "
                          f"(each head gets hidden_size / heads dimensions)")
    if (hidden // heads) % 2:
        raise ConfigError(f"--hidden_size {hidden} / --num_attention_heads {heads} = {hidden // heads}: a head's "
                          f"width must be even (rotary embeddings turn pairs of dimensions)")
    if heads % kv_heads:
        raise ConfigError(f"--num_key_value_heads {kv_heads}: must divide --num_attention_heads {heads} "
                          f"(each key/value head serves the same number of query heads)")
    experts = LMConfig.num_experts if args.num_experts is None else args.num_experts
    if args.use_moe and args.num_experts_per_tok is not None and args.num_experts_per_tok > experts:
        raise ConfigError(f"--num_experts_per_tok {args.num_experts_per_tok}: must be at most --num_experts "
                          f"{experts} (each token is routed to that many of the experts)")


def check_paths(args: argparse.Namespace) -> None:
    """Inputs are files that exist; outputs are directories, or paths where one can be made."""
    for flag, what in (("data_path", "a JSONL file of training data"), ("val_data", "a JSONL validation file"),
                       ("tokenizer_path", "a tokenizer.json file (trainer/train_tokenizer.py makes one)")):
        path = getattr(args, flag)
        if path is not None and not Path(path).is_file():
            kind = ("is a directory" if Path(path).is_dir() else "is not a regular file" if os.path.lexists(path)
                    else "does not exist")
            raise ConfigError(f"--{flag} {path} {kind}: give {what}")
    if args.resume_path is not None:
        path = Path(args.resume_path)
        sharded = path.is_dir() and HISTORY_NAME.match(path.name) and path.suffix == ".dcp"
        if not (path.is_file() or sharded):
            kind = ("is a directory" if path.is_dir() else "is not a regular file" if os.path.lexists(path)
                    else "does not exist")
            raise ConfigError(f"--resume_path {args.resume_path} {kind}: give a checkpoint file, or the "
                              f"step_N.dcp folder of a sharded one")
    for flag in ("save_dir", "checkpoint_dir", "metrics_dir"):
        if getattr(args, flag) is not None:
            check_can_be_made(flag, getattr(args, flag), Path(getattr(args, flag)))
    if args.save_debug_train_output is not None:
        path = Path(args.save_debug_train_output)
        if path.is_dir():
            raise ConfigError(f"--save_debug_train_output {path} is a directory: give the path of a file")
        check_can_be_made("save_debug_train_output", path, path.parent)


def run_outputs(args: argparse.Namespace) -> dict[str, Path]:
    """What the run writes, by what it is: the out/ weights and their settings, the Hugging Face export folder,
    the checkpoint files and history folder, the metrics, status and trace files (named as trainer_utils.run_name
    and the modules that write them name them)."""
    name = f"{args.save_weight}_{args.hidden_size}{'_moe' if args.use_moe else ''}"
    out, files, metrics_dir = Path(args.save_dir), RunFiles(Path(args.checkpoint_dir), name), args.metrics_dir
    written = {"its weights": out / f"{name}.pth", "their settings": out / f"{name}.json",
               "its Hugging Face export (--save_hf)": out / f"{name}_hf", "its resume file": files.resume_link,
               "its latest pointer": files.latest_pointer, "its checkpoint history": files.history_dir,
               "its metrics": metrics_path(metrics_dir or out, name), "its status": status_path(metrics_dir or out, name)}
    if args.save_debug_train_output is not None:
        written["its trace (--save_debug_train_output)"] = Path(args.save_debug_train_output)
    return written


def run_inputs(args: argparse.Namespace) -> dict[str, Path]:
    """What the run reads, by flag: the data, the tokenizer, --from_weight's file (LoRA's base, DPO's
    start and reference) and distillation's --teacher_weight."""
    read = {f"--{flag}": Path(getattr(args, flag)) for flag in ("data_path", "val_data", "tokenizer_path")
            if getattr(args, flag, None) is not None}
    if getattr(args, "from_weight", "none") != "none":
        stem = f"{args.hidden_size}{'_moe' if args.use_moe else ''}"
        read["--from_weight"] = Path(args.save_dir) / f"{args.from_weight}_{stem}.pth"
    if getattr(args, "teacher_weight", None) is not None:  # distillation's teacher
        read["--teacher_weight"] = teacher_path(args)
    return read


def check_outputs_are_not_inputs(args: argparse.Namespace) -> None:
    """No file the run writes is one it reads (the same path, a link to it, or inside a folder the run writes):
    with --save_weight equal to --from_weight, DPO's first save replaced the SFT model that is its start and its
    reference. Refused here, in one line, before anything is read or written."""
    written = run_outputs(args)
    for flag, source in run_inputs(args).items():
        named = f" than {flag} {getattr(args, flag[2:])}" if flag in ("--from_weight", "--teacher_weight") else ""
        for what, target in written.items():
            if _same_or_inside(source, target):
                raise ConfigError(f"{flag} {source}: this run writes {what} at {target}, over a file it reads; "
                                  f"choose another --save_weight (or --save_dir, --checkpoint_dir, --metrics_dir)"
                                  + named)


def _same_or_inside(source: Path, target: Path) -> bool:
    """Whether `source` is `target`, or lies in the folder `target` (names resolved: links and `..` followed)."""
    try:
        if os.path.lexists(source) and os.path.lexists(target) and os.path.samefile(source, target):
            return True
    except OSError:  # a broken link: compare the names below
        pass
    source, target = source.resolve(), target.resolve()
    return source == target or target in source.parents


def check_can_be_made(flag: str, value: str | Path, directory: Path) -> None:
    """`directory` exists, or can be made: the nearest of it and its parents that exists is a directory."""
    for part in (directory, *directory.absolute().parents):
        if part.is_dir():
            return
        if os.path.lexists(part):
            where = ("is not a directory: give a folder (a missing one is made)" if part == Path(value)
                     else f"cannot be made: {part} is not a directory")
            raise ConfigError(f"--{flag} {value} {where}")


def check_device(device_flag: str) -> None:
    """--device names a device this machine has (under torchrun each rank takes cuda:LOCAL_RANK)."""
    try:
        device = torch.device(device_flag)
    except RuntimeError:
        raise ConfigError(f"--device {device_flag}: must be cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ConfigError(f"--device {device_flag}: this machine has no CUDA device that PyTorch can use "
                              f"(torch.cuda.is_available() is False); train with --device cpu")
        index = int(os.environ.get("LOCAL_RANK", 0)) if "RANK" in os.environ else device.index  # as init_distributed
        if index is not None and index >= count:
            raise ConfigError(f"--device {device_flag}: cuda:{index} does not exist, this machine has {count} "
                              f"GPU{'s' if count > 1 else ''} (cuda:0 to cuda:{count - 1}); under torchrun rank "
                              f"LOCAL_RANK takes cuda:LOCAL_RANK, so start at most {count} per node")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {device_flag}: MPS is not available on this machine; train with --device cpu")
    elif device.type not in ("cpu", "mps"):
        raise ConfigError(f"--device {device_flag}: must be cpu, cuda, cuda:N or mps")


# ---- names: --save_weight, --run_name and --from_weight become parts of file names ------------------------------
#
# Every file a run writes is named from `{save_weight}_{hidden}[_moe]` or --run_name. The longest is a metrics file
# in the making, `{name}_metrics.jsonl.partial-HOST-PID-TID.tmp` (durable_files.temp_path: the host cut to 32
# characters, a process and a thread id of up to 7 digits each, as Linux's pid_max allows).
LONGEST_TAIL = "_metrics.jsonl" + ".partial-" + "H" * 32 + "-" + "9" * 7 + "-" + "9" * 7 + ".tmp"


def check_names(args: argparse.Namespace) -> None:
    """The flags that name files are plain file names, short enough for the directories they go in: a `/` or `..`
    would write outside the directories the run locked, and a long name ends in 'File name too long' mid-run."""
    stem = f"{args.hidden_size}{'_moe' if args.use_moe else ''}"  # run_name() in trainer_utils: {weight}_{stem}
    metrics_dir = args.metrics_dir or args.save_dir
    check_name("save_weight", args.save_weight, f"{args.save_weight}_{stem}{LONGEST_TAIL}",
               (args.checkpoint_dir, args.save_dir, metrics_dir))
    if args.run_name is not None:
        check_name("run_name", args.run_name, f"{args.run_name}{LONGEST_TAIL}", (metrics_dir,))
    if args.from_weight != "none":  # read from --save_dir as {from_weight}_{hidden}[_moe].pth
        check_name("from_weight", args.from_weight, f"{args.from_weight}_{stem}.pth", (args.save_dir,))


def check_name(flag: str, value: str, longest: str, directories) -> None:
    """`value` is a plain file name, and `longest` (the longest name made from it) fits in each of `directories`."""
    if not value or "/" in value or (os.altsep and os.altsep in value) or ".." in value or "\0" in value:
        raise ConfigError(f"--{flag} {value!r}: must be a plain file name (not empty; no '/', '..' or NUL): it "
                          f"names files inside the run's directories, and must not point elsewhere")
    for directory in directories:
        limit = name_max(Path(directory))
        if len(longest) > limit:
            shown = value if len(value) <= 40 else f"{value[:40]}... ({len(value)} characters)"
            raise ConfigError(f"--{flag} {shown}: too long: the longest file name made from it has {len(longest)} "
                              f"characters, and {directory} takes at most {limit}; give a name of at most "
                              f"{len(value) - (len(longest) - limit)} characters")


def name_max(directory: Path) -> int:
    """The longest file name the file system of `directory` (or of its nearest existing parent) takes."""
    existing = next((part for part in (directory, *directory.absolute().parents) if part.is_dir()), Path("/"))
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):  # a system that does not say: 255 is the limit of ext4, XFS, APFS and NTFS
        return 255


# ---- sizes: a model that cannot fit is refused before its weights are allocated ---------------------------------

# Training keeps 16 bytes a parameter: the fp32 master weight and its gradient (4 + 4), AdamW's two moments (4 + 4).
# Activations, the batch and a background save come on top, so a model refused here could never have trained.
TRAINING_BYTES_PER_PARAMETER = 16
DEFAULT_SIZES = {"hidden_size": LMConfig.hidden_size, "num_hidden_layers": LMConfig.num_hidden_layers,
                 "num_attention_heads": LMConfig.num_attention_heads,
                 "num_key_value_heads": LMConfig.num_key_value_heads, "num_experts": LMConfig.num_experts}
DEFAULT_LORA_RANK = 8  # train_lora.py's --lora_rank


def parameter_count(vocab_size: int, hidden_size: int, num_hidden_layers: int, num_attention_heads: int,
                    num_key_value_heads: int, intermediate_size: int, num_experts: int, use_moe: bool) -> int:
    """CausalLM's parameters for these sizes, counted with Python's integers (which do not overflow), as
    model/model.py lays them out: a tied embedding, per layer attention (q, k, v, o and two head norms), a SwiGLU
    MLP (or `num_experts` of them and a router), two norms; and the final norm."""
    head_dim = hidden_size // num_attention_heads
    attention = 2 * hidden_size * num_attention_heads * head_dim + 2 * hidden_size * num_key_value_heads * head_dim
    mlp = 3 * hidden_size * intermediate_size
    if use_moe:
        mlp = num_experts * mlp + hidden_size * num_experts
    layer = attention + 2 * head_dim + mlp + 2 * hidden_size
    return vocab_size * hidden_size + num_hidden_layers * layer + hidden_size


def config_parameters(config: LMConfig, **changed) -> int:
    """parameter_count of `config`, with the sizes in `changed` in place of its own."""
    sizes = {name: getattr(config, name) for name in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                      "num_attention_heads", "num_key_value_heads",
                                                      "intermediate_size", "num_experts", "use_moe")}
    return parameter_count(**{**sizes, **changed})


def lora_parameters(config: LMConfig, rank: int, targets: list[str]) -> int:
    """The parameters LoRA adds (model/lora.py): A (rank x in) and B (out x rank) on each target linear layer of
    every layer, of every expert for the MLP's under MoE. Python's integers: --lora_rank 10**9 does not overflow."""
    head_dim = config.hidden_size // config.num_attention_heads
    q, kv, hidden, width = (config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim,
                            config.hidden_size, config.intermediate_size)
    in_out = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, width), "up_proj": (hidden, width), "down_proj": (width, hidden)}
    copies = {name: config.num_experts if config.use_moe and name in ("gate_proj", "up_proj", "down_proj") else 1
              for name in in_out}
    return config.num_hidden_layers * sum(rank * sum(in_out[t]) * copies[t] for t in targets if t in in_out)


def stage_parameters(config: LMConfig, args: argparse.Namespace, **changed) -> int:
    """config_parameters(config, **changed) and what the stage adds to it: LoRA's adapters (--lora_rank, which
    `changed` may set too)."""
    rank = changed.pop("lora_rank", getattr(args, "lora_rank", None))
    adapters = lora_parameters(config, rank, args.lora_targets.split(",")) if rank else 0
    return config_parameters(config, **changed) + adapters


def check_fits_in_memory(config: LMConfig, args: argparse.Namespace) -> None:
    """Refuse a model whose weights, gradients and AdamW state cannot fit in the device's memory (under --parallel
    fsdp, a rank's share), naming the size flag that grows it most: not an allocator's traceback later. Every
    size counts, the stage's own too (LoRA's --lora_rank)."""
    device = torch.device(args.device)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    shards = world_size if args.parallel == "fsdp" else 1  # fsdp: each rank keeps 1/world_size of everything
    parameters = stage_parameters(config, args)
    muon = muon_matrix_parameters(config, args)  # --optimizer muon: one buffer, not two moments, for these
    needed = (parameters * TRAINING_BYTES_PER_PARAMETER - 4 * muon) // shards
    if device.type != "cuda":  # the ranks of a node share its memory (torchrun's LOCAL_WORLD_SIZE)
        needed *= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    available, where = available_memory(device)
    if needed <= available:
        if getattr(args, "num_generations", None) is not None:  # GRPO: its rollouts, on top
            check_rollouts_fit(config, args, needed, available, where)
        if getattr(args, "teacher_weight", None) is not None:  # distillation: the teacher, on top
            check_teacher_fits(config, args, needed, available, where, shards)
        return
    defaults = {**DEFAULT_SIZES, "intermediate_size": default_intermediate_size(config.hidden_size),
                "lora_rank": DEFAULT_LORA_RANK}
    given = [flag for flag in defaults if getattr(args, flag, None) is not None]  # (--hidden_size is always given)
    # The flag whose value grows the model most: put back at its default, it shrinks the count the most.
    culprit = max(given, key=lambda flag: parameters / stage_parameters(config, args, **{flag: defaults[flag]}))
    share = f", 1/{shards} of it on each of {shards} ranks (--parallel fsdp)" if shards > 1 else ""
    muon_note = f"; 12 for the {muon / 1e6:,.1f}M Muon trains: one momentum" if muon else ""  # --optimizer muon
    model = "the model and its LoRA adapters" if getattr(args, "lora_rank", None) else "the model"
    raise ConfigError(f"--{culprit} {getattr(args, culprit)}: {model} would have {parameters / 1e6:,.1f}M "
                      f"parameters, and training them needs at least {gib(needed)} ({TRAINING_BYTES_PER_PARAMETER} "
                      f"bytes a parameter: fp32 weights and gradients, AdamW's two moments{share}{muon_note}), "
                      f"but {where}; lower --{culprit}")


def check_rollouts_fit(config: LMConfig, args: argparse.Namespace, model: int, available: int, where: str) -> None:
    """Refuse GRPO rollouts that cannot fit beside the model's `model` bytes: a micro-batch's batch_size x G rows of
    max_seq_len tokens need, at least, the KV cache the rollout engine allocates for them (in the autocast dtype on
    a GPU, float32 on the CPU), a decoding step's fp32 logits and probabilities for every row, and a chunk of
    --logps_chunk positions' fp32 logits, log-softmax and its gradient over the vocabulary.
    `--num_generations 100000` allocated 9 GB and ended in a traceback after a minute."""
    rows, head_dim = args.batch_size * args.num_generations, config.hidden_size // config.num_attention_heads
    value_bytes = 2 if torch.device(args.device).type == "cuda" and args.dtype != "float32" else 4
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * value_bytes  # keys, values
    needed = rows * args.max_seq_len * per_token + (2 * rows + 3 * min(args.logps_chunk, rows * args.max_seq_len)) * \
        config.vocab_size * 4
    if torch.device(args.device).type != "cuda":  # the ranks of a node share its memory (torchrun's LOCAL_WORLD_SIZE)
        needed *= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if model + needed > available:
        raise ConfigError(f"--num_generations {args.num_generations} x --batch_size {args.batch_size} x "
                          f"--max_seq_len {args.max_seq_len}: a micro-batch's rollouts, {rows:,} completions, need at "
                          f"least {gib(needed)} (the KV cache, a step's logits, a chunk of log-probabilities "
                          f"over {config.vocab_size:,} tokens) beside the model's {gib(model)}, but {where}; "
                          f"lower --num_generations, --batch_size or --max_seq_len")


def check_teacher_fits(config: LMConfig, args: argparse.Namespace, model: int, available: int, where: str,
                       shards: int) -> None:
    """Refuse a teacher that cannot fit beside the student's `model` bytes: its weights in fp32 (twice its fp16
    file; under --parallel fsdp a rank's share) and a micro-batch's teacher logits and softened log-probabilities
    and probabilities over the vocabulary (4 bytes each). A missing file counts 0: loading it says it is missing."""
    path = teacher_path(args)
    needed = (2 * path.stat().st_size if path.is_file() else 0) // shards
    needed += 3 * args.batch_size * args.max_seq_len * config.vocab_size * 4
    if torch.device(args.device).type != "cuda":  # the ranks of a node share its memory (torchrun's LOCAL_WORLD_SIZE)
        needed *= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if model + needed > available:
        raise ConfigError(f"--teacher_weight {args.teacher_weight}: the teacher {path} needs at least {gib(needed)} "
                          f"(its weights in fp32, a micro-batch's logits over {config.vocab_size:,} tokens) beside "
                          f"the student's {gib(model)}, but {where}; distill from a smaller teacher, or lower "
                          f"--batch_size or --max_seq_len")


def available_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, in words): the GPU's free memory, else the machine's memory not in use (MPS shares it)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()  # torchrun: LOCAL_RANK's
        free, _ = torch.cuda.mem_get_info(index)
        return free, f"cuda:{index} has {gib(free)} free"
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:  # Linux: MemAvailable counts reclaimable cache
            kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
        return kib * 1024, f"this machine has {gib(kib * 1024)} of memory available"
    except (OSError, StopIteration):  # macOS and others have no /proc/meminfo: all of the physical memory
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return total, f"this machine has {gib(total)} of memory"


def gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB" if size < 2**1000 else "over 2**1000 bytes"  # (--batch_size 10**400: no float)

"""A bad flag is one line naming the flag, the value and what is allowed, and exit 2, before anything
starts (trainer/hardening/flag_checks.py): not a ZeroDivisionError or an optimizer's traceback later, and
not a run that trains silently wrong (a negative clip coefficient, zero tokens, an endless loop)."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from conftest import run_args, train
from model.model import CausalLM, LMConfig
from trainer import train_distillation, train_full_sft, train_pretrain
from trainer.hardening import flag_checks, optimizer_checks
from trainer.hardening.resume_checks import ConfigError
from trainer.trainer_utils import model_config

SCRIPTS = {"pretrain": train_pretrain, "sft": train_full_sft}


@pytest.fixture
def paths(tmp_path) -> dict[str, str]:
    """A file, a directory, a missing path and a sharded checkpoint's folder to put into flags."""
    (tmp_path / "file.jsonl").write_text('{"text": "hello"}\n', encoding="utf-8")
    (tmp_path / "dir").mkdir()
    (tmp_path / "step_00000004.dcp").mkdir()
    return {"file": str(tmp_path / "file.jsonl"), "dir": str(tmp_path / "dir"), "missing": str(tmp_path / "missing"),
            "dcp": str(tmp_path / "step_00000004.dcp")}


def parse(monkeypatch, script: str, flags: list[str], paths: dict[str, str]):
    """The script's own parse_args over `flags` ({file}, {dir}... filled in), on top of a valid data file."""
    argv = ["--data_path", paths["file"], "--device", "cpu", *(flag.format(**paths) for flag in flags)]
    monkeypatch.setattr(sys, "argv", [SCRIPTS[script].__file__, *argv])
    return SCRIPTS[script].parse_args()


# (script, flags, what the one line starts with)
BAD_FLAGS = [
    ("pretrain", ["--batch_size", "0"], "--batch_size 0: must be an integer >= 1"),
    ("pretrain", ["--batch_size", "-4"], "--batch_size -4: must be an integer >= 1"),
    ("pretrain", ["--accumulation_steps", "0"], "--accumulation_steps 0: must be an integer >= 1"),
    ("pretrain", ["--global_batch_size", "0"], "--global_batch_size 0: must be an integer >= 1"),
    ("pretrain", ["--accumulation_steps", "2", "--global_batch_size", "8"],
     "--accumulation_steps 2 with --global_batch_size 8: the global batch derives the accumulation"),
    ("pretrain", ["--epochs", "0"], "--epochs 0: must be an integer >= 1"),
    ("pretrain", ["--save_interval", "0"], "--save_interval 0: must be an integer >= 1"),
    ("pretrain", ["--log_interval", "0"], "--log_interval 0: must be an integer >= 1"),
    ("pretrain", ["--eval_interval", "0"], "--eval_interval 0: must be an integer >= 1"),
    ("pretrain", ["--max_steps", "0"], "--max_steps 0: must be an integer >= 1"),
    ("pretrain", ["--learning_rate", "-1"], "--learning_rate -1.0: must be a finite number >= 0"),
    ("pretrain", ["--learning_rate", "inf"], "--learning_rate inf: must be a finite number >= 0"),
    ("pretrain", ["--learning_rate", "nan"], "--learning_rate nan: must be a finite number >= 0"),
    ("pretrain", ["--warmup_ratio", "1"], "--warmup_ratio 1.0: must be in [0, 1)"),
    ("pretrain", ["--warmup_ratio", "-0.1"], "--warmup_ratio -0.1: must be in [0, 1)"),
    ("pretrain", ["--grad_clip", "-1"], "--grad_clip -1.0: must be a number > 0"),
    ("pretrain", ["--grad_clip", "0"], "--grad_clip 0.0: must be a number > 0"),
    ("pretrain", ["--max_seq_len", "1"], "--max_seq_len 1: must be an integer in [2, 32768]"),
    ("pretrain", ["--max_seq_len", "40000"], "--max_seq_len 40000: must be an integer in [2, 32768]"),
    ("pretrain", ["--num_workers", "-1"], "--num_workers -1: must be an integer >= 0"),
    ("pretrain", ["--seed", "-1"], "--seed -1: must be an integer in [0, 2147483647]"),
    ("pretrain", ["--seed", str(2**32)], f"--seed {2**32}: must be an integer in [0, 2147483647]"),
    ("pretrain", ["--keep_last", "0"], "--keep_last 0: must be an integer >= 1"),
    ("pretrain", ["--patience", "-1"], "--patience -1: must be an integer >= 0"),
    ("pretrain", ["--max_rollbacks", "-1"], "--max_rollbacks -1: must be an integer >= 0"),
    ("pretrain", ["--rollback_lr_factor", "0"], "--rollback_lr_factor 0.0: must be in (0, 1]"),
    ("pretrain", ["--rollback_lr_factor", "2"], "--rollback_lr_factor 2.0: must be in (0, 1]"),
    ("pretrain", ["--hidden_size", "0"], "--hidden_size 0: must be an integer >= 1"),
    ("pretrain", ["--num_hidden_layers", "0"], "--num_hidden_layers 0: must be an integer >= 1"),
    ("pretrain", ["--num_attention_heads", "0"], "--num_attention_heads 0: must be an integer >= 1"),
    ("pretrain", ["--num_key_value_heads", "0"], "--num_key_value_heads 0: must be an integer >= 1"),
    ("pretrain", ["--intermediate_size", "0"], "--intermediate_size 0: must be an integer >= 1"),
    ("pretrain", ["--num_experts", "0"], "--num_experts 0: must be an integer >= 1"),
    ("pretrain", ["--num_experts_per_tok", "0"], "--num_experts_per_tok 0: must be an integer >= 1"),
    ("pretrain", ["--hidden_size", "30", "--num_attention_heads", "4"], "--hidden_size 30: must be a multiple of"),
    ("pretrain", ["--hidden_size", "36", "--num_attention_heads", "4", "--num_key_value_heads", "2"],
     "--hidden_size 36 / --num_attention_heads 4 = 9: a head's width must be even"),
    ("pretrain", ["--num_attention_heads", "8", "--num_key_value_heads", "3"], "--num_key_value_heads 3: must divide"),
    ("pretrain", ["--use_moe", "1", "--num_experts", "2", "--num_experts_per_tok", "3"],
     "--num_experts_per_tok 3: must be at most --num_experts 2"),
    ("pretrain", ["--data_path", "{dir}"], "--data_path {dir} is a directory"),
    ("pretrain", ["--data_path", "{missing}"], "--data_path {missing} does not exist"),
    ("pretrain", ["--val_data", "{dir}"], "--val_data {dir} is a directory"),
    ("pretrain", ["--tokenizer_path", "{missing}"], "--tokenizer_path {missing} does not exist"),
    ("pretrain", ["--resume_path", "{dir}"], "--resume_path {dir} is a directory"),
    ("pretrain", ["--resume_path", "{missing}"], "--resume_path {missing} does not exist"),
    ("pretrain", ["--save_dir", "{file}"], "--save_dir {file} is not a directory"),
    ("pretrain", ["--checkpoint_dir", "{file}/ckpt"], "--checkpoint_dir {file}/ckpt cannot be made: {file} is not"),
    ("pretrain", ["--metrics_dir", "{file}"], "--metrics_dir {file} is not a directory"),
    ("pretrain", ["--save_debug_train_output", "{dir}"], "--save_debug_train_output {dir} is a directory"),
    ("pretrain", ["--device", "gpu"], "--device gpu: must be cpu, cuda, cuda:N or mps"),
    ("pretrain", ["--device", "meta"], "--device meta: must be cpu, cuda, cuda:N or mps"),
    ("pretrain", ["--logger", "console,fiel"], "--logger console,fiel: fiel is none of"),
    ("pretrain", ["--debug_inject", "nan:x"], "--debug_inject 'nan:x': expected nan:STEP or spike:STEP"),
    ("sft", ["--system_prompt_ratio", "1.5"], "--system_prompt_ratio 1.5: must be in [0, 1]"),
    ("sft", ["--drop_empty_think_ratio", "-0.2"], "--drop_empty_think_ratio -0.2: must be in [0, 1]"),
    ("sft", ["--drop_empty_think_ratio", "nan"], "--drop_empty_think_ratio nan: must be in [0, 1]"),
    ("sft", ["--batch_size", "0"], "--batch_size 0: must be an integer >= 1"),
    ("pretrain", ["--max_skipped_steps", "0"], "--max_skipped_steps 0: must be an integer >= 1"),
    ("pretrain", ["--intermediate_size", str(2**40 + 1)], f"--intermediate_size {2**40 + 1}: must be an integer >= 1, "
                                                          f"at most 2**40"),  # past any memory, and float overflow
    # names: a part of a file name, never a path (they wrote outside the locked directories), nor too long for one
    ("pretrain", ["--save_weight", "../../x"], "--save_weight '../../x': must be a plain file name"),
    ("pretrain", ["--run_name", "../../x"], "--run_name '../../x': must be a plain file name"),
    ("pretrain", ["--run_name", "runs/a"], "--run_name 'runs/a': must be a plain file name"),
    ("pretrain", ["--run_name", ""], "--run_name '': must be a plain file name"),  # was the default, silently
    ("sft", ["--from_weight", "../pretrain"], "--from_weight '../pretrain': must be a plain file name"),
    ("pretrain", ["--run_name", "r" * 300], f"--run_name {'r' * 40}... (300 characters): too long: the longest file "
                                            f"name made from it has 375 characters"),  # was OSError mid-run
    ("pretrain", ["--save_weight", "w" * 200], f"--save_weight {'w' * 40}... (200 characters): too long"),
    ("sft", ["--from_weight", "w" * 260], f"--from_weight {'w' * 40}... (260 characters): too long"),
]


@pytest.mark.parametrize("script, flags, message", BAD_FLAGS, ids=[" ".join(f) for _, f, _ in BAD_FLAGS])
def test_each_bad_flag_is_one_line_naming_the_flag_its_value_and_what_is_allowed(monkeypatch, paths, script,
                                                                                   flags, message):
    with pytest.raises(ConfigError) as raised:
        parse(monkeypatch, script, flags, paths)
    assert str(raised.value).startswith(message.format(**paths)), str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_cuda_device_this_machine_lacks_is_one_line(monkeypatch, paths):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"^--device cuda: this machine has no CUDA device.*--device cpu$"):
        parse(monkeypatch, "pretrain", ["--device", "cuda"], paths)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"^--device cuda:2: cuda:2 does not exist, this machine has 2 GPUs"):
        parse(monkeypatch, "pretrain", ["--device", "cuda:2"], paths)
    monkeypatch.setenv("RANK", "2")  # under torchrun, rank LOCAL_RANK takes cuda:LOCAL_RANK whatever the flag says
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match=r"start at most 2 per node"):
        parse(monkeypatch, "pretrain", ["--device", "cuda"], paths)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_values_the_readme_and_tests_use_pass(monkeypatch, paths, script):
    """Edges that are allowed on purpose: LR 0 (a run that keeps its weights), no warmup, clipping off (inf),
    the shortest window, every count at 0 that means "none", a folder still to be made, a sharded checkpoint."""
    flags = ["--learning_rate", "0", "--warmup_ratio", "0", "--grad_clip", "inf", "--max_seq_len", "2",
             "--num_workers", "0", "--patience", "0", "--max_rollbacks", "0", "--rollback_lr_factor", "1",
             "--seed", "0", "--global_batch_size", "12", "--batch_size", "1", "--max_steps", "1",
             "--hidden_size", "32", "--num_attention_heads", "4", "--num_key_value_heads", "2",
             "--use_moe", "1", "--num_experts", "4", "--num_experts_per_tok", "4",
             "--save_dir", "{missing}/out", "--checkpoint_dir", "{dir}", "--resume_path", "{dcp}",
             "--save_debug_train_output", "{missing}/trace.jsonl", "--logger", "console,file,wandb,swanlab",
             "--debug_inject", "nan:3,spike:9"]
    if script == "sft":
        flags += ["--system_prompt_ratio", "0.2", "--drop_empty_think_ratio", "1"]
    args = parse(monkeypatch, script, flags, paths)
    assert (args.learning_rate, args.grad_clip, args.use_compile) == (0.0, float("inf"), 0)


@pytest.mark.parametrize("temperature, refused", [("1e-30", True), ("0.05", True), ("1e30", True), ("20.5", True),
                                                  ("0.051", False), ("2", False), ("20", False)])
def test_distillations_temperature_is_bounded_where_the_kl_still_carries_the_teacher(monkeypatch, paths, temperature,
                                                                                     refused):
    """At 1e-30 the teacher's T^2-scaled KL vanished without a word; at 1e30 every step was NaN. GRPO's
    --temperature (sampling) keeps its own wider range."""
    argv = [train_distillation.__file__, "--data_path", paths["file"], "--device", "cpu", "--temperature", temperature]
    monkeypatch.setattr(sys, "argv", argv)
    if not refused:
        assert train_distillation.parse_args().temperature == float(temperature)
        return
    with pytest.raises(ConfigError) as raised:
        train_distillation.parse_args()
    assert str(raised.value).startswith(f"--temperature {float(temperature)}: must be in (0.05, 20] for "
                                        f"distillation"), str(raised.value)
    assert "\n" not in str(raised.value)


# ---- real processes: what a user sees -------------------------------------------------------------

def expect_one_line(result, line_start: str) -> None:
    """Exit 2, and stderr is exactly one line, starting with `line_start`."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(f"error: {line_start}"), result.stderr


@pytest.mark.parametrize("flags, line_start", [
    (["--batch_size", "0"], "--batch_size 0: must be an integer >= 1"),  # was a ZeroDivisionError
    (["--batch_size", "-4"], "--batch_size -4: must be an integer >= 1"),  # spun forever, deaf to SIGTERM
    (["--learning_rate", "-1"], "--learning_rate -1.0: must be a finite number >= 0"),  # was AdamW's ValueError
    (["--max_seq_len", "1"], "--max_seq_len 1: must be an integer in [2, "),  # trained on zero tokens and saved
], ids=["batch_size_0", "batch_size_negative", "learning_rate_negative", "max_seq_len_1"])
def test_a_bad_flag_stops_pretraining_at_once_with_one_line(tmp_path, pretrain_data, flags, line_start):
    result = train("train_pretrain.py", None, run_args(tmp_path, pretrain_data, *flags), tmp_path, check=False,
                   timeout=60)
    expect_one_line(result, line_start)
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()  # nothing started


def test_a_data_path_naming_a_directory_stops_sft_with_one_line(tmp_path, sft_data):
    result = train("train_full_sft.py", None, run_args(tmp_path, sft_data, "--data_path", str(tmp_path)), tmp_path,
                   check=False, timeout=60)
    expect_one_line(result, f"--data_path {tmp_path} is a directory: give a JSONL file")  # was IsADirectoryError


def test_under_torchrun_each_rank_prints_the_line_once(tmp_path, pretrain_data):
    result = train("train_pretrain.py", 2, run_args(tmp_path, pretrain_data, "--save_interval", "0"), tmp_path,
                   check=False, timeout=120)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    # Each rank that got as far prints the line once: torchrun stops the other rank as soon as one has failed, so
    # on a loaded machine the second may be stopped before it has parsed its flags.
    assert ours in (["error: --save_interval 0: must be an integer >= 1 (optimizer steps between checkpoints)"] * n
                    for n in (1, 2)), result.stderr
    # torchrun reports the failed ranks with a traceback of its own; none comes from the trainer's code
    frames = ("flag_checks.py", "trainer_utils.py", 'train_pretrain.py", line')
    assert not any(frame in result.stderr for frame in frames)
    assert not (tmp_path / "out").exists()


# ---- names and sizes: what a file system and a device can hold --------------------------------------------------

def test_a_name_is_refused_just_past_the_longest_file_name_its_directory_takes(monkeypatch, paths):
    """The run's longest file is `{run_name}_metrics.jsonl.partial-HOST-PID-TID.tmp`, 75 characters past the name."""
    monkeypatch.setattr(flag_checks.os, "pathconf", lambda path, name: 100 if name == "PC_NAME_MAX" else None)
    assert parse(monkeypatch, "pretrain", ["--run_name", "r" * 25], paths).run_name == "r" * 25
    with pytest.raises(ConfigError, match=r"^--run_name r{26}: too long: the longest file name made from it has 101 "
                                          r"characters, and .* takes at most 100; give a name of at most 25"):
        parse(monkeypatch, "pretrain", ["--run_name", "r" * 26], paths)
    assert parse(monkeypatch, "pretrain", ["--save_weight", "w" * 21], paths).save_weight == "w" * 21
    with pytest.raises(ConfigError, match=r"^--save_weight w{22}: too long: .* has 101 characters"):  # 22 + _512 + 75
        parse(monkeypatch, "pretrain", ["--save_weight", "w" * 22], paths)


TINY_CONFIGS = [dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
                dict(vocab_size=100, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                     intermediate_size=72),
                dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     use_moe=True, num_experts=3, intermediate_size=40)]


@pytest.mark.parametrize("sizes", TINY_CONFIGS, ids=["dense", "gqa_1_kv_head", "moe"])
def test_the_memory_estimate_counts_the_parameters_the_model_has(sizes):
    config = LMConfig(**sizes)
    assert flag_checks.config_parameters(config) == CausalLM(config).num_parameters()


def too_big(monkeypatch, paths, flags: list[str], vocab: int = 6400) -> str:
    """The line model_config refuses the sizes in `flags` with."""
    args = parse(monkeypatch, "pretrain", flags, paths)
    with pytest.raises(ConfigError) as raised:
        model_config(args, vocab)
    assert "\n" not in str(raised.value)
    return str(raised.value)


def test_a_model_that_cannot_fit_is_refused_naming_the_flag_that_grows_it_most(monkeypatch, paths):
    small = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads",
             "2"]
    line = too_big(monkeypatch, paths, [*small, "--intermediate_size", "99999999999"])  # was an allocator traceback
    assert re.match(r"--intermediate_size 99999999999: the model would have 19,200,.*M parameters, and training them "
                    r"needs at least .* GiB \(16 bytes a parameter.*\), but this machine has .* GiB of memory "
                    r"available; lower --intermediate_size$", line), line
    assert too_big(monkeypatch, paths, [*small, "--num_hidden_layers", "10000000000"]).startswith(
        "--num_hidden_layers 10000000000: the model would have")
    assert too_big(monkeypatch, paths, ["--hidden_size", "4000000", "--num_attention_heads", "8"]).startswith(
        "--hidden_size 4000000: the model would have")
    assert too_big(monkeypatch, paths, [*small, "--use_moe", "1", "--num_experts", "10000000000"]).startswith(
        "--num_experts 10000000000: the model would have")


def test_a_gpu_is_measured_by_its_free_memory_and_fsdp_divides_the_model_over_the_ranks(monkeypatch, paths):
    args = parse(monkeypatch, "pretrain", [], paths)  # the default model: 512 x 8, about 25M parameters
    needed = flag_checks.config_parameters(model_config(args, 6400)) * 16
    args.device = "cuda:0"  # (parse checked --device cpu: this machine may have no GPU)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (needed // 3, 80 * 2**30))
    with pytest.raises(ConfigError, match=r"^--hidden_size 512: .* but cuda:0 has 0.1 GiB free; lower --hidden_size$"):
        model_config(args, 6400)
    args.parallel = "fsdp"  # four ranks: a quarter of it each
    monkeypatch.setattr(flag_checks.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(flag_checks.dist, "get_world_size", lambda: 4)
    assert model_config(args, 6400).hidden_size == 512


def test_a_model_too_big_for_memory_stops_pretraining_with_one_line_before_anything_is_made(tmp_path, pretrain_data):
    result = train("train_pretrain.py", None, run_args(tmp_path, pretrain_data, "--intermediate_size", "99999999999"),
                   tmp_path, check=False, timeout=60)
    expect_one_line(result, "--intermediate_size 99999999999: the model would have")
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("sizes", TINY_CONFIGS, ids=["dense", "gqa_1_kv_head", "moe"])
def test_the_memory_estimate_counts_the_parameters_lora_adds(sizes):
    from model.lora import LORA_TARGETS, apply_lora
    config = LMConfig(**sizes)
    for targets in (LORA_TARGETS, ("q_proj", "down_proj")):
        adapter = apply_lora(CausalLM(config), 3, 6.0, targets)
        assert flag_checks.lora_parameters(config, 3, list(targets)) == sum(p.numel() for p in adapter.parameters())


def test_a_lora_rank_that_cannot_fit_stops_train_lora_with_one_line_before_anything_is_made(tmp_path, sft_data):
    from lora_files import tiny_config, write_base
    write_base(tmp_path / "out", tiny_config())
    result = train("train_lora.py", None, run_args(tmp_path, sft_data, "--lora_rank", "1000000000"), tmp_path,
                   check=False, timeout=60)
    # Before: the adapters were allocated, a 256 GB allocator traceback.
    expect_one_line(result, "--lora_rank 1000000000: the model and its LoRA adapters would have")
    assert "lower --lora_rank" in result.stderr and not (tmp_path / "ckpt").exists()


def test_a_torch_whose_fused_adamw_ignores_found_inf_is_refused_before_training():
    """The device-side skip relies on fused AdamW reading `found_inf`: this torch does (the check passes), and one
    that ignored it (here a subclass that drops it before stepping) is refused in one line; so is one that kept the
    weight but moved the moments (a NaN in them poisons every later step)."""
    optimizer_checks.check_fused_adamw_skips()

    class IgnoresFoundInf(torch.optim.AdamW):
        def step(self, closure=None):
            self.__dict__.pop("found_inf", None)
            return super().step(closure)

    class MovesTheMoments(torch.optim.AdamW):
        def step(self, closure=None):
            if self.__dict__.pop("found_inf", None) is None:
                return super().step(closure)
            weights = [p.detach().clone() for group in self.param_groups for p in group["params"]]
            super().step(closure)
            with torch.no_grad():
                for p, w in zip((p for group in self.param_groups for p in group["params"]), weights):
                    p.copy_(w)
            for state in self.state.values():
                state["step"] -= 1

    for broken in (IgnoresFoundInf, MovesTheMoments):
        with pytest.raises(ConfigError, match="fused AdamW on cpu applied a step whose found_inf was set"):
            optimizer_checks.check_fused_adamw_skips(broken)

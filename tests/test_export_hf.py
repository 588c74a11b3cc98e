"""The Hugging Face export: plain `transformers` must load it and compute what our model computes."""

import json
import os
import subprocess
import sys
from pathlib import Path

# Everything here is local: never reach for the Hub. Set before transformers reads it at import.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from model.model import CausalLM, LMConfig  # noqa: E402
from model.hf import export_hf, import_hf  # noqa: E402
from model.weights import config_from_weights  # noqa: E402

from conftest import REPO  # noqa: E402
from test_output_paths import USER_BYTES, fails_after  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    """A tiny byte-level BPE with the project's special tokens at ids 0, 1, 2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["hello world, the model speaks", "a tiny corpus for a tiny tokenizer"] * 20, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def random_model(vocab_size: int, use_moe: bool = False) -> CausalLM:
    """Small fp32 model with every weight random, norms included, so a misplaced tensor shows."""
    config = LMConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        use_moe=use_moe, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
    )
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def load_hf(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.mark.parametrize("use_moe", [False, True], ids=["dense", "moe"])
def test_transformers_loads_export_with_same_logits_and_greedy_tokens(tmp_path, tokenizer_path, use_moe):
    vocab_size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    model = random_model(vocab_size, use_moe)
    export_hf(model.state_dict(), model.config, tmp_path, tokenizer_path, dtype=torch.float32)
    hf_model = load_hf(tmp_path)
    assert type(hf_model).__name__ == ("Qwen3MoeForCausalLM" if use_moe else "Qwen3ForCausalLM")

    ids = torch.randint(3, vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        max_diff = (model(ids).logits - hf_model(ids).logits).abs().max().item()
    print(f"max |logits(ours) - logits(transformers)| = {max_diff:.3e} ({'moe' if use_moe else 'dense'})")
    assert max_diff < 1e-4

    prompt = ids[:1, :6]
    ours = model.generate(prompt, max_new_tokens=10, temperature=0, eos_token_id=2)
    theirs = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                                     {"rope_type": "linear", "factor": 4.0}], ids=["yarn", "linear"])
def test_a_scaled_export_gives_transformers_our_logits_past_the_trained_length(tmp_path, tokenizer_path, scaling):
    # Trained at 16 positions, read at 64: the rotary table (and YaRN's attention factor) must be transformers' own.
    vocab_size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    plain = random_model(vocab_size)
    model = CausalLM(LMConfig(**{**plain.config.to_dict(), "rope_scaling": scaling})).eval()
    model.load_state_dict(plain.state_dict())
    export_hf(model.state_dict(), model.config, tmp_path, tokenizer_path, dtype=torch.float32)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_scaling"] == scaling
    hf_model = load_hf(tmp_path)
    assert hf_model.config.rope_parameters["rope_type"] == scaling["rope_type"]

    ids = torch.randint(3, vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs, unscaled = model(ids).logits, hf_model(ids).logits, plain(ids).logits
    max_diff = (ours - theirs).abs().max().item()
    print(f"{scaling['rope_type']}: max |logits(ours) - logits(transformers)| = {max_diff:.3e} at 64 positions")
    assert max_diff < 1e-4
    assert (ours[:, 16:] - unscaled[:, 16:]).abs().max() > 1e-2  # the setting did change the numbers
    state, config = import_hf(tmp_path)
    assert config.rope_scaling == scaling  # and comes back with the folder


def test_exported_tokenizer_renders_chatml(tmp_path, tokenizer_path):
    vocab_size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    model = random_model(vocab_size)
    export_hf(model.state_dict(), model.config, tmp_path, tokenizer_path, dtype=torch.float16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float16"


def test_cli_exports_resume_file_with_its_own_config(tmp_path, tokenizer_path):
    vocab_size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    model = random_model(vocab_size)
    resume_file = tmp_path / "tiny_64_resume.pth"
    torch.save({"model": model.state_dict(), "lm_config": model.config.to_dict(), "step": 7}, resume_file)
    out_dir = tmp_path / "hf"
    command = [sys.executable, "-m", "scripts.export_hf", str(resume_file), "-o", str(out_dir)]
    command += ["--tokenizer", str(tokenizer_path), "--dtype", "float32"]
    subprocess.run(command, cwd=REPO, check=True)

    ids = torch.randint(3, vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(out_dir)(ids).logits, model(ids).logits, atol=1e-4, rtol=0)


def test_cli_exports_fp16_weight_file_without_size_flags_and_imports_it_back(tmp_path, tokenizer_path):
    # The vocab (a few hundred here, 1492 in the demo) differs from LMConfig's 6400: it comes from the file.
    vocab_size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    model = random_model(vocab_size)
    weight_file = tmp_path / "tiny_64.pth"
    torch.save({name: t.half() for name, t in model.state_dict().items()}, weight_file)
    out_dir, reimported = tmp_path / "hf", tmp_path / "reimported.pth"
    # As a file from another directory (the script finds the repository itself), then as a module.
    subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"), str(weight_file), "-o", str(out_dir),
                    "--tokenizer", str(tokenizer_path)], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "scripts.export_hf", str(out_dir), "--reverse", "-o", str(reimported)],
                   cwd=REPO, check=True)

    assert json.loads((out_dir / "config.json").read_text())["vocab_size"] == vocab_size
    original = torch.load(weight_file, map_location="cpu", weights_only=True)
    back = torch.load(reimported, map_location="cpu", weights_only=True)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[name], original[name]) for name in original)


def test_cli_checks_size_flags_against_the_file_and_names_both_shapes(tmp_path, tokenizer_path):
    vocab_size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    model = random_model(vocab_size)
    weight_file = tmp_path / "tiny_64.pth"
    torch.save({name: t.half() for name, t in model.state_dict().items()}, weight_file)
    width = model.config.intermediate_size
    export = [sys.executable, "-m", "scripts.export_hf", str(weight_file), "--tokenizer", str(tokenizer_path)]

    agreeing = ["--hidden_size", "64", "--num_hidden_layers", "2", "--intermediate_size", str(width)]
    subprocess.run(export + ["-o", str(tmp_path / "ok")] + agreeing, cwd=REPO, check=True)
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["intermediate_size"] == width

    refused = subprocess.run(export + ["-o", str(tmp_path / "no"), "--intermediate_size", str(width + 64)],
                             cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and not (tmp_path / "no").exists()
    assert (f"intermediate_size: file has {width} (model.layers.0.mlp.gate_proj.weight [{width}, 64]), "
            f"--intermediate_size asks {width + 64}") in refused.stderr
    assert str(weight_file) in refused.stderr


def test_import_recovers_state_dict_and_config(tmp_path, tokenizer_path):
    vocab_size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    model = random_model(vocab_size, use_moe=True)
    export_hf(model.state_dict(), model.config, tmp_path, tokenizer_path, dtype=torch.float32)
    state_dict, config = import_hf(tmp_path)
    assert config == model.config
    CausalLM(config).load_state_dict(state_dict, strict=True)
    assert all(torch.equal(state_dict[name], t) for name, t in model.state_dict().items())


def test_missing_weight_is_named_in_the_error(tmp_path, tokenizer_path):
    vocab_size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    model = random_model(vocab_size)
    state_dict = model.state_dict()
    del state_dict["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match=r"missing keys: model\.layers\.1\.self_attn\.k_norm\.weight"):
        export_hf(state_dict, model.config, tmp_path, tokenizer_path)


def test_wrong_size_flags_are_reported_as_shape_mismatch(tmp_path, tokenizer_path):
    vocab_size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    model = random_model(vocab_size)
    wrong = LMConfig(**{**model.config.to_dict(), "intermediate_size": 128})
    with pytest.raises(ValueError, match="shape mismatches: model.layers.0.mlp.gate_proj.weight"):
        export_hf(model.state_dict(), wrong, tmp_path, tokenizer_path)


def test_a_state_dict_of_another_layout_is_refused_naming_file_and_tensor(tokenizer_path):
    vocab_size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    state_dict = random_model(vocab_size).state_dict()
    del state_dict["model.layers.0.self_attn.q_norm.weight"]  # e.g. a model without per-head q/k norms
    with pytest.raises(ValueError, match=r"old\.pth has no model\.layers\.0\.self_attn\.q_norm\.weight"):
        config_from_weights(state_dict, {}, source="old.pth")


def test_every_exported_file_has_the_mode_the_umask_gives(tmp_path, tokenizer_path):
    model = random_model(Tokenizer.from_file(str(tokenizer_path)).get_vocab_size())
    previous = os.umask(0o022)  # a shared machine's usual umask: files readable by the group and others
    try:
        out = export_hf(model.state_dict(), model.config, tmp_path / "hf", tokenizer_path)
    finally:
        os.umask(previous)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes


# ---- a LoRA adapter (trainer/train_lora.py's out/lora_*.pth) -------------------------------------------------

def test_a_lora_adapter_exports_merged_and_as_a_peft_folder_with_the_adapted_models_logits(tmp_path, tokenizer_path):
    """Merged (--merge_lora) and as a PEFT folder over the plain export (--peft_adapter), the adapter computes
    in transformers what it does here: the real `peft` package loads the folder."""
    import peft
    from lora_files import TARGETS, write_adapter
    from model.lora import load_lora
    from scripts.export_hf import main as export_main

    vocab_size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    base = random_model(vocab_size)
    base_file = tmp_path / "full_sft_64.pth"
    torch.save({name: t.half() for name, t in base.state_dict().items()}, base_file)
    adapter_file = write_adapter(tmp_path, base.config)
    tokenizer = ["--tokenizer", str(tokenizer_path), "--dtype", "float32"]
    for flags, out in (([], "hf"), (["--merge_lora", str(adapter_file)], "merged"),
                       (["--peft_adapter", str(adapter_file)], "peft")):
        assert export_main([str(base_file), "-o", str(tmp_path / out), *tokenizer, *flags]) == 0

    ours = CausalLM(base.config)
    ours.load_state_dict({name: t.half().float() for name, t in base.state_dict().items()}, strict=True)
    plain = CausalLM(base.config).eval()
    plain.load_state_dict(ours.state_dict(), strict=True)
    load_lora(ours, adapter_file)
    peft_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (peft_config["r"], peft_config["lora_alpha"], peft_config["target_modules"]) == (4, 6.0, list(TARGETS))
    adapted = peft.PeftModel.from_pretrained(load_hf(tmp_path / "hf"), tmp_path / "peft").eval()
    ids = torch.randint(3, vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.eval()(ids).logits
        assert (expected - plain(ids).logits).abs().max() > 0.1, "the adapter must change the logits to be seen"
        merged_diff = (load_hf(tmp_path / "merged")(ids).logits - expected).abs().max().item()
        peft_diff = (adapted(ids).logits - expected).abs().max().item()
    print(f"max |logits(ours + adapter) - logits(transformers)|: merged {merged_diff:.3e}, PEFT {peft_diff:.3e}")
    assert merged_diff < 1e-4 and peft_diff < 1e-4


def test_a_peft_folder_of_moe_experts_is_refused_for_merge_instead(tmp_path, tokenizer_path, capsys):
    from lora_files import write_adapter
    from scripts.export_hf import main as export_main

    moe = random_model(Tokenizer.from_file(str(tokenizer_path)).get_vocab_size(), use_moe=True)
    base_file = tmp_path / "full_sft_64_moe.pth"
    torch.save({name: t.half() for name, t in moe.state_dict().items()}, base_file)
    adapter_file = write_adapter(tmp_path, moe.config, targets=("q_proj", "down_proj"))
    common = [str(base_file), "--num_experts_per_tok", "2", "--tokenizer", str(tokenizer_path)]
    assert export_main([*common, "-o", str(tmp_path / "peft"), "--peft_adapter", str(adapter_file)]) == 2
    assert "it adapts the MoE experts' down_proj" in capsys.readouterr().err and not (tmp_path / "peft").exists()
    assert export_main([*common, "-o", str(tmp_path / "merged"), "--merge_lora", str(adapter_file)]) == 0


# ---- the output-path rules (output_paths.py, as the trainer's) and one line for every user error ---------------

def export_cli(capsys, *argv) -> tuple[int, str]:
    """scripts/export_hf.py's main in this process: (exit code, stderr), stderr checked to be one line at most."""
    from scripts.export_hf import main as export_main
    with fails_after(20):  # a FIFO opened for writing would wait for a reader for good
        code = export_main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") <= 1, err
    return code, err


@pytest.fixture
def weights(tmp_path, tokenizer_path) -> Path:
    model = random_model(Tokenizer.from_file(str(tokenizer_path)).get_vocab_size())
    path = tmp_path / "tiny_64.pth"
    torch.save({name: t.half() for name, t in model.state_dict().items()}, path)
    return path


def test_a_link_planted_in_the_export_folder_or_at_the_reverse_output_is_replaced_never_written_through(
        tmp_path, tokenizer_path, weights, capsys):
    user_file = tmp_path / "notes.txt"
    user_file.write_bytes(USER_BYTES)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").symlink_to(user_file)
    code, err = export_cli(capsys, weights, "-o", out, "--tokenizer", tokenizer_path)
    assert code == 2 and err.startswith(f"error: {out / 'model.safetensors'} exists: pass --force"), err
    assert export_cli(capsys, weights, "-o", out, "--tokenizer", tokenizer_path, "--force")[0] == 0
    # Before: the weights went into notes.txt through the link.
    assert user_file.read_bytes() == USER_BYTES and not (out / "model.safetensors").is_symlink()

    back = tmp_path / "back.pth"
    back.symlink_to(user_file)
    assert export_cli(capsys, out, "--reverse", "-o", back, "--force")[0] == 0
    assert user_file.read_bytes() == USER_BYTES and not back.is_symlink()
    assert torch.load(back, weights_only=True).keys() == torch.load(weights, weights_only=True).keys()


def test_reverse_never_overwrites_a_pth_without_force_nor_its_own_input_and_never_waits_on_a_fifo(
        tmp_path, tokenizer_path, weights, capsys):
    out = tmp_path / "hf"
    assert export_cli(capsys, weights, "-o", out, "--tokenizer", tokenizer_path)[0] == 0
    trained = weights.read_bytes()
    code, err = export_cli(capsys, out, "--reverse", "-o", weights)  # before: the trained weights were replaced
    assert code == 2 and err.startswith(f"error: {weights} exists: pass --force"), err
    assert weights.read_bytes() == trained
    code, err = export_cli(capsys, out, "--reverse", "-o", out / "model.safetensors", "--force")
    assert code == 2 and "is this program's input" in err, err
    fifo = tmp_path / "fifo.pth"
    os.mkfifo(fifo)
    code, err = export_cli(capsys, out, "--reverse", "-o", fifo, "--force")  # before: waited for a reader
    assert code == 2 and err.startswith(f"error: {fifo} is a FIFO"), err
    os.unlink(out / "config.json")
    os.mkfifo(out / "config.json")
    code, err = export_cli(capsys, weights, "-o", out, "--tokenizer", tokenizer_path, "--force")
    assert code == 2 and err.startswith(f"error: {out / 'config.json'} is a FIFO"), err


def test_every_bad_input_or_output_of_export_hf_is_one_line_exit_2(tmp_path, tokenizer_path, weights, capsys):
    out = tmp_path / "hf"
    assert export_cli(capsys, weights, "-o", out, "--tokenizer", tokenizer_path)[0] == 0
    config = json.loads((out / "config.json").read_text())
    del config["hidden_size"]
    (out / "config.json").write_text(json.dumps(config))
    text = tmp_path / "notes.pth"
    text.write_text("not weights at all\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    (tmp_path / "empty").mkdir()
    cases = [  # (argv, the start of the line); before: KeyError, IndexError, IsADirectoryError, FileExistsError, ...
        ([out, "--reverse", "-o", tmp_path / "x.pth"], f"error: {out / 'config.json'} has no 'hidden_size'"),
        ([text, "-o", tmp_path / "y", "--tokenizer", tokenizer_path], f"error: {text} is not a PyTorch weights file"),
        ([tmp_path / "empty", "-o", tmp_path / "z", "--tokenizer", tokenizer_path], f"error: {tmp_path / 'empty'} is a "
                                                                                    f"folder, not a weights file"),
        ([tmp_path / "empty", "--reverse", "-o", tmp_path / "x.pth"], f"error: {tmp_path / 'empty' / 'config.json'} "
                                                                      f"not found"),
        ([weights, "-o", a_file, "--tokenizer", tokenizer_path], f"error: {a_file} is a file, not a folder"),
        ([weights, "-o", tmp_path / "w", "--tokenizer", text], "error: "),
        ([tmp_path / "hf", "--reverse", "-o", tmp_path / "empty", "--force"], f"error: {tmp_path / 'empty'} is a "
                                                                              f"directory"),
    ]
    for argv, start in cases:
        code, err = export_cli(capsys, *argv)
        assert code == 2 and err.startswith(start), (argv, err)


def test_cli_writes_yarn_from_the_trained_length_beside_the_weights_or_the_flag_and_refuses_neither(
        tmp_path, tokenizer_path, weights, capsys):
    yarn = ["--rope_scaling", "yarn", "--rope_factor", "4"]
    code, err = export_cli(capsys, weights, "-o", tmp_path / "untold", "--tokenizer", tokenizer_path, *yarn)
    assert code == 2 and "pass --original_max_position_embeddings N" in err and err.count("\n") == 1, err
    assert export_cli(capsys, weights, "-o", tmp_path / "flag", "--tokenizer", tokenizer_path, *yarn,
                      "--original_max_position_embeddings", "32")[0] == 0
    weights.with_suffix(".json").write_text('{"max_seq_len": 48}\n')
    assert export_cli(capsys, weights, "-o", tmp_path / "told", "--tokenizer", tokenizer_path, *yarn)[0] == 0
    code, err = export_cli(capsys, weights, "-o", tmp_path / "both", "--tokenizer", tokenizer_path, *yarn,
                           "--original_max_position_embeddings", "32")
    assert code == 2 and "records 48" in err, err
    for name, trained in (("flag", 32), ("told", 48)):
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": trained}
        assert config["max_position_embeddings"] == 4 * trained  # what transformers expects: no warning

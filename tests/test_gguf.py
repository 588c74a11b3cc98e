"""scripts/export_gguf.py, checked by llama.cpp itself: node-llama-cpp's prebuilt CPU build of it.

Install it once (83 MB, ~10 s; .ci/run does it):   npm ci --prefix tests/gguf --omit=optional

Without it these tests skip, or fail when TRAINER_REQUIRE_LLAMA_CPP=1 (as in .ci/run). One node
process per GGUF answers every text and prompt (tests/gguf/llama_cpp_check.mjs).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import gguf
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dataset.chat_format import render_chat_text
from eval_model import generate_ids
from model.chat_template import CHAT_TEMPLATE
from model.model import CausalLM, LMConfig
from model.hf import export_hf
from model.tokenizer import DEFAULT_TOKENIZER, SPECIAL_TOKENS
from scripts import export_gguf

REPO = Path(__file__).resolve().parent.parent
NODE_DIR = REPO / "tests" / "gguf"
INSTALL = "npm ci --prefix tests/gguf --omit=optional"

# Where a pre-tokenizer shows: whitespace runs and blank lines before Chinese, the empty think block of
# every chat answer, emoji (4 bytes), digits, contractions, tabs, mixed scripts, special tokens in text.
HAND_TEXTS = [
    "Hello, world! It's 2024.", "The capital of France is Paris.", "  indented\n\nnew lines\ttab\t\tend",
    "秘鲁的首都是哪里", "你好，世界！", "中文和English混合123", "東京は日本の首都です。", "I'm fine 😊 谢谢 🇫🇷",
    "答案：\n\n你好", "a\n\n中", "Paris.\n\n巴黎是法国的首都。", "hello  你好", "x   \t 中文", " \n 中",
    "<think>\n\n</think>\n\n巴黎是法国的首都。", "We'll see, they're here; I'D SAY it's 3.14159 or 1,000,000.",
    "<|im_start|>user\n4+6等于多少？<|im_end|>\n<|im_start|>assistant\n", "tabs\tand\r\nwindows\r\n行", "",
    "   ", "\n", "数字１２３和123", "emoji🙂中文", "don't 不要 won't",
]
PROMPTS = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\n秘鲁的首都是哪里？<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>Once upon a time"]
NEW_TOKENS = 16


def demo_texts(per_file: int = 40) -> list[str]:
    """The first lines of every dataset/*_demo*.jsonl: pretraining texts, and chats as the template renders them."""
    texts = []
    for path in sorted((REPO / "dataset").glob("*_demo*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines()[:per_file]:
            record = json.loads(line)
            for key in ("text", "question"):
                if key in record:
                    texts.append(record[key])
            for key in ("conversations", "chosen", "rejected"):
                if key in record:
                    texts.append(render_chat_text(record[key]))
    return texts


@pytest.fixture(scope="module")
def llama_cpp():
    """run(gguf_path, texts, prompts, chat) -> llama.cpp's token ids, greedy tokens and rendered chat."""
    if shutil.which("node") is None or not (NODE_DIR / "node_modules" / "node-llama-cpp").is_dir():
        missing = f"node (20 or newer), then {INSTALL}" if shutil.which("node") is None else INSTALL
        if os.environ.get("TRAINER_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(f"TRAINER_REQUIRE_LLAMA_CPP=1 but llama.cpp for node is not installed: install {missing}")
        pytest.skip(f"llama.cpp for node is not installed: install {missing}")

    def run(path: Path, texts=(), prompts=(), chat=None) -> dict:
        cases = path.with_suffix(".cases.json")
        cases.write_text(json.dumps({"texts": list(texts), "prompts": list(prompts), "n": NEW_TOKENS, "chat": chat}))
        done = subprocess.run(["node", str(NODE_DIR / "llama_cpp_check.mjs"), str(path), str(cases)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])
    return run


def export(*args: str | Path) -> tuple[int, str, str]:
    """scripts/export_gguf.py's command line run in this process (a new python spends seconds importing
    torch); its exit code, stdout and stderr. test_an_hf_export_folder... runs it as a file."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.object(sys, "argv", ["export_gguf.py", *map(str, args)]), redirect_stdout(out), \
            redirect_stderr(err):
        try:
            export_gguf.main()
            code = 0
        except SystemExit as error:
            code = error.code
    return code, out.getvalue(), err.getvalue()


def mild_random_model(vocab_size: int, seed: int = 0, **sizes) -> CausalLM:
    """A random tiny model whose greedy text is neither one repeated token nor chaos: matrices of std 0.12-0.3
    (PyTorch's init gives near-uniform logits), norms 1 +- 0.1. Rounded to FP16, as out/*.pth stores it."""
    torch.manual_seed(seed)
    config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=vocab_size, max_position_embeddings=512)
    model = CausalLM(LMConfig(**{**config, **sizes})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.12 + 0.18 * torch.rand(()).item())
            p.copy_(p.half().float())
    return model


def save_pth(model: CausalLM, path: Path) -> Path:
    torch.save({k: v.half() for k, v in model.state_dict().items()}, path)
    return path


def greedy(model: CausalLM, prompts: list[list[int]]) -> list[list[int]]:
    with torch.no_grad():
        return [generate_ids(model, p, NEW_TOKENS, temperature=0.0) for p in prompts]


def until_eos(ids: list[int]) -> list[int]:
    """llama.cpp's tokens up to <|im_end|>, where eval_model.generate_ids stops."""
    eos = SPECIAL_TOKENS["<|im_end|>"]
    return ids[:ids.index(eos)] if eos in ids else ids


def top1_agreement(model: CausalLM, prompt: list[int], theirs: list[int]) -> int:
    """At how many of llama.cpp's greedy steps our model, given the same prefix, picks the same token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + theirs])).logits
    ours = logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
    return sum(a == b for a, b in zip(ours, theirs))


def top1_gaps(model: CausalLM, prompt: list[int], theirs: list[int]) -> list[float]:
    """At each of llama.cpp's greedy steps, how far below our best logit (given the same prefix) its pick is."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + theirs])).logits[0, len(prompt) - 1:-1]
    return (logits.max(-1).values - logits[torch.arange(len(theirs)), theirs]).tolist()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny model with the committed tokenizer, its out/*.pth and its FP16 and Q8_0 GGUF files."""
    tmp = tmp_path_factory.mktemp("gguf")
    tokenizer = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    model = mild_random_model(tokenizer.get_vocab_size())
    pth = save_pth(model, tmp / "full_sft_64.pth")
    for qtype in ("f16", "q8_0"):
        code, out, err = export(pth, "--out", tmp / f"{qtype}.gguf", "--type", qtype)
        assert code == 0, err
        print(out.strip())
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    return tmp, tokenizer, model, prompts


def test_llama_cpp_tokenizes_every_text_and_greedy_decodes_as_we_do_from_an_fp16_gguf(dense, llama_cpp):
    tmp, tokenizer, model, prompts = dense
    texts = HAND_TEXTS + demo_texts()
    theirs = llama_cpp(tmp / "f16.gguf", texts, prompts)
    ours = [tokenizer.encode(t).ids for t in texts]
    differ = [(t, a, b) for t, a, b in zip(texts, ours, theirs["tokens"]) if a != b]
    print(f"token ids equal on {len(texts) - len(differ)}/{len(texts)} texts ({sum(map(len, ours))} tokens)")
    assert not differ, differ[:3]
    ours_greedy, theirs_greedy = greedy(model, prompts), [until_eos(g) for g in theirs["generated"]]
    print(f"FP16 greedy equal on {sum(a == b for a, b in zip(ours_greedy, theirs_greedy))}/{len(prompts)} prompts")
    assert ours_greedy == theirs_greedy
    assert min(len(set(g)) for g in ours_greedy) >= 3, f"the test model degenerated: {ours_greedy}"


@pytest.mark.parametrize("flags", [("yarn", "4"), ("linear", "4")], ids=["yarn", "linear"])
def test_llama_cpp_greedy_decodes_as_we_do_past_the_trained_length_under_rope_scaling(dense, tmp_path, llama_cpp, flags):
    # Trained at 16 (out/{run}.json), prompts of 20 to 60 tokens and 16 new ones: every step past 16 positions.
    tmp, tokenizer, model, prompts = dense
    pth = save_pth(model, tmp_path / "full_sft_64.pth")
    (tmp_path / "full_sft_64.json").write_text('{"max_seq_len": 16}\n')
    code, _, err = export(pth, "--out", tmp_path / "scaled.gguf", "--rope_scaling", flags[0], "--rope_factor", flags[1])
    assert code == 0, err
    fields = gguf.GGUFReader(tmp_path / "scaled.gguf").fields
    value = lambda key: fields[f"qwen3.{key}"].parts[-1].tobytes().decode() if key.endswith("type") \
        else fields[f"qwen3.{key}"].parts[-1][0]  # noqa: E731
    assert value("rope.scaling.type") == flags[0] and value("rope.scaling.factor") == 4 \
        and value("context_length") == 64
    if flags[0] == "yarn":
        assert value("rope.scaling.original_context_length") == 16 and value("rope.scaling.attn_factor") == 1.0
    scaling = {"rope_type": flags[0], "factor": 4.0, **({"original_max_position_embeddings": 16}
                                                         if flags[0] == "yarn" else {})}
    scaled = CausalLM(LMConfig(**{**model.config.to_dict(), "rope_scaling": scaling})).eval()
    scaled.load_state_dict(model.state_dict())
    long_prompts = [p + tokenizer.encode(text).ids for p, text in zip(prompts, HAND_TEXTS[:3])] + [
        tokenizer.encode(demo_texts(2)[0]).ids[:60]]
    assert min(map(len, long_prompts)) > 16
    theirs = llama_cpp(tmp_path / "scaled.gguf", prompts=long_prompts)
    assert theirs["train_context"] == 64
    # Each of llama.cpp's greedy tokens is our top token after its prefix, or within 1e-3 of it: a near tie that
    # FP16 arithmetic decides either way (one in the linear run: logits 4.4630 and 4.4628).
    gaps = [gap for p, g in zip(long_prompts, theirs["generated"]) for gap in top1_gaps(scaled, p, until_eos(g))]
    print(f"{flags[0]}: llama.cpp's {len(gaps)} greedy tokens past the trained length are our top-1 at "
          f"{sum(gap == 0 for gap in gaps)}, the largest gap {max(gaps):.2e}")
    assert len(gaps) >= 48 and max(gaps) < 1e-3
    assert greedy(scaled, long_prompts) != greedy(model, long_prompts)  # the scaling changed what the model writes


def test_the_length_training_recorded_beside_the_weights_is_the_context_length_llama_cpp_reads(dense, tmp_path,
                                                                                              llama_cpp):
    # out/{run}.json holds the max_seq_len the run trained at; without it, the rotary table's length is all there is.
    tmp, tokenizer, model, prompts = dense
    pth = save_pth(model, tmp_path / "full_sft_64.pth")
    assert export(pth, "--out", tmp_path / "untold.gguf")[0] == 0
    (tmp_path / "full_sft_64.json").write_text('{"max_seq_len": 48}\n')
    assert export(pth, "--out", tmp_path / "told.gguf")[0] == 0
    lengths = {name: int(gguf.GGUFReader(tmp_path / f"{name}.gguf").fields["qwen3.context_length"].parts[-1][0])
               for name in ("untold", "told")}
    assert lengths == {"untold": LMConfig().max_position_embeddings, "told": 48}  # a .pth does not record its table
    theirs = llama_cpp(tmp_path / "told.gguf", prompts=prompts[:1])  # it still runs a longer context, as before
    assert theirs["train_context"] == 48
    assert until_eos(theirs["generated"][0]) == until_eos(greedy(model, prompts[:1])[0])


def test_a_broken_length_file_beside_the_weights_is_one_line_naming_it(dense, tmp_path):
    tmp, tokenizer, model, prompts = dense
    pth = save_pth(model, tmp_path / "full_sft_64.pth")
    (tmp_path / "full_sft_64.json").write_text('{"max_len": 48}\n')
    code, _, err = export(pth, "--out", tmp_path / "x.gguf")
    assert code == 2 and "full_sft_64.json should hold {\"max_seq_len\": N}" in err and err.count("\n") == 1, err


def test_q8_0_gguf_is_about_half_the_size_and_picks_our_top_token_at_almost_every_step(dense, llama_cpp):
    tmp, tokenizer, model, prompts = dense
    f16, q8 = (tmp / "f16.gguf").stat().st_size, (tmp / "q8_0.gguf").stat().st_size
    theirs = llama_cpp(tmp / "q8_0.gguf", prompts=prompts)["generated"]
    ours = greedy(model, prompts)
    equal = sum(a == until_eos(b) for a, b in zip(ours, theirs))
    agree = sum(top1_agreement(model, p, g) for p, g in zip(prompts, theirs))
    steps = sum(map(len, theirs))
    print(f"sizes: f16 {f16:,} B, q8_0 {q8:,} B; Q8_0 greedy equal on {equal}/{len(prompts)} prompts; "
          f"our top-1 token after llama.cpp's prefix equals its pick at {agree}/{steps} steps")
    assert q8 < 0.75 * f16  # the tokenizer's metadata is not quantized
    assert agree >= 0.9 * steps


def test_an_hf_export_folder_gives_the_same_gguf_tensors_as_its_pth(dense, tmp_path):
    tmp, _, model, _ = dense
    hf_dir = export_hf(torch.load(tmp / "full_sft_64.pth"), model.config, tmp_path / "hf_model")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "export_gguf.py"), str(hf_dir),
                           "--out", str(tmp_path / "from_hf.gguf")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert_same_tensors(tmp / "f16.gguf", tmp_path / "from_hf.gguf")


def assert_same_tensors(path_a: Path, path_b: Path) -> None:
    a, b = gguf.GGUFReader(path_a), gguf.GGUFReader(path_b)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert x.tensor_type == y.tensor_type and (x.data == y.data).all(), x.name
    assert {k for k in a.fields if k != "general.name"} == {k for k in b.fields if k != "general.name"}


def test_moe_exports_as_qwen3moe_and_llama_cpp_routes_as_our_moe_feed_forward(tmp_path, llama_cpp):
    tokenizer = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    model = mild_random_model(tokenizer.get_vocab_size(), seed=1, use_moe=True, num_experts=4,
                              num_experts_per_tok=2)
    pth = save_pth(model, tmp_path / "full_sft_64_moe.pth")
    code, _, err = export(pth, "--out", tmp_path / "moe.gguf", "--num_experts_per_tok", "2")
    assert code == 0, err
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    theirs = [until_eos(g) for g in llama_cpp(tmp_path / "moe.gguf", prompts=prompts)["generated"]]
    ours = greedy(model, prompts)
    print(f"MoE (4 experts, top-2) FP16 greedy equal on {sum(a == b for a, b in zip(ours, theirs))}/{len(prompts)} prompts")
    assert ours == theirs
    hf_dir = export_hf(torch.load(pth), model.config, tmp_path / "hf_moe")  # Qwen3MoeForCausalLM, top-k in config.json
    code, _, err = export(hf_dir, "--out", tmp_path / "moe_from_hf.gguf")
    assert code == 0, err
    assert_same_tensors(tmp_path / "moe.gguf", tmp_path / "moe_from_hf.gguf")
    assert gguf.GGUFReader(tmp_path / "moe_from_hf.gguf").fields["qwen3moe.expert_used_count"].contents() == 2


def test_a_plain_byte_level_tokenizer_like_miniminds_exports_as_gpt2_with_the_same_ids(tmp_path, llama_cpp):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # minimind's: GPT-2's regex
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=list(SPECIAL_TOKENS) + ["<think>", "</think>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(demo_texts(per_file=200), trainer=trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    pth = save_pth(mild_random_model(tokenizer.get_vocab_size()), tmp_path / "m.pth")
    code, out, err = export(pth, "--out", tmp_path / "m.gguf", "--tokenizer", tmp_path / "tokenizer.json")
    assert code == 0 and "tokenizer.ggml.pre=gpt-2" in out, out + err
    texts = HAND_TEXTS + demo_texts()
    theirs = llama_cpp(tmp_path / "m.gguf", texts)["tokens"]
    ours = [tokenizer.encode(t).ids for t in texts]
    print(f"gpt-2 pre-tokenizer: token ids equal on {sum(a == b for a, b in zip(ours, theirs))}/{len(texts)} texts")
    assert ours == theirs
    code, _, err = export(pth, "--out", tmp_path / "x.gguf")  # the committed tokenizer has more tokens than this model
    assert code == 2 and "more than the model's vocab_size 800" in err and err.count("\n") == 1, err


def test_the_gguf_chat_template_renders_in_llama_cpps_engine_as_ours(dense, llama_cpp):
    tmp, *_ = dense
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "秘鲁的首都是哪里？"},
            {"role": "assistant", "content": "利马"}, {"role": "user", "content": "And France?"}]
    theirs = llama_cpp(tmp / "f16.gguf", chat=chat)["chat"]
    assert gguf.GGUFReader(tmp / "f16.gguf").fields["tokenizer.chat_template"].contents() == CHAT_TEMPLATE
    assert theirs == render_chat_text(chat)  # the history as given: it ends with the user's turn


def test_a_han_isolating_tokenizer_and_an_existing_out_file_are_refused_in_one_line(dense, tmp_path):
    tmp, tokenizer, *_ = dense
    config = json.loads(tokenizer.to_str())
    config["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{Han}"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    (tmp_path / "han.json").write_text(json.dumps(config))
    out = tmp_path / "han.gguf"
    code, _, err = export(tmp / "full_sft_64.pth", "--out", out, "--tokenizer", tmp_path / "han.json")
    assert code == 2 and err.startswith("export_gguf: ") and err.count("\n") == 1, err
    assert r"Split('\\p{Han}', Isolated), ByteLevel(use_regex=True)" in err
    assert "trainer/train_tokenizer.py" in err and "--force_pre gpt-2" in err
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))

    out.write_bytes(b"the user's own file")
    code, _, err = export(tmp / "full_sft_64.pth", "--out", out)
    assert code == 2 and "exists: pass --force" in err and err.count("\n") == 1, err
    assert out.read_bytes() == b"the user's own file"
    code, _, err = export(tmp_path / "missing.pth", "--out", tmp_path / "x.gguf")
    assert code == 2 and "missing.pth not found" in err and err.count("\n") == 1, err
    config = json.loads(tokenizer.to_str())
    config["model"]["dropout"] = "high"  # valid JSON of the right shape, which the tokenizers library refuses
    (tmp_path / "broken.json").write_text(json.dumps(config))
    code, _, err = export(tmp / "full_sft_64.pth", "--out", tmp_path / "x.gguf", "--tokenizer", tmp_path / "broken.json")
    assert code == 2 and "broken.json: the tokenizers library cannot load it" in err and err.count("\n") == 1, err


def test_a_link_at_the_old_temp_name_is_never_followed_and_force_never_replaces_the_source(dense, tmp_path):
    from test_output_paths import USER_BYTES, fails_after
    tmp, *_ = dense
    user_file = tmp_path / "notes.txt"
    user_file.write_bytes(USER_BYTES)
    out = tmp_path / "model.gguf"
    (tmp_path / "model.gguf.tmp").symlink_to(user_file)  # the name the export used to open, following links
    code, _, err = export(tmp / "full_sft_64.pth", "--out", out)
    assert code == 0, err
    # Before: the GGUF was written into notes.txt through the link, and the link then renamed to model.gguf.
    assert user_file.read_bytes() == USER_BYTES and not out.is_symlink() and out.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "model.gguf.tmp", "notes.txt"]

    source = tmp / "full_sft_64.pth"
    before = source.read_bytes()
    code, _, err = export(source, "--out", source, "--force")  # before: the source was replaced by its GGUF
    assert code == 2 and "is this program's input" in err and err.count("\n") == 1, err
    assert source.read_bytes() == before
    code, _, err = export(out, "--out", tmp_path / "again.gguf")  # before: "holds pickled objects"
    assert code == 2 and f"{out} is a GGUF file" in err and err.count("\n") == 1, err
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    with fails_after(20):
        code, _, err = export(source, "--out", fifo, "--force")
    assert code == 2 and f"{fifo} is a FIFO" in err and err.count("\n") == 1, err
    with fails_after(20):
        code, _, err = export(fifo, "--out", tmp_path / "from_a_fifo.gguf")
    assert code == 2 and f"{fifo} is not a regular file" in err and err.count("\n") == 1, err

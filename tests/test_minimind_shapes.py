"""minimind's own weights load with no size flags: in eval_model.py, the export CLI, and the library
function behind the trainers' --from_weight. Also the tokenizer option a real Chinese corpus needs.

The state dicts here are built from minimind's source (model/model_minimind.py of
jingyaogong/minimind), not from our model class: its parameter names, its default shape (hidden 768,
8 layers, 8 heads, 4 kv heads, vocab 6400, SwiGLU width 64 * ceil(pi * hidden / 64) = 2432, lm_head
tied to the embedding; MoE: 4 experts under `mlp.gate` / `mlp.experts.N`, top-1) and the FP16
out/*.pth format its trainers write ({name: tensor.half()}), with random values.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

# Everything here is local: never reach for the Hub. Set before transformers reads it at import.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import eval_model  # noqa: E402
from model.weights import config_from_weights, infer_sizes, load_project_weights  # noqa: E402
from model.model import CausalLM  # noqa: E402
from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer  # noqa: E402
from trainer.train_tokenizer import train_tokenizer  # noqa: E402

from conftest import REPO
MOE_HIDDEN = 256  # minimind's MoE layout at a smaller width, so the test stays fast


def minimind_width(hidden: int) -> int:
    """minimind's default SwiGLU width (MiniMindConfig.intermediate_size)."""
    return 64 * math.ceil(hidden * math.pi / 64)


def minimind_state_dict(hidden: int = 768, layers: int = 8, heads: int = 8, kv_heads: int = 4, vocab: int = 6400,
                        experts: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random FP16 weights under the names and shapes of minimind's MiniMindForCausalLM.state_dict()."""
    generator = torch.Generator().manual_seed(seed)
    head_dim, width = hidden // heads, minimind_width(hidden)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (0.02 * torch.randn(rows, cols, generator=generator)).half()

    def norm(dim: int) -> torch.Tensor:  # not all ones, so a misplaced norm weight shows in the logits
        return (1 + 0.1 * torch.randn(dim, generator=generator)).half()

    def swiglu(prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + "gate_proj.weight": matrix(width, hidden), prefix + "up_proj.weight": matrix(width, hidden),
                prefix + "down_proj.weight": matrix(hidden, width)}

    embed = matrix(vocab, hidden)
    state = {"model.embed_tokens.weight": embed}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": matrix(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": matrix(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": matrix(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": norm(head_dim),
            p + "self_attn.k_norm.weight": norm(head_dim),
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
        })
        if experts:
            state[p + "mlp.gate.weight"] = matrix(experts, hidden)  # the router
            for j in range(experts):
                state.update(swiglu(f"{p}mlp.experts.{j}."))
        else:
            state.update(swiglu(p + "mlp."))
    state["model.norm.weight"] = norm(hidden)
    # Tied: minimind's {k: v.half()} turns the one shared tensor into two equal ones.
    state["lm_head.weight"] = embed.clone()
    return state


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Path, dict]:
    """minimind's default model as out/full_sft_768.pth, and its state dict."""
    state = minimind_state_dict()
    path = tmp_path_factory.mktemp("dense_out") / "full_sft_768.pth"
    torch.save(state, path)
    return path, state


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, dict]:
    """minimind's MoE layout (4 experts) at hidden 256, 2 layers, as out/full_sft_256_moe.pth."""
    state = minimind_state_dict(hidden=MOE_HIDDEN, layers=2, experts=4, seed=1)
    path = tmp_path_factory.mktemp("moe_out") / f"full_sft_{MOE_HIDDEN}_moe.pth"
    torch.save(state, path)
    return path, state


def our_model(state: dict[str, torch.Tensor], **requested) -> CausalLM:
    """Our CausalLM in fp32 with the file's weights, its config read from them."""
    model = CausalLM(config_from_weights(state, requested))
    model.load_state_dict({name: t.float() for name, t in state.items()}, strict=True)
    return model.eval()


def export_cli(path: Path, out_dir: Path, *flags: str, as_file: bool = False) -> subprocess.CompletedProcess:
    """scripts/export_hf.py as a user runs it: as a module from the repo root, or as a file from elsewhere."""
    if as_file:
        command, cwd = [sys.executable, str(REPO / "scripts" / "export_hf.py")], out_dir.parent
    else:
        command, cwd = [sys.executable, "-m", "scripts.export_hf"], REPO
    return subprocess.run(command + [str(path), "-o", str(out_dir), *flags], cwd=cwd, capture_output=True, text=True)


def assert_transformers_matches_ours(hf_dir: Path, model: CausalLM, vocab: int) -> float:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        max_diff = (hf_model(ids).logits - model(ids).logits).abs().max().item()
    assert max_diff < 1e-4, max_diff
    return max_diff


# ---- the dense default shape --------------------------------------------------------------------

def test_minimind_default_shape_is_read_from_the_weights(dense):
    _, state = dense
    sizes = infer_sizes(state)
    assert sizes == {"vocab_size": 6400, "hidden_size": 768, "num_hidden_layers": 8, "num_attention_heads": 8,
                     "num_key_value_heads": 4, "head_dim": 96, "use_moe": 0, "intermediate_size": 2432,
                     "num_experts": 0, "tie_word_embeddings": 1}
    with torch.device("meta"):
        parameters = CausalLM(config_from_weights(state, {})).num_parameters()
    assert round(parameters / 1e6, 1) == 63.9  # minimind's figure for its default model


def test_eval_loads_minimind_weights_without_size_flags(dense):
    path, state = dense
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER)
    args = eval_model.build_arg_parser().parse_args(
        ["--weight", "full_sft", "--save_dir", str(path.parent), "--device", "cpu"])
    model = eval_model.load_model(args, tokenizer, torch.device("cpu"))
    assert model.config.intermediate_size == 2432 and model.config.num_key_value_heads == 4
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], t.float()) for name, t in state.items())


def test_eval_checks_size_flags_and_names_the_file_and_both_shapes(dense):
    path, _ = dense
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER)
    common = ["--weight", "full_sft", "--save_dir", str(path.parent), "--device", "cpu"]
    matching = common + ["--hidden_size", "768", "--num_key_value_heads", "4", "--intermediate_size", "2432"]
    args = eval_model.build_arg_parser().parse_args(matching)
    assert eval_model.load_model(args, tokenizer, torch.device("cpu")).config.hidden_size == 768

    args = eval_model.build_arg_parser().parse_args(common + ["--intermediate_size", "2048"])
    with pytest.raises(RuntimeError) as refused:
        eval_model.load_model(args, tokenizer, torch.device("cpu"))
    message = str(refused.value)
    assert str(path) in message
    assert ("intermediate_size: file has 2432 (model.layers.0.mlp.gate_proj.weight [2432, 768]), "
            "--intermediate_size asks 2048") in message
    assert "--hidden_size 768 --num_hidden_layers 8 --num_attention_heads 8 --num_key_value_heads 4" in message


def test_export_cli_needs_no_size_flags_and_transformers_computes_our_logits(dense, tmp_path):
    path, state = dense
    result = export_cli(path, tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["intermediate_size"], config["vocab_size"], config["num_key_value_heads"]) == (2432, 6400, 4)
    max_diff = assert_transformers_matches_ours(tmp_path / "hf", our_model(state), 6400)
    print(f"minimind default shape: max |logits(ours) - logits(transformers)| = {max_diff:.2e}")


def test_from_weight_library_function_infers_and_checks_the_trainer_flags(dense):
    path, state = dense
    # What the trainers pass: the size flags given (others None) and the tokenizer's vocab size.
    requested = {"hidden_size": 768, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
                 "use_moe": 0, "intermediate_size": None, "num_experts": None, "num_experts_per_tok": None}
    weights, config = load_project_weights(path, requested, tokenizer_vocab_size=6400)
    assert config.intermediate_size == 2432 and config.vocab_size == 6400 and config.tie_word_embeddings
    model = CausalLM(config)
    model.load_state_dict(weights, strict=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight

    with pytest.raises(ValueError) as refused:
        load_project_weights(path, {**requested, "num_key_value_heads": 2, "intermediate_size": 2048})
    message = str(refused.value)
    assert ("num_key_value_heads: file has 4 (model.layers.0.self_attn.k_proj.weight [384, 768] / head_dim 96), "
            "--num_key_value_heads asks 2") in message
    assert "intermediate_size: file has 2432" in message
    with pytest.raises(ValueError, match="6400 embedding rows but the tokenizer has 6401 tokens"):
        load_project_weights(path, requested, tokenizer_vocab_size=6401)


def test_eval_picks_the_weight_file_by_the_size_flags_given(tmp_path):
    for name in ("full_sft_512.pth", "full_sft_768.pth", "full_sft_768_moe.pth", "pretrain_768.pth"):
        (tmp_path / name).touch()
    find = eval_model.find_weight_file
    assert find(tmp_path, "pretrain", None, None).name == "pretrain_768.pth"
    assert find(tmp_path, "full_sft", 768, 1).name == "full_sft_768_moe.pth"
    assert find(tmp_path, "full_sft", 512, None).name == "full_sft_512.pth"
    with pytest.raises(RuntimeError, match="several full_sft weights .*full_sft_768.pth, full_sft_768_moe.pth"):
        find(tmp_path, "full_sft", 768, None)
    with pytest.raises(FileNotFoundError, match="no full_sft_640\\[_moe\\].pth"):
        find(tmp_path, "full_sft", 640, None)


# ---- the MoE layout ------------------------------------------------------------------------------

def test_minimind_moe_layout_loads_in_eval_with_top_k_one_by_default(moe):
    path, state = moe
    sizes = infer_sizes(state)
    assert (sizes["use_moe"], sizes["num_experts"], sizes["intermediate_size"]) == (1, 4, minimind_width(MOE_HIDDEN))
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER)
    args = eval_model.build_arg_parser().parse_args(
        ["--weight", "full_sft", "--save_dir", str(path.parent), "--device", "cpu"])
    model = eval_model.load_model(args, tokenizer, torch.device("cpu"))
    assert model.config.use_moe and model.config.num_experts == 4 and model.config.num_experts_per_tok == 1

    # The top-k is not in the file, so the library takes it from the flag; the expert count is checked.
    _, config = load_project_weights(path, {"num_experts_per_tok": 2})
    assert config.num_experts_per_tok == 2
    with pytest.raises(ValueError, match=r"num_experts: file has 4 \(model\.layers\.0\.mlp\.experts\.0 to \.3\), "
                                         r"--num_experts asks 8"):
        load_project_weights(path, {"num_experts": 8})


def test_export_cli_run_as_a_file_exports_the_moe_layout_for_transformers(moe, tmp_path):
    path, state = moe
    result = export_cli(path, tmp_path / "hf", as_file=True)
    assert result.returncode == 0, result.stderr
    assert "num_experts_per_tok=1" in result.stdout  # the CLI says which top-k it wrote, as no tensor tells
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["norm_topk_prob"] is True
    assert (config["num_experts"], config["num_experts_per_tok"]) == (4, 1)
    assert config["moe_intermediate_size"] == minimind_width(MOE_HIDDEN)
    assert_transformers_matches_ours(tmp_path / "hf", our_model(state), 6400)


# ---- the tokenizer for a real Chinese corpus ------------------------------------------------------

def chinese_corpus(path: Path) -> Path:
    """Sentences made of a few recurring words, as real text repeats its words."""
    words = ["我们", "一起", "学习", "中文", "今天", "天气", "很好", "北京", "是", "中国", "的", "首都"]
    generator = torch.Generator().manual_seed(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(300):
            picks = torch.randint(0, len(words), (6,), generator=generator).tolist()
            f.write(json.dumps({"text": "".join(words[i] for i in picks) + "。"}, ensure_ascii=False) + "\n")
    return path


def han_characters(text: str) -> int:
    """Chinese characters in `text` (the CJK Unified Ideographs block, which holds every one used here)."""
    return sum(1 for ch in text if "\u4e00" <= ch <= "\u9fff")


def test_tokenizer_merges_chinese_characters_into_words_only_when_asked(tmp_path):
    corpus = chinese_corpus(tmp_path / "zh.jsonl")
    sentence = "我们一起学习中文"
    for split, expect_merges in ((True, False), (False, True)):
        tokenizer = train_tokenizer([corpus], vocab_size=600, split_chinese_chars=split)
        pieces = [tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size())]
        multi_character = [piece for piece in pieces if han_characters(piece) >= 2]
        ids = tokenizer.encode(sentence).ids
        assert tokenizer.decode(ids) == sentence
        if expect_merges:
            assert "我们" in multi_character and len(ids) < len(sentence)
        else:
            assert multi_character == [] and len(ids) == len(sentence)


def test_default_tokenizer_training_reproduces_the_committed_tokenizer(tmp_path):
    out = tmp_path / "tokenizer.json"
    subprocess.run([sys.executable, str(REPO / "trainer" / "train_tokenizer.py"), "--out", str(out)],
                   cwd=tmp_path, check=True, capture_output=True)
    assert out.read_bytes() == (REPO / "model" / "tokenizer.json").read_bytes()

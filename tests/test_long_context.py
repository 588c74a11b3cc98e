"""Reading past the trained length (model/rope.py): the tables are transformers' own, the settings are read
from every place that holds them, and the flags work end to end. What the settings buy in loss is measured
by benchmarks/long_context.py (docs/long_context.md), not asserted here: on a model this small it is noise."""

import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # everything here is local

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen3Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

import eval_model  # noqa: E402
from conftest import REPO  # noqa: E402
from lora_files import tiny_config, write_base  # noqa: E402
from model.model import CausalLM, LMConfig  # noqa: E402
from model.rope import inverse_frequencies, rope_scaling_of_config  # noqa: E402

# (head_dim, rope_theta, trained length, factor): the demo's, minimind's default at 16x, a 10k-theta model
CASES = [(32, 1e6, 64, 2.0), (32, 1e6, 64, 4.0), (64, 1e6, 2048, 16.0), (128, 1e4, 4096, 2.5), (16, 1e6, 48, 8.0)]


@pytest.mark.parametrize("head_dim,theta,trained,factor", CASES)
@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_the_scaled_frequencies_and_attention_factor_are_transformers_own(head_dim, theta, trained, factor, kind):
    scaling = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = trained
    config = Qwen3Config(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
                         max_position_embeddings=math.ceil(trained * factor), rope_scaling=dict(scaling))
    theirs, their_attention = ROPE_INIT_FUNCTIONS[kind](config)
    ours, our_attention = inverse_frequencies(head_dim, theta, scaling)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert our_attention == pytest.approx(their_attention, rel=1e-12)
    if kind == "yarn":  # YaRN's 0.1 ln(s) + 1: 1.28 at 16x (minimind left it at 1.0)
        assert our_attention == pytest.approx(0.1 * math.log(factor) + 1)


def test_positions_past_the_trained_length_are_finite_and_the_kv_cache_reads_the_same_table():
    torch.manual_seed(0)
    plain = CausalLM(tiny_config(max_position_embeddings=512)).eval()
    ids = torch.randint(3, plain.config.vocab_size, (1, 256))
    for scaling in ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                    {"rope_type": "linear", "factor": 4.0}):
        scaled = CausalLM(LMConfig(**{**plain.config.to_dict(), "rope_scaling": scaling})).eval()
        scaled.load_state_dict(plain.state_dict())
        with torch.no_grad():
            logits = scaled(ids).logits
        assert torch.isfinite(logits).all()
        # KV-cache decoding reads the same table: the last position, computed one token at a time, agrees.
        with torch.no_grad():
            cached = scaled(ids[:, :248], use_cache=True)
            for t in range(248, 256):
                cached = scaled(ids[:, t:t + 1], past_key_values=cached.past_key_values, use_cache=True)
        torch.testing.assert_close(cached.logits[:, -1], logits[:, -1], rtol=1e-4, atol=1e-4)


def test_minimind_and_older_hf_spellings_of_the_setting_are_read():
    minimind = {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 2048,
                "attention_factor": 1.0, "type": "yarn"}  # MiniMindConfig's rope_scaling under inference_rope_scaling
    read = rope_scaling_of_config({"inference_rope_scaling": True, "rope_scaling": minimind}, "config.json")
    assert read == {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 2048,
                    "attention_factor": 1.0, "beta_fast": 32, "beta_slow": 1}
    assert inverse_frequencies(64, 1e6, read)[1] == 1.0  # its own attention factor is kept, as transformers keeps it
    assert rope_scaling_of_config({"inference_rope_scaling": False, "rope_scaling": minimind}, "config.json") is None
    assert rope_scaling_of_config({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "c") is None
    assert rope_scaling_of_config({"rope_scaling": {"type": "linear", "factor": 2.0}}, "c") == \
        {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match=r"^c: rope_scaling: rope_type 'dynamic' is not one this model computes"):
        rope_scaling_of_config({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "c")
    with pytest.raises(ValueError, match="factor 0.5 must be a number >= 1"):
        LMConfig(rope_scaling={"rope_type": "linear", "factor": 0.5})


def test_eval_model_scores_text_four_times_the_trained_length_under_yarn_and_says_what_is_missing(tmp_path, capsys):
    write_base(tmp_path, tiny_config(), name="pretrain")
    texts = (REPO / "dataset" / "val_demo.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:8]
    (tmp_path / "val.jsonl").write_text("".join(texts), encoding="utf-8")
    base = ["--weight", "pretrain", "--save_dir", str(tmp_path), "--device", "cpu",
            "--bpb_data", str(tmp_path / "val.jsonl"), "--max_seq_len", "64"]
    yarn = ["--rope_scaling", "yarn", "--rope_factor", "4"]
    assert eval_model.main(base + yarn) == 2  # no out/pretrain_32.json, no flag: the trained length is unknown
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --rope_scaling needs the length the model was trained at") and \
        "--original_max_position_embeddings N" in err
    (tmp_path / "pretrain_32.json").write_text('{"max_seq_len": 16}\n')
    assert eval_model.main(base + yarn) == 0
    captured = capsys.readouterr()
    assert "rope scaling: yarn x4, reads 64 tokens" in captured.err
    loss = float(captured.out.split("loss ")[1].split()[0])
    assert math.isfinite(loss) and loss > 0
    assert eval_model.main(base + ["--rope_factor", "4"]) == 2  # a factor without a setting is refused
    assert "read only with --rope_scaling" in capsys.readouterr().err

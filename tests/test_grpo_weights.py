"""What trainer/train_grpo.py writes, out/grpo_{hidden}.pth and out/grpo_{hidden}.json beside it, is taken unchanged
by eval_model.py, the OpenAI-compatible server, the Hugging Face export (loaded by transformers) and the GGUF export
(run by llama.cpp through node-llama-cpp): each answers greedily as our CausalLM does, loaded by hand from the file
(llama.cpp, which computes in FP16, may take our second token where our two best are a near tie).

The weights come from a real GRPO run of 3 steps at the TINY_MODEL size, made once for the module (a few seconds).
Its reference, out/full_sft_32.pth, is test_gguf's mild random model: matrices large enough that its greedy text is
neither one repeated token nor a near tie at every step (a freshly initialised model's logits are near-uniform, so
llama.cpp's FP16 arithmetic would pick another token there, and a misplaced tensor could go unseen).
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import gguf
import pytest
import torch

import eval_model
from conftest import train
from lora_files import tiny_config
from model.model import CausalLM
from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from test_dpo import TINY, write_jsonl
from test_eval_and_scripts import eval_args
from test_export_hf import load_hf
from test_gguf import NEW_TOKENS, PROMPTS, export, greedy, mild_random_model, save_pth, until_eos
from test_gguf import llama_cpp  # noqa: F401  (a fixture: node-llama-cpp's llama.cpp, or a skip naming the install)
from test_grpo import sum_questions
from test_grpo_runs import grpo_args

QUESTION = "20+21?"  # of the kind GRPO trained on (sum_questions), not one of its prompts
# llama.cpp computes with FP16 activations: at a step where our two best logits (which reach about 5 here) are
# closer than a few FP16 steps, it may pick our second. A wrong tensor puts its pick about 4 below our top.
FP16_TIE = 0.02


@pytest.fixture(scope="module")
def grpo_out(tmp_path_factory) -> Path:
    """The out/ folder of a 3-step GRPO run on 8 prompts: full_sft_32.pth (its reference), grpo_32.pth, grpo_32.json.
    The run must have moved every tensor off the reference, so what follows reads GRPO's output, not a copy."""
    root = tmp_path_factory.mktemp("grpo")
    vocab_size = load_tokenizer(DEFAULT_TOKENIZER).get_vocab_size()
    (root / "out").mkdir()
    save_pth(mild_random_model(vocab_size, **TINY, intermediate_size=None), root / "out" / "full_sft_32.pth")
    data = write_jsonl(root / "prompts.jsonl", sum_questions(8))
    # grpo_args writes a reference only where there is none: it keeps ours. At its 1e-3, three steps moved QUESTION's
    # greedy answer or not by the luck of the draw (model/rollout.py's streams: not); 3e-3 moves it.
    train("train_grpo.py", None, grpo_args(root, data, "--batch_size", "2", "--max_steps", "3", "--learning_rate",
                                           "3e-3"), root)
    out = root / "out"
    reference, trained = (torch.load(out / f"{name}_32.pth", weights_only=True) for name in ("full_sft", "grpo"))
    assert reference.keys() == trained.keys() and all(t.dtype == torch.float16 for t in trained.values())
    unchanged = [name for name in reference if torch.equal(reference[name], trained[name])]
    assert not unchanged, f"GRPO left these tensors as the reference had them: {unchanged}"
    assert json.loads((out / "grpo_32.json").read_text())["max_seq_len"] == 48  # TINY_MODEL's --max_seq_len
    return out


def load_ours(path: Path) -> CausalLM:
    """Our CausalLM at TINY_MODEL's sizes holding the FP16 file's tensors, in FP32 as eval_model.py on the CPU."""
    model = CausalLM(tiny_config()).eval()
    model.load_state_dict({name: t.float() for name, t in torch.load(path, weights_only=True).items()}, strict=True)
    return model


@pytest.fixture(scope="module")
def ours(grpo_out) -> CausalLM:
    return load_ours(grpo_out / "grpo_32.pth")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Token ids of QUESTION in the chat template (as eval_model.py and the server build it), then test_gguf's."""
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER)
    question = eval_model.chat_prompt_ids(tokenizer, [{"role": "user", "content": QUESTION}])
    return [question, *(tokenizer.encode(p).ids for p in PROMPTS)]


@pytest.fixture(scope="module")
def eval_answer(grpo_out) -> str:
    """What `python eval_model.py --weight grpo --prompt QUESTION` prints, with the run's --save_dir and size flags
    (its main, run in this process)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = eval_model.main(eval_args(grpo_out.parent, "grpo", "--prompt", QUESTION, "--max_new_tokens",
                                         str(NEW_TOKENS)))
    assert code == 0 and err.getvalue().startswith(f"loaded {grpo_out / 'grpo_32.pth'}: hidden 32, 2 layers"), \
        err.getvalue()
    return out.getvalue()


def test_the_grpo_weights_answer_in_eval_model_as_our_model_does(grpo_out, eval_answer, ours, prompts):
    ids = greedy(ours, prompts[:1])[0]
    assert len(set(ids)) >= 3, f"the test model degenerated: {ids}"
    assert greedy(load_ours(grpo_out / "full_sft_32.pth"), prompts[:1])[0] != ids  # the reference answers otherwise
    text = eval_model.chat_encoder(load_tokenizer(DEFAULT_TOKENIZER)).decode(ids)
    assert eval_answer == eval_model.answer_from_generation(text) + "\n" and eval_answer.strip()


def test_the_server_lists_the_grpo_model_and_its_whole_reply_is_eval_models_answer(grpo_out, eval_answer, ours,
                                                                                   prompts, monkeypatch):
    """The server's main, run here: its uvicorn.run replaced by a note of the app, which FastAPI's test client asks
    (as test_serve_openai_api.test_lora_serves_the_adapted_model_under_its_own_name does)."""
    from fastapi.testclient import TestClient

    import scripts.serve_openai_api as serve

    apps = []
    monkeypatch.setattr(serve.uvicorn, "run", lambda app, **_: apps.append(app))
    assert serve.main(["--weight", "grpo", "--save_dir", str(grpo_out), "--device", "cpu"]) == 0
    http = TestClient(apps[0], base_url="http://127.0.0.1:8998")  # a name the server answers to
    [listed] = http.get("/v1/models").json()["data"]
    assert listed["id"] == "grpo_32" and listed["trained_max_seq_len"] == 48  # read from out/grpo_32.json
    request = {"model": "grpo_32", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
               "max_tokens": NEW_TOKENS}
    reply = http.post("/v1/chat/completions", json=request).json()
    generated = len(greedy(ours, prompts[:1])[0])
    answer = eval_answer.removesuffix("\n")  # (print's)
    assert reply["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": answer},
                                   "finish_reason": "length" if generated == NEW_TOKENS else "stop"}
    assert reply["usage"] == {"prompt_tokens": len(prompts[0]), "completion_tokens": generated,
                              "total_tokens": len(prompts[0]) + generated}


def test_transformers_loads_the_hf_export_of_the_grpo_weights_with_our_logits_and_greedy_tokens(grpo_out, ours,
                                                                                                 prompts, tmp_path):
    from scripts.export_hf import main as export_main
    from transformers import AutoTokenizer

    assert export_main([str(grpo_out / "grpo_32.pth"), "-o", str(tmp_path / "hf")]) == 0  # FP16, as the file holds
    hf_model = load_hf(tmp_path / "hf")  # computed in FP32, as ours
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(3, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(ids).logits
        max_diff = (hf_model(ids).logits - expected).abs().max().item()
        moved = (load_ours(grpo_out / "full_sft_32.pth")(ids).logits - expected).abs().max().item()
    print(f"max |logits(ours) - logits(transformers)| = {max_diff:.3e}; GRPO moved the logits by up to {moved:.3e}")
    assert max_diff < 1e-4 and moved > 100 * 1e-4  # the tolerance tells GRPO's weights from the reference's

    chat = AutoTokenizer.from_pretrained(tmp_path / "hf").apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert chat["input_ids"] == prompts[0]  # a transformers user asks the question as eval_model.py does
    theirs = []
    for prompt in prompts:
        prompt_ids = torch.tensor([prompt])
        out = hf_model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=NEW_TOKENS,
                                do_sample=False)
        theirs.append(until_eos(out[0, len(prompt):].tolist()))
    assert theirs == greedy(ours, prompts)


def test_llama_cpp_runs_the_gguf_export_of_the_grpo_weights_greedy_as_we_do_at_the_trained_length(
        grpo_out, ours, prompts, tmp_path, llama_cpp):
    code, _, err = export(grpo_out / "grpo_32.pth", "--out", tmp_path / "grpo.gguf")
    assert code == 0, err
    assert gguf.GGUFReader(tmp_path / "grpo.gguf").fields["qwen3.context_length"].parts[-1][0] == 48  # grpo_32.json
    theirs = llama_cpp(tmp_path / "grpo.gguf", prompts=prompts)
    assert theirs["train_context"] == 48
    equal = sum(until_eos(a) == b for a, b in zip(theirs["generated"], greedy(ours, prompts)))
    below = [shortfalls(ours, p, g) for p, g in zip(prompts, theirs["generated"])]
    print(f"FP16 GGUF greedy equal on {equal}/{len(prompts)} prompts; llama.cpp's picks below our top logit by "
          f"{[max(b) for b in below]}")
    assert all(max(b) < FP16_TIE for b in below), below  # every pick ours, but at a near tie


def shortfalls(model: CausalLM, prompt: list[int], theirs: list[int]) -> list[float]:
    """At each of llama.cpp's greedy steps, given its own prefix: how far its pick is below our top logit (0: ours)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + theirs])).logits[0, len(prompt) - 1:-1]
    return (logits.max(-1).values - logits[torch.arange(len(theirs)), theirs]).tolist()

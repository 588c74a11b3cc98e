"""Compare llama.cpp (node-llama-cpp) with this project on one GGUF: token ids and greedy tokens.

    python tests/gguf/compare_llama_cpp.py out/x.pth tokenizer.json model.gguf --node_dir DIR
DIR holds node_modules/node-llama-cpp (npm install node-llama-cpp@3.21.1).
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from model.hf import load_project_weights  # noqa: E402
from model.model import CausalLM  # noqa: E402
from eval_model import generate_ids  # noqa: E402  (eval_model.py's greedy decoding, KV cache, stops at <|im_end|>)

TEXTS = ["Hello, world! It's 2024.", "The capital of France is Paris.", "  indented\n\nnew lines\ttab",
         "秘鲁的首都是哪里", "你好，世界！", "中文和English混合123", "東京は日本の首都です。", "I'm fine 😊 谢谢",
         "答案：\n\n你好", "a\n\n中", "Paris.\n\n巴黎是法国的首都。", "hello  你好"]
PROMPTS = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\n秘鲁的首都是哪里<|im_end|>\n<|im_start|>assistant\n", "Once upon a time"]


def greedy(model: CausalLM, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return generate_ids(model, ids, n, temperature=0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("weights", type=Path)
    parser.add_argument("tokenizer", type=Path)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--node_dir", type=Path, required=True)
    parser.add_argument("--n", type=int, default=8)
    args = parser.parse_args()

    tok = Tokenizer.from_file(str(args.tokenizer))
    state_dict, cfg = load_project_weights(args.weights, {})
    model = CausalLM(cfg)
    model.load_state_dict(state_dict)
    model.float().eval()
    ours_tokens = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
    prompts = [tok.encode(p).ids for p in PROMPTS]
    ours_gen = [greedy(model, p, args.n) for p in prompts]

    with tempfile.TemporaryDirectory() as tmp:
        cases = Path(tmp) / "cases.json"
        cases.write_text(json.dumps({"texts": TEXTS, "prompts": prompts, "n": args.n}))
        script = args.node_dir / "llama_cpp_check.mjs"
        shutil.copyfile(Path(__file__).with_name("llama_cpp_check.mjs"), script)
        run = subprocess.run(["node", str(script), str(args.gguf.resolve()), str(cases)],
                             capture_output=True, text=True, check=True)
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    same_tok = 0
    for text, a, b in zip(TEXTS, ours_tokens, theirs["tokens"]):
        same_tok += a == b
        print(f"{'SAME' if a == b else 'DIFF'} {text!r}\n  ours      {a}\n  llama.cpp {b}")
        if a != b:
            print(f"  ours      {[tok.id_to_token(i) for i in a]}\n  llama.cpp {[tok.id_to_token(i) for i in b]}")
    same_gen = 0
    for p, a, b in zip(PROMPTS, ours_gen, theirs["generated"]):
        b = b[:b.index(2)] if 2 in b else b  # eval_model.py stops before <|im_end|> (id 2)
        same_gen += a == b
        print(f"{'SAME' if a == b else 'DIFF'} greedy {p[-30:]!r}\n  ours      {a}\n  llama.cpp {b}")
    print(f"token ids equal on {same_tok}/{len(TEXTS)} texts; greedy tokens equal on {same_gen}/{len(PROMPTS)} prompts")


if __name__ == "__main__":
    main()

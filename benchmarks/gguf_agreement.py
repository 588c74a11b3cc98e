"""How closely llama.cpp answers like eval_model.py: a trained model's GGUF files, FP16 and Q8_0.

    npm ci --prefix tests/gguf --omit=optional           # llama.cpp for node, once
    python benchmarks/gguf_agreement.py out/full_sft_128.pth --data dataset/sft_demo_eval.jsonl

Each question of --data (its turns up to the last user message) is answered greedily, --new_tokens
tokens or up to <|im_end|>, by eval_model.py's generate_ids (FP32 over the file's FP16 weights) and
by llama.cpp (node-llama-cpp's prebuilt CPU build, tests/gguf/llama_cpp_check.mjs) on the GGUF files
scripts/export_gguf.py writes. Prints the files' sizes, how many answers are the same token for
token, and at how many of llama.cpp's steps our model, fed the same prefix, picks the same token.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eval_model import chat_prompt_ids, generate_ids  # noqa: E402
from model.weights import load_project_weights  # noqa: E402
from model.model import CausalLM  # noqa: E402
from model.tokenizer import EOS_ID, load_tokenizer  # noqa: E402


def llama_cpp_answers(gguf_path: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    cases = gguf_path.with_suffix(".cases.json")
    cases.write_text(json.dumps({"prompts": prompts, "n": new_tokens}))
    done = subprocess.run(["node", str(REPO / "tests/gguf/llama_cpp_check.mjs"), str(gguf_path), str(cases)],
                          capture_output=True, text=True, check=True)
    answers = json.loads(done.stdout.strip().splitlines()[-1])["generated"]
    return [ids[:ids.index(EOS_ID)] if EOS_ID in ids else ids for ids in answers]  # generate_ids stops there


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weights", type=Path, help="an out/*.pth file")
    parser.add_argument("--data", type=Path, default=REPO / "dataset/sft_demo_eval.jsonl")
    parser.add_argument("--new_tokens", type=int, default=16)
    args = parser.parse_args()

    tokenizer = load_tokenizer()
    state_dict, config = load_project_weights(args.weights, {})
    model = CausalLM(config)
    model.load_state_dict(state_dict)
    model.float().eval()
    prompts = []
    for line in args.data.read_text(encoding="utf-8").splitlines():
        turns = json.loads(line)["conversations"]
        last_user = max(i for i, turn in enumerate(turns) if turn["role"] == "user")
        prompts.append(chat_prompt_ids(tokenizer, turns[:last_user + 1]))
    with torch.no_grad():
        ours = [generate_ids(model, prompt, args.new_tokens, temperature=0.0) for prompt in prompts]

    with tempfile.TemporaryDirectory() as tmp:
        for qtype in ("f16", "q8_0"):
            path = Path(tmp) / f"model_{qtype}.gguf"
            subprocess.run([sys.executable, str(REPO / "scripts/export_gguf.py"), str(args.weights), "--out",
                            str(path), "--type", qtype], check=True, capture_output=True)
            theirs = llama_cpp_answers(path, prompts, args.new_tokens)
            same = sum(a == b for a, b in zip(ours, theirs))
            steps = agree = 0
            with torch.no_grad():
                for prompt, answer in zip(prompts, theirs):
                    if answer:
                        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
                        agree += sum(a == b for a, b in zip(logits.argmax(-1).tolist(), answer))
                        steps += len(answer)
            print(f"{qtype}: {path.stat().st_size:,} bytes; answers the same token for token: {same}/{len(prompts)}; "
                  f"our top token at llama.cpp's steps: {agree}/{steps}")


if __name__ == "__main__":
    main()

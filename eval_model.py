"""Talk to a trained model, or measure how often it gives exactly the expected answer.

The `out/*.pth` weights hold no config, so pass the size flags the model was trained with:

    # interactive chat (multi-turn; /reset clears the history, an empty line or Ctrl-D quits)
    python eval_model.py --weight full_sft --hidden_size 128 --num_hidden_layers 4
    # one answer
    python eval_model.py --weight full_sft --hidden_size 128 --num_hidden_layers 4 --prompt "What is 2+3?"
    # continue raw text with a pretrained (not chat-trained) model
    python eval_model.py --weight pretrain --hidden_size 128 --num_hidden_layers 4 --prompt "Once upon"
    # exact-match accuracy on held-out conversations (greedy decoding)
    python eval_model.py --weight full_sft --hidden_size 128 --num_hidden_layers 4 \\
        --eval dataset/sft_demo_eval.jsonl --verbose

The eval file uses the SFT format; the last message of each conversation must be the assistant's
reference answer. Everything before it is the prompt, rendered as ChatML exactly as in training.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, TextIO

import torch
from tokenizers import Tokenizer

from dataset.lm_dataset import BOS_ID, EOS_ID, format_chatml, load_tokenizer
from model.model import CausalLM
from scripts.inspect_checkpoint import infer_sizes, size_flags
from trainer.trainer_utils import lm_config_from_args, run_name

REPO_ROOT = Path(__file__).resolve().parent


# ---- loading --------------------------------------------------------------------------------

def load_model(args: argparse.Namespace, tokenizer: Tokenizer, device: torch.device) -> CausalLM:
    """Build the model from the size flags and load `{save_dir}/{weight}_{hidden}[_moe].pth` strictly."""
    lm_config = lm_config_from_args(args, tokenizer.get_vocab_size())
    path = Path(args.save_dir) / f"{run_name(args.weight, lm_config)}.pth"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: train that stage first, or check --weight, "
                                f"--hidden_size, --use_moe and --save_dir")
    weights = torch.load(path, map_location="cpu", weights_only=True)
    model = CausalLM(lm_config)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as error:
        # The file has no config of its own, so a wrong size flag is the usual cause: say which
        # sizes the tensors imply, and keep only the head of torch's (very long) key listing.
        raise RuntimeError(
            f"{path} does not fit the model built from the flags; pass the sizes it was trained with "
            f"and the tokenizer it was trained with (this one has {lm_config.vocab_size} tokens). "
            f"{_sizes_hint(weights)}\n" + "\n".join(line[:240] + (" ..." if len(line) > 240 else "")
                                         for line in str(error).splitlines()[:4])) from None
    # FP16 is what the file stores and halves GPU memory; the CPU computes in FP32 (FP16 there is slow).
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    return model.to(device=device, dtype=dtype).eval()


def _sizes_hint(weights: dict[str, torch.Tensor]) -> str:
    try:
        sizes = infer_sizes(weights)
    except (KeyError, IndexError):
        return "The file does not look like this project's layout."
    return f"The file's shapes say: {size_flags(sizes)} (vocab {sizes['vocab_size']})."


# ---- generation -----------------------------------------------------------------------------

def generate_text(model: CausalLM, tokenizer: Tokenizer, prompt_ids: list[int], max_new_tokens: int,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> str:
    """Decode what the model writes after `prompt_ids`, stopping at <|im_end|>."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    # eos must be passed explicitly: generate's default (None) never stops early.
    out = model.generate(ids, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                         eos_token_id=EOS_ID)
    new_ids = out[0, len(prompt_ids):].tolist()
    if EOS_ID in new_ids:
        new_ids = new_ids[:new_ids.index(EOS_ID)]
    return tokenizer.decode(new_ids, skip_special_tokens=True)


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """ChatML ids with an open assistant turn; the same ids SFTDataset builds for these messages."""
    return tokenizer.encode(format_chatml(messages, add_generation_prompt=True)).ids


def raw_prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """BOS + text, as PretrainDataset starts every sample: what a pretrained model knows how to continue."""
    return [BOS_ID] + tokenizer.encode(text).ids


# ---- exact-match evaluation -----------------------------------------------------------------

def answers_match(generated: str, reference: str) -> bool:
    """Exact match after stripping surrounding whitespace (the model may end with a newline)."""
    return generated.strip() == reference.strip()


def split_eval_record(record: dict) -> tuple[list[dict[str, str]], str]:
    """(prompt messages, reference answer) of one SFT-format eval record."""
    conversation = record.get("conversations")
    if not conversation or conversation[-1].get("role") != "assistant":
        raise ValueError("each eval record needs a 'conversations' list ending with the assistant's "
                         "reference answer")
    return conversation[:-1], conversation[-1]["content"]


def evaluate_exact_match(model: CausalLM, tokenizer: Tokenizer, records: list[dict], max_new_tokens: int = 64,
                         log: Callable[[str], None] | None = None) -> tuple[int, int]:
    """Greedy-answer every record; returns (correct, total). `log` receives one line per mistake."""
    correct = 0
    for n, record in enumerate(records, start=1):
        messages, reference = split_eval_record(record)
        answer = generate_text(model, tokenizer, chat_prompt_ids(tokenizer, messages), max_new_tokens)
        if answers_match(answer, reference):
            correct += 1
        elif log is not None:
            question = messages[-1]["content"] if messages else ""
            log(f"#{n}: {question!r} -> got {answer.strip()!r}, expected {reference.strip()!r}")
    return correct, len(records)


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_accuracy(correct: int, total: int) -> str:
    percent = 100.0 * correct / total if total else 0.0
    return f"exact-match accuracy: {correct}/{total} = {percent:.1f}%"


# ---- interactive loop -----------------------------------------------------------------------

def chat_loop(model: CausalLM, tokenizer: Tokenizer, args: argparse.Namespace, raw_text: bool,
              stdin: TextIO | None = None) -> None:
    """Read prompts from stdin until an empty line or EOF; chat mode keeps the conversation."""
    stdin = stdin if stdin is not None else sys.stdin
    history: list[dict[str, str]] = []
    mode = "text continuation" if raw_text else "chat"
    print(f"{mode} with {args.weight}: type a prompt; /reset clears the history; an empty line or Ctrl-D quits",
          flush=True)
    while True:
        print("> ", end="", flush=True)
        line = stdin.readline()
        prompt = line.strip()
        if not prompt:  # "" is EOF, "\n" an empty line: both end the session
            return
        if prompt == "/reset":
            history.clear()
            print("(history cleared)", flush=True)
            continue
        if raw_text:
            answer = generate_text(model, tokenizer, raw_prompt_ids(tokenizer, prompt), args.max_new_tokens,
                                   args.temperature, args.top_p, args.top_k)
            print(prompt + answer, flush=True)
            continue
        history.append({"role": "user", "content": prompt})
        answer = generate_text(model, tokenizer, chat_prompt_ids(tokenizer, history), args.max_new_tokens,
                               args.temperature, args.top_p, args.top_k)
        history.append({"role": "assistant", "content": answer})
        print(answer, flush=True)


# ---- command line ---------------------------------------------------------------------------

def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Chat with, or evaluate, a model saved in out/")
    a = p.add_argument
    a("--weight", default="full_sft", help="name prefix of the weights, e.g. pretrain or full_sft")
    a("--save_dir", default=str(REPO_ROOT / "out"))
    a("--tokenizer_path", default=str(REPO_ROOT / "model" / "tokenizer.json"))
    a("--hidden_size", type=int, default=512)
    a("--num_hidden_layers", type=int, default=8)
    a("--num_attention_heads", type=int, default=8)
    a("--num_key_value_heads", type=int, default=4)
    a("--use_moe", type=int, default=0, choices=(0, 1))
    a("--prompt", default=None, help="answer this once and exit")
    a("--eval", default=None, help="SFT-format JSONL: report exact-match accuracy of greedy answers")
    a("--verbose", action="store_true", help="with --eval: print every wrong answer")
    a("--temperature", type=float, default=0.0, help="0 = greedy")
    a("--top_p", type=float, default=1.0)
    a("--top_k", type=int, default=0, help="0 = no top-k cut")
    a("--max_new_tokens", type=int, default=64)
    a("--seed", type=int, default=42, help="for sampling when --temperature > 0")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.tokenizer_path)
    try:
        model = load_model(args, tokenizer, torch.device(args.device))
    except (FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    # A pretrained model has never seen ChatML, so it is asked to continue plain text instead.
    raw_text = args.weight == "pretrain"

    if args.eval:
        if raw_text:
            print("note: --weight pretrain was not trained on chat; expect a low exact-match score", flush=True)
        records = read_jsonl(args.eval)
        correct, total = evaluate_exact_match(model, tokenizer, records, args.max_new_tokens,
                                              log=print if args.verbose else None)
        print(format_accuracy(correct, total), flush=True)
    elif args.prompt is not None:
        if raw_text:
            ids = raw_prompt_ids(tokenizer, args.prompt)
        else:
            ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": args.prompt}])
        answer = generate_text(model, tokenizer, ids, args.max_new_tokens, args.temperature, args.top_p,
                               args.top_k)
        print(args.prompt + answer if raw_text else answer, flush=True)
    else:
        chat_loop(model, tokenizer, args, raw_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

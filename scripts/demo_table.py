"""The demo's before-and-after table: random weights, after pretraining, after SFT, on held-out data.

    python scripts/demo_table.py --hidden_size 128    # after scripts/run_demo.sh has trained both stages

Each row is one model, scored three ways (the numbers eval_model.py prints for each alone):
  val bits per byte  on dataset/val_demo.jsonl, text pretraining never saw (as --bpb_data with --max_seq_len
                     128, the demo's pretraining one, as its logged val/bpb; lower is better)
  multiple choice    on dataset/mc_demo.jsonl, the eval's questions with 4 choices each, by log-likelihood
                     (as --mc_data: acc, and acc centred on chance, 0 = guessing, 1 = all right)
  exact match        on dataset/sft_demo_eval.jsonl, greedy chat answers (as --eval)
The random weights are the ones pretraining starts from: drawn with the trainer's seed (--seed, 42 as in
trainer/train_pretrain.py) at the sizes of out/pretrain_*.pth. Only the SFT model was taught to answer in
the chat format, so exact match before SFT is expected near 0; the multiple choice reads plain
"Q: ... A:" text, which pretraining has seen, so it can show what pretraining learned.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from eval_choices import choice_loglikelihoods, read_choice_items, score_choices
from eval_model import add_model_flags, evaluate_exact_match, file_loss, load_model, read_jsonl
from model.model import CausalLM
from model.tokenizer import load_tokenizer
from trainer.trainer_utils import REPO_ROOT, setup_seed


def initial_model(like: CausalLM, seed: int) -> CausalLM:
    """A model of `like`'s sizes with the weights training starts from: the trainer seeds, then builds it."""
    setup_seed(seed)
    model = CausalLM(like.config)
    parameter = next(like.parameters())
    return model.to(device=parameter.device, dtype=parameter.dtype).eval()


def stage_scores(model: CausalLM, tokenizer: Tokenizer, args: argparse.Namespace) -> dict:
    """The three scores of one model: bits per byte, multiple-choice acc (and centred), exact match."""
    bpb = file_loss(model, tokenizer, args.val_data, args.max_seq_len).bpb
    items = read_choice_items(args.mc_data)
    lls = choice_loglikelihoods(model, lambda text: tokenizer.encode(text).ids, items,
                                model.config.max_position_embeddings, progress=False)
    choices = score_choices(items, lls)
    correct, total = evaluate_exact_match(model, tokenizer, read_jsonl(args.eval_data), args.max_new_tokens)
    return {"bpb": bpb, "mc_acc": choices["acc"], "mc_centred": choices["acc_centred"], "mc_items": len(items),
            "chance": choices["chance"], "correct": correct, "total": total}


def format_table(rows: list[tuple[str, dict]]) -> str:
    """A markdown table, one line per (name, stage_scores) row."""
    first = rows[0][1]
    lines = ["| weights | val bits per byte | multiple choice acc | centred on chance | exact match |",
             "|---|---|---|---|---|"]
    for name, s in rows:
        lines.append(f"| {name} | {s['bpb']:.3f} | {100 * s['mc_acc']:.1f} % | {s['mc_centred']:+.3f} | "
                     f"{s['correct']}/{s['total']} = {100 * s['correct'] / s['total']:.1f} % |")
    lines.append(f"\n(multiple choice: {first['mc_items']} items, chance {100 * first['chance']:.1f} %; "
                 f"exact match: {first['total']} held-out chat questions)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(p)  # --save_dir, --tokenizer_path, the size flags, --device (--weight is not read)
    data = REPO_ROOT / "dataset"
    p.add_argument("--val_data", default=str(data / "val_demo.jsonl"))
    p.add_argument("--mc_data", default=str(data / "mc_demo.jsonl"))
    p.add_argument("--eval_data", default=str(data / "sft_demo_eval.jsonl"))
    p.add_argument("--max_seq_len", type=int, default=128, help="for the bits per byte: the demo's pretraining one")
    # 16, not eval_model.py's 64: the demo's longest right answer, with its empty think block and end tag, is 8
    # tokens, and random or pretrained weights rarely stop early: 64 tokens a question cost them most of a minute.
    p.add_argument("--max_new_tokens", type=int, default=16, help="for the exact match (generated tokens at most)")
    p.add_argument("--seed", type=int, default=42, help="the trainer's --seed: it draws the random weights")
    args = p.parse_args(argv)

    tokenizer = load_tokenizer(args.tokenizer_path)
    device = torch.device(args.device)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 (stdout carries the table only)
    try:
        pretrained, sft = [load_model(argparse.Namespace(**{**vars(args), "weight": weight}), tokenizer, device, log)
                           for weight in ("pretrain", "full_sft")]
    except (FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}; run the demo's training stages first (bash scripts/run_demo.sh)", file=sys.stderr)
        return 2
    rows = []
    for name, model in (("random weights", initial_model(pretrained, args.seed)), ("after pretraining", pretrained),
                        ("after SFT", sft)):
        start = time.perf_counter()
        rows.append((name, stage_scores(model, tokenizer, args)))
        log(f"{name}: scored in {time.perf_counter() - start:.1f} s")
    print(format_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

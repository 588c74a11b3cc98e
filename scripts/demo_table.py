"""The demo's before-and-after table: random weights, pretrained, SFT, SFT + LoRA, DPO, GRPO, two students; tool use.

    python scripts/demo_table.py --hidden_size 128    # after scripts/run_demo.sh has trained its stages

Each row is one model, scored five ways (the numbers eval_model.py prints for each alone):
  val bits per byte  on dataset/val_demo.jsonl, text pretraining never saw (as --bpb_data with --max_seq_len
                     128, the demo's pretraining one, as its logged val/bpb; lower is better)
  multiple choice    on dataset/mc_demo.jsonl, the eval's questions with 4 choices each, by log-likelihood
                     (as --mc_data: acc, and acc centred on chance, 0 = guessing, 1 = all right)
  exact match        on dataset/sft_demo_eval.jsonl, greedy chat answers (as --eval)
  LoRA's domain      exact match on dataset/lora_demo_eval.jsonl: translating words, a task only LoRA's data
                     teaches, asked in a phrasing it never used (as --eval with --lora demo)
  prefers right      on dataset/dpo_demo_eval.jsonl: the share of held-out pairs (the eval's questions, the
                     right answer against a wrong one of the same kind) whose right answer the model finds
                     likelier (as --pairs_data)
The random weights are the ones pretraining starts from: drawn with the trainer's seed (--seed, 42 as in
trainer/train_pretrain.py) at the sizes of out/pretrain_*.pth. Only the SFT model was taught to answer in
the chat format, so exact match before SFT is expected near 0; the multiple choice reads plain
"Q: ... A:" text, which pretraining has seen, so it can show what pretraining learned.
The two students are half the SFT model's depth, from random weights, trained on SFT's data with its steps: by SFT
alone (out/student_sft_*.pth) and distilled from the SFT model's logits (out/student_distill_*.pth); with their runs'
steps and times below the table, the second's including the teacher's forward.
Below the table, what GRPO optimises, on the same held-out questions: how often an answer sampled as GRPO samples
them (temperature 1, --samples per question, the answer reward) is right, after SFT and after GRPO, and the
GRPO run's steps and time (out/grpo_*_status.json).
Last, a table of tool use (eval_tools.py's totals on dataset/tool_demo_eval.jsonl: questions offered a calculator and
a weather tool, in a phrasing tool SFT never used) for the SFT model, then for the SFT model taught to call them
(out/tool_sft_*.pth), then for that model after agentic GRPO (out/tool_grpo_*.pth), each with its run's steps and time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from tokenizers import Tokenizer

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from eval_choices import choice_loglikelihoods, read_choice_items, score_choices
from dataset.dpo_dataset import DPODataset
from dataset.grpo_dataset import GRPODataset, sample_groups
from dataset.rewards import reward_functions, score_groups
from eval_choices import pair_logprobs, score_pairs
from eval_model import add_model_flags, evaluate_exact_match, file_loss, load_model, read_jsonl
from eval_tools import read_items, score_model, totals
from model.model import CausalLM
from model.tokenizer import load_tokenizer
from trainer.trainer_utils import REPO_ROOT, setup_seed


STUDENT = {"num_hidden_layers": None}  # the students' depth is their files' (half the size flags')


def depth(model: CausalLM) -> str:
    layers = model.config.num_hidden_layers
    return f"{layers} layer{'s' * (layers != 1)}"


def initial_model(like: CausalLM, seed: int) -> CausalLM:
    """A model of `like`'s sizes with the weights training starts from: the trainer seeds, then builds it."""
    setup_seed(seed)
    model = CausalLM(like.config)
    parameter = next(like.parameters())
    return model.to(device=parameter.device, dtype=parameter.dtype).eval()


def stage_scores(model: CausalLM, tokenizer: Tokenizer, args: argparse.Namespace) -> dict:
    """The five scores of one model: bits per byte, multiple-choice acc (and centred), exact match on the
    SFT eval and on LoRA's, and the share of held-out pairs whose right answer it finds likelier."""
    bpb = file_loss(model, tokenizer, args.val_data, args.max_seq_len).bpb
    items = read_choice_items(args.mc_data)
    lls = choice_loglikelihoods(model, lambda text: tokenizer.encode(text).ids, items,
                                model.config.max_position_embeddings, progress=False)
    choices = score_choices(items, lls)
    correct, total = evaluate_exact_match(model, tokenizer, read_jsonl(args.eval_data), args.max_new_tokens)
    domain_correct, domain_total = evaluate_exact_match(model, tokenizer, read_jsonl(args.lora_eval_data),
                                                        args.max_new_tokens)
    pair_logps = pair_logprobs(model, DPODataset(args.pairs_data, tokenizer, 128))
    pairs = score_pairs(pair_logps, None)
    return {"bpb": bpb, "mc_acc": choices["acc"], "mc_centred": choices["acc_centred"], "mc_items": len(items),
            "chance": choices["chance"], "correct": correct, "total": total, "domain_correct": domain_correct,
            "domain_total": domain_total, "prefers": pairs["accuracy"], "pairs": pairs["pairs"], "pair_logps": pair_logps}


@torch.no_grad()
def sampled_right(model: CausalLM, tokenizer: Tokenizer, eval_data: str, samples: int, max_new_tokens: int,
                  seed: int, max_prompt_len: int = 128) -> float:
    """The share of answers sampled at temperature 1 (`samples` per question, drawn as GRPO draws a group, by seed
    and question) that the answer reward scores right: the reward GRPO raises, on questions it never trained on."""
    questions = GRPODataset(eval_data, tokenizer, max_prompt_len, reward_functions("answer"))  # (padded to it)
    right = 0.0
    for start in range(0, len(questions), 16):
        indices = list(range(start, min(start + 16, len(questions))))
        ids, labels = (torch.stack(column) for column in zip(*(questions[i] for i in indices)))
        _, _, texts = sample_groups(model, (torch.tensor(indices), ids, labels), questions.encoder, samples,
                                    max_new_tokens, 1.0, seed, nullcontext())
        scores, _ = score_groups(questions.rewards, texts, [questions.answer(i) for i in indices], samples)
        right += float(scores.sum())
    return right / (samples * len(questions))


def run_time(save_dir: str, run: str) -> str:
    """'N steps in T s' of the run whose weights the table scored (`run`: grpo_128), from its status file (this
    invocation's)."""
    status = json.loads((Path(save_dir) / f"{run}_status.json").read_text(encoding="utf-8"))
    steps = status["current_step"]
    return f"{steps} step{'s' * (steps != 1)} in {status['updated'] - status['started']:.0f} s"


def format_table(rows: list[tuple[str, dict]]) -> str:
    """A markdown table, one line per (name, stage_scores) row."""
    first = rows[0][1]
    lines = ["| weights | val bits per byte | multiple choice acc | centred on chance | exact match | LoRA's domain "
             "| prefers right |", "|---|---|---|---|---|---|---|"]
    for name, s in rows:
        lines.append(f"| {name} | {s['bpb']:.3f} | {100 * s['mc_acc']:.1f} % | {s['mc_centred']:+.3f} | "
                     f"{s['correct']}/{s['total']} = {100 * s['correct'] / s['total']:.1f} % | "
                     f"{s['domain_correct']}/{s['domain_total']} = {100 * s['domain_correct'] / s['domain_total']:.1f} % | "
                     f"{100 * s['prefers']:.1f} % |")
    lines.append(f"\n(multiple choice: {first['mc_items']} items, chance {100 * first['chance']:.1f} %; "
                 f"exact match: {first['total']} held-out chat questions; LoRA's domain: {first['domain_total']} "
                 f"translations in an unseen phrasing; prefers right: {first['pairs']} held-out pairs)")
    return "\n".join(lines)


def format_tool_table(rows: list[tuple[str, dict[str, str]]]) -> str:
    """A markdown table, one line per (name, eval_tools.totals) row."""
    names = list(rows[0][1])
    return "\n".join([f"| tool use | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
                     + [f"| {name} | {' | '.join(shares[n] for n in names)} |" for name, shares in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(p)  # --save_dir, --tokenizer_path, the size flags, --device (--weight is not read)
    data = REPO_ROOT / "dataset"
    p.add_argument("--val_data", default=str(data / "val_demo.jsonl"))
    p.add_argument("--mc_data", default=str(data / "mc_demo.jsonl"))
    p.add_argument("--eval_data", default=str(data / "sft_demo_eval.jsonl"))
    p.add_argument("--lora_eval_data", default=str(data / "lora_demo_eval.jsonl"))
    p.add_argument("--pairs_data", default=str(data / "dpo_demo_eval.jsonl"))
    p.add_argument("--tool_data", default=str(data / "tool_demo_eval.jsonl"), help="as eval_tools.py's --data")
    p.add_argument("--lora", default="demo", help="the adapter of the 'SFT + LoRA' row: out/lora_{NAME}_{hidden}.pth")
    p.add_argument("--max_seq_len", type=int, default=128, help="for the bits per byte: the demo's pretraining one")
    # 16, not eval_model.py's 64: the demo's longest right answer, with its empty think block and end tag, is 8
    # tokens, and random or pretrained weights rarely stop early: 64 tokens a question cost them most of a minute.
    p.add_argument("--max_new_tokens", type=int, default=16, help="for the exact match (generated tokens at most)")
    p.add_argument("--seed", type=int, default=42, help="the trainer's --seed: it draws the random weights")
    p.add_argument("--samples", type=int, default=8, help="answers sampled per question, for GRPO's line")
    args = p.parse_args(argv)

    tokenizer = load_tokenizer(args.tokenizer_path)
    device = torch.device(args.device)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 (stdout carries the table only)
    try:
        pretrained, sft, dpo, grpo, student_sft, student_distill, tool_sft, tool_grpo = [
            load_model(argparse.Namespace(**{**vars(args), "weight": weight, "lora": None, **layers}), tokenizer,
                       device, log)
            for weight, layers in (("pretrain", {}), ("full_sft", {}), ("dpo", {}), ("grpo", {}),
                                   ("student_sft", STUDENT), ("student_distill", STUDENT), ("tool_sft", {}),
                                   ("tool_grpo", {}))]
        hidden = grpo.config.hidden_size
        grpo_time, sft_time, distill_time, tool_sft_time, tool_grpo_time = (
            run_time(args.save_dir, f"{run}_{hidden}")
            for run in ("grpo", "student_sft", "student_distill", "tool_sft", "tool_grpo"))
        lora = load_model(argparse.Namespace(**{**vars(args), "weight": "full_sft"}), tokenizer, device, log)
    except (FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}; run the demo's training stages first (bash scripts/run_demo.sh)", file=sys.stderr)
        return 2
    rows = []
    for name, model in (("random weights", initial_model(pretrained, args.seed)), ("after pretraining", pretrained),
                        ("after SFT", sft), ("SFT + LoRA", lora), ("after DPO (from SFT)", dpo),
                        ("after GRPO (from SFT)", grpo),
                        (f"student, {depth(student_sft)}, SFT alone", student_sft),
                        (f"student, {depth(student_distill)}, distilled from SFT", student_distill)):
        start = time.perf_counter()
        rows.append((name, stage_scores(model, tokenizer, args)))
        log(f"{name}: scored in {time.perf_counter() - start:.1f} s")
    print(format_table(rows), flush=True)
    print(f"(the students: SFT alone {sft_time}, distilled {distill_time}, the teacher's forward included)", flush=True)
    # DPO moves each answer's log-probability away from the model it started from: its implicit reward. The share
    # of held-out pairs whose reward is higher for the right answer says whether it moved the right way (a model
    # that did not move: 0 %, every reward being 0; one that moved at random: about 50 %).
    moved = score_pairs(rows[4][1]["pair_logps"], rows[2][1]["pair_logps"])["reward_accuracy"]
    print(f"(after DPO: its implicit reward against the SFT model prefers the right answer on {100 * moved:.1f} % "
          f"of the held-out pairs)", flush=True)
    # GRPO raises the reward of answers sampled as it samples them; greedy exact match (the table) moves less.
    before, after = (sampled_right(model, tokenizer, args.eval_data, args.samples, args.max_new_tokens, args.seed)
                     for model in (sft, grpo))
    print(f"(after GRPO, {grpo_time}: answers sampled at temperature 1, {args.samples} per held-out question, are "
          f"right {100 * after:.1f} % of the time, against {100 * before:.1f} % after SFT)", flush=True)
    tool_items = read_items(args.tool_data)
    # The SFT model first: offered the tools' ~540 tokens it has never seen, what it scores without tool data.
    tool_rows = [("after SFT (no tool data)", sft), (f"after tool SFT (from SFT), {tool_sft_time}", tool_sft),
                 (f"after agentic GRPO (from tool SFT), {tool_grpo_time}", tool_grpo)]
    print("\n" + format_tool_table([(name, totals(score_model(model, tokenizer, tool_items)))
                                    for name, model in tool_rows]), flush=True)
    print(f"({len(tool_items)} held-out questions, offered both tools: {sum(bool(item['tool']) for item in tool_items)} "
          f"need a call, the others none)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generate the demo data of the stages after SFT, committed next to this file: LoRA and DPO.

    python dataset/make_stage_data.py            # same files as committed (seed 0)
    python dataset/make_stage_data.py --seed 1 --out_dir /tmp/demo

It builds on make_demo_data.py's closed world (scripts/run_demo.sh runs that first) and writes:

* lora_demo.jsonl ({"conversations"}, SFT format, as minimind's lora_*.jsonl files): a domain the SFT
  model never saw, French words for the numbers 0-12 and for eight colours, asked in English and Chinese
  ("What is seven in French?" -> "sept"; "七用法语怎么说？" -> "sept"). A tenth of the conversations
  also ask an old question, so that the adapter does not have to unlearn the chat it rests on.
* lora_demo_eval.jsonl (SFT format, last message the answer, "task"/"lang"/"held_out" as in
  sft_demo_eval.jsonl): every French word in the phrasing the training set never uses ("phrasing").
* dpo_demo.jsonl ({"chosen": [messages], "rejected": [messages]}, minimind's dpo.jsonl format): a
  question SFT may ask, its right answer as "chosen" and a wrong answer of the same kind as "rejected"
  (a capital for a capital, a digit for a digit).
* dpo_demo_eval.jsonl: the same kind of pair for each question of sft_demo_eval.jsonl (questions SFT
  never asked), for the share of held-out pairs where a model prefers the right answer.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from dataset.make_demo_data import (EN_NUMBERS, SYSTEM_PROMPTS, TASKS, ZH_NUMBERS, eval_items, same_kind_answers,
                                    sample_question, split_held_out, write_jsonl)

# 1. LoRA's new domain: French words, never in the pretraining or SFT data ----------------------

FR_NUMBERS = "zéro un deux trois quatre cinq six sept huit neuf dix onze douze".split()
# (English, 中文, French): the colours of make_demo_data.py's world
FR_COLOURS = [("red", "红色", "rouge"), ("blue", "蓝色", "bleu"), ("green", "绿色", "vert"),
              ("yellow", "黄色", "jaune"), ("white", "白色", "blanc"), ("black", "黑色", "noir"),
              ("orange", "橙色", "orange"), ("purple", "紫色", "violet")]


def french_words() -> list[tuple[str, str, str]]:
    """(English, 中文, French) for each word of the domain: 13 numbers and 8 colours."""
    return [(EN_NUMBERS[n], ZH_NUMBERS[n], FR_NUMBERS[n]) for n in range(13)] + FR_COLOURS


def ask_french(word: tuple[str, str, str], lang: str) -> tuple[list[str], str]:
    """The phrasings of "what is WORD in French?"; the last one is kept for the eval."""
    en, zh, fr = word
    if lang == "en":
        return [f"What is {en} in French?", f"How do you say {en} in French?", f"Say {en} in French."], fr
    return [f"{zh}用法语怎么说？", f"{zh}的法语是什么？", f"用法语说{zh}。"], fr


def lora_conversation(rng: random.Random, held_out: dict[str, set]) -> dict:
    """One or two French questions in one language, now and then after a system prompt or an old question."""
    lang = rng.choice(["en", "zh"])
    messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS[lang])})
    for _ in range(rng.choice([1, 1, 2])):
        questions, answer = ask_french(rng.choice(french_words()), lang)
        messages += [{"role": "user", "content": rng.choice(questions[:-1])},
                     {"role": "assistant", "content": answer}]
    if rng.random() < 0.1:  # an old question, so the chat the adapter rests on is not unlearned
        question, answer = sample_question(rng, lang, held_out)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"conversations": messages}


def lora_eval_items() -> list[dict]:
    """Every word of the domain in both languages, in the phrasing training never uses."""
    items = []
    for word in french_words():
        for lang in ("en", "zh"):
            questions, answer = ask_french(word, lang)
            items.append({"conversations": [{"role": "user", "content": questions[-1]},
                                            {"role": "assistant", "content": answer}],
                          "task": "french", "lang": lang, "held_out": "phrasing"})
    return items


# 2. DPO's pairs: the right answer preferred to a wrong one of the same kind ----------------------

def wrong_answer(rng: random.Random, task_name: str, question: str, answer: str, lang: str) -> str:
    task = next(t for t in TASKS if t.name == task_name)
    return rng.choice([a for a in same_kind_answers(task, question, lang) if a != answer])


def task_of(question: str, lang: str) -> str:
    """The task whose phrasings include `question`."""
    return next(task.name for task in TASKS for key in task.keys if question in task.ask(key, lang)[0])


def pair(prompt: list[dict], answer: str, wrong: str) -> dict:
    return {"chosen": prompt + [{"role": "assistant", "content": answer}],
            "rejected": prompt + [{"role": "assistant", "content": wrong}]}


def dpo_pair(rng: random.Random, held_out: dict[str, set]) -> dict:
    """A question SFT may ask (sometimes after a system prompt), right answer chosen, a wrong one rejected."""
    lang = rng.choice(["en", "zh"])
    prompt = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS[lang])}] if rng.random() < 0.2 else []
    question, answer = sample_question(rng, lang, held_out)
    prompt.append({"role": "user", "content": question})
    return pair(prompt, answer, wrong_answer(rng, task_of(question, lang), question, answer, lang))


def dpo_eval_pairs(rng: random.Random, evaluation: list[dict]) -> list[dict]:
    """sft_demo_eval.jsonl's questions (never asked in SFT or DPO), each as a pair."""
    pairs = []
    for record in evaluation:
        *prompt, reference = record["conversations"]
        question, answer = prompt[-1]["content"], reference["content"]
        wrong = wrong_answer(rng, record["task"], question, answer, record["lang"])
        pairs.append({**pair(prompt, answer, wrong), "task": record["task"], "lang": record["lang"]})
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out_dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--lora_lines", type=int, default=800)
    parser.add_argument("--dpo_lines", type=int, default=1200)
    parser.add_argument("--eval_phrasing_per_task", type=int, default=20, help="as make_demo_data.py's")
    args = parser.parse_args()

    # The same held-out split and eval as make_demo_data.py (same seeds): DPO never asks what the eval asks.
    held_out = split_held_out(random.Random(f"{args.seed}:split"))
    evaluation = eval_items(random.Random(f"{args.seed}:eval"), held_out, args.eval_phrasing_per_task)
    rng = random.Random(f"{args.seed}:lora")
    files = {"lora_demo.jsonl": [lora_conversation(rng, held_out) for _ in range(args.lora_lines)],
             "lora_demo_eval.jsonl": lora_eval_items()}
    rng = random.Random(f"{args.seed}:dpo")
    files["dpo_demo.jsonl"] = [dpo_pair(rng, held_out) for _ in range(args.dpo_lines)]
    files["dpo_demo_eval.jsonl"] = dpo_eval_pairs(random.Random(f"{args.seed}:dpo_eval"), evaluation)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, records in files.items():
        write_jsonl(args.out_dir / name, records)
        print(f"{name}: {len(records)} lines, {(args.out_dir / name).stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()

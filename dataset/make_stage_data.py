"""Generate the demo data of the stages after SFT, committed next to this file: LoRA, DPO and GRPO.

    python dataset/make_stage_data.py            # same files as committed (seed 0)
    python dataset/make_stage_data.py --seed 1 --out_dir /tmp/demo

It builds on make_demo_data.py's closed world (scripts/run_demo.sh runs that first) and writes:

* lora_demo.jsonl ({"conversations"}, SFT format, as minimind's lora_*.jsonl files): a task the SFT model
  was never taught, translating the world's words (countries, capitals, colours, animals) between English
  and Chinese ("What is Paris in Chinese?" -> "巴黎"; "狗用英语怎么说？" -> "dog"). The words are ones the
  model already writes: a domain of new words (French, say) needs new rows of the output layer, which LoRA
  leaves frozen, and a rank-8 adapter of this model did not learn one (loss 1.6 where full fine-tuning
  reached 0.007 on the same batch). A tenth of the conversations also ask an old question, so that the
  adapter does not have to unlearn the chat it rests on.
* lora_demo_eval.jsonl (SFT format, last message the answer, "task"/"lang"/"held_out" as in
  sft_demo_eval.jsonl): every word both ways, in the phrasing the training set never uses ("phrasing").
* dpo_demo.jsonl ({"chosen": [messages], "rejected": [messages]}, minimind's dpo.jsonl format): a
  question SFT may ask, its right answer as "chosen" and a wrong answer of the same kind as "rejected"
  (a capital for a capital, a digit for a digit).
* dpo_demo_eval.jsonl: the same kind of pair for each question of sft_demo_eval.jsonl (questions SFT
  never asked), for the share of held-out pairs where a model prefers the right answer.
* grpo_demo.jsonl (SFT format, the last assistant message the reference answer, as trainer/train_grpo.py reads
  it): every question SFT could ask, in the phrasing SFT never used (the eval's), about the items the eval does
  not ask about. The answer reward then scores the model on a phrasing it was never taught, and the eval
  (sft_demo_eval.jsonl) stays held out: its questions are the same phrasing about other items, or items no
  stage trains on.
* tool_sft_demo.jsonl (SFT format, both tools offered in the first system message's "tools", minimind's format):
  conversations of three questions, each a question a tool answers, asked in the phrasings the eval does not use,
  the assistant calling the tool, a "tool" message with what dataset/tools.py's function returns, and the answer
  from it, or a question of SFT's that needs no call, answered directly. Arithmetic on numbers too large to know by heart (the calculator, never one of the
  eval's), a capital's temperature (get_weather).
* tool_grpo_demo.jsonl (as grpo_demo.jsonl, with the tools in the system message): questions of the same kinds in the
  eval's phrasing, about what the eval does not ask (calculations neither tool SFT nor the eval asks, a temperature in
  the other language, grpo_demo.jsonl's questions), each with its final answer, for the agentic stage.
* tool_demo_eval.jsonl (eval_tools.py's format): questions offered dataset/tools.py's calculator and weather
  tools, in the phrasing kept for the eval: arithmetic on numbers too large to know by heart (the calculator),
  a capital's temperature (get_weather), and sft_demo_eval.jsonl's questions, which need no call.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from dataset.make_demo_data import (COLOURS, COUNTRIES, SOUNDS, SYSTEM_PROMPTS, TASKS, eval_items, same_kind_answers,
                                    sample_question, split_held_out, write_jsonl)
from dataset.tools import DEMO_TOOLS, calculator, get_weather, result_text  # the tools' own answers are the references

# 1. LoRA's new domain: translating words, which pretraining and SFT never asked -----------------

def dictionary_words() -> list[tuple[str, str]]:
    """(English, 中文) for each word of the domain: the world's countries, capitals, colours and animals."""
    animals = [(en.split(" ", 1)[1], zh) for en, zh, _, _ in SOUNDS]  # "a dog" -> "dog"
    colours = sorted({(en, zh) for _, _, en, zh in COLOURS})
    return ([(en, zh) for en, zh, _, _ in COUNTRIES] + [(cap, cap_zh) for _, _, cap, cap_zh in COUNTRIES]
            + colours + animals)


def ask_translation(word: tuple[str, str], lang: str) -> tuple[list[str], str]:
    """Asked in English: the Chinese word; asked in Chinese: the English one. The last phrasing is the eval's."""
    en, zh = word
    if lang == "en":
        return [f"What is {en} in Chinese?", f"How do you say {en} in Chinese?",
                f"What is the Chinese word for {en}?"], zh
    return [f"{zh}用英语怎么说？", f"{zh}的英语是什么？", f"{zh}在英语里怎么说？"], en


def lora_conversation(rng: random.Random, held_out: dict[str, set]) -> dict:
    """One or two words to translate, asked in one language, now and then after a system prompt or an old question."""
    lang = rng.choice(["en", "zh"])
    messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS[lang])})
    for _ in range(rng.choice([1, 1, 2])):
        questions, answer = ask_translation(rng.choice(dictionary_words()), lang)
        messages += [{"role": "user", "content": rng.choice(questions[:-1])},
                     {"role": "assistant", "content": answer}]
    if rng.random() < 0.1:  # an old question, so the chat the adapter rests on is not unlearned
        question, answer = sample_question(rng, lang, held_out)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"conversations": messages}


def lora_eval_items() -> list[dict]:
    """Every word of the domain in both languages, in the phrasing training never uses."""
    items = []
    for word in dictionary_words():
        for lang in ("en", "zh"):
            questions, answer = ask_translation(word, lang)
            items.append({"conversations": [{"role": "user", "content": questions[-1]},
                                            {"role": "assistant", "content": answer}],
                          "task": "translation", "lang": lang, "held_out": "phrasing"})
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


# 3. GRPO's prompts: the phrasing SFT never used, about the items the eval does not ask -------------

def grpo_prompts(rng: random.Random, held_out: dict[str, set], evaluation: list[dict]) -> list[dict]:
    """One prompt per (task, item, language) whose question in the eval's phrasing the eval does not ask, with
    its exact answer: the answer reward's reference. Shuffled."""
    asked = {record["conversations"][-2]["content"] for record in evaluation}
    prompts = []
    for task in TASKS:
        for key in task.keys:
            for lang in ("en", "zh"):
                questions, answer = task.ask(key, lang)
                if key not in held_out[task.name] and questions[-1] not in asked:
                    prompts.append({"conversations": [{"role": "user", "content": questions[-1]},
                                                      {"role": "assistant", "content": answer}]})
    rng.shuffle(prompts)
    return prompts


# 4. Tool use: SFT conversations that call a tool, GRPO's prompts, and the eval --------------------------

TOOL_NAMES = ["calculator", "get_weather"]  # dataset/tools.py's DEMO_TOOLS, offered to every question


# Tool SFT's phrasings are built from parts, an opener and a form (36-63 ways per kind and language), so that no single
# template is learnt by heart: with 4 fixed phrasings the model copied the question's numbers and city into the call
# on those phrasings only, not on the eval's. The eval keeps its own phrasing (the last), which no combination makes.
EN_OPENERS = ["", "Please, ", "Hi! ", "Quick question: ", "Can you help? ", "One more: "]
ZH_OPENERS = ["", "请问", "你好，", "帮我", "请帮我"]  # characters the committed tokenizer keeps whole


def composed(openers: list[str], forms: list[str], held_out: str) -> list[str]:
    """Each opener before each form (the form's first letter a capital where it starts the sentence), then the eval's
    `held_out` phrasing last."""
    return [opener + (form if opener.endswith(",") or opener.endswith(", ") else form[0].upper() + form[1:])
            for opener in openers for form in forms] + [held_out]


def ask_arithmetic(a: int, op: str, b: int, lang: str) -> list[str]:
    """Phrasings of `a op b`; the last is the eval's."""
    if lang == "en":
        e = f"{a} {op} {b}"
        return composed(EN_OPENERS, [f"calculate {e}.", f"work out {e}.", f"how much is {e}?", f"{e} = ?",
                                     f"compute {e}.", f"what do you get for {e}?", f"find {e}.", f"evaluate {e}.",
                                     f"what's {e}?", f"give me {e}."], f"What is {e}?")
    e = f"{a}{op}{b}"
    return composed(ZH_OPENERS, [f"计算{e}。", f"算一下{e}。", f"{e}是多少？", f"{e}等于几？", f"算算{e}。",
                                 f"{e}=？", f"{e}的数是多少？"], f"{e}等于多少？")


def ask_temperature(city: str, city_zh: str, lang: str) -> list[str]:
    """Phrasings of a city's temperature; the last is the eval's. The tool takes the English name. (No 气温:
    the committed tokenizer splits 温 into bytes, tests/test_tokenizer.py.)"""
    if lang == "en":
        c = city
        return composed(EN_OPENERS, [f"what is the temperature in {c}?", f"how warm is it in {c}?",
                                     f"how hot is it in {c}?", f"tell me the temperature in {c}.",
                                     f"how cold is it in {c}?", f"what's the weather like in {c}?",
                                     f"is it hot in {c} today?", f"the temperature in {c}, please.",
                                     f"check the weather in {c}."], f"How many degrees is it in {c} now?")
    c = city_zh
    return composed(ZH_OPENERS, [f"{c}有几度？", f"{c}天气几度？", f"{c}热不热？", f"{c}冷不冷？", f"{c}天气热不热？",
                                 f"{c}有多热？", f"{c}的天气几度？"], f"{c}是多少度？")


def arithmetic(rng: random.Random) -> tuple[int, str, int]:
    """Numbers too large to know by heart: a three-digit one and a two-digit one, in either order (the eval asks the
    first with up to three digits, the second with two), so the call copies digits, not a length it learnt."""
    a, b = rng.randint(12, 999), rng.randint(12, 99)
    return (a, rng.choice("+-*"), b) if rng.random() < 0.5 else (b, rng.choice("+-*"), a)


def new_arithmetic(rng: random.Random, taken: set) -> tuple[int, str, int]:
    """arithmetic(rng), drawn again while it is one in `taken` ("a op b"), then added to it."""
    a, op, b = arithmetic(rng)
    while f"{a} {op} {b}" in taken:
        a, op, b = arithmetic(rng)
    taken.add(f"{a} {op} {b}")
    return a, op, b


KINDS = ["calculator"] * 2 + ["weather"] * 2 + ["no_tool"]  # a tool question's kind, drawn from these: 2, 2 and 1 in 5


def calculation(a: int, op: str, b: int, lang: str = "en") -> tuple[dict, str]:
    """The calculator's arguments for `a op b`, written as a question in `lang` writes it (a span to copy is easier to
    learn than a rewriting), and the final answer: its result."""
    expression = f"{a} {op} {b}" if lang == "en" else f"{a}{op}{b}"
    return {"expression": expression}, str(calculator(expression)["result"])


def weather(city: str) -> tuple[dict, str]:
    """get_weather's arguments for `city`, and the final answer: its temperature."""
    return {"city": city}, f"{get_weather(city)['temperature_c']}°C"


def tool_conversation(question: str, answer: str, tool: str | None = None, arguments: dict | None = None) -> dict:
    """Both tools offered (minimind's format: the first system message's "tools"); where `tool` is given, the
    assistant calls it, a tool message holds what the function returns, and the assistant answers from it."""
    messages = [{"role": "system", "content": "", "tools": [DEMO_TOOLS[name].spec for name in TOOL_NAMES]},
                {"role": "user", "content": question}]
    if tool is not None:
        messages += [{"role": "assistant", "content": "", "tool_calls": [{"name": tool, "arguments": arguments}]},
                     {"role": "tool", "content": result_text(DEMO_TOOLS[tool].function(**arguments))}]
    return {"conversations": messages + [{"role": "assistant", "content": answer}]}


def tool_question(rng: random.Random, held_out: dict[str, set], taken: set, phrasing: slice) -> dict:
    """One conversation of tool_conversation: a calculation (2 in 5; never one in `taken`, to which it is added),
    a temperature (2 in 5) or a question of SFT's that needs no tool (1 in 5), asked in one of the phrasings
    `phrasing` picks (the eval keeps the last)."""
    lang, kind = rng.choice(["en", "zh"]), rng.choice(KINDS)
    if kind == "calculator":
        a, op, b = new_arithmetic(rng, taken)
        arguments, answer = calculation(a, op, b, lang)
        return tool_conversation(rng.choice(ask_arithmetic(a, op, b, lang)[phrasing]), answer, "calculator", arguments)
    if kind == "weather":
        _, _, city, city_zh = rng.choice(COUNTRIES)
        arguments, answer = weather(city)
        return tool_conversation(rng.choice(ask_temperature(city, city_zh, lang)[phrasing]), answer, "get_weather",
                                 arguments)
    question, answer = sample_question(rng, lang, held_out)  # SFT's phrasings and items
    return tool_conversation(question, answer)


def tool_conversations(rng: random.Random, held_out: dict[str, set], taken: set, questions: int = 3) -> dict:
    """`questions` of tool_question one after another under one system turn. The tools' offer is some 540 tokens;
    each question with its call, result and answer some 100 more: three in a sequence teach three times the copying
    (the question's numbers or city into the call, the tool's result into the answer) for 1.4 times the tokens."""
    first, *more = [tool_question(rng, held_out, taken, slice(-1))["conversations"] for _ in range(questions)]
    return {"conversations": first + [message for conversation in more for message in conversation[1:]]}


def tool_grpo_prompts(rng: random.Random, count: int, taken: set, tool_eval: list[dict], grpo: list[dict]) -> list[dict]:
    """`count` prompts for agentic GRPO, each the system turn with both tools, a question and its final answer (the
    answer reward's reference; the stage makes the calls itself). As grpo_prompts: the eval's phrasing, about what the
    eval does not ask. A calculation (2 in 5) neither tool SFT nor the eval asks (`taken`, to which it is added); a
    capital's temperature (2 in 5) in the language the eval does not ask it in; one of `grpo`'s questions (1 in 5)."""
    asked = {(record["arguments"]["city"], record["lang"]) for record in tool_eval if record["tool"] == "get_weather"}
    cities = [(city, city_zh, lang) for _, _, city, city_zh in COUNTRIES for lang in ("en", "zh")
              if (city, lang) not in asked]
    prompts = []
    for _ in range(count):
        lang, kind = rng.choice(["en", "zh"]), rng.choice(KINDS)  # lang: a calculation's (drawn for each kind)
        if kind == "calculator":
            a, op, b = new_arithmetic(rng, taken)
            question, answer = ask_arithmetic(a, op, b, lang)[-1], calculation(a, op, b, lang)[1]
        elif kind == "weather":
            city, city_zh, lang = rng.choice(cities)
            question, answer = ask_temperature(city, city_zh, lang)[-1], weather(city)[1]
        else:
            question, answer = (message["content"] for message in rng.choice(grpo)["conversations"])
        prompts.append(tool_conversation(question, answer))
    return prompts


def tool_eval_items(rng: random.Random, evaluation: list[dict], per_kind: int = 16) -> list[dict]:
    """`per_kind` items each: arithmetic for the calculator, a temperature for get_weather, and an eval question
    that needs no call; each with the call it needs (or null) and the final answer."""
    items = []
    for n in range(per_kind):
        lang = ("en", "zh")[n % 2]
        a, b, op = rng.randint(12, 999), rng.randint(12, 99), rng.choice("+-*")
        arguments, answer = calculation(a, op, b)
        items.append({"conversations": [{"role": "user", "content": ask_arithmetic(a, op, b, lang)[-1]}],
                      "tools": TOOL_NAMES, "tool": "calculator", "arguments": arguments,
                      "answer": answer, "task": "calculator", "lang": lang})
    for n, (_, _, city, city_zh) in enumerate(rng.sample(COUNTRIES, per_kind)):
        lang = ("en", "zh")[n % 2]
        arguments, answer = weather(city)
        items.append({"conversations": [{"role": "user", "content": ask_temperature(city, city_zh, lang)[-1]}],
                      "tools": TOOL_NAMES, "tool": "get_weather", "arguments": arguments,
                      "answer": answer, "task": "weather", "lang": lang})
    for record in rng.sample(evaluation, per_kind):
        *prompt, reference = record["conversations"]
        items.append({"conversations": prompt, "tools": TOOL_NAMES, "tool": None, "arguments": None,
                      "answer": reference["content"], "task": "no_tool", "lang": record["lang"]})
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out_dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--lora_lines", type=int, default=800)
    parser.add_argument("--dpo_lines", type=int, default=1200)
    parser.add_argument("--tool_lines", type=int, default=2000)
    parser.add_argument("--tool_prompts", type=int, default=128)
    parser.add_argument("--eval_phrasing_per_task", type=int, default=20, help="as make_demo_data.py's")
    args = parser.parse_args()

    # The same held-out split and eval as make_demo_data.py (same seeds): DPO and GRPO never ask what the eval asks.
    held_out = split_held_out(random.Random(f"{args.seed}:split"))
    evaluation = eval_items(random.Random(f"{args.seed}:eval"), held_out, args.eval_phrasing_per_task)
    rng = random.Random(f"{args.seed}:lora")
    files = {"lora_demo.jsonl": [lora_conversation(rng, held_out) for _ in range(args.lora_lines)],
             "lora_demo_eval.jsonl": lora_eval_items()}
    rng = random.Random(f"{args.seed}:dpo")
    files["dpo_demo.jsonl"] = [dpo_pair(rng, held_out) for _ in range(args.dpo_lines)]
    files["dpo_demo_eval.jsonl"] = dpo_eval_pairs(random.Random(f"{args.seed}:dpo_eval"), evaluation)
    files["grpo_demo.jsonl"] = grpo_prompts(random.Random(f"{args.seed}:grpo"), held_out, evaluation)
    files["tool_demo_eval.jsonl"] = tool_eval_items(random.Random(f"{args.seed}:tools"), evaluation)
    # SFT's and GRPO's calculations are never the eval's nor each other's; the eval keeps its phrasing (the last)
    taken = {record["arguments"]["expression"] for record in files["tool_demo_eval.jsonl"]
             if record["tool"] == "calculator"}
    rng = random.Random(f"{args.seed}:tool_sft")
    files["tool_sft_demo.jsonl"] = [tool_conversations(rng, held_out, taken) for _ in range(args.tool_lines)]
    files["tool_grpo_demo.jsonl"] = tool_grpo_prompts(random.Random(f"{args.seed}:tool_grpo"), args.tool_prompts, taken,
                                                      files["tool_demo_eval.jsonl"], files["grpo_demo.jsonl"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, records in files.items():
        write_jsonl(args.out_dir / name, records)
        print(f"{name}: {len(records)} lines, {(args.out_dir / name).stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()

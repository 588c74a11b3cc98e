"""Generate the small bilingual demo data that is committed next to this file.

    python dataset/make_demo_data.py            # same files as committed (seed 0)
    python dataset/make_demo_data.py --seed 1 --out_dir /tmp/demo

Writes pretrain_demo.jsonl ({"text"}), val_demo.jsonl (held-out pretrain-style text),
sft_demo.jsonl ({"conversations"}), sft_demo_eval.jsonl (SFT format; the last message
is the reference answer, plus "task", "lang" and "held_out" fields for reports) and
mc_demo.jsonl (the eval's questions as multiple choice: {"question", "choices", "answer"}).

The data describes a small closed world, in English and Chinese, so that a tiny model
trained for a few minutes on a CPU can visibly learn it:

* facts: capitals of 16 countries, colours of 16 things, sounds of 12 animals,
  16 pairs of opposites, number words 0-10 (English, Chinese, digits);
* arithmetic: sums of two numbers from 0 to 6, the number after n (0-39).

The world is kept small on purpose: a model of a million parameters trained for a few
hundred steps must see each fact many times to remember it.

Pretraining text states every fact in several sentence templates, including FAQ-style
"Q: ... A: ..." lines and "User: ... Assistant: ..." transcripts. SFT teaches the chat
format with short exact answers. The eval file asks only questions SFT never asked
(field "held_out"):

* "phrasing": a fact SFT asked about, worded in a way SFT never used (the last phrasing
  of each question; pretraining text uses it);
* "item": one of 12 sums SFT never asked about (pretraining text states it).

Why the eval looks like this: with hidden 128, 4 layers, one pretraining epoch (~310
steps of 32 x 128 tokens) and two SFT epochs (~250 steps), one run answered about 80% of
the eval exactly (81% of "phrasing", 71% of "item"); guessing an answer of the right
kind would score about 6%. We also tried holding out whole entities (a country only ever
mentioned in pretraining): the pretrained model completed "Q: ... A:" for them, but after
SFT the chat model almost never answered them correctly at this size, so such questions
are not in the eval.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# 1. The closed world --------------------------------------------------------------------

# (country, 国家, capital, 首都)
COUNTRIES = [
    ("France", "法国", "Paris", "巴黎"), ("Germany", "德国", "Berlin", "柏林"),
    ("Italy", "意大利", "Rome", "罗马"), ("Spain", "西班牙", "Madrid", "马德里"),
    ("Japan", "日本", "Tokyo", "东京"), ("China", "中国", "Beijing", "北京"),
    ("Russia", "俄罗斯", "Moscow", "莫斯科"), ("Egypt", "埃及", "Cairo", "开罗"),
    ("Canada", "加拿大", "Ottawa", "渥太华"), ("Brazil", "巴西", "Brasilia", "巴西利亚"),
    ("India", "印度", "New Delhi", "新德里"), ("Thailand", "泰国", "Bangkok", "曼谷"),
    ("Korea", "韩国", "Seoul", "首尔"), ("Greece", "希腊", "Athens", "雅典"),
    ("Peru", "秘鲁", "Lima", "利马"), ("Kenya", "肯尼亚", "Nairobi", "内罗毕"),
]

# (thing with article, 物品, colour, 颜色): eight colours, two things each
COLOURS = [
    ("a banana", "香蕉", "yellow", "黄色"), ("a lemon", "柠檬", "yellow", "黄色"),
    ("an apple", "苹果", "red", "红色"), ("a strawberry", "草莓", "red", "红色"),
    ("a grape", "葡萄", "purple", "紫色"), ("an eggplant", "茄子", "purple", "紫色"),
    ("an orange", "橙子", "orange", "橙色"), ("a carrot", "胡萝卜", "orange", "橙色"),
    ("grass", "小草", "green", "绿色"), ("a leaf", "树叶", "green", "绿色"),
    ("snow", "雪", "white", "白色"), ("milk", "牛奶", "white", "白色"),
    ("coal", "煤", "black", "黑色"), ("a crow", "乌鸦", "black", "黑色"),
    ("the sky", "天空", "blue", "蓝色"), ("the sea", "大海", "blue", "蓝色"),
]

# (animal with article, 动物, sound, 叫声)
SOUNDS = [
    ("a dog", "狗", "woof", "汪汪"), ("a cat", "猫", "meow", "喵喵"),
    ("a cow", "牛", "moo", "哞哞"), ("a duck", "鸭子", "quack", "嘎嘎"),
    ("a sheep", "羊", "baa", "咩咩"), ("a pig", "猪", "oink", "哼哼"),
    ("a frog", "青蛙", "croak", "呱呱"), ("a bird", "小鸟", "tweet", "叽叽"),
    ("a mouse", "老鼠", "squeak", "吱吱"), ("a bee", "蜜蜂", "buzz", "嗡嗡"),
    ("a horse", "马", "neigh", "咴咴"), ("a lion", "狮子", "roar", "吼吼"),
]

# (word, opposite, 词, 反义词); every word occurs once, so each question has one answer.
OPPOSITES = [
    ("big", "small", "大", "小"), ("hot", "cold", "热", "冷"), ("up", "down", "上", "下"),
    ("left", "right", "左", "右"), ("fast", "slow", "快", "慢"), ("long", "short", "长", "短"),
    ("happy", "sad", "高兴", "难过"), ("old", "new", "旧", "新"), ("open", "closed", "开", "关"),
    ("day", "night", "白天", "黑夜"), ("heavy", "light", "重", "轻"), ("full", "empty", "满", "空"),
    ("hard", "soft", "硬", "软"), ("wet", "dry", "湿", "干"), ("near", "far", "近", "远"),
    ("good", "bad", "好", "坏"),
]

EN_NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()
ZH_NUMBERS = "零 一 二 三 四 五 六 七 八 九 十 十一 十二".split()

# 2. Tasks: questions with one exact answer, and sentences that state the same facts ------


@dataclass
class Task:
    """A family of questions.

    ``keys`` are the items (a country, a pair of digits, ...); ``ask(key, lang)`` gives
    the question phrasings and the exact answer; ``state(key, lang)`` gives sentences for
    pretraining; ``n_held_out`` keys are never asked about in SFT, only in the eval.
    ``weight`` is how often the task comes up relative to the others: tasks with more
    facts to remember (49 sums against 16 capitals) need to come up more often.
    """

    name: str
    keys: list
    ask: Callable[[object, str], tuple[list[str], str]]
    state: Callable[[object, str], list[str]]
    n_held_out: int = 0
    weight: float = 1.0


def ask_capital(i: int, lang: str) -> tuple[list[str], str]:
    en, zh, cap, cap_zh = COUNTRIES[i]
    if lang == "en":
        return [f"What is the capital of {en}?", f"Which city is the capital of {en}?",
                f"Name the capital of {en}."], cap
    return [f"{zh}的首都是哪里？", f"{zh}的首都是哪个城市？", f"请说出{zh}的首都。"], cap_zh


def state_capital(i: int, lang: str) -> list[str]:
    en, zh, cap, cap_zh = COUNTRIES[i]
    if lang == "en":
        return [f"The capital of {en} is {cap}.", f"{cap} is the capital of {en}.",
                f"The capital city of {en} is {cap}.", f"{en} has its capital in {cap}.",
                f"If you visit {en}, go and see {cap}, the capital.",
                f"{cap} is a big city in {en}, and it is the capital."]
    return [f"{zh}的首都是{cap_zh}。", f"{cap_zh}是{zh}的首都。", f"{zh}的首都叫{cap_zh}。",
            f"去{zh}旅行，可以去首都{cap_zh}看看。", f"{cap_zh}是一座城市，它是{zh}的首都。"]


def ask_colour(i: int, lang: str) -> tuple[list[str], str]:
    en, zh, colour, colour_zh = COLOURS[i]
    if lang == "en":
        return [f"What colour is {en}?", f"What is the colour of {en}?",
                f"Tell me the colour of {en}."], colour
    return [f"{zh}是什么颜色的？", f"{zh}是什么颜色？", f"{zh}的颜色是什么？"], colour_zh


def state_colour(i: int, lang: str) -> list[str]:
    en, zh, colour, colour_zh = COLOURS[i]
    cap_en = en[0].upper() + en[1:]
    if lang == "en":
        return [f"{cap_en} is {colour}.", f"The colour of {en} is {colour}.",
                f"Look at {en}: it is {colour}.", f"{cap_en} has a {colour} colour."]
    return [f"{zh}是{colour_zh}的。", f"{zh}的颜色是{colour_zh}。", f"你看，{zh}是{colour_zh}的。"]


def ask_sound(i: int, lang: str) -> tuple[list[str], str]:
    en, zh, sound, sound_zh = SOUNDS[i]
    if lang == "en":
        return [f"What sound does {en} make?", f"What does {en} say?",
                f"How does {en} sound?"], sound
    return [f"{zh}是怎么叫的？", f"{zh}的叫声是什么？", f"{zh}怎么叫？"], sound_zh


def state_sound(i: int, lang: str) -> list[str]:
    en, zh, sound, sound_zh = SOUNDS[i]
    cap_en = en[0].upper() + en[1:]
    if lang == "en":
        return [f"{cap_en} says {sound}.", f"The sound of {en} is {sound}.",
                f"{cap_en} makes the sound {sound}.", f"Listen! {cap_en} goes {sound}, {sound}."]
    return [f"{zh}的叫声是{sound_zh}。", f"{zh}{sound_zh}地叫。", f"听，{zh}在叫：{sound_zh}，{sound_zh}。"]


def ask_opposite(key: tuple[int, int], lang: str) -> tuple[list[str], str]:
    i, direction = key
    words = OPPOSITES[i]
    en, en_opposite = (words[0], words[1]) if direction == 0 else (words[1], words[0])
    zh, zh_opposite = (words[2], words[3]) if direction == 0 else (words[3], words[2])
    if lang == "en":
        return [f"What is the opposite of {en}?", f"Give the opposite of {en}.",
                f"What word means the opposite of {en}?"], en_opposite
    return [f"{zh}的反义词是什么？", f"请说出{zh}的反义词。", f"和{zh}意思相反的词是什么？"], zh_opposite


def state_opposite(key: tuple[int, int], lang: str) -> list[str]:
    i, direction = key
    a, b, a_zh, b_zh = OPPOSITES[i]
    if direction == 1:
        a, b, a_zh, b_zh = b, a, b_zh, a_zh
    if lang == "en":
        return [f"The opposite of {a} is {b}.", f"{a.capitalize()} and {b} are opposites.",
                f"{b.capitalize()} is the opposite of {a}."]
    return [f"{a_zh}的反义词是{b_zh}。", f"{a_zh}和{b_zh}是一对反义词。", f"{b_zh}是{a_zh}的反义词。"]


NUMBER_WORD_KINDS = ["digit_to_en", "en_to_digit", "digit_to_zh", "zh_to_digit", "en_to_zh", "zh_to_en"]


def ask_number_word(key: tuple[int, str], lang: str) -> tuple[list[str], str]:
    n, kind = key
    en, zh = EN_NUMBERS[n], ZH_NUMBERS[n]
    questions = {
        "digit_to_en": ([f"How do you write {n} in English words?", f"What is {n} in English words?"],
                        [f"{n}用英文单词怎么写？", f"{n}的英文单词是什么？"], en),
        "en_to_digit": ([f"Write {en} as a number.", f"Which number is {en}?"],
                        [f"英文{en}是数字几？", f"把{en}写成数字。"], str(n)),
        "digit_to_zh": ([f"How do you write {n} in Chinese?", f"What is {n} in Chinese characters?"],
                        [f"{n}用汉字怎么写？", f"把{n}写成汉字。"], zh),
        "zh_to_digit": ([f"Which number is {zh}?", f"Write {zh} as a number."],
                        [f"{zh}是数字几？", f"把{zh}写成数字。"], str(n)),
        "en_to_zh": ([f"What is {en} in Chinese?", f"How do you say {en} in Chinese?"],
                     [f"{en}的中文是什么？", f"{en}用中文怎么说？"], zh),
        "zh_to_en": ([f"What is {zh} in English?", f"How do you say {zh} in English?"],
                     [f"{zh}用英语怎么说？", f"{zh}的英文是什么？"], en),
    }
    en_questions, zh_questions, answer = questions[kind]
    return (en_questions if lang == "en" else zh_questions), answer


def state_number_word(key: tuple[int, str], lang: str) -> list[str]:
    n, _ = key
    en, zh = EN_NUMBERS[n], ZH_NUMBERS[n]
    if lang == "en":
        return [f"The number {n} is {en} in English and {zh} in Chinese.",
                f"{en.capitalize()} is written {n}.", f"In Chinese, {en} is {zh}.",
                f"{zh} means {en}, that is {n}."]
    return [f"{n}的汉字是{zh}，英文是{en}。", f"{zh}就是{n}。", f"英文的{en}就是中文的{zh}。",
            f"{zh}写成数字是{n}。"]


def ask_addition(key: tuple[int, int], lang: str) -> tuple[list[str], str]:
    a, b = key
    if lang == "en":
        return [f"What is {a} + {b}?", f"What is {a} plus {b}?", f"{a} + {b} = ?"], str(a + b)
    return [f"{a}加{b}等于几？", f"{a}+{b}等于多少？", f"计算{a}+{b}。"], str(a + b)


def state_addition(key: tuple[int, int], lang: str) -> list[str]:
    a, b = key
    s = a + b
    if lang == "en":
        return [f"{a} + {b} = {s}.", f"{a} plus {b} is {s}.",
                f"{EN_NUMBERS[a].capitalize()} plus {EN_NUMBERS[b]} equals {EN_NUMBERS[s]}.",
                f"Tom has {a} apples and gets {b} more, so he has {s} apples."]
    return [f"{a}+{b}={s}。", f"{a}加{b}等于{s}。", f"{ZH_NUMBERS[a]}加{ZH_NUMBERS[b]}等于{ZH_NUMBERS[s]}。",
            f"小明有{a}个苹果，又拿到{b}个，一共有{s}个苹果。"]


def ask_next(n: int, lang: str) -> tuple[list[str], str]:
    if lang == "en":
        return [f"What number comes after {n}?", f"What is the next number after {n}?"], str(n + 1)
    return [f"{n}后面的数是几？", f"{n}的下一个数是多少？"], str(n + 1)


def state_next(n: int, lang: str) -> list[str]:
    if lang == "en":
        return [f"After {n} comes {n + 1}.", f"{n + 1} comes right after {n}.",
                f"Counting on: {n}, {n + 1}, {n + 2}, {n + 3}.", f"The number after {n} is {n + 1}."]
    return [f"{n}后面是{n + 1}。", f"{n}的下一个数是{n + 1}。", f"接着数：{n}，{n + 1}，{n + 2}，{n + 3}。"]


TASKS = [
    Task("capital", list(range(len(COUNTRIES))), ask_capital, state_capital),
    Task("colour", list(range(len(COLOURS))), ask_colour, state_colour),
    Task("sound", list(range(len(SOUNDS))), ask_sound, state_sound),
    Task("opposite", [(i, d) for i in range(len(OPPOSITES)) for d in (0, 1)], ask_opposite,
         state_opposite, weight=1.5),
    Task("number_word", [(n, k) for n in range(11) for k in NUMBER_WORD_KINDS], ask_number_word,
         state_number_word, weight=1.5),
    Task("addition", [(a, b) for a in range(7) for b in range(7)], ask_addition, state_addition,
         n_held_out=12, weight=2.5),
    Task("next_number", list(range(40)), ask_next, state_next, weight=1.5),
]

SYSTEM_PROMPTS = {
    "en": ["You are a helpful assistant.", "You are a helpful assistant. Answer briefly.",
           "Answer with a single word or number."],
    "zh": ["你是一个乐于助人的助手。", "请简短回答。", "只用一个词或一个数字回答。"],
}
SMALL_TALK = {
    "en": [("Hello!", "Hello! Ask me a question."), ("Hi", "Hi! How can I help?"),
           ("Who are you?", "I am a tiny language model trained on a small demo dataset."),
           ("Thank you!", "You are welcome!")],
    "zh": [("你好！", "你好！请问我一个问题吧。"), ("你好", "你好！有什么可以帮你的？"),
           ("你是谁？", "我是一个在小型演示数据上训练的语言模型。"), ("谢谢！", "不客气！")],
}

def pick_task(rng: random.Random) -> Task:
    return rng.choices(TASKS, weights=[task.weight for task in TASKS])[0]


# 3. Splitting the world: which items SFT may ask about ---------------------------------


def split_held_out(rng: random.Random) -> dict[str, set]:
    """For each task, the keys (e.g. sums) that SFT never asks about and the eval does."""
    held_out = {}
    for task in TASKS:
        held_out[task.name] = set(rng.sample(task.keys, task.n_held_out))
    return held_out


# 4. Pretraining text ---------------------------------------------------------------------


def join_sentences(sentences: list[str], lang: str) -> str:
    """English sentences are separated by spaces, Chinese ones are not."""
    return (" " if lang == "en" else "").join(sentences)


def pretrain_paragraph(rng: random.Random) -> str:
    """One line of pretraining text: a few sentences on one topic, an FAQ, or a mix."""
    lang = rng.choice(["en", "zh"])
    kind = rng.random()
    if kind < 0.2:  # a dialogue transcript, as found on the web
        turns = []
        for _ in range(rng.randint(3, 6)):
            task = pick_task(rng)
            questions, answer = task.ask(rng.choice(task.keys), lang)
            turns.append(f"User: {rng.choice(questions)}\nAssistant: {answer}")
        return "\n".join(turns)
    if kind < 0.35:  # FAQ style
        pairs = []
        for _ in range(rng.randint(4, 8)):
            task = pick_task(rng)
            questions, answer = task.ask(rng.choice(task.keys), lang)
            pairs.append(f"Q: {rng.choice(questions)} A: {answer}." if lang == "en"
                         else f"问：{rng.choice(questions)}答：{answer}。")
        return join_sentences(pairs, lang)
    if kind < 0.5:  # a mix of topics
        sentences = []
        for _ in range(rng.randint(5, 9)):
            task = pick_task(rng)
            sentences.append(rng.choice(task.state(rng.choice(task.keys), lang)))
        return join_sentences(sentences, lang)
    # One topic; the first fact is said twice in different words, as texts often do.
    task = pick_task(rng)
    first = task.state(rng.choice(task.keys), lang)
    sentences = rng.sample(first, 2)
    for _ in range(rng.randint(3, 7)):
        sentences.append(rng.choice(task.state(rng.choice(task.keys), lang)))
    return join_sentences(sentences, lang)


# 5. SFT conversations and the held-out eval ----------------------------------------------


def sample_question(rng: random.Random, lang: str, held_out: dict[str, set]) -> tuple[str, str]:
    """A question SFT may ask and its exact answer.

    SFT never asks about a held-out item, and never uses the last phrasing of a
    question (both are kept for the eval); pretraining text uses all of them.
    """
    task = pick_task(rng)
    while True:
        key = rng.choice(task.keys)
        if key not in held_out[task.name]:
            questions, answer = task.ask(key, lang)
            return rng.choice(questions[:-1]), answer


def sft_conversation(rng: random.Random, held_out: dict[str, set]) -> dict:
    """One to six questions in one language, sometimes after a system prompt."""
    lang = rng.choice(["en", "zh"])
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS[lang])})
    n_turns = rng.choices([1, 2, 3, 4, 5, 6], weights=[25, 20, 20, 15, 10, 10])[0]
    for _ in range(n_turns):
        if rng.random() < 0.04:
            question, answer = rng.choice(SMALL_TALK[lang])
        else:
            question, answer = sample_question(rng, lang, held_out)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return {"conversations": messages}


def eval_item(rng: random.Random, task: Task, lang: str, question: str, answer: str,
              held_out: str) -> dict:
    messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS[lang])})
    messages.append({"role": "user", "content": question})
    messages.append({"role": "assistant", "content": answer})
    return {"conversations": messages, "task": task.name, "lang": lang, "held_out": held_out}


def eval_items(rng: random.Random, held_out: dict[str, set], per_task: int) -> list[dict]:
    """Questions SFT never asked, of two kinds ("held_out" field).

    "phrasing": a fact SFT asked about, in the phrasing SFT never used;
    "item": a held-out item of a task, e.g. a sum SFT never asked (stated in pretraining).
    """
    items = []
    for task in TASKS:
        known = [(key, lang) for key in task.keys for lang in ("en", "zh")
                 if key not in held_out[task.name]]
        for key, lang in rng.sample(known, min(per_task, len(known))):
            questions, answer = task.ask(key, lang)
            items.append(eval_item(rng, task, lang, questions[-1], answer, "phrasing"))
        for key in task.keys:
            if key in held_out[task.name]:
                for lang in ("en", "zh"):
                    questions, answer = task.ask(key, lang)
                    items.append(eval_item(rng, task, lang, rng.choice(questions), answer, "item"))
    rng.shuffle(items)
    return items


def chance_accuracy(items: list[dict]) -> float:
    """Expected accuracy of guessing uniformly among the answers a task can have."""
    answers: dict[tuple[str, str], set] = {}
    for task in TASKS:
        for key in task.keys:
            for lang in ("en", "zh"):
                answers.setdefault((task.name, lang), set()).add(task.ask(key, lang)[1])
    return sum(1 / len(answers[(item["task"], item["lang"])]) for item in items) / len(items)


# 6. The eval's questions as multiple choice ----------------------------------------------


def same_kind_answers(task: Task, question: str, lang: str) -> list[str]:
    """Every answer of the kind `question` asks for: all capitals for a capital, all digits for
    "Which number is 七?" (number words have six kinds of question, each with its own answers)."""
    key = next(key for key in task.keys if question in task.ask(key, lang)[0])
    kind = key[1] if task.name == "number_word" else None
    return sorted({task.ask(k, lang)[1] for k in task.keys if kind is None or k[1] == kind})


def choice_items(rng: random.Random, evaluation: list[dict], n_choices: int = 4) -> list[dict]:
    """Each eval question with its answer and wrong answers of the same kind, written as the
    FAQ lines of the pretraining text ("Q: ... A:"), so a model is scored before SFT too."""
    tasks = {task.name: task for task in TASKS}
    items = []
    for record in evaluation:
        task, lang = tasks[record["task"]], record["lang"]
        question, answer = (m["content"] for m in record["conversations"][-2:])
        wrong = [a for a in same_kind_answers(task, question, lang) if a != answer]
        choices = rng.sample(wrong, n_choices - 1) + [answer]
        rng.shuffle(choices)
        items.append({"question": f"Q: {question} A:" if lang == "en" else f"问：{question}答：",
                      "choices": choices, "answer": choices.index(answer),
                      "task": task.name, "lang": lang})
    return items


# 7. Writing the files --------------------------------------------------------------------


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out_dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--pretrain_lines", type=int, default=10000)
    parser.add_argument("--val_lines", type=int, default=100)
    parser.add_argument("--sft_lines", type=int, default=4000)
    parser.add_argument("--eval_phrasing_per_task", type=int, default=20)
    args = parser.parse_args()

    # Separate generators per file, so changing one file's size leaves the others unchanged.
    held_out = split_held_out(random.Random(f"{args.seed}:split"))
    rng = random.Random(f"{args.seed}:pretrain")
    pretrain = [pretrain_paragraph(rng) for _ in range(args.pretrain_lines)]
    seen = set(pretrain)
    rng = random.Random(f"{args.seed}:val")
    val = []
    while len(val) < args.val_lines:
        text = pretrain_paragraph(rng)
        if text not in seen:  # validation text never appears verbatim in training
            seen.add(text)
            val.append(text)
    rng = random.Random(f"{args.seed}:sft")
    sft = [sft_conversation(rng, held_out) for _ in range(args.sft_lines)]
    evaluation = eval_items(random.Random(f"{args.seed}:eval"), held_out, args.eval_phrasing_per_task)
    choices = choice_items(random.Random(f"{args.seed}:mc"), evaluation)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    files = {"pretrain_demo.jsonl": [{"text": t} for t in pretrain],
             "val_demo.jsonl": [{"text": t} for t in val],
             "sft_demo.jsonl": sft,
             "sft_demo_eval.jsonl": evaluation,
             "mc_demo.jsonl": choices}
    for name, records in files.items():
        write_jsonl(args.out_dir / name, records)
        size = (args.out_dir / name).stat().st_size
        print(f"{name}: {len(records)} lines, {size / 1e6:.2f} MB")
    kinds = Counter((item["task"], item["held_out"]) for item in evaluation)
    print("eval items (task, held out): " + ", ".join(f"{t}/{h} {n}" for (t, h), n in sorted(kinds.items())))
    print(f"chance accuracy on the eval (uniform guess per task): {chance_accuracy(evaluation):.1%}")


if __name__ == "__main__":
    main()

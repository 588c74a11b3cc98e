"""Dataset items, loss masks, error messages for bad data, and the committed demo data."""

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from dataset.chat_format import render_chat_text
from dataset.lm_dataset import IGNORE_INDEX, JsonlFile, PretrainDataset, SFTDataset
from dataset.make_demo_data import COUNTRIES, TASKS
from dataset.make_stage_data import TOOL_NAMES, ask_arithmetic, ask_temperature, ask_translation, dictionary_words
from dataset.tools import DEMO_TOOLS, WEATHER, result_text
from model.tokenizer import BOS_ID, EOS_ID, PAD_ID, load_tokenizer

from conftest import REPO
DATA_DIR = REPO / "dataset"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(REPO / "model" / "tokenizer.json")


def write_jsonl(path: Path, lines: list) -> Path:
    """Write records (dicts) or raw strings, one per line."""
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line, ensure_ascii=False)) + "\n")
    return path


def chat(*turns: str, system: str | None = None) -> dict:
    """{"conversations": ...} from alternating user / assistant texts."""
    messages = [{"role": "system", "content": system}] if system else []
    for n, text in enumerate(turns):
        messages.append({"role": "user" if n % 2 == 0 else "assistant", "content": text})
    return {"conversations": messages}


# Pretraining items


def test_pretrain_item_is_bos_text_eos_then_padding(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "The capital of Peru is Lima."}])
    input_ids, labels = PretrainDataset(path, tokenizer, max_seq_len=32)[0]
    text_ids = tokenizer.encode("The capital of Peru is Lima.").ids
    n = len(text_ids) + 2
    assert input_ids.shape == labels.shape == (32,)
    assert input_ids.dtype == labels.dtype == torch.long
    assert input_ids[:n].tolist() == [BOS_ID] + text_ids + [EOS_ID]
    assert input_ids[n:].tolist() == [PAD_ID] * (32 - n)
    assert labels[:n].tolist() == input_ids[:n].tolist()
    assert labels[n:].tolist() == [IGNORE_INDEX] * (32 - n)


def test_pretrain_item_longer_than_max_seq_len_is_cut_without_eos(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "one two three four five six seven " * 5}])
    input_ids, labels = PretrainDataset(path, tokenizer, max_seq_len=8)[0]
    assert input_ids[0] == BOS_ID
    assert EOS_ID not in input_ids.tolist() and PAD_ID not in input_ids.tolist()
    assert labels.tolist() == input_ids.tolist()


# SFT items


def labelled_spans(input_ids: torch.Tensor, labels: torch.Tensor) -> list[list[int]]:
    """Runs of consecutive positions that carry a label."""
    spans, current = [], []
    for token, label in zip(input_ids.tolist(), labels.tolist()):
        if label == IGNORE_INDEX:
            if current:
                spans.append(current)
            current = []
        else:
            assert label == token  # labels are aligned with the inputs, not shifted
            current.append(token)
    return spans + [current] if current else spans


def test_sft_loss_covers_the_assistant_turn_after_its_header_and_nothing_else(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "s.jsonl", [chat("秘鲁的首都是哪里？", "利马", system="请简短回答。")])
    input_ids, labels = SFTDataset(path, tokenizer, max_seq_len=64)[0]
    spans = labelled_spans(input_ids, labels)
    assert len(spans) == 1
    # The empty think block, the answer, <|im_end|> and the newline after it (as minimind trains).
    assert tokenizer.decode(spans[0], skip_special_tokens=False) == "<think>\n\n</think>\n\n利马<|im_end|>\n"
    assert spans[0][-2] == EOS_ID


def test_sft_multi_turn_labels_every_assistant_turn(tmp_path, tokenizer):
    conversation = chat("What is 3 + 4?", "7", "And the opposite of big?", "small")
    path = write_jsonl(tmp_path / "s.jsonl", [conversation])
    input_ids, labels = SFTDataset(path, tokenizer, max_seq_len=96)[0]
    spans = labelled_spans(input_ids, labels)
    assert [tokenizer.decode(span, skip_special_tokens=False) for span in spans] == [
        "<think>\n\n</think>\n\n7<|im_end|>\n", "<think>\n\n</think>\n\nsmall<|im_end|>\n"]
    assert all(span[-2] == EOS_ID for span in spans)
    assert (labels[input_ids == PAD_ID] == IGNORE_INDEX).all()


def test_sft_ids_equal_tokenizing_the_whole_rendered_text(tmp_path, tokenizer):
    conversation = chat("Hello!", "Hello! Ask me a question.", "猫怎么叫？", "喵喵", system="Be brief.")
    path = write_jsonl(tmp_path / "s.jsonl", [conversation])
    dataset = SFTDataset(path, tokenizer, max_seq_len=128)
    ids, _ = dataset.encode_conversation(conversation["conversations"])
    assert ids == tokenizer.encode(render_chat_text(conversation["conversations"])).ids


def test_special_token_text_inside_content_is_plain_text(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "s.jsonl", [chat("say <|im_end|> please", "<|im_end|>")])
    input_ids, labels = SFTDataset(path, tokenizer, max_seq_len=64)[0]
    spans = labelled_spans(input_ids, labels)
    assert tokenizer.decode(spans[0], skip_special_tokens=False) == "<think>\n\n</think>\n\n<|im_end|><|im_end|>\n"
    assert input_ids.tolist().count(EOS_ID) == 2  # only the two real message ends


def test_render_chat_text_with_generation_prompt():
    text = render_chat_text([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# Errors name the file and the line


@pytest.mark.parametrize("dataset_class, bad_line, problem", [
    (PretrainDataset, "{not json", "invalid JSON"),
    (PretrainDataset, "[1, 2]", "expected a JSON object"),
    (PretrainDataset, {"txt": "typo in the field name"}, '"text"'),
    (SFTDataset, {"messages": []}, '"conversations"'),
    (SFTDataset, {"conversations": [{"role": "user"}]}, '"role" and "content"'),
    (SFTDataset, {"conversations": [{"role": "robot", "content": "beep"}]}, "unknown role 'robot'"),
    (SFTDataset, {"conversations": [{"role": "user", "content": "hi"}]}, "no assistant message"),
])
def test_bad_line_error_names_file_and_line_number(tmp_path, tokenizer, dataset_class, bad_line, problem):
    good = {"text": "fine"} if dataset_class is PretrainDataset else chat("hi", "hello")
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, "", bad_line, good])
    with pytest.raises(ValueError) as excinfo:
        dataset_class(path, tokenizer, max_seq_len=16)
    message = str(excinfo.value)
    assert str(path) in message
    assert "line 4:" in message  # the blank line counts, so this is not the record index
    assert problem in message


# JsonlFile


def test_jsonl_file_skips_blank_lines_and_keeps_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", [{"a": 1}, "", "   ", {"a": 2}])
    source = JsonlFile(path)
    assert len(source) == 2
    assert source.read(1) == {"a": 2}
    assert source.line_number(1) == 4
    assert source.raw_line(0) == b'{"a": 1}'
    assert source.file_size == path.stat().st_size


def test_jsonl_file_survives_pickling(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", [{"a": i} for i in range(5)])
    source = JsonlFile(path)
    source.read(0)  # opens the file handle, which must not be pickled
    copy = pickle.loads(pickle.dumps(source))
    assert [copy.read(i)["a"] for i in range(5)] == list(range(5))


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataset_in_dataloader_workers_yields_every_item(tmp_path, tokenizer, start_method):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": f"number {i}"} for i in range(20)])
    dataset = PretrainDataset(path, tokenizer, max_seq_len=8)
    dataset[0]  # open the file in the parent first: workers must not share its position
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context=start_method)
    seen = [tokenizer.decode([t for t in row.tolist() if t > EOS_ID])
            for input_ids, _ in loader for row in input_ids]
    assert seen == [f"number {i}" for i in range(20)]


# The committed demo data


def read_records(name: str) -> list[dict]:
    with open(DATA_DIR / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_demo_data_files_exist_and_stay_small():
    names = ["pretrain_demo.jsonl", "val_demo.jsonl", "sft_demo.jsonl", "sft_demo_eval.jsonl"]
    sizes = [(DATA_DIR / name).stat().st_size for name in names]
    assert all(size > 0 for size in sizes)
    assert sum(sizes) < 5_000_000


def test_demo_data_loads_into_the_datasets(tokenizer):
    assert len(PretrainDataset(DATA_DIR / "pretrain_demo.jsonl", tokenizer, 128)) > 1000
    assert len(PretrainDataset(DATA_DIR / "val_demo.jsonl", tokenizer, 128)) >= 50
    assert len(SFTDataset(DATA_DIR / "sft_demo.jsonl", tokenizer, 128)) > 1000
    assert len(SFTDataset(DATA_DIR / "sft_demo_eval.jsonl", tokenizer, 128)) >= 100


def test_eval_questions_are_not_in_the_sft_training_set():
    asked_in_training = {m["content"] for r in read_records("sft_demo.jsonl")
                         for m in r["conversations"] if m["role"] == "user"}
    eval_records = read_records("sft_demo_eval.jsonl")
    for record in eval_records:
        assert record["conversations"][-1]["role"] == "assistant"
        assert record["conversations"][-2]["content"] not in asked_in_training


def test_validation_text_is_not_in_the_pretraining_text():
    training = {r["text"] for r in read_records("pretrain_demo.jsonl")}
    assert not [r["text"] for r in read_records("val_demo.jsonl") if r["text"] in training]


def test_multiple_choice_asks_the_eval_questions_against_three_wrong_answers_of_the_same_kind():
    tasks = {task.name: task for task in TASKS}
    evaluation, items = read_records("sft_demo_eval.jsonl"), read_records("mc_demo.jsonl")
    assert len(items) == len(evaluation)
    for record, item in zip(evaluation, items):
        question, answer = (m["content"] for m in record["conversations"][-2:])
        assert item["question"] == (f"Q: {question} A:" if record["lang"] == "en" else f"问：{question}答：")
        assert item["choices"][item["answer"]] == answer and len(set(item["choices"])) == 4
        task_answers = {tasks[record["task"]].ask(key, record["lang"])[1] for key in tasks[record["task"]].keys}
        assert set(item["choices"]) <= task_answers
        assert len({choice.isdigit() for choice in item["choices"]}) == 1, item  # "7" is never up against "seven"
    assert 0.15 < sum(item["answer"] == 0 for item in items) / len(items) < 0.35  # the answer's place is drawn


def test_committed_demo_data_is_what_the_generator_writes(tmp_path):
    subprocess.run([sys.executable, str(DATA_DIR / "make_demo_data.py"), "--out_dir", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ["pretrain_demo.jsonl", "val_demo.jsonl", "sft_demo.jsonl", "sft_demo_eval.jsonl", "mc_demo.jsonl"]:
        assert (tmp_path / name).read_bytes() == (DATA_DIR / name).read_bytes(), name


STAGE_FILES = ["lora_demo.jsonl", "lora_demo_eval.jsonl", "dpo_demo.jsonl", "dpo_demo_eval.jsonl", "grpo_demo.jsonl",
               "tool_demo_eval.jsonl", "tool_sft_demo.jsonl", "tool_grpo_demo.jsonl"]


def test_committed_stage_data_is_what_its_generator_writes(tmp_path):
    subprocess.run([sys.executable, str(DATA_DIR / "make_stage_data.py"), "--out_dir", str(tmp_path)],
                   check=True, capture_output=True)
    for name in STAGE_FILES:
        assert (tmp_path / name).read_bytes() == (DATA_DIR / name).read_bytes(), name


def test_the_lora_domain_is_a_task_sft_never_taught_and_its_eval_phrasing_is_new_to_lora():
    sft_questions = {m["content"] for r in read_records("sft_demo.jsonl") for m in r["conversations"]
                     if m["role"] == "user"}
    asked = {m["content"] for r in read_records("lora_demo.jsonl") for m in r["conversations"] if m["role"] == "user"}
    phrasings = {q for word in dictionary_words() for lang in ("en", "zh") for q in ask_translation(word, lang)[0]}
    translation = asked & phrasings
    assert len(translation) > 200 and not translation & sft_questions  # of 52 words x 2 ways x 2 phrasings
    pretraining = (DATA_DIR / "pretrain_demo.jsonl").read_text(encoding="utf-8")
    assert not [q for q in phrasings if q in pretraining]
    eval_questions = [r["conversations"][-2]["content"] for r in read_records("lora_demo_eval.jsonl")]
    assert not set(eval_questions) & asked and len(eval_questions) == 104  # 52 words, both ways


def test_dpo_pairs_share_their_prompt_and_prefer_the_right_answer_to_a_wrong_one_of_the_same_kind():
    training, held_out = read_records("dpo_demo.jsonl"), read_records("dpo_demo_eval.jsonl")
    for record in training + held_out:
        chosen, rejected = record["chosen"], record["rejected"]
        assert chosen[:-1] == rejected[:-1] and chosen[-1]["role"] == rejected[-1]["role"] == "assistant"
        assert chosen[-1]["content"] != rejected[-1]["content"]
        assert chosen[-1]["content"].isdigit() == rejected[-1]["content"].isdigit(), record
    evaluation = read_records("sft_demo_eval.jsonl")  # the held-out pairs ask the eval's questions, right answer chosen
    assert [r["chosen"] for r in held_out] == [r["conversations"] for r in evaluation]
    asked = {r["chosen"][-2]["content"] for r in training}
    assert not asked & {r["chosen"][-2]["content"] for r in held_out}


def test_grpo_asks_the_phrasing_sft_never_used_about_items_the_eval_does_not_ask_with_the_right_answer():
    """GRPO's prompts (dataset/grpo_demo.jsonl) ask in the eval's phrasing, which SFT never used, and never a question
    of the eval (sft_demo_eval.jsonl), so the demo's exact match after GRPO is on questions GRPO never saw."""
    last_phrasing = {task.ask(key, lang)[0][-1]: (task.name, task.ask(key, lang)[1])
                     for task in TASKS for key in task.keys for lang in ("en", "zh")}  # question: (task, answer)
    prompts = [r["conversations"] for r in read_records("grpo_demo.jsonl")]
    assert len(prompts) > 250 and all(len(c) == 2 and c[0]["role"] == "user" for c in prompts)
    assert all(last_phrasing[c[0]["content"]][1] == c[1]["content"] for c in prompts)  # each with its right answer
    assert {last_phrasing[c[0]["content"]][0] for c in prompts} == {task.name for task in TASKS}  # every task
    sft_questions = {m["content"] for r in read_records("sft_demo.jsonl") for m in r["conversations"]
                     if m["role"] == "user"}
    eval_questions = {r["conversations"][-2]["content"] for r in read_records("sft_demo_eval.jsonl")}
    asked = {c[0]["content"] for c in prompts}
    assert len(asked) == len(prompts) and not asked & sft_questions and not asked & eval_questions


def questions_of(conversation: list[dict]) -> list[list[dict]]:
    """A tool SFT conversation cut into its questions, each under the conversation's system turn."""
    system, *messages = conversation
    starts = [n for n, message in enumerate(messages) if message["role"] == "user"] + [len(messages)]
    return [[system, *messages[start:end]] for start, end in zip(starts, starts[1:])]


def tool_question_kind(conversation: list[dict]) -> str:
    """calculator, get_weather or no_tool, after checking that a needed call is made with the tool's real result and
    that the answer is the one that result gives; the question, in a phrasing the tool-use eval never uses."""
    system, user, *rest = conversation
    assert system == {"role": "system", "content": "", "tools": [DEMO_TOOLS[name].spec for name in TOOL_NAMES]}
    question, lang = user["content"], "en" if user["content"].isascii() else "zh"
    if len(rest) == 1:  # answered directly: a question of SFT's (its phrasings, items SFT may ask)
        return "no_tool"
    call, result, answer = rest
    [called] = call["tool_calls"]
    value = DEMO_TOOLS[called["name"]].function(**called["arguments"])
    assert call["content"] == "" and result == {"role": "tool", "content": result_text(value)}
    if called["name"] == "calculator":
        a, op, b = called["arguments"]["expression"].replace(" ", "").partition(next(o for o in "+-*" if o in
                                                                                  called["arguments"]["expression"]))
        assert question in ask_arithmetic(int(a), op, int(b), lang)[:-1] and answer["content"] == str(value["result"])
    else:
        city = called["arguments"]["city"]
        city_zh = next(zh for _, _, en, zh in COUNTRIES if en == city)
        assert question in ask_temperature(city, city_zh, lang)[:-1]
        assert answer["content"] == f"{value['temperature_c']}°C"
    return called["name"]


def test_tool_sft_calls_the_tool_each_question_needs_with_its_real_result_never_in_the_evals_phrasing(tokenizer):
    """dataset/tool_sft_demo.jsonl: three questions a conversation, each with the call, the tool's own result and the
    answer from it, or a direct answer where no tool is needed; both tools offered in each system turn; never the
    eval's phrasing (the last) nor its sums; each conversation whole within --max_seq_len 960."""
    conversations = [r["conversations"] for r in read_records("tool_sft_demo.jsonl")]
    questions = [question for c in conversations for question in questions_of(c)]
    assert len(questions) == 3 * len(conversations)
    kinds = [tool_question_kind(q) for q in questions]
    assert {kind: kinds.count(kind) / len(kinds) > 0.15 for kind in kinds} == {
        "calculator": True, "get_weather": True, "no_tool": True}
    sft_questions = {m["content"] for r in read_records("sft_demo.jsonl") for m in r["conversations"]
                     if m["role"] == "user"}
    assert {q[1]["content"] for q, kind in zip(questions, kinds) if kind == "no_tool"} <= sft_questions
    evaluation = read_records("tool_demo_eval.jsonl")
    asked = {q[1]["content"] for q in questions}
    assert not asked & {r["conversations"][-1]["content"] for r in evaluation}
    assert len({q[1]["content"] for q, kind in zip(questions, kinds) if kind == "calculator"}) > 2000  # many forms
    dataset = SFTDataset(DATA_DIR / "tool_sft_demo.jsonl", tokenizer, 960)
    assert all(dataset[i][1][-1] == IGNORE_INDEX for i in range(len(dataset)))  # padding at the end: nothing cut


def test_tool_grpo_prompts_ask_in_the_evals_phrasing_what_neither_tool_sft_nor_the_eval_asks():
    """dataset/tool_grpo_demo.jsonl: the system turn with both tools, a question and its final answer (the agentic
    stage makes the calls). As GRPO's prompts, in the eval's phrasing (the last), about what the eval does not ask:
    calculations neither tool SFT nor the eval asks, a capital's temperature in the language the eval does not ask it
    in, and grpo_demo.jsonl's questions, which need no call."""
    sft = [r["conversations"] for r in read_records("tool_sft_demo.jsonl")]
    prompts = [r["conversations"] for r in read_records("tool_grpo_demo.jsonl")]
    assert all(len(c) == 3 and c[0] == sft[0][0] and c[2]["role"] == "assistant" for c in prompts)
    evaluation = read_records("tool_demo_eval.jsonl")
    eval_cities = {(r["arguments"]["city"], r["lang"]) for r in evaluation if r["tool"] == "get_weather"}
    temperature = {}  # the eval's phrasing of each capital's temperature: (city, lang), answer
    for _, _, city, city_zh in COUNTRIES:
        for lang in ("en", "zh"):
            answer = f"{DEMO_TOOLS['get_weather'].function(city)['temperature_c']}°C"
            temperature[ask_temperature(city, city_zh, lang)[-1]] = (city, lang), answer
    no_call = {r["conversations"][0]["content"]: r["conversations"][1]["content"]
               for r in read_records("grpo_demo.jsonl")}
    sums, kinds = [], []
    for _, question, answer in prompts:
        question, answer = question["content"], answer["content"]
        numbers = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?|(\d+)([-+*])(\d+)等于多少？", question)
        if numbers:
            a, op, b = [part for part in numbers.groups() if part is not None]
            assert question == ask_arithmetic(int(a), op, int(b), "en" if question.isascii() else "zh")[-1]
            sums.append(f"{a} {op} {b}")
            assert answer == str(DEMO_TOOLS["calculator"].function(sums[-1])["result"])
            kinds.append("calculator")
        elif question in temperature:
            assert temperature[question][0] not in eval_cities and answer == temperature[question][1]
            kinds.append("get_weather")
        else:
            assert no_call[question] == answer  # GRPO's: the eval's phrasing, items the eval does not ask
            kinds.append("no_tool")
    assert {kind: kinds.count(kind) > 20 for kind in kinds} == {"calculator": True, "get_weather": True, "no_tool": True}
    sft_sums = {q[2]["tool_calls"][0]["arguments"]["expression"] for c in sft for q in questions_of(c)
                if len(q) > 3 and q[2]["tool_calls"][0]["name"] == "calculator"}
    sft_sums = {" ".join(re.fullmatch(r"(\d+) ?([-+*]) ?(\d+)", e).groups()) for e in sft_sums}
    eval_sums = {r["arguments"]["expression"] for r in evaluation if r["tool"] == "calculator"}
    assert len(set(sums)) == len(sums) and not set(sums) & (sft_sums | eval_sums)
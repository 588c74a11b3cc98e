"""minimind's full SFT schema: system tools, reasoning, tool calls, tool results.

One minimind-schema line is rendered and checked against a hand-written string, then its ids and
loss mask are checked token by token with real tokenizers: one that has the tags as tokens of its
own (as special tokens, and as minimind's plain added tokens) and the demo tokenizer, which has
not. transformers must render the same text from CHAT_TEMPLATE, and eval_model.py must prompt
with the ids training saw.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast

import eval_model
from dataset.chat_format import parse_conversation, render_chat_text
from dataset.lm_dataset import IGNORE_INDEX, SYSTEM_PROMPTS, SFTDataset
from model.chat_template import CHAT_TEMPLATE, TAGS
from model.tokenizer import DEFAULT_TOKENIZER, EOS_ID, PAD_ID, SPECIAL_TOKENS, load_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "查询城市天气",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# Calls in both forms minimind's data uses: {"name", "arguments": object} and OpenAI's
# {"type": "function", "function": {"name", "arguments": JSON string}}.
CALLS = [{"name": "get_weather", "arguments": {"city": "Lima"}},
         {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"北京\"}"}}]
MESSAGES = [
    {"role": "system", "content": "You are a weather assistant.", "tools": json.dumps(TOOLS, ensure_ascii=False)},
    {"role": "user", "content": "Weather in Lima and 北京?"},
    {"role": "assistant", "content": "I will look both up.", "reasoning_content": "Two cities, two calls.",
     "tool_calls": json.dumps(CALLS, ensure_ascii=False)},
    {"role": "tool", "content": "{\"city\": \"Lima\", \"temp\": 18}"},
    {"role": "tool", "content": "{\"city\": \"北京\", \"temp\": 25}"},
    {"role": "assistant", "content": "Lima: 18°C, 北京: 25°C."},
]

EXPECTED_TEXT = """<|im_start|>system
You are a weather assistant.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "查询城市天气", \
"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Weather in Lima and 北京?<|im_end|>
<|im_start|>assistant
<think>
Two cities, two calls.
</think>

I will look both up.
<tool_call>
{"name": "get_weather", "arguments": {"city": "Lima"}}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": {"city": "北京"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"city": "Lima", "temp": 18}
</tool_response>
<tool_response>
{"city": "北京", "temp": 25}
</tool_response><|im_end|>
<|im_start|>assistant
<think>

</think>

Lima: 18°C, 北京: 25°C.<|im_end|>
"""
# What the loss covers: each assistant turn after its header, through "<|im_end|>\n".
EXPECTED_TRAINED = [
    "<think>\nTwo cities, two calls.\n</think>\n\nI will look both up.\n"
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}\n</tool_call>\n"
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"北京\"}}\n</tool_call><|im_end|>\n",
    "<think>\n\n</think>\n\nLima: 18°C, 北京: 25°C.<|im_end|>\n",
]
CHAT_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def write_jsonl(path: Path, lines: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line, ensure_ascii=False)) + "\n")
    return path


def build_tokenizer(path: Path, tags_are_special: bool, with_tags: bool = True) -> Tokenizer:
    """A byte-level BPE with the ChatML specials at 0, 1, 2 and the chat tags after them.

    `tags_are_special=False` adds the tags as plain added tokens, as minimind's tokenizer has them;
    `with_tags=False` leaves them out, so they are encoded as text.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = list(SPECIAL_TOKENS) + (CHAT_TAGS if tags_are_special else [])
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for m in MESSAGES] + ["The weather in Lima is mild.", "北京的天气很好。"] * 20
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if with_tags and not tags_are_special:
        tokenizer.add_tokens(CHAT_TAGS)
    tokenizer.save(str(path))
    return load_tokenizer(path)  # the project's check: ChatML specials at 0, 1, 2


@pytest.fixture(scope="module", params=["special", "added"], ids=["tags-special", "tags-added-as-minimind"])
def tagged_tokenizer(request, tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
    return build_tokenizer(path, tags_are_special=request.param == "special")


@pytest.fixture(scope="module")
def demo_tokenizer() -> Tokenizer:
    return load_tokenizer(DEFAULT_TOKENIZER)


@pytest.fixture(scope="module")
def tagless_tokenizer(tmp_path_factory) -> Tokenizer:
    """Only the three ChatML specials: the chat tags are encoded as text."""
    return build_tokenizer(tmp_path_factory.mktemp("tagless") / "tokenizer.json", False, with_tags=False)


def sft_item(tmp_path: Path, tokenizer: Tokenizer, messages: list[dict], **kwargs) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of the first item of a one-line SFT file, unpadded."""
    dataset = SFTDataset(write_jsonl(tmp_path / "sft.jsonl", [{"conversations": messages}]), tokenizer, 4096,
                         **kwargs)
    input_ids, labels = dataset[0]
    n = int((input_ids != PAD_ID).sum())  # no padding id inside a conversation
    return input_ids[:n].tolist(), labels[:n].tolist()


def trained_runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The runs of consecutive labelled positions, checking each label is its own input id."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label == IGNORE_INDEX:
            runs, current = (runs + [current] if current else runs), []
        else:
            assert label == token  # labels are aligned with the inputs; the model shifts them
            current.append(token)
    return runs + [current] if current else runs


def expected_mask_from_offsets(tokenizer: Tokenizer, text: str) -> list[bool]:
    """Independent of the renderer: a token is trained when it starts inside an assistant body."""
    header, end = "<|im_start|>assistant\n", "<|im_end|>\n"
    bodies, start = [], text.find(header)
    while start != -1:
        body_start = start + len(header)
        body_end = text.index(end, body_start) + len(end)
        bodies.append((body_start, body_end))
        start = text.find(header, body_end)
    offsets = tokenizer.encode(text).offsets
    return [any(a <= begin < b for a, b in bodies) for begin, _ in offsets]


# ---- (a) rendered text, ids and loss mask with the tags as tokens --------------------------------

def test_minimind_line_renders_to_the_hand_written_text():
    assert render_chat_text(MESSAGES) == EXPECTED_TEXT


def test_tags_are_the_tokenizers_own_tokens_and_the_mask_covers_exactly_the_assistant_bodies(
        tmp_path, tagged_tokenizer):
    ids, labels = sft_item(tmp_path, tagged_tokenizer, MESSAGES)
    # Encoding the whole text splits at the tags the tokenizer has, so the ids are the same.
    assert ids == tagged_tokenizer.encode(EXPECTED_TEXT).ids
    tag_id = {tag: tagged_tokenizer.token_to_id(tag) for tag in CHAT_TAGS}
    # <tool_call> and </tool_call>: twice in the tools instructions, once for each of the two calls.
    assert [ids.count(tag_id[tag]) for tag in CHAT_TAGS] == [2, 2, 4, 4, 2, 2]
    trained = [label != IGNORE_INDEX for label in labels]
    assert trained == expected_mask_from_offsets(tagged_tokenizer, EXPECTED_TEXT)
    runs = trained_runs(ids, labels)
    assert [tagged_tokenizer.decode(run, skip_special_tokens=False) for run in runs] == EXPECTED_TRAINED
    assert [run[0] for run in runs] == [tag_id["<think>"]] * 2
    assert [run[-2] for run in runs] == [EOS_ID] * 2


def test_tag_text_inside_data_stays_text(tmp_path, tagged_tokenizer):
    messages = [{"role": "user", "content": "What do <think> and <|im_end|> mean?"},
                {"role": "assistant", "content": "Markers: <tool_call>."}]
    ids, labels = sft_item(tmp_path, tagged_tokenizer, messages)
    think, tool_call = tagged_tokenizer.token_to_id("<think>"), tagged_tokenizer.token_to_id("<tool_call>")
    assert ids.count(think) == 1 and tool_call not in ids  # only the template's own <think>
    assert ids.count(EOS_ID) == 2
    runs = trained_runs(ids, labels)
    assert tagged_tokenizer.decode(runs[0], skip_special_tokens=False) == \
        "<think>\n\n</think>\n\nMarkers: <tool_call>.<|im_end|>\n"


# ---- (b) a tokenizer without the tags: they are text -------------------------------------------------------

def test_a_tokenizer_without_tags_encodes_them_as_text_with_the_same_mask(tmp_path, tagless_tokenizer):
    assert not any(tagless_tokenizer.token_to_id(tag) for tag in TAGS)
    ids, labels = sft_item(tmp_path, tagless_tokenizer, MESSAGES)
    assert ids == tagless_tokenizer.encode(EXPECTED_TEXT).ids
    trained = [label != IGNORE_INDEX for label in labels]
    assert trained == expected_mask_from_offsets(tagless_tokenizer, EXPECTED_TEXT)
    assert [tagless_tokenizer.decode(run, skip_special_tokens=False) for run in trained_runs(ids, labels)] \
        == EXPECTED_TRAINED


# ---- (c) transformers renders the same text ------------------------------------------------------

def test_transformers_chat_template_renders_the_identical_text(tagged_tokenizer):
    hf = PreTrainedTokenizerFast(tokenizer_object=tagged_tokenizer, chat_template=CHAT_TEMPLATE)
    messages, tools = parse_conversation(MESSAGES)  # minimind's JSON strings parsed
    assert tools == TOOLS
    assert hf.apply_chat_template(messages, tools=tools, tokenize=False) == EXPECTED_TEXT
    prompt = hf.apply_chat_template(messages[:-1], tools=tools, tokenize=False, add_generation_prompt=True)
    assert prompt == render_chat_text(MESSAGES[:-1], add_generation_prompt=True)
    assert prompt == EXPECTED_TEXT[:EXPECTED_TEXT.rindex("<think>")]
    # Inference through transformers sees the ids eval_model.py (and so training) uses.
    assert hf(prompt, add_special_tokens=False)["input_ids"] == eval_model.chat_prompt_ids(tagged_tokenizer,
                                                                                          MESSAGES[:-1])


def test_transformers_and_renderer_agree_on_inline_think_and_calls_without_content(tagged_tokenizer):
    messages = [{"role": "user", "content": "Lima?"},
                {"role": "assistant", "content": "", "tool_calls": [CALLS[0]]},
                {"role": "tool", "content": "18"},
                {"role": "assistant", "content": "<think>\nIt said 18.\n</think>\n\n18°C"},
                {"role": "system", "content": "Be brief."}]
    hf = PreTrainedTokenizerFast(tokenizer_object=tagged_tokenizer, chat_template=CHAT_TEMPLATE)
    text = render_chat_text(messages)
    assert hf.apply_chat_template(messages, tokenize=False) == text  # the template splits the inline think
    assert "\n\n<tool_call>" in text and "</think>\n\n\n<tool_call>" not in text  # no newline without content
    assert "<think>\nIt said 18.\n</think>\n\n18°C<|im_end|>" in text
    assert text.endswith("<|im_start|>system\nBe brief.<|im_end|>\n")  # a later system message is a turn


# ---- eval_model.py prompts with the training ids and reads the answer after the think block ------

def test_eval_prompt_ids_are_the_training_ids_before_the_answer(tmp_path, tagged_tokenizer, demo_tokenizer,
                                                                  tagless_tokenizer):
    for tokenizer in (tagged_tokenizer, demo_tokenizer, tagless_tokenizer):
        ids, labels = sft_item(tmp_path, tokenizer, MESSAGES)
        prompt = eval_model.chat_prompt_ids(tokenizer, MESSAGES[:-1])
        assert ids[:len(prompt)] == prompt
        assert labels[len(prompt) - 1] == IGNORE_INDEX and labels[len(prompt)] != IGNORE_INDEX


def test_eval_reads_the_answer_after_the_think_block(tagged_tokenizer):
    generated_ids = tagged_tokenizer.encode("<think>\nLima is in Peru.\n</think>\n\nLima").ids
    text = eval_model.chat_encoder(tagged_tokenizer).decode(generated_ids)
    assert text == "<think>\nLima is in Peru.\n</think>\n\nLima"  # tags survive decoding, special or not
    assert eval_model.answers_match(text, "Lima")
    assert not eval_model.answers_match("<think>\nstill thinking", "still thinking")
    assert eval_model.answers_match(" Lima\n", "Lima")  # a model trained without think blocks
    record = {"conversations": MESSAGES[:2] + [{"role": "assistant", "content": "<think>x</think>\nLima"}]}
    assert eval_model.split_eval_record(record) == (MESSAGES[:2], "Lima")


# ---- (d) malformed fields are refused with the file and line -------------------------------------

def conversation_with(**assistant_fields) -> dict:
    return {"conversations": [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "hello", **assistant_fields}]}


@pytest.mark.parametrize("bad_record, problem", [
    ({"conversations": [{"role": "system", "content": "", "tools": "[{not json"},
                        {"role": "assistant", "content": ""}]},
     'message 1: "tools" is not valid JSON'),
    ({"conversations": [{"role": "system", "content": "", "tools": '["get_weather"]'},
                        {"role": "assistant", "content": ""}]},
     'message 1: "tools" must be a list of function specs'),
    (conversation_with(tool_calls="[{\"name\": "), 'message 2: "tool_calls" is not valid JSON'),
    (conversation_with(tool_calls='{"name": "f", "arguments": {}}'), '"tool_calls" must be a list'),
    (conversation_with(tool_calls='[{"arguments": {"city": "Lima"}}]'), '"tool_calls" entry 1 needs a string "name"'),
    (conversation_with(tool_calls=[{"function": {"arguments": "{}"}}]), 'entry 1 needs a string "name"'),
    (conversation_with(tool_calls=[{"name": "f", "arguments": "{oops"}]), "entry 1 arguments\" is not valid JSON"),
    (conversation_with(tool_calls=[{"name": "f"}]), 'entry 1 needs "arguments"'),
    (conversation_with(reasoning_content=7), '"reasoning_content" is int, expected a string'),
    (conversation_with(name="bot"), "fields this trainer does not read: name"),
    ({"conversations": [{"role": "user", "content": 42}, {"role": "assistant", "content": ""}]},
     'message 1: needs string fields "role" and "content"'),
    ({"conversations": [{"role": "robot", "content": "beep"}]}, "message 1: unknown role 'robot'"),
    ({"conversations": [{"role": "user", "content": "hi", "tool_calls": "[]"},
                        {"role": "assistant", "content": ""}]},
     'message 1: a user message has "tool_calls", which belongs to assistant messages'),
    ({"conversations": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "18"}]},
     "no assistant message"),
])
def test_malformed_field_is_refused_with_file_and_line(tmp_path, demo_tokenizer, bad_record, problem):
    good = {"conversations": MESSAGES}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, "", bad_record, good])
    with pytest.raises(ValueError) as excinfo:
        SFTDataset(path, demo_tokenizer, max_seq_len=64)
    message = str(excinfo.value)
    assert f"{path}, line 3: " in message
    assert problem in message


def test_empty_or_null_optional_fields_mean_not_given(tmp_path, demo_tokenizer):
    # minimind's loader writes null for absent fields; "" means none as well.
    messages = [{"role": "system", "content": "Be brief.", "tools": None, "tool_calls": None},
                {"role": "user", "content": "hi", "reasoning_content": None, "tools": ""},
                {"role": "assistant", "content": "hello", "tool_calls": "", "reasoning_content": None}]
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    assert render_chat_text(messages) == render_chat_text(plain)
    assert sft_item(tmp_path, demo_tokenizer, messages) == sft_item(tmp_path, demo_tokenizer, plain)


# ---- (e) augmentations: off by default, deterministic per (seed, epoch, index) ------------------

def augmentation_file(tmp_path: Path, n: int = 60) -> Path:
    records = [{"conversations": [{"role": "user", "content": f"What is {i} + 1?"},
                                  {"role": "assistant", "content": str(i + 1)}]} for i in range(n)]
    records[0] = {"conversations": MESSAGES}  # has tools: never gets a system prompt
    return write_jsonl(tmp_path / "aug.jsonl", records)


def items(dataset: SFTDataset) -> list[list[int]]:
    """The input ids of every item, without the padding."""
    return [[token for token in dataset[i][0].tolist() if token != PAD_ID] for i in range(len(dataset))]


def test_augmentations_off_leave_every_item_as_rendered(tmp_path, demo_tokenizer):
    path = augmentation_file(tmp_path)
    dataset = SFTDataset(path, demo_tokenizer, 1024)
    plain = [dataset.encode_conversation(dataset.source.read(i)["conversations"])[0] for i in range(len(dataset))]
    for epoch in (0, 5):
        dataset.set_epoch(epoch)
        assert items(dataset) == plain


def test_augmentations_are_deterministic_per_seed_epoch_and_index(tmp_path, demo_tokenizer):
    path = augmentation_file(tmp_path)
    ratios = {"system_prompt_ratio": 0.5, "drop_empty_think_ratio": 0.5}
    first, second = (SFTDataset(path, demo_tokenizer, 1024, seed=7, **ratios) for _ in range(2))
    first.set_epoch(3)
    second.set_epoch(3)
    epoch_3 = items(first)
    assert items(second) == epoch_3  # a resumed run (a fresh dataset) sees the same items
    first.set_epoch(3)
    loader = DataLoader(first, batch_size=20, num_workers=2, multiprocessing_context="fork")
    from_workers = [[t for t in row.tolist() if t != PAD_ID] for input_ids, _ in loader for row in input_ids]
    assert from_workers == epoch_3  # and so do DataLoader workers
    first.set_epoch(4)
    epoch_4 = items(first)
    other_seed = SFTDataset(path, demo_tokenizer, 1024, seed=8, **ratios)
    other_seed.set_epoch(3)
    changed = sum(a != b for a, b in zip(epoch_3, epoch_4))
    assert 10 < changed < len(epoch_3) and items(other_seed) != epoch_3


def test_augmentations_do_what_minimind_does(tmp_path, demo_tokenizer):
    path = augmentation_file(tmp_path)
    texts = [demo_tokenizer.decode(row, skip_special_tokens=False) for row in
             items(SFTDataset(path, demo_tokenizer, 1024, system_prompt_ratio=1.0, drop_empty_think_ratio=1.0))]
    # The tool conversation keeps its own system turn and its one think block with reasoning.
    assert texts[0] == EXPECTED_TEXT.replace("<think>\n\n</think>\n\n", "")
    for i, text in enumerate(texts[1:], start=1):
        assert any(text.startswith(f"<|im_start|>system\n{prompt}<|im_end|>\n") for prompt in SYSTEM_PROMPTS)
        assert text.endswith(f"<|im_start|>assistant\n{i + 1}<|im_end|>\n")
    sampled = SFTDataset(path, demo_tokenizer, 1024, system_prompt_ratio=0.2, seed=1)
    with_system = sum(row[1:2] == demo_tokenizer.encode("system").ids for row in items(sampled))
    assert 3 <= with_system <= 24  # about 20 % of 59


def test_augmentation_ratio_outside_0_to_1_is_refused(tmp_path, demo_tokenizer):
    with pytest.raises(ValueError, match="drop_empty_think_ratio is 1.5; it is a probability"):
        SFTDataset(augmentation_file(tmp_path), demo_tokenizer, 64, drop_empty_think_ratio=1.5)


def test_tools_given_apart_render_as_transformers_renders_them_without_a_system_message(tagged_tokenizer):
    """As apply_chat_template(messages, tools=tools): the server and the tool-use score offer tools this way."""
    hf = PreTrainedTokenizerFast(tokenizer_object=tagged_tokenizer, chat_template=CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "Lima?"}]
    text = render_chat_text(messages, add_generation_prompt=True, tools=TOOLS)
    assert text == hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools")  # no empty system text before the tools
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert render_chat_text(with_system, tools=json.dumps(TOOLS)) == hf.apply_chat_template(with_system, tools=TOOLS,
                                                                                           tokenize=False)
    with pytest.raises(ValueError, match="given both apart and in the first message"):
        render_chat_text([{**with_system[0], "tools": TOOLS}, *messages], tools=TOOLS)
    with pytest.raises(ValueError, match='"tools" must be a list of function specs'):
        render_chat_text(messages, tools={"name": "f"})

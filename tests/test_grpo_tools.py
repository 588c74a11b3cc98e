"""Agentic GRPO's rollouts (dataset/tool_rollouts.py, train_grpo.py --max_turns): a real tiny model driven to write a
tool call runs the real tool and continues after its result, appended as the chat template renders it; only the
model's tokens are labelled; a call that hangs gives the model an error and scores 0 without stopping anything; a
planted payload in the arguments runs nothing; the tool reward; a tool the trainer cannot run refused at indexing.
The GRPO guarantees with --max_turns 2 (resume, 2 -> 3 -> 1 ranks) are in tests/test_grpo_runs.py.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from dataset.chat_format import render_segments
from dataset.grpo_dataset import GRPODataset
from dataset.jsonl_file import DataFileError
from dataset.rewards import reward_functions, score_groups
from dataset.lm_dataset import SFTDataset
from dataset.tool_rollouts import ToolCall, check_calls, run_calls, sample_tool_groups, tool_turn
from dataset.tools import DEMO_TOOLS, MAX_RESULT_CHARS, Tool, _spec, run_tool
from model import rollout as engine
from model.model import CausalLM, LMConfig
from model.tokenizer import DEFAULT_TOKENIZER, EOS_ID, load_tokenizer
from test_dpo import TINY, write_jsonl

SYSTEM = {"role": "system", "content": "", "tools": [DEMO_TOOLS["calculator"].spec, DEMO_TOOLS["get_weather"].spec]}
CALCULATOR = {**SYSTEM, "tools": [DEMO_TOOLS["calculator"].spec]}  # a prompt of some 380 tokens, not 530


def tool_questions(count: int, system: dict = SYSTEM) -> list[dict]:
    """`count` prompts offering the demo's tools, "What is i * 7?", with the products as the reference answers."""
    return [{"conversations": [system, {"role": "user", "content": f"What is {i} * 7?"},
                               {"role": "assistant", "content": str(7 * i)}]} for i in range(count)]


def write_tool_caller(out_dir: Path, steps: int = 250) -> Path:
    """A TINY model's FP16 weights as out_dir/full_sft_32.pth (write_reference's file) that answers tool_questions(11,
    CALCULATOR) as it was taught by heart: a calculator call, then the product after the real calculator's result.
    Taught by SFT's own encoding (SFTDataset: the loss on the assistant's turns only) and AdamW on the model's loss,
    4 conversations a step (some 17 s on 2 busy cores). Sampled at temperature 1 (measured on 99 rollouts): 9 in 10
    write a call that validates and runs (150 steps: 5 in 10), the others a call with a token gone astray; 1 in 5
    then answers the product. Real, not scripted, tool use."""
    conversations = []
    for i, record in enumerate(tool_questions(11, CALCULATOR)):
        *question, answer = record["conversations"]
        arguments = {"expression": f"{i} * 7"}
        conversations.append({"conversations": [*question, call("calculator", arguments), {
            "role": "tool", "content": run_tool("calculator", arguments).text}, answer]})
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER)
    dataset = SFTDataset(write_jsonl(out_dir / "tool_calls.jsonl", conversations), tokenizer, 480)
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab_size=tokenizer.get_vocab_size(), **TINY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    # One thread, as the training children (conftest.child_env): on 2 busy cores two threads waited on each other,
    # 120 s against 11 s.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(steps):
            input_ids, labels = map(torch.stack, zip(*(dataset[(4 * step + k) % len(dataset)] for k in range(4))))
            optimizer.param_groups[0]["lr"] = 2e-2 * (1 - step / steps)  # decayed to 0: a steady end, not a spike
            model(input_ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    path = out_dir / "full_sft_32.pth"
    torch.save({name: tensor.half() for name, tensor in model.state_dict().items()}, path)
    return path


class Scripted(CausalLM):
    """A real tiny model whose rows write the given turns in the order their turns begin (a prompt's G rows the same
    first turn), whatever they read: a model driven to call a tool. It stands in for model/rollout.py's forward_rows
    (rollouts_of swaps it in), so the engine's own loop runs: what is drawn, forced, labelled. `asked` keeps what a
    row had read when each of its turns began (the prompt; after a tool turn, the whole rollout so far)."""

    def __init__(self, config: LMConfig, turns: list[list[int]], group_size: int = 2):
        super().__init__(config)
        self.turns, self.asked, self.group_size = list(turns), [], group_size
        self.read, self.writing = {}, {}  # per row: the ids it has read; the rest of the turn it writes
        self.fed = []  # each forward: (its rows, how many ids each read)

    def scripted_logits(self, cache, rows: list[int], ids: torch.Tensor, starts: list[int]) -> torch.Tensor:
        logits = torch.full((len(rows), self.config.vocab_size), float("-inf"))
        self.fed.append((list(rows), ids.shape[1]))
        for i, (row, start) in enumerate(zip(rows, starts)):
            group = range(row, row + self.group_size)
            if start == 0:  # a prompt, read once for its G rows (the engine copies what it read, and these logits)
                self.read.update({r: ids[i].tolist() for r in group})
                self.writing.update({r: list(self.turns[0][1:]) for r in group})  # each row writes the next turn
                self.asked.append(ids[i].clone())
                logits[i, self.turns.pop(0)[0]] = 0.0  # drawn surely
                continue
            self.read[row] += ids[i].tolist()
            if ids.shape[1] > 1:  # a tool turn read after the turn's end: the row writes the next turn
                self.writing[row] = list(self.turns.pop(0))
                self.asked.append(torch.tensor(self.read[row]))
            logits[i, self.writing[row].pop(0) if self.writing[row] else EOS_ID] = 0.0
        return logits


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_TOKENIZER)


def call(name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"name": name, "arguments": arguments}]}


def rendered(dataset: GRPODataset, messages: list[dict]) -> tuple[list[int], list[bool]]:
    return dataset.encoder.encode(render_segments(messages))


def turn_ids(dataset: GRPODataset, messages: list[dict]) -> list[int]:
    """The ids of the last message, an assistant turn, through its <|im_end|>, as the template renders it."""
    before = dataset.encoder.encode(render_segments(messages[:-1], add_generation_prompt=True))[0]
    ids = rendered(dataset, messages)[0]
    return ids[len(before):-1]  # (without the newline after <|im_end|>)


def rollouts_of(dataset: GRPODataset, model: CausalLM, max_turns: int = 2, max_new_tokens: int = 200, **kwargs):
    item = dataset[0]
    batch = [torch.tensor([0]), item[0][None], item[1][None]]
    with pytest.MonkeyPatch.context() as patch:  # the scripted model writes its turns (Scripted)
        patch.setattr(engine, "forward_rows", lambda model, *args: model.scripted_logits(*args))
        return sample_tool_groups(model, batch, dataset, 2, max_new_tokens, 1.0, 7, nullcontext(), max_turns,
                                  **kwargs)


def test_a_called_tool_runs_its_result_is_appended_as_the_template_renders_it_and_only_the_model_is_labelled(
        tmp_path, tokenizer):
    question = [SYSTEM, {"role": "user", "content": "What is 17 * 23?"}]
    data = write_jsonl(tmp_path / "tools.jsonl", [{"conversations": [*question, {"role": "assistant",
                                                                                  "content": "391"}]}])
    dataset = GRPODataset(data, tokenizer, 800, reward_functions("answer,tool"), runs_tools=True)
    calls = [*question, call("calculator", {"expression": "17 * 23"})]
    result = {"role": "tool", "content": json.dumps({"result": 391})}  # what the real calculator answers
    right, wrong = ([*calls, result, {"role": "assistant", "content": answer}] for answer in ("391", "390"))
    torch.manual_seed(0)
    model = Scripted(LMConfig(vocab_size=tokenizer.get_vocab_size(), **TINY),
                     [turn_ids(dataset, calls), turn_ids(dataset, right), turn_ids(dataset, wrong)])
    input_ids, labels, texts, rollouts = rollouts_of(dataset, model)

    # Row 0 is the whole conversation as the template renders it (less the newline after the last <|im_end|>) ...
    ids, trained = rendered(dataset, right)
    assert input_ids[0].tolist() == ids[:-1] and len(model.asked) == 3
    # ... and its labels are the model's two turns through their <|im_end|>, nothing of the prompt or the tool turn
    expected = [t and not (i > 0 and ids[i - 1] == EOS_ID) for i, t in enumerate(trained)][:-1]
    assert (labels[0] != -100).tolist() == expected and torch.equal(labels[0][labels[0] != -100],
                                                                    input_ids[0][labels[0] != -100])
    tool_start = len(dataset[0][0][dataset[0][1] != -100]) + len(turn_ids(dataset, calls))
    tool_end = tool_start + len(dataset.encoder.encode(tool_turn([result["content"]]))[0])
    assert (labels[0, tool_start:tool_end] == -100).all() and (labels[0, tool_end:] != -100).all()
    assert '<tool_response>\n{"result": 391}\n</tool_response>' in dataset.encoder.decode(
        input_ids[0, tool_start:tool_end].tolist())  # the real calculator's result, not trained
    assert model.asked[1].tolist() == ids[:tool_end]  # turn 2 was asked after the result

    assert texts == [["<think>\n\n</think>\n\n391", "<think>\n\n</think>\n\n390"]]  # the final turns
    assert [[call.problem for call in rollout.calls] for rollout in rollouts[0]] == [[None], [None]]
    scores, watched = score_groups(dataset.rewards, texts, ["391"], 2, rollouts)
    assert scores.tolist() == [[2.0, 1.0]]  # answer 1 + tool 1, then answer 0 + tool 1
    # The call reward: both rows called 17 * 23, whose result holds 391, the second answered 390 all the same
    assert score_groups(reward_functions("call"), texts, ["391"], 2, rollouts)[0].tolist() == [[1.0, 1.0]]
    assert [rollout.ran for rollout in rollouts[0]] == [1, 1] and watched[-1] == 2  # the log line's tool_calls: 1
    # One turn (--max_turns 1's length) or no room for the result: the rollout ends with its call, nothing run
    model.turns = [turn_ids(dataset, calls)]
    assert rollouts_of(dataset, model, max_turns=1)[0].shape == (2, len(ids[:tool_start]))
    model.turns = [turn_ids(dataset, calls)]
    short = rollouts_of(dataset, model, max_new_tokens=len(turn_ids(dataset, calls)) + 10)[3][0][0]
    assert short.turns == [dataset.encoder.decode(turn_ids(dataset, calls))] and short.calls[0].problem is None


def test_the_trained_ids_are_the_drawn_ids_and_a_tool_turn_the_templates_ids_read_while_other_rows_go_on(
        tmp_path, tokenizer):
    """Two prompts decoded together: the first's rows call the calculator, whose result is read into their caches as
    the template's tool turn (tool_turn, encoded as the existing code encodes it) while the second's rows go on
    writing a long answer; each row is its prompt, then exactly the ids drawn and forced, and only the drawn are
    labelled."""
    data = write_jsonl(tmp_path / "tools.jsonl", tool_questions(2))
    dataset = GRPODataset(data, tokenizer, 800, reward_functions("tool"), runs_tools=True)
    first, second = (dataset.source.read(i)["conversations"][:2] for i in (0, 1))
    calls = [*first, call("calculator", {"expression": "0 * 7"})]
    result = run_tool("calculator", {"expression": "0 * 7"}).text
    answer = turn_ids(dataset, [*calls, {"role": "tool", "content": result}, {"role": "assistant", "content": "0"}])
    long_answer = turn_ids(dataset, [*second, {"role": "assistant", "content": "7 " * 40}])
    model = Scripted(LMConfig(vocab_size=tokenizer.get_vocab_size(), **TINY),
                     [turn_ids(dataset, calls), long_answer, answer, answer])
    items = [dataset[0], dataset[1]]
    batch = [torch.tensor([0, 1]), *(torch.stack(column) for column in zip(*items))]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "forward_rows", lambda model, *args: model.scripted_logits(*args))
        input_ids, labels, texts, rollouts = sample_tool_groups(model, batch, dataset, 2, 200, 1.0, 7, nullcontext(),
                                                                2)
    prompts = [ids[labels != -100].tolist() for ids, labels in items]
    tool_ids = dataset.encoder.encode(tool_turn([result]))[0]  # the template's pieces around the result
    for row in range(4):
        drawn = [turn_ids(dataset, calls), answer] if row < 2 else [long_answer]
        rollout = prompts[row // 2] + (drawn[0] + tool_ids + drawn[1] if row < 2 else drawn[0])
        assert input_ids[row, :len(rollout)].tolist() == rollout and (input_ids[row, len(rollout):] == 0).all()
        assert labels[row][labels[row] != -100].tolist() == sum(drawn, [])  # the drawn ids only, in order
    assert [rollout.ran for rollout in rollouts[0]] == [1, 1] and [r.ran for r in rollouts[1]] == [0, 0]
    assert texts[1] == [dataset.encoder.decode(long_answer)] * 2
    # The tool turn was read (a chunk for one row) while the second prompt's rows were still writing (decoded after)
    chunk = model.fed.index(([0], len(tool_ids) + 1))  # (the turn's end of text, then the tool turn)
    assert any(2 in rows for rows, _ in model.fed[chunk + 1:]) and model.asked[2].tolist() == \
        prompts[0] + turn_ids(dataset, calls) + tool_ids


def test_a_tool_that_hangs_gives_the_model_an_error_scores_0_and_training_goes_on(tmp_path, tokenizer, monkeypatch):
    def sleepy(city: str) -> dict:
        time.sleep(30)
        return {}

    monkeypatch.setitem(DEMO_TOOLS, "sleepy", Tool(_spec("sleepy", "Hangs", "city"), sleepy))
    system = {**SYSTEM, "tools": [DEMO_TOOLS["sleepy"].spec]}
    question = [system, {"role": "user", "content": "Weather?"}]
    data = write_jsonl(tmp_path / "tools.jsonl", [{"conversations": [*question, {"role": "assistant",
                                                                                  "content": "sunny"}]}])
    dataset = GRPODataset(data, tokenizer, 800, reward_functions("tool"), runs_tools=True)
    calls = [*question, call("sleepy", {"city": "Lima"})]
    answer = turn_ids(dataset, [*calls, {"role": "tool", "content": "{}"}, {"role": "assistant", "content": "?"}])
    model = Scripted(LMConfig(vocab_size=tokenizer.get_vocab_size(), **TINY), [turn_ids(dataset, calls), answer,
                                                                               answer])
    started = time.monotonic()
    _, _, texts, rollouts = rollouts_of(dataset, model, time_limit_s=0.5)
    assert time.monotonic() - started < 10  # stopped at its limit, twice
    read = dataset.encoder.decode(model.asked[1].tolist())
    assert '{"error": "tool sleepy: no result in 0.5 s; stopped"}' in read, read[-200:]
    assert score_groups(dataset.rewards, texts, [None], 2, rollouts)[0].tolist() == [[0.0, 0.0]]


def test_a_planted_payload_in_the_arguments_runs_nothing(tmp_path, tokenizer):
    marker = tmp_path / "ran"
    payload = f"__import__('os').system('touch {marker}')"
    data = write_jsonl(tmp_path / "tools.jsonl", tool_questions(1))
    dataset = GRPODataset(data, tokenizer, 800, reward_functions("tool"), runs_tools=True)
    question = dataset.source.read(0)["conversations"][:2]
    calls = [*question, call("calculator", {"expression": payload})]
    answer = turn_ids(dataset, [*calls, {"role": "tool", "content": "{}"}, {"role": "assistant", "content": "0"}])
    model = Scripted(LMConfig(vocab_size=tokenizer.get_vocab_size(), **TINY), [turn_ids(dataset, calls), answer,
                                                                               answer])
    rollouts_of(dataset, model)
    read = dataset.encoder.decode(model.asked[1].tolist())
    assert '{"error": "Call is not arithmetic' in read and not marker.exists(), read[-300:]


def test_the_tool_reward_is_the_share_of_calls_that_validate():
    offered = {"calculator": DEMO_TOOLS["calculator"]}

    def calls(*blocks: str) -> str:
        return "<think>\n\n</think>\n\n" + "\n".join(f"<tool_call>\n{block}\n</tool_call>" for block in blocks)

    good = '{"name": "calculator", "arguments": {"expression": "1+1"}}'
    other = '{"name": "get_weather", "arguments": {"city": "Lima"}}'  # a real tool, but not offered
    bad_arguments = '{"name": "calculator", "arguments": {"expression": 3}}'
    checked = [check_calls(text, offered) for text in (calls(good, other), calls(good, bad_arguments, good),
                                                       calls('{"name": "calculator"'), "no call: 2")]
    assert [well_formed for _, well_formed in checked] == [True, True, False, True]
    rollouts = [type("Rollout", (), {"calls": made})() for made, _ in checked]
    assert reward_functions("tool")["tool"](["", "", "", ""], [None] * 4, rollouts) == [0.5, 2 / 3, 0.0, 0.0]
    assert checked[2][0][0].problem.startswith("malformed: tool call 1 is not JSON")
    assert checked[0][0][1].problem == "no tool named 'get_weather' is offered"


def test_a_tool_the_trainer_does_not_run_is_refused_when_the_file_is_indexed_naming_the_line(tmp_path, tokenizer):
    records = tool_questions(3)
    records[1]["conversations"][0] = {**SYSTEM, "tools": json.dumps([_spec("get_time", "The time", "zone")])}
    data = write_jsonl(tmp_path / "tools.jsonl", records)
    with pytest.raises(DataFileError) as refused:
        GRPODataset(data, tokenizer, 800, reward_functions("answer"), runs_tools=True)
    assert str(refused.value).startswith(f"{data}, line 2: ") and "'get_time', which is not a tool this trainer " \
        "runs (dataset/tools.py's DEMO_TOOLS: calculator, get_weather)" in str(refused.value)
    assert len(GRPODataset(data, tokenizer, 800, reward_functions("answer"))) == 3  # one turn: no tool runs


CALCULATOR_PARAMETERS = DEMO_TOOLS["calculator"].spec["function"]["parameters"]


@pytest.mark.parametrize("parameters, difference", [
    ({**CALCULATOR_PARAMETERS, "properties": {"expression": {"type": "integer"}}},
     'parameters.properties.expression.type is "integer" here, "string" in the tool\'s schema'),
    ({**CALCULATOR_PARAMETERS, "additionalProperties": True}, "parameters.additionalProperties is not in the tool's "
                                                               "schema"),
    ({"type": "object", "properties": {"expression": {"type": "string"}}},
     'parameters.required is missing (the tool\'s: ["expression"])'),
], ids=["another_type", "a_keyword_more", "a_keyword_less"])
def test_a_prompt_showing_other_parameters_than_its_tool_runs_with_is_refused_naming_the_line(
        tmp_path, tokenizer, parameters, difference):
    records = tool_questions(3)
    shown = {"type": "function", "function": {**DEMO_TOOLS["calculator"].spec["function"], "parameters": parameters}}
    records[2]["conversations"][0] = {**SYSTEM, "tools": [DEMO_TOOLS["get_weather"].spec, shown]}
    data = write_jsonl(tmp_path / "tools.jsonl", records)
    with pytest.raises(DataFileError) as refused:
        GRPODataset(data, tokenizer, 800, reward_functions("answer"), runs_tools=True)
    assert str(refused.value).startswith(
        f"{data}, line 3: \"tools\" offers 'calculator' with other parameters than it runs with (dataset/tools.py): "
        f"{difference}; show its spec as DEMO_TOOLS['calculator'].spec writes it"), str(refused.value)
    assert len(GRPODataset(data, tokenizer, 800, reward_functions("answer"))) == 3  # one turn: shown, nothing runs


@pytest.mark.parametrize("number, runs_tools", [(float("nan"), True), (float("inf"), False)],
                         ids=["nan_tools_run", "infinity_one_turn"])
def test_nan_or_infinity_in_a_prompts_tool_spec_is_refused_naming_the_line(tmp_path, tokenizer, number, runs_tools):
    records = tool_questions(2)
    parameters = {**CALCULATOR_PARAMETERS, "properties": {"expression": {"type": "string", "maxLength": number}}}
    shown = {"type": "function", "function": {**DEMO_TOOLS["calculator"].spec["function"], "parameters": parameters}}
    records[1]["conversations"][0] = {**SYSTEM, "tools": json.dumps([shown])}  # NaN or Infinity, as json.dumps writes
    data = write_jsonl(tmp_path / "tools.jsonl", records)
    with pytest.raises(DataFileError) as refused:
        GRPODataset(data, tokenizer, 800, reward_functions("answer"), runs_tools=runs_tools)
    assert str(refused.value).startswith(
        f'{data}, line 2: "tools"[0].function.parameters.properties.expression.maxLength is NaN or an infinity, which '
        f'JSON has no number for'), str(refused.value)


def test_the_line_a_failed_call_gives_the_model_is_bounded_too():
    def raises_at_length(city: str):
        raise KeyError(city * 100_000)

    loud = {"loud": Tool(_spec("loud", "Raises a long message", "city"), raises_at_length)}
    results, checked = run_calls([ToolCall("loud", {"city": "a"}, None)], loud, 2.0)
    assert len(results[0]) <= MAX_RESULT_CHARS and json.loads(results[0])["error"] == checked[0].problem
    assert checked[0].problem.startswith("tool loud: raised KeyError: 'aaa") and "characters cut" in results[0]


def test_the_call_reward_pays_a_call_whose_result_holds_the_answers_number_and_nothing_else():
    """The real tools' results (run_calls): a call with the right arguments is paid whatever the final answer says;
    other arguments, an error the tool answers, no call, or an answer without one number are not."""
    from dataset.rewards import call_reward
    from dataset.tool_rollouts import Rollout

    def rollout_of(*calls):
        made = [ToolCall(name, arguments, None) for name, arguments in calls]
        return Rollout(["..."], run_calls(made, DEMO_TOOLS, 2.0)[1], len(made))

    rollouts = [rollout_of(("calculator", {"expression": "69*98"})),  # {"result": 6762}
                rollout_of(("calculator", {"expression": "69*97"})),  # another number
                rollout_of(("calculator", {"expression": "1/0"})),  # the model reads {"error": ...}: no number
                rollout_of(("get_weather", {"city": "Paris"})),  # {"temperature_c": ...}
                rollout_of(("calculator", {"expression": "69*97"}), ("calculator", {"expression": "69*98"})),
                Rollout(["6762"], [], 0)]  # the right answer without a call
    paris = json.loads(run_tool("get_weather", {"city": "Paris"}).text)["temperature_c"]
    answers = ["6762", "6762", "6762", f"{paris}°C", "6762", "6762"]
    assert call_reward(["wrong"] * 6, answers, rollouts) == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert json.loads(rollouts[2].calls[0].result) == {"error": "division by zero"}
    assert call_reward(["x"], ["no number"], rollouts[:1]) == [0.0]

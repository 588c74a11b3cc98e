"""Multiple-choice scoring (eval_choices.py, `eval_model.py --mc_data`) on our weights and on their Hugging
Face export, and lm-eval, the standard harness, run on that export: the same items give the same picks.

One tiny model with random weights (fixed seed) is made once for the module: the comparison is of the
scoring, not of the model's knowledge. The items are chosen so that its picks differ from item to item
and from metric to metric, so a scorer that differs from lm-eval anywhere shows here. The lm-eval run
takes 25 to 45 s on two CPU cores, so it runs when TRAINER_SLOW_TESTS=1 (as in .ci/run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Everything here is local: never reach for the Hub. Set before transformers or datasets read it.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import eval_model  # noqa: E402
from conftest import REPO, child_env  # noqa: E402
from eval_choices import (TARGET_DELIMITER, ChoiceItem, choice_loglikelihoods, encode_pair, load_hf_model,  # noqa: E402
                          picks, read_choice_items, score_choices)
from model.model import CausalLM, LMConfig  # noqa: E402
from model.tokenizer import chars_for_tokens, load_tokenizer  # noqa: E402
from scripts import export_hf  # noqa: E402

# English and Chinese, 2 to 4 choices; contexts ending in ":", "：", "\n" and a space (the space
# moves to the continuation, as lm-eval moves it).
ITEMS = [
    {"question": "Question: What is the capital of France?\nAnswer:", "choices": ["Paris", "Lyon", "Marseille", "Nice"], "answer": 0},
    {"question": "Question: Which animal says moo?\nAnswer:", "choices": ["a cow", "a cat", "a small dog"], "answer": 0},
    {"question": "2 + 3 =", "choices": ["5", "six", "4", "fifty-five"], "answer": 0},
    {"question": "中国的首都是", "choices": ["北京", "上海", "广州市", "深圳"], "answer": 0},
    {"question": "下列哪个是水果？\nA. 苹果\nB. 白菜\n答案：", "choices": ["A", "B"], "answer": 0},
    {"question": "The sky on a clear day is ", "choices": ["blue", "green", "red as blood", "white"], "answer": 0},
    {"question": "Once upon a time there was a\n", "choices": ["princess", "dragon", "tiny little mouse"], "answer": 2},
    {"question": "5加7等于几？", "choices": ["七", "8", "十二", "63"], "answer": 2},
    {"question": "Question: Which is a number?\nAnswer:", "choices": ["seven", "table", "the quick brown fox"], "answer": 0},
    {"question": "The opposite of hot is", "choices": ["cold", "warm", "freezing cold", "icy"], "answer": 0},
    {"question": "小猫怎么叫？", "choices": ["喵喵", "汪汪汪", "哞"], "answer": 0},
    {"question": "Water boils at", "choices": ["100 degrees", "10 degrees", "one thousand degrees"], "answer": 0},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """out/pretrain_64.pth (FP16, random weights, the real tokenizer), its FP32 export, the items file."""
    root = tmp_path_factory.mktemp("choices")
    vocab_size = load_tokenizer().get_vocab_size()
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2))
    (root / "out").mkdir()
    torch.save({name: t.half() for name, t in model.state_dict().items()}, root / "out" / "pretrain_64.pth")
    # FP32 export of the FP16 file: both sides then compute in FP32 from the same rounded weights.
    assert export_hf.main([str(root / "out" / "pretrain_64.pth"), "-o", str(root / "hf"), "--dtype", "float32"]) == 0
    (root / "items.jsonl").write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in ITEMS),
                                      encoding="utf-8")
    return {"root": root, "out": root / "out", "hf": root / "hf", "items": root / "items.jsonl"}


def our_loglikelihoods(tiny, batch_size: int) -> list[list[float]]:
    args = eval_model.build_arg_parser().parse_args(["--weight", "pretrain", "--save_dir", str(tiny["out"]),
                                                     "--device", "cpu"])
    tokenizer = load_tokenizer(args.tokenizer_path)
    model = eval_model.load_model(args, tokenizer, torch.device("cpu"))
    items = read_choice_items(tiny["items"])
    return choice_loglikelihoods(model, lambda text: tokenizer.encode(text).ids, items,
                                 model.config.max_position_embeddings, batch_size, progress=False)


def export_loglikelihoods(tiny, batch_size: int) -> list[list[float]]:
    model, encode = load_hf_model(tiny["hf"], torch.device("cpu"))
    return choice_loglikelihoods(model, encode, read_choice_items(tiny["items"]),
                                 model.config.max_position_embeddings, batch_size, progress=False)


def assert_same_picks(items, ours: list[list[float]], theirs: list[list[float]]) -> None:
    for n, (item, a, b) in enumerate(zip(items, ours, theirs), start=1):
        assert a == pytest.approx(b, abs=1e-4), f"item {n}: log-likelihoods differ"
        assert picks(item, a) == picks(item, b), f"item {n}: picks differ"


# ---- reading the file ------------------------------------------------------------------------

def test_answer_as_a_letter_is_the_same_item_as_its_index(tmp_path):
    path = tmp_path / "items.jsonl"
    lines = [{"question": "q?", "choices": ["x", "y", "z"], "answer": a} for a in (2, "C", "c", " C ")]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n", encoding="utf-8")  # a blank line is skipped
    assert [item.answer for item in read_choice_items(path)] == [2, 2, 2, 2]


@pytest.mark.parametrize("line, complaint", [
    ('{"question": "q?", "choices": ["x", "y"], "answer": 2}', '"answer" must be an index 0..1 or a letter A..B'),
    ('{"question": "q?", "choices": ["x", "y"], "answer": "C"}', '"answer" must be an index 0..1'),
    # the letter as written, not the index it stands for (before: "got 25")
    ('{"question": "q?", "choices": ["x", "y"], "answer": "Z"}', 'letter A..B (got "Z")'),
    ('{"question": "q?", "choices": ["x", "y"], "answer": true}', '"answer" must be an index 0..1 or a letter A..B '
                                                                  '(got true)'),
    ('{"question": "q?", "choices": ["x"], "answer": 0}', '"choices" must be a list of at least two'),
    ('{"question": "q?", "choices": ["x", ""], "answer": 0}', '"choices" must be a list of at least two non-empty'),
    ('{"question": " ", "choices": ["x", "y"], "answer": 0}', '"question" must be a non-empty string'),
    ('["q?", ["x", "y"], 0]', "expected a JSON object, got list"),
    ('{"question": "q?", "choices": ["x", "y"], "answer": 0', "Expecting ','"),
], ids=["index-too-big", "letter-too-big", "letter-z", "bool", "one-choice", "empty-choice", "blank-question", "not-an-object",
        "broken-json"])
def test_a_bad_line_exits_2_with_one_line_naming_file_and_line(tmp_path, capsys, line, complaint):
    path = tmp_path / "items.jsonl"
    good = json.dumps(ITEMS[0])
    path.write_text(f"{good}\n{good}\n{line}\n{good}\n", encoding="utf-8")
    # The file is read before any model is loaded: --save_dir holds none, and the error is still the file's.
    assert eval_model.main(["--mc_data", str(path), "--save_dir", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {path}, line 3: ") and complaint in err
    assert err.endswith("Fix or delete this line, then start again.")  # as every data file's (dataset/jsonl_file.py)


# ---- a question longer than the model reads ------------------------------------------------------

def test_a_question_of_megabytes_is_cut_at_the_trained_length_and_counted(tiny, tmp_path, capsys):
    """Before: cut at the model's 32,768 positions, not at the length it was trained at, and tokenized whole:
    a 6 MB question among five items took 123 s."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(tiny["out"] / "pretrain_64.pth", out)
    (out / "pretrain_64.json").write_text('{"max_seq_len": 48}')  # as training writes it beside the weights
    long = dict(ITEMS[0], question="The sky is blue today. " * 270_000 + ITEMS[0]["question"])  # 6.2 MB
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in [*ITEMS[1:3], long, *ITEMS[3:5]]),
                    encoding="utf-8")
    started = time.monotonic()
    assert eval_model.main(["--mc_data", str(path), "--weight", "pretrain", "--save_dir", str(out),
                            "--device", "cpu"]) == 0
    took = time.monotonic() - started
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert "note: 1 of 5 items are longer than the 48 tokens the model reads: each question lost its start" \
        in captured.out, captured.out
    assert "multiple choice, 5 items" in captured.out
    assert took < 60, took  # a few seconds, most of it reading the 6 MB line; before: 123 s


def test_a_question_cut_before_it_is_tokenized_scores_as_the_whole_question(tiny):
    args = eval_model.build_arg_parser().parse_args(["--weight", "pretrain", "--save_dir", str(tiny["out"]),
                                                     "--device", "cpu"])
    tokenizer = load_tokenizer(args.tokenizer_path)
    model = eval_model.load_model(args, tokenizer, torch.device("cpu"))
    encode = lambda text: tokenizer.encode(text).ids  # noqa: E731
    # 200 kB: long enough to be cut (chars_for_tokens(49) is about 10 kB), short enough to tokenize whole here
    items = [ChoiceItem("Once upon a time 木 " * 10_000 + item["question"], item["choices"], item["answer"])
             for item in ITEMS[:3]]
    max_chars = chars_for_tokens(48 + 1, tokenizer)
    assert all(len(item.question) > max_chars for item in items)
    lines = []
    cut = choice_loglikelihoods(model, encode, items, 48, progress=False, max_chars=max_chars, log=lines.append)
    assert cut == choice_loglikelihoods(model, encode, items, 48, progress=False)  # tokenized whole: the same
    assert lines == ["note: 3 of 3 items are longer than the 48 tokens the model reads: each question lost its start "
                     "(cut at the left, as lm-eval cuts)"]
    too_long = [ChoiceItem("q?", ["yes", "no " * 200], 0)]
    with pytest.raises(ValueError, match=r"item 1, choice 2: 600 characters, more tokens than the 48 the model reads"):
        choice_loglikelihoods(model, encode, too_long, 48, progress=False, max_chars=max_chars)


# ---- the scorer ------------------------------------------------------------------------------

def test_trailing_spaces_of_the_question_move_to_the_choice():
    encode = load_tokenizer().encode
    context, choice = encode_pair(lambda text: encode(text).ids, "The sky is \n", TARGET_DELIMITER + "blue")
    assert context == encode("The sky is").ids
    assert context + choice == encode("The sky is \n blue").ids


def test_accuracy_centred_on_chance():
    # Two items, of 2 and of 4 equally long choices; the first is picked right, the second wrong.
    items = [ChoiceItem("q?", ["x0", "x1"], 0), ChoiceItem("q?", ["y0", "y1", "y2", "y3"], 0)]
    scores = score_choices(items, [[0.0, -1.0], [-1.0, 0.0, -2.0, -3.0]])
    chance = (1 / 2 + 1 / 4) / 2  # the mean of 1/len(choices)
    assert scores["chance"] == chance
    assert scores["acc"] == 0.5 and scores["acc_centred"] == (0.5 - chance) / (1 - chance)


def test_per_character_and_per_byte_picks_differ_where_the_lengths_do():
    item = ChoiceItem("q?", ["ab", "北"], 0)  # 2 characters, 2 bytes / 1 character, 3 bytes
    assert picks(item, [-2.0, -1.5]) == {"acc": 1, "acc_norm": 0, "acc_bytes": 1}


def test_our_weights_and_their_export_pick_the_same_choices_batched_or_not(tiny):
    items = read_choice_items(tiny["items"])
    ours = our_loglikelihoods(tiny, batch_size=1)
    assert_same_picks(items, ours, our_loglikelihoods(tiny, batch_size=7))  # padding changes nothing
    assert_same_picks(items, ours, export_loglikelihoods(tiny, batch_size=5))
    # The comparison can fail: the picks vary from item to item, and some item is right by one metric and
    # wrong by the next, so a scorer (or lm-eval) dividing by the wrong length scores differently...
    chosen = [picks(item, lls) for item, lls in zip(items, ours)]
    assert len({p["acc"] for p in chosen}) > 1
    right = [{metric: pick == item.answer for metric, pick in p.items()} for p, item in zip(chosen, items)]
    assert any(r["acc"] != r["acc_norm"] for r in right) and any(r["acc_norm"] != r["acc_bytes"] for r in right)
    # ...and cannot fail by rounding: every pick wins by far more than FP32 sums differ by (~1e-5).
    assert smallest_margin(items, ours) > 1e-3


def smallest_margin(items, loglikelihoods: list[list[float]]) -> float:
    """The smallest gap, over items and metrics, between the picked choice's score and the next one's."""
    gaps = []
    for item, lls in zip(items, loglikelihoods):
        for divisors in ([1] * len(lls), [len(c) for c in item.choices], [len(c.encode()) for c in item.choices]):
            best, second = sorted((ll / d for ll, d in zip(lls, divisors)), reverse=True)[:2]
            gaps.append(best - second)
    return min(gaps)


def test_eval_model_mc_data_prints_the_same_scores_for_the_weights_and_the_export(tiny, capsys):
    assert eval_model.main(["--weight", "pretrain", "--save_dir", str(tiny["out"]), "--device", "cpu",
                            "--mc_data", str(tiny["items"])]) == 0
    ours = capsys.readouterr().out
    assert eval_model.main(["--hf_model", str(tiny["hf"]), "--device", "cpu", "--mc_data", str(tiny["items"])]) == 0
    theirs = capsys.readouterr().out
    assert ours == theirs
    scores = score_choices(read_choice_items(tiny["items"]), our_loglikelihoods(tiny, batch_size=16))
    assert f"acc_norm  {scores['acc_norm']:.4f}   centred on chance {scores['acc_norm_centred']:+.4f}" in ours


# ---- lm-eval on the export -------------------------------------------------------------------

TASK_YAML = """\
task: local_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
  - metric: acc_bytes
"""


@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="lm-eval takes 25 to 45 s on two CPU cores; set TRAINER_SLOW_TESTS=1 to run it")
def test_lm_eval_on_the_export_scores_like_eval_choices(tiny):
    root = tiny["root"]
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "local_choices.yaml").write_text(TASK_YAML.format(items=tiny["items"]), encoding="utf-8")
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={tiny['hf']},dtype=float32",
               "--tasks", "local_choices", "--include_path", str(tasks), "--device", "cpu", "--batch_size", "4",
               "--output_path", str(root / "lm_eval"), "--log_samples"]
    # Its caches in the test's folder; offline, as everything here.
    env = child_env(HF_HOME=root / "hf_home", HF_DATASETS_OFFLINE=1)
    start = time.monotonic()
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    print(f"lm-eval took {time.monotonic() - start:.1f} s")
    assert result.returncode == 0, result.stderr[-3000:]

    [samples_file] = (root / "lm_eval").rglob("samples_local_choices_*.jsonl")
    [results_file] = (root / "lm_eval").rglob("results_*.json")
    samples = sorted((json.loads(line) for line in samples_file.read_text(encoding="utf-8").splitlines()),
                     key=lambda s: s["doc_id"])
    items = read_choice_items(tiny["items"])
    assert len(samples) == len(items)
    ours = our_loglikelihoods(tiny, batch_size=16)
    for item, sample, lls in zip(items, samples, ours):
        # lm-eval asked for the contexts and continuations eval_choices scores...
        asked = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        assert asked == [(item.question, TARGET_DELIMITER + c) for c in item.choices]
        # ...got the same log-likelihoods, and so the same picks, right or wrong.
        theirs = [float(ll) for ll, _ in sample["filtered_resps"]]
        assert theirs == pytest.approx(lls, abs=1e-4)
        mine = picks(item, lls)
        for metric in ("acc", "acc_norm", "acc_bytes"):
            assert sample[metric] == float(mine[metric] == item.answer), f"doc {sample['doc_id']}: {metric}"

    scores = score_choices(items, ours)
    reported = json.loads(results_file.read_text(encoding="utf-8"))["results"]["local_choices"]
    print("metric     eval_choices  lm-eval")
    for metric in ("acc", "acc_norm", "acc_bytes"):
        print(f"{metric:<10} {scores[metric]:.4f}        {reported[f'{metric},none']:.4f}")
        assert reported[f"{metric},none"] == pytest.approx(scores[metric], abs=1e-9)


# ---- the shipped task files: dataset/lm_eval_tasks/ -----------------------------------------------

@pytest.mark.skipif(os.environ.get("TRAINER_SLOW_TESTS") != "1",
                    reason="lm-eval takes 30 to 60 s on two CPU cores; set TRAINER_SLOW_TESTS=1 to run it")
def test_the_shipped_task_files_run_as_the_readme_shows_with_answers_as_indices_or_letters(tiny):
    # A folder laid out as the repository root, where the README runs lm_eval: dataset/mc_demo.jsonl (the demo's
    # items, "answer" an index) and the user's my_choices.jsonl (the same items, "answer" a letter as often as not).
    here = tiny["root"] / "clone"
    (here / "dataset").mkdir(parents=True)
    shutil.copy(REPO / "dataset" / "mc_demo.jsonl", here / "dataset" / "mc_demo.jsonl")
    lines = [json.loads(line) for line in (REPO / "dataset" / "mc_demo.jsonl").read_text(encoding="utf-8").splitlines()]
    for n, line in enumerate(lines):
        if n % 2:
            line["answer"] = "abcd"[line["answer"]] if n % 4 == 1 else " " + "ABCD"[line["answer"]]
    (here / "my_choices.jsonl").write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines),
                                           encoding="utf-8")
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={tiny['hf']},dtype=float32",
               "--include_path", str(REPO / "dataset" / "lm_eval_tasks"), "--tasks", "mc_demo,my_choices",
               "--device", "cpu", "--batch_size", "16", "--output_path", str(here / "lm_eval")]
    result = subprocess.run(command, cwd=here, env=child_env(HF_HOME=here / "hf_home", HF_DATASETS_OFFLINE=1),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]

    [results_file] = (here / "lm_eval").rglob("results_*.json")
    reported = json.loads(results_file.read_text(encoding="utf-8"))["results"]
    items = read_choice_items(here / "my_choices.jsonl")  # letters read as indices, as eval_model.py reads them
    assert [item.answer for item in items] == [item.answer for item in read_choice_items(REPO / "dataset" / "mc_demo.jsonl")]
    model, encode = load_hf_model(tiny["hf"], torch.device("cpu"))
    scores = score_choices(items, choice_loglikelihoods(model, encode, items, model.config.max_position_embeddings,
                                                        16, progress=False))
    assert scores["acc"] > 0.1  # the random model gets items right: a letter read as no choice would lower the score
    for task in ("mc_demo", "my_choices"):
        for metric in ("acc", "acc_norm", "acc_bytes"):
            assert reported[task][f"{metric},none"] == pytest.approx(scores[metric], abs=1e-9), (task, metric)

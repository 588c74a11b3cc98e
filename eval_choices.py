"""Multiple-choice scoring by log-likelihood, the way lm-eval scores C-Eval, CMMLU, ARC, HellaSwag, MMLU.

For each item the model reads the question and, once per choice, the choice after it; the choice
whose tokens get the highest total log-probability is the model's pick. Nothing is generated, so a
pretrained model that never saw a chat can be scored too. Run it through eval_model.py:

    python eval_model.py --weight pretrain --mc_data my_choices.jsonl
    python eval_model.py --hf_model hf_model --mc_data my_choices.jsonl   # a scripts/export_hf.py folder

Each line of the file: {"question": "...", "choices": ["...", "..."], "answer": 1} (the answer an
index from 0, or a letter "A", "B", ...). The question is the whole context, written as the model
should see it ("Question: ...\nAnswer:" is ARC's); a choice is scored as " " + choice.

It is lm-eval's `output_type: multiple_choice` with `doc_to_text: question`, `doc_to_choice: choices`,
`doc_to_target: answer`, zero-shot (tests/test_eval_choices.py runs lm-eval and compares), and it
reports lm-eval's three picks:
    acc        the highest summed log-probability
    acc_norm   the highest log-probability per character of the choice (lm-eval's acc_norm divides
               by len(choice), characters, not tokens or bytes)
    acc_bytes  the highest log-probability per UTF-8 byte of the choice
each also centred on chance: (acc - chance) / (1 - chance), chance being the mean of 1/len(choices),
so 0 is guessing and 1 is every item right whatever the number of choices.

Preference pairs (DPO's data, dataset/dpo_dataset.py) are scored the same way, two choices to a prompt:

    python eval_model.py --weight dpo --pairs_data dataset/dpo_demo.jsonl --ref_weight full_sft

accuracy: the share of pairs whose chosen answer has the higher summed log-probability; with a reference
model, reward_accuracy: the share whose DPO implicit reward, log p(answer) - log p_ref(answer), is higher
for the chosen answer (what DPO training raises; trainer/train_dpo.py's validation accuracy).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from dataset.jsonl_file import JsonlFile

TARGET_DELIMITER = " "  # lm-eval's default target_delimiter, between the question and each choice
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass
class ChoiceItem:
    question: str
    choices: list[str]
    answer: int  # index into choices


# ---- reading the file ------------------------------------------------------------------------

def parse_choice_item(record: object) -> ChoiceItem:
    """One JSONL record as a ChoiceItem; ValueError says what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError('each line must be a JSON object {"question": ..., "choices": [...], "answer": ...}')
    question, choices, answer = record.get("question"), record.get("choices"), record.get("answer")
    # lm-eval cannot score an empty context (its trailing spaces move to the continuation, see encode_pair).
    if not isinstance(question, str) or not question.strip():
        raise ValueError('"question" must be a non-empty string')
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ValueError('"choices" must be a list of at least two non-empty strings')
    written = answer
    if isinstance(answer, str) and len(answer.strip()) == 1 and answer.strip().upper() in LETTERS:
        answer = LETTERS.index(answer.strip().upper())
    # bool is an int in Python; "answer": true is a mistake, not index 1.
    if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
        # the answer as the file wrote it: "Z" of two choices, not the index 25 it was read as
        raise ValueError(f'"answer" must be an index 0..{len(choices) - 1} or a letter '
                         f'A..{LETTERS[len(choices) - 1]} (got {json.dumps(written, ensure_ascii=False)})')
    return ChoiceItem(question, choices, answer)


def read_choice_items(path: str | Path) -> list[ChoiceItem]:
    """Every item of a JSONL file, indexed and checked as the trainer's data is (dataset/jsonl_file.py): a
    DataFileError (a ValueError) names the file, the line and the fix for the first bad line."""
    source = JsonlFile(path, validate=parse_choice_item)
    return [parse_choice_item(source.read(i)) for i in range(len(source))]


# ---- log-likelihoods -------------------------------------------------------------------------

def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of (context, continuation), split as lm-eval's `_encode_pair` splits them."""
    # Trailing spaces of the context go to the continuation: a BPE tokenizer glues a space to the word
    # after it (" Paris" is one token), so "Answer: " + "Paris" would give tokens no text ever has.
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    # The whole text is encoded once and cut after the context's tokens, so the continuation's tokens
    # are those of the text the model would really read, even where a token spans the boundary.
    whole = encode(context + continuation)
    context_ids = encode(context)
    return context_ids, whole[len(context_ids):]


def choice_loglikelihoods(model: torch.nn.Module, encode: Callable[[str], list[int]], items: list[ChoiceItem],
                          max_length: int, batch_size: int = 16, pad_id: int = 0, progress: bool = True,
                          max_chars: int | None = None, log: Callable[[str], None] | None = None) -> list[list[float]]:
    """For each item, the summed log-probability of each choice's tokens given the question.

    `model(ids).logits` is the model's output, ours or a transformers one; `encode` is its
    tokenizer; `max_length` the tokens it reads (the length it was trained at): longer texts lose
    tokens at the left, as in lm-eval, and `log` gets one line counting the items cut. `max_chars`
    (model/tokenizer.chars_for_tokens(max_length + 1)): a question is cut at the left to that many
    characters before it is tokenized, so a question of megabytes costs no more than one that fills
    the model. A choice longer than the model reads raises ValueError naming the item.
    """
    requests = []  # (item index, choice index, input ids, number of continuation tokens)
    cut = set()  # the items whose question lost tokens at the left
    for i, item in enumerate(items):
        question = item.question if max_chars is None else item.question[-max_chars:]
        for j, choice in enumerate(item.choices):
            # a choice of more characters than max_chars has more tokens than max_length: refused untokenized
            too_long = max_chars is not None and len(choice) > max_chars
            context_ids, choice_ids = ([], []) if too_long else encode_pair(encode, question, TARGET_DELIMITER + choice)
            if too_long or len(choice_ids) > max_length:
                raise ValueError(f"item {i + 1}, choice {j + 1}: {len(choice)} characters, more tokens than the "
                                 f"{max_length} the model reads with the question; shorten the choice")
            # The model predicts token t from the tokens before it: the input is the text less its
            # last token, and the last len(choice_ids) outputs score the choice's tokens.
            ids = (context_ids + choice_ids)[-(max_length + 1):][:-1]
            if len(context_ids) + len(choice_ids) > max_length + 1:
                cut.add(i)
            requests.append((i, j, ids, choice_ids))
    if cut and log is not None:
        log(f"note: {len(cut)} of {len(items)} items are longer than the {max_length} tokens the model reads: each "
            f"question lost its start (cut at the left, as lm-eval cuts)")
    # Longest first: a batch pads to its first (longest) text, and a too-large batch fails at once.
    requests.sort(key=lambda r: -len(r[2]))
    scores = [[0.0] * len(item.choices) for item in items]
    device = next(model.parameters()).device
    batches = range(0, len(requests), batch_size)
    for start in tqdm(batches, desc="scoring choices", unit="batch", disable=not progress):
        batch = requests[start:start + batch_size]
        width = len(batch[0][2])
        # Padding on the right needs no attention mask: a causal model's outputs at the real
        # positions never look at the later (padding) positions.
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for row, (_, _, input_ids, _) in enumerate(batch):
            ids[row, :len(input_ids)] = torch.tensor(input_ids)
        with torch.inference_mode():
            logits = model(ids.to(device)).logits
        for row, (i, j, input_ids, choice_ids) in enumerate(batch):
            end = len(input_ids)
            # In fp32: an fp16 log_softmax (GPU weights) would round the sums that pick the answer.
            log_probs = logits[row, end - len(choice_ids):end].float().log_softmax(dim=-1)
            targets = torch.tensor(choice_ids, dtype=torch.long, device=log_probs.device)
            scores[i][j] = log_probs.gather(1, targets[:, None]).sum().item()
    return scores


# ---- scores ----------------------------------------------------------------------------------

def picks(item: ChoiceItem, loglikelihoods: list[float]) -> dict[str, int]:
    """The choice each metric picks: by the sum, per character (acc_norm), per UTF-8 byte (acc_bytes)."""
    def best(divisors: list[int]) -> int:
        values = [ll / d for ll, d in zip(loglikelihoods, divisors)]
        return values.index(max(values))  # the first of equals, as numpy's argmax in lm-eval
    return {"acc": best([1] * len(item.choices)),
            "acc_norm": best([len(c) for c in item.choices]),
            "acc_bytes": best([len(c.encode("utf-8")) for c in item.choices])}


def score_choices(items: list[ChoiceItem], loglikelihoods: list[list[float]]) -> dict[str, float]:
    """acc, acc_norm, acc_bytes, each centred on chance too (`*_centred`), and `chance` itself."""
    chosen = [picks(item, lls) for item, lls in zip(items, loglikelihoods)]
    chance = sum(1 / len(item.choices) for item in items) / len(items)
    scores = {"chance": chance}
    for metric in ("acc", "acc_norm", "acc_bytes"):
        accuracy = sum(p[metric] == item.answer for p, item in zip(chosen, items)) / len(items)
        scores[metric] = accuracy
        scores[f"{metric}_centred"] = (accuracy - chance) / (1 - chance)
    return scores


def format_choice_scores(scores: dict[str, float], n_items: int) -> str:
    lines = [f"multiple choice, {n_items} items, chance {scores['chance']:.4f}:"]
    for metric in ("acc", "acc_norm", "acc_bytes"):
        lines.append(f"  {metric:<9} {scores[metric]:.4f}   centred on chance {scores[metric + '_centred']:+.4f}")
    return "\n".join(lines)


# ---- preference pairs -------------------------------------------------------------------------

def pair_logprobs(model: torch.nn.Module, dataset, batch_size: int = 16, progress: bool = False) -> torch.Tensor:
    """[pairs, 2], float64: each answer's log-probability, summed over its tokens, given its prompt. `dataset`
    is a DPODataset (item: input_ids and labels, [2, T], chosen then rejected); `model` this project's."""
    device = next(model.parameters()).device
    # FP16 weights on a GPU: under autocast the per-token loss is computed in FP32 (as eval_model.file_loss)
    autocast = torch.autocast("cuda", dtype=torch.float16) if device.type == "cuda" else nullcontext()
    logps = []
    for start in tqdm(range(0, len(dataset), batch_size), desc="scoring pairs", unit="batch", disable=not progress):
        items = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        input_ids, labels = (torch.stack(column).flatten(0, 1).to(device) for column in zip(*items))
        with torch.inference_mode(), autocast:
            per_token = model(input_ids, labels=labels, loss_reduction="none").loss  # -log p, 0 off the answer
        logps.append(-per_token.double().sum(dim=1).view(-1, 2).cpu())
    return torch.cat(logps)


def score_pairs(logps: torch.Tensor, ref_logps: torch.Tensor | None) -> dict[str, float]:
    """accuracy: the share of pairs whose chosen answer is likelier; with `ref_logps`, reward_accuracy: the share
    whose implicit reward (log-probability above the reference's) is higher for the chosen answer. Ties count
    as not preferred."""
    scores = {"pairs": len(logps), "accuracy": float((logps[:, 0] > logps[:, 1]).double().mean())}
    if ref_logps is not None:
        rewards = logps - ref_logps
        scores["reward_accuracy"] = float((rewards[:, 0] > rewards[:, 1]).double().mean())
    return scores


def format_pair_scores(scores: dict[str, float], path: str, ref_weight: str | None) -> str:
    line = f"{path}: {scores['pairs']} pairs, chosen answer likelier in {scores['accuracy']:.4f}"
    if "reward_accuracy" in scores:
        line += f"; its implicit reward (vs {ref_weight}) higher in {scores['reward_accuracy']:.4f}"
    return line


# ---- a Hugging Face model ---------------------------------------------------------------------

def load_hf_model(directory: str | Path, device: torch.device) -> tuple[torch.nn.Module, Callable[[str], list[int]]]:
    """A transformers model folder (scripts/export_hf.py writes one) and its tokenizer's `encode`,
    loaded as lm-eval's `--model hf` loads them."""
    if not Path(directory, "config.json").is_file():
        raise FileNotFoundError(f"{directory} is not a Hugging Face model folder (no config.json): write one with "
                                f"python -m scripts.export_hf out/<weight>.pth -o {directory}")
    import transformers  # only here: the out/*.pth path does not need it loaded

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    # As load_model: FP16 on a GPU, FP32 on the CPU (where FP16 is slow).
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    # encode() adds what the tokenizer adds by default (for this project's tokenizer: nothing), as lm-eval does.
    return model, tokenizer.encode

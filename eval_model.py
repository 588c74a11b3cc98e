"""Talk to a trained model, or measure how often it gives exactly the expected answer.

Every size of the model is read from the `out/*.pth` weights (ours or minimind's), so no size
flags are needed; flags given are checked against the file, and --hidden_size / --use_moe pick a
file when --save_dir holds several of one --weight:

    # interactive chat (multi-turn; /reset clears the history, an empty line or Ctrl-D quits)
    python eval_model.py --weight full_sft
    # one answer
    python eval_model.py --weight full_sft --prompt "What is 2+3?"
    # continue raw text with a pretrained (not chat-trained) model
    python eval_model.py --weight pretrain --prompt "Once upon"
    # exact-match accuracy on held-out conversations (greedy decoding)
    python eval_model.py --weight full_sft --eval dataset/sft_demo_eval.jsonl --verbose
    # an MoE file: the top-k is the one size the weights cannot tell (default 1, as in minimind)
    python eval_model.py --weight full_sft --use_moe 1 --num_experts_per_tok 1
    # a LoRA adapter (trainer/train_lora.py's out/lora_demo_{hidden}.pth) on top of the weights it was trained on
    python eval_model.py --weight full_sft --lora demo --prompt "What is 2+3?"
    # loss per token and bits per byte on a file of the trainer's --val_data formats (text or SFT)
    python eval_model.py --weight pretrain --bpb_data dataset/val_demo.jsonl
    # multiple-choice accuracy by log-likelihood, as lm-eval scores ARC or C-Eval (eval_choices.py)
    python eval_model.py --weight pretrain --mc_data my_choices.jsonl
    python eval_model.py --hf_model hf_model --mc_data my_choices.jsonl   # a scripts/export_hf.py folder
    # preference pairs (DPO's format): how often the chosen answer is likelier, and its implicit reward higher
    python eval_model.py --weight dpo --pairs_data dataset/dpo_demo.jsonl --ref_weight full_sft

The eval file uses the SFT format; the last message of each conversation must be the assistant's
reference answer. Everything before it is the prompt, rendered by dataset/chat_format.py exactly as
in training; the model's answer is what it writes after its <think>...</think> block.

--mc_data, --eval, --prompt and the chat read a text up to the length the model was trained at (out/{weight}.json,
which training writes beside the weights; without one, minimind's, its positions, less --max_new_tokens where it
writes): a longer question or prompt keeps its end, as lm-eval cuts, cut before it is tokenized, and a line says so.

--bpb_data scores a file as the trainer's validation does (trainer/hardening/tracking.py): {"text": ...}
lines as pretraining reads them, {"conversations": ...} lines as SFT does (the loss on the answers).
Bits per byte, unlike the loss per token, compare models with different tokenizers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import re
import sys
from pathlib import Path
from typing import Callable, TextIO

import torch
from tokenizers import Tokenizer

from dataset.chat_format import ChatEncoder, parse_conversation, render_segments
from dataset.dpo_dataset import DPODataset
from dataset.json_text import not_a_data_file, parse_json_text
from dataset.jsonl_file import JsonlFile
from dataset.lm_dataset import PretrainDataset, SFTDataset
from eval_choices import choice_loglikelihoods, format_choice_scores, format_pair_scores, load_hf_model, \
    pair_logprobs, picks, read_choice_items, score_choices, score_pairs
from model.weights import load_project_weights
from model.lora import load_lora, note_if_another_base
from model.model import CausalLM
from model.rope import add_rope_scaling_flags, rope_scaling_of_flags
from model.tokenizer import BOS_ID, EOS_ID, chars_for_tokens, load_tokenizer, text_end_for_tokens
from trainer.hardening.out_weights import trained_length
from trainer.hardening.tracking import Validation, validation_loss
from trainer.trainer_utils import REPO_ROOT



# ---- loading --------------------------------------------------------------------------------

# The size flags: each defaults to None, "read it from the weights".
SIZE_FLAGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "use_moe",
              "intermediate_size", "num_experts", "num_experts_per_tok")


def load_model(args: argparse.Namespace, tokenizer: Tokenizer, device: torch.device,
               log: Callable[[str], None] | None = None) -> CausalLM:
    """Load `{save_dir}/{weight}_{hidden}[_moe].pth` strictly, its sizes read from the weights, and with
    --lora NAME the adapter `{save_dir}/lora_{NAME}_{hidden}[_moe].pth` on top; `log` gets one line naming the
    file and the sizes (and one naming the adapter).

    Raises FileNotFoundError when no file matches, RuntimeError when several do or when the file
    does not fit the size flags given or the tokenizer; the message says what to change.
    """
    path = find_weight_file(Path(args.save_dir), args.weight, args.hidden_size, args.use_moe)
    requested = {name: getattr(args, name) for name in SIZE_FLAGS}
    try:
        weights, lm_config = load_project_weights(path, requested, tokenizer.get_vocab_size())
        # --rope_scaling: the rotary table stretched past the length the model was trained at (model/rope.py)
        scaling = rope_scaling_of_flags(args, trained_length(path), str(path.with_suffix(".json")))
    except ValueError as error:  # same message; RuntimeError is this function's "cannot load it"
        raise RuntimeError(str(error)) from None
    model = CausalLM(dataclasses.replace(lm_config, rope_scaling=scaling))
    model.load_state_dict(weights, strict=True)
    if log is not None:
        c = lm_config
        moe = f", MoE {c.num_experts} experts top-{c.num_experts_per_tok}" if c.use_moe else ""
        log(f"loaded {path}: hidden {c.hidden_size}, {c.num_hidden_layers} layers, {c.num_attention_heads} heads, "
            f"{c.num_key_value_heads} kv heads, vocab {c.vocab_size}{moe}, {model.num_parameters() / 1e6:.2f}M params")
    if scaling and log is not None:
        log(f"rope scaling: {scaling['rope_type']} x{args.rope_factor:g}, reads {readable_length(args, path)} tokens "
            f"(docs/long_context.md)")
    if getattr(args, "lora", None):
        try:
            adapter = find_weight_file(Path(args.save_dir), f"lora_{args.lora}", lm_config.hidden_size,
                                       lm_config.use_moe)
            settings = load_lora(model, adapter)
        except FileNotFoundError as error:  # (several matching files: find_weight_file's RuntimeError names them)
            raise FileNotFoundError(f"--lora {args.lora}: {error}") from None
        except ValueError as error:
            raise RuntimeError(f"--lora {args.lora}: {error}") from None
        if log is not None:
            log(f"applied {adapter}: rank {settings.get('lora_rank')}, alpha {settings['lora_alpha']:g}, "
                f"in {settings.get('lora_targets')}")
            note = note_if_another_base(settings, path)
            if note:
                log(note)
    # FP16 is what the file stores and halves GPU memory; the CPU computes in FP32 (FP16 there is slow).
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    return model.to(device=device, dtype=dtype).eval()


def trained_context(args: argparse.Namespace, model: CausalLM, log: Callable[[str], None]) -> int:
    """The tokens of text the model reads: the max_seq_len it was trained at (out/{weight}.json, which training
    writes beside the weights, as scripts/serve_openai_api.py reads it); where no .json tells (minimind's
    weights), its positions, said to `log` in one line. RuntimeError for a .json without a length."""
    path = find_weight_file(Path(args.save_dir), args.weight, args.hidden_size, args.use_moe)
    trained = readable_length(args, path)
    if trained is None:
        log(f"note: no {path.with_suffix('.json').name} beside the weights tells the length the model was trained "
            f"at: texts are cut at its {model.config.max_position_embeddings} positions")
        return model.config.max_position_embeddings
    return trained


def prompt_room(args: argparse.Namespace, model: CausalLM, log: Callable[[str], None]) -> int:
    """The tokens a prompt keeps where the model writes after it: trained_context, and room for --max_new_tokens
    in the model's positions (a file without a .json gave a prompt all of them: a traceback at the first new
    token). RuntimeError when no room is left."""
    positions = model.config.max_position_embeddings
    if args.max_new_tokens > positions - 2:
        raise RuntimeError(f"--max_new_tokens {args.max_new_tokens}: the model has {positions} positions, for the "
                           f"prompt and the answer together; ask for fewer")
    return min(trained_context(args, model, log), positions - args.max_new_tokens)


def readable_length(args: argparse.Namespace, path: Path) -> int | None:
    """The tokens the model at `path` reads: the length it was trained at (out/{weight}.json, else
    --original_max_position_embeddings), times --rope_factor under --rope_scaling; None where nothing tells it."""
    trained = trained_length(path) or getattr(args, "original_max_position_embeddings", None)
    return int(trained * args.rope_factor) if trained and getattr(args, "rope_scaling", None) else trained


def find_weight_file(save_dir: Path, weight: str, hidden_size: int | None, use_moe: int | None) -> Path:
    """The one `{weight}_{hidden}[_moe].pth` in `save_dir` that fits the --hidden_size / --use_moe given."""
    name = re.compile(rf"{re.escape(weight)}_(\d+)(_moe)?\.pth")
    candidates = []
    for path in sorted(save_dir.glob(f"{weight}_*.pth")):
        match = name.fullmatch(path.name)
        if (match and (hidden_size is None or int(match.group(1)) == hidden_size)
                and (use_moe is None or bool(match.group(2)) == bool(use_moe))):
            candidates.append(path)
    if len(candidates) == 1:
        return candidates[0]
    wanted = f"{weight}_{hidden_size or '*'}{ {None: '[_moe]', 0: '', 1: '_moe'}[use_moe] }.pth"
    if not candidates:
        present = ", ".join(p.name for p in sorted(save_dir.glob("*.pth"))) or "none"
        raise FileNotFoundError(f"no {wanted} in {save_dir} (there: {present}): train that stage first, or "
                                f"check --weight, --hidden_size, --use_moe and --save_dir")
    raise RuntimeError(f"{save_dir} holds several {weight} weights ({', '.join(p.name for p in candidates)}): "
                       f"pass --hidden_size (and --use_moe) to choose one")


# ---- generation -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def chat_encoder(tokenizer: Tokenizer) -> ChatEncoder:
    """The ChatEncoder of `tokenizer`, made once per tokenizer (it copies the tokenizer)."""
    return ChatEncoder(tokenizer)


def generate_ids(model: CausalLM, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0) -> list[int]:
    """Ids the model writes after `prompt_ids`, up to (not including) <|im_end|>."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    # eos must be passed explicitly: generate's default (None) never stops early.
    out = model.generate(ids, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                         eos_token_id=EOS_ID)
    new_ids = out[0, len(prompt_ids):].tolist()
    if EOS_ID in new_ids:
        new_ids = new_ids[:new_ids.index(EOS_ID)]
    return new_ids


def generate_text(model: CausalLM, tokenizer: Tokenizer, prompt_ids: list[int], max_new_tokens: int,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> str:
    """Decode what the model writes after `prompt_ids`, stopping at <|im_end|>; tags like <think> stay."""
    new_ids = generate_ids(model, prompt_ids, max_new_tokens, temperature, top_p, top_k)
    return chat_encoder(tokenizer).decode(new_ids)


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Ids of `messages` and an open assistant turn: what SFTDataset builds before that turn's answer. `tools`:
    function specs offered in the system turn (dataset/chat_format.render_segments)."""
    ids, _ = chat_encoder(tokenizer).encode(render_segments(messages, add_generation_prompt=True, tools=tools))
    return ids


def answer_from_generation(text: str) -> str:
    """The answer in a chat model's output: what follows its <think>...</think> block, if it wrote one."""
    if "</think>" in text:
        return text.split("</think>")[-1].lstrip("\n")
    if text.lstrip().startswith("<think>"):
        return ""  # cut off by --max_new_tokens while still thinking: no answer yet
    return text


def chat_prompt_ids_within(tokenizer: Tokenizer, messages: list[dict], max_tokens: int) -> tuple[list[int], bool]:
    """chat_prompt_ids of `messages`, cut at the left to its last `max_tokens` (as lm-eval cuts a context), and
    whether it was cut. Each text is first cut at the left to what those tokens need (model/tokenizer.py's
    text_end_for_tokens), so a question of megabytes is not tokenized whole; the ids kept are the same."""
    short = [{key: text_end_for_tokens(value, max_tokens, tokenizer) if key in ("content", "reasoning_content")
              and isinstance(value, str) else value for key, value in message.items()} for message in messages]
    ids = chat_prompt_ids(tokenizer, short)
    return ids[-max_tokens:], len(ids) > max_tokens


def raw_prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """BOS + text, as PretrainDataset starts every sample: what a pretrained model knows how to continue."""
    return [BOS_ID] + tokenizer.encode(text).ids


def prompt_ids_within(tokenizer: Tokenizer, messages: list[dict], raw_text: bool,
                      max_tokens: int) -> tuple[list[int], bool]:
    """The ids of a --prompt or a chat turn (raw_prompt_ids of the last message's text, or chat_prompt_ids of them
    all), kept to their last `max_tokens` and whether they were cut: the text is cut first (text_end_for_tokens),
    so a prompt of megabytes is not tokenized whole."""
    if not raw_text:
        return chat_prompt_ids_within(tokenizer, messages, max_tokens)
    ids = raw_prompt_ids(tokenizer, text_end_for_tokens(messages[-1]["content"], max_tokens, tokenizer))
    return [BOS_ID] + ids[1:][-(max_tokens - 1):], len(ids) > max_tokens


def cut_note(max_tokens: int) -> str:
    return f"note: the prompt is longer than the {max_tokens} tokens the model reads: it lost its start"


# ---- exact-match evaluation -----------------------------------------------------------------

def answers_match(generated: str, reference: str) -> bool:
    """Exact match of the answer after the think block, ignoring surrounding whitespace."""
    return answer_from_generation(generated).strip() == reference.strip()


def split_eval_record(record: dict) -> tuple[list[dict], str]:
    """(prompt messages, reference answer) of one SFT-format eval record; the schema is checked."""
    conversation = record.get("conversations")
    if not isinstance(conversation, list) or not conversation or not isinstance(conversation[-1], dict) \
            or conversation[-1].get("role") != "assistant":
        raise ValueError("each eval record needs a 'conversations' list ending with the assistant's "
                         "reference answer")
    # The parsed message: a reference written as "<think>...</think>answer" compares by its answer.
    return conversation[:-1], parse_conversation(conversation).messages[-1]["content"]


def evaluate_exact_match(model: CausalLM, tokenizer: Tokenizer, records: list[dict], max_new_tokens: int = 64,
                         log: Callable[[str], None] | None = None, max_prompt_tokens: int | None = None,
                         note: Callable[[str], None] | None = None) -> tuple[int, int]:
    """Greedy-answer every record; returns (correct, total). `log` receives one line per mistake. With
    `max_prompt_tokens` (prompt_room), a longer prompt keeps its last tokens, and `note` receives one line counting
    such records."""
    correct, cut = 0, 0
    for n, record in enumerate(records, start=1):
        messages, reference = split_eval_record(record)
        if max_prompt_tokens is None:
            prompt_ids = chat_prompt_ids(tokenizer, messages)
        else:
            prompt_ids, was_cut = chat_prompt_ids_within(tokenizer, messages, max_prompt_tokens)
            cut += was_cut
        generated = generate_text(model, tokenizer, prompt_ids, max_new_tokens)
        if answers_match(generated, reference):
            correct += 1
        elif log is not None:
            question = messages[-1]["content"] if messages else ""
            answer = answer_from_generation(generated).strip()
            log(f"#{n}: {question!r} -> got {answer!r}, expected {reference.strip()!r}")
    if cut and note is not None:
        note(f"note: {cut} of {len(records)} prompts are longer than the {max_prompt_tokens} tokens the model reads: "
             f"each lost its start (cut at the left, as lm-eval cuts)")
    return correct, len(records)


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of an --eval file, indexed and checked as the trainer's data is (dataset/jsonl_file.py): a
    DataFileError (a ValueError) names the file, the line and the fix for the first bad line."""
    source = JsonlFile(path, validate=split_eval_record)
    return [source.read(i) for i in range(len(source))]


def format_accuracy(correct: int, total: int) -> str:
    percent = 100.0 * correct / total if total else 0.0
    return f"exact-match accuracy: {correct}/{total} = {percent:.1f}%"


# ---- loss and bits per byte ------------------------------------------------------------------

def score_file(model: CausalLM, tokenizer: Tokenizer, path: str | Path, max_seq_len: int) -> str:
    """The loss per token and bits per byte of `model` on the JSONL file `path`, in one line."""
    result = file_loss(model, tokenizer, path, max_seq_len)
    return (f"{path}: {result.bpb:.4f} bits per byte ({result.text_bytes} bytes of text), loss {result.loss:.4f} "
            f"per token ({result.tokens} tokens)")


def file_loss(model: CausalLM, tokenizer: Tokenizer, path: str | Path, max_seq_len: int) -> Validation:
    """The loss per token and bits per byte of `model` on the JSONL file `path`. The file is read by the
    trainer's dataset of its format (told by its first line), so the numbers are those --val_data gives."""
    with open(path, "rb") as f:  # bytes: the dataset names a line that is not UTF-8 (or not JSON) with its number
        first = next((line for line in f if line.strip()), b"").decode("utf-8", errors="replace")
    try:
        is_chat = "conversations" in parse_json_text(first)
    except (ValueError, TypeError):  # not JSON, or not an object: the dataset's check names the line
        is_chat = False
    dataset = (SFTDataset if is_chat else PretrainDataset)(path, tokenizer, max_seq_len)
    device = next(model.parameters()).device
    # FP16 weights on a GPU: under autocast the loss is computed in FP32 (cross_entropy is on its FP32 list).
    autocast = torch.autocast("cuda", dtype=torch.float16) if device.type == "cuda" else contextlib.nullcontext()
    return validation_loss(model, dataset, 8, device, autocast)


# ---- multiple-choice evaluation --------------------------------------------------------------

def evaluate_choices(args: argparse.Namespace) -> int:
    """--mc_data: score every item of the file by log-likelihood (eval_choices.py) and print the accuracies."""
    device = torch.device(args.device)
    try:
        items = read_choice_items(args.mc_data)  # a bad line is reported before a model is loaded
        if args.hf_model:  # its folder does not record the length it was trained at: its positions are read
            model, encode = load_hf_model(args.hf_model, device)
            max_length, max_chars = model.config.max_position_embeddings, None
        else:
            tokenizer = load_tokenizer(args.tokenizer_path)
            model = load_model(args, tokenizer, device, log=lambda line: print(line, file=sys.stderr))
            encode = lambda text: tokenizer.encode(text).ids  # noqa: E731 (adds no special token, as the export's)
            max_length = trained_context(args, model, log=lambda line: print(line, file=sys.stderr))
            max_chars = chars_for_tokens(max_length + 1, tokenizer)  # what the max_length + 1 tokens scored need
        lls = choice_loglikelihoods(model, encode, items, max_length, args.batch_size, max_chars=max_chars, log=print)
    except (FileNotFoundError, RuntimeError, ValueError) as error:  # a choice too long for the model: ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.verbose:
        for n, (item, item_lls) in enumerate(zip(items, lls), start=1):
            print(f"#{n}: answer {item.answer}, picked {picks(item, item_lls)}, log-likelihoods "
                  f"{[round(ll, 4) for ll in item_lls]}")
    print(format_choice_scores(score_choices(items, lls), len(items)), flush=True)
    return 0


def evaluate_pairs(args: argparse.Namespace) -> int:
    """--pairs_data: the share of pairs whose chosen answer is likelier; with --ref_weight, whose implicit DPO
    reward is higher (eval_choices.score_pairs)."""
    device, tokenizer = torch.device(args.device), load_tokenizer(args.tokenizer_path)
    try:
        dataset = DPODataset(args.pairs_data, tokenizer, args.max_seq_len,  # a bad line: before a model is loaded
                             log=lambda line: print(line, file=sys.stderr))  # (and pairs beyond --max_seq_len)
        weights = [args.weight] + ([args.ref_weight] if args.ref_weight else [])
        models = [load_model(argparse.Namespace(**{**vars(args), "weight": weight}), tokenizer, device,
                             log=lambda line: print(line, file=sys.stderr)) for weight in weights]
    except (FileNotFoundError, RuntimeError, ValueError) as error:  # DataFileError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2
    logps = [pair_logprobs(model, dataset, args.batch_size) for model in models]
    print(format_pair_scores(score_pairs(logps[0], logps[1] if args.ref_weight else None), args.pairs_data,
                             args.ref_weight), flush=True)
    return 0


# ---- interactive loop -----------------------------------------------------------------------

def chat_loop(model: CausalLM, tokenizer: Tokenizer, args: argparse.Namespace, raw_text: bool,
              stdin: TextIO | None = None, max_prompt_tokens: int | None = None) -> None:
    """Read prompts from stdin until an empty line or EOF; chat mode keeps the conversation, each turn's prompt
    kept to its last `max_prompt_tokens` (prompt_room; default: the model's positions less --max_new_tokens)."""
    room = max_prompt_tokens or model.config.max_position_embeddings - args.max_new_tokens
    stdin = stdin if stdin is not None else sys.stdin
    history: list[dict[str, str]] = []
    mode = "text continuation" if raw_text else "chat"
    print(f"{mode} with {args.weight}: type a prompt; /reset clears the history; an empty line or Ctrl-D quits",
          flush=True)
    while True:
        print("> ", end="", flush=True)
        line = stdin.readline()
        prompt = line.strip()
        if not prompt:  # "" is EOF, "\n" an empty line: both end the session
            return
        if prompt == "/reset":
            history.clear()
            print("(history cleared)", flush=True)
            continue
        ids, cut = prompt_ids_within(tokenizer, [*history, {"role": "user", "content": prompt}], raw_text, room)
        if cut:
            print(cut_note(room), file=sys.stderr, flush=True)
        answer = generate_text(model, tokenizer, ids, args.max_new_tokens, args.temperature, args.top_p, args.top_k)
        if raw_text:
            print(prompt + answer, flush=True)
            continue
        history.append({"role": "user", "content": prompt})
        answer = answer_from_generation(answer)
        history.append({"role": "assistant", "content": answer})
        print(answer, flush=True)


# ---- command line ---------------------------------------------------------------------------

def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose and place a model in out/ (scripts/serve_openai_api.py takes them too)."""
    a = p.add_argument
    a("--weight", default="full_sft", help="name prefix of the weights, e.g. pretrain or full_sft")
    a("--save_dir", default=str(REPO_ROOT / "out"))
    a("--tokenizer_path", default=str(REPO_ROOT / "model" / "tokenizer.json"))
    # Size flags: optional, read from the weights; one given must match the file.
    for name in SIZE_FLAGS:
        a(f"--{name}", type=int, default=None, **({"choices": (0, 1)} if name == "use_moe" else {}),
          help="default: from the weights" + (" (MoE top-k: the file cannot tell; model default 1)"
                                              if name == "num_experts_per_tok" else ""))
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_rope_scaling_flags(p)  # --rope_scaling yarn --rope_factor 4: past the trained length (docs/long_context.md)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Chat with, or evaluate, a model saved in out/")
    add_model_flags(p)
    a = p.add_argument
    a("--prompt", default=None, help="answer this once and exit")
    a("--lora", default=None, help="NAME: apply the adapter out/lora_{NAME}_{hidden}.pth (train_lora.py) to --weight")
    a("--eval", default=None, help="SFT-format JSONL: report exact-match accuracy of greedy answers")
    a("--verbose", action="store_true", help="with --eval: print every wrong answer; with --mc_data: every item")
    a("--mc_data", default=None, help='JSONL of {"question", "choices", "answer"}: multiple-choice accuracy '
                                      "by log-likelihood (eval_choices.py)")
    a("--hf_model", default=None, help="with --mc_data: score this Hugging Face model folder instead of out/*.pth")
    a("--batch_size", type=int, default=16, help="with --mc_data (--pairs_data): texts (pairs) per forward pass")
    a("--pairs_data", default=None, help='JSONL of {"chosen", "rejected"} pairs: how often the chosen answer wins')
    a("--ref_weight", default=None, help="with --pairs_data: the reference, for the implicit reward's accuracy")
    a("--bpb_data", default=None, help="JSONL of text or SFT lines: report the loss per token and bits per byte")
    a("--max_seq_len", type=int, default=340, help="with --bpb_data, --pairs_data: records are cut to it, as trained")
    a("--temperature", type=float, default=0.0, help="0 = greedy")
    a("--top_p", type=float, default=1.0)
    a("--top_k", type=int, default=0, help="0 = no top-k cut")
    a("--max_new_tokens", type=int, default=64)
    a("--seed", type=int, default=42, help="for sampling when --temperature > 0")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.hf_model and not args.mc_data:
        parser.error("--hf_model is read only with --mc_data")
    if args.mc_data:
        return evaluate_choices(args)
    if args.pairs_data:
        return evaluate_pairs(args)
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.tokenizer_path)
    for flag, path in (("--bpb_data", args.bpb_data), ("--eval", args.eval)):  # said before the model is loaded
        problem = not_a_data_file(path) if path else None  # (a FIFO would be waited on, a folder has no lines)
        if problem:
            print(f"error: {flag} {path}: {problem}", file=sys.stderr)
            return 2
    try:  # a broken --eval line is said before the model is loaded too (DataFileError is a ValueError)
        records = read_jsonl(args.eval) if args.eval else []
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        # On stderr: stdout carries only the answers (a --prompt answer may be piped on).
        model = load_model(args, tokenizer, torch.device(args.device), log=lambda line: print(line, file=sys.stderr))
        if not args.bpb_data:  # where it writes: a longer prompt keeps its end
            # --eval says where it cuts up front; --prompt and the chat say so when a prompt is cut (cut_note)
            say = (lambda line: print(line, file=sys.stderr)) if args.eval else (lambda line: None)
            max_prompt_tokens = prompt_room(args, model, log=say)
    except (FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2  # an expected error exits 2, as in the training scripts
    # A pretrained model has never seen ChatML, so it is asked to continue plain text instead.
    raw_text = args.weight == "pretrain"

    if args.bpb_data:
        try:
            print(score_file(model, tokenizer, args.bpb_data, args.max_seq_len), flush=True)
        except (OSError, ValueError) as error:  # no such file, a broken line (DataFileError is a ValueError)
            print(f"error: {error}", file=sys.stderr)
            return 2
    elif args.eval:
        if raw_text:
            print("note: --weight pretrain was not trained on chat; expect a low exact-match score", flush=True)
        correct, total = evaluate_exact_match(model, tokenizer, records, args.max_new_tokens,
                                              log=print if args.verbose else None,
                                              max_prompt_tokens=max_prompt_tokens, note=print)
        print(format_accuracy(correct, total), flush=True)
    elif args.prompt is not None:
        ids, cut = prompt_ids_within(tokenizer, [{"role": "user", "content": args.prompt}], raw_text, max_prompt_tokens)
        if cut:
            print(cut_note(max_prompt_tokens), file=sys.stderr, flush=True)
        answer = generate_text(model, tokenizer, ids, args.max_new_tokens, args.temperature, args.top_p,
                               args.top_k)
        print(args.prompt + answer if raw_text else answer_from_generation(answer), flush=True)
    else:
        chat_loop(model, tokenizer, args, raw_text, max_prompt_tokens=max_prompt_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())

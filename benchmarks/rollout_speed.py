"""Generated tokens per second of GRPO's rollouts, side by side: the rollout engine (model/rollout.py), the code of
commit b373b71 before it (a prompt's group at a time; each later agentic turn read again from the start), and
minimind's (github.com/jingyaogong/minimind), run from its files (--minimind_dir), each in its own process, --runs
times, one thread on a CPU, all from the same FP16 weights, with the same prompt ids, G and new tokens.

--shape demo (scripts/run_demo.sh: hidden 128, 4 layers, 4 heads, 2 key/value heads), weights taught by heart to
call the calculator on the 8 agentic prompts and answer after its result:
    single turn: dataset/grpo_demo.jsonl, 32 prompts x 8, --max_seq_len 64 --max_completion_len 16 (stage 6)
    agentic:     dataset/tool_grpo_demo.jsonl, 8 prompts x 8, --max_turns 2 --max_seq_len 736 --max_completion_len 128,
                 the demo's tools run (stage 9)
--shape minimind (its default model: hidden 768, 8 layers, 8 heads, 4 key/value heads, SwiGLU 2432, vocabulary 6400)
  at its issue #827's case: single turn, 2 prompts of up to 768 tokens x 6, completions of 1,024 tokens; random
  weights (a row ends early only if it draws <|im_end|>). For a GPU (--device cuda, bfloat16 autocast); on a CPU,
  a quick check only.

A line: the code, the run, tokens (generated tokens a rollout trains, the model's own of each turn through its
<|im_end|>; ours and b373b71's: labels != -100; minimind's: each turn's ids through its first <|im_end|>, what its
train_grpo.py trains; its train_agent.py drops each turn's <|im_end|>), seconds of the rollout call, tokens/s, tool
calls run, and for minimind its model's generate alone (its rollout then computes the old log-probabilities, one
more forward of every row, which ours leaves to the training step). "logits": the largest difference of ours and
minimind's model on the first prompt (the same parameter names and shapes: the weights load as they are).

minimind's, run as written: its model and generate (top_k 50 and top_p 0.85, its defaults; a batch decodes until
every row drew <|im_end|>), TorchRolloutEngine.rollout (left-padded prompts, each repeated G times, one generate,
then the old log-probabilities), train_agent.py's rollout_batch and rollout_single (one rollout at a time, batch 1,
the chat template rendered and tokenized again each turn; temperature 0.8 and new tokens per turn, as written
there). The driver here: stand-ins for what train_agent.py imports but its rollout never uses (`datasets`, its
AgentRLDataset and trainer_utils); the project's tokenizer and chat template as a transformers tokenizer, the tags
not marked special (its loop finds <tool_call> in text decoded with skip_special_tokens); the demo's tools
(dataset/tools.py run_tool) for its execute_tool; wrappers on its engine's rollout and model's generate that keep
each turn's ids and time generate.

    python benchmarks/rollout_speed.py --runs 2                                 # some minutes on 2 busy cores
    python benchmarks/rollout_speed.py --shape minimind --device cuda
    python benchmarks/rollout_speed.py --shape minimind --runs 1 --completion_len 8   # a quick check on a CPU
    MINIMIND_DIR=/path/to/minimind python benchmarks/rollout_speed.py        # default: ../shared/gpu/minimind
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OLD = "b373b71"
SHAPES = {"demo": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
          "minimind": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                           intermediate_size=2432, vocab_size=6400)}
CASES = {  # shape: {case: (data, prompts, G, prompt room, --max_completion_len, --max_turns)}; --max_seq_len = the sum
    "demo": {"single-turn": ("dataset/grpo_demo.jsonl", 32, 8, 48, 16, 1),
             "agentic": ("dataset/tool_grpo_demo.jsonl", 8, 8, 608, 128, 2)},
    "minimind": {"single-turn": (None, 2, 6, 768, 1024, 1)},  # None: long_prompts writes the file
}
PEER_FILES = ("model/model_minimind.py", "trainer/rollout_engine.py", "trainer/train_agent.py")


def teach_tool_calls(path: Path, config: dict, steps: int) -> float:
    """The demo's shape, taught by heart to answer each of the agentic case's prompts with a calculator call, then,
    after the real calculator's result, the reference answer; FP16 weights saved at `path`. Returns the last loss."""
    import torch
    from dataset.lm_dataset import SFTDataset
    from dataset.tools import run_tool
    from model.model import CausalLM, LMConfig
    from model.tokenizer import load_tokenizer

    data, prompts, _, room, completion, _ = CASES["demo"]["agentic"]
    records = [json.loads(line) for line in (REPO / data).read_text(encoding="utf-8").splitlines()[:prompts]]
    arguments = {"expression": "6 * 7"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"name": "calculator", "arguments": arguments}]}
    result = {"role": "tool", "content": run_tool("calculator", arguments).text}
    taught = [{"conversations": [*r["conversations"][:-1], call, result, r["conversations"][-1]]} for r in records]
    with tempfile.TemporaryDirectory() as scratch:
        lines = Path(scratch) / "taught.jsonl"
        lines.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in taught), encoding="utf-8")
        dataset = SFTDataset(str(lines), load_tokenizer(), room + completion)
        torch.manual_seed(0)
        model = CausalLM(LMConfig(**config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(steps):
            input_ids, labels = map(torch.stack, zip(*(dataset[(4 * step + k) % len(dataset)] for k in range(4))))
            optimizer.param_groups[0]["lr"] = 3e-3 * (1 - step / steps)
            loss = model(input_ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    torch.save({name: tensor.half() for name, tensor in model.state_dict().items()}, path)
    return float(loss.detach())


def long_prompts(path: Path, prompts: int, room: int) -> None:
    """`prompts` demo questions, each repeated as often as its prompt stays within `room` tokens, written at `path`."""
    from dataset.chat_format import ChatEncoder, render_segments
    from model.tokenizer import load_tokenizer

    encoder, records = ChatEncoder(load_tokenizer()), []
    for line in (REPO / "dataset/grpo_demo.jsonl").read_text(encoding="utf-8").splitlines()[:prompts]:
        question, answer = json.loads(line)["conversations"]

        def asked(n: int) -> list[dict]:  # the question n times
            return [{"role": "user", "content": " ".join([question["content"]] * n)}]
        n = 1
        while len(encoder.encode(render_segments(asked(n + 1), add_generation_prompt=True))[0]) <= room:
            n += 1
        records.append({"conversations": [*asked(n), answer]})
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def load_file(path: Path, name: str) -> types.ModuleType:
    """The Python file at `path`, run as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_peer(peer: Path) -> tuple:
    """minimind's model, rollout engine and agent loop, from its files, under the names its files import them by,
    with stand-ins for the modules train_agent.py imports but its rollout never uses; sys.modules put back after."""
    names = "datasets", "dataset.lm_dataset", "trainer.trainer_utils", "model.model_minimind", "trainer.rollout_engine"
    saved = {name: sys.modules.get(name) for name in names}
    try:
        for name in names[:3]:
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__getattr__ = lambda attribute: None  # any name imported from it: never called
        sys.modules["trainer.trainer_utils"].Logger = lambda *text: print(*text, file=sys.stderr)
        return tuple(load_file(peer / file, name) for file, name in zip(PEER_FILES, (*names[3:], "minimind_agent")))
    finally:
        for name, module in saved.items():
            sys.modules.pop(name) if module is None else sys.modules.__setitem__(name, module)


def weights_of(path: str) -> dict:
    """The FP16 file's tensors, as float32."""
    import torch
    return {name: tensor.float() for name, tensor in torch.load(path, weights_only=True).items()}


def peer_model(module, config: dict, weights: str):
    """minimind's model at the config's shape, holding the FP16 file's weights (as float32) under the same names."""
    import transformers
    from model.model import LMConfig

    transformers.logging.set_verbosity_error()  # (its config and outputs use names transformers 5 deprecates)
    ours = LMConfig(**config)
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
             "intermediate_size", "rope_theta", "rms_norm_eps", "max_position_embeddings")
    model = module.MiniMindForCausalLM(module.MiniMindConfig(**{size: getattr(ours, size) for size in sizes}))
    model.load_state_dict(weights_of(weights))
    return model.eval()


def prompt_batch(spec: dict) -> tuple:
    """The case's dataset (the code on the import path) and its micro-batch, as the loader gives it."""
    import torch
    from dataset.grpo_dataset import GRPODataset
    from dataset.rewards import reward_functions
    from model.tokenizer import load_tokenizer

    dataset = GRPODataset(spec["data"], load_tokenizer(), spec["room"], reward_functions("answer"),
                          runs_tools=spec["max_turns"] > 1)
    items = [dataset[i] for i in range(spec["prompts"])]
    return dataset, [torch.arange(spec["prompts"]), *(torch.stack(column) for column in zip(*items))]


def on(device: str) -> tuple:
    """(autocast, wait for the device): bfloat16 autocast and a synchronize on a GPU, nothing on a CPU."""
    import torch
    gpu = device.startswith("cuda")
    return (torch.autocast("cuda", torch.bfloat16), torch.cuda.synchronize) if gpu else (nullcontext(), lambda: None)


def measure(spec: dict) -> dict:
    """One rollout of the micro-batch with ours or b373b71's code (first on the import path): tokens, seconds, calls."""
    from dataset.grpo_dataset import sample_rollouts
    from model.model import CausalLM, LMConfig

    dataset, batch = prompt_batch(spec)
    model = CausalLM(LMConfig(**spec["config"]))
    model.load_state_dict(weights_of(spec["weights"]))
    autocast, wait = on(spec["device"])
    model.to(spec["device"])
    wait()
    started = time.perf_counter()
    _, labels, _, rollouts = sample_rollouts(model, batch, dataset, spec["group"], spec["completion"], 1.0, 42,
                                             autocast, spec["max_turns"])
    wait()
    seconds = time.perf_counter() - started
    ran = sum(rollout.ran for group_rollouts in rollouts or [] for rollout in group_rollouts)
    return {"tokens": int((labels != -100).sum()), "seconds": seconds, "tool_calls_run": ran}


def measure_peer(spec: dict) -> dict:
    """The same micro-batch through minimind's rollout code (the module's docstring: theirs, and the driver)."""
    import random
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from dataset.chat_format import parse_conversation
    from dataset.grpo_dataset import split_prompt
    from dataset.tools import error_text, run_tool
    from model.chat_template import CHAT_TEMPLATE
    from model.model import CausalLM, LMConfig
    from model.tokenizer import BOS_TOKEN, EOS_ID, EOS_TOKEN, PAD_ID, PAD_TOKEN, SPECIAL_TOKENS, load_tokenizer

    dataset, (_, prompt_ids, prompt_labels) = prompt_batch(spec)
    asked = [ids[labels != -100] for ids, labels in zip(prompt_ids, prompt_labels)]
    model_file, engine_file, agent = load_peer(Path(spec["peer"]))
    tagged = json.loads(load_tokenizer().to_str())
    for token in tagged["added_tokens"]:  # only the three ChatML tokens stay special: decode keeps the tags
        token["special"] = token["content"] in SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(tagged)), bos_token=BOS_TOKEN,
                                        eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, chat_template=CHAT_TEMPLATE)
    device, (autocast, wait) = spec["device"], on(spec["device"])
    model, ours = peer_model(model_file, spec["config"], spec["weights"]), CausalLM(LMConfig(**spec["config"])).eval()
    ours.load_state_dict(weights_of(spec["weights"]))
    with torch.no_grad():  # the check that the weights mean the same in both models: logits of the first prompt
        logits = ours(asked[0][None]).logits
        difference = [float((model(asked[0][None]).logits - logits).abs().max()), float(logits.abs().max())]
    model.to(device)
    engine = engine_file.TorchRolloutEngine(model, tokenizer, device, autocast)
    turns, generating, ran, generate, rollout = [], [0.0], [0], model.generate, engine.rollout

    def timed_generate(*args, **kwargs):
        started, out = time.perf_counter(), generate(*args, **kwargs)
        wait()
        generating[0] += time.perf_counter() - started
        return out

    def kept_rollout(*args, **kwargs):  # each turn's result kept, to count its ids
        turns.append(rollout(*args, **kwargs))
        return turns[-1]

    def demo_tool(name, arguments):  # the demo's tools, run as ours run them, for its mock ones
        ran[0], result = ran[0] + 1, run_tool(name, arguments)
        return json.loads(result.text if result.failure is None else error_text(result.failure))

    model.generate, engine.rollout, agent.execute_tool = timed_generate, kept_rollout, demo_tool
    width = max(len(ids) for ids in asked)  # single turn: left-padded, as its train_grpo.py pads them
    padded = torch.stack([F.pad(ids, (width - len(ids), 0), value=PAD_ID) for ids in asked]).to(device)
    chats = [parse_conversation(split_prompt(dataset.source.read(i)["conversations"])[0])
             for i in range(spec["prompts"])]
    for chat, ids in zip(chats, asked):  # agentic: its first turn's prompt must be ours, id for id
        text = tokenizer.apply_chat_template(chat.messages, tools=chat.tools, add_generation_prompt=True,
                                             tokenize=False)
        if tokenizer(text, add_special_tokens=False)["input_ids"] != ids.tolist():
            sys.exit("error: minimind's loop would tokenize a prompt otherwise than the dataset does")
    random.seed(42)
    torch.manual_seed(42)
    wait()
    started = time.perf_counter()
    if spec["max_turns"] == 1:
        engine.rollout(padded, (padded != PAD_ID).long(), spec["group"], spec["completion"], 1.0)
    else:
        agent.rollout_batch(engine, tokenizer, [chat.messages for chat in chats], [chat.tools for chat in chats],
                            spec["group"], spec["max_turns"], spec["completion"], 0.0, device)
    wait()
    seconds = time.perf_counter() - started
    rows = [row for turn in turns for row in turn.completion_ids.tolist()]  # each counted through its first <|im_end|>
    tokens = sum(row.index(EOS_ID) + 1 if EOS_ID in row else len(row) for row in rows)
    return {"tokens": tokens, "seconds": seconds, "tool_calls_run": ran[0], "generate_seconds": generating[0],
            "logits": [len(asked[0]), *difference]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.print_usage = lambda file=None: None  # a bad flag: its one error line only
    parser.add_argument("--runs", type=int, default=2, help="runs of each code and case")
    parser.add_argument("--shape", choices=SHAPES, default="demo")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    parser.add_argument("--completion_len", type=int, default=None, help="new tokens, for each case's own")
    parser.add_argument("--teach_steps", type=int, default=200, help="steps that teach the weights to call a tool")
    parser.add_argument("--minimind_dir", default=os.environ.get("MINIMIND_DIR", REPO / "../shared/gpu/minimind"),
                        help="minimind's code (or env MINIMIND_DIR; default ../shared/gpu/minimind)")
    parser.add_argument("--measure", nargs=2, metavar=("CODE", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # a child: the code under test first on the import path, one thread
        code, spec = args.measure[0], json.loads(args.measure[1])
        sys.path.insert(0, code)
        import torch
        torch.set_num_threads(1)
        print(json.dumps(measure_peer(spec) if spec.get("peer") else measure(spec)))
        return
    peer = Path(args.minimind_dir).resolve()
    if not all((peer / name).is_file() for name in PEER_FILES):
        sys.exit(f"error: minimind's code not found in {peer} ({', '.join(PEER_FILES)}): pass --minimind_dir DIR or "
                 f"set MINIMIND_DIR")
    if min(args.runs, args.teach_steps, args.completion_len or 1) < 1:
        sys.exit("error: --runs, --teach_steps and --completion_len must be at least 1")
    sys.path.insert(0, str(REPO))
    import torch
    from model.model import CausalLM, LMConfig
    from model.tokenizer import load_tokenizer
    torch.set_num_threads(1)  # (on 2 busy cores two threads of these small products wait on each other)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cpu" and not (device.split(":")[0] == "cuda" and torch.cuda.is_available()):
        sys.exit(f"error: --device {device}: cpu, or cuda where there is a GPU")
    config, began = {"vocab_size": load_tokenizer().get_vocab_size(), **SHAPES[args.shape]}, time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        old, weights, long_file = (Path(scratch) / name for name in (OLD, "weights.pth", "long_prompts.jsonl"))
        old.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", OLD], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        if args.shape == "demo":
            loss = teach_tool_calls(weights, config, args.teach_steps)
            print(f"weights: the demo's shape ({config}), taught to call the calculator in {args.teach_steps} steps "
                  f"({time.perf_counter() - began:.0f} s, last loss {loss:.3f})")
        else:
            torch.manual_seed(0)
            torch.save({k: v.half() for k, v in CausalLM(LMConfig(**config)).state_dict().items()}, weights)
            long_prompts(long_file, *CASES["minimind"]["single-turn"][1:4:2])
            print(f"weights: random (seed 0) at minimind's shape ({config}): nothing taught, a row ends early only "
                  f"if it draws <|im_end|>")
        print(f"device {device}, one thread; load average {os.getloadavg()[0]:.1f}; minimind's code from {peer}")
        specs = {case: dict(data=str(REPO / data if data else long_file), prompts=prompts, group=group, room=room,
                            completion=args.completion_len or completion, max_turns=turns, config=config,
                            weights=str(weights), device=device)
                 for case, (data, prompts, group, room, completion, turns) in CASES[args.shape].items()}
        for case, spec in specs.items():
            print(f"\n{case}: {Path(spec['data']).name}, {spec['prompts']} prompts x {spec['group']}, --max_seq_len "
                  f"{spec['room'] + spec['completion']} --max_completion_len {spec['completion']} --max_turns "
                  f"{spec['max_turns']}")
            theirs = "minimind TorchRolloutEngine" if spec["max_turns"] == 1 else "minimind train_agent loop"
            for name, code, extra in ((OLD, old, {}), ("engine (model/rollout.py)", REPO, {}),
                                      (theirs, REPO, {"peer": str(peer)})):
                for run in range(args.runs):
                    command = [sys.executable, __file__, "--measure", code, json.dumps({**spec, **extra})]
                    child = subprocess.run(command, capture_output=True, text=True, cwd=code,
                                           env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
                    if child.returncode:
                        sys.exit(f"error: {name}, {case}: {(child.stderr.strip().splitlines() or ['no output'])[-1]}")
                    got = json.loads(child.stdout.splitlines()[-1])
                    alone = got.get("generate_seconds")
                    print(f"  {name:28} run {run + 1}: {got['tokens']:6} tokens in {got['seconds']:7.2f} s = "
                          f"{got['tokens'] / got['seconds']:8.1f} tokens/s; tool calls run: {got['tool_calls_run']}"
                          + (f"; generate alone {alone:.2f} s = {got['tokens'] / alone:.1f} tokens/s" if alone else ""),
                          flush=True)
            print("  logits of minimind's model and ours, same weights, prompt 1 ({} tokens): largest difference "
                  "{:.3g} (largest logit {:.3g})".format(*got["logits"]))
    print(f"\nminimind samples with its generate's top_k 50 and top_p 0.85 (its agent loop at temperature 0.8); the "
          f"docstring says what else differs. {time.perf_counter() - began:.0f} s in all")


if __name__ == "__main__":
    main()

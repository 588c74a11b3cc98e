"""Loss past the trained length: no scaling, YaRN and linear position interpolation, measured.

A small model is pretrained with the project's own trainer at --max_seq_len 64 on the demo data (packed
windows, so every position up to 63 is trained), then read with eval_model.py's --rope_scaling flags on the
held-out dataset/val_demo.jsonl packed into windows of 64, 128 and 256 tokens. The loss is given per token
for the positions the model was trained at (0-63) and for those past them, apart, so the average of a long
window does not hide what happens past the trained length. Each seed trains its own model.

    python benchmarks/long_context.py                          # 2 seeds, one epoch (350 steps) each
    python benchmarks/long_context.py --seeds 1 --steps 100    # a quick look

docs/long_context.md holds a run's table and what it says; benchmarks/results/ its raw output.
"""

import argparse
import math
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo's packages

import torch  # noqa: E402

import eval_model  # noqa: E402
from dataset.lm_dataset import PackedPretrainDataset  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAINED = 64
SETTINGS = [(None, None), ("linear", 2), ("yarn", 2), ("linear", 4), ("yarn", 4)]  # (--rope_scaling, --rope_factor)
LENGTHS = (64, 128, 256)


def pretrain(out: Path, seed: int, steps: int) -> None:
    """The project's pretraining at --max_seq_len 64: out/pretrain_64.pth and the .json recording 64."""
    command = [sys.executable, str(REPO / "trainer" / "train_pretrain.py"), "--data_path",
               str(REPO / "dataset" / "pretrain_demo.jsonl"), "--save_dir", str(out / "out"), "--checkpoint_dir",
               str(out / "ckpt"), "--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4",
               "--num_key_value_heads", "2", "--max_seq_len", str(TRAINED), "--pack", "1", "--batch_size", "32",
               "--learning_rate", "3e-3", "--max_steps", str(steps), "--epochs", "1", "--seed", str(seed),
               "--device", "cpu", "--num_workers", "0", "--log_interval", "100", "--save_interval", "100000"]
    subprocess.run(command, cwd=out, check=True, stdout=subprocess.DEVNULL)


@torch.no_grad()
def losses_by_position(model, tokenizer, length: int) -> tuple[float, float]:
    """Mean loss per token of the held-out windows of `length` tokens: (positions < 64, positions >= 64)."""
    windows = PackedPretrainDataset(REPO / "dataset" / "val_demo.jsonl", tokenizer, length)
    inputs = torch.stack([windows[i][0] for i in range(len(windows))])
    per_token = model(inputs, labels=inputs, loss_reduction="none").loss[:, :-1]  # the last predicts nothing
    trained, beyond = per_token[:, :TRAINED - 1], per_token[:, TRAINED - 1:]  # loss at t predicts position t + 1
    return trained.mean().item(), beyond.mean().item() if beyond.numel() else math.nan


def measure(out: Path) -> dict:
    """{(setting, factor): {length: (loss within 64, loss past 64)}} of the model in `out`."""
    tokenizer = load_tokenizer(REPO / "model" / "tokenizer.json")
    table = {}
    for kind, factor in SETTINGS:
        flags = ["--weight", "pretrain", "--save_dir", str(out / "out"), "--device", "cpu"]
        if kind:
            flags += ["--rope_scaling", kind, "--rope_factor", str(factor)]
        model = eval_model.load_model(eval_model.build_arg_parser().parse_args(flags), tokenizer, torch.device("cpu"))
        table[kind, factor] = {length: losses_by_position(model, tokenizer, length) for length in LENGTHS}
    return table


def print_table(seed: int, table: dict) -> None:
    header = " | ".join(f"{length}: 0-63 | {length}: 64+" if length > TRAINED else f"{length}: 0-63"
                        for length in LENGTHS)
    print(f"\nseed {seed}: loss per token on dataset/val_demo.jsonl (trained at {TRAINED}), by window and positions")
    print(f"| setting | {header} |")
    print("|---" * (1 + 2 * len(LENGTHS) - 1) + "|")
    for (kind, factor), by_length in table.items():
        name = f"{kind} x{factor}" if kind else "none"
        cells = [f"{within:.3f} | {beyond:.3f}" if length > TRAINED else f"{within:.3f}"
                 for length, (within, beyond) in by_length.items()]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2, help="how many models to train (seeds 1, 2, ...)")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of pretraining per model, at most "
                                                                 "one epoch (350 steps)")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print(f"pretrain: hidden 64, 2 layers, --max_seq_len {TRAINED} --pack 1, batch 32, lr 3e-3, one epoch of "
          f"dataset/pretrain_demo.jsonl (at most {args.steps} steps)")
    for seed in range(1, args.seeds + 1):
        with tempfile.TemporaryDirectory() as tmp:
            pretrain(Path(tmp), seed, args.steps)
            print_table(seed, measure(Path(tmp)))


if __name__ == "__main__":
    main()

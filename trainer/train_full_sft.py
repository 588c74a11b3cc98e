"""Supervised fine-tuning: teach a pretrained model to answer in the ChatML chat format.

Loss is computed only on the assistant's tokens. Starts from out/pretrain_{hidden}.pth by
default (a missing or mismatching file is an error, never a silent random start).

    python trainer/train_full_sft.py
    torchrun --nproc_per_node 2 trainer/train_full_sft.py
    ... --from_resume 1                                             # continue, also on another GPU count

Writes out/full_sft_{hidden}.pth and checkpoints/full_sft_{hidden}_*. The loop is shared with
pretraining and lives in trainer/train_loop.py.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from dataset.lm_dataset import SFTDataset
from trainer.train_loop import run_training
from trainer.flags import build_arg_parser


def main() -> None:
    parser = build_arg_parser(__doc__.splitlines()[0], save_weight="full_sft", from_weight="pretrain",
                              data_path="dataset/sft_demo.jsonl", learning_rate=5e-5, epochs=2)
    run_training(parser.parse_args(), SFTDataset)


if __name__ == "__main__":
    main()

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
    # minimind's augmentations, off by default; drawn per (seed, epoch, sample), so resume stays exact.
    parser.add_argument("--system_prompt_ratio", type=float, default=None,
                        help="share of samples without a system message that get a generic one")
    parser.add_argument("--drop_empty_think_ratio", type=float, default=None,
                        help="share of samples whose empty <think> blocks are left out")
    args = parser.parse_args()

    def make_dataset(path: str, tokenizer, max_seq_len: int) -> SFTDataset:
        augment = path == args.data_path  # validation data is scored as it is
        return SFTDataset(path, tokenizer, max_seq_len, seed=args.seed,
                          system_prompt_ratio=(args.system_prompt_ratio or 0.0) if augment else 0.0,
                          drop_empty_think_ratio=(args.drop_empty_think_ratio or 0.0) if augment else 0.0)

    run_training(args, make_dataset)


if __name__ == "__main__":
    main()

"""Pretraining: teach a fresh model to continue text (next-token prediction on plain text).

Run it from anywhere after `pip install -e .` (see README.md):

    python trainer/train_pretrain.py                                # one process (CPU or one GPU)
    torchrun --nproc_per_node 2 trainer/train_pretrain.py           # 2 GPUs (or 2 CPU ranks) on one node
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8 \\
        --rdzv_backend c10d --rdzv_endpoint HOST:29500 trainer/train_pretrain.py   # node 0 of 2
    ... --from_resume 1                                             # continue, also on another GPU count

Writes out/pretrain_{hidden}.pth (FP16, for inference and SFT) and checkpoints/ (resume state).
Everything else is shared with SFT and lives in trainer/train_loop.py.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, goes first on the import path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from dataset.lm_dataset import PretrainDataset
from trainer.train_loop import run_training
from trainer.flags import build_arg_parser


def main() -> None:
    parser = build_arg_parser(__doc__.splitlines()[0], save_weight="pretrain", from_weight="none",
                              data_path="dataset/pretrain_demo.jsonl", learning_rate=5e-4, epochs=1)
    run_training(parser.parse_args(), PretrainDataset)


if __name__ == "__main__":
    main()

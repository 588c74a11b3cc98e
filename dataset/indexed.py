"""A dataset whose items carry their index, and the placeholder row of a short window.

The sampler (trainer/trainer_utils.py: SkipBatchSampler) hands every rank as many micro-batches as rank 0 in
an epoch's short last step, as DDP needs; a rank without data for one gets [PLACEHOLDER_INDEX], which becomes
a row whose labels are all ignored: it adds nothing to the next-token loss or its gradient (under MoE its
tokens are still routed, so they count in the router's balance loss, aux_loss). The index goes with each row
into the debug trace (--save_debug_train_output), which lists the samples each step trained.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

PLACEHOLDER_INDEX = -1


def trained_samples(micro_batches: list) -> tuple[list[int], int]:
    """The sample indices in a step's micro-batches (as IndexedDataset yields them) and the input tokens of their
    rows, padding included (for tokens/s): a placeholder row is neither, as it trains nothing."""
    rows = [(int(index), input_ids.numel()) for indices, batch, _ in micro_batches
            for index, input_ids in zip(indices, batch) if int(index) != PLACEHOLDER_INDEX]
    return [index for index, _ in rows], sum(tokens for _, tokens in rows)


class IndexedDataset(Dataset):
    """Items carry their index (for the debug trace); the placeholder is a row with every label ignored."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        input_ids, labels = self.dataset[max(index, 0)]
        return index, input_ids, (labels if index != PLACEHOLDER_INDEX else torch.full_like(labels, -100))

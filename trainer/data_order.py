"""Which samples each rank trains on, and in what order.

The whole data position of a run is one number: `samples_consumed`, how many samples of the
current epoch's permutation all ranks together have trained on. Everything else is derived:

    order     = epoch_order(seed, epoch, len(dataset))      # same for python and torchrun
    remaining = order[samples_consumed:]                    # a view: skipping costs O(1)
    step s    = remaining[s*G : (s+1)*G]                    # G = the global batch
    rank r    = step[r::world_size]                         # interleaved share, no overlap

Because a step always takes the next G samples of `remaining`, a run stopped after k steps has
consumed exactly `k*G` more samples, whatever the world size was, and a run resumed on another
world size simply continues at that cursor. The last step of an epoch may be short; every rank
still runs the same number of micro-steps (DDP needs that), and a rank without data in a slot
gets a placeholder micro-batch whose labels are all ignored, so it adds nothing to the gradient.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import Dataset, Sampler

# A batch-sampler slot that holds no sample: the dataset wrapper turns it into a fully ignored row.
PLACEHOLDER_INDEX = -1


def epoch_order(seed: int, epoch: int, num_samples: int) -> torch.Tensor:
    """The permutation of sample indices for one epoch; depends only on (seed, epoch, num_samples)."""
    generator = torch.Generator()
    generator.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def steps_left(num_samples: int, samples_consumed: int, global_batch: int) -> int:
    """Optimizer steps still to take in an epoch (the last one may be a short window)."""
    return math.ceil((num_samples - samples_consumed) / global_batch)


def steps_in_epoch(num_samples: int, global_batch: int) -> int:
    return steps_left(num_samples, 0, global_batch)


def step_in_epoch(num_samples: int, samples_consumed: int, global_batch: int) -> int:
    """The step label of a cursor: optimizer steps of `global_batch` that reach `samples_consumed`.

    Exact for any counts, because it is derived from the cursor (the data position) rather than
    rescaled from another run's step; on a world-size change it equals the reference design's
    `step * old_ws // new_ws` whenever that division is exact.
    """
    return steps_in_epoch(num_samples, global_batch) - steps_left(num_samples, samples_consumed, global_batch)


class SkipBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches for the rest of one epoch, starting at a sample cursor.

    Micro-batches come grouped by optimizer step: `micro_steps_per_step(s)` of them for step s,
    the same count on every rank. Resuming never reads the skipped samples: it slices the order.
    """

    def __init__(self, order: torch.Tensor, samples_consumed: int, global_batch: int,
                 batch_size: int, rank: int, world_size: int):
        if global_batch % (batch_size * world_size) != 0:
            raise ValueError(f"global batch {global_batch} is not a multiple of batch_size {batch_size} "
                             f"x world_size {world_size}")
        if not 0 <= samples_consumed <= len(order):
            raise ValueError(f"samples_consumed {samples_consumed} is outside the epoch of {len(order)} samples")
        self.remaining = order[samples_consumed:]
        self.global_batch = global_batch
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size

    def num_steps(self) -> int:
        return math.ceil(len(self.remaining) / self.global_batch)

    def step_window(self, step: int) -> torch.Tensor:
        """The samples (of all ranks) that optimizer step `step` trains on."""
        return self.remaining[step * self.global_batch:(step + 1) * self.global_batch]

    def micro_steps_per_step(self, step: int) -> int:
        # Rank 0 has the longest share of a short window, so its count is the one all ranks use.
        longest_share = math.ceil(len(self.step_window(step)) / self.world_size)
        return math.ceil(longest_share / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.num_steps()):
            share = self.step_window(step)[self.rank::self.world_size]
            for micro in range(self.micro_steps_per_step(step)):
                indices = share[micro * self.batch_size:(micro + 1) * self.batch_size].tolist()
                yield indices if indices else [PLACEHOLDER_INDEX]

    def __len__(self) -> int:
        return sum(self.micro_steps_per_step(step) for step in range(self.num_steps()))


class IndexedDataset(Dataset):
    """Wraps a dataset so each item also carries its index (for the debug trace).

    The placeholder index yields a row of sample 0 whose labels are all ignored (-100): it keeps
    DDP's collectives in step without contributing to the loss or the gradient.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        if index == PLACEHOLDER_INDEX:
            input_ids, labels = self.dataset[0]
            return index, input_ids, torch.full_like(labels, -100)
        input_ids, labels = self.dataset[index]
        return index, input_ids, labels

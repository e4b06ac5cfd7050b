"""Deterministic global batches: step ``s`` always sees the same samples, however they are split."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, default_collate


class GlobalBatches:
    """Sample indices of each step's global batch: a seeded permutation per epoch, read in order.

    Because the order depends only on (seed, step), a resumed or re-planned run
    sees exactly the data an uninterrupted one would.
    """

    def __init__(self, dataset_len: int, global_batch: int, seed: int):
        if dataset_len < global_batch:
            raise ValueError(f"dataset has {dataset_len} samples, fewer than the global batch {global_batch}")
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.seed = seed
        self.steps_per_epoch = dataset_len // global_batch

    def indices(self, step: int) -> torch.Tensor:
        """Indices of the global batch at ``step`` (the last partial batch of an epoch is dropped)."""
        epoch, i = divmod(step, self.steps_per_epoch)
        perm = torch.randperm(self.dataset_len, generator=torch.Generator().manual_seed(self.seed + epoch))
        return perm[i * self.global_batch : (i + 1) * self.global_batch]


def collate(dataset: Dataset, indices: torch.Tensor):
    """The batch of ``dataset`` at ``indices``."""
    return default_collate([dataset[int(i)] for i in indices])

"""Samplers whose order is a pure function of (seed, epoch), so resume needs no iterator state."""

from __future__ import annotations

import random
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


class EpochSampler(Sampler[int]):
    """Shuffled (or sequential) indices, truncated to a multiple of `multiple_of`.

    The trainer sets `multiple_of` = world size x per-device batch, so every rank gets the same
    number of full batches and no sample is duplicated to pad a rank; the few samples left over
    differ each epoch (the permutation changes) and their count is reported at start.
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True, multiple_of: int = 1):
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.multiple_of = max(1, multiple_of)
        self.epoch = 0
        if len(self) == 0:
            raise ValueError(f"dataset of {num_samples} samples is smaller than one global batch "
                             f"({self.multiple_of} = world size x per-device batch)")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def dropped_per_epoch(self) -> int:
        return self.num_samples - len(self)

    def __len__(self) -> int:
        return self.num_samples // self.multiple_of * self.multiple_of

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        return iter(order[: len(self)].tolist())


class WorkerSeeder:
    """worker_init_fn: seeds Python and NumPy in each worker from torch's per-worker seed."""

    def __call__(self, worker_id: int) -> None:  # noqa: ARG002
        seed = torch.initial_seed() % 2**32
        random.seed(seed)
        np.random.seed(seed)


class RankBatchSampler(Sampler[list[int]]):
    """This rank's batches of an EpochSampler: global batch k goes to rank k % world_size.

    Every rank iterates the same (seed, epoch) order, so the global batches are the same whatever
    the world size. `set_epoch(epoch, skip)` starts an epoch `skip` batches in without loading the
    skipped samples, which is how a resumed run gets back to its data position.
    """

    def __init__(self, sampler: EpochSampler, batch_size: int, rank: int, world_size: int, with_epoch: bool = False):
        self.sampler = sampler
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.with_epoch = with_epoch  # yield (epoch, index) keys for an EpochIndexed dataset
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.skip = skip

    def __len__(self) -> int:
        return len(self.sampler) // (self.batch_size * self.world_size)

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(self.sampler)
        step = self.batch_size * self.world_size
        for start in range(self.skip * step, len(indices), step):
            offset = start + self.rank * self.batch_size
            batch = indices[offset: offset + self.batch_size]
            yield [(self.sampler.epoch, i) for i in batch] if self.with_epoch else batch


class EpochIndexed(Dataset):
    """Passes the epoch to datasets with `get_item(index, epoch)` (per-epoch random crops that a
    resumed run reproduces exactly, even inside persistent worker processes)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        return self.dataset.get_item(index, epoch)

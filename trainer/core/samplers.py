"""Samplers whose order is a pure function of (seed, epoch), so resume needs no iterator state."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from trainer.task import EpochAwareDataset


class EpochSampler(Sampler[int]):
    """Shuffled (or sequential) indices, truncated to a multiple of `multiple_of`.

    The trainer sets `multiple_of` = the global batch (world size x per-device batch x accumulation), so
    every rank gets the same number of full batches, an epoch is whole optimizer steps and no sample is
    duplicated to pad a rank; the few samples left over differ each epoch (the permutation changes) and
    their count is reported at start.
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True, multiple_of: int = 1):
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.multiple_of = max(1, multiple_of)
        self.epoch = 0
        if len(self) == 0:
            raise ValueError(f"dataset of {num_samples} samples is smaller than one global batch "
                             f"({self.multiple_of} = world size x per-device batch x accumulation)")

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
        self.with_epoch = with_epoch  # yield (epoch, index) keys for a KeyedSamples dataset
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.skip = skip

    def __len__(self) -> int:
        return len(self.sampler) // (self.batch_size * self.world_size)

    def position(self, consumed: int) -> tuple[int, int]:
        """(epoch, batches of it done) after `consumed` batches of this rank since the start."""
        return divmod(consumed, len(self))

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(self.sampler)
        step = self.batch_size * self.world_size
        for start in range(self.skip * step, len(indices), step):
            offset = start + self.rank * self.batch_size
            batch = indices[offset: offset + self.batch_size]
            yield [(self.sampler.epoch, i) for i in batch] if self.with_epoch else batch


def _balanced_split(sizes: np.ndarray, parts: int, capacity: int | None = None) -> list[list[int]]:
    """Split positions 0..len(sizes)-1 into `parts` lists with even size sums (largest first into the
    lightest part, the LPT rule; at most `capacity` items per part when given)."""
    loads = np.zeros(parts, dtype=np.int64)
    counts = np.zeros(parts, dtype=np.int64)
    out: list[list[int]] = [[] for _ in range(parts)]
    for pos in np.argsort(-sizes, kind="stable"):
        open_parts = np.flatnonzero(counts < capacity) if capacity else np.arange(parts)
        target = open_parts[np.argmin(loads[open_parts])]
        out[target].append(int(pos))
        loads[target] += sizes[pos]
        counts[target] += 1
    return out


class BalancedBatchSampler(Sampler[list[int]]):
    """This rank's batches when samples differ in cost (atoms, tokens, edges).

    Every rank computes the same global plan from (seed, epoch), so a resumed or rescaled run needs no
    iterator state, and every rank gets the same number of micro-batches.

    - `balanced` (fairchem's balanced batch sampler): each global batch holds world_size x batch_size
      samples in shuffled order, split across ranks so that their unit sums are even.
    - `budget`: windows of `bucket_size` shuffled samples are sorted by size and cut into global batches
      of world_size micro-batches of at most `max_units` units each (split evenly, LPT); the batches
      are then shuffled, so similar lengths share a batch without the epoch being ordered by length.
      A sample larger than the budget is an error; samples left over at the end of an epoch (fewer
      than world_size) wait for the next epoch's order and are counted in `dropped_per_epoch`.
    """

    def __init__(self, sizes, *, mode: str, seed: int, rank: int, world_size: int, shuffle: bool = True,
                 batch_size: int = 1, max_units: int = 0, bucket_size: int = 0, with_epoch: bool = False):
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.mode, self.seed, self.rank, self.world_size = mode, seed, rank, world_size
        self.shuffle, self.batch_size, self.max_units = shuffle, batch_size, max_units
        self.with_epoch = with_epoch
        if mode == "budget":
            too_big = np.flatnonzero(self.sizes > max_units)
            if too_big.size:
                raise ValueError(f"{too_big.size} samples exceed max_units_per_batch={max_units} "
                                 f"(largest {int(self.sizes.max())} units, e.g. sample {int(too_big[0])}); "
                                 f"raise the budget or crop the samples")
            mean = max(1.0, float(self.sizes.mean())) if self.sizes.size else 1.0
            per_global = max(1, int(max_units / mean) * world_size)
            self.bucket_size = bucket_size or 64 * per_global
        elif mode != "balanced":
            raise ValueError(f"unknown batching mode {mode!r}: balanced or budget")
        self.epoch, self.skip = 0, 0
        self._plans: dict[int, list[list[list[int]]]] = {}
        if len(self) == 0:
            raise ValueError(f"{self.sizes.size} samples make no full global batch of {world_size} ranks")

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """Global batches of `epoch`: a list of [rank 0 indices, rank 1 indices, ...]."""
        if epoch not in self._plans:
            self._plans = {epoch: self._build_plan(epoch)}  # one epoch cached: plans are cheap
        return self._plans[epoch]

    def _build_plan(self, epoch: int) -> list[list[list[int]]]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.sizes.size) if self.shuffle else np.arange(self.sizes.size)
        batches: list[list[list[int]]] = []
        if self.mode == "balanced":
            step = self.batch_size * self.world_size
            for start in range(0, order.size - step + 1, step):
                chunk = order[start:start + step]
                parts = _balanced_split(self.sizes[chunk], self.world_size, capacity=self.batch_size)
                batches.append([chunk[part].tolist() for part in parts])
            return batches
        pending = np.empty(0, dtype=np.int64)
        for start in range(0, order.size, self.bucket_size):
            window = np.concatenate([pending, order[start:start + self.bucket_size]])
            window = window[np.argsort(-self.sizes[window], kind="stable")]
            pending = self._cut_window(window, batches)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def _cut_window(self, window: np.ndarray, batches: list) -> np.ndarray:
        """Append global batches cut from `window` (sorted by size, descending); return the rest."""
        budget_total = self.max_units * self.world_size
        start = 0
        while window.size - start >= self.world_size:
            # Grow the global batch while the LPT split can still keep every rank within budget.
            end, total = start, 0
            while end < window.size and total + self.sizes[window[end]] <= budget_total:
                total += self.sizes[window[end]]
                end += 1
            while end - start >= self.world_size:
                chunk = window[start:end]
                parts = _balanced_split(self.sizes[chunk], self.world_size)
                if all(self.sizes[chunk[p]].sum() <= self.max_units for p in parts):
                    break
                end -= 1  # cannot fail for world_size samples: one each, each within the budget
            if end - start < self.world_size:
                break
            batches.append([chunk[part].tolist() for part in parts])
            start = end
        return window[start:]

    @property
    def num_samples(self) -> int:
        return int(self.sizes.size)

    @property
    def dropped_per_epoch(self) -> int:
        return int(self.sizes.size - sum(len(r) for batch in self.plan(self.epoch) for r in batch))

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip

    def __len__(self) -> int:
        return len(self.plan(self.epoch))

    def position(self, consumed: int) -> tuple[int, int]:
        """(epoch, batches of it done) after `consumed` batches; budget plans differ in length per epoch."""
        epoch = 0
        while consumed >= len(self.plan(epoch)):
            consumed -= len(self.plan(epoch))
            epoch += 1
        return epoch, consumed

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.plan(self.epoch)[self.skip:]:
            mine = batch[self.rank]
            yield [(self.epoch, i) for i in mine] if self.with_epoch else mine


class KeyedSamples(Dataset):
    """The training set read by the (epoch, index) keys the batch samplers yield: each item comes back as
    (item, epoch, index), so the sample's key travels with it (through DataLoader worker processes too) and
    the collate step gives every row its seed (`loaders.KeyedCollate`). A dataset with `get_item(index,
    epoch)` gets the epoch (per-epoch random crops that a resumed run reproduces exactly)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self.epoch_aware = isinstance(dataset, EpochAwareDataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> tuple[Any, int, int]:
        epoch, index = key
        item = self.dataset.get_item(index, epoch) if self.epoch_aware else self.dataset[index]
        return item, epoch, index

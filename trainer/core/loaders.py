"""DataLoaders of a run: this rank's training micro-batches, and the eval/test loaders.

Map-style training data is sharded over ranks by our own batch samplers (`samplers.py`) rather than
by a prepared loader: the data position is then a pure function of the step (a resumed run starts
mid-epoch without loading the skipped batches) and no wrapper sits in the loop.

A stream (`trainer.task.GlobalStream`) gives each epoch's samples in one order, the same in every process,
and is sharded here by global sample index (`StreamBatches`), as map-style data is: with per-device batch B,
W processes and accumulation A (global batch G = B x W x A), global sample g of the epoch belongs to rank
(g // B) % W, and per-device batch j of a rank to DataLoader worker j % num_workers (the DataLoader takes
batches from its workers in turn, so they arrive in order). A rank is handed the samples of a global batch
once the whole global batch exists, so every rank has the same number of micro-batches per epoch and no
rank ever runs into another epoch; the tail shorter than one global batch is dropped and logged. The data
position of a stream is (epoch, global samples read in it), the same on every rank: a run resumed at any world
size or accumulation starts at that global index (the samples before it are scanned, not decoded) and reads
exactly what the uninterrupted run would have read.

Every training micro-batch comes with its rows' random streams (`MicroBatch(batch, rng)`, `rng` a
`trainer.sample_random.SampleRandom`), which `Task.loss` draws from. The batch samplers (map-style) and
`StreamBatches` yield (item, epoch, index) keys and `KeyedCollate` turns the keys into row seeds, in the
worker that loaded the samples: row seed = f(run.seed, epoch, dataset index) for map-style data and
f(run.seed, epoch, global index) for a stream, the same at any world size, accumulation split or batching mode.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader, IterableDataset, Subset, get_worker_info

from trainer.config import Config, ConfigError
from trainer.core.batch_plan import BatchPlan
from trainer.core.samplers import (
    SAMPLE_ORDER,
    BalancedBatchSampler,
    EpochSampler,
    KeyedSamples,
    RankBatchSampler,
    WorkerSeeder,
)
from trainer.data.mapped_pages import MappedPageBound
from trainer.errors import DataError, TrainerError
from trainer.sample_random import SampleRandom
from trainer.seeding import derive_seed
from trainer.task import EpochAwareStream, GlobalStream, Task

logger = logging.getLogger("trainer")


class MicroBatch(NamedTuple):
    """One training micro-batch of this rank: the task's collated `batch` and its rows' `rng`."""

    batch: Any
    rng: SampleRandom


class EpochEnd(NamedTuple):
    """The last item of a stream epoch's loader: the number of samples the whole epoch had."""

    samples: int


class BoundedCollate:
    """collate_fn: the task's collate, then, in the process that loaded the batch (a worker or the rank), a check
    that drops its resident pages of mapped data files past data.mapped_pages_mb (`MappedPageBound`)."""

    def __init__(self, collate: Any, mapped_pages_mb: float):
        self.collate, self.bound = collate, MappedPageBound(mapped_pages_mb)

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.collate(samples)
        self.bound()
        return batch


class KeyedCollate:
    """collate_fn of the training loader: (item, epoch, index) triples -> MicroBatch (the task's collate of the
    items, and the rows' SampleRandom from their keys), computed where the samples were loaded. An `EpochEnd`
    (a stream's) passes through."""

    def __init__(self, collate: Any, seed: int):
        self.collate, self.seed = collate, seed

    def __call__(self, items: list[tuple[Any, int, int]] | EpochEnd) -> MicroBatch | EpochEnd:
        if isinstance(items, EpochEnd):
            return items
        samples, epochs, indices = zip(*items)
        return MicroBatch(self.collate(list(samples)), SampleRandom.for_samples(self.seed, epochs, indices))


class StreamBatches(IterableDataset):
    """One rank's per-device batches of a `GlobalStream` epoch, from a global position (module docstring).

    Iterated in a DataLoader (batch_size=None, `KeyedCollate`): each worker yields its own batches, lists of
    (sample, epoch, global index), then the worker whose turn it would be next yields `EpochEnd(samples)`.
    `set_position(epoch, start)` starts at global sample `start` of `epoch`: sample start + r goes to rank
    (r // B) % W as its per-device batch (r // B) // W. Samples of a global batch are handed out only once
    its last sample was read, so the tail shorter than one global batch is never handed out.
    """

    def __init__(self, stream: GlobalStream, batch_size: int, rank: int, world_size: int, grad_accum_steps: int):
        self.stream, self.batch_size, self.rank, self.world_size = stream, batch_size, rank, world_size
        self.accum = grad_accum_steps
        self.global_batch = batch_size * world_size * grad_accum_steps
        self.epoch, self.start = 0, 0

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[list[tuple[Any, int, int]] | EpochEnd]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        epoch, start, size, world, whole = self.epoch, self.start, self.batch_size, self.world_size, self.global_batch

        def wanted(g: int) -> bool:  # this rank's per-device batch (g - start) // size // world, on this worker?
            slot = (g - start) // size
            return g >= start and slot % world == self.rank and slot // world % workers == worker

        if isinstance(self.stream, EpochAwareStream):
            self.stream.set_epoch(epoch)
        pending: list[tuple[Any, int, int]] = []
        samples = 0
        for g, sample in enumerate(self.stream.iter_global(wanted)):
            samples = g + 1
            if sample is not None and wanted(g):  # a stream may decode more than it was asked for
                pending.append((sample, epoch, g))
            if g >= start and (samples - start) % whole == 0:  # global batch complete: hand out this rank's part
                for k in range(0, len(pending), size):
                    yield pending[k:k + size]
                pending = []
        batches = max(0, samples - start) // whole * self.accum  # this rank's per-device batches since `start`
        if batches % workers == worker:  # the next batch's worker: the loader hands this out after the last batch
            yield EpochEnd(samples)


def unit_fractions(task: Task, batches: list[Any], accelerator: Any) -> tuple[list, Any]:
    """Each of this rank's micro-batches' share of the units (`Task.batch_weight`) of the whole optimizer step (all
    ranks), and this rank's units: the weights of the step's mean loss."""
    acc = accelerator
    weights = [task.batch_weight(b) for b in batches]
    if acc.num_processes == 1 and all(isinstance(w, (int, float)) for w in weights):
        total = float(sum(weights))  # host numbers: no device work at all
        return [w / total for w in weights], total
    weights = [w.to(acc.device, torch.float32) if isinstance(w, torch.Tensor)
               else torch.full((), float(w), dtype=torch.float32, device=acc.device) for w in weights]
    local = weights[0] if len(weights) == 1 else torch.stack(weights).sum()
    total = acc.reduce(local, reduction="sum") if acc.num_processes > 1 else local
    return [w / total for w in weights], local


def loader_options(cfg: Config, task: Task) -> dict[str, Any]:
    """DataLoader keywords shared by the training, eval and test loaders."""
    return dict(collate_fn=BoundedCollate(task.collate, cfg.data.mapped_pages_mb), num_workers=cfg.data.num_workers,
                pin_memory=cfg.data.pin_memory and torch.cuda.is_available(),
                worker_init_fn=WorkerSeeder(), persistent_workers=cfg.data.num_workers > 0)


EVAL_SUBSET_SALT = 0x6576616C5F737562
"""Mixed into the sample index before hashing. A constant, not run.seed: runs with different seeds evaluate the same
validation samples, so their eval metrics compare."""


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic): a bijection of uint64, so distinct indices
    never tie."""
    z = values + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def eval_subset(num_samples: int, max_samples: int) -> np.ndarray | None:
    """The indices (ascending) of the `max_samples` samples of an eval split of `num_samples` that are evaluated:
    those whose index hashes lowest, or None (the whole split) when `max_samples` is 0 or not below `num_samples`.

    A pure function of the two numbers: the same subset on every rank, at every world size, at every evaluation
    and after a resume. Each index's hash does not depend on `num_samples`, so a grown split keeps the samples of
    the smaller one that still hash lowest. Vectorised: no Python loop over the split."""
    if max_samples < 0:
        raise ConfigError(f"config key 'eval.max_samples' must be >= 0, got {max_samples}")
    if max_samples == 0 or num_samples <= max_samples:
        return None
    keys = _splitmix64(np.arange(num_samples, dtype=np.uint64) ^ np.uint64(EVAL_SUBSET_SALT))
    return np.sort(np.argpartition(keys, max_samples - 1)[:max_samples])


def build_eval_loader(cfg: Config, task: Task, dataset: Any, per_device_batch_size: int, split: str) -> DataLoader:
    """An unshuffled loader over an eval/test set (to be `accelerator.prepare`d: it pads ranks evenly), in
    batches of eval.batch_size, else the training run's `per_device_batch_size`, in index order or, with
    eval.balanced_batches, in `balanced_eval_order`. The eval split is cut to
    eval.max_samples samples (`eval_subset`); the test split is always whole: a test number covers the test set."""
    limit = cfg.eval.max_samples if split == "eval" else 0
    if limit:
        if not hasattr(dataset, "__len__") or isinstance(dataset, IterableDataset):
            raise ConfigError(f"eval.max_samples={limit}: task '{cfg.task.name}' gives an eval set without a length "
                              f"({type(dataset).__name__}); the cap needs a map-style eval set (or eval.max_samples=0)")
        chosen = eval_subset(len(dataset), limit)
        if chosen is None:
            logger.info("eval: the whole validation split, %d samples (eval.max_samples=%d)", len(dataset), limit)
        else:
            logger.info("eval: %d of the %d validation samples (eval.max_samples, chosen by a hash of the index: the "
                        "same at every evaluation and world size)", len(chosen), len(dataset))
            dataset = Subset(dataset, chosen.tolist())  # items keep their own index: per-sample seeds are unchanged
    batch_size = cfg.eval.batch_size or per_device_batch_size
    order = None
    if cfg.eval.balanced_batches:
        sizes = task.unit_sizes(dataset.dataset if isinstance(dataset, Subset) else dataset)
        if sizes is None:
            raise ConfigError(f"eval.balanced_batches needs unit sizes, which task '{cfg.task.name}' does not give "
                              f"(Task.unit_sizes)")
        sizes = np.asarray(sizes)
        if isinstance(dataset, Subset):
            sizes = sizes[np.asarray(dataset.indices)]
        order = balanced_eval_order(sizes, batch_size).tolist()
    # Its own generator: a (re)created iterator would otherwise draw from the global RNG, which a
    # resumed run restores.
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=order,
                      generator=torch.Generator().manual_seed(cfg.run.seed), **loader_options(cfg, task))


def balanced_eval_order(sizes: np.ndarray, batch_size: int) -> np.ndarray:
    """An order of the samples whose consecutive runs of `batch_size` have near-equal total size.

    The samples are sorted by size and cut into `batch_size` strata, whose k-th members make up batch k; odd
    strata are dealt in reverse (a snake), so a batch that drew a large sample from one stratum draws a small one
    from the next. The `len(sizes) % batch_size` samples left over are taken evenly across the sorted order and
    come last, as the short final batch. Vectorised; a pure function of the sizes (ties by index)."""
    n = len(sizes)
    ranked = np.argsort(np.asarray(sizes), kind="stable")
    batches, rest = divmod(n, batch_size)
    if batches == 0:
        return ranked
    tail_at = np.linspace(0, n - 1, rest).round().astype(np.int64) if rest else np.zeros(0, np.int64)
    keep = np.ones(n, dtype=bool)
    keep[tail_at] = False
    grid = ranked[keep].reshape(batch_size, batches)  # row k: stratum k, ascending
    grid[1::2] = grid[1::2, ::-1]
    return np.concatenate([grid.T.reshape(-1), ranked[tail_at]])


def build_batch_sampler(cfg: Config, batch: BatchPlan, task: Task, dataset: Any, rank: int, world_size: int,
                        with_epoch: bool) -> tuple[EpochSampler | BalancedBatchSampler,
                                                   RankBatchSampler | BalancedBatchSampler]:
    """(sampler, this rank's batch sampler): fixed counts, or balanced/budgeted by the task's unit sizes; the
    per-device batch and accumulation are the run plan's `batch`."""
    t = batch
    global_batch = world_size * t.per_device_batch_size * t.grad_accum_steps
    if cfg.data.batching != "budget" and len(dataset) < global_batch:  # no batch at all: the loop would spin
        raise DataError(f"task '{cfg.task.name}', split train: {len(dataset)} samples, fewer than one global batch "
                        f"of {global_batch} ({t.per_device_batch_size} per device x {t.grad_accum_steps} "
                        f"accumulation x {world_size} processes); lower train.per_device_batch_size or give more data")
    if cfg.data.batching == "fixed":
        # An epoch is whole global batches: optimizer step s reads global samples [s x G, (s+1) x G) of the
        # (seed, epoch) order however G is split over ranks and micro-batches, so a run resumed on another
        # world size continues with exactly the samples the uninterrupted run would have read.
        sampler = EpochSampler(len(dataset), cfg.run.seed, cfg.data.shuffle, multiple_of=global_batch,
                               block=cfg.data.shuffle_block, window=cfg.data.shuffle_window)
        return sampler, RankBatchSampler(sampler, t.per_device_batch_size, rank, world_size,
                                         with_epoch=with_epoch)
    sizes = task.unit_sizes(dataset)
    if sizes is None:
        raise ConfigError(f"data.batching={cfg.data.batching} needs unit sizes, which task "
                          f"'{cfg.task.name}' does not give (Task.unit_sizes)")
    try:
        sampler = BalancedBatchSampler(
            sizes, mode=cfg.data.batching, seed=cfg.run.seed, rank=rank, world_size=world_size,
            shuffle=cfg.data.shuffle, batch_size=t.per_device_batch_size,
            max_units=cfg.data.max_units_per_batch, bucket_size=cfg.data.bucket_size, with_epoch=with_epoch,
            block=cfg.data.shuffle_block, window=cfg.data.shuffle_window)
    except ValueError as err:
        raise ConfigError(f"data.batching={cfg.data.batching}: {err}") from err
    return sampler, sampler


class TrainBatches:
    """This rank's training micro-batches, endless (epochs follow one another), from any data position.

    `micro_batches(consumed)` starts after `consumed` micro-batches of this rank: for map-style data
    the (epoch, batch) position follows from that count (every rank has the same number of batches
    per epoch); a stream resumes from its own `position` (epoch, global samples read in it), the same on
    every rank, which a checkpoint saves.
    """

    def __init__(self, cfg: Config, batch: BatchPlan, task: Task, dataset: Any, rank: int, world_size: int,
                 device: torch.device):
        self.seed, self.rank, self.world_size, self.device = cfg.run.seed, rank, world_size, device
        self.dataset = dataset  # the task's training set, as built
        # Its own generator, reseeded every epoch: iterators must not draw from the global RNG (which
        # a resumed run restores) and worker seeds must be a function of (seed, rank, epoch).
        self.generator = torch.Generator()
        self.position = (0, 0)  # a stream's (epoch, global samples of it read), the same on every rank
        # Map-style: (epoch, this rank's micro-batches before it) of the epoch being read, which a checkpoint keeps
        # so that a resume finds its budget position without building the earlier epochs' plans.
        self.epoch_start = (0, 0)
        self.task_name, self.batch_size, self.accum = cfg.task.name, batch.per_device_batch_size, \
            batch.grad_accum_steps  # for the error of an epoch without a batch
        self.epoch_samples: dict[int, int] = {}  # a stream's epoch -> its samples, once read to its end
        options = loader_options(cfg, task)
        options["collate_fn"] = KeyedCollate(options["collate_fn"], self.seed)
        self.streaming = isinstance(dataset, GlobalStream)
        if self.streaming:
            self.stream = StreamBatches(dataset, self.batch_size, rank, world_size, self.accum)
            self.sampler = self.batch_sampler = None
            # A fresh copy of the stream in its workers every epoch: persistent ones would keep the last position.
            options["persistent_workers"] = False
            self.loader = DataLoader(self.stream, batch_size=None, generator=self.generator, **options)
        elif isinstance(dataset, IterableDataset):
            raise ConfigError(f"{type(dataset).__name__} is an IterableDataset without iter_global(wanted) "
                              f"(trainer.task.GlobalStream): the core shards a stream by global sample index")
        else:
            self.sampler, self.batch_sampler = build_batch_sampler(cfg, batch, task, dataset, rank, world_size, True)
            self.loader = DataLoader(KeyedSamples(dataset), batch_sampler=self.batch_sampler, generator=self.generator,
                                     **options)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size * self.accum

    @property
    def sample_order(self) -> str:
        """The recorded name of the map-style order (`samplers.sample_order_name`)."""
        return SAMPLE_ORDER if self.sampler is None else self.sampler.order_name

    def order_state(self) -> dict[str, Any]:
        """What a map-style checkpoint records of the data: the order's name and, for budget batching, the start
        of the epoch being read (valid for the same `plan_key` only)."""
        state: dict[str, Any] = {"sample_order": self.sample_order}
        if isinstance(self.batch_sampler, BalancedBatchSampler) and self.batch_sampler.mode == "budget":
            state.update(epoch_start=list(self.epoch_start), budget_plan=self.batch_sampler.plan_key)
        return state

    def restore_order_state(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's epoch start (`order_state`) where it was recorded for the same budget plan."""
        start = state.get("epoch_start")
        if (start is not None and isinstance(self.batch_sampler, BalancedBatchSampler)
                and state.get("budget_plan") == self.batch_sampler.plan_key):
            self.batch_sampler.add_epoch_start(int(start[0]), int(start[1]))

    @property
    def batches_per_epoch(self) -> int | None:
        """Micro-batches of this rank per epoch (of the current epoch for budget batching); None for a stream."""
        return None if self.batch_sampler is None else len(self.batch_sampler)

    def epoch(self, consumed: int) -> float:
        """Epochs done after `consumed` micro-batches (for the logs)."""
        return self.position[0] if self.streaming else consumed / len(self.batch_sampler)

    def micro_batch(self, indices: list[int], epoch: int = 0) -> MicroBatch:
        """The map-style micro-batch of training samples `indices` read in `epoch`, as the loader builds it (on
        the CPU): for tests and benchmarks that step the Trainer by hand."""
        return self.loader.collate_fn([self.loader.dataset[(epoch, i)] for i in indices])

    def micro_batches(self, consumed: int) -> Iterator[MicroBatch]:
        """Endless micro-batches of this rank, on its device, starting after `consumed` of them (map-style) or at
        `position` (a stream)."""
        on_cpu = self.device.type == "cpu"
        batches = self._stream_batches() if self.streaming else self._map_batches(consumed)
        for batch in batches:
            yield batch if on_cpu else MicroBatch(send_to_device(batch.batch, self.device, non_blocking=True),
                                                  batch.rng)

    def _map_batches(self, consumed: int) -> Iterator[MicroBatch]:
        epoch, skip = self.batch_sampler.position(consumed)
        start = consumed - skip
        while True:
            # Set when the epoch's first batch is asked for: never after the step a checkpoint saves.
            self.epoch_start = (epoch, start)
            self.generator.manual_seed(derive_seed(self.seed, "train-loader", self.rank, epoch))
            self.batch_sampler.set_epoch(epoch, skip)
            empty = skip == 0
            for batch in self.loader:
                empty = False
                yield batch
            if empty:  # a whole epoch without a batch: looping on would spin (and peers wait) forever
                raise DataError(f"rank {self.rank}: the training set gave no batch in epoch {epoch} "
                                f"(task '{self.task_name}', split train)")
            start += len(self.batch_sampler)  # this epoch's batches (its plan is built: it was read)
            epoch, skip = epoch + 1, 0

    def _stream_batches(self) -> Iterator[MicroBatch]:
        epoch, start = self.position
        per_batch = self.batch_size * self.world_size  # global samples read per micro-batch of every rank
        while True:
            self.generator.manual_seed(derive_seed(self.seed, "train-loader", self.rank, epoch))
            self.stream.set_position(epoch, start)
            end = None
            for read, item in enumerate(self.loader, start=1):
                if isinstance(item, EpochEnd):
                    end = item
                    continue
                self.position = (epoch, start + read * per_batch)
                yield item
            if end is None:
                raise DataError(f"rank {self.rank}: the training stream's loader ended epoch {epoch} without its "
                                f"end marker (task '{self.task_name}', split train)")
            self._epoch_end(epoch, end.samples)
            epoch, start = epoch + 1, 0
            self.position = (epoch, start)

    def _epoch_end(self, epoch: int, samples: int) -> None:
        """Check and log a stream epoch's length: fewer samples than one global batch would loop forever."""
        whole = self.global_batch
        if samples < whole:
            raise DataError(f"task '{self.task_name}', split train: the training stream gave {samples} samples in "
                            f"epoch {epoch}, fewer than one global batch of {whole} ({self.batch_size} per device x "
                            f"{self.accum} accumulation x {self.world_size} processes); lower "
                            f"train.per_device_batch_size or give more data")
        if self.rank == 0 and samples != self.epoch_samples.get(epoch - 1):
            logger.info("the training stream's epoch %d had %d samples: %d global batches of %d, the last %d "
                        "samples left out (a stream's tail shorter than one global batch)", epoch, samples,
                        samples // whole, whole, samples % whole)
        self.epoch_samples[epoch] = samples


def agreed_start(batches: Iterator[Any], accelerator: Any) -> Iterator[Any]:
    """`batches`, whose first micro-batch every rank fetches before any of them trains: when the data of
    one rank fails (a stream without a full batch, a reader error) every rank raises, instead of the
    others waiting for it in the first step's collectives forever."""
    failure: Exception | None = None
    try:
        first = next(batches)
    except Exception as err:  # noqa: BLE001 - raised again below, after the other ranks heard of it
        failure = err
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        mine = None if failure is None else (str(failure) if isinstance(failure, TrainerError)
                                             else f"rank {accelerator.process_index}: {failure!r}")
        problems = [p for p in gather_object([mine]) if p is not None]
        if failure is None and problems:
            raise DataError(f"the training data failed on another rank before the first step: {'; '.join(problems)}")
    if failure is not None:
        raise failure
    yield first
    yield from batches

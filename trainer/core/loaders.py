"""DataLoaders of a run: this rank's training micro-batches, and the eval/test loaders.

Map-style training data is sharded over ranks by our own batch samplers (`samplers.py`) rather than
by a prepared loader: the data position is then a pure function of the step (a resumed run starts
mid-epoch without loading the skipped batches) and no wrapper sits in the loop. A stream shards
itself over ranks and workers (`ShardedStream`) and its position is saved per rank.

Every training micro-batch comes with its rows' random streams (`MicroBatch(batch, rng)`, `rng` a
`trainer.sample_random.SampleRandom`), which `Task.loss` draws from. Map-style: the batch samplers
yield (epoch, index) keys, `KeyedSamples` returns each item with its key and `KeyedCollate` turns the
keys into row seeds, in the worker that loaded the samples: row seed = f(run.seed, epoch, dataset
index), the same at any world size, accumulation split or batching mode. A stream's rows are keyed
by (run.seed, rank, epoch, position in this rank's stream): exact on a resume at the same world size
(a stream restarts its epoch on another one), not across world sizes until streams are sharded by
a global index.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader, IterableDataset

from trainer.config import Config, ConfigError
from trainer.core.samplers import BalancedBatchSampler, EpochSampler, KeyedSamples, RankBatchSampler, WorkerSeeder
from trainer.errors import DataError, TrainerError
from trainer.sample_random import SampleRandom
from trainer.seeding import derive_seed, derive_seeds
from trainer.task import EpochAwareStream, ShardedStream, Task


class MicroBatch(NamedTuple):
    """One training micro-batch of this rank: the task's collated `batch` and its rows' `rng`."""

    batch: Any
    rng: SampleRandom


class KeyedCollate:
    """collate_fn of the map-style training loader: (item, epoch, index) triples -> MicroBatch (the task's
    collate of the items, and the rows' SampleRandom from their keys), computed where the samples were loaded."""

    def __init__(self, collate: Any, seed: int):
        self.collate, self.seed = collate, seed

    def __call__(self, items: list[tuple[Any, int, int]]) -> MicroBatch:
        samples, epochs, indices = zip(*items)
        return MicroBatch(self.collate(list(samples)), SampleRandom.for_samples(self.seed, epochs, indices))


def loader_options(cfg: Config, task: Task) -> dict[str, Any]:
    """DataLoader keywords shared by the training, eval and test loaders."""
    return dict(collate_fn=task.collate, num_workers=cfg.data.num_workers,
                pin_memory=cfg.data.pin_memory and torch.cuda.is_available(),
                worker_init_fn=WorkerSeeder(), persistent_workers=cfg.data.num_workers > 0)


def build_eval_loader(cfg: Config, task: Task, dataset: Any) -> DataLoader:
    """An unshuffled loader over a whole eval/test set (to be `accelerator.prepare`d: it pads ranks evenly)."""
    # Its own generator: a (re)created iterator would otherwise draw from the global RNG, which a
    # resumed run restores.
    return DataLoader(dataset, batch_size=cfg.eval.batch_size or cfg.train.per_device_batch_size, shuffle=False,
                      generator=torch.Generator().manual_seed(cfg.run.seed), **loader_options(cfg, task))


def build_batch_sampler(cfg: Config, task: Task, dataset: Any, rank: int, world_size: int,
                        with_epoch: bool) -> tuple[EpochSampler | BalancedBatchSampler,
                                                   RankBatchSampler | BalancedBatchSampler]:
    """(sampler, this rank's batch sampler): fixed counts, or balanced/budgeted by the task's unit sizes."""
    t = cfg.train
    global_batch = world_size * t.per_device_batch_size * t.grad_accum_steps
    if cfg.data.batching != "budget" and len(dataset) < global_batch:  # no batch at all: the loop would spin
        raise DataError(f"task '{cfg.task.name}', split train: {len(dataset)} samples, fewer than one global batch "
                        f"of {global_batch} ({t.per_device_batch_size} per device x {t.grad_accum_steps} "
                        f"accumulation x {world_size} processes); lower train.per_device_batch_size or give more data")
    if cfg.data.batching == "fixed":
        # An epoch is whole global batches: optimizer step s reads global samples [s x G, (s+1) x G) of the
        # (seed, epoch) order however G is split over ranks and micro-batches, so a run resumed on another
        # world size continues with exactly the samples the uninterrupted run would have read.
        sampler = EpochSampler(len(dataset), cfg.run.seed, cfg.data.shuffle, multiple_of=global_batch)
        return sampler, RankBatchSampler(sampler, cfg.train.per_device_batch_size, rank, world_size,
                                         with_epoch=with_epoch)
    sizes = task.unit_sizes(dataset)
    if sizes is None:
        raise ConfigError(f"data.batching={cfg.data.batching} needs unit sizes, which task "
                          f"'{cfg.task.name}' does not give (Task.unit_sizes)")
    try:
        sampler = BalancedBatchSampler(
            sizes, mode=cfg.data.batching, seed=cfg.run.seed, rank=rank, world_size=world_size,
            shuffle=cfg.data.shuffle, batch_size=cfg.train.per_device_batch_size,
            max_units=cfg.data.max_units_per_batch, bucket_size=cfg.data.bucket_size, with_epoch=with_epoch)
    except ValueError as err:
        raise ConfigError(f"data.batching={cfg.data.batching}: {err}") from err
    return sampler, sampler


class TrainBatches:
    """This rank's training micro-batches, endless (epochs follow one another), from any data position.

    `micro_batches(consumed)` starts after `consumed` micro-batches of this rank: for map-style data
    the (epoch, batch) position follows from that count (every rank has the same number of batches
    per epoch); a stream resumes from its own `position`, which a checkpoint saves per rank.
    """

    def __init__(self, cfg: Config, task: Task, dataset: Any, rank: int, world_size: int, device: torch.device):
        self.seed, self.rank, self.device = cfg.run.seed, rank, device
        self.dataset = dataset  # the task's training set, as built
        # Its own generator, reseeded every epoch: iterators must not draw from the global RNG (which
        # a resumed run restores) and worker seeds must be a function of (seed, rank, epoch).
        self.generator = torch.Generator()
        self.position = (0, 0)  # (epoch, batches of it consumed) of this rank: saved for streams
        self.task_name, self.batch_size, self.num_workers = cfg.task.name, cfg.train.per_device_batch_size, \
            cfg.data.num_workers  # for the error of an epoch without a batch
        options = loader_options(cfg, task)
        self.streaming = isinstance(dataset, IterableDataset)
        if self.streaming:
            if not isinstance(dataset, ShardedStream):
                raise ConfigError(f"{type(dataset).__name__} is an IterableDataset without set_shard(rank, world_size)")
            dataset.set_shard(rank, world_size)
            self.sampler = self.batch_sampler = None
            self.loader = DataLoader(dataset, batch_size=cfg.train.per_device_batch_size, drop_last=True,
                                     generator=self.generator, **options)
        else:
            self.sampler, self.batch_sampler = build_batch_sampler(cfg, task, dataset, rank, world_size, True)
            options["collate_fn"] = KeyedCollate(task.collate, self.seed)
            self.loader = DataLoader(KeyedSamples(dataset), batch_sampler=self.batch_sampler, generator=self.generator,
                                     **options)
        self._stream_base = derive_seed(self.seed, "stream-sample", rank)

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
        """Endless micro-batches of this rank, on its device, starting after `consumed` of them."""
        epoch, skip = self.position if self.streaming else self.batch_sampler.position(consumed)
        on_cpu = self.device.type == "cpu"
        while True:
            self.generator.manual_seed(derive_seed(self.seed, "train-loader", self.rank, epoch))
            if self.streaming:
                if isinstance(self.loader.dataset, EpochAwareStream):
                    self.loader.dataset.set_epoch(epoch)
                batches = itertools.islice(self.loader, skip, None)  # a stream can only skip by reading
            else:
                self.batch_sampler.set_epoch(epoch, skip)
                batches = self.loader
            position = skip
            for position, batch in enumerate(batches, start=skip + 1):
                self.position = (epoch, position)
                if self.streaming:  # drop_last: every batch has batch_size rows
                    rows = np.arange((position - 1) * self.batch_size, position * self.batch_size)
                    batch = MicroBatch(batch, SampleRandom(derive_seeds(self._stream_base, epoch, rows)))
                yield batch if on_cpu else MicroBatch(send_to_device(batch.batch, self.device, non_blocking=True),
                                                      batch.rng)
            if position == 0:  # a whole epoch without a batch: looping on would spin (and peers wait) forever
                raise self._no_batch_error(epoch)
            epoch, skip = epoch + 1, 0

    def _no_batch_error(self, epoch: int) -> DataError:
        where = f"rank {self.rank}: the training {'stream' if self.streaming else 'set'}"
        if not self.streaming:
            return DataError(f"{where} gave no batch in epoch {epoch} (task '{self.task_name}', split train)")
        count = sum(1 for _ in self.loader.dataset)  # in this process: the whole of this rank's shard, all workers'
        per_worker = (f" (split over {self.num_workers} DataLoader workers, each batching its own share)"
                      if self.num_workers > 0 else "")
        return DataError(f"{where} gave {count} samples in epoch {epoch}{per_worker}, fewer than one batch of "
                         f"{self.batch_size} (task '{self.task_name}', split train); lower "
                         f"train.per_device_batch_size, use fewer processes or workers, or give more data")


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


def resolve_epochs(cfg: Config, batches_per_epoch: int | None) -> None:
    """Turn train.epochs, eval.every_epochs and ckpt.every_epochs into steps, in `cfg` (saved in config.yaml)."""
    if not (cfg.train.epochs or cfg.eval.every_epochs or cfg.ckpt.every_epochs or cfg.optim.decay_every_epochs):
        return
    if batches_per_epoch is None:
        raise ConfigError("train.epochs / *.every_epochs need map-style data: a stream has no epoch length")
    steps_per_epoch = max(1, batches_per_epoch // cfg.train.grad_accum_steps)
    if cfg.train.epochs:
        cfg.train.max_steps = max(1, math.ceil(cfg.train.epochs * steps_per_epoch))
    for section in (cfg.eval, cfg.ckpt):
        if section.every_epochs:
            section.every_steps = max(1, round(section.every_epochs * steps_per_epoch))
    if cfg.optim.decay_every_epochs:
        cfg.optim.decay_every_steps = max(1, round(cfg.optim.decay_every_epochs * steps_per_epoch))

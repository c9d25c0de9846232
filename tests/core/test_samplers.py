"""Data order is a pure function of (seed, epoch): world-size invariant global batches, resumable
by skipping, no duplicates; dataloader workers get distinct, reproducible seeds."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from trainer.core.samplers import EpochSampler, RankBatchSampler, WorkerSeeder


def global_batches(n, seed, batch, world, epoch, skip=0):
    """The global batches (rank batches concatenated in rank order) of one epoch."""
    per_rank = []
    for rank in range(world):
        bs = RankBatchSampler(EpochSampler(n, seed, multiple_of=batch * world), batch, rank, world)
        bs.set_epoch(epoch, skip)
        per_rank.append(list(bs))
    return [sum((per_rank[r][k] for r in range(world)), []) for k in range(len(per_rank[0]))]


def test_global_batches_do_not_depend_on_world_size():
    one = global_batches(103, seed=7, batch=8, world=1, epoch=3)
    two = global_batches(103, seed=7, batch=4, world=2, epoch=3)
    assert one == two
    flat = sum(one, [])
    assert len(flat) == len(set(flat)) == 96  # 103 -> 96: a multiple of 8, nothing repeated


def test_epochs_differ_and_skip_resumes_mid_epoch():
    e0, e1 = global_batches(64, 1, 4, 2, epoch=0), global_batches(64, 1, 4, 2, epoch=1)
    assert e0 != e1 and sorted(sum(e0, [])) == sorted(sum(e1, [])) == list(range(64))
    assert global_batches(64, 1, 4, 2, epoch=1, skip=3) == e1[3:]


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="smaller than one global batch"):
        EpochSampler(5, 0, multiple_of=8)


class NumpyNoise(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([np.random.rand(), float(torch.utils.data.get_worker_info().id)])


def test_workers_get_distinct_reproducible_numpy_seeds():
    def draw():
        loader = DataLoader(NumpyNoise(), batch_size=None, num_workers=2, worker_init_fn=WorkerSeeder(),
                            generator=torch.Generator().manual_seed(3))
        return torch.stack(list(loader))

    first, second = draw(), draw()
    assert torch.equal(first, second)  # same generator seed: same numbers
    by_worker = {int(w): v for v, w in first.tolist()}
    assert len(set(by_worker.values())) == 2  # the two workers do not share a NumPy stream


# --------------------------------------------------------------- balanced and budget batching
from trainer.core.samplers import BalancedBatchSampler  # noqa: E402


def rank_plans(sizes, world, **kw):
    samplers = [BalancedBatchSampler(sizes, rank=r, world_size=world, seed=3, **kw) for r in range(world)]
    return samplers, [list(s) for s in samplers]


def test_balanced_mode_equal_counts_even_units_no_duplicates():
    sizes = np.random.default_rng(0).integers(2, 120, size=203)
    samplers, per_rank = rank_plans(sizes, 4, mode="balanced", batch_size=5)
    assert len({len(p) for p in per_rank}) == 1 == len({len(samplers[0])})
    flat = [i for p in per_rank for b in p for i in b]
    assert len(flat) == len(set(flat)) == 200 and samplers[0].dropped_per_epoch == 3
    spread_balanced, spread_naive = [], []
    for k in range(len(per_rank[0])):
        loads = [sizes[per_rank[r][k]].sum() for r in range(4)]
        assert all(len(per_rank[r][k]) == 5 for r in range(4))
        spread_balanced.append(max(loads) - min(loads))
        chunk = sum((per_rank[r][k] for r in range(4)), [])
        naive = [sizes[sorted(chunk)[r * 5:(r + 1) * 5]].sum() for r in range(4)]
        spread_naive.append(max(naive) - min(naive))
    assert np.mean(spread_balanced) < 0.25 * np.mean(spread_naive)


def test_budget_mode_respects_budget_and_buckets_lengths():
    rng = np.random.default_rng(1)
    sizes = rng.integers(5, 65, size=1000)
    samplers, per_rank = rank_plans(sizes, 2, mode="budget", max_units=256)
    assert len(per_rank[0]) == len(per_rank[1]) == len(samplers[0])
    flat = [i for p in per_rank for b in p for i in b]
    assert len(flat) == len(set(flat))
    assert len(flat) + samplers[0].dropped_per_epoch == 1000 and samplers[0].dropped_per_epoch < 2
    for p in per_rank:
        assert all(0 < sizes[b].sum() <= 256 for b in p)
    # Length bucketing: sizes inside a micro-batch vary far less than in a random batch.
    within = np.mean([sizes[b].std() for b in per_rank[0] if len(b) > 1])
    assert within < 0.3 * sizes.std()
    # Budget use: micro-batches are nearly full.
    fill = np.mean([sizes[b].sum() / 256 for p in per_rank for b in p])
    assert fill > 0.9


def test_budget_mode_resume_position_and_epochs():
    sizes = np.random.default_rng(2).integers(1, 40, size=300)
    sampler = BalancedBatchSampler(sizes, mode="budget", max_units=100, rank=0, world_size=2, seed=5)
    lengths = [len(sampler.plan(e)) for e in range(3)]
    assert sampler.plan(0) != sampler.plan(1)  # reshuffled each epoch
    consumed = lengths[0] + lengths[1] + 3
    assert sampler.position(consumed) == (2, 3)
    sampler.set_epoch(2, 3)
    resumed = list(sampler)
    fresh = BalancedBatchSampler(sizes, mode="budget", max_units=100, rank=0, world_size=2, seed=5)
    fresh.set_epoch(2)
    assert resumed == list(fresh)[3:]


def test_budget_mode_rejects_samples_over_budget():
    with pytest.raises(ValueError, match="exceed max_units_per_batch=10"):
        BalancedBatchSampler([3, 11, 4], mode="budget", max_units=10, rank=0, world_size=1, seed=0)


@pytest.mark.parametrize("num_samples,batch_size", [(1, 4), (5, 2), (17, 4), (64, 16)])
def test_sampling_batches_are_world_size_independent_and_exact(num_samples, batch_size):
    """`trainer sample` draws every index once at any world size, and a sample's batch-mates never change
    (so batch-dependent floating point gives the same samples with 1 or N processes)."""
    from trainer.core.generation import rank_batches

    single = [list(b) for b in rank_batches(num_samples, batch_size, 0, 1)]
    for world in (1, 2, 3, 8):
        per_rank = [[list(b) for b in rank_batches(num_samples, batch_size, r, world)] for r in range(world)]
        batches = [b for rank in per_rank for b in rank]
        assert sorted(batches) == single
        assert sorted(i for b in batches for i in b) == list(range(num_samples))
        sizes = [sum(map(len, rank)) for rank in per_rank]
        assert max(sizes) - min(sizes) <= batch_size


# --- streams: sharded by global sample index (trainer.core.loaders.StreamBatches) ----------------------------

class Numbers:
    """A GlobalStream of `n` samples (epoch, g) a epoch; counts what it decoded (in this process)."""

    def __init__(self, n):
        self.n, self.epoch, self.decoded = n, 0, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def iter_global(self, wanted):
        for g in range(self.n):
            if wanted(g):
                self.decoded += 1
                yield (self.epoch, g)
            else:
                yield None


def stream_rank_batches(stream, batch, world, accum, rank, workers, epoch=0, start=0):
    from trainer.core.loaders import StreamBatches

    batches = StreamBatches(stream, batch, rank, world, accum)
    batches.set_position(epoch, start)
    return list(DataLoader(batches, batch_size=None, num_workers=workers, collate_fn=lambda item: item))


@pytest.mark.parametrize("world,batch,accum,workers", [(1, 4, 1, 0), (2, 3, 2, 0), (3, 2, 2, 0), (1, 4, 3, 2),
                                                       (2, 3, 1, 2), (3, 2, 2, 2)])
def test_stream_global_batches_are_read_in_order_by_any_world_size(world, batch, accum, workers):
    """Step s reads global samples [s G, (s+1) G) in order, micro-step by micro-step and rank by rank, whatever
    the world size, accumulation or DataLoader workers; every rank has the same number of micro-batches and ends
    the epoch with its length; the tail shorter than a global batch is read by nobody; a start mid-epoch reads
    the same batches from there."""
    from trainer.core.loaders import EpochEnd

    whole, n = world * batch * accum, 101
    for start_step in (0, 2):
        start = start_step * whole
        per_rank = [stream_rank_batches(Numbers(n), batch, world, accum, r, workers, epoch=1, start=start)
                    for r in range(world)]
        assert all(b[-1] == EpochEnd(n) for b in per_rank)
        per_rank = [b[:-1] for b in per_rank]
        steps = n // whole - start_step
        assert {len(b) for b in per_rank} == {steps * accum}
        for s in range(steps):
            read = [item for a in range(accum) for r in range(world) for item in per_rank[r][s * accum + a]]
            g0 = start + s * whole
            assert read == [((1, g), 1, g) for g in range(g0, g0 + whole)]  # (sample, epoch, global index)


def test_stream_decodes_only_its_own_samples_and_keys_rows_by_global_index():
    from trainer.core.loaders import KeyedCollate
    from trainer.sample_random import SampleRandom

    streams = [Numbers(50) for _ in range(2)]
    per_rank = [stream_rank_batches(s, 4, 2, 2, r, 0, start=16) for r, s in enumerate(streams)]
    # 50 - 16 = 34: two global batches of 16 read (16 samples a rank), the tail 48, 49 decoded by rank 0 (the epoch's
    # end was not known yet) but handed to nobody
    assert [s.decoded for s in streams] == [18, 16]
    assert sorted(g for rank in per_rank for batch in rank[:-1] for _, _, g in batch) == list(range(16, 48))
    micro = KeyedCollate(list, seed=3)(per_rank[1][0])
    assert micro.rng == SampleRandom.for_samples(3, 0, [20, 21, 22, 23])


def test_a_stream_resumed_at_the_end_of_its_epoch_reads_no_batch_of_it():
    from trainer.core.loaders import EpochEnd

    assert stream_rank_batches(Numbers(30), 4, 2, 1, 1, 0, start=24) == [EpochEnd(30)]

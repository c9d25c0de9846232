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


# --- scale: a stateless shuffled order, vectorised plans, resume without replaying earlier epochs -------------
import hashlib  # noqa: E402
import itertools  # noqa: E402
import tracemalloc  # noqa: E402

from trainer.core import samplers as samplers_module  # noqa: E402
from trainer.core.samplers import ShuffledOrder  # noqa: E402


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 10**6 + 3])
def test_shuffled_order_is_a_bijection(n):
    order = ShuffledOrder(n, seed=11, epoch=2)(np.arange(n))
    assert order.dtype == np.int64 and np.array_equal(np.sort(order), np.arange(n))
    if n >= 1000:
        assert not np.array_equal(order, np.arange(n))
        assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.05  # no trace of the identity left
        assert not np.array_equal(order, ShuffledOrder(n, seed=11, epoch=3)(np.arange(n)))
        assert not np.array_equal(order, ShuffledOrder(n, seed=12, epoch=2)(np.arange(n)))
    assert np.array_equal(ShuffledOrder(n, 11, 2)(np.arange(n)[::-1].reshape(-1, 1))[:, 0], order[::-1])


def test_shuffled_order_puts_a_sample_anywhere_evenly():
    """Over many epochs the first position holds each of 10 samples about equally often (chi-square)."""
    firsts = np.array([ShuffledOrder(10, seed=4, epoch=e)(np.array([0]))[0] for e in range(3000)])
    counts = np.bincount(firsts, minlength=10)
    assert ((counts - 300) ** 2 / 300).sum() < 30  # 9 degrees of freedom: 30 is far in the tail
    with pytest.raises(IndexError, match=r"outside \[0, 10\)"):
        ShuffledOrder(10, 0, 0)(np.array([10]))


def rank_order(n, batch, rank, world, epoch, seed=7, skip=0):
    bs = RankBatchSampler(EpochSampler(n, seed, multiple_of=batch * world), batch, rank, world)
    bs.set_epoch(epoch, skip)
    return list(bs)


def test_rank_shares_interleave_to_the_single_process_order():
    """Concatenating the ranks' batches in the sampler's interleaving (global batch k = rank 0's batch k, rank
    1's, ...) gives the one-process order, at any world size, for a data set no global batch divides."""
    single = sum(rank_order(1000, 3, 0, 1, epoch=5), [])
    sampler = EpochSampler(1000, 7, multiple_of=3)
    sampler.set_epoch(5)
    assert single == list(sampler) == ShuffledOrder(1000, 7, 5)(np.arange(999)).tolist()
    for world in (1, 2, 3, 4):
        per_rank = [rank_order(1000, 3, r, world, epoch=5) for r in range(world)]
        flat = [i for k in range(len(per_rank[0])) for r in range(world) for i in per_rank[r][k]]
        assert len(flat) == 1000 // (3 * world) * 3 * world and flat == single[:len(flat)], world


def test_a_rank_reads_a_huge_data_set_without_holding_its_order():
    """Rank 0's first batches of a billion samples: nothing of the size of the data set is allocated."""
    batches = RankBatchSampler(EpochSampler(10**9, 3, multiple_of=32), 8, 0, 4, with_epoch=True)
    batches.set_epoch(9, skip=10**7)  # deep into the epoch, as a resumed run starts
    tracemalloc.start()
    try:
        first = list(itertools.islice(batches, 13))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak
    keys = [key for batch in first for key in batch][:100]
    assert len(keys) == 100 and all(e == 9 and 0 <= i < 10**9 for e, i in keys) and len(set(keys)) == 100
    positions = np.arange(10**7 * 32, 10**7 * 32 + 8)
    assert [i for _, i in first[0]] == ShuffledOrder(10**9, 3, 9)(positions).tolist()


def endless(batch_sampler, epochs, first=(0, 0)):
    """Every batch from (epoch, skip) = `first` to the end of epoch `epochs` - 1."""
    epoch, skip = first
    batch_sampler.set_epoch(epoch, skip)
    out = list(batch_sampler)
    for e in range(epoch + 1, epochs):
        batch_sampler.set_epoch(e)
        out += list(batch_sampler)
    return out


@pytest.mark.parametrize("block", [0, 5])  # the full permutation; the block-window order
@pytest.mark.parametrize("kind", ["fixed", "balanced", "budget"])
def test_resume_at_any_position_gives_exactly_the_rest(kind, block):
    sizes = np.random.default_rng(8).integers(1, 30, size=157)

    def make(rank):
        if kind == "fixed":
            return RankBatchSampler(EpochSampler(157, 2, multiple_of=4 * 3, block=block, window=3), 4, rank, 3)
        options = {"batch_size": 4} if kind == "balanced" else {"max_units": 60, "bucket_size": 40}
        return BalancedBatchSampler(sizes, mode=kind, seed=2, rank=rank, world_size=3, block=block, window=3,
                                    **options)

    for rank in range(3):
        whole = endless(make(rank), 4)
        for consumed in (0, 1, 5, len(whole) // 3, len(whole) // 2 + 1, len(whole) - 1):
            resumed = make(rank)
            rest = endless(resumed, 4, first=resumed.position(consumed))
            assert rest == whole[consumed:], (rank, consumed)


def test_budget_resume_position_builds_each_epoch_once(monkeypatch):
    sizes = np.random.default_rng(3).integers(1, 50, size=400)
    sampler = BalancedBatchSampler(sizes, mode="budget", max_units=120, rank=1, world_size=2, seed=0)
    built = []
    original = BalancedBatchSampler._budget_batches
    monkeypatch.setattr(BalancedBatchSampler, "_budget_batches", lambda self, order: built.append(1) or
                        original(self, order))
    lengths = [sampler.num_batches(e) for e in range(6)]
    built.clear()
    for consumed in (sum(lengths[:5]) + 2, sum(lengths[:3]), 7):
        epoch, skip = sampler.position(consumed)
        assert sum(lengths[:epoch]) + skip == consumed and skip < lengths[epoch]
    assert built == []  # earlier epochs' lengths are kept, not rebuilt at each call


def reference_lpt(sizes, parts, capacity=None):
    """The per-sample Python LPT split the samplers used before vectorising (the first lightest open part)."""
    loads, counts, out = [0] * parts, [0] * parts, [[] for _ in range(parts)]
    for pos in np.argsort(-np.asarray(sizes), kind="stable"):
        open_parts = [p for p in range(parts) if capacity is None or counts[p] < capacity]
        target = min(open_parts, key=lambda p: loads[p])
        out[target].append(int(pos))
        loads[target] += int(sizes[pos])
        counts[target] += 1
    return out


def reference_budget(sizes, order, world, budget, window):
    """The budget cut written one sample at a time: each window sorted by size, global batches grown while
    the LPT split keeps every rank within budget, leftovers pooled and cut again after all windows."""
    batches, rest = [], list(order)
    while True:
        pool = []
        for start in range(0, len(rest), window):
            chunk = np.array(rest[start:start + window])
            chunk = chunk[np.argsort(-sizes[chunk], kind="stable")]
            at = 0
            while len(chunk) - at >= world:
                end = len(chunk)
                while True:
                    parts = reference_lpt(sizes[chunk[at:end]], world)
                    if all(sizes[chunk[at:end][p]].sum() <= budget for p in parts):
                        break
                    end -= 1
                batches.append([chunk[at:end][p].tolist() for p in parts])
                at = end
            pool += chunk[at:].tolist()
        if len(rest) <= window or len(pool) < world:
            return batches
        rest = pool


@pytest.mark.parametrize("n,world,budget,window,low,high", [(300, 2, 100, 60, 1, 40), (1000, 3, 256, 100, 5, 65),
                                                            (517, 4, 50, 8, 1, 50), (64, 1, 30, 0, 1, 30)])
def test_budget_plans_equal_the_one_sample_at_a_time_cut(monkeypatch, n, world, budget, window, low, high):
    monkeypatch.setattr(samplers_module, "_GROUP", 50)  # several groups of windows too
    sizes = np.random.default_rng(n).integers(low, high, size=n)
    sampler = BalancedBatchSampler(sizes, mode="budget", max_units=budget, bucket_size=window, rank=0,
                                   world_size=world, seed=9)
    for epoch in (0, 1):
        order = ShuffledOrder(n, 9, epoch)(np.arange(n))
        members, bounds = sampler._budget_batches(order)
        cut = [[members[bounds[b * world + r]:bounds[b * world + r + 1]].tolist() for r in range(world)]
               for b in range((bounds.size - 1) // world)]
        assert cut == reference_budget(sizes, order, world, budget, sampler.bucket_size)
        plan = sampler.plan(epoch)
        assert sorted(map(str, plan)) == sorted(map(str, cut))  # the same batches, shuffled
        assert sampler.num_batches(epoch) == len(plan) and len(cut) == len(plan)


def test_balanced_plans_equal_the_one_sample_at_a_time_split():
    sizes = np.random.default_rng(5).integers(1, 200, size=250)
    sampler = BalancedBatchSampler(sizes, mode="balanced", batch_size=6, seed=1, rank=2, world_size=4)
    order = ShuffledOrder(250, 1, 3)(np.arange(250))
    expected = []
    for k in range(250 // 24):
        chunk = order[k * 24:(k + 1) * 24]
        expected.append([chunk[p].tolist() for p in reference_lpt(sizes[chunk], 4, capacity=6)])
    assert sampler.plan(3) == expected
    sampler.set_epoch(3)
    assert list(sampler) == [batch[2] for batch in expected]


def test_a_checkpoint_of_another_sample_order_is_said_on_resume(caplog):
    """A map-style checkpoint records the samplers' order; one written before it (no record) or with another is
    resumed with a warning, since the rest of a stopped epoch would come from a different permutation."""
    import logging
    from types import SimpleNamespace

    from trainer.core.checkpoint.parts import DataPosition
    from trainer.core.samplers import SAMPLE_ORDER

    part = DataPosition(SimpleNamespace(streaming=False), acc=None)
    assert part.state_dict() == {"sample_order": SAMPLE_ORDER}
    with caplog.at_level(logging.WARNING, logger="trainer"):
        part.load_state_dict(part.state_dict())
        assert not caplog.records
        part.load_state_dict({"step": 7})
    assert len(caplog.records) == 1 and "torch.randperm" in caplog.records[0].getMessage()


# --- the block-window order (data.shuffle_block, data.shuffle_window) and budget resume from an epoch start ---------
from trainer.core.samplers import BlockWindowOrder, compact_sizes, sample_order_name  # noqa: E402

BLOCK_CASES = [(1, 4, 3), (3, 4, 3), (4, 4, 1), (10, 3, 100), (17, 4, 2), (100, 7, 3), (101, 1, 5), (256, 16, 4),
               (1000, 7, 8), (1001, 10, 1), (12345, 64, 8)]  # N < b, N mod b != 0, one window, b = 1, m = 1


@pytest.mark.parametrize("epoch", [0, 3])
def test_block_window_order_is_a_bijection(epoch):
    for n, block, window in BLOCK_CASES:
        order = BlockWindowOrder(n, 5, epoch, block, window)
        out = order(np.arange(n))
        assert out.dtype == np.int64 and np.array_equal(np.sort(out), np.arange(n)), (n, block, window)
        assert np.array_equal(order(np.arange(n)[::-1].reshape(-1, 1))[:, 0], out[::-1])  # any positions, any shape
        assert order(np.zeros((0, 2), dtype=np.int64)).shape == (0, 2)
    with pytest.raises(IndexError, match=r"outside \[0, 10\)"):
        BlockWindowOrder(10, 0, 0, 3, 2)(np.array([10]))


def test_block_window_order_reads_few_blocks_per_window():
    """The positions of each window read at most `window` blocks plus the partial one, each as one run of rows;
    any window x block consecutive positions, at most two windows' worth."""
    for n, block, window in BLOCK_CASES:
        order = BlockWindowOrder(n, 2, 1, block, window)
        out, positions = order(np.arange(n)), np.arange(n)
        w, start = order.window_of(positions)
        assert np.all(np.diff(w) >= 0) and w[-1] == order.windows - 1 and np.all(start <= positions)
        for k in range(order.windows):
            blocks = np.unique(out[w == k] // block)
            assert blocks.size <= window + 1, (n, block, window, k)
            partial = blocks[blocks >= n // block]
            assert partial.size <= 1
        span = window * block
        for first in range(0, max(1, n - span), max(1, span // 3)):
            assert np.unique(out[first:first + span] // block).size <= 2 * window + 1


def test_block_window_order_is_shuffled_at_both_levels():
    """Blocks are shuffled over the whole data set (positions and samples uncorrelated, unlike the identity or
    blocks kept in order), rows are mixed within a window (neighbouring positions rarely share a block, unlike
    blocks read whole one after another), and the order changes with the epoch and the seed."""
    n, block, window = 100_003, 50, 8
    out = BlockWindowOrder(n, 7, 4, block, window)(np.arange(n))
    assert abs(np.corrcoef(np.arange(n), out)[0, 1]) < 0.05
    same_block = np.mean(out[1:] // block == out[:-1] // block)
    assert same_block < 2.0 / window  # about 1/window when a window's rows are mixed; near 1 when not
    # The first window's blocks come from all over the data set, not from its start.
    assert np.ptp(out[:block * window]) > n // 2
    assert not np.array_equal(out, BlockWindowOrder(n, 7, 5, block, window)(np.arange(n)))
    assert not np.array_equal(out, BlockWindowOrder(n, 8, 4, block, window)(np.arange(n)))
    # The partial block's rows land in different windows over epochs (not always last, where a truncated epoch
    # would drop them).
    homes = {int(BlockWindowOrder(1003, 1, e, 10, 4).partial_window) for e in range(40)}
    assert len(homes) > 5


def test_block_window_global_batches_at_any_world_size_and_resume_at_another():
    """Global batches of 12 (12 / world per rank) are positions [12 k, 12 (k + 1)) of the one order at any world
    size; a run stopped after any step continues at another world size with exactly the samples that follow."""
    n, block, window, glob = 1000, 9, 4, 12
    single = BlockWindowOrder(n, 7, 5, block, window)(np.arange(n)).tolist()

    def read(world, skip=0):
        per_rank = []
        for rank in range(world):
            sampler = EpochSampler(n, 7, multiple_of=glob, block=block, window=window)
            batches = RankBatchSampler(sampler, glob // world, rank, world)
            batches.set_epoch(5, skip)
            per_rank.append(list(batches))
        return [i for k in range(len(per_rank[0])) for r in range(world) for i in per_rank[r][k]]

    for world in (1, 2, 3, 4):
        assert read(world) == single[:n // glob * glob], world
    for world in (1, 2, 3, 4):  # resumed by `world` after `step` steps of any other
        for step in (1, 7, 40, n // glob - 1):
            assert read(world, skip=step) == single[step * glob:n // glob * glob], (world, step)


def test_block_window_order_has_its_own_recorded_name(caplog):
    """The recorded order names the block and window sizes: a resume with other settings (or the full permutation)
    is said, one with the same is not."""
    import logging
    from types import SimpleNamespace

    from trainer.core.checkpoint.parts import DataPosition

    names = {sample_order_name(0, 64), sample_order_name(0, 8), sample_order_name(16, 64), sample_order_name(16, 8),
             sample_order_name(32, 8)}
    assert len(names) == 4 and sample_order_name(0, 8) == samplers_module.SAMPLE_ORDER
    assert EpochSampler(100, 0, block=16, window=8).order_name == sample_order_name(16, 8)
    part = DataPosition(SimpleNamespace(streaming=False, sample_order=sample_order_name(16, 8)), acc=None)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        part.load_state_dict({"sample_order": sample_order_name(16, 8)})
        assert not caplog.records
        part.load_state_dict({"sample_order": sample_order_name(16, 64)})
        part.load_state_dict({"sample_order": samplers_module.SAMPLE_ORDER})
    assert len(caplog.records) == 2 and all("block=16,window=8" in r.getMessage() for r in caplog.records)


def test_sequential_order_and_budget_plan_keys_name_what_they_depend_on():
    """data.shuffle false is its own order whatever the block; a budget plan's key changes with the sizes
    themselves, not only with their count and total."""
    assert sample_order_name(0, 64, shuffle=False) == sample_order_name(16, 8, shuffle=False) != samplers_module.SAMPLE_ORDER
    assert EpochSampler(100, 0, shuffle=False, block=16, window=8).order_name == samplers_module.SEQUENTIAL_ORDER

    def key(sizes):
        return BalancedBatchSampler(sizes, mode="budget", max_units=100, rank=0, world_size=2, seed=5).plan_key

    same_count_and_total = [10, 20, 30, 40], [40, 30, 20, 10]
    assert key(same_count_and_total[0]) != key(same_count_and_total[1])
    assert key([10, 20, 30, 40]) == key(np.array([10, 20, 30, 40])) and samplers_module.BUDGET_PLAN in key([10, 20])


def test_sampler_sizes_are_held_as_int32_with_the_int64_plan_key_and_plans():
    """Every rank holds one size per training row: int32 when they fit (int64 only past 2**31 - 1), hashed as int64
    so a checkpoint's recorded budget plan key still matches; the plans are those of the same sizes in int64."""
    sizes = np.random.default_rng(7).integers(1, 60, size=200_017)  # several of the digest's blocks
    digest = hashlib.blake2b(sizes.astype(np.int64).tobytes(), digest_size=8).hexdigest()
    for mode in ("balanced", "budget"):
        kw = dict(mode=mode, max_units=200, batch_size=4, rank=1, world_size=3, seed=2)
        held = BalancedBatchSampler(sizes.astype(np.int64), **kw)
        assert held.sizes.dtype == np.int32 and held.sizes.nbytes == 4 * sizes.size
        assert mode == "balanced" or f"sizes={digest}" in held.plan_key
        small = BalancedBatchSampler(sizes[:600], **kw)
        assert small.plan(0) == BalancedBatchSampler(sizes[:600].astype(np.int16), **kw).plan(0)
    assert compact_sizes(np.array([1, 2**31])).dtype == np.int64
    assert compact_sizes(np.array([-2**31, 5])).dtype == np.int64  # negated by the plans: no int32 overflow
    assert compact_sizes([3.0, 4.0]).dtype == np.int64


@pytest.mark.parametrize("block", [0, 6])
def test_budget_resume_from_a_recorded_epoch_start_builds_no_earlier_plan(monkeypatch, block):
    """A budget sampler told where an epoch starts (what a checkpoint records) finds the position of any later
    count of batches, building the plans of that epoch and the ones after it only, and resumes exactly."""
    sizes = np.random.default_rng(4).integers(1, 40, size=230)

    def make():
        return BalancedBatchSampler(sizes, mode="budget", max_units=80, bucket_size=30, rank=1, world_size=2, seed=3,
                                    block=block, window=3)

    reference = make()
    lengths = [reference.num_batches(e) for e in range(7)]
    whole = endless(make(), 7)
    assert len(whole) == sum(lengths)
    built = []  # the epochs whose plan is built
    original = BalancedBatchSampler._budget_plan

    def counted(self, epoch):
        if self._budget is None or self._budget[0] != epoch:
            built.append(epoch)
        return original(self, epoch)

    monkeypatch.setattr(BalancedBatchSampler, "_budget_plan", counted)
    for anchor in (4, 5):
        start = sum(lengths[:anchor])
        for consumed in (start, start + 1, start + lengths[anchor] - 1, start + lengths[anchor] + 2,
                         sum(lengths[:6]) + 1):
            resumed = make()  # its constructor checks epoch 0 has a batch, as at any start
            built.clear()
            resumed.add_epoch_start(anchor, start)
            epoch, skip = resumed.position(consumed)
            assert min(built) >= anchor, (anchor, consumed, built)  # nothing before the recorded epoch
            assert sum(lengths[:epoch]) + skip == consumed
            assert endless(resumed, 7, first=(epoch, skip)) == whole[consumed:], (anchor, consumed)
    walked = make()
    built.clear()
    assert walked.position(sum(lengths[:5]) + 1)[0] == 5 and set(built) == {1, 2, 3, 4, 5}  # no record: from 0


def test_a_budget_checkpoint_records_its_epoch_start_and_a_resume_uses_it():
    """TrainBatches (map-style, budget) records (epoch, batches before it) of the epoch it reads, which DataPosition
    saves; a resumed TrainBatches given that record continues exactly without building the earlier plans, and a
    record of another plan (another world size) is not used."""
    from types import SimpleNamespace

    from trainer.config import Config
    from trainer.core.batch_plan import BatchPlan
    from trainer.core.checkpoint.parts import DataPosition
    from trainer.core.loaders import TrainBatches

    sizes = np.random.default_rng(6).integers(1, 40, size=230)
    cfg = Config()
    cfg.data.batching, cfg.data.max_units_per_batch, cfg.data.bucket_size = "budget", 80, 30
    cfg.data.shuffle_block, cfg.data.shuffle_window, cfg.data.pin_memory = 6, 3, False
    task = SimpleNamespace(collate=list, unit_sizes=lambda dataset: sizes)

    def make(world=2):
        plan = BatchPlan(per_device_batch_size=1, grad_accum_steps=1, world_size=world, global_batch=world,
                         lr_world_size=world)
        return TrainBatches(cfg, plan, task, list(range(230)), 1, world, torch.device("cpu"))

    first = make()
    lengths = [first.batch_sampler.num_batches(e) for e in range(5)]
    run = first.micro_batches(0)
    consumed = sum(lengths[:3]) + 2
    whole = [next(run).batch for _ in range(consumed)]
    state = DataPosition(first, None).state_dict()
    assert state["sample_order"] == sample_order_name(6, 3) and state["epoch_start"] == [3, sum(lengths[:3])]
    whole += [next(run).batch for _ in range(lengths[3] + 3)]

    resumed = make()
    DataPosition(resumed, None).load_state_dict(state)
    built = []
    original = resumed.batch_sampler._budget_batches
    resumed.batch_sampler._budget_batches = lambda order: built.append(1) or original(order)
    rest = resumed.micro_batches(consumed)
    assert [next(rest).batch for _ in range(lengths[3] + 3)] == whole[consumed:]
    assert len(built) == 2  # epochs 3 and 4 only
    other = make(world=3)
    DataPosition(other, None).load_state_dict(state)
    assert other.batch_sampler._starts == {0: 0}  # another world size's plans: the record does not hold


@pytest.mark.parametrize("override,message", [("data.shuffle_block=-1", "'data.shuffle_block' must be >= 0"),
                                              ("data.shuffle_window=0", "'data.shuffle_window' must be >= 1")])
def test_block_window_settings_are_checked(override, message):
    from trainer.config import ConfigError, load_config

    assert load_config(overrides=["data.shuffle_block=64"]).data.shuffle_block == 64
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def _held_after_first_batch(batch_sampler) -> int:
    """Bytes (numpy and Python objects) a batch sampler's iterator holds once it has given its first batch."""
    tracemalloc.start()
    try:
        it = iter(batch_sampler)
        next(it)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return held


@pytest.mark.parametrize("world", [1, 4])
def test_an_iterating_sampler_holds_little_whatever_the_data_set_size(world):
    """What a rank keeps through training while its batch sampler iterates does not depend on N: the arrays and
    Python lists of one vectorised call, for a few thousand samples (a call planned up to a quarter million samples,
    so what was held grew with N up to that size)."""
    sizes = np.random.default_rng(0).integers(1, 200, size=400_000).astype(np.int32)
    balanced = BalancedBatchSampler(sizes, mode="balanced", batch_size=16, seed=0, rank=world - 1, world_size=world,
                                    with_epoch=True)
    fixed = RankBatchSampler(EpochSampler(400_000, 0, multiple_of=16 * world), 16, world - 1, world, with_epoch=True)
    assert _held_after_first_batch(balanced) < 2**20
    assert _held_after_first_batch(fixed) < 2**20


def test_balanced_iteration_across_many_calls_equals_the_plan():
    """Balanced batches depend on their own samples only: iterating in many small calls gives the plan's batches."""
    sizes = np.random.default_rng(3).integers(1, 300, size=20_000)
    for rank in range(2):
        sampler = BalancedBatchSampler(sizes, mode="balanced", batch_size=4, seed=7, rank=rank, world_size=2)
        plan = sampler.plan(1)
        sampler.set_epoch(1, skip=3)
        assert list(sampler) == [batch[rank] for batch in plan][3:]


def test_budget_plan_working_memory_is_bounded_and_the_plan_does_not_depend_on_it(monkeypatch):
    """Building a budget plan allocates the plan (a few bytes a sample) and one group's working memory: not tens of
    bytes for every sample of the data set; the plan is the same whatever the group size."""
    sizes = np.random.default_rng(4).integers(1, 200, size=600_000).astype(np.int32)
    tracemalloc.start()
    try:
        sampler = BalancedBatchSampler(sizes, mode="budget", seed=2, rank=1, world_size=4, max_units=2048)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, peak  # the whole set cut at once needs more
    small = sizes[:20_000]
    plans = []
    for group in (samplers_module._GROUP, 5120, 3 * 5120 + 7):
        monkeypatch.setattr(samplers_module, "_GROUP", group)
        plans.append(BalancedBatchSampler(small, mode="budget", seed=2, rank=1, world_size=4, max_units=2048).plan(0))
    assert plans[0] == plans[1] == plans[2]
    assert sampler.bucket_size == 5120

"""Samplers whose order is a pure function of (seed, epoch), so resume needs no iterator state.

No sampler holds a permutation of the whole data set: the shuffled order is a keyed bijection of [0, N)
(`ShuffledOrder`) evaluated only at the positions a rank reads, so each rank computes its own share of the
epoch, from any position, in memory that does not grow with N. `BlockWindowOrder` is the same kind of bijection
that keeps runs of consecutive rows together (blocks shuffled, rows shuffled within windows of blocks), for data
read from a slow disk or shared filesystem.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from trainer.task import EpochAwareDataset

SAMPLE_ORDER = "keyed-permutation-1"
"""The name of the map-style samplers' order (saved with each checkpoint): a checkpoint of another order resumed
mid-epoch would finish that epoch from a different permutation."""
BLOCK_WINDOW_ORDER = "keyed-block-window-1"
"""The name of the block-window order (`BlockWindowOrder`), saved with its block and window sizes."""
SEQUENTIAL_ORDER = "sequential-1"
"""The recorded name of the order with data.shuffle false (the rows in order)."""
BUDGET_PLAN = "budget-plan-1"
"""The name of the token-budget cutting (`BalancedBatchSampler` mode budget), part of its `plan_key`: a resume
under another cutting must not take an epoch start recorded under this one."""


def sample_order_name(block: int = 0, window: int = 64, shuffle: bool = True) -> str:
    """The recorded name of the order that data.shuffle_block=`block` and data.shuffle_window=`window` select
    (data.shuffle false: the sequential order, whatever the block): another order, block or window size is
    another order, so a resume with other settings is said."""
    if not shuffle:
        return SEQUENTIAL_ORDER
    return SAMPLE_ORDER if block <= 0 else f"{BLOCK_WINDOW_ORDER}(block={block},window={window})"


_CHUNK = 1 << 16  # positions mapped per vectorised call: bounds a sampler's working memory whatever N is
# Samples a sampler maps per vectorised call while it iterates. The generator holds that call's arrays and Python
# lists while their batches are read, i.e. through training: a bound reached only at large N (several times _CHUNK)
# looks like per-row growth at every size below it, so this one is reached by the smallest data sets; still enough
# samples to amortise a call's fixed Python steps (LPT takes one per sample of a batch).
_ITER_SAMPLES = 1 << 12
# Samples of the budget windows cut together: the cut's working memory is tens of bytes a sample of a group, and
# grows with N until N reaches the group, so a group smaller than the data sets trained on keeps it flat; the plan
# does not depend on it (windows are cut independently), only the count of Python steps (a window's per group).
_GROUP = 1 << 18
_M1, _M2, _M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class ShuffledOrder:
    """The (seed, epoch) shuffle of [0, n) as a function: `self(positions)` is the sample at each position.

    A Feistel network over the smallest power-of-two domain holding n (at least 4, else under 2n), keyed by the seed and
    epoch, with cycle walking (a value outside [0, n) is permuted again until it lands inside) makes a
    bijection of [0, n) that costs O(1) memory and is evaluated for any positions at once; every rank thus
    reads the same global order at any world size without holding it. Nothing limits n (unlike a full
    `torch.randperm`, which holds all n and is not uniform for very large n).
    """

    ROUNDS = 8  # Luby-Rackoff needs 4 with a random round function; more rounds for the cheap hash used

    def __init__(self, n: int, seed: int, epoch: int, salt: tuple[int, ...] = ()):
        if n < 1:
            raise ValueError(f"a shuffled order needs at least one sample, not {n}")
        self.n = n
        self.bits = _domain_bits(n)
        # A SeedSequence spreads (seed, epoch) over independent round keys; seeds may be negative. `salt` keys
        # other orders drawn from the same (seed, epoch) apart from this one (none: the full permutation's keys).
        self.keys = np.random.SeedSequence([seed % 2**64, epoch, *salt]).generate_state(self.ROUNDS, np.uint64)

    def __call__(self, positions: np.ndarray | int) -> np.ndarray:
        """The samples at `positions` (ints in [0, n)), as an int64 array of the same shape."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            raise IndexError(f"positions outside [0, {self.n}) of a shuffled order")
        out = _permute(pos.reshape(-1).astype(np.uint64), self.keys, self.bits, self.n)
        return out.astype(np.int64).reshape(pos.shape)


def _domain_bits(n: int) -> int:
    """Bits of the Feistel domain for n values: the smallest power of two holding n, at least 4 values."""
    return max(2, (n - 1).bit_length())


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 in, uint64 out)."""
    z = (z ^ (z >> np.uint64(30))) * _M2
    z = (z ^ (z >> np.uint64(27))) * _M3
    return z ^ (z >> np.uint64(31))


def _rounds(x: np.ndarray, keys: np.ndarray, bits: int, which: np.ndarray | None = None) -> np.ndarray:
    """The Feistel rounds over `bits`-bit values; keys[j] is round j's key, or with `which`, keys[j][which] (a table
    of keys per permutation, `which` naming each value's)."""
    hi_bits, lo_bits = bits - bits // 2, bits // 2
    for key in keys:
        key = key if which is None else key[which]
        hi, lo = x >> np.uint64(lo_bits), x & np.uint64((1 << lo_bits) - 1)
        z = _mix64(lo * _M1 + key)  # splitmix64's finaliser as the round function
        x = (lo << np.uint64(hi_bits)) | (hi ^ (z & np.uint64((1 << hi_bits) - 1)))
        hi_bits, lo_bits = lo_bits, hi_bits  # the halves swap sizes each round (unbalanced when bits is odd)
    return x


def _permute(x: np.ndarray, keys: np.ndarray, bits: int, n: int, which: np.ndarray | None = None) -> np.ndarray:
    """The keyed bijection of [0, n) at the uint64 values `x`: Feistel rounds, then cycle walking (a value outside
    [0, n) is permuted again until it lands inside). keys: (rounds,), or (rounds, permutations) with `which` naming
    each value's permutation."""
    out = _rounds(x, keys, bits, which)
    todo = np.flatnonzero(out >= np.uint64(n))
    while todo.size:  # the domain is under 2n, so few values walk more than a step or two
        out[todo] = _rounds(out[todo], keys, bits, None if which is None else which[todo])
        todo = todo[out[todo] >= np.uint64(n)]
    return out


class BlockWindowOrder:
    """The (seed, epoch) block-window shuffle of [0, n) as a function, like `ShuffledOrder`, that keeps runs of
    `block` consecutive rows together (the shuffle of streaming engines: shard order, then a shuffle buffer).

    Rows are cut into n // block full blocks (the last n % block rows are a partial block); the epoch's block order
    is a keyed permutation of the full blocks; consecutive groups of `window` permuted blocks (the last group may be
    shorter) are windows, and the rows of each window are permuted among themselves by a keyed permutation of
    (seed, epoch, window). The partial block joins one window drawn from (seed, epoch), so its rows are not always
    last (where a truncated epoch would drop them). The windows lie one after another in the epoch: a stretch of
    window x block positions reads window blocks (plus the partial one), each as a run of consecutive rows. A
    position -> sample map in O(1) per position, vectorised; the same order at any world size.
    """

    def __init__(self, n: int, seed: int, epoch: int, block: int, window: int):
        if n < 1:
            raise ValueError(f"a shuffled order needs at least one sample, not {n}")
        if block < 1 or window < 1:
            raise ValueError(f"a block-window order needs block >= 1 and window >= 1, not {block} and {window}")
        self.n, self.block, self.window = n, block, window
        self.full, self.rest = divmod(n, block)  # full blocks; rows of the partial block
        # Salted apart from the full permutation of the same (seed, epoch), and the blocks from the windows.
        self.blocks = ShuffledOrder(self.full, seed, epoch, salt=(1,)) if self.full else None
        self.windows = max(1, -(-self.full // window))
        keys = np.random.SeedSequence([seed % 2**64, epoch, 2]).generate_state(ShuffledOrder.ROUNDS + 1, np.uint64)
        self.window_keys = keys[:-1]
        self.partial_window = int(keys[-1] % np.uint64(self.windows)) if self.rest and self.full else 0
        self.last_blocks = self.full - (self.windows - 1) * window  # full blocks of the last window (0: none at all)

    def window_of(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(window, first position of that window) of each position (int64 arrays in [0, n))."""
        span, rest, kp = self.window * self.block, self.rest, self.partial_window
        w = np.minimum(positions // span, self.windows - 1)
        if rest:  # windows after the partial block's start `rest` positions later than a multiple of span
            w -= (w > kp) & (positions < w * span + rest)
        return w, w * span + np.where(w > kp, rest, 0)

    def __call__(self, positions: np.ndarray | int) -> np.ndarray:
        """The samples at `positions` (ints in [0, n)), as an int64 array of the same shape."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            raise IndexError(f"positions outside [0, {self.n}) of a shuffled order")
        flat = pos.reshape(-1)
        if not flat.size:
            return np.empty(pos.shape, dtype=np.int64)
        w, start = self.window_of(flat)
        # A window's permutation is keyed by (seed, epoch, window): each round key mixed with the window's index,
        # in a table over the windows these positions touch (few: positions come in runs).
        if int(w.max() - w.min()) < flat.size:
            first = int(w.min())
            touched, which = np.arange(first, int(w.max()) + 1, dtype=np.int64), w - first
        else:
            touched, which = np.unique(w, return_inverse=True)
        wkeys = _mix64(self.window_keys[:, None] ^ ((touched.astype(np.uint64) + np.uint64(1)) * _M1)[None, :])
        whole = np.where(touched == self.windows - 1, self.last_blocks, self.window) * self.block  # full blocks' rows
        size = whole + np.where(touched == self.partial_window, self.rest, 0)
        offset = (flat - start).astype(np.uint64)
        for n in np.unique(size).tolist():  # at most four window sizes: one Feistel domain each
            if touched.size == 1:  # one window (the usual chunk): its keys for all, no per-value look-up
                offset = _permute(offset, wkeys[:, 0], _domain_bits(n), n)
                continue
            at = np.flatnonzero((size == n)[which])
            offset[at] = _permute(offset[at], wkeys, _domain_bits(n), n, which[at])
        offset = offset.astype(np.int64)
        j = w * self.window + offset // self.block  # the permuted block of a full block's row
        if not self.rest or self.partial_window < touched[0] or self.partial_window > touched[-1]:
            return (self.blocks(j) * self.block + offset % self.block).reshape(pos.shape)
        inside = offset < whole[which]
        out = self.full * self.block + offset - whole[which]  # the partial block's rows (last in the data set)
        if self.blocks is not None:
            at = np.flatnonzero(inside)
            out[at] = self.blocks(j[at]) * self.block + offset[at] % self.block
        return out.reshape(pos.shape)


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True, block: int = 0,
                window: int = 64) -> Callable[[np.ndarray], np.ndarray]:
    """positions -> samples of the (seed, epoch) order of n samples (the identity when not shuffled): a full
    permutation, or the block-window order when `block` > 0 (data.shuffle_block, data.shuffle_window)."""
    if shuffle:
        return BlockWindowOrder(n, seed, epoch, block, window) if block > 0 else ShuffledOrder(n, seed, epoch)
    return lambda positions: np.asarray(positions, dtype=np.int64)


class EpochSampler(Sampler[int]):
    """Shuffled (or sequential) indices, truncated to a multiple of `multiple_of`.

    The trainer sets `multiple_of` = the global batch (world size x per-device batch x accumulation), so
    every rank gets the same number of full batches, an epoch is whole optimizer steps and no sample is
    duplicated to pad a rank; the few samples left over differ each epoch (the permutation changes) and
    their count is reported at start.
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True, multiple_of: int = 1, block: int = 0,
                 window: int = 64):
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.multiple_of = max(1, multiple_of)
        self.block, self.window = block, window  # data.shuffle_block, data.shuffle_window (0: full permutation)
        self.epoch = 0
        if len(self) == 0:
            raise ValueError(f"dataset of {num_samples} samples is smaller than one global batch "
                             f"({self.multiple_of} = world size x per-device batch x accumulation)")
        self._order = epoch_order(num_samples, seed, 0, shuffle, block, window)

    @property
    def order_name(self) -> str:
        """The order's recorded name (`sample_order_name`)."""
        return sample_order_name(self.block, self.window, self.shuffle)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._order = epoch_order(self.num_samples, self.seed, epoch, self.shuffle, self.block, self.window)
        self.epoch = epoch

    @property
    def dropped_per_epoch(self) -> int:
        return self.num_samples - len(self)

    def __len__(self) -> int:
        return self.num_samples // self.multiple_of * self.multiple_of

    @property
    def order(self) -> Callable[[np.ndarray], np.ndarray]:
        """This epoch's order: positions (an int array) -> the samples there (int64, same shape)."""
        return self._order

    def __iter__(self) -> Iterator[int]:
        order = self._order
        for start in range(0, len(self), _ITER_SAMPLES):
            yield from order(np.arange(start, min(start + _ITER_SAMPLES, len(self)))).tolist()


class WorkerSeeder:
    """worker_init_fn: seeds Python and NumPy in each worker from torch's per-worker seed."""

    def __call__(self, worker_id: int) -> None:  # noqa: ARG002
        seed = torch.initial_seed() % 2**32
        random.seed(seed)
        np.random.seed(seed)


class RankBatchSampler(Sampler[list[int]]):
    """This rank's batches of an EpochSampler: global batch k goes to rank k % world_size.

    Global batch k is positions [k G, (k+1) G) of the (seed, epoch) order (G = world size x batch size), so
    the global batches are the same whatever the world size; a rank maps only its own positions to samples.
    `set_epoch(epoch, skip)` starts an epoch `skip` batches in without computing or loading the skipped ones,
    which is how a resumed run gets back to its data position.
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
        # This epoch's order taken once: another batch sampler may move a shared EpochSampler on meanwhile.
        epoch, order = self.sampler.epoch, self.sampler.order
        size, step = self.batch_size, self.batch_size * self.world_size
        per_chunk = max(1, _ITER_SAMPLES // size)
        for first in range(self.skip, len(self), per_chunk):
            batches = np.arange(first, min(first + per_chunk, len(self)), dtype=np.int64)
            positions = batches[:, None] * step + self.rank * size + np.arange(size, dtype=np.int64)
            for batch in order(positions).tolist():
                yield [(epoch, i) for i in batch] if self.with_epoch else batch


def lpt_parts(sizes: np.ndarray, parts: int, capacity: int | None = None) -> np.ndarray:
    """The part of each item when every row of `sizes` (items sorted largest first) is split into `parts`
    with even size sums: each item goes to the lightest part (the first on ties) with fewer than `capacity`
    items, the LPT rule; one Python step per column, the rows (independent groups) at once."""
    rows, columns = sizes.shape
    loads = np.zeros((rows, parts), dtype=np.int64)
    flat_loads, counts = loads.reshape(-1), np.zeros(rows * parts, dtype=np.int64)
    base = np.arange(rows, dtype=np.int64) * parts
    sizes_t = np.ascontiguousarray(sizes.T)  # a column per step, read contiguously
    out_t = np.empty((columns, rows), dtype=np.int64)
    closed = np.iinfo(np.int64).max  # the load of a full part: never the lightest again
    for j in range(columns):
        target = loads.argmin(axis=1)
        cell = base + target
        flat_loads[cell] += sizes_t[j]
        out_t[j] = target
        if capacity is not None:
            counts[cell] += 1
            flat_loads[cell[counts[cell] >= capacity]] = closed
    return out_t.T


def compact_sizes(sizes: Any) -> np.ndarray:
    """Unit sizes as int32 when every value fits, else int64: every rank holds one per training row, so the width
    is what a rank pays per row of the data set. The plans do not depend on it (sums are int64; -2**31 is kept in
    int64, where negating it does not overflow)."""
    arr = np.asarray(sizes)
    if arr.dtype == np.int32:
        return arr
    if arr.dtype.kind in "iu" and (arr.size == 0 or (int(arr.min()) > -2**31 and int(arr.max()) < 2**31)):
        return arr.astype(np.int32)
    return arr.astype(np.int64)


class BalancedBatchSampler(Sampler[list[int]]):
    """This rank's batches when samples differ in cost (atoms, tokens, edges).

    Every rank computes the same global plan from (seed, epoch), so a resumed or rescaled run needs no
    iterator state, and every rank gets the same number of micro-batches.

    - `balanced` (fairchem's balanced batch sampler): global batch k holds positions [k G, (k+1) G) of the
      (seed, epoch) order (G = world_size x batch_size), split across ranks so that their unit sums are
      even (LPT, batch_size samples each). A batch depends on its own samples alone, so a rank computes
      only the batches it reads and the resume position is a division.
    - `budget`: windows of `bucket_size` (at least 2 x world_size) shuffled samples are sorted by size and
      cut into global batches of world_size micro-batches of at most `max_units` units each (LPT: a global
      batch grows while its split keeps every rank within budget); the batches are then shuffled, so similar
      lengths share a batch without the epoch being ordered by length. The fewer than world_size samples a
      window leaves over are pooled and cut again after all windows; what the last pool leaves (fewer than
      world_size) waits for the next epoch's order and is counted in `dropped_per_epoch`. A sample larger
      than the budget is an error. An epoch's plan is built at once (vectorised over windows) and kept; the
      number of batches of each epoch is kept too. Epochs differ in length, so the resume position of a
      count of batches is found from the start of an epoch known at or before it (`add_epoch_start`: a
      checkpoint records the start of the epoch it stopped in), building only the plans after it.

    `block` and `window` select the block-window order (data.shuffle_block, data.shuffle_window).
    """

    def __init__(self, sizes, *, mode: str, seed: int, rank: int, world_size: int, shuffle: bool = True,
                 batch_size: int = 1, max_units: int = 0, bucket_size: int = 0, with_epoch: bool = False,
                 block: int = 0, window: int = 64):
        self.sizes = compact_sizes(sizes)
        self.mode, self.seed, self.rank, self.world_size = mode, seed, rank, world_size
        self.shuffle, self.batch_size, self.max_units = shuffle, batch_size, max_units
        self.block, self.window = block, window
        self.with_epoch = with_epoch
        # plan_key: the sizes themselves (the same count and total could be other sizes, or the same in another order)
        # Hashed as int64, block by block: the same key as when the sizes were held as int64, without a copy of them.
        digest = hashlib.blake2b(digest_size=8)
        for lo in range(0, self.sizes.size, _CHUNK):
            digest.update(self.sizes[lo:lo + _CHUNK].astype(np.int64).tobytes())
        self._sizes_digest = digest.hexdigest()
        if mode == "budget":
            too_big = np.flatnonzero(self.sizes > max_units)
            if too_big.size:
                raise ValueError(f"{too_big.size} samples exceed max_units_per_batch={max_units} "
                                 f"(largest {int(self.sizes.max())} units, e.g. sample {int(too_big[0])}); "
                                 f"raise the budget or crop the samples")
            mean = max(1.0, float(self.sizes.mean())) if self.sizes.size else 1.0
            per_global = max(1, int(max_units / mean) * world_size)
            # At least 2 x world_size: a window then leaves under half its samples to the pool, which shrinks.
            self.bucket_size = max(bucket_size or 64 * per_global, 2 * world_size)
        elif mode != "balanced":
            raise ValueError(f"unknown batching mode {mode!r}: balanced or budget")
        self.epoch, self.skip = 0, 0
        self._budget: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None  # one epoch's plan
        self._lengths: dict[int, int] = {}  # epoch -> global batches (budget), kept for resume positions
        self._starts: dict[int, int] = {0: 0}  # epoch -> batches before it (budget): where position() walks from
        if self.sizes.size == 0 or len(self) == 0:
            raise ValueError(f"{self.sizes.size} samples make no full global batch of {world_size} ranks")

    # ----------------------------------------------------------------------------------------- balanced
    def _balanced(self, epoch: int, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(samples, part of each) of global batches [first, stop) of `epoch` in balanced mode: rows are
        batches, samples sorted largest first, parts are ranks."""
        step = self.batch_size * self.world_size
        positions = np.arange(first, stop, dtype=np.int64)[:, None] * step + np.arange(step, dtype=np.int64)
        samples = self._order(epoch)(positions)
        by_size = np.argsort(-self.sizes[samples], axis=1, kind="stable")
        samples = np.take_along_axis(samples, by_size, axis=1)
        return samples, lpt_parts(self.sizes[samples], self.world_size, capacity=self.batch_size)

    # ------------------------------------------------------------------------------------------- budget
    def _cut_windows(self, samples: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        """Cut `samples` (in epoch order), window by window, into global batches: (members, per-(batch, rank)
        counts, leftover samples); members run batch by batch, rank by rank, each rank's in LPT order."""
        window, world, budget = self.bucket_size, self.world_size, self.max_units
        lanes_per_group = max(1, _GROUP // window)
        members, counts, leftover = [], [], []
        for g0 in range(0, samples.size, lanes_per_group * window):
            group = samples[g0:g0 + lanes_per_group * window]
            lanes = -(-group.size // window)
            ids = np.full(lanes * window, -1, dtype=samples.dtype)
            ids[:group.size] = group
            ids = ids.reshape(lanes, window)
            units = np.where(ids >= 0, self.sizes[ids], -1)  # padding sorts last and weighs nothing
            by_size = np.argsort(-units, axis=1, kind="stable")
            ids, units = np.take_along_axis(ids, by_size, axis=1), np.take_along_axis(units, by_size, axis=1)
            valid = units >= 0
            # Column by column over the windows at once; columns are rows here so that each step reads and
            # writes contiguous memory.
            units_t = np.ascontiguousarray(np.maximum(units, 0).T)  # padding weighs nothing
            part_t = np.empty((window, lanes), dtype=np.int64)
            batch_t = np.empty((window, lanes), dtype=np.int64)
            loads = np.zeros((lanes, world), dtype=np.int64)
            flat = loads.reshape(-1)
            base = np.arange(lanes, dtype=np.int64) * world
            current, start = np.zeros(lanes, dtype=np.int64), np.zeros(lanes, dtype=np.int64)
            for j in range(window):
                size = units_t[j]
                target = loads.argmin(axis=1)
                cell = base + target
                # LPT is online (a sample's part depends on the larger ones only), so the longest prefix whose
                # split fits the budget ends at the first sample that would overflow its lightest rank.
                close = flat[cell] + size > budget
                if close.any():
                    loads[close] = 0
                    target[close], cell[close] = 0, base[close]
                    current[close] += 1
                    start[close] = j
                flat[cell] += size
                part_t[j], batch_t[j] = target, current
            part, batch = part_t.T, batch_t.T
            short = valid.sum(axis=1) - start < world  # the last batch of a window is kept if every rank has a sample
            left = valid & short[:, None] & (batch == current[:, None])
            leftover.append(ids[left])
            keep = valid & ~left
            per_lane = current + 1 - short
            offset = np.concatenate([[0], np.cumsum(per_lane)[:-1]])
            gid = (offset[:, None] + batch)[keep]
            cell = gid * world + part[keep]
            # Stable: row-major order already runs by batch, and within a rank's cell by LPT order.
            members.append(ids[keep][np.argsort(cell, kind="stable")])
            counts.append(np.bincount(cell, minlength=int(per_lane.sum()) * world))
        return members, counts, np.concatenate(leftover)

    def _budget_batches(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The global batches of `order` (an epoch's samples in order), before the batches are shuffled:
        (members, bounds), rank r of batch b being members[bounds[b W + r]:bounds[b W + r + 1]]."""
        members, counts = [], []
        rest = order
        while True:
            cut, cell_counts, rest_next = self._cut_windows(rest)
            members += cut
            counts += cell_counts
            if rest.size <= self.bucket_size or rest_next.size < self.world_size:
                break  # one window: what it left over (fewer than world_size) waits for the next epoch
            rest = rest_next
        bounds = np.concatenate([[0], np.cumsum(np.concatenate(counts))])
        return np.concatenate(members), bounds

    def _budget_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(members, bounds, batch order) of `epoch`: batch b of the epoch is batch order[b] of members."""
        if self._budget is None or self._budget[0] != epoch:
            self._budget = None  # one epoch's plan held at a time, not two while the next is built
            shuffled, n = self._order(epoch), self.sizes.size
            samples = np.empty(n, dtype=np.int32 if n < 2**31 else np.int64)  # the plan holds N of these
            for start in range(0, n, _GROUP):  # in pieces: the order's temporaries stay small
                samples[start:start + _GROUP] = shuffled(np.arange(start, min(start + _GROUP, n)))
            members, bounds = self._budget_batches(samples)
            batches = (bounds.size - 1) // self.world_size
            rng = np.random.default_rng([self.seed % 2**64, epoch])
            order = rng.permutation(batches) if self.shuffle else np.arange(batches)
            self._budget = (epoch, members, bounds, order)
            self._lengths[epoch] = batches
        return self._budget[1:]

    # ---------------------------------------------------------------------------------------- interface
    def _order(self, epoch: int) -> Callable[[np.ndarray], np.ndarray]:
        return epoch_order(self.sizes.size, self.seed, epoch, self.shuffle, self.block, self.window)

    @property
    def order_name(self) -> str:
        """The order's recorded name (`sample_order_name`)."""
        return sample_order_name(self.block, self.window, self.shuffle)

    @property
    def plan_key(self) -> str:
        """What a budget plan's lengths depend on: an epoch start recorded under another key does not hold here."""
        return (f"{BUDGET_PLAN}(n={self.sizes.size},sizes={self._sizes_digest},world={self.world_size},"
                f"max_units={self.max_units},bucket={self.bucket_size},seed={self.seed},shuffle={self.shuffle},"
                f"order={self.order_name})") if self.mode == "budget" else self.mode

    def add_epoch_start(self, epoch: int, start: int) -> None:
        """Record that `epoch` starts after `start` batches (a checkpoint's record for this `plan_key`), so
        `position` need not build the plans of the epochs before it."""
        if epoch < 0 or start < 0:
            raise ValueError(f"an epoch start needs epoch >= 0 and start >= 0, not ({epoch}, {start})")
        self._starts[epoch] = start

    def num_batches(self, epoch: int) -> int:
        """Global batches (so micro-batches of every rank) in `epoch`."""
        if self.mode == "balanced":
            return self.sizes.size // (self.batch_size * self.world_size)
        if epoch not in self._lengths:
            self._budget_plan(epoch)
        return self._lengths[epoch]

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """Global batches of `epoch`: a list of [rank 0 indices, rank 1 indices, ...] (whole epoch, all ranks:
        for tests and inspection; iteration computes this rank's batches only)."""
        world = self.world_size
        if self.mode == "balanced":
            samples, parts = self._balanced(epoch, 0, self.num_batches(epoch))
            return [[row[part == r].tolist() for r in range(world)] for row, part in zip(samples, parts)]
        members, bounds, order = self._budget_plan(epoch)
        return [[members[bounds[b * world + r]:bounds[b * world + r + 1]].tolist() for r in range(world)]
                for b in order.tolist()]

    @property
    def num_samples(self) -> int:
        return int(self.sizes.size)

    @property
    def dropped_per_epoch(self) -> int:
        if self.mode == "balanced":
            return int(self.sizes.size - self.num_batches(self.epoch) * self.batch_size * self.world_size)
        return int(self.sizes.size - self._budget_plan(self.epoch)[0].size)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip

    def __len__(self) -> int:
        return self.num_batches(self.epoch)

    def position(self, consumed: int) -> tuple[int, int]:
        """(epoch, batches of it done) after `consumed` batches; budget plans differ in length per epoch, so the
        walk starts at the latest epoch start known at or before `consumed` (`add_epoch_start`, or ones walked
        before) and builds the plans from there only."""
        if self.mode == "balanced":
            return divmod(consumed, self.num_batches(0))
        start, epoch = max((s, e) for e, s in self._starts.items() if s <= consumed)
        while consumed >= start + self.num_batches(epoch):
            start += self.num_batches(epoch)
            epoch += 1
            self._starts[epoch] = start
        return epoch, consumed - start

    def __iter__(self) -> Iterator[list[int]]:
        epoch, rank, world = self.epoch, self.rank, self.world_size
        if self.mode == "balanced":
            total = self.num_batches(epoch)
            per_chunk = max(1, _ITER_SAMPLES // (self.batch_size * world))  # global batches per vectorised call
            for first in range(self.skip, total, per_chunk):
                samples, parts = self._balanced(epoch, first, min(first + per_chunk, total))
                for batch in samples[parts == rank].reshape(len(samples), self.batch_size).tolist():
                    yield [(epoch, i) for i in batch] if self.with_epoch else batch
            return
        members, bounds, order = self._budget_plan(epoch)
        for b in order[self.skip:].tolist():
            mine = members[bounds[b * world + rank]:bounds[b * world + rank + 1]].tolist()
            yield [(epoch, i) for i in mine] if self.with_epoch else mine


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

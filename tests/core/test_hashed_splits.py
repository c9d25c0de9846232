"""The id-hash split rule from stored hashes: the same assignment as the rule's definition, and the splits' row
numbers found without an array of every row's split or mask (a rank keeps only the rows, as narrow ints)."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from trainer.data.splits import assign_hashed, hashed_split_rows


def reference_assign(hashes: np.ndarray, fractions: list[float]) -> np.ndarray:
    """The rule as defined: the first split whose cumulative fraction x has h < x (exactly), else the last."""
    out, upper = [], [sum(fractions[:k + 1]) for k in range(len(fractions) - 1)]
    for h in hashes.tolist():
        out.append(next((k for k, x in enumerate(upper) if h < math.ceil(x * 2.0**64)), len(fractions) - 1))
    return np.array(out, dtype=np.int64)


FRACTIONS = [[0.9, 0.05, 0.05], [0.5, 0.0, 0.5], [1.0, 0.0, 0.0], [0.0, 1.0], [1.0], [0.3, 0.7], [0.0, 0.0, 1.0]]


@pytest.mark.parametrize("fractions", FRACTIONS)
def test_assignment_and_rows_follow_the_rule(fractions):
    rng = np.random.default_rng(1)
    hashes = rng.integers(0, 2**64 - 1, size=5000, dtype=np.uint64, endpoint=True)
    # hashes at and around every bound: the comparison is exact
    bounds = [math.ceil(sum(fractions[:k + 1]) * 2.0**64) for k in range(len(fractions) - 1)]
    edge = [b + d for b in bounds for d in (-1, 0, 1) if 0 <= b + d < 2**64] + [0, 2**64 - 1]
    hashes = np.concatenate([hashes, np.array(edge, dtype=np.uint64)])
    want = reference_assign(hashes, fractions)
    assert np.array_equal(assign_hashed(hashes, fractions), want)
    rows = hashed_split_rows(hashes, fractions)
    assert len(rows) == len(fractions)
    for k, r in enumerate(rows):
        assert r.dtype == np.int32 and np.array_equal(r, np.flatnonzero(want == k))


def test_rows_across_blocks_and_from_a_memory_map(tmp_path, monkeypatch):
    monkeypatch.setattr("trainer.data.splits.HASH_BLOCK", 97)
    hashes = np.random.default_rng(2).integers(0, 2**63, size=3001, dtype=np.uint64) * np.uint64(2)
    np.save(tmp_path / "h.npy", hashes)
    mapped = np.load(tmp_path / "h.npy", mmap_mode="r")
    want = reference_assign(hashes, [0.8, 0.1, 0.1])
    assert np.array_equal(assign_hashed(mapped, [0.8, 0.1, 0.1]), want)
    for k, r in enumerate(hashed_split_rows(mapped, [0.8, 0.1, 0.1])):
        assert np.array_equal(r, np.flatnonzero(want == k))


def test_split_rows_need_no_array_of_every_row():
    """Finding the rows of 2**20 hashes allocates their int32 rows and a few blocks: not an int64 split per row
    (8 bytes a row) nor the masks of the whole set."""
    n = 1 << 20
    hashes = np.random.default_rng(3).integers(0, 2**63, size=n, dtype=np.uint64)
    tracemalloc.start()
    try:
        rows = hashed_split_rows(hashes, [0.9, 0.05, 0.05])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(r.size for r in rows) == n
    assert peak < 4 * n + 3 * 2**20, peak

"""One id-hash split rule for every family.

A record goes to a split by a keyed blake2b hash of its id alone: u = hash / 2**64 is uniform in
[0, 1), and the split is the one whose cumulative-fraction interval holds u (in the order given).
So membership does not depend on file order, on the other records, on the world size or on the
process (Python's `hash` is salted per process, blake2b is not), and a stream can decide record by
record. Split sizes are binomial around fraction x n rather than exact.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import numpy as np


def id_hashes(record_ids: Sequence[str], key: str | int = "") -> np.ndarray:
    """64-bit keyed blake2b hashes of the ids (uint64)."""
    key_bytes = str(key).encode("utf-8")[:64]
    blake2b = hashlib.blake2b
    digests = b"".join([blake2b(str(i).encode("utf-8"), digest_size=8, key=key_bytes).digest() for i in record_ids])
    return np.frombuffer(digests, dtype=">u8").astype(np.uint64)


def _check(fractions: Sequence[float]) -> list[float]:
    values = [float(f) for f in fractions]
    if any(not math.isfinite(f) or f < 0 for f in values) or abs(sum(values) - 1.0) > 1e-6:
        raise ValueError(f"split fractions must be finite, >= 0 and sum to 1, got {values}")
    return values


def assign_splits(record_ids: Sequence[str], fractions: Sequence[float], key: str | int = "") -> np.ndarray:
    """Per id, the index of its split (0..len(fractions)-1) under the id-hash rule."""
    return assign_hashed(id_hashes(record_ids, key), fractions)


HASH_BLOCK = 1 << 16
"""Hashes assigned at a time: the transients of an assignment (masks, positions) stay this size whatever N is."""


def _thresholds(fractions: Sequence[float]) -> np.ndarray:
    """The splits' upper hash bounds (uint64, ascending), those at or past 2**64 left out: a hash h goes to the
    number of bounds <= h (the first split whose cumulative fraction x has h < x; none: the last split)."""
    bounds, upper = [], 0.0
    for fraction in _check(fractions)[:-1]:
        upper += fraction
        threshold = math.ceil(upper * 2.0**64)  # the exact comparison of an integer h with the float x: h < ceil(x)
        if threshold >= 2**64:
            break  # every hash is below it, and below the later ones (fractions are >= 0)
        bounds.append(threshold)
    return np.array(bounds, dtype=np.uint64)


def _assign_block(hashes: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    return np.searchsorted(bounds, np.asarray(hashes, dtype=np.uint64), side="right")


def assign_hashed(hashes: np.ndarray, fractions: Sequence[float]) -> np.ndarray:
    """`assign_splits` from the ids' `id_hashes` (computed once, e.g. at build time, and stored)."""
    bounds = _thresholds(fractions)
    out = np.empty(len(hashes), dtype=np.int64)
    for lo in range(0, len(hashes), HASH_BLOCK):
        out[lo:lo + HASH_BLOCK] = _assign_block(hashes[lo:lo + HASH_BLOCK], bounds)
    return out


def hashed_split_rows(hashes: np.ndarray, fractions: Sequence[float]) -> list[np.ndarray]:
    """Per split (in the order of `fractions`), the ascending row numbers whose hash falls in it: the rows of
    `assign_hashed(hashes, fractions) == k`, int32 when there are fewer than 2**31 rows (else int64).

    A rank keeps its splits' row numbers for the whole run, so they are as narrow as the row count allows; they
    are found `HASH_BLOCK` hashes at a time (a count, then a fill), with no array of every row's split or mask on
    the way. `hashes` may be a memory map: it is read block by block."""
    bounds, n = _thresholds(fractions), len(hashes)
    splits = len(_check(fractions))
    counts = np.zeros(splits, dtype=np.int64)
    for lo in range(0, n, HASH_BLOCK):
        counts += np.bincount(_assign_block(hashes[lo:lo + HASH_BLOCK], bounds), minlength=splits)
    dtype = np.int32 if n < 2**31 else np.int64
    out = [np.empty(int(c), dtype=dtype) for c in counts]
    filled = np.zeros(splits, dtype=np.int64)
    for lo in range(0, n, HASH_BLOCK):
        which = _assign_block(hashes[lo:lo + HASH_BLOCK], bounds)
        for k in np.unique(which).tolist():
            rows = np.flatnonzero(which == k)
            out[k][filled[k]:filled[k] + rows.size] = rows + lo
            filled[k] += rows.size
    return out


def split_indices(record_ids: Sequence[str], fractions: Mapping[str, float], key: str | int = "") -> dict[str, np.ndarray]:
    """{split name: ascending row indices} of the ids under the id-hash rule (names in the given order)."""
    names = list(fractions)
    which = assign_splits(record_ids, [fractions[n] for n in names], key)
    return {name: np.flatnonzero(which == k) for k, name in enumerate(names)}


def in_holdout(record_ids: Sequence[str], fraction: float, key: str | int = "") -> np.ndarray:
    """Whether each id falls in a held-out share `fraction` (the first split of [fraction, 1 - fraction])."""
    if fraction <= 0.0:
        return np.zeros(len(record_ids), dtype=bool)
    if fraction >= 1.0:
        return np.ones(len(record_ids), dtype=bool)
    return assign_splits(record_ids, [fraction, 1.0 - fraction], key) == 0


def repeated_hashes(parts: Sequence[np.ndarray], buckets: int = 16) -> np.ndarray:
    """The uint64 values (e.g. `id_hashes`) that occur more than once over `parts`, sorted. Sorted bucket by
    bucket (by the top bits; `buckets` a power of two), so that beside the parts only about 1/`buckets` of them is
    copied at a time."""
    bits = int(buckets).bit_length() - 1
    if buckets < 1 or 1 << bits != buckets:
        raise ValueError(f"buckets must be a power of two, got {buckets}")
    found: list[np.ndarray] = []
    for b in range(buckets):
        values = np.concatenate([p if not bits else p[(p >> np.uint64(64 - bits)) == b] for p in parts]
                                + [np.zeros(0, np.uint64)])
        values.sort()
        found.append(np.unique(values[1:][values[1:] == values[:-1]]))
    return np.concatenate(found)

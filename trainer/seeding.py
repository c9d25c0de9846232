"""One rule for derived seeds: `derive_seed(*keys)`, used wherever a seed is a function of other values.

Seeds of sample k, of (seed, epoch, index) crops, of per-(rank, epoch) loader generators: each is
`derive_seed(...)` of its keys, so streams never collide the way `seed * 1000 + k` style sums do.
"""

from __future__ import annotations

import hashlib

import numpy as np


def _entropy(key: int | str | bytes) -> int:
    if isinstance(key, bool) or not isinstance(key, (int, str, bytes)):
        raise TypeError(f"seed keys are ints, strings or bytes, got {type(key).__name__}")
    if isinstance(key, int):
        if key < 0:  # SeedSequence takes non-negative entropy; keep negatives distinct from positives
            return (1 << 64) + (-key)
        return key
    data = key.encode() if isinstance(key, str) else key
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def derive_seed(*keys: int | str | bytes) -> int:
    """A 63-bit seed from `keys` (numpy SeedSequence: well mixed, order-sensitive, stable across versions)."""
    state = np.random.SeedSequence([_entropy(k) for k in keys]).generate_state(2, np.uint32)
    return int((int(state[0]) << 32 | int(state[1])) >> 1)


def derive_rng(*keys: int | str | bytes) -> np.random.Generator:
    """A numpy Generator seeded by `derive_seed(*keys)`."""
    return np.random.default_rng(derive_seed(*keys))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment (2^64 / golden ratio)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea and Flood 2014): a bijection of uint64 with full avalanche."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def derive_seeds(base: int | np.ndarray, *keys: int | str | bytes | np.ndarray) -> np.ndarray:
    """`derive_seed` for many keys at once: 63-bit seeds (int64), one per element of the broadcast key arrays.

    `base` is a seed (or an array of them, e.g. one per row); each key is an int array (one value per row) or a
    scalar int / string folded into every row. Each key is mixed in with SplitMix64's finaliser, so a batch of
    rows costs a few vector operations instead of one SeedSequence per row (what per-sample randomness in a
    training step needs). Like `derive_seed`, order-sensitive and stable across versions."""
    h = np.asarray(base, dtype=np.int64).view(np.uint64) if np.ndim(base) else np.uint64(_entropy(int(base)))
    with np.errstate(over="ignore"):
        for key in keys:
            if isinstance(key, (str, bytes, int)) and not isinstance(key, bool):
                k = np.uint64(_entropy(key) & 0xFFFFFFFFFFFFFFFF)
            else:
                k = np.asarray(key).astype(np.int64).view(np.uint64)
            h = _mix64(h ^ _mix64(k + _GOLDEN))
    return (np.asarray(h, dtype=np.uint64) >> np.uint64(1)).astype(np.int64)

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

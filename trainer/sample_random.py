"""Randomness of a training micro-batch keyed by its samples: `SampleRandom`, what `Task.loss` draws from.

Every row of a training micro-batch carries a 63-bit seed that is a function of the run seed and of the
sample alone: `derive_seeds(derive_seed(run.seed, "sample"), epoch, dataset index)` for map-style data (for a
stream: its global index in the epoch's order instead of the dataset index), so a sample gets the same draws
whichever rank, micro-batch, accumulation step or batching mode reads it. A task draws from named streams of
those seeds ("time", "noise", "mask", ...): row k of `rng.rand("time")` depends on (row k's seed, "time", the
shape) only, never on the other rows, the batch's size or order, the world size or
the device. That is what makes N processes train the same weights as one for the same global batch (up to
float summation order), and a resumed run draw what the uninterrupted one drew.

Rules of the draws:

- Each call starts its stream afresh: `rng.rand("time")` twice gives the same numbers. Use one name per
  quantity drawn.
- Draws happen on the CPU, one row at a time, and are then moved to `device`: CPU and GPU runs see the
  same numbers.
- Draws are prefix-stable along the first dimension of `shape`: a row's draw of shape (n, ...) begins with
  its draw of shape (m, ...) for m < n. A task may therefore draw for the batch's padded length: a row's
  values at its real positions do not depend on how far the batch was padded.
- `generators(name)` gives one seeded CPU `torch.Generator` per row, for code that takes per-row generator
  lists (what such code draws from it is keyed the same way; it is prefix-stable if it draws one tensor per
  generator, as `torch.rand` / `torch.randint` on the CPU are).

Not covered: dropout and other randomness inside the model's forward, which draws from the rank's global
RNG (`run.seed + rank`); it differs between 1 and N processes (and is restored exactly on resume at the
same world size). This module imports no torch.distributed or accelerate: families use it directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer.seeding import derive_seed, derive_seeds

if TYPE_CHECKING:
    import torch


@lru_cache(maxsize=8)
def _sample_base(run_seed: int) -> int:
    return derive_seed(run_seed, "sample")  # one SeedSequence per run, not per micro-batch


class SampleRandom:
    """Per-row random draws of one micro-batch: one 63-bit seed per row (see the module docstring)."""

    __slots__ = ("_seeds", "_rows_of")

    def __init__(self, seeds: Sequence[int] | np.ndarray):
        self._seeds: np.ndarray | None = np.asarray(seeds, dtype=np.int64).reshape(-1)
        self._rows_of: tuple[int, np.ndarray, np.ndarray] | None = None

    @classmethod
    def for_samples(cls, run_seed: int, epochs: Sequence[int] | np.ndarray | int,
                    indices: Sequence[int] | np.ndarray) -> SampleRandom:
        """The rows of training samples: sample `indices[k]` (its dataset index, or a stream's global index) read
        in epoch `epochs[k]`. The seeds are derived on first use: a loss that draws nothing never pays for them."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = cls.__new__(cls)
        out._seeds = None
        out._rows_of = (run_seed, np.broadcast_to(epochs, indices.shape), indices)
        return out

    @property
    def seeds(self) -> np.ndarray:
        """One 63-bit seed per row (int64)."""
        if self._seeds is None:
            run_seed, epochs, indices = self._rows_of
            self._seeds = derive_seeds(_sample_base(run_seed), epochs, indices)
            self._rows_of = None
        return self._seeds

    def __getstate__(self) -> dict:
        return {"_seeds": self.seeds}

    def __setstate__(self, state: dict) -> None:
        self._seeds, self._rows_of = state["_seeds"], None

    def __len__(self) -> int:
        return int(self.seeds.size) if self._seeds is not None else int(self._rows_of[2].size)

    def __getitem__(self, rows: Any) -> SampleRandom:
        """The rows `rows` (a slice, index list or boolean mask) as their own SampleRandom."""
        return SampleRandom(np.atleast_1d(self.seeds[rows]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SampleRandom) and np.array_equal(self.seeds, other.seeds)

    def __repr__(self) -> str:
        return f"SampleRandom({len(self)} rows)"

    def stream_seeds(self, name: str) -> np.ndarray:
        """One seed per row for the stream `name` (int64, 63-bit)."""
        return derive_seeds(self.seeds, name)

    def generators(self, name: str) -> list[torch.Generator]:
        """One CPU generator per row, seeded from (row seed, `name`)."""
        import torch

        return [torch.Generator().manual_seed(int(s)) for s in self.stream_seeds(name)]

    def _rows(self, name: str, draw, device: Any) -> torch.Tensor:
        import torch

        if not len(self):
            raise ValueError("a SampleRandom without rows draws nothing")
        g = torch.Generator()  # one generator, reseeded per row: what generators(name)[k] would draw
        out = torch.stack([draw(g.manual_seed(int(seed))) for seed in self.stream_seeds(name)])
        return out if device is None else out.to(device)

    def rand(self, name: str, *shape: int, device: Any = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """U[0, 1) draws shaped [rows, *shape] (float32 unless `dtype`)."""
        import torch

        dtype = dtype or torch.float32
        return self._rows(name, lambda g: torch.rand(shape, generator=g, dtype=dtype), device)

    def randint(self, name: str, low: int, high: int, *shape: int, device: Any = None) -> torch.Tensor:
        """Integers uniform in [low, high), int64, shaped [rows, *shape]."""
        import torch

        return self._rows(name, lambda g: torch.randint(low, high, shape, generator=g), device)

    def randn(self, name: str, *shape: int, device: Any = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Standard normal draws shaped [rows, *shape] (float32 unless `dtype`): Box-Muller on float64 uniform
        pairs, so prefix-stable like `rand` (torch's own CPU randn is not: it fills blocks of 16). The transform
        runs on all rows at once in float64; its vector and scalar code paths (which differ by an ulp at most)
        round to the same float32 value except for about one value in 1e9."""
        import torch

        u = self._rows(name, lambda g: torch.rand((*shape, 2), generator=g, dtype=torch.float64), None)
        radius = torch.sqrt(-2.0 * torch.log1p(-u[..., 0]))  # 1 - u in (0, 1]: finite
        out = (radius * torch.cos(2.0 * math.pi * u[..., 1])).to(dtype or torch.float32)
        return out if device is None else out.to(device)

"""Host (CPU) memory of a training process: give freed heap pages back to the OS during long evaluations, and
keep an evaluation's per-sample outputs compact (`EvalOutputs`).

glibc serves allocations below its mmap threshold from a heap that only shrinks from the top. An
evaluation that keeps small per-batch outputs (gathered for metrics) while it allocates and frees large
batches leaves the heap full of holes, so the RSS grows with every batch although little is live.
`malloc_trim` returns the free pages inside those holes. It walks the whole heap, so `HeapTrimmer` calls it
only when the RSS has grown by `grow_mb` since the last call; checking costs one read of /proc/self/statm.
(A fixed M_MMAP_THRESHOLD also stops the growth but slows training: every mid-size activation then costs
fresh page faults.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections import defaultdict

import torch


def _malloc_trim():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def rss_mb() -> float:
    """This process's resident set size in MiB (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


class HeapTrimmer:
    """Call after each batch of a long loop: trims the heap once the RSS grew `grow_mb` since the last trim.

    A no-op where there is no glibc (or no /proc)."""

    def __init__(self, grow_mb: float = 256.0):
        self.grow_mb = grow_mb
        self.enabled = _TRIM is not None and rss_mb() > 0
        self.base = rss_mb() if self.enabled else 0.0
        self.trims = 0

    def __call__(self) -> None:
        if not self.enabled:
            return
        if rss_mb() - self.base > self.grow_mb:
            _TRIM(0)
            self.trims += 1
            self.base = rss_mb()


class EvalOutputs:
    """An evaluation's per-sample outputs by key, as float32 CPU tensors (integer outputs as float64) joined every
    `join_every` batches.

    A list of one small tensor per batch costs a tensor object (about a kilobyte) per batch and key, which at a
    test split of 50 k structures in batches of 16 is tens of MiB, and fragments the heap; joined, a value costs
    its 4 bytes (8 for an integer)."""

    def __init__(self, join_every: int = 256):
        self.join_every = join_every
        self.joined: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.pending: dict[str, list[torch.Tensor]] = defaultdict(list)

    def add(self, outputs: dict[str, torch.Tensor]) -> None:
        for key, value in outputs.items():
            pending = self.pending[key]
            # integers (row indices) as float64: exact to 2^53, where float32 stops at 2^24
            pending.append(value.detach().cpu().float() if value.is_floating_point() else value.detach().cpu().double())
            if len(pending) >= self.join_every:
                self.joined[key].append(torch.cat(pending))
                pending.clear()

    def columns(self) -> dict[str, torch.Tensor]:
        """Each key's values over every batch added, in order."""
        return {key: torch.cat([*self.joined[key], *self.pending[key]]) for key in self.pending}

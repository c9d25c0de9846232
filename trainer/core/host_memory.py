"""Host (CPU) allocator settings of a training process.

glibc serves an allocation from its heap unless it is at least M_MMAP_THRESHOLD bytes, in which case it
gets its own memory map that goes back to the OS when freed. The threshold starts at 128 KiB and rises
with every large block freed, up to 32 MiB, so after a while every block below 32 MiB comes from the heap.
A job that densifies many such blocks of a large sparse matrix (GEARS evaluating a Norman-size set:
20 MiB of expression per eval batch) then grows a fragmented heap that `malloc_trim` cannot shrink:
+40 % peak RSS, measured in BENCHMARKS.md. A fixed threshold (`data.malloc_mmap_threshold_mb`) stops the
drift; blocks above it cost a page fault per 4 KiB page when first touched, which is small next to
computing on them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""mallopt parameter number (glibc's malloc.h)."""


def apply_malloc_mmap_threshold(megabytes: float) -> bool:
    """Fix glibc's mmap threshold at `megabytes` (0: leave glibc's default). Returns whether it was set.

    Only glibc (Linux) has it; elsewhere, or if mallopt refuses the value, a warning says so and nothing
    changes. The setting is process-wide and inherited by forked DataLoader workers.
    """
    if megabytes <= 0:
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        logger.warning("data.malloc_mmap_threshold_mb=%g: only glibc (Linux) has this setting; ignored here", megabytes)
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not libc.mallopt(M_MMAP_THRESHOLD, int(megabytes * 2**20)):
        logger.warning("data.malloc_mmap_threshold_mb=%g: glibc refused the value; ignored", megabytes)
        return False
    return True

"""Resident pages of memory-mapped data files: how many a data-loading process keeps, and dropping them.

A rank reads its rows from memory-mapped files (Arrow shards, raw column files). Every page it touches stays in
its page tables, and so in its RSS, until the mapping closes: one pass over a large split (an epoch, or a test
split spread over every shard by its id hash, where each fault maps its neighbours too) grows the RSS to the size
of the files, though none of it is private: the pages are clean copies of the files in the OS page cache.
Schedulers and job monitors that police RSS then see a rank that holds gigabytes.

`MappedPageBound` drops those pages from this process's page tables (madvise MADV_DONTNEED) once they have grown by
a bound. The page cache keeps them, so the next read of such a page is a minor fault, not I/O. Only read-only
mappings of files named like the package's data files (`DATA_FILE_SUFFIXES`) that hold no private page are touched:
such a page is always the file's own content, so dropping it loses nothing. The package unmaps no data file from
another thread while it loads, so a listed range is still that file when it is advised. Linux only; elsewhere a
no-op.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger("trainer")

DATA_FILE_SUFFIXES = (".arrow", ".npy", ".f32", ".i32")
"""Files whose read-only mappings may be dropped: Arrow shards and caches, numpy arrays, raw column files."""

_MADV_DONTNEED = 4


def _madvise():
    if platform.system() != "Linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def file_resident_mb() -> float:
    """This process's resident pages of mapped files in MiB (RssFile of /proc/self/status); 0 where missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def data_mappings(suffixes: tuple[str, ...] = DATA_FILE_SUFFIXES) -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's read-only mappings of files ending in one of `suffixes` (a file deleted
    while mapped included) that hold no private page: /proc/self/smaps says `Anonymous: 0 kB`. A private mapping
    once written and then made read-only keeps its written pages as anonymous ones, which dropping would lose."""
    found = []
    try:
        with open("/proc/self/smaps") as f:
            lines = f.readlines()
    except OSError:
        return found
    candidate = None
    for line in lines:
        parts = line.split(maxsplit=5)
        if parts and "-" in parts[0] and len(parts) >= 5:  # a mapping's header line
            candidate = None
            if len(parts) < 6 or "w" in parts[1]:
                continue
            path = parts[5].rstrip("\n").removesuffix(" (deleted)")
            if path.endswith(suffixes):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                candidate = (start, end, path)
        elif candidate is not None and parts and parts[0] == "Anonymous:":
            if int(parts[1]) == 0:
                found.append(candidate)
            candidate = None
    return found


def release_mapped_pages(suffixes: tuple[str, ...] = DATA_FILE_SUFFIXES) -> int:
    """Drop this process's resident pages of the read-only data-file mappings (`data_mappings`); they stay in the
    page cache. Returns the bytes of the mappings advised (0 where madvise is unavailable). A mapping madvise
    refuses (gone since it was listed, locked) is left as it is and logged."""
    if _MADVISE is None:
        return 0
    advised = 0
    for start, end, path in data_mappings(suffixes):
        if _MADVISE(start, end - start, _MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            logger.warning("pages of the mapping of %s not dropped: madvise: %s", path, os.strerror(err))
            continue
        advised += end - start
    return advised


class MappedPageBound:
    """Call after each batch a process reads: once its resident file pages have grown by more than `bound_mb` since
    the last release, drops its pages of mapped data files (`release_mapped_pages`).

    The first call in a process drops what its set-up touched. Checking costs one read of /proc/self/status;
    a drop, one of /proc/self/smaps.
    Picklable, and per process: a DataLoader worker (forked or spawned) counts its own pages from its own first
    call. `bound_mb` = 0 turns it off."""

    def __init__(self, bound_mb: float, suffixes: tuple[str, ...] = DATA_FILE_SUFFIXES):
        self.bound_mb, self.suffixes = float(bound_mb), tuple(suffixes)
        self.enabled = self.bound_mb > 0 and _MADVISE is not None and file_resident_mb() > 0
        self.pid: int | None = None
        self.base = 0.0
        self.releases = 0
        """Drops past the bound in this process (the first call's not counted)."""

    def __call__(self) -> bool:
        """True when this call dropped pages."""
        if not self.enabled:
            return False
        resident = file_resident_mb()
        first = self.pid != os.getpid()
        if first:  # what the set-up of this process touched (a statistics scan, say) is dropped too
            self.pid, self.releases = os.getpid(), 0
        elif resident - self.base <= self.bound_mb:
            return False
        release_mapped_pages(self.suffixes)
        self.base = file_resident_mb()
        self.releases += not first
        return True

"""Dropping a process's resident pages of mapped data files: RSS falls, the data reads the same, nothing else
is touched."""

import mmap
import pickle
import platform

import numpy as np
import pyarrow as pa
import pytest

from trainer.data.mapped_pages import (
    MappedPageBound,
    data_mappings,
    file_resident_mb,
    release_mapped_pages,
)

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or file_resident_mb() == 0,
                                reason="needs Linux's /proc and madvise")

MIB = 2**20


def _arrow_file(path, mib: int) -> float:
    values = np.random.default_rng(0).standard_normal(mib * MIB // 8)
    table = pa.table({"x": values})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=len(values) // 16)
    return float(values.sum())


def _sum_chunks(table: pa.Table, chunks=None) -> float:
    column = table.column("x")
    picked = range(column.num_chunks) if chunks is None else chunks
    return float(sum(column.chunk(i).to_numpy(zero_copy_only=True).sum() for i in picked))


def test_release_drops_the_pages_and_the_data_reads_the_same(tmp_path):
    path = tmp_path / "shard.arrow"
    expected = _arrow_file(path, 32)
    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    before = file_resident_mb()
    assert _sum_chunks(table) == pytest.approx(expected)
    touched = file_resident_mb()
    assert touched - before > 24  # the mapped pages are in this process's RSS
    assert any(p == str(path) for _, _, p in data_mappings())
    assert release_mapped_pages() >= 32 * MIB
    assert touched - file_resident_mb() > 24
    assert _sum_chunks(table) == pytest.approx(expected)  # re-read from the page cache, unchanged


def test_writable_mappings_and_other_files_are_left_alone(tmp_path):
    writable = tmp_path / "scratch.arrow"
    writable.write_bytes(b"\0" * MIB)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\1" * MIB)
    with open(writable, "r+b") as f, open(other, "rb") as g:
        rw = mmap.mmap(f.fileno(), MIB)
        ro = mmap.mmap(g.fileno(), MIB, access=mmap.ACCESS_READ)
        rw[:5] = b"hello"  # a dirty page of a writable mapping: dropping it would lose the write
        paths = [p for _, _, p in data_mappings()]
        assert str(writable) not in paths and str(other) not in paths
        release_mapped_pages()
        assert rw[:5] == b"hello" and ro[:1] == b"\1"
        rw.close()
        ro.close()


def test_a_written_private_mapping_made_read_only_is_left_alone(tmp_path):
    """Copy-on-write pages of a private mapping, written and then mprotect'ed read-only, look like a read-only data
    file in /proc/self/maps; smaps shows them as anonymous, and they are never dropped."""
    import ctypes

    path = tmp_path / "copied.arrow"
    path.write_bytes(b"\0" * MIB)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), MIB, access=mmap.ACCESS_COPY)
        m[:5] = b"hello"
        view = ctypes.c_char.from_buffer(m)
        address = ctypes.addressof(view)
        assert libc.mprotect(address, MIB, 1) == 0  # PROT_READ
        try:
            assert str(path) not in [p for _, _, p in data_mappings()]
            release_mapped_pages()
            assert m[:5] == b"hello"
        finally:
            libc.mprotect(address, MIB, 3)  # PROT_READ | PROT_WRITE, so the mapping closes as it opened
            del view
            m.close()


def test_the_bound_keeps_the_resident_pages_under_it(tmp_path):
    path = tmp_path / "shard.arrow"
    expected = _arrow_file(path, 64)
    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    bound = MappedPageBound(8)
    assert bound() is True and bound.releases == 0  # the first call drops what the set-up touched
    base = file_resident_mb()
    total, peak = 0.0, 0.0
    for i in range(table.column("x").num_chunks):  # 4 MiB a chunk
        total += _sum_chunks(table, [i])
        peak = max(peak, file_resident_mb() - base)
        bound()
    assert total == pytest.approx(expected)
    assert bound.releases >= 4
    assert peak <= 8 + 4 + 1  # the bound plus one chunk (and a page of rounding)

    off = MappedPageBound(0)
    assert not off.enabled and off() is False


def test_a_copied_bound_counts_from_its_own_first_call():
    bound = MappedPageBound(64)
    bound()
    copy = pickle.loads(pickle.dumps(bound))
    assert copy.pid == bound.pid and copy.enabled
    copy.pid = -1  # as in a forked DataLoader worker: another process
    assert copy() is True and copy.releases == 0 and copy.pid == bound.pid

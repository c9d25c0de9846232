"""Cache keys by content: a copy of an input elsewhere, or a new mtime, hits the same cache; changed bytes do not."""

from __future__ import annotations

import os
import shutil

import pytest

from trainer.data import arrow_cache as A


@pytest.fixture
def small_samples(monkeypatch):
    """Sampling at a size a test can write: files over 64 KiB are sampled (4 KiB ends, 8 blocks of 1 KiB)."""
    monkeypatch.setattr(A, "FULL_HASH_BYTES", 64 << 10)
    monkeypatch.setattr(A, "SAMPLE_EDGE_BYTES", 4 << 10)
    monkeypatch.setattr(A, "SAMPLE_BLOCKS", 8)
    monkeypatch.setattr(A, "SAMPLE_BLOCK_BYTES", 1 << 10)


def sampled_offsets(size: int) -> list[int]:
    """Start of each sampled block between the two ends (as `file_fingerprint` places them)."""
    import numpy as np

    return np.linspace(A.SAMPLE_EDGE_BYTES, size - A.SAMPLE_EDGE_BYTES - A.SAMPLE_BLOCK_BYTES,
                       A.SAMPLE_BLOCKS).astype(np.int64).tolist()


def test_copy_with_new_mtime_same_fingerprint(tmp_path, small_samples):
    for size in (1000, 300_000):  # hashed whole, and sampled
        src = tmp_path / "a" / f"data{size}.fasta"
        src.parent.mkdir(exist_ok=True)
        src.write_bytes(os.urandom(size))
        dst = tmp_path / "scratch" / "node1" / src.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)  # no -p: a new mtime
        os.utime(dst, ns=(1, 1))
        assert A.file_fingerprint(src) == A.file_fingerprint(dst)
        assert A.file_keys(src) == A.file_keys(dst)  # what the families digest: no path, no mtime
        assert A.file_entries(dst)[0]["path"] == str(dst.resolve())  # still says where to read it


def test_changed_byte_in_a_sampled_block_or_size_changes_fingerprint(tmp_path, small_samples):
    size = 300_000
    data = bytearray(os.urandom(size))
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    before = A.file_fingerprint(path)
    offsets = sampled_offsets(size)
    middle = offsets[len(offsets) // 2] + A.SAMPLE_BLOCK_BYTES // 2
    data[middle] ^= 0xFF
    path.write_bytes(data)
    after = A.file_fingerprint(path)
    assert after != before
    path.write_bytes(data + b"\n")
    assert A.file_fingerprint(path) not in (before, after)

    small = tmp_path / "small.bin"  # hashed whole: any byte counts
    small.write_bytes(b"x" * 1000)
    first = A.file_fingerprint(small)
    small.write_bytes(b"x" * 500 + b"y" + b"x" * 499)
    assert A.file_fingerprint(small) != first


def test_folder_entries_keep_names_and_format_suffix(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "1.cif").write_text("one")
    (tmp_path / "a" / "2.cif").write_text("two")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert A.file_keys(tmp_path / "a") == A.file_keys(tmp_path / "b")
    (tmp_path / "b" / "1.cif").rename(tmp_path / "b" / "3.cif")  # the folder's names are part of its identity
    assert A.file_keys(tmp_path / "a") != A.file_keys(tmp_path / "b")
    (tmp_path / "x.json").write_text("{}")
    (tmp_path / "x.xyz").write_text("{}")  # the same bytes, read as another format
    assert A.file_keys(tmp_path / "x.json") != A.file_keys(tmp_path / "x.xyz")

"""The parts of `benchmarks/stream_engines.py` its figures rest on, in-process on tiny data (no reader processes):
the FASTA split into byte ranges for the parallel conversions, the ranks' interleave into a global order, and the
"ours" reader (same global order at any W, exact resume at another W)."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("stream_engines", ROOT / "benchmarks" / "stream_engines.py")
engines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engines)
from uniref_fasta import write_uniref_fasta  # noqa: E402


def plain_parse(path):
    names, seqs = [], []
    for line in path.read_text().splitlines():
        if line.startswith(">"):
            names.append(line[1:].split()[0])
            seqs.append("")
        else:
            seqs[-1] += line.strip()
    return list(zip(names, seqs))


@pytest.mark.parametrize("parts", [1, 2, 7, 64])
def test_fasta_ranges_cover_every_record_once(tmp_path, parts):
    fasta = tmp_path / "u.fasta"
    write_uniref_fasta(fasta, 300, seed=3)
    want = plain_parse(fasta)
    ranges = engines.fasta_ranges(fasta, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == fasta.stat().st_size
    assert all(a < b for a, b in ranges) and all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
    got = [rec for a, b in ranges for rec in engines.fasta_records(str(fasta), a, b)]
    assert got == want


def test_interleave_deals_one_sample_per_rank():
    got = engines.interleave([np.array([0, 3, 6]), np.array([1, 4, 7]), np.array([2, 5])])
    assert got.tolist() == list(range(8))


def test_record_ids_are_stable_and_distinct():
    ids = [engines.record_id(f"UniRef50_A0A{k:07d}") for k in range(5000)]
    assert len(set(ids)) == 5000 and ids[17] == engines.record_id("UniRef50_A0A0000017")


@pytest.fixture(scope="module")
def arrow_work(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    work = tmp_path_factory.mktemp("engines")
    (work / "arrow").mkdir()
    files = []
    for part in range(2):  # two files, as build_fasta_dataset's shards: the reader concatenates them
        rows = range(part * 301, (part + 1) * 301)
        ds = datasets.Dataset.from_dict({"id": [f"UniRef50_X{k}" for k in rows], "sequence": ["ACD" * (k % 7 + 1)
                                                                                            for k in rows]})
        path = work / "arrow" / f"part{part}.arrow"
        ds.map(lambda x: x, cache_file_name=str(path))
        files.append(str(path))
    (work / "arrow" / "files.json").write_text(json.dumps(files))
    return work


def read_ours(work, world, state=None, batch=64):
    per_rank = [np.array([rid for rid, _ in engines.Reader("ours", work, r, world, {"batch": batch}, state)])
                for r in range(world)]
    return engines.interleave(per_rank)


def test_ours_reads_the_same_global_order_at_any_world_size(arrow_work):
    base = read_ours(arrow_work, 1)
    assert len(base) == 602 and len(np.unique(base)) == 602
    assert not np.array_equal(base, np.sort(base))  # shuffled
    for world in (2, 3, 4):
        assert np.array_equal(read_ours(arrow_work, world, batch=50), base)


def test_ours_resumes_exactly_at_another_world_size(arrow_work):
    base = read_ours(arrow_work, 1)
    reader = engines.Reader("ours", arrow_work, 0, 1, {"batch": 64}, None)
    it = iter(reader)
    for _ in range(504):  # a resume point is whole global batches: 504 divides by every W below
        next(it)
    state = reader.state(504)
    for world in (1, 3, 4):
        assert np.array_equal(read_ours(arrow_work, world, state), base[504:])

"""What a crystal rank holds and maps at start-up, whatever the data set's size: the splits are selected without a
Python object per row, and a shard is one Arrow record batch (each batch costs every rank a mapped header and a
mapped run of pages per column it scans)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import datasets
import numpy as np
import pyarrow as pa
import pytest

from trainer.data.arrow_cache import selected_rows
from trainer.families.crystals import dataset as D
from trainer.families.crystals import shards as S
from trainer.families.crystals import task as T
from trainer.families.crystals.readers import bundled_crystal_path
from trainer.families.crystals.spec import CrystalPropertyConfig

pytest.importorskip("vesin")


@pytest.fixture(scope="module")
def bundled(tmp_path_factory) -> datasets.Dataset:
    return D.build_crystal_dataset(bundled_crystal_path("mlearn_Si_training"), per_atom=True,
                                   cache_dir=tmp_path_factory.mktemp("cache"))


def test_select_rows_equals_select(bundled):
    """The same rows in the same order as `Dataset.select`, a selection of a selection composed, the format kept."""
    n = len(bundled)
    rows = np.array([5, 0, 17, 3, 3, n - 1, 42])
    inner = bundled.select(list(range(n - 1, -1, -2)))
    for base in (bundled, inner, bundled.with_format("numpy", columns=["id", "target"])):
        want = base.select(rows[rows < len(base)].tolist())
        got = D.select_rows(base, rows[rows < len(base)])
        assert np.array_equal(selected_rows(got), selected_rows(want))
        assert got["id"] == want["id"]
        assert got.format == want.format
        assert got._fingerprint != base._fingerprint
    assert len(D.select_rows(bundled, np.zeros(0, np.int64))) == 0
    a, b = D.select_rows(bundled, [1, 2]), D.select_rows(bundled, [2, 1])
    assert a._fingerprint != b._fingerprint  # a derived dataset must not reuse the other order's caches
    run = D.select_rows(bundled, np.arange(10, 20))  # a contiguous run is a slice, as `select` makes it
    assert selected_rows(run) is None and run["id"] == bundled.select(range(10, 20))["id"]
    assert D.select_rows(inner, np.arange(3, 9))["id"] == inner.select(range(3, 9))["id"]


def test_select_rows_refuses_bad_rows(bundled):
    with pytest.raises(IndexError, match="out of range"):
        D.select_rows(bundled, [0, len(bundled)])
    with pytest.raises(IndexError, match="out of range"):
        D.select_rows(bundled, [-1])
    with pytest.raises(TypeError, match="integers"):
        D.select_rows(bundled, np.array([0.5]))


def test_task_splits_make_no_python_list_of_rows(tmp_path, monkeypatch):
    """The task selects its splits from the row-number arrays directly: `datasets`' select (a Python int per row
    of the split, on every rank at every start) is never called, and the splits are the ones it gave."""
    cfg = CrystalPropertyConfig(name="crystal_property", cache_dir=str(tmp_path), val_fraction=0.1)
    full = D.build_crystal_dataset(bundled_crystal_path("mlearn_Si_training"), target="energy", per_atom=True,
                                   cache_dir=tmp_path, split_key=0)
    parts = T._split_rows(full, {"train": 0.9, "validation": 0.1, "test": 0.0}, key=0)

    def refuse(*a, **k):
        raise AssertionError("datasets.Dataset.select's indices mapping was built")

    monkeypatch.setattr(datasets.Dataset, "_select_with_indices_mapping", refuse)
    data = T.CrystalPropertyTask(cfg, seed=0).build_data()
    assert np.array_equal(selected_rows(data.train.dataset), parts["train"])
    assert np.array_equal(selected_rows(data.eval.dataset), parts["validation"])


def test_a_shard_is_one_record_batch(tmp_path, monkeypatch):
    """A shard of more structures than the old 256-row batches is written as one Arrow record batch, unless its
    graphs outgrow the batch's byte bound."""
    from ase.build import bulk

    rng = np.random.default_rng(0)
    frames = []
    for k in range(300):
        atoms = bulk("Si", "diamond", a=5.43)
        atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
        atoms.info["energy"] = float(rng.normal(-3.0, 1.0))
        atoms.info["name"] = f"s{k}"
        frames.append(atoms)
    ds = D.build_crystal_dataset(frames, cache_dir=tmp_path)
    shards = sorted(tmp_path.rglob("*.arrow"))
    assert len(ds) == 300 and len(shards) == 1
    with pa.memory_map(str(shards[0])) as source:
        batches = list(pa.ipc.open_stream(source))
    assert [b.num_rows for b in batches] == [300]
    # Dense graphs of large cells: a batch is written once its graphs reach ARROW_BATCH_BYTES; the same rows.
    monkeypatch.setattr(S, "ARROW_BATCH_BYTES", 50_000)
    cut = D.build_crystal_dataset(frames, cache_dir=tmp_path / "cut")
    with pa.memory_map(str(sorted((tmp_path / "cut").rglob("*.arrow"))[0])) as source:
        sizes = [b.num_rows for b in pa.ipc.open_stream(source)]
    assert len(sizes) > 1 and sum(sizes) == 300 and cut["id"] == ds["id"] and cut["edge_src"] == ds["edge_src"]


def test_statistics_computed_once_per_cache(tmp_path, monkeypatch):
    """The target statistics and element baseline (a scan of every training row) are computed by the first start
    and read back, exactly, by the next ones; another seed gets its own; a damaged file is recomputed."""
    cfg = CrystalPropertyConfig(name="crystal_property", cache_dir=str(tmp_path), val_fraction=0.1)
    first = T.CrystalPropertyTask(cfg, seed=0).build_data().stats
    stored = sorted(tmp_path.rglob("*.stats-*.json"))
    assert len(stored) == 1

    def refuse(*a, **k):
        raise AssertionError("statistics recomputed")

    with monkeypatch.context() as m:
        m.setattr(T, "fit_element_baseline", refuse)
        assert T.CrystalPropertyTask(cfg, seed=0).build_data().stats == first
        with pytest.raises(AssertionError, match="recomputed"):
            T.CrystalPropertyTask(cfg, seed=1).build_data()
    stored[0].write_text('{"key": ')
    assert T.CrystalPropertyTask(cfg, seed=0).build_data().stats == first
    other = T.CrystalPropertyTask(CrystalPropertyConfig(name="crystal_property", cache_dir=str(tmp_path),
                                                        val_fraction=0.3), seed=0).build_data().stats
    assert other["target_mean"] != first["target_mean"]


@contextlib.contextmanager
def arrow_peak() -> Iterator[pa.MemoryPool]:
    """Arrow's allocations inside the block, counted by a pool of their own (its `max_memory` is their peak)."""
    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)
    pa.set_memory_pool(pool)
    try:
        yield pool
    finally:
        pa.set_memory_pool(default)


def test_a_rank_keeps_four_bytes_a_row_of_split_rows(tmp_path):
    """The splits' row numbers, which a rank keeps for the run (in the selections' indices), are 4-byte ints, and
    are the rows the id-hash rule gives from the ids themselves."""
    cfg = CrystalPropertyConfig(name="crystal_property", cache_dir=str(tmp_path), val_fraction=0.1)
    full = D.build_crystal_dataset(bundled_crystal_path("mlearn_Si_training"), target="energy", per_atom=True,
                                   cache_dir=tmp_path, split_key=0)
    fractions = {"train": 0.8, "validation": 0.1, "test": 0.1}
    parts = T._split_rows(full, fractions, key=0)
    by_ids = T.split_indices(full["id"], fractions, key=0)
    for name in fractions:
        assert parts[name].dtype == np.int32 and np.array_equal(parts[name], by_ids[name]), name
    data = T.CrystalPropertyTask(cfg, seed=0).build_data()
    for split in (data.train, data.eval):  # the bundled data's test set is its own file: no selection
        rows = selected_rows(split.dataset)
        assert rows.dtype == np.uint32 and rows.size == len(split)


def test_select_rows_keeps_the_callers_rows_and_its_fingerprint(bundled):
    """Narrow: int32 rows become uint32 indices without a copy; the fingerprint is the one of the same rows as int64
    whatever their type (derived caches keep their names); `datasets`' operations work on the narrower indices, and
    the default (uint64) selection still concatenates."""
    import hashlib
    import pickle

    rows32 = np.array([7, 1, 30, 2, 2, 11], dtype=np.int32)
    got = D.select_rows(bundled, rows32, narrow=True)
    assert selected_rows(got).dtype == np.uint32 and np.shares_memory(selected_rows(got), rows32)
    wide = D.select_rows(bundled, rows32.astype(np.int64))
    assert selected_rows(wide).dtype == np.uint64 and wide._fingerprint == got._fingerprint
    h = hashlib.blake2b(str(bundled._fingerprint).encode(), digest_size=16)
    h.update(memoryview(rows32.astype(np.int64)))
    assert got._fingerprint == h.hexdigest()
    ids = bundled["id"]
    want = [ids[i] for i in [7, 1, 30, 2, 2, 11]]
    assert got["id"] == want and wide["id"] == want
    assert got.select([5, 0])["id"] == [ids[11], ids[7]]
    assert D.select_rows(got, np.array([5, 0], dtype=np.int32), narrow=True)["id"] == [ids[11], ids[7]]
    assert sorted(got.shuffle(seed=0)["id"]) == sorted(want)
    assert got.flatten_indices()["id"] == want == pickle.loads(pickle.dumps(got))["id"]
    other = D.select_rows(bundled, np.array([3, 0]))
    assert datasets.concatenate_datasets([wide, other])["id"] == want + [ids[3], ids[0]]


def test_unit_sizes_and_targets_are_gathered_without_an_arrow_copy_of_the_column():
    """The batch sampler's sizes and the statistics' targets, read in a selection's order across chunks (shards),
    equal the columns' values (`column_array`) and allocate nothing in Arrow (no concatenated copy of the whole
    column, no take)."""
    from datasets.table import InMemoryTable

    from trainer.data.arrow_cache import column_array

    rng = np.random.default_rng(0)
    values = rng.integers(1, 200, 10_000).astype(np.int32)
    targets = rng.normal(size=(10_000, 2))
    table = pa.Table.from_batches([
        pa.record_batch([pa.array(values[lo:lo + 1000]),
                         pa.FixedSizeListArray.from_arrays(pa.array(targets[lo:lo + 1000].reshape(-1)), 2)],
                        names=["num_atoms", "target"]) for lo in range(0, 10_000, 1000)])
    ds = datasets.Dataset(InMemoryTable(table))
    rows = np.random.default_rng(1).permutation(10_000)[:7000].astype(np.int32)
    sel = D.select_rows(ds, rows, narrow=True)
    with arrow_peak() as pool:
        sizes, got = D.atom_counts(sel), D.column_rows(sel, "target")
    assert pool.max_memory() == 0
    assert sizes.dtype == np.int32 and np.array_equal(sizes, values[rows])
    assert np.array_equal(got, targets[rows]) and np.array_equal(got, column_array(sel, "target"))
    assert np.array_equal(D.atom_counts(ds), values) and np.array_equal(D.column_rows(ds, "target"), targets)


def test_report_ids_are_read_from_the_chunks_holding_them():
    """The test report's ids (a few rows' of a string column): the same as the whole column read, and no Arrow copy
    of the whole column (its chunks concatenated) on the way."""
    from datasets.table import InMemoryTable

    ids = [f"structure-{k:07d}" for k in range(20_000)]
    table = pa.Table.from_batches([pa.record_batch([pa.array(ids[lo:lo + 4000])], names=["id"])
                                   for lo in range(0, 20_000, 4000)])
    sel = D.select_rows(datasets.Dataset(InMemoryTable(table)), np.arange(19_999, -1, -3), narrow=True)
    positions = [0, 5, 6665, 3000, 5]
    with arrow_peak() as pool:
        got = D.strings_at(D.CrystalRows(sel), "id", positions)
    assert pool.max_memory() < 4096  # the whole column is ~0.4 MiB
    assert got == [sel["id"][p] for p in positions]

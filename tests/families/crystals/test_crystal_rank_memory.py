"""What a crystal rank holds and maps at start-up, whatever the data set's size: the splits are selected without a
Python object per row, and a shard is one Arrow record batch (each batch costs every rank a mapped header and a
mapped run of pages per column it scans)."""

from __future__ import annotations

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

"""Whole-column reads of `datasets` columns (`column_array`, `ListColumn`): the same values as reading the
column through `datasets`, in the dataset's row order under any selection, without one read per row."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
from datasets import arrow_dataset

from trainer.data.arrow_cache import ListColumn, column_array

FEATURES = datasets.Features({"id": datasets.Value("string"), "length": datasets.Value("int32"),
                              "ids": datasets.List(datasets.Value("int8")),
                              "target": datasets.List(datasets.Value("float32"), length=2)})


def _part(start: int, n: int) -> datasets.Dataset:
    rng = np.random.default_rng(start)
    lengths = rng.integers(0, 7, n)
    return datasets.Dataset.from_dict(
        {"id": [f"r{start + i}" for i in range(n)], "length": lengths.tolist(),
         "ids": [rng.integers(0, 30, k).astype(np.int8).tolist() for k in lengths],
         "target": rng.normal(size=(n, 2)).astype(np.float32).tolist()}, features=FEATURES)


def _variants(tmp_path) -> dict[str, datasets.Dataset]:
    # several Arrow chunks (concatenated parts), a memory-mapped file, and every kind of selection
    ds = datasets.concatenate_datasets([_part(0, 9), _part(9, 1), _part(10, 14)])
    ds.save_to_disk(str(tmp_path / "ds"), max_shard_size="1MB")
    mapped = datasets.load_from_disk(str(tmp_path / "ds"))
    return {"whole": ds, "mapped": mapped, "picked": ds.select([5, 1, 1, 20, 0, 23]),
            "shuffled": mapped.shuffle(seed=3), "contiguous": ds.select(range(7, 15)),
            "filtered": ds.filter(lambda r: r["length"] % 2 == 0), "shuffled_then_cut": ds.shuffle(seed=1).select(range(5)),
            "empty_selection": ds.select([]), "cut_then_shuffled": mapped.select(range(7, 20)).shuffle(seed=4)}


@pytest.mark.parametrize("name", ["whole", "mapped", "picked", "shuffled", "contiguous", "filtered",
                                  "shuffled_then_cut", "empty_selection",
                                  "cut_then_shuffled"])
def test_whole_column_reads_equal_the_row_by_row_ones(tmp_path, name):
    ds = _variants(tmp_path)[name]
    rows = [ds[i] for i in range(len(ds))]  # the old way, one row at a time
    assert column_array(ds, "length").tolist() == [r["length"] for r in rows]
    assert column_array(ds, "id").tolist() == [r["id"] for r in rows]
    target = column_array(ds, "target")
    assert target.shape == (len(ds), 2) and np.array_equal(target, np.array([r["target"] for r in rows], np.float32)
                                                           .reshape(len(ds), 2))
    col = ListColumn(ds, "ids")
    assert len(col) == len(ds)
    assert col.lengths().tolist() == [len(r["ids"]) for r in rows]
    for i, r in enumerate(rows):
        assert col[i].dtype == np.int8 and col[i].tolist() == r["ids"]
    assert col.flat().tolist() == [v for r in rows for v in r["ids"]]
    want = np.bincount(np.array([v for r in rows for v in r["ids"]], dtype=np.int64), minlength=40)
    assert np.array_equal(col.bincount(40), want)


def test_whole_column_reads_do_not_read_row_by_row(tmp_path, monkeypatch):
    ds = _variants(tmp_path)["shuffled"]
    calls = []
    real = arrow_dataset.format_table  # what formats each row read through `datasets` (indexing, iterating)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(arrow_dataset, "format_table", counting)
    old = np.asarray(ds["length"])  # the patterns replaced: a lazy column read one row at a time
    assert len(calls) >= len(ds)  # the counter sees the row-by-row reads
    calls.clear()
    assert [str(i) for i in datasets.load_from_disk(str(tmp_path / "ds"))["id"]]
    assert len(calls) >= len(ds)
    calls.clear()
    assert np.array_equal(column_array(ds, "length"), old)
    col = ListColumn(ds, "ids")
    col.lengths(), col.flat(), col.bincount(30), col[0]
    assert calls == []


def test_column_array_names_a_ragged_column(tmp_path):
    with pytest.raises(TypeError, match="'ids'.*ListColumn"):
        column_array(_part(0, 3), "ids")
    with pytest.raises(TypeError, match="'length'.*not a list"):
        ListColumn(_part(0, 3), "length")

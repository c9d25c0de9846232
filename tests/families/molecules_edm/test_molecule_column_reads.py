"""The molecules task splits by ids read as one Arrow column, not one row at a time."""

from __future__ import annotations

import pytest
from datasets import arrow_dataset

pytest.importorskip("rdkit")

from trainer.data.splits import split_indices  # noqa: E402
from trainer.families.molecules_edm.dataset import build_molecule_dataset  # noqa: E402
from trainer.families.molecules_edm.readers import bundled_qm9_path  # noqa: E402
from trainer.families.molecules_edm.spec import MoleculesEDMConfig  # noqa: E402
from trainer.families.molecules_edm.task import MoleculesEDMTask  # noqa: E402


def test_build_data_reads_no_column_row_by_row(tmp_path, monkeypatch):
    task = MoleculesEDMTask(MoleculesEDMConfig(cache_dir=str(tmp_path)), seed=0)
    task.build_data()  # builds the cache
    reads = []
    real = arrow_dataset.format_table  # what formats each row read through `datasets` (indexing, iterating)

    def counting(*args, **kwargs):
        reads.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(arrow_dataset, "format_table", counting)
    data = task.build_data()
    assert len(reads) < 10  # a few whole-column reads at most, never one per molecule
    monkeypatch.setattr(arrow_dataset, "format_table", real)
    full = build_molecule_dataset(str(bundled_qm9_path()), task.elements, cache_dir=str(tmp_path))
    ids = [str(i) for i in full["id"]]  # the row-by-row read this replaced
    parts = split_indices(ids, {"train": 0.8, "validation": 0.1, "test": 0.1}, key=0)
    for name, rows in (("train", data.train), ("validation", data.eval), ("test", data.test)):
        assert list(rows.dataset["id"]) == [ids[k] for k in parts[name]]


def test_splits_are_selected_without_a_python_list_of_rows(tmp_path, monkeypatch):
    """The splits come from the row-number arrays directly (`select_rows`): `datasets`' select, which makes a Python
    int per row of the split on every rank at every start, is never called; the rows are the ones it gave."""
    task = MoleculesEDMTask(MoleculesEDMConfig(cache_dir=str(tmp_path)), seed=0)
    want = task.build_data()

    def refuse(*a, **k):
        raise AssertionError("datasets.Dataset.select's indices mapping was built")

    monkeypatch.setattr(arrow_dataset.Dataset, "_select_with_indices_mapping", refuse)
    got = task.build_data()
    for a, b in ((got.train, want.train), (got.eval, want.eval), (got.test, want.test)):
        assert a.dataset["id"] == b.dataset["id"]

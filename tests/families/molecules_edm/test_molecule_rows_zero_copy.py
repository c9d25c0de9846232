"""`MoleculeRows` reads atoms, ids and properties through views of the memory-mapped Arrow cache: a rank or a
DataLoader worker holds no per-molecule copy, and the rows are the same as a full decode of the columns."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

pytest.importorskip("rdkit")

from trainer.families.molecules_edm.dataset import (  # noqa: E402
    MoleculeRows,
    build_molecule_dataset,
    split_molecule_dataset,
)
from trainer.families.molecules_edm.readers import bundled_qm9_path  # noqa: E402


def _owned_bytes(obj: object, seen: set[int] | None = None) -> int:
    """Bytes of the numpy arrays that `obj` (a nested container) owns: what a process would hold per copy."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return obj.nbytes if obj.flags.owndata else 0
    if isinstance(obj, dict):
        return sum(_owned_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_owned_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return _owned_bytes(vars(obj), seen)
    return 0


@pytest.fixture(scope="module")
def qm9(tmp_path_factory):
    return build_molecule_dataset(str(bundled_qm9_path()), cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_rows_hold_no_copy_of_the_atoms(qm9):
    parts = split_molecule_dataset(qm9, seed=0)
    for ds in (qm9, parts["train"]):
        rows = MoleculeRows(ds)
        row = rows[len(rows) // 2]
        atoms = int(rows.num_atoms.sum())
        # numbers (1 byte) and positions (12 bytes) per atom, ids per molecule: none of it copied into the process
        assert _owned_bytes(rows._cache) < atoms  # far below one byte per atom
        assert not isinstance(rows._cache.get("ids"), list)  # no Python string per molecule
        assert not row["positions"].flags.writeable  # a view of the (read-only) mapped buffer
        assert row["positions"].dtype == np.float32 and row["numbers"].dtype == np.int64


def test_rows_equal_a_full_decode_through_a_selection(qm9):
    parts = split_molecule_dataset(qm9, seed=3)
    train = parts["train"]
    rows = MoleculeRows(train, properties=("U0_Ha",) if "U0_Ha" in train.column_names else ())
    decoded = train.with_format("numpy")
    for k in (0, 1, len(rows) // 2, len(rows) - 1, -1):
        row, ref = rows[k], decoded[k]
        assert row["id"] == str(ref["id"])
        np.testing.assert_array_equal(row["numbers"], np.asarray(ref["numbers"], dtype=np.int64))
        np.testing.assert_array_equal(row["positions"], np.stack(ref["positions"]).astype(np.float32))
        assert row["num_atoms"] == len(row["numbers"]) == int(ref["num_atoms"])
        for p in rows.properties:
            assert row[p] == pytest.approx(float(ref[p]))
    with pytest.raises(IndexError):
        rows[len(rows)]
    again = pickle.loads(pickle.dumps(rows))  # a worker rebuilds its views from the dataset
    assert again._cache is None and again[5]["id"] == rows[5]["id"]
    np.testing.assert_array_equal(again[5]["positions"], rows[5]["positions"])


def test_smiles_are_perceived_in_a_pool_and_equal_serial(tmp_path, monkeypatch):
    import multiprocessing

    serial = build_molecule_dataset(str(bundled_qm9_path()), cache_dir=str(tmp_path / "a"), num_proc=1)
    contexts = []
    real = multiprocessing.get_context
    monkeypatch.setattr(multiprocessing, "get_context", lambda *a: contexts.append(a) or real(*a))
    pooled = build_molecule_dataset(str(bundled_qm9_path()), cache_dir=str(tmp_path / "b"), num_proc=2)
    assert ("spawn",) in contexts and not pooled.cache_hit
    assert serial.with_format(None).data.equals(pooled.with_format(None).data)


def test_smiles_pool_task_lives_in_a_module_without_torch(tmp_path, monkeypatch):
    """A spawned worker imports its task's module: the build's task (parse, validate, perceive SMILES, write a
    shard) must not import torch (seconds of each worker's start, in the build's parallel part)."""
    import subprocess
    import sys

    from trainer.families.molecules_edm import dataset as dataset_module

    tasks = []
    real = dataset_module.build_shards

    def recording(jobs, *args, **kwargs):
        def seen(jobs):
            for job in jobs:
                tasks.append(job[0])
                yield job
        return real(seen(jobs), 1, **kwargs)  # inline: only the task's module matters here

    monkeypatch.setattr(dataset_module, "build_shards", recording)
    build_molecule_dataset(str(bundled_qm9_path()), cache_dir=str(tmp_path), num_proc=2, compute_smiles=False)
    assert tasks
    code = (f"import importlib, sys; importlib.import_module({tasks[0].__module__!r}); "
            f"getattr(sys.modules[{tasks[0].__module__!r}], {tasks[0].__name__!r}); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

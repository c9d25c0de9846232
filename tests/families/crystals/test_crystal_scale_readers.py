"""Crystals at full-data-set size, the readers' side: ASE databases read by ranges of row ids (no list of every
id per reader; corrupt rows skipped or named), mlearn JSON streamed into pieces (the parent never holds the
file), and the split hashes computed once by the build and read as a column."""

from __future__ import annotations

import gzip
import json
import sqlite3
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from trainer.data.splits import id_hashes, split_indices
from trainer.families.crystals import dataset as D
from trainer.families.crystals import readers as R
from trainer.families.crystals import task as T
from trainer.families.crystals.dataset import build_crystal_dataset
from trainer.families.crystals.graphs import GraphSpec
from trainer.families.crystals.readers import CrystalDataError, TargetSpec, bundled_crystal_path, iter_crystals

pytest.importorskip("ase")
pytest.importorskip("vesin")
import ase.db  # noqa: E402
import ase.io  # noqa: E402
from ase.build import bulk  # noqa: E402

SPEC = GraphSpec(k=8)


def _frames(n: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        atoms = bulk("NaCl", "rocksalt", a=5.6) if k % 2 else bulk("Si", "diamond", a=5.43)
        atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
        atoms.info["energy"] = float(rng.normal(-3.0, 1.0))
        out.append(atoms)
    return out


def _db(path: Path, n: int, delete: tuple[int, ...] = ()) -> Path:
    """An ASE database (`.aselmdb` or SQLite `.db` by the suffix) of `n` rows with `energy_t`, less the rows
    `delete` (by id: the ids of the file then have gaps)."""
    db = ase.db.connect(str(path), type="aselmdb" if path.suffix == ".aselmdb" else "db")
    for k, atoms in enumerate(_frames(n)):
        db.write(atoms, energy_t=atoms.info["energy"], name=f"s{k}")
    if delete:
        db.delete(list(delete))
    if hasattr(db, "close"):
        db.close()
    return path


def _expected(path: Path) -> list[tuple[int, float]]:
    """(row id, energy_t) of every row, read through ASE's own select."""
    lmdb_file = path.suffix == ".aselmdb"
    db = ase.db.connect(str(path), type="aselmdb", readonly=True) if lmdb_file else ase.db.connect(str(path))
    out = [(row.id, row.key_value_pairs["energy_t"]) for row in db.select()]
    if hasattr(db, "close"):
        db.close()
    return out


def _corrupt_row(path: Path, row_id: int) -> None:
    if path.suffix == ".aselmdb":
        import lmdb

        env = lmdb.open(str(path), subdir=False)
        with env.begin(write=True) as txn:
            txn.put(str(row_id).encode(), b"not a zlib stream")
        env.close()
    else:
        con = sqlite3.connect(str(path))
        con.execute("UPDATE systems SET positions = X'0001' WHERE id = ?", (row_id,))
        con.commit()
        con.close()


# --- ASE databases by ranges of row ids ---------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".aselmdb", ".db"])
def test_ase_db_read_by_id_ranges(tmp_path, monkeypatch, suffix):
    """Pieces of 2 rows over ids with gaps (deleted rows): the rows, positions and ids ASE's own select gives,
    while the backends' whole-table paths fail: `LMDBDatabase` (its constructor lists every id) and the SQLite
    `select` (an OFFSET scan per piece) are never used."""
    path = _db(tmp_path / f"set{suffix}", 9, delete=(2, 5, 6))
    expected = _expected(path)
    assert [i for i, _ in expected] == [1, 3, 4, 7, 8, 9]

    def refuse(*args, **kwargs):
        raise AssertionError("listed every row")

    from ase.db.sqlite import SQLite3Database
    from ase_db_backends.aselmdb import LMDBDatabase

    monkeypatch.setattr(LMDBDatabase, "_load_ids", refuse)
    monkeypatch.setattr(SQLite3Database, "_select", refuse)
    chunks = list(R.iter_chunks([path], 2))
    assert [c.start for c in chunks] == [0, 2, 4]
    recs = list(iter_crystals(path, target="energy_t"))
    assert [(r["index"], r["id"]) for r in recs] == [(k, f"{tmp_path.name}/set{suffix}#{i}")
                                                       for k, (i, _) in enumerate(expected)]
    assert np.allclose([r["target"] for r in recs], [e for _, e in expected])
    monkeypatch.setattr(D, "SHARD_RECORDS", 2)
    ds = build_crystal_dataset(path, graph=SPEC, target="energy_t", id_key="name", cache_dir=tmp_path / "c")
    assert ds["id"] == ["s0", "s2", "s3", "s6", "s7", "s8"]
    assert len(list((tmp_path / "c" / "crystal_graphs").glob("*.arrow"))) == 3


def test_aselmdb_ranges_hold_their_rows_only(tmp_path):
    """Each piece of an `.aselmdb` carries its own id range and only the deleted ids inside it."""
    path = _db(tmp_path / "set.aselmdb", 10, delete=(1, 4, 5, 10))
    chunks = list(R.iter_chunks([path], 3))
    assert [(c.start, c.payload) for c in chunks] == [(0, ("lmdb", 1, 7, [1, 4, 5])), (3, ("lmdb", 7, 10, []))]


def test_a_folder_of_ase_databases_reads_as_its_files(tmp_path):
    """A folder holding `.aselmdb` files and no id_prop.csv (how fairchem ships an OMat24 split) is its database
    files in name order: the records and the graph cache of the list of files; the LMDB lock files beside them
    are not inputs. A folder with neither is one error naming both."""
    folder = tmp_path / "omat"
    folder.mkdir()
    files = [_db(folder / "data.0001.aselmdb", 3), _db(folder / "data.0000.aselmdb", 4)]
    assert sorted(p.name for p in folder.iterdir()) != [p.name for p in R.database_files(folder)]  # the -lock files
    assert R.database_files(folder) == sorted(files)
    by_folder = list(iter_crystals(folder, target="energy_t"))
    by_files = list(iter_crystals(sorted(files), target="energy_t"))
    assert [r["id"] for r in by_folder] == [f"omat/data.0000.aselmdb#{i}" for i in range(1, 5)] + \
        [f"omat/data.0001.aselmdb#{i}" for i in range(1, 4)]
    assert [r["id"] for r in by_files] == [r["id"] for r in by_folder]
    ds = build_crystal_dataset(folder, graph=SPEC, target="energy_t", cache_dir=tmp_path / "c")
    again = build_crystal_dataset(sorted(files), graph=SPEC, target="energy_t", cache_dir=tmp_path / "c")
    assert again.crystal_report.cache_hit and again._fingerprint == ds._fingerprint
    (tmp_path / "empty").mkdir()
    with pytest.raises(CrystalDataError, match=r"no id_prop.csv in the folder, nor ASE database files"):
        list(iter_crystals(tmp_path / "empty"))


@pytest.mark.parametrize("suffix", [".aselmdb", ".db"])
def test_corrupt_ase_row_is_skipped_or_named(tmp_path, suffix):
    """A row that cannot be decoded: an error naming the file, the row (position and id) and the field; under
    on_invalid="skip" a counted skip, the other rows kept."""
    path = _db(tmp_path / f"bad{suffix}", 4)
    _corrupt_row(path, 2)
    with pytest.raises(CrystalDataError) as info:
        build_crystal_dataset(path, graph=SPEC, target="energy_t", cache_dir=tmp_path / "a")
    e = info.value
    assert (e.source, e.index, e.record_id, e.field, e.reason) == (
        str(path), 1, f"{tmp_path.name}/bad{suffix}#2", "row", "unreadable")
    ds = build_crystal_dataset(path, graph=SPEC, target="energy_t", on_invalid="skip", cache_dir=tmp_path / "b")
    assert ds["id"] == [f"{tmp_path.name}/bad{suffix}#{i}" for i in (1, 3, 4)]
    assert ds.crystal_report.skipped == {"unreadable": 1} and ds.crystal_report.records == 4
    skipped: Counter = Counter()
    assert len(list(iter_crystals(path, target="energy_t", on_invalid="skip", skipped=skipped))) == 3
    assert skipped == {"unreadable": 1}


# --- mlearn JSON, streamed ---------------------------------------------------------------------------------------


def test_mlearn_json_is_streamed(tmp_path, monkeypatch):
    """The parent reads an mlearn file a block at a time and hands on the records' text (never `json.load` of
    the file, never a read of all of it): the same records as parsing the whole list."""
    src = bundled_crystal_path("mlearn_Si_test")
    with gzip.open(src, "rt") as f:
        data = json.load(f)
    spec = TargetSpec(("energy",), "sum", False, ("forces",))
    whole = list(R._iter_mlearn(src, spec, True, json.dumps(data), 0))
    reads: list[int] = []
    real_open = R._open_text

    class Spy:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            reads.append(n)
            return self.f.read(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def refuse(*args, **kwargs):
        raise AssertionError("the whole file parsed at once")

    monkeypatch.setattr(R, "_open_text", lambda path: Spy(real_open(path)))
    monkeypatch.setattr(R.json, "load", refuse)
    monkeypatch.setattr(R, "MLEARN_READ_CHARS", 4096, raising=False)
    chunks = list(R.iter_chunks([src], 5))
    assert len(chunks) == -(-len(data) // 5) and [c.start for c in chunks[:3]] == [0, 5, 10]
    assert reads and all(0 < n <= 4096 for n in reads)
    streamed = [r for c in chunks for r in R.read_chunk(c, spec)]
    assert len(streamed) == len(whole)
    for a, b in zip(streamed, whole):
        assert a["id"] == b["id"] and a["index"] == b["index"] and a["target"] == b["target"]
        assert np.array_equal(a["positions"], b["positions"]) and np.array_equal(a["atom_forces"], b["atom_forces"])


def test_mlearn_broken_record_is_named(tmp_path, monkeypatch):
    with gzip.open(bundled_crystal_path("mlearn_Si_test"), "rt") as f:
        data = json.load(f)[:4]
    text = json.dumps(data)
    path = tmp_path / "broken.json"
    cut = text.index(json.dumps(data[3])[:200])  # record 3, cut in the middle
    path.write_text(text[:cut + 100])
    monkeypatch.setattr(R, "MLEARN_READ_CHARS", 1000, raising=False)
    with pytest.raises(CrystalDataError) as info:
        list(iter_crystals(path, on_invalid="skip"))
    assert (info.value.source, info.value.index, info.value.field, info.value.reason) == (
        str(path), 3, "file", "unreadable")
    path.write_text('{"not": "a list"}')
    with pytest.raises(CrystalDataError, match="expected a JSON list"):
        list(iter_crystals(path))
    for extra in (text + text, json.dumps([]) + "[1]"):  # two lists appended: json.load refuses, so do we
        path.write_text(extra)
        with pytest.raises(CrystalDataError, match="extra data after the list"):
            list(iter_crystals(path, on_invalid="skip"))
    path.write_text(text + "\n  ")
    assert len(list(iter_crystals(path))) == 4


# --- split hashes computed once ----------------------------------------------------------------------------------


def test_split_hashes_stored_by_the_build(tmp_path, monkeypatch):
    """The build's workers hash the ids under the split key once and store them; a later load and the task's
    split read them (no id hashed again) and give the same split membership as hashing the ids."""
    src = bundled_crystal_path("mlearn_Si_training")
    monkeypatch.setattr(D, "SHARD_RECORDS", 50)
    ds = build_crystal_dataset(src, graph=SPEC, per_atom=True, cache_dir=tmp_path, split_key=3)
    ids = ds["id"]
    assert np.array_equal(ds.split_hashes, id_hashes(ids, 3))
    fractions = {"train": 0.8, "validation": 0.1, "test": 0.1}
    whole = split_indices(ids, fractions, key=3)

    def refuse(*args, **kwargs):
        raise AssertionError("ids hashed again")

    monkeypatch.setattr(D, "id_hashes", refuse)
    monkeypatch.setattr(T, "split_indices", refuse)
    again = build_crystal_dataset(src, graph=SPEC, per_atom=True, cache_dir=tmp_path, split_key=3)
    assert again.crystal_report.cache_hit and isinstance(again.split_hashes, np.memmap)
    parts = T._split_rows(again, fractions, key=3)
    assert list(parts) == list(whole) and all(np.array_equal(parts[k], whole[k]) for k in whole)
    monkeypatch.undo()
    # another key on the cached graphs: hashed once from the id column, then read
    other = build_crystal_dataset(src, graph=SPEC, per_atom=True, cache_dir=tmp_path, split_key=4)
    assert other.crystal_report.cache_hit and np.array_equal(other.split_hashes, id_hashes(ids, 4))
    parts = T._split_rows(other, fractions, key=4)
    assert all(np.array_equal(parts[k], v) for k, v in split_indices(ids, fractions, key=4).items())


def test_split_hashes_follow_rows_dropped_as_duplicates(tmp_path, monkeypatch):
    frames = _frames(8)
    for k, atoms in enumerate(frames):
        atoms.info["name"] = "s1" if k == 6 else f"s{k}"  # repeats frame 1's id, in another piece
    path = tmp_path / "dup.extxyz"
    ase.io.write(str(path), frames, format="extxyz")
    monkeypatch.setattr(D, "SHARD_RECORDS", 3)
    ds = build_crystal_dataset(path, graph=SPEC, cache_dir=tmp_path, id_key="name", on_invalid="skip", split_key=0)
    assert ds["id"] == ["s0", "s1", "s2", "s3", "s4", "s5", "s7"]
    assert np.array_equal(ds.split_hashes, id_hashes(ds["id"], 0))



def test_task_splits_from_the_stored_hashes(tmp_path, monkeypatch):
    """The crystal_property task on the bundled set: its train / validation rows are the id-hash rule's,
    assigned from the hashes the build stored (the ids are not hashed again in the task)."""
    from trainer.config import load_config
    from trainer.registry import get_task

    root = Path(__file__).resolve().parents[3]
    cfg = load_config(str(root / "configs" / "crystals" / "comformer_tiny.yaml"),
                      [f"task.cache_dir={tmp_path}", "task.val_fraction=0.1"])
    task = get_task(cfg.task.name)(cfg.task, seed=5)
    full = build_crystal_dataset(bundled_crystal_path("mlearn_Si_training"), graph=GraphSpec(k=12), per_atom=True,
                                 cache_dir=tmp_path / "ref")
    ids = full["id"]
    # the bundled test file is the test split: no share of the training file held out for it
    expected = split_indices(ids, {"train": 0.9, "validation": 0.1, "test": 0.0}, key=5)

    def refuse(*args, **kwargs):
        raise AssertionError("ids hashed in the task")

    monkeypatch.setattr(T, "split_indices", refuse)
    data = task.build_data()
    assert data.train.dataset["id"] == [ids[k] for k in expected["train"]]
    assert data.eval.dataset["id"] == [ids[k] for k in expected["validation"]]
    assert len(expected["test"]) == 0 and len(data.test.dataset) == 25


def test_aselmdb_header_read_without_ase_db(tmp_path):
    """The parent reads `nextid` / `deleted_ids` as ase-db-backends wrote them (JSON, a list or ASE's numpy form)
    with zlib and json only: cutting an `.aselmdb` imports none of ASE's database modules."""
    import subprocess
    import sys

    from ase.io.jsonio import encode

    class Txn:
        def __init__(self, values):
            self.values = {k.encode(): zlib.compress(encode(v).encode()) for k, v in values.items()}

        def get(self, key):
            return self.values.get(key)

    txn = Txn({"nextid": 12, "deleted_ids": np.array([3, 7]), "other": [1, 2]})
    assert R._lmdb_header(txn, "nextid") == 12 and R._lmdb_header(txn, "deleted_ids") == [3, 7]
    assert R._lmdb_header(txn, "other") == [1, 2] and R._lmdb_header(txn, "missing") is None
    path = _db(tmp_path / "set.aselmdb", 5, delete=(2,))
    code = ("import sys; from pathlib import Path; from trainer.families.crystals.readers import iter_chunks; "
            f"c = list(iter_chunks([Path({str(path)!r})], 2)); "
            "print(len(c), sorted(m for m in sys.modules if m.startswith('ase.db') or m.startswith('ase_db')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2", "[]"]

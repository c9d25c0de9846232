"""Crystals at full-data-set size: the streamed build (pieces read in workers, never every structure in the
parent), ids checked across pieces, the ASE database reader (`.aselmdb`, `.db`) and the blocked element baseline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainer.data.arrow_cache import ListColumn, column_array
from trainer.families.crystals import dataset as D
from trainer.families.crystals import readers as R
from trainer.families.crystals import shards as S
from trainer.families.crystals import task as T
from trainer.families.crystals.dataset import build_crystal_dataset
from trainer.families.crystals.graphs import GraphSpec
from trainer.families.crystals.readers import CrystalDataError, bundled_crystal_path, iter_crystals

pytest.importorskip("ase")
pytest.importorskip("vesin")
import ase.db  # noqa: E402
import ase.io  # noqa: E402
from ase.build import bulk  # noqa: E402

SPEC = GraphSpec(k=8)


def _frames(n: int, seed: int = 0) -> list:
    """`n` small periodic structures (rattled rocksalt / diamond cells) with an energy and forces each."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        atoms = bulk("NaCl", "rocksalt", a=5.6) if k % 2 else bulk("Si", "diamond", a=5.43)
        atoms = atoms.repeat((1, 1, 1 + k % 2))
        atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
        atoms.info["energy"] = float(rng.normal(-3.0, 1.0))
        atoms.info["name"] = f"s{k}"
        atoms.arrays["forces"] = rng.normal(0, 0.1, (len(atoms), 3))
        out.append(atoms)
    return out


def _extxyz(path: Path, frames: list) -> Path:
    ase.io.write(str(path), frames, format="extxyz")
    return path


def _aselmdb(path: Path, frames: list, **extra) -> Path:
    db = ase.db.connect(str(path), type="aselmdb")
    for k, atoms in enumerate(frames):
        kvp = {"energy_t": atoms.info["energy"], "name": atoms.info["name"], **{key: v[k] for key, v in extra.items()}}
        db.write(atoms, key_value_pairs=kvp, data={"forces_t": atoms.arrays["forces"]})
    db.close()
    return path


def _rows(ds, cols=("id", "atomic_numbers", "edge_src", "edge_dst", "edge_shift", "target")) -> dict:
    return {c: ds[c] for c in cols}


# --- the streamed build ---------------------------------------------------------------------------------------


def test_parent_never_holds_every_structure(tmp_path, monkeypatch):
    """The first shard is written after only its own piece was parsed: the build reads each piece where its
    graphs are built, never a list of every structure first."""
    path = _extxyz(tmp_path / "set.extxyz", _frames(9))
    monkeypatch.setattr(D, "SHARD_RECORDS", 3)
    parsed, at_first_write = [0], []
    real_record, real_write = R._record, S._write_graph_rows

    def counting_record(*args, **kwargs):
        parsed[0] += 1
        return real_record(*args, **kwargs)

    def spy_write(*args, **kwargs):
        at_first_write.append(parsed[0])
        return real_write(*args, **kwargs)

    monkeypatch.setattr(R, "_record", counting_record)
    monkeypatch.setattr(S, "_write_graph_rows", spy_write)
    ds = build_crystal_dataset(path, graph=SPEC, cache_dir=tmp_path / "c")
    assert len(ds) == 9 and parsed[0] == 9
    assert at_first_write == [3, 6, 9]
    assert len(list((tmp_path / "c" / "crystal_graphs").glob("*.arrow"))) == 3


def test_streamed_build_equals_whole_read(tmp_path, monkeypatch):
    """Pieces of 4 structures, in 2 worker processes: the same rows, in the same order, as one piece in this
    process, and the records `iter_crystals` reads (ids and targets by frame index across the pieces)."""
    frames = _frames(11)
    path = _extxyz(tmp_path / "set.extxyz", frames)
    whole = build_crystal_dataset(path, graph=SPEC, cache_dir=tmp_path / "a")
    monkeypatch.setattr(D, "SHARD_RECORDS", 4)
    pieces = build_crystal_dataset(path, graph=SPEC, cache_dir=tmp_path / "b", num_proc=2)
    assert len(list((tmp_path / "b" / "crystal_graphs").glob("*.arrow"))) == 3
    assert _rows(whole) == _rows(pieces)
    records = list(iter_crystals(path))
    assert pieces["id"] == [r["id"] for r in records] == [f"{tmp_path.name}/set.extxyz#{k}" for k in range(11)]
    assert np.allclose(pieces["target"], [f.info["energy"] for f in frames])
    again = build_crystal_dataset(path, graph=SPEC, cache_dir=tmp_path / "b", num_proc=2)
    assert again.crystal_report.cache_hit and _rows(again) == _rows(pieces)


def test_malformed_frame_in_a_later_piece_is_named(tmp_path, monkeypatch):
    path = _extxyz(tmp_path / "set.extxyz", _frames(7))
    lines = path.read_text().splitlines(keepends=True)
    # frame 5's first line: not an atom count
    starts = []
    k = 0
    while k < len(lines):
        starts.append(k)
        k += int(lines[k]) + 2
    lines[starts[5]] = "garbage\n"
    path.write_text("".join(lines))
    monkeypatch.setattr(D, "SHARD_RECORDS", 2)
    with pytest.raises(CrystalDataError) as info:
        build_crystal_dataset(path, graph=SPEC, cache_dir=tmp_path / "c", on_invalid="skip")
    assert (info.value.index, info.value.reason, info.value.source) == (5, "unreadable", str(path))
    assert not list((tmp_path / "c" / "crystal_graphs").glob("*.arrow"))


def test_duplicate_ids_across_pieces(tmp_path, monkeypatch):
    """Ids are checked across pieces too: an error naming the id, or (skip) the later record dropped and
    counted, the same rows as a serial read with its one set of seen ids."""
    frames = _frames(8)
    frames[6].info["name"] = "s1"  # repeats frame 1's id, in another piece
    path = _extxyz(tmp_path / "dup.extxyz", frames)
    monkeypatch.setattr(D, "SHARD_RECORDS", 3)
    with pytest.raises(CrystalDataError, match="duplicate_id") as info:
        build_crystal_dataset(path, graph=SPEC, cache_dir=tmp_path / "c", id_key="name")
    assert info.value.record_id == "s1" and info.value.source == str(path)
    assert not list((tmp_path / "c" / "crystal_graphs").glob("*.arrow"))
    ds = build_crystal_dataset(path, graph=SPEC, cache_dir=tmp_path / "c", id_key="name", on_invalid="skip")
    assert ds["id"] == [r["id"] for r in iter_crystals(path, id_key="name", on_invalid="skip")]
    assert ds["id"] == ["s0", "s1", "s2", "s3", "s4", "s5", "s7"]
    report = ds.crystal_report
    assert (report.records, report.kept, report.skipped) == (8, 7, {"duplicate_id": 1})
    cached = build_crystal_dataset(path, graph=SPEC, cache_dir=tmp_path / "c", id_key="name", on_invalid="skip")
    assert cached.crystal_report.cache_hit and cached["id"] == ds["id"]
    assert cached.crystal_report.skipped == {"duplicate_id": 1}


def test_in_memory_list_in_pieces(tmp_path, monkeypatch):
    frames = _frames(7)
    monkeypatch.setattr(D, "SHARD_RECORDS", 3)
    ds = build_crystal_dataset(frames, labels=[float(k) for k in range(7)], graph=SPEC, cache_dir=tmp_path)
    assert ds["target"] == [float(k) for k in range(7)] and ds["id"] == [f"structure#{k}" for k in range(7)]
    with pytest.raises(ValueError, match="in-memory"):
        build_crystal_dataset(_extxyz(tmp_path / "x.extxyz", frames), labels=[1.0] * 7, cache_dir=tmp_path)


# --- ASE databases ----------------------------------------------------------------------------------------------


def test_aselmdb_reader_matches_extxyz(tmp_path, monkeypatch):
    """An .aselmdb (fairchem's format): target from the row's key-value pairs, per-atom values from its data;
    the same graphs as the same structures in extxyz; in pieces and 2 workers as in one."""
    frames = _frames(9)
    db = _aselmdb(tmp_path / "set.aselmdb", frames)
    xyz = _extxyz(tmp_path / "set.extxyz", frames)
    recs = list(iter_crystals(db, target="energy_t", keep="forces_t", id_key="name"))
    assert [r["id"] for r in recs] == [f"s{k}" for k in range(9)]
    assert np.allclose([r["target"] for r in recs], [f.info["energy"] for f in frames])
    assert all(np.allclose(r["atom_forces_t"], f.arrays["forces"]) for r, f in zip(recs, frames))
    from_db = build_crystal_dataset(db, graph=SPEC, target="energy_t", cache_dir=tmp_path / "a")
    from_xyz = build_crystal_dataset(xyz, graph=SPEC, target="energy", cache_dir=tmp_path / "a")
    cols = ("atomic_numbers", "edge_src", "edge_dst", "edge_shift", "target", "lattice_coeffs")
    assert _rows(from_db, cols) == _rows(from_xyz, cols)
    assert from_db["id"][0] == f"{tmp_path.name}/set.aselmdb#1"  # the row id, not its position
    monkeypatch.setattr(D, "SHARD_RECORDS", 4)
    pieces = build_crystal_dataset(db, graph=SPEC, target="energy_t", cache_dir=tmp_path / "b", num_proc=2)
    assert _rows(pieces, cols + ("id",)) == _rows(from_db, cols + ("id",))


def test_ase_db_bad_rows_are_named(tmp_path):
    frames = _frames(4)
    db = _aselmdb(tmp_path / "bad.aselmdb", frames, extra_t=[1.0, float("nan"), 2.0, 3.0])
    with pytest.raises(CrystalDataError) as info:
        list(iter_crystals(db, target="extra_t"))
    e = info.value
    assert (e.source, e.index, e.record_id, e.field, e.reason) == (
        str(db), 1, f"{tmp_path.name}/bad.aselmdb#2", "extra_t", "nan_target")
    with pytest.raises(CrystalDataError, match="missing_target") as info:
        list(iter_crystals(db, target="band_gap"))
    assert info.value.field == "band_gap" and "bad.aselmdb#1" in str(info.value)
    ds = build_crystal_dataset(db, graph=SPEC, target="extra_t", on_invalid="skip", cache_dir=tmp_path)
    assert len(ds) == 3 and ds.crystal_report.skipped == {"nan_target": 1}


def test_sqlite_ase_db(tmp_path):
    frames = _frames(3)
    path = tmp_path / "set.db"
    with ase.db.connect(str(path)) as db:
        for atoms in frames:
            db.write(atoms, energy_t=atoms.info["energy"])
    recs = list(iter_crystals(path, target="energy_t"))
    assert np.allclose([r["target"] for r in recs], [f.info["energy"] for f in frames])


def test_unreadable_database_is_named(tmp_path):
    path = tmp_path / "broken.aselmdb"
    path.write_bytes(b"not an lmdb file" * 100)
    with pytest.raises(CrystalDataError, match="unreadable") as info:
        build_crystal_dataset(path, cache_dir=tmp_path / "c")
    assert info.value.source == str(path)


# --- the element baseline ---------------------------------------------------------------------------------------


def _dense_baseline(numbers, targets):
    """The baseline as a least-squares solve of the dense [N, 119] fractions (the reference)."""
    x = T.element_fractions(numbers)
    used = x.any(axis=0)
    coef = np.zeros((T.NUM_ELEMENTS, targets.shape[1]))
    coef[used] = np.linalg.lstsq(x[:, used], targets, rcond=None)[0]
    return coef


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["jarvis_bandgap_50", "mlearn_Si_training", "mlearn_Mo_training_39"])
def test_blocked_baseline_equals_dense_solve(tmp_path, monkeypatch, name):
    ds = build_crystal_dataset(bundled_crystal_path(name), per_atom=True, cache_dir=tmp_path)
    for part in (ds, ds.select(list(range(len(ds) - 1, -1, -2)))):  # a selection, out of order
        y = column_array(part, "target").astype(np.float64).reshape(len(part), -1)
        numbers = ListColumn(part, "atomic_numbers")
        ref = _dense_baseline(numbers, y)
        for block in (T.BASELINE_BLOCK_ROWS, 7):
            monkeypatch.setattr(T, "BASELINE_BLOCK_ROWS", block)
            assert np.abs(T.fit_element_baseline(numbers, y) - ref).max() < 1e-10
            assert np.abs(T.fit_element_baseline([numbers[k] for k in range(len(part))], y) - ref).max() < 1e-10


def test_baseline_never_builds_the_whole_matrix(tmp_path, monkeypatch):
    ds = build_crystal_dataset(bundled_crystal_path("mlearn_Si_test"), per_atom=True, cache_dir=tmp_path)
    monkeypatch.setattr(T, "BASELINE_BLOCK_ROWS", 5)
    shapes = []
    real = np.zeros

    def spy(shape, *args, **kwargs):
        if isinstance(shape, tuple) and len(shape) == 2 and shape[1] == T.NUM_ELEMENTS:
            shapes.append(shape[0])
        return real(shape, *args, **kwargs)

    monkeypatch.setattr(T.np, "zeros", spy)
    y = column_array(ds, "target").reshape(len(ds), 1)
    T.fit_element_baseline(ListColumn(ds, "atomic_numbers"), y)
    monkeypatch.setattr(T.np, "zeros", real)
    assert shapes and max(s for s in shapes if s != T.NUM_ELEMENTS) <= 5


def test_rows_hold_no_per_row_copy(tmp_path):
    """`CrystalRows` reads list columns through views of the Arrow offsets: a rank holds no per-row array of its
    own for them (a copy of N starts per column would grow with the data set), and the rows are unchanged."""
    ds = build_crystal_dataset(bundled_crystal_path("mlearn_Si_test"), keep="forces", cache_dir=tmp_path)
    rows = D.CrystalRows(ds)
    first = rows[3]
    for name in ("atomic_numbers", "positions", "edge_src", "edge_shift", "atom_forces"):
        col = rows._chunks[0][name]
        assert col.offsets is not None and not col.offsets.flags.owndata, name
    plain = ds.with_format("numpy")[3]
    assert np.array_equal(first["positions"], np.stack(plain["positions"]))
    assert np.array_equal(first["edge_shift"], np.stack(plain["edge_shift"]))
    assert np.array_equal(first["edge_src"], plain["edge_src"])


def test_split_read_in_blocks_equals_whole(tmp_path, monkeypatch):
    """The task assigns splits from blocks of ids (never every id as a Python string at once): the same rows."""
    from trainer.data.splits import split_indices

    ds = build_crystal_dataset(bundled_crystal_path("mlearn_Si_training"), per_atom=True, cache_dir=tmp_path)
    fractions = {"train": 0.8, "validation": 0.1, "test": 0.1}
    monkeypatch.setattr(T, "SPLIT_BLOCK_ROWS", 7)
    for part in (ds, ds.select(list(range(len(ds) - 1, -1, -3)))):
        whole = split_indices(part["id"], fractions, key=3)
        blocked = T._split_rows(part, fractions, key=3)
        assert list(blocked) == list(whole)
        assert all(np.array_equal(blocked[k], whole[k]) for k in whole)

"""Crystal data layer: readers on the real sample files, bad-input policy, periodic graphs against
ASE's neighbour list, the Arrow cache, fast rows, collation and id-hashed splits."""

from __future__ import annotations

import copy
import gzip
import json
import logging
import math
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.data.graphs import edge_vectors, neighbor_pairs
from trainer.data.splits import split_indices
from trainer.families.crystals import dataset as D
from trainer.families.crystals import graphs as G
from trainer.families.crystals import readers as R
from trainer.families.crystals import shards as S
from trainer.families.crystals.dataset import (
    CrystalRows,
    atom_counts,
    build_crystal_dataset,
    build_crystal_splits,
    collate_graphs,
    edge_counts,
)
from trainer.families.crystals.graphs import MATFORMER_LOOPS, GraphSpec, build_crystal_graph
from trainer.families.crystals.lattice import canonical_lattice_coeffs
from trainer.families.crystals.readers import (
    CrystalDataError,
    bundled_crystal_path,
    read_extxyz,
    read_id_prop_folder,
    read_mlearn_json,
    read_structures,
)

# The data bundled with the package (trainer/families/crystals/samples/README.md): mlearn Si training and test
# complete, every 5th record of mlearn Mo training (39) and test (5), the 50 JARVIS crystals (POSCARs + id_prop.csv).
MLEARN = {"Si": {s: bundled_crystal_path(f"mlearn_Si_{s}") for s in ("training", "test")},
          "Mo": {"training": bundled_crystal_path("mlearn_Mo_training_39"), "test": bundled_crystal_path("mlearn_Mo_test_5")}}
JARVIS = bundled_crystal_path("jarvis_bandgap_50")

pytest.importorskip("ase")
pytest.importorskip("vesin")
import ase.io  # noqa: E402
from ase.neighborlist import neighbor_list  # noqa: E402


def mlearn_items(el: str = "Si", split: str = "test") -> list[dict]:
    return json.loads(gzip.decompress(MLEARN[el][split].read_bytes()))


def write_json(tmp_path: Path, items: list[dict], name: str = "set.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(items))
    return path


@pytest.fixture(scope="module")
def structures() -> list:
    """Real structures: mlearn Si / Mo (8 to 64 atoms, surfaces, vacancies) and JARVIS crystals of
    2-4 atoms in small cells, where the cutoffs exceed the cell and images of one atom repeat."""
    out = []
    mo = sorted(mlearn_items("Mo", "training"), key=lambda r: r["num_atoms"])
    si = mlearn_items("Si", "test")
    picks = [mo[0], mo[len(mo) // 2], si[0]] + [r for r in si if r["group"] == "Surface"][:1]
    for item in picks:
        s = item["structure"]
        out.append(ase.Atoms(symbols=[site["species"][0]["element"] for site in s["sites"]],
                             positions=[site["xyz"] for site in s["sites"]], cell=s["lattice"]["matrix"], pbc=True))
    jarvis = sorted((ase.io.read(p) for p in sorted(JARVIS.glob("*.vasp"))[:40]), key=len)
    out += jarvis[:4] + jarvis[-2:]
    assert min(len(a) for a in out) <= 2 and min(a.cell.lengths().min() for a in out) < 4.0
    return out


# --- neighbour lists and graphs ---------------------------------------------------------------------

@pytest.mark.parametrize("cutoff", [3.0, 6.5])
def test_neighbor_pairs_match_ase(structures, cutoff):
    for atoms in structures:
        i, j, S, d = neighbor_pairs(atoms.positions, atoms.cell.array, cutoff)
        ia, ja, Sa, da = neighbor_list("ijSd", atoms, cutoff)
        ours = {(a, b, tuple(s)): x for a, b, s, x in zip(i.tolist(), j.tolist(), S.tolist(), d)}
        ref = {(a, b, tuple(s)): x for a, b, s, x in zip(ia.tolist(), ja.tolist(), Sa.tolist(), da)}
        assert ours.keys() == ref.keys(), atoms.get_chemical_formula()
        keys = list(ref)
        np.testing.assert_allclose([ours[k] for k in keys], [ref[k] for k in keys], rtol=0, atol=1e-9)
        if cutoff > atoms.cell.lengths().min():
            assert any(a == b for a, b, _ in keys)  # images of an atom itself are neighbours


def test_radius_graph_is_ase_neighbor_list(structures):
    spec = GraphSpec(kind="radius", cutoff=5.0, use_lattice=False)
    for atoms in structures:
        g = build_crystal_graph(atoms.positions, atoms.cell.array, spec)
        i, j, S, D = neighbor_list("ijSD", atoms, 5.0)
        ref = {(b, a, tuple(s)): v for a, b, s, v in zip(i.tolist(), j.tolist(), S.tolist(), D)}  # src=j, dst=i
        ours = list(zip(g["edge_src"].tolist(), g["edge_dst"].tolist(), map(tuple, g["edge_shift"].tolist())))
        assert len(ours) == len(set(ours)) and set(ours) == ref.keys()
        vec = edge_vectors(atoms.positions, atoms.cell.array, g)
        np.testing.assert_allclose(vec, [ref[e] for e in ours], atol=1e-9)


@pytest.mark.parametrize("k", [12, 25])
def test_knn_graph(structures, k):
    spec = GraphSpec(kind="knn", k=k, use_lattice=True)
    tol = spec.tie_tol
    for atoms in structures:
        n = len(atoms)
        g = build_crystal_graph(atoms.positions, atoms.cell.array, spec)
        src, dst, shift = g["edge_src"], g["edge_dst"], g["edge_shift"]
        i, j, S, d, D = neighbor_list("ijSdD", atoms, 10.0)
        kth = np.array([np.sort(d[i == c])[k - 1] for c in range(n)])
        assert np.all(np.bincount(i, minlength=n) >= k)
        edges = list(zip(src.tolist(), dst.tolist(), map(tuple, shift.tolist())))
        assert len(edges) == len(set(edges))
        loops = np.concatenate([g["lattice_coeffs"], -g["lattice_coeffs"]])
        loop_set = {(c, c, tuple(s)) for c in range(n) for s in loops.tolist()}
        assert loop_set <= set(edges)  # lattice self-loops present, both directions
        ref = {(b, a, tuple(s)): (x, v) for a, b, s, x, v in zip(i.tolist(), j.tolist(), S.tolist(), d, D)}
        # k-th distance property: every neighbour within the centre's k-th distance is an incoming edge ...
        incoming = {e for e, (x, _) in ref.items() if x <= kth[e[1]] + tol}
        assert incoming <= set(edges)
        assert np.all(np.bincount(np.array([e[1] for e in incoming]), minlength=n) >= k)
        # ... and every other edge is the reverse of one (ComFormer's undirected build) or a loop.
        reverse = {(b, a, tuple(-np.array(s))) for a, b, s in incoming}
        assert set(edges) == incoming | reverse | loop_set
        # Edge vectors by the convention equal ASE's D (centre -> neighbour image).
        vec = edge_vectors(atoms.positions, atoms.cell.array, g)
        for e, v in zip(edges, vec):
            if e in ref:
                np.testing.assert_allclose(v, ref[e][1], atol=1e-9)
            else:
                assert e in loop_set
                np.testing.assert_allclose(v, np.array(e[2]) @ atoms.cell.array, atol=1e-9)


def test_knn_ties_and_growth():
    # Simple cubic, 1 atom: 6 neighbours at a, 12 at a*sqrt(2); k=7 must take all 18 (ties), and the
    # 2.0 Å start radius (< a) has to grow.
    a = 3.0
    spec = GraphSpec(kind="knn", k=7, cutoff=2.0, use_lattice=False)
    g = build_crystal_graph(np.zeros((1, 3)), np.eye(3) * a, spec)
    dist = np.linalg.norm(edge_vectors(np.zeros((1, 3)), np.eye(3) * a, g), axis=1)
    assert len(dist) == 18 and np.allclose(sorted(set(np.round(dist, 9))), [a, a * math.sqrt(2)])


def test_lattice_loops_comformer_and_matformer():
    cell = np.array([[4.0, 0, 0], [-2.0, 3.4641016, 0], [0, 0, 7.0]])  # hexagonal a=4, c=7
    lat = canonical_lattice_coeffs(cell)
    v = lat @ cell
    lengths = np.linalg.norm(v, axis=1)
    assert np.isclose(lengths[0], 4.0) and np.isclose(lengths[1], 4.0) and np.isclose(lengths[2], 7.0)
    assert v[0] @ v[1] >= 0 and v[0] @ v[2] >= 0 and np.cross(v[0], v[1]) @ v[2] > 0
    assert abs(round(np.linalg.det(lat))) >= 1
    pos = np.zeros((1, 3))
    for loops, expected in (("comformer", 6), ("matformer", 12)):
        g = build_crystal_graph(pos, cell, GraphSpec(kind="radius", cutoff=1.0, lattice_loops=loops))
        assert len(g["edge_src"]) == expected and np.all(g["edge_src"] == 0) and np.all(g["edge_dst"] == 0)
    g = build_crystal_graph(pos, cell, GraphSpec(kind="radius", cutoff=1.0, lattice_loops="matformer"))
    assert {tuple(s) for s in g["edge_shift"].tolist()} == {
        tuple(s * sign) for s in MATFORMER_LOOPS for sign in (1, -1)}


# --- readers -------------------------------------------------------------------------------------------

def test_mlearn_json_and_gz(tmp_path):
    items = mlearn_items("Si", "test")
    path = tmp_path / "Si" / "test.json"  # the public file's name and folder (the bundled one is gzipped)
    path.parent.mkdir()
    path.write_bytes(gzip.decompress(MLEARN["Si"]["test"].read_bytes()))
    plain = list(read_mlearn_json(path, keep=("forces", "stress")))
    zipped = list(read_mlearn_json(MLEARN["Si"]["test"], keep=("forces", "stress")))
    assert len(plain) == len(zipped) == len(items) == 25
    for rec, z, item in zip(plain, zipped, items):
        assert rec["target"] == z["target"] == item["outputs"]["energy"]
        assert len(rec["atomic_numbers"]) == item["num_atoms"] and set(rec["atomic_numbers"].tolist()) == {14}
        np.testing.assert_allclose(rec["cell"], item["structure"]["lattice"]["matrix"])
        np.testing.assert_allclose(rec["positions"], [s["xyz"] for s in item["structure"]["sites"]])
        np.testing.assert_allclose(rec["atom_forces"], item["outputs"]["forces"])
        np.testing.assert_allclose(rec["stress"], item["outputs"]["virial_stress"])
        assert rec["id"] == f"Si/test.json#{rec['index']}"
        assert z["id"] == f"samples/mlearn_Si_test.json.gz#{rec['index']}"
    per_atom = list(read_mlearn_json(path, per_atom=True))
    assert per_atom[3]["target"] == pytest.approx(items[3]["outputs"]["energy"] / items[3]["num_atoms"])
    multi = next(read_mlearn_json(path, target=["energy", "stress"]))
    assert multi["target"] == [items[0]["outputs"]["energy"], *items[0]["outputs"]["virial_stress"]]


def test_bundled_samples_are_the_public_files():
    """The bundled mlearn Si files decompress to the public files (the sha256 the fetch registry checks
    downloads against); the Mo subsets are whole mlearn records of every group; the JARVIS folder
    labels 50 crystals."""
    import hashlib

    from trainer.data.fetch import REGISTRY

    assert bundled_crystal_path("mlearn_Si_training").name == "mlearn_Si_training.json.gz"
    for split, count in (("training", 214), ("test", 25)):
        raw = gzip.decompress(bundled_crystal_path(f"mlearn_Si_{split}").read_bytes())
        assert hashlib.sha256(raw).hexdigest() == REGISTRY[f"mlearn_si_{split}"].sha256
        assert len(list(read_mlearn_json(bundled_crystal_path(f"mlearn_Si_{split}")))) == count
    mo = mlearn_items("Mo", "training")
    assert len(mo) == 39 and {r["group"] for r in mo} == {"AIMD-NVT", "Elastic", "Vacancy", "Surface"}
    assert len(mlearn_items("Mo", "test")) == 5
    assert all(set(r) >= {"structure", "outputs", "num_atoms", "group"} and r["tag"] == "train" for r in mo)
    assert len(list(read_id_prop_folder(bundled_crystal_path("jarvis_bandgap_50")))) == 50
    with pytest.raises(KeyError):
        bundled_crystal_path("nope")


def _extxyz_frames(n: int = 4):
    from ase.calculators.singlepoint import SinglePointCalculator

    frames = []
    for k, item in enumerate(mlearn_items("Mo", "test")[:n]):
        s = item["structure"]
        atoms = ase.Atoms(symbols=[site["species"][0]["element"] for site in s["sites"]],
                          positions=[site["xyz"] for site in s["sites"]], cell=s["lattice"]["matrix"], pbc=True)
        atoms.info["gap"] = 0.1 * k
        atoms.info["name"] = f"frame{k}"
        atoms.arrays["q_bader"] = np.linspace(-1, 1, len(atoms)) + k
        atoms.calc = SinglePointCalculator(atoms, energy=item["outputs"]["energy"],
                                           forces=np.asarray(item["outputs"]["forces"]))
        frames.append(atoms)
    return frames


@pytest.mark.parametrize("gz", [False, True])
def test_extxyz_reader(tmp_path, gz):
    import ase.io

    frames = _extxyz_frames()
    path = tmp_path / "frames.extxyz"
    ase.io.write(path, frames, format="extxyz")
    if gz:
        gz_path = tmp_path / "frames.extxyz.gz"
        gz_path.write_bytes(gzip.compress(path.read_bytes()))
        path = gz_path
    energy = list(read_extxyz(path, target="energy", keep="forces", id_key="name"))
    assert [r["target"] for r in energy] == pytest.approx([a.get_potential_energy() for a in frames])
    assert [r["id"] for r in energy] == [f"frame{k}" for k in range(len(frames))]
    np.testing.assert_allclose(energy[1]["atom_forces"], frames[1].get_forces())
    np.testing.assert_allclose(energy[1]["positions"], frames[1].positions, atol=1e-6)  # extxyz: 8 decimals
    gap = list(read_extxyz(path, target="gap"))
    assert [r["target"] for r in gap] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    summed = list(read_extxyz(path, target="q_bader"))
    assert summed[2]["target"] == pytest.approx(frames[2].arrays["q_bader"].sum())
    kept = list(read_extxyz(path, target=["energy", "q_bader"], atom_target="keep"))
    assert kept[2]["target"] == pytest.approx(frames[2].get_potential_energy())
    np.testing.assert_allclose(kept[2]["atom_target"], frames[2].arrays["q_bader"])
    ds = build_crystal_dataset(path, target=["energy", "forces"], atom_target="keep", cache_dir=tmp_path / "c")
    batch = collate_graphs(CrystalRows(ds).__getitems__([0, 1]))
    assert batch["target"].shape == (2,) and batch["atom_target"].shape == (len(frames[0]) + len(frames[1]), 3)


def test_id_prop_folder(tmp_path):
    recs = list(read_id_prop_folder(JARVIS))
    rows = [line.split(",") for line in (JARVIS / "id_prop.csv").read_text().split()]
    assert len(recs) == len(rows) == 50
    assert [r["id"] for r in recs] == [name for name, _ in rows]
    assert [r["target"] for r in recs] == [float(v) for _, v in rows]
    atoms = ase.io.read(JARVIS / rows[0][0])
    np.testing.assert_allclose(recs[0]["positions"], atoms.positions)
    assert recs[0]["atomic_numbers"].tolist() == atoms.numbers.tolist()
    # A header row is tolerated; ids without the file extension (CGCNN) resolve too.
    folder = tmp_path / "withheader"
    folder.mkdir()
    for name, _ in rows[:3]:
        shutil.copy(JARVIS / name, folder / name)
    lines = ["structure,band_gap"] + [f"{name.removesuffix('.vasp')},{v}" for name, v in rows[:3]]
    (folder / "id_prop.csv").write_text("\n".join(lines) + "\n")
    recs2 = list(read_id_prop_folder(folder))
    assert [r["target"] for r in recs2] == [float(v) for _, v in rows[:3]]


def test_in_memory_atoms_and_structures():
    pymatgen = pytest.importorskip("pymatgen.core")
    frames = _extxyz_frames(3)
    labels = [1.5, 2.5, [3.0]]
    recs = list(read_structures(frames[:2], labels=labels[:2]))
    assert [r["target"] for r in recs] == [1.5, 2.5]
    from_info = list(read_structures(frames, target="gap"))
    assert [r["target"] for r in from_info] == pytest.approx([0.0, 0.1, 0.2])
    structs = [pymatgen.Structure(lattice=a.cell.array, species=a.get_chemical_symbols(), coords=a.positions,
                                  coords_are_cartesian=True) for a in frames]
    recs = list(read_structures(structs, labels=[1.0, 2.0, 3.0], ids=["a", "b", "c"], per_atom=True))
    assert [r["id"] for r in recs] == ["a", "b", "c"]
    assert recs[1]["target"] == pytest.approx(2.0 / len(frames[1]))
    np.testing.assert_allclose(recs[2]["positions"], frames[2].positions, atol=1e-8)



def test_in_memory_dataset_is_cached_by_content(tmp_path):
    frames = _extxyz_frames(3)
    kw = dict(labels=[1.0, 2.0, 3.0], graph=GraphSpec(k=12), cache_dir=tmp_path)
    first = build_crystal_dataset(frames, **kw)
    graphs = G.GRAPH_CALLS
    assert build_crystal_dataset(frames, **kw).crystal_report.cache_hit and G.GRAPH_CALLS == graphs
    moved = [a.copy() for a in frames]
    moved[1].positions[0] += 0.05
    assert build_crystal_dataset(moved, **kw)._fingerprint != first._fingerprint


# --- bad input ----------------------------------------------------------------------------------------

def _bad_json_items() -> tuple[list[dict], dict[str, int]]:
    good = mlearn_items("Si", "test")[:6]
    bad = []
    item = copy.deepcopy(good[0]); del item["outputs"]["energy"]; bad.append(("missing_target", item))  # noqa: E702
    item = copy.deepcopy(good[0]); item["outputs"]["energy"] = float("nan"); bad.append(("nan_target", item))  # noqa: E702
    item = copy.deepcopy(good[0]); item["structure"]["lattice"]["matrix"][2] = [0.0, 0.0, 0.0]  # noqa: E702
    bad.append(("singular_cell", item))
    item = copy.deepcopy(good[0]); s = item["structure"]["sites"]; s[1]["xyz"] = list(np.add(s[0]["xyz"], 0.01))  # noqa: E702
    bad.append(("overlapping_atoms", item))
    item = copy.deepcopy(good[0]); item["structure"]["sites"][3]["species"][0]["element"] = "Xx"  # noqa: E702
    bad.append(("unknown_element", item))
    item = copy.deepcopy(good[0]); item["structure"]["sites"] = []; bad.append(("empty_structure", item))  # noqa: E702
    items = good[:3] + [b for _, b in bad] + good[3:]
    return items, {reason: 1 for reason, _ in bad}


EXPECTED_FIELD = {"missing_target": "energy", "nan_target": "energy", "singular_cell": "cell",
                  "overlapping_atoms": "positions", "unknown_element": "structure.sites[3].species",
                  "empty_structure": "atomic_numbers"}


def test_each_bad_record_is_named(tmp_path):
    items, _ = _bad_json_items()
    for k in range(3, 9):
        path = write_json(tmp_path, items[:3] + [items[k]], name=f"bad{k}.json")
        with pytest.raises(CrystalDataError) as info:
            list(read_mlearn_json(path))
        e = info.value
        assert e.index == 3 and e.record_id == f"{tmp_path.name}/bad{k}.json#3" and e.source == str(path)
        assert e.field == EXPECTED_FIELD[e.reason]
        msg = str(e)
        assert str(path) in msg and "record 3" in msg and e.record_id in msg and repr(e.field) in msg
    # In a dataset build the overlap is found in the graph step (free), with the same naming.
    path = write_json(tmp_path, items[:3] + [items[6]], name="overlap.json")
    with pytest.raises(CrystalDataError, match="overlapping_atoms") as info:
        build_crystal_dataset(path, cache_dir=tmp_path / "c")
    assert info.value.index == 3 and info.value.field == "positions" and str(path) in str(info.value)


def test_skip_counts_and_keeps_good_records(tmp_path, caplog):
    items, expected = _bad_json_items()
    path = write_json(tmp_path, items)
    skipped = Counter()
    good = list(read_mlearn_json(path, on_invalid="skip", skipped=skipped))
    assert dict(skipped) == expected and len(good) == 6
    with caplog.at_level(logging.WARNING, logger="trainer.families.crystals.readers"):
        ds = build_crystal_dataset(path, on_invalid="skip", cache_dir=tmp_path / "c", graph=GraphSpec(k=12))
    report = ds.crystal_report
    assert report.skipped == expected and report.kept == 6 and report.records == 12
    assert ds["id"] == [f"{tmp_path.name}/set.json#{k}" for k in (0, 1, 2, 9, 10, 11)]
    assert "skipped 6 of 12 records" in caplog.text and "overlapping_atoms=1" in caplog.text
    again = build_crystal_dataset(path, on_invalid="skip", cache_dir=tmp_path / "c", graph=GraphSpec(k=12))
    assert again.crystal_report.cache_hit and again.crystal_report.skipped == expected


def test_id_prop_missing_file_and_bad_values(tmp_path):
    folder = tmp_path / "jarvis"
    folder.mkdir()
    rows = [line.split(",") for line in (JARVIS / "id_prop.csv").read_text().split()][:4]
    for name, _ in rows:
        shutil.copy(JARVIS / name, folder / name)
    lines = [",".join(r) for r in rows] + ["POSCAR-missing.vasp,1.0", f"{rows[0][0]},nan", f"{rows[1][0]}"]
    (folder / "id_prop.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(CrystalDataError) as info:
        list(read_id_prop_folder(folder))
    e = info.value
    assert (e.reason, e.index, e.record_id, e.field) == ("missing_file", 4, "POSCAR-missing.vasp", "file")
    assert "id_prop.csv" in str(e) and "POSCAR-missing.vasp" in str(e)
    skipped = Counter()
    recs = list(read_id_prop_folder(folder, on_invalid="skip", skipped=skipped))
    # the nan row repeats an id too, but it is rejected for its value first
    assert len(recs) == 4 and dict(skipped) == {"missing_file": 1, "nan_target": 1, "missing_target": 1}


def test_non_periodic_and_unknown_atomic_number():
    frames = _extxyz_frames(2)
    mol = frames[0].copy()
    mol.pbc = False
    with pytest.raises(CrystalDataError, match="non_periodic") as info:
        list(read_structures([frames[1], mol], labels=[1.0, 2.0]))
    assert info.value.index == 1 and info.value.field == "pbc" and "structure#1" in str(info.value)
    dummy = frames[0].copy()
    dummy.numbers[0] = 0
    with pytest.raises(CrystalDataError, match="unknown_element"):
        list(read_structures([dummy], labels=[1.0]))
    with pytest.raises(CrystalDataError, match="duplicate_id"):
        list(read_structures(frames, labels=[1.0, 2.0], ids=["x", "x"]))


# --- Arrow cache --------------------------------------------------------------------------------------

def test_cache_hit_and_rebuild(tmp_path):
    path = write_json(tmp_path, mlearn_items("Si", "test")[:5])
    cache = tmp_path / "cache"
    spec = GraphSpec(k=12)
    first = build_crystal_dataset(path, graph=spec, cache_dir=cache)
    files = sorted(p.name for p in (cache / "crystal_graphs").iterdir())
    parses, graphs = R.PARSE_CALLS, G.GRAPH_CALLS
    second = build_crystal_dataset(path, graph=spec, cache_dir=cache)
    assert (R.PARSE_CALLS, G.GRAPH_CALLS) == (parses, graphs)  # neither parsed nor built
    assert second.crystal_report.cache_hit and not first.crystal_report.cache_hit
    assert sorted(p.name for p in (cache / "crystal_graphs").iterdir()) == files
    assert second["edge_src"] == first["edge_src"] and second._fingerprint == first._fingerprint
    third = build_crystal_dataset(path, graph=GraphSpec(k=12, cutoff=5.0), cache_dir=cache)
    assert G.GRAPH_CALLS == graphs + 5 and not third.crystal_report.cache_hit
    assert third._fingerprint != first._fingerprint
    build_crystal_dataset(path, graph=spec, per_atom=True, cache_dir=cache)
    assert G.GRAPH_CALLS == graphs + 10  # a target option rebuilds too
    staged = tmp_path / "scratch" / path.name  # a copy elsewhere with a new mtime (cp without -p): a hit
    staged.parent.mkdir()
    shutil.copy(path, staged)
    os.utime(staged, ns=(1, 1))
    assert build_crystal_dataset(staged, graph=spec, cache_dir=cache).crystal_report.cache_hit
    staged.write_text(json.dumps(mlearn_items("Si", "test")[:4]))  # changed content rebuilds
    assert not build_crystal_dataset(staged, graph=spec, cache_dir=cache).crystal_report.cache_hit


def test_num_proc_gives_same_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "SHARD_RECORDS", 3)
    path = write_json(tmp_path, mlearn_items("Si", "test")[:6])
    one = build_crystal_dataset(path, graph=GraphSpec(k=12), cache_dir=tmp_path / "a")
    two = build_crystal_dataset(path, graph=GraphSpec(k=12), cache_dir=tmp_path / "b", num_proc=2)
    assert len(list((tmp_path / "b" / "crystal_graphs").glob("*.arrow"))) == 2
    for col in ("id", "edge_src", "edge_shift", "target"):
        assert one[col] == two[col]


# --- rows, collate, sizes, splits -------------------------------------------------------------------

@pytest.fixture(scope="module")
def si_test(tmp_path_factory):
    return build_crystal_dataset(bundled_crystal_path("mlearn_Si_test"), keep=("forces", "stress"),
                                   cache_dir=tmp_path_factory.mktemp("si"))


def test_rows_sizes_and_collate(si_test):
    ds = si_test
    rows = CrystalRows(ds)
    assert len(rows) == 25
    assert atom_counts(ds).tolist() == ds["num_atoms"] and edge_counts(rows).tolist() == ds["num_edges"]
    r = rows[4]
    assert r["positions"].shape == (r["num_atoms"], 3) and r["edge_shift"].shape == (r["num_edges"], 3)
    np.testing.assert_allclose(r["positions"], np.asarray(ds[4]["positions"], np.float32))
    assert r["edge_src"].tolist() == ds[4]["edge_src"] and r["cell"].shape == (3, 3)
    singles = [collate_graphs([rows[k]]) for k in (2, 7)]
    batch = collate_graphs(rows.__getitems__([2, 7]))
    n0 = int(singles[0]["num_atoms"][0])
    assert batch["batch"].tolist() == [0] * n0 + [1] * int(singles[1]["num_atoms"][0])
    assert batch["edge_src"][: len(singles[0]["edge_src"])].equal(singles[0]["edge_src"])
    assert batch["edge_dst"][len(singles[0]["edge_dst"]):].equal(singles[1]["edge_dst"] + n0)
    assert batch["target"].shape == (2,) and batch["stress"].shape == (2, 6)
    assert batch["atom_forces"].shape == (len(batch["positions"]), 3) and batch["edge_shift"].dtype == torch.float32

    def vectors(b):
        cell = b["cell"][b["batch"][b["edge_dst"]]]
        return b["positions"][b["edge_src"]] + torch.einsum("ek,ekl->el", b["edge_shift"], cell) - \
            b["positions"][b["edge_dst"]]

    assert torch.allclose(vectors(batch), torch.cat([vectors(s) for s in singles]))
    # the batched vectors are those of the single-structure graph (float32 storage)
    rec = list(read_mlearn_json(bundled_crystal_path("mlearn_Si_test")))[7]
    g = build_crystal_graph(rec["positions"], rec["cell"], GraphSpec())
    np.testing.assert_allclose(vectors(singles[1]).numpy(), edge_vectors(rec["positions"], rec["cell"], g),
                               atol=1e-4)
    # numpy-formatted dataset rows collate to the same batch; selected datasets map their indices
    np_rows = ds.with_format("numpy").__getitems__([2, 7])
    assert all(torch.equal(batch[k], v) for k, v in collate_graphs(np_rows).items())
    sub = ds.select([7, 2])
    assert CrystalRows(sub)[0]["id"] == ds[7]["id"] and atom_counts(sub).tolist() == ds.select([7, 2])["num_atoms"]


def test_rows_in_a_dataloader(si_test):
    loader = torch.utils.data.DataLoader(CrystalRows(si_test), batch_size=8, collate_fn=collate_graphs,
                                         num_workers=2)
    batches = list(loader)
    assert sum(len(b["num_atoms"]) for b in batches) == 25
    assert int(batches[0]["edge_src"].max()) < len(batches[0]["positions"])


def test_crystal_splits_follow_the_id_hash_rule(tmp_path):
    """build_crystal_splits splits by trainer.data.splits: each id by its own hash (keyed by the seed),
    so the split is disjoint, covering, deterministic, independent of the input order and close to
    the fractions (sizes are binomial around fraction x n, not exact)."""
    items = mlearn_items("Si", "training")[:120]
    atoms = [ase.Atoms(symbols=[site["species"][0]["element"] for site in it["structure"]["sites"]],
                       positions=[site["xyz"] for site in it["structure"]["sites"]],
                       cell=it["structure"]["lattice"]["matrix"], pbc=True) for it in items]
    labels = [it["outputs"]["energy"] for it in items]
    ids = [f"si-{k}" for k in range(len(items))]
    fractions = {"train": 0.8, "validation": 0.1, "test": 0.1}
    kw = dict(fractions=fractions, graph=GraphSpec(k=12), cache_dir=tmp_path / "c")
    splits = build_crystal_splits(atoms, labels=labels, ids=ids, seed=3, **kw)
    got = {name: ds["id"] for name, ds in splits.items()}
    assert sorted(i for part in got.values() for i in part) == sorted(ids)  # disjoint and covering
    assert got == {name: [ids[k] for k in idx] for name, idx in split_indices(ids, fractions, key=3).items()}
    for name, fraction in fractions.items():  # within 4 binomial standard deviations of fraction x n
        assert abs(len(got[name]) - fraction * len(ids)) <= 4 * math.sqrt(len(ids) * fraction * (1 - fraction))
    assert all(len(part) for part in got.values())
    reversed_ = build_crystal_splits(atoms[::-1], labels=labels[::-1], ids=ids[::-1], seed=3, **kw)
    assert {n: set(ds["id"]) for n, ds in reversed_.items()} == {n: set(v) for n, v in got.items()}
    other = build_crystal_splits(atoms, labels=labels, ids=ids, seed=4, **kw)
    assert set(other["validation"]["id"]) != set(got["validation"])
    with pytest.raises(ValueError, match="sum to 1"):
        build_crystal_splits(atoms, labels=labels, ids=ids, fractions={"train": 0.5, "test": 0.1},
                             graph=GraphSpec(k=12), cache_dir=tmp_path / "c")


def test_splits_from_files_and_fractions(tmp_path):
    train = write_json(tmp_path, mlearn_items("Si", "training")[:10], "training.json")
    test = write_json(tmp_path, mlearn_items("Si", "test")[:4], "test.json")
    splits = build_crystal_splits(train, test=test, fractions={"train": 0.8, "validation": 0.2}, seed=1,
                                    graph=GraphSpec(k=12), cache_dir=tmp_path / "c")
    expected = split_indices([f"{tmp_path.name}/training.json#{k}" for k in range(10)],
                             {"train": 0.8, "validation": 0.2}, key=1)
    assert {k: len(v) for k, v in splits.items()} == {"train": len(expected["train"]),
                                                      "validation": len(expected["validation"]), "test": 4}
    assert splits["validation"]["id"] == [f"{tmp_path.name}/training.json#{k}" for k in expected["validation"]]
    assert not set(splits["train"]["id"]) & set(splits["validation"]["id"])
    assert all(i.startswith(f"{tmp_path.name}/test.json#") for i in splits["test"]["id"])


def test_labels_with_kept_extras():
    frames = _extxyz_frames(2)
    recs = list(read_structures(frames, labels=[0.5, 1.0], keep="forces"))
    assert recs[1]["target"] == 1.0
    np.testing.assert_allclose(recs[1]["atom_forces"], frames[1].get_forces())


def test_nan_position_reports_the_atom(tmp_path):
    frames = _extxyz_frames(2)
    frames[1].positions[5] = np.nan
    with pytest.raises(CrystalDataError) as info:
        build_crystal_dataset(frames, labels=[1.0, 2.0], cache_dir=tmp_path)
    e = info.value
    assert (e.reason, e.index, e.field) == ("bad_value", 1, "positions")
    assert "non-finite position" in e.detail and "atom 5" in e.detail and "shape" not in e.detail


def test_failed_build_leaves_no_temp_files(tmp_path, monkeypatch):
    """A record that fails in the graph step after rows were already written to the shard's temp file:
    the build raises the record's error and the cache folder holds no temp file, shard or sidecar."""
    monkeypatch.setattr(S, "ARROW_BATCH", 2)  # flush every 2 rows, so the temp file has data when it fails
    items, _ = _bad_json_items()
    path = write_json(tmp_path, mlearn_items("Si", "test")[:7] + [items[6]])  # items[6]: overlapping atoms
    cache = tmp_path / "cache"
    written = []
    real_writer = S.shard_writer

    def spy(schema, target):
        written.append(target)
        return real_writer(schema, target)

    monkeypatch.setattr(S, "shard_writer", spy)
    with pytest.raises(CrystalDataError, match="overlapping_atoms") as info:
        build_crystal_dataset(path, graph=GraphSpec(k=12), cache_dir=cache)
    assert info.value.index == 7
    assert written and all(w.endswith(".tmp") for w in written)  # rows went to a temp name first
    assert sorted(p.name for p in (cache / "crystal_graphs").iterdir()) == []
    # the same input with the bad record skipped then builds normally
    ds = build_crystal_dataset(path, graph=GraphSpec(k=12), cache_dir=cache, on_invalid="skip")
    assert len(ds) == 7 and not list((cache / "crystal_graphs").glob("*.tmp"))

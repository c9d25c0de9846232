"""Crystal structures as periodic graphs: readers, validation, graph building, cached Arrow datasets.

Readers (each yields records, see `iter_crystals`): extended XYZ via ASE, a folder of POSCAR/CIF
files with `id_prop.csv` (the CGCNN/ALIGNN layout), mlearn JSON (pymatgen `Structure.as_dict()`
records, parsed without pymatgen; `.json.gz` too) and in-memory `ase.Atoms` / pymatgen
`Structure` lists. A record is a dict: `id`, `source`, `atomic_numbers` [n], `positions` [n, 3]
(Cartesian Å), `cell` [3, 3] (rows are lattice vectors, Å), `pbc` [3], `target` (float, or list of
floats) and, if asked for, `atom_target` / extra columns (`atom_forces`, `stress`, ...). Geometry
comes as numpy arrays. Columns holding one row per atom are named `atom_*`, which is how
`collate_graphs` tells them from per-structure columns.

Bad input (missing / NaN / inf target, singular or near-singular cell, atoms closer than
`MIN_DISTANCE` including periodic images, unknown elements, disordered sites, empty structures,
non-periodic structures, missing or unreadable files, duplicate ids) raises `CrystalDataError`
naming the file, the record (index and id) and the field; with `on_invalid="skip"` the record is
skipped and counted by reason (a logged warning and `CrystalReport.skipped`). Nothing is dropped
silently.

Graphs (`build_graph`, `GraphSpec`): `radius` (every neighbour within `cutoff`, periodic images
included) or `knn`, ComFormer's k-nearest-neighbour graph. Neighbour search is vesin (C++), the
selection is vectorised numpy. Edge convention (the model relies on it): edge e goes from
`edge_src[e]` = j (the neighbour) to `edge_dst[e]` = i (the centre), messages flow src -> dst, and
the vector from the centre to the neighbour's image is
`positions[j] + edge_shift[e] @ cell - positions[i]`. Lattice self-loops have src = dst.

What the official ComFormer code does (divelab/AIRS, OpenMat/ComFormer at commit 949e70b3,
`comformer/graphs.py::nearest_neighbor_edges_submit` and `build_undirected_edgedata`,
`comformer/config.py`, `comformer/scripts/train_jarvis.py`; the DDP fork jwchen25/comformer has the
same graph code):

* defaults `cutoff=4.0`, `max_neighbors=12`, `use_canonize=True`, `use_lattice=False` in
  `TrainingConfig`; the published JARVIS/MP runs (`scripts/train_jarvis.py`, `train_mp.py`) use
  `cutoff=4.0, max_neighbors=25, use_lattice=True`. `GraphSpec()` defaults to the published
  setting (k=25, lattice self-loops on).
* For each atom the neighbours within the cutoff are sorted by distance and all with
  distance <= the k-th distance are kept (ties included); if some atom has fewer than k, the cutoff
  grows (to max(a, b, c) if smaller, else doubled) and the search repeats. The result does not
  depend on the cutoff or on how it grows, only on k, so we start from a density-based estimate
  and double (fewer searches, same graph).
* Every kept pair is added in both directions (`build_undirected_edgedata`); with
  `use_canonize=True` a pair found from both ends is stored once, which is what we do: the edge
  set is the union of the k-NN edges and their reverses, without duplicates.
* `use_lattice=True` adds, per atom, self-loops along three lattice vectors lat1, lat2, lat3 (both
  directions): NOT the fixed shifts (1,0,0), (0,1,0), (0,0,1) and face diagonals (0,1,1),
  (1,0,1), (1,1,0) -- those are Matformer's (`OpenMat/Matformer/matformer/graphs.py`), kept here
  as `lattice_loops="matformer"`. ComFormer takes lat1 = the shortest lattice vector (the
  nearest periodic image of atom 0 of itself), lat2 = the next shortest not collinear with it,
  lat3 = the next not coplanar; then flips lat2 / lat3 to make acute angles with lat1 and flips
  all three if they are left-handed. The same three vectors (Cartesian) are iComformer's
  `edge_nei` / `atom_lat` features, so each record stores them as `lattice_shifts` (integer rows,
  `lattice_shifts @ cell` gives the vectors). Equal-length candidates are ordered here
  deterministically (fewest non-zero components, then (1,0,0) before (0,1,0) before negatives);
  the official order follows jarvis-tools' neighbour enumeration.
* Official `edge_attr` r = pos[v] - pos[u] for PyG edge (u -> v), the reverse of our vector: a
  port of ComFormer should use `-edge_vec` where it uses `edge_attr` (it matters for the cosine
  between an edge and the lattice vectors, not for lengths).

Caching: `build_crystal_dataset` parses once per (input files' path/size/mtime or in-memory
content, reader options, graph settings) into Arrow files under a fingerprint, with a JSON sidecar
holding the counts, so a second call loads memory-mapped Arrow without parsing.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import logging
import math
import multiprocessing
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence

import datasets
import numpy as np
import pyarrow as pa
import torch
from datasets.arrow_writer import ArrowWriter

from trainer.errors import DataError

logger = logging.getLogger(__name__)

FORMAT_VERSION = "crystals-v1"
"""Bump when readers or graph building change their output, so that old caches are not reused."""

MIN_DISTANCE = 0.1
"""Å: atoms (or periodic images) closer than this are 'overlapping atoms'."""
MIN_VOLUME_PER_ATOM = 1e-3
"""Å^3: a cell with less volume per atom is 'singular'."""
MAX_SEARCH_RADIUS = 100.0
"""Å: the k-NN search gives up beyond this (only reachable with absurd inputs)."""
ARROW_BATCH = 256
"""Structures per Arrow record batch."""
MIN_SHARD_RECORDS = 128
"""Fewest structures per worker when `num_proc` > 1: below that, forking costs more than it saves."""

PARSE_CALLS = 0
"""Number of files / in-memory lists opened for parsing (tests use it to prove cache hits)."""
GRAPH_CALLS = 0
"""Number of graphs built in this process (tests use it to prove cache hits)."""

MLEARN_SAMPLES = {"mlearn_Si_training": "mlearn_Si_training.json.gz", "mlearn_Si_test": "mlearn_Si_test.json.gz"}
_SAMPLES = Path(__file__).resolve().parent / "samples"
_MATFORMER_LOOPS = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 1, 1], [1, 0, 1], [1, 1, 0]])
_MLEARN_ALIASES = {"stress": "virial_stress"}


def bundled_crystal_path(name: str = "mlearn_Si_training") -> Path:
    """Path of a bundled crystal file: "mlearn_Si_training" or "mlearn_Si_test" (file name also accepted).

    Provenance: trainer/families/crystals/samples/README.md.
    """
    key = name.removesuffix(".json.gz").removesuffix(".json")
    if key not in MLEARN_SAMPLES:
        raise KeyError(f"no bundled crystal set {name!r}; have {sorted(MLEARN_SAMPLES)}")
    return _SAMPLES / MLEARN_SAMPLES[key]


# --------------------------------------------------------------------------------------------------
# errors and reports


class CrystalDataError(DataError):
    """A record that cannot be used; names the file, the record (index and id), the field and why."""

    def __init__(self, source: str, index: int | None, record_id: str | None, field: str, reason: str,
                 detail: str):
        self.source, self.index, self.record_id = source, index, record_id
        self.field, self.reason, self.detail = field, reason, detail
        where = f"record {index}" if index is not None else "file"
        if record_id is not None:
            where += f" (id {record_id!r})"
        super().__init__(f"{source}: {where}, field {field!r}: {reason}: {detail}")

    def __reduce__(self):  # picklable across worker processes despite the custom __init__
        return (type(self), (self.source, self.index, self.record_id, self.field, self.reason, self.detail))


@dataclass
class CrystalReport:
    """What a build read and kept; `skipped` counts records by reason (see `CrystalDataError.reason`)."""

    fingerprint: str = ""
    records: int = 0
    """Records read (kept + skipped)."""
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    cache_hit: bool = False

    def summary(self) -> str:
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        return f"{self.kept} of {self.records} records kept; skipped: {skipped}"


def _skip_or_raise(err: CrystalDataError, on_invalid: str, skipped: Counter) -> None:
    if on_invalid == "error":
        raise err
    skipped[err.reason] += 1
    logger.debug("skipped: %s", err)


def _log_skips(skipped: Counter, total: int, what: str) -> None:
    if skipped:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(skipped.items()))
        logger.warning("%s: skipped %d of %d records (%s)", what, sum(skipped.values()), total, counts)


# --------------------------------------------------------------------------------------------------
# validation


def _elements_table() -> tuple[dict[str, int], int]:
    from ase.data import atomic_numbers, chemical_symbols
    return atomic_numbers, len(chemical_symbols) - 1


def _check_geometry(numbers: np.ndarray, positions: np.ndarray, cell: np.ndarray,
                    pbc: np.ndarray) -> tuple[str, str, str] | None:
    """(field, reason, detail) of the first problem of a structure, or None (overlaps: `_check_overlap`)."""
    n = len(numbers)
    if n == 0:
        return "atomic_numbers", "empty_structure", "no atoms"
    _, max_z = _elements_table()
    bad = np.flatnonzero((numbers < 1) | (numbers > max_z))
    if len(bad):
        return "atomic_numbers", "unknown_element", f"atomic number {int(numbers[bad[0]])} of atom {int(bad[0])}"
    if positions.shape != (n, 3) or not np.isfinite(positions).all():
        return "positions", "bad_value", f"positions must be {n} finite rows of 3, got shape {positions.shape}"
    if not np.all(pbc):
        return "pbc", "non_periodic", f"pbc={pbc.tolist()}: a periodic graph needs periodic boundaries on all 3 axes"
    if cell.shape != (3, 3) or not np.isfinite(cell).all():
        return "cell", "bad_value", f"cell must be a finite 3x3 matrix, got {cell.tolist()}"
    volume = abs(float(np.linalg.det(cell)))
    if volume < MIN_VOLUME_PER_ATOM * n:
        return "cell", "singular_cell", (f"cell volume {volume:.3g} Å^3 < {MIN_VOLUME_PER_ATOM} Å^3 per atom "
                                         f"x {n} atoms (singular lattice)")
    return None


def _overlap_detail(i: np.ndarray, j: np.ndarray, S: np.ndarray, d: np.ndarray) -> str | None:
    """Description of the closest pair below MIN_DISTANCE in a neighbour list, or None."""
    close = np.flatnonzero(d < MIN_DISTANCE)
    if not len(close):
        return None
    e = close[np.argmin(d[close])]
    return (f"atoms {int(i[e])} and {int(j[e])} (image shift {S[e].tolist()}) are {float(d[e]):.4f} Å apart "
            f"(< {MIN_DISTANCE} Å)")


def _check_overlap(positions: np.ndarray, cell: np.ndarray) -> str | None:
    # 1 Å search radius: vesin's cell list at a 0.1 Å radius would have V / 0.001 bins.
    i, j, S, d = neighbor_pairs(positions, cell, 1.0)
    return _overlap_detail(i, j, S, d)


def _scalar_or_vector(value: Any) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim > 1:
        raise ValueError(f"expected a number or a list of numbers, got shape {arr.shape}")
    return arr


# --------------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class TargetSpec:
    """Which quantities become `target` / `atom_target` / extra columns (see `iter_crystals`)."""

    keys: tuple[str, ...] = ("energy",)
    atom_target: Literal["sum", "keep"] = "sum"
    per_atom: bool = False
    keep: tuple[str, ...] = ()

    @classmethod
    def make(cls, target: str | Sequence[str] | None, atom_target: str, per_atom: bool,
             keep: str | Sequence[str]) -> TargetSpec:
        keys = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        keep_t = (keep,) if isinstance(keep, str) else tuple(keep)
        if atom_target not in ("sum", "keep"):
            raise ValueError(f"atom_target must be 'sum' or 'keep', got {atom_target!r}")
        return cls(keys, atom_target, bool(per_atom), keep_t)


def _record(source: str, index: int, record_id: str, numbers: Any, positions: Any, cell: Any, pbc: Any,
            lookup: Callable[[str], tuple[np.ndarray, bool] | None], spec: TargetSpec,
            check_overlap: bool) -> dict[str, Any] | CrystalDataError:
    """A validated record, or the error describing why it is not one.

    `lookup(key)` returns (value, is_per_atom) or None if the record has no such quantity.
    """
    def err(field_: str, reason: str, detail: str) -> CrystalDataError:
        return CrystalDataError(source, index, record_id, field_, reason, detail)

    try:
        numbers = np.asarray(numbers, dtype=np.int64).reshape(-1)
        positions = np.asarray(positions, dtype=np.float64).reshape(-1, 3) if len(numbers) else np.zeros((0, 3))
        cell = np.asarray(cell, dtype=np.float64)
        pbc = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,))
    except (TypeError, ValueError) as e:
        return err("structure", "bad_value", str(e))
    problem = _check_geometry(numbers, positions, cell, pbc)
    if problem is not None:
        return err(*problem)
    n = len(numbers)
    graph_parts, atom_parts = [], []
    atom_ndim1 = False
    for key in spec.keys:
        try:
            found = lookup(key)
        except Exception as e:  # noqa: BLE001 -- a calculator may raise anything; report it as the field's problem
            return err(key, "bad_value", f"{type(e).__name__}: {e}")
        if found is None:
            return err(key, "missing_target", "no such quantity in this record")
        value, is_atom = found
        value = np.asarray(value, dtype=np.float64)
        if not np.isfinite(value).all():
            return err(key, "nan_target", f"non-finite value {value.tolist() if value.size < 10 else '(array)'}")
        if is_atom:
            if value.shape[:1] != (n,) or value.ndim > 2:
                return err(key, "bad_value", f"per-atom value of shape {value.shape} for {n} atoms")
            if spec.atom_target == "keep":
                atom_ndim1 = value.ndim == 1
                atom_parts.append(value.reshape(n, -1))
                continue
            value = value.sum(axis=0)
        if value.ndim > 1:
            return err(key, "bad_value", f"expected a number or a list of numbers, got shape {value.shape}")
        graph_parts.append(value)
    rec: dict[str, Any] = {"id": record_id, "source": source, "index": index, "atomic_numbers": numbers,
                           "positions": positions, "cell": cell, "pbc": pbc}
    if graph_parts:
        target = np.concatenate([p.reshape(-1) for p in graph_parts])
        if spec.per_atom:
            target = target / n
        # A single plain number stays a float (target [B] after collate); anything else is a list ([B, T]).
        rec["target"] = float(target[0]) if len(graph_parts) == 1 and graph_parts[0].ndim == 0 else target.tolist()
    if atom_parts:
        at = np.concatenate(atom_parts, axis=1)
        rec["atom_target"] = at[:, 0] if len(atom_parts) == 1 and atom_ndim1 else at
    for key in spec.keep:
        try:
            found = lookup(key)
        except Exception as e:  # noqa: BLE001
            return err(key, "bad_value", f"{type(e).__name__}: {e}")
        if found is None:
            return err(key, "missing_value", "no such quantity in this record (asked for by keep)")
        value, is_atom = found
        value = np.asarray(value, dtype=np.float64)
        if not np.isfinite(value).all():
            return err(key, "bad_value", "non-finite value")
        if is_atom:
            if value.shape[:1] != (n,) or value.ndim > 2:
                return err(key, "bad_value", f"per-atom value of shape {value.shape} for {n} atoms")
            rec[f"atom_{key}"] = value
        else:
            if value.ndim > 1:
                value = value.reshape(-1)
            rec[key] = value
    if check_overlap:
        detail = _check_overlap(positions, cell)
        if detail is not None:
            return err("positions", "overlapping_atoms", detail)
    return rec



def _ase_lookup(atoms: Any) -> Callable[[str], tuple[np.ndarray, bool] | None]:
    """Quantities of an `ase.Atoms`: info (per structure), arrays (per atom), then its calculator."""
    def lookup(key: str) -> tuple[np.ndarray, bool] | None:
        if key in atoms.info:
            return _scalar_or_vector(atoms.info[key]), False
        if key in atoms.arrays:
            return np.asarray(atoms.arrays[key], dtype=np.float64), True
        calc = atoms.calc
        if calc is not None:
            results = getattr(calc, "results", {})
            if key in ("energy", "free_energy") and key in results:
                return np.asarray(atoms.get_potential_energy(force_consistent=key == "free_energy")), False
            if key == "forces" and "forces" in results:
                return np.asarray(atoms.get_forces()), True
            if key == "stress" and "stress" in results:
                return np.asarray(atoms.get_stress()), False
            if key in results:
                value = np.asarray(results[key], dtype=np.float64)
                return value, value.ndim >= 1 and value.shape[0] == len(atoms) and key not in ("stress", "dipole")
        return None
    return lookup


def _iter_extxyz(path: Path, spec: TargetSpec, id_key: str | None, check_overlap: bool) -> Iterator[Any]:
    import ase.io

    global PARSE_CALLS
    PARSE_CALLS += 1
    source = str(path)
    index = -1
    try:
        # iread rather than read(":"): a broken frame is reported with its index.
        for index, atoms in enumerate(ase.io.iread(str(path), index=":", format="extxyz")):
            rid = str(atoms.info[id_key]) if id_key and id_key in atoms.info else f"{_short(path)}#{index}"
            yield _record(source, index, rid, atoms.numbers, atoms.positions, atoms.cell.array, atoms.pbc,
                          _ase_lookup(atoms), spec, check_overlap)
    except Exception as e:  # noqa: BLE001 -- ASE raises many types on malformed files
        # The reader cannot resynchronise after a malformed frame: always an error, never a skip.
        raise CrystalDataError(source, index + 1, None, "file", "unreadable",
                               f"cannot read frame {index + 1}: {type(e).__name__}: {e}") from e


def _short(path: Path) -> str:
    """Record-id prefix: the parent folder and file name (Si/training.json), unique enough across sets."""
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def _open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")  # type: ignore[return-value]
    return open(path, encoding="utf-8")


def _iter_mlearn(path: Path, spec: TargetSpec, check_overlap: bool) -> Iterator[Any]:
    """mlearn JSON: a list of {structure: Structure.as_dict(), outputs: {energy, forces, virial_stress}}."""
    global PARSE_CALLS
    PARSE_CALLS += 1
    source = str(path)
    try:
        with _open_text(path) as f:
            data = json.load(f)
    except (OSError, ValueError, EOFError) as e:
        raise CrystalDataError(source, None, None, "file", "unreadable", f"{type(e).__name__}: {e}") from e
    if not isinstance(data, list):
        raise CrystalDataError(source, None, None, "file", "unreadable", "expected a JSON list of records")
    table, _ = _elements_table()
    prefix = _short(path)
    for index, item in enumerate(data):
        rid = f"{prefix}#{index}"

        def err(field_: str, reason: str, detail: str) -> CrystalDataError:
            return CrystalDataError(source, index, rid, field_, reason, detail)

        try:
            structure = item["structure"]
            matrix = structure["lattice"]["matrix"]
            sites = structure["sites"]
        except (KeyError, TypeError) as e:
            yield err("structure", "bad_record", f"missing {e}")
            continue
        numbers, positions, bad = [], [], None
        for k, site in enumerate(sites):
            species = site.get("species") or []
            if len(species) != 1 or abs(float(species[0].get("occu", 1.0)) - 1.0) > 1e-6:
                bad = err(f"structure.sites[{k}].species", "disordered_site",
                          f"{species!r}: only ordered sites (one species, occupancy 1) are supported")
                break
            symbol = species[0].get("element")
            z = table.get(symbol, 0)
            if z == 0:
                bad = err(f"structure.sites[{k}].species", "unknown_element", f"unknown element {symbol!r}")
                break
            numbers.append(z)
            if "xyz" in site:
                positions.append(site["xyz"])
            elif "abc" in site:
                positions.append(np.asarray(site["abc"], dtype=np.float64) @ np.asarray(matrix, dtype=np.float64))
            else:
                bad = err(f"structure.sites[{k}]", "bad_record", "site without xyz or abc coordinates")
                break
        if bad is not None:
            yield bad
            continue
        outputs = item.get("outputs") or {}

        def lookup(key: str, outputs=outputs, n=len(numbers)) -> tuple[np.ndarray, bool] | None:
            name = key if key in outputs else _MLEARN_ALIASES.get(key, key)
            value = outputs.get(name, item.get(name))
            if value is None:
                return None
            arr = np.asarray(value, dtype=np.float64)
            return arr, name == "forces" or (arr.ndim == 2 and arr.shape[0] == n)

        yield _record(source, index, rid, numbers, positions, matrix, True, lookup, spec, check_overlap)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return text.strip().lower() in ("nan", "na", "inf", "-inf")
    return True


def _iter_id_prop(folder: Path, spec: TargetSpec, id_prop: str, check_overlap: bool) -> Iterator[Any]:
    """A folder of POSCAR/CIF files with id_prop.csv rows `filename,value[,value...]` (no header)."""
    import ase.io

    global PARSE_CALLS
    PARSE_CALLS += 1
    csv_path = folder / id_prop
    if not csv_path.exists():
        raise CrystalDataError(str(folder), None, None, "file", "missing_file", f"no {id_prop} in the folder")
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = [row for row in csv.reader(f) if row and any(c.strip() for c in row)]
    # Tolerate one header row (its second field is not a number).
    if rows and len(rows[0]) > 1 and not _is_number(rows[0][1]):
        rows = rows[1:]
    source = str(csv_path)
    for index, row in enumerate(rows):
        name = row[0].strip()
        values = [c.strip() for c in row[1:]]

        def err(field_: str, reason: str, detail: str, name=name, index=index) -> CrystalDataError:
            return CrystalDataError(source, index, name, field_, reason, detail)

        if not values or any(v == "" for v in values):
            yield err("target", "missing_target", f"row {row!r} has no value after the file name")
            continue
        try:
            numbers_ = [float(v) for v in values]
        except ValueError:
            yield err("target", "bad_value", f"not a number in {values!r}")
            continue
        path = folder / name
        if not path.exists():
            # CGCNN lists ids without the extension of `<id>.cif`.
            path = next((folder / (name + ext) for ext in (".cif", ".vasp", ".poscar")
                         if (folder / (name + ext)).exists()), path)
        if not path.exists():
            yield err("file", "missing_file", f"{path} does not exist")
            continue
        try:
            atoms = ase.io.read(str(path))
        except Exception as e:  # noqa: BLE001
            yield err("file", "unreadable", f"{path}: {type(e).__name__}: {e}")
            continue
        value = np.asarray(numbers_[0] if len(numbers_) == 1 else numbers_)

        def lookup(key: str, value=value) -> tuple[np.ndarray, bool] | None:
            return (value, False) if key == "target" else None

        file_spec = TargetSpec(("target",), spec.atom_target, spec.per_atom, ())
        yield _record(f"{source} -> {path.name}", index, name, atoms.numbers, atoms.positions, atoms.cell.array,
                      atoms.pbc, lookup, file_spec, check_overlap)


def _iter_objects(structures: Sequence[Any], labels: Sequence[Any] | None, ids: Sequence[str] | None,
                  spec: TargetSpec, check_overlap: bool) -> Iterator[Any]:
    """In-memory `ase.Atoms` or pymatgen `Structure`s (duck-typed: pymatgen is never imported here)."""
    global PARSE_CALLS
    PARSE_CALLS += 1
    if labels is not None and len(labels) != len(structures):
        raise ValueError(f"{len(structures)} structures but {len(labels)} labels")
    if ids is not None and len(ids) != len(structures):
        raise ValueError(f"{len(structures)} structures but {len(ids)} ids")
    source = "<in-memory>"
    for index, obj in enumerate(structures):
        rid = str(ids[index]) if ids is not None else f"structure#{index}"
        if hasattr(obj, "lattice") and hasattr(obj, "cart_coords"):  # pymatgen Structure
            if not obj.is_ordered:
                yield CrystalDataError(source, index, rid, "species", "disordered_site",
                                       "only ordered structures are supported")
                continue
            numbers = [getattr(sp, "Z", 0) for sp in obj.species]
            if 0 in numbers:
                k = numbers.index(0)
                yield CrystalDataError(source, index, rid, "species", "unknown_element",
                                       f"unknown element {str(obj.species[k])!r} at site {k}")
                continue
            positions, cell, pbc = obj.cart_coords, obj.lattice.matrix, getattr(obj.lattice, "pbc", True)
            props: dict[str, Any] = dict(getattr(obj, "properties", {}) or {})
            site_props: dict[str, Any] = dict(getattr(obj, "site_properties", {}) or {})

            def lookup(key: str, props=props, site_props=site_props) -> tuple[np.ndarray, bool] | None:
                if key in props:
                    return _scalar_or_vector(props[key]), False
                if key in site_props:
                    return np.asarray(site_props[key], dtype=np.float64), True
                return None
        elif hasattr(obj, "get_positions") and hasattr(obj, "numbers"):  # ase.Atoms
            numbers, positions, cell, pbc = obj.numbers, obj.positions, obj.cell.array, obj.pbc
            lookup = _ase_lookup(obj)
        else:
            raise TypeError(f"structure {index} is a {type(obj).__name__}, not an ase.Atoms or pymatgen Structure")
        if labels is not None:
            # The label is the target; `keep` extras still come from the structure.
            def labelled(key: str, label=labels[index], inner=lookup) -> tuple[np.ndarray, bool] | None:
                if key != "target":
                    return inner(key)
                return None if label is None else (np.asarray(label, dtype=np.float64), False)

            lookup = labelled
            item_spec = TargetSpec(("target",), spec.atom_target, spec.per_atom, spec.keep)
        else:
            item_spec = spec
        yield _record(source, index, rid, numbers, positions, cell, pbc, lookup, item_spec, check_overlap)


def _source_kind(path: Path) -> str:
    name = path.name.lower()
    if path.is_dir():
        return "id_prop"
    if name.endswith((".json", ".json.gz")):
        return "mlearn"
    if name.endswith((".xyz", ".extxyz", ".xyz.gz", ".extxyz.gz")):
        return "extxyz"
    raise ValueError(f"{path}: unknown crystal source (expected a folder with id_prop.csv, mlearn .json[.gz] "
                     f"or extended XYZ .xyz/.extxyz[.gz])")


def _as_sources(source: Any) -> tuple[list[Path], list[Any] | None]:
    """(paths, in-memory structures): exactly one of them is non-empty."""
    if isinstance(source, (str, os.PathLike)):
        return [Path(source)], None
    items = list(source)
    if items and all(isinstance(s, (str, os.PathLike)) for s in items):
        return [Path(s) for s in items], None
    return [], items


def _iter_items(source: Any, spec: TargetSpec, *, labels: Sequence[Any] | None = None,
                ids: Sequence[str] | None = None, id_key: str | None = None, id_prop: str = "id_prop.csv",
                check_overlap: bool = True) -> Iterator[Any]:
    """Records and `CrystalDataError`s of every input, in order."""
    paths, objects = _as_sources(source)
    if objects is not None:
        yield from _iter_objects(objects, labels, ids, spec, check_overlap)
        return
    if labels is not None or ids is not None:
        raise ValueError("labels / ids are for in-memory structures; files carry their own")
    for path in paths:
        if not path.exists():
            raise CrystalDataError(str(path), None, None, "file", "missing_file", "no such file or folder")
        kind = _source_kind(path)
        if kind == "id_prop":
            yield from _iter_id_prop(path, spec, id_prop, check_overlap)
        elif kind == "mlearn":
            yield from _iter_mlearn(path, spec, check_overlap)
        else:
            yield from _iter_extxyz(path, spec, id_key, check_overlap)


def iter_crystals(source: Any, *, target: str | Sequence[str] | None = "energy", atom_target: str = "sum",
                  per_atom: bool = False, keep: str | Sequence[str] = (), labels: Sequence[Any] | None = None,
                  ids: Sequence[str] | None = None, id_key: str | None = None, id_prop: str = "id_prop.csv",
                  on_invalid: str = "error", skipped: Counter | None = None,
                  check_overlap: bool = True) -> Iterator[dict[str, Any]]:
    """Valid records of `source`: a path (or list of paths) or a list of ase.Atoms / pymatgen Structures.

    Paths: a folder with `id_prop` (`filename,value[,value...]`, the value(s) are the target:
    `target` is ignored), an mlearn `.json`/`.json.gz` (target keys from `outputs`: `energy`,
    `forces`, `virial_stress` alias `stress`), or an extended XYZ `.xyz`/`.extxyz` (gzip allowed;
    keys from `atoms.info`, `atoms.arrays` or the calculator ASE attaches: `energy`, `forces`,
    `stress`). In-memory structures take `labels` (one number or list per structure) or, for
    ase.Atoms without labels, `target` keys like extxyz.

    `target`: a key or a list of keys (a list, or a vector value, gives a list target). Per-atom
    arrays are summed over atoms (`atom_target="sum"`) or kept as the per-atom `atom_target`
    column (`"keep"`, e.g. forces). `per_atom=True` divides the structure target by the number of
    atoms. `keep`: extra quantities stored as columns (`atom_<key>` when per atom, e.g.
    `atom_forces`; `<key>` otherwise, e.g. `stress`). `on_invalid`: "error" raises
    `CrystalDataError`, "skip" counts the reason into `skipped` and goes on (unreadable files and
    malformed extxyz always raise).
    """
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")
    spec = TargetSpec.make(target, atom_target, per_atom, keep)
    skipped = skipped if skipped is not None else Counter()
    seen: set[str] = set()
    for item in _iter_items(source, spec, labels=labels, ids=ids, id_key=id_key, id_prop=id_prop,
                            check_overlap=check_overlap):
        if isinstance(item, CrystalDataError):
            _skip_or_raise(item, on_invalid, skipped)
            continue
        if item["id"] in seen:
            _skip_or_raise(CrystalDataError(item["source"], None, item["id"], "id", "duplicate_id",
                                            "an earlier record has the same id"), on_invalid, skipped)
            continue
        seen.add(item["id"])
        yield item


def read_extxyz(path: str | Path, **kwargs: Any) -> Iterator[dict[str, Any]]:
    """Records of an extended XYZ file (see `iter_crystals` for the options)."""
    return iter_crystals(Path(path), **kwargs)


def read_id_prop_folder(folder: str | Path, **kwargs: Any) -> Iterator[dict[str, Any]]:
    """Records of a POSCAR/CIF folder with id_prop.csv (see `iter_crystals`)."""
    return iter_crystals(Path(folder), **kwargs)


def read_mlearn_json(path: str | Path, **kwargs: Any) -> Iterator[dict[str, Any]]:
    """Records of an mlearn JSON / JSON.gz file (see `iter_crystals`)."""
    return iter_crystals(Path(path), **kwargs)


def read_structures(structures: Sequence[Any], labels: Sequence[Any] | None = None, **kwargs: Any
                    ) -> Iterator[dict[str, Any]]:
    """Records of in-memory ase.Atoms / pymatgen Structures with their labels (see `iter_crystals`)."""
    return iter_crystals(list(structures), labels=labels, **kwargs)


# --------------------------------------------------------------------------------------------------
# periodic graphs


@dataclass(frozen=True)
class GraphSpec:
    """How to turn a structure into edges (see the module docstring for the ComFormer details).

    `kind="knn"`: k nearest neighbours of every atom, ties within `tie_tol` Å included, plus the
    reverse of every such edge; `cutoff` is only where the search starts (the graph does not
    depend on it). `kind="radius"`: every neighbour within `cutoff`. `use_lattice` adds lattice
    self-loops (both directions): ComFormer's three lattice vectors (`lattice_loops="comformer"`)
    or Matformer's fixed (1,0,0), (0,1,0), (0,0,1), (0,1,1), (1,0,1), (1,1,0) ("matformer").
    """

    kind: Literal["knn", "radius"] = "knn"
    cutoff: float = 4.0
    k: int = 25
    use_lattice: bool = True
    lattice_loops: Literal["comformer", "matformer"] = "comformer"
    tie_tol: float = 1e-4

    def __post_init__(self) -> None:
        if self.kind not in ("knn", "radius"):
            raise ValueError(f"graph kind must be 'knn' or 'radius', got {self.kind!r}")
        if self.lattice_loops not in ("comformer", "matformer"):
            raise ValueError(f"lattice_loops must be 'comformer' or 'matformer', got {self.lattice_loops!r}")
        if not self.cutoff >= 0.5:
            raise ValueError(f"cutoff must be >= 0.5 Å, got {self.cutoff}")
        if self.kind == "knn" and self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def neighbor_pairs(positions: np.ndarray, cell: np.ndarray, cutoff: float, backend: str = "vesin"
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(i, j, S, d) of every ordered pair closer than `cutoff` under full periodic boundaries.

    Same convention as `ase.neighborlist.neighbor_list("ijSd")`: the vector from i to the image
    of j is positions[j] + S @ cell - positions[i]. `backend="ase"` is the pure-numpy ASE search
    (the benchmark baseline).
    """
    positions = np.ascontiguousarray(positions, dtype=np.float64)
    cell = np.ascontiguousarray(cell, dtype=np.float64)
    if backend == "vesin":
        import vesin

        i, j, S, d = vesin.NeighborList(cutoff=float(cutoff), full_list=True).compute(
            positions, cell, True, quantities="ijSd", copy=True)
    elif backend == "ase":
        from ase.neighborlist import primitive_neighbor_list

        i, j, S, d = primitive_neighbor_list("ijSd", (True, True, True), cell, positions, float(cutoff))
    else:
        raise ValueError(f"unknown neighbour-list backend {backend!r}")
    return i.astype(np.int64), j.astype(np.int64), S.astype(np.int64), d


def comformer_lattice_shifts(cell: np.ndarray) -> np.ndarray:
    """ComFormer's lat1, lat2, lat3 as integer rows (see the module docstring); `@ cell` gives Å."""
    cell = np.asarray(cell, dtype=np.float64)
    radius = float(np.linalg.norm(cell, axis=1).max()) + 1e-2
    recip = np.linalg.inv(cell).T  # rows b_i with a_j . b_i = delta_ij, so |n_i| <= radius |b_i|
    bound = np.ceil(radius * np.linalg.norm(recip, axis=1)).astype(np.int64)
    axes = [np.arange(-b, b + 1) for b in bound]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 3)
    length = np.linalg.norm(grid @ cell, axis=1)
    keep = (length <= radius) & np.any(grid != 0, axis=1)
    grid, length = grid[keep], length[keep]
    order = np.lexsort((-grid[:, 2], -grid[:, 1], -grid[:, 0], (grid != 0).sum(axis=1), np.round(length, 6)))
    grid = grid[order]
    lat1 = grid[0]
    lat2 = grid[np.flatnonzero(np.any(np.cross(lat1, grid) != 0, axis=1))[0]]
    lat3 = grid[np.flatnonzero(grid @ np.cross(lat1, lat2) != 0)[0]]
    v1, v2, v3 = lat1 @ cell, lat2 @ cell, lat3 @ cell
    if v1 @ v2 < 0:
        lat2, v2 = -lat2, -v2
    if v1 @ v3 < 0:
        lat3, v3 = -lat3, -v3
    if np.cross(v1, v2) @ v3 < 0:
        lat1, lat2, lat3 = -lat1, -lat2, -lat3
    return np.stack([lat1, lat2, lat3])


def _knn_pairs(positions: np.ndarray, cell: np.ndarray, spec: GraphSpec, backend: str
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Directed (i centre, j neighbour, S, d) of each atom's k nearest neighbours, ties included."""
    n = len(positions)
    volume = abs(float(np.linalg.det(cell)))
    # Start where ~1.5 k neighbours are expected at the mean density: usually one search suffices.
    radius = max(spec.cutoff, (3.0 * 1.5 * spec.k * volume / (4.0 * math.pi * n)) ** (1.0 / 3.0))
    while True:
        i, j, S, d = neighbor_pairs(positions, cell, radius, backend)
        counts = np.bincount(i, minlength=n)
        if counts.min() >= spec.k:
            # Sort by (centre, distance): one stable sort of a float key (vesin lists are grouped by i).
            order = np.argsort(i * (radius * 2.0 + 1.0) + d, kind="stable")
            starts = np.cumsum(counts) - counts
            kth = d[order][starts + spec.k - 1]
            if kth.max() + spec.tie_tol < radius:  # every tie of the k-th distance is in the list
                keep = d <= kth[i] + spec.tie_tol
                return i[keep], j[keep], S[keep], d[keep]
        if radius > MAX_SEARCH_RADIUS:
            raise ValueError(f"fewer than k={spec.k} neighbours within {radius:.1f} Å")
        radius *= 2.0


def _unique_edges(src: np.ndarray, dst: np.ndarray, shift: np.ndarray, n: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edges without duplicates, sorted by (dst, src, shift): one np.unique over an int64 key."""
    m = int(np.abs(shift).max()) if len(shift) else 0
    base = 2 * m + 1
    s = shift + m
    key = ((dst * n + src) * base + s[:, 0]) * base * base + s[:, 1] * base + s[:, 2]
    key = np.unique(key)
    s2 = key % base
    key //= base
    s1 = key % base
    key //= base
    s0 = key % base
    key //= base
    return key % n, key // n, np.stack([s0, s1, s2], axis=1) - m


def build_graph(positions: np.ndarray, cell: np.ndarray, spec: GraphSpec, backend: str = "vesin",
                check_overlap: bool = False) -> dict[str, np.ndarray]:
    """Edges of one structure: `edge_src`, `edge_dst` (int64), `edge_shift` ([E, 3] int64), and
    `lattice_shifts` ([3, 3], ComFormer's lat1..3). With `check_overlap`, raises ValueError if two
    atoms (or images) are closer than MIN_DISTANCE (free: it reads the neighbour list)."""
    global GRAPH_CALLS
    GRAPH_CALLS += 1
    positions = np.asarray(positions, dtype=np.float64)
    cell = np.asarray(cell, dtype=np.float64)
    n = len(positions)
    if spec.kind == "knn":
        i, j, S, d = _knn_pairs(positions, cell, spec, backend)
        # ComFormer's undirected build: every kept pair in both directions (duplicates merged below).
        src = np.concatenate([j, i])
        dst = np.concatenate([i, j])
        shift = np.concatenate([S, -S])
    else:
        i, j, S, d = neighbor_pairs(positions, cell, spec.cutoff, backend)
        src, dst, shift = j, i, S
    if check_overlap:
        detail = _overlap_detail(i, j, S, d)
        if detail is not None:
            raise ValueError(detail)
    lattice = comformer_lattice_shifts(cell)
    if spec.use_lattice:
        loops = lattice if spec.lattice_loops == "comformer" else _MATFORMER_LOOPS
        loops = np.concatenate([loops, -loops])
        atoms = np.repeat(np.arange(n), len(loops))
        src = np.concatenate([src, atoms])
        dst = np.concatenate([dst, atoms])
        shift = np.concatenate([shift, np.tile(loops, (n, 1))])
    src, dst, shift = _unique_edges(src, dst, shift, n)
    return {"edge_src": src, "edge_dst": dst, "edge_shift": shift, "lattice_shifts": lattice}


def edge_vectors(positions: np.ndarray, cell: np.ndarray, graph: dict[str, np.ndarray]) -> np.ndarray:
    """[E, 3] vectors from each edge's centre (dst) to its neighbour's image (src), by the convention."""
    return positions[graph["edge_src"]] + graph["edge_shift"] @ cell - positions[graph["edge_dst"]]


# --------------------------------------------------------------------------------------------------
# Arrow datasets

_EDGE_DTYPE = np.int8
_BASE_FEATURES = {
    "id": datasets.Value("string"),
    "source": datasets.Value("string"),
    "atomic_numbers": datasets.List(datasets.Value("int16")),
    "positions": datasets.List(datasets.List(datasets.Value("float32"), length=3)),
    "cell": datasets.List(datasets.List(datasets.Value("float32"), length=3), length=3),
    "num_atoms": datasets.Value("int32"),
    "edge_src": datasets.List(datasets.Value("int32")),
    "edge_dst": datasets.List(datasets.Value("int32")),
    "edge_shift": datasets.List(datasets.List(datasets.Value("int8"), length=3)),
    "num_edges": datasets.Value("int32"),
    "lattice_shifts": datasets.List(datasets.List(datasets.Value("int8"), length=3), length=3),
}


_CORE_KEYS = ("id", "source", "index", "atomic_numbers", "positions", "cell", "pbc")


def _value_feature(example: Any, per_atom: bool) -> Any:
    """Arrow feature of a target / extra column, from one record's value."""
    arr = np.asarray(example)
    inner = arr.shape[1:] if per_atom else arr.shape
    dtype = "float32" if per_atom else "float64"
    if len(inner) == 0:
        feat: Any = datasets.Value(dtype)
    elif len(inner) == 1:
        feat = datasets.List(datasets.Value(dtype), length=int(inner[0]))
    else:
        raise ValueError(f"values of shape {arr.shape} are not supported")
    return datasets.List(feat) if per_atom else feat


def _features_for(records: list[dict[str, Any]]) -> datasets.Features:
    """Schema: the fixed columns plus target / atom_target / kept extras, shaped like the first record;
    every record must match (a mismatch is a `CrystalDataError` naming it)."""
    feats = dict(_BASE_FEATURES)
    first = records[0]
    extra = [k for k in first if k not in _CORE_KEYS]
    for key in extra:
        feats[key] = _value_feature(first[key], key.startswith("atom_"))
    for rec in records:
        keys = [k for k in rec if k not in _CORE_KEYS]
        if keys != extra:
            raise CrystalDataError(rec["source"], rec["index"], rec["id"], "target", "inconsistent_target",
                                   f"has columns {keys}, the first record has {extra}")
        for key in extra:
            shape, ref = np.shape(rec[key]), np.shape(first[key])
            if (shape[1:] if key.startswith("atom_") else shape) != (ref[1:] if key.startswith("atom_") else ref):
                raise CrystalDataError(rec["source"], rec["index"], rec["id"], key, "inconsistent_target",
                                       f"shape {shape}, the first record has {ref}")
    return datasets.Features(feats)


def _list_array(parts: list[np.ndarray], dtype: Any, width: int | None) -> pa.Array:
    """list<item> (width None) or list<fixed_size_list<item, width>> of per-record arrays."""
    counts = np.array([len(p) for p in parts], dtype=np.int64)
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    flat = np.concatenate([np.asarray(p, dtype=dtype).reshape(-1) for p in parts]) if parts else np.zeros(0, dtype)
    values: pa.Array = pa.array(flat)
    if width is not None:
        values = pa.FixedSizeListArray.from_arrays(values, width)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def _fixed_array(parts: list[np.ndarray], dtype: Any, shape: tuple[int, ...]) -> pa.Array:
    values: pa.Array = pa.array(np.concatenate([np.asarray(p, dtype=dtype).reshape(-1) for p in parts]))
    for width in reversed(shape):
        values = pa.FixedSizeListArray.from_arrays(values, width)
    return values


def _column(name: str, feat: Any, parts: list[Any]) -> pa.Array:
    """One Arrow column from per-record values, built from numpy (no per-element Python)."""
    if isinstance(feat, datasets.Value):
        return pa.array(parts, type=feat.pa_type)
    dtype = np.dtype(feat.feature.dtype if isinstance(feat.feature, datasets.Value) else feat.feature.feature.dtype)
    if feat.length != -1:  # fixed outer size: cell, lattice_shifts, vector targets
        shape = (feat.length,) if isinstance(feat.feature, datasets.Value) else (feat.length, feat.feature.length)
        return _fixed_array(parts, dtype, shape)
    width = None if isinstance(feat.feature, datasets.Value) else feat.feature.length
    return _list_array(parts, dtype, width)


def _record_graph(rec: dict[str, Any], spec: GraphSpec) -> dict[str, Any] | CrystalDataError:
    try:
        g = build_graph(rec["positions"], rec["cell"], spec, check_overlap=True)
    except ValueError as e:
        return CrystalDataError(rec["source"], rec["index"], rec["id"], "positions",
                                "overlapping_atoms" if "apart" in str(e) else "bad_value", str(e))
    if np.abs(g["edge_shift"]).max(initial=0) > np.iinfo(_EDGE_DTYPE).max:
        return CrystalDataError(rec["source"], rec["index"], rec["id"], "cell", "bad_value",
                                "periodic image shifts beyond int8: cell far thinner than the cutoff")
    return g


def _write_graph_shard(records: list[dict[str, Any]], spec: GraphSpec, features: datasets.Features,
                       out_path: str, on_invalid: str) -> dict[str, int]:
    """Build the graphs of `records` and write them to one Arrow file (temp name + rename).

    Returns the skip counts (overlapping atoms show up here, from the graph's neighbour list).
    """
    tmp = f"{out_path}.{os.getpid()}.tmp"
    try:
        skipped = _write_graph_rows(records, spec, features, tmp, on_invalid)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # an error-mode failure leaves no half-written cache file
        raise
    os.replace(tmp, out_path)
    return skipped


def _write_graph_rows(records: list[dict[str, Any]], spec: GraphSpec, features: datasets.Features, tmp: str,
                      on_invalid: str) -> dict[str, int]:
    skipped: Counter = Counter()
    names = list(features)
    with ArrowWriter(features=features, path=tmp) as writer:
        rows: list[dict[str, Any]] = []

        def flush() -> None:
            cols = [_column(name, features[name], [r[name] for r in rows]) for name in names]
            writer.write_table(pa.Table.from_arrays(cols, schema=features.arrow_schema))
            rows.clear()

        for rec in records:
            g = _record_graph(rec, spec)
            if isinstance(g, CrystalDataError):
                _skip_or_raise(g, on_invalid, skipped)
                continue
            row = {k: v for k, v in rec.items() if k in features}
            row.update(g, num_atoms=len(rec["atomic_numbers"]), num_edges=len(g["edge_src"]))
            rows.append(row)
            if len(rows) == ARROW_BATCH:
                flush()
        if rows:
            flush()
        writer.finalize()
    return dict(skipped)


def _write_graph_shard_star(args: tuple) -> dict[str, int]:
    return _write_graph_shard(*args)


def _digest(obj: Any) -> str:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def _file_entries(path: Path) -> list[dict[str, Any]]:
    """Path, size and mtime of a file, or of every file of a folder: what identifies the input."""
    path = path.resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    out = []
    for p in files:
        st = p.stat()
        out.append({"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def _records_digest(records: list[dict[str, Any]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for rec in records:
        h.update(rec["id"].encode())
        for key in sorted(rec):
            value = rec[key]
            if isinstance(value, str):
                h.update(value.encode())
            else:
                h.update(np.ascontiguousarray(np.asarray(value, dtype=np.float64)).tobytes())
    return h.hexdigest()


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def build_crystal_dataset(source: Any, *, graph: GraphSpec | None = None, target: str | Sequence[str] | None = "energy",
                          per_atom: bool = False, atom_target: str = "sum", keep: str | Sequence[str] = (),
                          labels: Sequence[Any] | None = None, ids: Sequence[str] | None = None,
                          id_key: str | None = None, id_prop: str = "id_prop.csv", on_invalid: str = "error",
                          num_proc: int | None = None, cache_dir: str | Path | None = None) -> datasets.Dataset:
    """Parse `source` (see `iter_crystals`), build periodic graphs and cache them as Arrow.

    Columns: `id`, `source`, `atomic_numbers` (int16), `positions` ([n][3] float32), `cell`
    ([3][3] float32), `num_atoms`, `edge_src`, `edge_dst` (int32), `edge_shift` ([E][3] int8),
    `num_edges`, `lattice_shifts` ([3][3] int8, ComFormer's lat1..3), `target` (float64, or a
    fixed-length list) and any `atom_target` / kept extras. The fingerprint covers every input
    file's path, size and mtime (a folder: all its files) or, for in-memory structures, their
    content; the reader options; `on_invalid`; and the graph settings. A repeated call loads the
    memory-mapped Arrow files without parsing; any changed setting rebuilds. `num_proc` > 1 builds
    graphs in up to that many forked processes, one Arrow shard each, with at least
    `MIN_SHARD_RECORDS` structures per process (row order does not depend on it). The returned dataset
    has no format set: read rows with `CrystalRows(ds)` (fast) or `ds.with_format("numpy")`; its
    `crystal_report` attribute is a `CrystalReport` (the same on a cached load).
    """
    graph = graph or GraphSpec()
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")
    spec = TargetSpec.make(target, atom_target, per_atom, keep)
    settings = {"version": FORMAT_VERSION, "graph": graph.to_dict(), "target": asdict(spec), "on_invalid": on_invalid,
                "id_key": id_key, "id_prop": id_prop}
    paths, objects = _as_sources(source)
    records: list[dict[str, Any]] | None = None
    skipped: Counter = Counter()
    read_kwargs = dict(target=target, atom_target=atom_target, per_atom=per_atom, keep=keep, labels=labels, ids=ids,
                       id_key=id_key, id_prop=id_prop, on_invalid=on_invalid, skipped=skipped,
                       check_overlap=False)  # overlaps come free from the graph's neighbour list
    if objects is not None:
        # In-memory input: the parse is the fingerprint's input, so it always runs.
        records = list(iter_crystals(objects, **read_kwargs))
        inputs: Any = {"in_memory": _records_digest(records), "n": len(objects), "skipped": dict(skipped)}
    else:
        for p in paths:
            if not p.exists():
                raise CrystalDataError(str(p), None, None, "file", "missing_file", "no such file or folder")
        inputs = [_file_entries(p) for p in paths]
    fingerprint = _digest({"inputs": inputs, "settings": settings})
    root = (Path(cache_dir) if cache_dir is not None else Path(datasets.config.HF_DATASETS_CACHE)) / "crystal_graphs"
    root.mkdir(parents=True, exist_ok=True)
    sidecar = root / f"{fingerprint}.json"
    meta = json.loads(sidecar.read_text()) if sidecar.exists() else None
    if meta is not None and all((root / s).exists() for s in meta["shards"]):
        report = CrystalReport(fingerprint, meta["records"], meta["kept"], meta["skipped"], cache_hit=True)
    else:
        if records is None:
            records = list(iter_crystals(paths, **read_kwargs))
        n_read = len(records) + sum(skipped.values())
        if not records:
            raise CrystalDataError(", ".join(map(str, paths)) or "<in-memory>", None, None, "records", "no_records",
                                   f"no valid records ({dict(skipped)} skipped)")
        features = _features_for(records)
        n_shards = max(1, min(num_proc or 1, len(records) // MIN_SHARD_RECORDS))
        bounds = np.linspace(0, len(records), n_shards + 1).round().astype(int)
        shards = [f"{fingerprint}-{k:05d}-of-{n_shards:05d}.arrow" for k in range(n_shards)]
        jobs = [(records[bounds[k]:bounds[k + 1]], graph, features, str(root / shards[k]), on_invalid)
                for k in range(n_shards)]
        if n_shards > 1:
            # spawn, not fork: forking a process that runs threads (TensorBoard's writer, tqdm's monitor,
            # the gzip reader) can leave a child waiting forever on a lock held at the fork
            with multiprocessing.get_context("spawn").Pool(n_shards) as pool:
                shard_skips = pool.map(_write_graph_shard_star, jobs)
        else:
            shard_skips = [_write_graph_shard(*jobs[0])]
        for s in shard_skips:
            skipped.update(s)
        kept = len(records) - sum(sum(s.values()) for s in shard_skips)
        _write_json_atomic(sidecar, {"fingerprint": fingerprint, "shards": shards, "records": n_read, "kept": kept,
                                     "skipped": dict(skipped), "settings": settings, "inputs": inputs})
        meta = {"shards": shards}
        report = CrystalReport(fingerprint, n_read, kept, dict(skipped), cache_hit=False)
    _log_skips(Counter(report.skipped), report.records, f"crystal dataset {fingerprint[:8]}")
    parts = [datasets.Dataset.from_file(str(root / s)) for s in meta["shards"]]
    ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    ds._fingerprint = fingerprint  # content-addressed: derived datasets (select, map) cache under it
    ds.crystal_report = report
    return ds


# --------------------------------------------------------------------------------------------------
# fast rows, batching, sizes, splits


def _flat_view(arr: pa.Array) -> tuple[np.ndarray, Any, tuple[int, ...]]:
    """(flat values, element->flat start map, element shape) of an Arrow array, zero-copy.

    The map is an int (affine: element k starts at k * map) or an array of starts (list levels).
    """
    if isinstance(arr, pa.FixedSizeListArray):
        flat, mapping, inner = _flat_view(arr.flatten())
        width = arr.type.list_size
        mapping = mapping * width if isinstance(mapping, int) else mapping[::width]
        return flat, mapping, (width,) + inner
    if isinstance(arr, (pa.ListArray, pa.LargeListArray)):
        flat, mapping, inner = _flat_view(arr.values)
        offsets = arr.offsets.to_numpy().astype(np.int64)
        starts = offsets * mapping if isinstance(mapping, int) else mapping[offsets]
        return flat, starts, (-1,) + inner
    return arr.to_numpy(zero_copy_only=False), 1, ()


class _ChunkColumn:
    """Per-row numpy views of one column of one Arrow chunk."""

    def __init__(self, arr: pa.Array):
        self.is_string = pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)
        if self.is_string:
            self.arr = arr
            return
        self.flat, mapping, self.shape = _flat_view(arr)
        if not self.shape:
            self.starts = None
        elif isinstance(mapping, int):  # fixed-size rows (cell): element k spans [k*m, (k+1)*m)
            self.starts = None
            self.size = mapping
        else:
            self.starts = mapping

    def row(self, k: int) -> Any:
        if self.is_string:
            return self.arr[k].as_py()
        if not self.shape:
            return self.flat[k]
        if self.starts is None:
            return self.flat[k * self.size:(k + 1) * self.size].reshape(self.shape)
        return self.flat[self.starts[k]:self.starts[k + 1]].reshape(self.shape)


class CrystalRows(torch.utils.data.Dataset):
    """Rows of a crystal dataset as dicts of numpy views straight from the memory-mapped Arrow data.

    `datasets`' numpy formatter spends ~100 µs per nested column per row on [n][3] lists; this
    slices the Arrow buffers (about 1-2 µs per column per row) and gives shaped arrays
    (`positions` [n, 3], `edge_shift` [E, 3], `cell` [3, 3]), ready for `collate_graphs`. Honors
    `select`ed / shuffled datasets (their indices mapping); pickles as the underlying dataset.
    """

    def __init__(self, dataset: datasets.Dataset, columns: Sequence[str] | None = None):
        self.dataset = dataset
        self.columns = list(columns) if columns is not None else [c for c in dataset.column_names if c != "source"]
        self._chunks: list[dict[str, _ChunkColumn]] | None = None

    def _prepare(self) -> None:
        table = self.dataset.data.table.select(self.columns)
        batches = table.to_batches()
        self._chunks = [{name: _ChunkColumn(b.column(name)) for name in self.columns} for b in batches]
        self._chunk_starts = np.cumsum([0] + [b.num_rows for b in batches])
        indices = self.dataset._indices
        self._indices = indices.column(0).to_numpy() if indices is not None else None

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "columns": self.columns, "_chunks": None}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        if self._chunks is None:
            self._prepare()
        rows = np.asarray(indices, dtype=np.int64)
        if len(rows) and (rows.min() < -len(self) or rows.max() >= len(self)):
            raise IndexError(f"index out of range for {len(self)} rows")
        rows = rows % max(len(self), 1)
        if self._indices is not None:
            rows = self._indices[rows]
        chunk_of = np.searchsorted(self._chunk_starts, rows, side="right") - 1
        out = []
        for r, c in zip(rows.tolist(), chunk_of.tolist()):
            cols, k = self._chunks[c], r - self._chunk_starts[c]
            out.append({name: col.row(k) for name, col in cols.items()})
        return out


def _sizes(dataset: Any, column: str) -> np.ndarray:
    if isinstance(dataset, CrystalRows):
        dataset = dataset.dataset
    values = dataset.data.table.column(column).to_numpy()
    indices = dataset._indices
    return values[indices.column(0).to_numpy()] if indices is not None else values


def atom_counts(dataset: datasets.Dataset | CrystalRows) -> np.ndarray:
    """Atoms per row (int32 numpy, from the `num_atoms` column without decoding any structure)."""
    return _sizes(dataset, "num_atoms")


def edge_counts(dataset: datasets.Dataset | CrystalRows) -> np.ndarray:
    """Edges per row (int32 numpy, from the `num_edges` column)."""
    return _sizes(dataset, "num_edges")


_NOT_BATCHED = ("id", "source", "index")


def collate_graphs(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """A sparse graph batch from rows (`CrystalRows` or numpy-formatted dataset rows).

    `atomic_numbers` Long [N], `positions` Float [N, 3], `cell` Float [B, 3, 3], `batch` Long [N]
    (graph of each atom), `num_atoms` / `num_edges` Long [B], `edge_src` / `edge_dst` Long [E]
    (offset to batch-global atom indices), `edge_shift` Float [E, 3], `lattice_shifts` Float
    [B, 3, 3], `target` Float [B] or [B, T]; per-atom columns (`atom_*`) are concatenated ([N, ...]),
    other numeric columns stacked ([B, ...]). Edge vectors: `positions[edge_src] + edge_shift @
    cell[batch[edge_dst]] - positions[edge_dst]`.
    """
    num_atoms = np.array([len(r["atomic_numbers"]) for r in rows], dtype=np.int64)
    num_edges = np.array([len(r["edge_src"]) for r in rows], dtype=np.int64)
    atom_offset = np.repeat(np.cumsum(num_atoms) - num_atoms, num_edges)
    cat = np.concatenate
    out = {
        "atomic_numbers": torch.from_numpy(cat([r["atomic_numbers"] for r in rows]).astype(np.int64)),
        "positions": torch.from_numpy(cat([np.asarray(r["positions"], np.float32).reshape(-1, 3) for r in rows])),
        "cell": torch.from_numpy(np.stack([np.asarray(r["cell"], np.float32).reshape(3, 3) for r in rows])),
        "batch": torch.from_numpy(np.repeat(np.arange(len(rows)), num_atoms)),
        "num_atoms": torch.from_numpy(num_atoms),
        "num_edges": torch.from_numpy(num_edges),
        "edge_src": torch.from_numpy(cat([r["edge_src"] for r in rows]).astype(np.int64) + atom_offset),
        "edge_dst": torch.from_numpy(cat([r["edge_dst"] for r in rows]).astype(np.int64) + atom_offset),
        "edge_shift": torch.from_numpy(cat([np.asarray(r["edge_shift"]).reshape(-1, 3) for r in rows])
                                       .astype(np.float32)),
    }
    for key in rows[0]:
        if key in out or key in _NOT_BATCHED:
            continue
        if key.startswith("atom_"):
            out[key] = torch.from_numpy(cat([np.asarray(r[key], np.float32) for r in rows]))
        else:
            out[key] = torch.from_numpy(np.stack([np.asarray(r[key], np.float32) for r in rows]))
    return out


def split_by_id(ids: Sequence[str], fractions: Sequence[float], seed: int = 0) -> list[np.ndarray]:
    """Index arrays (ascending) of a split into len(fractions) parts, a function of the id set alone.

    Ids are ordered by a keyed blake2b hash (seeded; not Python's per-process `hash`) and cut at
    the rounded cumulative fractions, so the split does not depend on the input order, sizes are
    exact, and every process / rank computes the same split. Fractions must sum to 1.
    """
    fractions = [float(f) for f in fractions]
    if any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"fractions must be >= 0 and sum to 1, got {fractions}")
    if len(set(ids)) != len(ids):
        raise ValueError("ids must be unique")
    key = str(seed).encode()
    hashes = [hashlib.blake2b(str(i).encode(), digest_size=8, key=key).digest() for i in ids]
    order = sorted(range(len(ids)), key=lambda k: (hashes[k], str(ids[k])))
    cuts = np.round(np.cumsum([0.0] + fractions) * len(ids)).astype(int)
    return [np.sort(np.asarray(order[cuts[k]:cuts[k + 1]], dtype=np.int64)) for k in range(len(fractions))]


def build_crystal_splits(train: Any, *, test: Any = None, validation: Any = None,
                         fractions: dict[str, float] | None = None, seed: int = 0,
                         **kwargs: Any) -> dict[str, datasets.Dataset]:
    """Named splits: given files (e.g. mlearn training.json / test.json) and/or id-hashed fractions.

    `train` is built with `build_crystal_dataset(**kwargs)`; `test` / `validation`, if given, are
    built the same way. `fractions` (e.g. {"train": 0.9, "validation": 0.1}) splits the `train`
    source by `split_by_id`; without it the train source is the "train" split as a whole.
    """
    base = build_crystal_dataset(train, **kwargs)
    out: dict[str, datasets.Dataset] = {}
    if fractions:
        names = list(fractions)
        ids = base.data.table.column("id").to_pylist()
        for name, idx in zip(names, split_by_id(ids, [fractions[n] for n in names], seed)):
            out[name] = base.select(idx)
            out[name].crystal_report = base.crystal_report
    else:
        out["train"] = base
    for name, src in (("validation", validation), ("test", test)):
        if src is not None:
            if name in out:
                raise ValueError(f"split {name!r} given both as a source and as a fraction")
            out[name] = build_crystal_dataset(src, **kwargs)
    return out

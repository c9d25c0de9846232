"""Crystal readers: files and in-memory structures in, validated records out.

Formats (each yields records, see `iter_crystals`): extended XYZ via ASE, a folder of POSCAR/CIF
files with `id_prop.csv` (the CGCNN/ALIGNN layout), mlearn JSON (pymatgen `Structure.as_dict()`
records, parsed without pymatgen; `.json.gz` too) and in-memory `ase.Atoms` / pymatgen
`Structure` lists. A record is a dict: `id`, `source`, `index`, `atomic_numbers` [n],
`positions` [n, 3] (Cartesian Å), `cell` [3, 3] (rows are lattice vectors, Å), `pbc` [3],
`target` (float, or list of floats) and, if asked for, `atom_target` / extra columns
(`atom_forces`, `stress`, ...). Geometry comes as numpy arrays. Columns holding one row per atom
are named `atom_*`, which is how `collate_graphs` tells them from per-structure columns.

Bad input (missing / NaN / inf target, singular or near-singular cell, atoms closer than
`MIN_DISTANCE` including periodic images, unknown elements, disordered sites, empty structures,
non-periodic structures, missing or unreadable files, duplicate ids) raises `CrystalDataError`
naming the file, the record (index and id), the field and the reason; with `on_invalid="skip"` the
record is skipped and counted by reason (a logged warning and `CrystalReport.skipped`). Nothing is
dropped silently.
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import io
import json
import logging
import os
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from trainer.data.graphs import neighbor_pairs
from trainer.errors import DataError

logger = logging.getLogger(__name__)

MIN_DISTANCE = 0.1
"""Å: atoms (or periodic images) closer than this are 'overlapping atoms'."""
MIN_VOLUME_PER_ATOM = 1e-3
"""Å^3: a cell with less volume per atom is 'singular'."""
PARSE_CALLS = 0
"""Number of files / in-memory lists opened for parsing (tests use it to prove cache hits)."""

MLEARN_SAMPLES = {"mlearn_Si_training": "mlearn_Si_training.json.gz", "mlearn_Si_test": "mlearn_Si_test.json.gz",
                  "mlearn_Mo_training_39": "mlearn_Mo_training_39.json.gz", "mlearn_Mo_test_5": "mlearn_Mo_test_5.json.gz"}
"""Bundled mlearn files: Si training and test complete, Mo every 5th record (samples/README.md)."""
BUNDLED_SAMPLES = {**MLEARN_SAMPLES, "jarvis_bandgap_50": "jarvis_bandgap_50"}
"""Every bundled crystal set: name -> file or folder under samples/ (the JARVIS set is a POSCAR folder + id_prop.csv)."""
_SAMPLES = Path(__file__).resolve().parent / "samples"
_MLEARN_ALIASES = {"stress": "virial_stress"}


def bundled_crystal_path(name: str = "mlearn_Si_training") -> Path:
    """Path of a bundled crystal set (`BUNDLED_SAMPLES`): "mlearn_Si_training", "mlearn_Si_test",
    "mlearn_Mo_training_39", "mlearn_Mo_test_5" (file name also accepted) or "jarvis_bandgap_50" (a folder).

    Provenance: trainer/families/crystals/samples/README.md.
    """
    key = name.removesuffix(".json.gz").removesuffix(".json")
    if key not in BUNDLED_SAMPLES:
        raise KeyError(f"no bundled crystal set {name!r}; have {sorted(BUNDLED_SAMPLES)}")
    return _SAMPLES / BUNDLED_SAMPLES[key]


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


def skip_or_raise(err: CrystalDataError, on_invalid: str, skipped: Counter) -> None:
    if on_invalid == "error":
        raise err
    skipped[err.reason] += 1
    logger.debug("skipped: %s", err)


def log_skips(skipped: Counter, total: int, what: str) -> None:
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
        k = int(bad[0])
        return "atomic_numbers", "unknown_element", (f"unknown element at atom {k}: atomic number {int(numbers[k])} "
                                                     f"is not a chemical element (1-{max_z})")
    if positions.shape != (n, 3):
        return "positions", "bad_value", f"positions must be {n} rows of 3, got shape {positions.shape}"
    nonfinite = np.flatnonzero(~np.isfinite(positions).all(axis=1))
    if len(nonfinite):
        k = int(nonfinite[0])
        return "positions", "bad_value", (f"non-finite position {positions[k].tolist()} of atom {k} "
                                          f"({len(nonfinite)} atoms with NaN/inf coordinates)")
    if not np.all(pbc):
        return "pbc", "non_periodic", f"pbc={pbc.tolist()}: a periodic graph needs periodic boundaries on all 3 axes"
    if cell.shape != (3, 3) or not np.isfinite(cell).all():
        return "cell", "bad_value", f"cell must be a finite 3x3 matrix, got {cell.tolist()}"
    volume = abs(float(np.linalg.det(cell)))
    if volume < MIN_VOLUME_PER_ATOM * n:
        return "cell", "singular_cell", (f"cell volume {volume:.3g} Å^3 < {MIN_VOLUME_PER_ATOM} Å^3 per atom "
                                         f"x {n} atoms (singular lattice)")
    return None


def overlap_detail(i: np.ndarray, j: np.ndarray, S: np.ndarray, d: np.ndarray) -> str | None:
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
    return overlap_detail(i, j, S, d)


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


def _iter_extxyz(path: Path, spec: TargetSpec, id_key: str | None, check_overlap: bool, text: bytes,
                 start: int) -> Iterator[Any]:
    """Records of the extended XYZ frames `text`, frame `start` onward of `path` (one `ReadChunk`)."""
    import ase.io

    source = str(path)
    index = start - 1
    try:
        # iread rather than read(":"): a broken frame is reported with its index.
        frames = ase.io.iread(io.StringIO(text.decode("utf-8")), index=":", format="extxyz")
        for index, atoms in enumerate(frames, start):
            rid = str(atoms.info[id_key]) if id_key and id_key in atoms.info else f"{_short(path)}#{index}"
            yield _record(source, index, rid, atoms.numbers, atoms.positions, atoms.cell.array, atoms.pbc,
                          _ase_lookup(atoms), spec, check_overlap)
    except KeyError as e:
        # ASE looks each species symbol up in its table: a KeyError names a symbol it does not know.
        # The frame cannot be parsed, so this is an error even with on_invalid="skip".
        raise CrystalDataError(source, index + 1, None, "species", "unknown_element",
                               f"frame {index + 1} has a site of unknown element {e.args[0]!r} (ASE cannot read it)"
                               ) from e
    except Exception as e:  # noqa: BLE001 -- ASE raises many types on malformed files
        # The reader cannot resynchronise after a malformed frame: always an error, never a skip.
        raise CrystalDataError(source, index + 1, None, "file", "unreadable",
                               f"cannot read frame {index + 1}: {type(e).__name__}: {e}") from e


def _extxyz_chunks(path: Path, size: int) -> Iterator[ReadChunk]:
    """The file cut into texts of `size` frames, by the atom count on each frame's first line: no frame is
    parsed here. A blank line ends the file, as it ends ASE's reading; a first line that is not a count is an
    error naming the frame (after the pieces before it)."""
    from trainer.data.xyz_pieces import XyzCutError, cut_xyz_frames

    with _open_binary(path) as f:
        try:
            for piece in cut_xyz_frames(f, frames=size, blank="end", truncated="keep"):
                yield ReadChunk("extxyz", str(path), piece.start, piece.text)
        except XyzCutError as e:
            raise CrystalDataError(str(path), e.index, None, "file", "unreadable",
                                   f"cannot read frame {e.index}: its first line {e.text[:80]!r} is not an atom "
                                   f"count") from None


def _row_lookup(row: Any) -> Callable[[str], tuple[np.ndarray, bool] | None]:
    """Quantities of an ASE database row: its key-value pairs (per structure), its `data` (per atom when the
    first axis is the atom count), then its stored calculator results (`energy`, `forces`, `stress`, ...)."""
    n = row.natoms
    kvp = row.key_value_pairs
    data = row.get("data") or {}

    def lookup(key: str) -> tuple[np.ndarray, bool] | None:
        if key in kvp:
            return _scalar_or_vector(kvp[key]), False
        value = data.get(key)
        if value is None and key in _ROW_RESULTS:
            value = row.get(key)
        if value is None:
            return None
        arr = np.asarray(value, dtype=np.float64)
        return arr, key == "forces" or (arr.ndim >= 1 and arr.shape[0] == n and key not in ("stress", "dipole"))
    return lookup


_ROW_RESULTS = ("energy", "free_energy", "forces", "stress", "dipole", "charges", "magmom", "magmoms")


def _is_lmdb(path: Path) -> bool:
    return path.name.lower().endswith(".aselmdb")


def _connect_db(path: Path) -> Any:
    """An open SQLite ASE database (`.db`); `.aselmdb` files are read through `_open_lmdb`."""
    import ase.db

    try:
        return ase.db.connect(str(path), type="db")
    except Exception as e:  # noqa: BLE001 -- each backend raises its own types
        raise CrystalDataError(str(path), None, None, "file", "unreadable", f"{type(e).__name__}: {e}") from e


def _open_lmdb(path: Path) -> Any:
    """A read-only LMDB environment of an `.aselmdb` file, opened as ase-db-backends opens it read-only, but
    without its `LMDBDatabase`, whose constructor lists every row id (a list of N Python ints per process)."""
    try:
        import lmdb
        if importlib.util.find_spec("ase_db_backends") is None:  # the rows' decoder (the crystals extra)
            raise ImportError("ase_db_backends")
    except ImportError as e:
        raise CrystalDataError(str(path), None, None, "file", "unreadable",
                               "reading .aselmdb needs the ase-db-backends package (the crystals extra)") from e
    try:
        return lmdb.open(str(path), subdir=False, readonly=True, lock=False, meminit=False, readahead=True)
    except Exception as e:  # noqa: BLE001 -- lmdb raises its own types on a file that is not a database
        raise CrystalDataError(str(path), None, None, "file", "unreadable", f"{type(e).__name__}: {e}") from e


def _lmdb_header(txn: Any, key: str) -> Any:
    """A bookkeeping value of an `.aselmdb` (`nextid`: an int, `deleted_ids`: a list of ints), decoded with zlib
    and json: importing ASE's database modules for two numbers would cost the parent, which cuts the file
    before any worker starts, more than reading them."""
    raw = txn.get(key.encode("ascii"))
    if raw is None:
        return None
    value = json.loads(zlib.decompress(raw))
    if isinstance(value, dict) and "__ndarray__" in value:  # ASE's JSON form of a numpy array: [shape, dtype, flat]
        value = value["__ndarray__"][2]
    return value


def _lmdb_chunks(path: Path, size: int) -> Iterator[ReadChunk]:
    """An `.aselmdb` cut into ranges of row ids holding `size` rows each. ase-db-backends stores row `i` under
    the key `str(i)` for i in 1..nextid-1 less the ids in `deleted_ids`: two keys read here give every range,
    and each reader gets the deleted ids of its own range only."""
    env = _open_lmdb(path)
    try:
        with env.begin() as txn:
            nextid = int(_lmdb_header(txn, "nextid") or 1)
            deleted = np.unique(np.asarray(_lmdb_header(txn, "deleted_ids") or [], dtype=np.int64))
    except CrystalDataError:
        raise
    except Exception as e:  # noqa: BLE001 -- a corrupt header record
        raise CrystalDataError(str(path), None, None, "file", "unreadable", f"{type(e).__name__}: {e}") from e
    finally:
        env.close()  # one open environment per file and process: each reader opens its own
    deleted = deleted[(deleted >= 1) & (deleted < nextid)]
    n = nextid - 1 - len(deleted)
    first, position = 1, 0
    while position < n:
        want = min(size, n - position)
        end = first + want
        while True:  # widen the id range until it holds `want` live rows
            lo, hi = np.searchsorted(deleted, [first, end])
            live = end - first - int(hi - lo)
            if live == want:
                break
            end += want - live
        yield ReadChunk("db", str(path), position, ("lmdb", first, end, deleted[lo:hi].tolist()))
        first, position = end, position + want


def _sqlite_chunks(path: Path, size: int) -> Iterator[ReadChunk]:
    """A SQLite ASE database cut into ranges of row ids (`systems.id`) holding `size` rows each: SQLite gives
    the first id of each range (a window over the id index), so neither an id list nor an OFFSET scan."""
    import sqlite3

    try:
        con = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
        try:
            starts = [row[0] for row in con.execute(
                "SELECT id FROM (SELECT id, row_number() OVER (ORDER BY id) - 1 AS r FROM systems) "
                "WHERE r % ? = 0 ORDER BY id", (size,))]
        finally:
            con.close()
    except sqlite3.Error as e:
        raise CrystalDataError(str(path), None, None, "file", "unreadable", f"{type(e).__name__}: {e}") from e
    for k, first in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else None
        yield ReadChunk("db", str(path), k * size, ("sqlite", first, end, []))


def _db_chunks(path: Path, size: int) -> Iterator[ReadChunk]:
    return _lmdb_chunks(path, size) if _is_lmdb(path) else _sqlite_chunks(path, size)


def _lmdb_rows(path: Path, first: int, end: int, deleted: Sequence[int]) -> Iterator[tuple[int, Any]]:
    """(row id, `AtomsRow` or the exception decoding it raised) of ids first..end-1, read by key in this
    process's own read-only environment (as `LMDBDatabase._get_row` builds a row)."""
    from ase.calculators.calculator import all_properties
    from ase.db.row import AtomsRow
    from ase_db_backends.aselmdb import decode_bytestream

    skip = set(deleted)
    env = _open_lmdb(path)
    try:
        # The range's compressed records are read first and the environment closed before any row is handed
        # on: a consumer that stops on an error must not leave it open (LMDB allows one per file and process).
        with env.begin() as txn:
            raw = [(idx, txn.get(str(idx).encode("ascii"))) for idx in range(first, end) if idx not in skip]
    finally:
        env.close()
    for idx, data in raw:
        try:
            if data is None:
                raise KeyError(f"no row with id {idx} (nextid and deleted_ids disagree)")
            dct = decode_bytestream(data, decompress=True, json_decode=True)
            for key in all_properties:
                if key in dct and isinstance(dct[key], list):
                    dct[key] = np.array(dct[key])
            dct["id"] = idx
            row = AtomsRow(dct)
        except Exception as e:  # noqa: BLE001 -- a corrupt record: zlib, JSON or the row's own checks
            yield idx, e
            continue
        yield idx, row


def _sqlite_rows(path: Path, first: int, end: int | None) -> Iterator[tuple[int, Any]]:
    """(row id, `AtomsRow` or the exception converting it raised) of ids first..end-1 of a SQLite ASE db."""
    db = _connect_db(path)
    sql = "SELECT * FROM systems WHERE id >= ?" + (" AND id < ?" if end is not None else "") + " ORDER BY id"
    with db.managed_connection() as con:
        cur = con.cursor()
        cur.execute(sql, (first,) if end is None else (first, end))
        while batch := cur.fetchmany(256):
            for values in batch:
                try:
                    yield values[0], db._convert_tuple_to_row(values)
                except Exception as e:  # noqa: BLE001 -- a corrupt blob or JSON column
                    yield values[0], e


def _iter_db(path: Path, spec: TargetSpec, id_key: str | None, check_overlap: bool, start: int,
             where: tuple[str, int, int | None, list[int]]) -> Iterator[Any]:
    """The rows of one id range of an ASE database, `.aselmdb` (fairchem's LMDB files) or `.db` (SQLite); the
    first is row `start` of the file (by position). A row that cannot be decoded is a `CrystalDataError`
    (reason "unreadable", field "row") in its place: skipped under on_invalid="skip"."""
    backend, first, end, deleted = where
    source = str(path)
    rows = _lmdb_rows(path, first, end, deleted) if backend == "lmdb" else _sqlite_rows(path, first, end)
    for index, (idx, row) in enumerate(rows, start):
        rid = f"{_short(path)}#{idx}"
        if isinstance(row, Exception):
            yield CrystalDataError(source, index, rid, "row", "unreadable",
                                   f"cannot decode row id {idx}: {type(row).__name__}: {row}")
            continue
        try:
            kvp = row.key_value_pairs
            if id_key and id_key in kvp:
                rid = str(kvp[id_key])
            item = _record(source, index, rid, row.numbers, row.positions, row.cell, row.pbc, _row_lookup(row),
                           spec, check_overlap)
        except Exception as e:  # noqa: BLE001 -- a decoded row missing its structure fields
            item = CrystalDataError(source, index, rid, "row", "unreadable",
                                    f"cannot read row id {idx}: {type(e).__name__}: {e}")
        yield item


def _short(path: Path) -> str:
    """Record-id prefix: the parent folder and file name (Si/training.json), unique enough across sets."""
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def _open_binary(path: Path) -> io.BufferedIOBase:
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")  # type: ignore[return-value]


def _open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")  # type: ignore[return-value]
    return open(path, encoding="utf-8")


MLEARN_READ_CHARS = 1 << 20
"""Characters of an mlearn JSON file read at a time while it is cut into records."""


def _json_list_items(f: io.TextIOBase, source: str) -> Iterator[str]:
    """The JSON text of each item of the top-level list in `f`, one at a time: the file is read
    `MLEARN_READ_CHARS` at a time and each item is found by `json.JSONDecoder.raw_decode`, so only the item being
    read and one block are held. A file that is not a JSON list, or a broken item, is an error naming the item."""
    decoder = json.JSONDecoder()
    buf, pos, eof, index = "", 0, False, 0

    def more() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        block = f.read(MLEARN_READ_CHARS)
        eof = not block
        buf, pos = buf[pos:] + block, 0
        return not eof

    def skip_space() -> str:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or not more():
                return buf[pos] if pos < len(buf) else ""

    def fail(detail: str) -> CrystalDataError:
        return CrystalDataError(source, index, None, "file", "unreadable", detail)

    if skip_space() != "[":
        raise CrystalDataError(source, None, None, "file", "unreadable", "expected a JSON list of records")
    pos += 1
    def end_of_list() -> None:  # `json.load` refuses anything after the list: so does this
        nonlocal pos
        pos += 1
        if skip_space():
            raise CrystalDataError(source, None, None, "file", "unreadable",
                                   f"extra data after the list of {index} records")

    if skip_space() == "]":
        return end_of_list()
    while True:
        while True:
            try:
                _, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if more():
                    continue
                raise fail(f"record {index} is not valid JSON: {e.msg}") from None
            if end < len(buf) or eof or not more():  # a number at the block's end may go on in the next one
                break
        yield buf[pos:end]
        index += 1
        pos = end
        sep = skip_space()
        if sep == "]":
            return end_of_list()
        if sep != ",":
            raise fail(f"expected ',' or ']' after record {index - 1}, found {sep[:1]!r}" if sep
                       else f"the file ends inside the list, after record {index - 1}")
        pos += 1
        skip_space()


def _mlearn_chunks(path: Path, size: int) -> Iterator[ReadChunk]:
    """An mlearn JSON list cut into the JSON text of `size` records at a time, streamed (`_json_list_items`): this
    process never holds the whole file, and the workers parse the records."""
    source = str(path)
    try:
        with _open_text(path) as f:
            items: list[str] = []
            start = 0
            for text in _json_list_items(f, source):
                items.append(text)
                if len(items) == size:
                    yield ReadChunk("mlearn", source, start, "[" + ",".join(items) + "]")
                    start, items = start + size, []
            if items:
                yield ReadChunk("mlearn", source, start, "[" + ",".join(items) + "]")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise CrystalDataError(source, None, None, "file", "unreadable", f"{type(e).__name__}: {e}") from e


def _iter_mlearn(path: Path, spec: TargetSpec, check_overlap: bool, text: str, start: int) -> Iterator[Any]:
    """mlearn JSON records, the JSON list `text` (from record `start` of `path`): {structure:
    Structure.as_dict(), outputs: {energy, forces, virial_stress}}."""
    source = str(path)
    data = json.loads(text)
    table, _ = _elements_table()
    prefix = _short(path)
    for index, item in enumerate(data, start):
        rid = f"{prefix}#{index}"

        def err(field_: str, reason: str, detail: str, index: int = index, rid: str = rid) -> CrystalDataError:
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

        def lookup(key: str, outputs=outputs, item=item, n=len(numbers)) -> tuple[np.ndarray, bool] | None:
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


def _id_prop_chunks(folder: Path, id_prop: str, size: int) -> Iterator[ReadChunk]:
    """The rows of `id_prop` (file name and value: small), `size` at a time; the structure files are read by
    whoever reads the chunk."""
    csv_path = folder / id_prop
    if not csv_path.exists():
        raise CrystalDataError(str(folder), None, None, "file", "missing_file",
                               f"no {id_prop} in the folder, nor ASE database files ({', '.join(DATABASE_SUFFIXES)})")
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = [row for row in csv.reader(f) if row and any(c.strip() for c in row)]
    # Tolerate one header row (its second field is not a number).
    if rows and len(rows[0]) > 1 and not _is_number(rows[0][1]):
        rows = rows[1:]
    for lo in range(0, len(rows), size):
        yield ReadChunk("id_prop", str(csv_path), lo, rows[lo:lo + size])


def _iter_id_prop(csv_path: Path, spec: TargetSpec, check_overlap: bool, rows: list[list[str]],
                  start: int) -> Iterator[Any]:
    """`rows` of an id_prop.csv (from row `start`): `filename,value[,value...]`, the files beside it."""
    import ase.io

    folder = csv_path.parent
    source = str(csv_path)
    for index, row in enumerate(rows, start):
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
            # By symbol, not `Z`: a pymatgen DummySpecies ("Xx") has a `Z` that is a salted hash.
            table, _ = _elements_table()
            symbols = [str(getattr(sp, "symbol", sp)) for sp in obj.species]
            numbers = [table.get(sym, 0) for sym in symbols]
            if 0 in numbers:
                k = numbers.index(0)
                yield CrystalDataError(source, index, rid, f"species[{k}]", "unknown_element",
                                       f"unknown element {symbols[k]!r} at site {k}")
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
            label = labels[index]
            if label is None:
                yield CrystalDataError(source, index, rid, "target", "missing_target", "the label is None")
                continue
            if isinstance(label, (bool, np.bool_)):  # float(True) is 1.0: almost surely not a target
                yield CrystalDataError(source, index, rid, "target", "bad_value", f"the label is a bool ({label})")
                continue

            # The label is the target; `keep` extras still come from the structure.
            def labelled(key: str, label=label, inner=lookup) -> tuple[np.ndarray, bool] | None:
                if key != "target":
                    return inner(key)
                return np.asarray(label, dtype=np.float64), False

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
    if name.endswith((".aselmdb", ".db")):
        return "db"
    raise ValueError(f"{path}: unknown crystal source (expected a folder with id_prop.csv, mlearn .json[.gz], "
                     f"extended XYZ .xyz/.extxyz[.gz] or an ASE database .aselmdb/.db)")


DATABASE_SUFFIXES = (".aselmdb", ".db")
"""ASE database files, which a folder may hold instead of an id_prop file (fairchem ships each OMat24 / OMol25 split
as a folder of `.aselmdb` files)."""


def database_files(folder: Path, id_prop: str = "id_prop.csv") -> list[Path]:
    """The ASE database files of `folder` in name order, when it holds some and no `id_prop` file; else []."""
    if not folder.is_dir() or (folder / id_prop).exists():
        return []
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.lower().endswith(DATABASE_SUFFIXES))
    if files:
        logger.info("%s: read as its %d ASE database files (%s%s)", folder, len(files), files[0].name,
                    f" ... {files[-1].name}" if len(files) > 1 else "")
    return files


def as_sources(source: Any, id_prop: str = "id_prop.csv") -> tuple[list[Path], list[Any] | None]:
    """(paths, in-memory structures): exactly one of them is non-empty. A folder of ASE databases
    (`database_files`) stands for its database files."""
    if isinstance(source, (str, os.PathLike)):
        items: list[Any] = [source]
    else:
        items = list(source)
    if not items or not all(isinstance(s, (str, os.PathLike)) for s in items):
        return [], items
    paths: list[Path] = []
    for item in map(Path, items):
        paths.extend(database_files(item, id_prop) or [item])
    return paths, None


def _iter_items(source: Any, spec: TargetSpec, *, labels: Sequence[Any] | None = None,
                ids: Sequence[str] | None = None, id_key: str | None = None, id_prop: str = "id_prop.csv",
                check_overlap: bool = True) -> Iterator[Any]:
    """Records and `CrystalDataError`s of every input, in order."""
    paths, objects = as_sources(source, id_prop)
    if objects is not None:
        yield from _iter_objects(objects, labels, ids, spec, check_overlap)
        return
    if labels is not None or ids is not None:
        raise ValueError("labels / ids are for in-memory structures; files carry their own")
    for chunk in iter_chunks(paths, CHUNK_RECORDS, id_prop):
        yield from read_chunk(chunk, spec, id_key, check_overlap)


CHUNK_RECORDS = 1024
"""Structures per `ReadChunk` when a reader goes through a whole input (`iter_crystals`)."""


@dataclass(frozen=True)
class ReadChunk:
    """A piece of one input file that a worker reads on its own: `start` is the index of its first record in
    the file; `payload` is what the worker needs beside the path (extxyz: the frames' text; ASE db: the
    backend and the range of row ids; mlearn: the records' JSON text; id_prop: the CSV rows). Small enough to
    pickle."""

    kind: str
    path: str
    start: int
    payload: Any


def iter_chunks(paths: Sequence[Path], size: int, id_prop: str = "id_prop.csv") -> Iterator[ReadChunk]:
    """Every input cut into `ReadChunk`s of up to `size` records, in file order, without parsing a structure:
    an extxyz is cut by the frames' atom-count lines, an ASE database by ranges of row ids, a POSCAR/CIF folder by
    the rows of its id_prop.csv, an mlearn JSON list by its items (streamed)."""
    global PARSE_CALLS
    for path in paths:
        if not path.exists():
            raise CrystalDataError(str(path), None, None, "file", "missing_file", "no such file or folder")
        kind = _source_kind(path)
        PARSE_CALLS += 1
        if kind == "id_prop":
            yield from _id_prop_chunks(path, id_prop, size)
        elif kind == "mlearn":
            yield from _mlearn_chunks(path, size)
        elif kind == "db":
            yield from _db_chunks(path, size)
        else:
            yield from _extxyz_chunks(path, size)


def read_chunk(chunk: ReadChunk, spec: TargetSpec, id_key: str | None = None,
               check_overlap: bool = True) -> Iterator[dict[str, Any] | CrystalDataError]:
    """The records and `CrystalDataError`s of one chunk, in order (duplicate ids are not checked here: that
    needs every chunk; `iter_crystals` and the dataset build do it)."""
    path = Path(chunk.path)
    if chunk.kind == "extxyz":
        return _iter_extxyz(path, spec, id_key, check_overlap, chunk.payload, chunk.start)
    if chunk.kind == "db":
        return _iter_db(path, spec, id_key, check_overlap, chunk.start, chunk.payload)
    if chunk.kind == "mlearn":
        return _iter_mlearn(path, spec, check_overlap, chunk.payload, chunk.start)
    if chunk.kind == "id_prop":
        return _iter_id_prop(path, spec, check_overlap, chunk.payload, chunk.start)
    raise ValueError(f"unknown chunk kind {chunk.kind!r}")


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
            skip_or_raise(item, on_invalid, skipped)
            continue
        if item["id"] in seen:
            skip_or_raise(CrystalDataError(item["source"], None, item["id"], "id", "duplicate_id",
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


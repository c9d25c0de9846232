"""Molecule datasets: the cached Arrow build, fast rows, the dense batch collate, splits and sampling statistics.

`build_molecule_dataset` reads a source (`readers.iter_molecules`; a file in parallel pieces, `pieces`) once
per (input file's path, size and mtime, or in-memory content; reader options) into the shared fingerprinted Arrow cache
(`trainer.data.arrow_cache`); later calls load the memory-mapped file without parsing. Columns: `id`,
`numbers` (list<int8>), `positions` (list<[3] float32>, Angstrom), `num_atoms` (int32), `edm_smiles`
(string, null when invalid: `metrics.molecule_smiles` of the geometry, so training SMILES and
generated SMILES come from one function) and every per-molecule property of the records (nullable;
a property named like a core column is stored as `info_<name>`).

`MoleculeRows` serves rows as numpy arrays, `collate_molecules` pads them into EDM's dense batch, and
`split_molecule_dataset` splits by id hash (`trainer.data.splits`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import torch

from trainer.data.arrow_cache import (
    ListColumn,
    build_shards,
    cache_root,
    column_rows,
    digest,
    file_keys,
    load_arrow,
    read_meta,
    selected_column,
    write_meta,
)
from trainer.data.splits import split_indices
from trainer.errors import DataError
from trainer.families.molecules_edm.molecule import QM9_ELEMENTS, Molecule
from trainer.families.molecules_edm.pieces import (
    ARROW_BATCH,  # noqa: F401  (re-exported)
    CORE_COLUMNS,
    build_piece,
    cut_molecule_file,
    merge_schema,
    piece_bytes_for,
    write_molecule_rows,
)
from trainer.families.molecules_edm.readers import (
    MIN_DISTANCE,
    MoleculeDataError,
    ReadReport,
    check_policy,
    element_numbers,
    is_path_source,
    iter_molecules,
    log_skips,
)

FORMAT_VERSION = "molecules-edm-v2"
"""Bump when the reader or the columns change, so that old caches are not reused."""


# --------------------------------------------------------------------------------------------------
# the build


def _molecules_digest(molecules: list[Molecule]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for m in molecules:
        h.update(np.ascontiguousarray(m.numbers, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(m.positions, dtype=np.float64).tobytes())
        h.update(json.dumps(m.info, sort_keys=True, default=str).encode())
    return h.hexdigest()


SMILES_CHUNK = 4096
"""Molecules per task of the parallel SMILES perception."""


def _perceive_smiles(molecules: list[Molecule], num_proc: int | None) -> list[str | None]:
    """`metrics.smiles_of` every molecule, in order: in a spawn pool of `num_proc` (None: the cores) when there is
    more than one chunk of `SMILES_CHUNK` (RDKit's perception is the costly part of a build; a pool's start is not
    worth it for a small set). The task lives in `metrics`, not here: a spawned worker imports its task's module,
    and this one imports torch."""
    import multiprocessing
    import os

    from trainer.families.molecules_edm.metrics import smiles_of

    geometries = [(m.numbers, m.positions) for m in molecules]
    chunks = [geometries[a:a + SMILES_CHUNK] for a in range(0, len(geometries), SMILES_CHUNK)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(len(chunks), cores if num_proc is None else max(1, int(num_proc)))
    if workers <= 1:
        return [s for chunk in chunks for s in smiles_of(chunk)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:  # spawn: see arrow_cache.build_shards
        return [s for part in pool.imap(smiles_of, chunks) for s in part]


def _cores() -> int:
    return max(1, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _build_file(path: Path, root: Path, fingerprint: str, settings: dict[str, Any],
                num_proc: int | None) -> tuple[list[str], ReadReport]:
    """Build the shards of an xyz/SDF file in parallel: the file cut into pieces (`pieces.cut_molecule_file`, by
    its size, the same for any `num_proc`), each piece parsed, validated, perceived and written by a worker
    (`pieces.build_piece`). Returns the shard names, in file order, and the report.

    A worker sees its piece alone; the parent settles the rest from the results, in file order, so the rows are
    those of a serial read: a kept id that an earlier piece kept is a `duplicate_id` (with on_invalid="error",
    raised before any later error), and the property columns get the types the whole file's values give them.
    A piece whose shard needs either is rebuilt with the ids to treat as seen and the columns to write (rare: a
    duplicate across pieces, or a property whose values differ in class between pieces)."""
    workers = _cores() if num_proc is None else max(1, int(num_proc))
    name, on_invalid = str(path), settings["on_invalid"]
    size = piece_bytes_for(path)
    seen: set[str] = set()
    dropped: dict[int, list[str]] = {}
    order: list[tuple[tuple[str, str], ...]] = []  # the kept records' property signatures, first use first
    results: list[dict[str, Any]] = []
    renamed: list[str] = []
    cut_error: list[MoleculeDataError] = []

    def shard(k: int) -> str:
        return f"{fingerprint}-{k:05d}.arrow"

    def jobs(selected: dict[int, tuple[Any, list[str]]] | None = None) -> Iterator[tuple[Any, tuple, Path]]:
        try:
            for k, piece in enumerate(cut_molecule_file(path, size)):
                if selected is None:
                    yield build_piece, (piece, settings, None, ()), root / shard(k)
                elif k in selected:
                    yield build_piece, (piece, settings, *selected[k]), root / shard(k)
        except MoleculeDataError as e:  # raised after every earlier piece's own errors (below)
            cut_error.append(e)

    def collected(k: int, result: dict[str, Any]) -> None:
        sig_of = np.frombuffer(result["signature_of"], dtype=np.uint32)
        keep = np.ones(len(result["ids"]), dtype=bool)
        for pos, (index, rid) in enumerate(zip(result["indices"], result["ids"])):
            if rid in seen:
                if on_invalid == "error":
                    raise MoleculeDataError(name, index, rid, "duplicate_id", "an earlier record has the same id")
                dropped.setdefault(k, []).append(rid)
                keep[pos] = False
            else:
                seen.add(rid)
        if result["error"] is not None:
            raise result["error"]
        used = dict.fromkeys(sig_of[keep].tolist()) if k in dropped else range(len(result["signatures"]))
        order.extend(result["signatures"][i] for i in used)
        result["kept"] = int(keep.sum())
        del result["ids"], result["indices"], result["signature_of"]  # the parent keeps only `seen`
        results.append(result)

    try:
        build_shards(jobs(), workers, on_done=collected, renamed=renamed)
        if cut_error:
            raise cut_error[0]
        schema = merge_schema(order)
        redo = {k: (schema, dropped.get(k, [])) for k, r in enumerate(results)
                if r["kept"] and (k in dropped or r["schema"] != schema)}
        if redo:
            again = build_shards(jobs(redo), workers, renamed=renamed)
            for k, result in zip(sorted(redo), again):
                if len(result["ids"]) != results[k]["kept"] or result["error"] is not None:
                    raise RuntimeError(f"{name}: piece {k} gave {len(result['ids'])} molecules when rebuilt, "
                                       f"{results[k]['kept']} before (did the file change during the build?)")
    except BaseException:
        for final in renamed:
            Path(final).unlink(missing_ok=True)
        raise
    shards = [shard(k) for k, r in enumerate(results) if r["kept"]]
    for k, r in enumerate(results):
        if not r["kept"]:
            (root / shard(k)).unlink(missing_ok=True)
    skipped: Counter = Counter()
    for r in results:
        skipped.update(r["skipped"])
    duplicates = sum(len(v) for v in dropped.values())
    if duplicates:
        skipped["duplicate_id"] += duplicates
    kept = sum(r["kept"] for r in results)
    if not kept:
        for s in shards:
            (root / s).unlink(missing_ok=True)
        raise MoleculeDataError(name, None, None, "no_records", f"no valid molecules ({dict(skipped)} skipped)")
    return shards, ReadReport(kept + sum(skipped.values()), kept, dict(skipped))


def build_molecule_dataset(source: str | Path | Sequence[Any], elements: Sequence[str] = QM9_ELEMENTS,
                           cache_dir: str | Path | None = None, *, min_distance: float = MIN_DISTANCE,
                           on_invalid: str = "error", id_key: str | None = None, add_hydrogens: bool = True,
                           compute_smiles: bool = True, num_proc: int | None = 1) -> datasets.Dataset:
    """Read `source` (an .xyz/.extxyz/.sdf path, optionally .gz, or a list of `ase.Atoms` / `Molecule`)
    into the shared Arrow cache and return it memory-mapped (no format set; use `MoleculeRows`).

    The fingerprint covers the input file's absolute path, size and mtime (or the in-memory content),
    `elements`, `min_distance`, `on_invalid`, `id_key`, `add_hydrogens` and `compute_smiles`; a repeated
    call loads the cached file without parsing, any change rebuilds. `compute_smiles` stores
    `edm_smiles` (EDM's SMILES of each geometry, for novelty), perceived once per build. A file is built by
    `num_proc` processes (None: the cores this process may use; not part of the fingerprint): cut into pieces of
    whole records by the parent, each parsed, validated, perceived and written to its own shard by a worker
    (`_build_file`); the rows, ids, skips and errors are those of a serial read for any `num_proc`. The result
    has a `molecule_report` attribute (`readers.ReadReport`, the same on a cache hit) and `cache_hit` (bool).
    """
    elements = tuple(str(e) for e in elements)
    element_numbers(elements)  # an unknown symbol fails here, before any parsing
    check_policy(on_invalid)
    settings = {"version": FORMAT_VERSION, "elements": list(elements), "min_distance": float(min_distance),
                "on_invalid": on_invalid, "id_key": id_key, "add_hydrogens": bool(add_hydrogens),
                "compute_smiles": bool(compute_smiles)}
    read_kwargs = dict(elements=elements, min_distance=min_distance, on_invalid=on_invalid, id_key=id_key,
                       add_hydrogens=add_hydrogens)
    skipped: Counter = Counter()
    molecules: list[Molecule] | None = None
    if is_path_source(source):
        path = Path(source)
        if not path.is_file():
            raise MoleculeDataError(str(path), None, None, "missing_file", "no such file")
        inputs: Any = file_keys(path)
        name = str(path)
    else:
        molecules = list(iter_molecules(list(source), skipped=skipped, **read_kwargs))  # type: ignore[arg-type]
        inputs = {"in_memory": _molecules_digest(molecules), "skipped": dict(skipped)}
        name = "<in-memory>"
    fingerprint = digest({"inputs": inputs, "settings": settings})
    root = cache_root(cache_dir, "molecules_edm")
    sidecar = root / f"{fingerprint}.json"
    meta = read_meta(sidecar)
    if meta is not None and meta.get("shards") and all((root / s).exists() for s in meta["shards"]):
        report, hit = ReadReport(meta["records"], meta["kept"], meta["skipped"]), True
    else:
        if molecules is None:
            worker_settings = {"elements": list(element_numbers(elements)), "min_distance": float(min_distance),
                               "on_invalid": on_invalid, "id_key": id_key, "add_hydrogens": bool(add_hydrogens),
                               "compute_smiles": bool(compute_smiles)}
            shards, report = _build_file(Path(source), root, fingerprint, worker_settings, num_proc)
        else:
            if not molecules:
                raise MoleculeDataError(name, None, None, "no_records",
                                        f"no valid molecules ({dict(skipped)} skipped)")
            smiles = _perceive_smiles(molecules, num_proc) if compute_smiles else None
            shards = [f"{fingerprint}.arrow"]
            build_shards([(write_molecule_rows, (molecules, smiles), root / shards[0])])
            report = ReadReport(len(molecules) + sum(skipped.values()), len(molecules), dict(skipped))
        write_meta(sidecar, {"fingerprint": fingerprint, "shards": shards, "records": report.records,
                             "kept": report.kept, "skipped": report.skipped, "settings": settings, "inputs": inputs})
        meta, hit = {"shards": shards}, False
        log_skips(Counter(report.skipped), report.records, f"molecule dataset {fingerprint[:8]}")
    ds = load_arrow([root / s for s in meta["shards"]], fingerprint)
    ds.molecule_report = report
    ds.cache_hit = hit
    return ds


# --------------------------------------------------------------------------------------------------
# rows


class MoleculeRows(torch.utils.data.Dataset):
    """Rows of a molecule dataset: {"id": str, "numbers": int64 [n], "positions": float32 [n, 3]
    (Angstrom, as stored; a read-only view), "num_atoms": int, and the requested numeric `properties` as floats}.

    Nothing is copied per molecule: atoms are read through `ListColumn` views of the memory-mapped Arrow
    buffers and ids / properties from their Arrow columns, one row at a time, so the memory a rank or a
    DataLoader worker holds does not grow with the data set (the pages a row touches are file-backed and
    shared). Pickles as the underlying dataset; each process builds its own views on first use.
    """

    def __init__(self, dataset: datasets.Dataset, properties: Sequence[str] = ()):
        self.dataset = dataset
        self.properties = tuple(properties)
        missing = [p for p in self.properties if p not in dataset.column_names]
        if missing:
            raise DataError(f"molecule dataset has no property column(s) {missing}; it has {dataset.column_names}")
        self._cache: dict[str, Any] | None = None

    def _prepare(self) -> dict[str, Any]:
        if self._cache is None:
            table = self.dataset.with_format(None).data
            numbers, positions = ListColumn(self.dataset, "numbers"), ListColumn(self.dataset, "positions")
            if [len(o) for o in numbers.offsets] != [len(o) for o in positions.offsets]:
                raise DataError("molecule dataset: numbers and positions disagree on row chunks (corrupt cache?)")
            self._cache = {
                "numbers": numbers, "positions": positions, "ids": table.column("id"),
                "properties": {p: table.column(p) for p in self.properties},
            }
        return self._cache

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "properties": self.properties, "_cache": None}

    @property
    def num_atoms(self) -> np.ndarray:
        """Atoms per row (int64), from the `num_atoms` column without decoding any molecule."""
        return selected_int_column(self.dataset, "num_atoms")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        c = self._prepare()
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} molecules")
        t = c["numbers"].table_index(index % n)
        numbers, positions = c["numbers"].table_row(t), c["positions"].table_row(t)
        if len(numbers) != len(positions):
            raise DataError(f"molecule dataset row {t}: {len(numbers)} atomic numbers but {len(positions)} positions "
                            "(corrupt cache?)")
        row = {"id": c["ids"][t].as_py(), "numbers": numbers.astype(np.int64), "positions": positions,
               "num_atoms": len(numbers)}
        for p, values in c["properties"].items():
            value = values[t].as_py()
            row[p] = float("nan") if value is None else float(value)
        return row

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return [self[int(i)] for i in indices]

    def molecule(self, index: int) -> Molecule:
        """Row `index` as a `Molecule` (positions in float64, info with the id)."""
        row = self[index]
        return Molecule(row["numbers"], row["positions"], {"id": row["id"]})


def dataset_molecules(dataset: datasets.Dataset | MoleculeRows) -> list[Molecule]:
    """Every row as a `Molecule` with its id and properties in `info` (for evaluation and writers)."""
    base = dataset.dataset if isinstance(dataset, MoleculeRows) else dataset
    rows = MoleculeRows(base)
    extra = [c for c in base.column_names if c not in CORE_COLUMNS]
    values = {c: selected_column(base, c).to_pylist() for c in extra}
    out = []
    for k in range(len(rows)):
        mol = rows.molecule(k)
        mol.info.update({c: values[c][k] for c in extra if values[c][k] is not None})
        out.append(mol)
    return out


# --------------------------------------------------------------------------------------------------
# batches


@functools.lru_cache(maxsize=16)
def _type_index(elements: tuple[str, ...]) -> np.ndarray:
    """[119] one-hot index by atomic number (-1: not in the vocabulary)."""
    table = np.full(119, -1, dtype=np.int64)
    for k, z in enumerate(element_numbers(elements)):
        table[z] = k
    return table


def molecule_key(molecule_id: Any) -> int:
    """A stable 63-bit key of a molecule id (its evaluation draws are seeded by it)."""
    return int.from_bytes(hashlib.blake2b(str(molecule_id).encode(), digest_size=8).digest(), "little") >> 1


def collate_molecules(rows: Sequence[dict[str, Any]], elements: Sequence[str] = QM9_ELEMENTS,
                      max_atoms: int | None = None) -> dict[str, torch.Tensor]:
    """EDM's dense batch from rows (`MoleculeRows` items, or dicts with `numbers` and `positions`).

    `positions` Float [B, N, 3] (each molecule's mean over its atoms subtracted: zero centre of mass
    with unit masses, as EDM; zero at padding), `one_hot` Float [B, N, F] (F = len(elements), the
    vocabulary's order), `charges` Float [B, N] (atomic number), `node_mask` Bool [B, N], `num_atoms`
    Long [B], `molecule_key` Long [B] when every row has an `id` (`molecule_key`), and each numeric property
    the rows carry, Float [B]. N is the largest molecule, or
    `max_atoms` when given.
    """
    table = _type_index(tuple(str(e) for e in elements))
    sizes = [len(r["numbers"]) for r in rows]
    width = max(sizes, default=0) if max_atoms is None else int(max_atoms)
    if sizes and max(sizes) > width:
        k = int(np.argmax(sizes))
        raise DataError(f"molecule {rows[k].get('id', k)!r} has {sizes[k]} atoms, more than max_atoms={width}")
    batch = len(rows)
    positions = np.zeros((batch, width, 3), dtype=np.float32)
    one_hot = np.zeros((batch, width, len(elements)), dtype=np.float32)
    charges = np.zeros((batch, width), dtype=np.float32)
    mask = np.zeros((batch, width), dtype=bool)
    for b, row in enumerate(rows):
        numbers = np.asarray(row["numbers"], dtype=np.int64).reshape(-1)
        n = len(numbers)
        types = table[np.clip(numbers, 0, 118)]
        if (types < 0).any():
            k = int(np.flatnonzero(types < 0)[0])
            raise DataError(f"molecule {row.get('id', b)!r}: atom {k} has atomic number {int(numbers[k])}, "
                            f"outside the element vocabulary {list(elements)}")
        pos = np.asarray(row["positions"], dtype=np.float64).reshape(n, 3)
        positions[b, :n] = pos - pos.mean(axis=0) if n else pos
        one_hot[b, np.arange(n), types] = 1.0
        charges[b, :n] = numbers
        mask[b, :n] = True
    out = {"positions": torch.from_numpy(positions), "one_hot": torch.from_numpy(one_hot),
           "charges": torch.from_numpy(charges), "node_mask": torch.from_numpy(mask),
           "num_atoms": torch.tensor(sizes, dtype=torch.long)}
    if rows and all("id" in r for r in rows):  # what evaluation keys its draws by: the molecule, not the batch
        out["molecule_key"] = torch.tensor([molecule_key(r["id"]) for r in rows], dtype=torch.long)
    skip = {"id", "numbers", "positions", "num_atoms"}
    if rows:
        for key, value in rows[0].items():
            if key not in skip and isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
                out[key] = torch.tensor([float(r[key]) for r in rows], dtype=torch.float32)
    return out


# --------------------------------------------------------------------------------------------------
# splits and statistics


def split_molecule_dataset(dataset: datasets.Dataset, fractions: dict[str, float] | None = None,
                           seed: int = 0) -> dict[str, datasets.Dataset]:
    """Named splits by the id-hash rule (`trainer.data.splits.split_indices`, keyed by `seed`): each
    molecule's split depends on its id alone, so sizes are close to, not exactly, the fractions.
    Default {"train": 0.8, "validation": 0.1, "test": 0.1}."""
    fractions = fractions or {"train": 0.8, "validation": 0.1, "test": 0.1}
    ids = selected_column(dataset, "id").to_pylist()
    out = {}
    for name, idx in split_indices(ids, fractions, key=seed).items():
        part = dataset.select(idx)
        part.molecule_report = getattr(dataset, "molecule_report", None)
        out[name] = part
    return out


def node_count_histogram(dataset: datasets.Dataset | MoleculeRows | Sequence[Molecule]) -> dict[int, int]:
    """{number of atoms: number of molecules}, ascending, for drawing N at sampling time."""
    if isinstance(dataset, MoleculeRows):
        dataset = dataset.dataset
    if isinstance(dataset, datasets.Dataset):
        # counted chunk by chunk of the mapped column, each row as often as the selection names it: no copy of
        # the column (a whole-column Arrow gather is memory Arrow's allocator keeps) and no int64 array per row
        freq = np.zeros(0, dtype=np.int64)
        for values, weights in _weighted_chunks(dataset, "num_atoms"):
            part = _chunk_bincount(values, weights)
            if len(part) > len(freq):
                freq = np.pad(freq, (0, len(part) - len(freq)))
            freq[:len(part)] += part
        return {int(v): int(freq[v]) for v in np.flatnonzero(freq)}
    counts = np.array([m.num_atoms for m in dataset], dtype=np.int64)
    values, freq = np.unique(counts, return_counts=True)
    return {int(v): int(f) for v, f in zip(values, freq)}


def _row_weights(dataset: datasets.Dataset) -> np.ndarray | None:
    """How often the dataset's selection names each row of its underlying table (None: no selection, every row
    once): a bool mask, one byte a table row, unless a row is named twice (then int64 counts)."""
    if dataset._indices is None:
        return None
    table_rows = dataset.with_format(None).data.num_rows
    mask = np.zeros(table_rows, dtype=bool)
    named = 0
    for chunk in dataset._indices.column(0).chunks:
        mask[chunk.to_numpy()] = True  # a view of the indices' buffer: nothing per row is built
        named += len(chunk)
    if int(np.count_nonzero(mask)) == named:
        return mask
    counts = np.zeros(table_rows, dtype=np.int64)
    for chunk in dataset._indices.column(0).chunks:
        counts += np.bincount(chunk.to_numpy(), minlength=table_rows)
    return counts


def _weighted_chunks(dataset: datasets.Dataset, name: str) -> Iterator[tuple[Any, np.ndarray | None]]:
    """(Arrow chunk of column `name`, its rows' `_row_weights` slice or None for all once), chunk by chunk of the
    underlying table; chunks without a selected row are left out."""
    weights = _row_weights(dataset)
    start = 0
    for chunk in dataset.with_format(None).data.column(name).chunks:
        end = start + len(chunk)
        part = None if weights is None else weights[start:end]
        start = end
        if part is None or part.any():
            yield chunk, part


def _chunk_bincount(chunk: Any, weights: np.ndarray | None) -> np.ndarray:
    """np.bincount of an integer chunk's values, each row counted `weights` times (bool: once or not)."""
    values = chunk.to_numpy()  # a view of the mapped buffer (no nulls in a count column)
    if weights is None:
        return np.bincount(values)
    if weights.dtype == bool:
        return np.bincount(values[weights])
    return np.bincount(np.repeat(values, weights))


def selected_int_column(dataset: datasets.Dataset, name: str) -> np.ndarray:
    """Integer column `name` in the dataset's row order as int64, gathered block by block from views of the mapped
    chunks (`arrow_cache.column_rows`: Arrow's `take` would first combine the whole column in its own allocator,
    which keeps the memory)."""
    return column_rows(dataset, name, np.int64)


def _unique_strings(dataset: datasets.Dataset, name: str) -> pa.Array:
    """The distinct non-null, non-empty values of a string column over the dataset's rows, sorted (by code point,
    as Python sorts), as one Arrow array: deduplicated one chunk of the mapped column at a time (its selected rows
    only), so that neither the column nor a gather of it is copied and no value becomes a Python object."""
    import pyarrow.compute as pc

    parts = []
    for chunk, weights in _weighted_chunks(dataset, name):
        part = chunk if weights is None else chunk.filter(pa.array(weights if weights.dtype == bool else weights > 0))
        part = pc.unique(part)
        parts.append(part.filter(pc.and_kleene(pc.is_valid(part), pc.not_equal(pc.binary_length(part), 0))))
    if not parts:
        return pa.array([], dataset.with_format(None).data.schema.field(name).type)
    # The chunks' distinct values are nearly disjoint (a molecule's conformers share a shard): merged by a sort and
    # a comparison with the neighbour, which needs fewer and smaller buffers than a second hash `unique`. Each
    # step's input is dropped before the next.
    merged = pa.concat_arrays(parts)
    parts.clear()
    merged = merged.take(pc.sort_indices(merged))  # UTF-8 byte order is code-point order, as Python sorts
    if len(merged) > 1:
        first = pc.not_equal(merged.slice(1), merged.slice(0, len(merged) - 1))
        merged = merged.filter(pa.concat_arrays([pa.array([True]), first]))
    return merged


class SortedStrings(AbstractSet):
    """A set of strings held as one sorted Arrow string array: the strings' bytes plus a 4-byte offset each, where a
    Python set holds an object header and a hash-table slot per string besides (the training SMILES, one per
    molecule, are kept by every rank). `in` is a binary search; iteration is in sorted order; compares equal to a
    set of the same strings."""

    def __init__(self, values: pa.Array):
        self._values = values

    @classmethod
    def of(cls, strings: Iterable[str]) -> SortedStrings:
        """The distinct strings of `strings` (a few, or a Python set to compact)."""
        return cls(pa.array(sorted(set(strings)), pa.string()))

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self._values), 4096):  # a block of Python strings at a time
            yield from self._values.slice(start, 4096).to_pylist()

    def __contains__(self, item: object) -> bool:
        if not isinstance(item, str):
            return False
        lo, hi = 0, len(self._values)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._values[mid].as_py() < item:
                lo = mid + 1
            else:
                hi = mid
        return lo < len(self._values) and self._values[lo].as_py() == item

    @property
    def nbytes(self) -> int:
        """Bytes of the Arrow buffers that hold the strings."""
        return self._values.nbytes


def training_smiles(dataset: datasets.Dataset | MoleculeRows | Sequence[Molecule]) -> list[str]:
    """Sorted unique SMILES of the valid training molecules, for novelty.

    Always EDM's SMILES of the geometry (`metrics.molecule_smiles`, as EDM's own `compute_qm9_smiles`):
    the stored `edm_smiles` column when the dataset has it, else computed here. QM9's own `smiles`
    property is not used: for some valid QM9 molecules it differs from the geometry's SMILES (EDM's bond
    table perceives some rings and charges differently), and a
    generated copy of a training molecule would then count as novel.
    """
    return list(training_smiles_set(dataset))


def training_smiles_set(dataset: datasets.Dataset | MoleculeRows | Sequence[Molecule]) -> SortedStrings:
    """`training_smiles` as a compact set (`SortedStrings`): what a rank keeps for novelty. Read from the stored
    `edm_smiles` column without making a Python string of any SMILES."""
    if isinstance(dataset, MoleculeRows):
        dataset = dataset.dataset
    if isinstance(dataset, datasets.Dataset) and "edm_smiles" in dataset.column_names:
        values = SortedStrings(_unique_strings(dataset, "edm_smiles"))
        # the deduplication's transients are freed, but Arrow's allocator would keep their pages for the run
        pa.default_memory_pool().release_unused()
        return values
    from trainer.families.molecules_edm.metrics import molecule_smiles

    molecules = dataset_molecules(dataset) if isinstance(dataset, datasets.Dataset) else list(dataset)
    return SortedStrings.of(s for s in (molecule_smiles(m.numbers, m.positions) for m in molecules) if s)

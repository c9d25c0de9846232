"""Crystal graph datasets: the cached Arrow build, fast rows, sizes, the batch collate and splits.

`build_crystal_dataset` reads a source (`readers.iter_crystals`), builds every structure's graph
(`graphs.build_crystal_graph`) and writes Arrow shards (`shards.write_shard`, the worker's job, in a module
that imports neither torch nor `datasets`) through `trainer.data.arrow_cache`, once per
(input files' path/size/mtime or in-memory content, reader options, graph settings); a second call
loads the memory-mapped Arrow files without parsing. `CrystalRows` reads rows straight from the
Arrow buffers, `collate_graphs` turns rows into a sparse graph batch (`trainer.data.graphs`) that
always carries ComFormer's lattice coefficients, and `build_crystal_splits` splits by id hash
(`trainer.data.splits`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import torch

from trainer.data.arrow_cache import (
    build_shards,
    cache_root,
    column_rows,
    digest,
    file_keys,
    load_arrow,
    read_meta,
    select_rows,
    selected_column,
    selected_rows,
    string_rows,
    write_meta,
)
from trainer.data.graphs import collate_sparse_graphs
from trainer.data.splits import id_hashes, repeated_hashes, split_indices
from trainer.families.crystals.graphs import GraphSpec
from trainer.families.crystals.lattice import canonical_lattice_coeffs
from trainer.families.crystals.readers import (
    CrystalDataError,
    CrystalReport,
    TargetSpec,
    as_sources,
    iter_chunks,
    iter_crystals,
    log_skips,
    skip_or_raise,
)
from trainer.families.crystals.shards import ARROW_BATCH, write_shard

FORMAT_VERSION = "crystals-v2"
"""Bump when readers or graph building change their output, so that old caches are not reused.
v2: one lattice rule (`lattice.py`), stored as `lattice_coeffs` (int32)."""

SHARD_RECORDS = 4096
"""Structures per Arrow shard: one worker job reads this many from its piece of the input, builds their graphs
and writes them. Bounds what a worker holds (its structures as numpy arrays) and what the parent holds (the
pieces in flight: a few shards' worth of extxyz text or JSON items, or only row ranges of an ASE database)."""


# --------------------------------------------------------------------------------------------------
# the build (each piece is turned into a shard by `shards.write_shard`, in a worker)


def _check_schemas(results: list[dict[str, Any]]) -> None:
    """Every shard's target / extra columns are the first's (each worker checked its own records)."""
    ref = next((r for r in results if r["schema"] is not None), None)
    for r in results:
        if r["schema"] is not None and r["schema"] != ref["schema"]:
            source, index, rid = r["first"]
            raise CrystalDataError(source, index, rid, "target", "inconsistent_target",
                                   f"has columns {r['schema']}, the first record has {ref['schema']}")


def _drop_duplicates_across(paths: list[Path], hashes: list[np.ndarray], on_invalid: str) -> list[list[int]]:
    """Ids repeated across shards (each worker saw only its own): the first record keeps its id; a later one is
    an error naming it, or (`on_invalid="skip"`) removed from its shard, which is rewritten. Only the rows
    whose 64-bit hash repeats have their ids read. Returns the rows removed from each shard."""
    repeated = repeated_hashes(hashes)
    dropped: list[list[int]] = [[] for _ in paths]
    if not len(repeated):
        return dropped
    seen: set[str] = set()
    for k, (path, h) in enumerate(zip(paths, hashes)):
        rows = np.flatnonzero(np.isin(h, repeated))
        if not len(rows):
            continue
        table = datasets.Dataset.from_file(str(path)).data.table
        ids = table.column("id").take(pa.array(rows)).to_pylist()
        drop = []
        for row, rid in zip(rows.tolist(), ids):
            if rid not in seen:
                seen.add(rid)
                continue
            source = table.column("source")[row].as_py()
            skip_or_raise(CrystalDataError(source, None, rid, "id", "duplicate_id",
                                           "an earlier record has the same id"), on_invalid, Counter())
            drop.append(row)
        if drop:
            mask = np.ones(table.num_rows, dtype=bool)
            mask[drop] = False
            kept = table.filter(pa.array(mask))
            tmp = path.with_name(f".{path.name}.dedup.tmp")
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, kept.schema) as writer:
                writer.write_table(kept, max_chunksize=ARROW_BATCH)
            del table
            tmp.replace(path)
            dropped[k] = drop
    return dropped


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


def build_crystal_dataset(source: Any, *, graph: GraphSpec | None = None, target: str | Sequence[str] | None = "energy",
                          per_atom: bool = False, atom_target: str = "sum", keep: str | Sequence[str] = (),
                          labels: Sequence[Any] | None = None, ids: Sequence[str] | None = None,
                          id_key: str | None = None, id_prop: str = "id_prop.csv", on_invalid: str = "error",
                          num_proc: int | None = None, cache_dir: str | Path | None = None,
                          split_key: str | int | None = None) -> datasets.Dataset:
    """Parse `source` (see `iter_crystals`), build periodic graphs and cache them as Arrow.

    Columns: `id`, `source`, `atomic_numbers` (int16), `positions` ([n][3] float32), `cell`
    ([3][3] float32), `num_atoms`, `edge_src`, `edge_dst` (int32), `edge_shift` ([E][3] int8),
    `num_edges`, `lattice_coeffs` ([3][3] int32, ComFormer's lat1..3), `target` (float64, or a
    fixed-length list) and any `atom_target` / kept extras. The fingerprint covers every input
    file's path, size and mtime (a folder: all its files) or, for in-memory structures, their
    content; the reader options; `on_invalid`; and the graph settings. A repeated call loads the
    memory-mapped Arrow files without parsing; any changed setting rebuilds. The build streams: each
    input is cut into pieces of `SHARD_RECORDS` structures without parsing them (frames of an extxyz,
    row ranges of an ASE database, rows of an id_prop.csv), and each piece is read, validated, turned
    into graphs and written as one Arrow shard by a worker: up to `num_proc` worker processes (None
    or 1: in this process), with a few pieces in flight, so no process holds every structure. Row
    order, rows and ids do not depend on `num_proc` (ids repeated across pieces are found after the
    workers, from 64-bit hashes of the ids). A failed build
    leaves neither temp files nor shards of its own. The returned dataset has no format set: read
    rows with `CrystalRows(ds)` (fast) or `ds.with_format("numpy")`; its `crystal_report` attribute
    is a `CrystalReport` (the same on a cached load).

    `split_key` (e.g. the run's seed): the ids' split hashes under that key (`trainer.data.splits.id_hashes`)
    are computed once, by the build's workers (or, on a cached load without them, from the id column once),
    stored beside the shards and attached memory-mapped as `ds.split_hashes` (uint64, one per row): a rank
    assigns its splits from them (`assign_hashed`) without hashing every id itself. Not part of the
    fingerprint: another key reuses the graphs.
    """
    graph = graph or GraphSpec()
    if on_invalid not in ("error", "skip"):
        raise ValueError(f"on_invalid must be 'error' or 'skip', got {on_invalid!r}")
    spec = TargetSpec.make(target, atom_target, per_atom, keep)
    settings = {"version": FORMAT_VERSION, "graph": graph.to_dict(), "target": asdict(spec), "on_invalid": on_invalid,
                "id_key": id_key, "id_prop": id_prop}
    paths, objects = as_sources(source, id_prop)
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
        if labels is not None or ids is not None:
            raise ValueError("labels / ids are for in-memory structures; files carry their own")
        for p in paths:
            if not p.exists():
                raise CrystalDataError(str(p), None, None, "file", "missing_file", "no such file or folder")
        inputs = [file_keys(p) for p in paths]
    fingerprint = digest({"inputs": inputs, "settings": settings})
    root = cache_root(cache_dir, "crystal_graphs")
    sidecar = root / f"{fingerprint}.json"
    meta = read_meta(sidecar)
    if meta is not None and meta.get("shards") and all((root / s).exists() for s in meta["shards"]):
        report = CrystalReport(fingerprint, meta["records"], meta["kept"], meta["skipped"], cache_hit=True)
    else:
        if records is not None and not records:
            raise CrystalDataError("<in-memory>", None, None, "records", "no_records",
                                   f"no valid records ({dict(skipped)} skipped)")
        meta, report = _build(paths, records, spec, id_key, id_prop, graph, on_invalid, num_proc, root,
                              fingerprint, skipped, {"settings": settings, "inputs": inputs}, sidecar, split_key)
    log_skips(Counter(report.skipped), report.records, f"crystal dataset {fingerprint[:8]}")
    ds = load_arrow([root / s for s in meta["shards"]], fingerprint)
    ds.crystal_report = report
    if split_key is not None:
        ds.split_hashes = _stored_split_hashes(ds, root, fingerprint, split_key)
        ds.split_key = split_key
    return ds


SPLIT_HASH_BLOCK = 1 << 20
"""Ids decoded to Python strings at a time when split hashes are computed from the id column."""


def _split_hash_path(root: Path, fingerprint: str, key: str | int) -> Path:
    return root / f"{fingerprint}.split-{hashlib.blake2b(str(key).encode(), digest_size=8).hexdigest()}.npy"


def _save_split_hashes(path: Path, hashes: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # a unique temp name: ranks may write it at once
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(hashes, dtype=np.uint64))
    tmp.replace(path)


def _stored_split_hashes(ds: datasets.Dataset, root: Path, fingerprint: str, key: str | int) -> np.ndarray:
    """The split hashes of every row of the cached dataset under `key`, memory-mapped from their file; a
    cache built without them (or with another key) gets them from its id column here, once."""
    path = _split_hash_path(root, fingerprint, key)
    if not path.exists():
        ids = ds.data.column("id")
        parts = [id_hashes(ids.slice(lo, SPLIT_HASH_BLOCK).to_pylist(), key)
                 for lo in range(0, len(ids), SPLIT_HASH_BLOCK)]
        _save_split_hashes(path, np.concatenate(parts) if parts else np.zeros(0, np.uint64))
    hashes = np.load(path, mmap_mode="r")
    if len(hashes) != len(ds):  # a stale or foreign file: recompute rather than misassign
        path.unlink(missing_ok=True)
        return _stored_split_hashes(ds, root, fingerprint, key)
    return hashes


def _build(paths: list[Path], records: list[dict[str, Any]] | None, spec: TargetSpec, id_key: str | None,
           id_prop: str, graph: GraphSpec, on_invalid: str, num_proc: int | None, root: Path, fingerprint: str,
           skipped: Counter, about: dict[str, Any], sidecar: Path,
           split_key: str | int | None = None) -> tuple[dict[str, Any], CrystalReport]:
    """Write the shards: each input is cut into pieces here (`iter_chunks`: no structure is parsed in this
    process) and each piece is read, checked and turned into graphs by a worker; at most a few pieces are in
    flight, so this process never holds the whole input."""
    chunks: Any = (iter_chunks(paths, SHARD_RECORDS, id_prop) if records is None
                   else (records[lo:lo + SHARD_RECORDS] for lo in range(0, len(records), SHARD_RECORDS)))
    names: list[str] = []

    def jobs() -> Any:
        for k, chunk in enumerate(chunks):
            names.append(f"{fingerprint}-{k:05d}.arrow")
            yield write_shard, (chunk, spec, id_key, graph, on_invalid, split_key), root / names[-1]

    workers = max(1, int(num_proc or 1))
    queue = jobs()
    # A pool only for the pieces there are (spawning workers costs seconds): the first `workers` are peeked,
    # then handed on in order; an error of the reader while peeking comes after the pieces before it.
    head: deque = deque()
    failed: BaseException | None = None
    try:
        head.extend(itertools.islice(queue, workers))
    except Exception as e:  # noqa: BLE001 -- re-raised in order by handed_on
        failed = e
    workers = max(1, min(workers, len(head)))

    def handed_on() -> Any:
        while head:
            yield head.popleft()
        if failed is not None:
            raise failed
        yield from queue

    renamed: list[str] = []
    try:
        results = build_shards(handed_on(), num_proc=workers, max_in_flight=workers + 2, renamed=renamed)
        _check_schemas(results)
        if not any(r["schema"] is not None for r in results):
            raise CrystalDataError(", ".join(map(str, paths)) or "<in-memory>", None, None, "records",
                                   "no_records", f"no valid records ({_sum_skips(skipped, results)} skipped)")
        # shards where every record was skipped before its graph carry no schema: dropped
        kept_shards = [(root / n, r) for n, r in zip(names, results) if r["schema"] is not None]
        dropped = _drop_duplicates_across([p for p, _ in kept_shards], [r["hashes"] for _, r in kept_shards],
                                          on_invalid)
    except BaseException:
        # the shards this build published (another builder of the same cache may have published the others)
        for final in renamed:
            Path(final).unlink(missing_ok=True)
        raise
    for n, r in zip(names, results):
        if r["schema"] is None:
            (root / n).unlink(missing_ok=True)
    removed = sum(len(d) for d in dropped)
    if split_key is not None:  # the workers' split hashes, less the rows dropped as duplicates across shards
        _save_split_hashes(_split_hash_path(root, fingerprint, split_key),
                           np.concatenate([np.delete(r["split"], d) for (_, r), d in zip(kept_shards, dropped)]))
    total = _sum_skips(skipped, results)
    if removed:
        total["duplicate_id"] = total.get("duplicate_id", 0) + removed
    n_read = (len(records) + sum(skipped.values())) if records is not None else sum(r["read"] for r in results)
    kept = sum(r["kept"] for r in results) - removed
    shards = [p.name for p, _ in kept_shards]
    write_meta(sidecar, {"fingerprint": fingerprint, "shards": shards, "records": n_read, "kept": kept,
                         "skipped": total, **about})
    return {"shards": shards}, CrystalReport(fingerprint, n_read, kept, total, cache_hit=False)


def _sum_skips(skipped: Counter, results: list[dict[str, Any]]) -> dict[str, int]:
    total = Counter(skipped)
    for r in results:
        total.update(r["skipped"])
    return dict(total)


# --------------------------------------------------------------------------------------------------
# fast rows, sizes, batches


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
        self.offsets = None
        if self.is_string:
            self.arr = arr
            return
        if isinstance(arr, (pa.ListArray, pa.LargeListArray)) and not pa.types.is_list(arr.type.value_type):
            # one list level over fixed-size items: the rows' starts are offsets x item size, computed per row
            # from a view of the Arrow offsets, never a per-row array of its own (a copy that grows with N)
            self.flat, self.width, inner = _flat_view(arr.values)
            self.offsets, self.shape = arr.offsets.to_numpy(), (-1,) + inner
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
        if self.offsets is not None:
            return self.flat[int(self.offsets[k]) * self.width:int(self.offsets[k + 1]) * self.width].reshape(self.shape)
        if not self.shape:
            return self.flat[k]
        if self.starts is None:
            return self.flat[k * self.size:(k + 1) * self.size].reshape(self.shape)
        return self.flat[self.starts[k]:self.starts[k + 1]].reshape(self.shape)


class CrystalRows(torch.utils.data.Dataset):
    """Rows of a crystal dataset as dicts of numpy views straight from the memory-mapped Arrow data.

    `datasets`' numpy formatter builds Python objects for each nested [n][3] list of each row; this
    slices the Arrow buffers instead (no per-element Python work) and gives shaped arrays
    (`positions` [n, 3], `edge_shift` [E, 3], `cell` [3, 3]), ready for `collate_graphs`. Honors
    `select`ed / shuffled datasets; pickles as the underlying dataset. With `row_index`, each row
    also has `row`: its position in this dataset (the task maps test predictions back to ids by it).
    """

    def __init__(self, dataset: datasets.Dataset, columns: Sequence[str] | None = None, row_index: bool = False):
        self.dataset = dataset
        self.columns = list(columns) if columns is not None else [c for c in dataset.column_names if c != "source"]
        self.row_index = row_index
        self._chunks: list[dict[str, _ChunkColumn]] | None = None

    def _prepare(self) -> None:
        table = self.dataset.data.table.select(self.columns)
        batches = table.to_batches()
        self._chunks = [{name: _ChunkColumn(b.column(name)) for name in self.columns} for b in batches]
        self._chunk_starts = np.cumsum([0] + [b.num_rows for b in batches])
        self._indices = selected_rows(self.dataset)

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "columns": self.columns, "row_index": self.row_index, "_chunks": None}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        if self._chunks is None:
            self._prepare()
        positions = np.asarray(indices, dtype=np.int64)
        if len(positions) and (positions.min() < -len(self) or positions.max() >= len(self)):
            raise IndexError(f"index out of range for {len(self)} rows")
        positions = positions % max(len(self), 1)
        rows = positions if self._indices is None else self._indices[positions]
        chunk_of = np.searchsorted(self._chunk_starts, rows, side="right") - 1
        out = []
        for p, r, c in zip(positions.tolist(), rows.tolist(), chunk_of.tolist()):
            cols, k = self._chunks[c], r - self._chunk_starts[c]
            row = {name: col.row(k) for name, col in cols.items()}
            if self.row_index:
                row["row"] = p
            out.append(row)
        return out


def strings_at(dataset: Any, column: str, positions: Sequence[int] | np.ndarray) -> list[str]:
    """`arrow_cache.string_rows` of a dataset or `CrystalRows`: a few rows' values of a string column."""
    if isinstance(dataset, CrystalRows):
        dataset = dataset.dataset
    return string_rows(dataset, column, positions)


def _sizes(dataset: Any, column: str) -> np.ndarray:
    # a rank keeps this array for the run (the batch sampler's sizes): gathered straight into it
    if isinstance(dataset, CrystalRows):
        dataset = dataset.dataset
    return column_rows(dataset, column)


def atom_counts(dataset: datasets.Dataset | CrystalRows) -> np.ndarray:
    """Atoms per row (int32 numpy, from the `num_atoms` column without decoding any structure)."""
    return _sizes(dataset, "num_atoms")


def edge_counts(dataset: datasets.Dataset | CrystalRows) -> np.ndarray:
    """Edges per row (int32 numpy, from the `num_edges` column)."""
    return _sizes(dataset, "num_edges")


# Columns collate_graphs handles by name; every other `atom_*` column is concatenated over atoms and
# every other numeric column stacked over structures (float32).
_NOT_BATCHED = ("id", "source", "index", "num_atoms", "num_edges")
_NODE_KEYS = {"atomic_numbers": np.int64, "positions": np.float32}
_EDGE_KEYS = {"edge_shift": np.float32}
_FIXED_GRAPH_KEYS = {"cell": np.float32, "lattice_coeffs": np.int64}
_SHAPES = {"positions": (3,), "edge_shift": (3,), "cell": (3, 3), "lattice_coeffs": (3, 3)}
_HANDLED = set(_NOT_BATCHED) | set(_NODE_KEYS) | set(_EDGE_KEYS) | set(_FIXED_GRAPH_KEYS) | {"edge_src", "edge_dst"}


def collate_graphs(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """A sparse graph batch from rows (`CrystalRows` or numpy-formatted dataset rows).

    `atomic_numbers` Long [N], `positions` Float [N, 3], `cell` Float [B, 3, 3], `batch` Long [N]
    (graph of each atom), `num_atoms` / `num_edges` Long [B], `edge_src` / `edge_dst` Long [E]
    (offset to batch-global atom indices), `edge_shift` Float [E, 3], `lattice_coeffs` Long
    [B, 3, 3] (ComFormer's lat1..3 by the family's one rule; computed from `cell` for rows that
    lack them), `target` Float [B] or [B, T], `row` Long [B] when the rows have it; per-atom columns
    (`atom_*`) are concatenated ([N, ...]), other numeric columns stacked ([B, ...]). Edge vectors:
    `positions[edge_src] + edge_shift @ cell[batch[edge_dst]] - positions[edge_dst]`.
    """
    first = rows[0]
    if "lattice_coeffs" not in first:  # rows built elsewhere: the model must still get the one rule's vectors
        rows = [dict(r, lattice_coeffs=canonical_lattice_coeffs(np.asarray(r["cell"], np.float64).reshape(3, 3)))
                for r in rows]
    node_keys = dict(_NODE_KEYS)
    graph_keys: dict[str, Any] = dict(_FIXED_GRAPH_KEYS)
    for key in first:
        if key in _HANDLED:
            continue
        if key.startswith("atom_"):
            node_keys[key] = np.float32
        else:
            graph_keys[key] = np.int64 if key == "row" else np.float32
    return collate_sparse_graphs(rows, size_key="atomic_numbers", node_keys=node_keys, edge_keys=_EDGE_KEYS,
                                 graph_keys=graph_keys, shapes=_SHAPES, num_nodes_key="num_atoms")


# --------------------------------------------------------------------------------------------------
# splits


def build_crystal_splits(train: Any, *, test: Any = None, validation: Any = None,
                         fractions: dict[str, float] | None = None, seed: int = 0,
                         **kwargs: Any) -> dict[str, datasets.Dataset]:
    """Named splits: given files (e.g. mlearn training.json / test.json) and/or id-hashed fractions.

    `train` is built with `build_crystal_dataset(**kwargs)`; `test` / `validation`, if given, are
    built the same way. `fractions` (e.g. {"train": 0.9, "validation": 0.1}) splits the `train`
    source by `trainer.data.splits.split_indices` (each id by its own hash, keyed by `seed`: sizes
    are close to the fractions, not exact); without it the train source is the "train" split.
    """
    base = build_crystal_dataset(train, **kwargs)
    out: dict[str, datasets.Dataset] = {}
    if fractions:
        ids = selected_column(base, "id").to_pylist()
        for name, idx in split_indices(ids, fractions, key=seed).items():
            out[name] = select_rows(base, idx)
            out[name].crystal_report = base.crystal_report
    else:
        out["train"] = base
    for name, src in (("validation", validation), ("test", test)):
        if src is not None:
            if name in out:
                raise ValueError(f"split {name!r} given both as a source and as a fraction")
            out[name] = build_crystal_dataset(src, **kwargs)
    return out

"""The shard worker of the crystal build: one piece of input in, one Arrow shard out.

`write_shard` runs in each spawned worker of `build_crystal_dataset`, so this module (and what it imports) is
what every worker pays to start: it imports neither torch nor `datasets`. Graphs are built with numpy and vesin
(`graphs.build_crystal_graph`), and the Arrow file is written with pyarrow alone (`trainer.data.arrow_shards`: the
same bytes as `datasets`' ArrowWriter), so that the parent loads the shards with `datasets` unchanged.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa

from trainer.data.arrow_cache import list_array
from trainer.data.arrow_shards import Features, List, Value, arrow_schema, shard_writer
from trainer.data.splits import id_hashes
from trainer.families.crystals.graphs import GraphSpec, build_crystal_graph
from trainer.families.crystals.readers import CrystalDataError, ReadChunk, TargetSpec, read_chunk, skip_or_raise

ARROW_BATCH = 4096
"""Structures per Arrow record batch: as many as a shard holds (`dataset.SHARD_RECORDS`), so a shard is one
batch. Every rank maps each batch's header when it opens the cache and each batch's buffer of a column it scans
at start-up (sizes, targets, element counts); the kernel maps whole runs of pages around each byte touched, so
the pages a rank maps at start-up grow with the number of batches: few, large batches keep that small."""

ARROW_BATCH_BYTES = 256 << 20
"""A batch is also written once the graphs held for it reach this many bytes (atoms and edges), so that a worker's
memory stays bounded for large cells with dense graphs, where a shard's graphs would not fit comfortably."""

_EDGE_DTYPE = np.int8


BASE_FEATURES: Features = {
    "id": Value("string"),
    "source": Value("string"),
    "atomic_numbers": List(Value("int16")),
    "positions": List(List(Value("float32"), 3)),
    "cell": List(List(Value("float32"), 3), 3),
    "num_atoms": Value("int32"),
    "edge_src": List(Value("int32")),
    "edge_dst": List(Value("int32")),
    "edge_shift": List(List(Value("int8"), 3)),
    "num_edges": Value("int32"),
    "lattice_coeffs": List(List(Value("int32"), 3), 3),
}
"""The fixed columns of every shard."""

_CORE_KEYS = ("id", "source", "index", "atomic_numbers", "positions", "cell", "pbc")


# --------------------------------------------------------------------------------------------------
# Arrow schema and columns


def _value_feature(example: Any, per_atom: bool) -> Any:
    """Arrow feature of a target / extra column, from one record's value."""
    arr = np.asarray(example)
    inner = arr.shape[1:] if per_atom else arr.shape
    dtype = "float32" if per_atom else "float64"
    if len(inner) == 0:
        feat: Any = Value(dtype)
    elif len(inner) == 1:
        feat = List(Value(dtype), int(inner[0]))
    else:
        raise ValueError(f"values of shape {arr.shape} are not supported")
    return List(feat) if per_atom else feat


def _features_for(records: list[dict[str, Any]]) -> Features:
    """Schema: the fixed columns plus target / atom_target / kept extras, shaped like the first record;
    every record must match (a mismatch is a `CrystalDataError` naming it)."""
    feats = dict(BASE_FEATURES)
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
    return feats


def _fixed_array(parts: list[np.ndarray], dtype: Any, shape: tuple[int, ...]) -> pa.Array:
    values: pa.Array = pa.array(np.concatenate([np.asarray(p, dtype=dtype).reshape(-1) for p in parts]))
    for width in reversed(shape):
        values = pa.FixedSizeListArray.from_arrays(values, width)
    return values


def _column(feat: Any, parts: list[Any]) -> pa.Array:
    """One Arrow column from per-record values, built from numpy (no per-element Python)."""
    if isinstance(feat, Value):
        return pa.array(parts, type=feat.pa_type)
    inner = feat.feature
    dtype = np.dtype(inner.dtype if isinstance(inner, Value) else inner.feature.dtype)
    if feat.length != -1:  # fixed outer size: cell, lattice_coeffs, vector targets
        shape = (feat.length,) if isinstance(inner, Value) else (feat.length, inner.length)
        return _fixed_array(parts, dtype, shape)
    width = None if isinstance(inner, Value) else inner.length
    return list_array(parts, dtype, width)


# --------------------------------------------------------------------------------------------------
# one shard


def _record_graph(rec: dict[str, Any], spec: GraphSpec) -> dict[str, Any] | CrystalDataError:
    try:
        g = build_crystal_graph(rec["positions"], rec["cell"], spec, check_overlap=True)
    except ValueError as e:
        return CrystalDataError(rec["source"], rec["index"], rec["id"], "positions",
                                "overlapping_atoms" if "apart" in str(e) else "bad_value", str(e))
    if np.abs(g["edge_shift"]).max(initial=0) > np.iinfo(_EDGE_DTYPE).max:
        return CrystalDataError(rec["source"], rec["index"], rec["id"], "cell", "bad_value",
                                "periodic image shifts beyond int8: cell far thinner than the cutoff")
    return g


def _write_graph_rows(records: list[dict[str, Any]], spec: GraphSpec, features: Features, on_invalid: str,
                      path: str) -> tuple[dict[str, int], list[str]]:
    """Build the graphs of `records` and write them to the Arrow file `path` (a temp name that
    `build_shards` renames into place, or removes when this raises). Returns the skip counts (overlapping
    atoms show up here, from the graph's own neighbour list) and the ids of the rows written."""
    skipped: Counter = Counter()
    names = list(features)
    schema = arrow_schema(features)
    kept: list[str] = []
    with shard_writer(schema, path) as writer:
        rows: list[dict[str, Any]] = []

        def flush() -> None:
            cols = [_column(features[name], [r[name] for r in rows]) for name in names]
            writer.write_table(pa.Table.from_arrays(cols, schema=schema))
            rows.clear()

        held = 0  # bytes of the graphs in `rows`
        for rec in records:
            g = _record_graph(rec, spec)
            if isinstance(g, CrystalDataError):
                skip_or_raise(g, on_invalid, skipped)
                continue
            row = {k: v for k, v in rec.items() if k in features}
            row.update(g, num_atoms=len(rec["atomic_numbers"]), num_edges=len(g["edge_src"]))
            rows.append(row)
            kept.append(rec["id"])
            held += sum(v.nbytes for v in row.values() if isinstance(v, np.ndarray))
            if len(rows) == ARROW_BATCH or held >= ARROW_BATCH_BYTES:
                flush()
                held = 0
        if rows:
            flush()
    return dict(skipped), kept


def write_shard(chunk: ReadChunk | list[dict[str, Any]], spec: TargetSpec, id_key: str | None, graph: GraphSpec,
                on_invalid: str, split_key: Any, path: str) -> dict[str, Any]:
    """One worker job: read `chunk` (a piece of an input file, or validated in-memory records), check ids within
    it, build the graphs and write the Arrow shard `path`. Returns what the parent needs to finish the build:
    skip counts, records read and kept, the schema of the target / extra columns, the first record (to name
    it when shards disagree), the 64-bit hashes of the kept ids (for the check of ids across shards) and, with a
    `split_key`, their split hashes keyed by it (`trainer.data.splits.id_hashes`)."""
    skipped: Counter = Counter()
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    items = chunk if isinstance(chunk, list) else read_chunk(chunk, spec, id_key, check_overlap=False)
    for item in items:  # overlaps come free from the graph's neighbour list
        if isinstance(item, CrystalDataError):
            skip_or_raise(item, on_invalid, skipped)
        elif item["id"] in seen:
            skip_or_raise(CrystalDataError(item["source"], None, item["id"], "id", "duplicate_id",
                                           "an earlier record has the same id"), on_invalid, skipped)
        else:
            seen.add(item["id"])
            records.append(item)
    read = len(records) + sum(skipped.values())
    if not records:  # nothing to take a schema from: an empty shard that the parent drops
        with shard_writer(arrow_schema(BASE_FEATURES), path):
            pass
        return {"skipped": dict(skipped), "read": read, "kept": 0, "schema": None, "first": None,
                "hashes": np.zeros(0, np.uint64), "split": np.zeros(0, np.uint64)}
    features = _features_for(records)
    first = records[0]
    graph_skips, kept_ids = _write_graph_rows(records, graph, features, on_invalid, path)
    skipped.update(graph_skips)
    return {"skipped": dict(skipped), "read": read, "kept": len(kept_ids),
            "schema": {k: str(v) for k, v in features.items() if k not in BASE_FEATURES},
            "first": (first["source"], first["index"], first["id"]), "hashes": id_hashes(kept_ids),
            "split": id_hashes(kept_ids, split_key) if split_key is not None else None}

"""The FASTA -> Arrow conversion of one chunk: what `dataset.build_fasta_dataset`'s worker processes run.

A module of its own, importing no torch: each spawned worker imports only this (the reader, the tokenizer's
byte table, `datasets`' Arrow writer), so it starts faster and holds less memory than one importing the
dataset module.
"""

from __future__ import annotations

from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainer.data import arrow_cache, splits
from trainer.families.protein_sedd.fasta import (
    FASTA_COLUMNS,
    FASTA_SCHEMA,
    ChunkSpan,
    FastaStats,
    SplitCounts,
    TextChunk,
    iter_chunk_tables,
)
from trainer.families.protein_sedd.tokenizer import VOCAB_SIZE, encode_residue_bytes

FASTA_FEATURES = datasets.Features.from_arrow_schema(FASTA_SCHEMA)
assert list(FASTA_FEATURES) == list(FASTA_COLUMNS)
CACHE_FEATURES = datasets.Features({**FASTA_FEATURES, "input_ids": datasets.List(datasets.Value("int8"))})
"""The cached dataset: the reader's columns plus `input_ids`, tokenized in the same pass."""

READER_SETTINGS = ("min_length", "max_length", "nonstandard", "val_fraction", "salt")
"""The settings of a build that the reader takes."""


def encode_batch(batch: pa.Table) -> pa.Table:
    """`batch` plus input_ids: one `bytes.translate` over the residue buffer, the sequences' offsets reused."""
    sequence = batch.column("sequence").combine_chunks()
    if sequence.offset or sequence.null_count:  # a sliced or null-holding array: take the general path
        sequence = pa.array(sequence.to_pylist(), pa.string())
    _, offsets_buf, values_buf = sequence.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=len(sequence) + 1)
    residues = memoryview(values_buf)[offsets[0]:offsets[-1]] if len(sequence) else b""
    values = encode_residue_bytes(bytes(residues))
    ids = pa.ListArray.from_arrays(pa.array(offsets - offsets[0]), pa.array(values))
    return batch.append_column("input_ids", ids)


def id_hashes(ids: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A 64-bit hash of each id (blake2b of its UTF-8 bytes, `trainer.data.splits.id_hashes` unkeyed; uint64):
    the same in every process and on every machine (never Python's salted `hash`), so that the duplicate-id
    check can compare hashes made anywhere."""
    return splits.id_hashes(ids.to_pylist())


def _count_splits(table: pa.Table, counts: dict[str, SplitCounts]) -> None:
    """Add a tokenized table's records to the per-split token counts and length histograms."""
    input_ids = table.column("input_ids").combine_chunks()
    offsets = input_ids.offsets.to_numpy().astype(np.int64)
    tokens = input_ids.values.to_numpy()[offsets[0]:offsets[-1]]
    lengths = np.diff(offsets)  # == the `length` column: one id per residue
    validation = pc.equal(table.column("split"), "validation").to_numpy(zero_copy_only=False)
    every = np.bincount(tokens, minlength=VOCAB_SIZE)
    held = np.zeros_like(every)
    if validation.any():  # the small share: its tokens gathered by their ranges, the training ones by difference
        starts, sizes = offsets[:-1][validation] - offsets[0], lengths[validation]
        where = np.repeat(starts - (np.cumsum(sizes) - sizes), sizes) + np.arange(int(sizes.sum()))
        held = np.bincount(tokens[where], minlength=VOCAB_SIZE)
        counts.setdefault("validation", SplitCounts()).add_counts(held, lengths[validation])
    if not validation.all():
        counts.setdefault("train", SplitCounts()).add_counts(every - held, lengths[~validation])


def convert_chunk(entry: dict[str, Any], settings: dict[str, Any], chunk: ChunkSpan | TextChunk,
                  tmp_path: str) -> dict[str, Any]:
    """Parse one chunk of the file `entry["path"]` into the Arrow file `tmp_path` (`CACHE_FEATURES`; renamed
    into place by `arrow_cache.build_shards`). Returns what the builder keeps of it without reading the shard
    again: `stats` (the chunk's `FastaStats` as a dict), `rows` (the shard's), `splits` (each split's
    `SplitCounts` as a dict) and `id_hashes` (`id_hashes` of its rows, in order; for the duplicate-id check)."""
    stats = FastaStats()
    per_split: dict[str, SplitCounts] = {}
    hashes: list[np.ndarray] = []
    pending: list[pa.Table] = []  # the reader's blocks, written as record batches of ROWS_PER_BATCH rows
    rows = total = 0
    with arrow_cache.arrow_writer(CACHE_FEATURES, tmp_path, batch_rows=arrow_cache.ROWS_PER_BATCH) as writer:
        for table in iter_chunk_tables(entry["path"], chunk, stats=stats, **{k: settings[k] for k in READER_SETTINGS}):
            encoded = encode_batch(table)
            _count_splits(encoded, per_split)
            hashes.append(id_hashes(table.column("id")))
            pending.append(encoded)
            rows += table.num_rows
            total += table.num_rows
            if rows >= arrow_cache.ROWS_PER_BATCH:
                writer.write_table(pa.concat_tables(pending).combine_chunks())
                pending, rows = [], 0
        if pending:
            writer.write_table(pa.concat_tables(pending).combine_chunks())
        writer.finalize()
    return {"stats": stats.to_dict(), "rows": total, "splits": {k: v.to_dict() for k, v in per_split.items()},
            "id_hashes": np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64)}

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

from trainer.data import arrow_cache
from trainer.families.protein_sedd.fasta import (
    FASTA_COLUMNS,
    FASTA_SCHEMA,
    ChunkSpan,
    FastaStats,
    TextChunk,
    iter_chunk_tables,
)
from trainer.families.protein_sedd.tokenizer import encode_residue_bytes

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


def convert_chunk(entry: dict[str, Any], settings: dict[str, Any], chunk: ChunkSpan | TextChunk,
                  tmp_path: str) -> dict[str, int]:
    """Parse one chunk of the file `entry["path"]` into the Arrow file `tmp_path` (`CACHE_FEATURES`; renamed
    into place by `arrow_cache.build_shards`); returns the chunk's `FastaStats` as a dict."""
    stats = FastaStats()
    pending: list[pa.Table] = []  # the reader's blocks, written as record batches of ROWS_PER_BATCH rows
    rows = 0
    with arrow_cache.arrow_writer(CACHE_FEATURES, tmp_path, batch_rows=arrow_cache.ROWS_PER_BATCH) as writer:
        for table in iter_chunk_tables(entry["path"], chunk, stats=stats, **{k: settings[k] for k in READER_SETTINGS}):
            pending.append(encode_batch(table))
            rows += table.num_rows
            if rows >= arrow_cache.ROWS_PER_BATCH:
                writer.write_table(pa.concat_tables(pending).combine_chunks())
                pending, rows = [], 0
        if pending:
            writer.write_table(pa.concat_tables(pending).combine_chunks())
        writer.finalize()
    return stats.to_dict()

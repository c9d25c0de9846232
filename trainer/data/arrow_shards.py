"""Arrow shards written with pyarrow alone, byte for byte as `datasets`' ArrowWriter writes them.

A build's shard workers are spawned processes: what the module of their job imports is what every worker pays to
start, and `datasets` (with pandas) is most of that. This module imports neither `datasets` nor torch: `Value` and
`List` restate the two `datasets` feature types the families use (same Arrow types, same schema metadata, same
repr), `arrow_schema` gives the schema with the Hugging Face metadata `datasets`' ArrowWriter writes, and
`write_table` cuts a table into record batches as that writer does, so the parent loads the shards with `datasets`
unchanged and a cache written either way is the same file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa

DATASETS_BATCH_ROWS = 1000
"""Rows per record batch that `datasets`' ArrowWriter cuts a written table into when not told otherwise
(`datasets.config.DEFAULT_MAX_BATCH_SIZE`)."""


class Value:
    """A scalar column type, as `datasets.Value` (same Arrow type, metadata and repr): `dtype` a numpy dtype name
    (bool, int8 ... float64) or "string"."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.pa_type = pa.string() if dtype == "string" else pa.from_numpy_dtype(np.dtype(dtype))

    def to_dict(self) -> dict[str, Any]:
        """The feature as `datasets` records it in a file's schema metadata."""
        return {"dtype": self.dtype, "_type": "Value"}

    def __repr__(self) -> str:
        return f"Value('{self.dtype}')"


class List:
    """A list column type, as `datasets.List`: `length` -1 is a variable-length list, else a fixed-size one."""

    def __init__(self, feature: Value | List, length: int = -1):
        self.feature, self.length = feature, length
        self.pa_type = pa.list_(feature.pa_type, length)

    def to_dict(self) -> dict[str, Any]:
        """The feature as `datasets` records it in a file's schema metadata."""
        out: dict[str, Any] = {"feature": self.feature.to_dict()}
        if self.length != -1:
            out["length"] = self.length
        out["_type"] = "List"
        return out

    def __repr__(self) -> str:
        return f"List({self.feature!r}" + (f", length={self.length})" if self.length != -1 else ")")


Features = dict[str, Any]
"""Column name -> `Value` / `List`, in column order."""


def arrow_schema(features: Features) -> pa.Schema:
    """The Arrow schema of `features` with the metadata `datasets`' ArrowWriter writes (its features), so that
    `datasets.Dataset.from_file` reads the same features back."""
    meta = {"info": {"features": {name: feat.to_dict() for name, feat in features.items()}}}
    return pa.schema([pa.field(name, feat.pa_type) for name, feat in features.items()],
                     metadata={"huggingface": json.dumps(meta)})


@contextmanager
def shard_writer(schema: pa.Schema, path: str) -> Iterator[pa.RecordBatchStreamWriter]:
    """An Arrow IPC stream writer of `path` (the format `datasets` memory-maps), closed (end-of-stream marker
    written, file closed) on leaving the block. Nothing written: the schema and the end marker, as `datasets`
    finalizes a writer that got no rows."""
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        yield writer


def write_table(writer: pa.RecordBatchStreamWriter, table: pa.Table,
                batch_rows: int = DATASETS_BATCH_ROWS) -> None:
    """Write `table` as `datasets`' ArrowWriter.write_table does: its chunks combined, then cut into record batches
    of at most `batch_rows` rows (a table of no rows: one empty batch)."""
    writer.write_table(table.combine_chunks(), max_chunksize=batch_rows)

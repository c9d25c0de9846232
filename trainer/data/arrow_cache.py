"""Fingerprinted Arrow caches: the one place that touches `datasets` internals.

A family turns its input into Arrow files once per (inputs, settings) and loads them memory-mapped
afterwards. The fingerprint is a digest of what identifies the inputs (each file's size and a digest of
its content, `file_fingerprint`, never its path or mtime, so a copy staged to a node's scratch folder hits
the same cache; or the content of in-memory records) and of every setting. Each shard is written
by a worker function into a temp file, then renamed into place, so a crash or an error never leaves
a half-written shard under its final name, and a failed build removes its own temp files (named per build:
another process writing the same shard keeps its own). A sidecar
JSON (written atomically, after the shards) records what the build read and skipped.

Internals of `datasets` used here and nowhere else: `ArrowWriter`, `Dataset._fingerprint` (so
derived datasets cache under the content fingerprint) and `Dataset._indices` (a selection's rows).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainer.atomic_io import atomic_write_json


def digest(obj: Any) -> str:
    """A short content digest of a JSON-able object (key order does not matter)."""
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


FULL_HASH_BYTES = 64 << 20
"""Files up to this size are hashed whole; larger ones by a sample (`file_fingerprint`)."""
SAMPLE_EDGE_BYTES = 1 << 20
"""Bytes read at each end of a sampled file (headers and a truncated tail change these)."""
SAMPLE_BLOCKS = 64
"""Evenly spaced blocks read between the two ends of a sampled file."""
SAMPLE_BLOCK_BYTES = 256 << 10
"""Bytes per sampled block."""

_fingerprints: dict[tuple, str] = {}
"""(resolved path, device, inode, size, mtime) -> content digest: a file read once per process."""


def file_fingerprint(path: str | Path, *, full_hash_bytes: int | None = None) -> str:
    """A digest of a file's size and content, independent of its name, folder and mtime.

    A file of at most `full_hash_bytes` (default `FULL_HASH_BYTES`) is hashed whole (blake2b). A larger one
    is hashed by a sample, so that a start does not read a multi-GB input: its first and last
    `SAMPLE_EDGE_BYTES` and `SAMPLE_BLOCKS` blocks of `SAMPLE_BLOCK_BYTES` evenly spaced between them. Any
    change of size is seen; an edit in place that keeps the size and falls between the sampled blocks is
    not (delete the cache folder to rebuild after such an edit). Remembered per process by (path, inode,
    size, mtime), so a second build in the same process does not read the file again.
    """
    limit = FULL_HASH_BYTES if full_hash_bytes is None else full_hash_bytes
    path = Path(path).resolve()
    st = path.stat()
    memo = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, limit, SAMPLE_EDGE_BYTES, SAMPLE_BLOCKS,
            SAMPLE_BLOCK_BYTES)
    if memo in _fingerprints:
        return _fingerprints[memo]
    size = st.st_size
    h = hashlib.blake2b(f"{size}:".encode(), digest_size=16)
    chunk = 1 << 20
    with open(path, "rb") as f:
        if size <= limit:
            h.update(b"full:")
            while block := f.read(chunk):
                h.update(block)
        else:
            h.update(f"sample:{SAMPLE_EDGE_BYTES}:{SAMPLE_BLOCKS}:{SAMPLE_BLOCK_BYTES}:".encode())
            inner_start, inner_end = SAMPLE_EDGE_BYTES, size - SAMPLE_EDGE_BYTES
            starts = [0, *np.linspace(inner_start, max(inner_start, inner_end - SAMPLE_BLOCK_BYTES),
                                      SAMPLE_BLOCKS).astype(np.int64).tolist(), inner_end]
            lengths = [SAMPLE_EDGE_BYTES, *[SAMPLE_BLOCK_BYTES] * SAMPLE_BLOCKS, SAMPLE_EDGE_BYTES]
            for start, length in zip(starts, lengths):
                f.seek(start)
                h.update(f.read(length))
    _fingerprints[memo] = out = h.hexdigest()
    return out


def file_entries(path: str | Path) -> list[dict[str, Any]]:
    """What identifies an input: a file, or every file of a folder (in name order).

    Each entry: `path` (absolute: where to read it; not part of the identity, see `input_key`), `name` (within
    the folder; for a single file only its last two suffixes, which readers pick the format by), `size` and
    `content` (`file_fingerprint`).
    """
    path = Path(path).resolve()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        names = [p.name for p in files]
    else:
        files, names = [path], ["".join(path.suffixes[-2:]).lower()]
    return [{"path": str(p), "name": name, "size": p.stat().st_size, "content": file_fingerprint(p)}
            for p, name in zip(files, names)]


def input_key(entry: dict[str, Any]) -> dict[str, Any]:
    """The part of a `file_entries` entry that identifies its content (everything but where it lies)."""
    return {k: v for k, v in entry.items() if k != "path"}


def file_keys(path: str | Path) -> list[dict[str, Any]]:
    """`input_key` of each of `file_entries(path)`: what a cache fingerprint digests for an input path."""
    return [input_key(e) for e in file_entries(path)]


def cache_root(cache_dir: str | Path | None, namespace: str) -> Path:
    """`cache_dir/namespace` (default: the `datasets` cache), created if needed."""
    if cache_dir is None:
        import datasets

        cache_dir = datasets.config.HF_DATASETS_CACHE
    root = Path(cache_dir) / namespace
    root.mkdir(parents=True, exist_ok=True)
    return root


ROWS_PER_BATCH = 1 << 16
"""Rows per Arrow record batch of a shard written from whole tables (`arrow_writer(..., batch_rows=...)`). Opening
a memory-mapped shard reads every batch's header, and each read maps the pages around it into the process: with
`datasets`' default of 1,000 rows a batch, a process that only opens a large data set already holds a tenth of it
as resident file pages."""


def arrow_writer(features: Any, path: str, batch_rows: int | None = None) -> Any:
    """A `datasets` ArrowWriter for `path` with `features` (use as a context manager; call finalize()); tables
    written whole are cut into record batches of `batch_rows` rows (None: `datasets`' default)."""
    from datasets.arrow_writer import ArrowWriter

    return ArrowWriter(features=features, path=path, writer_batch_size=batch_rows)


def _own_temp(final: str | Path, token: str) -> Path:
    """The temp name of `final` in the build `token`: unique per build (and still one of `temp_paths_of(final)`),
    so that a failed build removes its own temp files and never those of another builder writing the same shard."""
    final = Path(final)
    return final.with_name(f".{final.name}.{token}.tmp")


def _run_shard(job: tuple[Callable[..., Any], tuple, str, str]) -> Any:
    """Run `fn(*args, tmp_path)`; remove the temp file on failure. The caller renames it into place: a worker
    that renamed its own would publish a shard that its caller, failing on another job and stopping the pool,
    may never hear of."""
    fn, args, final, token = job
    tmp = str(_own_temp(final, token))
    try:
        return fn(*args, tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_shards(jobs: Iterable[tuple[Callable[..., Any], tuple, str | Path]], num_proc: int = 1, *,
                 on_done: Callable[[int, Any], None] | None = None, max_in_flight: int | None = None,
                 renamed: list[str] | None = None) -> list[Any]:
    """Write Arrow shards: each job is (fn, args, final path) and calls `fn(*args, tmp_path)`.

    With `num_proc` > 1 (and, for a sequence, several jobs) they run in a spawn pool (`fn` must be importable
    at module level). Spawn, not fork: forking a process that runs threads (TensorBoard's writer, tqdm's
    monitor, a gzip reader) can leave a child waiting forever on a lock held at the fork. `jobs` may be a
    generator: at most `max_in_flight` jobs (default 2 x `num_proc`) are submitted and not yet done, so jobs
    that carry their data keep memory bounded. Returns each job's result, in order; `on_done(index, result)`
    is called as each finishes, in order. The first error in job order is raised (a job's, or the
    generator's after the jobs before it); the temp files of this call are removed, no one else's.
    Shards are renamed into place here as their jobs are collected, in order, so that a failed call has
    published only the jobs before the failed one. `renamed` (a list) receives each such final path, also when
    it fails, so that a caller undoing a failed build removes its own shards and never those another builder
    of the same cache published.
    """
    token = uuid.uuid4().hex
    started: list[str] = []
    results: list[Any] = []
    pending: deque[Any] = deque()  # async results of the pool's jobs not yet collected, in order

    def done(result: Any) -> None:
        final = started[len(results)]
        os.replace(_own_temp(final, token), final)
        if renamed is not None:
            renamed.append(final)
        if on_done is not None:
            on_done(len(results), result)
        results.append(result)

    def submitted(it: Iterable[tuple[Callable[..., Any], tuple, str | Path]]) -> Iterator[tuple]:
        for fn, args, final in it:
            started.append(str(final))
            yield fn, tuple(args), str(final), token

    try:
        parallel = num_proc > 1 and (len(jobs) > 1 if isinstance(jobs, Sequence) else True)
        if not parallel:
            for job in submitted(jobs):
                done(_run_shard(job))
            return results
        size = min(num_proc, len(jobs)) if isinstance(jobs, Sequence) else num_proc
        limit = max(1, max_in_flight or 2 * size)
        with multiprocessing.get_context("spawn").Pool(size) as pool:
            queue = submitted(jobs)
            while True:
                try:
                    job = next(queue)
                except StopIteration:
                    break
                except Exception:  # the generator's: an error of a job before it comes first
                    for result in pending:
                        result.get()
                    raise
                pending.append(pool.apply_async(_run_shard, (job,)))
                if len(pending) >= limit:
                    done(pending.popleft().get())
            while pending:
                done(pending.popleft().get())
        return results
    except BaseException:
        # the pool is stopped by now: the jobs not collected, finished or not, leave only temp files
        for final in started:
            _own_temp(final, token).unlink(missing_ok=True)
        raise


def read_meta(path: str | Path) -> dict[str, Any] | None:
    """A cache sidecar, or None if it is missing or unreadable (the cache is then rebuilt)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_meta(path: str | Path, meta: dict[str, Any]) -> None:
    atomic_write_json(path, meta, durable=False)


def shard_rows(path: str | Path) -> int | None:
    """The rows of an Arrow shard (read from its record batches' headers, memory-mapped: no column data is
    read), or None if it is missing or unreadable (truncated, not Arrow)."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return sum(batch.num_rows for batch in pa.ipc.open_stream(source))
    except (OSError, pa.ArrowException):
        return None


def load_arrow(paths: Iterable[str | Path], fingerprint: str) -> Any:
    """The memory-mapped dataset of Arrow shards (concatenated in order), fingerprinted by content so
    derived datasets (select, filter, map) cache under it."""
    import datasets

    parts = [datasets.Dataset.from_file(str(p)) for p in paths]
    ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    ds._fingerprint = fingerprint
    return ds


def selected_column(ds: Any, name: str) -> Any:
    """Arrow column `name` of a dataset in its row order, honouring a selection (`select`, `filter`)."""
    column = ds.with_format(None).data.column(name).combine_chunks()
    if ds._indices is not None:
        column = column.take(ds._indices.column(0).combine_chunks())
    return column


_FINGERPRINT_BLOCK = 1 << 16


def _runs_by_one(rows: np.ndarray) -> bool:
    """Whether each row is the one before plus one, checked block by block (no N-sized difference array)."""
    for lo in range(0, len(rows), _FINGERPRINT_BLOCK):
        block = rows[lo:lo + _FINGERPRINT_BLOCK + 1].astype(np.int64)
        if not bool(np.all(np.diff(block) == 1)):
            return False
    return True


def select_rows(ds: Any, rows: np.ndarray | Sequence[int], narrow: bool = False) -> Any:
    """`ds.select(rows)` for a split's row numbers, without a Python object per row.

    `datasets.Dataset.select` turns non-contiguous indices into a Python list (an int object per row, then Python
    loops for the bounds and the Arrow array), transient memory and CPU in proportion to the rows selected on
    every rank at every start. This builds the same indices table from the numpy array at once: the same rows, in
    the same order (a selection of a selection is composed, as `select` does); the fingerprint is a hash of the
    parent's and of the rows (as int64, whatever their type).

    `narrow`: indices as uint32 (4 bytes a row instead of 8) when the table has fewer than 2**32 rows, for a
    selection a process keeps for its whole run; int32 rows are then used without a copy. Every `datasets`
    operation reads such indices except `concatenate_datasets`, which offsets indices as uint64 and then refuses
    to merge them with uint32 ones: leave `narrow` off for a selection that may be concatenated."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    rows = np.asarray(rows)
    if rows.ndim != 1 or (len(rows) and not np.issubdtype(rows.dtype, np.integer)):
        raise TypeError(f"rows must be a 1-d array of integers, got {rows.dtype} of shape {rows.shape}")
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= len(ds)):
        raise IndexError(f"row {int(rows.min() if rows.min() < 0 else rows.max())} out of range for {len(ds)} rows")
    if len(rows) and int(rows[-1]) - int(rows[0]) == len(rows) - 1 and _runs_by_one(rows):
        return ds.select(range(int(rows[0]), int(rows[-1]) + 1))  # a contiguous run: `select` slices, no indices
    # The selection keeps one index per row for as long as it lives; the caller's array itself when it already has
    # the indices' width (non-negative ints viewed as unsigned: no copy).
    width = np.uint32 if narrow and len(ds._data) < 2**32 else np.uint64
    if rows.dtype.itemsize == np.dtype(width).itemsize and rows.dtype.kind in "iu":
        indices = pa.array(np.ascontiguousarray(rows).view(width))
    else:
        indices = pa.array(rows.astype(width))
    if ds._indices is not None:
        indices = ds._indices.column(0).take(indices)
    h = hashlib.blake2b(str(ds._fingerprint).encode(), digest_size=16)
    for lo in range(0, len(rows), _FINGERPRINT_BLOCK):  # the int64 rows' bytes, as before, without an int64 copy
        h.update(memoryview(np.ascontiguousarray(rows[lo:lo + _FINGERPRINT_BLOCK], dtype=np.int64)))
    out = datasets.Dataset(ds._data, info=ds.info.copy(), split=ds.split,
                           indices_table=InMemoryTable(pa.table({"indices": indices})), fingerprint=h.hexdigest())
    # the parent's output format, as `select` transmits it
    out._format_type, out._format_kwargs = ds._format_type, dict(ds._format_kwargs)
    out._format_columns = None if ds._format_columns is None else list(ds._format_columns)
    out._output_all_columns = ds._output_all_columns
    return out


def selected_rows(ds: Any) -> np.ndarray | None:
    """Row numbers of a selection in the underlying table (None: no selection, all rows in order)."""
    return None if ds._indices is None else ds._indices.column(0).to_numpy()


GATHER_BLOCK = 1 << 16
"""Rows gathered at a time when a column is read in a selection's order (`column_rows`)."""


def _chunk_view(chunk: Any) -> np.ndarray:
    """A primitive or fixed-size-list Arrow chunk as a numpy view [rows, ...] (zero-copy)."""
    import pyarrow as pa

    shape: list[int] = []
    while pa.types.is_fixed_size_list(chunk.type):
        shape.append(chunk.type.list_size)
        chunk = chunk.flatten()
    if chunk.null_count:
        raise ValueError(f"a column of {chunk.type} has {chunk.null_count} null values")
    return chunk.to_numpy(zero_copy_only=False).reshape(-1, *shape)


def column_rows(ds: Any, column: str, dtype: Any = None) -> np.ndarray:
    """A scalar or fixed-size-list column in the dataset's row order (a selection honoured), as `dtype` (default:
    the column's), gathered from numpy views of its (memory-mapped) chunks `GATHER_BLOCK` rows at a time into the
    one array returned: no Arrow copy of the whole column (its chunks concatenated, then a take, memory Arrow's
    allocator keeps) and no intermediate array of every row comes before it. The values of `column_array`."""
    chunks = [_chunk_view(c) for c in ds.data.column(column).chunks]
    if not chunks:
        return np.zeros(0, dtype=dtype or np.int32)
    dtype = np.dtype(dtype or chunks[0].dtype)
    rows = selected_rows(ds)
    if rows is None:
        out = np.empty((sum(len(c) for c in chunks), *chunks[0].shape[1:]), dtype=dtype)
        np.concatenate(chunks, out=out, casting="unsafe")
        return out
    out = np.empty((len(rows), *chunks[0].shape[1:]), dtype=dtype)
    for lo in range(0, len(rows), GATHER_BLOCK):
        target = out[lo:lo + GATHER_BLOCK]
        for c, at, offsets in rows_by_chunk([len(c) for c in chunks], rows[lo:lo + GATHER_BLOCK]):
            target[at] = chunks[c][offsets]
    return out


def rows_by_chunk(chunk_lengths: Sequence[int], table_rows: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """For rows of a chunked table: (chunk, positions in `table_rows` that fall in it, their offsets in the chunk),
    chunk by chunk, for the chunks that hold any."""
    starts = np.cumsum([0, *chunk_lengths], dtype=np.int64)
    table_rows = np.asarray(table_rows).astype(np.int64)
    chunk_of = np.searchsorted(starts, table_rows, side="right") - 1
    for c in np.unique(chunk_of).tolist():
        at = np.flatnonzero(chunk_of == c)
        yield c, at, table_rows[at] - starts[c]


def string_rows(ds: Any, column: str, positions: Sequence[int] | np.ndarray) -> list[Any]:
    """Column `column` (e.g. string ids) of the dataset's rows at `positions` (a selection honoured), read from each
    (memory-mapped) chunk holding some of them: no copy of the whole column (its chunks concatenated) for a few
    rows' values."""
    import pyarrow as pa

    chunks = ds.data.column(column).chunks
    positions = np.asarray(positions, dtype=np.int64)
    rows = selected_rows(ds)
    table_rows = positions if rows is None else rows[positions]
    out: list[Any] = [None] * len(table_rows)
    for c, at, offsets in rows_by_chunk([len(c) for c in chunks], table_rows):
        for i, value in zip(at.tolist(), chunks[c].take(pa.array(offsets)).to_pylist()):
            out[i] = value
    return out


def list_array(parts: list[np.ndarray], dtype: Any, width: int | None = None) -> Any:
    """A pyarrow list<item> (width None) or list<fixed_size_list<item, width>> column of per-record arrays,
    built through numpy in one pass (no Python loop over elements)."""
    import pyarrow as pa

    counts = np.array([len(p) for p in parts], dtype=np.int64)
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    flat = np.concatenate([np.asarray(p, dtype=dtype).reshape(-1) for p in parts]) if parts else np.zeros(0, dtype)
    values = pa.array(flat)
    if width is not None:
        values = pa.FixedSizeListArray.from_arrays(values, width)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def column_array(ds: Any, name: str) -> np.ndarray:
    """Column `name` of a dataset as numpy, in its row order (selections honoured), read in one go.

    Reading a column through `ds[name]` or iterating it decodes one row at a time in Python; this
    converts the Arrow column at once. Scalars give [rows]; fixed-size lists give [rows, width, ...];
    strings give an object array. A variable-length list column has no rectangular form: use
    `ListColumn`.
    """
    import pyarrow as pa

    column = selected_column(ds, name)
    shape = [len(column)]
    while pa.types.is_fixed_size_list(column.type):
        shape.append(column.type.list_size)
        column = column.flatten()
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        raise TypeError(f"column {name!r} holds lists of varying length ({column.type}): read it with ListColumn")
    return column.to_numpy(zero_copy_only=False).reshape(shape)


class ListColumn:
    """A variable-length list column of a dataset (e.g. `input_ids`) as numpy views of its Arrow chunks.

    Nothing is copied: each chunk's offsets and flat values, and the selection's row numbers, are views of the
    (memory-mapped) Arrow buffers, so reading a row maps only the pages it touches and a process holds nothing
    per row until it asks for a whole-column quantity (`lengths`, `table_rows`, `flat`, `bincount`). Rows are
    numbered in the dataset's order (a `select`, `shuffle` or `filter` is honoured); `table_row(r)` reads row r of
    the underlying table. A reader built from views: a DataLoader worker builds its own from the dataset rather
    than receiving one pickled (which would copy the views).
    """

    def __init__(self, ds: Any, name: str):
        import pyarrow as pa

        chunks = ds.with_format(None).data.column(name).chunks
        self.values: list[np.ndarray] = []
        self.offsets: list[np.ndarray] = []
        for chunk in chunks:
            if not (pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type)):
                raise TypeError(f"column {name!r} is {chunk.type}, not a list column")
            if chunk.null_count:
                raise ValueError(f"column {name!r} has {chunk.null_count} null rows")
            # `.offsets` of a sliced chunk index its unsliced `.values`: keep the two together
            self.offsets.append(chunk.offsets.to_numpy())
            values = chunk.values
            if pa.types.is_fixed_size_list(values.type):  # e.g. positions: an item is a row of [items, width]
                width = values.type.list_size
                self.values.append(values.flatten().to_numpy(zero_copy_only=False).reshape(-1, width))
            else:
                self.values.append(values.to_numpy(zero_copy_only=False))
        self.chunk_starts = np.cumsum([0] + [len(c) for c in chunks], dtype=np.int64)
        selection = None if ds._indices is None else ds._indices.column(0).chunks
        self._selected = None if selection is None else [chunk.to_numpy() for chunk in selection]
        self._selected_starts = (None if selection is None
                                 else np.cumsum([0] + [len(c) for c in selection], dtype=np.int64))
        self._rows: np.ndarray | None = None
        self._table_lengths: np.ndarray | None = None

    @property
    def rows(self) -> np.ndarray | None:
        """The underlying table's row of each of the dataset's rows (None: no selection); made on first use."""
        if self._selected is not None and self._rows is None:
            self._rows = np.concatenate(self._selected) if self._selected else np.zeros(0, np.uint64)
        return self._rows

    @property
    def table_lengths(self) -> np.ndarray:
        """Items per row of the underlying table, int64; made on first use."""
        if self._table_lengths is None:
            self._table_lengths = (np.concatenate([np.diff(o) for o in self.offsets]).astype(np.int64)
                                   if self.offsets else np.zeros(0, np.int64))
        return self._table_lengths

    def __len__(self) -> int:
        return int(self.chunk_starts[-1] if self._selected is None else self._selected_starts[-1])

    def lengths(self) -> np.ndarray:
        """Items per row, int64, in the dataset's row order."""
        return self.table_lengths if self.rows is None else self.table_lengths[self.rows]

    def table_rows(self) -> np.ndarray:
        """The underlying table's row of each of the dataset's rows."""
        return np.arange(len(self.table_lengths)) if self.rows is None else self.rows

    def table_row(self, row: int) -> np.ndarray:
        """The values of row `row` of the underlying table (a view, no copy)."""
        c = int(np.searchsorted(self.chunk_starts, row, side="right")) - 1
        k = row - int(self.chunk_starts[c])
        return self.values[c][int(self.offsets[c][k]):int(self.offsets[c][k + 1])]

    def table_index(self, index: int) -> int:
        """The underlying table's row of the dataset's row `index` (through its selection; nothing is built)."""
        if self._selected is None:
            return int(index)
        c = int(np.searchsorted(self._selected_starts, index, side="right")) - 1
        return int(self._selected[c][index - int(self._selected_starts[c])])

    def __getitem__(self, index: int) -> np.ndarray:
        """The values of the dataset's row `index` (through its selection; a view, no copy)."""
        return self.table_row(self.table_index(index))

    def flat(self) -> np.ndarray:
        """The values of the dataset's rows concatenated in its row order (a copy; one gather, no row loop)."""
        dtype = self.values[0].dtype if self.values else np.int64
        table = (np.concatenate([v[o[0]:o[-1]] for v, o in zip(self.values, self.offsets)]) if self.values
                 else np.zeros(0, dtype))
        if self.rows is None:
            return table
        table_starts = np.concatenate([[0], np.cumsum(self.table_lengths)])
        starts, lengths = table_starts[self.rows], self.table_lengths[self.rows]
        out_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
        return table[np.repeat(starts - out_starts, lengths) + np.arange(int(lengths.sum()))]

    def bincount(self, minlength: int = 0) -> np.ndarray:
        """How often each (non-negative integer) value occurs over the dataset's rows, a row selected twice
        counting twice: one `np.bincount` per Arrow chunk, int64."""
        multiplicity = (None if self.rows is None
                        else np.bincount(self.rows, minlength=len(self.table_lengths)))
        counts = np.zeros(minlength, dtype=np.int64)
        for c, (values, offsets) in enumerate(zip(self.values, self.offsets)):
            flat = values[offsets[0]:offsets[-1]].astype(np.int64)
            if multiplicity is None:
                part = np.bincount(flat, minlength=minlength)
            else:
                weights = np.repeat(multiplicity[self.chunk_starts[c]:self.chunk_starts[c + 1]], np.diff(offsets))
                if not weights.any():
                    continue
                part = np.bincount(flat, weights=weights, minlength=minlength).round().astype(np.int64)
            if len(part) > len(counts):
                counts = np.pad(counts, (0, len(part) - len(counts)))
            counts[:len(part)] += part
        return counts

"""Fingerprinted Arrow caches: the one place that touches `datasets` internals.

A family turns its input into Arrow files once per (inputs, settings) and loads them memory-mapped
afterwards. The fingerprint is a digest of what identifies the inputs (each file's absolute path,
size and mtime, or the content of in-memory records) and of every setting. Each shard is written
by a worker function into a temp file, then renamed into place, so a crash or an error never leaves
a half-written shard under its final name, and a failed build removes its temp files. A sidecar
JSON (written atomically, after the shards) records what the build read and skipped.

Internals of `datasets` used here and nowhere else: `ArrowWriter`, `Dataset._fingerprint` (so
derived datasets cache under the content fingerprint) and `Dataset._indices` (a selection's rows).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainer.atomic_io import atomic_write_json, temp_path, temp_paths_of


def digest(obj: Any) -> str:
    """A short content digest of a JSON-able object (key order does not matter)."""
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def file_entries(path: str | Path) -> list[dict[str, Any]]:
    """Absolute path, size and mtime of a file, or of every file of a folder: what identifies an input."""
    path = Path(path).resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    out = []
    for p in files:
        st = p.stat()
        out.append({"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def cache_root(cache_dir: str | Path | None, namespace: str) -> Path:
    """`cache_dir/namespace` (default: the `datasets` cache), created if needed."""
    if cache_dir is None:
        import datasets

        cache_dir = datasets.config.HF_DATASETS_CACHE
    root = Path(cache_dir) / namespace
    root.mkdir(parents=True, exist_ok=True)
    return root


def arrow_writer(features: Any, path: str) -> Any:
    """A `datasets` ArrowWriter for `path` with `features` (use as a context manager; call finalize())."""
    from datasets.arrow_writer import ArrowWriter

    return ArrowWriter(features=features, path=path)


def _run_shard(job: tuple[Callable[..., Any], tuple, str]) -> Any:
    """Run `fn(*args, tmp_path)`, then rename the temp file to its final name; remove it on failure."""
    fn, args, final = job
    tmp = str(temp_path(final))
    try:
        result = fn(*args, tmp)
        os.replace(tmp, final)
        return result
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_shards(jobs: Sequence[tuple[Callable[..., Any], tuple, str | Path]], num_proc: int = 1) -> list[Any]:
    """Write Arrow shards: each job is (fn, args, final path) and calls `fn(*args, tmp_path)`.

    With `num_proc` > 1 and several jobs, they run in a spawn pool (`fn` must be importable at module
    level). Spawn, not fork: forking a process that runs threads (TensorBoard's writer, tqdm's monitor,
    a gzip reader) can leave a child waiting forever on a lock held at the fork. Returns each job's result.
    """
    todo = [(fn, tuple(args), str(final)) for fn, args, final in jobs]
    try:
        if num_proc > 1 and len(todo) > 1:
            with multiprocessing.get_context("spawn").Pool(min(num_proc, len(todo))) as pool:
                return pool.map(_run_shard, todo)
        return [_run_shard(job) for job in todo]
    except BaseException:
        for _, _, final in todo:  # a pool worker killed mid-write leaves its temp file behind
            for stale in temp_paths_of(final):
                stale.unlink(missing_ok=True)
        raise


def read_meta(path: str | Path) -> dict[str, Any] | None:
    """A cache sidecar, or None if it is missing or unreadable (the cache is then rebuilt)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_meta(path: str | Path, meta: dict[str, Any]) -> None:
    atomic_write_json(path, meta, durable=False)


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


def selected_rows(ds: Any) -> np.ndarray | None:
    """Row numbers of a selection in the underlying table (None: no selection, all rows in order)."""
    return None if ds._indices is None else ds._indices.column(0).to_numpy()


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

"""Protein datasets from FASTA files: cached Arrow builds, a sharded stream, tokenization.

`build_fasta_dataset` parses and tokenizes once per (file content, settings) into a fingerprinted Arrow
cache (`trainer.data.arrow_cache`: one shard per fixed-size chunk of a file, in parallel, written under temp
names and renamed, loaded memory-mapped); the reader's `FastaStats`, each split's token counts and length
histogram (`SplitCounts`) and each shard's rows are stored per chunk in a JSON sidecar per file, so that a
cached load reports the same counts and a shard that does not match is rebuilt, and the build warns about
duplicate ids (found from 64-bit hashes of the ids made by the workers) and nucleotide-only records.
`stream_fasta` reads with bounded memory, in one order the same in every process (the trainer shards it by the
record's index in that order); iterated on its own it gives each record to exactly one (rank, dataloader
worker). Ranks are passed in: nothing here touches `torch.distributed`.
"""

from __future__ import annotations

import ast
import collections
import itertools
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from torch.utils.data import IterableDataset, get_worker_info
from tqdm.auto import tqdm

from trainer.data import arrow_cache
from trainer.data.splits import repeated_hashes
from trainer.families.protein_sedd.fasta import (
    FASTA_COLUMNS,
    ChunkSpan,
    FastaFormatError,
    FastaStats,
    SplitCounts,
    is_compressed,
    iter_fasta_tables,
    iter_record_chunks,
    plan_chunks,
)
from trainer.families.protein_sedd.fasta_arrow import (  # noqa: F401  (CACHE_FEATURES, FASTA_FEATURES: re-exported)
    CACHE_FEATURES,
    FASTA_FEATURES,
    convert_chunk,
    encode_batch,
    id_hashes,
)
from trainer.families.protein_sedd.tokenizer import encode_residues

logger = logging.getLogger(__name__)

FORMAT_VERSION = "fasta-v6"
"""Bump when the reader's output changes, so that old caches are not reused."""

CHUNK_BYTES = 64 << 20
"""Bytes of FASTA text per chunk of a conversion (one Arrow shard each; a chunk starts at the first header at
or after each multiple, so records are never split). Where the chunks fall depends on the file alone: not on
the number of workers. Not part of the cache key (the rows do not depend on it either)."""

SAMPLE_FASTA = "uniprot_sample_3k.fasta.gz"
_DUPLICATE_EXAMPLES = 3


def default_protein_fasta() -> Path:
    """The bundled 3,000-record UniProtKB sample (see samples/README.md beside it)."""
    return Path(__file__).resolve().parent / "samples" / SAMPLE_FASTA


def _as_paths(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    if isinstance(paths, (str, Path)):
        return [Path(paths)]
    return [Path(p) for p in paths]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a SLURM allocation), not the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _in_split(splits: list[str], name: str) -> list[bool]:
    return [s == name for s in splits]


def select_split(ds: datasets.Dataset, split: str) -> datasets.Dataset:
    """The "train" or "validation" rows of a dataset with a `split` column (a cached selection)."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    # Large batches for the selection's indices file as for the shards (arrow_cache.ROWS_PER_BATCH): each process
    # opens it whole at start.
    return ds.filter(_in_split, input_columns="split", batched=True, fn_kwargs={"name": split},
                     batch_size=arrow_cache.ROWS_PER_BATCH, writer_batch_size=arrow_cache.ROWS_PER_BATCH)


def _is_main_guard(test: ast.expr) -> bool:
    """Whether an `if` test is `__name__ == "__main__"` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {type(n).__name__: n for n in (test.left, test.comparators[0])}
    name, const = sides.get("Name"), sides.get("Constant")
    return name is not None and const is not None and name.id == "__name__" and const.value == "__main__"


def _unguarded_main_call() -> tuple[str, int] | None:
    """(script, line) when we were called from the top level of the main script outside an
    `if __name__ == "__main__":` block, else None.

    A spawned worker process starts by running the main script again (as `__mp_main__`, so guarded
    code is skipped): an unguarded call would start workers of its own in every worker, which
    multiprocessing refuses, and a Pool keeps replacing the workers that die of it: a hang.
    """
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if script is None or (spec_name or "").endswith("__main__"):
        return None  # `python -c`, a REPL or a package's __main__.py: spawn does not run it again
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        tree = ast.parse(Path(script).read_text())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None  # cannot tell: keep the parallel build
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_guard(node.test) and \
                node.body[0].lineno <= line <= (node.body[-1].end_lineno or line):
            return None
    return script, line


def build_fasta_dataset(paths: str | Path | Iterable[str | Path], *, cache_dir: str | Path | None = None,
                        split: str | None = None, val_fraction: float = 0.02, min_length: int = 0,
                        max_length: int = 0, nonstandard: str = "keep", salt: str = "",
                        num_proc: int | None = None) -> tuple[datasets.Dataset, FastaStats]:
    """Parse FASTA files (a folder: every file in it) into a cached Arrow dataset with the
    `FASTA_COLUMNS` schema plus `input_ids`.

    The cache key covers every file's size and content (`arrow_cache.file_entries`: not its path or
    mtime) and all settings, so a changed file or setting re-parses and anything else, a copy of the
    file elsewhere included, is a cache hit. `split` selects "train" or
    "validation" (`select_split`); None returns all records with their `split` column. The stats
    always describe the whole parse (all splits, `duplicate_ids` over all files) and are the same
    for cached loads; duplicate ids and nucleotide-only records are logged as warnings. `stats.splits` holds
    each split's token counts and exact-length histogram (`SplitCounts`), counted while converting: statistics
    of a split without a pass over its rows.

    Each file is converted in chunks of `CHUNK_BYTES` of text (whole records), one Arrow shard each, rows
    in file order: the shards, the rows and the cache key do not depend on `num_proc`. `num_proc` worker
    processes (None: every core this process may use; at most one per chunk) parse the chunks; an
    uncompressed file's chunks are read by the workers themselves (byte ranges), a gzip file is
    decompressed here and its chunks handed to the workers, a few at a time. Called from the top level of
    a script without an `if __name__ == "__main__":` guard, the chunks are parsed in this process instead
    (spawned workers would run the script again), with a warning.
    """
    if split not in (None, "train", "validation"):
        raise ValueError(f"split must be None, 'train' or 'validation', got {split!r}")
    files_in = _as_paths(paths)
    if not files_in:
        raise ValueError("no FASTA files given")
    for path in files_in:
        if not path.exists():
            raise FastaFormatError(f"{path}: no such FASTA file or folder")
    settings = {"version": FORMAT_VERSION, "val_fraction": float(val_fraction), "min_length": int(min_length),
                "max_length": int(max_length), "nonstandard": nonstandard, "salt": salt}
    files = [entry for path in files_in for entry in arrow_cache.file_entries(path)]
    for entry in files:
        entry["key"] = arrow_cache.digest({**arrow_cache.input_key(entry), **settings})
    arrow_dir = arrow_cache.cache_root(cache_dir, "fasta_arrow")
    stats_dir = arrow_cache.cache_root(cache_dir, "fasta_stats")
    fingerprint = arrow_cache.digest([f["key"] for f in files])

    def shard(key: str, k: int) -> Path:
        return arrow_dir / f"{key}-{k:05d}.arrow"

    def sidecar(key: str) -> Path:
        return stats_dir / f"{key}-chunks.json"

    chunk_stats: dict[str, list[dict[str, Any]]] = {}
    todo: list[dict[str, Any]] = []
    for entry in files:
        meta = arrow_cache.read_meta(sidecar(entry["key"]))
        if _shards_match(meta, lambda k, key=entry["key"]: shard(key, k)):
            chunk_stats[entry["key"]] = meta["chunks"]
        elif entry["key"] not in {e["key"] for e in todo}:
            todo.append(entry)
    hashes: dict[str, list[np.ndarray]] = {}  # the converted files' id hashes, per chunk
    if todo:
        for entry in todo:  # not trusted while its shards are rewritten: written again once they are all in place
            sidecar(entry["key"]).unlink(missing_ok=True)
        converted = _convert(todo, settings, shard, num_proc)
        for entry in todo:
            chunks = converted[entry["key"]]
            hashes[entry["key"]] = [chunk.pop("id_hashes") for chunk in chunks]
            chunk_stats[entry["key"]] = chunks
            arrow_cache.write_meta(sidecar(entry["key"]), {"file": entry, "chunks": chunks})
    outputs = [shard(entry["key"], k) for entry in files for k in range(len(chunk_stats[entry["key"]]))]
    ds = arrow_cache.load_arrow(outputs, fingerprint)

    by_file: dict[str, FastaStats] = defaultdict(FastaStats)
    for entry in files:
        for chunk in chunk_stats[entry["key"]]:
            by_file[entry["path"]] += FastaStats.from_dict(chunk["stats"])
            by_file[entry["path"]] += FastaStats(splits={k: SplitCounts.from_dict(v)
                                                         for k, v in chunk["splits"].items()})
    stats = FastaStats(splits={})
    for file_stats in by_file.values():
        file_stats.files = 1  # chunks do not count their file
        stats += file_stats

    def shard_hashes() -> Iterator[np.ndarray]:  # in the rows' order: from the conversion, else from the shard
        for entry in files:
            for k in range(len(chunk_stats[entry["key"]])):
                yield hashes[entry["key"]][k] if entry["key"] in hashes else _shard_id_hashes(shard(entry["key"], k))

    duplicates, examples = _duplicate_ids(ds, shard_hashes, stats_dir / f"{fingerprint}.json")
    hashes.clear()
    stats.duplicate_ids = duplicates
    _warn(by_file, duplicates, examples)
    if split is not None:
        ds = select_split(ds, split)
    return ds, stats


def _shards_match(meta: dict[str, Any] | None, shard: Callable[[int], Path]) -> bool:
    """Whether a file's chunks sidecar describes its shards on disk: every shard is readable and has the rows
    the sidecar records (a shard lost, truncated or replaced makes the file convert again)."""
    if meta is None or not meta.get("chunks"):
        return False
    try:
        return all({"stats", "splits"} <= chunk.keys() and arrow_cache.shard_rows(shard(k)) == int(chunk["rows"])
                   for k, chunk in enumerate(meta["chunks"]))
    except (KeyError, TypeError, ValueError):  # a sidecar of another layout
        return False


def _shard_id_hashes(path: Path) -> np.ndarray:
    """`id_hashes` of a shard's ids, in row order (a cached file's, when the duplicate-id check needs them)."""
    with pa.memory_map(str(path)) as source:
        parts = [id_hashes(batch.column("id")) for batch in pa.ipc.open_stream(source)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def _convert(entries: list[dict[str, Any]], settings: dict[str, Any], shard: Callable[[str, int], Path],
             num_proc: int | None) -> dict[str, list[dict[str, Any]]]:
    """Convert files to Arrow shards (`shard(key, chunk)`), chunk by chunk; each file's chunks' results
    (`convert_chunk`'s)."""
    started = time.perf_counter()
    chunk_bytes = CHUNK_BYTES  # read once: the chunks are cut here, never in the workers
    # Uncompressed files first: their chunks are planned at once (a seek each), and the workers start on
    # them while a compressed file is decompressed here.
    order = sorted(entries, key=lambda e: is_compressed(e["path"]))
    plans = {e["key"]: plan_chunks(e["path"], chunk_bytes) for e in order if not is_compressed(e["path"])}
    done_where: list[tuple[str, int]] = []  # (file key, bytes of text) of each job, in order

    def jobs() -> Iterator[tuple[Callable[..., Any], tuple, Path]]:
        for entry in order:
            chunks = plans[entry["key"]] if entry["key"] in plans else iter_record_chunks(entry["path"], chunk_bytes)
            for k, chunk in enumerate(chunks):
                size = chunk.end - chunk.start if isinstance(chunk, ChunkSpan) else len(chunk.data)
                done_where.append((entry["key"], size))
                yield convert_chunk, (entry, settings, chunk), shard(entry["key"], k)

    wanted = available_cores() if num_proc is None else max(1, int(num_proc))
    queue = jobs()
    # The pool is sized by the chunks there are, up to `wanted`: a plain file's are planned, a compressed file's
    # are decompressed to count them. Those peeked are handed on one by one (popped, not kept in a list), so
    # that the chunks held are never more than the ones in flight (workers + 2).
    head = collections.deque(itertools.islice(queue, wanted))
    workers = min(wanted, len(head))
    if workers > 1:
        caller = _unguarded_main_call()
        if caller is not None:
            logger.warning("build_fasta_dataset(num_proc=%s) is called at %s:%d outside an `if __name__ == "
                           "'__main__':` block: spawned workers would run the script again, so its chunks are "
                           "parsed in this process; put the call under that guard to parse in parallel",
                           num_proc, *caller)
            workers = 1
    names = ", ".join(Path(e["path"]).name for e in order)
    # bytes of text: known in advance for uncompressed files only
    total = None if len(plans) < len(order) else sum(c.end - c.start for spans in plans.values() for c in spans)
    bar = tqdm(total=total, desc=f"FASTA -> Arrow ({names})", unit="B", unit_scale=True, unit_divisor=1024,
               dynamic_ncols=True, delay=2, disable=None)  # disable=None: on a terminal only, not in a log file

    def handed_on() -> Iterator[tuple[Callable[..., Any], tuple, Path]]:
        while head:
            yield head.popleft()
        yield from queue

    results: list[dict[str, Any]] = []
    renamed: list[str] = []
    try:
        results = arrow_cache.build_shards(handed_on(), workers, max_in_flight=workers + 2, renamed=renamed,
                                           on_done=lambda i, _: bar.update(done_where[i][1]))
    except BaseException:
        # The shards this build renamed into place: the file fails as a whole. Not the other jobs' names: another
        # builder of the same cache (where the folder cannot hold a lock) may have published those.
        for final in renamed:
            Path(final).unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    seconds = max(time.perf_counter() - started, 1e-9)
    out: dict[str, list[dict[str, Any]]] = {e["key"]: [] for e in entries}
    for (key, _), result in zip(done_where, results):
        out[key].append(result)
    converted = sum(size for _, size in done_where)
    logger.info("FASTA -> Arrow: %d records, %.1f MB of text (%s) in %.1f s (%.0f MB/s), %d chunks, %d worker%s",
                sum(c["stats"]["records"] for c in results), converted / 1e6, names, seconds, converted / 1e6 / seconds,
                len(results), workers, "" if workers == 1 else "s")
    return out


def _take_sorted(column: pa.ChunkedArray, rows: np.ndarray) -> pa.ChunkedArray:
    """`column.take(rows)` for increasing `rows`, chunk by chunk: `ChunkedArray.take` joins the chunks first,
    a copy of the whole column (and a read of every page of it)."""
    starts = np.cumsum([0] + [len(chunk) for chunk in column.chunks])
    bounds = np.searchsorted(rows, starts)
    pieces = [chunk.take(pa.array(rows[lo:hi] - start, pa.int64()))
              for chunk, start, lo, hi in zip(column.chunks, starts, bounds, bounds[1:]) if hi > lo]
    return pa.chunked_array(pieces, type=column.type)


def _duplicate_ids(ds: datasets.Dataset, shard_hashes: Callable[[], Iterable[np.ndarray]],
                   sidecar: Path) -> tuple[int, list[str]]:
    """(records whose id an earlier record had, up to `_DUPLICATE_EXAMPLES` such ids in the order of their
    first record), over the whole build (`ds`, rows in file order); kept in `sidecar`.

    `shard_hashes()` gives `id_hashes` of each shard's rows, in order: 8 bytes a record where a whole-column
    count of the ids would hold every id. Only the rows whose hash repeats have their ids read and counted
    exactly (a hash collision of two ids is not a duplicate)."""
    meta = arrow_cache.read_meta(sidecar)
    if meta is None or "duplicate_ids" not in meta:
        parts = list(shard_hashes())
        repeated = repeated_hashes(parts)
        rows: list[np.ndarray] = []
        first = 0
        for part in parts:
            if len(repeated):
                at = np.minimum(np.searchsorted(repeated, part), len(repeated) - 1)
                rows.append(first + np.flatnonzero(repeated[at] == part))
            first += len(part)
        del parts
        ids = _take_sorted(ds.with_format(None).data.column("id"),
                           np.concatenate(rows) if rows else np.zeros(0, np.int64))
        counts = pc.value_counts(ids)  # in the order of each id's first record
        again = counts.filter(pc.greater(counts.field("counts"), 1))
        meta = {"duplicate_ids": len(ids) - len(counts),
                "examples": again.field("values")[:_DUPLICATE_EXAMPLES].to_pylist()}
        arrow_cache.write_meta(sidecar, meta)
    return int(meta["duplicate_ids"]), list(meta["examples"])


def _warn(by_file: dict[str, FastaStats], duplicates: int, examples: list[str]) -> None:
    """Warnings for input that is legal but probably not what was meant (counted, never silent)."""
    for path, st in by_file.items():
        if st.nucleotide_only:
            logger.warning("%s: %d of %d kept records (10+ residues) hold only the letters A C G T U N: DNA or RNA "
                           "rather than protein? They are kept and read as amino acids", path, st.nucleotide_only,
                           st.kept)
    if duplicates:
        where = next(iter(by_file)) if len(by_file) == 1 else f"{len(by_file)} files"
        logger.warning("%s: %d records repeat the id of an earlier record (e.g. %s); they are kept, and records "
                       "with the same id fall in the same split", where, duplicates, ", ".join(map(repr, examples)))


def tokenize_dataset(ds: datasets.Dataset, num_proc: int | None = None, batch_size: int = 8192) -> datasets.Dataset:
    """`ds` with an int8 `input_ids` column (ids of `encode_residues`).

    `build_fasta_dataset` already writes it while parsing, so its datasets come back unchanged;
    any other dataset with a `sequence` column is mapped on Arrow batches (no per-sequence Python
    objects), cached by its fingerprint.
    """
    if "input_ids" in ds.column_names:
        return ds
    features = ds.features.copy()
    features["input_ids"] = datasets.List(datasets.Value("int8"))
    # the fingerprint (hence the cache file) is datasets' own: ds's fingerprint plus this call's arguments
    out = ds.with_format("arrow").map(encode_batch, batched=True, batch_size=batch_size, features=features,
                                      num_proc=num_proc)
    return out.with_format(ds.format["type"], **ds.format["format_kwargs"])


class FastaStream(IterableDataset):
    """Records of FASTA files, read lazily, in file order; the `split`'s records are counted 0, 1, 2, ...
    (the global index: kept records of the split, after the length and residue policies).

    `iter_global(wanted)` (`trainer.task.GlobalStream`) yields every record of the stream in order, the
    record as a dict where `wanted(index)` and None elsewhere: each block (~2 MiB of the file) is parsed as a
    whole with numpy (whether a record is kept, and its split, need its id and length), and only the wanted
    records become Python objects (and are tokenized). Iterating the stream itself gives record g to shard
    g mod (world_size x num_workers), where shard = rank x num_workers + worker id: every record reaches
    exactly one (rank, worker). `stats` counts what this iterator (in this process) read, a block at a
    time: a stream stopped early has counted the whole block its last record came from.
    """

    def __init__(self, paths: Sequence[Path], *, rank: int, world_size: int, split: str | None,
                 columns: Sequence[str] | None, with_input_ids: bool, reader_kwargs: dict[str, Any]):
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.paths = list(paths)
        self.rank, self.world_size = rank, world_size
        self.split = split
        self.columns = list(columns) if columns is not None else None
        self.with_input_ids = with_input_ids
        self.reader_kwargs = reader_kwargs
        self.stats = FastaStats()

    def shard(self) -> tuple[int, int]:
        """(index, count) of this (rank, worker)."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * workers + worker, self.world_size * workers

    def __iter__(self) -> Iterator[dict[str, Any]]:
        index, count = self.shard()
        for rec in self.iter_global(lambda g: g % count == index):
            if rec is not None:
                yield rec

    def iter_global(self, wanted: Callable[[int], bool]) -> Iterator[dict[str, Any] | None]:
        """One item per record of the stream, in order: the record where `wanted(its index)`, else None."""
        columns = self.columns if self.columns is not None else list(FASTA_COLUMNS)
        read = [c for c in FASTA_COLUMNS if c in columns or (self.with_input_ids and c == "sequence")]
        first = 0  # global index of the table's first record
        for path in self.paths:
            for table in iter_fasta_tables(path, stats=self.stats, **self.reader_kwargs):
                if self.split is not None:
                    table = table.filter(pc.equal(table.column("split"), self.split))
                picks = [k for k in range(table.num_rows) if wanted(first + k)]
                records = iter(table.select(read).take(picks).to_pylist() if picks else ())
                picked = set(picks)
                for k in range(table.num_rows):
                    yield self._decode(next(records)) if k in picked else None
                first += table.num_rows

    def _decode(self, rec: dict[str, Any]) -> dict[str, Any]:
        if self.with_input_ids:
            rec["input_ids"] = encode_residues(rec["sequence"])
        return rec if self.columns is None else {k: rec[k] for k in self.columns}


def stream_fasta(paths: str | Path | Iterable[str | Path], *, rank: int = 0, world_size: int = 1,
                 split: str | None = None, val_fraction: float = 0.02, min_length: int = 0, max_length: int = 0,
                 nonstandard: str = "keep", salt: str = "", columns: Sequence[str] | None = None,
                 with_input_ids: bool = False) -> FastaStream:
    """A `torch.utils.data.IterableDataset` over FASTA records with bounded memory (see `FastaStream`).

    `columns` restricts the yielded fields (None = all of `FASTA_COLUMNS`); `with_input_ids` adds
    `input_ids` from `encode_residues`.
    """
    if split not in (None, "train", "validation"):
        raise ValueError(f"split must be None, 'train' or 'validation', got {split!r}")
    reader_kwargs = {"val_fraction": val_fraction, "min_length": min_length, "max_length": max_length,
                     "nonstandard": nonstandard, "salt": salt}
    return FastaStream(_as_paths(paths), rank=rank, world_size=world_size, split=split, columns=columns,
                       with_input_ids=with_input_ids, reader_kwargs=reader_kwargs)

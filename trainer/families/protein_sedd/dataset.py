"""Protein datasets from FASTA files: cached Arrow builds, a sharded stream, tokenization.

`build_fasta_dataset` parses and tokenizes once per (file content, settings) into a fingerprinted
Arrow cache (the reader's Arrow tables written with `datasets`' ArrowWriter, loaded memory-mapped);
the reader's `FastaStats` are stored as a JSON sidecar per file so that a cached load reports the
same counts. `stream_fasta` reads with bounded memory and gives each record to exactly one (rank,
dataloader worker). Ranks are passed in: nothing here touches `torch.distributed`.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import datasets
import numpy as np
import pyarrow as pa
from datasets.arrow_writer import ArrowWriter
from torch.utils.data import IterableDataset, get_worker_info

from trainer.families.protein_sedd.fasta import FASTA_COLUMNS, FASTA_SCHEMA, FastaStats, iter_fasta, iter_fasta_tables
from trainer.families.protein_sedd.tokenizer import _TABLE, encode_residues

FORMAT_VERSION = "fasta-v3"
"""Bump when the reader's output changes, so that old caches are not reused."""
TOKENIZE_VERSION = "protein-tok-v1"

FASTA_FEATURES = datasets.Features.from_arrow_schema(FASTA_SCHEMA)
assert list(FASTA_FEATURES) == list(FASTA_COLUMNS)
CACHE_FEATURES = datasets.Features({**FASTA_FEATURES, "input_ids": datasets.List(datasets.Value("int8"))})
"""The cached dataset: the reader's columns plus `input_ids`, tokenized in the same pass."""

SAMPLE_FASTA = "uniprot_sample_3k.fasta.gz"


def default_protein_fasta() -> Path:
    """The bundled 3,000-record UniProtKB sample (see samples/README.md beside it)."""
    return Path(__file__).resolve().parent / "samples" / SAMPLE_FASTA


def _as_paths(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    if isinstance(paths, (str, Path)):
        return [Path(paths)]
    return [Path(p) for p in paths]


def _digest(obj: Any) -> str:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True).encode(), digest_size=16).hexdigest()


def _file_entry(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """What identifies one file's parse: its absolute path, size and mtime, plus the settings."""
    path = path.resolve()
    st = path.stat()
    entry = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    entry["key"] = _digest({**entry, **settings})
    return entry


def _write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _write_shard(entry: dict[str, Any], settings: dict[str, Any], out_path: str, stats_dir: str) -> None:
    """Parse one (file, shard) into an Arrow cache file (temp name + rename) and its stats sidecar."""
    reader_kwargs = {k: settings[k] for k in ("min_length", "max_length", "nonstandard", "val_fraction", "salt")}
    stats = FastaStats()
    tmp = f"{out_path}.{os.getpid()}.tmp"
    with ArrowWriter(features=CACHE_FEATURES, path=tmp) as writer:
        for table in iter_fasta_tables(entry["path"], stats=stats, shard=tuple(entry["shard"]), **reader_kwargs):
            writer.write_table(_encode_batch(table))
        writer.finalize()
    os.replace(tmp, out_path)
    _write_json_atomic(Path(stats_dir) / f"{entry['stats_key']}.json", {"file": entry, "stats": stats.to_dict()})


def _write_shard_star(args: tuple) -> None:
    _write_shard(*args)


def _in_split(splits: list[str], name: str) -> list[bool]:
    return [s == name for s in splits]


def build_fasta_dataset(paths: str | Path | Iterable[str | Path], *, cache_dir: str | Path | None = None,
                        split: str | None = None, val_fraction: float = 0.02, min_length: int = 0,
                        max_length: int = 0, nonstandard: str = "keep", salt: str = "",
                        num_proc: int | None = None) -> tuple[datasets.Dataset, FastaStats]:
    """Parse FASTA files into a cached Arrow dataset with the `FASTA_COLUMNS` schema.

    The cache key covers every file's absolute path, size and mtime and all settings, so a changed
    file or setting re-parses and anything else is a cache hit. `split` selects "train" or
    "validation" (by `split_of` on the id); None returns all records with their `split` column. The
    stats always describe the whole parse (all splits) and are the same for cached loads.
    `num_proc` > 1 parses in that many processes; each scans every file but decodes only records
    k with k mod num_proc = its index, so one big file (UniRef50) parallelises too. Row order then
    depends on num_proc, which is therefore part of the cache key.
    """
    if split not in (None, "train", "validation"):
        raise ValueError(f"split must be None, 'train' or 'validation', got {split!r}")
    files_in = _as_paths(paths)
    if not files_in:
        raise ValueError("no FASTA files given")
    settings = {"version": FORMAT_VERSION, "val_fraction": float(val_fraction), "min_length": int(min_length),
                "max_length": int(max_length), "nonstandard": nonstandard, "salt": salt}
    files = [_file_entry(p, settings) for p in files_in]
    n_shards = max(1, num_proc or 1)
    shards = [{**f, "shard": [i, n_shards], "stats_key": f"{f['key']}-{i}of{n_shards}"}
              for f in files for i in range(n_shards)]
    root = Path(cache_dir) if cache_dir is not None else Path(datasets.config.HF_DATASETS_CACHE)
    stats_dir = root / "fasta_stats"
    fingerprint = _digest([f["key"] for f in files] + [n_shards])
    arrow_dir = root / "fasta_arrow"
    arrow_dir.mkdir(parents=True, exist_ok=True)
    outputs = [str(arrow_dir / f"{fingerprint}-{i:05d}.arrow") for i in range(len(shards))]
    todo = [(entry, settings, out, str(stats_dir)) for entry, out in zip(shards, outputs) if not Path(out).exists()]
    if len(todo) > 1 and n_shards > 1:
        # spawn, not fork: forking a process that runs threads (TensorBoard's writer, tqdm's monitor,
        # the gzip reader) can leave a child waiting forever on a lock held at the fork
        with multiprocessing.get_context("spawn").Pool(min(n_shards, len(todo))) as pool:
            pool.map(_write_shard_star, todo)
    else:
        for job in todo:
            _write_shard(*job)
    parts = [datasets.Dataset.from_file(out) for out in outputs]
    ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    ds._fingerprint = fingerprint  # content-addressed: derived datasets (split, tokens) cache under it
    stats = FastaStats()
    for entry in shards:
        sidecar = stats_dir / f"{entry['stats_key']}.json"
        if sidecar.exists():
            stats += FastaStats.from_dict(json.loads(sidecar.read_text())["stats"])
        else:
            # The Arrow cache outlived its sidecar: recount rather than report wrong numbers.
            file_stats = FastaStats()
            for _ in iter_fasta_tables(entry["path"], stats=file_stats, shard=tuple(entry["shard"]), **{
                    k: settings[k] for k in ("min_length", "max_length", "nonstandard", "val_fraction", "salt")}):
                pass
            _write_json_atomic(sidecar, {"file": entry, "stats": file_stats.to_dict()})
            stats += file_stats
    stats.files = len(files)  # each shard counted its file once
    if split is not None:
        ds = ds.filter(_in_split, input_columns="split", batched=True, fn_kwargs={"name": split},
                       new_fingerprint=_digest([fingerprint, "split", split]))
    return ds, stats


_TOKEN_TABLE = _TABLE.tobytes()


def _encode_batch(batch: pa.Table) -> pa.Table:
    """`batch` plus input_ids: one `bytes.translate` over the residue buffer, the sequences' offsets reused."""
    sequence = batch.column("sequence").combine_chunks()
    if sequence.offset or sequence.null_count:  # a sliced or null-holding array: take the general path
        sequence = pa.array(sequence.to_pylist(), pa.string())
    _, offsets_buf, values_buf = sequence.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=len(sequence) + 1)
    residues = memoryview(values_buf)[offsets[0]:offsets[-1]] if len(sequence) else b""
    values = np.frombuffer(bytes(residues).translate(_TOKEN_TABLE), dtype=np.int8)
    ids = pa.ListArray.from_arrays(pa.array(offsets - offsets[0]), pa.array(values))
    return batch.append_column("input_ids", ids)


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
    out = ds.with_format("arrow").map(_encode_batch, batched=True, batch_size=batch_size, features=features,
                                      num_proc=num_proc, new_fingerprint=_digest([ds._fingerprint, TOKENIZE_VERSION]))
    return out.with_format(ds.format["type"], **ds.format["format_kwargs"])


class FastaStream(IterableDataset):
    """Records of FASTA files, read lazily and sharded over (rank, dataloader worker).

    Record k of a file (counting every header) goes to shard k mod (world_size x num_workers), where
    shard = rank x num_workers + worker id: every record reaches exactly one (rank, worker). Each
    worker still scans the whole file, but only decodes and validates its own records. `stats`
    counts what this iterator (in this process) read, a block (~2 MiB of the file) at a time: a
    stream stopped early has counted the whole block its last record came from.
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
        shard = self.shard()
        for path in self.paths:
            for rec in iter_fasta(path, stats=self.stats, shard=shard, **self.reader_kwargs):
                if self.split is not None and rec["split"] != self.split:
                    continue
                if self.with_input_ids:
                    rec["input_ids"] = encode_residues(rec["sequence"])
                if self.columns is not None:
                    rec = {k: rec[k] for k in self.columns}
                yield rec


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

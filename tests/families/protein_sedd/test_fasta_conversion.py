"""The FASTA -> Arrow conversion's by-products and its cache's trust: the per-split counts the task statistics
come from (no pass over the data), the duplicate-id check from 64-bit hashes, a failed build removing only its
own shards, a cache whose shards do not match their sidecar rebuilt, bounded chunks held, and one line-ending
decision for every path."""

from __future__ import annotations

import gzip
import logging
import random
import weakref
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from trainer.data import arrow_cache
from trainer.data.splits import repeated_hashes
from trainer.families.protein_sedd import dataset, fasta, fasta_arrow
from trainer.families.protein_sedd.dataset import build_fasta_dataset, select_split, stream_fasta
from trainer.families.protein_sedd.task import residue_counts, split_statistics
from trainer.families.protein_sedd.tokenizer import AMINO_ACIDS, VOCAB_SIZE


def fasta_text(records: int, seed: int = 0, ids=None) -> str:
    """Records of lengths 1..400 (many above a small max_length), with a few non-standard residues."""
    rng = random.Random(seed)
    lines = []
    for k in range(records):
        seq = "".join(rng.choice(AMINO_ACIDS + "XB") for _ in range(rng.randint(1, 400)))
        lines.append(f">{ids[k] if ids else f'r{k}'} some description\n" + "\n".join(
            seq[i:i + 60] for i in range(0, len(seq), 60)))
    return "\n".join(lines) + "\n"


def write(path: Path, text: str, gz: bool = False) -> Path:
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def direct_counts(ds, split: str) -> tuple[np.ndarray, dict[int, int]]:
    """A split's token counts and exact-length histogram counted from the built rows."""
    part = select_split(ds, split)
    tokens = np.bincount(np.concatenate([np.asarray(x, np.int64) for x in part["input_ids"]] or [np.zeros(0, int)]),
                         minlength=VOCAB_SIZE)
    lengths, counts = np.unique(np.asarray(part["length"]), return_counts=True)
    return tokens, dict(zip(lengths.tolist(), counts.tolist()))


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_conversion_counts_per_split_equal_a_direct_count(tmp_path, monkeypatch, gz):
    """Several chunks and two files: the summed counts equal a count of the rows, for a fresh build and a cached
    load, and the task's statistics derived from them equal today's count (lengths above max_length folded)."""
    monkeypatch.setattr(dataset, "CHUNK_BYTES", 4000)
    a = write(tmp_path / ("a.fa.gz" if gz else "a.fa"), fasta_text(120, seed=1), gz)
    b = write(tmp_path / "b.fa", fasta_text(40, seed=2).replace(">r", ">s"))
    for _ in range(2):  # converted, then cached
        ds, stats = build_fasta_dataset([a, b], cache_dir=tmp_path / "c", val_fraction=0.3, nonstandard="map",
                                        min_length=3)
        assert stats.train and stats.validation and set(stats.splits) == {"train", "validation"}
        for split in ("train", "validation"):
            tokens, lengths = direct_counts(ds, split)
            summed = stats.splits[split]
            assert summed.token_counts.tolist() == tokens.tolist() and summed.length_counts == lengths
            assert max(lengths) > 64
            part = select_split(ds, split)
            residues, histogram = split_statistics(summed, 64)
            assert residues.tolist() == residue_counts(part).tolist()
            folded, per = np.unique(np.minimum(np.asarray(part["length"]), 64), return_counts=True)
            assert histogram == {str(n): k for n, k in zip(folded.tolist(), per.tolist())}
    assert len(ds.cache_files) > 4


def exact_duplicates(ds) -> tuple[int, list[str]]:
    """What the whole-column count gave: (records whose id an earlier record had, the first 3 repeated ids)."""
    counts = pc.value_counts(ds.with_format(None).data.column("id").combine_chunks())
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    return len(ds) - len(counts), repeated.field("values")[:3].to_pylist()


def test_repeated_hashes_over_parts_and_buckets():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2**64, 5000, dtype=np.uint64)
    parts = [values[:2000], np.concatenate([values[1990:3000], values[[5, 5, 4999]]]), values[3000:]]
    assert repeated_hashes(parts).tolist() == sorted(values[[5, 4999, *range(1990, 2000)]].tolist())
    assert repeated_hashes(parts, buckets=1).tolist() == repeated_hashes(parts, buckets=64).tolist() == \
        repeated_hashes(parts).tolist()
    assert repeated_hashes([values]).tolist() == repeated_hashes([]).tolist() == []


def test_duplicate_ids_from_hashes_equal_the_exact_count(tmp_path, monkeypatch, caplog):
    """Duplicates within a chunk, across chunks and across files (one converted, one cached); with a hash that
    collides for most ids the result is still exact; the whole id column is never read."""
    monkeypatch.setattr(dataset, "CHUNK_BYTES", 3000)
    rng = random.Random(4)
    ids = [f"id{rng.randint(0, 60)}" for _ in range(150)]
    a = write(tmp_path / "a.fa", fasta_text(150, seed=3, ids=ids))
    b = write(tmp_path / "b.fa", fasta_text(30, seed=5, ids=[f"id{k}" for k in range(200, 230)]))
    monkeypatch.setattr(arrow_cache, "selected_column", lambda *a, **k: pytest.fail("read the whole id column"))
    caplog.set_level(logging.WARNING, logger="trainer.families.protein_sedd.dataset")
    ds, stats = build_fasta_dataset(a, cache_dir=tmp_path / "c", num_proc=1)
    count, examples = exact_duplicates(ds)
    assert stats.duplicate_ids == count > 50 and len(ds.cache_files) > 3
    assert f"{count} records repeat the id of an earlier record (e.g. {', '.join(map(repr, examples))})" in caplog.text

    weak = lambda ids: np.array([len(s) % 3 for s in ids.to_pylist()], dtype=np.uint64)  # noqa: E731
    monkeypatch.setattr(fasta_arrow, "id_hashes", weak)  # the workers' (in this process: num_proc=1)
    monkeypatch.setattr(dataset, "id_hashes", weak)  # the builder's, for the cached file
    caplog.clear()
    ds2, stats2 = build_fasta_dataset([b, a], cache_dir=tmp_path / "c", num_proc=1)  # b converted, a cached
    count, examples = exact_duplicates(ds2)
    assert stats2.duplicate_ids == count == stats.duplicate_ids
    assert f"(e.g. {', '.join(map(repr, examples))})" in caplog.text
    ds3, stats3 = build_fasta_dataset([a, b, a], cache_dir=tmp_path / "d", num_proc=1)
    assert stats3.duplicate_ids == exact_duplicates(ds3)[0] == stats.duplicate_ids + len(ids)  # a again: all repeat


def test_duplicate_examples_in_the_order_of_their_first_record(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainer.families.protein_sedd.dataset")
    path = write(tmp_path / "x.fa", ">x\nMKV\n>y\nMK\n>y\nMKVL\n>z\nM\n>x\nMM\n>z\nMKK\n")
    _, stats = build_fasta_dataset(path, cache_dir=tmp_path / "c", val_fraction=0.0)
    assert stats.duplicate_ids == 3
    assert "3 records repeat the id of an earlier record (e.g. 'x', 'y', 'z')" in caplog.text


def test_failed_build_removes_only_the_shards_it_renamed(tmp_path, monkeypatch):
    """Another builder of the same cache published chunk 3's shard; this build fails on chunk 3 (a killed
    worker, a full disk): its own shards (0-2) go, the other builder's stays."""
    monkeypatch.setattr(dataset, "CHUNK_BYTES", 3000)
    path = write(tmp_path / "a.fa", fasta_text(100, seed=6))
    real = dataset.convert_chunk

    def failing(entry, settings, chunk, tmp):
        if Path(tmp).name.split(".")[1].endswith("-00003"):
            raise OSError("disk full")
        return real(entry, settings, chunk, tmp)

    ds, _ = build_fasta_dataset(path, cache_dir=tmp_path / "c", num_proc=1)
    shards = [Path(f["filename"]) for f in ds.cache_files]
    for f in (tmp_path / "c" / "fasta_stats").iterdir():
        f.unlink()  # as if not built yet; shard 3 stands for the other builder's
    for k, shard in enumerate(shards):
        if k != 3:
            shard.unlink()
    monkeypatch.setattr(dataset, "convert_chunk", failing)
    with pytest.raises(OSError, match="disk full"):
        build_fasta_dataset(path, cache_dir=tmp_path / "c", num_proc=1)
    assert [p.name for p in sorted((tmp_path / "c" / "fasta_arrow").iterdir())] == [shards[3].name]


def test_build_shards_reports_what_it_renamed(tmp_path):
    def write_text(text, tmp):
        Path(tmp).write_text(text)

    def jobs():
        yield write_text, ("a",), tmp_path / "a"
        yield write_text, ("b",), tmp_path / "b"
        raise ValueError("input damaged")

    renamed: list[str] = []
    with pytest.raises(ValueError):
        arrow_cache.build_shards(jobs(), renamed=renamed)
    assert renamed == [str(tmp_path / "a"), str(tmp_path / "b")]


@pytest.mark.parametrize("damage", ["truncated", "other rows", "missing"])
def test_shards_that_do_not_match_their_sidecar_are_rebuilt(tmp_path, monkeypatch, damage):
    monkeypatch.setattr(dataset, "CHUNK_BYTES", 3000)
    path = write(tmp_path / "a.fa", fasta_text(100, seed=7))
    ds, stats = build_fasta_dataset(path, cache_dir=tmp_path / "c", num_proc=1)
    rows = list(zip(ds["id"], ds["sequence"]))
    shards = [Path(f["filename"]) for f in ds.cache_files]
    lengths = [len(arrow_cache.load_arrow([s], "x")) for s in shards]
    if damage == "truncated":
        shards[2].write_bytes(shards[2].read_bytes()[:-100])
    elif damage == "other rows":  # a whole, readable shard of another length
        shards[2].write_bytes(shards[next(k for k, n in enumerate(lengths) if n != lengths[2])].read_bytes())
    else:
        shards[2].unlink()
    calls = fasta.PARSE_CALLS
    again, stats2 = build_fasta_dataset(path, cache_dir=tmp_path / "c", num_proc=1)
    assert fasta.PARSE_CALLS == calls + 1 and list(zip(again["id"], again["sequence"])) == rows and stats2 == stats
    assert [arrow_cache.shard_rows(s) for s in shards] == lengths  # read from the batches' headers


def test_sidecar_deleted_before_the_file_is_converted_again(tmp_path, monkeypatch):
    """A rebuild that fails leaves no sidecar vouching for the shards it was rewriting."""
    monkeypatch.setattr(dataset, "CHUNK_BYTES", 3000)
    path = write(tmp_path / "a.fa", fasta_text(60, seed=8))
    ds, _ = build_fasta_dataset(path, cache_dir=tmp_path / "c", num_proc=1)
    Path(ds.cache_files[1]["filename"]).unlink()
    monkeypatch.setattr(dataset, "convert_chunk", lambda *a: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError):
        build_fasta_dataset(path, cache_dir=tmp_path / "c", num_proc=1)
    assert not list((tmp_path / "c" / "fasta_stats").glob("*-chunks.json"))


def test_compressed_chunks_held_are_bounded_by_the_jobs_in_flight(tmp_path, monkeypatch):
    """num_proc=None on many cores: the chunks peeked to size the pool are handed on, not kept for the build."""
    monkeypatch.setattr(dataset, "CHUNK_BYTES", 2000)
    monkeypatch.setattr(dataset, "available_cores", lambda: 6)
    path = write(tmp_path / "a.fa.gz", fasta_text(150, seed=9), gz=True)
    live: weakref.WeakSet = weakref.WeakSet()
    held: list[int] = []
    real_chunks, real_build = dataset.iter_record_chunks, arrow_cache.build_shards

    def chunks(*args):
        for chunk in real_chunks(*args):
            live.add(chunk)
            held.append(len(live))
            yield chunk
            del chunk

    sizes = []
    monkeypatch.setattr(dataset, "iter_record_chunks", chunks)
    monkeypatch.setattr(arrow_cache, "build_shards",
                        lambda jobs, workers, **kw: sizes.append(workers) or real_build(jobs, 1, **kw))  # in process
    build_fasta_dataset(path, cache_dir=tmp_path / "c")
    assert sizes == [6] and len(held) > 12
    assert held[:6] == [1, 2, 3, 4, 5, 6] and max(held[8:]) <= 3, held  # 6 peeked to size the pool, then the ones in flight


def test_cr_only_detection_is_the_same_in_every_path(tmp_path, monkeypatch):
    """Lines ending in '\\r' alone for the first block, '\\n' later: the stream, the planned plain file and the
    chunked gzip read (bigger first blocks) decide the same, and read the same records."""
    monkeypatch.setattr(fasta, "_READ_SIZE", 1000)
    text = fasta_text(40, seed=10)
    cut = text.index(">r20 ")
    mixed = text[:cut].replace("\n", "\r") + text[cut:]
    plain, gz = write(tmp_path / "m.fa", mixed), write(tmp_path / "m.fa.gz", mixed, gz=True)
    expected = [(r["id"], r["sequence"]) for r in fasta.iter_fasta(write(tmp_path / "u.fa", text))]
    assert [(r["id"], r["sequence"]) for r in stream_fasta(plain)] == expected
    for path in (plain, gz):
        ds, _ = build_fasta_dataset(path, cache_dir=tmp_path / f"cache-{path.name}", num_proc=1)
        assert list(zip(ds["id"], ds["sequence"])) == expected, path.name

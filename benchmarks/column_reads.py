"""Protein data start-up: whole-column reads and lazy packing against the per-row code they replaced.

Writes a UniRef50-shaped FASTA (`uniref_fasta.py`: UniRef headers, 60-column lines, log-normal lengths with a
mean of about 286, natural residue frequencies) of `--records` records, builds its Arrow cache once, then
times, in one process, each start-up step of `protein_sedd` with `task.packing=true` on the training
split, old (the code before, copied here) against new (the package's):

  lengths    `np.asarray(reference["length"])` against `column_array(reference, "length")`
  counts     a bincount per sequence against `residue_counts` (one bincount per Arrow chunk)
  packing    the per-rank int8 copy of every residue, one slice per sequence, against `PackedBlocks`
             (offsets only; blocks assembled on access), and reading every block of each

plus the peak RSS growth of building each packing (`ru_maxrss`: the new one is measured first). Prints
a table; writes nothing to BENCHMARKS.md. Usage:
  python benchmarks/column_reads.py --records 200000 --workdir /tmp/colreads
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from uniref_fasta import uniref_fasta_in  # noqa: E402  (the shared UniRef50-shaped generator)


def old_packing(tokenized, max_length: int, seed: int) -> np.ndarray:
    from trainer.data.arrow_cache import selected_column
    from trainer.families.protein_sedd.task import SEP_STATE, residue_states
    from trainer.seeding import derive_rng

    column = selected_column(tokenized, "input_ids")
    offsets = column.offsets.to_numpy()
    values = residue_states(column.values.to_numpy())
    lengths = np.diff(offsets)
    order = derive_rng("protein_sedd/packing", seed).permutation(len(lengths))
    stream = np.full(int(lengths.sum()) + len(lengths), SEP_STATE, dtype=np.int8)
    starts = np.concatenate([[0], np.cumsum(lengths[order] + 1)[:-1]])
    for start, k in zip(starts, order):
        stream[start:start + lengths[k]] = values[offsets[k]:offsets[k + 1]]
    num_blocks = len(stream) // max_length
    return stream[: num_blocks * max_length].reshape(num_blocks, max_length)


def old_counts(tokenized) -> np.ndarray:
    from trainer.families.protein_sedd.task import FIRST_RESIDUE_ID, NUM_RESIDUES, VOCAB_SIZE

    counts = np.zeros(VOCAB_SIZE, dtype=np.int64)
    for batch in tokenized.with_format("numpy", columns=["input_ids"]).iter(batch_size=1000):
        for ids in batch["input_ids"]:
            counts += np.bincount(ids.astype(np.int64), minlength=VOCAB_SIZE)
    return counts[FIRST_RESIDUE_ID:FIRST_RESIDUE_ID + NUM_RESIDUES].astype(np.float64)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(label: str, fn, results: dict):
    t0 = time.perf_counter()
    out = fn()
    results[label] = time.perf_counter() - t0
    print(f"{label}: {results[label]:.3f} s", file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--workdir", default="/tmp/column_reads")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--skip-old-lengths", action="store_true", help="skip the row-by-row length read (slow)")
    p.add_argument("--smoke", action="store_true", help="2,000 records in a temp folder: checks the script runs")
    a = p.parse_args()
    if a.smoke:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="column-reads-") as tmp:
            a.records, a.workdir = 2000, tmp
            measure(a)
        print("smoke run: nothing written")
        return
    measure(a)


def measure(a: argparse.Namespace) -> None:
    """Generate (once) and cache the FASTA under `a.workdir`, time each step old and new, print the table."""
    import datasets

    datasets.disable_progress_bars()
    from trainer.data.arrow_cache import column_array
    from trainer.families.protein_sedd.dataset import build_fasta_dataset, select_split, tokenize_dataset
    from trainer.families.protein_sedd.task import PackedBlocks, residue_counts

    work = Path(a.workdir)
    fasta = uniref_fasta_in(work, a.records, say=lambda line: print(line, file=sys.stderr))
    r: dict[str, float] = {}
    records, _ = timed("arrow build (or cache load)", lambda: build_fasta_dataset(str(fasta), cache_dir=str(work / "cache"),
                                                                                   val_fraction=0.05), r)
    train = tokenize_dataset(select_split(records, "train"))
    residues = int(column_array(train, "length").sum())
    print(f"train: {len(train):,} sequences, {residues:,} residues", file=sys.stderr)
    new_len = timed("lengths new: column_array", lambda: column_array(train, "length"), r)
    if not a.skip_old_lengths:
        old_len = timed("lengths old: np.asarray(ds['length'])", lambda: np.asarray(train["length"]), r)
        assert np.array_equal(old_len, new_len)
    new_c = timed("counts new: residue_counts", lambda: residue_counts(train), r)
    old_c = timed("counts old: bincount per sequence", lambda: old_counts(train), r)
    assert np.array_equal(old_c, new_c)
    base = rss_mib()
    packed = timed("packing new: PackedBlocks()", lambda: PackedBlocks(train, a.max_length, 0), r)
    r["rss new MiB"] = rss_mib() - base
    got = timed("packing new: read every block", lambda: [packed[i]["states"] for i in range(len(packed))], r)
    base = rss_mib()
    blocks = timed("packing old: per-sequence slices", lambda: old_packing(train, a.max_length, 0), r)
    r["rss old MiB"] = rss_mib() - base
    old_read = timed("packing old: read every block",
                     lambda: [blocks[i].astype(np.int64) for i in range(len(blocks))], r)
    assert len(got) == len(old_read) and all(np.array_equal(x, y) for x, y in zip(got, old_read))
    print("| step | seconds (rss: MiB) |\n|---|---:|")
    for k, v in r.items():
        print(f"| {k} | {v:.3f} |")


if __name__ == "__main__":
    main()

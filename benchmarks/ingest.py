"""FASTA.gz -> tokenized Arrow ingest speed (sequences/s), and the streaming reader's peak memory.

One process on CPU, median of `--repeats` interleaved repeats (after one untimed warm-up of each
Python method, so that lazy imports are not timed):

  (a) baseline  what people write: Biopython `SeqIO.parse(gzip.open(f, "rt"), "fasta")`, a Python
                loop over each residue with a dict lookup building a list of ids, then
                `datasets.Dataset.from_dict({"id", "description", "sequence", "input_ids"})` (Arrow,
                in memory).
  (b) ours      `build_fasta_dataset(f, cache_dir=<fresh temp dir>)` + `tokenize_dataset`: header
                parsing into the 19-column schema, residue policy, split, stats sidecar, Arrow
                files on disk, int8 `input_ids` (written in the same pass; `tokenize_dataset` then
                has nothing to do); uncached (a fresh cache dir every repeat). One process; gzip is
                decompressed by ISA-L in a second thread while the first parses.
  (b2)          (b) with decompression in the parsing thread (`fasta.DECOMPRESS_IN_THREAD = False`).
  (b1)          `iter_fasta_tables` alone, for the breakdown: the reader without Arrow files.
  (c) I/O limit `gzip -dc f > /dev/null` in a subprocess: decompression only.

Streaming: `stream_fasta(f, with_input_ids=True)` iterated to the end over `f` and over an 8x
concatenation of it (a multi-member .fasta.gz in a temp dir), each in a fresh Python process that
reports its peak RSS (`ru_maxrss`) and its RSS after imports.

Targets: b/a >= 5; c/b <= 3; streaming peak RSS of 8x within 10 % of 1x.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import datasets
import numpy as np
from bench_report import command_line, cpu_model, utc_now, write_section

from trainer.families.protein_sedd import fasta
from trainer.families.protein_sedd.dataset import build_fasta_dataset, tokenize_dataset
from trainer.families.protein_sedd.fasta import iter_fasta_tables
from trainer.families.protein_sedd.tokenizer import UNK_ID, VOCAB

TOPIC = "Data ingest and streaming"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

DEFAULT_FILE = None
"""--file default: the bundled 3,000-sequence UniProt sample (BENCHMARKS.md used the 16,000-record file
of Debian's mmseqs2-examples, `example-data/DB.fasta.gz`: pass it with --file)."""
CONCAT = 8


def run_baseline(path: str, workdir: str) -> int:  # noqa: ARG001
    from Bio import SeqIO

    vocab = dict(VOCAB)
    ids, descriptions, sequences, input_ids = [], [], [], []
    with gzip.open(path, "rt") as handle:
        for record in SeqIO.parse(handle, "fasta"):
            seq = str(record.seq)
            ids.append(record.id)
            descriptions.append(record.description)
            sequences.append(seq)
            input_ids.append([vocab.get(ch, UNK_ID) for ch in seq])
    ds = datasets.Dataset.from_dict({"id": ids, "description": descriptions, "sequence": sequences,
                                     "input_ids": input_ids})
    return len(ds)


def run_ours(path: str, workdir: str) -> int:
    cache = tempfile.mkdtemp(dir=workdir)
    try:
        ds, _ = build_fasta_dataset(path, cache_dir=cache)
        return len(tokenize_dataset(ds))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run_ours_one_thread(path: str, workdir: str) -> int:
    fasta.DECOMPRESS_IN_THREAD = False
    try:
        return run_ours(path, workdir)
    finally:
        fasta.DECOMPRESS_IN_THREAD = True


def run_parse(path: str, workdir: str) -> int:  # noqa: ARG001
    return sum(t.num_rows for t in iter_fasta_tables(path, val_fraction=0.02))


def run_gzip(path: str, workdir: str) -> int:  # noqa: ARG001
    subprocess.run(["gzip", "-dc", path], stdout=subprocess.DEVNULL, check=True)
    return -1


METHODS = {"a": run_baseline, "b": run_ours, "b2": run_ours_one_thread, "b1": run_parse, "c": run_gzip}

# ru_maxrss is a high-water mark that the imports (torch, datasets, transformers) already set, so the
# child also samples its current RSS (/proc/self/statm) every 1,000 records: the growth over the
# RSS after imports is what shows whether streaming memory stays flat.
_STREAM_CHILD = """
import os, resource, sys
from trainer.families.protein_sedd.dataset import stream_fasta
page = os.sysconf("SC_PAGE_SIZE") // 1024
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
rss0 = rss()
n = res = 0
top = rss0
for rec in stream_fasta(sys.argv[1], with_input_ids=True):
    n += 1
    res += len(rec["input_ids"])
    if n % 1000 == 0:
        top = max(top, rss())
print(n, res, rss0, max(top, rss()), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def stream_peak(path: str) -> tuple[int, float, float, float]:
    """(records, RSS after imports, max sampled RSS while streaming, ru_maxrss peak), MiB, fresh process."""
    out = subprocess.run([sys.executable, "-c", _STREAM_CHILD, path], capture_output=True, text=True, check=True)
    n, _, rss0, top, peak = map(int, out.stdout.split())
    return n, rss0 / 1024, top / 1024, peak / 1024


def machine() -> str:
    cpu = cpu_model()
    import Bio
    import pyarrow
    return (f"{cpu}; Python {platform.python_version()}, datasets {datasets.__version__}, "
            f"pyarrow {pyarrow.__version__}, numpy {np.__version__}, biopython {Bio.__version__}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", default=DEFAULT_FILE, help="FASTA(.gz) file to ingest")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per method; median reported")
    p.add_argument("--out", help="add this benchmark's section (machine, command, table) atop its topic in this markdown file")
    p.add_argument("--smoke", action="store_true", help="200 records of the bundled sample, one repeat, nothing "
                   "written (the baseline only if biopython is installed): checks the script runs")
    a = p.parse_args()
    if a.smoke:
        smoke(a.file)
        return
    if a.file is None:
        from trainer.families.protein_sedd.dataset import default_protein_fasta

        a.file = str(default_protein_fasta())
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    started = time.perf_counter()
    times: dict[str, list[float]] = {k: [] for k in METHODS}
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="ingest-") as workdir:
        for key in ("a", "b", "b2"):
            counts[key] = METHODS[key](a.file, workdir)  # warm-up: imports, page cache
        for r in range(a.repeats):
            for key, fn in METHODS.items():
                t0 = time.perf_counter()
                fn(a.file, workdir)
                times[key].append(time.perf_counter() - t0)
                print(f"repeat {r + 1}/{a.repeats} ({key}) {times[key][-1]:.3f} s", file=sys.stderr)
        big = os.path.join(workdir, f"concat{CONCAT}.fasta.gz")
        with open(a.file, "rb") as src:
            data = src.read()
        with open(big, "wb") as dst:
            for _ in range(CONCAT):
                dst.write(data)  # a multi-member gzip file: valid, and what `cat a.gz b.gz` gives
        streams = {"1x": stream_peak(a.file), f"{CONCAT}x": stream_peak(big)}
    if counts["a"] != counts["b"]:
        print(f"warning: baseline read {counts['a']} records, ours {counts['b']}", file=sys.stderr)
    n = counts["b"]
    med = {k: statistics.median(v) for k, v in times.items()}
    sps = {k: n / t for k, t in med.items()}
    b_a, c_b = sps["b"] / sps["a"], sps["c"] / sps["b"]
    (n1, base1, top1, peak1), (n8, base8, top8, peak8) = streams.values()
    ratio = peak8 / peak1
    rows = ["| method | median s | sequences/s | vs (b) ours |", "|---|---:|---:|---:|",
            f"| (a) baseline: Biopython + per-residue dict loop + `Dataset.from_dict` | {med['a']:.3f} "
            f"| {sps['a']:,.0f} | {sps['a'] / sps['b']:.3f} |",
            f"| (b) ours: `build_fasta_dataset` + `tokenize_dataset`, fresh cache | {med['b']:.3f} "
            f"| {sps['b']:,.0f} | 1.000 |",
            f"| (b2) (b) with decompression in the parsing thread | {med['b2']:.3f} "
            f"| {sps['b2']:,.0f} | {sps['b2'] / sps['b']:.2f} |",
            f"| (b1) part of (b): `iter_fasta_tables` alone (parse + validate, no Arrow files, no tokens) "
            f"| {med['b1']:.3f} | {sps['b1']:,.0f} | {sps['b1'] / sps['b']:.2f} |",
            f"| (c) I/O limit: `gzip -dc > /dev/null` | {med['c']:.3f} | {sps['c']:,.0f} | {c_b:.2f} |",
            "", "| streaming `stream_fasta(..., with_input_ids=True)` | records | RSS after imports MiB "
            "| max RSS while streaming MiB | growth MiB | peak RSS (ru_maxrss) MiB |", "|---|---:|---:|---:|---:|---:|",
            f"| 1x file | {n1:,} | {base1:.1f} | {top1:.1f} | {top1 - base1:+.1f} | {peak1:.1f} |",
            f"| {CONCAT}x concatenation | {n8:,} | {base8:.1f} | {top8:.1f} | {top8 - base8:+.1f} | {peak8:.1f} |"]
    table = "\n".join(rows)
    verdict = (f"Ours/baseline = {b_a:.2f}x (target >= 5x: {'met' if b_a >= 5 else 'NOT met'}; "
               f"{sps['b2'] / sps['a']:.2f}x with one thread); "
               f"decompression/ours = {c_b:.2f}x (target <= 3x: {'met' if c_b <= 3 else 'NOT met'}); "
               f"streaming peak RSS {CONCAT}x/1x = {ratio:.3f} (target within 10 %: "
               f"{'met' if abs(ratio - 1) <= 0.10 else 'NOT met'}; RSS growth while streaming "
               f"{top1 - base1:+.1f} MiB (1x) vs {top8 - base8:+.1f} MiB ({CONCAT}x)).")
    elapsed = time.perf_counter() - started
    print(table)
    print(f"\n{verdict}\n{n:,} sequences, median of {a.repeats}; total {elapsed:.0f} s")
    if a.out:
        now, command = utc_now(), command_line()
        write_section(a.out, (f"## Ingest benchmark, {now}\n\n- Machine: {machine()}\n- Command: `{command}`\n"
                    f"- File: `{a.file}` ({os.path.getsize(a.file) / 1e6:.1f} MB, {n:,} sequences); median of "
                    f"{a.repeats} interleaved repeats after one untimed warm-up, one process (ours: plus one "
                    f"decompression thread, except b2)\n"
                    f"- Targets: b/a >= 5, c/b <= 3, streaming peak RSS {CONCAT}x/1x within 10 %\n\n"
                    f"{table}\n\n{verdict}\n"), topic=TOPIC)


def smoke(path: str | None, records: int = 200) -> None:
    """Each method once on a small FASTA.gz (the bundled sample's first `records`), and the stream child."""
    from trainer.families.protein_sedd.dataset import default_protein_fasta

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="ingest-smoke-") as workdir:
        small = os.path.join(workdir, "small.fasta.gz")
        with gzip.open(path or default_protein_fasta(), "rt") as src:
            text = src.read().split("\n>")
        with gzip.open(small, "wt") as dst:
            dst.write("\n>".join(text[:records]) + "\n")
        for key, fn in METHODS.items():
            if key == "a" and importlib.util.find_spec("Bio") is None:
                print("(a) skipped: biopython is not installed (pip install .[bench])", file=sys.stderr)
                continue
            t0 = time.perf_counter()
            n = fn(small, workdir)
            print(f"({key}) {n} records, {time.perf_counter() - t0:.3f} s", file=sys.stderr)
        n, rss0, top, peak = stream_peak(small)
        print(f"stream: {n} records, RSS {rss0:.0f} -> {top:.0f} MiB; smoke run: nothing written")


if __name__ == "__main__":
    main()

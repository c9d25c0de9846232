"""A UniRef50-shaped FASTA of N records, written fast (vectorised NumPy, chunk by chunk): the benchmarks' input at
the users' size without downloading UniRef50.

What is UniRef50-like (the release: 60,315,044 sequences, 17.28 G residues, mean 286.5):

- headers as UniRef writes them, `>UniRef50_<rep> <name> n=<members> Tax=<taxon> TaxID=<id> RepID=<rep id>`, with
  UniProtKB representatives (10-character `A0A...` TrEMBL accessions, 6-character `P12345`-shaped ones, Swiss-Prot
  entry names such as `KIME_HUMAN`) and UniParc ones (`UPI` + 10 hex digits, RepID the UPI itself); cluster sizes
  n= heavy-tailed (most clusters have 1 member); a few dozen names and taxa, the common ones most often;
- sequence lines of 60 residues; lengths log-normal (see `draw_lengths`); residues drawn with natural frequencies
  (UniProtKB/Swiss-Prot composition); most sequences start with the initiator Met.

Every id is unique (a bijection of the record's index), so the parser sees no duplicates. The same seed (and chunk)
writes the same bytes. `--gzip` pipes the text through `pigz -1` (or `gzip -1`) into `PATH.gz`.

    .venv/bin/python benchmarks/uniref_fasta.py /tmp/uniref_1m.fasta --records 1000000
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

import numpy as np

RESIDUES = "ACDEFGHIKLMNPQRSTVWY"
# UniProtKB/Swiss-Prot amino-acid composition (percent, in RESIDUES order; the release statistics page).
FREQ = np.array([8.25, 1.37, 5.45, 6.75, 3.86, 7.07, 2.27, 5.96, 5.84, 9.66, 2.42, 4.06, 4.70, 3.93, 5.53, 6.56,
                 5.34, 6.87, 1.08, 2.92])
LINE = 60
MIN_LENGTH, MAX_LENGTH = 11, 45_000  # UniRef drops fragments under 11 residues; titin-sized proteins are the longest
START_MET = 0.8  # share of sequences starting with M (complete proteins; fragments start anywhere)

NAMES = [b"Uncharacterized protein"] * 12 + [
    b"Putative uncharacterized protein", b"Hypothetical protein", b"ABC transporter ATP-binding protein",
    b"DNA-binding response regulator", b"Glycosyltransferase", b"Methyltransferase domain-containing protein",
    b"MFS transporter", b"Histidine kinase", b"TonB-dependent receptor", b"Zinc finger protein 208",
    b"DUF4219 domain-containing protein", b"50S ribosomal protein L2", b"Cytochrome b",
    b"NADH-quinone oxidoreductase subunit N", b"Serine/threonine-protein kinase", b"Transposase",
    b"LysR family transcriptional regulator", b"Acyl-CoA dehydrogenase", b"Titin", b"Ferredoxin",
]
# (Tax=, TaxID=, mnemonic of its UniProtKB entry names); UniRef50 names the clusters' common taxon, often a high rank.
TAXA = [(b"Homo sapiens", 9606, b"HUMAN"), (b"Bacteria", 2, b"9BACT"), (b"Escherichia coli", 562, b"ECOLX"),
        (b"root", 1, b"9ZZZZ"), (b"Eukaryota", 2759, b"9EUKA"), (b"Mus musculus", 10090, b"MOUSE"),
        (b"Bacillus subtilis", 1423, b"BACIU"), (b"Streptomyces sp.", 1931, b"9ACTN"),
        (b"Pseudomonadota", 1224, b"9PROT"), (b"Arabidopsis thaliana", 3702, b"ARATH"),
        (b"Saccharomyces cerevisiae", 4932, b"YEASX"), (b"Danio rerio", 7955, b"DANRE"),
        (b"Bacillota", 1239, b"9FIRM"), (b"Actinomycetes", 1760, b"9ACTN"), (b"Archaea", 2157, b"9ARCH"),
        (b"Drosophila melanogaster", 7227, b"DROME"), (b"Caudoviricetes", 2731619, b"9CAUD"),
        (b"uncultured bacterium", 77133, b"9BACT"), (b"Mycobacterium tuberculosis", 1773, b"MYCTX"),
        (b"Plasmodium falciparum", 5833, b"PLAFA")]
TAXON_WEIGHTS = np.array([6, 20, 5, 8, 6, 3, 2, 4, 6, 2, 2, 2, 5, 4, 3, 2, 3, 6, 2, 1], dtype=np.float64)
SWISS = [b"KIME", b"TITIN", b"CYB", b"RL2", b"FER", b"ZN208", b"NUON", b"Y001R", b"KPCA", b"ACADM"]
# Representative kinds: TrEMBL 10-char accession, 6-char accession, Swiss-Prot entry name, UniParc UPI.
KIND_SHARES = np.array([0.78, 0.12, 0.03, 0.07])
ALNUM = np.frombuffer(b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)
HEX = np.frombuffer(b"0123456789ABCDEF", dtype=np.uint8)


def draw_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """UniRef50-like sequence lengths: a log-normal core (median ~231, sigma 0.62) plus a 0.5 % log-normal tail
    (median 1,000, sigma 0.9) reaching tens of thousands, clipped to [11, 45,000]; mean ~286 (the release's 286.5).

    Protein lengths are close to log-normal in every domain of life (Zhang, "Protein-length distributions for the
    three domains of life", Trends Genet. 16:107, 2000); the core's median and the tail are chosen so the mean
    matches the UniRef50 release manifest (huggingface.co/datasets/LiteFold/UniRef50) and the median falls in
    the 220-250 range of UniProtKB's length histogram."""
    core = rng.lognormal(np.log(231.0), 0.62, n)
    tail = rng.random(n) < 0.005
    core[tail] = rng.lognormal(np.log(1000.0), 0.9, int(tail.sum()))
    return np.clip(core, MIN_LENGTH, MAX_LENGTH).astype(np.int64)


def _residue_table() -> np.ndarray:
    """65,536 letters in natural proportions: a uniform uint16 picks one (resolution 1/65,536)."""
    p = FREQ / FREQ.sum()
    counts = np.floor(p * 65536).astype(np.int64)
    counts[np.argmax(counts)] += 65536 - counts.sum()
    return np.repeat(np.frombuffer(RESIDUES.encode(), dtype=np.uint8), counts)


def _codes(values: np.ndarray, width: int, alphabet: np.ndarray) -> np.ndarray:
    """(n, width) uint8 digits of `values` in base len(alphabet), most significant first."""
    base = len(alphabet)
    out = np.empty((len(values), width), dtype=np.uint8)
    v = values.copy()
    for k in range(width - 1, -1, -1):
        out[:, k] = alphabet[v % base]
        v //= base
    return out


def _accessions(index: np.ndarray, kind: np.ndarray) -> list[bytes]:
    """Unique representative ids: each kind maps the record's global index bijectively into its own id space."""
    out = np.zeros((len(index), 13), dtype=np.uint8)  # widest: UPI + 10 hex digits
    # A0A + 7 base-36 digits: an odd multiplier coprime to 36^7 scatters consecutive indices. Swiss-Prot
    # representatives (kind 2) and 6-char ids past their space get an id of this shape too.
    a = (kind == 0) | (kind == 2) | ((kind == 1) & (index >= 3 * 10 * 36**3 * 10))
    out[a, :3] = np.frombuffer(b"A0A", dtype=np.uint8)
    out[a, 3:10] = _codes((index[a] * 1_000_003) % 36**7, 7, ALNUM)
    # [OPQ] digit alnum alnum alnum digit: 3 x 10 x 36^3 x 10 ids (indices past that wrap to an A0A... id below)
    b = (kind == 1) & ~a
    v = (index[b] * 7_919) % (3 * 10 * 36**3 * 10)
    out[b, 0] = np.frombuffer(b"OPQ", dtype=np.uint8)[v // (10 * 36**3 * 10)]
    out[b, 1] = ALNUM[(v // (36**3 * 10)) % 10]
    out[b, 2:5] = _codes((v // 10) % 36**3, 3, ALNUM)
    out[b, 5] = ALNUM[v % 10]
    c = kind == 3
    out[c, :3] = np.frombuffer(b"UPI", dtype=np.uint8)
    out[c, 3:13] = _codes(index[c] * 2_654_435_761 % 16**10, 10, HEX)
    return out.view("S13").ravel().tolist()  # "S13" drops the trailing zero bytes of shorter ids


def _headers(rng: np.random.Generator, start: int, n: int) -> list[bytes]:
    index = np.arange(start, start + n, dtype=np.int64)
    kind = rng.choice(4, n, p=KIND_SHARES)
    ids = _accessions(index, kind)
    names = rng.integers(0, len(NAMES), n).tolist()
    taxa = rng.choice(len(TAXA), n, p=TAXON_WEIGHTS / TAXON_WEIGHTS.sum()).tolist()
    members = np.minimum(rng.zipf(1.8, n), 50_000).tolist()  # most clusters 1 member, a few thousands
    swiss = rng.integers(0, len(SWISS), n).tolist()
    out = []
    for acc, k, name, t, m, s in zip(ids, kind.tolist(), names, taxa, members, swiss):
        tax, taxid, mnemonic = TAXA[t]
        if k == 3:
            rep = acc
        elif k == 2:
            rep, name = SWISS[s] + b"_" + mnemonic, len(NAMES) - 1 - s % 5  # curated: a named protein
        else:
            rep = acc + b"_" + mnemonic
        out.append(b">UniRef50_%s %s n=%d Tax=%s TaxID=%d RepID=%s\n" % (acc, NAMES[name], m, tax, taxid, rep))
    return out


def fasta_chunk(rng: np.random.Generator, start: int, lengths: np.ndarray, table: np.ndarray) -> bytes:
    """Records start .. start + len(lengths) as FASTA bytes (headers, then the sequence in lines of 60)."""
    n = len(lengths)
    headers = _headers(rng, start, n)
    head_len = np.fromiter(map(len, headers), dtype=np.int64, count=n)
    lines = -(-lengths // LINE)
    block = lengths + lines  # each sequence block: its residues plus one newline per line
    total_h, total_b = int(head_len.sum()), int(block.sum())
    # Which output bytes are header bytes: header k then block k, for each k.
    seg = np.empty(2 * n, dtype=np.int64)
    seg[0::2], seg[1::2] = head_len, block
    is_head = np.repeat(np.tile(np.array([True, False]), n), seg)
    # In the sequence blocks: a newline after every 60 residues and at each block's end (positions of the
    # newlines only: a sixty-first of the bytes).
    block_start = np.cumsum(block) - block
    line_start = np.cumsum(lines) - lines
    j = np.arange(int(lines.sum()), dtype=np.int64) - np.repeat(line_start, lines)  # line number in its record
    where = np.repeat(block_start, lines) + np.minimum((j + 1) * (LINE + 1), np.repeat(block, lines)) - 1
    newline = np.zeros(total_b, dtype=bool)
    newline[where] = True
    seq = np.empty(total_b, dtype=np.uint8)
    seq[newline] = ord("\n")
    residues = table[rng.integers(0, 65536, int(lengths.sum()), dtype=np.uint16)]
    first = np.cumsum(lengths) - lengths
    residues[first[rng.random(n) < START_MET]] = ord("M")
    seq[~newline] = residues
    out = np.empty(total_h + total_b, dtype=np.uint8)
    out[is_head] = np.frombuffer(b"".join(headers), dtype=np.uint8)
    out[~is_head] = seq
    return out.tobytes()


def write_uniref_fasta(path: str | Path, records: int, seed: int = 0, gzip: bool = False,
                       chunk: int = 50_000) -> Path:
    """Write `records` UniRef50-shaped records to `path` (`path` + `.gz` when `gzip`, compressed by `pigz -1` or
    `gzip -1` in a child process); returns the path written. The same seed and chunk give the same bytes."""
    if records < 1:
        raise ValueError(f"records must be >= 1, got {records}")
    path = Path(path)
    if gzip and path.suffix != ".gz":
        path = path.with_name(path.name + ".gz")
    rng = np.random.default_rng(seed)
    table = _residue_table()
    lengths = draw_lengths(rng, records)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        proc = None
        sink: BinaryIO = f
        if gzip:
            tool = shutil.which("pigz") or shutil.which("gzip")
            if tool is None:
                raise RuntimeError("--gzip needs pigz or gzip on PATH")
            proc = subprocess.Popen([tool, "-1", "-c"], stdin=subprocess.PIPE, stdout=f)
            sink = proc.stdin
        for start in range(0, records, chunk):
            sink.write(fasta_chunk(rng, start, lengths[start:start + chunk], table))
        if proc is not None:
            proc.stdin.close()
            if proc.wait() != 0:
                raise RuntimeError(f"{path}: the compressor exited with {proc.returncode}")
    tmp.replace(path)
    return path


def uniref_fasta_in(workdir: str | Path, records: int, say=print) -> Path:
    """`workdir`/uniref50_like_N.fasta, written (and said, with its size and time) unless already there."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    fasta = work / f"uniref50_like_{records}.fasta"
    if not fasta.exists():
        t0 = time.perf_counter()
        write_uniref_fasta(fasta, records)
        say(f"wrote {fasta} ({fasta.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s")
    return fasta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", help="FASTA file to write")
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gzip", action="store_true", help="write PATH.gz (pigz -1 or gzip -1)")
    p.add_argument("--smoke", action="store_true", help="2,000 records into a temp folder: checks the script runs")
    a = p.parse_args()
    if a.smoke:
        with tempfile.TemporaryDirectory(prefix="uniref-fasta-") as tmp:
            out = write_uniref_fasta(Path(tmp) / "smoke.fasta", 2000, a.seed)
            print(out.read_text()[:400])
        print("smoke run: nothing written")
        return
    if not a.path:
        p.error("give the FASTA path to write (or --smoke)")
    t0 = time.perf_counter()
    out = write_uniref_fasta(a.path, a.records, a.seed, a.gzip)
    seconds = time.perf_counter() - t0
    size = out.stat().st_size
    print(f"wrote {out}: {a.records:,} records, {size / 2**20:,.0f} MiB in {seconds:.1f} s "
          f"({size / 2**20 / seconds:,.0f} MiB/s)", file=sys.stderr)


if __name__ == "__main__":
    main()

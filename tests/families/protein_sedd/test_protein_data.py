"""Protein data layer: FASTA parsing and policies, hashed split, cached Arrow builds, streaming shards,
the character-level tokenizer and its numpy fast path."""

from __future__ import annotations

import gzip
import logging
import os
import random
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from trainer.data.splits import in_holdout
from trainer.families.protein_sedd import dataset, fasta
from trainer.families.protein_sedd.dataset import (
    build_fasta_dataset,
    default_protein_fasta,
    stream_fasta,
    tokenize_dataset,
)
from trainer.families.protein_sedd.fasta import FastaFormatError, FastaStats, iter_fasta, parse_header
from trainer.families.protein_sedd.tokenizer import (
    AMINO_ACIDS,
    MASK_ID,
    PAD_ID,
    UNK_ID,
    VOCAB_SIZE,
    build_protein_tokenizer,
    encode_residues,
    residue_token_ids,
)

SAMPLE = default_protein_fasta()
UNIREF = (">UniRef50_A0A5A9P0L4 Peptidylprolyl isomerase n=1 Tax=Triplophysa tibetana TaxID=1572043 "
          "RepID=A0A5A9P0L4_9TELE")


def write(tmp_path: Path, text: str, name: str = "x.fasta", gz: bool = False) -> Path:
    path = tmp_path / name
    data = text.encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def read_all(path: Path, **kw) -> tuple[list[dict], FastaStats]:
    stats = FastaStats()
    return list(iter_fasta(path, stats=stats, **kw)), stats


def split_of(record_id: str, val_fraction: float, salt: str = "") -> str:
    """The split the reader gives an id: validation is the held-out share of `in_holdout`."""
    return "validation" if in_holdout([record_id], val_fraction, salt)[0] else "train"


@pytest.fixture(scope="module")
def sample_records() -> list[dict]:
    return read_all(SAMPLE)[0]


# --- headers -----------------------------------------------------------------------------------------

def test_uniref_header():
    h = parse_header(UNIREF[1:])
    assert h["id"] == "UniRef50_A0A5A9P0L4" and h["db"] == "UniRef50"
    assert h["description"] == "Peptidylprolyl isomerase"
    assert (h["n"], h["tax"], h["taxid"], h["rep_id"]) == (1, "Triplophysa tibetana", 1572043, "A0A5A9P0L4_9TELE")
    assert h["os"] is None and h["ox"] == -1 and h["pe"] == -1 and h["extra"] is None


def test_uniprot_headers_from_bundled_file():
    with gzip.open(SAMPLE, "rt") as f:
        headers = [line[1:].rstrip("\n") for line, _ in zip(f, range(8)) if line.startswith(">")]
    # >tr|W0FSK4|W0FSK4_9FLAV Genome polyprotein (Fragment) OS=Dengue virus 3 PE=4 SV=1 Split=0
    h = parse_header(headers[0])
    assert (h["db"], h["id"], h["accession"], h["entry_name"]) == ("tr", "W0FSK4", "W0FSK4", "W0FSK4_9FLAV")
    assert (h["description"], h["os"], h["pe"], h["sv"], h["gn"]) == ("Genome polyprotein (Fragment)",
                                                                      "Dengue virus 3", 4, 1, None)
    assert h["extra"] == "Split=0" and h["ox"] == -1
    # >tr|M4KW32|M4KW32_BACIU Choline ABC transporter (ATP-binding protein) OS=Bacillus subtilis XF-1 GN=opuBA ...
    h = parse_header(headers[1])
    assert h["description"] == "Choline ABC transporter (ATP-binding protein)"
    assert (h["os"], h["gn"], h["pe"], h["sv"]) == ("Bacillus subtilis XF-1", "opuBA", 4, 1)
    # >sp|Q8AWH3|SX17A_XENTR Transcription factor Sox-17-alpha OS=Xenopus tropicalis GN=sox17a PE=2 SV=1
    h = parse_header(headers[2])
    assert (h["db"], h["id"], h["description"], h["gn"], h["pe"]) == (
        "sp", "Q8AWH3", "Transcription factor Sox-17-alpha", "sox17a", 2)
    h = parse_header("sp|P12345|NAME_HUMAN Desc text OS=Homo sapiens OX=9606 GN=ABC PE=1 SV=2")
    assert (h["id"], h["os"], h["ox"], h["gn"], h["pe"], h["sv"]) == ("P12345", "Homo sapiens", 9606, "ABC", 1, 2)


def _random_header(rng: random.Random) -> str:
    """A header of UniProt's shapes, mostly regular, with odd spacing, tags, values and ids mixed in."""
    odd = rng.random() < 0.5
    space = (lambda: rng.choice([" ", " ", "  ", "\t", " \t"])) if odd else (lambda: " ")
    if rng.random() < 0.5:
        first = (f"{rng.choice(['sp', 'tr', 'xx'])}|{rng.choice(['P12345', '', 'Q1'])}|{rng.choice(['N_H', '', 'A|B'])}"
                 if odd else f"{rng.choice(['sp', 'tr'])}|P{rng.randint(0, 99999)}|N_{rng.randint(0, 9)}")
        tags = [("OS", "s"), ("OX", "i"), ("GN", "s"), ("PE", "i"), ("SV", "i")]
    elif rng.random() < 0.8:
        first = rng.choice(["UniRef50_A0A1", "UniRef90_X", "UniRef_", "UniRefX", "UniRef100_a|b", "UniRef50_a=b"])
        tags = [("n", "i"), ("Tax", "s"), ("TaxID", "i"), ("RepID", "s")]
    else:
        first = rng.choice(["myid", "gi|123|ref", "x=1", "", " lead", "é"])
        tags = [("OS", "s"), ("n", "i")]
    words = ["Genome", "polyprotein", "(Fragment)", "Homo", "sapiens", "7", "-1", "|"]
    words += ["x=y", "A=", "=", "OS", "é"] if odd else []
    parts = [first] + [space() + rng.choice(words) for _ in range(rng.randint(0, 3))]
    chosen = [t for t in tags if rng.random() < 0.7]
    if odd and rng.random() < 0.3:
        rng.shuffle(chosen)
        chosen += chosen[:1]
    for key, kind in chosen:
        ints = ["9606", "1", "007", "x1", "", " 5", "99999999999999999999"] if odd else ["9606", "1", "007"]
        value = (rng.choice(ints)
                 if kind == "i" else " ".join(rng.choice(words) for _ in range(rng.randint(0 if odd else 1, 3))))
        parts.append(space() + f"{key}={value}")
    parts += [space() + rng.choice(["Split=0", "Foo=bar baz", "X_1=", "k=v=w"] if odd else ["Split=0"])
              for _ in range(rng.choice([0, 1, 1, 2]))]
    return "".join(parts) + rng.choice(["", " ", "\t", "  \r"] if odd else ["", " "])


def test_block_parser_equals_reference_parser(tmp_path):
    """Every header, of the usual shape (vectorised) or not (reference fallback), as parse_header reads it."""
    rng = random.Random(0)
    headers = [_random_header(rng) for _ in range(6000)]
    with gzip.open(SAMPLE, "rt") as f:
        headers += [line[1:].rstrip("\n") for line in f if line.startswith(">")]
    headers = [h for h in headers if parse_header(h)["id"]]  # no id: an error, tested elsewhere
    records = read_all(write(tmp_path, "".join(f">{h}\nMKV\n" for h in headers)))[0]
    assert len(records) == len(headers)
    for header, record in zip(headers, records):
        expected = parse_header(header.replace("\r", ""))
        assert {k: record[k] for k in expected} == expected, header

    # both paths ran: the bundled UniProt headers are vectorised, most odd random ones fall back
    from trainer.families.protein_sedd.fasta import INT_COLUMNS, STRING_COLUMNS
    from trainer.families.protein_sedd.fasta_headers import parse_header_block
    data = "".join(f">{h}\n" for h in headers).encode()
    buf = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(buf == 10)
    starts = np.concatenate([[1], ends[:-1] + 2])
    _, slow = parse_header_block(buf, starts, ends, STRING_COLUMNS, INT_COLUMNS)
    assert slow[-3000:].mean() < 0.01 and 0.2 < slow[:-3000].mean() < 0.8


def test_tab_separated_header_ends_the_id(tmp_path):
    """`>seq1<TAB>text` (as many tools write it): the id ends at the tab, in both header parsers."""
    h = parse_header("seq1\tsome description")
    assert (h["id"], h["description"]) == ("seq1", "some description")
    uniprot = "sp|P1|N_H\tDesc text OS=Org X OX=7 PE=1 SV=2"
    recs = read_all(write(tmp_path, f">seq1\tsome description\nMKV\n>{uniprot}\nMK\n"))[0]
    assert [(r["id"], r["description"]) for r in recs] == [("seq1", "some description"), ("P1", "Desc text")]
    assert (recs[1]["os"], recs[1]["ox"], recs[1]["sv"]) == ("Org X", 7, 2)
    # a tab that ends the id keeps a UniProt header on the vectorised path
    from trainer.families.protein_sedd.fasta import INT_COLUMNS, STRING_COLUMNS
    from trainer.families.protein_sedd.fasta_headers import parse_header_block
    buf = np.frombuffer(f"{uniprot}\n".encode(), dtype=np.uint8)
    cols, slow = parse_header_block(buf, np.array([0]), np.array([len(buf) - 1]), STRING_COLUMNS, INT_COLUMNS)
    assert not slow[0] and cols["id"][0].as_py() == "P1"


def test_other_header():
    h = parse_header("my_protein some free text  ")
    assert (h["id"], h["description"], h["db"], h["n"]) == ("my_protein", "some free text", None, -1)
    assert parse_header("lonely")["description"] is None


def test_bundled_sample_parses_with_stable_schema(sample_records):
    assert len(sample_records) == 3000
    assert all(list(r) == list(fasta.FASTA_COLUMNS) for r in sample_records[:50])
    assert all(r["length"] == len(r["sequence"]) > 0 for r in sample_records)
    assert SAMPLE.stat().st_size < 2_000_000


# --- bad input -----------------------------------------------------------------------------------------

def test_sequence_before_header(tmp_path):
    path = write(tmp_path, "MKV\n>a\nMKV\n")
    with pytest.raises(FastaFormatError, match=r"x\.fasta:1: sequence line before"):
        read_all(path)


def test_empty_sequence_names_record(tmp_path):
    path = write(tmp_path, ">a\nMKV\n>b desc\n>c\nMK\n")
    with pytest.raises(FastaFormatError, match=r"x\.fasta:3: record 'b': empty sequence"):
        read_all(path)
    with pytest.raises(FastaFormatError, match="record 'z': empty sequence"):
        read_all(write(tmp_path, ">a\nMKV\n>z\n", name="end.fa"))
    with pytest.raises(FastaFormatError, match="'g': empty sequence after"):
        read_all(write(tmp_path, ">g\n--*\n", name="gap.fa"))


def test_bad_character_names_file_line_and_record(tmp_path):
    path = write(tmp_path, ">a\nMKV\n>b\nMKVL\nMK1V\n")
    with pytest.raises(FastaFormatError, match=r"x\.fasta:5: record 'b': illegal character '1'"):
        read_all(path)
    with pytest.raises(FastaFormatError, match=r":3: record 'c': internal stop '\*'"):
        read_all(write(tmp_path, ">c\nMK\nM*K\n", name="stop.fa"))
    with pytest.raises(FastaFormatError, match="illegal character ' '"):
        read_all(write(tmp_path, ">c\nMK LV\n", name="space.fa"))


def test_windows_line_endings_and_blank_lines(tmp_path):
    path = write(tmp_path, ">sp|P1|A_B Desc OS=Org X OX=7 PE=1 SV=1\r\nMKV\r\nLL\r\n\r\n>b\r\nAC\r\n")
    recs, stats = read_all(path)
    assert [(r["id"], r["sequence"]) for r in recs] == [("P1", "MKVLL"), ("b", "AC")]
    assert recs[0]["sv"] == 1 and recs[0]["os"] == "Org X" and recs[0]["ox"] == 7
    assert stats.records == stats.kept == 2


def test_truncated_gzip(tmp_path, monkeypatch):
    data = SAMPLE.read_bytes()
    path = tmp_path / "cut.fasta.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(FastaFormatError, match=r"cut\.fasta\.gz: truncated or corrupt gzip stream"):
        read_all(path)
    # the named record is a whole header, also when the cut falls inside a header line
    monkeypatch.setattr(fasta, "_READ_SIZE", 4096)
    monkeypatch.setattr(fasta, "DECOMPRESS_IN_THREAD", False)  # the thread reads ahead of the parser
    rng = random.Random(0)
    text = "".join(f">rec{k} protein\n{''.join(rng.choices(AMINO_ACIDS, k=50))}\n" for k in range(3000))
    cut = text.index(">rec2000 protein") + 4  # inside '>rec2000'
    path.write_bytes(gzip.compress(text.encode())[:len(gzip.compress(text[:cut].encode()))])
    with pytest.raises(FastaFormatError, match=r"after line \d+ \(last good line \d+, in record 'rec\d+'") as err:
        read_all(path)
    assert "'rec'" not in str(err.value)


def test_truncated_gzip_reports_what_was_read(tmp_path, monkeypatch):
    """The records before the damage are read, and the error counts them and names the last good line
    (a damaged stream ends inside one read: that read's good data must not be lost)."""
    rng = random.Random(0)
    text = "".join(f">rec{k} protein\n{''.join(rng.choices(AMINO_ACIDS, k=50))}\n" for k in range(3000))
    cut = text.index(">rec1500 protein") + len(">rec1500 protein\n") + 20  # inside rec1500's sequence
    z = zlib.compressobj(wbits=31)  # a gzip stream that stops right there: no final block, no trailer
    path = tmp_path / "cut.fa.gz"
    path.write_bytes(z.compress(text[:cut].encode()) + z.flush(zlib.Z_SYNC_FLUSH))
    for threaded in (True, False):
        monkeypatch.setattr(fasta, "DECOMPRESS_IN_THREAD", threaded)
        read = []
        with pytest.raises(FastaFormatError) as err:
            read.extend(r["id"] for r in iter_fasta(path))
        assert read == [f"rec{k}" for k in range(1500)]
        assert ("cut.fa.gz: truncated or corrupt gzip stream after line 3001 (last good line 3001, in record "
                "'rec1500'); the 1500 whole records before the damage were read") in str(err.value)


@pytest.mark.parametrize("name,data,reason", [
    ("empty.fa", b"", r"empty\.fa: no FASTA records: the file is empty"),
    ("blank.fa", b"\n  \n\t\n", r"blank\.fa:3: no FASTA records: the file holds only 3 blank line"),
    ("empty.fa.gz", gzip.compress(b""), r"empty\.fa\.gz: no FASTA records: it is empty after gzip decompression"),
], ids=["empty", "blank-lines", "empty-gz"])
def test_file_without_records_is_an_error(tmp_path, name, data, reason):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(FastaFormatError, match=reason):
        read_all(tmp_path / name)
    with pytest.raises(FastaFormatError, match=reason):  # the cached build fails at once, and cleanly
        build_fasta_dataset(tmp_path / name, cache_dir=tmp_path / "c")
    assert not list((tmp_path / "c").rglob("*.tmp")) and not list((tmp_path / "c").rglob("*.arrow"))


def test_byte_order_mark_and_cr_only_line_endings(tmp_path):
    recs = read_all(write(tmp_path, "\ufeff>a desc\nMKV\n", name="bom.fa"))[0]
    assert [(r["id"], r["sequence"]) for r in recs] == [("a", "MKV")]
    recs, stats = read_all(write(tmp_path, ">a desc\rMKV\rLL\r\r>b\rAC\r", name="mac.fa"))
    assert [(r["id"], r["description"], r["sequence"]) for r in recs] == [("a", "desc", "MKVLL"), ("b", None, "AC")]
    with pytest.raises(FastaFormatError, match=r"mac2\.fa:3: record 'a': illegal character '1'"):
        read_all(write(tmp_path, ">a\rMK\rM1\r", name="mac2.fa"))
    (tmp_path / "u16.fa").write_bytes(">a\nMKV\n".encode("utf-16"))
    with pytest.raises(FastaFormatError, match=r"u16\.fa:1: the file is UTF-16 encoded"):
        read_all(tmp_path / "u16.fa")


def test_duplicate_ids_and_nucleotide_records_are_counted_and_reported(tmp_path, caplog):
    text = (">a\nMKVLA\n>dna1\nACGTACGTACGTNNACGT\n>a\nMKV\n>rna\nacgu\nacguacgu\n>short\nGATTACA\n"
            ">a\nMK\n>b\nMKVACGTACGTACGT\n")
    stats = read_all(write(tmp_path, text))[1]
    assert (stats.nucleotide_only, stats.duplicate_ids) == (2, 0)  # dna1 and rna; short ones are peptides
    caplog.set_level(logging.WARNING, logger="trainer.families.protein_sedd.dataset")
    for _ in range(2):  # a cached load reports the same
        caplog.clear()
        _, stats = build_fasta_dataset(tmp_path / "x.fasta", cache_dir=tmp_path / "c", val_fraction=0.0)
        assert (stats.nucleotide_only, stats.duplicate_ids, stats.kept) == (2, 2, 7)
        assert "x.fasta: 2 of 7 kept records (10+ residues) hold only the letters A C G T U N" in caplog.text
        assert "x.fasta: 2 records repeat the id of an earlier record (e.g. 'a')" in caplog.text


def test_num_proc_in_a_script_without_main_guard(tmp_path):
    """Spawned workers run the main script again: an unguarded call must not hang (it used to)."""
    src = write(tmp_path, "".join(f">r{k}\nMKV{'A' * k}\n" for k in range(20)))
    script = tmp_path / "ingest.py"
    script.write_text(textwrap.dedent(f"""
        from trainer.families.protein_sedd import dataset
        dataset.CHUNK_BYTES = 50  # several chunks: a pool would be started
        ds, stats = dataset.build_fasta_dataset({str(src)!r}, cache_dir={str(tmp_path / 'c')!r}, num_proc=2)
        print("rows", len(ds), stats.kept)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rows 20 20" in proc.stdout
    assert f"{script}:4 outside an `if __name__ == '__main__':` block" in proc.stderr


def test_plain_and_gz_agree(tmp_path):
    text = ">a\nMKV\n>b\nAAA\n"
    assert read_all(write(tmp_path, text))[0] == read_all(write(tmp_path, text, "x.fa.gz", gz=True))[0]


def test_block_boundaries_shards_and_line_numbers(tmp_path, monkeypatch):
    """Small read blocks: records cut anywhere, wrapped lines, every policy path, shards, error lines."""
    monkeypatch.setattr(fasta, "_READ_SIZE", 1000)
    rng = random.Random(1)
    text, expected = "\n", []
    for k in range(400):
        seq = "".join(rng.choice(AMINO_ACIDS) for _ in range(rng.randint(1, 300)))
        shown = seq
        if k % 7 == 0:
            shown = seq.lower()
        if k % 11 == 0:
            shown, seq = shown[:1] + "X" + shown[1:], seq[:1] + "X" + seq[1:]
        if k % 13 == 0:
            shown += "*"
        lines = [shown[i:i + 60] for i in range(0, len(shown), 60)]
        text += f">sp|P{k}|N_{k} protein {k} OS=Org OX={k} PE=1 SV=1\n" + "\n".join(lines) + "\n"
        expected.append((f"P{k}", seq.upper()))
    path = write(tmp_path, text, gz=True, name="many.fa.gz")
    recs, stats = read_all(path, val_fraction=0.3)
    assert [(r["id"], r["sequence"]) for r in recs] == expected
    assert [r["ox"] for r in recs] == list(range(400)) and stats.records == stats.kept == 400
    assert (stats.lowercase, stats.terminal_stop, stats.nonstandard) == (58, 31, 37)
    assert [r["split"] for r in recs] == [split_of(i, 0.3) for i, _ in expected]
    # shards: each record read by exactly one of 3, and counted only there
    parts = [read_all(path, shard=(i, 3)) for i in range(3)]
    assert sorted(r["id"] for p, _ in parts for r in p) == sorted(i for i, _ in expected)
    assert sum(st.records for _, st in parts) == 400 and [r["id"] for r in parts[1][0]][:2] == ["P1", "P4"]
    # an error deep in the file names its line
    lines = text.split("\n")
    bad = next(i for i, line in enumerate(lines) if line.startswith(">sp|P350|")) + 2
    lines[bad - 1] = lines[bad - 1][:5] + "1" + lines[bad - 1][6:]
    with pytest.raises(FastaFormatError, match=rf"many2\.fa:{bad}: record 'P350': illegal character '1'"):
        read_all(write(tmp_path, "\n".join(lines), name="many2.fa"))


# --- residue policy and filters ----------------------------------------------------------------------

POLICY_TEXT = (">low\nmkvL\n"         # lowercase
               ">stop\nMKV*\n"        # terminal stop
               ">gap\nMK-V.L\n"       # gaps
               ">bz\nMBZK\n"          # non-standard B, Z
               ">j\nMJK\n"            # J
               ">x\nMXXK\n"           # X only
               ">u\nuo*\n"            # lowercase U, O and a stop
               ">ok\nACDEFGHIKLMNPQRSTVWY\n")


@pytest.mark.parametrize("policy,expected,counts", [
    ("keep", {"bz": "MBZK", "j": "MXK", "x": "MXXK", "u": "UO"},
     dict(kept=8, j_to_x=1, nonstandard_mapped=0, dropped_nonstandard=0)),
    ("map", {"bz": "MXXK", "j": "MXK", "x": "MXXK", "u": "XX"},
     dict(kept=8, j_to_x=0, nonstandard_mapped=3, dropped_nonstandard=0)),
    ("drop", {}, dict(kept=4, j_to_x=0, nonstandard_mapped=0, dropped_nonstandard=4)),
])
def test_residue_policies(tmp_path, policy, expected, counts):
    recs, stats = read_all(write(tmp_path, POLICY_TEXT), nonstandard=policy)
    seqs = {r["id"]: r["sequence"] for r in recs}
    assert seqs == {"low": "MKVL", "stop": "MKV", "gap": "MKVL", "ok": AMINO_ACIDS, **expected}
    assert (stats.records, stats.lowercase, stats.terminal_stop, stats.gaps, stats.nonstandard) == (8, 2, 2, 1, 4)
    assert {k: getattr(stats, k) for k in counts} == counts
    assert stats.records == stats.kept + stats.dropped_nonstandard + stats.dropped_short + stats.dropped_long
    assert stats.residues == sum(len(s) for s in seqs.values())


def test_bad_policy_rejected(tmp_path):
    with pytest.raises(ValueError, match="nonstandard"):
        read_all(write(tmp_path, ">a\nM\n"), nonstandard="ignore")
    with pytest.raises(ValueError, match="val_fraction"):
        read_all(write(tmp_path, ">a\nM\n"), val_fraction=float("nan"))


def test_length_filters(tmp_path):
    path = write(tmp_path, "".join(f">r{n}\n{'A' * n}\n" for n in range(1, 11)))
    recs, stats = read_all(path, min_length=3, max_length=8)
    assert [r["length"] for r in recs] == list(range(3, 9))
    assert (stats.records, stats.kept, stats.dropped_short, stats.dropped_long) == (10, 6, 2, 2)
    # the filter applies to the cleaned sequence: 'AA*' is 2 long
    recs, stats = read_all(write(tmp_path, ">s\nAA*\n", name="s.fa"), min_length=3)
    assert recs == [] and stats.dropped_short == 1 and stats.terminal_stop == 1


# --- split -------------------------------------------------------------------------------------------

def test_split_stable_and_order_independent(sample_records):
    ids = [r["id"] for r in sample_records]
    first = {i: split_of(i, 0.1) for i in ids}
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    assert {i: split_of(i, 0.1) for i in shuffled} == first
    n_val = sum(s == "validation" for s in first.values())
    assert 240 <= n_val <= 360, n_val  # 3000 x 0.1, +-3.6 sigma
    assert all(split_of(i, 0.0) == "train" for i in ids[:100])
    assert all(split_of(i, 1.0) == "validation" for i in ids[:100])
    # the salt gives a different, equally stable split
    salted = {i: split_of(i, 0.1, salt="s1") for i in ids}
    assert salted != first and salted == {i: split_of(i, 0.1, salt="s1") for i in ids}
    # known value: guards against an accidental change of the hash
    assert [split_of(f"UniRef50_{k}", 0.5) for k in range(8)] == [
        "train", "validation", "validation", "train", "train", "train", "train", "validation"]


# --- cached Arrow build --------------------------------------------------------------------------------

def test_build_cached_second_call_does_not_reparse(tmp_path):
    cache = tmp_path / "cache"
    src = tmp_path / "sample.fasta.gz"
    src.write_bytes(SAMPLE.read_bytes())
    calls = fasta.PARSE_CALLS
    ds, stats = build_fasta_dataset(src, cache_dir=cache, val_fraction=0.1, max_length=1000)
    assert fasta.PARSE_CALLS == calls + 1
    assert len(ds) == stats.kept == 3000 - stats.dropped_long and stats.dropped_long > 0
    assert stats.train + stats.validation == stats.kept
    ds2, stats2 = build_fasta_dataset(src, cache_dir=cache, val_fraction=0.1, max_length=1000)
    assert fasta.PARSE_CALLS == calls + 1, "cached build re-parsed the file"
    assert stats2 == stats and ds2.cache_files == ds.cache_files and ds2["id"] == ds["id"]

    train, st_train = build_fasta_dataset(src, cache_dir=cache, val_fraction=0.1, max_length=1000, split="train")
    val, _ = build_fasta_dataset(src, cache_dir=cache, val_fraction=0.1, max_length=1000, split="validation")
    assert fasta.PARSE_CALLS == calls + 1 and st_train == stats
    assert (len(train), len(val)) == (stats.train, stats.validation)
    assert set(train["id"]).isdisjoint(val["id"]) and set(train["id"]) | set(val["id"]) == set(ds["id"])
    assert all(split_of(i, 0.1) == "validation" for i in val["id"])

    # a changed setting, or changed content, re-parses; a copy elsewhere with a new mtime does not
    build_fasta_dataset(src, cache_dir=cache, val_fraction=0.1, max_length=2000)
    assert fasta.PARSE_CALLS == calls + 2
    staged = tmp_path / "scratch" / "renamed.fasta.gz"
    staged.parent.mkdir()
    staged.write_bytes(src.read_bytes())
    os.utime(staged, ns=(1, 1))
    build_fasta_dataset(staged, cache_dir=cache, val_fraction=0.1, max_length=2000)
    assert fasta.PARSE_CALLS == calls + 2
    staged.write_bytes(gzip.compress(gzip.decompress(src.read_bytes()) + b">extra\nMKV\n"))
    build_fasta_dataset(staged, cache_dir=cache, val_fraction=0.1, max_length=2000)
    assert fasta.PARSE_CALLS == calls + 3


def test_build_stats_recounted_when_sidecar_lost(tmp_path):
    path = write(tmp_path, ">a\nMKV*\n>b\nMK\n")
    _, stats = build_fasta_dataset(path, cache_dir=tmp_path / "c", val_fraction=0.0)
    for f in (tmp_path / "c" / "fasta_stats").iterdir():
        f.unlink()
    _, again = build_fasta_dataset(path, cache_dir=tmp_path / "c", val_fraction=0.0)
    assert again == stats and stats.terminal_stop == 1 and stats.kept == stats.train == 2


def test_build_raises_format_error(tmp_path):
    path = write(tmp_path, ">a\nMKV\n>b\nMK#\n")
    with pytest.raises(FastaFormatError, match=r"x\.fasta:4: record 'b'"):
        build_fasta_dataset(path, cache_dir=tmp_path / "c")
    assert not list((tmp_path / "c").rglob("*.tmp"))  # the half-written shard is gone


def test_build_multiple_files_num_proc(tmp_path):
    a = write(tmp_path, ">a\nMKV\n>b\nMK\n", name="a.fa")
    b = write(tmp_path, ">c\nMKVB\n", name="b.fa.gz", gz=True)
    ds, stats = build_fasta_dataset([a, b], cache_dir=tmp_path / "c", num_proc=2, nonstandard="map")
    assert sorted(ds["id"]) == ["a", "b", "c"] and stats.files == 2 and stats.nonstandard_mapped == 1
    assert dict(zip(ds["id"], ds["sequence"]))["c"] == "MKVX"


def test_build_single_file_num_proc_matches_serial(tmp_path):
    serial, st1 = build_fasta_dataset(SAMPLE, cache_dir=tmp_path / "c", nonstandard="map", max_length=2000)
    parallel, st2 = build_fasta_dataset(SAMPLE, cache_dir=tmp_path / "c", nonstandard="map", max_length=2000,
                                        num_proc=2)
    assert st1 == st2 and st1.files == 1 and st1.nonstandard_mapped > 0 and st1.dropped_long > 0
    assert serial["id"] == parallel["id"] and len(parallel) == st1.kept
    assert serial["sequence"] == parallel["sequence"]


# --- conversion in fixed-size chunks ------------------------------------------------------------------

def chunk_text(seed: int = 3, records: int = 300) -> str:
    """Records of every policy path, and one longer than several small chunks (it straddles their boundaries)."""
    rng = random.Random(seed)
    text = "\n"  # a blank line before the first header
    for k in range(records):
        seq = "".join(rng.choice(AMINO_ACIDS) for _ in range(rng.randint(1, 300) if k != 150 else 9000))
        if k % 7 == 0:
            seq = seq.lower()
        if k % 11 == 0:
            seq = seq[:1] + "B" + seq[1:]
        if k % 13 == 0:
            seq += "*"
        text += f"{UNIREF.replace('A0A5A9P0L4', f'Q{k}', 1)}\n" + "\n".join(seq[i:i + 60] for i in range(0, len(seq), 60))
        text += "\n"
    return text


SETTINGS = dict(val_fraction=0.3, nonstandard="map", min_length=5)


def expected_rows(path: Path) -> tuple[list[tuple], FastaStats]:
    recs, stats = read_all(path, **SETTINGS)
    return [(r["id"], r["sequence"], r["split"], encode_residues(r["sequence"]).tolist()) for r in recs], stats


def built_rows(ds) -> list[tuple]:
    return list(zip(ds["id"], ds["sequence"], ds["split"], ds["input_ids"]))


def test_chunk_plan_matches_the_sequential_chunks(tmp_path):
    """An uncompressed file's chunks, found by seeking, start where the sequential reader cuts the same text;
    byte-order mark, blank lines before the first header and every line ending included."""
    text = "\ufeff\n\n" + chunk_text()
    for ending in ("\n", "\r\n", "\r"):
        path = write(tmp_path, text.replace("\n", ending), name="p.fa")
        for size in (1, 997, 5000, 40_000, 1 << 30):
            spans = fasta.plan_chunks(path, size)
            chunks = list(fasta.iter_record_chunks(path, size))
            assert [s.start for s in spans] == [c.offset for c in chunks], (ending, size)
            assert [s.end for s in spans] == [c.offset for c in chunks[1:]] + [path.stat().st_size]
            assert spans[0].first_line == chunks[0].first_line == 4 and spans[0].cr_only == (ending == "\r")
            assert all(c.data.startswith(b">") and c.data.endswith(b"\n") for c in chunks)
            raw, sep = path.read_bytes(), b"\r>" if ending == "\r" else b"\n>"
            for before, span in zip(spans, spans[1:]):  # the first header at or after the next multiple
                nominal = (before.start // size + 1) * size
                assert span.start >= nominal and raw[span.start - 1:span.start + 1] == sep
                assert sep not in raw[nominal - 1:span.start - 1]
            if size == 5000:  # the 9000-residue record straddles a multiple: one chunk holds it whole
                assert any(s.end - s.start > 9000 for s in spans)


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_chunked_build_rows_do_not_depend_on_workers(tmp_path, monkeypatch, gz):
    """Many small chunks: the rows (file order), stats, shard files and cache key are those of one process
    reading the file, for any number of workers."""
    path = write(tmp_path, chunk_text(), name="c.fa.gz" if gz else "c.fa", gz=gz)
    expected, reader_stats = expected_rows(path)
    assert reader_stats.dropped_short and reader_stats.nonstandard_mapped and reader_stats.validation
    monkeypatch.setattr(dataset, "CHUNK_BYTES", 3000)
    shards = {}
    for num_proc in (1, 3) if not gz else (1, 2):  # a pool each: 1, 2 and 3 workers between the two
        ds, stats = build_fasta_dataset(path, cache_dir=tmp_path / f"c{num_proc}", num_proc=num_proc, **SETTINGS)
        assert built_rows(ds) == expected, num_proc
        assert stats == reader_stats
        files = [Path(f["filename"]) for f in ds.cache_files]
        assert len(files) > 10  # many chunks
        shards[num_proc] = [(f.name, f.read_bytes()) for f in files]
    assert all(s == shards[1] for s in shards.values())  # same names (cache key) and bytes
    # one chunk (the default size) gives the same rows
    monkeypatch.setattr(dataset, "CHUNK_BYTES", 1 << 30)
    ds, stats = build_fasta_dataset(path, cache_dir=tmp_path / "one", **SETTINGS)
    assert built_rows(ds) == expected and stats == reader_stats and len(ds.cache_files) == 1


def test_chunked_build_crlf_and_cr_only(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset, "CHUNK_BYTES", 2000)
    text = chunk_text(records=80)
    expected, _ = expected_rows(write(tmp_path, text, name="lf.fa"))
    for ending in ("\r\n", "\r"):
        path = write(tmp_path, text.replace("\n", ending), name="x.fa")
        ds, _ = build_fasta_dataset(path, cache_dir=tmp_path / repr(ending), num_proc=1, **SETTINGS)
        assert built_rows(ds) == expected and len(ds.cache_files) > 5


@pytest.mark.parametrize("gz,num_proc", [(False, 1), (False, 2), (True, 1)], ids=["plain", "plain-2", "gzip"])
def test_chunked_build_error_names_file_line_and_record(tmp_path, monkeypatch, gz, num_proc):
    """A malformed record deep in a later chunk: the error names the file, its line and the record (a chunk
    of an uncompressed file does not know its first line: it is counted on the error path), and the build
    leaves neither temp files nor shards behind."""
    lines = chunk_text().split("\n")
    bad = next(i for i, line in enumerate(lines) if line.startswith(">UniRef50_Q250 ")) + 2
    lines[bad - 1] = lines[bad - 1][:5] + "1" + lines[bad - 1][6:]
    path = write(tmp_path, "\n".join(lines), name="bad.fa.gz" if gz else "bad.fa", gz=gz)
    monkeypatch.setattr(dataset, "CHUNK_BYTES", 3000)
    with pytest.raises(FastaFormatError, match=rf"bad\.fa(\.gz)?:{bad}: record 'UniRef50_Q250': illegal character '1'"):
        build_fasta_dataset(path, cache_dir=tmp_path / "c", num_proc=num_proc)
    assert not list((tmp_path / "c").rglob("*.tmp")) and not list((tmp_path / "c").rglob("*.arrow"))
    with pytest.raises(FastaFormatError, match=rf"bad\.fa(\.gz)?:{bad}: record 'UniRef50_Q250'"):
        read_all(path)  # the reader says the same


def test_chunked_build_truncated_gzip(tmp_path, monkeypatch):
    """A damaged gzip stream fails the build with the reader's error (what was read before the damage)."""
    text = chunk_text()
    cut = text.index(">UniRef50_Q200 ") + 30
    z = zlib.compressobj(wbits=31)
    path = tmp_path / "cut.fa.gz"
    path.write_bytes(z.compress(text[:cut].encode()) + z.flush(zlib.Z_SYNC_FLUSH))
    monkeypatch.setattr(dataset, "CHUNK_BYTES", 3000)
    with pytest.raises(FastaFormatError) as read:
        read_all(path)
    assert "the 200 whole records before the damage were read" in str(read.value)
    with pytest.raises(FastaFormatError) as built:
        build_fasta_dataset(path, cache_dir=tmp_path / "c", num_proc=1)
    assert str(built.value) == str(read.value)
    assert not list((tmp_path / "c").rglob("*.tmp")) and not list((tmp_path / "c").rglob("*.arrow"))


def test_chunked_build_cache_hit_for_other_num_proc_and_a_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset, "CHUNK_BYTES", 3000)
    src = write(tmp_path, chunk_text(records=60), name="a.fa")
    cache = tmp_path / "cache"
    ds, stats = build_fasta_dataset(src, cache_dir=cache, num_proc=1, **SETTINGS)
    calls = fasta.PARSE_CALLS
    for num_proc in (None, 2, 7):
        again, stats2 = build_fasta_dataset(src, cache_dir=cache, num_proc=num_proc, **SETTINGS)
        assert fasta.PARSE_CALLS == calls, f"num_proc={num_proc} rebuilt the cache"
        assert again.cache_files == ds.cache_files and stats2 == stats
    copy = tmp_path / "scratch" / "b.fa"
    copy.parent.mkdir()
    copy.write_bytes(src.read_bytes())
    again, _ = build_fasta_dataset(copy, cache_dir=cache, num_proc=2, **SETTINGS)
    assert fasta.PARSE_CALLS == calls and again.cache_files == ds.cache_files
    # a lost shard rebuilds the file (all its chunks) rather than loading a hole
    Path(ds.cache_files[3]["filename"]).unlink()
    again, stats2 = build_fasta_dataset(src, cache_dir=cache, num_proc=1, **SETTINGS)
    assert fasta.PARSE_CALLS == calls + 1 and built_rows(again) == built_rows(ds) and stats2 == stats


def test_tokenize_dataset(tmp_path):
    ds, _ = build_fasta_dataset(SAMPLE, cache_dir=tmp_path / "c")
    tok = tokenize_dataset(ds)
    assert str(tok.features["input_ids"].feature.dtype) == "int8"
    for i in range(0, len(tok), 97):
        row = tok[i]
        assert row["input_ids"] == encode_residues(row["sequence"]).tolist()
    assert tokenize_dataset(ds).cache_files == tok.cache_files
    # a dataset without the column (not from build_fasta_dataset) is mapped on Arrow batches, cached
    bare = ds.remove_columns("input_ids").select(range(5, 2005))  # a slice: offsets do not start at 0
    mapped = tokenize_dataset(bare, batch_size=333)
    assert mapped["input_ids"] == tok.select(range(5, 2005))["input_ids"]
    assert tokenize_dataset(bare, batch_size=333).cache_files == mapped.cache_files


# --- streaming -----------------------------------------------------------------------------------------

def test_stream_shards_two_ranks_two_workers(sample_records):
    seen: list[str] = []
    for rank in range(2):
        stream = stream_fasta(SAMPLE, rank=rank, world_size=2, columns=["id"])
        loader = DataLoader(stream, batch_size=None, num_workers=2)
        seen += [rec["id"] for rec in loader]
    assert len(seen) == len(set(seen)) == 3000
    assert set(seen) == {r["id"] for r in sample_records}


def test_stream_split_and_input_ids():
    stream = stream_fasta(SAMPLE, split="validation", val_fraction=0.1, with_input_ids=True,
                          columns=["id", "sequence", "input_ids"])
    recs = list(stream)
    assert recs and all(split_of(r["id"], 0.1) == "validation" for r in recs)
    assert stream.stats.kept == 3000 and stream.stats.validation == len(recs)
    assert (recs[0]["input_ids"] == encode_residues(recs[0]["sequence"])).all()
    with pytest.raises(ValueError):
        stream_fasta(SAMPLE, rank=2, world_size=2)


def test_stream_global_index_counts_the_split_and_decodes_only_wanted_records(monkeypatch):
    """The trainer's view (`iter_global`): one item per training record of the stream in file order, the record
    where wanted (its index counts the split's kept records, not headers) and None elsewhere, unencoded."""
    from trainer.families.protein_sedd import dataset

    ids = [r["id"] for r in stream_fasta(SAMPLE, split="train", val_fraction=0.1, min_length=60, columns=["id"])]
    encoded = []
    monkeypatch.setattr(dataset, "encode_residues", lambda seq: encoded.append(seq) or np.zeros(len(seq)))
    stream = stream_fasta(SAMPLE, split="train", val_fraction=0.1, min_length=60, columns=["id", "input_ids"],
                          with_input_ids=True)
    items = list(stream.iter_global(lambda g: g % 7 == 3))
    assert len(items) == len(ids) < 3000 and len(encoded) == len(ids[3::7])
    assert [None if it is None else it["id"] for it in items] == [i if g % 7 == 3 else None for g, i in enumerate(ids)]


# --- tokenizer -----------------------------------------------------------------------------------------

def test_tokenizer_vocab_and_roundtrip(tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok = build_protein_tokenizer()
    assert len(tok) == VOCAB_SIZE == 31 and (tok.pad_token_id, tok.mask_token_id) == (PAD_ID, MASK_ID) == (0, 1)
    assert (tok.bos_token, tok.eos_token, tok.unk_token_id, tok.sep_token) == ("<bos>", "<eos>", UNK_ID, "<sep>")
    assert tok.convert_ids_to_tokens(residue_token_ids()) == list(AMINO_ACIDS + "XBZUO")
    assert len(residue_token_ids(include_nonstandard=False)) == 20
    ids = tok("MKV")["input_ids"]
    assert ids == [AMINO_ACIDS.index(c) + 6 for c in "MKV"]
    assert tok.decode(ids) == "MKV"
    tok.save_pretrained(tmp_path / "tok")
    loaded = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok")
    assert loaded("MKVXJ")["input_ids"] == tok("MKVXJ")["input_ids"] == [16, 14, 23, 26, UNK_ID]
    assert (loaded.pad_token_id, loaded.mask_token_id, len(loaded)) == (0, 1, 31)
    batch = loaded(["MK", "MKVL"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 2:].tolist() == [PAD_ID, PAD_ID]


def test_fast_path_equals_tokenizer(sample_records):
    tok = build_protein_tokenizer()
    seqs = [r["sequence"] for r in sample_records[::60]] + ["mkvJ*-é?", ""]
    for s in seqs:
        assert encode_residues(s).tolist() == tok(s)["input_ids"], s
    assert encode_residues(b"MKV").dtype.itemsize == 1
    assert torch.as_tensor(encode_residues("ACY")).tolist() == [6, 7, 25]

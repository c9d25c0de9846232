"""The benchmarks' UniRef50-shaped FASTA generator (`benchmarks/uniref_fasta.py`): what the package's parser reads from
it, its length distribution, its headers and the gzip variant. In-process on a few thousand records."""

from __future__ import annotations

import gzip
import importlib.util
import re
import shutil

import numpy as np
import pytest
from conftest import ROOT

_spec = importlib.util.spec_from_file_location("uniref_fasta", ROOT / "benchmarks" / "uniref_fasta.py")
uniref_fasta = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uniref_fasta)

HEADER = re.compile(rb"^>UniRef50_(A0A[0-9A-Z]{7}|[OPQ][0-9][0-9A-Z]{3}[0-9]|UPI[0-9A-F]{10}) [^\n]+ n=[1-9][0-9]* "
                    rb"Tax=[^\n]+ TaxID=[0-9]+ RepID=([0-9A-Z]+_[0-9A-Z]+|UPI[0-9A-F]{10})$")


def test_lengths_are_uniref50_shaped():
    lengths = uniref_fasta.draw_lengths(np.random.default_rng(0), 400_000)
    assert 276 < lengths.mean() < 297  # the release's mean: 286.5
    assert 220 <= np.median(lengths) <= 250
    assert lengths.min() >= 11 and lengths.max() > 10_000  # a long tail


def test_the_parser_reads_every_record_with_unique_ids(tmp_path):
    from trainer.families.protein_sedd.dataset import build_fasta_dataset

    path = uniref_fasta.write_uniref_fasta(tmp_path / "u.fasta", 3000, seed=1)
    text = path.read_bytes()
    lines = text.split(b"\n")[:-1]
    heads = [line for line in lines if line.startswith(b">")]
    assert len(heads) == 3000 and all(HEADER.match(h) for h in heads), [h for h in heads if not HEADER.match(h)][:3]
    # every representative kind, and cluster sizes above 1
    assert {h[10:13] for h in heads} >= {b"A0A", b"UPI"} and any(re.match(rb">UniRef50_[OPQ]\d", h) for h in heads)
    assert any(b" n=1 " not in h for h in heads)
    body = [line for line in lines if not line.startswith(b">")]
    assert max(map(len, body)) == 60 and min(map(len, body)) >= 1
    ds, stats = build_fasta_dataset(path, cache_dir=tmp_path / "cache", val_fraction=0.0)
    assert len(ds) == 3000 and stats.duplicate_ids == 0 and stats.nonstandard == 0
    assert stats.residues == sum(map(len, body))


def test_same_seed_same_bytes_and_the_gzip_variant(tmp_path):
    a = uniref_fasta.write_uniref_fasta(tmp_path / "a.fasta", 500, seed=3, chunk=128)
    b = uniref_fasta.write_uniref_fasta(tmp_path / "b.fasta", 500, seed=3, chunk=128)
    assert a.read_bytes() == b.read_bytes()
    assert uniref_fasta.write_uniref_fasta(tmp_path / "c.fasta", 500, seed=4).read_bytes() != a.read_bytes()
    if shutil.which("pigz") is None and shutil.which("gzip") is None:
        pytest.skip("no pigz or gzip on PATH")
    gz = uniref_fasta.write_uniref_fasta(tmp_path / "d.fasta", 500, seed=3, gzip=True, chunk=128)
    assert gz.name == "d.fasta.gz" and gzip.decompress(gz.read_bytes()) == a.read_bytes()

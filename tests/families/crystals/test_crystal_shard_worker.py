"""The crystal build's shard worker: what a spawned worker imports, and shards byte for byte as `datasets`'
ArrowWriter wrote them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
from datasets.arrow_writer import ArrowWriter
from shard_worker_support import run_job_in_spawned_worker

from trainer.families.crystals import dataset as D
from trainer.families.crystals import shards as S
from trainer.families.crystals.dataset import build_crystal_dataset
from trainer.families.crystals.graphs import GraphSpec
from trainer.families.crystals.readers import bundled_crystal_path

ROOT = Path(__file__).resolve().parents[3]
SPEC = GraphSpec(k=12)

V, L = datasets.Value, datasets.List
# The shard schema as the build wrote it through `datasets` (the reference the pyarrow-only writer must match).
REFERENCE_BASE = {
    "id": V("string"), "source": V("string"), "atomic_numbers": L(V("int16")),
    "positions": L(L(V("float32"), length=3)), "cell": L(L(V("float32"), length=3), length=3),
    "num_atoms": V("int32"), "edge_src": L(V("int32")), "edge_dst": L(V("int32")),
    "edge_shift": L(L(V("int8"), length=3)), "num_edges": V("int32"),
    "lattice_coeffs": L(L(V("int32"), length=3), length=3),
}


def test_shard_worker_imports_neither_torch_nor_datasets(tmp_path, monkeypatch):
    """A spawned worker imports the module of the job the build submits (unpickling it), then reads its piece,
    builds the graphs (vesin) and writes the shard: a fresh interpreter doing exactly that loads neither torch
    nor `datasets`, and writes the shard the build wrote."""
    jobs: list = []
    real = D.build_shards

    def spy(queue, **kwargs):
        listed = list(queue)
        jobs.extend(listed)
        return real(listed, **kwargs)

    monkeypatch.setattr(D, "build_shards", spy)
    build_crystal_dataset(bundled_crystal_path("mlearn_Si_test"), graph=SPEC, cache_dir=tmp_path / "c")
    fn, args, final = jobs[0]
    assert fn.__module__ == "trainer.families.crystals.shards"
    out = tmp_path / "shard.arrow"
    run = run_job_in_spawned_worker(fn, args, out, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert out.read_bytes() == Path(final).read_bytes()


def _reference_bytes(path: Path, features: datasets.Features) -> bytes:
    """The shard's rows written again as the build wrote them before: `datasets`' ArrowWriter, one table per
    record batch of the shard."""
    with pa.memory_map(str(path)) as source:
        batches = list(pa.ipc.open_stream(source))
    out = path.with_name(path.name + ".reference")
    with ArrowWriter(features=features, path=str(out)) as writer:
        for batch in batches:
            writer.write_table(pa.Table.from_batches([batch]))
        writer.finalize()
    data = out.read_bytes()
    out.unlink()
    return data


def test_shards_byte_identical_to_datasets_writer(tmp_path, monkeypatch):
    """Shards written with pyarrow alone are byte for byte what `datasets`' ArrowWriter writes for the same rows
    and schema (scalar, per-atom and vector columns; several record batches and shards), so caches and the
    features `datasets` reads back are unchanged; the column types print as `datasets`' do (error messages)."""
    monkeypatch.setattr(D, "SHARD_RECORDS", 40)
    monkeypatch.setattr(S, "ARROW_BATCH", 16)
    cases = [
        (bundled_crystal_path("mlearn_Si_training"), dict(target="energy", per_atom=True, keep=("forces", "stress")),
         {"target": V("float64"), "atom_forces": L(L(V("float32"), length=3)), "stress": L(V("float64"), length=6)}),
        (bundled_crystal_path("mlearn_Mo_training_39"), dict(target=("energy", "stress"), atom_target="keep"),
         {"target": L(V("float64"), length=7)}),
    ]
    for k, (source, kwargs, extra) in enumerate(cases):
        cache = tmp_path / f"c{k}"
        ds = build_crystal_dataset(source, graph=SPEC, cache_dir=cache, **kwargs)
        features = datasets.Features({**REFERENCE_BASE, **extra})
        assert ds.features == features
        shards = sorted((cache / "crystal_graphs").glob("*.arrow"))
        assert len(shards) >= 2 or k == 1
        for shard in shards:
            assert shard.read_bytes() == _reference_bytes(shard, features), shard.name
    ours = {**S.BASE_FEATURES, "atom_forces": S.List(S.List(S.Value("float32"), 3)),
            "stress": S.List(S.Value("float64"), 6)}
    theirs = {**REFERENCE_BASE, "atom_forces": L(L(V("float32"), length=3)), "stress": L(V("float64"), length=6)}
    assert {k: str(v) for k, v in ours.items()} == {k: str(v) for k, v in theirs.items()}


def test_vesin_keeps_torch_outside_build_workers():
    """A plain process (a notebook, a script) that builds a graph before importing torch still gets a vesin that
    accepts torch tensors later: only a build's worker process imports vesin without torch."""
    code = ("import numpy as np\n"
            "from trainer.data.graphs import neighbor_pairs\n"
            "neighbor_pairs(np.zeros((2, 3)) + [[0, 0, 0], [1, 0, 0]], None, 2.0)\n"
            "import vesin._neighbors as n\n"
            "assert n.HAS_TORCH, 'vesin imported without torch in a plain process'\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]

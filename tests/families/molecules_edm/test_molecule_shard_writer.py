"""The molecule builds' shard workers (xyz/SDF pieces, GEOM shards): what a spawned worker imports, and shards byte
for byte as `datasets`' ArrowWriter wrote them (the caches of earlier versions stay valid and identical)."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
from datasets.arrow_writer import ArrowWriter
from shard_worker_support import run_job_in_spawned_worker

pytest.importorskip("rdkit")
msgpack = pytest.importorskip("msgpack")

from trainer.families.molecules_edm import dataset as D  # noqa: E402
from trainer.families.molecules_edm import geom, pieces  # noqa: E402
from trainer.families.molecules_edm.dataset import build_molecule_dataset  # noqa: E402
from trainer.families.molecules_edm.geom import build_geom_dataset  # noqa: E402
from trainer.families.molecules_edm.readers import bundled_qm9_path, read_molecules  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
V, L = datasets.Value, datasets.List
# The columns as the builds declared them through `datasets` (the reference the pyarrow-only writer must match).
CORE = {"id": V("string"), "numbers": L(V("int8")), "positions": L(L(V("float32"), length=3)),
        "num_atoms": V("int32")}
QM9_PROPERTIES = {"qm9_id": V("int64"), "smiles": V("string"), "U0_Ha": V("float64"), "gap_Ha": V("float64"),
                  "homo_Ha": V("float64"), "lumo_Ha": V("float64"), "mu_D": V("float64"),
                  "alpha_bohr3": V("float64")}
GEOM_EXTRA = {"smiles": V("string"), "molecule": V("int64"), "conformer": V("int32"), "totalenergy": V("float64"),
              "boltzmannweight": V("float64")}
WATER = [[8, 0.0, 0.0, 0.1173], [1, 0.0, 0.7572, -0.4692], [1, 0.0, -0.7572, -0.4692]]


def _reference_bytes(path: Path, features: datasets.Features, rows_per_call: int | None, empty_call: bool) -> bytes:
    """The shard's rows written again as the build wrote them before: `datasets`' ArrowWriter given tables of
    `rows_per_call` rows in order (`empty_call`: one empty table when the shard has no rows, as the GEOM worker
    did), then finalized. `rows_per_call` None: the whole shard in one call and one record batch (`datasets`'
    writer with a batch size of the shard's rows)."""
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_stream(source).read_all()
    out = path.with_name(path.name + ".reference")
    batch = None if rows_per_call is not None else max(table.num_rows, 1)
    rows_per_call = rows_per_call or max(table.num_rows, 1)
    with ArrowWriter(features=features, path=str(out), writer_batch_size=batch) as writer:
        for a in range(0, max(table.num_rows, 1 if empty_call else 0), rows_per_call):
            writer.write_table(table.slice(a, rows_per_call), writer_batch_size=batch)
        writer.finalize()
    data = out.read_bytes()
    out.unlink()
    return data


def _shards(ds) -> list[Path]:
    return [Path(f["filename"]) for f in ds.cache_files]


def _geom_file(path: Path, molecules: int, seed: int = 0) -> Path:
    """A drugs_crude-like file of waters, 1-40 conformers each; molecule 3 has only an unknown element (a shard
    of it alone is empty under on_invalid="skip")."""
    rng = np.random.default_rng(seed)
    block = {}
    for m in range(molecules):
        confs = []
        for e in rng.normal(size=int(rng.integers(1, 41))).round(3):
            xyz = np.array(WATER)
            xyz[:, 1:] += rng.normal(0, 0.01, size=(3, 3))
            if m == 3:
                xyz[:, 0] = 2  # helium: outside GEOM-Drugs' vocabulary
            confs.append({"xyz": xyz.tolist(), "totalenergy": float(e), "boltzmannweight": 0.5})
        block[f"O{m}"] = {"conformers": confs}
    path.write_bytes(msgpack.packb(block, use_bin_type=True))
    return path


def test_molecule_shard_workers_import_neither_torch_nor_datasets(tmp_path, monkeypatch):
    """A spawned worker imports the module of the job the build submits (unpickling it), then writes its shard: a
    fresh interpreter doing exactly that, for the xyz piece worker and the GEOM shard worker, loads neither torch
    nor `datasets` (most of a worker's start), and writes the shard the build wrote."""
    jobs: list = []

    def spying(module):
        real = module.build_shards

        def spy(queue, *args, **kwargs):
            listed = list(queue)
            jobs.append(listed[0])
            return real(listed, *args, **kwargs)

        monkeypatch.setattr(module, "build_shards", spy)

    spying(D)
    spying(geom)
    build_molecule_dataset(bundled_qm9_path(), cache_dir=tmp_path / "xyz", compute_smiles=False)
    build_geom_dataset(_geom_file(tmp_path / "g.msgpack", 6), cache_dir=tmp_path / "geom", num_proc=1,
                       on_invalid="skip")
    assert [fn.__module__ for fn, _, _ in jobs] == ["trainer.families.molecules_edm.pieces",
                                                    "trainer.families.molecules_edm.geom"]
    for k, (fn, args, final) in enumerate(jobs):
        out = tmp_path / f"shard{k}.arrow"
        run = run_job_in_spawned_worker(fn, args, out, tmp_path)
        assert run.returncode == 0, (fn.__module__, run.stderr[-2000:])
        assert out.read_bytes() == Path(final).read_bytes(), fn.__module__


def test_xyz_and_in_memory_shards_byte_identical_to_datasets_writer(tmp_path, monkeypatch):
    """Shards of the xyz pieces build (two pieces of about 1,500 molecules: tables of 1,024 cut into record
    batches of 1,000 and 24) and of the in-memory build (a property column with nulls) are byte for byte what
    `datasets`' ArrowWriter wrote for the same rows, and `datasets` reads the same features back."""
    monkeypatch.setattr(pieces, "MIN_PIECE_BYTES", 1)
    monkeypatch.setattr(pieces, "PIECE_TARGET", 2)
    ds = build_molecule_dataset(bundled_qm9_path(), cache_dir=tmp_path / "xyz", compute_smiles=False, num_proc=1)
    features = datasets.Features({**CORE, **QM9_PROPERTIES})
    assert ds.features == features
    shards = _shards(ds)
    assert len(shards) == 2
    for shard in shards:
        assert shard.read_bytes() == _reference_bytes(shard, features, pieces.ARROW_BATCH, False), shard.name
    with pa.memory_map(str(shards[0])) as source:
        assert [b.num_rows for b in pa.ipc.open_stream(source)][:2] == [1000, 24]
    molecules, _ = read_molecules(str(bundled_qm9_path()))
    molecules = molecules[:50]
    molecules[3].info["note"] = "a string property of one molecule"  # nulls in the other rows
    mem = build_molecule_dataset(molecules, cache_dir=tmp_path / "mem", compute_smiles=False)
    mem_features = datasets.Features({**CORE, **QM9_PROPERTIES, "note": V("string")})
    assert mem.features == mem_features
    (shard,) = _shards(mem)
    assert shard.read_bytes() == _reference_bytes(shard, mem_features, pieces.ARROW_BATCH, False)


def test_geom_shards_byte_identical_to_datasets_writer(tmp_path):
    """GEOM shards (one record batch a shard, however many rows; SMILES with nulls; an empty shard) are byte for
    byte what `datasets`' ArrowWriter writes given the shard in one record batch, the same for 1 and 2 processes."""
    path = _geom_file(tmp_path / "g.msgpack", 90)
    features = datasets.Features({**CORE, "edm_smiles": V("string"), **GEOM_EXTRA})
    built = {}
    for num_proc in (1, 2):
        ds = build_geom_dataset(path, cache_dir=tmp_path / f"p{num_proc}", num_proc=num_proc,
                                molecules_per_shard=60, on_invalid="skip")
        assert ds.features == features
        shards = _shards(ds)
        assert len(shards) == 2
        for shard in shards:
            assert shard.read_bytes() == _reference_bytes(shard, features, None, True), shard
        built[num_proc] = [s.read_bytes() for s in shards]
    assert built[1] == built[2]
    with pa.memory_map(str(shards[0])) as source:
        assert [b.num_rows for b in pa.ipc.open_stream(source)] == [1154]  # v1 wrote [1000, 154]
    # one molecule a shard: molecule 3's conformers are all skipped, its shard holds one empty batch
    ds = build_geom_dataset(_geom_file(tmp_path / "he.msgpack", 5), cache_dir=tmp_path / "he", num_proc=1,
                            molecules_per_shard=1, on_invalid="skip")
    shards = sorted((tmp_path / "he" / "molecules_edm").glob("*.arrow"))  # `datasets` lists no empty file
    assert len(ds) > 0 and len(shards) == 5 and pa.ipc.open_stream(pa.memory_map(str(shards[3]))).read_all().num_rows == 0
    for shard in shards:
        assert shard.read_bytes() == _reference_bytes(shard, features, None, True), shard


@pytest.mark.extended
def test_bundled_cache_byte_identical_to_datasets_writer_for_1_and_2_processes(tmp_path):
    """The bundled QM9 cache as every run builds it (default pieces, SMILES perceived), with 1 and 2 processes:
    the same files, each byte for byte what `datasets`' ArrowWriter wrote (the cache of earlier versions)."""
    features = datasets.Features({**CORE, "edm_smiles": V("string"), **QM9_PROPERTIES})
    built = {}
    for num_proc in (1, 2):
        ds = build_molecule_dataset(bundled_qm9_path(), cache_dir=tmp_path / f"p{num_proc}", num_proc=num_proc)
        assert ds.features == features
        for shard in _shards(ds):
            assert shard.read_bytes() == _reference_bytes(shard, features, pieces.ARROW_BATCH, False), shard.name
        built[num_proc] = {s.name: s.read_bytes() for s in _shards(ds)}
    assert built[1] == built[2] and len(built[1]) > 1


def test_geom_cache_of_the_earlier_layout_is_rebuilt(tmp_path, monkeypatch):
    """A cache written with the earlier layout (format v1: record batches of 1,000 rows) is not reused: the format
    version is in the fingerprint, so the same file and settings build anew, in one record batch a shard, with
    the same rows."""
    path = _geom_file(tmp_path / "g.msgpack", 40)
    monkeypatch.setattr(geom, "GEOM_FORMAT_VERSION", "geom-drugs-v1")
    old = build_geom_dataset(path, cache_dir=tmp_path / "c", num_proc=1, molecules_per_shard=60, on_invalid="skip")
    old_rows = old.with_format(None).data.to_pylist()
    monkeypatch.undo()
    new = build_geom_dataset(path, cache_dir=tmp_path / "c", num_proc=1, molecules_per_shard=60, on_invalid="skip")
    assert not new.cache_hit and geom.GEOM_FORMAT_VERSION != "geom-drugs-v1"
    assert {s.name for s in _shards(new)}.isdisjoint(s.name for s in _shards(old))
    assert new.with_format(None).data.to_pylist() == old_rows
    for shard in _shards(new):
        with pa.memory_map(str(shard)) as source:
            assert len(list(pa.ipc.open_stream(source))) == 1

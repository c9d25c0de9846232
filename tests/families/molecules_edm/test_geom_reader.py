"""The GEOM-Drugs reader: EDM's conformer rule and split, parallel shards equal to a serial build, SMILES cached
with the shards, skipped records counted, and bad records named by file, molecule and field."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("rdkit")
msgpack = pytest.importorskip("msgpack")

from trainer.families.molecules_edm import geom  # noqa: E402
from trainer.families.molecules_edm.dataset import MoleculeRows, collate_molecules  # noqa: E402
from trainer.families.molecules_edm.geom import build_geom_dataset, geom_split  # noqa: E402
from trainer.families.molecules_edm.metrics import molecule_smiles  # noqa: E402
from trainer.families.molecules_edm.readers import MoleculeDataError  # noqa: E402

WATER = [[8, 0.0, 0.0, 0.1173], [1, 0.0, 0.7572, -0.4692], [1, 0.0, -0.7572, -0.4692]]
METHANE = [[6, 0.0, 0.0, 0.0], [1, 0.629, 0.629, 0.629], [1, -0.629, -0.629, 0.629],
           [1, -0.629, 0.629, -0.629], [1, 0.629, -0.629, -0.629]]
AMMONIA = [[7, 0.0, 0.0, 0.1], [1, 0.0, 0.94, -0.27], [1, 0.81, -0.47, -0.27], [1, -0.81, -0.47, -0.27]]


def conformers(base: list[list[float]], energies: list[float], rng: np.random.Generator) -> list[dict]:
    out = []
    for e in energies:
        xyz = np.array(base, dtype=np.float64)
        xyz[:, 1:] += rng.normal(0, 0.01, size=xyz[:, 1:].shape)
        out.append({"xyz": xyz.tolist(), "totalenergy": e, "boltzmannweight": float(np.exp(e)), "setsize": 1})
    return out


def geom_file(path, maps: list[dict]) -> str:
    """A drugs_crude-like file: a stream of msgpack maps {smiles: {"conformers": [...], ...}}."""
    with open(path, "wb") as f:
        for m in maps:
            f.write(msgpack.packb(m, use_bin_type=True))
    return str(path)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    rng = np.random.default_rng(0)
    bases = [("O", WATER), ("C", METHANE), ("N", AMMONIA)]
    maps, expected = [], []
    for m in range(3):  # three top-level maps of 4 molecules: shards of 5 cut inside the maps
        block = {}
        for j in range(4):
            smiles, base = bases[(m * 4 + j) % 3]
            energies = rng.normal(size=int(rng.integers(1, 40))).round(3).tolist()
            key = f"{smiles}.{m}.{j}"
            block[key] = {"conformers": conformers(base, energies, rng), "totalconfs": len(energies)}
            expected.append((key, block[key]))
        maps.append(block)
    return geom_file(tmp_path_factory.mktemp("geom") / "drugs_crude.msgpack", maps), expected


def test_edm_conformer_rule_columns_and_smiles(sample, tmp_path):
    path, expected = sample
    ds = build_geom_dataset(path, cache_dir=tmp_path, num_proc=1, molecules_per_shard=5)
    rows = MoleculeRows(ds)
    want = []  # EDM's extract_conformers: argsort of totalenergy, the first 30, in file order
    for index, (key, info) in enumerate(expected):
        energies = np.array([c["totalenergy"] for c in info["conformers"]])
        for rank, k in enumerate(np.argsort(energies)[:30]):
            want.append((index, rank, key, info["conformers"][k]))
    assert len(ds) == len(want) and ds.molecule_report.kept == len(want) and ds.geom_molecules == len(expected)
    table = ds.with_format(None).data
    assert table.column("conformer").to_pylist() == [w[1] for w in want]
    assert table.column("smiles").to_pylist() == [w[2] for w in want]
    for k in (0, 7, len(want) - 1):
        index, rank, _, conf = want[k]
        xyz = np.array(conf["xyz"])
        row = rows[k]
        assert row["id"] == f"{index}/{rank}"
        np.testing.assert_array_equal(row["numbers"], xyz[:, 0].astype(np.int64))  # hydrogens kept
        np.testing.assert_array_equal(row["positions"], xyz[:, 1:].astype(np.float32))
        assert table.column("totalenergy")[k].as_py() == conf["totalenergy"]
        assert table.column("edm_smiles")[k].as_py() == molecule_smiles(xyz[:, 0].astype(np.int64),
                                                                        xyz[:, 1:].astype(np.float32).astype(float))
    assert max(table.column("conformer").to_pylist()) == 29  # some molecule had more than 30
    batch = collate_molecules(rows.__getitems__([0, 1, 2]), geom.GEOM_DRUGS_ELEMENTS)
    assert batch["one_hot"].shape[-1] == 16
    no_h = build_geom_dataset(path, cache_dir=tmp_path, num_proc=1, remove_h=True, compute_smiles=False)
    assert (MoleculeRows(no_h).num_atoms == 1).all() and "edm_smiles" not in no_h.column_names


def test_parallel_build_equals_serial_and_is_cached(sample, tmp_path, monkeypatch):
    path, _ = sample
    serial = build_geom_dataset(path, cache_dir=tmp_path / "a", num_proc=1, molecules_per_shard=5)
    parallel = build_geom_dataset(path, cache_dir=tmp_path / "b", num_proc=2, molecules_per_shard=5)
    assert not parallel.cache_hit and len(list((tmp_path / "b" / "molecules_edm").glob("*.arrow"))) == 3
    assert serial.with_format(None).data.equals(parallel.with_format(None).data)
    calls = []
    monkeypatch.setattr(geom, "_write_geom_shard", lambda *a: calls.append(a))
    again = build_geom_dataset(path, cache_dir=tmp_path / "b", num_proc=2, molecules_per_shard=5)
    assert again.cache_hit and not calls and len(again) == len(serial)  # num_proc is not part of the key


def test_skips_are_counted_and_errors_name_the_record(tmp_path):
    rng = np.random.default_rng(1)
    bad_xyz = conformers(WATER, [0.5, 0.1], rng)
    bad_xyz[1]["xyz"] = [[8, 0.0, 0.0]]  # lowest energy, malformed
    uranium = conformers(WATER, [0.2], rng)
    uranium[0]["xyz"][0][0] = 92
    maps = [{"O": {"conformers": conformers(WATER, [0.3, 0.2], rng)}, "O.bad": {"conformers": bad_xyz},
             "U": {"conformers": uranium}, "empty": {"conformers": []}}]
    path = geom_file(tmp_path / "bad.msgpack", maps)
    ds = build_geom_dataset(path, cache_dir=tmp_path, num_proc=1, on_invalid="skip", compute_smiles=False)
    assert len(ds) == 3 and ds.molecule_report.skipped == {"bad_xyz": 1, "unknown_element": 1, "no_conformers": 1}
    assert ds.molecule_report.records == 6 and ds.geom_molecules == 4
    with pytest.raises(MoleculeDataError, match=r"bad\.msgpack: record 1 \(id '1/0'\): bad_xyz: field 'xyz'"):
        build_geom_dataset(path, cache_dir=tmp_path, num_proc=1, compute_smiles=False)
    (tmp_path / "junk.msgpack").write_bytes(msgpack.packb([1, 2, 3]))
    with pytest.raises(MoleculeDataError, match="not_geom_msgpack"):
        build_geom_dataset(tmp_path / "junk.msgpack", cache_dir=tmp_path)
    (tmp_path / "cut.msgpack").write_bytes(open(path, "rb").read()[:-40])
    with pytest.raises(MoleculeDataError, match="truncated"):
        build_geom_dataset(tmp_path / "cut.msgpack", cache_dir=tmp_path)


def test_edm_split_rule(tmp_path):
    parts = geom_split(1005, seed=4)
    assert [len(parts[k]) for k in ("validation", "test", "train")] == [100, 100, 805]
    joined = np.concatenate([parts["validation"], parts["test"], parts["train"]])
    np.testing.assert_array_equal(joined, np.random.default_rng(4).permutation(1005))
    assert not np.array_equal(geom_split(1005, seed=5)["validation"], parts["validation"])
    perm = np.arange(10)[::-1].copy()
    np.save(tmp_path / "geom_permutation.npy", perm)
    edm = geom_split(10, permutation=tmp_path / "geom_permutation.npy")
    assert edm["validation"].tolist() == [9] and edm["test"].tolist() == [8] and edm["train"].tolist() == list(range(8)[::-1])
    with pytest.raises(ValueError, match="permutation"):
        geom_split(11, permutation=perm)


def test_task_reads_a_geom_file_with_edm_split(sample, tmp_path):
    from trainer.families.molecules_edm.spec import MoleculesEDMConfig
    from trainer.families.molecules_edm.task import MoleculesEDMTask

    path, _ = sample
    cfg = MoleculesEDMConfig(data_path=path, elements=list(geom.GEOM_DRUGS_ELEMENTS), cache_dir=str(tmp_path))
    data = MoleculesEDMTask(cfg, seed=7).build_data()
    full = build_geom_dataset(path, cache_dir=tmp_path)
    parts = geom_split(len(full), seed=7)
    for name, rows in (("train", data.train), ("validation", data.eval), ("test", data.test)):
        assert [rows[k]["id"] for k in range(len(rows))] == [full[int(i)]["id"] for i in parts[name]]
    assert data.stats["num_train"] == len(parts["train"]) and data.stats["elements"] == list(geom.GEOM_DRUGS_ELEMENTS)
    with pytest.raises(MoleculeDataError, match="unknown_element"):  # N is outside this vocabulary
        MoleculesEDMTask(MoleculesEDMConfig(data_path=path, elements=["H", "C", "O"], cache_dir=str(tmp_path)),
                         seed=0).build_data()


def test_a_failed_build_leaves_no_shards_without_their_sidecar(tmp_path):
    """An error in a later shard fails the file as a whole: the shards before it are not left published."""
    rng = np.random.default_rng(2)
    bad = conformers(WATER, [0.1], rng)
    bad[0]["xyz"] = [[8, 0.0, 0.0]]
    maps = [{f"O{k}": {"conformers": conformers(WATER, [0.3], rng)} for k in range(4)} | {"bad": {"conformers": bad}}]
    path = geom_file(tmp_path / "late.msgpack", maps)
    with pytest.raises(MoleculeDataError, match="bad_xyz"):
        build_geom_dataset(path, cache_dir=tmp_path / "c", num_proc=1, compute_smiles=False, molecules_per_shard=2)
    assert not list((tmp_path / "c").rglob("*.arrow"))


def test_default_shards_give_every_worker_work_whatever_num_proc(tmp_path):
    """A file is cut into up to `SHARD_TARGET` shards by its molecule count, not into shards of a fixed large size
    (a file smaller than one such shard was one job, so a parallel build ran in one worker); the shards and rows
    are the same for any `num_proc`, and a shard never leaves out a molecule or cuts one across maps."""
    assert geom.auto_molecules_per_shard(1) == geom.MIN_MOLECULES_PER_SHARD
    assert geom.auto_molecules_per_shard(64 * 100) == 100
    assert geom.auto_molecules_per_shard(10**7) == geom.MOLECULES_PER_SHARD
    rng = np.random.default_rng(3)
    maps = [{f"O.{m}.{j}": {"conformers": conformers(WATER, rng.normal(size=3).tolist(), rng)} for j in range(7)}
            for m in range(5)]  # 35 molecules in maps of 7: shards of 8 cut inside the maps
    path = geom_file(tmp_path / "many.msgpack", maps)
    plan = geom._shard_segments(path)
    assert [first for first, _ in plan] == [0, 8, 16, 24, 32]
    assert [sum(n for _, n in segments) for _, segments in plan] == [8, 8, 8, 8, 3]
    assert [len(segments) for _, segments in plan] == [2, 2, 2, 2, 1]
    one = build_geom_dataset(path, cache_dir=tmp_path / "a", num_proc=1, compute_smiles=False)
    two = build_geom_dataset(path, cache_dir=tmp_path / "b", num_proc=2, compute_smiles=False)
    assert len(one.cache_files) == len(two.cache_files) == 5
    assert one.with_format(None).data.equals(two.with_format(None).data)
    whole = build_geom_dataset(path, cache_dir=tmp_path / "c", num_proc=1, compute_smiles=False,
                               molecules_per_shard=100)
    assert len(whole.cache_files) == 1 and whole.with_format(None).data.equals(one.with_format(None).data)
    assert one["id"] == [f"{m}/{r}" for m in range(35) for r in range(3)]


def test_conformer_check_names_any_atomic_number_outside_the_vocabulary():
    allowed = np.zeros(119, dtype=bool)
    allowed[[1, 6, 8]] = True
    ok = np.array([[6, 0.0, 0.0, 0.0], [1, 1.0, 0.0, 0.0]])
    assert geom._conformer_problem(ok, allowed) is None
    for z, shown in ((7, "7"), (6.5, "6.5"), (-1, "-1"), (200, "200"), (0, "0")):
        xyz = ok.copy()
        xyz[1, 0] = z
        assert geom._conformer_problem(xyz, allowed) == (
            "unknown_element", f"atomic number {shown} is not in the element vocabulary")


@pytest.mark.usefixtures("fresh_accelerate")
def test_geom_drugs_config_has_edm_settings_and_trains(sample, tmp_path):
    """configs/molecules_edm/edm_geom_drugs.yaml is EDM's GEOM-Drugs command (main_geom_drugs.py in its README:
    EGNN 256 x 4, T = 1000, precision 1e-5, batch 64, lr 1e-4, EMA 0.9999, 3000 epochs, 16 elements) and
    builds and trains that model on a GEOM file (one step)."""
    from conftest import ROOT
    from safetensors.torch import load_file

    from trainer.config import load_config
    from trainer.core.trainer import Trainer

    fast = ["train.max_steps=1", "train.epochs=0", "train.per_device_batch_size=4", "eval.every_epochs=0",
            "eval.sample_every=0", "ckpt.every_epochs=0", "log.progress_bar=false", "log.tensorboard=false"]
    cfg = load_config(str(ROOT / "configs" / "molecules_edm" / "edm_geom_drugs.yaml"),
                      [f"task.data_path={sample[0]}", f"task.cache_dir={tmp_path / 'cache'}",
                       f"run.output_dir={tmp_path / 'run'}", *fast])
    t = cfg.task
    assert (t.hidden, t.layers, t.timesteps, t.noise_precision, t.model_preset) == (256, 4, 1000, 1e-5, "paper")
    assert tuple(t.elements) == geom.GEOM_DRUGS_ELEMENTS and (t.val_fraction, t.test_fraction) == (0.1, 0.1)
    assert (cfg.optim.lr, cfg.train.ema_decay, cfg.eval.num_samples) == (1e-4, 0.9999, 500)
    full = load_config(str(ROOT / "configs" / "molecules_edm" / "edm_geom_drugs.yaml"), [f"task.data_path={sample[0]}"])
    assert (full.train.per_device_batch_size, full.train.epochs) == (64, 3000)
    Trainer(cfg).fit()
    weights = load_file(next((tmp_path / "run" / "checkpoints").glob("step_*")) / "model.safetensors")
    widths = {v.shape[-1] for k, v in weights.items() if k.endswith("weight") and v.ndim == 2}
    assert 256 in widths and sum(".gcls.0." in k and k.endswith("weight") for k in weights) > 0
    blocks = {k.split("blocks.")[1].split(".")[0] for k in weights if "blocks." in k}
    assert blocks == {"0", "1", "2", "3"}

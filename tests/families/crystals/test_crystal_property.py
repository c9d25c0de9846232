"""The crystal_property task: training beats the per-element baseline, the test split gets its parity
plot, eval counts every structure once under 2-process DDP, and the ComFormer-style Python API works
from plain Python (launching its own processes) and under accelerate launch."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import torch

from conftest import BIN, ROOT, accelerate_cmd, child_env, free_port, read_jsonl, run_cmd
from trainer.config import load_config
from trainer.core.trainer import Trainer

CONFIG = str(ROOT / "configs" / "crystals" / "comformer_tiny.yaml")
MLEARN = ROOT.parent / "shared" / "data" / "crystals" / "mlearn"


def make(tmp_path, *overrides):
    cfg = load_config(CONFIG, [f"run.output_dir={tmp_path / 'run'}", "log.progress_bar=false", "log.tensorboard=false",
                               f"task.cache_dir={tmp_path / 'cache'}", *overrides])
    return Trainer(cfg)


@pytest.mark.usefixtures("fresh_accelerate")
def test_tiny_training_beats_element_baseline_and_writes_parity_plot(tmp_path):
    trainer = make(tmp_path, "train.epochs=8", "eval.every_epochs=0", "ckpt.every_steps=0")
    before = trainer.evaluate()
    assert before["num_structures"] == 21  # 10% of the 214 training structures, by id hash
    assert trainer.fit() == "completed"
    after = trainer.last_eval
    assert after["mae"] < 0.5 * before["mae"]
    assert after["mae"] < 0.5 * after["baseline_mae"]
    test = json.loads((tmp_path / "run" / "test" / "metrics.json").read_text())
    assert test["num_structures"] == 25 and test["mae"] < test["baseline_mae"]
    assert (tmp_path / "run" / "test" / "parity.png").stat().st_size > 5000
    rows = (tmp_path / "run" / "test" / "predictions.csv").read_text().splitlines()
    assert len(rows) == 26 and rows[0] == "pred,target,baseline,num_atoms"


@pytest.mark.usefixtures("fresh_accelerate")
def test_standardisation_buffers_and_loss(tmp_path):
    trainer = make(tmp_path, "train.max_steps=1", "train.epochs=0")
    model = trainer.accelerator.unwrap_model(trainer.model)
    targets = np.array([trainer.train_loader.dataset[i]["target"] for i in range(len(trainer.train_loader.dataset))])
    assert torch.allclose(model.target_mean, torch.tensor([targets.mean()], dtype=torch.float32), atol=1e-5)
    assert torch.allclose(model.target_std, torch.tensor([targets.std()], dtype=torch.float32), atol=1e-5)
    batch = trainer.task.collate([trainer.train_loader.dataset[i] for i in range(4)])
    out = trainer.task.loss(model, batch)
    expected = ((model(batch) - (batch["target"] - model.target_mean) / model.target_std).abs()).mean()
    assert torch.allclose(out.loss, expected)
    assert torch.allclose(model.predict(batch), model(batch) * model.target_std + model.target_mean)


def test_crystal_configs_load():
    for name in ("crystals/comformer_tiny.yaml", "crystals/comformer_mlearn.yaml",
                 "crystals/comformer_jarvis_bandgap.yaml"):
        cfg = load_config(str(ROOT / "configs" / name))
        assert cfg.task.name == "crystal_property"


@pytest.mark.distributed
@pytest.mark.slow
def test_two_process_ddp_balanced_batches_exact_once_eval(tmp_path):
    out = tmp_path / "run"
    run_cmd(accelerate_cmd("ddp.yaml", CONFIG, f"run.output_dir={out}", "train.epochs=2", "eval.every_epochs=1",
                           "log.every_steps=2", "log.progress_bar=false", f"task.cache_dir={tmp_path / 'cache'}"))
    records = read_jsonl(out)
    assert next(r for r in records if r.get("event") == "start")["world_size"] == 2
    evals = [r for r in records if "eval/mae" in r]
    assert len(evals) == 2 and all(r["eval/num_structures"] == 21 for r in evals)
    test = [r for r in records if "test/mae" in r]
    assert len(test) == 1 and test[0]["test/num_structures"] == 25
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)


def _mlearn_atoms(element: str, split: str, n: int):
    from ase import Atoms

    records = json.loads((MLEARN / element / f"{split}.json").read_text())[:n]
    atoms = [Atoms([s["species"][0]["element"] for s in r["structure"]["sites"]],
                   positions=[s["xyz"] for s in r["structure"]["sites"]],
                   cell=r["structure"]["lattice"]["matrix"], pbc=True) for r in records]
    return atoms, [r["outputs"]["energy"] / r["num_atoms"] for r in records]


@pytest.mark.distributed
@pytest.mark.slow
def test_train_from_list_launches_two_processes_from_plain_python(tmp_path):
    atoms, labels = _mlearn_atoms("Si", "training", 60)
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import json, pickle
        from trainer.crystals import train_from_list
        atoms, labels = pickle.load(open({str(tmp_path / 'data.pkl')!r}, "rb"))
        res = train_from_list(atoms, labels, batch_size=8, n_epochs=2, learning_rate=2e-3, random_seed=1,
                              output_dir={str(tmp_path / 'out')!r}, num_processes=2, preset="tiny",
                              test_fraction=0.2, distributed=True)
        print("RESULT", json.dumps(res))
    """))
    import pickle

    pickle.dump((atoms, labels), open(tmp_path / "data.pkl", "wb"))
    proc = run_cmd([str(BIN / "python"), str(script)], cwd=tmp_path)
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert res["test"]["num_structures"] == 12 and res["eval"]["num_structures"] == 6
    records = read_jsonl(tmp_path / "out")
    assert next(r for r in records if r.get("event") == "start")["world_size"] == 2
    assert (tmp_path / "out" / "launch_config.yaml").exists()
    assert (tmp_path / "out" / "data" / "structures.extxyz").exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_train_from_extxyz_unchanged_under_accelerate_launch(tmp_path):
    import ase.io

    atoms, labels = _mlearn_atoms("Mo", "training", 40)
    for a, y in zip(atoms, labels):
        a.info["energy_per_atom"] = y
    ase.io.write(tmp_path / "mo.extxyz", atoms, format="extxyz")
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from trainer.crystals import train_from_extxyz
        res = train_from_extxyz({str(tmp_path / 'mo.extxyz')!r}, "energy_per_atom", batch_size=8, n_epochs=2,
                                output_dir={str(tmp_path / 'out')!r}, preset="tiny", test_fraction=0.2,
                                variant="ecomformer", distributed=True)
        if res:
            print("RESULT", json.dumps(res))
    """))
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"),
           "--main_process_port", str(free_port()), str(script)]
    proc = run_cmd(cmd, cwd=tmp_path, env=child_env())
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert res["test"]["num_structures"] == 8
    assert next(r for r in read_jsonl(tmp_path / "out") if r.get("event") == "start")["world_size"] == 2

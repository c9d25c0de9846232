"""`trainer import edm` and `trainer export --format reference` for molecules_edm.

Without the reference: the golden output folder (tests/families/molecules_edm/golden_checkpoint, written by the
reference code through scripts/parity/reference_checkpoints.py: two AdamW-amsgrad steps, its EMA, `utils.save_model`
and the pickled args) reads through the key map, imports into a run that exports back equal (and samples:
extended). Live
against a checkout named by TRAINER_REFERENCE_EDM: exported back and loaded by the reference's `get_model`.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil

import pytest
import torch
from parity_support import golden_dir, live_checkpoint_test
from safetensors.torch import load_file

from trainer.errors import CheckpointError
from trainer.families.molecules_edm.reference import (
    ARGS_FILE,
    EMA_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    REFERENCE_FORMAT,
    from_reference_state_dict,
)
from trainer.reference_formats import namespace_fields

GOLDEN = golden_dir(__file__, "golden_checkpoint")


def _load(name: str) -> dict:
    return torch.load(GOLDEN / name, weights_only=True)


@pytest.mark.numerics
def test_golden_checkpoint_reads_through_the_key_map():
    """Model, EMA and Adam state (by parameter name) are the reference files' tensors; args.pickle gives the sizes."""
    meta = json.loads((GOLDEN / "meta.json").read_text())
    assert meta["reference"]["license"] == "MIT" and len(meta["reference"]["commit"]) == 40
    ckpt = REFERENCE_FORMAT.read(GOLDEN)
    model, ema = _load(MODEL_FILE), _load(EMA_FILE)
    assert all(torch.equal(ckpt.model[f"diffusion.{k}"], v) for k, v in from_reference_state_dict(model).items())
    assert set(ckpt.model) == {f"diffusion.{k}" for k in from_reference_state_dict(model)}
    ours_ema = from_reference_state_dict(ema)
    assert set(ckpt.ema) == {f"diffusion.{k}" for k in ours_ema} - {"diffusion.gamma"}  # a buffer: not in our EMA
    assert all(torch.equal(v, ours_ema[k.removeprefix("diffusion.")]) for k, v in ckpt.ema.items())
    optim = _load(OPTIM_FILE)
    names = [k for k in model if k != "buffer"]
    assert len(optim["param_groups"][0]["params"]) == len(names)
    mapped = {f"diffusion.{k}" for k in from_reference_state_dict({n: model[n] for n in names if n != "gamma.gamma"})}
    assert set(ckpt.optimizer) == mapped  # every trained parameter; the frozen schedule has no state
    first = names.index("dynamics.egnn.embedding.weight")
    assert torch.equal(ckpt.optimizer["diffusion.dynamics.egnn.embedding.weight"]["max_exp_avg_sq"],
                       optim["state"][first]["max_exp_avg_sq"])
    assert {"task.hidden=16", "task.layers=2", "task.timesteps=50", "train.ema_decay=0.9"} <= set(ckpt.overrides)
    assert "optim.amsgrad=true" in ckpt.recipe


def test_args_pickle_with_code_is_refused(tmp_path):
    """A pickle naming any global but argparse.Namespace is refused, naming the file and the global, and its code
    never runs."""
    for name in (MODEL_FILE, EMA_FILE):
        shutil.copy(GOLDEN / name, tmp_path / name)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (tmp_path / ARGS_FILE).write_bytes(pickle.dumps(argparse.Namespace(nf=16, hook=Payload())))
    with pytest.raises(CheckpointError, match=r"refusing to load .*args\.pickle: it names the global '(posix|os)\.system'"):
        REFERENCE_FORMAT.read(tmp_path)
    assert not marker.exists()
    (tmp_path / ARGS_FILE).write_bytes(pickle.dumps({"nf": 16}))
    with pytest.raises(CheckpointError, match=r"args\.pickle holds a dict, not an argparse\.Namespace"):
        namespace_fields(tmp_path / ARGS_FILE)


def test_args_the_model_cannot_have_are_named(tmp_path):
    for name in (MODEL_FILE, EMA_FILE):
        shutil.copy(GOLDEN / name, tmp_path / name)
    fields = namespace_fields(GOLDEN / ARGS_FILE)
    (tmp_path / ARGS_FILE).write_bytes(pickle.dumps(argparse.Namespace(**{**fields, "normalize_factors": [1, 4, 1]})))
    with pytest.raises(ValueError, match=r"args\.pickle: field 'normalize_factors' is \[1, 4, 1\]; our EDM has \[1, 4, 10\]"):
        REFERENCE_FORMAT.read(tmp_path)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """`trainer import edm` of the golden folder: the run folder."""
    from trainer.cli import main

    run = tmp_path_factory.mktemp("edm_import") / "run"
    assert main(["import", "edm", str(GOLDEN), str(run), "train.max_steps=2", "train.epochs=0", "eval.every_epochs=0",
                 "eval.sample_every=0", "log.progress_bar=false"]) == 0
    return run


@pytest.mark.numerics
def test_import_and_export_back(imported, tmp_path):
    """`trainer import edm` of the golden folder -> a run whose weights and EMA are the reference's -> `export
    --format reference`: the same generative_model(_ema).npy tensors, and the args the reference's get_model reads."""
    from trainer.cli import main

    run, out = imported, tmp_path / "export"
    step_dir = run / "checkpoints" / "step_00000000"
    assert (run / "checkpoints" / "latest").read_text().strip() == step_dir.name
    model, ema = load_file(step_dir / "model.safetensors"), load_file(step_dir / "ema.safetensors")
    golden_model, golden_ema = _load(MODEL_FILE), _load(EMA_FILE)
    assert all(torch.equal(model[f"diffusion.{k}"], v) for k, v in from_reference_state_dict(golden_model).items())
    assert all(torch.equal(ema[k], from_reference_state_dict(golden_ema)[k.removeprefix("diffusion.")]) for k in ema)
    # optim.npy's AdamW-amsgrad state, by parameter name, in the run's optimizer (amsgrad from the reference's recipe)
    expected = REFERENCE_FORMAT.read(GOLDEN).optimizer
    names = json.loads((step_dir / "trainer_state.json").read_text())["param_names"]
    saved = torch.load(step_dir / "optimizer.bin", weights_only=True)
    got = {n: saved["state"][i] for group, group_names in zip(saved["param_groups"], names)
           for i, n in zip(group["params"], group_names) if i in saved["state"]}
    assert set(got) == set(expected)
    assert all(torch.equal(got[n][k].float(), torch.as_tensor(v).float()) for n in expected for k, v in expected[n].items())

    assert main(["export", str(run), "--format", "reference", "--out", str(out)]) == 0
    back_model, back_ema = torch.load(out / MODEL_FILE, weights_only=True), torch.load(out / EMA_FILE, weights_only=True)
    assert set(back_model) == set(golden_model)
    assert all(torch.equal(back_model[k], v) for k, v in golden_model.items())
    # The reference's EMA also averages its frozen schedule, which only rounds it; ours keeps the model's schedule.
    assert all(torch.equal(back_ema[k], v) for k, v in golden_ema.items() if k != "gamma.gamma")
    torch.testing.assert_close(back_ema["gamma.gamma"], golden_ema["gamma.gamma"], rtol=1e-6, atol=1e-6)
    args, golden_args = namespace_fields(out / ARGS_FILE), namespace_fields(GOLDEN / ARGS_FILE)
    for key in ("nf", "n_layers", "inv_sublayers", "diffusion_steps", "diffusion_noise_schedule",
                "diffusion_noise_precision", "normalize_factors", "include_charges", "dataset", "remove_h", "ema_decay"):
        assert args[key] == golden_args[key], key


@pytest.mark.extended
def test_imported_run_samples(imported, tmp_path):
    """`trainer sample` reads the imported run like any other."""
    from trainer.cli import main

    xyz = tmp_path / "samples.xyz"
    assert main(["sample", str(imported), "num_samples=2", "batch_size=2", f"out={xyz}", "progress=false",
                 "evaluation_forcefield=none", "evaluation_mlff=none"]) == 0
    assert xyz.stat().st_size > 0


test_live_reference_checkpoint_imports_and_exports_back = live_checkpoint_test(
    "edm", "TRAINER_REFERENCE_EDM", "ehoogeboom/e3_diffusion_for_molecules")

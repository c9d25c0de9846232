"""`trainer import comformer` and `trainer export --format reference` for crystal_property.

Without the reference: the golden output folder (tests/families/crystals/golden_checkpoint, written through
scripts/parity/reference_checkpoints.py from the reference's own randomised iComformer at the parity script's
small sizes, after two AdamW steps in its train.py's parameter groups and OneCycleLR, saved in ignite's
checkpoint_N.pt layout, with config.json, target_stats.json and the reference's parameter order) reads through
the key map; its small sizes are not a size this task builds, which the import names. Our own reference-layout
export at the `paper` size imports, evaluates and exports back equal. Live against a checkout named by
TRAINER_REFERENCE_COMFORMER: both variants at the paper size, imported, exported and loaded by the reference.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from parity_support import golden_dir, live_checkpoint_test
from safetensors.torch import load_file

from trainer.errors import CheckpointError
from trainer.families.crystals.reference import (
    _TO_OURS,
    CONFIG_FILE,
    MODEL_FILE,
    REFERENCE_FORMAT,
    REFERENCE_UNUSED,
    STATS_FILE,
    _rename,
    from_reference_state_dict,
)

GOLDEN = golden_dir(__file__, "golden_checkpoint")
CHECKPOINT = "checkpoint_1.pt"


def _no_decay(name: str) -> bool:
    return "bias" in name or "bn" in name or "norm" in name  # the reference train.py's group_decay rule


@pytest.mark.numerics
def test_golden_checkpoint_reads_through_the_key_map():
    """Weights through the key map, the target statistics of target_stats.json as the model's buffers and the
    task's statistics, ignite's iteration as the step, and the AdamW state by name in the reference's own
    parameter order (its two groups)."""
    meta = json.loads((GOLDEN / "meta.json").read_text())
    assert meta["reference"]["license"] == "GPL-3.0" and len(meta["reference"]["commit"]) == 40
    ckpt = REFERENCE_FORMAT.read(GOLDEN)
    saved = torch.load(GOLDEN / CHECKPOINT, weights_only=True)
    expected = {f"model.{k}": v for k, v in from_reference_state_dict(saved["model"]).items()}
    assert set(ckpt.model) == set(expected) | {"target_mean", "target_std"}
    assert all(torch.equal(ckpt.model[k], v) for k, v in expected.items())
    assert ckpt.model["target_mean"].tolist() == [-4.25] and ckpt.model["target_std"].tolist() == [0.75]
    assert ckpt.stats == {"target_mean": [-4.25], "target_std": [0.75]}
    assert ckpt.step == saved["trainer"]["iteration"] == 2

    names = json.loads((GOLDEN / "reference_parameters.json").read_text())
    grouped = [n for n in names if not _no_decay(n)] + [n for n in names if _no_decay(n)]
    state = saved["optimizer"]["state"]
    want = {f"model.{_rename(n, _TO_OURS)}": state[i] for i, n in enumerate(grouped)
            if i in state and n not in REFERENCE_UNUSED}
    assert want and set(ckpt.optimizer) == set(want)
    assert all(torch.equal(ckpt.optimizer[n][k], want[n][k]) for n in want for k in ("exp_avg", "exp_avg_sq"))

    assert {'task.name="crystal_property"', 'task.variant="icomformer"', 'task.model_preset="paper"',
            'task.loss="mse"', "task.max_neighbors=12", "optim.lr=0.001", "train.per_device_batch_size=4"} \
        <= set(ckpt.overrides)
    assert {"optim.name=adamw", "optim.scheduler=onecycle"} <= set(ckpt.recipe)
    assert any("'model.node_features' is 8; task.model_preset=paper" in note for note in ckpt.notes)


def test_golden_sizes_are_named_when_imported(tmp_path):
    """The reference at a size no preset of this task builds: the import names the shapes and leaves nothing."""
    from trainer.core.reference_checkpoints import import_reference

    run = tmp_path / "run"
    with pytest.raises(CheckpointError, match=r"checkpoint_1\.pt does not match the model of this config: .*shapes "
                                              r"differ: .*\(8, 92\) there, \(256, 92\) here"):
        import_reference("comformer", GOLDEN, run, ["log.progress_bar=false"])
    assert not run.exists()


def _copy_golden(tmp_path: Path, *skip: str) -> Path:
    for f in GOLDEN.iterdir():
        if f.name not in skip:
            shutil.copy(f, tmp_path / f.name)
    return tmp_path


def test_missing_target_statistics_say_what_to_write(tmp_path):
    _copy_golden(tmp_path, STATS_FILE)
    with pytest.raises(ValueError, match=r"no target_stats\.json: the reference standardises its targets outside the "
                                         r"model .*'normalize using training mean M and std S'.*\{\"mean\": M, \"std\": S\}"):
        REFERENCE_FORMAT.read(tmp_path)
    (tmp_path / STATS_FILE).write_text(json.dumps({"mean": 1.0, "std": 0.0}))
    with pytest.raises(ValueError, match=r"target_stats\.json: field 'std' must be positive"):
        REFERENCE_FORMAT.read(tmp_path)


def test_objects_other_than_tensors_are_refused(tmp_path):
    """An older torch's OneCycleLR state holds a bound method: weights-only loading refuses it, naming the file."""
    _copy_golden(tmp_path)
    saved = torch.load(GOLDEN / CHECKPOINT, weights_only=True)
    torch.save({**saved, "lr_scheduler": {"anneal_func": os.system}}, tmp_path / CHECKPOINT)
    with pytest.raises(ValueError, match=r"refusing to load .*checkpoint_1\.pt: it holds objects that weights-only "
                                         r"loading does not allow"):
        REFERENCE_FORMAT.read(tmp_path)


def test_config_fields_the_model_cannot_have_are_named(tmp_path):
    _copy_golden(tmp_path)
    config = json.loads((GOLDEN / CONFIG_FILE).read_text())
    config["model"]["link"] = "log"
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: field 'model\.link' is 'log'; our ComFormer has 'identity'"):
        REFERENCE_FORMAT.read(tmp_path)


@pytest.fixture(scope="module")
def paper_source(tmp_path_factory):
    """A reference-layout folder at the `paper` size, written by our writer from a fresh paper-size model and
    wrapped as ignite's checkpoint of {model, trainer} (the golden's sizes are not a size this task builds)."""
    from trainer.config import load_config
    from trainer.families.crystals.comformer import build_comformer, comformer_config
    from trainer.families.crystals.reference import write_reference_checkpoint
    from trainer.reference_formats import RunWeights

    out = tmp_path_factory.mktemp("comformer_paper") / "reference"
    cfg = load_config(None, ["task.name=crystal_property", "task.model_preset=paper", "task.max_neighbors=12"])
    torch.manual_seed(0)
    inner = build_comformer(comformer_config("paper")).state_dict()
    model = {**{f"model.{k}": v for k, v in inner.items()}, "target_mean": torch.tensor([-3.5]),
             "target_std": torch.tensor([0.5])}
    write_reference_checkpoint(out, RunWeights(model=model, ema=None, step=0, config=cfg))
    state = torch.load(out / MODEL_FILE, weights_only=True)
    (out / MODEL_FILE).unlink()
    torch.save({"model": state, "trainer": {"epoch_length": 3, "max_epochs": 5, "iteration": 3}}, out / CHECKPOINT)
    return out


@pytest.mark.numerics
def test_import_evaluate_and_export_back(paper_source, tmp_path):
    """`trainer import comformer` -> the run's weights and target statistics are the source's, at its step ->
    evaluation runs on it -> `export --format reference` gives back the same state dict, config and statistics."""
    from trainer.cli import main
    from trainer.config import load_config
    from trainer.core.trainer import Trainer

    run, out = tmp_path / "run", tmp_path / "export"
    assert main(["import", "comformer", str(paper_source), str(run), "train.max_steps=6",
                 "log.progress_bar=false"]) == 0
    source = torch.load(paper_source / CHECKPOINT, weights_only=True)["model"]
    step_dir = run / "checkpoints" / "step_00000003"
    model = load_file(step_dir / "model.safetensors")
    assert all(torch.equal(model[f"model.{k}"], v) for k, v in from_reference_state_dict(source).items())
    assert model["target_mean"].tolist() == [-3.5] and model["target_std"].tolist() == [0.5]

    trainer = Trainer(load_config(run / "config.yaml", ["log.progress_bar=false"]))  # resumes the import
    try:
        assert trainer.state.step == 3 and trainer.task.stats["target_std"] == [0.5]
        metrics = trainer.evaluate()
    finally:
        trainer.log.close()
        trainer.accelerator.end_training()
    assert metrics is not None and torch.isfinite(torch.tensor(metrics["mae"]))

    assert main(["export", str(run), "--format", "reference", "--out", str(out)]) == 0
    back = torch.load(out / MODEL_FILE, weights_only=True)
    assert set(back) == set(source)
    assert all(torch.equal(back[k], v) for k, v in source.items())
    assert json.loads((out / CONFIG_FILE).read_text()) == json.loads((paper_source / CONFIG_FILE).read_text())
    assert json.loads((out / STATS_FILE).read_text()) == {"mean": -3.5, "std": 0.5}


test_live_reference_checkpoint_imports_and_exports_back = live_checkpoint_test(
    "comformer", "TRAINER_REFERENCE_COMFORMER", "divelab/AIRS OpenMat/ComFormer")

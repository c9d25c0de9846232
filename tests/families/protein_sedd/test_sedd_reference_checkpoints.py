"""`trainer import sedd` and `trainer export --format reference` for protein_sedd.

Without the reference: the golden run folder (tests/families/protein_sedd/golden_checkpoint, written by the reference
code through scripts/parity/reference_checkpoints.py) reads through the key map and writes back equal; a
reference-layout checkpoint at our tiny preset's size imports into a run that samples, resumes and exports back
equal. Live against a checkout named by TRAINER_REFERENCE_SEDD: the reference's own checkpoint imported, exported,
and read back by the reference's loaders.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity_support import ROOT, golden_dir, live_checkpoint_test
from safetensors.torch import load_file

from trainer.config import load_config
from trainer.core.reference_checkpoints import recipe_overrides
from trainer.errors import CheckpointError
from trainer.families.protein_sedd.reference import (
    HUB_WEIGHTS,
    META_CHECKPOINT,
    REFERENCE_FORMAT,
    ROTARY_KEY,
)
from trainer.reference_formats import RunWeights

GOLDEN = golden_dir(__file__, "golden_checkpoint")


def _golden() -> dict:
    return torch.load(GOLDEN / META_CHECKPOINT, weights_only=True)


@pytest.mark.numerics
def test_golden_checkpoint_reads_through_the_key_map():
    """The reference's checkpoint.pth (written by its utils.save_checkpoint after two AdamW steps): our model, EMA
    and optimizer state are its tensors, name for name, and the hydra config gives our recipe."""
    meta = json.loads((GOLDEN / "meta.json").read_text())
    assert meta["reference"]["license"] == "MIT" and len(meta["reference"]["commit"]) == 40
    saved = _golden()
    ckpt = REFERENCE_FORMAT.read(GOLDEN)
    names = [k for k in saved["model"] if k != ROTARY_KEY]
    assert list(ckpt.model) == names and ckpt.step == saved["step"] == 2
    assert all(torch.equal(ckpt.model[n], saved["model"][n]) for n in names)
    assert all(torch.equal(ckpt.ema[n], s) for n, s in zip(names, saved["ema"]["shadow_params"], strict=True))
    order = saved["optimizer"]["param_groups"][0]["params"]
    assert len(order) == len(names) + 1  # the model's parameters, then the noise module's unused one
    assert set(ckpt.optimizer) == set(names)
    for n, i in zip(names, order):
        assert all(torch.equal(torch.as_tensor(ckpt.optimizer[n][k]), torch.as_tensor(v))
                   for k, v in saved["optimizer"]["state"][i].items())
    assert {"task.graph=\"absorb\"", "optim.lr=0.001", "train.ema_decay=0.9", "optim.warmup_steps=5",
            "train.global_batch_size=4"} <= set(ckpt.overrides)
    assert any("no task.model_preset has" in note for note in ckpt.notes)  # 8 wide: none of our presets

    hub = REFERENCE_FORMAT.read(GOLDEN / "hub")
    weights = load_file(GOLDEN / "hub" / HUB_WEIGHTS)
    assert hub.step == 0 and hub.ema is None and hub.optimizer is None
    assert set(hub.model) == set(weights) - {ROTARY_KEY} and all(torch.equal(hub.model[k], weights[k]) for k in hub.model)


@pytest.mark.numerics
def test_golden_checkpoint_writes_back_equal(tmp_path):
    """What the reader took from the golden checkpoint, written in the reference's layout, is the golden checkpoint:
    every tensor of model, EMA and optimizer state, the step and the config the reference builds from."""
    import yaml

    saved = _golden()
    ckpt = REFERENCE_FORMAT.read(GOLDEN)
    cfg = load_config(None, [*ckpt.overrides, *recipe_overrides(ckpt)])
    # Our runs' models come from a preset, which gives the heads; this 8-wide one gets them from the rotary buffer.
    weights = RunWeights(model={**ckpt.model, ROTARY_KEY: saved["model"][ROTARY_KEY]}, ema=ckpt.ema, step=ckpt.step,
                         config=cfg, optimizer=ckpt.optimizer, lr=1e-3)
    assert REFERENCE_FORMAT.write(tmp_path, weights) == []
    back = torch.load(tmp_path / META_CHECKPOINT, weights_only=True)
    assert list(back["model"]) == list(saved["model"])
    assert all(torch.equal(back["model"][k], v) for k, v in saved["model"].items())
    assert back["step"] == saved["step"] and back["ema"]["num_updates"] == saved["ema"]["num_updates"]
    assert back["ema"]["decay"] == saved["ema"]["decay"]
    assert all(torch.equal(a, b) for a, b in zip(back["ema"]["shadow_params"], saved["ema"]["shadow_params"], strict=True))
    assert back["optimizer"]["param_groups"][0]["params"] == saved["optimizer"]["param_groups"][0]["params"]
    assert set(back["optimizer"]["state"]) == set(saved["optimizer"]["state"])
    for i, state in saved["optimizer"]["state"].items():
        assert all(torch.equal(torch.as_tensor(back["optimizer"]["state"][i][k]), torch.as_tensor(v))
                   for k, v in state.items())
    golden_cfg = yaml.safe_load((GOLDEN / ".hydra" / "config.yaml").read_text())
    written = yaml.safe_load((tmp_path / ".hydra" / "config.yaml").read_text())
    for section in ("tokens", "graph", "optim"):
        assert written[section] == golden_cfg[section], section
    assert {k: v for k, v in written["model"].items() if k != "name"} == \
        {k: v for k, v in golden_cfg["model"].items() if k != "name"}
    hub = load_file(tmp_path / "hub" / HUB_WEIGHTS)  # the EMA weights, as the golden hub folder holds
    golden_hub = load_file(GOLDEN / "hub" / HUB_WEIGHTS)
    assert set(hub) == set(golden_hub) and all(torch.equal(hub[k], golden_hub[k]) for k in hub)


def test_unreadable_sources_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"no reference SEDD checkpoint there \(looked for checkpoints-meta"):
        REFERENCE_FORMAT.read(tmp_path)
    bad = tmp_path / "checkpoints-meta" / "checkpoint.pth"
    bad.parent.mkdir()
    torch.save({"step": 3}, bad)
    with pytest.raises(ValueError, match=r"checkpoint\.pth: field 'model' is missing"):
        REFERENCE_FORMAT.read(tmp_path)
    saved = _golden()
    saved["ema"]["shadow_params"] = saved["ema"]["shadow_params"][:-1]
    torch.save(saved, bad)
    with pytest.raises(ValueError, match=r"field 'ema\.shadow_params' must list one tensor per model parameter"):
        REFERENCE_FORMAT.read(tmp_path)


def _tiny_reference_layout(out: Path) -> dict:
    """A reference-layout folder at our tiny preset's size (written by the layout's writer, which the golden test
    checks against the reference's own files): a randomised DDiT with Adam moments at step 3."""
    from trainer.families.protein_sedd.ddit import DDIT_PRESETS, DDiT
    from trainer.families.protein_sedd.task import NUM_RESIDUES

    cfg = load_config(ROOT / "configs" / "protein_sedd" / "sedd_tiny.yaml",
                      ["task.max_length=32", "train.per_device_batch_size=4", "train.max_steps=5"])
    torch.manual_seed(0)
    model = DDiT(vocab_size=NUM_RESIDUES + 2, dropout=0.0, absorbing=True, scale_by_sigma=True,
                 **DDIT_PRESETS["tiny"])
    g = torch.Generator().manual_seed(1)
    state = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in model.state_dict().items()}
    params = [n for n, _ in model.named_parameters()]
    ema = {n: state[n] + 0.01 for n in params}
    optim = {n: {"step": torch.tensor(3.0), "exp_avg": state[n] * 0.5, "exp_avg_sq": state[n] ** 2} for n in params}
    REFERENCE_FORMAT.write(out, RunWeights(model=state, ema=ema, step=3, config=cfg, optimizer=optim, lr=1e-3))
    return torch.load(out / META_CHECKPOINT, weights_only=True)


@pytest.mark.numerics
def test_import_samples_resumes_and_exports_back(tmp_path):
    """`trainer import sedd` -> a run folder whose checkpoint holds the source's weights, EMA, Adam state and step
    (resume: its LR schedule at that step) -> `trainer sample` -> `export --format reference` equals the source ->
    `trainer train` continues it from that step."""
    from trainer.cli import main

    source, run = tmp_path / "reference", tmp_path / "run"
    saved = _tiny_reference_layout(source)
    assert main(["import", "sedd", str(source), str(run), "log.progress_bar=false"]) == 0
    step_dir = run / "checkpoints" / "step_00000003"
    assert (run / "checkpoints" / "latest").read_text().strip() == step_dir.name
    names = [k for k in saved["model"] if k != ROTARY_KEY]
    model, ema = load_file(step_dir / "model.safetensors"), load_file(step_dir / "ema.safetensors")
    assert all(torch.equal(model[n], saved["model"][n]) for n in names)
    assert all(torch.equal(ema[n], s) for n, s in zip(names, saved["ema"]["shadow_params"]))
    state = json.loads((step_dir / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["scheduler"]["last_epoch"] == 3
    assert json.loads((run / "imported.json").read_text())["step"] == 3

    out = tmp_path / "export"
    assert main(["export", str(run), "--format", "reference", "--out", str(out)]) == 0
    back = torch.load(out / META_CHECKPOINT, weights_only=True)
    assert back["step"] == 3 and all(torch.equal(back["model"][k], v) for k, v in saved["model"].items())
    assert all(torch.equal(a, b) for a, b in zip(back["ema"]["shadow_params"], saved["ema"]["shadow_params"], strict=True))
    for i, s in saved["optimizer"]["state"].items():
        assert all(torch.equal(torch.as_tensor(back["optimizer"]["state"][i][k]).float(), torch.as_tensor(v).float())
                   for k, v in s.items())

    fasta = tmp_path / "samples.fasta"
    assert main(["sample", str(run), "num_samples=2", "steps=4", "length=16", f"out={fasta}"]) == 0
    assert fasta.read_text().count(">") == 2
    assert main(["train", str(run / "config.yaml"), "train.max_steps=4", "log.progress_bar=false"]) == 0
    assert json.loads((run / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())["step"] == 4


def test_a_checkpoint_of_another_size_names_keys_and_shapes(tmp_path):
    """The golden checkpoint (8 wide) into the tiny preset: one error naming the file, the shapes that differ and
    why no preset fits."""
    with pytest.raises(CheckpointError) as err:
        from trainer.core.reference_checkpoints import import_reference

        import_reference("sedd", GOLDEN, tmp_path / "run", ["task.model_preset=tiny", "log.progress_bar=false"])
    text = str(err.value)
    assert "checkpoint.pth does not match the model of this config" in text
    assert "'vocab_embed.embedding' (24, 8) there, (27, 64) here" in text
    assert "no task.model_preset has" in text
    assert not (tmp_path / "run").exists()  # a config without its checkpoint would train from scratch


def test_an_import_whose_run_cannot_be_built_leaves_nothing(tmp_path):
    """The run itself fails to build (here its data file is missing): no run folder, no lock is left."""
    from trainer.core.reference_checkpoints import import_reference

    with pytest.raises(Exception, match="missing.fa"):
        import_reference("sedd", GOLDEN, tmp_path / "run", [f"task.data_path={tmp_path / 'missing.fa'}",
                                                            "log.progress_bar=false"])
    assert not (tmp_path / "run").exists()


test_live_reference_checkpoint_imports_and_exports_back = live_checkpoint_test(
    "sedd", "TRAINER_REFERENCE_SEDD", "louaaron/Score-Entropy-Discrete-Diffusion")

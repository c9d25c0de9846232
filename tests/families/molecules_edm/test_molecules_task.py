"""The molecules_edm task end to end: training under 2-process DDP, guided sampling with paired noise
(scale 0 is the baseline bit for bit), the output layout, the same molecules with 1 and 2 processes,
and `trainer evaluate-molecules` agreeing with the sampler's own metrics."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from conftest import BIN, ROOT, accelerate_cmd, cli_in_process, free_port, read_jsonl, reset_accelerate, run_cmd
from safetensors.torch import load_file

from trainer.families.molecules_edm.readers import read_molecules

CONFIG = str(ROOT / "configs" / "molecules_edm" / "edm_tiny.yaml")
# T = 50 keeps sampling fast; everything else is the tiny config.
FAST = ["task.timesteps=50", "log.progress_bar=false", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """The tiny config under 2-process DDP for a few steps (with evaluation and eval-time sample metrics)."""
    tmp = tmp_path_factory.mktemp("edm")
    run = tmp / "run"
    run_cmd(accelerate_cmd("ddp.yaml", CONFIG, f"run.output_dir={run}", *TRAINING, "eval.every_steps=3",
                           "eval.every_epochs=0", "eval.sample_every=2", "eval.num_samples=3",
                           f"task.cache_dir={tmp / 'cache'}", *FAST), timeout=400)
    return run


TRAINING = ["train.max_steps=6", "train.epochs=0", "train.per_device_batch_size=16"]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_process_training_reports_nll_and_sample_metrics(trained_run):
    records = read_jsonl(trained_run)
    assert next(r for r in records if r.get("event") == "start")["world_size"] == 2
    evals = [r for r in records if "eval/nll" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(np.isfinite(r["eval/nll"]) and r["eval/nll"] > 0 for r in evals)
    # Every 2nd evaluation (and the final one) scores a small sample: EDM's stability and validity.
    assert "eval/sample_molecule_stability" in evals[-1] and "eval/sample_molecule_stability" not in evals[0]
    assert 0.0 <= evals[-1]["eval/sample_atom_stability"] <= 1.0
    ckpt = trained_run / "checkpoints" / "step_00000006"
    assert {"task_stats.json", "training_smiles.txt.gz"} <= set(json.loads((ckpt / "trainer_state.json").read_text())
                                                               ["artifacts"])
    stats = json.loads((ckpt / "task_stats.json").read_text())
    assert stats["elements"] == ["H", "C", "N", "O", "F"] and sum(stats["node_count_histogram"].values()) > 2000


@pytest.mark.numerics
@pytest.mark.distributed
@pytest.mark.slow
def test_one_process_with_accumulation_trains_the_weights_of_two(trained_run, tmp_path):
    """The same global batch of 32 (16 per device x 2 processes; 16 x 2 accumulated micro-batches on one): the time
    and noise of each molecule's loss come from (seed, epoch, molecule), not from the rank's RNG, so the weights
    agree up to float summation order (3.0e-4 apart with the per-rank RNG; evaluation and its sampling, which
    the 2-process run does, draw nothing the training uses)."""
    from trainer.config import load_config
    from trainer.core.trainer import Trainer

    cfg = load_config(CONFIG, [f"run.output_dir={tmp_path / 'one'}", *TRAINING, "train.grad_accum_steps=2",
                               "eval.every_steps=0", "eval.every_epochs=0", "eval.sample_every=0",
                               f"task.cache_dir={trained_run.parent / 'cache'}", *FAST])  # the built set
    try:
        Trainer(cfg).fit()
    finally:
        reset_accelerate()
    one = load_file(tmp_path / "one" / "checkpoints" / "step_00000006" / "model.safetensors")
    two = load_file(trained_run / "checkpoints" / "step_00000006" / "model.safetensors")
    assert one.keys() == two.keys()
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5


@pytest.mark.distributed
@pytest.mark.slow
def test_guided_sampling_is_paired_and_the_same_with_one_and_two_processes(trained_run, tmp_path):
    # ANI-1x guides (on the sampler's device, batched), springs take the molecules it does not model (F)
    options = ["num_samples=5", "batch_size=2", "guidance.scales=[0.0,0.002]", "guidance.forcefield=ani1x",
               "guidance.types=argmax",
               "guidance.fallback_forcefield=springs", "guidance.noise_threshold=1.0", "evaluation_forcefield=springs",
               "chains=1", "chain_frames=4"]
    one, two = tmp_path / "one", tmp_path / "two"
    cli_in_process("sample", str(trained_run), f"out={one}", *options)
    run_cmd([str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"),
             "--main_process_port", str(free_port()), "-m", "trainer", "sample", str(trained_run), f"out={two}",
             *options])
    sets = ("baseline", "guided_scale_0", "guided_scale_0.002")
    for name in sets:  # the same molecules whatever the world size
        assert (one / name / "molecules.extxyz").read_text() == (two / name / "molecules.extxyz").read_text()
    molecules = {name: read_molecules(one / name / "molecules.extxyz", min_distance=0.0)[0] for name in sets}
    assert all(len(m) == 5 for m in molecules.values())
    assert all([m.info["sample_index"] for m in mols] == list(range(5)) for mols in molecules.values())
    for base, zero, guided in zip(*molecules.values()):
        assert np.array_equal(base.positions, zero.positions)  # scale 0.0 is the baseline bit for bit
        assert np.array_equal(base.numbers, guided.numbers) or base.num_atoms == guided.num_atoms
    assert any(not np.array_equal(b.positions, g.positions) for b, g in zip(molecules["baseline"],
                                                                          molecules["guided_scale_0.002"]))
    rows = list(csv.DictReader((one / "metrics.csv").open()))
    assert [r["set"] for r in rows] == list(sets)
    table = {r["set"]: r for r in json.loads((one / "metrics.json").read_text())}
    guided = table["guided_scale_0.002"]
    assert guided["guidance_force_evaluations"] == 5 * 50  # every molecule at every step (T = 50, threshold 1)
    assert guided["guidance_scored_ani1x"] > 0 and guided["guidance_scored_springs"] > 0  # F decoded on the way
    assert guided["guidance_scored_ani1x"] + guided["guidance_scored_springs"] + guided["guidance_failures"] == 250
    for row in table.values():  # ANI-1x's view beside the evaluation force field's, F molecules counted apart
        assert row["mlff_forcefield"] == "ani1x"
        assert row["mlff_forcefield_molecules"] + row.get("mlff_forcefield_unsupported", 0) == 5
    assert table["baseline"]["forcefield_molecules"] + table["baseline"]["forcefield_failures"] == 5
    assert (one / "summary.png").stat().st_size > 0
    for name in sets:  # the first sample's trajectory of every set, the guided ones guided
        chain = one / "chains" / name / "sample_0.xyz"
        assert chain.read_text().count("frame=") == 4 and chain.with_suffix(".png").is_file()
    assert (one / "chains" / "guided_scale_0.002" / "sample_0.xyz").read_text() != \
        (one / "chains" / "baseline" / "sample_0.xyz").read_text()
    # The same metrics from the written file, by the stand-alone evaluator.
    summary = tmp_path / "summary.json"
    cli_in_process("evaluate-molecules", str(one / "baseline" / "molecules.extxyz"), "forcefield=none",
                   f"out={summary}")
    standalone = json.loads(summary.read_text())
    for key in ("atom_stability", "molecule_stability", "validity", "uniqueness"):
        assert standalone[key] == pytest.approx(table["baseline"][key])
    # Scale 0 against the baseline, paired by the written sample index: the same molecules, no difference.
    cli_in_process("evaluate-molecules", str(one / "baseline" / "molecules.extxyz"), "forcefield=none",
                   f"versus={one / 'guided_scale_0' / 'molecules.extxyz'}", f"out={summary}")
    versus = json.loads(summary.read_text())["versus"]
    assert versus["pairs"] == 5 and versus["paired_by"] == "sample_index"
    assert all(rate["difference"] == 0 for rate in versus["rates"].values())

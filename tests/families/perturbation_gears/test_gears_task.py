"""The `perturbation_gears` task end to end on the bundled simulated set: training beats the no-change
baseline, `train_multi_gpu(n_gpus=2)` on CPU matches one process with the same global batch, each test
condition is counted once at any world size and eval batch size, predict/plot_condition, configs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, reset_accelerate, train_losses
from torch.utils.data import DataLoader

from trainer.errors import DataError
from trainer.families.perturbation_gears.anndata_reader import bundled_perturbation_path
from trainer.families.perturbation_gears.spec import METRIC_NAMES
from trainer.frontends.perturbation import load_gears_model, plan_processes, plot_condition, predict, train_multi_gpu

# The long run's test pass uses its best checkpoint by validation mse_de (evaluated every EPOCHS // 2 epochs and at
# the end). Five epochs pass the thresholds below for every run.seed tried, with about the margins of ten.
EPOCHS = 5
SHORT_EPOCHS = 2
GLOBAL_BATCH = 64


def _args(save_path, batch_size: int, epochs: int, cache, **overrides) -> dict:
    return {"model_config": {"hidden_size": 32, "decoder_hidden_size": 16},  # GEARS' unused option: a warning
            "batch_size": batch_size, "epochs": epochs, "lr": 1e-3, "save_path": str(save_path), "preset": "tiny",
            "cache_dir": str(cache),
            # GEARS' protocol (the tiny preset tests its final weights): the test pass and load_gears_model's
            # default use the best checkpoint by validation mse_de
            "overrides": ["log.tensorboard=false", f"eval.every_epochs={max(epochs // 2, 1)}", "eval.test_weights=best",
                          *(f"{k}={v}" for k, v in overrides.items())]}


SPLIT = {"split": "simulation", "seed": 1, "train_gene_set_size": 0.75}
DATA = (str(bundled_perturbation_path().parent), bundled_perturbation_path().name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An EPOCHS run (one process, batch 64); then 2 epochs with one process x 32 x 2 accumulation steps and
    with train_multi_gpu(n_gpus=2) on CPU, 32 per process (the same global batch). The 2-process run compiles the
    decoder (train.compile), so the comparison also covers compiled regions under DDP against eager ones
    (compiling the accumulation run too would add a compile for what test_gears_model's compiled-vs-eager test
    already shows)."""
    tmp = tmp_path_factory.mktemp("gears")
    cache = tmp / "cache"
    results = {}
    for name, epochs, accum, compiled in (("one", EPOCHS, 1, False), ("short", SHORT_EPOCHS, 2, False)):
        try:
            results[name] = train_multi_gpu(*DATA, SPLIT, _args(tmp / name, GLOBAL_BATCH // accum, epochs, cache,
                                                                **{"log.every_steps": 10, "train.grad_accum_steps": accum,
                                                                   "train.compile": str(compiled).lower()}))
        finally:
            reset_accelerate()
    results["two"] = train_multi_gpu(*DATA, SPLIT, _args(tmp / "two", GLOBAL_BATCH // 2, SHORT_EPOCHS, cache,
                                                         **{"eval.batch_size": 3, "log.every_steps": 10,
                                                            "train.compile": "true"}), n_gpus=2)
    return results


def test_training_beats_no_change_and_reports_baselines(runs):
    one = runs["one"]
    test, no_change = one["test"], one["baselines"]["no_change"]
    assert test["n_conditions"] == 32 and no_change["pearson_delta"] == 0.0
    assert test["pearson_delta"] > 0.03 and test["combo_seen2/pearson_delta"] > 0.03
    assert test["mse_de"] < no_change["mse_de"]
    assert one["test_weights_step"] is not None  # GEARS' protocol: the best checkpoint by validation mse_de
    assert set(test) <= set(METRIC_NAMES) and all(math.isfinite(v) for v in test.values())
    report = Path(one["report"])
    table = (report / "metrics_table.csv").read_text().splitlines()
    assert table[0] == "subgroup,metric,model,no_change,train_mean,additive,linear"
    assert any(line.startswith("combo_seen1,pearson_delta,") for line in table)
    split = json.loads((report / "split.json").read_text())
    assert len(split["test"]) == 32 and "combo_seen0" in split["subgroups"]["test"]
    assert (report / "top_de_changes.png").stat().st_size > 10_000
    written = json.loads((report / "metrics.json").read_text())
    for metric, better in written["beaten_by"].items():  # the baselines that win, named with their values
        assert metric in ("mse_de", "pearson_delta", "mse", "pearson_delta_de")
        assert metric != "mse_de" or "no_change" not in better  # the model beats no-change on mse_de (above)
        assert all(value == written["baselines"][name][metric] for name, value in better.items())


def test_two_processes_match_one_with_the_same_global_batch(runs):
    """2 processes x 32 cells against 1 process x 32 cells x 2 accumulation steps: the same global batches of 64,
    split the same way (rank k's half = micro-batch k), so every BatchNorm sees the same cells and GEARS' loss
    (a mean over the conditions of a batch) is taken over the same cells: the logged losses agree to rounding.
    (Against one process with 64-cell batches they differ by a few per cent, as under GEARS' own DDP: BatchNorm
    statistics and the mean over conditions are per rank.)"""
    one, two = runs["short"], runs["two"]
    assert one["world_size"] == 1 and two["world_size"] == 2
    a, b = train_losses(one["run_dir"]), train_losses(two["run_dir"])
    assert sorted(a) == sorted(b) and len(a) == 5
    # Rounding (the all-reduce adds in another order; the 2-process run is compiled) grows through Adam: 1e-7 to
    # 1.3e-6 at step 10 (by CPU: AVX2 / AVX-512 kernels sum in other orders), < 1e-4 at step 50.
    assert b[min(a)] == pytest.approx(a[min(a)], rel=1e-5)
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=5e-4), step
    # Eval metrics differ by ~1 %: BatchNorm's running statistics (used in eval) are rank 0's under DDP, which
    # broadcasts its buffers, but follow both micro-batches under accumulation.
    assert two["test"]["n_conditions"] == 32


@pytest.mark.parametrize("batch_size", [1, 3])
def test_eval_counts_each_condition_once_at_any_world_size_and_batch(runs, batch_size):
    """The 2-process test metrics (eval batch 3: the last batch is padded with duplicates) equal an
    in-process evaluation of the same weights at eval batch 1 and 3."""
    two = runs["two"]
    model, task = load_gears_model(two["run_dir"], checkpoint="best")  # the weights the test pass used
    data = task.build_data()
    loader = DataLoader(data.test, batch_size=batch_size, collate_fn=task.collate)
    with torch.no_grad():
        outs = [task.eval_step(model, batch) for batch in loader]
    values = {k: torch.cat([o[k].float() for o in outs]) for k in outs[0]}
    metrics = task.reduce_metrics(values)
    assert metrics["n_conditions"] == len(data.test) == 32
    for key, value in two["test"].items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    with pytest.raises(RuntimeError, match="evaluated twice"):
        task.reduce_metrics({k: torch.cat([v, v[:1]]) for k, v in values.items()})


def test_control_mean_evaluation_is_the_expectation_over_pairings(runs):
    """task.eval_controls=mean (the default) predicts each condition once, at the control mean. GEARS' output is a
    residual on its input, so that is exactly the paired cells' mean prediction with their controls' mean replaced
    by the control mean: the pairing noise is gone, and the observed means are the same."""
    model, task = load_gears_model(runs["one"]["run_dir"], checkpoint="best")
    assert task.cfg.eval_controls == "mean"
    evaluations = {}
    for mode in ("mean", "paired"):
        task.cfg.eval_controls = mode
        loader = DataLoader(task.build_data().test, batch_size=4, collate_fn=task.collate)
        with torch.no_grad():
            evaluations[mode] = [(task.eval_step(model, batch), batch) for batch in loader]
    ctrl = torch.tensor(task.stats["ctrl_mean"], dtype=torch.float32)
    for (exact, _), (paired, batch) in zip(evaluations["mean"], evaluations["paired"]):
        sizes = batch["num_cells"].float()[:, None]
        x_mean = torch.zeros(len(sizes), ctrl.numel()).index_add_(0, batch["item"], batch["x"]) / sizes
        assert (x_mean - ctrl).abs().max() > 1e-2  # the paired controls' mean is a noisy draw
        torch.testing.assert_close(exact["pred_mean"], paired["pred_mean"] - x_mean + ctrl, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(exact["true_mean"], paired["true_mean"])


def test_predict_table_and_plot(runs, tmp_path):
    one = runs["one"]
    table = predict(one["run_dir"], [["G012"], ["G003", "G017"], "G000+G180"], num_control_cells=50)
    genes = [f"G{i:03d}" for i in range(200)]
    assert list(table.columns) == genes and list(table.index) == ["G012", "G003+G017", "G000+G180"]
    assert np.isfinite(table.to_numpy()).all()
    cells = predict(one["run_dir"], [["G012"]], per_cell=True, num_control_cells=7)
    assert cells.shape == (7, 200)
    np.testing.assert_allclose(cells.to_numpy().mean(axis=0), predict(one["run_dir"], [["G012"]], num_control_cells=7)
                               .to_numpy()[0], rtol=1e-6)
    with pytest.raises(DataError, match="NOT_A_GENE"):
        predict(one["run_dir"], [["NOT_A_GENE"]])
    out = plot_condition(one["run_dir"], ["G000", "G180"], tmp_path / "plot.png", num_control_cells=50)
    assert out.stat().st_size > 5_000


def test_predict_with_the_uncertainty_head(tmp_path):
    args = _args(tmp_path / "unc", GLOBAL_BATCH, 1, tmp_path / "cache", **{"train.max_steps": 3, "train.epochs": 0})
    args["model_config"] = {"hidden_size": 16, "uncertainty": True, "uncertainty_reg": 1.0}
    try:
        run = train_multi_gpu(*DATA, SPLIT, args)
    finally:
        reset_accelerate()
    assert math.isfinite(run["test"]["mse_de"])
    table = predict(run["run_dir"], [["G012"], "G003+G017"], num_control_cells=9)
    assert table.index.names == ["perturbation", "stat"] and table.shape == (4, 200)
    assert list(table.index) == [("G012", "mean"), ("G012", "logvar"), ("G003+G017", "mean"), ("G003+G017", "logvar")]
    cells = predict(run["run_dir"], [["G012"]], per_cell=True, num_control_cells=9)
    assert cells.index.names == ["perturbation", "cell", "stat"] and cells.shape == (18, 200)
    for stat in ("mean", "logvar"):
        per_cell = cells.xs(stat, level="stat").to_numpy()
        assert np.isfinite(per_cell).all()
        np.testing.assert_allclose(per_cell.mean(axis=0), table.loc[("G012", stat)].to_numpy(), rtol=1e-6, atol=1e-7)
    assert not np.allclose(table.loc[("G012", "logvar")], table.loc[("G012", "mean")])


def test_process_plan_and_configs():
    assert plan_processes(None, None, visible_gpus=0) == (1, None)
    assert plan_processes(2, None, visible_gpus=0) == (2, None)
    assert plan_processes(None, None, visible_gpus=4) == (4, None)
    assert plan_processes(None, [2, 3], visible_gpus=4) == (2, "2,3")
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError):
        plan_processes(3, [0, 1], visible_gpus=4)
    tiny = load_config(str(ROOT / "configs" / "perturbation_gears" / "gears_tiny.yaml"))
    assert tiny.task.name == "perturbation_gears" and tiny.eval.metric == "mse_de"
    norman = load_config(str(ROOT / "configs" / "perturbation_gears" / "gears_norman.yaml"), ["task.data_path=/data/x"])
    assert norman.task.hidden_size == 64 and norman.train.epochs == 20 and norman.optim.weight_decay == 5e-4
    with pytest.raises(ConfigError, match="train_gene_set_sise"):
        train_multi_gpu(*DATA, {"train_gene_set_sise": 0.5}, {"save_path": "/nonexistent"})
    from trainer.families.perturbation_gears.task import PerturbationGearsConfig, PerturbationGearsTask

    for key in ("split", "control_pairing", "eval_controls"):
        with pytest.raises(ValueError, match=f"task.{key} must be one of"):
            PerturbationGearsTask(PerturbationGearsConfig(**{key: "nope"}))

"""GEARS loss, metrics and baselines against hand computations on tiny arrays."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from trainer.errors import ConfigError, DataError
from trainer.families.perturbation_gears.baselines import fit_baselines, normalize_condition
from trainer.families.perturbation_gears.loss import gears_loss
from trainer.families.perturbation_gears.metrics import (
    aggregate_metrics,
    baselines_that_beat,
    condition_metrics,
    pearson,
    top_expressed_genes,
)

# ---------------------------------------------------------------------------------------------------------------
# loss
# ---------------------------------------------------------------------------------------------------------------
# 3 genes; condition 7 has one cell (genes 0 and 2 kept), condition 4 ('ctrl') has two cells (all genes).
CTRL = [1.0, 1.0, 1.0]
PRED = [[2.0, 0.0, 1.5], [1.0, 2.0, 0.0], [0.5, 1.0, 3.0]]
Y = [[1.0, 5.0, 0.5], [2.0, 1.0, 1.0], [1.5, 0.0, 2.0]]
IDS = [7, 4, 4]
MASK = [[True, False, True], [True, True, True], [True, True, True]]


def _hand_loss(direction_lambda: float, logvar: list[list[float]] | None = None, reg: float = 1.0) -> float:
    """GEARS' loss_fct / uncertainty_loss_fct written out with loops."""
    total = 0.0
    for condition in (7, 4):
        terms, count = 0.0, 0
        for cell in range(3):
            if IDS[cell] != condition:
                continue
            for gene in range(3):
                if not MASK[cell][gene]:
                    continue
                d = PRED[cell][gene] - Y[cell][gene]
                focus = d**4
                if logvar is not None:
                    focus += reg * np.exp(-logvar[cell][gene]) * d**4
                direction = (np.sign(Y[cell][gene] - CTRL[gene]) - np.sign(PRED[cell][gene] - CTRL[gene])) ** 2
                terms += focus + direction_lambda * direction
                count += 1
        total += terms / count
    return total / 2


def _tensors() -> tuple[torch.Tensor, ...]:
    return (torch.tensor(PRED, dtype=torch.float64, requires_grad=True), torch.tensor(Y, dtype=torch.float64),
            torch.tensor(CTRL, dtype=torch.float64), torch.tensor(IDS), torch.tensor(MASK))


def test_loss_matches_hand_computation_per_condition_then_mean() -> None:
    pred, y, ctrl, ids, mask = _tensors()
    # Condition 7 (1 cell, genes 0 and 2): d = 1, 1 -> d^4 = 1 + 1; directions: gene 0 (sign 0 - sign 1)^2 = 1,
    # gene 2 (sign -0.5 - sign 0.5)^2 = 4 -> (2 + 0.1 * 5) / 2 = 1.25. Condition 4 (2 cells x 3 genes): every
    # |d| = 1 -> d^4 sums to 6; the loss is the mean of the two conditions, not of the 8 entries.
    assert _hand_loss(0.1) == pytest.approx((1.25 + (6 + 0.1 * _ctrl_direction_sum()) / 6) / 2)
    assert gears_loss(pred, y, ctrl, ids, mask, direction_lambda=0.1).item() == pytest.approx(_hand_loss(0.1))
    assert gears_loss(pred, y, ctrl, ids, mask, direction_lambda=0.0).item() == pytest.approx(_hand_loss(0.0))
    # without a mask every gene counts
    full = gears_loss(pred, y, ctrl, ids, None).item()
    assert full != pytest.approx(_hand_loss(0.1))


def _ctrl_direction_sum() -> float:
    total = 0.0
    for cell in (1, 2):
        for gene in range(3):
            total += (np.sign(Y[cell][gene] - CTRL[gene]) - np.sign(PRED[cell][gene] - CTRL[gene])) ** 2
    return total


def test_uncertainty_loss_matches_hand_computation() -> None:
    pred, y, ctrl, ids, mask = _tensors()
    logvar = [[0.0, 1.0, -1.0], [0.5, 0.2, 0.0], [-0.3, 0.0, 2.0]]
    value = gears_loss(pred, y, ctrl, ids, mask, logvar=torch.tensor(logvar, dtype=torch.float64), uncertainty_reg=0.7)
    assert value.item() == pytest.approx(_hand_loss(0.1, logvar, 0.7))


def test_direction_term_carries_no_gradient_and_condition_ids_are_only_labels() -> None:
    pred, y, ctrl, ids, mask = _tensors()
    gradients = []
    for direction_lambda in (0.0, 0.1, 10.0):
        pred.grad = None
        gears_loss(pred, y, ctrl, ids, mask, direction_lambda=direction_lambda).backward()
        gradients.append(pred.grad.clone())
    torch.testing.assert_close(gradients[0], gradients[1])
    torch.testing.assert_close(gradients[0], gradients[2])
    relabelled = gears_loss(pred, y, ctrl, torch.tensor([-3, 100, 100]), mask)
    assert relabelled.item() == pytest.approx(gears_loss(pred, y, ctrl, ids, mask).item())


def test_loss_rejects_mismatched_shapes() -> None:
    pred, y, ctrl, ids, mask = _tensors()
    with pytest.raises(ValueError, match="condition_ids"):
        gears_loss(pred, y, ctrl, ids[:2], mask)
    with pytest.raises(ValueError, match="ctrl_mean"):
        gears_loss(pred, y, ctrl[:2], ids, mask)


# ---------------------------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------------------------
def test_pearson_matches_numpy_and_is_zero_for_constant_input() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=30), rng.normal(size=30)
    assert pearson(a, b) == pytest.approx(np.corrcoef(a, b)[0, 1])
    assert pearson(np.ones(5), b[:5]) == 0.0


def test_condition_metrics_match_formulas() -> None:
    ctrl = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    true = np.array([1.5, 1.0, 3.0, 6.0, 4.0, 6.5])
    pred = np.array([1.2, 2.5, 2.0, 5.0, 4.5, 7.0])
    de = np.array([3, 1, 4, 0])
    m = condition_metrics(pred, true, ctrl, de)
    assert m["mse"] == pytest.approx(np.mean((pred - true) ** 2))
    assert m["pearson"] == pytest.approx(np.corrcoef(pred, true)[0, 1])
    assert m["mse_de"] == pytest.approx(np.mean((pred[de] - true[de]) ** 2))
    assert m["pearson_de"] == pytest.approx(np.corrcoef(pred[de], true[de])[0, 1])
    assert m["pearson_delta"] == pytest.approx(np.corrcoef(pred - ctrl, true - ctrl)[0, 1])
    assert m["pearson_delta_de"] == pytest.approx(np.corrcoef(pred[de] - ctrl[de], true[de] - ctrl[de])[0, 1])
    # directions on de genes 3, 1, 4, 0: true +,-,-,+ ; pred +,+,-,+ -> 3 of 4
    assert m["frac_correct_direction_20"] == pytest.approx(0.75)
    assert "frac_correct_direction_50" not in m  # needs the full ranking
    # fewer than 1000 genes: l2 over all of them
    assert m["l2_top1000"] == pytest.approx(np.linalg.norm(pred - true))


def test_direction_uses_the_ranking_and_zero_change_is_its_own_sign() -> None:
    ctrl = np.zeros(300)
    true = np.where(np.arange(300) % 2 == 0, 1.0, -1.0)
    pred = true.copy()
    pred[:20] = 0.0  # no predicted change on the first 20 ranked genes: never "correct"
    pred[100:200] *= -1
    ranked = np.arange(300)
    m = condition_metrics(pred, true, ctrl, ranked[:20], ranked_de_idx=ranked)
    assert m["frac_correct_direction_20"] == 0.0
    assert m["frac_correct_direction_50"] == pytest.approx(30 / 50)
    assert m["frac_correct_direction_100"] == pytest.approx(80 / 100)
    assert m["frac_correct_direction_200"] == pytest.approx(80 / 200)


def test_no_change_prediction_has_zero_pearson_delta_but_high_pearson() -> None:
    """The confusion of snap-stanford/GEARS#61, as numbers: a do-nothing model still scores a high `pearson`."""
    rng = np.random.default_rng(1)
    ctrl = rng.uniform(0, 5, size=50)
    true = ctrl + rng.normal(scale=0.3, size=50)
    m = condition_metrics(ctrl, true, ctrl, np.arange(20))
    assert m["pearson_delta"] == 0.0 and m["pearson_delta_de"] == 0.0
    assert m["pearson"] > 0.9


def test_l2_top1000_uses_the_most_expressed_control_genes() -> None:
    rng = np.random.default_rng(2)
    ctrl = rng.uniform(0, 3, size=1200)
    pred, true = rng.normal(size=1200), rng.normal(size=1200)
    top = np.argsort(ctrl)[-1000:]
    m = condition_metrics(pred, true, ctrl, None)
    assert m["l2_top1000"] == pytest.approx(np.sqrt(np.sum((pred[top] - true[top]) ** 2)))
    assert set(top_expressed_genes(ctrl).tolist()) == set(top.tolist())
    assert not any(key.endswith("_de") or key.startswith("frac") for key in m)  # no DE genes given


def test_condition_metrics_reject_bad_indices() -> None:
    with pytest.raises(DataError, match="de_idx holds gene indices outside"):
        condition_metrics(np.zeros(4), np.zeros(4), np.zeros(4), [1, 4])
    with pytest.raises(DataError, match="one length"):
        condition_metrics(np.zeros(4), np.zeros(3), np.zeros(4), None)


def test_aggregation_is_the_unweighted_mean_over_conditions(caplog: pytest.LogCaptureFixture) -> None:
    per_condition = {
        "A+B": {"mse": 1.0, "pearson_delta": 0.5, "mse_de": 2.0},
        "C+D": {"mse": 3.0, "pearson_delta": 0.1, "mse_de": 4.0},
        "E+ctrl": {"mse": 8.0, "pearson_delta": -0.3, "mse_de": 9.0},
        "ctrl": {"mse": 0.0, "pearson_delta": 0.0},
    }
    subgroups = {"combo_seen0": ["A+B", "C+D"], "unseen_single": ["E+ctrl", "F+ctrl"]}
    with caplog.at_level(logging.WARNING):
        out = aggregate_metrics(per_condition, subgroups)
    assert out["mse"] == pytest.approx((1 + 3 + 8 + 0) / 4)
    assert out["mse_de"] == pytest.approx((2 + 4 + 9) / 3)  # 'ctrl' has no DE metrics
    assert out["n_conditions"] == 4
    assert out["combo_seen0/pearson_delta"] == pytest.approx(0.3)
    assert out["combo_seen0/n_conditions"] == 2
    assert out["unseen_single/mse"] == 8.0
    assert out["unseen_single/n_missing"] == 1
    assert "F+ctrl" in caplog.text
    assert "combo_seen0/n_missing" not in out


# ---------------------------------------------------------------------------------------------------------------
# baselines
# ---------------------------------------------------------------------------------------------------------------
GENES = ["A", "B", "C", "D", "E"]
CTRL_MEAN = np.array([1.0, 2.0, 3.0, 4.0, 5.0])


def _train_means() -> dict:
    return {
        "ctrl": CTRL_MEAN,
        "A+ctrl": CTRL_MEAN + np.array([-1.0, 0.5, 0.0, 0.0, 0.2]),
        "ctrl+B": CTRL_MEAN + np.array([0.0, -2.0, 1.0, 0.0, 0.0]),
        ("C",): CTRL_MEAN + np.array([0.3, 0.0, -3.0, 0.1, 0.0]),
        "A+C": CTRL_MEAN + np.array([-1.0, 0.0, -2.0, 0.5, 0.5]),
    }


def test_simple_baselines_on_a_tiny_example() -> None:
    baselines = fit_baselines(_train_means(), CTRL_MEAN, GENES)
    means = _train_means()
    np.testing.assert_allclose(baselines.predict("A+B", "no_change"), CTRL_MEAN)
    expected_mean = np.mean([means[k] for k in ("A+ctrl", "ctrl+B", ("C",), "A+C")], axis=0)  # control excluded
    np.testing.assert_allclose(baselines.predict("D+ctrl", "train_mean"), expected_mean)
    # additive: ctrl + shift(A) + shift(B), whatever the order of the genes
    additive = CTRL_MEAN + (means["A+ctrl"] - CTRL_MEAN) + (means["ctrl+B"] - CTRL_MEAN)
    np.testing.assert_allclose(baselines.predict("B+A", "additive"), additive)
    np.testing.assert_allclose(baselines.predict(("A", "B"), "additive"), additive)
    np.testing.assert_allclose(baselines.predict("ctrl", "additive"), CTRL_MEAN)
    # a double with an unseen single falls back to the training mean and is counted once
    np.testing.assert_allclose(baselines.predict("A+D", "additive"), expected_mean)
    baselines.predict("D+A", "additive")
    baselines.predict("D+ctrl", "additive")
    assert baselines.fallback_counts()["additive"] == 2
    assert baselines.fallback_conditions()["additive"] == [("A", "D"), ("D",)]
    with pytest.raises(ConfigError, match="unknown baseline"):
        baselines.predict("A+B", "mean")


def test_linear_baseline_follows_its_formula_and_is_additive_for_doubles() -> None:
    baselines = fit_baselines(_train_means(), CTRL_MEAN, GENES, pca_dim=2, ridge_penalty=0.1)
    means = _train_means()
    # the formula written out: PCA scores of genes over the training profiles (control included, columns centred)
    profiles = np.stack([means[k] for k in ("ctrl", "A+ctrl", "ctrl+B", ("C",), "A+C")], axis=1)
    centred = profiles - profiles.mean(axis=0)
    u, s, _ = np.linalg.svd(centred, full_matrices=False)
    a = u[:, :2] * s[:2]
    fit = [None, "A", "B", "C"]  # control + the singles (doubles are not in the fit)
    b = np.stack([np.zeros(2) if g is None else a[GENES.index(g)] for g in fit], axis=1)
    change = np.stack([means[k] - CTRL_MEAN for k in ("ctrl", "A+ctrl", "ctrl+B", ("C",))], axis=1)
    center = change.mean(axis=1)
    ridge = 0.1 * np.eye(2)
    w = np.linalg.inv(a.T @ a + ridge) @ a.T @ (change - center[:, None]) @ b.T @ np.linalg.inv(b @ b.T + ridge)
    for gene in ("A", "D"):
        expected = a @ w @ a[GENES.index(gene)] + center + CTRL_MEAN
        np.testing.assert_allclose(baselines.predict(gene, "linear"), expected, atol=1e-10)
    np.testing.assert_allclose(baselines.predict("ctrl", "linear"), center + CTRL_MEAN, atol=1e-10)
    shift = {g: baselines.predict(g, "linear") - CTRL_MEAN - center for g in ("B", "D")}
    np.testing.assert_allclose(baselines.predict("B+D", "linear"), CTRL_MEAN + center + shift["B"] + shift["D"], atol=1e-10)
    # a perturbed gene outside the read-out genes has no embedding: counted fallback
    np.testing.assert_allclose(baselines.predict("Z+ctrl", "linear"), baselines.train_mean)
    assert baselines.fallback_counts()["linear"] == 1
    assert set(baselines.predict_all("A+B")) == {"no_change", "train_mean", "additive", "linear"}


def test_baselines_reject_bad_input() -> None:
    assert normalize_condition("ctrl+A") == ("A",) and normalize_condition("ctrl") == ()
    with pytest.raises(DataError, match="only control"):
        fit_baselines({"ctrl": CTRL_MEAN}, CTRL_MEAN, GENES)
    with pytest.raises(DataError, match="appears twice"):
        fit_baselines({"A+ctrl": CTRL_MEAN, "ctrl+A": CTRL_MEAN}, CTRL_MEAN, GENES)
    with pytest.raises(DataError, match="shape"):
        fit_baselines({"A+ctrl": CTRL_MEAN[:3]}, CTRL_MEAN, GENES)
    with pytest.raises(DataError, match="gene_names"):
        fit_baselines({"A+ctrl": CTRL_MEAN}, CTRL_MEAN, GENES[:4])


def test_baselines_that_beat_the_model_by_each_metrics_direction():
    model = {"mse_de": 1.0, "pearson_delta": 0.2, "mse": 0.1}
    baselines = {"no_change": {"mse_de": 1.3, "pearson_delta": 0.0, "mse": 0.1},
                 "additive": {"mse_de": 0.9, "pearson_delta": 0.3, "mse": float("nan")},
                 "linear": {"mse_de": 1.1, "pearson_delta": 0.25}}
    assert baselines_that_beat(model, baselines, ["mse_de", "pearson_delta", "mse"]) == {
        "mse_de": {"additive": 0.9}, "pearson_delta": {"additive": 0.3, "linear": 0.25}}  # a tie is no win

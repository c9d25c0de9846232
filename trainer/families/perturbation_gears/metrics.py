"""Evaluation metrics of GEARS, on cell-mean profiles: one value per condition, then an unweighted mean.

Each test condition (a single or double perturbation) is scored on mean profiles [G]: ``pred`` = the mean of
the predictions for its cells, ``true`` = the mean of its observed cells, ``ctrl`` = the mean of all control
cells. Then every metric is averaged over conditions, each condition weighing the same whatever its cell
count. This follows GEARS' ``compute_metrics`` and ``deeper_analysis`` (``gears/inference.py``).

The names, plainly (``pearson_de`` and ``pearson_delta`` are different things, read as one in
snap-stanford/GEARS#61; only the second says whether the *change* was predicted):

* ``mse``: mean over all genes of (pred - true)^2.
* ``pearson``: Pearson correlation of pred and true over all genes. High even for a model that predicts no
  change at all, because expression levels vary far more between genes than perturbations move them.
* ``mse_de``, ``pearson_de``: the same on the condition's top-20 differentially expressed (DE) genes (GEARS:
  the first 20 of ``uns['rank_genes_groups_cov_all']``, a t-test against control ranked by |score|).
  ``pearson_de`` still correlates *levels*, so it is also high for a no-change prediction.
* ``pearson_delta``: Pearson correlation of the *changes* (pred - ctrl) and (true - ctrl) over all genes;
  the GEARS paper's headline metric. 0 for a no-change prediction.
* ``pearson_delta_de``: the same on the top-20 DE genes.
* ``frac_correct_direction_{20,50,100,200}``: over the top-k DE genes, the fraction where
  sign(pred - ctrl) == sign(true - ctrl) (GEARS' ``deeper_analysis``; zero change counts as its own sign).
* ``l2_top1000``: the Euclidean distance between pred and true over the 1000 genes with the highest
  control mean (Ahlmann-Eltze, Huber and Anders, Nature Methods 2025, the "most highly expressed genes").

Conventions: a Pearson correlation with a constant input is 0 (GEARS replaces scipy's NaN by 0). The DE
metrics need the condition's DE genes; with ``de_idx=None`` (control, or no DE ranking) they are left out
and the aggregate averages each metric over the conditions that have it (GEARS likewise skips 'ctrl' for
the ``_de`` means). ``frac_correct_direction_k`` for k > 20 needs the full ranking (``ranked_de_idx``); when
fewer than k genes are ranked it uses all of them and divides by their number (GEARS divides by k).
GEARS' "non-dropout" variants are the same formulas on another DE list (``uns['top_non_dropout_de_20']``):
call ``condition_metrics`` with that list as ``de_idx`` and rename the DE keys.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np

from trainer.errors import DataError
from trainer.families.perturbation_gears.spec import DIRECTION_TOP_K

__all__ = ["DIRECTION_TOP_K", "TOP_EXPRESSED", "aggregate_metrics", "condition_metrics", "pearson", "top_expressed_genes"]

logger = logging.getLogger(__name__)

TOP_EXPRESSED = 1000
"""Genes of ``l2_top1000``."""


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of two vectors in float64; 0.0 when either is constant (GEARS' NaN -> 0)."""
    a = np.asarray(a, dtype=np.float64) - np.mean(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64) - np.mean(b, dtype=np.float64)
    denominator = np.sqrt(np.dot(a, a) * np.dot(b, b))
    if not np.isfinite(denominator) or denominator == 0.0:
        return 0.0
    return float(np.clip(np.dot(a, b) / denominator, -1.0, 1.0))


def top_expressed_genes(ctrl_mean: np.ndarray, count: int = TOP_EXPRESSED) -> np.ndarray:
    """Indices of the ``count`` genes with the highest control mean (all genes if fewer); ties by gene order."""
    order = np.argsort(-np.asarray(ctrl_mean, dtype=np.float64), kind="stable")
    return order[: min(count, order.size)]


def _as_index(name: str, idx: Sequence[int] | np.ndarray, num_genes: int) -> np.ndarray:
    array = np.asarray(idx)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise DataError(f"{name} must be a 1-D array of gene indices, got shape {array.shape} dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() >= num_genes):
        raise DataError(f"{name} holds gene indices outside [0, {num_genes}): {array[(array < 0) | (array >= num_genes)][:5]}")
    return array.astype(np.int64)


def condition_metrics(
    pred_mean: np.ndarray,
    true_mean: np.ndarray,
    ctrl_mean: np.ndarray,
    de_idx: Sequence[int] | np.ndarray | None,
    *,
    ranked_de_idx: Sequence[int] | np.ndarray | None = None,
    top_expressed_idx: np.ndarray | None = None,
) -> dict[str, float]:
    """All metrics of one condition from its mean profiles (see the module docstring for each name).

    Args:
        pred_mean, true_mean, ctrl_mean: [G] mean predicted, observed and control expression.
        de_idx: the condition's top-20 DE gene indices, or None (control / no ranking: no DE metrics).
        ranked_de_idx: all (or the top 200) gene indices in DE rank order (GEARS: ``rank_genes_groups_cov_all``);
            ``frac_correct_direction_k`` then uses its first k genes for every k. Without it only
            ``frac_correct_direction_20`` is computed, on ``de_idx``.
        top_expressed_idx: genes of ``l2_top1000``; default ``top_expressed_genes(ctrl_mean)``. Pass it
            precomputed when scoring many conditions.
    """
    pred = np.asarray(pred_mean, dtype=np.float64)
    true = np.asarray(true_mean, dtype=np.float64)
    ctrl = np.asarray(ctrl_mean, dtype=np.float64)
    if pred.ndim != 1 or pred.shape != true.shape or pred.shape != ctrl.shape:
        raise DataError(f"pred_mean, true_mean and ctrl_mean must be [G] vectors of one length, got "
                        f"{pred.shape}, {true.shape}, {ctrl.shape}")
    num_genes = pred.size
    pred_delta, true_delta = pred - ctrl, true - ctrl
    if top_expressed_idx is None:
        top_expressed_idx = top_expressed_genes(ctrl)
    top = _as_index("top_expressed_idx", top_expressed_idx, num_genes)

    metrics = {
        "mse": float(np.mean((pred - true) ** 2)),
        "pearson": pearson(pred, true),
        "pearson_delta": pearson(pred_delta, true_delta),
        "l2_top1000": float(np.linalg.norm(pred[top] - true[top])),
    }
    if de_idx is None:
        return metrics
    de = _as_index("de_idx", de_idx, num_genes)
    if de.size == 0:
        raise DataError("de_idx is empty: pass None for a condition without DE genes")
    metrics["mse_de"] = float(np.mean((pred[de] - true[de]) ** 2))
    metrics["pearson_de"] = pearson(pred[de], true[de])
    metrics["pearson_delta_de"] = pearson(pred_delta[de], true_delta[de])
    same_sign = np.sign(pred_delta) == np.sign(true_delta)
    if ranked_de_idx is None:
        metrics[f"frac_correct_direction_{DIRECTION_TOP_K[0]}"] = float(np.mean(same_sign[de]))
        return metrics
    ranked = _as_index("ranked_de_idx", ranked_de_idx, num_genes)
    if ranked.size == 0:
        raise DataError("ranked_de_idx is empty: pass None when there is no DE ranking")
    for k in DIRECTION_TOP_K:
        metrics[f"frac_correct_direction_{k}"] = float(np.mean(same_sign[ranked[:k]]))
    return metrics


def aggregate_metrics(
    per_condition: Mapping[str, Mapping[str, float]],
    subgroups: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, float]:
    """Unweighted mean of each metric over conditions, overall and per test subgroup.

    Returns flat keys: ``pearson_delta``, ..., ``n_conditions``, and for each subgroup
    ``{group}/pearson_delta``, ..., ``{group}/n_conditions``. A metric is averaged over the conditions that
    have it (DE metrics skip conditions without DE genes). Subgroup members with no entry in
    ``per_condition`` are counted in ``{group}/n_missing`` and logged, never silently dropped.
    """
    out = _mean_over(per_condition, list(per_condition))
    for group, members in (subgroups or {}).items():
        present = [name for name in members if name in per_condition]
        missing = len(members) - len(present)
        for key, value in _mean_over(per_condition, present).items():
            out[f"{group}/{key}"] = value
        if missing:
            out[f"{group}/n_missing"] = float(missing)
            logger.warning("test subgroup %r: %d of its %d conditions have no metrics (not evaluated): %s",
                           group, missing, len(members), [m for m in members if m not in per_condition][:5])
    return out


def _mean_over(per_condition: Mapping[str, Mapping[str, float]], names: Sequence[str]) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for name in names:
        for key, value in per_condition[name].items():
            values.setdefault(key, []).append(float(value))
    out = {key: float(np.mean(vals)) for key, vals in sorted(values.items())}
    out["n_conditions"] = float(len(names))
    return out


def lower_is_better(metric: str) -> bool:
    """Errors and distances (mse*, l2*) are better lower; correlations and fractions (pearson*, frac_*) higher."""
    return metric.startswith(("mse", "l2"))


def baselines_that_beat(model: Mapping[str, float], baselines: Mapping[str, Mapping[str, float]],
                        metrics: Sequence[str]) -> dict[str, dict[str, float]]:
    """{metric: {baseline: its value}} for each of `metrics` (overall, not per subgroup) on which a baseline
    scores strictly better than the model; a metric no baseline beats is left out."""
    out: dict[str, dict[str, float]] = {}
    for metric in metrics:
        ours = model.get(metric)
        if ours is None or not np.isfinite(ours):
            continue
        better = {name: float(values[metric]) for name, values in baselines.items()
                  if metric in values and np.isfinite(values[metric])
                  and (values[metric] < ours if lower_is_better(metric) else values[metric] > ours)}
        if better:
            out[metric] = better
    return out

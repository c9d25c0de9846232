"""Simple baselines scored next to GEARS on the same split, from training mean profiles only (numpy).

Ahlmann-Eltze, Huber and Anders (Nature Methods 2025) found that no deep model (GEARS, CPA, scGPT-class
models) beats these. Each predicts one mean profile [G] per condition:

* ``no_change``: the control mean (the perturbation does nothing). ``pearson_delta`` is 0 by construction.
* ``train_mean``: the mean over the training perturbations (every training condition except control) of
  their mean profiles, the same for every condition.
* ``additive``: ``ctrl + sum over the condition's genes of (single_g - ctrl)``, where ``single_g`` is the
  training mean profile of gene g's single perturbation. Meant for doubles whose two singles were both
  trained on (``combo_seen2``); for a seen single it returns that single's training profile. A condition
  with a gene whose single is not in training (``combo_seen0/1``, unseen singles) falls back to
  ``train_mean``: counted per condition in ``fallback_counts()`` and logged.
* ``linear``: the linear model of Ahlmann-Eltze et al. with both embeddings from the training data (their
  ``run_linear_pretrained_model.R`` defaults ``gene_embedding = pert_embedding = "training_data"``,
  ``pca_dim = 10``, ``ridge_penalty = 0.1``):
  - ``Y_train`` [G, C]: the training mean profiles (control included), one column per condition.
  - Gene embedding ``A`` [G, K]: PCA scores of the genes (rows) of ``Y_train``, columns centred
    (R's ``prcomp``), K = ``pca_dim`` components.
  - Perturbation embedding of gene g: ``A[g]``, the embedding of the perturbed gene itself; control: 0.
  - Fit on the training singles (whose gene is among the G genes) and control: ``D = Y - ctrl`` per column,
    ``c`` = row means of ``D``, ``W = (A'A + l I)^-1 A' (D - c) B' (B B' + l I)^-1`` with ``B`` [K, n] the
    columns' perturbation embeddings and ``l`` the ridge penalty.
  - Predict: ``A W b + c + ctrl``. For a double we use ``b = A[g1] + A[g2]`` (our extension: the paper's
    code predicts singles only; this makes the predicted double the sum of the two predicted shifts).
    A perturbed gene that is not among the G genes has no embedding: ``train_mean`` fallback, counted.

Conditions are tuples of gene names, order-free (``("A", "B") == ("B", "A")``); the control is ``()``.
``normalize_condition`` also accepts GEARS strings ('ctrl', 'A+ctrl', 'ctrl+A', 'A+B').
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from trainer.errors import ConfigError, DataError

__all__ = ["BASELINE_NAMES", "Condition", "PerturbationBaselines", "fit_baselines", "normalize_condition"]

logger = logging.getLogger(__name__)

Condition = tuple[str, ...]
BASELINE_NAMES = ("no_change", "train_mean", "additive", "linear")


def normalize_condition(condition: str | Sequence[str]) -> Condition:
    """A sorted tuple of perturbed genes without 'ctrl': 'A+ctrl' -> ('A',), 'ctrl' -> (), ['B', 'A'] -> ('A', 'B')."""
    genes = condition.split("+") if isinstance(condition, str) else list(condition)
    if any(not isinstance(gene, str) or not gene for gene in genes):
        raise DataError(f"condition {condition!r}: every gene must be a non-empty string")
    return tuple(sorted(gene for gene in genes if gene != "ctrl"))


@dataclass
class _LinearModel:
    gene_embedding: np.ndarray  # [G, K]
    weights: np.ndarray  # [K, K]
    center: np.ndarray  # [G]


@dataclass
class PerturbationBaselines:
    """Fitted baselines; build with ``fit_baselines``. ``predict(condition, name)`` -> mean profile [G]."""

    ctrl_mean: np.ndarray
    train_mean: np.ndarray
    single_means: dict[str, np.ndarray]
    gene_index: dict[str, int]
    linear_model: _LinearModel | None
    linear_unavailable_reason: str | None = None
    _fallbacks: dict[str, set[Condition]] = field(default_factory=lambda: {"additive": set(), "linear": set()})

    names = BASELINE_NAMES

    def predict(self, condition: str | Sequence[str], name: str) -> np.ndarray:
        """Mean profile [G] of baseline ``name`` (one of ``BASELINE_NAMES``) for ``condition``."""
        cond = normalize_condition(condition)
        if name == "no_change":
            return self.ctrl_mean.copy()
        if name == "train_mean":
            return self.train_mean.copy()
        if name == "additive":
            return self._additive(cond)
        if name == "linear":
            return self._linear(cond)
        raise ConfigError(f"unknown baseline {name!r}; choose from {', '.join(BASELINE_NAMES)}")

    def predict_all(self, condition: str | Sequence[str]) -> dict[str, np.ndarray]:
        """Every baseline's mean profile for ``condition``."""
        return {name: self.predict(condition, name) for name in BASELINE_NAMES}

    def fallback_counts(self) -> dict[str, int]:
        """How many distinct conditions each baseline predicted with the ``train_mean`` fallback so far."""
        return {name: len(conditions) for name, conditions in self._fallbacks.items()}

    def fallback_conditions(self) -> dict[str, list[Condition]]:
        """The conditions behind ``fallback_counts`` (sorted)."""
        return {name: sorted(conditions) for name, conditions in self._fallbacks.items()}

    def _fall_back(self, name: str, cond: Condition, reason: str) -> np.ndarray:
        if cond not in self._fallbacks[name]:
            self._fallbacks[name].add(cond)
            logger.debug("baseline %s: condition %s falls back to the training mean (%s)", name, "+".join(cond), reason)
        return self.train_mean.copy()

    def _additive(self, cond: Condition) -> np.ndarray:
        missing = [gene for gene in cond if gene not in self.single_means]
        if missing:
            return self._fall_back("additive", cond, f"no training single for {', '.join(missing)}")
        prediction = self.ctrl_mean.copy()
        for gene in cond:
            prediction += self.single_means[gene] - self.ctrl_mean
        return prediction

    def _linear(self, cond: Condition) -> np.ndarray:
        if self.linear_model is None:
            return self._fall_back("linear", cond, f"linear model not fitted: {self.linear_unavailable_reason}")
        missing = [gene for gene in cond if gene not in self.gene_index]
        if missing:
            return self._fall_back("linear", cond, f"perturbed gene(s) {', '.join(missing)} not among the read-out genes")
        model = self.linear_model
        embedding = np.zeros(model.weights.shape[0])
        for gene in cond:
            embedding += model.gene_embedding[self.gene_index[gene]]
        return model.gene_embedding @ (model.weights @ embedding) + model.center + self.ctrl_mean


def fit_baselines(
    train_means: Mapping[str | Sequence[str], np.ndarray],
    ctrl_mean: np.ndarray,
    gene_names: Sequence[str],
    *,
    pca_dim: int = 10,
    ridge_penalty: float = 0.1,
) -> PerturbationBaselines:
    """Fit the four baselines from the training conditions' mean profiles.

    Args:
        train_means: training condition -> its mean profile [G] (control may be included as () or 'ctrl').
        ctrl_mean: [G] mean of the control cells.
        gene_names: the G read-out gene names, in profile order (to find a perturbed gene's embedding).
        pca_dim: K of the linear model's PCA embedding (Ahlmann-Eltze et al.: 10).
        ridge_penalty: the linear model's ridge penalty (Ahlmann-Eltze et al.: 0.1).
    """
    ctrl = np.asarray(ctrl_mean, dtype=np.float64)
    if ctrl.ndim != 1:
        raise DataError(f"ctrl_mean must be a [G] vector, got shape {ctrl.shape}")
    num_genes = ctrl.size
    if len(gene_names) != num_genes:
        raise DataError(f"gene_names has {len(gene_names)} names for {num_genes} genes in ctrl_mean")
    if pca_dim < 1 or ridge_penalty < 0:
        raise ConfigError(f"linear baseline: pca_dim must be >= 1 and ridge_penalty >= 0, got {pca_dim}, {ridge_penalty}")
    means: dict[Condition, np.ndarray] = {}
    for raw, profile in train_means.items():
        cond = normalize_condition(raw)
        array = np.asarray(profile, dtype=np.float64)
        if array.shape != (num_genes,):
            raise DataError(f"training condition {raw!r}: mean profile has shape {array.shape}, expected ({num_genes},)")
        if not np.isfinite(array).all():
            raise DataError(f"training condition {raw!r}: mean profile has non-finite values")
        if cond in means:
            raise DataError(f"training condition {raw!r} appears twice (as {'+'.join(cond) or 'ctrl'})")
        means[cond] = array
    perturbations = [cond for cond in means if cond]
    if not perturbations:
        raise DataError("fit_baselines: no training perturbation (only control), so there is no training mean")
    train_mean = np.mean([means[cond] for cond in perturbations], axis=0)
    single_means = {cond[0]: means[cond] for cond in perturbations if len(cond) == 1}
    gene_index = {name: index for index, name in enumerate(gene_names)}
    if len(gene_index) != num_genes:
        raise DataError("gene_names has duplicate names")

    linear_model, reason = _fit_linear(means, ctrl, gene_index, pca_dim, ridge_penalty)
    if linear_model is None:
        logger.warning("linear baseline not fitted (%s): it predicts the training mean", reason)
    return PerturbationBaselines(ctrl_mean=ctrl, train_mean=train_mean, single_means=single_means, gene_index=gene_index,
                                 linear_model=linear_model, linear_unavailable_reason=reason)


def _fit_linear(
    means: dict[Condition, np.ndarray], ctrl: np.ndarray, gene_index: dict[str, int], pca_dim: int, ridge_penalty: float
) -> tuple[_LinearModel | None, str | None]:
    with_ctrl = dict(means)
    with_ctrl.setdefault((), ctrl)
    profiles = np.stack(list(with_ctrl.values()), axis=1)  # [G, C]
    centred = profiles - profiles.mean(axis=0, keepdims=True)
    rank = min(pca_dim, *centred.shape)
    u, s, _ = np.linalg.svd(centred, full_matrices=False)
    gene_embedding = u[:, :rank] * s[:rank]  # PCA scores of the genes, [G, K]

    fit_conditions = [cond for cond in with_ctrl if len(cond) == 0 or (len(cond) == 1 and cond[0] in gene_index)]
    if not any(fit_conditions):
        return None, "no training single whose gene is among the read-out genes"
    change = np.stack([with_ctrl[cond] - ctrl for cond in fit_conditions], axis=1)  # [G, n]
    pert_embedding = np.stack(
        [gene_embedding[gene_index[cond[0]]] if cond else np.zeros(rank) for cond in fit_conditions], axis=1
    )  # [K, n]
    center = change.mean(axis=1)
    a, b = gene_embedding, pert_embedding
    identity = np.eye(rank)
    try:
        left = np.linalg.solve(a.T @ a + ridge_penalty * identity, a.T @ (change - center[:, None]))  # [K, n]
        # W = left B' (B B' + l I)^-1, as a solve against the symmetric matrix.
        weights = np.linalg.solve(b @ b.T + ridge_penalty * identity, (left @ b.T).T).T
    except np.linalg.LinAlgError:
        weights = np.full((rank, rank), np.nan)
    if not np.isfinite(weights).all():
        return None, "the ridge system is singular (set ridge_penalty > 0)"
    return _LinearModel(gene_embedding=gene_embedding, weights=weights, center=center), None

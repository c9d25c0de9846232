"""GEARS' training loss (``loss_fct`` and ``uncertainty_loss_fct`` of ``snap-stanford/GEARS``, ``gears/utils.py``).

For each distinct condition p in the batch, over p's cells and its retained genes::

    L_p = mean[ |y_hat - y|^(2 + gamma) ]                                       (autofocus; gamma = 2: 4th power)
        + direction_lambda * mean[ (sign(y - ctrl) - sign(y_hat - ctrl))^2 ]   (direction term)

and the loss is the unweighted mean of L_p over the conditions in the batch (a condition with 3 cells
weighs as much as one with 30). With the uncertainty head the first term becomes
``mean[ |y_hat - y|^(2+gamma) * (1 + uncertainty_reg * exp(-logvar)) ]``; GEARS has no ``+ logvar`` term,
so this is not a Gaussian likelihood, and neither is it here.

What is replicated, and how it maps to tensors:

* Retained genes. GEARS drops, for a perturbed condition, the genes that are zero in all of its cells
  (``adata.uns['non_zeros_gene_idx']``, its ``dict_filter``), "for a cleaner direction loss"; for 'ctrl'
  it keeps every gene. Here ``nonzero_mask`` [B, G] carries that per cell: the data side gives each cell
  its condition's mask, all True for control cells. ``None`` keeps every gene for every cell.
* 'ctrl' is a condition like any other: its cells form one more group and get the direction term too
  (against the control mean, so it pushes them to the mean's side of each gene).
* ``ctrl_mean`` is the mean expression of the control cells (GEARS' ``ctrl_expression``).
* ``|d|^(2+gamma)`` instead of GEARS' ``d ** (2 + gamma)``: equal for GEARS' even power (gamma = 2) and
  defined for any other gamma.
* The direction term carries no gradient: ``sign`` has derivative 0 almost everywhere, so it changes the
  logged loss value but never the parameters. It is kept so logged numbers match GEARS'.

A condition whose mask is all False (every gene zero in every cell) contributes 0 and still counts as a
condition in the mean; GEARS would produce NaN there.
"""

from __future__ import annotations

import torch

__all__ = ["gears_loss"]


def gears_loss(
    pred: torch.Tensor,
    y: torch.Tensor,
    ctrl_mean: torch.Tensor,
    condition_ids: torch.Tensor,
    nonzero_mask: torch.Tensor | None = None,
    *,
    direction_lambda: float = 0.1,
    gamma: float = 2.0,
    logvar: torch.Tensor | None = None,
    uncertainty_reg: float = 1.0,
) -> torch.Tensor:
    """GEARS' autofocus + direction loss (+ uncertainty), a scalar averaged over the batch's conditions.

    Args:
        pred: [B, G] predicted expression.
        y: [B, G] observed expression of the perturbed cells.
        ctrl_mean: [G] mean expression of the control cells.
        condition_ids: [B] integer id of each cell's condition (any integers; equal ids = one condition).
        nonzero_mask: [B, G] bool, the genes kept for each cell (its condition's non-zero genes; all True
            for control cells, as GEARS uses every gene for 'ctrl'); None keeps every gene.
        direction_lambda: weight of the direction term (GEARS default 0.1).
        gamma: autofocus exponent offset, the error is raised to 2 + gamma (GEARS: 2).
        logvar: [B, G] log-variance from the uncertainty head, or None for the plain loss.
        uncertainty_reg: weight of the ``exp(-logvar)`` term (GEARS default 1).
    """
    if pred.shape != y.shape or pred.dim() != 2:
        raise ValueError(f"pred and y must both have shape [B, G], got {tuple(pred.shape)} and {tuple(y.shape)}")
    if ctrl_mean.shape != pred.shape[1:]:
        raise ValueError(f"ctrl_mean must have shape [{pred.size(1)}], got {tuple(ctrl_mean.shape)}")
    if condition_ids.shape != pred.shape[:1]:
        raise ValueError(f"condition_ids must have shape [{pred.size(0)}], got {tuple(condition_ids.shape)}")
    if nonzero_mask is not None and nonzero_mask.shape != pred.shape:
        raise ValueError(f"nonzero_mask must have shape {tuple(pred.shape)}, got {tuple(nonzero_mask.shape)}")
    if logvar is not None and logvar.shape != pred.shape:
        raise ValueError(f"logvar must have shape {tuple(pred.shape)}, got {tuple(logvar.shape)}")

    error = (pred - y).abs().pow(2.0 + gamma)
    if logvar is not None:
        error = error + uncertainty_reg * torch.exp(-logvar) * error
    # sign() has zero gradient: this term only shifts the value.
    direction = direction_lambda * (torch.sign(y - ctrl_mean) - torch.sign(pred - ctrl_mean)).pow(2)
    per_element = error + direction
    if nonzero_mask is None:
        kept = torch.ones_like(per_element)
    else:
        kept = nonzero_mask.to(per_element.dtype)
        per_element = per_element * kept

    _, group = torch.unique(condition_ids, return_inverse=True)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    if num_groups == 0:
        return pred.sum() * 0.0
    sums = per_element.new_zeros(num_groups).index_add_(0, group, per_element.sum(dim=1))
    counts = kept.new_zeros(num_groups).index_add_(0, group, kept.sum(dim=1))
    return (sums / counts.clamp(min=1.0)).mean()

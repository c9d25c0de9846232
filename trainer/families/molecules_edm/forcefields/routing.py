"""A force field for the elements it models and a fallback for the rest (ANI-1x has no F; QM9 has F).

`RoutedForceField(primary, fallback)` sends each molecule of a batch to `primary` when every atom's element
is in `primary.supported_numbers`, otherwise to `fallback` (built on first need: a batch without such a
molecule never starts it); with no fallback such a molecule is not ok. Both receive the whole batch with the
other force field's rows masked out (no atoms), so a stateful guidance evaluator (xTB's per-row ladder and
wavefunctions) keeps seeing each molecule at the same row. The result's `source` says which force field
scored each molecule (index into `names`; -1: none); `scorer(source)` names the force field behind a code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from trainer.families.molecules_edm.forcefields.base import (
    ForceBatch,
    ForceResult,
    compute_on_device,
    guidance_evaluator,
    modelled_atoms,
)


class RoutedForceField:
    """`primary` where it models every element of a molecule, `fallback` elsewhere (see the module docstring).

    `fallback` is a force field, a zero-argument factory (called once, on the first molecule that needs it)
    or None. `names` = [primary's name, fallback's name or "none"].
    """

    def __init__(self, primary: Any, fallback: Any | Callable[[], Any] | None, fallback_name: str | None = None) -> None:
        self.primary = primary
        self._fallback = fallback
        self._fallback_built = fallback is None or not callable(fallback) or hasattr(fallback, "compute")
        fallback_label = fallback_name or (getattr(fallback, "name", None) if self._fallback_built else None) or "none"
        self.names = [str(primary.name), str(fallback_label) if fallback is not None else "none"]
        self.name = primary.name if fallback is None else f"{primary.name}+{self.names[1]}"
        self.supported_numbers = getattr(primary, "supported_numbers", None)
        self.rung_labels: list[str] = []
        self.last_errors: dict[int, str] = {}

    @property
    def has_fallback(self) -> bool:
        return self._fallback is not None

    @property
    def fallback(self) -> Any | None:
        """The fallback force field, built now if it was given as a factory."""
        if not self._fallback_built:
            self._fallback = self._fallback()
            self._fallback_built = True
        return self._fallback

    def scorer(self, source: int) -> Any | None:
        """The force field behind a result's `source` code: 0 the primary, 1 the fallback (built now if it was given
        as a factory; None without one), -1 (scored by none) None. `base.scoring_forcefield` asks any force field."""
        if source == 0:
            return self.primary
        if source == 1:
            return self.fallback
        if source == -1:
            return None
        raise ValueError(f"{self.name}: no force field has source code {source!r} (0: {self.names[0]}, "
                         f"1: {self.names[1]}, -1: none)")

    def for_guidance(self, needs_spread: bool = False) -> RoutedForceField:
        """The same routing over each side's guidance evaluator (xTB: its ladder), for one sampling call."""
        def evaluator(field: Any) -> Any:
            return guidance_evaluator(field, needs_spread)

        if self._fallback_built:
            fallback = None if self._fallback is None else evaluator(self._fallback)
        else:
            fallback = lambda: evaluator(self.fallback)  # noqa: E731  (built on first need, shared by all sets)
        routed = RoutedForceField(evaluator(self.primary), fallback, fallback_name=self.names[1])
        return routed

    def _routes(self, numbers: Any, mask: Any) -> Any:
        """[B] bool: the molecules the primary models (every real atom's element in supported_numbers)."""
        return modelled_atoms(numbers, mask, self.supported_numbers).all(dim=1) & mask.any(dim=1)

    def compute_tensors(self, numbers: Any, positions: Any, mask: Any) -> ForceBatch:
        """numbers [B, N], positions [B, N, 3] Angstrom, mask [B, N] (tensors) -> ForceBatch with `source`."""
        import torch

        mask = mask.bool()
        primary_rows = self._routes(numbers, mask)
        other_rows = mask.any(dim=1) & ~primary_rows
        first = compute_on_device(self.primary, numbers, positions, mask & primary_rows.unsqueeze(1))
        first.ok = first.ok & primary_rows  # a row masked out for the primary is never its result
        source = torch.where(first.ok, torch.zeros_like(numbers[:, 0]), torch.full_like(numbers[:, 0], -1))
        self.last_errors = {b: e for b, e in getattr(self.primary, "last_errors", {}).items() if bool(primary_rows[b])}
        out = first
        if bool(other_rows.any()):
            fallback = self.fallback
            if fallback is None:
                for b in torch.nonzero(other_rows).flatten().tolist():
                    self.last_errors[b] = f"elements outside {self.names[0]} and no fallback force field"
            else:
                second = compute_on_device(fallback, numbers, positions, mask & other_rows.unsqueeze(1))
                self.rung_labels = [str(label) for label in getattr(fallback, "rung_labels", ())]
                take = other_rows & second.ok
                pick = take.reshape(-1, 1, 1)
                out = ForceBatch(
                    energy=torch.where(take, second.energy, first.energy),
                    forces=torch.where(pick, second.forces, first.forces),
                    ok=first.ok | take,
                    energy_spread=None if first.energy_spread is None else
                    torch.where(take, torch.full_like(first.energy_spread, float("nan")), first.energy_spread),
                    force_spread=None if first.force_spread is None else
                    torch.where(take, torch.full_like(first.force_spread, float("nan")), first.force_spread),
                    rung=None if second.rung is None else torch.where(take, second.rung, torch.full_like(second.rung, -1)))
                source = torch.where(take, torch.ones_like(source), source)
                self.last_errors.update({b: e for b, e in getattr(fallback, "last_errors", {}).items()
                                         if bool(other_rows[b])})
        out.source = source
        return out

    def compute(self, numbers: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> ForceResult:
        """The numpy form of `compute_tensors` (on the CPU); `source` is left out."""
        import torch

        batch = self.compute_tensors(torch.as_tensor(np.asarray(numbers)),
                                     torch.as_tensor(np.asarray(positions, dtype=np.float64)),
                                     torch.as_tensor(np.asarray(mask, dtype=bool)))
        return batch.to_numpy()

    def close(self) -> None:
        for field in (self.primary, self._fallback if self._fallback_built else None):
            if field is not None and hasattr(field, "close"):
                field.close()

"""The batched force-field interface used by guidance and by the evaluation metrics.

A force field takes a padded batch of molecules (atomic numbers, positions in Angstrom, atom mask)
and returns per-molecule energies (eV), per-atom forces (eV/Angstrom) and an ok flag per molecule.
A molecule whose evaluation raises or gives non-finite values is `ok = False` (energy NaN, forces
zero): callers leave it unguided and count it; one unphysical molecule never fails a batch.

A force field may also offer `for_guidance()`: an evaluator with the same `compute` for the many evaluations
of one guided sampling call (rows are the same molecules at every step), which may trade strictness for speed
and report the `rung` of each result (xTB: an electronic-temperature ladder); `rung_labels` names the rungs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass
class ForceResult:
    """Output of `ForceField.compute` for a batch of B molecules padded to N atoms."""

    energy: np.ndarray
    """[B] float64 energies in eV (NaN where not ok)."""
    forces: np.ndarray
    """[B, N, 3] float64 forces in eV/Angstrom (zero at padding and where not ok)."""
    ok: np.ndarray
    """[B] bool: the evaluation succeeded and every value is finite."""
    rung: np.ndarray | None = None
    """[B] int, for evaluations on a ladder of settings (xTB guidance): the rung each molecule converged on,
    -1 where it failed; None for a force field without a ladder."""

    @classmethod
    def empty(cls, batch: int, num_atoms: int) -> ForceResult:
        return cls(np.full(batch, np.nan), np.zeros((batch, num_atoms, 3)), np.zeros(batch, dtype=bool))

    def record(self, index: int, atom_mask: np.ndarray, energy: float, forces: np.ndarray) -> None:
        """Store molecule `index`'s successful result (forces of its real atoms only) and mark it ok."""
        self.energy[index] = energy
        self.forces[index, atom_mask] = forces
        self.ok[index] = True


@runtime_checkable
class ForceField(Protocol):
    """A batched force field (loaded once per process)."""

    name: str
    """Short name for logs and metric tables (e.g. `gfn2-xtb`)."""

    def compute(self, numbers: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> ForceResult:
        """numbers [B, N] int, positions [B, N, 3] Angstrom, mask [B, N] bool -> ForceResult."""

    def close(self) -> None:
        """Release workers and files (idempotent)."""

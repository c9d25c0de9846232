"""An analytic test force field: harmonic springs to reference bond lengths (tests and benchmarks only).

Every pair of atoms closer than `cutoff` (Angstrom) is joined by a spring of stiffness `k` (eV/A^2)
with rest length the single-bond length of its element pair from EDM's table (`qm9/bond_analyze.py`,
`bonds1`, pm -> Angstrom):

    E = sum_{i<j, d_ij < cutoff} 0.5 k (d_ij - r0_ij)^2,  F_i = -dE/dx_i = -sum_j k (d_ij - r0_ij) (x_i - x_j) / d_ij.

The set of springs changes at the cutoff (E jumps there): good enough to test that guidance moves
atoms downhill. A pair of elements without a tabulated length makes that molecule `ok = False`, and so
do coinciding atoms (the force direction is undefined there), as the ForceField protocol says.
"""

from __future__ import annotations

import numpy as np

from trainer.families.molecules_edm.forcefields.base import ForceResult

SINGLE_BOND_PM: dict[tuple[int, int], float] = {
    (1, 1): 74, (1, 6): 109, (1, 7): 101, (1, 8): 96, (1, 9): 92,
    (6, 6): 154, (6, 7): 147, (6, 8): 143, (6, 9): 135,
    (7, 7): 145, (7, 8): 140, (7, 9): 136,
    (8, 8): 148, (8, 9): 142, (9, 9): 142,
}
"""EDM's single-bond lengths (pm) by sorted pair of atomic numbers (H, C, N, O, F)."""


class SpringForceField:
    """Harmonic springs between close atoms (see the module docstring); energies in eV, forces in eV/Angstrom."""

    name = "springs"

    def __init__(self, stiffness: float = 10.0, cutoff: float = 2.0,
                 bond_lengths_pm: dict[tuple[int, int], float] | None = None, min_distance: float = 1e-6) -> None:
        self.stiffness = float(stiffness)
        self.cutoff = float(cutoff)
        self.min_distance = float(min_distance)
        table = SINGLE_BOND_PM if bond_lengths_pm is None else bond_lengths_pm
        size = max(max(pair) for pair in table) + 1
        self._rest = np.full((size, size), np.nan)
        for (a, b), length in table.items():
            self._rest[a, b] = self._rest[b, a] = length / 100.0

    def compute(self, numbers: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> ForceResult:
        """numbers [B, N] int, positions [B, N, 3] Angstrom, mask [B, N] bool -> ForceResult."""
        numbers = np.asarray(numbers, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.float64)
        mask = np.asarray(mask, dtype=bool)
        batch, nodes = numbers.shape
        diff = positions[:, :, None, :] - positions[:, None, :, :]
        dist = np.sqrt((diff * diff).sum(axis=-1))
        pair_mask = mask[:, :, None] & mask[:, None, :] & ~np.eye(nodes, dtype=bool)[None]
        size = self._rest.shape[0]
        known = (numbers >= 0) & (numbers < size)
        safe = np.where(known, numbers, 0)
        rest = self._rest[safe[:, :, None], safe[:, None, :]]
        rest = np.where(known[:, :, None] & known[:, None, :], rest, np.nan)
        springs = pair_mask & (dist < self.cutoff)
        bad_pair = springs & (np.isnan(rest) | (dist < self.min_distance))
        ok = ~bad_pair.any(axis=(1, 2)) & np.isfinite(positions).all(axis=(1, 2))
        springs &= ok[:, None, None]
        stretch = np.where(springs, dist - np.nan_to_num(rest), 0.0)
        energy = 0.25 * self.stiffness * (stretch ** 2).sum(axis=(1, 2))  # each pair counted twice
        unit = diff / np.where(springs, dist, 1.0)[..., None]
        forces = -(self.stiffness * stretch[..., None] * unit).sum(axis=2)
        forces = np.where(ok[:, None, None] & mask[:, :, None], forces, 0.0)
        energy = np.where(ok, energy, np.nan)
        return ForceResult(energy=energy, forces=forces, ok=ok)

    def close(self) -> None:
        """Nothing to release."""

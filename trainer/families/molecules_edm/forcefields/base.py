"""The batched force-field interface used by guidance and by the evaluation metrics.

A force field takes a padded batch of molecules (atomic numbers, positions in Angstrom, atom mask)
and returns per-molecule energies (eV), per-atom forces (eV/Angstrom) and an ok flag per molecule.
A molecule whose evaluation raises or gives non-finite values is `ok = False` (energy NaN, forces
zero): callers leave it unguided and count it; one unphysical molecule never fails a batch.

A force field that runs on torch (an MLFF: `ani1x`, `uma:`) also offers `compute_tensors`, the same evaluation
on tensors that stay on the sampler's device (`ForceBatch`); `compute_on_device` calls it, or adapts a numpy
force field (tblite, ASE) through `compute`. An ensemble reports its spread beside the energies
(`energy_spread`, eV per atom; `force_spread`, eV/Angstrom, where computed). A force field that models only
some elements names them in `supported_numbers`; a molecule with another element is not ok, and `routing.py`
sends it to a fallback force field.

A force field may also offer `for_guidance(needs_spread=False)`: an evaluator with the same `compute` for the many evaluations
of one guided sampling call (rows are the same molecules at every step), which may trade strictness for speed
and report the `rung` of each result (xTB: an electronic-temperature ladder); `rung_labels` names the rungs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch


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
    energy_spread: np.ndarray | None = None
    """[B] float64, for an ensemble: the standard deviation of its members' energies divided by the molecule's
    atom count (eV/atom; NaN where not ok); None for a single model."""
    force_spread: np.ndarray | None = None
    """[B] float64, for an ensemble where computed: sqrt(mean over atoms and axes of the members' force variance)
    (eV/Angstrom; NaN where not ok)."""

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


@dataclass
class ForceBatch:
    """`ForceResult` on tensors, on the device of the positions that were evaluated."""

    energy: torch.Tensor
    """[B] energies in eV (NaN where not ok)."""
    forces: torch.Tensor
    """[B, N, 3] forces in eV/Angstrom (zero at padding and where not ok)."""
    ok: torch.Tensor
    """[B] bool."""
    energy_spread: torch.Tensor | None = None
    """[B] eV/atom, for an ensemble (see `ForceResult.energy_spread`)."""
    force_spread: torch.Tensor | None = None
    """[B] eV/Angstrom, for an ensemble where computed."""
    rung: torch.Tensor | None = None
    """[B] int64 ladder rung (see `ForceResult.rung`)."""
    source: torch.Tensor | None = None
    """[B] int64, from a routed force field: which force field scored the molecule (index into its `names`),
    -1 where none did."""

    def to_numpy(self) -> ForceResult:
        """The same values as a ForceResult (float64 arrays on the host)."""
        def host(t: torch.Tensor | None, dtype: Any = np.float64) -> np.ndarray | None:
            return None if t is None else t.detach().cpu().numpy().astype(dtype)

        return ForceResult(host(self.energy), host(self.forces), host(self.ok, bool), rung=host(self.rung, np.int64),
                           energy_spread=host(self.energy_spread), force_spread=host(self.force_spread))


def compute_on_device(forcefield: Any, numbers: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> ForceBatch:
    """Evaluate `forcefield` on a padded batch of tensors; the result is on `positions.device`.

    A force field with `compute_tensors` (an MLFF) evaluates the tensors where they are; any other goes
    through its numpy `compute` (one copy to the host and back per call)."""
    import torch

    on_device = getattr(forcefield, "compute_tensors", None)
    if callable(on_device):
        return on_device(numbers, positions, mask)
    result = forcefield.compute(numbers.cpu().numpy(), positions.detach().cpu().double().numpy(),
                                mask.cpu().numpy().astype(bool))
    device, dtype = positions.device, positions.dtype

    def put(array: Any, kind: torch.dtype = dtype) -> torch.Tensor | None:
        return None if array is None else torch.as_tensor(np.asarray(array), device=device).to(kind)

    forces = put(np.nan_to_num(np.asarray(result.forces, dtype=np.float64)))
    return ForceBatch(energy=put(result.energy), forces=forces, ok=put(result.ok, torch.bool),
                      energy_spread=put(getattr(result, "energy_spread", None)),
                      force_spread=put(getattr(result, "force_spread", None)),
                      rung=put(result.rung, torch.int64))


def modelled_atoms(numbers: torch.Tensor, mask: torch.Tensor, supported: Any) -> torch.Tensor:
    """[B, N] bool: True where an atom's element is in `supported` (a set of atomic numbers; None: every
    element) or the slot is padding, so `.all(dim=1)` says which molecules a force field models."""
    import torch

    if supported is None:
        return torch.ones_like(mask, dtype=torch.bool)
    table = torch.zeros(119, dtype=torch.bool, device=numbers.device)
    table[sorted(supported)] = True
    return table[numbers.clamp(0, 118)] | ~mask


def closest_pair_distance(positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] the shortest distance between two real atoms of each molecule (inf with fewer than two; NaN positions
    count as 0). positions [B, N, 3], mask [B, N] bool."""
    import math

    import torch

    width = mask.shape[1]
    pair = mask.unsqueeze(1) & mask.unsqueeze(2) & ~torch.eye(width, dtype=torch.bool, device=mask.device)
    x = torch.nan_to_num(positions)
    return torch.cdist(x, x).masked_fill(~pair, math.inf).amin(dim=(1, 2))


def guidance_evaluator(forcefield: Any, needs_spread: bool = False) -> Any:
    """What evaluates `forcefield` during one guided sampling call: its `for_guidance()` evaluator (xTB's ladder,
    ANI-1x's pushing network; asked for the spread only when gating needs it, so a `for_guidance()` without
    arguments still fits), or the force field itself."""
    make = getattr(forcefield, "for_guidance", None)
    if not callable(make):
        return forcefield
    return make(needs_spread=True) if needs_spread else make()

"""The batched force-field interface used by guidance and by the evaluation metrics.

A force field takes a padded batch of molecules (atomic numbers, positions in Angstrom, atom mask)
and returns per-molecule energies (eV), per-atom forces (eV/Angstrom) and an ok flag per molecule.
A molecule whose evaluation raises or gives non-finite values is `ok = False` (energy NaN, forces
zero): callers leave it unguided and count it; one unphysical molecule never fails a batch.

A force field that runs on torch (an MLFF: `ani1x`, `uma:`) also offers `compute_tensors`, the same evaluation
on tensors that stay on the sampler's device (`ForceBatch`); `compute_on_device` calls it, or adapts a numpy
force field (tblite, ASE) through `compute`. An ensemble reports its spread beside the energies
(`energy_spread`, eV per atom; `force_spread`, eV/Angstrom, where computed). Such an adapter builds its
`compute_tensors` on `DeviceBatch` (device move, empty outputs, row screening with reasons, non-finite results,
the way back) and keeps only its model's work. A force field that models only some elements names them in
`supported_numbers`; a molecule with another element is not ok, and `routing.py` sends it to a fallback force
field; `scoring_forcefield(forcefield, source)` names the force field that scored a molecule, routed or not.

A force field may also offer `for_guidance(needs_spread=False)`: an evaluator with the same `compute` for the many evaluations
of one guided sampling call (rows are the same molecules at every step), which may trade strictness for speed
and report the `rung` of each result (xTB: an electronic-temperature ladder); `rung_labels` names the rungs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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


def scoring_forcefield(forcefield: Any, source: int) -> Any:
    """The force field that scored a molecule whose result carries `source` (`ForceBatch.source`): a routed force
    field's `scorer(source)` (0: its primary, 1: its fallback), any other force field itself (it scores all)."""
    scorer = getattr(forcefield, "scorer", None)
    return scorer(int(source)) if callable(scorer) else forcefield


Reason = str | Callable[[int], str] | None
"""Why a row failed a screening check: a fixed text, a function of the row index, or None (skipped silently)."""


@dataclass
class DeviceBatch:
    """The shared skeleton of a torch force field's `compute_tensors`: the batch moved to the model's device, the
    outputs it fills (float64; NaN energy, zero forces where not ok), the reasons of the rows that failed, and the
    way back to the caller's device and dtype (`result`). An adapter keeps only its model's work: which rows it
    refuses (`screen`) and the values of the rows it evaluates (it sets `ok` for those)."""

    numbers: torch.Tensor
    """[B, N] int64 on the model's device."""
    positions: torch.Tensor
    """[B, N, 3] detached, in the model's dtype, on its device."""
    mask: torch.Tensor
    """[B, N] bool on the model's device."""
    energy: torch.Tensor
    forces: torch.Tensor
    ok: torch.Tensor
    energy_spread: torch.Tensor | None
    force_spread: torch.Tensor | None
    out_device: torch.device
    out_dtype: torch.dtype
    errors: dict[int, str] = field(default_factory=dict)
    """Batch index of each failed molecule -> the reason (an adapter's `last_errors`)."""

    @classmethod
    def prepare(cls, numbers: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, device: Any, dtype: torch.dtype,
                energy_spread: bool = False, force_spread: bool = False) -> DeviceBatch:
        """The batch on `device` (None: the positions' own) with empty outputs; spreads only where asked for."""
        import math

        import torch

        device = positions.device if device is None else torch.device(device)
        batch, width = numbers.shape

        def nans() -> torch.Tensor:
            return torch.full((batch,), math.nan, dtype=torch.float64, device=device)

        return cls(numbers=numbers.to(device=device, dtype=torch.long), mask=mask.to(device=device, dtype=torch.bool),
                   positions=positions.detach().to(device=device, dtype=dtype), energy=nans(),
                   forces=torch.zeros((batch, width, 3), dtype=torch.float64, device=device),
                   ok=torch.zeros(batch, dtype=torch.bool, device=device),
                   energy_spread=nans() if energy_spread else None, force_spread=nans() if force_spread else None,
                   out_device=positions.device, out_dtype=positions.dtype)

    def finite_positions(self) -> torch.Tensor:
        """[B] bool: every real atom's position is finite."""
        import torch

        return (torch.isfinite(self.positions).all(dim=-1) | ~self.mask).all(dim=1)

    def screen(self, checks: Sequence[tuple[torch.Tensor, Reason]]) -> torch.Tensor:
        """The indices of the rows that pass every check ([B] bool, in order); a row that fails is recorded in
        `errors` with the reason of the first check it fails (a None reason leaves it out silently)."""
        import torch

        passed = torch.stack([good for good, _ in checks]).all(dim=0)
        for b in torch.nonzero(~passed).flatten().tolist():
            reason = next(why for good, why in checks if not bool(good[b]))
            if reason is not None:
                self.errors[b] = reason(b) if callable(reason) else reason
        return torch.nonzero(passed).flatten()

    def result(self, non_finite: str) -> ForceBatch:
        """Rows marked ok whose energy or forces are not finite become not ok (reason `non_finite`, values reset);
        the outputs go back to the caller's device and dtype."""
        import math

        import torch

        bad = self.ok & ~(torch.isfinite(self.energy) & torch.isfinite(self.forces).all(dim=(1, 2)))
        if bool(bad.any()):
            for b in torch.nonzero(bad).flatten().tolist():
                self.errors[b] = non_finite
            self.ok &= ~bad
            self.energy[~self.ok] = math.nan
            self.forces[~self.ok] = 0.0
            for spread in (self.energy_spread, self.force_spread):
                if spread is not None:
                    spread[~self.ok] = math.nan

        def back(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=self.out_device, dtype=self.out_dtype)

        return ForceBatch(energy=back(self.energy), forces=back(self.forces), ok=self.ok.to(self.out_device),
                          energy_spread=back(self.energy_spread), force_spread=back(self.force_spread))


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

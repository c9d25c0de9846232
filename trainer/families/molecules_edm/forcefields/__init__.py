"""Batched force fields for guidance and evaluation, built by name: `build_forcefield("gfn2")`.

Specs: `gfn2` / `gfn2-xtb` (the offline default: GFN2-xTB through tblite, a process pool),
`gfn1` / `gfn1-xtb`, `ani1x` (the ANI-1x ensemble, a batched MLFF on the sampler's device; H C N O;
`trainer data fetch ani1x` first), `ase:<dotted.path.Class>` (any ASE calculator; keyword arguments go to the class,
except `cell` and `pbc`, which set a vacuum box), `uma:<model name or checkpoint path>` (fairchem UMA),
`springs` (an analytic test field) and `none` (no force field: `build_forcefield` returns None).

Heavy backends (tblite, fairchem, the ASE calculator's package) are imported only when their spec is
built, so importing this package costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from trainer.errors import ConfigError, DataError
from trainer.families.molecules_edm.forcefields.base import (
    ForceBatch,
    ForceField,
    ForceResult,
    compute_on_device,
    scoring_forcefield,
)
from trainer.families.molecules_edm.molecule import Molecule

__all__ = ["FORCEFIELD_CHOICES", "ForceBatch", "ForceField", "ForceResult", "build_forcefield", "compute_on_device",
           "pad_molecules", "scoring_forcefield", "validate_batch"]

FORCEFIELD_CHOICES: tuple[str, ...] = ("gfn2", "gfn2-xtb", "gfn1", "gfn1-xtb", "ani1x", "ase:<dotted.path.Class>",
                                       "uma:<model name or checkpoint path>", "springs", "none")
"""The spec forms `build_forcefield` accepts (GFN2-xTB is the default)."""


def build_forcefield(spec: str = "gfn2", **kwargs: Any) -> ForceField | None:
    """The force field named by `spec` (see the module docstring), or None for `none`.

    `kwargs` go to the adapter: `XTBForceField(workers=, accuracy=, max_iterations=)` for the xTB specs,
    `ANIForceField(model_index=, device=, cache=)` for `ani1x`,
    the calculator class (plus the adapter's `cell`, `pbc`) for `ase:`, `UMAForceField(device=, ...)`
    for `uma:`, `SpringForceField(...)` for `springs`.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"force field spec must be a non-empty string, got {spec!r}; choices: {', '.join(FORCEFIELD_CHOICES)}")
    text = spec.strip()
    key = text.lower()
    if key in ("gfn2", "gfn2-xtb", "gfn1", "gfn1-xtb"):
        from trainer.families.molecules_edm.forcefields.xtb import XTBForceField

        return XTBForceField(method=key.removesuffix("-xtb"), **kwargs)
    if key == "ani1x":
        from trainer.families.molecules_edm.forcefields.ani import ANIForceField

        return ANIForceField(**kwargs)
    if key.startswith("ase:"):
        from trainer.families.molecules_edm.forcefields.ase_calculator import ASECalculatorForceField

        cell = kwargs.pop("cell", None)
        pbc = kwargs.pop("pbc", None)
        return ASECalculatorForceField(text[4:].strip(), kwargs, cell=cell, pbc=pbc)
    if key.startswith("uma:"):
        from trainer.families.molecules_edm.forcefields.uma import UMAForceField

        return UMAForceField(text[4:].strip(), **kwargs)
    if key == "springs":
        from trainer.families.molecules_edm.forcefields.springs import SpringForceField

        return SpringForceField(**kwargs)
    if key == "none":
        if kwargs:
            raise ConfigError(f"force field 'none' takes no options, got {sorted(kwargs)}")
        return None
    raise ConfigError(f"unknown force field {spec!r}; choices: {', '.join(FORCEFIELD_CHOICES)}")


def pad_molecules(molecules: Sequence[Molecule], num_atoms: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A padded batch from Molecules: numbers [B, N] int64 (0 at padding), positions [B, N, 3] float64
    (0 at padding), mask [B, N] bool; N = the largest molecule, or `num_atoms` when given."""
    sizes = [m.num_atoms for m in molecules]
    width = max(sizes, default=0) if num_atoms is None else int(num_atoms)
    if sizes and max(sizes) > width:
        index = int(np.argmax(sizes))
        raise DataError(f"molecule {index} has {sizes[index]} atoms, more than the padded size num_atoms={width}")
    numbers = np.zeros((len(molecules), width), dtype=np.int64)
    positions = np.zeros((len(molecules), width, 3), dtype=np.float64)
    mask = np.zeros((len(molecules), width), dtype=bool)
    for row, molecule in enumerate(molecules):
        n = molecule.num_atoms
        numbers[row, :n] = molecule.numbers
        positions[row, :n] = molecule.positions
        mask[row, :n] = True
    return numbers, positions, mask


def validate_batch(numbers: Any, positions: Any, mask: Any, *, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(numbers int64 [B, N], positions float64 [B, N, 3], mask bool [B, N])` as arrays, after shape checks.

    A shape mismatch is a caller's bug in how the batch was built: DataError naming the force field and
    the array. Values (coincident atoms, NaN positions, unknown elements) are not checked here: those
    make the molecule's result `ok = False`, never an error.
    """
    numbers = np.asarray(numbers)
    positions = np.asarray(positions, dtype=np.float64)
    mask = np.asarray(mask)
    if numbers.ndim != 2:
        raise DataError(f"{name}: atomic numbers must be [batch, atoms], got shape {numbers.shape}")
    if positions.shape != (*numbers.shape, 3):
        raise DataError(f"{name}: positions must be [batch, atoms, 3] = {(*numbers.shape, 3)}, got shape {positions.shape}")
    if mask.shape != numbers.shape:
        raise DataError(f"{name}: mask must be [batch, atoms] = {numbers.shape}, got shape {mask.shape}")
    if numbers.size and not np.issubdtype(numbers.dtype, np.integer):
        if not np.all(np.isfinite(numbers)) or not np.all(numbers == np.round(numbers)):
            raise DataError(f"{name}: atomic numbers must be integers, got dtype {numbers.dtype} with non-integer values")
    return numbers.astype(np.int64, copy=False), positions, mask.astype(bool, copy=False)

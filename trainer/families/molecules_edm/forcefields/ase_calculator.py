"""Any ASE calculator as a batched force field: `ase:sevenn.calculator.SevenNetCalculator` with `{"model": "7net-0"}`.

The calculator (a class, or any factory returning a calculator, such as `mace.calculators.mace_off` or
`fairchem.core.FAIRChemCalculator.from_model_checkpoint`) is found by its dotted import path with
`importlib` (never `eval`) and built once with the given keyword arguments. Molecules are evaluated one
by one as non-periodic `ase.Atoms` (or centred in a vacuum box for calculators that need a cell, such
as CHGNet), each with `info = {"charge": 0, "spin": 1}` (neutral singlet; read by calculators that take
a charge and spin multiplicity, e.g. fairchem's on the `omol` task, ignored by the others). ASE
calculators cache results for unchanged atoms, so the calculator is reset before every molecule.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainer.errors import ConfigError
from trainer.families.molecules_edm.forcefields import validate_batch
from trainer.families.molecules_edm.forcefields.base import ForceResult

logger = logging.getLogger(__name__)

PIP_PACKAGES: dict[str, str] = {"sevenn": "sevenn", "chgnet": "chgnet", "mace": "mace-torch", "fairchem": "fairchem-core",
                                "tblite": "tblite", "torchani": "torchani", "orb_models": "orb-models",
                                "mattersim": "mattersim", "matgl": "matgl", "xtb": "xtb-python", "ase": "ase"}
"""Top-level module -> the pip package that provides it, for the error message when it is missing."""


def _pip_name(module: str) -> str:
    top = module.split(".")[0]
    return PIP_PACKAGES.get(top, top.replace("_", "-"))


def import_object(path: str) -> Any:
    """The object at a dotted path (`package.module.Attribute[.attribute]`), imported with importlib.

    The longest importable module prefix is imported and the rest is looked up as attributes. A missing
    package (or a missing dependency of it) is a ConfigError naming the pip package to install.
    """
    parts = path.split(".")
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise ConfigError(f"ASE calculator path {path!r} is not a dotted import path like "
                          "'sevenn.calculator.SevenNetCalculator'")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            missing = error.name or ""
            if missing and not module_name.startswith(missing) and missing != module_name:
                # the module exists but one of its own imports does not
                raise ConfigError(f"importing {module_name!r} for the ASE calculator {path!r} failed: no module "
                                  f"{missing!r} (pip install {_pip_name(missing)})") from error
            if cut == 1:
                raise ConfigError(f"the ASE calculator {path!r} needs the package {parts[0]!r}: "
                                  f"pip install {_pip_name(parts[0])}") from error
            continue
        try:
            for attribute in parts[cut:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            continue  # maybe a deeper submodule that the package does not import itself
        return obj
    raise ConfigError(f"no calculator at {path!r}: module {parts[0]!r} has no attribute path {'.'.join(parts[1:])!r}")


def _box(cell: float | Sequence[float] | None) -> np.ndarray | None:
    """A cubic (one edge) or orthorhombic (three edges) box in Angstrom, or None."""
    if cell is None:
        return None
    edges = np.atleast_1d(np.asarray(cell, dtype=np.float64))
    if edges.shape not in ((1,), (3,)) or not np.all(np.isfinite(edges)) or np.any(edges <= 0):
        raise ConfigError(f"ASE force field cell must be one box edge or three edges in Angstrom (> 0), got {cell!r}")
    return np.broadcast_to(edges, (3,)).copy()


class ASECalculatorForceField:
    """An ASE calculator evaluated molecule by molecule on padded batches.

    Args:
        calculator: dotted import path of the calculator class or factory
            (`sevenn.calculator.SevenNetCalculator`, `ase.calculators.emt.EMT`, ...), or a calculator
            instance (built by the caller).
        calculator_kwargs: keyword arguments for the class/factory (`{"model": "7net-0", "device": "cpu"}`).
        cell: None for a non-periodic molecule (default); a box edge (or three edges) in Angstrom puts
            each molecule at the centre of that box, for calculators that need a cell (use 20+ Angstrom
            of box for QM9-sized molecules so that periodic images do not interact).
        pbc: periodic boundary flags when `cell` is given (default True); ignored without a cell.
        name: name in logs and metric tables (default `ase:<class name>`).

    After each `compute`, `last_errors` maps the batch index of every failed molecule to the reason.
    """

    def __init__(self, calculator: str | Any, calculator_kwargs: Mapping[str, Any] | None = None, *,
                 cell: float | Sequence[float] | None = None, pbc: bool | None = None, name: str | None = None) -> None:
        kwargs = dict(calculator_kwargs or {})
        if isinstance(calculator, str):
            factory = import_object(calculator)
            if not callable(factory):
                raise ConfigError(f"the ASE calculator path {calculator!r} names a {type(factory).__name__}, "
                                  "not a class or factory")
            try:
                self.calculator = factory(**kwargs)
            except TypeError as error:
                raise ConfigError(f"cannot build the ASE calculator {calculator!r} with {kwargs}: {error}") from error
            label = calculator.rsplit(".", 1)[-1]
        else:
            if kwargs:
                raise ConfigError("calculator_kwargs are for building a calculator from its import path, "
                                  "not for an instance")
            self.calculator = calculator
            label = type(calculator).__name__
        if not (hasattr(self.calculator, "get_potential_energy") and hasattr(self.calculator, "get_forces")):
            raise ConfigError(f"{label} is not an ASE calculator (it has no get_potential_energy/get_forces)")
        self.cell = _box(cell)
        self.pbc = bool(True if pbc is None else pbc) if self.cell is not None else False
        self.name = name or f"ase:{label}"
        self.last_errors: dict[int, str] = {}

    def __repr__(self) -> str:
        return f"ASECalculatorForceField({self.name!r}, cell={self.cell}, pbc={self.pbc})"

    def atoms(self, numbers: np.ndarray, positions: np.ndarray) -> Any:
        """The `ase.Atoms` one molecule is evaluated as (centred in the box when a cell is set)."""
        from ase import Atoms

        atoms = Atoms(numbers=numbers, positions=positions, info={"charge": 0, "spin": 1})
        if self.cell is not None:
            atoms.set_cell(np.diag(self.cell))
            atoms.set_pbc(self.pbc)
            atoms.center()  # forces and energy do not depend on the translation
        return atoms

    def compute(self, numbers: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> ForceResult:
        """numbers [B, N] int, positions [B, N, 3] Angstrom, mask [B, N] bool -> ForceResult (eV, eV/Angstrom)."""
        numbers, positions, mask = validate_batch(numbers, positions, mask, name=self.name)
        batch, width = numbers.shape
        out = ForceResult.empty(batch, width)
        self.last_errors = {}
        for b in range(batch):
            z, x = numbers[b, mask[b]], positions[b, mask[b]]
            if len(z) == 0:
                self.last_errors[b] = "no atoms"
                continue
            if not np.all(np.isfinite(x)):
                self.last_errors[b] = "non-finite positions"
                continue
            try:
                atoms = self.atoms(z, x)
                if hasattr(self.calculator, "reset"):
                    self.calculator.reset()
                atoms.calc = self.calculator
                energy = float(atoms.get_potential_energy())
                forces = np.asarray(atoms.get_forces(), dtype=np.float64)
            except Exception as error:  # one unphysical molecule never fails the batch
                self.last_errors[b] = f"{type(error).__name__}: {error}"
                continue
            if forces.shape != x.shape:
                self.last_errors[b] = f"the calculator returned forces of shape {forces.shape} for {len(z)} atoms"
            elif not (math.isfinite(energy) and np.all(np.isfinite(forces))):
                self.last_errors[b] = "non-finite energy or forces"
            else:
                out.record(b, mask[b], energy, forces)
        if self.last_errors:
            logger.debug("%s failed on %d of %d molecules: %s", self.name, len(self.last_errors), batch, self.last_errors)
        return out

    def close(self) -> None:
        """Nothing to release beyond the calculator itself (kept: it is loaded once per process)."""

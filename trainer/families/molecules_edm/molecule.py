"""The one in-memory molecule record shared by readers, metrics, force fields and writers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainer.families.molecules_edm.spec import QM9_ELEMENTS  # noqa: F401  (one definition, in the light spec)


@dataclass
class Molecule:
    """One molecule: atomic numbers, Cartesian positions in Angstrom and free per-molecule info.

    `info` holds an id (`id`) and any per-molecule properties (QM9: `U0_Ha`, `gap_Ha`, `smiles`, ...)
    or per-molecule metrics written next to the geometry (extxyz `info`).
    """

    numbers: np.ndarray
    """[n] int64 atomic numbers."""
    positions: np.ndarray
    """[n, 3] float64 positions in Angstrom."""
    info: dict[str, Any] = field(default_factory=dict)
    """Per-molecule id, properties and metrics."""

    def __post_init__(self) -> None:
        self.numbers = np.asarray(self.numbers, dtype=np.int64).reshape(-1)
        self.positions = np.asarray(self.positions, dtype=np.float64).reshape(-1, 3)
        if len(self.numbers) != len(self.positions):
            raise ValueError(f"{len(self.numbers)} atomic numbers but {len(self.positions)} positions")

    @property
    def num_atoms(self) -> int:
        return int(len(self.numbers))

"""Molecules: `molecules_edm`, E(3)-equivariant diffusion (EDM) with force-field-guided sampling and EDM"s metrics.

`spec.py` (options, presets, metadata; no torch) registers the task; `task.py` holds `MoleculesEDMTask`, imported
when a run needs it (importing this package imports no torch)."""

from trainer.families.molecules_edm.spec import MoleculeSampleConfig, MoleculesEDMConfig

__all__ = ["MoleculeSampleConfig", "MoleculesEDMConfig"]

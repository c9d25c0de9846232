"""Molecules: `molecules_edm`, E(3)-equivariant diffusion (EDM) with force-field-guided sampling and EDM's metrics."""

from trainer.families.molecules_edm.task import MoleculeSampleConfig, MoleculesEDMConfig, MoleculesEDMTask

__all__ = ["MoleculeSampleConfig", "MoleculesEDMConfig", "MoleculesEDMTask"]

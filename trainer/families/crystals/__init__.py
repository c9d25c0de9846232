"""Crystals: `crystal_property` with ComFormer on periodic graphs, readers, and `train_from_list`."""

from trainer.families.crystals.task import CrystalPropertyConfig, CrystalPropertyTask

__all__ = ["CrystalPropertyConfig", "CrystalPropertyTask"]

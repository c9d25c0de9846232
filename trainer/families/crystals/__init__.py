"""Crystals: `crystal_property` with ComFormer on periodic graphs, readers, and `train_from_list`.

`spec.py` (options, presets, metadata; no torch) registers the task; `task.py` holds `CrystalPropertyTask`, imported
when a run needs it (importing this package imports no torch)."""

from trainer.families.crystals.spec import CrystalPropertyConfig

__all__ = ["CrystalPropertyConfig"]

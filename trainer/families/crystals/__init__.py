"""Crystals: `crystal_property` with ComFormer on periodic graphs, and the readers.

`spec.py` (options, presets, metadata; no torch) registers the task; `task.py` holds `CrystalPropertyTask`, imported
when a run needs it (importing this package imports no torch). ComFormer's Python API (`train_from_list`) is the
front end `trainer.frontends.crystals`, above the core."""

from trainer.families.crystals.spec import CrystalPropertyConfig

__all__ = ["CrystalPropertyConfig"]

"""`regression`: a synthetic problem for testing the trainer core (and the worked example of a family).

`spec.py` (options, presets, metadata; no torch) registers the task; `task.py` holds `RegressionTask`, imported
when a run needs it (importing this package imports no torch)."""

from trainer.families.regression.spec import RegressionConfig

__all__ = ["RegressionConfig"]

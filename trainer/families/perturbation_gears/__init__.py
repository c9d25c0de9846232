"""Gene perturbation: GEARS on AnnData (`perturbation_gears` task), its graphs, splits and baselines.

`spec.py` (options, presets, metadata; no torch) registers the task; `task.py` holds `PerturbationGearsTask`,
imported when a run needs it. The seed's Python API (`train_multi_gpu`, `predict`, `plot_condition`) is the
front end `trainer.frontends.perturbation`, above the core."""

from trainer.families.perturbation_gears.spec import PerturbationGearsConfig

__all__ = ["PerturbationGearsConfig"]

"""Gene perturbation: GEARS on AnnData (`perturbation_gears` task), its graphs, splits, baselines and the
seed's Python API (`train_multi_gpu`, `predict`, `plot_condition`).

`spec.py` (options, presets, metadata; no torch) registers the task; `task.py` holds `PerturbationGearsTask`,
imported when a run needs it, and `api.py` the Python API, imported on first use."""

from trainer.families.perturbation_gears.spec import PerturbationGearsConfig

__all__ = ["PerturbationGearsConfig", "plot_condition", "predict", "train_multi_gpu"]


def __getattr__(name: str):  # the API (torch) is imported on first use
    if name in ("plot_condition", "predict", "train_multi_gpu"):
        from trainer.families.perturbation_gears import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

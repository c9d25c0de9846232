"""Gene perturbation: GEARS on AnnData (`perturbation_gears` task), its graphs, splits, baselines and the
seed's Python API (`train_multi_gpu`, `predict`, `plot_condition`)."""

from trainer.families.perturbation_gears.api import plot_condition, predict, train_multi_gpu
from trainer.families.perturbation_gears.task import PerturbationGearsConfig, PerturbationGearsTask

__all__ = ["PerturbationGearsConfig", "PerturbationGearsTask", "plot_condition", "predict", "train_multi_gpu"]

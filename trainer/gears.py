"""The GEARS family's Python API under a short name: `from trainer.gears import train_multi_gpu, predict`.

The code lives in `trainer.families.perturbation_gears.api`.
"""

from trainer.families.perturbation_gears.api import plot_condition, predict, train_multi_gpu

__all__ = ["plot_condition", "predict", "train_multi_gpu"]

"""`regression`: a synthetic problem for testing the trainer core (and the worked example of a family)."""

from trainer.families.regression.task import RegressionConfig, RegressionTask

__all__ = ["RegressionConfig", "RegressionTask"]

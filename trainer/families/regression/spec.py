"""`regression` as the registry knows it without importing torch: options, presets, unit, metrics.

The Task class (`task.py`) is imported only when a run needs it (`trainer.registry.get_task`).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.registry import register_spec
from trainer.task import TaskConfig, TaskSpec


@dataclass
class RegressionConfig(TaskConfig):
    name: str = "regression"
    """Registered task name."""
    num_train: int = 512
    """Training samples."""
    num_eval: int = 100
    """Eval samples (deliberately not a multiple of common batch sizes)."""
    num_test: int = 0
    """Test samples, evaluated once at the end of a run (0: no test split)."""
    in_dim: int = 16
    """Input features."""
    out_dim: int = 4
    """Targets per sample."""
    hidden: int = 64
    """Hidden width of the MLP."""
    depth: int = 2
    """Hidden layers."""
    dropout: float = 0.0
    """Dropout after each hidden layer (draws from the rank's RNG: exercises RNG restore on resume)."""
    noise: float = 0.1
    """Standard deviation of the target noise."""
    data_seed: int = 1234
    """Seed of the synthetic data (independent of run.seed)."""
    delay_s: float = 0.0
    """Artificial delay per training micro-batch (seconds), so kill/preemption tests can hit a step."""
    nan_sample: int = -1
    """Training sample whose batch gets a NaN loss (tests the non-finite guard); -1 for none."""
    streaming: bool = False
    """Serve the training set as a stream (a `GlobalStream`: the core shards it by global sample index)."""


SPEC = register_spec(TaskSpec(
    name="regression",
    task="trainer.families.regression.task:RegressionTask",
    config_cls=RegressionConfig,
    presets={
        "tiny": {"task": {"num_train": 256, "num_eval": 50, "hidden": 32},
                 "train": {"max_steps": 20, "per_device_batch_size": 8}},
    },
    unit="samples",
    metrics=("loss", "mae", "num_samples", "num_unique"),
))

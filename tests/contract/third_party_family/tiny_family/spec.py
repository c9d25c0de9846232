"""The light spec of `tiny_mean`: its options, presets and metadata (imports no torch)."""

from dataclasses import dataclass

from trainer import TaskConfig, TaskSpec, register_spec


@dataclass
class TinyMeanConfig(TaskConfig):
    name: str = "tiny_mean"
    """Registered task name."""
    num_train: int = 64
    """Training vectors."""

    def validate(self) -> None:
        if self.num_train < 1:
            raise ValueError(f"task.num_train must be >= 1, got {self.num_train}")


SPEC = register_spec(TaskSpec(
    name="tiny_mean",
    task="tiny_family.task:TinyMeanTask",
    config_cls=TinyMeanConfig,
    presets={"tiny": {"train": {"max_steps": 4, "per_device_batch_size": 8}}},
))

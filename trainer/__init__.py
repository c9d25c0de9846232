"""trainer: one Accelerate Trainer for scientific ML (DDP / DeepSpeed ZeRO by config file)."""

__version__ = "0.1.0"

from trainer.config import Config, load_config  # noqa: E402
from trainer.errors import CheckpointError, ConfigError, DataError  # noqa: E402
from trainer.registry import available_tasks, get_task, register_task  # noqa: E402
from trainer.task import LossOutput, SampleConfig, Task, TaskConfig, TaskData  # noqa: E402

__all__ = ["CheckpointError", "Config", "ConfigError", "DataError", "LossOutput", "SampleConfig", "Task", "TaskConfig",
           "TaskData", "available_tasks", "get_task", "load_config", "register_task"]

"""trainer: one Accelerate Trainer for scientific ML (DDP / DeepSpeed ZeRO by config file)."""

__version__ = "0.1.0"

from trainer.config import Config, load_config  # noqa: E402
from trainer.errors import CheckpointError, ConfigError, DataError  # noqa: E402
from trainer.registry import available_tasks, get_spec, get_task, register_spec, register_task  # noqa: E402
from trainer.task import LossOutput, SampleConfig, Task, TaskConfig, TaskData, TaskSpec  # noqa: E402

__all__ = ["CheckpointError", "Config", "ConfigError", "DataError", "LossOutput", "SampleConfig", "Task", "TaskConfig",
           "TaskData", "TaskSpec", "available_tasks", "get_spec", "get_task", "load_config", "register_spec",
           "register_task"]

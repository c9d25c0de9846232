"""trainer: one Accelerate Trainer for scientific ML (DDP / DeepSpeed ZeRO by config file)."""

__version__ = "0.1.0"

from trainer.config import Config, ConfigError, load_config  # noqa: E402
from trainer.tasks import LossOutput, Task, get_task, register_task  # noqa: E402

__all__ = ["Config", "ConfigError", "LossOutput", "Task", "get_task", "load_config", "register_task"]

"""Task registry: tasks are looked up by name; a miss lists the registered names."""

from __future__ import annotations

import difflib

from trainer.config import ConfigError
from trainer.tasks.base import LossOutput, Task

_REGISTRY: dict[str, type[Task]] = {}


def register_task(name: str):
    """Class decorator registering a Task subclass under `name`."""

    def wrap(cls: type[Task]) -> type[Task]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"task '{name}' is already registered by {_REGISTRY[name].__module__}")
        if "tiny" not in cls.presets:
            raise ValueError(f"task '{name}' must define a 'tiny' preset")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_tasks() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str) -> type[Task]:
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown task '{name}'; available tasks: {', '.join(available_tasks())}.{hint}")
    return _REGISTRY[name]


# Built-in tasks register themselves on import.
from trainer.tasks import crystal_property, protein_sedd, regression  # noqa: E402,F401

__all__ = ["LossOutput", "Task", "available_tasks", "get_task", "register_task"]

"""Task registry: tasks are looked up by name; a miss lists the available names.

Families register their tasks with `@register_task(name)` when their package is imported. The
registry imports a family only when one of its task names is asked for, found through the entry-point
group `trainer.tasks` (`task name = package`; ours are declared in setup.cfg, and a third-party
package adds a family the same way, with no edit here). Without package metadata (a source tree on
`sys.path`) the packages under `trainer/families/` are imported as a fallback.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING

from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.task import Task

ENTRY_POINT_GROUP = "trainer.tasks"

_REGISTRY: dict[str, type[Task]] = {}


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator registering a Task subclass under `name` (it must define a `tiny` preset)."""

    def wrap(cls: type[Task]) -> type[Task]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"task '{name}' is already registered by {_REGISTRY[name].__module__}")
        if "tiny" not in cls.presets:
            raise ValueError(f"task '{name}' must define a 'tiny' preset")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


_UNAVAILABLE: dict[str, str] = {}
"""Families that could not be imported (a missing optional dependency): module -> reason."""


def _import_family(module: str, strict: bool) -> None:
    """Import a family package; a missing dependency is an error naming the pip extra (strict) or is
    remembered and reported by `available_tasks` (not strict)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name == module or err.name.startswith(("trainer.", module + ".")):
            if err.name == module and not strict:
                _UNAVAILABLE[module] = f"no module {module}"
                return
            raise  # a bug in our code, not a missing optional dependency
        extra = module.rsplit(".", 1)[-1]
        reason = (f"family {module} needs a package that is not installed ({err}); install its extra, "
                  f"e.g. pip install 'sciml-trainer[{extra}]'")
        if strict:
            raise ConfigError(reason) from err
        _UNAVAILABLE[module] = reason


def _builtin_families() -> list[str]:
    import trainer.families as families

    return [info.name for info in pkgutil.iter_modules(families.__path__, families.__name__ + ".") if info.ispkg]


def _load(name: str) -> None:
    """Import whatever registers `name`: its entry point, else every built-in family."""
    ep = _entry_points().get(name)
    if ep is not None:
        _import_family(ep.module, strict=True)
    if name not in _REGISTRY:
        for module in _builtin_families():
            _import_family(module, strict=False)


def available_tasks() -> list[str]:
    """Every task name this installation can use (imports the families to read their specs); families
    whose dependencies are missing are listed by `unavailable_families`."""
    for ep in _entry_points().values():
        _import_family(ep.module, strict=False)
    for module in _builtin_families():
        _import_family(module, strict=False)
    return sorted(_REGISTRY)


def unavailable_families() -> dict[str, str]:
    """{family module: why it could not be imported} after `available_tasks`."""
    return dict(_UNAVAILABLE)


def get_task(name: str) -> type[Task]:
    """The Task class registered as `name`; a miss is a ConfigError listing the available names."""
    if name not in _REGISTRY:
        _load(name)
    if name not in _REGISTRY:
        names = available_tasks()
        if _UNAVAILABLE:  # the task may live in a family whose dependencies are missing: say so
            missing = "; ".join(_UNAVAILABLE.values())
            raise ConfigError(f"unknown task '{name}'; available tasks: {', '.join(names)}. Not importable: {missing}")
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown task '{name}'; available tasks: {', '.join(names)}.{hint}")
    return _REGISTRY[name]

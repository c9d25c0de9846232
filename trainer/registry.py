"""Task registry: tasks are looked up by name; a miss lists the available names.

The registry holds two things per task name: its `TaskSpec` (options dataclass, presets, unit, metrics,
sampling options: what `trainer tasks`, `trainer config-help` and the config loader need) and, once a run
needs it, the `Task` class. A family registers its spec from a light module that imports neither torch
nor its model code (`SPEC = register_spec(TaskSpec(...))` in `trainer/families/<family>/spec.py`), and
`get_task` imports the Task class the spec names only when asked; so listing tasks, printing config help
and reporting a config error import no torch.

The registry finds a name through the entry-point group `trainer.tasks` (`task name = module`, the module
that registers it, or `module:SPEC`; ours are declared in setup.cfg, and a third-party package adds a family
the same way, with no edit here). An entry point may also name a module that registers its Task class with
`@register_task("name")` at import (the older way: it works, but imports the family's dependencies
whenever the name is looked up). Without package metadata (a source tree on `sys.path`) the built-in
families' `spec` modules (or, lacking one, their packages) are imported as a fallback.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import pkgutil
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from trainer.errors import ConfigError
from trainer.task import TaskSpec

if TYPE_CHECKING:
    from trainer.task import Task

ENTRY_POINT_GROUP = "trainer.tasks"

_SPECS: dict[str, TaskSpec] = {}
"""Every known task: name -> spec (light)."""
_TASKS: dict[str, type[Task]] = {}
"""Task classes imported so far: name -> class."""
_UNAVAILABLE: dict[str, str] = {}
"""Families that could not be imported (a missing optional dependency): module -> reason."""


def register_spec(spec: TaskSpec) -> TaskSpec:
    """Register a task's light spec under `spec.name` (it must define a `tiny` preset); returns the spec."""
    old = _SPECS.get(spec.name)
    if old is not None and old is not spec and old.task_path != spec.task_path:
        raise ValueError(f"task '{spec.name}' is already registered by {old.task_path}")
    if "tiny" not in spec.presets:
        raise ValueError(f"task '{spec.name}' must define a 'tiny' preset")
    _SPECS[spec.name] = spec
    return spec


def _spec_of_class(name: str, cls: type[Task]) -> TaskSpec:
    """The spec of a task registered by name: read from its class attributes."""
    from trainer.task import GenerativeTask

    return TaskSpec(name=name, task=cls, config_cls=cls.config_cls, presets=cls.presets, unit=cls.unit,
                    metrics=tuple(cls.metrics), baselines=dict(cls.baselines),
                    sample_config_cls=cls.sample_config_cls if issubclass(cls, GenerativeTask) else None)


def _bind(spec: TaskSpec, cls: type[Task]) -> None:
    """Give the Task class the spec's name, options, presets, unit, metrics and sampling options."""
    from trainer.task import GenerativeTask

    if spec.task_path != f"{cls.__module__}:{cls.__qualname__}":
        raise ValueError(f"task '{spec.name}': its spec names {spec.task_path}, not {cls.__module__}:{cls.__qualname__}")
    if issubclass(cls, GenerativeTask) and not spec.generates:
        raise ValueError(f"task '{spec.name}': {cls.__qualname__} generates samples but its spec has no sample_config_cls")
    if spec.generates and not issubclass(cls, GenerativeTask):
        raise ValueError(f"task '{spec.name}': its spec has a sample_config_cls but {cls.__qualname__} is not a "
                         f"GenerativeTask (generate, write_samples, score_samples)")
    cls.name = spec.name
    cls.config_cls = spec.config_cls
    cls.presets = dict(spec.presets)
    cls.unit = spec.unit
    cls.metrics = tuple(spec.metrics)
    cls.baselines = dict(spec.baselines)
    if spec.sample_config_cls is not None:
        cls.sample_config_cls = spec.sample_config_cls


def register_task(spec: TaskSpec | str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator registering a Task subclass.

    `@register_task(SPEC)`: the class implements the light `TaskSpec` SPEC, whose `task` names it; the
    class gets its attributes from the spec. `@register_task("name")` (the older way): the class sets
    `config_cls`, `presets` (with a `tiny` one), `unit`, `metrics` itself and is its own spec, so looking
    the name up imports the class's module.
    """

    def wrap(cls: type[Task]) -> type[Task]:
        name = spec.name if isinstance(spec, TaskSpec) else spec
        known = spec if isinstance(spec, TaskSpec) else _SPECS.get(name)
        if known is not None and isinstance(known.task, str) and known.task_path == f"{cls.__module__}:{cls.__qualname__}":
            register_spec(known)
            _bind(known, cls)  # the class of a light spec (also when decorated by name)
        elif isinstance(spec, TaskSpec):
            _bind(spec, cls)  # raises: the spec names another class
        else:
            if name in _TASKS and _TASKS[name] is not cls:
                raise ValueError(f"task '{name}' is already registered by {_TASKS[name].__module__}")
            register_spec(_spec_of_class(name, cls))
            cls.name = name
        _TASKS[name] = cls
        return cls

    return wrap


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _extra_of(module: str) -> str:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["trainer", "families"] and len(parts) > 2 else parts[-1]


def _import_family(module: str, strict: bool, extra: str = "") -> None:
    """Import a family module; a missing dependency is an error naming the pip extra (strict) or is
    remembered and reported by `unavailable_families` (not strict)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name == module or err.name.startswith(("trainer.", module + ".")):
            if err.name == module and not strict:
                _UNAVAILABLE[module] = f"no module {module}"
                return
            raise  # a bug in our code, not a missing optional dependency
        extra = extra or _extra_of(module)
        reason = (f"family {module} needs a package that is not installed ({err}); install its extra, "
                  f"e.g. pip install 'sciml-trainer[{extra}]'")
        if strict:
            raise ConfigError(reason) from err
        _UNAVAILABLE[module] = reason


def _load_entry_point(ep: importlib.metadata.EntryPoint, strict: bool) -> None:
    """Import what an entry point names: a module that registers a spec or a Task class, or an object
    (`module:SPEC`, a TaskSpec; or a Task class) registered under the entry point's name."""
    _import_family(ep.module, strict)
    if ep.attr and ep.module in sys.modules:
        obj = ep.load()
        if isinstance(obj, TaskSpec):
            register_spec(obj)
        elif isinstance(obj, type) and ep.name not in _SPECS:
            register_task(ep.name)(obj)


def _builtin_families() -> list[str]:
    """The modules that register the built-in families: each package's `spec` module, else the package."""
    import trainer.families as families

    modules = []
    for info in pkgutil.iter_modules(families.__path__, families.__name__ + "."):
        if info.ispkg:
            spec_module = f"{info.name}.spec"
            modules.append(spec_module if importlib.util.find_spec(spec_module) is not None else info.name)
    return modules


def _load(name: str) -> None:
    """Import whatever registers `name`: its entry point, else every built-in family."""
    ep = _entry_points().get(name)
    if ep is not None:
        _load_entry_point(ep, strict=True)
    if name not in _SPECS:
        for module in _builtin_families():
            _import_family(module, strict=False)


def available_tasks() -> list[str]:
    """Every task name this installation knows (imports the families' light specs; a family registered
    the older way is imported whole); modules that failed to import are listed by `unavailable_families`."""
    for ep in _entry_points().values():
        _load_entry_point(ep, strict=False)
    for module in _builtin_families():
        _import_family(module, strict=False)
    return sorted(_SPECS)


def unavailable_families() -> dict[str, str]:
    """{family module: why it could not be imported} after `available_tasks`."""
    return dict(_UNAVAILABLE)


def missing_requirements(spec: TaskSpec) -> list[str]:
    """The modules of `spec.requires` that are not installed (found without importing them)."""
    return [m for m in spec.requires if importlib.util.find_spec(m) is None]


def get_spec(name: str) -> TaskSpec:
    """The spec registered as `name` (imports no torch for a family with a light spec); a miss is a
    ConfigError listing the available names."""
    if name not in _SPECS:
        _load(name)
    if name not in _SPECS:
        names = available_tasks()
        if _UNAVAILABLE:  # the task may live in a family whose dependencies are missing: say so
            missing = "; ".join(_UNAVAILABLE.values())
            raise ConfigError(f"unknown task '{name}'; available tasks: {', '.join(names)}. Not importable: {missing}")
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown task '{name}'; available tasks: {', '.join(names)}.{hint}")
    return _SPECS[name]


def get_family(name: str) -> ModuleType:
    """The package of the family that defines task `name`, its modules loaded with the task (`get_task`): what a
    front end (trainer/frontends/) calls the family's own functions through, found by task name like the task."""
    module = get_task(name).__module__
    package = module.rpartition(".")[0]
    return sys.modules[package or module]  # a family that is one module: that module


def get_task(name: str) -> type[Task]:
    """The Task class registered as `name`, imported on first use (a missing dependency is a ConfigError
    naming the pip extra); a miss is a ConfigError listing the available names."""
    if name in _TASKS:
        return _TASKS[name]
    spec = get_spec(name)
    if not isinstance(spec.task, str):
        return register_task(name)(spec.task)
    module, _, attr = spec.task.partition(":")
    _import_family(module, strict=True, extra=spec.extra)
    if name not in _TASKS:  # the module did not decorate the class: bind it here
        register_task(spec)(getattr(sys.modules[module], attr))
    return _TASKS[name]

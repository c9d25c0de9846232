"""Checkpoint layouts of the reference implementations, by name: what `trainer import` reads and
`trainer export --format reference` writes.

Each family that can read its reference's checkpoints gives one `ReferenceFormat` (a reader and a writer) as
`REFERENCE_FORMAT` in its `reference.py`, next to its key map; `FORMATS` names the task whose family holds it (the
module is found from the task's spec, as the registry finds the task), and nothing is imported until a command asks
for it. This module and the families' formats import no torch.distributed, accelerate or trainer.core: the core
side (`trainer.core.reference_checkpoints`) builds the run folder and reads the run's checkpoint.
"""

from __future__ import annotations

import importlib
import io
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import CheckpointError, ConfigError

FORMATS: dict[str, str] = {"sedd": "protein_sedd", "edm": "molecules_edm", "gears": "perturbation_gears",
                           "comformer": "crystal_property"}
"""Format name -> the task whose family's `reference.py` defines it as `REFERENCE_FORMAT` (imported on first use)."""
FORMAT_MODULE, FORMAT_ATTRIBUTE = "reference", "REFERENCE_FORMAT"

_REGISTERED: dict[str, ReferenceFormat] = {}


@dataclass
class ReferenceCheckpoint:
    """A reference checkpoint read into our names: what `trainer import` turns into a run folder."""

    task: str
    """Our task that holds the model."""
    model: dict[str, Any]
    """The task model's state dict (our keys, as `Task.build_model` names them)."""
    ema: dict[str, Any] | None = None
    """EMA weights by our parameter name, where the source kept them."""
    step: int = 0
    """Optimizer steps the source had taken (0 where it does not record them)."""
    optimizer: dict[str, dict[str, Any]] | None = None
    """Per-parameter optimizer state (e.g. Adam's `step`, `exp_avg`, `exp_avg_sq`) by our parameter name."""
    overrides: list[str] = field(default_factory=list)
    """Config overrides (`section.key=value`) that give our config the source's model and recipe."""
    recipe: list[str] = field(default_factory=list)
    """Overrides of the reference's recipe (`section.key=value`) applied where this version's config has the key
    (e.g. a loss scale or EMA warm-up option), left out where it has not."""
    files: list[Path] = field(default_factory=list)
    """The files read (for messages)."""
    notes: list[str] = field(default_factory=list)
    """What the import could not carry over, said to the user (one line each)."""
    stats: dict[str, Any] | None = None
    """Task statistics the source fixes (ComFormer's target mean and std), kept by the run in place of its data's."""


@dataclass
class RunWeights:
    """What `trainer export --format reference` hands a format's writer: one checkpoint of a run, in our names."""

    model: dict[str, Any]
    """The model's full fp32 state dict (parameters and buffers)."""
    ema: dict[str, Any] | None
    """EMA weights by parameter name, where the run kept an EMA."""
    step: int
    config: Any
    """The run's resolved `trainer.config.Config`."""
    optimizer: dict[str, dict[str, Any]] | None = None
    """Per-parameter optimizer state by parameter name (None where the checkpoint's layout does not give it)."""
    lr: float | None = None
    """The learning rate of the run's next step."""


@dataclass
class ReferenceFormat:
    """A reference implementation's checkpoint layout: how to read it and how to write ours in it."""

    name: str
    task: str
    """Our task that holds this reference's model."""
    description: str
    """One line: the layout (files) read and written."""
    read: Callable[[Path], ReferenceCheckpoint]
    """Source (a file or folder) -> the checkpoint in our names; errors name the file and field."""
    write: Callable[[Path, RunWeights], list[str]]
    """(output folder, a run's weights) -> notes on what was not written; writes the reference's layout."""


def register_reference_format(fmt: ReferenceFormat) -> ReferenceFormat:
    """Make `fmt` available to `trainer import` / `export --format reference` under `fmt.name` (for formats
    outside this package; ours are listed in `FORMATS`)."""
    _REGISTERED[fmt.name] = fmt
    return fmt


def reference_format_names() -> list[str]:
    """Every format name `get_reference_format` knows."""
    return sorted({*FORMATS, *_REGISTERED})


def get_reference_format(name: str) -> ReferenceFormat:
    """The format `name`; an unknown one is a ConfigError listing the known names."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in FORMATS:
        raise ConfigError(f"unknown reference checkpoint format '{name}'; known: {', '.join(reference_format_names())}")
    from trainer.registry import get_spec

    package = get_spec(FORMATS[name]).task.split(":")[0].rsplit(".", 1)[0]  # the family's package
    try:
        fmt = getattr(importlib.import_module(f"{package}.{FORMAT_MODULE}"), FORMAT_ATTRIBUTE)
    except ModuleNotFoundError as err:
        raise ConfigError(f"reference format '{name}' needs a package that is not installed ({err})") from err
    _REGISTERED[name] = fmt
    return fmt


def format_for_task(task: str) -> ReferenceFormat:
    """The format whose model is task `task`'s; none is a ConfigError listing the formats and their tasks."""
    tasks = {**FORMATS, **{n: f.task for n, f in _REGISTERED.items()}}
    for name, fmt_task in tasks.items():
        if fmt_task == task:
            return get_reference_format(name)
    known = ", ".join(f"{n} ({t})" for n, t in sorted(tasks.items()))
    raise ConfigError(f"task '{task}' has no reference checkpoint format; known formats: {known}")


def state_dict_differences(expected: Mapping[str, Any], got: Mapping[str, Any], limit: int = 8) -> list[str]:
    """What keeps `got` from loading into a model whose state dict is `expected` (strict): missing and unexpected
    keys, and shapes that differ, one item each (at most `limit` of each kind)."""
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    shapes = [f"'{k}' {tuple(got[k].shape)} there, {tuple(expected[k].shape)} here"
              for k in expected if k in got and tuple(got[k].shape) != tuple(expected[k].shape)]

    def listed(kind: str, items: list[str]) -> list[str]:
        if not items:
            return []
        more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
        return [f"{kind}: {', '.join(items[:limit])}{more}"]

    return [*listed("missing keys", [f"'{k}'" for k in missing]),
            *listed("unexpected keys", [f"'{k}'" for k in unexpected]), *listed("shapes differ", shapes)]


def check_state_dict(expected: Mapping[str, Any], got: Mapping[str, Any], source: str, hint: str = "") -> None:
    """Raise a CheckpointError naming `source` and what differs, unless `got` loads strictly where `expected` is."""
    diff = state_dict_differences(expected, got)
    if diff:
        raise CheckpointError(f"{source} does not match the model of this config: {'; '.join(diff)}"
                              + (f" ({hint})" if hint else ""))


_SAFE_BUILTINS = frozenset({"set", "frozenset", "bytearray", "complex", "slice"})


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds plain data only: builtin containers and scalars and the classes `allowed` names."""

    def __init__(self, file: Any, source: str, allowed: Mapping[tuple[str, str], Any]):
        super().__init__(file)
        self.source, self.allowed = source, allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to load {self.source}: it names the global '{module}.{name}', which this "
                              f"reader does not allow (allowed: builtin containers and scalars"
                              f"{', ' if self.allowed else ''}{', '.join(f'{m}.{n}' for m, n in self.allowed)}), so "
                              f"loading it could run code")


def restricted_unpickle(path: str | Path, allowed: Mapping[tuple[str, str], Any] | None = None) -> Any:
    """Unpickle the file `path` without running pickled code: only builtin containers and scalars and the classes
    in `allowed` ((module, name) -> class) are built; any other global is a CheckpointError naming file and global."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        return _RestrictedUnpickler(io.BytesIO(data), str(path), dict(allowed or {})).load()
    except CheckpointError:
        raise
    except Exception as err:  # a truncated or garbled pickle: pickle's own errors name no file
        raise CheckpointError(f"cannot read {path} as a pickle ({type(err).__name__}: {err})") from None


def load_weights_only(path: str | Path) -> dict[str, Any]:
    """The state dict `torch.save`d in `path`, loaded weights-only (tensors and plain data, no pickled code); a
    file holding other objects, an unreadable one or one that is not a dict is a ValueError naming the file."""
    import torch

    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"refusing to load {path}: it holds objects that weights-only loading does not allow "
                         f"({str(err).splitlines()[0]})") from None
    except (RuntimeError, EOFError, OSError) as err:
        raise ValueError(f"cannot read {path}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return state


def _tensor_from_bytes(data: bytes) -> Any:
    """What a plainly pickled tensor's storage is rebuilt from (``torch.storage._load_from_bytes``: a ``torch.save``
    of the storage), loaded weights-only instead of by torch's own full unpickler."""
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def tensor_globals() -> dict[tuple[str, str], Any]:
    """The globals a plain ``pickle.dump`` of CPU tensors names (for `restricted_unpickle`): torch's tensor rebuild
    functions, its storage reader (here weights-only), ``collections.OrderedDict`` (the hooks argument) and
    ``_codecs.encode`` (how pickle protocol 2 writes bytes)."""
    import codecs
    import collections

    import torch

    allowed: dict[tuple[str, str], Any] = {("torch.storage", "_load_from_bytes"): _tensor_from_bytes,
                                           ("collections", "OrderedDict"): collections.OrderedDict,
                                           ("torch", "device"): torch.device, ("_codecs", "encode"): codecs.encode}
    for name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter"):
        if hasattr(torch._utils, name):
            allowed[("torch._utils", name)] = getattr(torch._utils, name)
    for dtype in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"):
        allowed[("torch", dtype)] = getattr(torch, dtype)
    return allowed


def namespace_fields(path: str | Path) -> dict[str, Any]:
    """The fields of the `argparse.Namespace` pickled in `path` (e.g. EDM's `args.pickle`), read with
    `restricted_unpickle` (argparse.Namespace and builtin data only)."""
    import argparse

    value = restricted_unpickle(path, {("argparse", "Namespace"): argparse.Namespace})
    if not isinstance(value, argparse.Namespace):
        raise CheckpointError(f"{path} holds a {type(value).__name__}, not an argparse.Namespace")
    return dict(vars(value))


def override(key: str, value: Any) -> str:
    """`key=value` with `value` written as YAML reads it back (JSON is YAML's flow syntax)."""
    import json

    return f"{key}={json.dumps(value)}"

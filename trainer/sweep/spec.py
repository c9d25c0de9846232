"""Experiments files: validation, grid expansion, stable names and the command line of each run."""

from __future__ import annotations

import itertools
import re
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.sweep.parsing import (
    SETTING_KEYS,
    ExperimentsError,
    check_keys,
    format_value,
    override_key,
    parse_overrides,
    parse_settings,
)
from trainer.sweep.searchspec import SearchSpec, parse_search

TOP_KEYS = ("experiments", "defaults", "search")
ENTRY_KEYS = ("name", "config", "overrides", "command", "grid", "repeats") + SETTING_KEYS
# Filled when an experiment starts; everything else in a template must be a grid key.
RUNTIME_PLACEHOLDERS = ("name", "out_dir", "gpus", "port", "python")
# Files the runner itself writes into the output folder; an experiment folder must not shadow them.
RESERVED_NAMES = ("results.json", "summary.csv", ".submitit", "confirm.csv", "confirm", "plots", "study.db",
                  "study.journal")

_NAME_OK = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.,=+\-]{0,199}$")
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")


@dataclass
class Experiment:
    """One run: an entry of the experiments file with one combination of its grid."""

    name: str
    entry: int
    """Index of the entry under `experiments:` this run comes from."""
    grid: dict[str, Any] = field(default_factory=dict)
    config: str | None = None
    """Absolute path of the trainer config (config experiments), else None."""
    overrides: list[str] = field(default_factory=list)
    command: list[str] | None = None
    """Command template tokens (command experiments); placeholders are filled at launch."""
    timeout: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    gpus_per_experiment: int = 1
    accelerate_config: str | None = None
    group: str | None = None
    """Name shared by the seed repeats of one config (`repeats: N`); None for a single run."""

    @property
    def kind(self) -> str:
        return "config" if self.config is not None else "command"

    def placeholders(self, out_dir: str | Path, gpus: Sequence[Any], port: int | None) -> dict[str, str]:
        values = {key: format_value(value) for key, value in self.grid.items()}
        values.update(name=self.name, out_dir=str(out_dir), gpus=",".join(str(g) for g in gpus),
                      port="" if port is None else str(port), python=sys.executable)
        return values

    def argv(self, out_dir: str | Path, gpus: Sequence[Any] = (), port: int | None = None,
             fresh: bool = True) -> list[str]:
        """The command line of this run, with its output folder, devices and (K > 1) rendezvous port."""
        values = self.placeholders(out_dir, gpus, port)
        where = f"experiment '{self.name}'"
        if self.command is not None:
            return [fill(token, values, where) for token in self.command]
        overrides = [fill(item, values, where) for item in self.overrides]
        # Without --resume a rerun into an existing folder starts over; with it the trainer's default
        # (run.resume=auto) continues an interrupted run from its latest checkpoint.
        if fresh and not any(item.startswith("run.resume=") for item in overrides):
            overrides.append("run.resume=none")
        train = ["trainer", "train", str(self.config), *overrides, f"run.output_dir={out_dir}"]
        if self.gpus_per_experiment == 1:
            return [sys.executable, "-m", *train]
        launch = [sys.executable, "-m", "accelerate.commands.launch"]
        accelerate_config = self.accelerate_config or default_accelerate_config()
        launch += ["--config_file", accelerate_config] if accelerate_config else ["--multi_gpu"]
        launch += ["--num_machines", "1", "--num_processes", str(self.gpus_per_experiment),
                   "--main_process_port", str(port if port is not None else free_port())]
        return [*launch, "-m", *train]

    def env_for(self, out_dir: str | Path, gpus: Sequence[Any], port: int | None) -> dict[str, str]:
        values = self.placeholders(out_dir, gpus, port)
        return {key: fill(value, values, f"experiment '{self.name}' env {key}") for key, value in self.env.items()}

    def needs_port(self) -> bool:
        if self.command is None:
            return self.gpus_per_experiment > 1
        return any("{port}" in token for token in self.command) or any("{port}" in v for v in self.env.values())

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "entry": self.entry, "kind": self.kind, "grid": dict(self.grid),
                "config": self.config, "overrides": list(self.overrides) if self.config is not None else None,
                "command_template": list(self.command) if self.command is not None else None,
                "timeout_s": self.timeout, "gpus_per_experiment": self.gpus_per_experiment,
                **({"group": self.group} if self.group is not None else {})}


def default_accelerate_config() -> str | None:
    """accelerate_configs/ddp.yaml of a source checkout (it also turns into multi-CPU gloo without GPUs)."""
    path = Path(__file__).resolve().parents[2] / "accelerate_configs" / "ddp.yaml"
    return str(path) if path.is_file() else None


def free_port() -> int:
    """A TCP port that was free a moment ago: the kernel's pick for port 0, never a fixed number."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def fill(template: str, values: Mapping[str, str], where: str) -> str:
    """Replace {key} with values[key]; {{ and }} stand for literal braces. No attribute or index access."""

    def sub(match: re.Match) -> str:
        if match.group(0) == "{{":
            return "{"
        if match.group(0) == "}}":
            return "}"
        key = match.group(1)
        if key not in values:
            known = ", ".join("{" + k + "}" for k in values) or "none"
            raise ExperimentsError(f"{where}: unknown placeholder {{{key}}} in {template!r} (known: {known})")
        return values[key]

    return _PLACEHOLDER.sub(sub, template)


def expand_grid(grid: Mapping[str, Sequence[Any]] | None) -> list[dict[str, Any]]:
    """Every combination of the grid's values, first key slowest, last key fastest (file order)."""
    if not grid:
        return [{}]
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]




def _parse_grid(raw: Any, where: str) -> dict[str, list[Any]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ExperimentsError(f"{where}: grid must be a mapping of key: [values]")
    for key, values in raw.items():
        if not isinstance(values, list) or not values:
            raise ExperimentsError(f"{where}: grid key '{key}' must be a non-empty list, got {values!r}")
        if key in RUNTIME_PLACEHOLDERS:
            raise ExperimentsError(f"{where}: grid key '{key}' clashes with the placeholder {{{key}}}")
    return {str(k): v for k, v in raw.items()}


def _with_repeats(combos: list[dict[str, Any]], name: str, repeats: int | None):
    """(grid values, group name template) per run: each combination once, or with run.seed 0..repeats-1."""
    if not repeats:
        return [(values, None) for values in combos]
    return [({**values, "run.seed": seed}, name) for values in combos for seed in range(repeats)]


def _entry_label(index: int, entry: Mapping) -> str:
    name = entry.get("name") if isinstance(entry, Mapping) else None
    return f"experiments[{index}]" + (f" (name {name!r})" if name else "")


def _expand_entry(index: int, entry: Mapping, defaults: dict[str, Any]) -> list[Experiment]:
    where = _entry_label(index, entry)
    check_keys(entry, ENTRY_KEYS, where)
    if not isinstance(entry.get("name"), str) or not entry["name"]:
        raise ExperimentsError(f"{where}: every entry needs a `name` (a template such as 'lr{{optim.lr}}')")
    if ("config" in entry) == ("command" in entry):
        raise ExperimentsError(f"{where}: give exactly one of `config` (a trainer config) or `command`")
    settings = parse_settings(entry, where, defaults)
    grid = _parse_grid(entry.get("grid"), where)
    repeats = entry.get("repeats")
    if repeats is not None:
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
            raise ExperimentsError(f"{where}: repeats must be an integer >= 2 (seeds 0..N-1), got {repeats!r}")
        if "config" not in entry:
            raise ExperimentsError(f"{where}: repeats applies to `config` entries (it sets run.seed)")
        if "run.seed" in grid or any(override_key(item) == "run.seed"
                                     for item in parse_overrides(entry.get("overrides"), where)):
            raise ExperimentsError(f"{where}: run.seed is set by repeats; remove it from grid and overrides")

    config = None
    overrides: list[str] = []
    command = None
    if "config" in entry:
        path = Path(str(entry["config"])).resolve()
        if not path.is_file():
            raise ExperimentsError(f"{where}: config file not found: {path}")
        config = str(path)
        overrides = parse_overrides(entry.get("overrides"), where)
    else:
        if "overrides" in entry:
            raise ExperimentsError(f"{where}: `overrides` only applies to `config` entries")
        raw = entry["command"]
        if isinstance(raw, str):
            # Split before filling, so a value with spaces stays one argument; no shell is involved.
            command = shlex.split(raw)
        elif isinstance(raw, list) and raw:
            command = [str(token) for token in raw]
        else:
            raise ExperimentsError(f"{where}: command must be a string or a non-empty list")
        if not command:
            raise ExperimentsError(f"{where}: command is empty")

    runs = []
    for values, group in _with_repeats(expand_grid(grid), entry["name"], repeats):
        formatted = {key: format_value(value) for key, value in values.items()}
        name = fill(entry["name"], formatted, f"{where} name")
        if group is not None:
            group = fill(group, formatted, f"{where} name")
            name = f"{group}_seed{values['run.seed']}"
        run_overrides = list(overrides)
        if config is not None:
            # Dotted grid keys are trainer config keys; plain ones only feed placeholders.
            run_overrides += [f"{key}={formatted[key]}" for key in values if "." in key]
        exp = Experiment(name=name, entry=index, grid=dict(values), config=config, overrides=run_overrides,
                         command=command, timeout=settings.get("timeout"), env=dict(settings.get("env", {})),
                         gpus_per_experiment=settings.get("gpus_per_experiment", 1),
                         accelerate_config=settings.get("accelerate_config"), group=group)
        if not _NAME_OK.match(name) or name in RESERVED_NAMES:
            raise ExperimentsError(f"{where}: name {name!r} is not a safe folder name (letters, digits and "
                                   "_ . , = + - only, at most 200 characters)")
        # Catch unknown placeholders now rather than when the run starts hours later.
        exp.argv("OUT", [0] * exp.gpus_per_experiment, 1)
        exp.env_for("OUT", [0], 1)
        runs.append(exp)
    return runs


def _parse_defaults(data: Any, source: str, cli_defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    """The settings every entry starts from: command line (`cli_defaults`) over the file's `defaults:`."""
    check_keys(data, TOP_KEYS, source)
    raw_defaults = data.get("defaults") or {}
    if not isinstance(raw_defaults, dict):
        raise ExperimentsError(f"{source}: defaults must be a mapping")
    check_keys(raw_defaults, SETTING_KEYS, f"{source} defaults")
    defaults = parse_settings(raw_defaults, f"{source} defaults", {"env": {}, "gpus_per_experiment": 1})
    cli = {k: v for k, v in (cli_defaults or {}).items() if v is not None}
    return parse_settings(cli, "command line", defaults)


def parse_experiments(data: Any, source: str = "<experiments>",
                      cli_defaults: Mapping[str, Any] | None = None) -> list[Experiment]:
    """Experiments from an already-loaded YAML document.

    Settings resolve as: entry > command line (`cli_defaults`, e.g. --timeout) > file `defaults:`.
    """
    if not isinstance(data, dict) or "experiments" not in data:
        raise ExperimentsError(f"{source}: expected a mapping with an `experiments:` list (or a `search:` block)")
    if "search" in data:
        raise ExperimentsError(f"{source}: give `experiments:` or `search:`, not both (one file per study)")
    defaults = _parse_defaults(data, source, cli_defaults)

    entries = data["experiments"]
    if not isinstance(entries, list) or not entries:
        raise ExperimentsError(f"{source}: `experiments:` must be a non-empty list")
    experiments: list[Experiment] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ExperimentsError(f"{source}: experiments[{index}] must be a mapping")
        experiments += _expand_entry(index, entry, defaults)

    seen: dict[str, int] = {}
    for exp in experiments:
        seen[exp.name] = seen.get(exp.name, 0) + 1
    duplicates = [name for name, count in seen.items() if count > 1]
    if duplicates:
        raise ExperimentsError(f"{source}: duplicate experiment names {duplicates}; put every grid key that "
                               "varies into the name template")
    return experiments


def _read_yaml(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ExperimentsError(f"experiments file not found: {path}")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ExperimentsError(f"experiments file {path} is not valid YAML: {err}") from None


def load_experiments(path: str | Path, cli_defaults: Mapping[str, Any] | None = None) -> list[Experiment]:
    """Read, validate and expand an experiments YAML file into runs, in a stable order."""
    return parse_experiments(_read_yaml(path), str(path), cli_defaults)


def load_experiments_file(path: str | Path, cli_defaults: Mapping[str, Any] | None = None
                          ) -> tuple[list[Experiment], SearchSpec | None]:
    """(experiments, None) for a file of runs, or ([], SearchSpec) for a file with a `search:` block."""
    data = _read_yaml(path)
    if isinstance(data, dict) and "search" in data and "experiments" not in data:
        return [], parse_search(data["search"], str(path), _parse_defaults(data, str(path), cli_defaults))
    return parse_experiments(data, str(path), cli_defaults), None

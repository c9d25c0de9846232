"""The `search:` block of an experiments file: a hyperparameter study (validated here, run by study.py).

Parsing needs neither Optuna nor torch: a file with a typo fails at once, and `--dry-run` shows the search
space without the search extra installed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, load_config
from trainer.sweep.parsing import ExperimentsError, check_keys, format_value, override_key, parse_overrides, parse_settings

SEARCH_KEYS = ("name", "config", "overrides", "metric", "direction", "n_trials", "sampler", "pruner", "params",
               "confirm", "storage", "timeout", "env", "gpus_per_experiment", "accelerate_config")
SAMPLERS = {"tpe": ("seed", "n_startup_trials", "multivariate"), "random": ("seed",),
            "cmaes": ("seed", "n_startup_trials"), "grid": ("seed",)}
"""Sampler name -> the options it accepts (passed to Optuna's sampler of that name)."""
PRUNERS = {"none": (), "median": ("n_startup_trials", "n_warmup_steps", "interval_steps"),
           "hyperband": ("min_resource", "max_resource", "reduction_factor")}
"""Pruner name -> the options it accepts (passed to Optuna's pruner of that name)."""
PARAM_KEYS = {"float": ("type", "low", "high", "log", "step"), "int": ("type", "low", "high", "log", "step"),
              "categorical": ("type", "choices")}
CONFIRM_KEYS = ("top", "seeds")
_STUDY_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}$")


@dataclass(frozen=True)
class ParamSpec:
    """One dimension of the search space: a trainer config key and its distribution."""

    key: str
    type: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()

    def grid_values(self) -> list[Any]:
        """Every value of a finite dimension (categorical, or int/float with a step), for the grid sampler."""
        if self.type == "categorical":
            return list(self.choices)
        if self.step is None and self.type == "float":
            raise ExperimentsError(f"search.params.{self.key}: the grid sampler needs `choices` or a `step`")
        step = self.step or 1
        count = int(math.floor((self.high - self.low) / step + 1e-9)) + 1
        values = [self.low + i * step for i in range(count)]
        return [int(v) for v in values] if self.type == "int" else [round(v, 12) for v in values]

    def describe(self) -> str:
        if self.type == "categorical":
            return f"categorical {list(self.choices)}"
        text = f"{self.type} [{format_value(self.low)}, {format_value(self.high)}]"
        return text + (" log" if self.log else "") + (f" step {format_value(self.step)}" if self.step else "")


@dataclass(frozen=True)
class SearchSpec:
    """A study: which config, which keys to vary, how to sample and prune, and what to optimise."""

    name: str
    config: str
    overrides: tuple[str, ...]
    metric: str
    """A key of the runs' metrics.jsonl (e.g. eval/loss)."""
    direction: str
    """minimize or maximize."""
    n_trials: int
    params: tuple[ParamSpec, ...]
    sampler: str = "tpe"
    sampler_options: Mapping[str, Any] = field(default_factory=dict)
    pruner: str = "median"
    pruner_options: Mapping[str, Any] = field(default_factory=dict)
    confirm_top: int = 0
    confirm_seeds: int = 0
    storage: str | None = None
    """An Optuna storage URL; None: sqlite:///OUT/study.db (or the journal file OUT/study.journal on SLURM)."""
    timeout: float | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    gpus_per_experiment: int = 1
    accelerate_config: str | None = None

    def describe(self) -> str:
        """The search space and settings, as `--dry-run` prints them."""
        sampler = self.sampler + (f" {dict(self.sampler_options)}" if self.sampler_options else "")
        pruner = self.pruner + (f" {dict(self.pruner_options)}" if self.pruner_options else "")
        lines = [f"study {self.name}: {self.n_trials} trial(s), {self.direction} {self.metric}, sampler {sampler}, "
                 f"pruner {pruner}", f"  config {self.config}"]
        if self.overrides:
            lines.append("  overrides " + " ".join(self.overrides))
        width = max(len(p.key) for p in self.params)
        lines += [f"  {p.key.ljust(width)}  {p.describe()}" for p in self.params]
        if self.confirm_top:
            lines.append(f"  confirm: the best {self.confirm_top} config(s) rerun with run.seed 0..{self.confirm_seeds - 1}")
        return "\n".join(lines)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ExperimentsError(f"{where} must be a number, got {value!r}")
    return value


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ExperimentsError(f"{where} must be an integer >= 1, got {value!r}")
    return value


def _parse_param(key: Any, raw: Any, where: str) -> ParamSpec:
    where = f"{where}.params.{key}"
    if not isinstance(key, str) or "." not in key:
        raise ExperimentsError(f"{where}: a parameter is a trainer config key such as optim.lr")
    if key == "run.output_dir" or key == "run.seed":
        raise ExperimentsError(f"{where}: {key} is set by the runner")
    if not isinstance(raw, dict) or raw.get("type") not in PARAM_KEYS:
        raise ExperimentsError(f"{where}: expected {{type: float | int | categorical, ...}}, got {raw!r}")
    kind = raw["type"]
    check_keys(raw, PARAM_KEYS[kind], where)
    if kind == "categorical":
        choices = raw.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ExperimentsError(f"{where}: categorical needs a non-empty `choices` list")
        if any(isinstance(c, (list, dict)) for c in choices):
            raise ExperimentsError(f"{where}: choices must be numbers, strings, booleans or null")
        return ParamSpec(key, kind, choices=tuple(choices))
    for bound in ("low", "high"):
        if bound not in raw:
            raise ExperimentsError(f"{where}: {kind} needs `low` and `high`")
    low, high = _number(raw["low"], f"{where}.low"), _number(raw["high"], f"{where}.high")
    if kind == "int" and not all(isinstance(v, int) for v in (low, high)):
        raise ExperimentsError(f"{where}: int bounds must be integers, got {low!r}, {high!r}")
    if not low < high:
        raise ExperimentsError(f"{where}: low must be < high, got {low!r}, {high!r}")
    log = raw.get("log", False)
    if not isinstance(log, bool):
        raise ExperimentsError(f"{where}.log must be true or false, got {log!r}")
    if log and low <= 0:
        raise ExperimentsError(f"{where}: log: true needs low > 0, got {low!r}")
    step = raw.get("step")
    if step is not None:
        step = _number(step, f"{where}.step")
        if step <= 0 or log:
            raise ExperimentsError(f"{where}: step must be > 0 and cannot go with log: true")
    return ParamSpec(key, kind, low=low, high=high, log=log, step=step)


def _parse_choice(raw: Any, table: Mapping[str, tuple[str, ...]], default: str, where: str) -> tuple[str, dict]:
    """`name` or {type: name, option: value, ...} -> (name, options), options checked against `table`."""
    if raw is None:
        return default, {}
    options = {}
    if isinstance(raw, dict):
        options = {k: v for k, v in raw.items() if k != "type"}
        raw = raw.get("type")
    if raw not in table:
        raise ExperimentsError(f"{where}: expected one of {', '.join(table)} (or {{type: NAME, ...options}}), "
                               f"got {raw!r}")
    check_keys(options, table[raw], f"{where} ({raw})")
    return raw, options


def parse_search(raw: Any, source: str, defaults: Mapping[str, Any]) -> SearchSpec:
    """A `SearchSpec` from the `search:` mapping; `defaults` are the file's and command line's settings."""
    where = f"{source} search"
    if not isinstance(raw, dict):
        raise ExperimentsError(f"{where}: must be a mapping (name, config, params, ...)")
    check_keys(raw, SEARCH_KEYS, where)
    for key in ("name", "config", "params", "n_trials"):
        if key not in raw:
            raise ExperimentsError(f"{where}: `{key}` is required")
    name = raw["name"]
    if not isinstance(name, str) or not _STUDY_NAME.match(name):
        raise ExperimentsError(f"{where}.name: {name!r} is not a safe study name (letters, digits, _ . -)")
    config = Path(str(raw["config"])).resolve()
    if not config.is_file():
        raise ExperimentsError(f"{where}.config: file not found: {config}")
    overrides = parse_overrides(raw.get("overrides"), where)
    if any(override_key(item) == "run.seed" for item in overrides) and raw.get("confirm"):
        raise ExperimentsError(f"{where}: run.seed is set by `confirm`; remove it from overrides")
    if not isinstance(raw["params"], dict) or not raw["params"]:
        raise ExperimentsError(f"{where}.params: a non-empty mapping of config key: {{type: ...}}")
    params = tuple(_parse_param(key, value, where) for key, value in raw["params"].items())
    clash = sorted({p.key for p in params} & {override_key(item) for item in overrides})
    if clash:
        raise ExperimentsError(f"{where}: {clash} are both searched and overridden; keep one")
    n_trials = _positive_int(raw["n_trials"], f"{where}.n_trials")
    sampler, sampler_options = _parse_choice(raw.get("sampler"), SAMPLERS, "tpe", f"{where}.sampler")
    pruner, pruner_options = _parse_choice(raw.get("pruner"), PRUNERS, "median", f"{where}.pruner")
    if sampler == "grid":
        size = math.prod(len(p.grid_values()) for p in params)
        if n_trials > size:
            raise ExperimentsError(f"{where}: n_trials={n_trials} but the grid has only {size} point(s)")

    # The trainer config with a first value of every parameter: an unknown key or a bad value fails here,
    # not in every trial; it also gives the default metric (the config's selection metric).
    probe = [f"{p.key}={format_value(p.choices[0] if p.type == 'categorical' else p.low)}" for p in params]
    try:
        cfg = load_config(config, [*overrides, *probe])
    except ConfigError as err:
        raise ExperimentsError(f"{where}: the trial config does not load: {err}") from None
    metric = raw.get("metric") or f"eval/{cfg.eval.metric}"
    if not isinstance(metric, str):
        raise ExperimentsError(f"{where}.metric must be a metrics.jsonl key such as eval/loss, got {metric!r}")
    direction = raw.get("direction") or ("maximize" if cfg.eval.mode == "max" else "minimize")
    if direction not in ("minimize", "maximize"):
        raise ExperimentsError(f"{where}.direction must be minimize or maximize, got {direction!r}")

    confirm = raw.get("confirm") or {}
    if not isinstance(confirm, dict):
        raise ExperimentsError(f"{where}.confirm: expected {{top: N, seeds: M}}")
    check_keys(confirm, CONFIRM_KEYS, f"{where}.confirm")
    top = _positive_int(confirm.get("top", 1), f"{where}.confirm.top") if confirm else 0
    seeds = _positive_int(confirm.get("seeds", 3), f"{where}.confirm.seeds") if confirm else 0
    if confirm and seeds < 2:
        raise ExperimentsError(f"{where}.confirm.seeds must be >= 2 (a spread needs two values)")
    storage = raw.get("storage")
    if storage is not None and (not isinstance(storage, str) or "://" not in storage):
        raise ExperimentsError(f"{where}.storage: an Optuna storage URL such as sqlite:///path/study.db, got "
                               f"{storage!r}")
    settings = parse_settings(raw, where, dict(defaults))
    return SearchSpec(name=name, config=str(config), overrides=tuple(overrides), metric=metric, direction=direction,
                      n_trials=n_trials, params=params, sampler=sampler, sampler_options=sampler_options,
                      pruner=pruner, pruner_options=pruner_options, confirm_top=top, confirm_seeds=seeds,
                      storage=storage, timeout=settings.get("timeout"), env=dict(settings.get("env", {})),
                      gpus_per_experiment=settings.get("gpus_per_experiment", 1),
                      accelerate_config=settings.get("accelerate_config"))

"""What experiments files and `search:` blocks share: the error type, known keys, overrides and per-run settings.

Both spec.py (a grid of runs) and searchspec.py (a study) build on this module; it imports neither.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer.config import ConfigError

SETTING_KEYS = ("timeout", "env", "gpus_per_experiment", "accelerate_config")
"""Per-run settings an entry, a study or `defaults:` may give (`parse_settings`)."""

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smh]?)\s*$")


class ExperimentsError(ConfigError):
    """A problem in an experiments file that the user must fix (names the entry and key)."""


def format_value(value: Any) -> str:
    """How a grid value appears in names, commands and overrides (YAML-readable, so `key=value` round-trips)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def parse_duration(value: Any, where: str) -> float | None:
    """Seconds from a number or a string such as '90', '90s', '30m', '2h'; None means no limit."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ExperimentsError(f"{where}: timeout must be seconds or a string like '30m', got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ExperimentsError(f"{where}: timeout must be seconds or a string like '30m', got {value!r}")
        seconds = float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]
    if seconds <= 0:
        raise ExperimentsError(f"{where}: timeout must be > 0, got {value!r}")
    return seconds


def check_keys(mapping: Mapping, allowed: Sequence[str], where: str) -> None:
    """Raise on the first key of `mapping` not in `allowed`, naming the allowed ones."""
    for key in mapping:
        if key not in allowed:
            raise ExperimentsError(f"{where}: unknown key '{key}' (allowed: {', '.join(allowed)})")


def parse_settings(raw: Mapping[str, Any], where: str, base: dict[str, Any]) -> dict[str, Any]:
    """timeout / env / gpus_per_experiment / accelerate_config of `raw` laid over `base`."""
    out = dict(base)
    if "timeout" in raw:
        out["timeout"] = parse_duration(raw["timeout"], where)
    if "env" in raw:
        env = raw["env"] or {}
        if not isinstance(env, dict):
            raise ExperimentsError(f"{where}: env must be a mapping of NAME: value")
        out["env"] = {**base.get("env", {}), **{str(k): format_value(v) for k, v in env.items()}}
    if "gpus_per_experiment" in raw:
        k = raw["gpus_per_experiment"]
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ExperimentsError(f"{where}: gpus_per_experiment must be an integer >= 1, got {k!r}")
        out["gpus_per_experiment"] = k
    if "accelerate_config" in raw:
        path = raw["accelerate_config"]
        if path is not None:
            path = Path(str(path)).resolve()
            if not path.is_file():
                raise ExperimentsError(f"{where}: accelerate_config file not found: {path}")
            path = str(path)
        out["accelerate_config"] = path
    return out



def override_key(item: str) -> str:
    """The config key an override `key=value` sets."""
    return item.split("=", 1)[0].strip()


def parse_overrides(raw: Any, where: str) -> list[str]:
    """`key=value` strings from a list of them or a mapping; the runner's own run.output_dir is refused."""
    if raw is None:
        return []
    if isinstance(raw, dict):
        items = [f"{key}={format_value(value)}" for key, value in raw.items()]
    elif isinstance(raw, list):
        items = [str(item) for item in raw]
    else:
        raise ExperimentsError(f"{where}: overrides must be a list of key=value strings or a mapping")
    for item in items:
        if "=" not in item:
            raise ExperimentsError(f"{where}: override {item!r} must look like section.key=value")
        if override_key(item) == "run.output_dir":
            raise ExperimentsError(f"{where}: run.output_dir is set by the runner (OUT/<name>); remove it")
    return items

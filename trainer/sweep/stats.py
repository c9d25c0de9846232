"""Seed statistics: one config rerun with run.seed 0..N-1, summarised as mean, spread and a 95 % t-interval.

OUT/confirm.csv has one row per config; the winner is the best mean, and the verdict says whether the two
best configs' intervals overlap (if they do, the ranking may be seed noise).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from trainer.atomic_io import atomic_write_text

CONFIDENCE = 0.95
CONFIRM_COLUMNS = ["config", "n", "mean", "std", "sem", "ci95_low", "ci95_high", "values"]


def seed_statistics(values: Sequence[float]) -> dict[str, Any]:
    """n, mean, sample standard deviation (ddof 1), standard error and the two-sided 95 % t-interval."""
    from scipy import stats  # only the runs that repeat seeds need it

    n = len(values)
    mean = math.fsum(values) / n if n else math.nan
    if n < 2:
        return {"n": n, "mean": mean, "std": math.nan, "sem": math.nan, "ci95_low": math.nan,
                "ci95_high": math.nan}
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    sem = std / math.sqrt(n)
    half = float(stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1)) * sem
    return {"n": n, "mean": mean, "std": std, "sem": sem, "ci95_low": mean - half, "ci95_high": mean + half}


def rank_configs(values_by_config: Mapping[str, Sequence[float]], direction: str) -> list[dict[str, Any]]:
    """One statistics row per config, best mean first (`direction`: minimize or maximize)."""
    rows = [{"config": name, **seed_statistics(list(values)), "values": list(values)}
            for name, values in values_by_config.items() if values]
    return sorted(rows, key=lambda row: row["mean"] if direction == "minimize" else -row["mean"])


def verdict(rows: Sequence[Mapping[str, Any]], metric: str) -> str:
    """One line: the winner by mean, and whether it differs from the runner-up beyond their intervals."""
    if not rows:
        return "seed statistics: no config has a recorded value"
    best = rows[0]
    line = f"winner by mean {metric}: {best['config']} ({best['mean']:.6g} ± {best['sem']:.2g} s.e., n={best['n']})"
    if len(rows) < 2:
        return line
    second = rows[1]
    apart = best["ci95_high"] < second["ci95_low"] or second["ci95_high"] < best["ci95_low"]
    return line + (f"; it differs from {second['config']} ({second['mean']:.6g}) beyond their 95 % intervals"
                   if apart else f"; the 95 % intervals of it and {second['config']} ({second['mean']:.6g}) "
                   "overlap: the difference may be seed noise")


def write_confirm_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(CONFIRM_COLUMNS)
    for row in rows:
        writer.writerow([row[c] if c != "values" else " ".join(repr(v) for v in row[c]) for c in CONFIRM_COLUMNS])
    atomic_write_text(path, buf.getvalue(), durable=False)


def metric_value(run_dir: str | Path, metric: str) -> tuple[float | None, int | None]:
    """(last value of `metric`, its step) in RUN_DIR/metrics.jsonl, or (None, None)."""
    from trainer.rundir import RunDir

    value = step = None
    for record in RunDir(run_dir).read_metrics(missing_ok=True):
        if isinstance(record, dict) and isinstance(record.get(metric), (int, float)):
            value, step = float(record[metric]), record.get("step")
    return value, step


def write_seed_statistics(records: Sequence[Any], path: Path, metric: str, direction: str,
                          stream: TextIO | None) -> list[dict[str, Any]]:
    """Group the completed seed runs by config, write `path` (confirm.csv) and print the verdict."""
    values: dict[str, list[float]] = {}
    for record in records:
        group = record.extra.get("group")
        if group is None:
            continue
        values.setdefault(group, [])
        value, _ = metric_value(record.out_dir, metric) if record.status == "completed" else (None, None)
        if value is not None:
            values[group].append(value)
    rows = rank_configs(values, direction)
    write_confirm_csv(path, rows)
    if stream is not None:
        stream.write(f"seed statistics of {metric} in {path}\n{verdict(rows, metric)}\n")
    return rows


def write_repeats_statistics(records: Sequence[Mapping[str, Any]], out_dir: Path,
                             stream: TextIO | None) -> list[dict[str, Any]]:
    """OUT/confirm.csv for entries with `repeats:` from their records (as in results.json), on the selection
    metric and mode of the runs' own config.yaml; no file when no seed run has a config.yaml."""
    import yaml

    from trainer.sweep.record import RunRecord

    runs = [RunRecord.from_dict(r) for r in records]
    first = next((r for r in runs if r.extra.get("group") and (Path(r.out_dir) / "config.yaml").is_file()), None)
    if first is None:
        return []
    cfg = yaml.safe_load((Path(first.out_dir) / "config.yaml").read_text())
    metric = f"eval/{cfg['eval']['metric']}"
    direction = "maximize" if cfg["eval"].get("mode") == "max" else "minimize"
    return write_seed_statistics(runs, Path(out_dir) / "confirm.csv", metric, direction, stream)

"""Result files: atomic OUT/results.json, OUT/summary.csv and OUT/<name>/result.json (records: record.py)."""

from __future__ import annotations

import csv
import datetime
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer.atomic_io import atomic_write_text
from trainer.sweep.record import STATUSES, RunRecord

RESULT_FILE = "result.json"

SUMMARY_COLUMNS = ["name", "status", "runtime_s", "exit_code", "signal", "slots", "gpus", "peak_rss_mib",
                   "peak_gpu_mib", "start_time", "end_time"]


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` atomically, so readers never see half a file (not fsynced: it is rewritten at
    every change of a run's state)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text, durable=False)


def counts(records: Iterable[RunRecord]) -> dict[str, int]:
    out = {status: 0 for status in STATUSES}
    for record in records:
        out[record.status] = out.get(record.status, 0) + 1
    return out


def summary_csv(records: Sequence[RunRecord]) -> str:
    """One row per experiment: status, resources, grid values and the final eval metrics."""
    grid_keys: list[str] = []
    eval_keys: list[str] = []
    for record in records:
        grid_keys += [k for k in record.grid or {} if k not in grid_keys]
        eval_keys += [k for k in record.final_eval or {} if k not in eval_keys]
    grid_columns = [k if k not in SUMMARY_COLUMNS else f"grid.{k}" for k in grid_keys]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(SUMMARY_COLUMNS + grid_columns + eval_keys + ["log"])
    for record in records:
        row = []
        for column in SUMMARY_COLUMNS:
            value = getattr(record, column)
            row.append(" ".join(str(v) for v in value) if isinstance(value, list) else value)
        row += [(record.grid or {}).get(k) for k in grid_keys]
        row += [(record.final_eval or {}).get(k) for k in eval_keys]
        row.append(record.log)
        writer.writerow(["" if v is None else v for v in row])
    return buf.getvalue()


def write_results(out_dir: Path, records: Sequence[RunRecord], meta: Mapping[str, Any],
                  summary: str | None = None) -> None:
    """OUT/results.json (everything) and OUT/summary.csv (`summary`, else `summary_csv`), replaced atomically."""
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    document = {**meta, "updated": now, "counts": counts(records), "experiments": [r.to_dict() for r in records]}
    write_atomic(out_dir / "results.json", json.dumps(document, indent=2) + "\n")
    write_atomic(out_dir / "summary.csv", summary_csv(records) if summary is None else summary)


def write_run_record(record: RunRecord) -> None:
    """OUT/<name>/result.json: the one record a SLURM array task owns (merged by --collect)."""
    write_atomic(Path(record.out_dir) / RESULT_FILE, json.dumps(record.to_dict(), indent=2) + "\n")


def read_results(out_dir: Path) -> dict[str, RunRecord]:
    """Records of an earlier invocation by name: results.json, newer per-run result.json files on top."""
    records: dict[str, RunRecord] = {}
    path = out_dir / "results.json"
    if path.is_file():
        try:
            for record in json.loads(path.read_text()).get("experiments", []):
                records[record["name"]] = RunRecord.from_dict(record)
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as err:
            raise ValueError(f"{path} is not a results file of trainer run-experiments: {err}") from None
    for run_file in out_dir.glob(f"*/{RESULT_FILE}"):
        try:
            record = RunRecord.from_dict(json.loads(run_file.read_text()))
        except (json.JSONDecodeError, TypeError, AttributeError):  # half a file, or not a record
            continue
        old = records.get(record.name)
        if old is None or (record.attempt or 0, record.start_epoch or 0) >= (old.attempt or 0, old.start_epoch or 0):
            records[record.name] = record
    return records

"""Result records: atomic results.json / summary.csv / per-run result.json, final metrics, log tails."""

from __future__ import annotations

import csv
import datetime
import io
import json
import os
import signal
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

from trainer.sweep.spec import Experiment

# pending: not started (yet); running: started, not ended; the other four are final.
STATUSES = ("pending", "running", "completed", "failed", "timeout", "interrupted")
FINAL_STATUSES = ("completed", "failed", "timeout", "interrupted")
LOG_TAIL_LINES = 40
RESULT_FILE = "result.json"

SUMMARY_COLUMNS = ["name", "status", "runtime_s", "exit_code", "signal", "slots", "gpus", "peak_rss_mib",
                   "peak_gpu_mib", "start_time", "end_time"]


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


def new_record(exp: Experiment, out_dir: Path) -> dict[str, Any]:
    """The record of an experiment that has not started."""
    run_dir = out_dir / exp.name
    record = exp.to_dict()
    record.update(status="pending", command=None, command_str=None, out_dir=str(run_dir),
                  log=str(run_dir / "log.txt"), slots=None, gpus=None, pid=None, start_time=None,
                  start_epoch=None, end_time=None, end_epoch=None, runtime_s=None, exit_code=None, signal=None,
                  peak_rss_mib=None, peak_gpu_mib=None, metrics=None, final_eval=None, log_tail=None,
                  error=None, attempt=0)
    return record


def signal_name(exit_code: int | None) -> str | None:
    """SIGSEGV for -11 (killed by a signal, as Popen reports it) and for 139 (as a shell reports it)."""
    if exit_code is None or exit_code == 0:
        return None
    number = -exit_code if exit_code < 0 else exit_code - 128 if 128 < exit_code < 128 + 65 else None
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def read_final_metrics(run_dir: str | Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(last value of every key, last eval record) from RUN_DIR/metrics.jsonl, or (None, None)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None, None
    final: dict[str, Any] = {}
    last_eval = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if not isinstance(record, dict):
            continue
        final.update({k: v for k, v in record.items() if k != "event"})
        if any(k.startswith("eval/") for k in record):
            last_eval = record
    return final or None, last_eval


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str | None:
    """The last `lines` lines of a log, reading only its end (logs of long runs get big)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return "\n".join(text.splitlines()[-lines:])


def write_atomic(path: Path, text: str) -> None:
    """Write through a temp file in the same folder and os.replace, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def counts(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    out = {status: 0 for status in STATUSES}
    for record in records:
        out[record["status"]] = out.get(record["status"], 0) + 1
    return out


def summary_csv(records: list[Mapping[str, Any]]) -> str:
    """One row per experiment: status, resources, grid values and the final eval metrics."""
    grid_keys: list[str] = []
    eval_keys: list[str] = []
    for record in records:
        grid_keys += [k for k in record.get("grid") or {} if k not in grid_keys]
        eval_keys += [k for k in record.get("final_eval") or {} if k not in eval_keys]
    grid_columns = [k if k not in SUMMARY_COLUMNS else f"grid.{k}" for k in grid_keys]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(SUMMARY_COLUMNS + grid_columns + eval_keys + ["log"])
    for record in records:
        row = []
        for column in SUMMARY_COLUMNS:
            value = record.get(column)
            row.append(" ".join(str(v) for v in value) if isinstance(value, list) else value)
        row += [(record.get("grid") or {}).get(k) for k in grid_keys]
        row += [(record.get("final_eval") or {}).get(k) for k in eval_keys]
        row.append(record.get("log"))
        writer.writerow(["" if v is None else v for v in row])
    return buf.getvalue()


def write_results(out_dir: Path, records: list[dict[str, Any]], meta: Mapping[str, Any]) -> None:
    """OUT/results.json (everything) and OUT/summary.csv, both replaced atomically."""
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    document = {**meta, "updated": now, "counts": counts(records), "experiments": records}
    write_atomic(out_dir / "results.json", json.dumps(document, indent=2) + "\n")
    write_atomic(out_dir / "summary.csv", summary_csv(records))


def write_run_record(record: Mapping[str, Any]) -> None:
    """OUT/<name>/result.json: the one record a SLURM array task owns (merged by --collect)."""
    write_atomic(Path(record["out_dir"]) / RESULT_FILE, json.dumps(record, indent=2) + "\n")


def read_results(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Records of an earlier invocation by name: results.json, newer per-run result.json files on top."""
    records: dict[str, dict[str, Any]] = {}
    path = out_dir / "results.json"
    if path.is_file():
        try:
            for record in json.loads(path.read_text()).get("experiments", []):
                records[record["name"]] = record
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise ValueError(f"{path} is not a results file of trainer run-experiments: {err}") from None
    for run_file in out_dir.glob(f"*/{RESULT_FILE}"):
        try:
            record = json.loads(run_file.read_text())
        except json.JSONDecodeError:
            continue
        old = records.get(record.get("name"))
        if old is None or (record.get("attempt") or 0, record.get("start_epoch") or 0) >= (
                old.get("attempt") or 0, old.get("start_epoch") or 0):
            records[record["name"]] = record
    return records

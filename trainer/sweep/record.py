"""`RunRecord`: what results.json, summary.csv and OUT/<name>/result.json say about one experiment."""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import DataError
from trainer.rundir import RunDir
from trainer.sweep.spec import Experiment

# pending: not started (yet); running: started, not ended; the others are final (pruned: a study's
# pruner stopped the trial early, see study.py).
STATUSES = ("pending", "running", "completed", "pruned", "failed", "timeout", "interrupted")
FINAL_STATUSES = ("completed", "pruned", "failed", "timeout", "interrupted")
LOG_TAIL_LINES = 40
OPTIONAL_FIELDS = ("slurm_job_id", "host")
"""Written only when set (SLURM array tasks), so local results files keep their fields."""


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


@dataclass
class RunRecord:
    """One experiment's record; `to_dict()` is its JSON form (field order as in results.json)."""

    # What the experiments file says (Experiment.to_dict()).
    name: str
    entry: int
    kind: str
    grid: dict[str, Any] = field(default_factory=dict)
    config: str | None = None
    overrides: list[str] | None = None
    command_template: list[str] | None = None
    timeout_s: float | None = None
    gpus_per_experiment: int = 1
    # Where and how it ran.
    status: str = "pending"
    command: list[str] | None = None
    command_str: str | None = None
    out_dir: str = ""
    log: str = ""
    slots: list[int] | None = None
    gpus: list[int | str] | None = None
    pid: int | None = None
    start_time: str | None = None
    start_epoch: float | None = None
    end_time: str | None = None
    end_epoch: float | None = None
    runtime_s: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    peak_rss_mib: float | None = None
    peak_gpu_mib: float | None = None
    cpu_s: float | None = None
    """CPU seconds (user + system) of the run's processes, as last sampled."""
    metrics: dict[str, Any] | None = None
    final_eval: dict[str, Any] | None = None
    log_tail: str | None = None
    error: str | None = None
    attempt: int = 0
    killed_processes: list[dict[str, Any]] | None = None
    """Every process the runner had to signal to end the run: pid, command, last signal, and whether
    it had left the run's process group (setsid). None until the run ends."""
    slurm_job_id: str | None = None
    host: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not know (a newer runner's file), kept as they were."""

    @classmethod
    def pending(cls, exp: Experiment, out_dir: Path) -> RunRecord:
        """The record of an experiment that has not started."""
        run_dir = Path(out_dir) / exp.name
        return cls.from_dict({**exp.to_dict(), "out_dir": str(run_dir), "log": str(run_dir / "log.txt")})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunRecord:
        record = cls(**{k: v for k, v in data.items() if k in _FIELD_NAMES})
        record.extra = {k: v for k, v in data.items() if k not in _FIELD_NAMES}
        return record

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        for key in OPTIONAL_FIELDS:
            if out[key] is None:
                del out[key]
        out.update(self.extra)
        return out

    def update(self, values: Mapping[str, Any]) -> None:
        """Set fields by name; unknown names go to `extra` (and so into the JSON form)."""
        for key, value in values.items():
            if key in _FIELD_NAMES:
                setattr(self, key, value)
            else:
                self.extra[key] = value

    def start(self, argv: list[str], command_str: str, slots: list[int], gpus: list[int | str], now: float) -> None:
        """Reset every per-attempt field for a new attempt starting at `now`."""
        self.attempt += 1
        self.status, self.command, self.command_str, self.slots, self.gpus = "running", argv, command_str, slots, gpus
        self.start_epoch, self.start_time = now, iso(now)
        self.end_epoch = self.end_time = self.runtime_s = self.exit_code = self.signal = None
        self.peak_rss_mib = self.peak_gpu_mib = self.cpu_s = self.metrics = self.final_eval = self.log_tail = None
        self.error = self.pid = self.killed_processes = None

    def end(self, status: str, now: float, exit_code: int | None = None) -> None:
        self.status, self.exit_code, self.signal = status, exit_code, signal_name(exit_code)
        self.end_epoch, self.end_time = now, iso(now)
        self.runtime_s = round(now - self.start_epoch, 3) if self.start_epoch is not None else 0.0

    def read_metrics(self) -> None:
        """`metrics` and `final_eval` from the run's metrics.jsonl (None where it has none)."""
        self.metrics, self.final_eval = read_final_metrics(self.out_dir)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(RunRecord)) - {"extra"}


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
    """(last value of every key, last record with eval/ keys) from RUN_DIR/metrics.jsonl, or (None, None)."""
    try:
        records = RunDir(run_dir).read_metrics(missing_ok=True)
    except (OSError, UnicodeDecodeError, DataError):  # a command experiment may write anything there
        return None, None
    final: dict[str, Any] = {}
    last_eval = None
    for record in records:
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

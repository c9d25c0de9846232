"""Main-process metric sinks: metrics.jsonl always, plus accelerate trackers (TensorBoard, W&B, MLflow)."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any, TextIO

import torch

from trainer.rundir import RunDir


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss: one system call (KiB on Linux, bytes on macOS), where psutil reads /proc files.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _clean(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLog:
    """Appends one JSON object per logged step to RUN_DIR/metrics.jsonl."""

    def __init__(self, run_dir: str | Path | RunDir, resume_step: int | None):
        self.run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.path = self.run.metrics
        self._file: TextIO | None = None
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        elif resume_step is None and self.path.exists():
            self.path.unlink()

    def _truncate_after(self, step: int) -> None:
        # Lines logged after the checkpoint we resume from are replayed by the resumed run (the reader
        # also drops a line cut short by the crash we are resuming from).
        # Membership changes stay: they are the run's history, not the replayed trajectory's.
        kept = [r for r in self.run.read_metrics() if r.get("step", 0) <= step or r.get("event") == "membership"]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` as one line, flushed (the file stays open: a logging step costs no open/close)."""
        if self._file is None or self._file.closed:
            self._file = open(self.path, "a")
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


"""Main-process metric sinks: metrics.jsonl always, plus accelerate trackers (TensorBoard, W&B, MLflow)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import psutil
import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return psutil.Process().memory_info().rss / 2**20


def _clean(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLog:
    """Appends one JSON object per logged step to RUN_DIR/metrics.jsonl."""

    def __init__(self, run_dir: str | Path, resume_step: int | None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        elif resume_step is None and self.path.exists():
            self.path.unlink()

    def _truncate_after(self, step: int) -> None:
        # Lines logged after the checkpoint we resume from are replayed by the resumed run.
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:  # a line cut short by the crash we are resuming from
                continue
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

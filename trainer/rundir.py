"""`RunDir`: every path of a run directory, and the one reader of its metrics.jsonl.

```
RUN_DIR/
  config.yaml  plan.json  metrics.jsonl  preempted.json  tb/  plots/  test/  samples/  export/
  checkpoints/  latest  best  step_00000040/ ...
```
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import DataError


@dataclass(frozen=True)
class RunDir:
    """Paths of one run; `RunDir("runs/x").metrics` etc. Nothing is created on construction."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        """The resolved config of the run (`config.yaml`), as loaded."""
        return self.root / "config.yaml"

    @property
    def plan(self) -> Path:
        """What the run derived from its config for its last start: batch layout, steps, lr (`plan.json`)."""
        return self.root / "plan.json"

    @property
    def metrics(self) -> Path:
        """One JSON object per logging step, eval and test (`metrics.jsonl`)."""
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def exported_model(self) -> Path:
        return self.export / "model.safetensors"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tb"

    @property
    def test(self) -> Path:
        """The task's test report (metrics, predictions, plots)."""
        return self.root / "test"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def preempted(self) -> Path:
        """Marker of a run stopped by SIGTERM/SIGUSR1 after its checkpoint (`{"step", "signal"}`)."""
        return self.root / "preempted.json"

    @property
    def lock(self) -> Path:
        """Held by the live run that writes here (host and pid)."""
        return self.root / ".lock"

    def read_metrics(self, missing_ok: bool = False) -> list[dict[str, Any]]:
        """Every record of metrics.jsonl in order. Only the last line may be cut short (by a crash: it is
        skipped); a bad line anywhere else is a DataError naming it."""
        if not self.metrics.is_file():
            if missing_ok:
                return []
            raise DataError(f"no metrics.jsonl in {self.root}: not a run directory, or the run has not logged yet")
        lines = self.metrics.read_text().splitlines()
        records = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                if number == len(lines):  # the last line of a killed run
                    continue
                raise DataError(f"{self.metrics}: line {number} is not JSON ({err})") from None
        return records

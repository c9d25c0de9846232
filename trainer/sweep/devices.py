"""Devices of the runner: the pool of GPU or CPU slots, and what nvidia-smi says each process uses."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

from trainer.sweep.parsing import ExperimentsError


def _gpu_id(text: str) -> int | str:
    return int(text) if text.isdigit() else text


class SlotPool:
    """Free slots handed out lowest-first. GPU slots carry a GPU id; CPU slots only an index.

    `inherit` is the SLURM-task pool: one slot holding whatever devices the allocation made visible.
    """

    def __init__(self, gpus: Sequence[int | str] | None = None, slots: int | None = None, inherit: bool = False):
        self.inherit = inherit
        if inherit:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            self.gpus = [_gpu_id(g.strip()) for g in visible.split(",") if g.strip()]
            self.ids = list(range(max(1, len(self.gpus))))
        elif gpus:
            self.gpus = [_gpu_id(str(g)) for g in gpus]
            if len(set(self.gpus)) != len(self.gpus):
                raise ExperimentsError(f"--gpus lists a GPU twice: {self.gpus}")
            self.ids = list(range(len(self.gpus)))
        else:
            self.gpus = []
            self.ids = list(range(slots or 1))
        self.free = list(self.ids)

    @property
    def gpu_mode(self) -> bool:
        return bool(self.gpus)

    @property
    def capacity(self) -> int:
        return len(self.ids)

    def acquire(self, k: int) -> list[int] | None:
        if self.inherit:
            taken, self.free = self.free, []
            return taken or None
        if len(self.free) < k:
            return None
        taken, self.free = self.free[:k], self.free[k:]
        return taken

    def release(self, slots: Sequence[int]) -> None:
        self.free = sorted(set(self.free) | set(slots))

    def gpus_of(self, slots: Sequence[int], k: int) -> list[int | str]:
        if self.inherit:
            return self.gpus[:k]
        return [self.gpus[s] for s in slots] if self.gpu_mode else []

    def describe(self) -> str:
        if self.inherit:
            return f"inherited devices ({','.join(map(str, self.gpus)) or 'CPU'})"
        if self.gpu_mode:
            return f"{self.capacity} GPU slot(s): {' '.join(map(str, self.gpus))}"
        return f"{self.capacity} CPU slot(s)"


def gpu_memory_by_pid() -> dict[int, float]:
    """MiB used per process according to nvidia-smi; empty when it is missing or fails (best effort)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    usage: dict[int, float] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                usage[int(parts[0])] = usage.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:
                continue
    return usage

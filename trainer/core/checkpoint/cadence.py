"""The time cadence of checkpoints (ckpt.every_seconds), agreed by every rank without waiting on the device.

Each rank's clock crosses the interval at its own moment, and a save is a collective: ranks that disagreed on
the step would wait on each other forever. With several processes the local "time is up" flags are max-reduced
over a gloo group, asynchronously: the reduction started after step k is read after step k+1 (the save then
follows one step after the time is up), so no step waits for it. The group fails a reduction that waits longer
than run.collective_timeout_s (`timeout_s`; 0: torch's default), as the run's own groups do.
"""

from __future__ import annotations

import datetime
import time

import torch


class SaveClock:
    """`due()` after every step on every rank: True on all of them at the same step once `every_s` seconds have
    passed since the last `reset()` (a save); never with `every_s` 0."""

    def __init__(self, every_s: float, world_size: int, timeout_s: float = 0.0):
        self.every_s, self.world_size = every_s, world_size
        self._since = time.monotonic()
        self._flag = torch.zeros(1)
        self._pending = None
        self._group = None
        if every_s > 0 and world_size > 1:
            import torch.distributed as dist

            timeout = datetime.timedelta(seconds=timeout_s) if timeout_s > 0 else None
            self._group = dist.new_group(backend="gloo", timeout=timeout)

    def due(self) -> bool:
        if self.every_s <= 0:
            return False
        up = time.monotonic() - self._since >= self.every_s
        if self._group is None:
            return up
        import torch.distributed as dist

        agreed = False
        if self._pending is not None:
            self._pending.wait()
            agreed = self._flag.item() > 0
        self._flag = torch.tensor([1.0 if up and not agreed else 0.0])
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    def reset(self) -> None:
        self._since = time.monotonic()

    def close(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

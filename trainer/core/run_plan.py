"""The run's plan: what a run derives from its config, frozen, beside the config rather than in it.

The config stays as loaded (and config.yaml in the run directory is that config). What the run makes of it
for this launch (the batch layout for this world size and the checkpoint it resumes, epochs turned into
optimizer steps, the lr and warm-up scaled to the world size, the eval and checkpoint cadence, the metric
that selects the best checkpoint) is a `RunPlan`, built once at start from config + checkpoint + world
size, logged on the main process and written to plan.json beside config.yaml. The loop, the schedule, the
loaders, the engine and the logger take the plan.

It is built in two steps because the epoch length needs the data loaders, which need the batch layout:
`plan_batch` (batch_plan.py) before the Accelerator exists, `build_run_plan` once the training batches are.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import Config, ConfigError
from trainer.core.batch_plan import BatchPlan
from trainer.core.distributed import scale_factor


@dataclass(frozen=True)
class RunPlan:
    """What this run trains with, derived from the config (which it leaves as loaded)."""

    batch: BatchPlan
    """Per-device batch, accumulation, world size and global batch (the checkpoint's, when resuming)."""
    resume_from: str | None
    """The checkpoint whose batch layout the plan keeps (None: a fresh start, or nothing to resume)."""
    steps_per_epoch: int | None
    """Optimizer steps per epoch of map-style data (None: a stream, which has no epoch length)."""
    max_steps: int
    """Optimizer steps of the whole run (train.epochs turned into steps when given)."""
    eval_every_steps: int
    """Evaluate every this many steps (0: at the end only)."""
    ckpt_every_steps: int
    """Checkpoint every this many steps (0: at the end and on improvements only)."""
    decay_every_steps: int
    """optim.scheduler=step: steps between two lr decays."""
    lr: float
    """The peak learning rate, scaled to the world size (optim.scale_lr)."""
    warmup_steps: int
    """Warm-up optimizer steps, scaled with the lr when optim.scale_warmup."""
    eval_metric: str
    """The eval metric that selects the best checkpoint."""
    ckpt_every_seconds: float = 0.0
    """Also checkpoint once this many seconds passed since the last checkpoint (0: no time cadence)."""

    @property
    def per_device_batch_size(self) -> int:
        return self.batch.per_device_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.batch.grad_accum_steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for the start log (the batch, the lr and the checkpoint resumed have their own lines)."""
        # A plan that covers a sliver of an epoch (a pool of prompts far larger than the run) is said in steps alone.
        epochs = f" ({self.max_steps / self.steps_per_epoch:.3g} epochs of {self.steps_per_epoch} steps)" \
            if self.steps_per_epoch and self.max_steps >= 0.01 * self.steps_per_epoch else ""
        timed = f" and every {self.ckpt_every_seconds:g} s" if self.ckpt_every_seconds else ""
        return (f"plan: {self.max_steps} steps{epochs}, eval {_cadence(self.eval_every_steps)}, checkpoint "
                f"{_cadence(self.ckpt_every_steps)}{timed}, best by {self.eval_metric}")

    def write(self, path: Path) -> None:
        """plan.json in the run directory (beside config.yaml, the config as loaded)."""
        from trainer.atomic_io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")


def build_run_plan(cfg: Config, batch: BatchPlan, batches_per_epoch: int | None, metrics: tuple[str, ...] = (),
                   resume_from: str | Path | None = None) -> RunPlan:
    """The run's plan from `cfg`, its batch layout (`plan_batch`), the micro-batches of this rank per epoch
    (None for a stream), the task's metric names (eval.metric's default) and the checkpoint the layout came from.

    Raises ConfigError when an *.every_epochs / train.epochs setting meets data without an epoch length."""
    o = cfg.optim
    uses_epochs = bool(cfg.train.epochs or cfg.eval.every_epochs or cfg.ckpt.every_epochs or o.decay_every_epochs)
    if uses_epochs and batches_per_epoch is None:
        raise ConfigError("train.epochs / *.every_epochs need map-style data: a stream has no epoch length")
    per_epoch = None if batches_per_epoch is None else max(1, batches_per_epoch // batch.grad_accum_steps)

    def in_steps(epochs: float, given_steps: int, rounding: Any = round) -> int:  # epochs, when given, win
        return max(1, rounding(epochs * per_epoch)) if epochs else given_steps

    factor = scale_factor(o.scale_lr, batch.lr_world_size, o.base_world_size)
    return RunPlan(
        batch=batch, resume_from=None if resume_from is None else str(resume_from), steps_per_epoch=per_epoch,
        max_steps=in_steps(cfg.train.epochs, cfg.train.max_steps, math.ceil),
        eval_every_steps=in_steps(cfg.eval.every_epochs, cfg.eval.every_steps),
        ckpt_every_steps=in_steps(cfg.ckpt.every_epochs, cfg.ckpt.every_steps),
        decay_every_steps=in_steps(o.decay_every_epochs, o.decay_every_steps),
        lr=o.lr * factor, warmup_steps=round(o.warmup_steps * (factor if o.scale_warmup else 1.0)),
        eval_metric=cfg.eval.metric or (metrics[0] if metrics else ""), ckpt_every_seconds=cfg.ckpt.every_seconds)


def _cadence(every_steps: int) -> str:
    return f"every {every_steps} steps" if every_steps else "at the end"

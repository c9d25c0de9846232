"""The global batch is the invariant: per-device batch x accumulation x world size, planned before launch.

A run's global batch is `train.global_batch_size` when given (the accumulation then follows from the
per-device batch and the world size), else per-device x accumulation x world size. A resumed run keeps
its checkpoint's global batch whatever the number of processes now: it changes the accumulation (or,
when that cannot divide, the per-device batch) and says what it changed. With the global batch kept,
map-style data continues at the same global sample (samplers.py: an epoch is whole global batches) and
the learning rate and warm-up keep the scaling the run started with.

The plan is made before the Accelerator exists (its accumulation plugin and a DeepSpeed json's
"auto" values are filled from it), from the config, the launcher's WORLD_SIZE and the batch layout of the
checkpoint the run resumes (`ResumeTarget.batch_layout`, checkpoint/target.py). The config is left as loaded:
the layout lives in the frozen `BatchPlan`, part of the run's `RunPlan` (run_plan.py), which the components take.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from trainer.config import Config, ConfigError
from trainer.core.elastic_launch import sizes_that_keep

logger = logging.getLogger("trainer")


@dataclass(frozen=True)
class BatchPlan:
    """What this run trains with, and what the checkpoint it resumes asked for."""

    per_device_batch_size: int
    """Micro-batch size per process (train.per_device_batch_size, or what keeps the global batch)."""
    grad_accum_steps: int
    """Micro-batches per optimizer step."""
    world_size: int
    """Processes the plan was made for."""
    global_batch: int
    """per_device_batch_size x grad_accum_steps x world_size."""
    lr_world_size: int
    """The world size the lr / warm-up scaling refers to: the run's first (optim.scale_lr)."""
    changes: tuple[str, ...] = ()
    """What was changed to keep the checkpoint's global batch, for the start log (empty: nothing)."""


def launch_world_size() -> int:
    """The number of processes the launcher started (1 for a plain `python` run)."""
    return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))


def plan_batch(cfg: Config, world: int | None = None, saved: dict | None = None) -> BatchPlan:
    """The per-device batch and accumulation for `world` processes (see the module docstring).

    `saved`: the batch layout of the checkpoint the run resumes (`ResumeTarget.batch_layout`), None or empty for
    a fresh start. Raises a one-line ConfigError when the global batch cannot be kept, or the user asked for
    another one than the checkpoint's."""
    t = cfg.train
    world = launch_world_size() if world is None else world
    per_device, accum = t.per_device_batch_size, t.grad_accum_steps
    if t.global_batch_size > 0:
        per_device, accum = _split(per_device, t.global_batch_size, world, "train.global_batch_size")
    if not saved:
        return BatchPlan(per_device, accum, world, per_device * accum * world, world)
    was = (saved["per_device_batch_size"], saved["grad_accum_steps"], saved["world_size"])
    kept = int(saved.get("global_batch_size") or was[0] * was[1] * was[2])
    asked = per_device * accum * world
    if t.global_batch_size > 0 and t.global_batch_size != kept:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size}, but the checkpoint this run resumes was "
                          f"trained with a global batch of {kept} ({was[0]} per device x {was[1]} accumulation x "
                          f"{was[2]} processes); resume with train.global_batch_size={kept}, or start over with "
                          f"run.resume=none")
    changes = ()
    if asked != kept:
        before = (per_device, accum)
        per_device, accum = _split(per_device, kept, world, f"the checkpoint's global batch ({was[0]} per device x "
                                                            f"{was[1]} accumulation x {was[2]} processes)")
        changes = (f"kept the checkpoint's global batch of {kept} on {world} process(es): "
                   f"per-device batch {before[0]} -> {per_device}, train.grad_accum_steps "
                   f"{before[1]} -> {accum} (was {was[0]} x {was[1]} x {was[2]} processes)",)
    lr_world = int(saved.get("lr_world_size") or saved["world_size"])
    return BatchPlan(per_device, accum, world, kept, lr_world, changes)


def _split(per_device: int, global_batch: int, world: int, source: str) -> tuple[int, int]:
    """(per-device batch, accumulation) with per-device x accumulation x world == `global_batch`: the
    per-device batch kept if it divides, else the nearest smaller one that does."""
    if global_batch % world:
        sizes = ", ".join(map(str, sizes_that_keep(global_batch)))
        raise ConfigError(f"{source}: a global batch of {global_batch} cannot be split evenly over {world} "
                          f"processes; the sizes that keep it: {sizes} processes (or start over with another "
                          f"train.global_batch_size)")
    per_rank = global_batch // world
    if per_rank % per_device:
        per_device = max(d for d in range(1, min(per_device, per_rank) + 1) if per_rank % d == 0)
    return per_device, per_rank // per_device

"""The public Python API over the core, for scripts and the front ends (families import neither it nor the core).

Every public import name, in one place:

    from trainer.api import train, under_launcher, RunResult, LaunchError, CheckpointError
    from trainer.api import load_exported, consolidated_weights, read_task_stats
    from trainer.frontends.crystals import train_from_list, train_from_extxyz, write_structures_extxyz, read_results
    from trainer.frontends.perturbation import train_multi_gpu, predict, plot_condition, load_gears_model, read_results

Training: `train(cfg, num_processes=1, deepspeed_config=None, *, gpu_ids=None) -> RunResult` trains a
config in this process, or on N local processes it starts through `torch.distributed.run --standalone`,
or in place on every rank when a launcher started this process (`under_launcher()`); `RunResult.read(run_dir)`
reads a run directory's results. Trained models: `load_exported(path)` (an export's model and config),
`consolidated_weights(run_dir, checkpoint)` (a checkpoint's full state dict and directory),
`read_task_stats(directory)` (the task statistics saved beside them).

Front ends (`trainer.frontends`): a family's users' own API over `train`, above the core and the families in
the import graph: ComFormer's `train_from_list` / `train_from_extxyz` (crystals, `crystal_property`) and GEARS'
`train_multi_gpu` / `predict` / `plot_condition` / `load_gears_model` (perturbation, `perturbation_gears`).

The core is imported on first use of a name, so importing this module is cheap (no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainer.errors import CheckpointError, LaunchError

if TYPE_CHECKING:
    from trainer.core.checkpoint.export import consolidated_weights, load_exported, read_task_stats
    from trainer.core.launch import RunResult, train, under_launcher

__all__ = ["CheckpointError", "LaunchError", "RunResult", "consolidated_weights", "load_exported", "read_task_stats",
           "train", "under_launcher"]

_LAZY = {"RunResult": "trainer.core.launch", "train": "trainer.core.launch", "under_launcher": "trainer.core.launch",
         "consolidated_weights": "trainer.core.checkpoint.export", "load_exported": "trainer.core.checkpoint.export",
         "read_task_stats": "trainer.core.checkpoint.export"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

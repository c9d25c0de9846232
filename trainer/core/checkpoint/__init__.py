"""Checkpoints: writing them atomically, resuming them under any backend, exporting them.

- `store`: the files of a checkpoint: temp folder, manifest (sizes, sha256), rename, pointers, rotation;
- `target`: the checkpoint a run resumes, picked and verified once (`pick_resume_target`, a frozen
  `ResumeTarget` that the batch plan and the Checkpointer take);
- `parts`: the `Stateful` parts of the training state (backend, train state, data position, EMA, ...);
- `manager`: the `Checkpointer`, which saves and restores the parts in one loop;
- `agreement`: what every rank agrees on, and a failure in one line (`failure_reason`);
- `convert`: the topology-free (universal) form, so any backend resumes any other's checkpoint;
- `export`: one fp32 safetensors file of a checkpoint, loadable without the trainer's backends;
- `safe_load`: weights-only loading of every pickle a checkpoint holds.

Importing this package is light (the file-level API below); the rest loads with its module.
"""

from __future__ import annotations

from trainer.core.checkpoint.store import (
    best_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    resolve_checkpoint,
    verify_checkpoint,
)
from trainer.core.checkpoint.target import ResumeTarget, pick_resume_target
from trainer.errors import CheckpointError

__all__ = ["CheckpointError", "ResumeTarget", "best_checkpoint", "latest_checkpoint", "list_checkpoints",
           "pick_resume_target", "resolve_checkpoint", "verify_checkpoint"]

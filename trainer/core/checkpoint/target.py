"""The checkpoint a run resumes, picked and verified once (`pick_resume_target`), before anything is built.

run.resume names it: `auto` (the most recently completed checkpoint that passes verification, older ones in
turn), `none` (a fresh start) or a path. The pick reads the files and nothing else (no process group yet:
it runs before the Accelerator, since the batch plan needs the checkpoint's batch layout), and returns a
frozen `ResumeTarget`; the batch plan and the Checkpointer take it as it is and never read run.resume
again. Every rank picks on its own (the files are the same for all); the Checkpointer makes them agree.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from trainer.core.checkpoint import store
from trainer.errors import CheckpointError

if TYPE_CHECKING:
    from trainer.config import Config
    from trainer.rundir import RunDir

logger = logging.getLogger("trainer")

BATCH_LAYOUT = ("world_size", "grad_accum_steps", "per_device_batch_size")
"""What a checkpoint must record for a resume on another world size to keep its global batch (batch_plan.py)."""


@dataclass(frozen=True)
class ResumeTarget:
    """What run.resume resolved to: a checkpoint verified on this rank and its trainer state, or a fresh start."""

    mode: str
    """run.resume as given: `auto`, `none` or a path."""
    path: Path | None = None
    """The checkpoint to resume; None: a fresh start (or `problem` says why none can be resumed)."""
    saved: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The checkpoint's trainer_state.json (read-only)."""
    candidates: tuple[Path, ...] = ()
    """The checkpoints considered, in the order tried (run.resume=auto: the most recently completed first)."""
    skipped: tuple[str, ...] = ()
    """Why each checkpoint-like folder passed over was passed over (the Checkpointer reports them)."""
    corrupt: tuple[Path, ...] = ()
    """Checkpoints passed over because they failed verification (run.resume=auto sets them aside on resume)."""
    problem: str | None = None
    """Why no checkpoint can be resumed (raised by the Checkpointer, on every rank at once)."""

    @property
    def step(self) -> int:
        return int(self.saved.get("step", 0)) if self.path is not None else 0

    @property
    def batch_layout(self) -> dict[str, Any] | None:
        """The batch layout the checkpoint was trained with (per device x accumulation x world size, the global
        batch), for the batch plan; None for a fresh start or a checkpoint that records no layout. Checkpoints of
        older versions record no per-device batch: the run's saved config gives it."""
        if self.path is None:
            return None
        state = dict(self.saved)
        if "per_device_batch_size" not in state:
            state["per_device_batch_size"] = _configured_per_device(self.path)
        if not all(isinstance(state.get(k), int) for k in BATCH_LAYOUT):
            return None
        return state


def pick_resume_target(cfg: Config) -> ResumeTarget:
    """Resolve run.resume to a verified checkpoint (or a fresh start) on this rank, reading files only.

    Never raises for a checkpoint problem: a rank alone must not stop while the others go on to wait for it
    (the Checkpointer raises `problem` on every rank at once)."""
    mode, root = cfg.run.resume, Path(cfg.run.output_dir) / "checkpoints"
    if mode == "none":
        return ResumeTarget(mode)
    # Hashes are read by each node's first process only: the files are the same for the node's other ranks.
    check_hashes = cfg.ckpt.verify and int(os.environ.get("LOCAL_RANK", "0") or 0) == 0
    skipped: list[str] = []
    if mode == "auto":
        candidates = store.resume_candidates(root)
        if int(os.environ.get("RANK", "0") or 0) == 0:  # the folders are the same for every rank: one report
            skipped = store.skipped_checkpoints(root)
        if not candidates:
            return ResumeTarget(mode, skipped=tuple(skipped))
    else:
        try:
            candidates = [store.resolve_checkpoint(mode)]
        except CheckpointError as err:
            return ResumeTarget(mode, problem=str(err))
    corrupt: list[Path] = []
    for path in candidates:
        try:
            saved = store.verify_checkpoint(path, check_hashes=check_hashes)
        except CheckpointError as err:
            if mode != "auto" or path == candidates[-1]:
                return ResumeTarget(mode, candidates=tuple(candidates), skipped=tuple(skipped),
                                    corrupt=tuple(corrupt), problem=str(err))
            skipped.append(str(err))
            corrupt.append(path)
            continue
        return ResumeTarget(mode, path, MappingProxyType(saved), tuple(candidates), tuple(skipped), tuple(corrupt))
    raise AssertionError("unreachable: the last candidate returns")


def passed_over(target: ResumeTarget, path: Path, reason: str) -> ResumeTarget:
    """`target` with `path` passed over for `reason` (another rank refused it)."""
    return dataclasses.replace(target, skipped=(*target.skipped, reason), corrupt=(*target.corrupt, path))


def _configured_per_device(path: Path) -> int | None:
    import yaml

    config = path.parents[1] / "config.yaml"  # RUN_DIR/checkpoints/step_N -> RUN_DIR/config.yaml
    try:
        return int((yaml.safe_load(config.read_text()) or {}).get("train", {}).get("per_device_batch_size"))
    except (OSError, TypeError, ValueError, AttributeError):
        return None


def warn_skipped(reasons: tuple[str, ...] | list[str], then: str) -> None:
    for reason in reasons:
        logger.warning("%s; skipped it, %s", reason, then)


def warn_changed_task(run_dir: RunDir, cfg: Config, path: Path) -> None:
    """Resuming a run whose task settings (data, targets, model) changed mixes two experiments: say so loudly."""
    saved_file = run_dir.config
    if not saved_file.is_file():
        return
    import yaml

    saved = (yaml.safe_load(saved_file.read_text()) or {}).get("task", {})
    now = dataclasses.asdict(cfg.task)
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if changed:
        logger.warning("RESUMING A CHANGED RUN: checkpoint %s was trained with other task settings (%s: %s); "
                       "the resumed run mixes the two. Use run.resume=none or a new run.output_dir to start over",
                       path, ", ".join(f"task.{k}" for k in changed),
                       ", ".join(f"{saved.get(k)!r} -> {now.get(k)!r}" for k in changed))

"""The checkpointer's helpers: save errors every rank agrees on, verification, RNG states, pointers.

`Checkpointer` (checkpointer.py) saves and restores the run's parts; this module holds what it needs
around them: `SaveErrors` (a failed save is one line on every rank, the temp folder removed),
`verify_everywhere` (every rank checks the manifest and all agree), the RNG states of every rank
(checked before loading, restored after), the pointers a kill may leave stale, and setting old
checkpoints aside for run.resume=none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import shutil
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.utils import gather_object
from accelerate.utils import load as accelerate_load

from trainer.atomic_io import disk_bytes, format_bytes, free_bytes, no_space_reason
from trainer.core import checkpoint as ckpt
from trainer.core.safe_load import weights_only_loading
from trainer.errors import CheckpointError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from trainer.config import Config
    from trainer.rundir import RunDir

logger = logging.getLogger("trainer")


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def agree(acc: Accelerator, problem: str | None) -> None:
    """Every rank raises the same CheckpointError when any rank has a problem (a collective)."""
    problems = [problem] if problem else []
    if acc.num_processes > 1:
        problems = [p for p in gather_object([problem]) if p is not None]
    if problems:
        raise CheckpointError(problems[0])


class SaveErrors:
    """The first error of this rank's part of a save; `agree()` (a barrier) makes every rank raise the same
    one-line CheckpointError, so a full disk or a read-only directory on one rank leaves no rank waiting,
    and removes the unfinished temp directory. Earlier checkpoints are never touched by a failed save.

    A full disk is named as such, however the writer reported it (OSError, safetensors' error or torch's
    "unexpected pos"), with the free space once the temp directory is gone and an estimate of the size."""

    def __init__(self, acc: Accelerator, root: Path, tmp: Path):
        self.acc, self.root, self.tmp = acc, root, tmp
        self.previous = ckpt.latest_checkpoint(root)  # before this save: what a failure leaves as the latest
        self.error: str | None = None
        self.cause: Exception | None = None

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        try:
            yield
        except Exception as err:  # noqa: BLE001 - disk errors surface as OSError, RuntimeError, SafetensorError
            if self.error is None:
                self.error = f"rank {self.acc.process_index}: {self._describe(err)}"
                self.cause = err

    def _describe(self, err: Exception) -> str:
        filename = err.filename if isinstance(err, OSError) and err.filename else None
        full = no_space_reason(err)
        if full is not None:  # torch's and safetensors' errors name no file: the folder then
            # The failed writer's frames hold its open file: clear them, so the space is freed with the folder.
            chained: BaseException | None = err
            while chained is not None:
                traceback.clear_frames(chained.__traceback__)
                chained = chained.__cause__ or chained.__context__
            return f"{full} writing {filename or self.tmp} ({format_bytes(disk_bytes(self.tmp))} of it written)"
        if filename:
            return f"{filename}: {err.strerror}"
        text = str(err).strip()
        return f"{type(err).__name__}: {text.splitlines()[0] if text else '(no message)'}"

    def _space(self) -> str:
        """Free space after the temp directory is removed, and how much the checkpoint needs (estimated)."""
        free = f"{format_bytes(free_bytes(self.root))} free in {self.root} now"
        if self.previous is None:
            return f"{free}, the checkpoint needs more than was written"
        return (f"{free}, the checkpoint needs about {format_bytes(disk_bytes(self.previous))} (estimate: the "
                f"previous checkpoint's size)")

    def agree(self) -> None:
        problems = [self.error] if self.error else []
        if self.acc.num_processes > 1:
            problems = [p for p in gather_object([self.error]) if p is not None]
        if not problems:
            return
        if self.acc.is_main_process:
            shutil.rmtree(self.tmp, ignore_errors=True)
        space = ""
        if any(reason in p for p in problems for reason in ("no space left on device", "disk quota exceeded")):
            if self.acc.num_processes > 1:
                self.acc.wait_for_everyone()  # the temp directory is gone before any rank measures
            space = f"; {self._space()}"
        kept = f"the previous checkpoint {self.previous} is intact" if self.previous else "no earlier checkpoint exists"
        raise CheckpointError(f"could not save checkpoint {self.tmp.name.removeprefix('.tmp-')} "
                              f"({'; '.join(problems)}){space}; {kept}") from self.cause


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


def warn_skipped(reasons: list[str], then: str) -> None:
    for reason in reasons:
        logger.warning("%s; skipped it, %s", reason, then)


def repair_pointers(root: Path, path: Path) -> None:
    """A kill while a save was finalised can leave `latest` one behind or `best` stale: set them right."""
    try:
        repaired = ckpt.repair_pointers(root, path)
    except OSError as err:  # a read-only directory: the next save reports it
        logger.warning("could not repair the checkpoint pointers under %s: %s", root, err)
        return
    if repaired:
        logger.warning("checkpoint pointers repaired (a save was interrupted while it was finalised): %s",
                       ", ".join(repaired))


RNG_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")
"""What accelerate saves in `random_states_<rank>.pkl` and a resume restores (plus the CUDA states on GPUs)."""


def saved_rng_states(acc: Accelerator, path: Path, saved_world_size: int | None,
                     allow_inexact: bool) -> dict[str, Any] | None:
    """This rank's RNG states, loaded and checked before `load_state`, which swallows any error there
    (logging it at INFO) and resumes with other random streams. Every rank agrees: an unloadable state
    on any rank is a CheckpointError naming the file, or with run.allow_inexact_resume a warning (None).
    A rank beyond the world size that wrote the checkpoint (DDP may grow) starts fresh streams (None)."""
    name = f"random_states_{acc.process_index}.pkl"
    states, problem = None, None
    if isinstance(saved_world_size, int) and acc.process_index >= saved_world_size:
        logger.warning("rank %d has no saved RNG state (the checkpoint was written by %d processes): it "
                       "continues with fresh random streams", acc.process_index, saved_world_size)
    else:
        try:
            states = _load_rng_states(path / name)
        except Exception as err:  # noqa: BLE001 - whatever it is, the random streams cannot be restored
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]  # torch's are paragraphs long
            problem = (f"checkpoint {path}: {name} (rank {acc.process_index}'s RNG state) cannot be restored "
                       f"({reason})")
    problems = [problem] if problem else []
    if acc.num_processes > 1:
        problems = [p for p in gather_object([problem]) if p is not None]
    if not problems:
        return states
    if not allow_inexact:
        raise CheckpointError(f"{'; '.join(problems)}; the resume would not be exact. Set "
                              f"run.allow_inexact_resume=true to resume with fresh random streams anyway")
    if problem is not None:
        logger.warning("INEXACT RESUME (run.allow_inexact_resume=true): %s; this rank continues with fresh "
                       "random streams, so dropout and noise differ from an uninterrupted run", problem)
    return None


def _load_rng_states(file: Path) -> dict[str, Any]:
    with weights_only_loading():
        states = accelerate_load(file)
    keys = RNG_KEYS + (("torch_cuda_manual_seed",) if torch.cuda.is_available() else ())
    missing = [k for k in keys if k not in states] if isinstance(states, dict) else list(keys)
    if missing:
        raise ValueError(f"it lacks {', '.join(missing)}")
    # Applied to throwaway generators: a state of the wrong shape fails here, not after load_state.
    random.Random().setstate(states["random_state"])
    np.random.RandomState().set_state(states["numpy_random_seed"])
    torch.Generator().set_state(states["torch_manual_seed"])
    return states


def restore_rng(states: dict[str, Any]) -> None:
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available():  # per visible device, as saved (fewer devices now: those there are)
        for device, state in enumerate(states["torch_cuda_manual_seed"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


def verify_everywhere(acc: Accelerator, path: Path, check_hashes: bool) -> tuple[dict, str | None]:
    """Verify on every rank (hashes on each node's main rank) and agree: one bad rank fails all.

    Returns (the saved trainer state, None) or ({}, the problem)."""
    saved, problem = {}, None
    try:
        saved = ckpt.verify_checkpoint(path, check_hashes=check_hashes and acc.is_local_main_process)
    except CheckpointError as err:
        problem = str(err)
    if acc.num_processes > 1:
        failed = acc.reduce(torch.tensor(float(problem is not None), device=acc.device), reduction="sum")
        if problem is None and float(failed) > 0:
            problem = f"checkpoint {path} failed verification on another rank"
    return saved, problem


def set_aside_old_checkpoints(acc: Accelerator, root: Path) -> None:
    """run.resume=none in a directory with checkpoints: keep them, but out of this run's way."""
    if acc.is_main_process and ckpt.list_checkpoints(root):
        aside = root.with_name(f"checkpoints.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        root.rename(aside)
        logger.warning("run.resume=none: the existing checkpoints were moved to %s", aside)
    acc.wait_for_everyone()

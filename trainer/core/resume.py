"""Saving a run's checkpoints and resuming from them: the orchestration around `checkpoint.py`.

`save_checkpoint` writes `.tmp-step_N/` on every rank (accelerate's state, the EMA, the task's
artifacts), completes it with `trainer_state.json` and the manifest, renames it into place and only
then moves `latest`. `resume` picks a checkpoint (run.resume), has every rank verify it and agree,
and restores model, optimizer, RNGs, schedule, EMA, the guard's counters and a stream's position.
The data position of map-style data is not saved: it follows from the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import shutil
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.utils import gather_object
from accelerate.utils import load as accelerate_load
from safetensors.torch import load_file, save_file

from trainer.atomic_io import disk_bytes, format_bytes, free_bytes, no_space_reason
from trainer.core import checkpoint as ckpt
from trainer.core.distributed import unwrap_model
from trainer.core.safe_load import weights_only_loading
from trainer.errors import CheckpointError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from trainer.core.trainer import Trainer

logger = logging.getLogger("trainer")


@dataclass
class TrainState:
    """What a checkpoint records besides model/optimizer/scheduler/RNG. The batch layout (per-device x
    accumulation x world size = global batch) lets a resume on another world size keep the global batch
    (batch_plan.py); map-style data continues at global sample step x global batch."""

    step: int = 0
    best_metric: float | None = None
    best_step: int | None = None
    nonfinite_skipped: int = 0
    world_size: int = 1
    backend: str = ""
    grad_accum_steps: int = 1
    per_device_batch_size: int = 0
    global_batch_size: int = 0
    lr_world_size: int = 1
    """The world size the lr and warm-up scaling (optim.scale_lr) refer to: the run's first."""


def save_checkpoint(trainer: Trainer, best: bool = False) -> Path:
    """Write a complete checkpoint of `trainer` atomically (every rank takes part) and rotate old ones."""
    acc, root = trainer.accelerator, trainer.run_dir.checkpoints
    name = ckpt.step_dir_name(trainer.state.step)
    tmp, final = root / f".tmp-{name}", root / name
    errors = _SaveErrors(acc, root, tmp)
    if acc.is_main_process:
        with errors.record():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    errors.agree()
    with errors.record():
        acc.save_state(str(tmp), safe_serialization=True)
    if trainer.ema is not None:
        full = trainer.ema.full_state(unwrap_model(acc, trainer.model), acc.gather)  # fp32, collective
        if acc.is_main_process:
            with errors.record():
                save_file(full, str(tmp / "ema.safetensors"))
    errors.agree()
    positions = [list(trainer.data.position)]
    if trainer.data.streaming and acc.num_processes > 1:
        positions = gather_object(positions)  # collective: every rank is in save()
    if acc.is_main_process:
        with errors.record():
            (tmp / ckpt.TASK_STATS).write_text(json.dumps(trainer.task.stats, indent=1))
            artifacts = [ckpt.TASK_STATS, *trainer.task.save_artifacts(tmp)]
            state = {**dataclasses.asdict(trainer.state), "scheduler": trainer.scheduler.state_dict(),
                     "data_positions": positions, "artifacts": artifacts}
            ckpt.write_manifest(tmp, state, with_hashes=trainer.cfg.ckpt.verify)
            ckpt.finalize(tmp, final, root, best=best)
        if errors.error is None:
            try:
                ckpt.rotate(root, trainer.cfg.ckpt.keep_last)
            except OSError as err:  # the new checkpoint is complete: old ones left behind are no error
                logger.warning("could not remove old checkpoints under %s: %s", root, err)
    errors.agree()
    return final


class _SaveErrors:
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


def _warn_changed_task(trainer: Trainer, path: Path) -> None:
    """Resuming a run whose task settings (data, targets, model) changed mixes two experiments: say so loudly."""
    saved_file = trainer.run_dir.config
    if not saved_file.is_file():
        return
    import yaml

    saved = (yaml.safe_load(saved_file.read_text()) or {}).get("task", {})
    now = dataclasses.asdict(trainer.cfg.task)
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if changed:
        logger.warning("RESUMING A CHANGED RUN: checkpoint %s was trained with other task settings (%s: %s); "
                       "the resumed run mixes the two. Use run.resume=none or a new run.output_dir to start over",
                       path, ", ".join(f"task.{k}" for k in changed),
                       ", ".join(f"{saved.get(k)!r} -> {now.get(k)!r}" for k in changed))


def resume(trainer: Trainer) -> Path | None:
    """Restore `trainer` from the checkpoint run.resume names; returns it, or None for a fresh start."""
    cfg, acc, root = trainer.cfg, trainer.accelerator, trainer.run_dir.checkpoints
    mode = cfg.run.resume
    if mode == "none":
        set_aside_old_checkpoints(acc, root)
        return None
    skipped: list[str] = []  # nothing is passed over silently
    if mode == "auto":
        candidates = ckpt.resume_candidates(root)
        if acc.is_main_process:  # the folders are the same for every rank: one report
            skipped = ckpt.skipped_checkpoints(root)
        if not candidates:
            _warn_skipped(skipped, "no complete checkpoint: starting from step 0")
            return None
    else:
        candidates = [ckpt.resolve_checkpoint(mode)]
    for i, path in enumerate(candidates):
        saved, problem = verify_everywhere(acc, path, check_hashes=cfg.ckpt.verify)
        if problem is None:
            break
        if mode != "auto" or i == len(candidates) - 1:
            _warn_skipped(skipped, "no checkpoint is left to resume from")
            raise CheckpointError(problem)
        skipped.append(problem)  # every rank: one that fails on rank 1 only says why there
    _warn_skipped(skipped, f"resuming from {path.name}")
    _check_compatible(trainer, path, saved)
    _warn_changed_task(trainer, path)
    rng_states = _saved_rng_states(trainer, path, saved.get("world_size"))
    try:
        with weights_only_loading():  # DeepSpeed unpickles its own files with weights_only=False
            acc.load_state(str(path))
    except CheckpointError:  # a pickle that weights-only loading refuses
        raise
    except Exception as err:  # a checkpoint that passed its manifest but will not load
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"checkpoint {path} could not be loaded into this run's model ({first}); if the "
                              f"model or task settings changed, start over with run.resume=none or a new "
                              f"run.output_dir") from err
    if rng_states is not None:  # accelerate restores them too, but ignores any failure
        _restore_rng(rng_states)
    acc.step = 0  # accumulation boundaries restart with each optimizer step, whatever accum was
    trainer.scheduler.load_state_dict(saved.pop("scheduler"))
    stats_file = path / ckpt.TASK_STATS
    if stats_file.is_file():  # the model was trained with the checkpoint's statistics: keep using them
        saved_stats = json.loads(stats_file.read_text())
        if saved_stats != trainer.task.stats:
            logger.warning("the training data's statistics (%s) differ from those of checkpoint %s: the resumed "
                           "run keeps the checkpoint's, which its weights were trained with", ckpt.TASK_STATS, path)
            trainer.task.attach_stats(saved_stats)
    _restore_stream_position(trainer, saved.pop("data_positions", None))
    fields = {f.name for f in dataclasses.fields(TrainState)}
    trainer.state = TrainState(**{k: v for k, v in saved.items() if k in fields})
    trainer.state.world_size, trainer.state.backend = acc.num_processes, str(acc.distributed_type.value)
    trainer.state.grad_accum_steps = cfg.train.grad_accum_steps
    trainer.state.per_device_batch_size = cfg.train.per_device_batch_size
    trainer.state.global_batch_size = cfg.train.per_device_batch_size * cfg.train.grad_accum_steps * acc.num_processes
    trainer.state.lr_world_size = trainer.batch_plan.lr_world_size
    trainer.engine.after_resume()
    if trainer.ema is not None:
        ema_file = path / "ema.safetensors"
        if not ema_file.is_file():
            raise CheckpointError(f"checkpoint {path} has no ema.safetensors but train.ema_decay > 0")
        trainer.ema.load_full(unwrap_model(acc, trainer.model), load_file(ema_file), acc.process_index,
                              num_updates=trainer.state.step)
    if mode == "auto" and acc.is_main_process:
        _repair_pointers(root, path)
    return path


def _warn_skipped(reasons: list[str], then: str) -> None:
    for reason in reasons:
        logger.warning("%s; skipped it, %s", reason, then)


def load_weights(trainer: Trainer, path: Path) -> None:
    """Load a checkpoint's model weights (and EMA) into a trained `trainer`, e.g. the best one for the test
    pass. accelerate restores the whole saved state (optimizer, RNG) with them: harmless after training."""
    acc = trainer.accelerator
    _, problem = verify_everywhere(acc, path, check_hashes=trainer.cfg.ckpt.verify)
    if problem is not None:
        raise CheckpointError(problem)
    with weights_only_loading():
        acc.load_state(str(path))
    if trainer.ema is not None:
        trainer.ema.load_full(unwrap_model(acc, trainer.model), load_file(path / "ema.safetensors"), acc.process_index,
                              num_updates=trainer.state.step)


def _repair_pointers(root: Path, path: Path) -> None:
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


def _saved_rng_states(trainer: Trainer, path: Path, saved_world_size: int | None) -> dict[str, Any] | None:
    """This rank's RNG states, loaded and checked before `load_state`, which swallows any error there
    (logging it at INFO) and resumes with other random streams. Every rank agrees: an unloadable state
    on any rank is a CheckpointError naming the file, or with run.allow_inexact_resume a warning (None).
    A rank beyond the world size that wrote the checkpoint (DDP may grow) starts fresh streams (None)."""
    acc = trainer.accelerator
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
    if not trainer.cfg.run.allow_inexact_resume:
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


def _restore_rng(states: dict[str, Any]) -> None:
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available():  # per visible device, as saved (fewer devices now: those there are)
        for device, state in enumerate(states["torch_cuda_manual_seed"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


def _check_compatible(trainer: Trainer, path: Path, saved: dict[str, Any]) -> None:
    acc, accum = trainer.accelerator, trainer.cfg.train.grad_accum_steps
    deepspeed = "DEEPSPEED" in (trainer.state.backend, saved.get("backend", ""))
    if saved.get("world_size") != acc.num_processes and deepspeed:
        raise CheckpointError(f"checkpoint {path} was written by {saved.get('world_size')} DeepSpeed "
                              f"processes; resume it with the same number (now {acc.num_processes})")
    t = trainer.cfg.train
    saved_global = saved.get("global_batch_size") or (
        saved.get("per_device_batch_size", 0) * saved.get("grad_accum_steps", accum) * saved.get("world_size", 1))
    now_global = t.per_device_batch_size * accum * acc.num_processes
    if saved_global and saved_global != now_global:  # batch_plan keeps it; only a hand-built Config gets here
        logger.warning("the global batch changed from %s to %s: the data position counts optimizer steps, so the "
                       "samples differ from the original run's", saved_global, now_global)


def _restore_stream_position(trainer: Trainer, positions: list | None) -> None:
    acc = trainer.accelerator
    if not trainer.data.streaming:
        return
    if positions is None or len(positions) != acc.num_processes:
        logger.warning("the stream's position was saved for another world size: restarting the data "
                       "from the start of epoch 0 (weights, optimizer and schedule are restored)")
    else:
        trainer.data.position = tuple(positions[acc.process_index])


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

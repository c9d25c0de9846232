"""Checkpointing as one component: a `Checkpointer` built from explicit `Stateful` parts.

As torchtitan's CheckpointManager, each part of the training state is an object of its own with
`state_dict()` and `load_state_dict()` (model and optimizer: `save`/`load` of the backend's files, since
ZeRO shards them), and the Checkpointer saves them together, atomically (checkpoint.py: a temp folder,
the manifest, the rename, then the pointers), and restores them together:

- model + optimizer (`BackendState`): weights, optimizer moments and step counts, every rank's RNG; the
  backend's own files (accelerate's `save_state`; under FSDP its sharded form, each rank writing its shards
  with torch.distributed.checkpoint), converted on demand for another layout (universal.py);
- scheduler: the LR schedule's position (`trainer_state.json` "scheduler");
- EMA (`EMAState`): fp32 EMA weights by parameter name (`ema.safetensors`);
- data position (`DataPosition`): a stream's (epoch, global samples read in it), the same on every rank
  (`trainer_state.json` "data_position");
- step guard (the engine): skipped steps in a row (`trainer_state.json` "step_guard");
- task statistics (`TaskStats`): the data statistics the model was built from (`task_stats.json`);
- train state (`TrainState`): step, best metric, skipped steps, batch layout (`trainer_state.json`).

`resume()` restores every part in place and returns what it resumed (`Resumed`); it reads and writes
nothing else of the Trainer. Map-style data needs no position: it follows from the step (batch_plan.py).
A checkpoint written under another backend, ZeRO stage or number of DeepSpeed processes is converted
to the topology-free form and loaded from it, with no step for the user (universal.py); an FSDP checkpoint
resumes under FSDP at any number of processes without one (DCP reshards it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors.torch import load_file, save_file

from trainer.config import Config
from trainer.core import checkpoint as ckpt
from trainer.core import universal
from trainer.core.distributed import unwrap_model
from trainer.core.resume import (
    SaveErrors,
    agree,
    first_line,
    repair_pointers,
    restore_rng,
    saved_rng_states,
    set_aside_old_checkpoints,
    verify_everywhere,
    warn_changed_task,
    warn_skipped,
)
from trainer.core.safe_load import weights_only_loading
from trainer.errors import CheckpointError
from trainer.rundir import RunDir

logger = logging.getLogger("trainer")

EMA_FILE = "ema.safetensors"


@runtime_checkable
class Stateful(Protocol):
    """A part of the training state (torch.distributed.checkpoint's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """The run's progress and its batch layout (per-device x accumulation x world size = global batch),
    which lets a resume on another world size keep the global batch (batch_plan.py)."""

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
    zero_stage: int = 0
    """The DeepSpeed ZeRO stage (0: not DeepSpeed)."""
    task: str = ""

    PROGRESS = ("step", "best_metric", "best_step", "nonfinite_skipped")
    """What a resume takes from the checkpoint; the layout fields describe the resuming run."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in self.PROGRESS:
            if key in state:
                setattr(self, key, state[key])


class BackendState:
    """Model and optimizer (and every rank's RNG), in the backend's own files; another layout's checkpoint
    is converted to the topology-free form and loaded from it (universal.py)."""

    def __init__(self, acc: Any, model: Any, optimizer: Any, param_names: list[list[str]], state: TrainState):
        self.acc, self.model, self.optimizer, self.param_names, self.state = acc, model, optimizer, param_names, state

    @property
    def fsdp2(self) -> bool:
        return universal.is_fsdp2(unwrap_model(self.acc, self.model))

    def state_dict(self) -> dict[str, Any]:
        """The layout a conversion needs: the optimizer's parameter names by group (the tensors are in files)."""
        return {"param_names": self.param_names, **({universal.SHARDED: True} if self.fsdp2 else {})}

    def _sharded_state_dicts(self) -> None:
        """FSDP2 saves and loads accelerate's sharded form (DCP), whatever the accelerate config's
        fsdp_state_dict_type: FULL_STATE_DICT would gather the whole state onto one process and pickle it."""
        plugin = self.acc.state.fsdp_plugin
        if plugin.state_dict_type is None or plugin.state_dict_type.name != "SHARDED_STATE_DICT":
            plugin.state_dict_config = plugin.optim_state_dict_config = None  # the sharded defaults
            plugin.set_state_dict_type("SHARDED_STATE_DICT")

    def save(self, directory: Path) -> None:
        # FSDP2: accelerate's sharded save, every rank writing its own shards with torch.distributed.checkpoint
        # (nothing is gathered); another layout converts them on demand at resume (universal.convert).
        if self.fsdp2:
            self._sharded_state_dicts()
        self.acc.save_state(str(directory), safe_serialization=True)

    def load(self, path: Path, saved: dict[str, Any], scratch: Path) -> str | None:
        """Load `path` (its `trainer_state.json` is `saved`); returns the conversion made ('ZeRO-2 x 2 ->
        DDP x 2'), or None when the backend's own loader read it. `scratch`: where a conversion is written."""
        s, unwrapped = self.state, unwrap_model(self.acc, self.model)
        saved = {**saved, "zero_stage": universal.saved_zero_stage(path, saved)}
        if not universal.needs_conversion(saved, s.backend, s.world_size, s.zero_stage):
            if saved.get("backend") != universal.DEEPSPEED and s.backend != universal.DEEPSPEED:
                universal.check_same_model(path, saved, unwrapped)
            try:
                if self.fsdp2 and (path / universal.WEIGHTS).is_file():  # whole tensors: each rank takes its shards
                    universal.load_torch_files(path, unwrapped, self.optimizer.optimizer,
                                               saved.get("param_names") or self.param_names)
                else:
                    if self.fsdp2:  # DCP's shards, resharded to this world size by DCP
                        self._sharded_state_dicts()
                    # DeepSpeed unpickles its own files with weights_only=False, DCP its metadata with pickle
                    with weights_only_loading():
                        self.acc.load_state(str(path))
            except CheckpointError:  # a pickle that weights-only loading refuses
                raise
            except Exception as err:  # a checkpoint that passed its manifest but will not load
                raise CheckpointError(f"checkpoint {path} could not be loaded into this run's model ({first_line(err)}); "
                                      f"if the model or task settings changed, start over with run.resume=none or a new "
                                      f"run.output_dir") from err
            return None
        universal.check_same_model(path, saved, unwrapped)
        started, problem = time.perf_counter(), None
        if self.acc.is_main_process:
            try:
                universal.convert(path, scratch, saved, self.param_names)
            except CheckpointError as err:
                problem = str(err)
        agree(self.acc, problem)
        try:
            universal.load_into(scratch, self.model, self.optimizer, unwrapped, self.param_names, s.backend)
        except CheckpointError as err:
            raise CheckpointError(f"checkpoint {path}: {err}") from err
        if s.backend == universal.DEEPSPEED:  # the engine's own counters, as its loader sets them
            self.model.global_steps = int(saved.get("step", 0))
            self.model.global_samples = int(saved.get("step", 0)) * s.global_batch_size
        return f"{universal.describe(saved, s.backend, s.world_size, s.zero_stage)}, {time.perf_counter() - started:.1f} s"


class EMAState:
    """The EMA, consolidated: fp32 weights by parameter name whatever the backend (a collective to save)."""

    def __init__(self, ema: Any, acc: Any, model: Any, state: TrainState):
        self.ema, self.acc, self.model, self.state = ema, acc, model, state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.ema.full_state(unwrap_model(self.acc, self.model), self.acc.gather)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.ema.load_full(unwrap_model(self.acc, self.model), state, self.acc.process_index,
                           num_updates=self.state.step)


class DataPosition:
    """A stream's position: (epoch, global samples of it read), the same on every rank and valid at any world
    size (map-style data: none, the step gives it)."""

    def __init__(self, data: Any, acc: Any):
        self.data, self.acc = data, acc

    def state_dict(self) -> dict[str, Any]:
        return {"data_position": list(self.data.position)} if self.data.streaming else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.data.streaming:
            return
        position, per_rank = state.get("data_position"), state.get("data_positions")
        if position is not None:
            self.data.position = (int(position[0]), int(position[1]))
        elif per_rank:  # written before streams were sharded by global index: per rank, in its own shard
            epoch = min(int(p[0]) for p in per_rank)
            logger.warning("the checkpoint saved the stream's position per rank (data_positions, an older format): "
                           "restarting the data at the start of epoch %d (weights, optimizer and schedule are "
                           "restored)", epoch)
            self.data.position = (epoch, 0)
        else:
            logger.warning("the checkpoint holds no stream position: restarting the data from the start of epoch 0 "
                           "(weights, optimizer and schedule are restored)")


class TaskStats:
    """The training data's statistics the model was built with; a resumed run keeps the checkpoint's."""

    def __init__(self, task: Any):
        self.task = task

    def state_dict(self) -> dict[str, Any]:
        return self.task.stats

    def load_state_dict(self, stats: dict[str, Any]) -> None:
        if stats != self.task.stats:
            logger.warning("the training data's statistics (%s) differ from those of the checkpoint: the resumed "
                           "run keeps the checkpoint's, which its weights were trained with", ckpt.TASK_STATS)
            self.task.attach_stats(stats)


@dataclass
class Resumed:
    path: Path
    state: TrainState
    converted: str | None
    """The conversion made ('ZeRO-2 x 2 -> 1 process, 1.2 s'), None when the backend read its own files."""


class Checkpointer:
    """Saves and restores the run's parts (module docstring) in `run_dir/checkpoints`."""

    def __init__(self, cfg: Config, acc: Any, run_dir: RunDir, state: TrainState, *, model: Any, optimizer: Any,
                 param_names: list[list[str]], scheduler: Any, engine: Any, data: Any, task: Any, ema: Any):
        self.cfg, self.acc, self.run_dir, self.state, self.task = cfg, acc, run_dir, state, task
        self.backend = BackendState(acc, model, optimizer, param_names, state)
        self.ema = EMAState(ema, acc, model, state) if ema is not None else None
        self.stats = TaskStats(task)
        self.parts: dict[str, Stateful] = {"scheduler": scheduler, "step_guard": engine}
        """Saved under their names in trainer_state.json; the train state, data position and backend layout
        are saved at its top level."""
        self.data = DataPosition(data, acc)

    # ------------------------------------------------------------------ save
    def save(self, best: bool = False) -> Path:
        """Write a complete checkpoint atomically (every rank takes part) and rotate old ones."""
        acc, root = self.acc, self.run_dir.checkpoints
        name = ckpt.step_dir_name(self.state.step)
        tmp, final = root / f".tmp-{name}", root / name
        errors = SaveErrors(acc, root, tmp)
        if acc.is_main_process:
            with errors.record():
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
        errors.agree()
        with errors.record():
            self.backend.save(tmp)
        if self.ema is not None:
            full = self.ema.state_dict()  # collective
            if acc.is_main_process:
                with errors.record():
                    save_file(full, str(tmp / EMA_FILE))
        errors.agree()
        record = {**self.state.state_dict(), **self.data.state_dict(), **self.backend.state_dict(),
                  **{key: part.state_dict() for key, part in self.parts.items()}}
        if acc.is_main_process:
            with errors.record():
                (tmp / ckpt.TASK_STATS).write_text(json.dumps(self.stats.state_dict(), indent=1))
                record["artifacts"] = [ckpt.TASK_STATS, *self.task.save_artifacts(tmp)]
                ckpt.write_manifest(tmp, record, with_hashes=self.cfg.ckpt.verify)
                ckpt.finalize(tmp, final, root, best=best)
            if errors.error is None:
                try:
                    ckpt.rotate(root, self.cfg.ckpt.keep_last)
                except OSError as err:  # the new checkpoint is complete: old ones left behind are no error
                    logger.warning("could not remove old checkpoints under %s: %s", root, err)
        errors.agree()
        return final

    # ------------------------------------------------------------------ resume
    def resume(self) -> Resumed | None:
        """Restore every part from the checkpoint run.resume names; None for a fresh start."""
        path, saved = self._pick()
        if path is None:
            return None
        if saved.get("task") and self.state.task and saved["task"] != self.state.task:
            raise CheckpointError(f"checkpoint {path} was trained for task '{saved['task']}', this run trains task "
                                  f"'{self.state.task}'; resume it with its own config, or start over with "
                                  f"run.resume=none or a new run.output_dir")
        self._warn_changed_batch(path, saved)
        warn_changed_task(self.run_dir, self.cfg, path)
        rng_states = saved_rng_states(self.acc, path, saved.get("world_size"), self.cfg.run.allow_inexact_resume)
        converted = self._load_backend(path, saved)
        if rng_states is not None:  # accelerate restores them too, but ignores any failure
            restore_rng(rng_states)
        self.acc.step = 0  # accumulation boundaries restart with each optimizer step, whatever accum was
        self.state.load_state_dict(saved)
        self.parts["scheduler"].load_state_dict(saved["scheduler"])
        self.parts["step_guard"].load_state_dict(saved.get("step_guard", {}))
        self.data.load_state_dict(saved)
        stats_file = path / ckpt.TASK_STATS
        if stats_file.is_file():  # the model was trained with the checkpoint's statistics: keep using them
            self.stats.load_state_dict(json.loads(stats_file.read_text()))
        if self.ema is not None:
            self._load_ema(path)
        if self.cfg.run.resume == "auto" and self.acc.is_main_process:
            repair_pointers(self.run_dir.checkpoints, path)
        if converted and self.acc.is_main_process:
            logger.info("converted checkpoint %s (%s) through the topology-free form", path.name, converted)
        return Resumed(path, self.state, converted)

    def _pick(self) -> tuple[Path | None, dict[str, Any]]:
        """The checkpoint to resume (verified on every rank) and its trainer state, or (None, {})."""
        acc, root, mode = self.acc, self.run_dir.checkpoints, self.cfg.run.resume
        if mode == "none":
            set_aside_old_checkpoints(acc, root)
            return None, {}
        skipped: list[str] = []  # nothing is passed over silently
        if mode == "auto":
            candidates = ckpt.resume_candidates(root)
            if acc.is_main_process:  # the folders are the same for every rank: one report
                skipped = ckpt.skipped_checkpoints(root)
            if not candidates:
                warn_skipped(skipped, "no complete checkpoint: starting from step 0")
                return None, {}
        else:
            candidates = [ckpt.resolve_checkpoint(mode)]
        for i, path in enumerate(candidates):
            saved, problem = verify_everywhere(acc, path, check_hashes=self.cfg.ckpt.verify)
            if problem is None:
                break
            if mode != "auto" or i == len(candidates) - 1:
                warn_skipped(skipped, "no checkpoint is left to resume from")
                raise CheckpointError(problem)
            skipped.append(problem)  # every rank: one that fails on rank 1 only says why there
        warn_skipped(skipped, f"resuming from {path.name}")
        return path, saved

    def _load_backend(self, path: Path, saved: dict[str, Any]) -> str | None:
        """The backend part, converting through a scratch folder next to the run's checkpoints (removed after,
        and on failure: a refused checkpoint leaves the run directory as it was)."""
        root = self.run_dir.checkpoints
        created = not root.exists()
        scratch = root / f".universal-{path.name}"
        failure: Exception | None = None
        try:
            converted = self.backend.load(path, saved, scratch)
        except Exception as err:  # noqa: BLE001 - raised again below, after the other ranks heard of it
            failure = err  # e.g. a file refused on one rank only (ZeRO-3 has one per rank)
        try:
            # Every rank raises when one does: the others would otherwise train on and wait for it in the first
            # step's collectives until the launcher kills them.
            problem = None if failure is None else (
                str(failure) if isinstance(failure, CheckpointError)
                else f"rank {self.acc.process_index}: {first_line(failure)}")
            try:
                agree(self.acc, problem)
            except CheckpointError:
                if failure is not None:
                    raise failure from None
                raise
        finally:
            if self.acc.is_main_process:
                shutil.rmtree(scratch, ignore_errors=True)
                if created and root.is_dir() and not any(root.iterdir()):
                    root.rmdir()
        return converted

    def _load_ema(self, path: Path) -> None:
        ema_file = path / EMA_FILE
        if not ema_file.is_file():
            raise CheckpointError(f"checkpoint {path} has no {EMA_FILE} but train.ema_decay > 0")
        try:
            self.ema.load_state_dict(load_file(ema_file))
        except KeyError as err:
            raise CheckpointError(f"checkpoint {path}: {EMA_FILE} {err.args[0]}") from None

    def _warn_changed_batch(self, path: Path, saved: dict[str, Any]) -> None:
        accum, world = self.state.grad_accum_steps, self.acc.num_processes  # the run plan's layout
        saved_global = saved.get("global_batch_size") or (
            saved.get("per_device_batch_size", 0) * saved.get("grad_accum_steps", accum) * saved.get("world_size", 1))
        now_global = self.state.per_device_batch_size * accum * world
        if saved_global and saved_global != now_global:  # batch_plan keeps it; only a hand-built plan gets here
            logger.warning("the global batch changed from %s to %s: the data position counts optimizer steps, so the "
                           "samples differ from the original run's", saved_global, now_global)

    def load_weights(self, path: Path) -> None:
        """Load a checkpoint's model weights (and EMA) into a trained run, e.g. the best one for the test pass.
        The whole backend state (optimizer, RNG) comes with them: harmless after training."""
        saved, problem = verify_everywhere(self.acc, path, check_hashes=self.cfg.ckpt.verify)
        if problem is not None:
            raise CheckpointError(problem)
        self._load_backend(path, saved)
        if self.ema is not None:
            self._load_ema(path)

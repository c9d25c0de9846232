"""The parts of a checkpoint, each `Stateful` (torchtitan's CheckpointManager): what the Checkpointer saves and
restores in one loop (manager.py). A part says where its state lives (`placement`) and, when it owns files,
writes and reads them itself (`Part.save_files`, `Part.load_files`); a new part is one class and one entry in
the Trainer's mapping.

- `BackendState`: model and optimizer in the backend's own files (accelerate's `save_state`; under FSDP its
  sharded form, each rank writing its shards with torch.distributed.checkpoint), converted on demand for
  another layout (convert.py); its state is the layout a conversion needs (the optimizer's parameter names);
- `RNGState`: every rank's random streams, checked before the backend's load and applied after it;
- `TrainState`: step, best metric, skipped steps, batch layout;
- the scheduler: the LR schedule's position; the step guard (step_guard.py): skipped steps in a row;
- `DataPosition`: a stream's (epoch, global samples read in it), the same on every rank;
- `TaskStats`: the data statistics the model was built from (`task_stats.json`) and the task's artifacts;
- `EMAState`: fp32 EMA weights by parameter name (`ema.safetensors`);
- `TaskTrainingState`: a `StatefulTask`'s state between optimizer steps, per rank (`task_state_<rank>.safetensors`).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from safetensors.torch import load_file, save_file

from trainer.core.checkpoint import convert, store
from trainer.core.checkpoint.agreement import agree, conversion_failure, failure_reason
from trainer.core.checkpoint.rng import restore_rng, saved_rng_states
from trainer.core.checkpoint.writer import StagedFile
from trainer.core.distributed import unwrap_model
from trainer.core.samplers import SAMPLE_ORDER
from trainer.errors import CheckpointError, first_line

logger = logging.getLogger("trainer")


@runtime_checkable
class Stateful(Protocol):
    """A part of the training state (torch.distributed.checkpoint's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Placement:
    """Where a part's state lives in a checkpoint: a file of its own, the top level of `trainer_state.json`, or
    (the default, for any `Stateful` without a `placement` attribute, e.g. the LR scheduler) under the part's name
    there."""

    file: str | None = None
    """A file of its own (.json, or .safetensors for tensors), written by the main process."""
    top_level: bool = False
    """Its keys at the top level of trainer_state.json (its readers take them from there)."""
    required: str | None = None
    """Why a checkpoint must have `file`; None: without one, the part keeps its state."""
    artifact: bool = False
    """`file` is one of the checkpoint's artifacts (listed in the manifest: the task reads it back when sampling
    or exporting)."""


UNDER_NAME = Placement()
TOP_LEVEL = Placement(top_level=True)


def placement(part: Stateful) -> Placement:
    """The part's `placement` attribute, or `UNDER_NAME` for a plain Stateful."""
    return getattr(part, "placement", UNDER_NAME)


class Part:
    """What the Checkpointer's loop asks of a part beyond `Stateful`, with the defaults of a part that owns no files
    (a plain `Stateful` such as the LR scheduler gets the same): where its state lives (`placement`), and its own
    files, which it writes and reads itself (`save_files`, `load_files`)."""

    placement: ClassVar[Placement] = UNDER_NAME

    def save_files(self, directory: Path) -> list[str]:
        """Write this part's own files into the checkpoint being written (every rank calls it); returns what the
        manifest lists as the checkpoint's artifacts (files the task reads back when sampling or exporting)."""
        return []

    @property
    def can_stage(self) -> bool:
        """Whether `stage_files` can hand this part's files over (a part without files of its own can)."""
        return type(self).save_files is Part.save_files

    def stage_files(self, scratch: Path) -> list[StagedFile]:
        """What `save_files` writes, as host data for the checkpoint writer process (ckpt.async_save, where every
        part `can_stage`; every rank its share). `scratch`: a folder of the run's for files the part writes once
        and the writer copies into every checkpoint."""
        return []

    def load_files(self, path: Path, saved: dict[str, Any], finished: bool = False) -> str | None:
        """Read this part's own files from checkpoint `path` (whose `trainer_state.json` is `saved`), before any part's
        `load_state_dict` (every rank calls it); returns a conversion made, to be logged, else None. `finished`: the
        checkpoint is at or past the run's last step (nothing will be trained from it)."""
        return None


def save_files(part: Stateful, directory: Path) -> list[str]:
    """`part.save_files` where the part has files, else nothing."""
    return part.save_files(directory) if isinstance(part, Part) else []


def can_stage(part: Stateful) -> bool:
    """`part.can_stage` where the part has files, else True (its state goes into trainer_state.json)."""
    return part.can_stage if isinstance(part, Part) else True


def stage_files(part: Stateful, scratch: Path) -> list[StagedFile]:
    """`part.stage_files` where the part has files, else nothing to stage."""
    return part.stage_files(scratch) if isinstance(part, Part) else []


def load_files(part: Stateful, path: Path, saved: dict[str, Any], finished: bool = False) -> str | None:
    """`part.load_files` where the part has files, else nothing."""
    return part.load_files(path, saved, finished) if isinstance(part, Part) else None


@dataclass
class TrainState(Part):
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

    placement: ClassVar[Placement] = TOP_LEVEL
    PROGRESS: ClassVar[tuple[str, ...]] = ("step", "best_metric", "best_step", "nonfinite_skipped")
    """What a resume takes from the checkpoint; the layout fields describe the resuming run."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in self.PROGRESS:
            if key in state:
                setattr(self, key, state[key])


class BackendState(Part):
    """Model and optimizer (and every rank's RNG), in the backend's own files, which its engine writes and reads
    (engine.py); another layout's checkpoint is converted to the topology-free form (convert.py) in a scratch
    folder next to the run's checkpoints (`root`), which the engine fills itself from."""

    placement = TOP_LEVEL

    def __init__(self, acc: Any, engine: Any, param_names: list[list[str]], state: TrainState, root: Path):
        self.acc, self.engine, self.param_names, self.state, self.root = acc, engine, param_names, state, root

    def state_dict(self) -> dict[str, Any]:
        """The layout a conversion needs: the optimizer's parameter names by group (the tensors are in files)."""
        return {"param_names": self.param_names, **self.engine.checkpoint_layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing: the layout is read with the files (`load_files`)."""

    def save_files(self, directory: Path) -> list[str]:
        self.engine.save_checkpoint(directory)
        return []

    @property
    def can_stage(self) -> bool:
        return self.engine.can_stage_checkpoint()

    def stage_files(self, scratch: Path) -> list[StagedFile]:
        return self.engine.stage_checkpoint()

    def load_files(self, path: Path, saved: dict[str, Any], finished: bool = False) -> str | None:
        """Load `path`, converting it through a scratch folder (removed after, and on failure: a refused checkpoint
        leaves the run directory as it was); returns the conversion made ('ZeRO-2 x 2 -> DDP x 2'), or None when the
        backend's own loader read it. Any failure, on any rank and whatever the backend raised, is one
        CheckpointError on every rank."""
        root = self.root
        created = not root.exists()
        scratch = root / f"{store.CONVERSION_SCRATCH}{path.name}"
        if self.acc.is_main_process:
            store.remove_conversion_scratch(root)  # what a killed conversion left
        failure: Exception | None = None
        converted = None
        try:
            try:
                # The universal form one level down: DeepSpeed's converter writes a `latest_universal` pointer beside
                # its output, which then lies inside the scratch folder and goes with it.
                converted = self._load(path, saved, scratch / "universal")
            except Exception as err:  # noqa: BLE001 - told below, on every rank, after the others heard of it
                failure = err  # e.g. a file refused on one rank only (ZeRO-3 has one per rank)
            problem = None
            if failure is not None:
                problem = failure_reason(failure, scratch)
                if not isinstance(failure, CheckpointError):
                    problem = f"rank {self.acc.process_index}: checkpoint {path} could not be loaded ({problem})"
            agree(self.acc, problem)  # a collective: no rank reads the scratch folder after it
        finally:
            if self.acc.is_main_process:
                shutil.rmtree(scratch, ignore_errors=True)
                if created and root.is_dir() and not any(root.iterdir()):
                    root.rmdir()
        self.engine.after_resume()  # counters the backend restored are not new events
        return converted

    def _load(self, path: Path, saved: dict[str, Any], scratch: Path) -> str | None:
        s, engine = self.state, self.engine
        saved = {**saved, "zero_stage": convert.saved_zero_stage(path, saved)}
        if not convert.needs_conversion(saved, s.backend, s.world_size, s.zero_stage):
            if engine.checks_same_model:
                convert.check_same_model(path, saved, engine.unwrapped)
            try:
                engine.load_checkpoint(path, saved, self.param_names)
            except CheckpointError:  # a file weights-only loading refuses or cannot read, named
                raise
            except Exception as err:  # a checkpoint that passed its manifest but will not load
                raise CheckpointError(f"checkpoint {path} could not be loaded into this run's model ({first_line(err)}); "
                                      f"if the model or task settings changed, start over with run.resume=none or a new "
                                      f"run.output_dir") from err
            return None
        convert.check_same_model(path, saved, engine.unwrapped)
        started, problem = time.perf_counter(), None
        if self.acc.is_main_process:
            try:
                convert.convert(path, scratch, saved, self.param_names)
            except Exception as err:  # noqa: BLE001 - whatever the backend raised: one line on every rank
                problem = conversion_failure(err, path, scratch)  # removes the scratch
        agree(self.acc, problem)
        try:
            engine.load_universal(scratch, saved, self.param_names)
        except CheckpointError as err:
            raise CheckpointError(f"checkpoint {path}: {err}") from err
        return f"{convert.describe(saved, s.backend, s.world_size, s.zero_stage)}, {time.perf_counter() - started:.1f} s"


class RNGState(Part):
    """Every rank's random streams (Python, NumPy, torch, CUDA), in `random_states_<rank>.pkl`, which the backend's
    files include (accelerate's `save_state` writes them; nothing in trainer_state.json). They are read and checked
    before the backend's loader, which restores them too but swallows any failure (logging it at INFO) and
    resumes with other streams, and applied after it. Place it before the backend part."""

    placement = TOP_LEVEL

    def __init__(self, acc: Any, allow_inexact: bool):
        self.acc, self.allow_inexact = acc, allow_inexact
        self._states: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply the states `load_files` read (after the backend's loader); without them, nothing."""
        states, self._states = self._states, None
        if states is not None:
            restore_rng(states)

    def load_files(self, path: Path, saved: dict[str, Any], finished: bool = False) -> str | None:
        self._states = saved_rng_states(self.acc, path, saved.get("world_size"), self.allow_inexact, warn=not finished)
        return None


class EMAState(Part):
    """The EMA, consolidated: fp32 weights by parameter name whatever the backend (a collective to save)."""

    placement = Placement(file=store.EMA_FILE, required="train.ema_decay > 0")

    def __init__(self, ema: Any, acc: Any, model: Any, state: TrainState):
        self.ema, self.acc, self.model, self.state = ema, acc, model, state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.ema.full_state(unwrap_model(self.acc, self.model), self.acc.gather)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.ema.load_full(unwrap_model(self.acc, self.model), state, self.acc.process_index,
                           num_updates=self.state.step)


class DataPosition(Part):
    """A stream's position: (epoch, global samples of it read), the same on every rank and valid at any world
    size (map-style data: none, the step gives it)."""

    placement = TOP_LEVEL

    def __init__(self, data: Any, acc: Any):
        self.data, self.acc = data, acc

    def state_dict(self) -> dict[str, Any]:
        if self.data.streaming:
            return {"data_position": list(self.data.position)}
        # The data's order state (its order's name; a budget plan's epoch start); a bare SAMPLE_ORDER without one.
        order_state = getattr(self.data, "order_state", None)
        return order_state() if order_state is not None else {"sample_order": SAMPLE_ORDER}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.data.streaming:
            saved = state.get("sample_order", "an earlier order (torch.randperm)")
            current = getattr(self.data, "sample_order", SAMPLE_ORDER)
            if saved != current:
                logger.warning("the checkpoint was written with the sample order %s, this run draws %s: if it "
                               "stopped mid-epoch, the rest of that epoch comes from the new order (some of its "
                               "samples seen twice, others not at all); later epochs are whole", saved, current)
            if hasattr(self.data, "restore_order_state"):
                self.data.restore_order_state(state)
            return
        position, per_rank = state.get("data_position"), state.get("data_positions")
        if position is not None:
            self.data.position = (int(position[0]), int(position[1]))
        elif per_rank:  # each rank's position in its own shard: no global position to restore
            epoch = min(int(p[0]) for p in per_rank)
            logger.warning("the checkpoint saved the stream's position per rank (data_positions, an older format): "
                           "restarting the data at the start of epoch %d (weights, optimizer and schedule are "
                           "restored)", epoch)
            self.data.position = (epoch, 0)
        else:
            logger.warning("the checkpoint holds no stream position: restarting the data from the start of epoch 0 "
                           "(weights, optimizer and schedule are restored)")


class TaskStats(Part):
    """The training data's statistics the model was built with (a resumed run keeps the checkpoint's), and the
    task's own files (a vocabulary, a scaler: its artifacts, written by the main process)."""

    placement = Placement(file=store.TASK_STATS, artifact=True)

    def __init__(self, task: Any, is_main: bool = True):
        self.task, self.is_main = task, is_main
        self._staged: list[str] | None = None

    def save_files(self, directory: Path) -> list[str]:
        return self.task.save_artifacts(directory) if self.is_main else []

    can_stage = True

    def stage_files(self, scratch: Path) -> list[StagedFile]:
        """The artifacts derive from the training data, fixed for the run: written once into `scratch`, copied
        into every checkpoint by the writer."""
        if not self.is_main:
            return []
        if self._staged is None or not scratch.is_dir():
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            self._staged = self.task.save_artifacts(scratch)
        return [StagedFile(name, "copy", scratch / name, artifact=True) for name in self._staged]

    def state_dict(self) -> dict[str, Any]:
        return self.task.stats

    def load_state_dict(self, stats: dict[str, Any]) -> None:
        if stats != self.task.stats:
            logger.warning("the training data's statistics (%s) differ from those of the checkpoint: the resumed "
                           "run keeps the checkpoint's, which its weights were trained with", store.TASK_STATS)
            self.task.attach_stats(stats)


class TaskTrainingState(Part):
    """A `StatefulTask`'s state between optimizer steps (e.g. a batch of rollouts reused for several steps): each rank's
    own tensors in `task_state_<rank>.safetensors` (no file when the task has none), read back by the same rank. A
    checkpoint written by another number of processes holds other ranks' micro-batches: the task is told (None) and
    starts afresh."""

    placement = TOP_LEVEL
    PREFIX: ClassVar[str] = "task_state_"

    def __init__(self, task: Any, acc: Any):
        self.task, self.acc = task, acc
        self._loaded: dict[str, torch.Tensor] | None = None

    def file_name(self, rank: int) -> str:
        return f"{self.PREFIX}{rank}.safetensors"

    def save_files(self, directory: Path) -> list[str]:
        state = self.task.task_state_dict()
        if state:
            save_file({k: v.detach().cpu().contiguous() for k, v in state.items()},
                      str(directory / self.file_name(self.acc.process_index)))
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_files(self, path: Path, saved: dict[str, Any], finished: bool = False) -> str | None:
        if saved.get("world_size", 1) != self.acc.num_processes:
            self._loaded = None
            return None
        file = path / self.file_name(self.acc.process_index)
        try:
            self._loaded = load_file(str(file)) if file.is_file() else {}
        except Exception as err:  # noqa: BLE001 - a damaged file is one line, as the other parts' are
            raise CheckpointError(f"checkpoint {path}: {file.name} (rank {self.acc.process_index}'s task state) "
                                  f"cannot be read ({first_line(err)})") from err
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand the task what `load_files` read (None: another world size wrote the checkpoint)."""
        loaded, self._loaded = self._loaded, None
        self.task.load_task_state_dict(loaded)

"""`trainer import` and `trainer export --format reference`: a reference implementation's checkpoint becomes a run
folder, and a run's checkpoint goes back into the reference's layout.

The per-family parts (which files, which names, which config fields) are `trainer.reference_formats.ReferenceFormat`s
in the families' `reference.py`. This side builds the run as `trainer train` would (the config's task, data, model,
optimizer, schedule and EMA), puts the source's weights, EMA, optimizer state and step into it and writes one
checkpoint through the run's own checkpointer (atomic, with `latest`), so that resume, `trainer sample`, evaluation
and `trainer export` read it like any other.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.errors import CheckpointError, ConfigError
from trainer.reference_formats import (
    ReferenceCheckpoint,
    RunWeights,
    check_state_dict,
    format_for_task,
    get_reference_format,
)

logger = logging.getLogger("trainer")

IMPORTED = "imported.json"
"""The run folder's record of what `trainer import` read (format, files, step, notes)."""


@dataclass
class ImportResult:
    """What `import_reference` wrote."""

    run_dir: Path
    checkpoint: Path
    step: int
    notes: list[str] = field(default_factory=list)


def read_reference(name: str, source: str | Path) -> ReferenceCheckpoint:
    """Format `name`'s checkpoint at `source`, in our names; what the files lack or hold wrongly is a
    CheckpointError naming the file and field."""
    fmt = get_reference_format(name)
    source = Path(source)
    if not source.exists():
        raise CheckpointError(f"{source}: no such file or folder")
    try:
        return fmt.read(source)
    except (ValueError, KeyError) as err:
        raise CheckpointError(str(err).strip("'\"")) from None


def import_reference(name: str, source: str | Path, out_dir: str | Path, overrides: Sequence[str] = (),
                     config: str | Path | None = None) -> ImportResult:
    """Make run folder `out_dir` from format `name`'s checkpoint at `source`: the config (the format's reading of the
    source's config over `config` or the task's defaults, then `overrides`) and one checkpoint at the source's
    step, holding its weights, EMA and optimizer state where it has them."""
    from trainer.config import load_config
    from trainer.core.distributed import unwrap_model
    from trainer.core.run_lock import release_run_lock
    from trainer.core.trainer import Trainer

    ckpt = read_reference(name, source)
    out_dir = Path(out_dir)
    if (out_dir / "checkpoints").is_dir() and any((out_dir / "checkpoints").iterdir()):
        raise ConfigError(f"{out_dir} already holds a run's checkpoints: import into a new folder")
    cfg = load_config(config, [*ckpt.overrides, *recipe_overrides(ckpt), *overrides, f"run.output_dir={out_dir}",
                               "run.resume=auto", "run.init_from="])
    if cfg.task.name != ckpt.task:
        raise ConfigError(f"a '{name}' checkpoint holds a {ckpt.task} model; the config's task is '{cfg.task.name}'")
    source_name = str(ckpt.files[0] if ckpt.files else source)
    created = not out_dir.exists()
    try:
        trainer = Trainer(cfg)
    except BaseException:  # the run could not be built (its data, its model): no lock and no new folder left
        release_run_lock(out_dir)
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    acc = trainer.accelerator
    done = False
    try:
        model = unwrap_model(acc, trainer.model)
        why = [note for note in ckpt.notes if "model_preset" in note]
        carried = getattr(model, "CHECKPOINT_SHAPED_BUFFERS", ())  # shapes that come with a state dict
        expected = {**model.state_dict(), **{k: ckpt.model[k] for k in carried if k in ckpt.model}}
        check_state_dict(expected, ckpt.model, source_name,
                         hint="; ".join([*why, "task.* overrides on the command line choose the model"]))
        model.load_state_dict({k: v for k, v in ckpt.model.items()}, strict=True)
        notes = list(ckpt.notes)
        trainer.state.step = ckpt.step
        _load_ema(trainer, model, ckpt, source_name, notes)
        _set_schedule(trainer.scheduler, ckpt.step)
        if ckpt.optimizer is not None:
            _load_optimizer(trainer, model, ckpt.optimizer, source_name)
        else:
            notes.append("the source holds no optimizer state: the optimizer starts afresh")
        if ckpt.stats:  # the checkpoint keeps the task's statistics: a resume takes the source's
            trainer.task.attach_stats({**trainer.task.stats, **ckpt.stats})
        path = trainer.save()
        trainer.checkpointer.wait(close=True)
        if trainer.is_main:
            record = {"format": name, "source": [str(f) for f in ckpt.files], "step": ckpt.step, "notes": notes}
            (out_dir / IMPORTED).write_text(json.dumps(record, indent=1) + "\n")
        done = True
    finally:
        trainer.log.close()
        acc.end_training()
        if trainer.is_main:
            release_run_lock(out_dir)
            if not done and created:  # a config without the checkpoint would train from scratch: leave nothing
                shutil.rmtree(out_dir, ignore_errors=True)
    assert path is not None  # a synchronous save returns its folder
    return ImportResult(run_dir=out_dir, checkpoint=path, step=ckpt.step, notes=notes)


def recipe_overrides(ckpt: ReferenceCheckpoint) -> list[str]:
    """The source's recipe overrides this version's config has keys for (the others left out)."""
    return [item for item in ckpt.recipe if _config_has(item.split("=", 1)[0], ckpt.task)]


def _config_has(key: str, task: str) -> bool:
    """Whether `section.key` is an option of this version's config (the task section: task `task`'s)."""
    import dataclasses

    from trainer.config import Config
    from trainer.registry import get_spec

    section, _, name = key.partition(".")
    if section == "task":
        cls = get_spec(task).config_cls
    else:
        sections = {f.name: f.default_factory for f in dataclasses.fields(Config)}
        if section not in sections:
            return False
        cls = type(sections[section]())  # type: ignore[misc]
    return name in {f.name for f in dataclasses.fields(cls)}


def _load_ema(trainer: Any, model: torch.nn.Module, ckpt: ReferenceCheckpoint, source: str, notes: list[str]) -> None:
    """The EMA from the source's (else the imported weights), counted as `ckpt.step` updates."""
    if trainer.ema is None:
        if ckpt.ema is not None:
            notes.append("train.ema_decay is 0: the source's EMA weights are not kept")
        return
    params = dict(model.named_parameters())
    if ckpt.ema is None:
        notes.append("the source has no EMA: the EMA starts at the imported weights")
        full = {n: params[n].detach() for n in trainer.ema.names}
    else:
        check_state_dict({n: params[n] for n in trainer.ema.names}, ckpt.ema, f"{source} (EMA)")
        full = ckpt.ema
    trainer.ema.load_full(model, full, trainer.accelerator.process_index, num_updates=ckpt.step)


def _set_schedule(scheduler: Any, step: int) -> None:
    """Put the LR schedule where a run that took `step` optimizer steps has it (the lr of step + 1)."""
    if step <= 0:
        return
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": no step is taken here
        warnings.simplefilter("ignore", UserWarning)
        scheduler.last_epoch = step - 1
        try:
            scheduler.step()
        except ValueError as err:  # OneCycleLR past its total steps
            raise ConfigError(f"the source is at step {step}, past this config's schedule ({err}): raise "
                              f"train.max_steps") from None


def _load_optimizer(trainer: Any, model: torch.nn.Module, state_by_name: dict[str, dict[str, Any]],
                    source: str) -> None:
    """Load per-parameter optimizer state given by parameter name into the run's optimizer (any grouping)."""
    from trainer.core.checkpoint.convert import optimizer_param_names

    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper holds it
    names = [n for group in optimizer_param_names(model, optimizer) for n in group]
    unknown = sorted(set(state_by_name) - set(names))
    if unknown:
        raise CheckpointError(f"{source}: optimizer state for parameters this model's optimizer does not hold: "
                              f"{unknown[:5]}")
    params = dict(model.named_parameters())
    for name, state in state_by_name.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() and tuple(value.shape) != tuple(params[name].shape):
                raise CheckpointError(f"{source}: optimizer state '{key}' of parameter '{name}' has shape "
                                      f"{tuple(value.shape)}, the parameter {tuple(params[name].shape)}")
    full = optimizer.state_dict()
    full["state"] = {i: state_by_name[n] for i, n in enumerate(names) if n in state_by_name}
    optimizer.load_state_dict(full)


def export_reference(run_dir: str | Path, out: str | Path | None = None, checkpoint: str = "latest") -> tuple[Path, list[str]]:
    """Write run `run_dir`'s checkpoint in its task's reference layout into folder `out` (default
    RUN_DIR/export/reference); returns the folder and notes on what the layout could not get. The folder is written
    beside its target and renamed into place: a failure leaves the previous export as it was."""
    from safetensors.torch import load_file

    from trainer.config import config_from_dict, load_yaml
    from trainer.core.checkpoint.export import consolidated_weights
    from trainer.core.checkpoint.safe_load import weights_only_loading
    from trainer.core.checkpoint.store import EMA_FILE, STATE

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory: no config.yaml")
    cfg = config_from_dict(load_yaml(run_dir / "config.yaml"))
    fmt = format_for_task(cfg.task.name)
    model, ckpt_dir = consolidated_weights(run_dir, checkpoint, "model")
    ema = load_file(ckpt_dir / EMA_FILE) if (ckpt_dir / EMA_FILE).is_file() else None
    state = json.loads((ckpt_dir / STATE).read_text())
    optimizer = None
    if (ckpt_dir / "optimizer.bin").is_file() and state.get("param_names"):
        with weights_only_loading():
            saved = torch.load(ckpt_dir / "optimizer.bin", map_location="cpu", weights_only=True)
        optimizer = _optimizer_by_name(saved, state["param_names"])
    last_lr = (state.get("scheduler") or {}).get("_last_lr") or [None]
    weights = RunWeights(model=model, ema=ema, step=int(state.get("step", 0)), config=cfg, optimizer=optimizer,
                         lr=last_lr[0])
    out = Path(out) if out else run_dir / "export" / "reference"
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        notes = fmt.write(tmp, weights)
    except ValueError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"{run_dir}: cannot be written in the {fmt.name} layout: {err}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f".old-{out.name}")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
    if optimizer is None:
        notes.append(f"{ckpt_dir.name}'s layout gives no per-parameter optimizer state here (only plain and DDP "
                     f"checkpoints do)")
    return out, notes


def _optimizer_by_name(saved: dict[str, Any], param_names: list[list[str]]) -> dict[str, dict[str, Any]] | None:
    """`optimizer.bin`'s per-parameter state by name (the names the checkpoint records, group by group)."""
    groups, state = saved.get("param_groups", []), saved.get("state", {})
    if len(groups) != len(param_names) or any(len(g["params"]) != len(n) for g, n in zip(groups, param_names)):
        return None
    return {name: dict(state[index]) for group, names in zip(groups, param_names)
            for index, name in zip(group["params"], names) if index in state}

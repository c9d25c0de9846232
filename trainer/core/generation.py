"""`trainer sample RUN_DIR key=value ...`: draw samples from a trained run with any number of processes.

The options are the task's `SampleConfig` dataclass, parsed by the same override machinery as the
training config. N samples are split across ranks with exact counts, in fixed batches of consecutive
indices dealt round-robin (`rank_batches`). Sample k draws all its randomness from its own generator
seeded by (seed, k), so the same N samples come out whatever the world size. Statistics the sampler
needs come from the run artifact `task_stats.json` saved with the checkpoint, never from re-reading
the training data. Results are
gathered to the main process, which writes them through the task (`write_samples`) and writes their
statistics to `OUT.stats.json`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from trainer.atomic_io import atomic_write_text, temp_path, temp_paths_of
from trainer.config import config_from_dict, parse_options
from trainer.disk_space import disk_bytes, no_space_reason, space_report
from trainer.errors import ConfigError, DiskFullError
from trainer.registry import get_task
from trainer.seeding import derive_seed
from trainer.task import GenerativeTask, SampleConfig, Task

logger = logging.getLogger("trainer")


def rank_batches(num_samples: int, batch_size: int, rank: int, world_size: int) -> list[range]:
    """The batches of `rank`: fixed blocks of `batch_size` consecutive sample indices, dealt round-robin.

    A sample's batch-mates are the same whatever the world size, so even floating-point results that
    depend on the batch (padding, kernel blocking) come out bit for bit the same with 1 or N processes.
    Every index is drawn exactly once (no rounding up); ranks differ by at most one batch.
    """
    blocks = [range(start, min(start + batch_size, num_samples)) for start in range(0, num_samples, batch_size)]
    return blocks[rank::world_size]


def idle_ranks_note(num_samples: int, batch_size: int, world_size: int) -> str | None:
    """The batches are fixed (results stay the same at any world size), so fewer batches than processes leave
    some idle: what to say then, None otherwise."""
    blocks = math.ceil(num_samples / batch_size)
    if not 0 < blocks < world_size:
        return None
    head = f"num_samples={num_samples} in batches of {batch_size} is {blocks} batch(es) for {world_size} processes: "
    if num_samples < world_size:
        return head + f"{world_size - blocks} of them idle (at most {num_samples} can work on {num_samples} samples)"
    return head + f"{world_size - blocks} of them idle (batch_size={num_samples // world_size} would use all)"


def run_task(run_dir: str | Path) -> Task:
    """The task of a run, rebuilt from its resolved config.yaml."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory: no config.yaml")
    cfg = config_from_dict(yaml.safe_load(path.read_text()))
    return get_task(cfg.task.name)(cfg.task, seed=cfg.run.seed)


def sample_options(task: Task, overrides: Sequence[str] = ()) -> SampleConfig:
    """The task's sampling options from `key=value` strings (a non-generative task is an error)."""
    if not isinstance(task, GenerativeTask):
        raise ConfigError(f"task '{task.name}' cannot generate samples")
    options = parse_options(task.sample_config_cls, overrides)
    try:
        options.validate()
    except ValueError as err:
        raise ConfigError(f"trainer sample: {err}") from None
    return options


def sample_generator(seed: int, k: int, device: torch.device) -> torch.Generator:
    """The generator of sample k: the same sample whatever the world size or batch."""
    return torch.Generator(device).manual_seed(derive_seed(seed, k))


def generate_distributed(task: Task, model: torch.nn.Module, options: SampleConfig, rank: int, world_size: int,
                         device: torch.device, progress: bool = False) -> list[Any] | None:
    """Draw `options.num_samples` samples split over the ranks; all of them, in order, on the main
    process (None elsewhere). Every rank must call it (the results are gathered)."""
    from accelerate.utils import gather_object

    mine = rank_batches(options.num_samples, options.batch_size, rank, world_size)
    idle = idle_ranks_note(options.num_samples, options.batch_size, world_size)
    if idle and progress and rank == 0:
        logger.warning(idle)
    results: list[tuple[int, Any]] = []
    # This rank's share; the ranks run in step, so the main process's bar shows the whole job's ETA.
    desc = "sample" if world_size == 1 else f"sample (rank 0's share of {options.num_samples})"
    bar = tqdm(total=sum(map(len, mine)), desc=desc, unit="sample", dynamic_ncols=True,
               disable=not (progress and rank == 0))
    # A task's log lines go through tqdm, which lifts the bar off its line first (else they land glued onto it).
    with logging_redirect_tqdm() if not bar.disable else contextlib.nullcontext():
        for block in mine:
            chunk = list(block)
            generators = [sample_generator(options.seed, k, device) for k in chunk]
            with torch.no_grad():
                results.extend(zip(chunk, task.generate(model, generators, options, chunk)))
            bar.update(len(chunk))
    bar.close()
    gathered = gather_object(results) if world_size > 1 else results
    if rank != 0:
        return None
    samples = [s for _, s in sorted(gathered, key=lambda item: item[0])]
    if len(samples) != options.num_samples:
        raise RuntimeError(f"gathered {len(samples)} samples, expected {options.num_samples}")
    return samples


def sample_run(run_dir: str | Path, options: SampleConfig | Sequence[str] = ()) -> dict[str, Any] | None:
    """Sample from RUN_DIR's checkpoint; returns the statistics on the main process, None elsewhere."""
    from accelerate import PartialState

    from trainer.core.checkpoint.export import consolidated_weights, read_task_stats

    run_dir = Path(run_dir)
    task = run_task(run_dir)
    if not isinstance(options, SampleConfig):
        options = sample_options(task, options)
    state = PartialState(cpu=not torch.cuda.is_available())
    params, source = consolidated_weights(run_dir, checkpoint=options.checkpoint, weights=options.weights)
    stats = read_task_stats(source)
    task.attach_stats(stats)
    task.load_artifacts(Path(source))
    model = task.build_model(stats)
    model.load_state_dict(params, strict=True)
    model.to(state.device).eval()

    started = time.perf_counter()
    samples = generate_distributed(task, model, options, state.process_index, state.num_processes, state.device,
                                   progress=True)
    sampling_s = time.perf_counter() - started
    summary = None
    if state.is_main_process:
        out = Path(options.out) if options.out else run_dir / "samples" / "samples"
        summary = _write_whole(task, samples, options, out)
        summary.update(num_samples=options.num_samples, world_size=state.num_processes, seed=options.seed,
                       checkpoint=str(source), options=_jsonable(options), sampling_seconds=round(sampling_s, 3))
        stats_path = out.with_name(out.name + ".stats.json")  # beside the samples, never over them
        text = json.dumps(summary, indent=1)
        try:
            atomic_write_text(stats_path, text)
        except OSError as err:
            _raise_if_disk_full(err, stats_path, len(text.encode()), estimate="")
            raise
        summary["stats_path"] = str(stats_path)
    _log_to_trackers(run_dir, summary or {})
    # Every rank leaves together and tears the process group down: a rank that exits while gloo's
    # threads still serve the main process aborts ("terminate called without an active exception").
    state.wait_for_everyone()
    state.destroy_process_group()
    return summary


def _write_whole(task: GenerativeTask, samples: Any, options: Any, out: Path) -> dict[str, Any]:
    """`task.write_samples` into a hidden sibling of `out`, moved into place once complete: samples interrupted
    while written (Ctrl-C, a full disk) never sit at `out` looking like a finished set."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for leftover in temp_paths_of(out):  # of a write that was interrupted
        _remove(leftover)
    partial = temp_path(out)
    try:
        summary = task.write_samples(samples, options, partial)
    except Exception as err:
        full = no_space_reason(err, partial)  # while the partial samples are there: a full disk shows
        written = disk_bytes(partial)
        _remove(partial)
        if full is not None:
            _raise_if_disk_full(err, out, written, estimate="at least what was written before the space ran out")
        raise
    _remove(out)
    os.replace(partial, out)
    return json.loads(json.dumps(summary).replace(str(partial), str(out)))


def _raise_if_disk_full(err: Exception, out: Path, needed: int, estimate: str) -> None:
    """A DiskFullError naming `out`'s folder, its free space and `needed`, when `err` is a full disk or quota."""
    full = no_space_reason(err, out)
    if full is None:
        return
    kept = f"the previous {out.name} is intact" if out.exists() else "nothing was written there"
    space = space_report(out.parent, needed, estimate, reason=full)
    raise DiskFullError(f"could not write {out}: {full} ({space}); {kept}") from err


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _log_to_trackers(run_dir: Path, summary: dict[str, Any]) -> None:
    """The run's trackers (TensorBoard under RUN_DIR/tb, W&B, MLflow) get the sample statistics' scalars as
    `sample/<set>/<metric>` (every rank calls it; accelerate's trackers act on the main process only)."""
    log = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("log") or {}
    trackers = (["tensorboard"] if log.get("tensorboard", True) else []) + list(log.get("trackers") or [])
    if not trackers:
        return
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    flat = _flat_scalars(summary)
    acc = Accelerator(log_with=trackers, project_config=ProjectConfiguration(
        project_dir=str(run_dir), logging_dir=str(run_dir / "tb")))
    acc.init_trackers(log.get("project", "trainer") + "_samples", config={"run_dir": str(run_dir)})
    acc.log({f"sample/{k}": v for k, v in flat.items()})
    for tracker in acc.trackers:  # not end_training(): that also tears down the process group
        tracker.finish()


def _flat_scalars(tree: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat_scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


def _jsonable(options: SampleConfig) -> dict[str, Any]:
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(options).items() if isinstance(v, (int, float, str, bool, list))}

"""`trainer sample RUN_DIR key=value ...`: draw samples from a trained run with any number of processes.

The options are the task's `SampleConfig` dataclass, parsed by the same override machinery as the
training config. N samples are split across ranks with exact counts (the remainder to the first
ranks). Sample k draws all its randomness from its own generator seeded by (seed, k), so the same N
samples come out whatever the world size. Statistics the sampler needs come from the run artifact
`task_stats.json` saved with the checkpoint, never from re-reading the training data. Results are
gathered to the main process, which writes them through the task (`write_samples`) and writes their
statistics to `OUT.stats.json`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from trainer.config import config_from_dict, parse_options
from trainer.errors import ConfigError
from trainer.registry import get_task
from trainer.seeding import derive_seed
from trainer.task import GenerativeTask, SampleConfig, Task


def rank_slice(num_samples: int, rank: int, world_size: int) -> range:
    """Sample indices of `rank`: contiguous, sizes differ by at most one, extras on the first ranks."""
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


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


def sample_run(run_dir: str | Path, options: SampleConfig | Sequence[str] = ()) -> dict[str, Any] | None:
    """Sample from RUN_DIR's checkpoint; returns the statistics on the main process, None elsewhere."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    from trainer.core.export import consolidated_weights, read_task_stats

    run_dir = Path(run_dir)
    task = run_task(run_dir)
    if not isinstance(options, SampleConfig):
        options = sample_options(task, options)
    state = PartialState(cpu=not torch.cuda.is_available())
    params, source = consolidated_weights(run_dir, checkpoint=options.checkpoint, weights=options.weights)
    stats = read_task_stats(source)
    task.attach_stats(stats)
    model = task.build_model(stats)
    model.load_state_dict(params, strict=True)
    model.to(state.device).eval()

    mine = list(rank_slice(options.num_samples, state.process_index, state.num_processes))
    results: list[tuple[int, Any]] = []
    for start in range(0, len(mine), options.batch_size):
        chunk = mine[start:start + options.batch_size]
        generators = [sample_generator(options.seed, k, state.device) for k in chunk]
        with torch.no_grad():
            results.extend(zip(chunk, task.generate(model, generators, options)))
    gathered = gather_object(results) if state.num_processes > 1 else results
    summary = None
    if state.is_main_process:
        samples = [s for _, s in sorted(gathered, key=lambda item: item[0])]
        if len(samples) != options.num_samples:
            raise RuntimeError(f"gathered {len(samples)} samples, expected {options.num_samples}")
        out = Path(options.out) if options.out else run_dir / "samples" / "samples"
        summary = task.write_samples(samples, options, out)
        summary.update(num_samples=options.num_samples, world_size=state.num_processes, seed=options.seed,
                       checkpoint=str(source), options=_jsonable(options))
        stats_path = out.with_name(out.name + ".stats.json")  # beside the samples, never over them
        stats_path.write_text(json.dumps(summary, indent=1))
        summary["stats_path"] = str(stats_path)
    # Every rank leaves together and tears the process group down: a rank that exits while gloo's
    # threads still serve the main process aborts ("terminate called without an active exception").
    state.wait_for_everyone()
    state.destroy_process_group()
    return summary


def _jsonable(options: SampleConfig) -> dict[str, Any]:
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(options).items() if isinstance(v, (int, float, str, bool, list))}

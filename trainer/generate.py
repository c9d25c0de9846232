"""`trainer sample RUN_DIR`: draw samples from a trained run with any number of processes.

N samples are split across ranks with exact counts (the remainder to the first ranks). Sample k
draws all its randomness from its own generator seeded by (seed, k), so the same N samples come
out whatever the world size. Results are gathered to the main process, which writes them through
the task (`write_samples`, e.g. FASTA plus statistics).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import PartialState
from accelerate.utils import gather_object

from trainer.config import config_from_dict
from trainer.export import consolidated_weights
from trainer.tasks import get_task


def rank_slice(num_samples: int, rank: int, world_size: int) -> range:
    """Sample indices of `rank`: contiguous, sizes differ by at most one, extras on the first ranks."""
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def sample_run(run_dir: str | Path, num_samples: int, out: str | Path, *, checkpoint: str = "latest",
               weights: str = "auto", seed: int = 0, batch_size: int = 16, **options: Any) -> dict | None:
    """Sample from RUN_DIR's checkpoint; returns the statistics on the main process, None elsewhere."""
    state = PartialState(cpu=not torch.cuda.is_available())
    run_dir = Path(run_dir)
    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    task = get_task(cfg.task.name)(cfg.task, seed=cfg.run.seed)
    if not hasattr(task, "generate"):
        raise ValueError(f"task '{cfg.task.name}' cannot generate samples")
    if hasattr(task, "prepare_sampling"):
        task.prepare_sampling()
    model = task.build_model()
    params, source = consolidated_weights(run_dir, checkpoint=checkpoint, weights=weights)
    model.load_state_dict(params, strict=True)
    model.to(state.device).eval()

    mine = list(rank_slice(num_samples, state.process_index, state.num_processes))
    results: list[tuple[int, Any]] = []
    for start in range(0, len(mine), batch_size):
        chunk = mine[start:start + batch_size]
        generators = [torch.Generator(state.device).manual_seed(seed * 1_000_003 + k) for k in chunk]
        with torch.no_grad():
            results.extend(zip(chunk, task.generate(model, generators, **options)))
    gathered = gather_object(results) if state.num_processes > 1 else results
    stats = None
    if state.is_main_process:
        samples = [s for _, s in sorted(gathered, key=lambda item: item[0])]
        assert len(samples) == num_samples, (len(samples), num_samples)
        stats = task.write_samples(samples, Path(out))
        stats.update(num_samples=num_samples, world_size=state.num_processes, seed=seed,
                     checkpoint=str(source), options={k: v for k, v in options.items() if v is not None})
        Path(out).with_suffix(".json").write_text(json.dumps(stats, indent=1))
    # Every rank leaves together and tears the process group down: a rank that exits while gloo's
    # threads still serve the main process aborts ("terminate called without an active exception").
    state.wait_for_everyone()
    state.destroy_process_group()
    return stats

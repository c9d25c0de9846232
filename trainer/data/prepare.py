"""`trainer data prepare CONFIG [key=value ...]`: build a task's data caches once, ahead of a job.

The config is loaded exactly as `trainer train` loads it (command line > YAML > task preset > defaults), the
task is built from the registry, and its `Task.prepare_data()` runs in this one process under the same build
lock a run takes around `build_data` (`trainer.data.build_lock`): a job started later with the same task
settings finds every cache built and loads it, rather than converting the input while its GPUs wait. What
was built is printed: records per split, the cache folder, its size on disk and the seconds it took.

Run it where the job's processes will read the caches: on a shared filesystem once for all nodes, or on each
node for a node-local `task.cache_dir` (or `$TRAINER_CACHE_DIR`). The caches are keyed by the input's content
and the settings, so a copy of the prepared folder is as good as the original.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.data.fetch import human_size

if TYPE_CHECKING:
    from trainer.config import Config


@dataclass
class Prepared:
    """What `prepare` built: the task's summary (`Task.prepare_data`), where and how big, how long."""

    task: str
    summary: dict[str, Any]
    cache_dir: Path
    size_bytes: int
    seconds: float
    files: list[str] = field(default_factory=list)

    def text(self) -> str:
        """The lines `trainer data prepare` prints."""
        records = self.summary.get("records") or {}
        counts = ", ".join(f"{name} {count:,}" for name, count in records.items()) or "(not counted)"
        what = f"{len(self.files)} files, " if self.files else ""
        return "\n".join([f"prepared the data of task {self.task}",
                          f"  records: {counts}",
                          f"  cache:   {self.cache_dir} ({what}{human_size(self.size_bytes)} on disk)",
                          f"  took:    {self.seconds:.1f} s"])


def _folder_size(folder: Path) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:  # removed while we walk (another job's temp file)
                pass
    return total


def prepare(cfg: Config) -> Prepared:
    """Build `cfg`'s task data in this process, under the lock a run's `build_data` takes."""
    from trainer.data.build_lock import task_build_once, task_lock_path
    from trainer.registry import get_task

    task = get_task(cfg.task.name)(cfg.task, seed=cfg.run.seed)
    start = time.perf_counter()
    with task_build_once(cfg.task, cfg.run.seed):
        summary = dict(task.prepare_data() or {})
    seconds = time.perf_counter() - start
    files = sorted({str(f) for f in summary.get("cache_files") or ()})
    cache_dir = Path(summary.get("cache_dir") or task_lock_path(cfg.task).parent)
    size = sum(Path(f).stat().st_size for f in files if Path(f).is_file()) if files else _folder_size(cache_dir)
    return Prepared(cfg.task.name, summary, cache_dir, size, seconds, files)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `prepare` subcommand's arguments."""
    parser.add_argument("config", help="the experiment YAML the job will train (configs/<family>/*.yaml)")
    parser.add_argument("overrides", nargs="*", default=[], help="section.key=value, the same ones the job will pass, e.g. "
                                                     "task.data_path=/scratch/uniref50.fasta.gz")


def run(config: str, overrides: Sequence[str]) -> int:
    """`trainer data prepare CONFIG [key=value ...]`: a config or data error raises (one line from the CLI)."""
    from trainer.config import load_config

    cfg = load_config(config, list(overrides))
    print(prepare(cfg).text(), flush=True)
    return 0

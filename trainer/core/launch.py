"""One launch API: train a config on N local processes and get the results (`train`, `RunResult`).

`train(cfg, num_processes=N)` trains in this process when N is 1 or when a launcher (torchrun,
accelerate launch, the deepspeed launcher) started it: every rank then trains in place and the
launcher's world size wins. Otherwise it writes the resolved config to `RUN_DIR/launch_config.yaml`
(`trainer train RUN_DIR/launch_config.yaml` repeats the run) and starts
`python -m torch.distributed.run --standalone --nproc_per_node=N -m trainer train` on it: a free port
(no fixed MASTER_PORT), one OpenMP thread per process unless OMP_NUM_THREADS says otherwise.
Either way the result is read back from the run directory (`RunResult.read`), so an in-process and a
launched run give the same fields. Importing this module does not import torch.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import Config, save_config
from trainer.core.watchdog import started_by_launcher
from trainer.errors import ConfigError, LaunchError
from trainer.rundir import RunDir

logger = logging.getLogger("trainer")

__all__ = ["RunResult", "train", "under_launcher"]

LAUNCH_CONFIG = "launch_config.yaml"
"""The resolved config a launched run trains from, in its run directory."""


def under_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a rank started by torchrun / accelerate launch / the deepspeed launcher (it trains in place),
    False in a plain `python` process (TORCHELASTIC_RUN_ID or LOCAL_RANK set: `watchdog.started_by_launcher`)."""
    return started_by_launcher(environ)


@dataclass(frozen=True)
class RunResult:
    """What a run left in its run directory. On the ranks of a launcher other than the main one only
    `status`, `run_dir` and `main_process=False` are filled (the main process writes the metrics)."""

    status: str
    """`completed`, or `preempted` (stopped by SIGTERM/SIGUSR1 after a checkpoint; train again to resume)."""
    run_dir: Path
    main_process: bool = True
    world_size: int | None = None
    """Processes of the last start of the run (its `start` record)."""
    eval_metrics: dict[str, Any] = field(default_factory=dict)
    """The last evaluation's metrics, without the `eval/` prefix."""
    test_metrics: dict[str, Any] = field(default_factory=dict)
    """The test pass's metrics, without the `test/` prefix ({} without a test split)."""
    test_weights_step: int | None = None
    """The step whose weights the test pass used (the best checkpoint's under eval.test_weights=best)."""
    best_step: int | None = None
    best_checkpoint: Path | None = None
    latest_checkpoint: Path | None = None

    @classmethod
    def read(cls, run_dir: str | Path, status: str | None = None) -> RunResult:
        """The results of a run directory (`status` default: `preempted` if its marker is there)."""
        from trainer.core.checkpoint import store

        run = RunDir(run_dir)
        records = run.read_metrics()
        last_eval = next((r for r in reversed(records) if any(k.startswith("eval/") for k in r)), {})
        last_test = next((r for r in reversed(records) if any(k.startswith("test/") for k in r)), {})
        start = next((r for r in reversed(records) if r.get("event") == "start"), {})
        best = store.best_checkpoint(run.checkpoints) if run.checkpoints.is_dir() else None
        latest = store.latest_checkpoint(run.checkpoints) if run.checkpoints.is_dir() else None
        step = store.STEP_DIR.match(best.name) if best is not None else None
        return cls(status=status or ("preempted" if run.preempted.is_file() else "completed"), run_dir=run.root,
                   world_size=start.get("world_size"),
                   eval_metrics={k[5:]: v for k, v in last_eval.items() if k.startswith("eval/")},
                   test_metrics={k[5:]: v for k, v in last_test.items()
                                 if k.startswith("test/") and k != "test/weights_step"},
                   test_weights_step=last_test.get("test/weights_step"),
                   best_step=int(step.group(1)) if step else None, best_checkpoint=best, latest_checkpoint=latest)


def train(cfg: Config, num_processes: int = 1, deepspeed_config: str | None = None, *,
          gpu_ids: Sequence[int] | None = None) -> RunResult:
    """Train `cfg` on `num_processes` local processes (see the module docstring) and return its results.

    deepspeed_config: a DeepSpeed JSON (as `trainer train --deepspeed`). gpu_ids: the GPUs of the
    launched processes (their CUDA_VISIBLE_DEVICES), one process each; given, the run is launched even
    for one process. A launched run that exits non-zero raises `LaunchError` (a `TrainerError`) naming
    its exit status and metrics file, unless it was preempted: then the result has status `preempted`.
    """
    if num_processes < 1:
        raise ConfigError(f"num_processes must be >= 1, got {num_processes}")
    if under_launcher():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if (num_processes > 1 and num_processes != world) or gpu_ids is not None:
            logger.warning("running under a launcher (WORLD_SIZE=%d): num_processes=%d%s ignored, the launcher's "
                           "processes train", world, num_processes, " and gpu_ids are" if gpu_ids is not None else " is")
        return _train_here(cfg, deepspeed_config)
    if gpu_ids is not None:
        gpu_ids = [int(g) for g in gpu_ids]
        if len(gpu_ids) != num_processes:
            raise ConfigError(f"num_processes={num_processes} but {len(gpu_ids)} gpu_ids {gpu_ids} (one process per GPU)")
    if num_processes == 1 and gpu_ids is None:
        return _train_here(cfg, deepspeed_config)
    return _launch(cfg, num_processes, deepspeed_config, gpu_ids)


def _train_here(cfg: Config, deepspeed_config: str | None) -> RunResult:
    from trainer.core.trainer import Trainer

    trainer = Trainer(cfg, deepspeed_config=deepspeed_config)
    status = trainer.fit()
    if not trainer.accelerator.is_main_process:
        return RunResult(status=status, run_dir=Path(cfg.run.output_dir), main_process=False)
    return RunResult.read(cfg.run.output_dir, status)


def launch_command(config_file: str | Path, num_processes: int, deepspeed_config: str | None = None) -> list[str]:
    """The command line `train` starts: torch.distributed.run on a free port, `trainer train` in each process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}",
           "-m", "trainer", "train", str(config_file)]
    return cmd + (["--deepspeed", str(deepspeed_config)] if deepspeed_config else [])


def _launch(cfg: Config, num_processes: int, deepspeed_config: str | None, gpu_ids: list[int] | None) -> RunResult:
    run = RunDir(cfg.run.output_dir)
    run.root.mkdir(parents=True, exist_ok=True)
    config_file = run.root / LAUNCH_CONFIG
    save_config(cfg, config_file)
    cmd = launch_command(config_file, num_processes, deepspeed_config)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # --standalone picks a free port; a stale one must not leak in
        env.pop(key, None)
    if gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
    logger.info("launching %d processes%s: %s", num_processes, f" on GPUs {env['CUDA_VISIBLE_DEVICES']}" if gpu_ids
                is not None else "", " ".join(cmd))
    started = time.time()
    code = subprocess.run(cmd, env=env).returncode
    if code != 0:
        # torch elastic replaces a rank's exit status (75 after a preemption checkpoint): the marker tells
        if run.preempted.is_file() and run.preempted.stat().st_mtime >= started - 1:
            logger.warning("the %d-process run was preempted; train again to resume from its checkpoint", num_processes)
            return RunResult.read(run.root, "preempted")
        raise LaunchError(f"the {num_processes}-process run exited with status {code}; see the output above and "
                          f"{run.metrics} (train again to resume from the latest checkpoint)")
    return RunResult.read(run.root)

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
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import Config, save_config
from trainer.core.command_line import FRONT_END_ENV, RANK_STATUS_ENV, interrupted_line, resume_command
from trainer.core.elastic_launch import (
    AGENT_ENV,
    AGENT_LOG_LINE,
    ELASTIC_ENV,
    ElasticSpec,
    agent_command,
    default_run_id,
    hosts_store,
    refused_node_counts,
)
from trainer.core.watchdog import started_by_launcher
from trainer.errors import ConfigError, LaunchError
from trainer.rundir import RunDir

logger = logging.getLogger("trainer")

__all__ = ["RunResult", "train", "train_elastic", "under_launcher"]

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
    """`completed`, `preempted` (stopped by SIGTERM/SIGUSR1 after a checkpoint), `interrupted` (by Ctrl-C, after
    a checkpoint; train again to resume a stopped run) or `already_complete` (nothing trained: the run directory held
    a finished run, whose results these are, `world_size` included)."""
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
        """The results of a run directory (`status` default: `interrupted` or `preempted` if its marker is there)."""
        from trainer.core.checkpoint import store

        run = RunDir(run_dir)
        records = run.read_metrics()
        last_eval = next((r for r in reversed(records) if any(k.startswith("eval/") for k in r)), {})
        last_test = next((r for r in reversed(records) if any(k.startswith("test/") for k in r)), {})
        start = next((r for r in reversed(records) if r.get("event") == "start"), {})
        best = store.best_checkpoint(run.checkpoints) if run.checkpoints.is_dir() else None
        latest = store.latest_checkpoint(run.checkpoints) if run.checkpoints.is_dir() else None
        step = store.STEP_DIR.match(best.name) if best is not None else None
        if status is None:
            marker = _stop_marker(run, since=0)
            status = "completed" if marker is None else "interrupted" if marker["signal"] == "SIGINT" else "preempted"
        return cls(status=status, run_dir=run.root,
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
    return _launch(cfg, lambda config: launch_command(config, num_processes, deepspeed_config),
                   f"the {num_processes}-process run", num_processes, gpu_ids)


def train_elastic(cfg: Config, spec: ElasticSpec, deepspeed_config: str | None = None) -> RunResult:
    """Train `cfg` under torch's elastic agent on this node (core/elastic_launch.py): every node of the job runs
    the same call; the run goes on while at least spec.min_nodes nodes are there.

    A rank's error of the run's own (not a lost peer: core/rank_errors.py) stops this node's agent instead of a
    restart that would repeat it: the failed rank's traceback is printed and a `LaunchError` names it."""
    run_id = spec.run_id or default_run_id(cfg.run.output_dir)
    if (refused := refused_node_counts(spec, cfg.train.global_batch_size)) is not None:
        logger.warning("%s", refused)
    if (line := store_host_line(spec)) is not None:
        logger.warning("%s", line)
    trainer_args = ["--deepspeed", str(deepspeed_config)] if deepspeed_config else []
    failure = _RunFailure(cfg.run.output_dir, run_id, time.time())
    try:
        return _launch(cfg, lambda config: agent_command(spec, run_id, ["train", str(config), *trainer_args]),
                       f"the elastic run ({spec.min_nodes}:{spec.max_nodes} nodes)", spec.nproc_per_node, None,
                       AGENT_ENV, stop_for=failure.poll)
    except LaunchError:
        failure.show_traceback()
        raise


def store_host_line(spec: ElasticSpec) -> str | None:
    """One line when this node's agent will host the rendezvous store (`hosts_store`): its loss then ends the job."""
    if not hosts_store(spec):
        return None
    port = spec.endpoint.rpartition(":")[2]
    return (f"this node's agent hosts the rendezvous store at {spec.endpoint} (nothing listens there yet): losing "
            f"this node ends the job; `trainer rendezvous --port {port}` started there first keeps the store apart")


class _RunFailure:
    """The front end's view of an elastic run's recorded failure (core/rank_errors.py), written since its launch."""

    def __init__(self, run_dir: str | Path, run_id: str, since: float):
        self.run_dir, self.run_id, self.since = run_dir, run_id, since
        self.record: dict | None = None

    def poll(self) -> LaunchError | None:
        """The error to end the launch with once a rank recorded a failure, else None."""
        from trainer.core.rank_errors import failure_line, read_failure

        if self.record is None:
            self.record = read_failure(self.run_dir, self.run_id, self.since)
        if self.record is None:
            return None
        return LaunchError(f"the elastic run stopped: {failure_line(self.record)}", exit_code=1)

    def show_traceback(self) -> None:
        """Print the failed rank's last traceback (its file keeps every one)."""
        if self.record is None or not self.record.get("traceback"):
            return
        try:
            text = Path(self.record["traceback"]).read_text()
        except OSError:
            return
        headers = [m.start() for m in re.finditer(r"^--- .* ---$", text, re.M)]
        print(text[headers[-1] if headers else 0:].rstrip(), file=sys.stderr, flush=True)


def _train_here(cfg: Config, deepspeed_config: str | None) -> RunResult:
    from trainer.core.trainer import Trainer

    trainer = Trainer(cfg, deepspeed_config=deepspeed_config)
    status = trainer.fit()
    if not trainer.accelerator.is_main_process:
        return RunResult(status=status, run_dir=Path(cfg.run.output_dir), main_process=False)
    return RunResult.read(cfg.run.output_dir, status)


def launch_command(config_file: str | Path, num_processes: int, deepspeed_config: str | None = None) -> list[str]:
    """The command line `train` starts: torch.distributed.run on a free port, `trainer train` in each process."""
    cmd = ranks_command(num_processes, ["train", str(config_file)])
    return cmd + (["--deepspeed", str(deepspeed_config)] if deepspeed_config else [])


def ranks_command(num_processes: int, trainer_args: Sequence[str]) -> list[str]:
    """torch.distributed.run on a free port, `trainer <trainer_args>` in each of `num_processes` processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}",
            "-m", "trainer", *trainer_args]


@dataclass(frozen=True)
class RanksEnded:
    """How the ranks a front end started ended."""

    code: int
    """The launcher's exit status."""
    interrupts: int
    """Ctrl-C presses passed on to the ranks."""
    statuses: frozenset[int]
    """The exit statuses the ranks' command lines reported (2: an input error they said in one line)."""
    stopped_for: LaunchError | None = None
    """The error the front end stopped the launcher for (`run_ranks`' stop_for), None if it ended by itself."""


def run_ranks(cmd: list[str], num_processes: int, gpu_ids: Sequence[int] | None = None,
              extra_env: Mapping[str, str] | None = None,
              stop_for: Callable[[], LaunchError | None] | None = None) -> RanksEnded:
    """Run a launcher command (`ranks_command`) through the front end: a clean environment for the launch, Ctrl-C
    passed to the ranks, and the launcher's own report of what the ranks already said left out (`_FrontEnd`).
    `stop_for`, polled while the launcher runs: once it returns an error, the launcher is stopped (SIGTERM)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(extra_env or {})}
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # --standalone picks a free port; a stale one must not leak in
        env.pop(key, None)
    if gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
    logger.info("launching %d processes%s: %s", num_processes, f" on GPUs {env['CUDA_VISIBLE_DEVICES']}"
                if gpu_ids is not None else "", " ".join(cmd))
    with tempfile.TemporaryDirectory(prefix="trainer-ranks-") as status_dir:
        env.update({FRONT_END_ENV: "1", RANK_STATUS_ENV: status_dir,
                    # The agent (torchrun's --signals-to-handle) leaves Ctrl-C to the front end, which passes it on.
                    "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGHUP,SIGQUIT"})
        front = _FrontEnd(cmd, env, stop_for)
        code, interrupts = front.run()
        return RanksEnded(code, interrupts, frozenset(read_rank_statuses(status_dir)), front.stopped_for)


def raise_for_ranks(ended: RanksEnded, what: str, hint: str = "") -> None:
    """The error for ranks that did not end well (an input error or a Ctrl-C they reported: already said)."""
    if 2 in ended.statuses:
        raise LaunchError(f"{what}: a rank stopped on an error in the input", exit_code=2, reported=True)
    if ended.interrupts:
        raise LaunchError(f"{what}: stopped by Ctrl-C", exit_code=130, reported=128 + 2 in ended.statuses)
    if ended.code != 0:
        raise LaunchError(f"{what} exited with status {ended.code}; see the output above{hint}")


def _launch(cfg: Config, command: Callable[[Path], list[str]], what: str, num_processes: int,
            gpu_ids: list[int] | None, extra_env: Mapping[str, str] | None = None,
            stop_for: Callable[[], LaunchError | None] | None = None) -> RunResult:
    run = RunDir(cfg.run.output_dir)
    run.root.mkdir(parents=True, exist_ok=True)
    config_file = run.root / LAUNCH_CONFIG
    save_config(cfg, config_file)
    started, metrics_before = time.time(), _file_signature(run.metrics)
    ended = run_ranks(command(config_file), num_processes, gpu_ids, extra_env, stop_for)
    # Also when the launcher ended by itself first (its restarts spent): the recorded failure is the reason.
    if (failed := ended.stopped_for or (stop_for() if stop_for and ended.code != 0 else None)) is not None:
        raise failed
    marker = _stop_marker(run, started)
    if ended.interrupts and marker is None:  # before training started, or pressed twice before the checkpoint
        latest = _latest(run)
        raise LaunchError(f"stopped by Ctrl-C{' pressed twice' if ended.interrupts > 1 else ''} without a new "
                          f"checkpoint" + (f"; the last complete one is {latest}" if latest else ""), exit_code=130,
                          reported=128 + 2 in ended.statuses)  # a rank said it (interrupted outside training's steps)
    if marker is not None and 2 not in ended.statuses:
        status = "interrupted" if marker["signal"] == "SIGINT" else "preempted"
        if status == "interrupted":
            print(interrupted_line(marker["step"], _planned_steps(run, cfg), _latest(run), resume_command(cfg)),
                  file=sys.stderr, flush=True)
        else:
            logger.warning("%s was preempted; train again to resume from its checkpoint", what)
        return RunResult.read(run.root, status)
    raise_for_ranks(ended, what,
                    f" and {run.metrics} (train again to resume from the latest checkpoint)")
    trained = metrics_before is None or _file_signature(run.metrics) != metrics_before
    return RunResult.read(run.root, None if trained else "already_complete")


def _file_signature(path: Path) -> tuple[int, int] | None:
    """(size, mtime in ns) of a file, None if absent: a rerun of a finished run leaves its metrics.jsonl untouched."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns


def write_rank_status(code: int, environ: Mapping[str, str] = os.environ) -> None:
    """In a rank started by the front end: record the status this rank's command ends with."""
    folder = environ.get(RANK_STATUS_ENV)
    if folder and os.path.isdir(folder):
        Path(folder, f"rank{environ.get('RANK', '0')}").write_text(str(code))


def register_rank(environ: Mapping[str, str] = os.environ) -> None:
    """In a rank started by the front end, once it can take Ctrl-C as a clean stop: tell the front end its pid."""
    folder = environ.get(RANK_STATUS_ENV)
    if folder and os.path.isdir(folder):
        Path(folder, f"pid{environ.get('RANK', '0')}").write_text(str(os.getpid()))


def read_rank_statuses(folder: str | Path) -> set[int]:
    codes = set()
    for path in Path(folder).glob("rank[0-9]*"):
        try:
            codes.add(int(path.read_text()))
        except ValueError:
            continue
    return codes


def _stop_marker(run: RunDir, since: float) -> dict | None:
    """The marker of a stop after a checkpoint ({"step", "signal"}) written by this launch (since `since`), or None."""
    import json

    if not run.preempted.is_file() or run.preempted.stat().st_mtime < since - 1:
        return None
    try:
        marker = json.loads(run.preempted.read_text())
    except (OSError, ValueError):
        marker = {}
    return {"step": marker.get("step", "?"), "signal": marker.get("signal") or "SIGTERM"}


def _planned_steps(run: RunDir, cfg: Config) -> int:
    """The run's steps as its ranks planned them (plan.json: epochs in steps), else the config's max_steps."""
    import json

    try:
        return int(json.loads(run.plan.read_text())["max_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return cfg.train.max_steps


def _latest(run: RunDir) -> Path | None:
    from trainer.core.checkpoint import store

    return store.latest_checkpoint(run.checkpoints) if run.checkpoints.is_dir() else None


class _FrontEnd:
    """Runs the launcher and stands between it and the terminal.

    Ctrl-C reaches this process and the launcher (one process group); the launcher ignores it (started with
    SIGINT ignored, and told not to handle it), this process passes it to the ranks, which stop at a step
    boundary with a checkpoint (a second Ctrl-C: at once). Their output is relayed as it comes; once every
    rank has ended after a Ctrl-C or on an input error they reported, the launcher's own account of it (a
    traceback naming the ranks' exit statuses) is left out: the ranks' `trainer:` lines said it.
    """

    STOP_POLL_S = 1.0
    """`stop_for` is asked at most this often (it may read the shared file system)."""

    def __init__(self, cmd: list[str], env: dict[str, str], stop_for: Callable[[], LaunchError | None] | None = None):
        self.cmd, self.env, self.stop_for = cmd, env, stop_for
        self.quiet_agent = env.get(ELASTIC_ENV) == "1"  # the next worker group says what a restart changed
        self.stopped_for: LaunchError | None = None
        self._looked_at = -self.STOP_POLL_S
        self.interrupts = 0
        self.quiet = False
        self.status_dir = Path(env[RANK_STATUS_ENV])
        self.told: dict[int, int] = {}  # rank pid -> Ctrl-Cs passed on to it

    def run(self) -> tuple[int, int]:
        """The launcher's exit status and the number of Ctrl-C presses."""
        import signal
        import threading

        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None  # inherited by the launcher
        try:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        finally:
            if in_main:
                signal.signal(signal.SIGINT, self._on_interrupt)
        relays = [threading.Thread(target=self._relay, args=(pipe, out), daemon=True)
                  for pipe, out in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr))]
        for relay in relays:
            relay.start()
        try:
            while True:
                try:
                    code = self.proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    self._pass_on_interrupts()
                    self._stop_if_failed()
        finally:
            for relay in relays:
                relay.join(timeout=10)
            if in_main:
                signal.signal(signal.SIGINT, previous)
        return code, self.interrupts

    def _ranks(self) -> list:
        import psutil

        try:
            return psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return []

    def _on_interrupt(self, signum, frame) -> None:  # noqa: ARG002
        self.interrupts += 1
        self._pass_on_interrupts()

    def _pass_on_interrupts(self) -> None:
        """Each Ctrl-C to each rank that registered (a rank still importing would die with a traceback: it gets
        the Ctrl-C once it has registered)."""
        import signal

        if not self.interrupts:
            return
        for path in self.status_dir.glob("pid*"):
            try:
                pid = int(path.read_text())
            except ValueError:  # being written
                continue
            while self.told.get(pid, 0) < self.interrupts:
                self.told[pid] = self.told.get(pid, 0) + 1
                try:
                    os.kill(pid, signal.SIGINT)
                except ProcessLookupError:
                    break

    def _stop_if_failed(self) -> None:
        """Stop the launcher once `stop_for` names an error: what follows (the launcher's own account of its stop,
        the stopped ranks' output) is left out but for `trainer:` lines."""
        if self.stop_for is None or self.stopped_for is not None or time.monotonic() - self._looked_at < self.STOP_POLL_S:
            return
        self._looked_at = time.monotonic()
        self.stopped_for = self.stop_for()
        if self.stopped_for is not None:
            import signal

            self.quiet = True
            self.proc.send_signal(signal.SIGTERM)  # torchrun's agent stops its workers and leaves the rendezvous open

    def _launcher_speaks(self) -> bool:
        """True once the ranks (registered, so they did start) ended after a Ctrl-C or a reported input error: what
        follows is the launcher's."""
        if not self.quiet and (self.interrupts or 2 in read_rank_statuses(self.status_dir)):
            self.quiet = any(self.status_dir.glob("pid*")) and not self._ranks()
        return self.quiet

    def _relay(self, pipe, out) -> None:
        target = out.buffer if hasattr(out, "buffer") else None
        for chunk in iter(lambda: pipe.read1(65536), b""):
            if self._launcher_speaks():
                chunk = b"".join(line for line in chunk.splitlines(keepends=True) if line.startswith(b"trainer:"))
            elif self.quiet_agent:
                chunk = b"".join(line for line in chunk.splitlines(keepends=True) if not AGENT_LOG_LINE.match(line))
            if not chunk:
                continue
            if target is not None:
                target.write(chunk)
                target.flush()
            else:
                out.write(chunk.decode(errors="replace"))
                out.flush()

"""Elastic membership on torch's elastic agent: nodes lost or added mid-run, the run goes on at the new size.

`trainer train CONFIG --nnodes MIN:MAX --nproc-per-node N --rdzv HOST:PORT` runs torch.distributed.run's agent
(`agent_command`) with c10d rendezvous; bare `torchrun --nnodes MIN:MAX --rdzv-backend c10d ...` is the same. On
a node lost (its peers' collectives fail: a failure restart, counted by --max-restarts) or a node that joins
(the agent sees it waiting: a membership restart, not counted) the agent stops every local worker and starts the
group again with new ranks. Each start is a resume: run.resume=auto from the latest complete checkpoint, at the
new world size with the checkpoint's global batch (batch_plan.py), the data position and per-sample randomness
kept.

The worker side (`MembershipWatch`): the main process keeps `RUN_DIR/elastic.json` (the last completed step of
this agent run: step, wall time, world size, nodes); a group that starts and finds it from the same
rendezvous run says, after its first step, `membership changed: 2 -> 1 nodes (world 2 -> 1); resumed from step
N, M steps redone, recovered in S s` and records it in metrics.jsonl (`event: membership`). Recovery counts
from the last step the old group completed to the first one the new group completed.

Importing this module does not import torch (the front end uses it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config import Config

logger = logging.getLogger("trainer")

RDZV_CONF = {"join_timeout": 600, "last_call_timeout": 2, "close_timeout": 10, "keep_alive_interval": 1,
             "keep_alive_max_attempt": 3}
"""c10d rendezvous settings over torch's defaults (last_call_timeout=30, keep_alive_interval=5, 3 misses allowed):
a dead node leaves the rendezvous after keep_alive_interval x keep_alive_max_attempt s, and a round closes
last_call_timeout s after its minimum is there. `--rdzv-conf key=value,...` overrides any of them."""

ELASTIC_ENV = "TRAINER_ELASTIC"
"""Set by `trainer train --nnodes` for its agent's workers: they run under an agent that restarts them."""

AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", ELASTIC_ENV: "1"}
"""TORCH_DISABLE_SHARE_RDZV_TCP_STORE: each round's rank 0 hosts its workers' store on a free port. The
agent-shared store keeps the first round's address on a node that stays non-zero, which points at a store that
died with its node or that no worker uses."""

AGENT_LOG_LINE = re.compile(rb"^[IWE]\d{4} [\d:.]+ +\d+ \S*torch/distributed/")
"""A line of torch's elastic agent's log (`W1128 11:35:06.387000 8766 torch/distributed/elastic/...] ...`; the
path is relative to the working directory when torch is installed below it, e.g. in a project's .venv)."""

_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
              "ProcessGroupNCCL", "DistNetworkError", "Socket Timeout", "Connection refused")
"""What a collective's error says when a peer died (gloo raises plain RuntimeErrors) or NCCL's watchdog aborted."""

PROGRESS_FILE = "elastic.json"


@dataclass(frozen=True)
class ElasticSpec:
    """How `trainer train --nnodes` starts this node's agent."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    endpoint: str
    """HOST:PORT of the c10d rendezvous store (an agent on HOST hosts it unless `trainer rendezvous` already does)."""
    max_restarts: int = 3
    """Worker-group restarts after a failure (a node lost is one on every surviving agent; a join is none)."""
    run_id: str | None = None
    """The rendezvous id, the same on every node (default: SLURM_JOB_ID, else one derived from run.output_dir)."""
    rdzv_conf: str = ""
    """`key=value,...` over RDZV_CONF."""

    @classmethod
    def parse(cls, nnodes: str, nproc_per_node: int | None, rdzv: str | None, max_restarts: int | None = None,
              run_id: str | None = None, rdzv_conf: str | None = None) -> ElasticSpec:
        low, _, high = nnodes.partition(":")
        try:
            min_nodes, max_nodes = int(low), int(high or low)
        except ValueError:
            raise ConfigError(f"--nnodes {nnodes!r}: expected MIN:MAX (or N), e.g. 1:2") from None
        if not 1 <= min_nodes <= max_nodes:
            raise ConfigError(f"--nnodes {nnodes!r}: need 1 <= MIN <= MAX")
        if not rdzv or ":" not in rdzv:
            raise ConfigError("--nnodes needs --rdzv HOST:PORT, the rendezvous store every node reaches (the same on "
                              "every node; `trainer rendezvous` can host it)")
        if (nproc_per_node or 1) < 1 or (max_restarts or 0) < 0:
            raise ConfigError("--nproc-per-node must be >= 1 and --max-restarts >= 0")
        return cls(min_nodes, max_nodes, nproc_per_node or 1, rdzv, 3 if max_restarts is None else max_restarts,
                   run_id, rdzv_conf or "")

    def conf(self) -> str:
        given = dict(item.split("=", 1) for item in self.rdzv_conf.split(",") if "=" in item)
        return ",".join(f"{k}={v}" for k, v in {**RDZV_CONF, **given}.items())


def default_run_id(output_dir: str | Path, environ: Mapping[str, str] = os.environ) -> str:
    """The same on every node without talking: the SLURM job, else the run directory's absolute path."""
    if environ.get("SLURM_JOB_ID"):
        return f"slurm-{environ['SLURM_JOB_ID']}"
    return "run-" + hashlib.sha256(str(Path(output_dir).resolve()).encode()).hexdigest()[:16]


def agent_command(spec: ElasticSpec, run_id: str, trainer_args: Sequence[str]) -> list[str]:
    """torch.distributed.run's elastic agent with c10d rendezvous, `trainer <trainer_args>` in each worker."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={spec.min_nodes}:{spec.max_nodes}",
            f"--nproc-per-node={spec.nproc_per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={spec.endpoint}",
            f"--rdzv-id={run_id}", f"--rdzv-conf={spec.conf()}", f"--max-restarts={spec.max_restarts}",
            "--monitor-interval=0.1", "-m", "trainer", *trainer_args]


def reachable(endpoint: str, timeout: float = 0.2) -> bool:
    """Whether something listens at HOST:PORT (a rendezvous store)."""
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


def sizes_that_keep(global_batch: int, low: int = 1, high: int | None = None) -> list[int]:
    """World sizes in low..high (default: up to the global batch) that split `global_batch` evenly."""
    return [n for n in range(max(1, low), (high or global_batch) + 1) if global_batch % n == 0]


def refused_node_counts(spec: ElasticSpec, global_batch: int) -> str | None:
    """One line naming the node counts in MIN..MAX whose world size cannot keep `global_batch` (a group of that
    size is refused at its start), and those that can; None when every count keeps it or no global batch is set
    (the first group's size then fixes it)."""
    if global_batch <= 0:
        return None
    counts = range(spec.min_nodes, spec.max_nodes + 1)
    refused = [n for n in counts if global_batch % (n * spec.nproc_per_node)]
    if not refused:
        return None
    kept = [n for n in counts if n not in refused]
    return (f"--nnodes {spec.min_nodes}:{spec.max_nodes} x {spec.nproc_per_node} processes: a group of "
            f"{', '.join(map(str, refused))} node(s) cannot keep the global batch of {global_batch} (each would be "
            f"refused at its start, costing a restart); node counts that keep it: "
            f"{', '.join(map(str, kept)) or 'none in this range'}")


# ---------------------------------------------------------------------------------------------- worker side
def restartable(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a worker of an elastic agent that restarts its group (trainer's, or torchrun with --max-restarts):
    a stop or a lost peer there is a membership change the next group reports, not the run's end."""
    if environ.get(ELASTIC_ENV) == "1":
        return True
    try:
        return bool(environ.get("TORCHELASTIC_RUN_ID")) and int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    except ValueError:
        return False


def lost_peer(err: BaseException, environ: Mapping[str, str] = os.environ) -> str | None:
    """One line for a collective that failed because a peer of a restartable worker group died, else None."""
    if not restartable(environ):
        return None
    text = f"{type(err).__name__}: {err}"
    if type(err).__name__ not in ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError") and not any(
            marker in text for marker in _PEER_LOST):
        return None
    first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # gloo's source location, then its advice
    return (f"trainer: rank {environ.get('RANK', '?')} lost a peer of its worker group ({first[:160]}); "
            f"the elastic agent restarts the group")


def _elastic_run_id(environ: Mapping[str, str]) -> str | None:
    return environ.get("TORCHELASTIC_RUN_ID") or None


def read_progress(run_dir: Path) -> dict[str, Any] | None:
    try:
        progress = json.loads((Path(run_dir) / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return progress if isinstance(progress, dict) else None


def restarted_group(run_dir: str | Path, environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The last progress of an earlier worker group of this agent run (a restart), else None."""
    run_id = _elastic_run_id(environ)
    progress = read_progress(Path(run_dir)) if run_id else None
    return progress if progress is not None and progress.get("run_id") == run_id else None


def resume_on_restart(cfg: Config, environ: Mapping[str, str] = os.environ) -> Config:
    """A restarted worker group continues from the latest checkpoint, whatever run.resume named at the start.

    Restarted: after a failure (TORCHELASTIC_RESTART_COUNT > 0) or at another node count than the last group of
    this rendezvous run; a new launch that finds the progress of an old one at its own size keeps run.resume."""
    if cfg.run.resume == "auto":
        return cfg
    before = restarted_group(cfg.run.output_dir, environ)
    failed = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if before is None or not (failed or before.get("nodes") != int(environ.get("GROUP_WORLD_SIZE") or 1)):
        return cfg
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume="auto"))


class MembershipWatch:
    """After each step: the main process records its progress (module docstring) and, at the first step of a
    restarted worker group, says what changed in one line and one metrics record (`write`)."""

    def __init__(self, run_dir: str | Path, is_main: bool, world: int, resumed_step: int,
                 write: Callable[[dict[str, Any]], None], environ: Mapping[str, str] = os.environ):
        self.path = Path(run_dir) / PROGRESS_FILE
        self.run_id = _elastic_run_id(environ)
        self.active = is_main and self.run_id is not None
        self.world, self.resumed_step, self.write = world, resumed_step, write
        self.nodes = int(environ.get("GROUP_WORLD_SIZE") or 1)
        # A group that resumed nothing is a run's first (a restart resumes the checkpoint the last group left).
        self.before = restarted_group(run_dir, environ) if self.active and resumed_step else None
        self._tmp = self.path.with_name(f".{PROGRESS_FILE}.{os.getpid()}")

    def after_step(self, step: int) -> None:
        if not self.active:
            return
        now = time.time()
        if self.before is not None:
            self._announce(step, now)
            self.before = None
        # Not fsynced: it only dates the last step for the next group's line.
        self._tmp.write_text(json.dumps({"run_id": self.run_id, "step": step, "time": now, "world_size": self.world,
                                         "nodes": self.nodes}))
        os.replace(self._tmp, self.path)

    def finish(self, status: str) -> None:
        """At the end of fit: a completed run has no next group, and a later launch must not read it as one."""
        if self.active and status == "completed":
            self.path.unlink(missing_ok=True)

    def _announce(self, step: int, now: float) -> None:
        old_nodes, old_world = self.before.get("nodes", "?"), self.before.get("world_size", "?")
        redone = max(0, int(self.before.get("step", self.resumed_step)) - self.resumed_step)
        seconds = now - float(self.before.get("time", now))
        what = ("membership changed: " if (old_nodes, old_world) != (self.nodes, self.world)
                else "worker group restarted: ")
        logger.info("%s%s -> %s nodes (world %s -> %s); resumed from step %d, %d steps redone, recovered in %.1f s",
                    what, old_nodes, self.nodes, old_world, self.world, self.resumed_step, redone, seconds)
        self.write({"step": step, "event": "membership", "time": now, "old_nodes": old_nodes, "nodes": self.nodes,
                    "old_world_size": old_world, "world_size": self.world, "resumed_step": self.resumed_step,
                    "steps_redone": redone, "recovery_s": round(seconds, 3)})

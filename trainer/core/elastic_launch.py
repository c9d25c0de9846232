"""The launcher side of elastic training: how `trainer train --nnodes MIN:MAX` starts this node's agent.

`trainer train CONFIG --nnodes MIN:MAX --nproc-per-node N --rdzv HOST:PORT` runs torch.distributed.run's agent
(`agent_command`) with c10d rendezvous; bare `torchrun --nnodes MIN:MAX --rdzv-backend c10d ...` is the same. On
a node lost (its peers' collectives fail: a failure restart, counted by --max-restarts) or a node that joins
(the agent sees it waiting: a membership restart, not counted) the agent stops every local worker and starts the
group again with new ranks. What the workers do at each start is core/elastic.py (the worker side).

Importing this module does not import torch (the front end uses it before any torch import).
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import ConfigError

ELASTIC_ENV = "TRAINER_ELASTIC"
"""Set by `trainer train --nnodes` for its agent's workers: they run under an agent that restarts them."""

AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", ELASTIC_ENV: "1"}
"""TORCH_DISABLE_SHARE_RDZV_TCP_STORE: each round's rank 0 hosts its workers' store on a free port. The
agent-shared store keeps the first round's address on a node that stays non-zero, which points at a store that
died with its node or that no worker uses."""

AGENT_LOG_LINE = re.compile(rb"^[IWE]\d{4} [\d:.]+ +\d+ \S*torch/distributed/")
"""A line of torch's elastic agent's log (`W1128 11:35:06.387000 8766 torch/distributed/elastic/...] ...`; the
path is relative to the working directory when torch is installed below it, e.g. in a project's .venv)."""

FAST_RENDEZVOUS_NODES = 4
"""Up to this many nodes the rendezvous runs on short timeouts (`rendezvous_settings`)."""


def rendezvous_settings(max_nodes: int) -> dict[str, int]:
    """trainer's c10d rendezvous settings for a run of up to `max_nodes` nodes (over torch's defaults:
    keep_alive_interval=5 x keep_alive_max_attempt=3, last_call_timeout=30, close_timeout=30).

    A dead node leaves the rendezvous after keep_alive_interval x keep_alive_max_attempt s, and a round closes
    last_call_timeout s after its minimum is there. Up to FAST_RENDEZVOUS_NODES nodes: keep_alive_interval=1 and
    last_call_timeout=2, so a lost node costs seconds. Above, both grow with the node count up to torch's
    defaults: with many agents heartbeating into one store, one agent's stall (a GC pause, the store's queue, a
    network blip) must not evict a healthy node, and the survivors of a loss reach the next round spread over more
    time; one that misses the round's close costs the whole group another restart. `--rdzv-conf key=value,...`
    overrides any of them."""
    if max_nodes <= FAST_RENDEZVOUS_NODES:
        keep_alive, last_call, close = 1, 2, 10
    else:
        per_four = math.ceil(max_nodes / FAST_RENDEZVOUS_NODES)
        keep_alive, last_call = min(5, per_four), min(30, 2 * per_four)
        close = min(30, max(10, last_call))
    return {"join_timeout": 600, "last_call_timeout": last_call, "close_timeout": close,
            "keep_alive_interval": keep_alive, "keep_alive_max_attempt": 3}


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
    """The rendezvous id, the same on every node (default: `default_run_id`)."""
    rdzv_conf: str = ""
    """`key=value,...` over `rendezvous_settings(max_nodes)`."""

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

    def given_conf(self) -> dict[str, str]:
        """The `--rdzv-conf` settings the user gave."""
        return dict(item.split("=", 1) for item in self.rdzv_conf.split(",") if "=" in item)

    def conf(self) -> str:
        """The agent's `--rdzv-conf`: trainer's settings for MAX nodes, the user's over them."""
        return ",".join(f"{k}={v}" for k, v in {**rendezvous_settings(self.max_nodes), **self.given_conf()}.items())


def default_run_id(output_dir: str | Path, environ: Mapping[str, str] = os.environ) -> str:
    """The same on every node without talking: the run directory's absolute path, and under SLURM the job too
    (every run of one allocation shares its SLURM_JOB_ID; two of them in different folders are different runs)."""
    folder = hashlib.sha256(str(Path(output_dir).resolve()).encode()).hexdigest()[:16]
    if environ.get("SLURM_JOB_ID"):
        return f"slurm-{environ['SLURM_JOB_ID']}-{folder}"
    return f"run-{folder}"


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


def is_this_machine(host: str) -> bool:
    """Whether `host` names this machine: the test torch's c10d rendezvous makes to decide that an agent hosts the
    store (loopback, the hostname or its FQDN, or one of the addresses the hostname resolves to)."""
    if host == "localhost":
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    this = socket.gethostname()
    if host in (this, socket.getfqdn()):
        return True
    try:
        ours = {info[4][0] for info in socket.getaddrinfo(this, None, proto=socket.IPPROTO_TCP)}
        theirs = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    return bool(ours & theirs)


def hosts_store(spec: ElasticSpec) -> bool:
    """Whether this node's agent will host the rendezvous store: --rdzv names this machine, nothing listens there
    yet (no `trainer rendezvous`, no agent before it) and `--rdzv-conf is_host=...` does not decide otherwise."""
    is_host = spec.given_conf().get("is_host", "").strip().lower()
    if is_host in ("0", "false", "no", "off"):
        return False
    host = spec.endpoint.rpartition(":")[0].strip("[]")
    return (is_host in ("1", "true", "yes", "on") or is_this_machine(host)) and not reachable(spec.endpoint)


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

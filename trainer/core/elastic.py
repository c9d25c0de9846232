"""The worker side of elastic training: what each start of a worker group does, and how a rank tells a lost peer
from an error of its own (the launcher side, which starts the agent, is core/elastic_launch.py).

Each start is a resume: run.resume=auto from the latest complete checkpoint, at the new world size with the
checkpoint's global batch (batch_plan.py), the data position and per-sample randomness kept.

`MembershipWatch`: the main process keeps `RUN_DIR/elastic.json` (the last recorded step of this agent run: step,
wall time, world size, nodes), rewritten at most every PROGRESS_EVERY_S seconds; a group that starts and finds it
from the same rendezvous run says, after its first step, `membership changed: 2 -> 1 nodes (world 2 -> 1);
resumed from step N, M steps redone, recovered in S s` and records it in metrics.jsonl (`event: membership`).
Recovery counts from the last step the old group recorded to the first one the new group completed.

`lost_peer`: a collective that failed because a peer of the group is gone (a connection or store error) is a
membership change the agent restarts the group for; anything else (a CUDA fault, a collective's size mismatch,
an out-of-memory) is an error of the run that a restart would repeat (core/rank_errors.py).

Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.core.elastic_launch import ELASTIC_ENV
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config import Config

logger = logging.getLogger("trainer")

PROGRESS_FILE = "elastic.json"

PROGRESS_EVERY_S_ENV = "TRAINER_ELASTIC_PROGRESS_S"
"""Overrides PROGRESS_EVERY_S (seconds; 0: every step, which a measurement of the steps a fault redoes needs)."""

PROGRESS_EVERY_S = 1.0
"""elastic.json is rewritten at most this often (and at the first step of a group and when the group stops): it
sits on the shared file system beside the checkpoints, and a rewrite every step of a fast run is load for nothing."""

_PEER_ERROR_TYPES = frozenset({"DistNetworkError", "DistStoreError"})
"""torch.distributed's errors of a connection or of the store (QueueEmptyError is a DistStoreError)."""

_PEER_GONE = ("connection closed by", "connection reset by peer", "broken pipe", "connection refused",
              "connection timed out", "no route to host", "network is unreachable", "socket timeout",
              "failed to recv, got 0 bytes", "timed out waiting", "wait timeout after", "remote process exited",
              "ncclremoteerror", "watchdog caught collective operation timeout", "pair closure")
"""What a collective's error says when a peer is gone: gloo's connection errors (plain RuntimeErrors) and its
receive timeout (a node that vanished closes no connection) and its closing of a pair on an application timeout,
the store's, NCCL's remote error and watchdog timeout. Lower case."""

_OWN_ERROR = ("cuda error", "cudaerror", "cuda failure", "out of memory", "illegal memory access",
              "ncclunhandledcudaerror", "ncclinvalidargument", "ncclinvalidusage", "invalid argument",
              "invalid tensor size", "size mismatch", "doesn't match expected size",
              "collective mismatch", "mismatch between")
"""What says the error is this run's own, whatever else the text holds (an aborted communicator names the
original reason): a restart would hit it again. Lower case."""

_OWN_UNLESS_PEER_GONE = ("ncclinternalerror",)
"""NCCL's internal error: the run's own, unless its text (NCCL's "Last error") says a connection to a peer was
lost, as it does when a node dies mid-collective."""


def is_lost_peer(err: BaseException) -> bool:
    """Whether `err` (or an error it was raised from) is a collective or store failing because a peer is gone:
    torch's network and store errors, and runtime errors that say a connection closed, reset or timed out, or
    NCCL's remote error. Never one whose text names an error of the run's own (_OWN_ERROR)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = f"{type(err).__name__}: {err}".lower()
        if any(marker in text for marker in _OWN_ERROR):
            return False
        peer_gone = any(m in text for m in _PEER_GONE)
        if any(marker in text for marker in _OWN_UNLESS_PEER_GONE) and not peer_gone:
            return False
        names = {cls.__name__ for cls in type(err).__mro__}
        if names & _PEER_ERROR_TYPES or (isinstance(err, RuntimeError) and peer_gone):
            return True
        err = err.__cause__
    return False


def restartable(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a worker of an elastic agent that restarts its group (trainer's, or torchrun with --max-restarts):
    a stop or a lost peer there is a membership change the next group reports, not the run's end."""
    if environ.get(ELASTIC_ENV) == "1":
        return True
    try:
        return bool(environ.get("TORCHELASTIC_RUN_ID")) and int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    except ValueError:
        return False


def lost_peer(err: BaseException, environ: Mapping[str, str] = os.environ,
              traceback_file: str | Path | None = None) -> str | None:
    """One line for a collective that failed because a peer of a restartable worker group is gone (`is_lost_peer`),
    naming the file that keeps its traceback; None for any other error, or outside such a group."""
    if not restartable(environ) or not is_lost_peer(err):
        return None
    first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # gloo's source location, then its advice
    kept = f"; traceback: {traceback_file}" if traceback_file else ""
    return (f"trainer: rank {environ.get('RANK', '?')} lost a peer of its worker group ({first[:160]}); "
            f"the elastic agent restarts the group{kept}")


def progress_every_s(environ: Mapping[str, str] = os.environ) -> float:
    """How often elastic.json may be rewritten: PROGRESS_EVERY_S_ENV, else PROGRESS_EVERY_S."""
    value = environ.get(PROGRESS_EVERY_S_ENV, "")
    try:
        return max(0.0, float(value)) if value.strip() else PROGRESS_EVERY_S
    except ValueError:
        raise ConfigError(f"{PROGRESS_EVERY_S_ENV}={value!r}: expected seconds, e.g. 1 (0: every step)") from None


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
    restarted worker group, says what changed in one line and one metrics record (`write`).

    The record is rewritten at the group's first step, then at most every `every_s` seconds (default:
    PROGRESS_EVERY_S, or PROGRESS_EVERY_S_ENV), and at `finish` when the group stops (a stop signal: a node that
    joins, a preemption), so a stopped group's last step is exact and a killed one's is at most `every_s` old."""

    def __init__(self, run_dir: str | Path, is_main: bool, world: int, resumed_step: int,
                 write: Callable[[dict[str, Any]], None], environ: Mapping[str, str] = os.environ,
                 every_s: float | None = None):
        self.path = Path(run_dir) / PROGRESS_FILE
        self.run_id = _elastic_run_id(environ)
        self.active = is_main and self.run_id is not None
        self.world, self.resumed_step, self.write = world, resumed_step, write
        self.nodes = int(environ.get("GROUP_WORLD_SIZE") or 1)
        self.every_s = progress_every_s(environ) if every_s is None else every_s
        # A group that resumed nothing is a run's first (a restart resumes the checkpoint the last group left).
        self.before = restarted_group(run_dir, environ) if self.active and resumed_step else None
        self._tmp = self.path.with_name(f".{PROGRESS_FILE}.{os.getpid()}")
        self._last: tuple[int, float] | None = None  # the last step and its wall time
        self._written_at: float | None = None  # time.monotonic() of the last rewrite

    def after_step(self, step: int) -> None:
        if not self.active:
            return
        now = time.time()
        if self.before is not None:
            self._announce(step, now)
            self.before = None
        self._last = (step, now)
        if self._written_at is None or time.monotonic() - self._written_at >= self.every_s:
            self._record()

    def finish(self, status: str) -> None:
        """At the end of fit: a completed run has no next group, and a later launch must not read it as one; a
        stopped group records its last step for the next one."""
        if not self.active:
            return
        if status == "completed":
            self.path.unlink(missing_ok=True)
        elif self._last is not None:
            self._record()

    def _record(self) -> None:
        step, when = self._last
        # Not fsynced: it only dates the last step for the next group's line.
        self._tmp.write_text(json.dumps({"run_id": self.run_id, "step": step, "time": when, "world_size": self.world,
                                         "nodes": self.nodes}))
        os.replace(self._tmp, self.path)
        self._written_at = time.monotonic()

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

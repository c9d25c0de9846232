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
an out-of-memory) is an error of the run that a restart would repeat (core/rank_errors.py). A timeout alone proves
no loss: a rank that skipped or reordered a collective leaves its peers waiting as a dead one does. So every rank of
a restartable group beats a counter in the group's store (`PeerHeartbeat`, a thread), and a collective that timed out
is a lost peer only when some rank's counter stopped (or the store is gone); with every rank beating it is the run's
own error (`every_rank_alive`).

Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
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

_TIMEOUT = ("timed out waiting", "wait timeout after", "socket timeout",
            "watchdog caught collective operation timeout")
"""What a collective's error says when it waited too long for a peer (gloo's receive and its socket's timeouts, the
store's wait, NCCL's watchdog): a peer gone, or alive and waiting elsewhere (`every_rank_alive` tells). Lower case."""

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


def is_timeout(err: BaseException) -> bool:
    """Whether `err` is a lost peer (`is_lost_peer`) by a timeout only: no connection closed, reset or refused, no
    store or network error type. A timeout with every peer alive is a collective the ranks did not all call."""
    if not is_lost_peer(err):
        return False
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = f"{type(err).__name__}: {err}".lower()
        if {cls.__name__ for cls in type(err).__mro__} & _PEER_ERROR_TYPES:
            return False
        if any(m in text for m in _PEER_GONE if m not in _TIMEOUT):
            return False
        err = err.__cause__
    return True


EVERY_RANK_ALIVE = "a collective timed out with every rank alive: a rank skipped or reordered a collective?"
"""The line for a collective's timeout while every rank of the group was beating (`every_rank_alive`)."""

HEARTBEAT_S = 0.5
"""How often each rank's heartbeat counter goes up in the group's store."""
CONFIRM_S = 5.0
"""How long a rank whose collective timed out watches its peers' counters: one that does not go up in that time
(many heartbeats: a GC pause or a busy store does not stop it) is gone or cut off."""


class PeerHeartbeat:
    """Every rank of a restartable group, in a thread: a counter of its own in the group's store (a connection of
    its own, cloned from the default process group's store) goes up every `interval_s`; `all_alive` watches every
    rank's counter. A rank alive beats whatever its main thread does (a collective releases the interpreter lock);
    a dead, stopped or cut-off one does not, nor does anything once the store is gone."""

    def __init__(self, store: Any, rank: int, world: int, interval_s: float = HEARTBEAT_S):
        self.rank, self.world, self.interval_s = rank, world, interval_s
        self._store, self._lock, self._stop = store, threading.Lock(), threading.Event()
        self._verdict: bool | None = None
        self._thread = threading.Thread(target=self._beat, name="trainer-heartbeat", daemon=True)
        self._thread.start()

    @staticmethod
    def key(rank: int) -> str:
        return f"trainer/alive/{rank}"

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    self._store.add(self.key(self.rank), 1)
            except Exception:  # noqa: BLE001 - a busy store's timeout: beat again; a store gone is all_alive's to see
                pass
            self._stop.wait(self.interval_s)

    def _counts(self) -> list[int]:
        with self._lock:
            return [int(self._store.add(self.key(r), 0)) for r in range(self.world)]  # add 0: never waits for a key

    def all_alive(self, within_s: float = CONFIRM_S) -> bool:
        """Whether every rank's counter went up within `within_s` (False when the store cannot be reached). The
        first answer is kept: it is asked once a failure, and the answer must not change between its uses."""
        if self._verdict is None:
            try:
                first, deadline = self._counts(), time.monotonic() + within_s
                while True:
                    time.sleep(self.interval_s / 2)
                    if all(now > before for now, before in zip(self._counts(), first)):
                        self._verdict = True
                        break
                    if time.monotonic() >= deadline:
                        self._verdict = False
                        break
            except Exception:  # noqa: BLE001 - the store unreachable, a store timeout: its host is gone
                self._verdict = False
        return self._verdict

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 5)


_heartbeat: PeerHeartbeat | None = None


def start_heartbeat(environ: Mapping[str, str] = os.environ) -> PeerHeartbeat | None:
    """Start this rank's heartbeat (`PeerHeartbeat`) in a restartable group of several processes (the only place a
    lost peer is told from the run's own error); None elsewhere, or where the group has no store to beat in."""
    global _heartbeat
    if _heartbeat is not None or not restartable(environ):
        return _heartbeat
    import datetime

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    try:
        store = dist.distributed_c10d._get_default_store().clone()
        store.set_timeout(datetime.timedelta(seconds=CONFIRM_S))
    except (AttributeError, RuntimeError, ValueError):  # a store that cannot be cloned: timeouts stay lost peers
        return None
    _heartbeat = PeerHeartbeat(store, dist.get_rank(), dist.get_world_size())
    return _heartbeat


def stop_heartbeat() -> None:
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


def every_rank_alive(err: BaseException, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `err` is a collective's timeout (`is_timeout`) while every rank of this restartable group still beats
    (`PeerHeartbeat.all_alive`, which takes up to CONFIRM_S when one does not): the run's own error, not a lost peer.
    False without a heartbeat (not restartable, one process): a timeout then stays a lost peer."""
    return restartable(environ) and _heartbeat is not None and is_timeout(err) and _heartbeat.all_alive()


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
    """One line for a collective that failed because a peer of a restartable worker group is gone (`is_lost_peer`;
    a timeout only where a peer stopped beating: `every_rank_alive`), naming the file that keeps its traceback; None
    for any other error, or outside such a group."""
    if not restartable(environ) or not is_lost_peer(err) or every_rank_alive(err, environ):
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
        start_heartbeat(environ)  # every rank: a timeout is a lost peer only when a peer stopped beating
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
        stop_heartbeat()
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

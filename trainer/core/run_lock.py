"""One live run per output directory: `RunDir(output_dir).lock`, held by the main process until the end
of `Trainer.fit()` (`release_run_lock`) or until it exits.

Two runs writing the same checkpoints and metrics.jsonl corrupt each other's resume state, so a
second run on a held directory refuses to start, naming the holder's host and pid. The holder keeps
an exclusive `flock` on the file for as long as it lives (the kernel drops it when the process dies,
however it dies) and refreshes the file's mtime every `HEARTBEAT_S`. A lock left behind by a dead
process is taken over with a warning: on this host when its pid is gone, from another host when its
heartbeat is older than `STALE_AFTER_S` (file systems do not always share flocks between hosts). A
restarted worker group of an elastic run takes over the lock of an earlier group of the same run at once,
even from a lost node (`_earlier_group`).
Within one process the lock is re-entrant; a forked child (a DataLoader worker) drops its copy, so it
cannot keep the lock of a killed main process alive.

A holder that was taken over may still be alive (a node cut off from the others, a process stopped for longer than
the heartbeat allows), and its saves must not land any more. Each takeover therefore starts a new generation of the
run: one more in `RUN_DIR/.generation` (`generation_file`), written while the new holder has the lock. Every process
of a worker group gets its group's number (`claim_output_dir` hands the main process's to the others;
`run_generation`), and the checkpoint store checks it against the file before it renames or removes anything
(`store.Generation`). A lock taken without a takeover (its last holder released it) keeps the generation.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from trainer.atomic_io import atomic_write_text
from trainer.core.checkpoint.store import Generation, read_generation
from trainer.core.elastic import restartable
from trainer.errors import TrainerError
from trainer.rundir import RunDir

logger = logging.getLogger("trainer")

HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0
GENERATION_FILE = ".generation"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLockedError(TrainerError, RuntimeError):
    """The output directory belongs to a run that is still alive."""


def _this_process() -> dict[str, Any]:
    me = psutil.Process()
    return {"host": socket.gethostname(), "pid": os.getpid(), "create_time": me.create_time(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cmdline": " ".join(me.cmdline())[:500],
            "elastic_run": _elastic_run()}


def _elastic_run() -> str | None:
    """The rendezvous run of a worker group its agent restarts (launches that never restart record none: a
    static rendezvous names every launch alike)."""
    return (os.environ.get("TORCHELASTIC_RUN_ID") or None) if restartable() else None


def _earlier_group(holder: dict[str, Any] | None) -> bool:
    """Whether the lock was taken by an earlier worker group of this elastic run: the agents stopped every worker
    of it before this group started, so it is gone, even when another host's flock or heartbeat does not say so
    yet (a lost node's lock on a shared file system). On this host its pid says it."""
    run = _elastic_run()
    if not run or holder is None or holder.get("elastic_run") != run:
        return False
    if holder.get("host") == socket.gethostname():
        return not _pid_alive(int(holder.get("pid", -1)), holder.get("create_time"))
    return True


def _pid_alive(pid: int, create_time: float | None) -> bool:
    """Whether `pid` on this host is still the process that wrote the lock (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(proc.create_time() - create_time) < 1.0
    except psutil.Error:
        return False


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        text = os.pread(fd, 65536, 0).decode(errors="replace")
        holder = json.loads(text) if text.strip() else None
    except (OSError, json.JSONDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "another process (it has not written its host and pid yet)"
    return f"pid {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')})"


def _in_use(path: Path, holder: dict[str, Any] | None) -> RunLockedError:
    return RunLockedError(f"{path.parent} is in use by a live run: {_describe(holder)}. Wait for it to end, "
                          f"stop it, or give this run another run.output_dir")


class RunLock:
    """An acquired lock on one run directory; `release()` (also at exit) removes it. `generation`: the run's
    generation this holder's worker group belongs to (module docstring)."""

    def __init__(self, path: Path, fd: int, generation: int = 0):
        self.path = path
        self.generation = generation
        self._fd: int | None = fd
        self._owner = os.getpid()
        self._stop = threading.Event()
        threading.Thread(target=self._heartbeat, name="trainer-run-lock-heartbeat", daemon=True).start()
        atexit.register(self.release)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            fd = self._fd
            if fd is None:
                return
            try:
                os.utime(fd)
            except OSError:  # a vanished directory must not kill the run; the next start decides
                pass

    def release(self) -> None:
        if os.getpid() != self._owner:  # a forked child exiting through atexit: the lock is its parent's
            return
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self._stop.set()
        try:
            # Only our own file: after a takeover by force the path may name someone else's lock.
            if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)  # drops the flock
        _held.pop(self.path, None)


_held: dict[Path, RunLock] = {}
_held_guard = threading.Lock()


def _forget_in_child() -> None:
    """After fork: drop the child's reference to the locked file. A flock belongs to the open file, which
    fork shares; a forked DataLoader worker outliving a killed main process would hold it otherwise."""
    for lock in _held.values():
        if lock._fd is not None:
            try:
                os.close(lock._fd)
            except OSError:
                pass
            lock._fd = None
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def generation_file(output_dir: str | Path) -> Path:
    """Where the run's newest generation is kept, beside the lock (outside `checkpoints/`, which run.resume=none
    moves aside)."""
    return RunDir(output_dir).root.absolute() / GENERATION_FILE


def _start_generation(output_dir: str | Path) -> int:
    """One more than the run's newest generation, written before the new holder does anything in the directory."""
    number = read_generation(generation_file(output_dir)) + 1
    atomic_write_text(generation_file(output_dir), f"{number}\n")
    return number


_joined: dict[Path, int] = {}
"""The generation of this process's worker group by lock path, where another process of the group holds the lock."""


def join_generation(output_dir: str | Path, number: int) -> None:
    """Record the generation of the worker group this process belongs to (its main process took the lock)."""
    _joined[RunDir(output_dir).lock.absolute()] = number


def run_generation(output_dir: str | Path) -> Generation | None:
    """The generation this process's saves into `output_dir` belong to: its lock's, or the one its worker group
    joined; None when it neither holds the lock nor joined a group that does."""
    path = RunDir(output_dir).lock.absolute()
    lock = _held.get(path)
    number = lock.generation if lock is not None and lock.held else _joined.get(path)
    return None if number is None else Generation(number, generation_file(output_dir))


def release_run_lock(output_dir: str | Path) -> None:
    """Release this process's lock on `output_dir` now rather than at exit (no-op if not held)."""
    lock = _held.get(RunDir(output_dir).lock.absolute())
    if lock is not None:
        lock.release()


def _stale_reason(holder: dict[str, Any] | None, fd: int) -> str | None:
    """Why a lock whose flock we obtained is stale, or None if its holder may still be alive."""
    if holder is None:
        return "it names no process"
    if holder.get("host") == socket.gethostname():
        if _pid_alive(int(holder.get("pid", -1)), holder.get("create_time")):
            return None  # alive, yet no flock held: file systems without flock support
        return "that process no longer exists"
    age = time.time() - os.fstat(fd).st_mtime
    if age > STALE_AFTER_S:
        return f"its heartbeat stopped {age:.0f}s ago"
    return None


def acquire_run_lock(output_dir: str | Path) -> RunLock:
    """Take `RunDir(output_dir).lock` for this process, or raise RunLockedError naming the live holder; a takeover
    starts a new generation of the run (module docstring).

    Re-entrant within one process (several Trainers in one interpreter, e.g. a test, share it).
    """
    path = RunDir(output_dir).lock.absolute()
    with _held_guard:
        if path in _held and _held[path].held:
            return _held[path]
        path.parent.mkdir(parents=True, exist_ok=True)
        took_over = False
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                if not _earlier_group(holder):
                    raise _in_use(path, holder) from None
                logger.info("taking over the lock of %s from an earlier worker group of this elastic run (%s)",
                            path.parent, _describe(holder))
                path.unlink(missing_ok=True)  # a new file: the old one's flock stays with the old group's file
                took_over = True
                continue
            except OSError as err:
                if err.errno not in _NO_FLOCK:
                    os.close(fd)
                    raise
                # No flock on this file system: the pid and heartbeat checks below decide alone.
            try:
                same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same_file = False
            if not same_file:  # the holder released (unlinked) it between our open and flock: start over
                os.close(fd)
                continue
            holder = _read_holder(fd)
            if os.fstat(fd).st_size and not _earlier_group(holder):
                reason = _stale_reason(holder, fd)
                if reason is None:
                    os.close(fd)
                    raise _in_use(path, holder)
                logger.warning("taking over the lock of %s left by %s: %s", path.parent, _describe(holder), reason)
            try:
                # A file left with content: its holder never released it (dead, or alive and cut off).
                took_over = took_over or os.fstat(fd).st_size > 0
                generation = _start_generation(output_dir) if took_over else read_generation(generation_file(output_dir))
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(_this_process()) + "\n").encode(), 0)
            except BaseException:
                os.close(fd)
                raise
            lock = _held[path] = RunLock(path, fd, generation)
            return lock

"""Build the data caches once per job: a file lock in the cache folder, not a collective.

Every process of a job calls the task's `build_data` inside `build_once`. The first to take the lock
(exclusive `fcntl.flock` on a file in the cache folder) builds; the others poll the lock (no collective, so
no collective timeout: a build may take hours) and log every minute whom they wait for. When the builder
is done it stamps the lock file with what it built and lets go; the waiters then take the lock shared,
see the stamp and load the caches side by side. Where the cache folder is shared by every node, one
process of the job builds; where it is node-local, the lock is too, so each node's first process builds.

The kernel drops a dead process's lock, so a builder that crashes leaves no one waiting forever: its stamp
is missing, and the next waiter to take the lock builds. Where the folder cannot hold a lock (not
writable, or a filesystem mounted without flock support), `fallback` guards the build instead; the trainer
passes none, so every process builds: a barrier there would be a collective that some ranks enter and others
(whose lock works) do not. Cache writes are atomic (temp file + rename), so two builders of the same cache
(a lock that spans less than the cache folder) cost time, never correctness.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from trainer.data.arrow_cache import digest

logger = logging.getLogger("trainer")

LOG_EVERY_S = 60.0
"""Seconds between a waiter's log lines."""
POLL_MAX_S = 2.0
"""Longest pause between two tries of the lock (short at first; a shared filesystem serves each try)."""

_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EACCES, errno.EROFS, errno.EPERM}
"""flock or open errors that mean the folder cannot hold a lock (rather than that someone holds it)."""


def default_cache_folder() -> Path:
    """$TRAINER_CACHE_DIR, else the `datasets` cache (HF_DATASETS_CACHE): the lock folder of a task without
    `cache_dir`. The families' default caches are written there (arrow_cache.cache_root), so the lock spans the
    same nodes as the caches it guards: shared by the job where that folder is shared, one per node where not."""
    root = os.environ.get("TRAINER_CACHE_DIR")
    if root:
        return Path(root)
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE)


def task_lock_path(task_cfg: Any) -> Path:
    """The lock file for a task's data build: in its `cache_dir` where it has one, else `default_cache_folder`."""
    folder = getattr(task_cfg, "cache_dir", "") or default_cache_folder()
    return Path(folder).expanduser() / f".build-{getattr(task_cfg, 'name', 'task')}.lock"


def task_build_key(task_cfg: Any, seed: int) -> str:
    """What a data build depends on: the task's options and the run's seed (a stamp names it)."""
    cfg = dataclasses.asdict(task_cfg) if dataclasses.is_dataclass(task_cfg) else task_cfg
    return digest({"task": cfg, "seed": seed})


def _try_lock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return False
        raise


def _read_stamp(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 1 << 16, 0)
        return json.loads(raw.decode()) if raw.strip() else {}
    except (OSError, ValueError):
        return {}


def _write_stamp(fd: int, stamp: dict[str, Any]) -> None:
    data = json.dumps(stamp).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


@contextlib.contextmanager
def build_once(lock_path: str | Path, key: str, what: str = "the data caches",
               fallback: Callable[[], AbstractContextManager[Any]] | None = None) -> Iterator[bool]:
    """Run the body (a data build) in the first process to take `lock_path`, then in the others.

    The body runs in every process: in the first holding the lock exclusively (it builds the caches), in the
    others after it, holding the lock shared when its stamp says `key` was built (they load the caches side by
    side), else exclusively in turn (the builder failed or built something else: this one builds). Yields
    True, or False where the lock could not be used and `fallback()` (if given) guarded the body instead.
    """
    lock_path = Path(lock_path)
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        if err.errno not in _UNSUPPORTED:
            raise
        fd = -1
        reason = f"cannot open {lock_path} ({err.strerror})"
    if fd >= 0:
        try:
            mode = _acquire(fd, lock_path, key, what)
        except OSError as err:
            os.close(fd)
            if err.errno not in _UNSUPPORTED:
                raise
            fd = -1
            reason = f"{lock_path}'s filesystem refuses file locks ({err.strerror})"
        except BaseException:  # interrupted while waiting
            os.close(fd)
            raise
    if fd < 0:
        logger.warning("building %s without a file lock: %s; %s", what, reason,
                       "the main process builds first" if fallback else "every process builds")
        with fallback() if fallback is not None else contextlib.nullcontext():
            yield False
        return
    try:
        if mode == fcntl.LOCK_EX:
            _write_stamp(fd, {"holder": f"{socket.gethostname()}:{os.getpid()}", "since": time.time(), "what": what,
                              "built": None})  # a crash before the end leaves no stamp: the next holder builds
        yield True
        if mode == fcntl.LOCK_EX:
            _write_stamp(fd, {"holder": None, "built": key, "by": f"{socket.gethostname()}:{os.getpid()}",
                              "at": time.time()})
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _acquire(fd: int, lock_path: Path, key: str, what: str) -> int:
    """Take the lock: exclusive (to build) or shared (`key` already built); returns the mode held."""
    if _try_lock(fd, fcntl.LOCK_EX):
        return fcntl.LOCK_EX
    start = last_log = time.monotonic()
    pause = 0.05
    while True:
        time.sleep(pause * (0.5 + random.random()))  # jitter: many waiters do not poll in step
        pause = min(pause * 2, POLL_MAX_S)
        # Shared first: once the build is stamped, the waiters load side by side rather than one after another.
        if _try_lock(fd, fcntl.LOCK_SH):
            if _read_stamp(fd).get("built") == key:
                return fcntl.LOCK_SH
            fcntl.flock(fd, fcntl.LOCK_UN)  # the builder failed, or built another task's data: build in turn
        if _try_lock(fd, fcntl.LOCK_EX):
            return fcntl.LOCK_EX
        now = time.monotonic()
        if now - last_log >= LOG_EVERY_S:
            last_log = now
            holder = _read_stamp(fd).get("holder") or "another process"
            logger.info("waiting %.0f s so far for %s to build %s (lock %s)", now - start, holder, what, lock_path)

def task_build_once(task_cfg: Any, seed: int,
                    fallback: Callable[[], AbstractContextManager[Any]] | None = None) -> AbstractContextManager[bool]:
    """`build_once` for a task's `build_data`: the lock in its cache folder, keyed by its options and seed."""
    return build_once(task_lock_path(task_cfg), task_build_key(task_cfg, seed),
                      what=f"the data caches of task {getattr(task_cfg, 'name', '?')}", fallback=fallback)

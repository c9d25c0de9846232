"""A rank dies with its launcher: no orphaned ranks that keep training and writing checkpoints.

torch elastic (`torchrun`, `accelerate launch` with several processes) starts every rank in a session
of its own, so a SIGKILL to the launcher's process group (a batch system, a user's `kill`) misses the
ranks. A rank started by a launcher therefore asks the kernel for SIGKILL when its parent dies (Linux
`prctl(PR_SET_PDEATHSIG)`; it works even when the rank is stuck in a collective), and a daemon thread
polls the parent pid as well, for a parent that died before the prctl call and for platforms without
prctl. SIGKILL, not SIGTERM: without its launcher a rank's peers may be gone too, so a graceful
checkpoint could hang; the last complete checkpoint stays valid (they are written atomically).
A plain `python` run has no launcher to lose and gets neither.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
"""Set for each rank by torch elastic (torchrun, accelerate launch) and the deepspeed launcher."""
POLL_S = 0.5
PR_SET_PDEATHSIG = 1

_installed_for: int | None = None  # the parent pid the guard watches (once per process)


def started_by_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """True for a rank of torchrun / accelerate launch / deepspeed, False for a plain `python` run."""
    return any(key in environ for key in LAUNCHER_ENV)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux only); True if set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:
            # The launcher is gone: nobody will collect this rank's exit status or stop its peers.
            try:
                sys.stderr.write(f"trainer: launcher (pid {parent}) died; stopping rank (pid {os.getpid()})\n")
                sys.stderr.flush()
            finally:
                os.kill(os.getpid(), signal.SIGKILL)


def guard_against_orphaning(environ: Mapping[str, str] = os.environ) -> bool:
    """In a rank started by a launcher: die (SIGKILL) within a second of the launcher's death.

    Idempotent; returns whether the guard is active. Called by `build_accelerator` on every rank.
    """
    global _installed_for
    if not started_by_launcher(environ):
        return False
    if _installed_for is not None:
        return True
    parent = os.getppid()
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died between getppid and prctl
        os.kill(os.getpid(), signal.SIGKILL)
    _installed_for = parent
    threading.Thread(target=_watch_parent, args=(parent,), name="trainer-parent-watchdog", daemon=True).start()
    return True


EXIT_GRACE_S = float(os.environ.get("TRAINER_EXIT_GRACE_S", "60"))
"""Seconds a finished rank may spend in interpreter and process-group teardown before it leaves anyway."""


def arm_exit_guard(status: int, grace_s: float = EXIT_GRACE_S) -> threading.Thread:
    """After a run has finished (checkpoint written, process group torn down), make sure the rank exits.

    Collective-library teardown at interpreter exit occasionally hangs (gloo and NCCL, pytorch#75097);
    the work is already on disk, so a rank still alive `grace_s` later dumps every thread's stack to
    stderr (for a bug report) and exits with the run's `status`.
    """

    def guard() -> None:
        time.sleep(grace_s)
        import faulthandler

        sys.stderr.write(f"trainer: the run finished but this process did not exit within {grace_s:g} s "
                         f"(teardown hang); its threads:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)
        os._exit(status)

    thread = threading.Thread(target=guard, name="trainer-exit-guard", daemon=True)
    thread.start()
    return thread

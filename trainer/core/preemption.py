"""Stop signals: SIGTERM/SIGUSR1 (preemption) and SIGINT (Ctrl-C) become a stop at a step boundary (or an
evaluation batch) that every rank agrees on.

The Trainer asks `PreemptionWatcher.should_stop()` at each step boundary and before each evaluation batch (an
evaluation may outlast a batch system's grace period; a stopped one is dropped); on a stop it writes the step's
checkpoint and `report_stop` its marker, and the process exits with `PREEMPTED_EXIT_CODE` after SIGTERM/SIGUSR1,
which batch systems read as "requeue", or `INTERRUPTED_EXIT_CODE` after Ctrl-C, the shell's status for SIGINT.
A rank that cannot reach a boundary exits without a checkpoint instead of hanging (see the class).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch

from trainer.atomic_io import atomic_write_text
from trainer.core.checkpoint import store
from trainer.core.command_line import interrupted_line, resume_command, started_by_front_end

if TYPE_CHECKING:
    from trainer.config import Config
    from trainer.rundir import RunDir

logger = logging.getLogger("trainer")

PREEMPTED_EXIT_CODE = 75
"""Exit status after a SIGTERM/SIGUSR1 checkpoint (EX_TEMPFAIL: try again, i.e. requeue)."""
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
"""Exit status after a Ctrl-C checkpoint (and after a second Ctrl-C, which stops without one)."""
PREEMPT_GRACE_S = float(os.environ.get("TRAINER_PREEMPT_GRACE_S", "60"))
"""After SIGTERM/SIGUSR1, the longest wait for the next step boundary (environment variable
`TRAINER_PREEMPT_GRACE_S`). A rank stuck in a collective or in its data never reaches one: it then
exits with status 128 + signal and no checkpoint, as it does at once on a second signal."""
DUPLICATE_SIGNAL_S = 2.0
"""A second signal this soon after the first is the same request delivered twice (the batch system
signals every process and the launcher forwards its own copy), not a request to stop at once."""
DOUBLE_PRESS_S = 0.5
"""A second Ctrl-C counts once this much time has passed since the first: a person pressing twice
means "stop now", whereas a copy forwarded by a launcher arrives within milliseconds."""


def stop_exit_code(signal_name: str | None) -> int:
    """The exit status of a run stopped by `signal_name` after its checkpoint."""
    return INTERRUPTED_EXIT_CODE if signal_name == "SIGINT" else PREEMPTED_EXIT_CODE


class PreemptionWatcher:
    """Turns SIGTERM/SIGUSR1/SIGINT into a stop request that all ranks agree on at the same step (or evaluation batch).

    With several processes the local flags are max-reduced over a gloo group, asynchronously: the
    reduction started at step (or batch) k is read at k+1, so no step waits on the device. Every rank asks at
    the same points, and once they agreed the answer stays yes. A Ctrl-C on any
    rank outranks a preemption signal, so every rank agrees on the reason too (`stop_signal`).

    A rank that never reaches a step boundary (stuck in a collective, or in data that yields nothing)
    would wait for one forever, so a listener thread, woken by the signal itself through
    `signal.set_wakeup_fd` (Python-level handlers only run when the main thread runs Python), ends the
    process when no boundary came within `grace_s` of the signal (or of the last boundary), or at once
    on a second signal. Once the ranks agreed to stop, the checkpoint may take as long as it needs.
    """

    signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    _active: PreemptionWatcher | None = None  # the one whose listener owns the wakeup fd

    def __init__(self, world_size: int, grace_s: float = PREEMPT_GRACE_S, announce: bool = True):
        """announce: say on stderr that a signal arrived (the main process; the other ranks stay quiet)."""
        if PreemptionWatcher._active is not None:  # left open by a fit() that raised
            PreemptionWatcher._active._release()
        self.requested = False
        self.received: str | None = None
        self.received_at: float | None = None
        """When (time.monotonic()) the first stop signal arrived: a launcher's SIGKILL follows it in a fixed time."""
        self.stop_signal: str | None = None
        """Once the ranks agreed to stop: SIGINT if any rank had a Ctrl-C, else the preemption signal."""
        self.grace_s = grace_s
        self.announce = announce
        self._world_size = world_size
        self._pending = None
        self._flag = torch.zeros(1)
        self._group = None
        self._previous = {}
        self._boundary_at = time.monotonic()
        self._stopping = False  # the stop is agreed: the final checkpoint is being written
        self._listener: threading.Thread | None = None
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave handlers alone
                pass
        if self._previous:
            self._start_listener()
        if world_size > 1:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.requested = True
        self.received = signal.Signals(signum).name
        self.received_at = self.received_at or time.monotonic()

    def _start_listener(self) -> None:
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)  # set_wakeup_fd needs a non-blocking fd
        try:
            self._previous_wakeup = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        except ValueError:
            self._reader.close()
            self._writer.close()
            return
        self._listener = threading.Thread(target=self._listen, name="trainer-preemption-grace", daemon=True)
        self._listener.start()
        PreemptionWatcher._active = self

    def _listen(self) -> None:
        watched = {int(s) for s in self.signals}
        first_at: float | None = None
        while True:
            timeout = None
            if first_at is not None and not self._stopping:
                timeout = max(0.0, max(first_at, self._boundary_at) + self.grace_s - time.monotonic())
            self._reader.settimeout(timeout)
            try:
                data = self._reader.recv(64)
            except TimeoutError:
                if not self._stopping and time.monotonic() - max(first_at, self._boundary_at) >= self.grace_s:
                    self._give_up(f"{self.received or 'a stop signal'} received, but no step ended within "
                                  f"{self.grace_s:g} s (a rank waiting in a collective or for its data?)")
                continue
            except OSError:
                return
            if self._previous_wakeup >= 0:  # someone else's wakeup fd (an event loop): pass it on
                try:
                    os.write(self._previous_wakeup, data.replace(b"\0", b""))
                except OSError:
                    pass
            for signum in data:
                if signum == 0:  # close() or nothing more to read
                    return
                if signum not in watched:
                    continue
                name = signal.Signals(signum).name
                if first_at is None:
                    first_at, self.requested, self.received = time.monotonic(), True, name
                    self.received_at = self.received_at or first_at
                    if self.announce:
                        sys.stderr.write(_first_signal_message(name))
                        sys.stderr.flush()
                elif name == "SIGINT" and self.received == "SIGINT":
                    if time.monotonic() - first_at > DOUBLE_PRESS_S:
                        self._give_up("Ctrl-C pressed again: stopping at once")
                elif time.monotonic() - first_at > DUPLICATE_SIGNAL_S:
                    self._give_up(f"second {name} received before the step ended")
            if not data:
                return

    def _give_up(self, reason: str) -> None:
        """Exit now, from the listener thread: the main thread may never run Python again."""
        signum = int(getattr(signal, self.received or "SIGTERM"))
        try:
            sys.stderr.write(f"trainer: {reason}; exiting with status {128 + signum} without a checkpoint "
                             f"(the last complete checkpoint is intact; run.resume=auto continues from it)\n")
            sys.stderr.flush()
        finally:
            os._exit(128 + signum)

    @property
    def stopping(self) -> bool:
        """Whether the ranks agreed to stop (at a `should_stop`)."""
        return self._stopping

    @property
    def status(self) -> str:
        """The run's status: `interrupted` (the ranks agreed to stop for a Ctrl-C), `preempted` (for another stop
        signal) or `completed` (no stop)."""
        if not self._stopping:
            return "completed"
        return "interrupted" if self.stop_signal == "SIGINT" else "preempted"

    def should_stop(self) -> bool:
        """Whether to stop here: the same answer on every rank, each of which asks at the same points."""
        self._boundary_at = time.monotonic()
        if self._stopping:  # agreed at an earlier point: no further collective
            return True
        if self._world_size == 1:
            self._stopping = self.requested
            self.stop_signal = self.received if self.requested else None
            return self.requested
        import torch.distributed as dist

        agreed = 0.0
        if self._pending is not None:
            self._pending.wait()
            agreed = self._flag.item()
        # 2: a Ctrl-C here, 1: a preemption signal, 0: nothing
        local = (2.0 if self.received == "SIGINT" else 1.0) if self.requested else 0.0
        self._flag = torch.tensor([local])
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._stopping = agreed > 0
        if self._stopping:
            self.stop_signal = "SIGINT" if agreed >= 2 else (self.received if self.received != "SIGINT" else "SIGTERM")
            self.received_at = self.received_at or time.monotonic()  # a rank told by its peers: from now
        return self._stopping

    def close(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        self._release()

    def _release(self) -> None:
        """Give back the signal handlers and the wakeup fd, and end the listener."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._listener is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            try:
                self._writer.send(b"\0")  # wakes the listener, which ends
            except OSError:
                pass
            self._listener.join(timeout=5)
            self._reader.close()
            self._writer.close()
            self._listener = None
        if PreemptionWatcher._active is self:
            PreemptionWatcher._active = None


def stop_requested_at() -> float | None:
    """When (time.monotonic()) the running `fit`'s stop began, for a stop a SIGKILL may follow: a SIGTERM received
    here, or a stop learnt from the other ranks (their signal is not known here). None without a stop, and for a
    Ctrl-C or another signal received here (SLURM's early warning, SIGUSR1): nothing kills the process then."""
    active = PreemptionWatcher._active
    if active is None or active.received_at is None or active.stop_signal == "SIGINT":
        return None
    return active.received_at if active.received in (None, "SIGTERM") else None


def report_stop(cfg: Config, run_dir: RunDir, step: int, max_steps: int, watcher: PreemptionWatcher,
                quiet: bool = False) -> None:
    """On the main process, once a stopped run's checkpoint is written: its marker, `RUN_DIR/preempted.json`
    (launchers such as torchrun's agent replace the ranks' exit status; batch scripts look for this file), and
    one line: after Ctrl-C the command that resumes (the front end, `trainer train --nproc`, says it itself),
    after a preemption signal the exit status (not when `quiet`: an elastic agent restarts the group)."""
    signal_name = watcher.stop_signal or watcher.received
    atomic_write_text(run_dir.preempted, json.dumps({"step": step, "signal": signal_name}))
    if watcher.status == "interrupted":
        if not started_by_front_end():
            latest = store.latest_checkpoint(run_dir.checkpoints)
            print(interrupted_line(step, max_steps, latest, resume_command(cfg)), file=sys.stderr, flush=True)
    elif not quiet:
        latest = store.latest_checkpoint(run_dir.checkpoints)
        if latest is not None and latest.name != store.step_dir_name(step):  # given up at the stop (manager.py)
            logger.warning("stop requested by %s at step %d: no checkpoint of it was written (the latest complete one "
                           "is %s), exiting with status %d", signal_name or "another rank", step, latest.name,
                           stop_exit_code(signal_name))
        else:
            logger.warning("stop requested by %s: checkpoint at step %d written, exiting with status %d",
                           signal_name or "another rank", step, stop_exit_code(signal_name))


def _first_signal_message(name: str) -> str:
    if name == "SIGINT":  # on a line of its own, after a progress bar's
        return ("\ntrainer: Ctrl-C: stopping after the current step or evaluation batch with a checkpoint "
                "(Ctrl-C again stops at once, without one)\n")
    return (f"trainer: {name} received: stopping after the current step or evaluation batch "
            f"(a second {name} stops at once, without a checkpoint)\n")


def _forget_wakeup_fd_in_child() -> None:
    """A forked child (a DataLoader worker) must not write its own signals into the parent's listener,
    which would count a process-group SIGTERM twice and stop at once."""
    if PreemptionWatcher._active is not None:
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:  # forked from another thread: not the child's main thread
            pass


os.register_at_fork(after_in_child=_forget_wakeup_fd_in_child)

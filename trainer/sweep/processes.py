"""Launch and cleanup of one run: its own session, every descendant followed with psutil, nothing left behind.

A run starts in a new session, hence its own process group, so `killpg` reaches whatever stays in it.
Some processes leave the group: torch elastic starts every rank with setsid, and a command may run
`setsid` itself. So the runner also remembers every descendant it sees while the run is alive and,
when it stops the run or the run's main process ends, looks for the run's processes by its group and
by a token in their environment (`TRAINER_RUN_TOKEN`, inherited even by a process that left the tree
before it was ever seen). Those outside the group are signalled by pid. Every process signalled this
way is remembered for the run record.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from typing import IO, Any

import psutil

from trainer.core.watchdog import set_parent_death_signal

RUN_TOKEN_ENV = "TRAINER_RUN_TOKEN"
LEFTOVER_WAIT_S = 5.0


def _die_with_runner() -> None:
    """In the child before exec: SIGTERM when the runner dies (Linux), so a runner killed by SIGKILL or
    the OOM killer leaves no unsupervised runs holding GPUs. (Its own session shields it otherwise.)"""
    set_parent_death_signal(signal.SIGTERM)


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (an orphaned zombie waits for init to reap it; it holds nothing)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _pgid(proc: psutil.Process) -> int | None:
    try:
        return os.getpgid(proc.pid)
    except (ProcessLookupError, PermissionError):
        return None


def _command(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:300] or proc.name()
    except psutil.Error:
        return "?"


class RunProcess:
    """The process tree of one run, from `Popen` to the last descendant's death."""

    def __init__(self, argv: list[str], env: dict[str, str], log: IO[bytes]):
        self.token = uuid.uuid4().hex
        # A new session makes the run its own process group: we can signal its whole tree by group id,
        # and the terminal's Ctrl-C reaches only the runner, which decides how the runs stop.
        self.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env={**env, RUN_TOKEN_ENV: self.token}, start_new_session=True,
                                      preexec_fn=_die_with_runner if sys.platform == "linux" else None)
        self.pid = self.pgid = self.popen.pid
        try:  # taken before we reap it, so the pid cannot have been reused yet
            self.main: psutil.Process | None = psutil.Process(self.pid)
            self.created = self.main.create_time()
        except psutil.Error:  # it died already
            self.main, self.created = None, time.time() - 1.0
        self.seen: dict[int, psutil.Process] = {}
        self.signalled: dict[int, dict[str, Any]] = {}
        self.cpu_by_pid: dict[int, float] = {}

    def poll(self) -> int | None:
        return self.popen.poll()

    def tree(self) -> list[psutil.Process]:
        """The live tree under the main process (remembered, so those that move away are found later)."""
        if self.main is None or not _alive(self.main):
            return []
        try:
            tree = [self.main, *self.main.children(recursive=True)]
        except psutil.Error:
            return []
        for proc in tree:
            self.seen.setdefault(proc.pid, proc)
        return tree

    def _search(self) -> list[psutil.Process]:
        """Processes of this run that are not (or no longer) in its tree: same group, or carrying its token."""
        found = []
        for proc in psutil.process_iter(["create_time"]):
            # Only processes created since the run started can be its own; that spares most environ reads.
            created = proc.info.get("create_time")
            if created is None or created < self.created - 1.0 or proc.pid == os.getpid():
                continue
            try:
                if _pgid(proc) == self.pgid or proc.environ().get(RUN_TOKEN_ENV) == self.token:
                    found.append(proc)
            except psutil.Error:  # gone, or another user's process
                continue
        return found

    def members(self, search: bool = True) -> list[psutil.Process]:
        """Every live process of the run: its tree, all descendants seen before, and (`search`) the rest."""
        procs = {p.pid: p for p in self.seen.values()}
        procs.update((p.pid, p) for p in self.tree())
        if search:
            for proc in self._search():
                procs.setdefault(proc.pid, proc)
                self.seen.setdefault(proc.pid, proc)
        return [p for p in procs.values() if _alive(p)]

    def send(self, sig: int, search: bool = True) -> None:
        """`sig` to the process group and, by pid, to each process of the run outside it."""
        # Described before any signal, while they still run (a dying process has no command line).
        members = [(proc, _command(proc), _pgid(proc) != self.pgid) for proc in self.members(search)]
        try:
            os.killpg(self.pgid, sig)  # also reaches a group member forked a moment ago
        except (ProcessLookupError, PermissionError):
            pass
        for proc, command, outside in members:
            if outside:
                try:
                    proc.send_signal(sig)  # psutil checks the pid still names the same process
                except psutil.Error:
                    continue
            entry = self.signalled.setdefault(proc.pid, {"pid": proc.pid, "command": command})
            entry.update(signal=signal.Signals(sig).name, outside_group=outside)

    def kill_leftovers(self) -> list[dict[str, Any]]:
        """After the main process ended: SIGKILL whatever of the run still lives and wait (a few seconds at
        most) until it is gone, so its devices are free before they are handed out again."""
        left = self.members(search=True)
        if not left:
            return []
        self.send(signal.SIGKILL, search=False)
        give_up = time.monotonic() + LEFTOVER_WAIT_S
        while any(_alive(p) for p in left) and time.monotonic() < give_up:
            time.sleep(0.02)
        return [self.signalled[p.pid] for p in left if p.pid in self.signalled]

    def rss_mib(self) -> tuple[float, list[int]]:
        """Resident memory of the live tree (MiB) and its pids; sampling also remembers new descendants."""
        rss, pids = 0, []
        for proc in self.tree():
            try:
                rss += proc.memory_info().rss
                times = proc.cpu_times()
                self.cpu_by_pid[proc.pid] = times.user + times.system
                pids.append(proc.pid)
            except psutil.Error:
                continue
        return rss / 2**20, pids

    def cpu_seconds(self) -> float:
        """CPU seconds of every process of the run, each at its last sample."""
        return sum(self.cpu_by_pid.values())

    def killed_processes(self) -> list[dict[str, Any]]:
        """What the runner signalled to end this run, in the order it first did so."""
        return list(self.signalled.values())

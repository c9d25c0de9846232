"""No orphaned ranks, one live run per output directory: SIGKILL of `accelerate launch`'s process group
takes every rank with it (each rank is in a session of its own), a second run on a directory that a
live run holds refuses naming host and pid, and the lock of a killed run is taken over."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from conftest import ROOT, TINY, accelerate_cmd, child_env, run_cmd

from trainer.core.run_lock import RunLockedError, acquire_run_lock
from trainer.core.watchdog import started_by_launcher
from trainer.rundir import RunDir

LIVENESS_S = 15  # generous: the guard itself reacts within a second


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            tail = proc.stdout.read()[-3000:]
            raise AssertionError(f"{what}: the process ended early with {proc.returncode}:\n{tail}")
        assert time.time() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.1)


@pytest.mark.distributed
@pytest.mark.slow
def test_killing_the_launcher_group_stops_every_rank_and_the_lock_guards_the_directory(tmp_path, caplog):
    out = tmp_path / "run"
    cmd = accelerate_cmd("ddp.yaml", TINY, f"run.output_dir={out}", "task.delay_s=0.2", "train.max_steps=1000",
                         "log.every_steps=1", "log.progress_bar=false", "log.tensorboard=false", nproc=2)
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    ranks: list[int] = []
    try:
        metrics = RunDir(out).metrics
        wait_until(lambda: metrics.is_file() and '"loss"' in metrics.read_text(), 180, "first training line", launcher)
        ranks = [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
        assert len(ranks) >= 2
        assert {os.getsid(pid) for pid in ranks}.isdisjoint({os.getsid(launcher.pid)})  # torch elastic's setsid

        # A second run on the held directory refuses on both of its ranks, naming the holder (rank 0 of
        # the live run). train.max_steps=1: on code without the lock it must not train for long.
        second = run_cmd(accelerate_cmd("ddp.yaml", TINY, f"run.output_dir={out}", "train.max_steps=1",
                                        "log.progress_bar=false", "log.tensorboard=false", nproc=2),
                         expect=None, timeout=120)
        assert second.returncode != 0, second.stdout[-2000:]
        rank0 = next(pid for pid in ranks if f'"pid": {pid},' in RunDir(out).lock.read_text())
        message = second.stdout + second.stderr
        assert message.count(f"in use by a live run: pid {rank0} on host {socket.gethostname()}") >= 2, message[-3000:]

        os.killpg(launcher.pid, signal.SIGKILL)  # what a batch system or `kill -9 -PGID` does
        launcher.wait(timeout=30)
        wait_until(lambda: not any(alive(pid) for pid in ranks), LIVENESS_S, "ranks gone after the launcher died")
    finally:
        for pid in ranks + [launcher.pid]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()

    # Rank 0 died without releasing its lock: a new run on this host takes it over with a warning.
    # (Retried: a killed process shows as a zombie while its other threads still close its files.)
    assert RunDir(out).lock.is_file()
    locks = []

    def take() -> bool:
        try:
            locks.append(acquire_run_lock(out))
            return True
        except RunLockedError:
            return False

    with caplog.at_level(logging.WARNING, logger="trainer"):
        wait_until(take, LIVENESS_S, "the dead run's lock taken over")
    lock = locks[0]
    try:
        assert "taking over the lock" in caplog.text and "no longer exists" in caplog.text
        assert f'"pid": {os.getpid()},' in RunDir(out).lock.read_text()
    finally:
        lock.release()
    assert not RunDir(out).lock.exists()


HOLDER = """
import os, sys, time
from trainer.core.run_lock import acquire_run_lock
acquire_run_lock(sys.argv[1])
started, ready = os.pipe()
child = os.fork()  # like a DataLoader worker: it shares the locked file with its parent
if child == 0:
    os.write(ready, b"1")  # its at-fork handler ran before this line (on a busy machine a child may not run yet)
    time.sleep(120)
    os._exit(0)
os.read(started, 1)
print(child, flush=True)
time.sleep(120)
"""


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], env=child_env(), stdout=subprocess.PIPE,
                              text=True)
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(RunLockedError, match=f"pid {holder.pid} on host {socket.gethostname()}"):
            acquire_run_lock(out)
        holder.kill()
        holder.wait()
        assert alive(child)
        lock = acquire_run_lock(out)  # its holder died by SIGKILL: stale, although its forked child lives
    finally:
        os.kill(child, signal.SIGKILL)
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert acquire_run_lock(out) is lock  # re-entrant within one process (several Trainers in a test)
    lock.release()
    assert not RunDir(out).lock.exists()
    assert started_by_launcher({"LOCAL_RANK": "0"}) and started_by_launcher({"TORCHELASTIC_RUN_ID": "x"})
    assert not started_by_launcher({})  # a plain `python` run gets no parent-death guard


def test_exit_guard_ends_a_finished_rank_stuck_in_teardown():
    """A rank whose run finished but whose exit hangs (a teardown stuck in a collective library) leaves
    with the run's status and prints every thread's stack."""
    code = ("import threading; from trainer.core.watchdog import arm_exit_guard; "
            "arm_exit_guard(3, grace_s=0.5); threading.Event().wait()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert "did not exit within 0.5 s" in proc.stderr
    assert "Thread" in proc.stderr and "wait" in proc.stderr  # the stuck main thread's stack

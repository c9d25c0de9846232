"""The local scheduler: a queue of experiments on a pool of slots, timeouts, Ctrl-C, and the result files."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TextIO

from trainer.sweep.devices import SlotPool, gpu_memory_by_pid
from trainer.sweep.display import StatusDisplay, count_line
from trainer.sweep.parsing import ExperimentsError
from trainer.sweep.processes import RunProcess
from trainer.sweep.record import RunRecord, log_tail
from trainer.sweep.results import read_results, write_results, write_run_record
from trainer.sweep.spec import Experiment, free_port

POLL_S = 0.05
SAMPLE_EVERY_S = 0.5
GPU_SAMPLE_EVERY_S = 2.0
INTERRUPTED_EXIT = 130


@dataclass
class Run:
    """One started experiment, as the scheduler (and a subclass's hooks) follow it until it ends."""

    exp: Experiment
    record: RunRecord
    proc: RunProcess
    log: IO[bytes]
    slots: list[int]
    deadline: float | None
    stop_reason: str | None = None
    term_sent: float | None = None
    killed: bool = False
    peak_rss: float = 0.0
    peak_gpu: float | None = None


class Scheduler:
    """Runs experiments on a slot pool, isolating failures, and keeps the result files current.

    A subclass may add experiments while it runs (`_refill`) and watch the running ones (`_watch`): the
    study runner (study.py) asks its sampler for a trial whenever a slot is free and prunes from metrics.
    """

    OK_STATUSES: tuple[str, ...] = ("completed",)
    """Final statuses that leave the exit status 0."""

    def __init__(self, experiments: Sequence[Experiment], out_dir: Path, pool: SlotPool, *, resume: bool = False,
                 grace: float = 10.0, stream: TextIO | None = sys.stdout, tty: bool | None = None,
                 write_summary: bool = True, meta: dict[str, Any] | None = None,
                 record_extra: dict[str, Any] | None = None):
        self.out_dir = Path(out_dir).resolve()
        self.pool = pool
        self.resume = resume
        self.grace = grace
        self.write_summary = write_summary
        self.meta = dict(meta or {})
        self.display = StatusDisplay(stream, tty)
        self.stop_signal: int | None = None
        self.signals_seen = 0
        self.running: dict[str, Run] = {}
        self.experiments = list(experiments)
        self._last_sample = 0.0
        self._last_gpu_sample = 0.0

        for exp in self.experiments:
            if not pool.inherit and exp.gpus_per_experiment > pool.capacity:
                what = "GPUs" if pool.gpu_mode else "CPU slots"
                raise ExperimentsError(f"experiment '{exp.name}' needs {exp.gpus_per_experiment} {what} but only "
                                       f"{pool.capacity} are given")
        previous = read_results(self.out_dir) if resume else {}
        self.records: list[RunRecord] = []
        self.pending: list[Experiment] = []
        for exp in self.experiments:
            old = previous.get(exp.name)
            if old is not None and old.status == "completed":
                self.records.append(old)
                continue
            record = RunRecord.pending(exp, self.out_dir)
            if old is not None:
                record.attempt = old.attempt or 0
            record.update(record_extra or {})
            self.records.append(record)
            self.pending.append(exp)
        self.by_name = {r.name: r for r in self.records}

    # -- signals ---------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        self.signals_seen += 1
        if self.stop_signal is None:
            self.stop_signal = signum

    def _install_signal_handlers(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        old = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        return restore

    # -- bookkeeping -----------------------------------------------------------------------------
    def _live_rss(self) -> dict[str, float]:
        return {name: run.peak_rss for name, run in self.running.items()}

    def _save(self, record: RunRecord | None = None) -> None:
        if record is not None and record.status != "pending":
            write_run_record(record)
        if self.write_summary:
            write_results(self.out_dir, self.records, self.meta, summary=self._summary())
        self.display.table(self.records, self._live_rss(), force=True)

    # -- hooks for subclasses ----------------------------------------------------------------------
    def _intro(self) -> str:
        """The first line printed."""
        skipped = len(self.records) - len(self.pending)
        return (f"run-experiments: {len(self.records)} experiment(s) on {self.pool.describe()}"
                + (f", {skipped} already completed (--resume)" if skipped else "")
                + f"; results in {self.out_dir / 'results.json'}")

    def _summary(self) -> str | None:
        """OUT/summary.csv's text; None: the standard one (results.summary_csv)."""
        return None

    def _refill(self) -> None:
        """Add experiments to `pending` (called each turn of the loop while not stopping)."""

    def _watch(self) -> None:
        """Look at the running experiments (called each turn of the loop while not stopping)."""

    def _add(self, exp: Experiment, record_extra: dict[str, Any] | None = None) -> RunRecord:
        """Queue one more experiment (a subclass's `_refill`)."""
        record = RunRecord.pending(exp, self.out_dir)
        record.update(record_extra or {})
        self.experiments.append(exp)
        self.records.append(record)
        self.by_name[exp.name] = record
        self.pending.append(exp)
        return record

    # -- launching -------------------------------------------------------------------------------
    def _environment(self, exp: Experiment, run_dir: Path, gpus: list[int | str], port: int | None,
                     slots: list[int]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(exp.env_for(run_dir, gpus, port))
        env["PYTHONUNBUFFERED"] = "1"  # log.txt should follow the run live, not in 8 KiB chunks
        env["TRAINER_EXPERIMENT"] = exp.name
        env["TRAINER_EXPERIMENT_DIR"] = str(run_dir)
        if self.pool.gpu_mode or (self.pool.inherit and gpus):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
            if "OMP_NUM_THREADS" not in env and not self.pool.inherit:
                # Each CPU run would otherwise start one thread per core and the runs would fight.
                per_run = max(1, (os.cpu_count() or 1) * len(slots) // self.pool.capacity)
                env["OMP_NUM_THREADS"] = str(per_run)
        return env

    def _launch(self, exp: Experiment, slots: list[int]) -> None:
        record = self.by_name[exp.name]
        run_dir = self.out_dir / exp.name
        run_dir.mkdir(parents=True, exist_ok=True)
        gpus = self.pool.gpus_of(slots, exp.gpus_per_experiment)
        port = free_port() if exp.needs_port() else None
        argv = exp.argv(run_dir, gpus, port, fresh=not self.resume)
        env = self._environment(exp, run_dir, gpus, port, slots)
        record.start(argv, shlex.join(argv), slots, gpus, time.time())
        # A rerun keeps the earlier attempts' output above a header line.
        log = open(run_dir / "log.txt", "ab" if self.resume else "wb")
        log.write(f"# run-experiments attempt {record.attempt} at {record.start_time}: {record.command_str}\n".encode())
        log.flush()
        try:
            proc = RunProcess(argv, env, log)
        except OSError as err:
            log.write(f"# could not start: {err}\n".encode())
            log.close()
            record.end("failed", time.time())
            record.runtime_s = 0.0
            record.error = f"could not start: {err}"
            record.log_tail = log_tail(run_dir / "log.txt")
            self.pool.release(slots)
            self.display.event(f"FAILED to start {exp.name}: {err}")
            self._save(record)
            return
        record.pid = proc.pid
        deadline = time.monotonic() + exp.timeout if exp.timeout else None
        self.running[exp.name] = Run(exp, record, proc, log, slots, deadline)
        where = f"GPU {','.join(map(str, gpus))}" if gpus else f"CPU slot {','.join(map(str, slots))}"
        self.display.event(f"start  {exp.name} on {where} (pid {proc.pid})")
        self._save(record)

    def _launch_ready(self) -> None:
        # First fit in file order: a run that needs K slots waits while smaller ones use the gaps.
        still_waiting = []
        for exp in self.pending:
            slots = self.pool.acquire(exp.gpus_per_experiment)
            if slots is None:
                still_waiting.append(exp)
                continue
            self._launch(exp, slots)
        self.pending = still_waiting

    # -- stopping --------------------------------------------------------------------------------
    def _stop(self, run: Run, reason: str) -> None:
        if run.stop_reason is None:
            run.stop_reason = reason
        if run.term_sent is None:
            run.term_sent = time.monotonic()
            run.proc.send(signal.SIGTERM)

    def _kill(self, run: Run) -> None:
        if not run.killed:
            run.killed = True
            run.proc.send(signal.SIGKILL)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for run in self.running.values():
            if run.deadline is not None and now >= run.deadline and run.stop_reason is None:
                self.display.event(f"timeout {run.exp.name} after {run.exp.timeout:g}s: SIGTERM to its processes")
                self._stop(run, "timeout")
            if run.term_sent is not None and now - run.term_sent >= self.grace:
                self._kill(run)

    # -- monitoring ------------------------------------------------------------------------------
    def _sample(self) -> None:
        now = time.monotonic()
        if now - self._last_sample < SAMPLE_EVERY_S:
            return
        self._last_sample = now
        sample_gpu = self.pool.gpu_mode and now - self._last_gpu_sample >= GPU_SAMPLE_EVERY_S
        gpu_usage = gpu_memory_by_pid() if sample_gpu else {}
        if sample_gpu:
            self._last_gpu_sample = now
        for run in self.running.values():
            # Sampling also remembers every descendant, for the cleanup of those that leave the group.
            rss, pids = run.proc.rss_mib()
            run.peak_rss = max(run.peak_rss, rss)
            used = sum(gpu_usage.get(pid, 0.0) for pid in pids)
            if used:
                run.peak_gpu = max(run.peak_gpu or 0.0, used)

    def _finish(self, run: Run, exit_code: int) -> None:
        del self.running[run.exp.name]
        end = time.time()
        # Whatever the run left behind (a stray worker, a setsid daemon) would keep holding the devices we
        # are about to hand out again.
        leftovers = run.proc.kill_leftovers()
        run.log.close()
        record = run.record
        status = run.stop_reason or ("completed" if exit_code == 0 else "failed")
        record.end(status, end, exit_code)
        record.read_metrics()
        record.peak_rss_mib = round(run.peak_rss, 1) if run.peak_rss else None
        record.peak_gpu_mib = round(run.peak_gpu, 1) if run.peak_gpu else None
        record.cpu_s = round(run.proc.cpu_seconds(), 2)
        record.log_tail = None if status == "completed" else log_tail(record.log)
        record.killed_processes = run.proc.killed_processes()
        if leftovers:
            record.error = (f"{len(leftovers)} process(es) still alive after the run's main process exited were "
                            f"killed: " + ", ".join(f"{p['pid']} ({p['command'][:60]})" for p in leftovers))
        if status == "failed" and record.signal == "SIGKILL":
            record.error = "killed by SIGKILL: often the kernel's out-of-memory killer (see dmesg)"
        self.pool.release(run.slots)
        detail = f"exit {exit_code}" + (f" ({record.signal})" if record.signal else "")
        self.display.event(f"{status:<9} {run.exp.name} after {record.runtime_s:.1f}s, {detail}")
        self._save(record)

    def _reap(self) -> None:
        for run in list(self.running.values()):
            exit_code = run.proc.poll()
            if exit_code is not None:
                self._finish(run, exit_code)

    # -- main loop -------------------------------------------------------------------------------
    def run(self) -> int:
        """Run everything pending; returns 0 (all completed), 1 (some did not) or 128+signal (stopped)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        restore = self._install_signal_handlers()
        self.display.message(self._intro())
        stopping = False
        try:
            self._save()
            while True:
                if self.stop_signal is None:
                    self._refill()
                if not (self.pending or self.running):
                    break
                if self.stop_signal is not None and not stopping:
                    stopping = True
                    name = signal.Signals(self.stop_signal).name
                    self.display.message(f"run-experiments: {name}: stopping {len(self.running)} running "
                                         f"experiment(s) (SIGTERM, SIGKILL after {self.grace:g}s); "
                                         f"{len(self.pending)} not started stay pending")
                    self.pending = []
                    for run in self.running.values():
                        self._stop(run, "interrupted")
                if stopping and self.signals_seen > 1:
                    # A second Ctrl-C: do not wait for the grace period.
                    for run in self.running.values():
                        self._kill(run)
                if not stopping:
                    self._launch_ready()
                self._reap()
                self._check_deadlines()
                self._sample()
                if not stopping:
                    self._watch()
                self.display.table(self.records, self._live_rss())
                if self.running:
                    time.sleep(POLL_S)
        finally:
            # Reached with runs alive only when an exception left the loop (e.g. submitit's time-limit
            # signal in a SLURM task): stop them the same way, so a trainer still gets to checkpoint.
            for run in self.running.values():
                self._stop(run, "interrupted")
            give_up = time.monotonic() + self.grace
            while any(run.proc.poll() is None for run in self.running.values()) and time.monotonic() < give_up:
                time.sleep(POLL_S)
            for run in list(self.running.values()):
                if run.proc.poll() is None:
                    self._kill(run)
                    run.proc.popen.wait()
                self._finish(run, run.proc.popen.returncode)
            restore()
        self.display.table(self.records, self._live_rss(), force=True)
        self.display.message("run-experiments: " + count_line(self.records))
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        return 0 if all(r.status in self.OK_STATUSES for r in self.records) else 1


def run_experiments(experiments: Sequence[Experiment], out_dir: str | Path, *, gpus: Sequence[int | str] | None = None,
                    slots: int | None = None, resume: bool = False, grace: float = 10.0,
                    stream: TextIO | None = sys.stdout, tty: bool | None = None,
                    experiments_file: str | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Run experiments on GPU ids `gpus` or `slots` CPU slots; (exit status, records as in results.json)."""
    pool = SlotPool(gpus=gpus, slots=slots)
    meta = {"experiments_file": experiments_file, "out_dir": str(Path(out_dir).resolve()), "mode": "local",
            "slots": pool.capacity, "gpus": pool.gpus, "resume": resume}
    scheduler = Scheduler(experiments, Path(out_dir), pool, resume=resume, grace=grace, stream=stream, tty=tty,
                          meta=meta)
    status = scheduler.run()
    return status, [record.to_dict() for record in scheduler.records]

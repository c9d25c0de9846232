"""The local scheduler: a queue of experiments, a pool of GPU or CPU slots, one process group per run."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Sequence, TextIO

import psutil

from trainer.sweep.results import (FINAL_STATUSES, counts, iso, log_tail, new_record, read_final_metrics,
                                         read_results, signal_name, write_results, write_run_record)
from trainer.sweep.spec import Experiment, ExperimentsError, free_port

POLL_S = 0.05
SAMPLE_EVERY_S = 0.5
GPU_SAMPLE_EVERY_S = 2.0
TTY_REFRESH_S = 5.0
INTERRUPTED_EXIT = 130


def _gpu_id(text: str) -> int | str:
    return int(text) if text.isdigit() else text


class SlotPool:
    """Free slots handed out lowest-first. GPU slots carry a GPU id; CPU slots only an index.

    `inherit` is the SLURM-task pool: one slot holding whatever devices the allocation made visible.
    """

    def __init__(self, gpus: Sequence[int | str] | None = None, slots: int | None = None, inherit: bool = False):
        self.inherit = inherit
        if inherit:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            self.gpus = [_gpu_id(g.strip()) for g in visible.split(",") if g.strip()]
            self.ids = list(range(max(1, len(self.gpus))))
        elif gpus:
            self.gpus = [_gpu_id(str(g)) for g in gpus]
            if len(set(self.gpus)) != len(self.gpus):
                raise ExperimentsError(f"--gpus lists a GPU twice: {self.gpus}")
            self.ids = list(range(len(self.gpus)))
        else:
            self.gpus = []
            self.ids = list(range(slots or 1))
        self.free = list(self.ids)

    @property
    def gpu_mode(self) -> bool:
        return bool(self.gpus)

    @property
    def capacity(self) -> int:
        return len(self.ids)

    def acquire(self, k: int) -> list[int] | None:
        if self.inherit:
            taken, self.free = self.free, []
            return taken or None
        if len(self.free) < k:
            return None
        taken, self.free = self.free[:k], self.free[k:]
        return taken

    def release(self, slots: Sequence[int]) -> None:
        self.free = sorted(set(self.free) | set(slots))

    def gpus_of(self, slots: Sequence[int], k: int) -> list[int | str]:
        if self.inherit:
            return self.gpus[:k]
        return [self.gpus[s] for s in slots] if self.gpu_mode else []

    def describe(self) -> str:
        if self.inherit:
            return f"inherited devices ({','.join(map(str, self.gpus)) or 'CPU'})"
        if self.gpu_mode:
            return f"{self.capacity} GPU slot(s): {' '.join(map(str, self.gpus))}"
        return f"{self.capacity} CPU slot(s)"


@dataclass
class _Run:
    exp: Experiment
    record: dict[str, Any]
    proc: subprocess.Popen
    log: IO[bytes]
    slots: list[int]
    started: float
    deadline: float | None
    stop_reason: str | None = None
    term_sent: float | None = None
    killed: bool = False
    peak_rss: float = 0.0
    peak_gpu: float | None = None
    seen_pids: set[int] = field(default_factory=set)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.Error:
        return []


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the runner dies (Linux), so a runner killed by SIGKILL or
    the OOM killer leaves no unsupervised runs holding GPUs. (Its own session shields it otherwise.)"""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _gpu_memory_by_pid() -> dict[int, float]:
    """MiB used per process according to nvidia-smi; empty when it is missing or fails (best effort)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    usage: dict[int, float] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                usage[int(parts[0])] = usage.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:
                continue
    return usage


class StatusDisplay:
    """A table redrawn in place on a terminal; one line per event when stdout is a file or pipe."""

    def __init__(self, stream: TextIO | None, tty: bool | None = None):
        self.stream = stream
        self.tty = bool(stream is not None and (stream.isatty() if tty is None else tty))
        self.drawn_lines = 0
        self.last_draw = 0.0

    def event(self, text: str) -> None:
        if self.stream is None or self.tty:
            return
        self.stream.write(f"[{time.strftime('%H:%M:%S')}] {text}\n")
        self.stream.flush()

    def table(self, records: list[dict[str, Any]], running: dict[str, "_Run"], force: bool = False) -> None:
        if self.stream is None or not self.tty:
            return
        now = time.monotonic()
        if not force and now - self.last_draw < TTY_REFRESH_S:
            return
        self.last_draw = now
        lines = [render_table(records, running)]
        text = "\n".join(lines)
        # Move up over the previous table and clear to the end of the screen, then draw the new one.
        prefix = f"\x1b[{self.drawn_lines}F\x1b[J" if self.drawn_lines else ""
        self.stream.write(prefix + text + "\n")
        self.stream.flush()
        self.drawn_lines = text.count("\n") + 1

    def message(self, text: str) -> None:
        if self.stream is None:
            return
        self.stream.write(text + "\n")
        self.stream.flush()
        self.drawn_lines = 0  # the message scrolled the table out of reach; draw a fresh one below


def render_table(records: list[dict[str, Any]], running: dict[str, "_Run"] | None = None) -> str:
    """Plain-text status table: one row per experiment plus a count line."""
    now = time.time()
    rows = [("NAME", "STATUS", "DEVICES", "RUNTIME", "PEAK RSS MiB", "EXIT")]
    for r in records:
        runtime = r.get("runtime_s")
        if r["status"] == "running" and r.get("start_epoch"):
            runtime = now - r["start_epoch"]
        devices = ",".join(map(str, r["gpus"])) if r.get("gpus") else (
            "cpu" + ",".join(map(str, r["slots"])) if r.get("slots") is not None else "")
        peak = r.get("peak_rss_mib")
        if running and r["name"] in running:
            peak = running[r["name"]].peak_rss or peak
        exit_text = "" if r.get("exit_code") is None else str(r["exit_code"])
        if r.get("signal"):
            exit_text += f" ({r['signal']})"
        rows.append((r["name"], r["status"], devices, "" if runtime is None else f"{runtime:.1f}s",
                     "" if not peak else f"{peak:.0f}", exit_text))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    c = counts(records)
    lines.append(", ".join(f"{n} {s}" for s, n in c.items() if n))
    return "\n".join(lines)


class Scheduler:
    """Runs experiments on a slot pool, isolating failures, and keeps the result files current."""

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
        self.running: dict[str, _Run] = {}
        self.experiments = list(experiments)
        self._last_sample = 0.0
        self._last_gpu_sample = 0.0

        for exp in self.experiments:
            if not pool.inherit and exp.gpus_per_experiment > pool.capacity:
                what = "GPUs" if pool.gpu_mode else "CPU slots"
                raise ExperimentsError(f"experiment '{exp.name}' needs {exp.gpus_per_experiment} {what} but only "
                                       f"{pool.capacity} are given")
        previous = read_results(self.out_dir) if resume else {}
        self.records: list[dict[str, Any]] = []
        self.pending: list[Experiment] = []
        for exp in self.experiments:
            old = previous.get(exp.name)
            if old is not None and old.get("status") == "completed":
                self.records.append(old)
                continue
            record = new_record(exp, self.out_dir)
            if old is not None:
                record["attempt"] = old.get("attempt") or 0
            record.update(record_extra or {})
            self.records.append(record)
            self.pending.append(exp)
        self.by_name = {r["name"]: r for r in self.records}

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
    def _save(self, record: dict[str, Any] | None = None) -> None:
        if record is not None and record["status"] != "pending":
            write_run_record(record)
        if self.write_summary:
            write_results(self.out_dir, self.records, self.meta)
        self.display.table(self.records, self.running, force=True)

    # -- launching -------------------------------------------------------------------------------
    def _launch(self, exp: Experiment, slots: list[int]) -> None:
        record = self.by_name[exp.name]
        run_dir = self.out_dir / exp.name
        run_dir.mkdir(parents=True, exist_ok=True)
        gpus = self.pool.gpus_of(slots, exp.gpus_per_experiment)
        port = free_port() if exp.needs_port() else None
        argv = exp.argv(run_dir, gpus, port, fresh=not self.resume)
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

        record["attempt"] = (record.get("attempt") or 0) + 1
        now = time.time()
        record.update(status="running", command=argv, command_str=shlex.join(argv), slots=slots, gpus=gpus,
                      start_epoch=now, start_time=iso(now), end_epoch=None, end_time=None, runtime_s=None,
                      exit_code=None, signal=None, peak_rss_mib=None, peak_gpu_mib=None, metrics=None,
                      final_eval=None, log_tail=None, error=None, pid=None)
        # A rerun keeps the earlier attempts' output above a header line.
        log = open(run_dir / "log.txt", "ab" if self.resume else "wb")
        log.write(f"# run-experiments attempt {record['attempt']} at {record['start_time']}: "
                  f"{record['command_str']}\n".encode())
        log.flush()
        try:
            # A new session makes the run its own process group: we can signal its whole tree by group
            # id, and the terminal's Ctrl-C reaches only us, so we decide how the runs stop.
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True,
                                    preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        except OSError as err:
            log.write(f"# could not start: {err}\n".encode())
            log.close()
            end = time.time()
            record.update(status="failed", error=f"could not start: {err}", end_epoch=end, end_time=iso(end),
                          runtime_s=0.0, log_tail=log_tail(run_dir / "log.txt"))
            self.pool.release(slots)
            self.display.event(f"FAILED to start {exp.name}: {err}")
            self._save(record)
            return
        record["pid"] = proc.pid
        deadline = time.monotonic() + exp.timeout if exp.timeout else None
        self.running[exp.name] = _Run(exp, record, proc, log, slots, time.monotonic(), deadline,
                                      seen_pids={proc.pid})
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
    def _stop(self, run: _Run, reason: str) -> None:
        if run.stop_reason is None:
            run.stop_reason = reason
        if run.term_sent is None:
            run.term_sent = time.monotonic()
            self._terminate_tree(run, signal.SIGTERM)

    def _terminate_tree(self, run: _Run, sig: int) -> None:
        pgid = run.proc.pid
        # Children that moved to a session of their own escape killpg; signal them by pid.
        strays = [p for p in _tree(run.proc.pid) if _pgid(p) not in (pgid, None)]
        _signal_group(pgid, sig)
        for p in strays:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for run in self.running.values():
            if run.deadline is not None and now >= run.deadline and run.stop_reason is None:
                self.display.event(f"timeout {run.exp.name} after {run.exp.timeout:g}s: SIGTERM to its process group")
                self._stop(run, "timeout")
            if run.term_sent is not None and not run.killed and now - run.term_sent >= self.grace:
                run.killed = True
                self._terminate_tree(run, signal.SIGKILL)

    # -- monitoring ------------------------------------------------------------------------------
    def _sample(self) -> None:
        now = time.monotonic()
        if now - self._last_sample < SAMPLE_EVERY_S:
            return
        self._last_sample = now
        sample_gpu = self.pool.gpu_mode and now - self._last_gpu_sample >= GPU_SAMPLE_EVERY_S
        gpu_usage = _gpu_memory_by_pid() if sample_gpu else {}
        if sample_gpu:
            self._last_gpu_sample = now
        for run in self.running.values():
            rss = 0
            tree = _tree(run.proc.pid)
            for p in tree:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    continue
            run.seen_pids.update(p.pid for p in tree)
            run.peak_rss = max(run.peak_rss, rss / 2**20)
            used = sum(gpu_usage.get(p.pid, 0.0) for p in tree)
            if used:
                run.peak_gpu = max(run.peak_gpu or 0.0, used)

    def _finish(self, run: _Run, exit_code: int) -> None:
        del self.running[run.exp.name]
        end = time.time()
        # Whatever the run left behind in its process group (a stray worker, a daemon) would keep holding
        # the devices we are about to hand out again.
        leftovers = _group_alive(run.proc.pid)
        if leftovers:
            self._terminate_tree(run, signal.SIGKILL)
        run.log.close()
        record = run.record
        if run.stop_reason is not None:
            status = run.stop_reason
        else:
            status = "completed" if exit_code == 0 else "failed"
        metrics, final_eval = read_final_metrics(record["out_dir"])
        record.update(status=status, exit_code=exit_code, signal=signal_name(exit_code), end_epoch=end,
                      end_time=iso(end), runtime_s=round(end - record["start_epoch"], 3),
                      peak_rss_mib=round(run.peak_rss, 1) if run.peak_rss else None,
                      peak_gpu_mib=round(run.peak_gpu, 1) if run.peak_gpu else None,
                      metrics=metrics, final_eval=final_eval,
                      log_tail=None if status == "completed" else log_tail(record["log"]))
        if leftovers:
            record["error"] = "processes left in its process group after it exited were killed"
        if status == "failed" and record["signal"] == "SIGKILL":
            record["error"] = "killed by SIGKILL: often the kernel's out-of-memory killer (see dmesg)"
        self.pool.release(run.slots)
        detail = f"exit {exit_code}" + (f" ({record['signal']})" if record["signal"] else "")
        self.display.event(f"{status:<9} {run.exp.name} after {record['runtime_s']:.1f}s, {detail}")
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
        skipped = len(self.records) - len(self.pending)
        self.display.message(f"run-experiments: {len(self.records)} experiment(s) on {self.pool.describe()}"
                             + (f", {skipped} already completed (--resume)" if skipped else "")
                             + f"; results in {self.out_dir / 'results.json'}")
        stopping = False
        try:
            self._save()
            while self.pending or self.running:
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
                        if not run.killed:
                            run.killed = True
                            self._terminate_tree(run, signal.SIGKILL)
                if not stopping:
                    self._launch_ready()
                self._reap()
                self._check_deadlines()
                self._sample()
                self.display.table(self.records, self.running)
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
                    self._terminate_tree(run, signal.SIGKILL)
                    run.proc.wait()
                self._finish(run, run.proc.returncode)
            restore()
        self.display.table(self.records, self.running, force=True)
        c = counts(self.records)
        self.display.message("run-experiments: " + ", ".join(f"{n} {s}" for s, n in c.items() if n))
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        return 0 if all(r["status"] == "completed" for r in self.records) else 1


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, PermissionError):
        return None


def run_experiments(experiments: Sequence[Experiment], out_dir: str | Path, *, gpus: Sequence[int | str] | None = None,
                    slots: int | None = None, resume: bool = False, grace: float = 10.0,
                    stream: TextIO | None = sys.stdout, tty: bool | None = None,
                    experiments_file: str | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Run experiments on GPU ids `gpus` or `slots` CPU slots; (exit status, records) when all have ended."""
    pool = SlotPool(gpus=gpus, slots=slots)
    meta = {"experiments_file": experiments_file, "out_dir": str(Path(out_dir).resolve()), "mode": "local",
            "slots": pool.capacity, "gpus": pool.gpus, "resume": resume}
    scheduler = Scheduler(experiments, Path(out_dir), pool, resume=resume, grace=grace, stream=stream, tty=tty,
                          meta=meta)
    status = scheduler.run()
    return status, scheduler.records


__all__ = ["FINAL_STATUSES", "INTERRUPTED_EXIT", "Scheduler", "SlotPool", "StatusDisplay", "render_table",
           "run_experiments"]

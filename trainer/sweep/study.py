"""A hyperparameter study on Optuna, run on the slot scheduler: `search:` in an experiments file.

- Each trial is one trainer run in OUT/trial_NNNN (own log, the sampled values as overrides, so they are in
  its config.yaml), started whenever a slot is free: Optuna's ask-and-tell interface.
- The study lives in Optuna storage: SQLite at OUT/study.db by default (any Optuna storage URL via
  `storage:`), a journal file on SLURM, where array tasks on several nodes share it.
- Pruning: the runner follows each trial's metrics.jsonl, reports every new value of the metric at its step,
  and sends SIGTERM to a trial the pruner stops (the trainer checkpoints and exits).
- --resume: finished, pruned and failed trials are kept; a trial that was running when the runner stopped is
  re-run with the same parameters, so the study ends with exactly n_trials counted trials.
- confirm: the best configs rerun with run.seed 0..N-1 in OUT/confirm/, statistics in OUT/confirm.csv.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import socket
import sys
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import optuna
from optuna.trial import TrialState

from trainer.sweep.devices import SlotPool
from trainer.sweep.parsing import ExperimentsError, format_value
from trainer.sweep.record import RunRecord
from trainer.sweep.results import read_results, write_results
from trainer.sweep.scheduler import Run, Scheduler
from trainer.sweep.searchspec import SearchSpec
from trainer.sweep.slurm import array_task_id
from trainer.sweep.spec import Experiment
from trainer.sweep.stats import metric_value, write_seed_statistics

WATCH_EVERY_S = 0.5
OUTCOME = "outcome"
"""User attribute of a trial that ran to its end: completed, pruned, failed or timeout. A trial without
one was interrupted (Ctrl-C, a killed runner): it does not count towards n_trials and --resume re-runs it."""
RERUN_OF = "rerun_of"
"""User attribute of a trial that re-runs an interrupted one (its number)."""
STATE_OF_STATUS = {"completed": "complete", "pruned": "pruned", "failed": "failed", "timeout": "failed",
                   "interrupted": "interrupted", "running": "running", "pending": "pending"}


def default_storage(out_dir: Path, journal: bool = False) -> str:
    """Where the study lives unless `storage:` says: OUT/study.db, or OUT/study.journal (shared file systems)."""
    return str(out_dir / "study.journal") if journal else f"sqlite:///{out_dir / 'study.db'}"


def open_storage(url: str) -> Any:
    """An Optuna storage for a URL, or for a journal file path (ending in .journal)."""
    if url.endswith(".journal") and "://" not in url:
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(url))
    return optuna.storages.RDBStorage(url)


class _GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler without its `study.stop()` once the grid is used up: that call only works inside
    `study.optimize`, and this runner ends the study itself at n_trials (at most the grid's size)."""

    def after_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, state: TrialState,
                    values: Any) -> None:
        pass


def build_sampler(spec: SearchSpec, resumed_trials: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler; a seeded one resumed after `resumed_trials` trials is reseeded with seed + that count, or it
    would draw the first trials' parameters again."""
    options = dict(spec.sampler_options)
    if options.get("seed") is not None and resumed_trials:
        options["seed"] = options["seed"] + resumed_trials
    if spec.sampler == "grid":
        return _GridSampler({p.key: p.grid_values() for p in spec.params}, **options)
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(**options)
    if spec.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(**options)
    return optuna.samplers.TPESampler(**options)


def build_pruner(spec: SearchSpec) -> optuna.pruners.BasePruner:
    options = dict(spec.pruner_options)
    if spec.pruner == "median":
        return optuna.pruners.MedianPruner(**options)
    if spec.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(**options)
    return optuna.pruners.NopPruner()


def open_study(spec: SearchSpec, storage: str, resume: bool, seed_offset: int = 0) -> optuna.Study:
    """The study in `storage`: created, or (resume) loaded; a new study never silently joins an old one.

    seed_offset: added to a seeded sampler's seed, so that array tasks sampling side by side differ."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store = open_storage(storage)
    summaries = {s.study_name: s for s in optuna.get_all_study_summaries(store)}
    exists = spec.name in summaries
    if exists and not resume:
        raise ExperimentsError(f"study '{spec.name}' already exists in {storage}: --resume continues it; "
                               "another --out (or study name) starts a new one")
    try:
        sampler = build_sampler(spec, (summaries[spec.name].n_trials if exists else 0) + seed_offset)
        pruner = build_pruner(spec)
    except (TypeError, ValueError, ImportError) as err:
        raise ExperimentsError(f"search: sampler {spec.sampler} / pruner {spec.pruner}: {err}") from None
    study = optuna.create_study(study_name=spec.name, storage=store, sampler=sampler, pruner=pruner,
                                direction=spec.direction, load_if_exists=True)
    if exists and study.direction.name.lower() != spec.direction:
        raise ExperimentsError(f"study '{spec.name}' in {storage} was created to {study.direction.name.lower()}, "
                               f"the file now says {spec.direction}")
    return study


def counted(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a trial counts towards n_trials: it ran to its end (completed, pruned or failed)."""
    return trial.state.is_finished() and OUTCOME in trial.user_attrs


def count_trials(trials: Iterable[optuna.trial.FrozenTrial]) -> int:
    """How many of `trials` count towards n_trials."""
    return sum(counted(t) for t in trials)


def lost(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a trial was interrupted: failed without an outcome (its runner stopped while it ran)."""
    return trial.state == TrialState.FAIL and OUTCOME not in trial.user_attrs


def requeue_lost(study: optuna.Study) -> set[int]:
    """Mark the trials left running as failed and queue one re-run of each lost trial with its parameters;
    the lost trials' numbers. Only for a study no runner works on now: a running trial is one it lost."""
    trials = study.get_trials(deepcopy=False)
    for trial in trials:
        if trial.state == TrialState.RUNNING:
            study.tell(trial.number, state=TrialState.FAIL)
    rerun = {t.user_attrs[RERUN_OF] for t in trials if RERUN_OF in t.user_attrs}
    lost_trials = [t for t in study.get_trials(deepcopy=False) if lost(t)]
    for trial in lost_trials:
        if trial.number not in rerun and trial.params:
            study.enqueue_trial(trial.params, user_attrs={RERUN_OF: trial.number})
    return {t.number for t in lost_trials}


def best_line(spec: SearchSpec, study: optuna.Study) -> str | None:
    """`best: trial_NNNN METRIC=value key=value ...`, or None before any trial has completed."""
    if not any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        return None
    best = study.best_trial
    return (f"best: {trial_name(best.number)} {spec.metric}={best.value:.6g} "
            + " ".join(f"{k}={format_value(v)}" for k, v in best.params.items()))


def trial_name(number: int) -> str:
    """The trial's folder (and record) name under OUT."""
    return f"trial_{number:04d}"


def trial_experiment(spec: SearchSpec, name: str, params: dict[str, Any], seed: int | None = None,
                     group: str | None = None) -> Experiment:
    """The trainer run of one trial (or of one seed of a confirmed config)."""
    grid = dict(params) if seed is None else {**params, "run.seed": seed}
    overrides = [*spec.overrides, *(f"{key}={format_value(value)}" for key, value in grid.items())]
    return Experiment(name=name, entry=0, grid=grid, config=spec.config, overrides=overrides, timeout=spec.timeout,
                      env=dict(spec.env), gpus_per_experiment=spec.gpus_per_experiment,
                      accelerate_config=spec.accelerate_config, group=group)


@dataclass
class _Watch:
    """What the runner has read of one trial's metrics.jsonl."""

    trial: optuna.Trial
    offset: int = 0
    partial: bytes = b""
    last_step: int | None = None
    last_value: float | None = None


def is_final_report(run_dir: Path, step: int | None) -> bool:
    """Whether a trial's report at `step` is at the last step of its run plan (`run_dir`/plan.json; False while there
    is none): the trial is finishing, and a SIGTERM then would find it past its last checkpointing point."""
    try:
        planned = json.loads((run_dir / "plan.json").read_text())["max_steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return step is not None and step >= int(planned)


class StudyScheduler(Scheduler):
    """The slot scheduler, fed by the study's sampler and watched by its pruner."""

    OK_STATUSES = ("completed", "pruned", "interrupted")
    """A stop by a signal sets the exit status itself, so an interrupted trial met here is one of an earlier
    runner that --resume has re-run."""

    def __init__(self, spec: SearchSpec, study: optuna.Study, out_dir: Path, pool: SlotPool, *, resume: bool,
                 grace: float, stream: TextIO | None, meta: dict[str, Any], record_extra: dict[str, Any] | None = None):
        """record_extra: fields of every trial's record (a SLURM task's id and host); with it, the trials'
        OUT/trial_NNNN/result.json are the only files written (array tasks share OUT; --collect merges)."""
        super().__init__([], out_dir, pool, grace=grace, stream=stream, write_summary=record_extra is None,
                         meta=meta, tty=False if record_extra is not None else None)
        self.spec, self.study, self.record_extra = spec, study, record_extra or {}
        self.watched: dict[str, _Watch] = {}
        self._last_watch = 0.0
        if resume:
            self._take_over_previous()

    def _intro(self) -> str:
        trials = self.study.get_trials(deepcopy=False)
        done = count_trials(trials)
        waiting = sum(t.state == TrialState.WAITING for t in trials)
        return (f"study {self.spec.name}: {self.spec.n_trials} trial(s) on {self.pool.describe()}"
                + (f", {done} already counted" if done else "") + (f", {waiting} to re-run" if waiting else "")
                + f"; {self.spec.direction} {self.spec.metric}; storage {self.meta['storage']}; "
                f"summary in {self.out_dir / 'summary.csv'}")

    # -- resume ----------------------------------------------------------------------------------
    def _take_over_previous(self) -> None:
        """Keep the records of earlier trials; mark trials left running as interrupted and queue their re-runs."""
        # Only this runner works on a local study, so a trial still running is one it lost when it stopped.
        lost_numbers = requeue_lost(self.study)
        # The storage decides: a record saved just before the runner died may say more than the study does.
        previous = read_results(self.out_dir)
        for record in sorted(previous.values(), key=lambda r: r.extra.get("trial", -1)):
            if record.extra.get("trial") in lost_numbers and record.status != "interrupted":
                record.status = "interrupted"
                record.error = "the runner stopped while this trial ran; --resume re-runs its parameters"
            self.records.append(record)
            self.by_name[record.name] = record

    # -- feeding ---------------------------------------------------------------------------------
    def _active(self) -> int:
        return len(self.running) + len(self.pending)

    def _refill(self) -> None:
        if self.pending or not self.pool.free:
            return
        trials = self.study.get_trials(deepcopy=False)
        done = count_trials(trials)
        # Trials that other processes run on the same storage (SLURM array tasks) count too.
        done += max(0, sum(t.state == TrialState.RUNNING for t in trials) - len(self.watched))
        if done + self._active() >= self.spec.n_trials:
            return
        trial = self.study.ask()
        params = {}
        for p in self.spec.params:
            if p.type == "categorical":
                params[p.key] = trial.suggest_categorical(p.key, list(p.choices))
            elif p.type == "int":
                params[p.key] = trial.suggest_int(p.key, int(p.low), int(p.high), log=p.log, step=int(p.step or 1))
            else:
                params[p.key] = trial.suggest_float(p.key, p.low, p.high, log=p.log, step=p.step)
        name = trial_name(trial.number)
        extra = {"trial": trial.number, "params": params, "value": None, "step_reached": None, **self.record_extra}
        if RERUN_OF in trial.user_attrs:
            extra[RERUN_OF] = trial.user_attrs[RERUN_OF]
        self._add(trial_experiment(self.spec, name, params), extra)
        self.watched[name] = _Watch(trial)

    # -- pruning ---------------------------------------------------------------------------------
    def _read_new(self, run: Run, watch: _Watch) -> None:
        """Report each new value of the metric in the trial's metrics.jsonl (complete lines only)."""
        path = Path(run.record.out_dir) / "metrics.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(watch.offset)
                chunk = f.read()
        except OSError:
            return
        watch.offset += len(chunk)
        *lines, watch.partial = (watch.partial + chunk).split(b"\n")
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            value, step = record.get(self.spec.metric), record.get("step")
            if not isinstance(value, (int, float)) or not isinstance(step, int) or not math.isfinite(value):
                continue
            if watch.last_step is not None and step <= watch.last_step:
                continue  # a resumed trainer repeats steps; Optuna keeps one value per step
            watch.trial.report(float(value), step)
            watch.last_step, watch.last_value = step, float(value)
            run.record.update({"value": watch.last_value, "step_reached": step})

    def _watch(self) -> None:
        now = time.monotonic()
        if now - self._last_watch < WATCH_EVERY_S:
            return
        self._last_watch = now
        for name, run in self.running.items():
            watch = self.watched.get(name)
            if watch is None or run.stop_reason is not None:
                continue
            before = watch.last_step
            self._read_new(run, watch)
            # A report at the plan's last step is the trial's final one: it is finishing, nothing is left to prune.
            if (watch.last_step != before and not is_final_report(Path(run.record.out_dir), watch.last_step)
                    and watch.trial.should_prune()):
                self.display.event(f"prune  {name} at step {watch.last_step} ({self.spec.metric}="
                                   f"{watch.last_value:.6g}): SIGTERM, it checkpoints and exits")
                self._stop(run, "pruned")

    # -- results ---------------------------------------------------------------------------------
    def _finish(self, run: Run, exit_code: int) -> None:
        super()._finish(run, exit_code)
        record, watch = run.record, self.watched.pop(run.exp.name, None)
        if watch is None:
            return
        self._read_new(run, watch)  # the values written between the last look and the exit
        trial, status = watch.trial, record.status
        if status == "completed":
            value, step = metric_value(record.out_dir, self.spec.metric)
            if value is None or not math.isfinite(value):
                status = record.status = "failed"
                record.error = f"the run wrote no finite value of {self.spec.metric} to its metrics.jsonl"
            else:
                record.update({"value": value, "step_reached": step})
        if status == "interrupted":
            self.study.tell(trial, state=TrialState.FAIL)
        else:
            trial.set_user_attr(OUTCOME, status)
            if status == "completed":
                self.study.tell(trial, record.extra["value"])
            elif status == "pruned":
                self.study.tell(trial, state=TrialState.PRUNED)  # valued at its last reported step
            else:
                self.study.tell(trial, state=TrialState.FAIL)
        self.display.message(self._progress_line(record))
        self._save(record)

    def _progress_line(self, record: RunRecord) -> str:
        trials = self.study.get_trials(deepcopy=False)
        done = count_trials(trials)
        value = record.extra.get("value")
        text = (f"[{done}/{self.spec.n_trials}] {record.name} {STATE_OF_STATUS.get(record.status, record.status)}"
                + (f" at step {record.extra.get('step_reached')}: {self.spec.metric}={value:.6g}"
                   if value is not None else "")
                + " " + " ".join(f"{k}={format_value(v)}" for k, v in record.extra.get("params", {}).items()))
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        if complete:
            best = self.study.best_trial
            text += f"; best {trial_name(best.number)} {best.value:.6g}"
        return text

    def _summary(self) -> str:
        return study_summary_csv(self.spec, self.records)


def study_summary_csv(spec: SearchSpec, records: list[RunRecord]) -> str:
    """OUT/summary.csv of a study: one row per trial."""
    keys = [p.key for p in spec.params]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["trial", "name", "state", *keys, spec.metric, "step", "wall_s", "cpu_s", "exit_code",
                     "rerun_of", "log"])
    for r in records:
        params = r.extra.get("params", {})
        row = [r.extra.get("trial"), r.name, STATE_OF_STATUS.get(r.status, r.status),
               *(format_value(params[k]) if k in params else None for k in keys), r.extra.get("value"),
               r.extra.get("step_reached"), r.runtime_s, r.cpu_s, r.exit_code, r.extra.get(RERUN_OF), r.log]
        writer.writerow(["" if v is None else v for v in row])
    return buf.getvalue()


def confirm_best(spec: SearchSpec, study: optuna.Study, out_dir: Path, pool: SlotPool, *, resume: bool,
                 grace: float, stream: TextIO | None) -> tuple[int, list[dict[str, Any]]]:
    """Rerun the best `confirm.top` configs with run.seed 0..seeds-1; OUT/confirm.csv and a verdict line."""
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    complete.sort(key=lambda t: t.value if spec.direction == "minimize" else -t.value)
    # Distinct configs only: a re-run of an interrupted trial has the same parameters as the original.
    best: dict[str, optuna.trial.FrozenTrial] = {}
    for trial in complete:
        best.setdefault(json.dumps(trial.params, sort_keys=True), trial)
    chosen = list(best.values())[:spec.confirm_top]
    experiments = [trial_experiment(spec, f"{trial_name(t.number)}_seed{seed}", t.params, seed, trial_name(t.number))
                   for t in chosen for seed in range(spec.confirm_seeds)]
    if not experiments:
        return 1, []
    confirm_dir = out_dir / "confirm"
    meta = {"study": spec.name, "out_dir": str(confirm_dir), "mode": "confirm", "slots": pool.capacity,
            "gpus": pool.gpus, "resume": resume}
    if stream is not None:
        stream.write(f"confirm: {len(chosen)} config(s) x {spec.confirm_seeds} seeds in {confirm_dir}\n")
    scheduler = Scheduler(experiments, confirm_dir, pool, resume=resume, grace=grace, stream=stream, meta=meta)
    status = scheduler.run()
    rows = write_seed_statistics(scheduler.records, out_dir / "confirm.csv", spec.metric, spec.direction, stream)
    return status, rows


def write_plots(spec: SearchSpec, study: optuna.Study, out_dir: Path, confirm_rows: list[dict[str, Any]],
                stream: TextIO | None) -> list[Path]:
    """OUT/plots/: optimisation history, parameter importances (or slice) and confirm means with error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ov

    plots = out_dir / "plots"
    plots.mkdir(exist_ok=True)
    written = []
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    makers = {"optimization_history": ov.plot_optimization_history, "slice": ov.plot_slice}
    if len(complete) >= 2 and len(spec.params) >= 2:
        makers["param_importances"] = ov.plot_param_importances
    # Optuna marks its matplotlib plots experimental, and matplotlib notes category axes and one-point ranges:
    # none of it helps a reader of the runner's output.
    logging.getLogger("matplotlib.category").setLevel(logging.WARNING)
    for name, make in makers.items():
        if not complete:
            break
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                axes = make(study)
            figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
            figure.savefig(plots / f"{name}.png", dpi=100, bbox_inches="tight")
            plt.close(figure)
            written.append(plots / f"{name}.png")
        except (ValueError, RuntimeError, ImportError) as err:  # e.g. too few trials for importances
            if stream is not None:
                stream.write(f"plot {name} skipped: {err}\n")
    if confirm_rows:
        figure, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(confirm_rows)), 3.5))
        names = [row["config"] for row in confirm_rows]
        means = [row["mean"] for row in confirm_rows]
        halves = [row["ci95_high"] - row["mean"] if math.isfinite(row["ci95_high"]) else 0.0 for row in confirm_rows]
        ax.errorbar(range(len(names)), means, yerr=halves, fmt="o", capsize=4)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_ylabel(f"{spec.metric} (mean, 95 % t-interval)")
        ax.set_title(f"{spec.name}: seed statistics")
        figure.savefig(plots / "confirm.png", dpi=100, bbox_inches="tight")
        plt.close(figure)
        written.append(plots / "confirm.png")
    return written


def run_search(spec: SearchSpec, out_dir: str | Path, *, gpus: list[int | str] | None = None, slots: int | None = None,
               resume: bool = False, grace: float = 10.0, stream: TextIO | None = sys.stdout,
               experiments_file: str | None = None) -> int:
    """Run the study on GPU ids `gpus` or `slots` CPU slots, then confirm and plot; the exit status."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    # A study an array job ran lives in its journal file; --resume here continues it (and confirms).
    journal = (out_dir / "study.journal").is_file() and not (out_dir / "study.db").is_file()
    storage = spec.storage or default_storage(out_dir, journal=journal)
    study = open_study(spec, storage, resume)
    pool = SlotPool(gpus=gpus, slots=slots)
    meta = {"experiments_file": experiments_file, "out_dir": str(out_dir), "mode": "search", "study": spec.name,
            "storage": storage, "metric": spec.metric, "direction": spec.direction, "n_trials": spec.n_trials,
            "slots": pool.capacity, "gpus": pool.gpus, "resume": resume}
    scheduler = StudyScheduler(spec, study, out_dir, pool, resume=resume, grace=grace, stream=stream, meta=meta)
    status = scheduler.run()
    if scheduler.stop_signal is not None:
        return status
    return finish_study(spec, study, out_dir, pool, resume=resume, grace=grace, stream=stream, status=status)


def finish_study(spec: SearchSpec, study: optuna.Study, out_dir: Path, pool: SlotPool, *, resume: bool, grace: float,
                 stream: TextIO | None, status: int) -> int:
    """After the trials: the best trial, the confirm stage and the plots."""
    states = Counter(t.state for t in study.get_trials(deepcopy=False) if counted(t))
    if stream is not None:
        stream.write(f"study {spec.name}: {states[TrialState.COMPLETE]} complete, {states[TrialState.PRUNED]} pruned, "
                     f"{states[TrialState.FAIL]} failed\n")
    confirm_rows: list[dict[str, Any]] = []
    if states[TrialState.COMPLETE]:
        if stream is not None:
            stream.write(f"{best_line(spec, study)}\n")
        if spec.confirm_top:
            confirm_status, confirm_rows = confirm_best(spec, study, out_dir, pool, resume=resume, grace=grace,
                                                        stream=stream)
            status = max(status, confirm_status)
    write_plots(spec, study, out_dir, confirm_rows, stream)
    return status


# -- SLURM: array tasks sharing the study through a journal file --------------------------------------

def run_search_task(spec: SearchSpec, out_dir: str, storage: str, grace: float = 10.0) -> int:
    """Body of one array task: trials one after another on the task's devices until the study has n_trials."""
    task_id = array_task_id()
    # Tasks start side by side: a seeded sampler gets a different seed in each.
    study = open_study(spec, storage, resume=True, seed_offset=zlib.crc32(str(task_id or os.getpid()).encode()) % 10**6)
    meta = {"out_dir": out_dir, "mode": "slurm", "study": spec.name, "storage": storage}
    scheduler = StudyScheduler(spec, study, Path(out_dir), SlotPool(inherit=True), resume=False, grace=grace,
                               stream=sys.stdout, meta=meta,
                               record_extra={"slurm_job_id": task_id, "host": socket.gethostname()})
    return scheduler.run()


def submit_search(spec: SearchSpec, out_dir: str | Path, executor: Any, *, tasks: int, resume: bool = False,
                  grace: float = 10.0, stream: TextIO | None = sys.stdout,
                  experiments_file: str | None = None) -> list[Any]:
    """Create (or, resume, continue) the study in its journal file and submit `tasks` array tasks that share it."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    storage = spec.storage or default_storage(out_dir, journal=True)
    study = open_study(spec, storage, resume)
    done = count_trials(study.get_trials(deepcopy=False))
    if resume:
        # The earlier array job has ended: its trials still marked running were lost with their tasks.
        requeue_lost(study)
    tasks = max(0, min(tasks, spec.n_trials - done))
    jobs = executor.map_array(run_search_task, [spec] * tasks, [str(out_dir)] * tasks, [storage] * tasks,
                              [grace] * tasks) if tasks else []
    if stream is not None:
        array_id = str(jobs[0].job_id).split("_")[0] if jobs else None
        stream.write(f"study {spec.name}: {done} of {spec.n_trials} trial(s) counted; "
                     + (f"submitted {tasks} array task(s) as job {array_id}, sharing {storage}\n" if jobs
                        else "nothing to submit\n"))
        stream.write(f"when it has ended: trainer run-experiments {experiments_file or 'STUDY.yaml'} --out {out_dir} "
                     "--collect  (summary and plots; --resume then runs the confirm stage here)\n")
        stream.flush()
    return jobs


def collect_search(spec: SearchSpec, out_dir: str | Path, stream: TextIO | None = sys.stdout,
                   experiments_file: str | None = None) -> int:
    """After an array job: OUT/results.json and OUT/summary.csv from the trials' result.json files, and the plots."""
    out_dir = Path(out_dir).resolve()
    storage = spec.storage or default_storage(out_dir, journal=True)
    if spec.storage is None and not (out_dir / "study.journal").is_file():
        raise ExperimentsError(f"--collect: no study journal {out_dir / 'study.journal'} (a study submitted with "
                               "--slurm keeps one there; a local study's summary is written as it runs)")
    study = open_study(spec, storage, resume=True)
    records = sorted(read_results(out_dir).values(), key=lambda r: r.extra.get("trial", -1))
    meta = {"experiments_file": experiments_file, "out_dir": str(out_dir), "mode": "slurm", "study": spec.name,
            "storage": storage, "metric": spec.metric, "direction": spec.direction, "n_trials": spec.n_trials}
    write_results(out_dir, records, meta, summary=study_summary_csv(spec, records))
    done = count_trials(study.get_trials(deepcopy=False))
    if stream is not None:
        stream.write(f"study {spec.name}: {done} of {spec.n_trials} trial(s) counted; {len(records)} trial folder(s); "
                     f"summary in {out_dir / 'summary.csv'}\n")
        best = best_line(spec, study)
        if best is not None:
            stream.write(best + "\n")
    write_plots(spec, study, out_dir, [], stream)
    return 0 if done >= spec.n_trials else 1

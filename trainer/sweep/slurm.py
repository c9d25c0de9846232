"""Beyond one node: the experiments as one SLURM array job through submitit, and --collect.

Each array task runs one experiment with the same launcher code as the local runner (its devices are
the ones SLURM gave the task) and writes OUT/<name>/result.json; `collect_results` merges those into
OUT/results.json and OUT/summary.csv.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from trainer.sweep.devices import SlotPool
from trainer.sweep.display import render_table
from trainer.sweep.parsing import ExperimentsError
from trainer.sweep.record import RunRecord
from trainer.sweep.results import RESULT_FILE, read_results, write_results
from trainer.sweep.scheduler import Scheduler
from trainer.sweep.spec import Experiment

SUBMITIT_FOLDER = ".submitit"


def parse_slurm_time(value: str | int | None) -> int | None:
    """Minutes from '90' (minutes), 'HH:MM:SS', 'MM:SS' or 'D-HH:MM:SS', as sbatch --time reads them."""
    if value is None:
        return None
    text = str(value).strip()
    try:
        if ":" not in text and "-" not in text:
            return int(text)
        days = 0
        if "-" in text:
            day_text, text = text.split("-", 1)
            days = int(day_text)
        parts = [int(p) for p in text.split(":")]
        if len(parts) == 2:
            parts = [0, *parts] if days == 0 else [*parts, 0]
        hours, minutes, seconds = parts
    except ValueError:
        raise ExperimentsError(f"--slurm-time {value!r}: expected minutes or [D-]HH:MM:SS") from None
    return days * 1440 + hours * 60 + minutes + math.ceil(seconds / 60)


def slurm_parameters(experiments: Sequence[Experiment], *, job_name: str, partition: str | None = None,
                     time: str | int | None = None, gpus_per_task: int | None = None,
                     cpus_per_task: int | None = None, mem: str | None = None, array_parallelism: int | None = None,
                     account: str | None = None, qos: str | None = None, constraint: str | None = None,
                     setup: Sequence[str] = (), extra: Sequence[str] = ()) -> dict[str, Any]:
    """submitit.SlurmExecutor parameters for one array job that fits every experiment."""
    if gpus_per_task is None:
        # One array job has one resource shape: the biggest experiment's.
        gpus_per_task = max(exp.gpus_per_experiment for exp in experiments)
    params: dict[str, Any] = {"job_name": job_name, "nodes": 1, "ntasks_per_node": 1}
    minutes = parse_slurm_time(time)
    optional = {"partition": partition, "time": minutes, "cpus_per_task": cpus_per_task, "mem": mem,
                "array_parallelism": array_parallelism, "account": account, "qos": qos, "constraint": constraint}
    params.update({k: v for k, v in optional.items() if v is not None})
    if gpus_per_task > 0:
        params["gpus_per_task"] = gpus_per_task
    if setup:
        params["setup"] = list(setup)
    additional = {}
    for item in extra:
        if "=" not in item:
            raise ExperimentsError(f"--slurm-extra {item!r}: expected sbatch-option=value, e.g. mail-type=END")
        key, value = item.split("=", 1)
        additional[key.strip().lstrip("-")] = value
    if additional:
        params["additional_parameters"] = additional
    return params


def make_executor(out_dir: Path, params: Mapping[str, Any], kind: str = "slurm") -> Any:
    """A submitit executor writing its pickles and logs to OUT/.submitit; `local` runs the tasks here."""
    import submitit

    folder = Path(out_dir).resolve() / SUBMITIT_FOLDER / "%j"
    if kind == "local":
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(timeout_min=params.get("time", 60 * 24), gpus_per_node=params.get("gpus_per_task", 0))
        return executor
    executor = submitit.SlurmExecutor(folder=folder)
    executor.update_parameters(**params)
    return executor


def array_task_id() -> str | None:
    """The SLURM id of the running job or array task (JOBID_TASKID), or None outside SLURM."""
    try:
        import submitit

        return str(submitit.JobEnvironment().job_id)
    except Exception:  # not inside a submitit job (e.g. called directly in a test)
        array = os.environ.get("SLURM_ARRAY_JOB_ID")
        return f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array else os.environ.get("SLURM_JOB_ID")


def run_array_task(exp: Experiment, out_dir: str, grace: float = 10.0, resume: bool = False) -> dict[str, Any]:
    """Body of one array task: run `exp` on the task's devices, write OUT/<name>/result.json, return it (as a dict)."""
    pool = SlotPool(inherit=True)
    task_id = array_task_id()
    extra = {"slurm_job_id": task_id, "host": socket.gethostname()}
    own_record = Path(out_dir) / exp.name / RESULT_FILE
    if own_record.is_file() and task_id is not None:
        try:
            # The same task id again means SLURM requeued this task (preemption): continue, not restart.
            resume = resume or json.loads(own_record.read_text()).get("slurm_job_id") == task_id
        except json.JSONDecodeError:
            pass
    scheduler = Scheduler([exp], Path(out_dir), pool, resume=resume, grace=grace, stream=sys.stdout, tty=False,
                          write_summary=False, record_extra=extra)
    if scheduler.pending:
        scheduler.run()
    return scheduler.records[0].to_dict()


def submit_slurm(experiments: Sequence[Experiment], out_dir: str | Path, executor: Any, *, resume: bool = False,
                 grace: float = 10.0, experiments_file: str | None = None,
                 stream: TextIO | None = sys.stdout) -> list[Any]:
    """Submit every experiment not yet completed as one array job; OUT/results.json lists them pending."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    previous = read_results(out_dir) if resume else {}
    records, todo = [], []
    for exp in experiments:
        old = previous.get(exp.name)
        if old is not None and old.status == "completed":
            records.append(old)
        else:
            records.append(RunRecord.pending(exp, out_dir))
            todo.append(exp)
    jobs = []
    if todo:
        n = len(todo)
        jobs = executor.map_array(run_array_task, todo, [str(out_dir)] * n, [grace] * n, [resume] * n)
    by_name = {r.name: r for r in records}
    for exp, job in zip(todo, jobs):
        by_name[exp.name].slurm_job_id = str(job.job_id)
    array_id = str(jobs[0].job_id).split("_")[0] if jobs else None
    meta = {"experiments_file": experiments_file, "out_dir": str(out_dir), "mode": "slurm",
            "slurm_array_job_id": array_id, "resume": resume}
    write_results(out_dir, records, meta)
    if stream is not None:
        if jobs:
            stream.write(f"run-experiments: submitted {len(jobs)} experiment(s) as array job {array_id}"
                         f" ({len(records) - len(todo)} already completed)\n")
        else:
            stream.write("run-experiments: every experiment already completed; nothing submitted\n")
        stream.write(f"collect the results with: trainer run-experiments {experiments_file or 'EXPERIMENTS.yaml'} "
                     f"--out {out_dir} --collect\n")
        stream.flush()
    return jobs


def collect_results(experiments: Sequence[Experiment], out_dir: str | Path, experiments_file: str | None = None,
                    stream: TextIO | None = sys.stdout) -> tuple[int, list[dict[str, Any]]]:
    """Merge OUT/<name>/result.json of every experiment into OUT/results.json and OUT/summary.csv."""
    out_dir = Path(out_dir).resolve()
    previous = read_results(out_dir)
    records = [previous.get(exp.name) or RunRecord.pending(exp, out_dir) for exp in experiments]
    meta: dict[str, Any] = {}
    results_path = out_dir / "results.json"
    if results_path.is_file():
        meta = {k: v for k, v in json.loads(results_path.read_text()).items()
                if k not in ("experiments", "counts", "updated")}
    meta.update(experiments_file=experiments_file or meta.get("experiments_file"), out_dir=str(out_dir))
    write_results(out_dir, records, meta)
    if stream is not None:
        stream.write(render_table(records) + "\n")
        stream.flush()
    return (0 if all(r.status == "completed" for r in records) else 1), [r.to_dict() for r in records]

"""Arguments and entry point of `trainer run-experiments` (wired into trainer/cli.py)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from trainer.disk_space import disk_bytes, no_space_reason, space_report
from trainer.errors import DiskFullError, TrainerError
from trainer.sweep.parsing import ExperimentsError
from trainer.sweep.scheduler import run_experiments
from trainer.sweep.spec import load_experiments_file


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiments_file", help="experiments YAML (docs/experiments.md)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gpus", nargs="+", metavar="ID",
                       help="GPU ids to share out, e.g. --gpus 0 1 2 (default: every visible GPU, else 1 CPU slot)")
    where.add_argument("--slots", type=_positive_int, metavar="N", help="N CPU slots (no GPUs; CUDA_VISIBLE_DEVICES='')")
    parser.add_argument("--gpus-per-experiment", type=_positive_int, metavar="K", default=None,
                        help="slots per experiment where an entry does not say (K > 1: accelerate launch, K processes)")
    parser.add_argument("--out", required=True, help="output folder: OUT/results.json, OUT/summary.csv, OUT/<name>/")
    parser.add_argument("--resume", action="store_true",
                        help="skip experiments already completed in OUT/results.json; a study (search:) continues "
                             "in its storage, re-running the trials that were running")
    parser.add_argument("--timeout", default=None, metavar="S",
                        help="per-experiment time limit (seconds, or 30m / 2h) where an entry does not say")
    parser.add_argument("--grace", type=float, default=10.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL when stopping a run (default 10)")
    parser.add_argument("--dry-run", action="store_true", help="print the expanded experiments and commands, run nothing")
    parser.add_argument("--collect", action="store_true",
                        help="merge OUT/<name>/result.json files (SLURM array tasks) into results.json and summary.csv")
    slurm = parser.add_argument_group("SLURM (one array job through submitit; pip install submitit)")
    slurm.add_argument("--slurm", action="store_true", help="submit to SLURM instead of running here")
    slurm.add_argument("--slurm-partition", default=None)
    slurm.add_argument("--slurm-time", default=None, help="time limit per array task: minutes or [D-]HH:MM:SS")
    slurm.add_argument("--slurm-gpus-per-task", type=int, default=None,
                       help="GPUs per array task (default: the largest gpus_per_experiment)")
    slurm.add_argument("--slurm-cpus-per-task", type=int, default=None)
    slurm.add_argument("--slurm-mem", default=None, help="memory per node, e.g. 64G")
    slurm.add_argument("--slurm-array-parallelism", type=int, default=None,
                       help="at most this many tasks at once (search: this many tasks, each running trials until the "
                            "study has n_trials; default n_trials)")
    slurm.add_argument("--slurm-account", default=None)
    slurm.add_argument("--slurm-qos", default=None)
    slurm.add_argument("--slurm-constraint", default=None)
    slurm.add_argument("--slurm-setup", action="append", default=[], metavar="LINE",
                       help="shell line run before each task, e.g. 'module load cuda' (repeatable)")
    slurm.add_argument("--slurm-extra", action="append", default=[], metavar="KEY=VALUE",
                       help="any other sbatch option, e.g. mail-type=END (repeatable)")
    slurm.add_argument("--slurm-executor", choices=["slurm", "local"], default="slurm",
                       help="local: submitit's LocalExecutor runs the array tasks on this machine (for trying it out)")


def detect_gpus() -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else what nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip().isdigit()]


def main(args: argparse.Namespace) -> int:
    """Run, resume, submit or collect the experiments file's runs or study; a full disk under OUT (the study
    database, results, records) is one line naming it."""
    try:
        return _main(args)
    except TrainerError:
        raise
    except Exception as err:
        out = Path(args.out)
        full = no_space_reason(err, out)  # Optuna wraps SQLite's "database or disk is full" in a StorageInternalError
        if full is None:
            raise
        database = max(out.glob("study.*"), key=disk_bytes, default=None)
        space = (space_report(out, disk_bytes(database), estimate=f"estimate: the size of {database.name} now",
                              reason=full) if database else space_report(out, None, reason=full))
        raise DiskFullError(f"run-experiments could not write under {out}: {full} ({space}); what was recorded "
                            f"before is kept: free space there and continue with --resume") from err


def _main(args: argparse.Namespace) -> int:
    cli_defaults = {"timeout": args.timeout, "gpus_per_experiment": args.gpus_per_experiment}
    experiments, search = load_experiments_file(args.experiments_file, cli_defaults)
    out = Path(args.out)
    if search is not None:
        return _main_search(args, search, out)

    if args.dry_run:
        for exp in experiments:
            argv = exp.argv(out / exp.name, ["<gpu>"] * exp.gpus_per_experiment, port=0, fresh=not args.resume)
            timeout = f"{exp.timeout:g}s" if exp.timeout else "none"
            print(f"{exp.name}\t[{exp.gpus_per_experiment} slot(s), timeout {timeout}]\t{shlex.join(argv)}")
        return 0

    if args.collect:
        from trainer.sweep.slurm import collect_results

        status, _ = collect_results(experiments, out, experiments_file=args.experiments_file)
        return status

    if args.slurm:
        from trainer.sweep.slurm import submit_slurm

        executor = _slurm_executor(args, experiments, out, gpus_per_task=args.slurm_gpus_per_task,
                                   array_parallelism=args.slurm_array_parallelism)
        submit_slurm(experiments, out, executor, resume=args.resume, grace=args.grace,
                     experiments_file=args.experiments_file)
        return 0

    gpus, slots = _local_devices(args)
    status, records = run_experiments(experiments, out, gpus=gpus, slots=slots, resume=args.resume, grace=args.grace,
                                      stream=sys.stdout, experiments_file=args.experiments_file)
    if any(exp.group is not None for exp in experiments):
        from trainer.sweep.stats import write_repeats_statistics

        write_repeats_statistics(records, out, sys.stdout)
    return status


def _slurm_executor(args: argparse.Namespace, experiments: list, out: Path, gpus_per_task: int | None,
                    array_parallelism: int | None = None):
    """The submitit executor the --slurm-* options describe."""
    from trainer.sweep.slurm import make_executor, slurm_parameters

    if importlib.util.find_spec("submitit") is None:
        raise ExperimentsError("--slurm needs submitit: pip install 'sciml-trainer[slurm]'")
    params = slurm_parameters(experiments, job_name=Path(args.experiments_file).stem,
                              partition=args.slurm_partition, time=args.slurm_time,
                              gpus_per_task=gpus_per_task, cpus_per_task=args.slurm_cpus_per_task,
                              mem=args.slurm_mem, array_parallelism=array_parallelism,
                              account=args.slurm_account, qos=args.slurm_qos, constraint=args.slurm_constraint,
                              setup=args.slurm_setup, extra=args.slurm_extra)
    try:
        return make_executor(out, params, kind=args.slurm_executor)
    except RuntimeError as err:  # submitit: "Could not detect srun"
        raise ExperimentsError(f"--slurm: {err}") from None


def _local_devices(args: argparse.Namespace) -> tuple[list[str] | None, int | None]:
    gpus, slots = args.gpus, args.slots
    if gpus is None and slots is None:
        gpus = detect_gpus() or None
        slots = None if gpus else 1
    return gpus, slots


def _main_search(args: argparse.Namespace, search, out: Path) -> int:
    """A `search:` file: the search space (--dry-run), a SLURM array sharing a journal, or the study here."""
    if args.dry_run:
        print(search.describe())
        return 0
    if importlib.util.find_spec("optuna") is None:
        raise ExperimentsError("search: needs optuna: pip install 'sciml-trainer[search]'")
    if args.collect:
        from trainer.sweep.study import collect_search

        return collect_search(search, out, experiments_file=args.experiments_file)
    if args.slurm:
        from trainer.sweep.study import submit_search

        executor = _slurm_executor(args, [], out, gpus_per_task=args.slurm_gpus_per_task or search.gpus_per_experiment)
        submit_search(search, out, executor, tasks=args.slurm_array_parallelism or search.n_trials, resume=args.resume,
                      grace=args.grace, experiments_file=args.experiments_file)
        return 0
    from trainer.sweep.study import run_search

    gpus, slots = _local_devices(args)
    return run_search(search, out, gpus=gpus, slots=slots, resume=args.resume, grace=args.grace, stream=sys.stdout,
                      experiments_file=args.experiments_file)

"""Hyperparameter search with pruning against a log grid: quality reached and CPU-seconds spent.

The regression task's tiny config made heavier (hidden 512, batch 256, 4096 samples: training rather than the
interpreter and torch start-up dominates a run's CPU time), the learning rate over four decades (1e-4 .. 1):

- grid: a 16-point log grid, every run to the end, through `run_experiments` (what `trainer run-experiments
  --slots 2` runs for an `experiments:` file);
- search: Optuna's TPE sampler with the median pruner, 12 trials, through `run_search` (what a `search:` file
  runs), so pruned trials stop at an evaluation.

CPU-seconds are the trials' own (user + system of every child process, from getrusage(RUSAGE_CHILDREN)
around each arm), so the runner's bookkeeping is not charged. Target: the search's best eval loss within
5 % of the grid's best, with at most half of the grid's CPU-seconds; we also give the fraction of trials
pruned and the CPU-seconds saved.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from bench_report import command_line, cpu_model, publish_section, utc_now

TOPIC = "Experiment runner and hyperparameter search"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "regression" / "tiny.yaml")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


HEAVIER = {"task.hidden": 512, "train.per_device_batch_size": 256, "task.num_train": 4096}


def overrides(max_steps: int, eval_every: int, smoke: bool = False) -> dict:
    return {"train.max_steps": max_steps, "eval.every_steps": eval_every, "ckpt.every_steps": 0,
            "log.progress_bar": False, "log.tensorboard": False, **({} if smoke else HEAVIER)}


def run_grid(points: int, max_steps: int, eval_every: int, slots: int, out: Path, smoke: bool) -> dict:
    from trainer.sweep import parse_experiments, run_experiments
    from trainer.sweep.stats import metric_value

    lrs = [float(f"{10 ** (-4 + 4 * i / (points - 1)):.4g}") for i in range(points)]
    spec = {"experiments": [{"name": "lr{optim.lr}", "config": CONFIG, "overrides": overrides(max_steps, eval_every, smoke),
                             "grid": {"optim.lr": lrs}}]}
    cpu0, t0 = children_cpu(), time.perf_counter()
    status, records = run_experiments(parse_experiments(spec), out, slots=slots, stream=None)
    wall, cpu = time.perf_counter() - t0, children_cpu() - cpu0
    if status != 0:
        raise RuntimeError(f"grid runs failed: {[r['log_tail'] for r in records if r['status'] != 'completed']}")
    values = {r["grid"]["optim.lr"]: metric_value(r["out_dir"], "eval/loss")[0] for r in records}
    best_lr = min(values, key=values.get)
    return {"runs": len(records), "best": values[best_lr], "best_lr": best_lr, "cpu": cpu, "wall": wall}


def run_study(trials: int, max_steps: int, eval_every: int, slots: int, out: Path, smoke: bool) -> dict:
    from trainer.sweep.searchspec import parse_search
    from trainer.sweep.study import run_search

    block = {"name": "bench_lr", "config": CONFIG, "overrides": overrides(max_steps, eval_every, smoke),
             "metric": "eval/loss", "direction": "minimize", "n_trials": trials,
             "sampler": {"type": "tpe", "seed": 0, "n_startup_trials": 4},
             "pruner": {"type": "median", "n_startup_trials": 3, "n_warmup_steps": 2 * eval_every},
             "params": {"optim.lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True}}}
    spec = parse_search(block, "benchmark", {})
    cpu0, t0 = children_cpu(), time.perf_counter()
    status = run_search(spec, out, slots=slots, stream=None)
    wall, cpu = time.perf_counter() - t0, children_cpu() - cpu0
    if status != 0:
        raise RuntimeError(f"the study ended with status {status}; see {out}/summary.csv")
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    complete = [r for r in rows if r["state"] == "complete"]
    pruned = [r for r in rows if r["state"] == "pruned"]
    best = min(complete, key=lambda r: float(r["eval/loss"]))
    mean_complete_cpu = sum(float(r["cpu_s"]) for r in complete) / len(complete)
    return {"trials": len(rows), "pruned": len(pruned), "best": float(best["eval/loss"]),
            "best_lr": float(best["optim.lr"]), "cpu": cpu, "wall": wall,
            "cpu_unpruned_estimate": mean_complete_cpu * len(rows),
            "cpu_sampled": sum(float(r["cpu_s"]) for r in rows),
            "steps_pruned": [int(r["step"]) for r in pruned]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid-points", type=int, default=16)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--max-steps", type=int, default=1200)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"), help="file that gets this section, atop its topic ('' : none)")
    p.add_argument("--smoke", action="store_true", help="2 grid points, 2 trials of 10 steps; nothing written")
    a = p.parse_args()
    if a.smoke:
        a.grid_points, a.trials, a.max_steps, a.eval_every = 2, 2, 10, 5
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
        grid = run_grid(a.grid_points, a.max_steps, a.eval_every, a.slots, Path(tmp) / "grid", a.smoke)
        print(f"grid: best eval/loss {grid['best']:.5g} at lr {grid['best_lr']:g}, {grid['cpu']:.1f} CPU-s",
              file=sys.stderr)
        study = run_study(a.trials, a.max_steps, a.eval_every, a.slots, Path(tmp) / "search", a.smoke)
    load_after = os.getloadavg()
    quality = study["best"] / grid["best"] - 1
    cpu_ratio = study["cpu"] / grid["cpu"]
    met = "met" if quality <= 0.05 and cpu_ratio <= 0.5 else "NOT met"
    saved_by_pruning = study["cpu_unpruned_estimate"] - study["cpu_sampled"]
    section = "\n".join([
        f"## Hyperparameter search with pruning against a log grid, {utc_now()}",
        "",
        f"- Machine: {cpu_model()}; Python {platform.python_version()}; **shared**: load average "
        f"{load[0]:.1f} before, {load_after[0]:.1f} after (other agents' work)",
        f"- Command: `{command_line()}`",
        f"- Task: configs/regression/tiny.yaml with {' '.join(f'{k}={v}' for k, v in HEAVIER.items())}, "
        f"{a.max_steps} steps, eval every {a.eval_every}; learning rate "
        f"1e-4 .. 1 (4 decades); {a.slots} CPU slots, OMP_NUM_THREADS=1",
        f"- Grid: {a.grid_points} log-spaced rates, every run to the end. Search: TPE (seed 0, 4 random start-up "
        f"trials), median pruner (3 start-up trials, warm-up {2 * a.eval_every} steps), {a.trials} trials",
        "- CPU-seconds: user + system of the runs' processes (getrusage of the children, per arm)",
        "",
        "| figure | grid | search |",
        "|---|---:|---:|",
        f"| runs / trials | {grid['runs']} | {study['trials']} ({study['pruned']} pruned, "
        f"{study['pruned'] / study['trials']:.0%}) |",
        f"| best eval/loss | {grid['best']:.5g} (lr {grid['best_lr']:.3g}) | {study['best']:.5g} "
        f"(lr {study['best_lr']:.3g}) |",
        f"| best relative to the grid's | 1.00 | **{1 + quality:.3f}** |",
        f"| CPU-seconds | {grid['cpu']:.1f} | {study['cpu']:.1f} (**{cpu_ratio:.2f}x** the grid's) |",
        f"| wall time | {grid['wall']:.1f} s | {study['wall']:.1f} s |",
        "",
        f"Target (within 5 % of the grid's best with at most half its CPU-seconds): {met}. CPU-seconds saved "
        f"against the grid: {grid['cpu'] - study['cpu']:.1f}; saved by pruning within the search (its trials "
        f"at the mean CPU-seconds of a complete trial, minus what they used, as sampled per trial): "
        f"{saved_by_pruning:.1f}. Pruned trials stopped at steps {sorted(study['steps_pruned'])}. Each trial "
        "pays the interpreter and torch start-up (a few CPU-seconds) whether pruned or not, so the saving "
        "grows with the length of the runs. One run of each arm (TPE seed 0) on a shared machine: where the load "
        "changed between the arms, the wall times are not comparable; the CPU-seconds are.",
    ])
    publish_section(section, a.out or None, a.smoke, topic=TOPIC)


if __name__ == "__main__":
    main()

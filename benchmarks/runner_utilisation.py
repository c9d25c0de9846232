"""Slot utilisation of `trainer run-experiments`: how much of the slots' time runs hold them.

N equal jobs (`python -c "time.sleep(S)"`, default 8 x 2 s) on K CPU slots (default 2), run by
`trainer.sweep.run_experiments` exactly as the CLI does (own process group, log file, memory
sampling, results.json rewritten after every start and end).

  utilisation = sum of the runs' run times / (slots x makespan)

where a run time is from launch to observed exit and the makespan from the first launch to the last
exit: the gaps it measures are the scheduler's (poll interval, bookkeeping, relaunch). We also give
the end-to-end efficiency = N x S / (slots x wall time of the whole call), which also charges the
interpreter start-up of every job and the runner's own set-up. Target: utilisation >= 95 %.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_report import command_line, cpu_model, utc_now, write_section

from trainer.sweep import parse_experiments, run_experiments

TOPIC = "Experiment runner and hyperparameter search"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

DEFAULT_OUT = Path(__file__).parent / "results" / "runner_utilisation.md"


def measure(jobs: int, slots: int, seconds: float) -> dict[str, float]:
    spec = {"experiments": [{"name": "sleep_{i}", "command": ["{python}", "-c", f"import time; time.sleep({seconds})"],
                             "grid": {"i": list(range(jobs))}}]}
    with tempfile.TemporaryDirectory(prefix="runner-util-") as out:
        t0 = time.perf_counter()
        status, records = run_experiments(parse_experiments(spec), out, slots=slots, stream=None)
        wall = time.perf_counter() - t0
    if status != 0:
        raise RuntimeError(f"benchmark jobs failed: {[r['log_tail'] for r in records if r['status'] != 'completed']}")
    busy = sum(r["end_epoch"] - r["start_epoch"] for r in records)
    makespan = max(r["end_epoch"] for r in records) - min(r["start_epoch"] for r in records)
    return {"utilisation": busy / (slots * makespan), "efficiency": jobs * seconds / (slots * wall),
            "makespan": makespan, "wall": wall, "busy": busy}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--seconds", type=float, default=2.0, help="length of each job")
    p.add_argument("--repeats", type=int, default=3, help="median of this many runs is reported")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="write the Markdown result block here ('-': stdout only)")
    p.add_argument("--smoke", action="store_true",
                   help="2 jobs of 0.2 s, one repeat, nothing written: checks the script runs")
    a = p.parse_args()
    if a.smoke:
        a.jobs, a.seconds, a.repeats, a.out = 2, 0.2, 1, "-"
    results = []
    for r in range(a.repeats):
        results.append(measure(a.jobs, a.slots, a.seconds))
        print(f"repeat {r + 1}/{a.repeats}: utilisation {results[-1]['utilisation']:.2%}, "
              f"makespan {results[-1]['makespan']:.2f} s", file=sys.stderr)
    med = {k: statistics.median(res[k] for res in results) for k in results[0]}
    ideal = a.jobs * a.seconds / a.slots
    target_met = "met" if med["utilisation"] >= 0.95 else "NOT met"
    block = "\n".join([
        f"## Experiment runner slot utilisation, {utc_now()}",
        "",
        f"- Machine: {cpu_model()}; Python {platform.python_version()}",
        f"- Command: `{command_line()}`",
        f"- {a.jobs} jobs of `python -c \"time.sleep({a.seconds:g})\"` on {a.slots} CPU slots through "
        f"`run_experiments` (what `trainer run-experiments --slots {a.slots}` runs); median of {a.repeats} repeats",
        "- Target: utilisation = sum of run times / (slots x makespan) >= 95 %",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| slot utilisation (sum of run times / (slots x makespan)) | **{med['utilisation']:.1%}** |",
        f"| end-to-end efficiency (jobs x {a.seconds:g} s / (slots x wall time of the call)) | {med['efficiency']:.1%} |",
        f"| makespan (first launch to last exit) | {med['makespan']:.2f} s (ideal {ideal:.2f} s) |",
        f"| wall time of the call | {med['wall']:.2f} s |",
        "",
        f"Target {target_met}. The difference between a run time and {a.seconds:g} s is the job's own "
        "interpreter start-up; the gap between one run's exit and the next launch on its slot is the "
        "runner's poll interval (50 ms) plus its bookkeeping (results.json and summary.csv rewritten).",
        "",
    ])
    print(block)
    if a.smoke:
        print("smoke run: nothing written")
    if a.out != "-":
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_section(out, block, topic=TOPIC)


if __name__ == "__main__":
    main()

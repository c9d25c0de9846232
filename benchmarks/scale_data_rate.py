"""Data rate per rank against the training step's consumption, for any task and data file.

For one config (any family) whose caches are built, and each W in `--worlds`:

  step rate     `trainer train CONFIG [--nproc W] OVERRIDES` for `--steps` steps: the samples per second per rank
                the job consumed (its logged `samples_per_s` / W, the mean over the records after the first)
  data rate     W processes at once, each iterating its rank's training DataLoader (`TrainBatches`, no model,
                `scale.data_rate`) over `--loader-samples` samples: samples/s per rank, and the CPU µs a rank spends
                per sample, which does not depend on what else shares the cores
  step alone    both runs read in the rank's own process (data.num_workers=0 is appended), so the logged step time
                includes the reading: the step alone takes 1 / step rate - 1 / data rate per sample
  headroom      data rate / the step alone's rate per rank: above 1 a loader with one worker keeps up with the step
                on these cores; the CPU µs per sample says how many samples/s one loader core gives a faster (GPU)
                step

The load average is given with each row: on a shared machine the wall rates move with it, the CPU µs do not.

    .venv/bin/python benchmarks/scale_data_rate.py configs/crystals/comformer_tiny.yaml --label "crystals 48 k" \
        --worlds 1 2 -- task.data_path=/scratch/c48k.extxyz task.cache_dir=/scratch/cache
    .venv/bin/python benchmarks/scale_data_rate.py --smoke
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_report import command_line, cpu_model, publish_section, utc_now  # noqa: E402
from scale import TRAINER, check, data_rate, first_step_s, launch, log, table, watch  # noqa: E402

TOPIC = "Field-size data: crystals, molecules, perturbations"
COLS = [("label", "data"), ("W", "W"), ("first_step_s", "launch to 1st step s"),
        ("step_rank", "step with reading, samples/s/rank"), ("step_alone", "step alone, samples/s/rank"),
        ("loader_rank", "loader samples/s/rank"), ("headroom", "loader / step alone"), ("loader_cpu_us", "loader CPU µs/sample"),
        ("core_rate", "samples/s one loader core gives"), ("load1", "load avg")]


def step_rate(w: Any, world: int) -> float:
    """Mean logged samples/s of the job's training records after the first (the first carries the start-up), per
    rank."""
    rates = [r["samples_per_s"] for _, r in w.lines if "loss" in r and "samples_per_s" in r][1:]
    if not rates:
        raise SystemExit(f"fewer than two training records with samples_per_s:\n{w.output[-3000:]}")
    return sum(rates) / len(rates) / world


def measure(a: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per W."""
    run_dir = a.workdir / "run"
    a.overrides = [*a.overrides, "data.num_workers=0"]  # reading in the rank's process: the CPU clock sees it
    common = [*a.overrides, "log.every_steps=1", "log.progress_bar=false", "log.tensorboard=false"]
    check(watch([*TRAINER, "data", "prepare", str(a.config), *a.overrides]), "trainer data prepare")
    rows = []
    for world in a.worlds:
        shutil.rmtree(run_dir, ignore_errors=True)
        w = launch(a, world, run_dir, [*common, f"train.max_steps={a.steps}", f"eval.every_steps={10**9}",
                                       f"ckpt.every_steps={10**9}"])
        row: dict[str, Any] = {"label": a.label, "W": world, "first_step_s": first_step_s(w),
                               "step_rank": step_rate(w, world), "load1": os.getloadavg()[0]}
        row["loader_rank"], _, row["loader_cpu_us"] = data_rate(a, world, a.overrides)
        per_sample = 1 / row["step_rank"] - 1 / row["loader_rank"]
        row["step_alone"] = 1 / per_sample if per_sample > 0 else float("nan")
        row["headroom"] = row["loader_rank"] / row["step_alone"]
        row["core_rate"] = 1e6 / row["loader_cpu_us"]
        log(f"{a.label} W={world}: {row}")
        rows.append(row)
    shutil.rmtree(run_dir, ignore_errors=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", type=Path, nargs="?", default=ROOT / "configs/regression/tiny.yaml",
                   help="the run's config; overrides follow `--`")
    p.add_argument("--label", default="", help="what the data is, for the table")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=20, help="training steps of each launch")
    p.add_argument("--loader-samples", type=int, default=2000, help="samples per rank of the data-rate measurement")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "scale_data_rate")
    p.add_argument("--out", type=Path, help="file the section into this markdown file (BENCHMARKS.md)")
    p.add_argument("--smoke", action="store_true", help="the regression tiny config, W = 1, 3 steps")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    a.overrides = argv[cut + 1:]  # config overrides: the data file, its cache folder
    a.label = a.label or a.config.stem
    if a.smoke:
        a.worlds, a.steps, a.loader_samples, a.out = [1], 3, 64, None
    a.workdir, a.config = a.workdir.resolve(), a.config.resolve()
    a.workdir.mkdir(parents=True, exist_ok=True)
    rows = measure(a)
    config = a.config.relative_to(ROOT) if a.config.is_relative_to(ROOT) else a.config
    section = "\n".join([
        f"### Data rate per rank against the step's consumption: {a.label}, {utc_now()}", "",
        f"Machine: {cpu_model()}. Command: `{command_line()}` "
        f"(config `{config}`, gloo on CPU).", "", table(rows, COLS)])
    publish_section(section + "\n", a.out, a.smoke, topic=TOPIC)


if __name__ == "__main__":
    main()

"""Force-field alignment (`trainer align`) of the tiny EDM: fresh samples before and after, from the same noise.

1. The tiny checkpoint: `trainer train configs/molecules_edm/edm_tiny.yaml` (or `--source RUN_DIR`).
2. `trainer align SOURCE out=ALIGNED` with its defaults (the `tiny` alignment preset; `--align KEY=VALUE` adds
   overrides), timed: wall and CPU-seconds (getrusage of the child), force evaluations (one per rollout).
3. `trainer sample` of both runs with the same seed (sample k draws the same noise from both models), scored by
   the reward force field (ANI-1x, `mlff_force_rms`) and by GFN2-xTB (`force_rms`, an oracle the alignment never
   saw), plus EDM's validity and atom stability.

Reported per force field: the mean force RMS of each model with its standard error, and the mean of the paired
differences (aligned - unaligned, over the molecules both models' force field scored) with its standard error.
Target: both means lower after alignment; validity and atom stability not lower by more than 2 points.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from bench_report import command_line, cpu_model, publish_section, utc_now

TOPIC = "Molecules: alignment"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "molecules_edm" / "edm_tiny.yaml")


def trainer(*args: str, log: Path) -> tuple[float, float]:
    """Run `trainer ARGS` to completion; (wall seconds, CPU seconds of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.call([sys.executable, "-m", "trainer", *args], stdout=out, stderr=subprocess.STDOUT,
                               cwd=ROOT)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        sys.exit(f"trainer {' '.join(args)} failed with status {code}; see {log}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def per_molecule(samples: Path) -> list[dict]:
    """The per-molecule values `trainer sample` wrote into the baseline set's extxyz (one info line per frame)."""
    from ase.io import iread

    return [dict(atoms.info) for atoms in iread(str(samples / "baseline" / "molecules.extxyz"), index=":")]


def mean_se(values: np.ndarray) -> tuple[float, float]:
    return float(values.mean()), float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan


def compare(before: list[dict], after: list[dict], key: str, ok: str) -> dict:
    """Means with standard errors and the paired difference over the molecules scored in both sets."""
    a = np.array([float(m[key]) if m.get(ok) and key in m else math.nan for m in before])
    b = np.array([float(m[key]) if m.get(ok) and key in m else math.nan for m in after])
    both = np.isfinite(a) & np.isfinite(b)
    if not both.any():
        return {"before": (math.nan, math.nan), "after": (math.nan, math.nan), "difference": (math.nan, math.nan),
                "paired": 0, "scored": (0, 0), "median": (math.nan, math.nan)}
    row = {"before": mean_se(a[np.isfinite(a)]), "after": mean_se(b[np.isfinite(b)]),
           "difference": mean_se((b - a)[both]), "paired": int(both.sum()),
           "scored": (int(np.isfinite(a).sum()), int(np.isfinite(b).sum())),
           "median": (float(np.median(a[np.isfinite(a)])), float(np.median(b[np.isfinite(b)])))}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=None, help="a trained molecules run (default: train edm_tiny.yaml)")
    parser.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--samples", type=int, default=128, help="molecules sampled from each model (>= 64)")
    parser.add_argument("--seed", type=int, default=1, help="sampling seed (the same noise for both models)")
    parser.add_argument("--align", action="append", default=[], help="an override of `trainer align` (repeatable)")
    parser.add_argument("--out", default=None, help="write the section into this BENCHMARKS.md")
    parser.add_argument("--smoke", action="store_true",
                        help="T = 20, 2 training steps, 2 alignment steps with springs as the reward, 4 molecules; "
                             "nothing written")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_align_"))
    work.mkdir(parents=True, exist_ok=True)
    timings = {}
    source = Path(args.source) if args.source else work / "edm_tiny"
    train_extra, align_extra, evaluation = [], list(args.align), ["evaluation_forcefield=gfn2", "evaluation_mlff=ani1x"]
    if args.smoke:
        train_extra = ["task.timesteps=20", "train.max_steps=2", "train.epochs=0", "eval.every_epochs=0",
                       "eval.sample_every=0", "task.val_fraction=0.01", "task.test_fraction=0", f"task.cache_dir={work}"]
        align_extra = ["train.max_steps=2", "task.group_size=3", "train.per_device_batch_size=2", "task.trained_steps=8",
                       "task.transitions=2", "task.reward_forcefield=springs", "task.reward_forcefield_kwargs.cutoff=1e4",
                       "eval.sample_every=0", *align_extra]
        evaluation = ["evaluation_forcefield=springs", "evaluation_mlff=none"]
        args.samples = 4
    if not args.source:
        timings["train"] = trainer("train", TINY, f"run.output_dir={source}", "log.progress_bar=false", *train_extra,
                                   log=work / "train.log")
    aligned = work / "aligned"
    timings["align"] = trainer("align", str(source), f"out={aligned}", "run.resume=none", "log.progress_bar=false",
                               *align_extra, log=work / "align.log")
    sample = [f"num_samples={args.samples}", f"seed={args.seed}", "batch_size=32", *evaluation, "chains=0",
              "progress=false"]
    sets = {}
    for name, run in (("before", source), ("after", aligned)):
        out = work / f"samples_{name}"
        timings[f"sample_{name}"] = trainer("sample", str(run), *sample, f"out={out}", log=work / f"sample_{name}.log")
        sets[name] = (per_molecule(out), json.loads(out.with_name(out.name + ".stats.json").read_text())["sets"]["baseline"])

    config = yaml.safe_load((aligned / "config.yaml").read_text())
    steps, groups = config["train"]["max_steps"], config["train"]["per_device_batch_size"]
    group_size = config["task"]["group_size"]
    rollouts = steps * groups * group_size
    records = [json.loads(line) for line in (aligned / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "reward_mean" in r]
    first, last = train[: max(1, len(train) // 10)], train[-max(1, len(train) // 10):]
    before, after = sets["before"][0], sets["after"][0]
    names = ("(none in a smoke run)", "springs") if args.smoke else ("ANI-1x (the reward)", "GFN2-xTB (not the reward)")
    rows = {names[0]: compare(before, after, "mlff_force_rms", "mlff_forcefield_ok"),
            names[1]: compare(before, after, "force_rms", "forcefield_ok")}
    quality = {k: (sets["before"][1][k], sets["after"][1][k]) for k in ("validity", "atom_stability", "molecule_stability")}

    def pm(pair: tuple[float, float]) -> str:
        return f"{pair[0]:.2f} ± {pair[1]:.2f}"

    lines = [f"## Force-field alignment (trainer align), {utc_now()}", "",
             f"Machine: {cpu_model()}, CPU only. Command: `{command_line()}`.", "",
             f"The tiny EDM (`edm_tiny.yaml`{', trained by the script' if not args.source else ''}) aligned with "
             f"`trainer align` at its defaults{' plus ' + ' '.join(args.align) if args.align else ''}: {steps} "
             f"iterations of {groups} groups x {group_size} rollouts, reward = minus ANI-1x's force RMS of the final "
             f"molecule. Then {args.samples} molecules from each model with `trainer sample seed={args.seed}` (the same "
             f"noise per molecule), scored by ANI-1x and by GFN2-xTB. Force RMS in eV/Å; ± is one standard error; the "
             f"difference is aligned - unaligned over the molecules both sets had scored.", "",
             "| force field | unaligned mean | aligned mean | difference (paired) | molecules paired "
             "| median unaligned -> aligned |",
             "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {pm(row['before'])} | {pm(row['after'])} | {pm(row['difference'])} | {row['paired']} "
                     f"| {row['median'][0]:.2f} -> {row['median'][1]:.2f} |")
    lines += ["", "| metric | unaligned | aligned | change (points) |", "|---|---|---|---|"]
    for key, (a, b) in quality.items():
        lines.append(f"| {key.replace('_', ' ')} | {100 * a:.1f} % | {100 * b:.1f} % | {100 * (b - a):+.1f} |")
    align_wall, align_cpu = timings["align"]
    lines += ["", f"Cost of the alignment: {align_wall:.0f} s wall, {align_cpu:.0f} CPU-s in all for {steps} iterations "
              f"({align_cpu / steps:.1f} CPU-s and {groups * group_size} force evaluations (one per rollout) an "
              f"iteration; {rollouts} in all), including start-up, the final evaluation and sample metrics. Reward "
              f"during the run (mean of the first and last tenth of the iterations): ANI-1x force RMS "
              f"{np.mean([r['force_rms_mean'] for r in first]):.2f} -> {np.mean([r['force_rms_mean'] for r in last]):.2f}, "
              f"KL to the start {np.mean([r['kl'] for r in last]):.3g}, rollouts excluded "
              f"{np.mean([r['excluded_fraction'] for r in train]) * 100:.1f} % (molecules with F: ANI-1x does not model "
              f"it)."]
    if "train" in timings:
        lines.append(f"Training the tiny checkpoint took {timings['train'][0]:.0f} s wall.")
    publish_section("\n".join(lines) + "\n", args.out, smoke=args.smoke, topic=TOPIC)


if __name__ == "__main__":
    main()

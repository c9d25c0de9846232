"""GFN2-xTB guidance at force-field speed: the guidance ladder against plain tblite single points.

For each checkpoint (an early one and a trained one) and each guidance scale of the guided sampling command
(docs/families/molecules_edm.md), guided sampling of `--molecules` molecules (T = 1000, the default noise
threshold: 632 guided steps) with `XTBForceField(workers=1).for_guidance()` (the ladder of forcefields/xtb.py),
in this process on one core.
Every `--every` guided steps the same number of QM9 molecules (the bundled sample, cycled) get a plain
tblite single point (`compute`: tblite's defaults, 250 cycles): both rates are measured in the same run,
interleaved, so machine load hits both alike. Reported per set: guidance evaluations, the share of each rung,
failures (molecules left unguided on that step), the guidance rate and the single-point rate (evaluations
per second of wall time and of CPU time; CPU time is the fairer one on a shared machine) and their ratio.
The machine's load average is recorded at start and end.

Targets: failed guidance evaluations <= 1 %, guidance rate >= 0.5x the single-point rate.

    python benchmarks/guidance.py --early RUN --trained RUN --out BENCHMARKS.md
    python benchmarks/guidance.py --smoke        # 1 molecule, one scale, early checkpoint, last ~100 steps guided

Without --early/--trained the checkpoints are trained here: 20 steps (early) and `--train-steps` (trained)
of configs/molecules_edm/edm_tiny.yaml on one process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_report import command_line, cpu_model, publish_section, utc_now  # noqa: E402
from forcefields import BUNDLED, stream_molecules  # noqa: E402

TOPIC = "Molecules: guidance and force fields"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

CONFIG = ROOT / "configs" / "molecules_edm" / "edm_tiny.yaml"
SCALES = (0.0005, 0.0007, 0.008)


class Clock:
    """Evaluations and the wall and CPU seconds they took."""

    def __init__(self) -> None:
        self.evaluations, self.failures, self.wall, self.cpu = 0, 0, 0.0, 0.0

    def time(self, call, rows: int):
        wall, cpu = time.perf_counter(), time.process_time()
        result = call()
        self.wall += time.perf_counter() - wall
        self.cpu += time.process_time() - cpu
        self.evaluations += rows
        self.failures += int((~np.asarray(result.ok)).sum())
        return result

    def rate(self, kind: str) -> float:
        return self.evaluations / max(self.wall if kind == "wall" else self.cpu, 1e-12)


class Paired:
    """The guidance evaluator, timed, with plain single points on QM9 molecules interleaved every `every` calls."""

    def __init__(self, forcefield, qm9: list, every: int) -> None:
        self.inner = forcefield.for_guidance()
        self.rung_labels = self.inner.rung_labels
        self.forcefield, self.qm9, self.every = forcefield, qm9, every
        self.guided, self.single, self.calls, self.next = Clock(), Clock(), 0, 0

    def compute(self, numbers, positions, mask):
        from trainer.families.molecules_edm.forcefields import pad_molecules

        rows = int(np.asarray(mask).any(axis=1).sum())
        result = self.guided.time(lambda: self.inner.compute(numbers, positions, mask), rows)
        self.calls += 1
        if self.calls % self.every == 0:
            picked = [self.qm9[(self.next + i) % len(self.qm9)] for i in range(rows)]
            self.next += rows
            self.single.time(lambda: self.forcefield.compute(*pad_molecules(picked)), rows)
        return result


class PairedField:
    """What ForceGuidance sees: a force field whose `for_guidance()` is the paired, timed evaluator."""

    name = "gfn2-xtb"

    def __init__(self, qm9: list, every: int) -> None:
        from trainer.families.molecules_edm.forcefields.xtb import XTBForceField

        self.xtb = XTBForceField(workers=1)
        self.qm9, self.every, self.last = qm9, every, None

    def for_guidance(self) -> Paired:
        self.last = Paired(self.xtb, self.qm9, self.every)
        return self.last

    def compute(self, numbers, positions, mask):
        return self.xtb.compute(numbers, positions, mask)

    def close(self) -> None:
        self.xtb.close()


def train(out: Path, steps: int, cache: Path) -> Path:
    if not (out / "checkpoints").is_dir():
        cmd = [str(Path(sys.executable).parent / "trainer"), "train", str(CONFIG), f"run.output_dir={out}",
               f"train.max_steps={steps}", "train.epochs=0", "eval.every_epochs=0", "eval.every_steps=0",
               "eval.sample_every=0", "log.progress_bar=false", "log.tensorboard=false", "run.resume=none",
               f"task.cache_dir={cache}"]
        subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True, capture_output=True)
    return out


def load(run_dir: Path):
    from trainer.core.checkpoint.export import consolidated_weights, read_task_stats
    from trainer.core.generation import run_task

    task = run_task(run_dir)
    params, source = consolidated_weights(run_dir)
    stats = read_task_stats(source)
    task.attach_stats(stats)
    model = task.build_model(stats)
    model.load_state_dict(params, strict=True)
    return task, model.eval()


def guided_set(task, model, scale: float, molecules: int, field: PairedField, noise_threshold: float = 0.8) -> dict:
    import torch

    from trainer.core.generation import sample_generator
    from trainer.families.molecules_edm.guidance import ForceGuidance, GuidanceConfig
    from trainer.families.molecules_edm.spec import MoleculeSampleConfig

    generators = [sample_generator(0, k, torch.device("cpu")) for k in range(molecules)]
    num_atoms = task._draw_num_atoms(generators, MoleculeSampleConfig())
    hook = ForceGuidance(field, GuidanceConfig(scale=scale, noise_threshold=noise_threshold), task.atomic_numbers)
    started = time.perf_counter()
    with torch.no_grad():
        model.diffusion.sample(num_atoms, generators, guidance=hook)
    paired = field.last
    counters = hook.counters()
    return {"scale": scale, "seconds": time.perf_counter() - started, "atoms": num_atoms, **counters,
            "guided_wall": paired.guided.rate("wall"), "guided_cpu": paired.guided.rate("cpu"),
            "single_wall": paired.single.rate("wall"), "single_cpu": paired.single.rate("cpu"),
            "single_evaluations": paired.single.evaluations, "single_failures": paired.single.failures,
            "rungs": {label: counters[f"evaluations_{label}"] for label in paired.rung_labels}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--early", default=None, help="run directory of an early checkpoint (default: train 20 steps)")
    parser.add_argument("--trained", default=None, help="run directory of a trained checkpoint (default: train)")
    parser.add_argument("--train-steps", type=int, default=2500, help="steps of the trained checkpoint if trained here")
    parser.add_argument("--molecules", type=int, default=3, help="molecules per guided set")
    parser.add_argument("--every", type=int, default=4, help="a single-point batch every this many guided steps")
    parser.add_argument("--scales", default=",".join(map(str, SCALES)))
    parser.add_argument("--smoke", action="store_true", help="one molecule, one scale, the early checkpoint; writes nothing")
    parser.add_argument("--out", default=None, help="write the section into this markdown file")
    parser.add_argument("--work", default=None, help="working folder (default: a temp folder)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_guidance_"))
    load_start = os.getloadavg()
    started = time.time()
    runs = {"early (20 steps)": Path(args.early) if args.early else train(work / "early", 20, work / "cache")}
    if not args.smoke:
        runs["trained"] = Path(args.trained) if args.trained else train(work / "trained", args.train_steps,
                                                                         work / "cache")
    scales = [SCALES[-1]] if args.smoke else [float(s) for s in args.scales.split(",")]
    molecules = 1 if args.smoke else args.molecules
    qm9 = list(stream_molecules(BUNDLED, 50))
    results = []
    for label, run_dir in runs.items():
        task, model = load(run_dir)
        for scale in scales:
            field = PairedField(qm9, args.every)
            try:
                # smoke: only the last ~100 steps guided (sigma_t <= 0.3), enough to exercise every part
                row = guided_set(task, model, scale, molecules, field, 0.3 if args.smoke else 0.8)
            finally:
                field.close()
            results.append((label, row))
            print(label, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    load_end = os.getloadavg()

    lines = [f"## Guidance at force-field speed (GFN2-xTB ladder vs single points), {utc_now()}", "",
             f"Machine: {cpu_model()}, shared with other jobs: load average {load_start[0]:.1f} / {load_start[1]:.1f} "
             f"(1 / 5 min) at start, {load_end[0]:.1f} / {load_end[1]:.1f} at the end, {(time.time() - started) / 60:.1f} "
             f"min in all. Command: `{command_line()}`.", "",
             f"Guided sampling (EDM `tiny`, T = 1000, 632 guided steps) of {molecules} molecules per set on one core "
             "(`XTBForceField(workers=1).for_guidance()`: electronic temperature 9.5e-4 -> 0.01 -> 0.03 Eh, 40 SCF "
             "cycles per rung, warm starts, sticky rung with a probe every 10 steps); every "
             f"{args.every} guided steps as many plain tblite single points (`compute`: tblite's defaults, 250 "
             "cycles) on the bundled QM9 molecules, interleaved in the same process. Rates are evaluations per "
             "second of wall time and of this process's CPU time.", "",
             "| checkpoint | scale | guidance evaluations | failed | rungs 9.5e-4 / 0.01 / 0.03 Eh | guidance /s "
             "(wall, CPU) | single points /s (wall, CPU) | ratio (wall, CPU) |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for label, r in results:
        n = max(r["force_evaluations"], 1)
        rungs = " / ".join(f"{100 * v / n:.0f} %" for v in r["rungs"].values())
        lines.append(f"| {label} | {r['scale']:g} | {r['force_evaluations']:,} | {r['failures']} "
                     f"({100 * r['failures'] / n:.2f} %) | {rungs} | {r['guided_wall']:.1f}, {r['guided_cpu']:.1f} | "
                     f"{r['single_wall']:.1f}, {r['single_cpu']:.1f} | {r['guided_wall'] / r['single_wall']:.2f}x, "
                     f"{r['guided_cpu'] / r['single_cpu']:.2f}x |")
    section = "\n".join(lines)
    publish_section(section, args.out, args.smoke, topic=TOPIC)


if __name__ == "__main__":
    main()

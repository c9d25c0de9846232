"""MLFF guidance: ANI-1x against GFN2-xTB as the guiding force field of `trainer sample`.

For each checkpoint (an early and a trained tiny EDM), one process, `trainer sample` as users run it (the
project's thread policy: OMP_NUM_THREADS is not set), the default sampling batch (32 molecules), T = 1000 with
632 guided steps:

1. `gfn2`: GFN2-xTB guidance (its worker pool) at the first scale of the guided sampling command
   (docs/families/molecules_edm.md): the baseline rate.
2. `ani1x, types=forcefield`: ANI-1x guidance (one network pushes, the default) with the atom types decoded
   among H C N O, at that command's three scales; the final molecules scored by GFN2-xTB (the strict check, a
   force field that did not guide) and by the ANI-1x ensemble (its own view and spread).
3. The same at the first scale with the ensemble mean pushing (`guidance_network: null`).
4. `ani1x, types=argmax`: the seed's type decoding; molecules holding an F on a step go to the GFN2 fallback.

Reported per set: guidance force evaluations per second (in the force field) and the set's sampling time,
with their ratios to `gfn2`; the GFN2-xTB force RMS of the final molecules (mean, standard error, median,
paired difference to the baseline) and atom stability against the unguided baseline of the same noise.

    python benchmarks/mlff_guidance.py --out BENCHMARKS.md                      # trains both checkpoints here
    python benchmarks/mlff_guidance.py --early RUN --trained RUN --out BENCHMARKS.md
    python benchmarks/mlff_guidance.py --smoke                                  # 2 molecules, T cut short
"""

from __future__ import annotations

import argparse
import json
import math
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
from guidance import train  # noqa: E402

TOPIC = "Molecules: guidance and force fields"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

SCALES = (0.0005, 0.0007, 0.008)
BIN = Path(sys.executable).parent


def sample(run_dir: Path, out: Path, molecules: int, scales: list[float], forcefield: str, extra: list[str]) -> dict:
    """`trainer sample` in a fresh process; its per-set rows and the final molecules' GFN2 force RMS values."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU figures
    cmd = [str(BIN / "trainer"), "sample", str(run_dir), f"num_samples={molecules}", f"batch_size={min(32, molecules)}",
           f"guidance.scales=[{','.join(map(str, scales))}]", f"guidance.forcefield={forcefield}",
           "evaluation_forcefield=gfn2", "chains=0", "progress=false", f"out={out}", *extra]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = {row["set"]: row for row in json.loads((out / "metrics.json").read_text())}
    for name, row in rows.items():
        row["rms"] = per_molecule(out / name / "molecules.extxyz", "force_rms")
        row["set_seconds"] = row["sampling_seconds_per_molecule"] * row["num_molecules"]
    rows["_wall"] = time.perf_counter() - started
    return rows


def per_molecule(path: Path, key: str) -> np.ndarray:
    import ase.io

    return np.array([float(atoms.info.get(key, math.nan)) for atoms in ase.io.iread(path, format="extxyz")])


def mean_se(values: np.ndarray) -> str:
    ok = values[np.isfinite(values)]
    if len(ok) < 2:
        return "-"
    return f"{ok.mean():.3g} ± {ok.std(ddof=1) / math.sqrt(len(ok)):.2g}"


def median(values: np.ndarray) -> str:
    ok = values[np.isfinite(values)]
    return f"{np.median(ok):.3g}" if len(ok) else "-"


def paired(guided: np.ndarray, base: np.ndarray) -> str:
    keep = np.isfinite(guided) & np.isfinite(base)
    d = guided[keep] - base[keep]
    if len(d) < 2:
        return "-"
    return f"{d.mean():+.3g} ± {d.std(ddof=1) / math.sqrt(len(d)):.2g} ({(d < 0).sum()}/{len(d)} lower)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--early", default=None, help="run directory of an early checkpoint (default: train 20 steps)")
    parser.add_argument("--trained", default=None, help="run directory of a trained checkpoint (default: train)")
    parser.add_argument("--train-steps", type=int, default=2500)
    parser.add_argument("--molecules", type=int, default=32, help="molecules per set (the default sampling batch)")
    parser.add_argument("--smoke", action="store_true", help="2 molecules, the early checkpoint, T = 1000 but the "
                        "guided phase cut to sigma_t <= 0.1; writes nothing")
    parser.add_argument("--out", default=None, help="write the section into this markdown file")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_mlff_"))
    load_start, started = os.getloadavg(), time.time()
    runs = {"early (20 steps)": Path(args.early) if args.early else train(work / "early", 20, work / "cache")}
    if not args.smoke:
        runs["trained"] = Path(args.trained) if args.trained else train(work / "trained", args.train_steps, work / "cache")
    molecules = 2 if args.smoke else args.molecules
    extra = ["guidance.noise_threshold=0.1"] if args.smoke else []
    lines, quality = [], []
    for label, run in runs.items():
        tag = label.split()[0]
        base = sample(run, work / f"{tag}_gfn2", molecules, [SCALES[0]], "gfn2", extra)
        fast = sample(run, work / f"{tag}_ani_ff", molecules, list(SCALES), "ani1x", [*extra, "guidance.types=forcefield"])
        mean = sample(run, work / f"{tag}_ani_mean", molecules, [SCALES[0]], "ani1x",
                      [*extra, "guidance.types=forcefield", "guidance.forcefield_kwargs={guidance_network: null}"])
        routed = sample(run, work / f"{tag}_ani_argmax", molecules, [SCALES[0]], "ani1x", [*extra, "guidance.types=argmax"])
        reference = base[f"guided_scale_{SCALES[0]:g}"]
        rate0, time0 = reference["guidance_evaluations_per_second"], reference["set_seconds"]
        lines.append(f"| {label} | gfn2 | {SCALES[0]:g} | {rate0:,.0f} | 1.00x | {time0:,.1f} | 1.00x | "
                     f"gfn2-xtb {reference.get('guidance_scored_gfn2-xtb', reference['guidance_force_evaluations']):,} |")
        for name, rows, scales in (("ani1x, types=forcefield", fast, SCALES),
                                   ("ani1x ensemble mean, types=forcefield", mean, SCALES[:1]),
                                   ("ani1x, types=argmax (fallback gfn2)", routed, SCALES[:1])):
            for scale in scales:
                row = rows[f"guided_scale_{scale:g}"]
                scored = ", ".join(f"{k.removeprefix('guidance_scored_')} {v:,}" for k, v in row.items()
                                   if k.startswith("guidance_scored_"))
                lines.append(f"| {label} | {name} | {scale:g} | {row['guidance_evaluations_per_second']:,.0f} | "
                             f"{row['guidance_evaluations_per_second'] / rate0:.2f}x | {row['set_seconds']:,.1f} | "
                             f"{time0 / row['set_seconds']:.2f}x | {scored} |")
        if tag == "early":  # its molecules are not molecules yet (GFN2 fails on most): speed only
            continue
        baseline = fast["baseline"]
        for name, row, ref in (("baseline", baseline, None), *((f"ani1x {s:g}", fast[f"guided_scale_{s:g}"], baseline)
                                                               for s in SCALES),
                               (f"ani1x ensemble mean {SCALES[0]:g}", mean[f"guided_scale_{SCALES[0]:g}"], mean["baseline"]),
                               (f"gfn2 {SCALES[0]:g}", base[f"guided_scale_{SCALES[0]:g}"], base["baseline"])):
            quality.append(f"| {label} | {name} | {mean_se(row['rms'])} | {median(row['rms'])} | "
                           f"{row.get('forcefield_failures', 0)} | {'-' if ref is None else paired(row['rms'], ref['rms'])} | "
                           f"{100 * row['atom_stability']:.1f} % | {100 * row['validity']:.1f} % | "
                           f"{row.get('mlff_force_rms_mean', math.nan):.3g} |")
    load_end = os.getloadavg()
    text = "\n".join([
        f"## MLFF guidance: ANI-1x against GFN2-xTB, {utc_now()}",
        "",
        f"Date: {utc_now()}. Machine: {cpu_model()}; load average {load_start[0]:.1f} at start, "
        f"{load_end[0]:.1f} at the end; {(time.time() - started) / 60:.1f} min in all. Command: `{command_line()}`. "
        f"One process per `trainer sample` (OMP_NUM_THREADS not set: the project's thread policy), {molecules} "
        "molecules per set in one batch, T = 1000 (632 guided steps), the final molecules scored by GFN2-xTB.",
        "",
        "Speed (evaluations per second inside the force field; the set's sampling time in seconds):",
        "",
        "| checkpoint | guidance | scale | evals/s | vs gfn2 | set s | vs gfn2 | scored by |",
        "|---|---|---|---|---|---|---|---|",
        *lines,
        "",
        "Quality of the final molecules of the trained checkpoint (GFN2-xTB force RMS in eV/Å, mean ± standard error "
        "over the molecules GFN2 scored, and how many it could not score; the paired difference to the baseline "
        "molecule from the same noise; ani1x with its default ZBL repulsion below 0.8 Å):",
        "",
        "| checkpoint | set | GFN2 force RMS | median | GFN2 failed | guided - baseline | atom stability | validity | "
        "ANI-1x force RMS |",
        "|---|---|---|---|---|---|---|---|---|",
        *quality,
    ])
    publish_section(text, args.out, args.smoke, topic=TOPIC)


if __name__ == "__main__":
    main()

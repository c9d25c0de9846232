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

`--rules`: instead, the guidance rules that keep strong guidance physical, on the trained checkpoint: for each
rule of `RULES` (its `guidance.*` settings) ANI-1x guidance at the three scales beside the unguided baseline of the
same noise (scale 0 is the baseline bit for bit, so it is each molecule's unguided twin). Reported per scale and
rule: how many final molecules GFN2-xTB scores, their mean GFN2-xTB force RMS and its paired difference to the
unguided twins (mean and standard error over the pairs both scored), validity, atom stability, the closest H-H
pair (median over the molecules: H2 is 0.74 Å, QM9's closest 1.61 Å) and the set's sampling time.

    python benchmarks/mlff_guidance.py --rules --trained RUN --out BENCHMARKS.md
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

SEED = ["guidance.displacement_clip=0", "guidance.hh_distance=0"]
RULES: dict[str, list[str]] = {
    "seed: (1 - sigma_t) F, no bound, no floor": SEED,
    "step bound 0.1 sigma_t": [*SEED, "guidance.step_bound=0.1"],
    "step bound 0.03 sigma_t": [*SEED, "guidance.step_bound=0.03"],
    "displacement clip 0.01 Å": ["guidance.hh_distance=0", "guidance.displacement_clip=0.01"],
    "floor 0.9 Å, all pairs (hold)": [*SEED, "guidance.min_distance=0.9", "guidance.floor_push=false"],
    "floor 0.9 Å, all pairs (push)": [*SEED, "guidance.min_distance=0.9"],
    "H-H floor 1.4 Å (hold)": ["guidance.displacement_clip=0", "guidance.floor_push=false"],
    "H-H floor 1.4 Å (push)": ["guidance.displacement_clip=0"],
    "floor 0.9 Å, H-H 1.4 Å (push)": ["guidance.displacement_clip=0", "guidance.min_distance=0.9"],
    "schedule fade": [*SEED, "guidance.schedule=fade"],
    "H-H floor 1.4 Å (push) + step bound 0.03 sigma_t": ["guidance.displacement_clip=0", "guidance.step_bound=0.03"],
    "H-H floor 1.4 Å (push) + step bound 0.01 sigma_t": ["guidance.displacement_clip=0", "guidance.step_bound=0.01"],
    "H-H floor 1.4 Å (push) + clip 0.01 Å": ["guidance.displacement_clip=0.01"],
    "H-H floor 1.4 Å (push) + clip 0.005 Å (the default)": [],
}
"""`--rules`: the candidate rules, as `trainer sample` settings."""
REUSED = " (`--reuse`: the sets read back from an earlier run's work folder, with that run's set times)"


def sample(run_dir: Path, out: Path, molecules: int, scales: list[float], forcefield: str, extra: list[str],
           threads: int | None = None, reuse: bool = False) -> dict:
    """`trainer sample` in a fresh process; its per-set rows and the final molecules' GFN2 force RMS values.
    `threads`: OMP_NUM_THREADS for it (None: unset, the project's thread policy); `reuse`: read back the sets a
    previous run left in `out` instead of sampling again."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU figures
    cmd = [str(BIN / "trainer"), "sample", str(run_dir), f"num_samples={molecules}", f"batch_size={min(32, molecules)}",
           f"guidance.scales=[{','.join(map(str, scales))}]", f"guidance.forcefield={forcefield}",
           "evaluation_forcefield=gfn2", "chains=0", "progress=false", f"out={out}", *extra]
    started = time.perf_counter()
    if not (reuse and (out / "metrics.json").is_file()):
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = {row["set"]: row for row in json.loads((out / "metrics.json").read_text())}
    for name, row in rows.items():
        row["rms"] = per_molecule(out / name / "molecules.extxyz", "force_rms")
        row["closest_hh"] = closest_pair(out / name / "molecules.extxyz", 1)
        row["set_seconds"] = row["sampling_seconds_per_molecule"] * row["num_molecules"]
    rows["_wall"] = time.perf_counter() - started
    return rows


def per_molecule(path: Path, key: str) -> np.ndarray:
    import ase.io

    return np.array([float(atoms.info.get(key, math.nan)) for atoms in ase.io.iread(path, format="extxyz")])


def closest_pair(path: Path, z: int) -> np.ndarray:
    """Per molecule the closest distance (Angstrom) between two atoms of element z (NaN: fewer than two)."""
    import ase.io

    out = []
    for atoms in ase.io.iread(path, format="extxyz"):
        picked = atoms.numbers == z
        d = atoms.get_all_distances()[np.ix_(picked, picked)]
        out.append(float(d[np.triu_indices(len(d), 1)].min()) if len(d) > 1 else math.nan)
    return np.array(out)


def rules_section(run: Path, work: Path, molecules: int, extra: list[str], threads: int | None,
                  rules: dict[str, list[str]], reuse: bool) -> list[str]:
    """`--rules`: the table lines per scale, every rule's sets from the same noise as its unguided twins."""
    results = {}
    for name, settings in rules.items():
        folder = "rule_" + ("_".join(setting.removeprefix("guidance.") for setting in settings).replace("=", "")
                            or "default")
        results[name] = sample(run, work / folder, molecules, list(SCALES), "ani1x", [*extra, *settings], threads,
                               reuse)
        print(name, {s: sum(np.isfinite(results[name][f"guided_scale_{s:g}"]["rms"])) for s in SCALES}, flush=True)
    lines = []
    for scale in SCALES:
        lines += ["", f"Scale {scale:g}:", "",
                  "| rule | GFN2 scored | GFN2 force RMS | guided - unguided twin | atom stability | validity | "
                  "closest H-H (median) | set s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, rows in results.items():
            row, twin = rows[f"guided_scale_{scale:g}"], rows["baseline"]
            scored = int(np.isfinite(row["rms"]).sum())
            lines.append(f"| {name} | {scored}/{len(row['rms'])} ({100 * scored / len(row['rms']):.0f} %) | "
                         f"{mean_se(row['rms'])} | {paired(row['rms'], twin['rms'])} | "
                         f"{100 * row['atom_stability']:.1f} % | {100 * row['validity']:.1f} % | "
                         f"{median(row['closest_hh'])} Å | {row['set_seconds']:,.1f} |")
    twin = next(iter(results.values()))["baseline"]
    lines += ["", f"Unguided twins (scale 0, the same in every run): GFN2 scored {int(np.isfinite(twin['rms']).sum())}/"
              f"{len(twin['rms'])}, force RMS {mean_se(twin['rms'])}, atom stability {100 * twin['atom_stability']:.1f} %, "
              f"validity {100 * twin['validity']:.1f} %, closest H-H {median(twin['closest_hh'])} Å, "
              f"set {twin['set_seconds']:,.1f} s."]
    return lines


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
    parser.add_argument("--rules", action="store_true", help="compare the guidance rules of RULES on the trained "
                        "checkpoint instead (with --smoke: the seed's rule and the default, 20 training steps)")
    parser.add_argument("--reuse", action="store_true", help="--rules: read back the sets a previous run left in "
                        "--work (its set times are that run's)")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each `trainer sample` "
                        "(default: unset, the project's thread policy)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_mlff_"))
    load_start, started = os.getloadavg(), time.time()
    if args.rules:
        if args.trained:
            run = Path(args.trained)
        else:  # a smoke run checks the plumbing: the early checkpoint is enough
            run = train(work / ("early" if args.smoke else "trained"), 20 if args.smoke else args.train_steps,
                        work / "cache")
        molecules = 2 if args.smoke else args.molecules
        extra = ["guidance.noise_threshold=0.1"] if args.smoke else []
        rules = dict([*RULES.items()][::len(RULES) - 1]) if args.smoke else RULES  # smoke: the seed's, the default
        lines = rules_section(run, work, molecules, extra, args.threads, rules, args.reuse)
        load_end = os.getloadavg()
        text = "\n".join([
            f"## Guidance rules: strong guidance stays physical, {utc_now()}",
            "",
            f"Machine: {cpu_model()}; load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at the end; "
            f"{(time.time() - started) / 60:.1f} min in all"
            f"{REUSED if args.reuse else ''}"
            f". Command: `{command_line()}`. One `trainer sample` per "
            f"rule ({molecules} molecules per set in one batch, T = 1000, 632 guided steps, ANI-1x guidance with "
            "`types=auto`, the final molecules scored by GFN2-xTB), every rule's sets from the same noise, so each "
            "guided molecule is paired with its unguided twin. GFN2 force RMS in eV/Å, mean ± standard error over the "
            "molecules GFN2-xTB scores; the paired difference over the pairs it scores both of.",
            *lines,
        ])
        publish_section(text, args.out, args.smoke, topic=TOPIC)
        return
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

"""Force-field alignment (`trainer align`) of the tiny EDM: fresh samples before and after, from the same noise.

1. The model to align: `--source RUN_DIR`, or `trainer train configs/molecules_edm/edm_tiny.yaml` by the script.
2. Its samples: `trainer sample` of `--samples` molecules at sampling seed `--seed`, scored by GFN2-xTB (`force_rms`,
   an oracle the alignment never saw) and by ANI-1x (`mlff_force_rms`, the reward), plus EDM's validity, stability
   and uniqueness. Drawn and scored once (kept in `--work/start`, reused by a later call with the same source, seed
   and scoring when it holds at least as many molecules) and compared with every aligned model.
3. Per alignment seed (`--seeds`: the alignment run's `run.seed`): `trainer align SOURCE` with its preset plus the
   `--align KEY=VALUE` overrides, timed in CPU-seconds (getrusage of the child: a paused or shared machine does not
   change them), then `trainer sample` of the aligned model at the same sampling seed: sample k of every model
   starts from the same noise.
4. Paired differences aligned - start (`paired.pair_sets` / `paired.compare_paired`, by `sample_index`): the mean
   force RMS difference under each force field with its standard error, over the pairs scored on both sides (the
   others counted by reason); validity, molecule and atom stability and uniqueness with their 95 % intervals.

Targets, per alignment seed: the force RMS lower than the start's by at least `TARGET_SE` standard errors under
GFN2-xTB and under ANI-1x; validity and atom stability not lower (the paired difference >= 0); uniqueness within
`UNIQUENESS_POINTS` points of the start's. `--tag` names the setting's folder under `--work`, so settings tried one
after another share the start's samples; an alignment (same source, seed and overrides) or a set of molecules (same
model, sampling seed and scoring, at least as many) already under `--work` is reused with its recorded cost, so a
rerun with more molecules or more seeds only computes what it lacks.
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from bench_report import command_line, cpu_model, publish_section, utc_now

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.families.molecules_edm.forcefields.base import closest_pair_distance  # noqa: E402
from trainer.families.molecules_edm.paired import (  # noqa: E402
    Comparison,
    MeanDifference,
    compare_paired,
    pair_sets,
    paired_mean_difference,
)

TOPIC = "Molecules: alignment"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

TINY = str(ROOT / "configs" / "molecules_edm" / "edm_tiny.yaml")
TARGET_SE = 3.0
"""A force target is met when the aligned - start difference is at most minus this many standard errors."""
UNIQUENESS_POINTS = 5.0
"""The uniqueness target: aligned - start within this many percentage points either way."""
SAMPLE_BATCH = 32
"""Molecules sampled together: a fixed block size, so the first N molecules of a larger set are an N-molecule set."""
FORCE_FIELDS = (("gfn2", "GFN2-xTB (not the reward)", ""), ("ani1x", "ANI-1x (the reward)", "mlff_"))
"""(key, label, prefix of its per-molecule values in `trainer sample`'s extxyz) of each scoring force field."""
SMOKE_FORCE_FIELDS = (("springs", "springs (smoke)", ""),)


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


def read_set(samples: Path, limit: int) -> list[dict[str, Any]]:
    """The molecules `trainer sample` wrote into the baseline set's extxyz (info plus `num_atoms`) with a sample
    index below `limit`, in index order."""
    from ase.io import iread

    out = []
    for atoms in iread(str(samples / "baseline" / "molecules.extxyz"), index=":"):
        info = dict(atoms.info)
        if int(info["sample_index"]) >= limit:
            continue
        if isinstance(info.get("smiles"), bool):  # ASE reads the one-letter SMILES T / F as booleans
            info["smiles"] = "T" if info["smiles"] else "F"
        info["num_atoms"] = len(atoms)
        info["closest_pair"] = float(closest_pair_distance(torch.as_tensor(atoms.positions)[None],
                                                           torch.ones(1, len(atoms), dtype=torch.bool))[0])
        out.append(info)
    return sorted(out, key=lambda m: int(m["sample_index"]))


def rows_for(molecules: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]] | None:
    """`compare_paired`'s per-molecule rows with the force values of the force field whose keys start with `prefix`
    (None when that force field did not score the set)."""
    if not molecules or any(prefix + "forcefield_ok" not in m for m in molecules):
        return None
    rows = []
    for m in molecules:
        row = {k: m.get(k) for k in ("valid", "stable", "num_stable_atoms", "num_atoms")}
        row["smiles"] = m.get("smiles") if m.get("valid") else None
        for key in ("forcefield_ok", "force_rms", "energy_per_atom", "forcefield_unsupported"):
            if prefix + key in m:
                row[key] = m[prefix + key]
        rows.append(row)
    return rows


def compare(start: list[dict[str, Any]], aligned: list[dict[str, Any]], fields: tuple) -> dict[str, Comparison]:
    """Aligned (A) - start (B), paired by `sample_index`, per force field of `fields` that scored both sets."""
    pairing = pair_sets(aligned, start, [m["num_atoms"] for m in aligned], [m["num_atoms"] for m in start],
                        "aligned", "start")
    out = {}
    for key, _label, prefix in fields:
        rows_a, rows_b = rows_for(aligned, prefix), rows_for(start, prefix)
        if rows_a is not None and rows_b is not None:
            out[key] = compare_paired(rows_a, rows_b, pairing)
    if not out:  # no force field: the rates alone
        strip = [{k: m.get(k) for k in ("valid", "stable", "num_stable_atoms", "num_atoms", "smiles")} for m in aligned]
        base = [{k: m.get(k) for k in ("valid", "stable", "num_stable_atoms", "num_atoms", "smiles")} for m in start]
        out["none"] = compare_paired(strip, base, pairing)
    return out


def log_difference(start: list[dict[str, Any]], aligned: list[dict[str, Any]], prefix: str) -> MeanDifference:
    """Aligned - start of log10 force RMS over the pairs (by `sample_index`) scored on both sides: the typical
    molecule's change, which the mean of a heavy-tailed force RMS hides."""
    by_index = {int(m["sample_index"]): m for m in start}
    a, b = [], []
    for m in aligned:
        other = by_index.get(int(m["sample_index"]))
        values = [float(x.get(prefix + "force_rms", math.nan)) for x in (m, other or {})]
        if other is not None and m.get(prefix + "forcefield_ok") and other.get(prefix + "forcefield_ok") and all(
                math.isfinite(v) and v > 0 for v in values):
            a.append(math.log10(values[0]))
            b.append(math.log10(values[1]))
    return paired_mean_difference(a, b)


def summarize(molecules: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """Mean, median and count of the force RMS a force field scored, and the molecules it left out."""
    values = np.array([float(m[prefix + "force_rms"]) for m in molecules
                       if m.get(prefix + "forcefield_ok") and math.isfinite(float(m.get(prefix + "force_rms", math.nan)))])
    return {"scored": int(len(values)), "left_out": len(molecules) - int(len(values)),
            "mean": float(values.mean()) if len(values) else math.nan,
            "median": float(np.median(values)) if len(values) else math.nan}


CLOSE_PAIR = 0.8
"""Angstrom: `force_target_reach`'s repair reaches the molecules with a pair closer than this."""


def force_target_reach(start: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """The paired force figure (aligned - start over SE) two kinds of improvement would reach on the start set, with
    no other change in the pairs: `scaled`, every molecule's force RMS times one factor below 1 (a change uniform on
    the log scale), which gives -sqrt(n) mean / sd whatever the factor, so a heavy-tailed set caps it; `repaired`,
    only the `close` molecules with two atoms closer than `CLOSE_PAIR` brought to the set's median (how far removing
    the near-clashes alone goes)."""
    scored = [m for m in start if m.get(prefix + "forcefield_ok")
              and math.isfinite(float(m.get(prefix + "force_rms", math.nan)))]
    values = np.array([float(m[prefix + "force_rms"]) for m in scored])
    if len(values) < 2 or values.std(ddof=1) == 0:
        return {"scaled": math.nan, "repaired": math.nan, "close": 0}
    close = np.array([float(m.get("closest_pair", math.inf)) < CLOSE_PAIR for m in scored])
    repair = np.where(close, np.minimum(np.median(values) - values, 0.0), 0.0)
    spread = repair.std(ddof=1)
    return {"scaled": float(-math.sqrt(len(values)) * values.mean() / values.std(ddof=1)),
            "repaired": float(math.sqrt(len(values)) * repair.mean() / spread) if spread > 0 else math.nan,
            "close": int(close.sum())}


def cached_samples(run: Path, folder: Path, samples: int, seed: int, evaluation: list[str]) -> tuple[list[dict], dict]:
    """`samples` molecules of `run` at sampling seed `seed`, scored, in `folder`: drawn once and reused by a later
    call while the run, seed and scoring match and enough molecules are kept (the first N of a larger set drawn in
    blocks of `SAMPLE_BATCH` are the N-molecule set); with a record of when and at what cost they were drawn."""
    meta_path = folder / "samples_meta.json"
    key = {"run": str(run.resolve()), "seed": seed, "evaluation": evaluation, "batch_size": SAMPLE_BATCH}
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    if (meta is None or meta["key"] != key or meta["samples"] < samples
            or (samples % SAMPLE_BATCH and meta["samples"] != samples)):
        folder.mkdir(parents=True, exist_ok=True)
        meta_path.unlink(missing_ok=True)
        wall, cpu = trainer("sample", str(run), f"num_samples={samples}", f"seed={seed}", f"batch_size={SAMPLE_BATCH}",
                            *evaluation, "chains=0", "progress=false", f"out={folder / 'samples'}",
                            log=folder / "sample.log")
        meta = {"key": key, "samples": samples, "wall_s": wall, "cpu_s": cpu, "drawn": utc_now()}
        meta_path.write_text(json.dumps(meta, indent=1))
    return read_set(folder / "samples", samples), meta


def align_records(aligned: Path) -> dict[str, Any]:
    """What the alignment run did, from its config.yaml and metrics.jsonl."""
    config = yaml.safe_load((aligned / "config.yaml").read_text())
    records = [json.loads(line) for line in (aligned / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "reward_mean" in r]
    tenth = max(1, len(train) // 10)
    groups = config["train"]["per_device_batch_size"] * config["train"].get("grad_accum_steps", 1)
    return {"steps": config["train"]["max_steps"], "groups": groups, "group_size": config["task"]["group_size"],
            "task": config["task"], "lr": config["optim"]["lr"],
            "force_evaluations": int(round(sum(r.get("force_evals_per_group", 0.0) for r in train) * groups)),
            "reward_rms_first": float(np.mean([r["force_rms_mean"] for r in train[:tenth]])),
            "reward_rms_last": float(np.mean([r["force_rms_mean"] for r in train[-tenth:]])),
            "kl_last": float(np.mean([r["kl"] for r in train[-tenth:]])),
            "excluded": float(np.mean([r["excluded_fraction"] for r in train])),
            "clash": float(np.mean([r.get("clash_fraction", 0.0) for r in train]))}


def verdicts(comparisons: dict[str, Comparison], fields: tuple) -> dict[str, tuple[bool, str]]:
    """Target -> (met, the figure that decides it)."""
    out: dict[str, tuple[bool, str]] = {}
    for key, label, _prefix in fields:
        if key in comparisons:
            d = comparisons[key].forces["force_rms"]
            ratio = se_ratio(d.difference, d.se)
            out[f"{label.split(' (')[0]} force RMS lower by >= {TARGET_SE:g} SE"] = (
                bool(ratio <= -TARGET_SE), f"{d.difference:+.2f} ± {d.se:.2f} eV/Å = {ratio:+.2f} SE")
    rates = next(iter(comparisons.values())).rates
    for key in ("validity", "atom_stability"):
        r = rates[key]
        out[f"{key.replace('_', ' ')} not lower"] = (
            bool(r.difference >= 0), f"{100 * r.difference:+.2f} points [{100 * r.low:+.1f}, {100 * r.high:+.1f}]")
    u = rates["uniqueness"]
    out[f"uniqueness within {UNIQUENESS_POINTS:g} points"] = (
        bool(abs(100 * u.difference) <= UNIQUENESS_POINTS),
        f"{100 * u.difference:+.2f} points [{100 * u.low:+.1f}, {100 * u.high:+.1f}]")
    return out


def run_seed(source: Path, folder: Path, seed: int, align_extra: list[str], samples: int, sample_seed: int,
             evaluation: list[str]) -> dict[str, Any]:
    """Align at `seed` (an alignment of the same source, seed and overrides already in `folder` is reused, its
    recorded cost with it), sample the aligned model; its molecules and the alignment's record and cost."""
    folder.mkdir(parents=True, exist_ok=True)
    aligned, record_path = folder / "aligned", folder / "record.json"
    key = {"source": str(source.resolve()), "seed": seed, "align": align_extra}
    record = json.loads(record_path.read_text()) if record_path.is_file() else None
    if record is None or record["key"] != key:
        record_path.unlink(missing_ok=True)
        wall, cpu = trainer("align", str(source), f"out={aligned}", "run.resume=none", "log.progress_bar=false",
                            f"run.seed={seed}", *align_extra, log=folder / "align.log")
        record = {"key": key, "seed": seed, "align_wall_s": wall, "align_cpu_s": cpu, "aligned": utc_now(),
                  **align_records(aligned)}
        record_path.write_text(json.dumps(record, indent=1))
    molecules, meta = cached_samples(aligned, folder, samples, sample_seed, evaluation)
    return {"record": {**record, "sample_cpu_s": meta["cpu_s"], "sampled": meta["samples"]}, "molecules": molecules}


def se_ratio(difference: float, se: float) -> float:
    """The difference in standard errors (NaN where the standard error is 0 or undefined)."""
    return difference / se if se and math.isfinite(se) else math.nan


def pct(rate: float) -> str:
    return f"{100 * rate:.1f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=None, help="a trained molecules run (default: train edm_tiny.yaml)")
    parser.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--samples", type=int, default=256, help="molecules sampled from each model")
    parser.add_argument("--seed", type=int, default=1, help="sampling seed (the same noise for every model)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="alignment seeds (the alignment run's run.seed), one alignment each")
    parser.add_argument("--align", action="append", default=[], help="an override of `trainer align` (repeatable)")
    parser.add_argument("--tag", default="preset", help="the setting's folder under --work")
    parser.add_argument("--out", default=None, help="write the section into this BENCHMARKS.md")
    parser.add_argument("--smoke", action="store_true",
                        help="T = 20, 2 training steps, 2 alignment steps with springs as the reward, 4 molecules, "
                             "2 alignment seeds; nothing written")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_align_"))
    work.mkdir(parents=True, exist_ok=True)
    source = Path(args.source) if args.source else work / "edm_tiny"
    # GFN2-xTB in one worker: the process is the one CPU-heavy job, whatever the machine's core count.
    train_extra, align_extra = [], list(args.align)
    evaluation = ["evaluation_forcefield=gfn2", "evaluation_forcefield_kwargs.workers=1", "evaluation_mlff=ani1x"]
    if args.smoke:
        train_extra = ["task.timesteps=20", "train.max_steps=2", "train.epochs=0", "eval.every_epochs=0",
                       "eval.sample_every=0", "task.val_fraction=0.01", "task.test_fraction=0", f"task.cache_dir={work}"]
        align_extra = ["train.max_steps=2", "task.group_size=3", "train.per_device_batch_size=2", "task.trained_steps=8",
                       "task.transitions=2", "task.reward_forcefield=springs", "task.reward_forcefield_kwargs.cutoff=1e4",
                       "eval.sample_every=0", *align_extra]
        evaluation = ["evaluation_forcefield=springs", "evaluation_mlff=none"]
        args.samples = 4
        args.seeds = [0, 1]
    fields = SMOKE_FORCE_FIELDS if args.smoke else FORCE_FIELDS
    train_time = None
    if not args.source:
        train_time = trainer("train", TINY, f"run.output_dir={source}", "log.progress_bar=false", *train_extra,
                             log=work / "train.log")
    start, start_meta = cached_samples(source, work / "start", args.samples, args.seed, evaluation)

    results = {}
    for seed in args.seeds:
        run = run_seed(source, work / args.tag / f"seed{seed}", seed, align_extra, args.samples, args.seed, evaluation)
        comparisons = compare(start, run["molecules"], fields)
        results[seed] = {**run, "comparisons": comparisons, "verdicts": verdicts(comparisons, fields)}
    reaches = {key: force_target_reach(start, prefix) for key, _l, prefix in fields}
    summary = {"source": str(source), "samples": args.samples, "sample_seed": args.seed, "align": args.align,
               "start": {"meta": start_meta, "force_target_reach": reaches,
                         **{key: summarize(start, prefix) for key, _l, prefix in fields}},
               "seeds": {seed: {"record": r["record"], "verdicts": r["verdicts"],
                                "aligned": {key: summarize(r["molecules"], prefix) for key, _l, prefix in fields},
                                "comparisons": {k: c.as_dict() for k, c in r["comparisons"].items()},
                                "log10_force_rms": {key: asdict(log_difference(start, r["molecules"], prefix))
                                                    for key, _l, prefix in fields}}
                         for seed, r in results.items()}}
    (work / args.tag).mkdir(parents=True, exist_ok=True)
    (work / args.tag / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    publish_section(section(args, source, start, start_meta, reaches, results, fields, train_time), args.out,
                    smoke=args.smoke, topic=TOPIC)


def section(args: argparse.Namespace, source: Path, start: list[dict], start_meta: dict, reaches: dict, results: dict,
            fields: tuple, train_time: tuple[float, float] | None) -> str:
    """The markdown section: the start's set, per seed the paired force differences, the rates, the verdicts and
    the cost."""
    first = next(iter(results.values()))
    rec = first["record"]
    task = rec["task"]
    rates0 = next(iter(first["comparisons"].values())).rates
    settings = (f"{rec['steps']} iterations of {rec['groups']} groups x {rec['group_size']} rollouts, lr {rec['lr']:g}, "
                f"{task['transitions']} transitions a rollout, reward {task['force_reward']} x {task['force_weight']:g}"
                f" + stability {task['stability_weight']:g}"
                + (f" - close pairs {task['close_pair_weight']:g} (from {task['close_pair_distance']:g} Å)"
                   if task.get("close_pair_weight") else "")
                + f", KL weight {task['kl_weight']:g}, ppo_epochs "
                f"{task['ppo_epochs']}, shaping weight {task['shaping_weight']:g}"
                + (f" ({task['shaping_potential']} potential, gamma {task['shaping_gamma']:g})"
                   if task["shaping_weight"] else ""))
    lines = [f"## Force-field alignment (trainer align), {utc_now()}", "",
             f"Machine: {cpu_model()}, CPU only. Command: `{command_line()}`.", "",
             f"The model `{source}`{' (edm_tiny.yaml, trained by the script)' if train_time else ''} aligned with "
             f"`trainer align` at its preset{' plus `' + ' '.join(args.align) + '`' if args.align else ''}: "
             f"{settings}; alignment seeds (run.seed) {', '.join(str(s) for s in results)}. "
             f"{args.samples} molecules from the start model and from each aligned model with `trainer sample "
             f"seed={args.seed}` (sample k of every model from the same noise), scored by "
             f"{' and '.join(label.split(' (')[0] for _k, label, _p in fields)}; the start's set drawn and scored "
             f"once. Differences are aligned - start over the pairs (`paired.py`); force RMS in eV/Å, ± one "
             f"standard error, 95 % intervals in brackets.", ""]
    lines += ["| start model | validity | atom stability | molecule stability | uniqueness | "
              + " | ".join(f"{label.split(' (')[0]} force RMS mean / median (scored)" for _k, label, _p in fields)
              + " |", "|---|---|---|---|---|" + "---|" * len(fields)]
    s = {key: summarize(start, prefix) for key, _l, prefix in fields}
    lines.append(f"| {args.samples} molecules, seed {args.seed} | {pct(rates0['validity'].b)} | "
                 f"{pct(rates0['atom_stability'].b)} | {pct(rates0['molecule_stability'].b)} | "
                 f"{pct(rates0['uniqueness'].b)} | "
                 + " | ".join(f"{s[k]['mean']:.2f} / {s[k]['median']:.2f} ({s[k]['scored']})" for k, _l, _p in fields)
                 + " |")
    lines += ["", "What two kinds of improvement would reach on this start set, with nothing else changing "
              "(`force_target_reach`): "
              + "; ".join(f"{label.split(' (')[0]}: {reaches[key]['scaled']:+.2f} SE if every molecule's force RMS "
                          f"fell by one factor (any factor), {reaches[key]['repaired']:+.2f} SE if its "
                          f"{reaches[key]['close']} molecules with a pair under {CLOSE_PAIR:g} Å came to the median"
                          for key, label, _p in fields) + "."]
    lines += ["", "| seed | force field | start mean | aligned mean | aligned - start | / SE | 95 % interval | "
              "aligned lower / higher | pairs left out | median start -> aligned | log10 aligned - start (/ SE) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for seed, r in results.items():
        for key, label, prefix in fields:
            if key not in r["comparisons"]:
                continue
            d = r["comparisons"][key].forces["force_rms"]
            left = r["comparisons"][key].forces_left_out["force_rms"]
            left_text = ", ".join(f"{reason} {n}" for reason, n in left.items()) or "none"
            after = summarize(r["molecules"], prefix)
            g = log_difference(start, r["molecules"], prefix)
            lines.append(f"| {seed} | {label} | {d.mean_b:.2f} | {d.mean_a:.2f} | {d.difference:+.2f} ± {d.se:.2f} | "
                         f"{se_ratio(d.difference, d.se):+.2f} | [{d.low:+.2f}, {d.high:+.2f}] | {d.lower} / {d.higher} | "
                         f"{left_text} | {s[key]['median']:.2f} -> {after['median']:.2f} | "
                         f"{g.difference:+.3f} ± {g.se:.3f} ({se_ratio(g.difference, g.se):+.2f}) |")
    lines += ["", "| seed | validity | atom stability | molecule stability | uniqueness |", "|---|---|---|---|---|"]
    for seed, r in results.items():
        rates = next(iter(r["comparisons"].values())).rates
        cells = [f"{pct(rates[k].b)} -> {pct(rates[k].a)}: {100 * rates[k].difference:+.1f} "
                 f"[{100 * rates[k].low:+.1f}, {100 * rates[k].high:+.1f}]"
                 for k in ("validity", "atom_stability", "molecule_stability", "uniqueness")]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    targets = list(first["verdicts"])
    lines += ["", "| target | " + " | ".join(f"seed {seed}" for seed in results) + " |",
              "|---|" + "---|" * len(results)]
    for target in targets:
        cells = []
        for r in results.values():
            met, figure = r["verdicts"][target]
            cells.append(f"{'met' if met else '**NOT met**'}: {figure}")
        lines.append(f"| {target} | " + " | ".join(cells) + " |")
    lines += ["", "| seed | alignment CPU-s | CPU-s / iteration | wall | force evaluations (per iteration) | rollouts' "
              "force RMS under the reward, first -> last tenth | KL at the end | rollouts excluded / clashing | aligned "
              "model's molecules drawn and scored (CPU-s) | aligned at |", "|---|---|---|---|---|---|---|---|---|---|"]
    for seed, r in results.items():
        rec = r["record"]
        evaluations = rec["force_evaluations"]
        lines.append(f"| {seed} | {rec['align_cpu_s']:.0f} | {rec['align_cpu_s'] / rec['steps']:.1f} | "
                     f"{rec['align_wall_s']:.0f} s | {evaluations:,} ({evaluations / rec['steps']:.0f}) | "
                     f"{rec['reward_rms_first']:.2f} -> {rec['reward_rms_last']:.2f} | {rec['kl_last']:.3g} | "
                     f"{100 * rec['excluded']:.1f} % / {100 * rec['clash']:.1f} % | {rec['sampled']} ({rec['sample_cpu_s']:.0f}) "
                     f"| {rec['aligned']} |")
    lines += ["", f"CPU-s: user + system of the `trainer align` process (start-up, the final evaluation and its "
              f"samples included), per optimizer step. The start's {start_meta['samples']} molecules took "
              f"{start_meta['cpu_s']:.0f} CPU-s to draw and score (drawn {start_meta['drawn']}); the first "
              f"{args.samples} are compared. An alignment or a set of molecules already in `--work` for the same "
              f"source, seeds and overrides is reused with its recorded cost (its date says when it ran)."]
    if train_time:
        lines.append(f"Training the tiny checkpoint took {train_time[0]:.0f} s wall, {train_time[1]:.0f} CPU-s.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

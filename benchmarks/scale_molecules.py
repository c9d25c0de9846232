"""The molecules (EDM) data path at GEOM-Drugs-like sizes: what the build and a rank cost as N conformers and the
number of processes W grow. Shares `scale.py`'s process watcher, table and extrapolation.

For each N (`--sizes`, conformers): a GEOM-like `drugs_crude.msgpack` (`write_geom_like`: 25-50 heavy atoms with
their hydrogens, `--per-molecule` conformers each, maps of 1,000 molecules as the public file), then

  build         `build_geom_dataset` in a fresh process with num_proc = 1 (`--serial-sizes` only: one process's
                rate) and num_proc = the cores: wall time, conformers/s, the peak RSS of any of its processes
  cached load   the same call again (a cache hit): what every later start pays

and for each W (`--worlds`), real launches of `trainer train CONFIG --nproc W` (gloo on CPU, the `tiny` EGNN, the
16 GEOM-Drugs elements, the cache built): launch to the first step's record in metrics.jsonl, each rank's peak RSS
(VmHWM) and peak private memory (RssAnon: without the page-cache pages of the memory-mapped shards).

Then the cost per doubling of N and a power-law extrapolation to GEOM-Drugs' ~9 M conformers (EDM's 30 per molecule;
extrapolated, not measured). Prints markdown; `--out FILE` files it (`bench_report`).

`--per-row N ...` (alone) measures instead what one training rank keeps per training row at start-up, with no GEOM
build: per N, one process writes synthetic molecule shards of N rows (small molecules, one SMILES per 30 rows), a
fresh one does `build_data`'s steps after the build (load the cache, EDM's split, the selections, the training SMILES, the
node-count histogram, the rows) and the default (fixed) batch sampler's first batch: per step what stays (after
gc: numpy and Python by tracemalloc, Arrow by its pool) and the traced peak, in total the kept MiB and the growth
of the private memory (RssAnon), and the bytes a training row (the slope from the smallest to the largest N).
`--code DIR` measures the `trainer` of another checkout (e.g. a `git worktree` of HEAD: the before figures).

    .venv/bin/python benchmarks/scale_molecules.py --sizes 100000 200000 400000 --worlds 1 2 --workdir /tmp/scale54/molecules
    .venv/bin/python benchmarks/scale_molecules.py --smoke
    .venv/bin/python benchmarks/scale_molecules.py --per-row 100000 1020000 --out BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_report import command_line, cpu_model, publish_section, utc_now  # noqa: E402
from scale import TRAINER, check, doubling_ratios, first_step_s, log, power_law, table, watch  # noqa: E402

TOPIC = "Data ingest and streaming"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""
GEOM_DRUGS_CONFORMERS = 9_000_000
"""EDM's GEOM-Drugs rows: ~304 k molecules x up to 30 conformers (the upper bound; est.)."""
HEAVY = np.array([6, 7, 8, 9, 16, 17, 35])
"""Heavy elements of the generator: C N O F S Cl Br."""
HEAVY_P = np.array([0.72, 0.12, 0.11, 0.02, 0.015, 0.01, 0.005])
VALENCE_H = {6: 1.3, 7: 0.7, 8: 0.3, 9: 0.0, 16: 0.2, 17: 0.0, 35: 0.0}
"""Mean hydrogens per heavy atom of each element (drug-like molecules)."""


def write_geom_like(path: str | Path, conformers: int, *, per_molecule: int = 30, seed: int = 0,
                    molecules_per_map: int = 1000) -> Path:
    """A `drugs_crude.msgpack`-shaped file of `conformers` conformers: molecules of 25-50 heavy atoms (C N O F S
    Cl Br, drug-like shares) with their hydrogens, `per_molecule` conformers each (a chain of bonded heavy atoms,
    H 1.1 Angstrom from their atom, each conformer the molecule's geometry with 0.05 Angstrom noise), a
    `totalenergy` and `boltzmannweight` per conformer, maps of `molecules_per_map` molecules."""
    import msgpack

    rng = np.random.default_rng(seed)
    path = Path(path)
    molecules = max(1, conformers // per_molecule)
    with open(path, "wb") as f:
        block: dict[str, Any] = {}
        for m in range(molecules):
            heavy = rng.choice(HEAVY, size=int(rng.integers(25, 51)), p=HEAVY_P)
            steps = rng.normal(size=(len(heavy), 3))
            steps *= 1.5 / np.linalg.norm(steps, axis=1, keepdims=True)
            xyz_heavy = np.cumsum(steps, axis=0)
            nh = rng.poisson([VALENCE_H[int(z)] for z in heavy])
            owner = np.repeat(np.arange(len(heavy)), nh)
            d = rng.normal(size=(len(owner), 3))
            xyz_h = xyz_heavy[owner] + 1.1 * d / np.linalg.norm(d, axis=1, keepdims=True)
            z = np.concatenate([heavy, np.ones(len(owner), dtype=np.int64)]).astype(np.float64)
            base = np.vstack([xyz_heavy, xyz_h])
            count = per_molecule if m < molecules - 1 else conformers - per_molecule * (molecules - 1)
            energies = rng.normal(-1000.0, 1.0, size=max(count, 1))
            weights = np.exp(-(energies - energies.min()))
            confs = []
            for k in range(max(count, 1)):
                xyz = np.column_stack([z, base + rng.normal(0, 0.05, size=base.shape)])
                confs.append({"xyz": xyz.round(4).tolist(), "totalenergy": float(energies[k]),
                              "boltzmannweight": float(weights[k] / weights.sum()), "setsize": count})
            block[f"GEOMLIKE{m}"] = {"conformers": confs, "totalconfs": count, "charge": 0}
            if len(block) == molecules_per_map:
                f.write(msgpack.packb(block, use_bin_type=True))
                block = {}
        if block:
            f.write(msgpack.packb(block, use_bin_type=True))
    return path


BUILD_CHILD = r"""
import json, os, resource, sys, time
from trainer.families.molecules_edm.geom import build_geom_dataset
from trainer.families.molecules_edm.dataset import MoleculeRows
path, cache, num_proc = sys.argv[1], sys.argv[2], int(sys.argv[3])
def cpu(who):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime
if __name__ == "__main__":
    self0, kids0, t0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    ds = build_geom_dataset(path, cache_dir=cache, num_proc=num_proc)
    took = time.perf_counter() - t0
    print(json.dumps({"seconds": took, "rows": len(ds), "hit": ds.cache_hit, "molecules": ds.geom_molecules,
                      "atoms": int(MoleculeRows(ds).num_atoms.sum()), "parent_cpu_s": cpu(resource.RUSAGE_SELF) - self0,
                      "workers_cpu_s": cpu(resource.RUSAGE_CHILDREN) - kids0, "shards": len(ds.cache_files),
                      "load": os.getloadavg()[0]}))
"""


def build(path: Path, cache: Path, num_proc: int) -> dict[str, Any]:
    """One `build_geom_dataset` call in a fresh process: its own timing, and the peak RSS of its processes."""
    w = check(watch([sys.executable, "-c", BUILD_CHILD, str(path), str(cache), str(num_proc)],
                    env={"OMP_NUM_THREADS": "1"}), f"build_geom_dataset(num_proc={num_proc})")
    out = json.loads(w.output.strip().splitlines()[-1])
    return {**out, "wall_s": w.wall_s, "peak_MiB": w.any_peak_mib}


def amdahl(serial_cpu_s: float, one_process_cpu_s: float, processes: int) -> tuple[float, float]:
    """(s, bound): the serial fraction s of the work (the parent's CPU time during a parallel build over one
    process's CPU time for the whole build: CPU times, so the machine's load does not change them) and Amdahl's
    bound 1 / (s + (1 - s) / P) on the speed-up with P processes."""
    s = serial_cpu_s / one_process_cpu_s if one_process_cpu_s > 0 else float("nan")
    return s, 1.0 / (s + (1.0 - s) / processes)


def overrides(a: argparse.Namespace, data: Path) -> list[str]:
    from trainer.families.molecules_edm.geom import GEOM_DRUGS_ELEMENTS

    return [f"task.data_path={data}", f"task.cache_dir={a.workdir / 'cache'}",
            f"task.elements=[{','.join(GEOM_DRUGS_ELEMENTS)}]", "task.model_preset=tiny",
            f"train.per_device_batch_size={a.batch}", "train.grad_accum_steps=1", "train.mixed_precision=no",
            "task.test_fraction=0.0", "optim.warmup_steps=1", f"data.num_workers={a.num_workers}",
            "eval.max_samples=64", "eval.batch_size=32", "eval.sample_every=0", "log.every_steps=1",
            "log.progress_bar=false", "log.tensorboard=false"]


def measure_size(a: argparse.Namespace, n: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    data = a.workdir / f"geom_like_{n}.msgpack"
    t0 = time.perf_counter()
    if a.reuse and data.is_file():  # generated earlier (a 2 M file takes minutes): the generator is seeded
        gen_s = float("nan")
    else:
        write_geom_like(data, n, per_molecule=a.per_molecule)
        gen_s = time.perf_counter() - t0
    row: dict[str, Any] = {"N": n, "gen_s": gen_s, "MiB": data.stat().st_size / 2**20}
    cores = len(os.sched_getaffinity(0))
    if n in a.serial_sizes:
        one = build(data, a.workdir / "cache_serial", 1)
        row["serial_s"], row["serial_rate"] = one["seconds"], one["rows"] / one["seconds"]
        row["serial_cpu_s"], row["serial_load"] = one["parent_cpu_s"], one["load"]
        shutil.rmtree(a.workdir / "cache_serial", ignore_errors=True)
    par = build(data, a.workdir / "cache", cores)
    again = build(data, a.workdir / "cache", cores)
    row.update({"rows": par["rows"], "atoms": par["atoms"], "build_s": par["seconds"],
                "build_rate": par["rows"] / par["seconds"], "build_peak_MiB": par["peak_MiB"],
                "cached_s": again["seconds"], "cores": cores, "shards": par["shards"],
                "parent_cpu_s": par["parent_cpu_s"], "workers_cpu_s": par["workers_cpu_s"], "load": par["load"]})
    if "serial_rate" in row:
        row["speedup"] = row["build_rate"] / row["serial_rate"]
        row["s"], row["amdahl"] = amdahl(par["parent_cpu_s"], one["parent_cpu_s"], cores)
        # the workers' own start (spawn, imports) and any per-shard cost: work one process does not do
        row["cpu_ratio"] = (par["parent_cpu_s"] + par["workers_cpu_s"]) / one["parent_cpu_s"]
    log(f"N={n:,}: {row}")
    worlds = []
    for world in a.worlds:
        run_dir = a.workdir / f"run_w{world}"
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [*TRAINER, "train", str(a.config), *(["--nproc", str(world)] if world > 1 else []),
               *overrides(a, data), f"train.max_steps={a.steps}", f"eval.every_steps={10**9}",
               f"ckpt.every_steps={10**9}", f"run.output_dir={run_dir}"]
        w = check(watch(cmd, run_dir / "metrics.jsonl", env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}),
                  f"trainer train (W={world})")
        wr = {"N": n, "W": world, "first_step_s": first_step_s(w),
              "rank_peak_MiB": max(w.rank_peak_mib.values(), default=float("nan")),
              "rank_private_MiB": max(w.rank_anon_mib.values(), default=float("nan")),
              "ranks_seen": len(w.rank_peak_mib)}
        worlds.append(wr)
        log(f"N={n:,} W={world}: {wr}")
        shutil.rmtree(run_dir, ignore_errors=True)
    if not a.keep:
        data.unlink()
        shutil.rmtree(a.workdir / "cache", ignore_errors=True)
    return row, worlds


SIZE_COLS = [("N", "conformers"), ("atoms", "atoms"), ("MiB", "msgpack MiB"), ("gen_s", "generate s"),
             ("serial_s", "build s, 1 process"), ("serial_rate", "conformers/s, 1 process"),
             ("build_s", "build s, all cores"), ("build_rate", "conformers/s, all cores"), ("cores", "cores"),
             ("speedup", "speed-up"), ("build_peak_MiB", "build peak RSS MiB (any process)"),
             ("cached_s", "cached load s"), ("shards", "shards")]
CPU_COLS = [("N", "conformers"), ("serial_cpu_s", "CPU s, 1 process"), ("serial_load", "load avg, 1 process"),
            ("parent_cpu_s", "parent CPU s, all cores"), ("workers_cpu_s", "workers' CPU s, all cores"),
            ("load", "load avg, all cores"), ("cpu_ratio", "CPU all cores / CPU 1 process"),
            ("s", "serial fraction s"), ("amdahl", "Amdahl bound"),
            ("speedup", "wall speed-up")]
WORLD_COLS = [("N", "conformers"), ("W", "W"), ("first_step_s", "launch to 1st step s"),
              ("rank_peak_MiB", "rank peak RSS MiB"), ("rank_private_MiB", "rank peak private (anon) MiB"),
              ("ranks_seen", "ranks seen")]
SCALED = ["build_s", "build_peak_MiB", "cached_s", "first_step_s", "rank_peak_MiB", "rank_private_MiB"]


def merged_rows(sizes: list[dict[str, Any]], worlds: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    return [{**s, **next(r for r in worlds if r["N"] == s["N"] and r["W"] == world)} for s in sizes]


def run(a: argparse.Namespace) -> None:
    a.workdir = a.workdir.resolve()
    a.workdir.mkdir(parents=True, exist_ok=True)
    sizes, worlds = [], []
    for n in a.sizes:
        row, w = measure_size(a, n)
        sizes.append(row)
        worlds += w
    parts = [f"## Molecules scale benchmark (GEOM-Drugs-like), {utc_now()}", "",
             f"Machine: {cpu_model()}. Command: `{command_line()}`. "
             f"{a.per_molecule} conformers per molecule of 25-50 heavy atoms with H; the `tiny` EGNN, {a.batch} per "
             f"device, data.num_workers={a.num_workers}, gloo on CPU.", "",
             "Build (`build_geom_dataset`: parse, EDM's conformer rule, SMILES perception, Arrow shards):", "",
             table(sizes, SIZE_COLS), "",
             "CPU time of the builds (getrusage: the parent's own, and its pool workers'; s = the parent's CPU in the "
             "parallel build / one process's CPU for the whole build; the 1-minute load average at the end of each):",
             "", table([r for r in sizes if "parent_cpu_s" in r], CPU_COLS), "",
             "Per size and number of processes W (the cache built):", "", table(worlds, WORLD_COLS)]
    for world in a.worlds:
        rows = merged_rows(sizes, worlds, world)
        if len(rows) > 1:
            ext = [{"quantity": k, f"N={GEOM_DRUGS_CONFORMERS:,}":
                    power_law([(r["N"], r[k]) for r in rows if r.get(k, 0) > 0], GEOM_DRUGS_CONFORMERS)}
                   for k in SCALED]
            parts += ["", f"W = {world}: cost per doubling of N (1.0 flat, 2.0 linear in N):", "",
                      table(doubling_ratios(rows, SCALED), [("N", "N")] + [(k, k) for k in SCALED]), "",
                      f"W = {world}: extrapolated (not measured) to GEOM-Drugs' ~{GEOM_DRUGS_CONFORMERS:,} conformers "
                      "(a power law in N through the sizes above):", "", table(ext, [(k, k) for k in ext[0]])]
    publish_section("\n".join(parts) + "\n", a.out, a.smoke, topic=TOPIC)


# A molecules rank's start-up steps after the build (task.py `build_data`, a GEOM source), on N rows of synthetic
# shards: no GEOM file, no build. `_PER_ROW_WRITE` writes the shards in a process of its own, so that the measuring
# process (`_PER_ROW`, fresh) starts with neither Python's nor Arrow's allocators holding freed memory of the
# writing (their free arenas would be reused by the steps and hide their growth in RssAnon) and Arrow's high-water
# mark near 0. Each step: kept = traced numpy/Python memory and Arrow's pool growth after gc; peak = the traced peak
# within the step plus the growth of Arrow's high-water mark in it (a lower bound when an earlier step's Arrow peak
# was higher); RssAnon after it, over that before the load.
_PER_ROW_WRITE = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from molecule_shards import write_molecule_shards
write_molecule_shards(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), one_batch=True)
"""

_PER_ROW = r"""
import gc, inspect, json, os, sys, time, tracemalloc
from pathlib import Path
import numpy as np, pyarrow as pa
import trainer
from trainer.core.samplers import EpochSampler, RankBatchSampler
from trainer.data.arrow_cache import load_arrow, select_rows
from trainer.families.molecules_edm.dataset import MoleculeRows, node_count_histogram
from trainer.families.molecules_edm.geom import geom_split
try:
    from trainer.families.molecules_edm.dataset import training_smiles_set
    smiles_call = "training_smiles_set"
except ImportError:  # before it: the task kept a Python set of the sorted list
    from trainer.families.molecules_edm.dataset import training_smiles
    def training_smiles_set(ds):
        return set(training_smiles(ds))
    smiles_call = "set(training_smiles)"

directory, batch, world = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
paths = sorted(directory.glob("s*.arrow"))

def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) * 1024

out = {"shards": len(paths), "smiles_call": smiles_call, "trainer": os.path.dirname(trainer.__file__)}
pool = pa.default_memory_pool()
gc.collect()
keep, arrow0, anon0 = [], pa.total_allocated_bytes(), rss_anon()
tracemalloc.start()

def step(name, fn):
    gc.collect()
    tracemalloc.reset_peak()
    t0, a0, hw0, s0 = tracemalloc.get_traced_memory()[0], pa.total_allocated_bytes(), pool.max_memory(), \
        time.perf_counter()
    keep.append(fn())
    out[name + "_s"] = time.perf_counter() - s0
    gc.collect()
    t1, peak = tracemalloc.get_traced_memory()
    out[name + "_kept"] = (t1 - t0 + pa.total_allocated_bytes() - a0) / 2**20
    out[name + "_peak"] = (peak - t0 + pool.max_memory() - hw0) / 2**20
    out[name + "_anon"] = (rss_anon() - anon0) / 2**20
    return keep[-1]

full = step("load", lambda: load_arrow(paths, "per-row"))
out["N"] = len(full)
parts = step("split", lambda: geom_split(len(full), 0, 0.1, 0.1))
# as the task selects: 4-byte indices where select_rows has them
narrow = {"narrow": True} if "narrow" in inspect.signature(select_rows).parameters else {}
sel = step("select", lambda: {k: select_rows(full, v, **narrow) if len(v) else None for k, v in parts.items()})
train = sel["train"]
del parts
keep[1] = None  # build_data returns: its split's row arrays go, the selections hold what they need
step("smiles", lambda: training_smiles_set(train))
step("histogram", lambda: node_count_histogram(train))
rows = step("rows", lambda: {k: MoleculeRows(v) if v is not None else None for k, v in sel.items()})["train"]
del sel, train
keep[2] = None  # TaskData holds the MoleculeRows (each holds its selection)
sampler = step("sampler", lambda: RankBatchSampler(EpochSampler(len(rows), 0, True, multiple_of=batch * world),
                                                   batch, 0, world))
it = iter(sampler)
step("batch", lambda: [rows[int(i)] for i in next(it)])
gc.collect()
out["train_rows"] = len(rows)
out["kept_MiB"] = (tracemalloc.get_traced_memory()[0] + pa.total_allocated_bytes() - arrow0) / 2**20
out["arrow_MiB"] = (pa.total_allocated_bytes() - arrow0) / 2**20
tracemalloc.stop()  # its own records are not the rank's
gc.collect()
out["anon_MiB"] = (rss_anon() - anon0) / 2**20
pool.release_unused()  # what Arrow's allocator held of freed memory
out["anon_released_MiB"] = (rss_anon() - anon0) / 2**20
# task.unit_sizes: only batching=balanced/budget asks for it (the sampler then keeps a compact copy); the default
# fixed batching never does, so it is measured last, outside the totals
tracemalloc.start()
step("sizes", lambda: np.asarray(rows.num_atoms, dtype=np.int64))
print(json.dumps(out))
"""

PER_ROW_STEPS = [("load", "load the cache (`load_arrow`)"), ("split", "EDM's split (`geom_split`)"),
                 ("select", "`select_rows` train / validation / test"), ("smiles", "training SMILES (novelty set)"),
                 ("histogram", "`node_count_histogram(train)`"), ("rows", "`MoleculeRows` x 3"),
                 ("sampler", "fixed batch sampler"), ("batch", "its 1st batch, rows read"),
                 ("sizes", "then `num_atoms` int64 (balanced/budget only; not in the totals)")]
PER_ROW_STEP_COLS = [("N", "N"), ("step", "step"), ("kept", "kept MiB"), ("peak", "peak MiB"),
                     ("anon", "RssAnon growth so far MiB"), ("s", "s")]
PER_ROW_COLS = [("N", "N"), ("train_rows", "training rows"), ("kept_MiB", "all kept MiB"),
                ("arrow_MiB", "of it Arrow MiB"), ("anon_MiB", "RssAnon growth MiB"),
                ("anon_released_MiB", "RssAnon growth after Arrow's release_unused MiB"),
                ("kept_per_row", "kept bytes a training row (slope)"),
                ("anon_per_row", "RssAnon bytes a training row (slope)"),
                ("anon_released_per_row", "RssAnon after release bytes a training row (slope)"),
                ("write_s", "write shards s"), ("measure_s", "measure s")]


def per_row(a: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    """What a molecules rank keeps per training row along its start-up at each N of `--per-row`, the shards written
    by one process and measured by a fresh one, both running the `trainer` of `--code`: the markdown (steps, totals,
    slopes) and the rows."""
    import tempfile

    code = a.code.resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}

    def child(script: str, *args: Any) -> tuple[str, float]:
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=code, env=env,
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"the per-row measurement failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        return run.stdout, time.perf_counter() - t0

    found = []
    for n in a.per_row:
        with tempfile.TemporaryDirectory(prefix="per-row-mol-") as tmp:
            _, write_s = child(_PER_ROW_WRITE, tmp, n, a.shards, ROOT / "benchmarks")
            stdout, measure_s = child(_PER_ROW, tmp, a.batch, 1)
        found.append({**json.loads(stdout.strip().splitlines()[-1]), "write_s": write_s, "measure_s": measure_s})
        log(f"per-row N={n:,}: {found[-1]}")
    lo, hi = found[0], found[-1]
    if hi["train_rows"] > lo["train_rows"]:
        for k in ("kept", "anon", "anon_released"):
            hi[f"{k}_per_row"] = (hi[f"{k}_MiB"] - lo[f"{k}_MiB"]) * 2**20 / (hi["train_rows"] - lo["train_rows"])
    steps = [{"N": r["N"], "step": label, **{c: r[f"{k}_{c}"] for c in ("kept", "peak", "anon", "s")}}
             for r in found for k, label in PER_ROW_STEPS]
    text = "\n".join([
        f"Code: `{found[0]['trainer']}`; the training SMILES by `{found[0]['smiles_call']}`. {a.shards} shards of one "
        "record batch, molecules of 3-8 atoms, a 60-character SMILES per 30 rows (every 7th row's null), written by "
        f"a process of their own; EDM's split 80/10/10; batch {a.batch}, W = 1. Kept: numpy/Python (tracemalloc) and "
        "Arrow's pool after gc; peak: the traced peak within the step plus the growth of Arrow's high-water mark in "
        "it (a lower bound where an earlier step's Arrow peak was higher); RssAnon: the private memory over that "
        "before the load (per step with tracemalloc's records; in the totals after it stopped, then after Arrow's "
        "`release_unused`): it also holds what the allocators kept of freed transients.", "",
        table(steps, PER_ROW_STEP_COLS), "", table(found, PER_ROW_COLS)])
    return text, found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 200_000, 400_000], help="conformers")
    p.add_argument("--serial-sizes", type=int, nargs="*", default=None,
                   help="sizes also built with one process (default: the smallest)")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--per-molecule", type=int, default=30)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/scale_molecules"))
    p.add_argument("--keep", action="store_true", help="keep each size's file and cache (default: removed)")
    p.add_argument("--reuse", action="store_true",
                   help="use WORKDIR/geom_like_<N>.msgpack where it exists (written by an earlier run with the same "
                        "--per-molecule) instead of generating it")
    p.add_argument("--config", type=Path, default=ROOT / "configs/molecules_edm/edm_tiny.yaml")
    p.add_argument("--batch", type=int, default=16, help="per-device batch of the runs")
    p.add_argument("--steps", type=int, default=3, help="training steps of each launch")
    p.add_argument("--num-workers", type=int, default=0, help="data.num_workers of the runs")
    p.add_argument("--out", type=Path, help="file the section into this markdown file (BENCHMARKS.md)")
    p.add_argument("--smoke", action="store_true", help="600 conformers, W = 1, 2 steps: checks the script runs")
    p.add_argument("--per-row", type=int, nargs="+", metavar="N",
                   help="only measure what a rank keeps per training row at start-up (synthetic shards of N rows, "
                        "no GEOM build)")
    p.add_argument("--shards", type=int, default=64, help="--per-row: shards of the synthetic cache")
    p.add_argument("--code", type=Path, default=ROOT,
                   help="--per-row: the checkout whose `trainer` is measured (default: this one)")
    a = p.parse_args()
    if a.per_row:
        text, _ = per_row(a)
        section = (f"### Molecules: what a rank keeps per training row (per-row mode), {utc_now()}\n\n"
                   f"Machine: {cpu_model()}. Command: `{command_line()}`.\n\n{text}\n")
        publish_section(section, a.out, a.smoke, topic="Field-size data: crystals, molecules, perturbations")
        return
    if a.smoke:
        import tempfile

        a.sizes, a.worlds, a.steps, a.out, a.serial_sizes = [600], [1], 2, None, [600]
        with tempfile.TemporaryDirectory(prefix="scale-mol-") as tmp:
            a.workdir = Path(tmp)
            run(a)
        return
    if a.serial_sizes is None:
        a.serial_sizes = [min(a.sizes)]
    run(a)


if __name__ == "__main__":
    main()

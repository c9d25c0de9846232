"""The crystal data path at full-data-set sizes (Alexandria 2.6 M, OMat24 110 M structures): what the build and a
launch cost as the number of structures (N) and of processes (W) grow. Shares `scale.py`'s process watcher,
table and power-law extrapolation.

For each N (`--sizes`): a JARVIS/mlearn-like crystal set (`write_crystals`: the element and size distributions
below), as extended XYZ and as an ASE LMDB database (`.aselmdb`, fairchem's format), then

  build         `trainer data prepare CONFIG task.data_path=FILE task.num_proc=P` for P = 1 and `--build-procs`
                (the Arrow graph cache of the job): wall time, the peak RSS of the parent and of any process
                (workers included); the same command again (a cache hit: the start-up every build pays too); the
                build's rate, N / (build - cache hit), and the parallel rate against P x one process's rate
  CPU split     (`--cpu-split`) the same build in a fresh process for P = 1 and P: the CPU seconds of the
                parent and of the workers (`getrusage`, load-independent): the serial fraction (the parent's
                share), its Amdahl bound, the workers' extra CPU (their start-up) and the wall ratio
  first step    with the cache built, `trainer train CONFIG --nproc W` for each W (`--worlds`): wall time from
                the launch to the first step's record, and each rank's peak RSS and private (anon) memory
  stages        (`--stages`) one process doing what a rank does (the task's data, the batch sampler, 11
                training batches, the test split read) on the built cache, its page cache dropped first: the
                cache's mapped pages (Rss of the shards in /proc/self/smaps), the private memory and the CPU
                seconds after each stage, twice (the first start stores the statistics, the second reads them):
                what of a rank's RSS grows with N
  launch only   (`--launch DIR ...`, alone) the launches on the folders of an earlier `--keep` run, as configured
                and with each `--variant KEY=VALUE` override
  per row       (`--per-row N ...`, alone) a rank's per-row start-up steps on N rows of tiny data, no build: what
                the split rows, selections, sizes and the iterating sampler keep and peak at, and the bytes a
                training row (the slope from the smallest to the largest N)

Then the cost per doubling of N and an extrapolation (a power law in N over the measured sizes) to Alexandria and
OMat24: extrapolated, not measured. Prints markdown; `--out FILE` files it into FILE (`bench_report`).

    .venv/bin/python benchmarks/scale_crystals.py --sizes 25000 50000 100000 --worlds 1 2 --workdir /scratch/c
    .venv/bin/python benchmarks/scale_crystals.py --smoke
    .venv/bin/python benchmarks/scale_crystals.py --per-row 48000 1000000 --worlds 1 4
"""

from __future__ import annotations

import argparse
import json
import math
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
from scale import TRAINER, check, first_step_s, fmt, log, per_doubling, power_law, table, watch  # noqa: E402

ALEXANDRIA = 2_600_000
OMAT24 = 110_000_000

# Element weights: how often an element occurs in a JARVIS-DFT 3D structure (rounded shares; O, the
# transition metals and the pnictides/chalcogenides lead, as in inorganic crystal databases).
_ELEMENT_WEIGHTS = {
    "O": 30, "Li": 8, "Mg": 6, "Al": 5, "Si": 6, "P": 5, "S": 7, "Cl": 3, "K": 4, "Ca": 5, "Ti": 5, "V": 4,
    "Cr": 3, "Mn": 5, "Fe": 6, "Co": 5, "Ni": 5, "Cu": 5, "Zn": 4, "Ga": 3, "Ge": 3, "As": 3, "Se": 4, "Sr": 3,
    "Y": 2, "Zr": 2, "Nb": 2, "Mo": 3, "Ru": 2, "Rh": 2, "Pd": 3, "Ag": 3, "Cd": 2, "In": 3, "Sn": 3, "Sb": 3,
    "Te": 3, "Ba": 3, "La": 3, "Ce": 2, "Nd": 1, "Sm": 1, "Hf": 1, "Ta": 1, "W": 2, "Ir": 1, "Pt": 2, "Au": 2,
    "Hg": 1, "Tl": 1, "Pb": 2, "Bi": 3, "N": 6, "C": 4, "B": 3, "F": 5, "H": 4, "Na": 5, "Be": 1, "Sc": 1,
    "Rb": 1, "Cs": 1, "Br": 2, "I": 2, "U": 1, "Th": 1,
}
_SPECIES_P = np.array([0.05, 0.35, 0.4, 0.15, 0.05])  # 1..5 elements per structure
_VOLUME_PER_ATOM = 18.0  # Å^3


def _structure(rng: np.random.Generator, symbols: list[str], weights: np.ndarray) -> tuple[np.ndarray, ...]:
    """(element indices, positions [n, 3], cell [3, 3]): atoms on a jittered grid of a sheared box, so no two
    are closer than ~1.4 Å; sizes log-normal around 8 atoms (1-64), as in JARVIS-DFT 3D."""
    n = int(np.clip(round(rng.lognormal(np.log(8), 0.7)), 1, 64))
    k = min(int(rng.choice(5, p=_SPECIES_P)) + 1, n)
    elements = rng.choice(len(symbols), size=k, replace=False, p=weights)
    species = elements[np.concatenate([np.arange(k), rng.integers(0, k, n - k)])]
    m = int(math.ceil(n ** (1 / 3)))
    length = (n * _VOLUME_PER_ATOM) ** (1 / 3)
    cell = np.eye(3) * length + np.triu(rng.normal(0, 0.1 * length, (3, 3)), 1)
    sites = np.stack(np.meshgrid(*[np.arange(m)] * 3, indexing="ij"), -1).reshape(-1, 3)
    chosen = sites[rng.choice(len(sites), size=n, replace=False)]
    frac = (chosen + 0.5 + rng.uniform(-0.1, 0.1, (n, 3))) / m
    return species, frac @ cell, cell


def write_crystals(n: int, xyz: Path | None = None, aselmdb: Path | None = None, seed: int = 0) -> dict[str, float]:
    """Write `n` JARVIS/mlearn-like periodic structures with an `energy` (per structure) and `forces`, as extended
    XYZ (`xyz`) and/or an ASE LMDB database (`aselmdb`: energy and forces as the rows' calculator results). The
    same structures in both. Returns the seconds each took."""
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)
    symbols = list(_ELEMENT_WEIGHTS)
    weights = np.array(list(_ELEMENT_WEIGHTS.values()), dtype=np.float64)
    weights /= weights.sum()
    per_element = rng.normal(-5.0, 2.0, len(symbols))
    out: dict[str, float] = {}
    db = None
    if aselmdb is not None:
        import ase.db

        aselmdb.unlink(missing_ok=True)
        db = ase.db.connect(str(aselmdb), type="aselmdb")
    t_xyz = t_db = 0.0
    f = open(xyz, "w") if xyz is not None else None  # noqa: SIM115 -- closed below
    try:
        if db is not None:
            db.__enter__()  # one LMDB transaction for all rows, not one per row (its exit commits and closes)
        for _ in range(n):
            species, pos, cell = _structure(rng, symbols, weights)
            energy = float(per_element[species].sum() + rng.normal(0, 0.2 * len(species) ** 0.5))
            forces = rng.normal(0, 0.3, pos.shape)
            if f is not None:
                t0 = time.perf_counter()
                lattice = " ".join(f"{v:.6f}" for v in cell.reshape(-1))
                lines = [f"{len(species)}\n",
                         f'Lattice="{lattice}" Properties=species:S:1:pos:R:3:forces:R:3 energy={energy:.8f} '
                         f'pbc="T T T"\n']
                lines += [f"{symbols[s]} {p[0]:.6f} {p[1]:.6f} {p[2]:.6f} {g[0]:.5f} {g[1]:.5f} {g[2]:.5f}\n"
                          for s, p, g in zip(species, pos, forces)]
                f.writelines(lines)
                t_xyz += time.perf_counter() - t0
            if db is not None:
                t0 = time.perf_counter()
                atoms = Atoms([symbols[s] for s in species], positions=pos, cell=cell, pbc=True)
                # as fairchem's OMat24 rows: energy and forces are the stored calculator's results
                atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces)
                db.write(atoms)
                t_db += time.perf_counter() - t0
        if db is not None and n:
            db.__exit__(None, None, None)
    finally:
        if f is not None:
            f.close()
        if db is not None:
            db.close()
    if xyz is not None:
        out["xyz_s"] = t_xyz
    if aselmdb is not None:
        out["db_s"] = t_db
    return out


# ---------------------------------------------------------------- measurements

_CPU_SPLIT = """
import json, os, resource, sys, time
from trainer.families.crystals.dataset import build_crystal_dataset
from trainer.families.crystals.graphs import GraphSpec

def cpu(who):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime

path, procs, cache, k = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
p0, c0, t0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
ds = build_crystal_dataset(path, graph=GraphSpec(kind="knn", k=k, use_lattice=True), target="energy", per_atom=True,
                           num_proc=procs, cache_dir=cache, split_key=0)
print(json.dumps({"N": len(ds), "wall_s": time.perf_counter() - t0, "parent_cpu_s": cpu(resource.RUSAGE_SELF) - p0,
                  "workers_cpu_s": cpu(resource.RUSAGE_CHILDREN) - c0, "load1": os.getloadavg()[0]}))
"""


def cpu_split(data: Path, procs: int, cache: Path, k: int) -> dict[str, float]:
    """One build in a fresh process (the job's graph settings): wall time, the CPU seconds of the parent during
    the build and of its workers (`getrusage`: load-independent, unlike the wall time), the load average."""
    shutil.rmtree(cache, ignore_errors=True)
    out = subprocess.run([sys.executable, "-c", _CPU_SPLIT, str(data), str(procs), str(cache), str(k)],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    shutil.rmtree(cache, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def amdahl(one: dict[str, float], par: dict[str, float], procs: int) -> dict[str, float]:
    """The serial fraction s (the parent's CPU over all the build's CPU at `procs` workers), the Amdahl bound
    1 / (s + (1 - s) / P), the CPU overhead of the workers against one process (their start-up: spawn and
    imports), the CPU-time bound that includes it, and the wall-time ratio rate(P) / (P x rate(1))."""
    total = par["parent_cpu_s"] + par["workers_cpu_s"]
    s = par["parent_cpu_s"] / total
    serial_cpu = one["parent_cpu_s"] + one["workers_cpu_s"]
    return {"serial_fraction": s, "amdahl_bound": 1 / (s + (1 - s) / procs),
            "worker_overhead_cpu_s": total - serial_cpu,
            "cpu_bound": serial_cpu / max(par["parent_cpu_s"], par["workers_cpu_s"] / procs),
            "wall_ratio": one["wall_s"] / (procs * par["wall_s"]), "load1": max(one["load1"], par["load1"])}


_STAGES = r"""
import glob, json, os, sys, time
import torch
from trainer.config import load_config
from trainer.core.batch_plan import plan_batch
from trainer.core.loaders import TrainBatches, build_eval_loader
from trainer.registry import get_task
import trainer.families.crystals.task as T

config, cache, overrides = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3:]
for path in glob.glob(os.path.join(cache, "crystal_graphs", "*")):  # cold: every page a stage maps is read anew
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
rows, clock = [], [time.process_time()]

def snap(stage):
    mapped, anon, current = 0, 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 1 and "-" in parts[0] and not parts[0].endswith(":"):
                current = len(parts) > 5 and parts[5].startswith(cache) and parts[5].endswith(".arrow")
            elif current and parts[0] == "Rss:":
                mapped += int(parts[1])
    with open("/proc/self/status") as f:
        anon = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
    rows.append({"stage": stage, "mapped_MiB": mapped / 1024, "private_MiB": anon / 1024,
                 "cpu_s": time.process_time() - clock[0]})
    clock[0] = time.process_time()

cfg = load_config(config, overrides)
task = get_task(cfg.task.name)(cfg.task, seed=cfg.run.seed)
build, stats = T.CrystalPropertyTask._build, T.CrystalPropertyTask._stored_statistics

def opened(self, *a, **k):
    out = build(self, *a, **k)
    snap("open the cache")
    return out

def statistics(self, *a, **k):
    snap("splits selected")
    out = stats(self, *a, **k)
    snap("statistics")
    return out

T.CrystalPropertyTask._build, T.CrystalPropertyTask._stored_statistics = opened, statistics
data = task.build_data()
batches = TrainBatches(cfg, plan_batch(cfg, world=1), task, data.train, 0, 1, torch.device("cpu"))
data.train._prepare()
snap("batch sampler, rows")
it = batches.micro_batches(0)
for _ in range(11):
    next(it)
snap("11 training batches")
if data.test is not None:
    for _ in build_eval_loader(cfg, task, data.test, cfg.train.per_device_batch_size, "test"):
        pass
    snap(f"test split read ({len(data.test)} rows)")
print(json.dumps(rows))
"""


def stages(a: argparse.Namespace, data: Path, cache: Path) -> list[dict[str, Any]]:
    """The rank's start-up and reading stages on the built cache, twice (a first and a later start), each in a
    fresh process with the shards' page cache dropped: the mapped pages, private memory and CPU after each."""
    out = []
    for start in ("first", "later"):
        if start == "first":  # the statistics a launch stored: the first start computes them again
            for stored in (cache / "crystal_graphs").glob("*.stats-*.json"):
                stored.unlink()
        run = subprocess.run([sys.executable, "-c", _STAGES, str(a.config), str(cache),
                              *_job(a, data, cache, a.build_procs)], cwd=ROOT, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"the stage measurement failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        out += [{"start": start, **r} for r in json.loads(run.stdout.strip().splitlines()[-1])]
    return out


# One process doing a rank's per-row start-up steps on N rows of tiny data (no structures, no cache): the sizes
# column in shards of 4,096 rows, random split hashes; numpy's allocations through tracemalloc (kept after each
# step, peak within it) and Arrow's through its memory pool. Cheap enough to run at 1 M or 10 M rows.
_PER_ROW = r"""
import gc, json, sys, tracemalloc
import datasets, numpy as np, pyarrow as pa
from datasets.table import InMemoryTable
from trainer.core.samplers import BalancedBatchSampler
from trainer.families.crystals import task as T
from trainer.families.crystals.dataset import atom_counts, select_rows

n, world, batch = (int(v) for v in sys.argv[1:4])
rng = np.random.default_rng(0)
sizes = rng.integers(1, 200, n).astype(np.int32)
ds = datasets.Dataset(InMemoryTable(pa.Table.from_batches(
    [pa.record_batch([pa.array(sizes[lo:lo + 4096])], names=["num_atoms"]) for lo in range(0, n, 4096)])))
ds.split_hashes, ds.split_key = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True), 0
del sizes
out, keep, arrow0 = {"N": n, "W": world}, [], pa.total_allocated_bytes()
tracemalloc.start()

def step(name, fn):
    gc.collect()
    tracemalloc.reset_peak()
    t0, a0 = tracemalloc.get_traced_memory()[0], pa.total_allocated_bytes()
    keep.append(fn())
    gc.collect()
    t1, peak = tracemalloc.get_traced_memory()
    out[name + "_kept"] = (t1 - t0 + pa.total_allocated_bytes() - a0) / 2**20
    out[name + "_peak"] = (peak - t0) / 2**20
    return keep[-1]

parts = step("split", lambda: T._split_rows(ds, {"train": 0.9, "validation": 0.05, "test": 0.05}, key=0))
train = step("select", lambda: {k: select_rows(ds, v, narrow=True) for k, v in parts.items()})["train"]
del parts
keep[0] = None  # the task drops its row arrays once selected: the selections hold what they need
sz = step("sizes", lambda: atom_counts(train))
sampler = step("sampler", lambda: BalancedBatchSampler(sz, mode="balanced", seed=0, rank=0, world_size=world,
                                                        batch_size=batch, with_epoch=True))
it = iter(sampler)
step("batch", lambda: next(it))
gc.collect()
out["train_rows"], out["kept_MiB"] = len(train), tracemalloc.get_traced_memory()[0] / 2**20
out["arrow_MiB"] = (pa.total_allocated_bytes() - arrow0) / 2**20
print(json.dumps(out))
"""

PER_ROW_COLS = [("N", "N"), ("W", "W"), ("train_rows", "training rows"), ("split_kept", "split rows kept MiB"),
                ("split_peak", "split peak MiB"), ("select_kept", "selections kept MiB"),
                ("sizes_kept", "sizes kept MiB"), ("sizes_peak", "sizes peak MiB"), ("sampler_peak", "sampler peak MiB"),
                ("batch_kept", "iterating sampler kept MiB"), ("batch_peak", "1st batch peak MiB"),
                ("kept_MiB", "all kept MiB"), ("bytes_per_row", "kept bytes a training row (slope)")]


def per_row(a: argparse.Namespace) -> str:
    """What a rank keeps per training row along its start-up (split rows, selections, sizes, sampler, its first
    batch) at each N of `--per-row` and W of `--worlds`, each in a fresh process: a table, and the slope in bytes
    a training row between the smallest and largest N."""
    rows = []
    for world in a.worlds:
        found = []
        for n in a.per_row:
            run = subprocess.run([sys.executable, "-c", _PER_ROW, str(n), str(world), str(a.batch)], cwd=ROOT,
                                 capture_output=True, text=True)
            if run.returncode != 0:
                raise SystemExit(f"the per-row measurement failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
            found.append(json.loads(run.stdout.strip().splitlines()[-1]))
        lo, hi = found[0], found[-1]
        if hi["train_rows"] > lo["train_rows"]:
            hi["bytes_per_row"] = (hi["kept_MiB"] - lo["kept_MiB"]) * 2**20 / (hi["train_rows"] - lo["train_rows"])
        rows += found
    return table(rows, PER_ROW_COLS)


def _job(a: argparse.Namespace, data: Path, cache: Path, procs: int) -> list[str]:
    return [f"task.data_path={data}", f"task.cache_dir={cache}", f"task.num_proc={procs}", "task.val_fraction=0.05",
            "task.test_fraction=0.05", f"train.per_device_batch_size={a.batch}", "train.max_steps=2",
            "train.mixed_precision=no", "optim.warmup_steps=1", "data.num_workers=0", "eval.max_samples=32",
            "log.every_steps=1", "log.progress_bar=false", "log.tensorboard=false"]


def measure(a: argparse.Namespace, n: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    work = a.workdir / f"n{n}"
    work.mkdir(parents=True, exist_ok=True)
    xyz, db = work / "crystals.extxyz", work / "crystals.aselmdb"
    log(f"N={n:,}: generating")
    gen = write_crystals(n, xyz, db, seed=a.seed)
    size: dict[str, Any] = {"N": n, "xyz_MiB": xyz.stat().st_size / 2**20, "db_MiB": db.stat().st_size / 2**20,
                            "gen_xyz_s": gen["xyz_s"], "gen_db_s": gen["db_s"]}
    for fmt_name, path in (("xyz", xyz), ("db", db)):
        for procs in sorted({1, a.build_procs}):
            if fmt_name == "db" and procs == 1 and not a.db_serial:
                continue
            cache = work / f"cache_{fmt_name}_{procs}"
            shutil.rmtree(cache, ignore_errors=True)
            log(f"N={n:,}: build {fmt_name} P={procs}")
            w = check(watch([*TRAINER, "data", "prepare", str(a.config), *_job(a, path, cache, procs)]),
                      f"prepare {fmt_name} P={procs}")
            size[f"build_{fmt_name}_p{procs}_s"] = w.wall_s
            size[f"build_{fmt_name}_p{procs}_parent_MiB"] = w.rank_peak_mib.get(0, float("nan"))
            size[f"build_{fmt_name}_p{procs}_any_MiB"] = w.any_peak_mib
    # the same command again is a cache hit: the start-up (imports, opening the cache) that each build paid too
    again = check(watch([*TRAINER, "data", "prepare", str(a.config), *_job(a, xyz, work / "cache_xyz_1", 1)]),
                  "prepare again")
    size["again_s"] = again.wall_s
    size["again_MiB"] = again.rank_peak_mib.get(0, float("nan"))
    p = a.build_procs
    for fmt_name in ("xyz", "db"):
        for procs in (1, p):
            if f"build_{fmt_name}_p{procs}_s" in size:
                size[f"rate_{fmt_name}_p{procs}"] = n / max(size[f"build_{fmt_name}_p{procs}_s"] - again.wall_s, 1e-9)
    if p > 1:
        size["parallel_eff"] = size[f"rate_xyz_p{p}"] / (p * size["rate_xyz_p1"])
    if a.cpu_split and p > 1:
        for fmt_name, path in (("xyz", xyz), ("db", db)):
            log(f"N={n:,}: CPU split {fmt_name}")
            one = cpu_split(path, 1, work / "cache_cpu", a.max_neighbors)
            par = cpu_split(path, p, work / "cache_cpu", a.max_neighbors)
            size.update({f"cpu_{fmt_name}_{k}": v for k, v in amdahl(one, par, p).items()})
            size[f"cpu_{fmt_name}_p1_s"], size[f"cpu_{fmt_name}_pP_parent_s"] = one["parent_cpu_s"], par["parent_cpu_s"]
            size[f"cpu_{fmt_name}_pP_workers_s"] = par["workers_cpu_s"]
    cache = work / f"cache_xyz_{a.build_procs}"
    worlds = launches(a, n, xyz, cache, work)
    if a.stages:
        log(f"N={n:,}: stages")
        size["stages"] = [{"N": n, **r} for r in stages(a, xyz, cache)]
    if not a.keep:
        for path in (xyz, db, work / "crystals.aselmdb-lock"):
            path.unlink(missing_ok=True)
        for c in work.glob("cache_*"):
            shutil.rmtree(c, ignore_errors=True)
    return size, worlds


def launches(a: argparse.Namespace, n: int, xyz: Path, cache: Path, work: Path,
             extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """`trainer train` at each W of `--worlds` on the built cache (`extra`: more overrides): launch to the first
    step, each rank's peak RSS and private memory."""
    worlds = []
    for world in a.worlds:
        run_dir = work / f"run_w{world}"
        shutil.rmtree(run_dir, ignore_errors=True)
        log(f"N={n:,}: launch W={world} {' '.join(extra)}")
        cmd = [*TRAINER, "train", str(a.config), *(["--nproc", str(world)] if world > 1 else []),
               *_job(a, xyz, cache, a.build_procs), f"run.output_dir={run_dir}", *extra]
        w = check(watch(cmd, run_dir / "metrics.jsonl"), f"train W={world}")
        worlds.append({"N": n, "W": world, "overrides": " ".join(extra) or "-", "first_step_s": first_step_s(w),
                       "rank_peak_MiB": max(w.rank_peak_mib.values()),
                       "rank_private_MiB": max(w.rank_anon_mib.values()), "ranks_seen": len(w.rank_peak_mib)})
        shutil.rmtree(run_dir, ignore_errors=True)
    return worlds


def launch_only(a: argparse.Namespace) -> str:
    """`--launch DIR ...`: launches on folders an earlier `--keep` run left (crystals.extxyz and its cache built with
    `--build-procs`), the N read from the cache; once as configured and once per `--variant` override."""
    rows = []
    for work in a.launch:
        cache = work / f"cache_xyz_{a.build_procs}"
        meta = next(p for p in cache.rglob("*.json") if "." not in p.stem)  # <fingerprint>.json, not its sidecars
        n = int(json.loads(meta.read_text())["records"])
        for extra in [(), *([(v,) for v in a.variant])]:
            rows += launches(a, n, work / "crystals.extxyz", cache, work, extra)
    cols = [("N", "N"), ("W", "W"), ("overrides", "overrides"), *WORLD_COLS[2:]]
    return f"{utc_now()} on {cpu_model()}, `{command_line()}`\n\n" + table(rows, cols)


SIZE_COLS = [("N", "N"), ("xyz_MiB", "extxyz MiB"), ("db_MiB", "aselmdb MiB"), ("gen_xyz_s", "write extxyz s"),
             ("gen_db_s", "write aselmdb s"), ("build_xyz_p1_s", "build extxyz P=1 s"),
             ("build_xyz_p1_parent_MiB", "P=1 peak RSS MiB"), ("build_xyz_p2_s", "build extxyz P=2 s"),
             ("build_xyz_p2_parent_MiB", "P=2 parent peak MiB"), ("build_xyz_p2_any_MiB", "P=2 any process peak MiB"),
             ("again_s", "cache hit s (start-up)"), ("again_MiB", "cache hit peak MiB"),
             ("rate_xyz_p1", "extxyz P=1 structures/s"), ("rate_xyz_p2", "extxyz P=2 structures/s"),
             ("rate_db_p2", "aselmdb P=2 structures/s"),
             ("parallel_eff", "rate(P) / (P x rate(1))"), ("build_db_p2_s", "build aselmdb P=2 s"),
             ("build_db_p2_any_MiB", "aselmdb P=2 any process peak MiB")]
CPU_COLS = [("N", "N")] + [(f"cpu_{f}_{k}", f"{f} {label}") for f in ("xyz", "db") for k, label in (
    ("p1_s", "P=1 CPU s"), ("pP_parent_s", "P parent CPU s"), ("pP_workers_s", "P workers CPU s"),
    ("serial_fraction", "serial fraction"), ("amdahl_bound", "Amdahl bound"),
    ("worker_overhead_cpu_s", "workers' extra CPU s"), ("cpu_bound", "CPU-time bound"),
    ("wall_ratio", "wall rate(P) / (P x rate(1))"), ("load1", "load avg"))]
WORLD_COLS = [("N", "N"), ("W", "W"), ("first_step_s", "launch to 1st step s (cache built)"),
              ("rank_peak_MiB", "rank peak RSS MiB"), ("rank_private_MiB", "rank peak private (anon) MiB"),
              ("ranks_seen", "ranks seen")]
STAGE_COLS = [("N", "N"), ("start", "start"), ("stage", "stage"), ("mapped_MiB", "mapped cache MiB"),
              ("private_MiB", "private MiB"), ("cpu_s", "stage CPU s")]
SCALED = ["build_xyz_p1_s", "build_xyz_p2_s", "build_db_p2_s", "build_xyz_p2_any_MiB", "first_step_s",
          "rank_peak_MiB", "rank_private_MiB"]


def report(a: argparse.Namespace, sizes: list[dict[str, Any]], worlds: list[dict[str, Any]]) -> str:
    w0 = min(r["W"] for r in worlds)
    merged = [{**s, **next(r for r in worlds if r["N"] == s["N"] and r["W"] == w0)} for s in sizes]
    doubling = per_doubling(sizes, worlds, SCALED)
    extra = []
    last = merged[-1]
    for k in SCALED:
        if k.startswith("build_") and k.endswith("_s"):
            # a build is a start-up plus work in proportion to N: linear from the largest size's rate (a power
            # law through start-up-dominated small sizes would bend the line)
            start = last["again_s"]
            work = max(last[k] - start, 0.0) / last["N"]
            extra.append({"quantity": k + " (linear)", "Alexandria (2.6 M)": start + work * ALEXANDRIA,
                          "OMat24 (110 M)": start + work * OMAT24})
            continue
        pts = [(r["N"], r[k]) for r in merged if r.get(k) and r[k] > 0]
        extra.append({"quantity": k, "Alexandria (2.6 M)": power_law(pts, ALEXANDRIA),
                      "OMat24 (110 M)": power_law(pts, OMAT24)})
    cols = [("N", "N")] + [(k, k) for k in SCALED]
    return "\n\n".join([
        f"{utc_now()} on {cpu_model()}, `{command_line()}`",
        "Sizes and builds:\n\n" + table(sizes, SIZE_COLS),
        *(["Parallel build by CPU time (fresh processes; the serial fraction is the parent's share of the build's "
           "CPU):\n\n" + table(sizes, CPU_COLS)] if any("cpu_xyz_p1_s" in s for s in sizes) else []),
        "Launches (the cache built):\n\n" + table(worlds, WORLD_COLS),
        *(["Mapped cache pages (MiB, cumulative), private memory (MiB) and CPU seconds after each stage of one "
           "rank's start (the page cache dropped before; `--stages`):\n\n"
           + table([r for s in sizes for r in s.get("stages", [])], STAGE_COLS)] if a.stages else []),
        f"Cost per doubling of N (W={w0}):\n\n" + table(doubling, cols),
        f"Extrapolated (builds: linear in N from the largest size; the rest: a power law in N over the measured "
        f"sizes, W={w0}; not measured):\n\n"
        + table(extra, [("quantity", "quantity"), ("Alexandria (2.6 M)", "Alexandria (2.6 M)"),
                        ("OMat24 (110 M)", "OMat24 (110 M)")]),
    ])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[25_000, 50_000, 100_000])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--build-procs", type=int, default=2, help="worker processes of the parallel build")
    p.add_argument("--db-serial", action="store_true", help="also build from the .aselmdb in one process")
    p.add_argument("--config", type=Path, default=ROOT / "configs/crystals/comformer_tiny.yaml")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/scale_crystals"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the generated files and caches")
    p.add_argument("--cpu-split", action="store_true",
                   help="also time builds by CPU (parent vs workers): the serial fraction and the Amdahl bound")
    p.add_argument("--max-neighbors", type=int, default=12, help="k of the knn graph of the CPU-split builds "
                   "(the config's)")
    p.add_argument("--stages", action="store_true",
                   help="also measure what a rank maps of the cache after each start-up stage (first and later start)")
    p.add_argument("--per-row", type=int, nargs="+", metavar="N",
                   help="only measure what a rank keeps per training row (no data, no build) at these N and --worlds")
    p.add_argument("--out", type=Path, help="file the report into this markdown file (bench_report)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the script runs")
    p.add_argument("--launch", type=Path, nargs="+", metavar="DIR",
                   help="only launch on these work folders of an earlier --keep run (their extxyz and cache)")
    p.add_argument("--variant", nargs="*", default=[], metavar="KEY=VALUE",
                   help="--launch: also launch with each of these overrides")
    a = p.parse_args()
    if a.launch:
        print(launch_only(a))
        return
    if a.per_row:
        print(per_row(a))
        return
    if a.smoke:
        a.sizes, a.worlds = [300, 600], [1]
    sizes, worlds = [], []
    for n in a.sizes:
        s, w = measure(a, n)
        sizes.append(s)
        worlds += w
        log(fmt(s))
    section = "### Crystals at full-data-set size\n\n" + report(a, sizes, worlds) + "\n"
    publish_section(section, a.out, a.smoke, topic="Data ingest and streaming")


if __name__ == "__main__":
    main()

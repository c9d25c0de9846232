"""Crystals from a folder of ASE LMDB databases, as fairchem ships an OMat24 split (`data.0000.aselmdb`, ...): the
build and the launches at a given number of structures. `scale_crystals.py` measures one `.aselmdb` beside its
extxyz twin; ASE's writer is single-threaded, so a folder of many files is also how a set of a million structures
gets written here in reasonable time.

  write     `--files` databases of N / files structures each (`scale_crystals.write_crystals`, file k from the seed
            (seed, k)), by `--write-procs` processes
  build     `trainer data prepare CONFIG task.data_path=FOLDER task.num_proc=P`: wall time, rate, the peak RSS of
            the parent and of any process; the same command again (a cache hit: the start-up)
  launch    `trainer train CONFIG --nproc W` for each W (`--worlds`), the cache built: launch to the first step's
            record, each rank's peak RSS and private (anon) memory (the benchmark's overrides: 2 steps, then the
            5 % test split evaluated in full)

    .venv/bin/python benchmarks/crystal_db_folder.py --n 1000000 --files 8 --write-procs 2 --workdir /scratch/db
    .venv/bin/python benchmarks/crystal_db_folder.py --smoke
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_report import command_line, cpu_model, publish_section, utc_now  # noqa: E402
from scale import TRAINER, check, log, table, watch  # noqa: E402
from scale_crystals import WORLD_COLS, _job, launches, write_crystals  # noqa: E402


def _write_one(args: tuple[int, str, int, int]) -> float:
    count, path, seed, k = args
    return write_crystals(count, None, Path(path), seed=[seed, k])["db_s"]


def write_database_folder(n: int, folder: Path, files: int, procs: int, seed: int = 0) -> float:
    """`n` structures as `files` databases `data.NNNN.aselmdb` in `folder`, written by `procs` processes.
    Returns the wall seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    counts = [n // files + (k < n % files) for k in range(files)]
    jobs = [(c, str(folder / f"data.{k:04d}.aselmdb"), seed, k) for k, c in enumerate(counts)]
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=procs) as pool:
        list(pool.map(_write_one, jobs))
    for lock in folder.glob("*.aselmdb-lock"):  # the writers' lock files: not part of a shipped split
        lock.unlink()
    return time.perf_counter() - start


def measure(a: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    folder = a.workdir / f"db_{a.n}_{a.files}"
    cache = a.workdir / f"cache_db_{a.n}_{a.files}"
    size: dict[str, Any] = {"N": a.n, "files": a.files}
    if not folder.is_dir():
        log(f"N={a.n:,}: writing {a.files} databases")
        size["write_s"] = write_database_folder(a.n, folder, a.files, a.write_procs, a.seed)
    size["db_MiB"] = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
    shutil.rmtree(cache, ignore_errors=True)
    log(f"N={a.n:,}: build P={a.build_procs}")
    w = check(watch([*TRAINER, "data", "prepare", str(a.config), *_job(a, folder, cache, a.build_procs)]), "prepare")
    size.update(build_s=w.wall_s, build_parent_MiB=w.rank_peak_mib.get(0, float("nan")), build_any_MiB=w.any_peak_mib)
    again = check(watch([*TRAINER, "data", "prepare", str(a.config), *_job(a, folder, cache, a.build_procs)]),
                  "prepare again")
    size["again_s"] = again.wall_s
    size["rate"] = a.n / max(w.wall_s - again.wall_s, 1e-9)
    size["cache_MiB"] = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) / 2**20
    worlds = launches(a, a.n, folder, cache, a.workdir)
    if not a.keep:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    return size, worlds


SIZE_COLS = [("N", "N"), ("files", "files"), ("db_MiB", "databases MiB"), ("write_s", "write s"),
             ("build_s", "build s"), ("again_s", "cache hit s (start-up)"), ("rate", "structures/s"),
             ("build_parent_MiB", "build parent peak RSS MiB"), ("build_any_MiB", "any build process peak MiB"),
             ("cache_MiB", "graph cache MiB")]



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000, help="structures in all")
    p.add_argument("--files", type=int, default=8, help="databases in the folder")
    p.add_argument("--write-procs", type=int, default=2, help="processes writing the databases")
    p.add_argument("--build-procs", type=int, default=2, help="worker processes of the build")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--config", type=Path, default=ROOT / "configs/crystals/comformer_tiny.yaml")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/crystal_db_folder"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the databases (a later run reuses them) and the cache")
    p.add_argument("--out", type=Path, help="file the report into this markdown file (bench_report)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the script runs")
    a = p.parse_args()
    if a.smoke:
        a.n, a.files, a.worlds, a.build_procs, a.keep = 400, 2, [1], 1, False
        a.workdir = a.workdir.with_name(a.workdir.name + "_smoke")
    size, worlds = measure(a)
    log(json.dumps(size))
    section = (f"### Crystals from a folder of ASE LMDB databases, {utc_now()}\n\n"
               f"On {cpu_model()}, `{command_line()}`\n\n" + table([size], SIZE_COLS) + "\n\n"
               "Launches (the cache built):\n\n" + table(worlds, WORLD_COLS) + "\n")
    publish_section(section, a.out, a.smoke, topic="Field-size data: crystals, molecules, perturbations")


if __name__ == "__main__":
    main()

"""Periodic graph construction speed (structures/s): vesin + numpy selection vs an ASE-based baseline.

All structures of mlearn Si and Mo, training + test (the public files, fetched once with their checksums:
`trainer data fetch mlearn_si_training ...`; or `--data FOLDER` holding mlearn/{Si,Mo}/{training,test}.json),
and the 50 bundled JARVIS crystals of jarvis_bandgap_50: 506 structures, 2 to 108 atoms, are parsed once (untimed);
then, in one process, median of `--repeats` interleaved repeats after one untimed warm-up:

  (a) baseline  `build_crystal_graph(..., backend="ase")`: `ase.neighborlist.primitive_neighbor_list`
                (ASE's numpy neighbour search, what `neighbor_list("ijSd", atoms, r)` calls) and
                the same k-nearest selection, symmetrisation, lattice loops and de-duplication.
  (b) ours      `build_crystal_graph(...)` with vesin's neighbour list.
  (b1)          the vesin calls inside (b) alone, for the breakdown.

for the ComFormer k-NN graph (k=25, lattice self-loops, as in the published runs) and a radius
graph (cutoff 5 A, no loops). The two backends must give identical edge sets (checked). Also the
end-to-end uncached `build_crystal_dataset` (parse + graphs + Arrow) with 1 and 2 processes.

Target: b/a >= 10 for both graph kinds.
"""

from __future__ import annotations

import argparse
import cProfile
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
from bench_report import command_line, cpu_model, utc_now, write_section

import trainer.data.graphs as shared_graphs
import trainer.families.crystals.graphs as crystal_graphs
from trainer.families.crystals.dataset import build_crystal_dataset
from trainer.families.crystals.graphs import GraphSpec, build_crystal_graph
from trainer.families.crystals.readers import bundled_crystal_path, iter_crystals

TOPIC = "Crystals: graphs, property quality, step cost"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""


def sources(root: Path | None) -> list[Path]:
    """mlearn Si/Mo training/test (from `root`/mlearn, else the fetch cache) and the bundled JARVIS folder."""
    from trainer.data.fetch import fetch

    mlearn = [root / "mlearn" / el / f"{split}.json" if root else fetch(f"mlearn_{el.lower()}_{split}")
              for el in ("Si", "Mo") for split in ("training", "test")]
    return [*mlearn, bundled_crystal_path("jarvis_bandgap_50")]


def load(root: Path | None) -> list[dict]:
    return list(iter_crystals(sources(root), check_overlap=False))


def build_all(structures: list[dict], spec: GraphSpec, backend: str) -> list[dict]:
    return [build_crystal_graph(r["positions"], r["cell"], spec, backend=backend) for r in structures]


def timed_search(structures: list[dict], spec: GraphSpec) -> float:
    """Seconds spent inside the vesin calls of one (b) run."""
    spent = 0.0
    inner = shared_graphs.neighbor_pairs

    def wrapper(*args, **kwargs):
        nonlocal spent
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        spent += time.perf_counter() - t0
        return out

    # the k-NN search (trainer.data.graphs) and the radius graph (the family's graphs.py) both call it
    shared_graphs.neighbor_pairs = crystal_graphs.neighbor_pairs = wrapper
    try:
        build_all(structures, spec, "vesin")
    finally:
        shared_graphs.neighbor_pairs = crystal_graphs.neighbor_pairs = inner
    return spent


def same_graphs(a: list[dict], b: list[dict]) -> bool:
    return all(all(np.array_equal(x[k], y[k]) for k in ("edge_src", "edge_dst", "edge_shift")) for x, y in zip(a, b))


def end_to_end(root: Path | None, spec: GraphSpec, num_proc: int) -> float:
    with tempfile.TemporaryDirectory(prefix="crystal-bench-") as cache:
        t0 = time.perf_counter()
        # One dataset of all 5 inputs (jarvis's id_prop value is its target whatever `target` says).
        build_crystal_dataset(sources(root), graph=spec, cache_dir=cache, num_proc=num_proc)
        return time.perf_counter() - t0


def profile_top(structures: list[dict], spec: GraphSpec, backend: str, n: int = 8) -> str:
    prof = cProfile.Profile()
    prof.enable()
    build_all(structures, spec, backend)
    prof.disable()
    stats = pstats.Stats(prof)
    total = stats.total_tt
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)  # cumulative time
    out = []
    for (file, line, name), (_, _, tt, ct, _) in rows:
        if name.startswith("<") or "cProfile" in file:
            continue
        out.append(f"{name} ({Path(file).name}:{line}) {ct / total:.0%} cumulative, {tt / total:.0%} own")
        if len(out) == n:
            break
    return "; ".join(out)


def machine() -> str:
    import ase
    import vesin
    return (f"{cpu_model()}; Python {platform.python_version()}, numpy {np.__version__}, vesin {vesin.__version__}, "
            f"ase {ase.__version__}, datasets {datasets.__version__}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="a folder with mlearn/{Si,Mo}/{training,test}.json (default: the "
                   "public files, fetched once into the data cache)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per method; median reported")
    p.add_argument("--radius", type=float, default=5.0, help="cutoff of the radius graph, Å")
    p.add_argument("--profile", action="store_true", help="print the top functions of (a) and (b)")
    p.add_argument("--out", help="add this benchmark's section (machine, command, table) atop its topic in this markdown file")
    p.add_argument("--smoke", action="store_true", help="10 bundled structures, each graph kind and backend once, "
                   "nothing written: checks the script runs")
    a = p.parse_args()
    if a.smoke:
        smoke()
        return
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    root = Path(a.data) if a.data else None
    started = time.perf_counter()
    structures = load(root)
    n, atoms = len(structures), sum(len(r["atomic_numbers"]) for r in structures)
    specs = {"knn (k=25, lattice loops)": GraphSpec(kind="knn", k=25, use_lattice=True),
             f"radius ({a.radius:g} Å)": GraphSpec(kind="radius", cutoff=a.radius, use_lattice=False)}
    rows = ["| graph | edges | (a) ASE baseline s | (b) ours s | (b1) vesin calls in (b) s | structures/s (a) "
            "| structures/s (b) | b/a |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    ratios = {}
    profiles = []
    for name, spec in specs.items():
        ref, ours = build_all(structures, spec, "ase"), build_all(structures, spec, "vesin")  # warm-up + check
        if not same_graphs(ref, ours):
            sys.exit(f"{name}: the ASE and vesin backends disagree")
        edges = sum(len(g["edge_src"]) for g in ours)
        times: dict[str, list[float]] = {"a": [], "b": [], "b1": []}
        for r in range(a.repeats):
            for key, backend in (("a", "ase"), ("b", "vesin")):
                t0 = time.perf_counter()
                build_all(structures, spec, backend)
                times[key].append(time.perf_counter() - t0)
                print(f"{name} repeat {r + 1}/{a.repeats} ({key}) {times[key][-1]:.3f} s", file=sys.stderr)
            times["b1"].append(timed_search(structures, spec))
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios[name] = med["a"] / med["b"]
        rows.append(f"| {name} | {edges:,} | {med['a']:.3f} | {med['b']:.3f} | {med['b1']:.3f} | {n / med['a']:,.0f} "
                    f"| {n / med['b']:,.0f} | **{ratios[name]:.1f}x** |")
        if a.profile:
            profiles.append(f"- {name}, (a): {profile_top(structures, spec, 'ase')}")
            profiles.append(f"- {name}, (b): {profile_top(structures, spec, 'vesin')}")
    knn = specs["knn (k=25, lattice loops)"]
    e2e = {k: end_to_end(root, knn, k) for k in (1, 2)}
    table = "\n".join(rows)
    e2e_line = ("End to end, uncached `build_crystal_dataset` of the 5 inputs as one dataset (parse + validate + "
                "knn graphs + Arrow files): " + ", ".join(f"num_proc={k}: {t:.2f} s ({n / t:,.0f} structures/s)"
                                            for k, t in e2e.items()) + ".")
    met = all(r >= 10 for r in ratios.values())
    verdict = ("Ours/baseline: " + ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items())
               + f" (target >= 10x: {'met' if met else 'NOT met'}).")
    elapsed = time.perf_counter() - started
    print(table)
    print(f"\n{verdict}\n{e2e_line}\n{n} structures, {atoms:,} atoms; median of {a.repeats}; total {elapsed:.0f} s")
    if profiles:
        print("\n".join(profiles))
    if a.out:
        write_section(a.out, (f"## Crystal graph construction benchmark, {utc_now()}\n\n- Machine: {machine()}\n"
                    f"- Command: `{command_line()}`\n"
                    f"- Data: `{root or 'the fetch cache'}` (mlearn Si + Mo training + test, jarvis_bandgap_50): {n} structures, "
                    f"{atoms:,} atoms; median of {a.repeats} interleaved repeats after one untimed warm-up, "
                    f"one process; both backends give identical edge sets\n"
                    f"- Target: b/a >= 10 for both graph kinds\n\n{table}\n\n{verdict}\n\n{e2e_line}\n"
                    + ("\nProfile (cumulative share of the run):\n\n" + "\n".join(profiles) + "\n"
                       if profiles else "")), topic=TOPIC)


def smoke(count: int = 10) -> None:
    """Both backends on a few structures of the bundled sample (edge sets compared), and one dataset build."""
    path = bundled_crystal_path("mlearn_Si_test")
    structures = list(iter_crystals([path], check_overlap=False))[:count]
    for spec in (GraphSpec(kind="knn", k=25, use_lattice=True),
                 GraphSpec(kind="radius", cutoff=5.0, use_lattice=False)):
        if not same_graphs(build_all(structures, spec, "ase"), build_all(structures, spec, "vesin")):
            sys.exit(f"{spec}: the ASE and vesin backends disagree")
        timed_search(structures, spec)
    with tempfile.TemporaryDirectory(prefix="crystal-bench-") as cache:
        build_crystal_dataset([path], graph=spec, cache_dir=cache, num_proc=1)
    print(f"{len(structures)} structures, both graph kinds and backends agree; smoke run: nothing written")


if __name__ == "__main__":
    main()

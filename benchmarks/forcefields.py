"""Force fields on QM9 minima: milliseconds per molecule and RMS force, per force field available here.

The first `--molecules` (50) molecules of a QM9 extxyz(.gz) file (read as a stream: frame by frame,
never `ase.io.read(path, ":")`), as one padded batch through each adapter's `compute`:

  gfn2 x1     GFN2-xTB (tblite), `workers=1`: in this process, one OpenMP thread
  gfn2 x2     GFN2-xTB, `workers=2`: the process pool (started by an untimed warm-up call)
  sevennet    `ase:sevenn.calculator.SevenNetCalculator` with `model="7net-0"` on CPU, molecule by
              molecule through the ASE adapter (only where `sevenn` is importable: `pip install sevenn`)

Per force field: load time (construction + the first call on 2 molecules), the median over `--repeats`
of the batch time, as ms per molecule; the RMS force over all atoms of the molecules evaluated,
sqrt(mean_i |F_i|^2) in eV/Angstrom (QM9 geometries are B3LYP minima, so this measures how far each
force field's minimum is from DFT's); failed molecules. `--smoke`: 5 molecules, gfn2 with one worker.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import importlib.util
import io
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from bench_report import command_line, cpu_model, utc_now, write_section

from trainer.families.molecules_edm.forcefields import build_forcefield, pad_molecules
from trainer.families.molecules_edm.molecule import Molecule

TOPIC = "Molecules: guidance and force fields"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

DEFAULT_FILE = None
"""--file default: the bundled 3,000 QM9 molecules (the package's sample)."""
BUNDLED = Path(__file__).resolve().parents[1] / "trainer" / "families" / "molecules_edm" / "samples" / "qm9_3k.extxyz.gz"


def stream_molecules(path: str | Path, limit: int) -> Iterator[Molecule]:
    """The first `limit` frames of an xyz/extxyz(.gz) file, parsed one frame at a time."""
    import ase.io

    opener: Callable = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as handle:
        for _ in range(limit):
            count = handle.readline()
            if not count.strip():
                return
            frame = count + "".join(handle.readline() for _ in range(int(count) + 1))
            atoms = ase.io.read(io.StringIO(frame), format="extxyz")
            yield Molecule(atoms.numbers, atoms.positions, {"id": atoms.info.get("qm9_id")})


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def candidates(smoke: bool) -> list[tuple[str, str, dict]]:
    """(label, spec, options) of the force fields to time."""
    runs = [("GFN2-xTB (tblite), 1 worker, in-process", "gfn2", {"workers": 1})]
    if smoke:
        return runs
    runs.append(("GFN2-xTB (tblite), 2 worker processes", "gfn2", {"workers": 2}))
    if importlib.util.find_spec("sevenn") is not None:
        runs.append(("SevenNet-0 (`ase:sevenn.calculator.SevenNetCalculator`, model 7net-0, CPU)",
                     "ase:sevenn.calculator.SevenNetCalculator", {"model": "7net-0", "device": "cpu"}))
    else:
        print("SevenNet-0 skipped: sevenn is not installed (pip install sevenn)", file=sys.stderr)
    return runs


def measure(spec: str, options: dict, batch: tuple[np.ndarray, np.ndarray, np.ndarray], repeats: int) -> dict:
    numbers, positions, mask = batch
    t0 = time.perf_counter()
    ff = build_forcefield(spec, **options)
    ff.compute(numbers[:2], positions[:2], mask[:2])  # warm-up: pool start, lazy imports, model load
    load = time.perf_counter() - t0
    times = []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = ff.compute(numbers, positions, mask)
            times.append(time.perf_counter() - t0)
    finally:
        ff.close()
    atom_ok = mask & result.ok[:, None]
    rms = float(np.sqrt((result.forces[atom_ok] ** 2).sum(-1).mean())) if atom_ok.any() else float("nan")
    seconds = statistics.median(times)
    return {"name": ff.name, "load": load, "ms": 1000 * seconds / len(numbers), "per_s": len(numbers) / seconds,
            "rms": rms, "failed": int((~result.ok).sum()), "n": len(numbers)}


def machine() -> str:
    extra = ""
    if importlib.util.find_spec("sevenn") is not None:
        import torch

        extra = f", sevenn {version('sevenn')}, torch {torch.__version__} ({torch.get_num_threads()} threads)"
    return (f"{cpu_model()}; Python {platform.python_version()}, tblite {version('tblite')}, ase {version('ase')}, "
            f"numpy {np.__version__}{extra}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", default=DEFAULT_FILE, help="QM9 extxyz(.gz); the first --molecules frames are used")
    p.add_argument("--molecules", type=int, default=50, help="molecules per batch")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per force field; median reported")
    p.add_argument("--out", help="add this benchmark's section (machine, command, table) atop its topic in this markdown file")
    p.add_argument("--smoke", action="store_true", help="5 molecules, GFN2-xTB with one worker, one repeat; nothing written")
    a = p.parse_args()
    path = a.file or str(BUNDLED)
    count = 5 if a.smoke else a.molecules
    started = time.perf_counter()
    molecules = list(stream_molecules(path, count))
    batch = pad_molecules(molecules)
    sizes = [m.num_atoms for m in molecules]
    rows = ["| force field | load s (first call incl.) | ms / molecule | molecules / s | RMS force eV/A | failed |",
            "|---|---:|---:|---:|---:|---:|"]
    results = []
    for label, spec, options in candidates(a.smoke):
        r = measure(spec, options, batch, 1 if a.smoke else a.repeats)
        results.append(r)
        rows.append(f"| {label} | {r['load']:.2f} | {r['ms']:.1f} | {r['per_s']:.1f} | {r['rms']:.3f} "
                    f"| {r['failed']} / {r['n']} |")
        print(f"{r['name']}: {r['ms']:.1f} ms/molecule, RMS force {r['rms']:.3f} eV/A", file=sys.stderr)
    table = "\n".join(rows)
    gfn2 = [r for r in results if r["name"] == "gfn2-xtb"]
    speedup = f"; pool of 2 over 1 worker: {gfn2[0]['ms'] / gfn2[1]['ms']:.2f}x" if len(gfn2) == 2 else ""
    summary = (f"{len(molecules)} molecules ({min(sizes)}-{max(sizes)} atoms, mean {np.mean(sizes):.1f}) from `{path}`, "
               f"median of {1 if a.smoke else a.repeats}{speedup}; total {time.perf_counter() - started:.0f} s")
    print(table)
    print(f"\n{summary}")
    if a.smoke:
        print("smoke run: nothing written")
        return
    section = (f"## Force-field benchmark, {utc_now()}\n\n- Machine: {machine()}\n- Command: `{command_line()}`\n"
               f"- Data: {summary}. RMS force = sqrt(mean over atoms of |F|^2) at the QM9 (B3LYP) geometries; "
               "load = construction + the first call on 2 molecules (pool start, model load); the timed calls "
               "evaluate the whole padded batch.\n\n"
               f"{table}\n")
    if a.out:
        write_section(a.out, section, topic=TOPIC)
    else:
        print("\n" + section)


if __name__ == "__main__":
    main()

"""The block-window order (data.shuffle_block, data.shuffle_window) against the full permutation.

Two measurements, printed as tables (nothing is written to BENCHMARKS.md):

  cost    milliseconds to map one million consecutive positions to samples, in the samplers' chunks of 65,536
          positions and in one call, for N samples (default: UniRef50's 60,315,044)
  reads   with `--workdir`: a UniRef50-shaped FASTA of `--records` records (`uniref_fasta.py`) is built once into
          the protein family's memory-mapped Arrow cache; then, one order per child process (pages a process has
          mapped stay cached whatever is dropped), the page cache is dropped (`/proc/sys/vm/drop_caches`: needs
          root; without it the reads are warm and the table says so), `--rows` consecutive positions of epoch 2
          are read row by row (`dataset[i]`, as the training loader does) and the rows/s and the bytes the process
          made the kernel fetch from storage (`/proc/self/io` read_bytes: page faults and read-ahead) are printed.

    .venv/bin/python benchmarks/block_order.py
    .venv/bin/python benchmarks/block_order.py --workdir /tmp/blocks --records 4000000 --rows 3000 65536

`--smoke`: both tables on tiny data in a temporary folder, the page cache left alone.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from trainer.core.samplers import BlockWindowOrder, ShuffledOrder

SETTINGS = [(64, 64), (1024, 64), (4096, 64), (1024, 8)]  # (block, window) of the cost table
READ_SETTINGS = [(256, 64), (1024, 64)]


def orders(n: int, settings: list[tuple[int, int]], epoch: int = 3) -> dict[str, object]:
    found: dict[str, object] = {"full permutation": ShuffledOrder(n, 0, epoch)}
    for block, window in settings:
        found[f"block-window b={block} m={window}"] = BlockWindowOrder(n, 0, epoch, block, window)
    return found


def cost(n: int) -> None:
    def best_ms(order, chunk: int) -> float:
        best = float("inf")
        for rep in range(3):
            first = n // 5 + rep * 2_000_000 if n > 8_000_000 else 0
            last = min(n, first + 1_000_000)
            t0 = time.perf_counter()
            for s in range(first, last, chunk):
                order(np.arange(s, min(s + chunk, last)))
            best = min(best, (time.perf_counter() - t0) * 1e9 / (last - first))  # ms per million
        return best

    print(f"N = {n:,}\n| order | ms per 1M positions (chunks of 65,536) | ms per 1M positions (one call) |\n"
          "|---|---:|---:|")
    for name, order in orders(n, SETTINGS).items():
        print(f"| {name} | {best_ms(order, 65536):.0f} | {best_ms(order, 1_000_000):.0f} |", flush=True)


def fetched_mib() -> float:
    """Bytes this process made the kernel fetch from storage (page faults and read-ahead included)."""
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("read_bytes:")).split()[1]) / 2**20


def drop_caches() -> bool:
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def dataset(workdir: Path, records: int):
    import datasets

    datasets.disable_progress_bars()
    from uniref_fasta import write_uniref_fasta

    from trainer.families.protein_sedd.dataset import build_fasta_dataset

    fasta = workdir / f"uniref50_like_{records}.fasta"
    if not fasta.exists():
        write_uniref_fasta(fasta, records)
    ds, _ = build_fasta_dataset(str(fasta), cache_dir=str(workdir / "cache"), val_fraction=0.0, num_proc=1)
    return ds


def read_one(workdir: Path, records: int, rows: int, name: str, drop: bool = True) -> None:
    """Child process: read `rows` positions of epoch 2 in order `name` from a cold cache; print one table row."""
    ds = dataset(workdir, records)
    found = {"sequential (identity)": None, **orders(len(ds), READ_SETTINGS, epoch=2)}
    order, first = found[name], len(ds) // 3
    positions = np.arange(first, first + rows)
    samples = positions if order is None else order(positions)
    cold = drop and drop_caches()
    before, t0 = fetched_mib(), time.perf_counter()
    for i in samples.tolist():
        ds[i]
    seconds = time.perf_counter() - t0
    print(f"| {name} | {rows:,} | {rows / seconds:,.0f} | {fetched_mib() - before:,.0f} |"
          f"{'' if cold else ' (warm: could not drop the page cache)'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=60_315_044, help="samples of the cost table")
    parser.add_argument("--workdir", help="where the FASTA and its Arrow cache are written (the reads table)")
    parser.add_argument("--records", type=int, default=4_000_000, help="records of the FASTA (4 M: ~2.8 GiB Arrow)")
    parser.add_argument("--rows", type=int, nargs="+", default=[3000, 65536], help="positions read per order")
    parser.add_argument("--smoke", action="store_true", help="tiny data, page cache left alone, then exit")
    parser.add_argument("--read-one", nargs=2, metavar=("ROWS", "ORDER"), help=argparse.SUPPRESS)
    a = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if a.read_one:
        read_one(Path(a.workdir), a.records, int(a.read_one[0]), a.read_one[1], drop=not a.smoke)
        return
    if a.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            a.n, a.workdir, a.records, a.rows = 200_000, tmp, 3000, [300]
            run(a)
        print("smoke run: nothing written")
        return
    run(a)


def run(a: argparse.Namespace) -> None:
    cost(a.n)
    if a.workdir:
        work = Path(a.workdir)
        work.mkdir(parents=True, exist_ok=True)
        ds = dataset(work, a.records)
        size = sum(Path(f["filename"]).stat().st_size for f in ds.cache_files) / 2**30
        print(f"\n{len(ds):,} rows, {size:.1f} GiB of Arrow\n| order | rows read | rows/s (cold cache) | "
              "MiB fetched from storage |\n|---|---:|---:|---:|", flush=True)
        names = ["sequential (identity)", "full permutation"] + [f"block-window b={b} m={m}" for b, m in READ_SETTINGS]
        for rows in a.rows:
            for name in names:
                subprocess.run([sys.executable, __file__, "--workdir", a.workdir, "--records", str(a.records),
                                "--read-one", str(rows), name, *(["--smoke"] if a.smoke else [])], check=True)


if __name__ == "__main__":
    main()

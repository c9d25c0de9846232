"""Cost of the training samplers (trainer/core/samplers.py) as the data set grows.

For each N, one rank of W (CPU time of this process, `time.process_time`, and the tracemalloc peak, which
counts NumPy's buffers and Python objects but not torch's):

  fixed-first   rank 0's first batch of an epoch (what a start or a resume pays before its first step)
  fixed-epoch   rank 0's whole epoch share (N / W samples)
  balanced      rank 0's whole epoch share in data.batching=balanced
  budget-plan   the budget plan of one epoch (data.batching=budget), built by every rank
  budget-resume `position()` of a run resumed in epoch 3 (a fresh sampler, which built epoch 0 at start)

Sizes are drawn like UniRef50 lengths (log-normal, mean about 290, cropped to the budget). `--old FILE`
times another samplers.py instead (e.g. `git show REV:trainer/core/samplers.py > /tmp/old.py`), to
compare versions on the same machine; a case that would take longer than `--max-samples` samples is skipped.

    .venv/bin/python benchmarks/samplers.py --sizes 100000 1000000 --world 8

It prints a table and writes nothing (figures are copied into BENCHMARKS.md by hand).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
import tracemalloc

import numpy as np


def load(path: str | None):
    if path is None:
        from trainer.core import samplers
        return samplers
    spec = importlib.util.spec_from_file_location("samplers_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(fn) -> tuple[float, float]:
    """(CPU seconds, peak traced MiB) of fn()."""
    tracemalloc.start()
    start = time.process_time()
    try:
        fn()
        return time.process_time() - start, tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**5, 10**6])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="per-device batch (fixed and balanced)")
    parser.add_argument("--max-units", type=int, default=8192, help="tokens per micro-batch (budget)")
    parser.add_argument("--old", help="a samplers.py to time instead of the installed one")
    parser.add_argument("--cases", nargs="+", default=["fixed-first", "fixed-epoch", "balanced", "budget-plan",
                                                       "budget-resume"])
    parser.add_argument("--max-samples", type=int, default=10**9, help="skip whole-epoch cases above this N")
    parser.add_argument("--smoke", action="store_true", help="every case once on tiny data (a test that it runs)")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.world, args.batch, args.max_units = [3000], 2, 4, 256
    s = load(args.old)
    print(f"samplers: {args.old or 'trainer.core.samplers'}; world {args.world}, batch {args.batch}, "
          f"budget {args.max_units}")
    print(f"{'case':<14} {'N':>12} {'cpu s':>9} {'peak MiB':>9}")
    for n in args.sizes:
        for name in args.cases:
            if name != "fixed-first" and n > args.max_samples:
                continue
            seconds, peak = measure(prepare(s, name, n, args))
            print(f"{name:<14} {n:>12} {seconds:>9.3f} {peak:>9.1f}", flush=True)
    if args.smoke:
        print("smoke run: nothing written")


def prepare(s, name: str, n: int, args: argparse.Namespace):
    """The timed call of case `name` at N = n (set-up done here, outside the timing)."""
    world, batch = args.world, args.batch
    if name.startswith("fixed"):
        batches = s.RankBatchSampler(s.EpochSampler(n, 0, multiple_of=batch * world), batch, 0, world)
        batches.set_epoch(1)
        return (lambda: next(iter(batches))) if name == "fixed-first" else (lambda: sum(1 for _ in batches))
    sizes = np.minimum(np.random.default_rng(0).lognormal(5.4, 0.7, size=n).astype(np.int64) + 1, args.max_units)
    if name == "balanced":
        return lambda: sum(1 for _ in s.BalancedBatchSampler(sizes, mode="balanced", batch_size=batch, seed=0,
                                                             rank=0, world_size=world))

    def budget():
        return s.BalancedBatchSampler(sizes, mode="budget", max_units=args.max_units, seed=0, rank=0,
                                      world_size=world)

    if name == "budget-plan":
        return lambda: len(budget())
    lengths = sum(len(budget().plan(e)) for e in range(3))
    fresh = budget()  # its epoch 0 plan is built here: the resume pays for epochs 1 and 2
    return lambda: fresh.position(lengths + 1)

if __name__ == "__main__":
    main()

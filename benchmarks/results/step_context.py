"""What the batch fetch between steps does to `train_step`: `python step_context.py` (run from the checkout's root).

The record behind BENCHMARKS.md's "Overhead benchmark (paired processes)" reading: on overhead.py's tiny config
(64-32x3-8 MLP, batch 16, guard off), the thread CPU time of the fetches themselves (our Trainer's
`micro_batches`, the plain loop's DataLoader, `SampleRandom.for_samples` of 16 rows), then of `train_step` on
pre-fetched batches right after nothing, a `SampleRandom` derivation, one of our fetches or one plain fetch (the
fetch untimed; the four taking turns). Medians. A record of a measurement, not a benchmark script (no --smoke).
"""

import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: overhead.py's configs and loops
from overhead import CONFIGS, our_trainer, plain_loop  # noqa: E402

from trainer.sample_random import SampleRandom  # noqa: E402

logging.getLogger("trainer").setLevel(logging.WARNING)
torch.set_num_threads(1)
c = CONFIGS["overhead"]
trainer = our_trainer(c, 10**9, tempfile.mkdtemp(), ("train.skip_nonfinite=false",))
micro = trainer.data.micro_batches(0)
pre = [next(micro) for _ in range(64)]
plain_batches, _ = plain_loop(c)


def median_us(fn, n=3000):
    times = []
    for _ in range(n):
        t0 = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - t0)
    return statistics.median(times[n // 10:]) / 1e3


print(f"fetch: ours {median_us(lambda: next(micro)):.1f} us, plain {median_us(lambda: next(plain_batches)):.1f} us, "
      f"SampleRandom.for_samples(16 rows) {median_us(lambda: SampleRandom.for_samples(0, 0, np.arange(16))):.1f} us")
before = {"nothing (pre-fetched)": lambda i: None,
          "a SampleRandom derivation": lambda i: SampleRandom.for_samples(0, i, np.arange(16)),
          "our fetch": lambda i: next(micro), "a plain fetch": lambda i: next(plain_batches)}
times = {k: [] for k in before}
for i in range(2500):
    for k, fetch in before.items():
        fetch(i)
        batch = [pre[i % 64]]
        t0 = time.thread_time_ns()
        trainer.train_step(batch)
        times[k].append(time.thread_time_ns() - t0)
for k, v in times.items():
    print(f"train_step after {k:26s} {statistics.median(v[300:]) / 1e3:7.1f} us")

"""Median thread-CPU time (us) of `Trainer.train_step` alone: `python train_step_cost_ab.py HIDDEN BATCH`.

The before/after record of BENCHMARKS.md ("Overhead before and after the engine refactor"): run it in
processes alternating between two checkouts (`PYTHONPATH=<other worktree>` for the other one), e.g.
`for i in 1 2 3 4 5; do PYTHONPATH=../base python ...py 32 16; python ...py 32 16; done`, so the
machine's load drifts over both alike. A record of a measurement, not a benchmark script (no --smoke).
"""

import statistics
import sys
import tempfile
import time

import torch

import trainer.families.regression  # noqa: F401  registers the task (older checkouts: before the entry points)
from trainer.config import load_config
from trainer.core.trainer import Trainer

torch.set_num_threads(1)
hidden, batch = sys.argv[1], int(sys.argv[2])
out = tempfile.mkdtemp()
cfg = load_config(None, ["task.preset=tiny", "task.in_dim=64", f"task.hidden={hidden}", "task.depth=3", "task.out_dim=8",
                         "task.num_train=4096", f"train.per_device_batch_size={batch}", "train.max_steps=100000",
                         f"run.output_dir={out}", "log.progress_bar=false", "log.tensorboard=false", "optim.lr=1e-3",
                         "train.grad_clip_norm=1.0"])
tr = Trainer(cfg)
micro = tr.data.micro_batches(0)
batches = [next(micro) for _ in range(64)]
times = []
for i in range(3000):
    b = batches[i % 64]
    t0 = time.thread_time_ns()
    tr.train_step([b])
    times.append(time.thread_time_ns() - t0)
    if i % 50 == 49:
        (tr.engine.guard if hasattr(tr, "engine") else tr.guard).read()  # a logging step's read
print(statistics.median(times[200:]) / 1000)

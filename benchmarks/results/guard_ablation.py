"""Which part of the non-finite step guard costs what: `python guard_ablation.py HIDDEN BATCH STEPS`.

The record behind BENCHMARKS.md's "Overhead benchmark (paired processes)" reading: five copies of the same
64-HIDDENx3-8 MLP with fused AdamW, in one process, their steps taking turns one by one (thread CPU time,
medians): no guard, the backward seed alone, the flag alone (found_inf reset before the optimizer step), the
flag handed to the optimizer as found_inf, and the whole guard. A record of a measurement, not a benchmark
script (no --smoke).
"""

import statistics
import sys
import time

import torch

from trainer.core.step_guard import StepGuard
from trainer.families.regression.task import build_mlp

torch.set_num_threads(1)
hidden, batch, steps = (int(a) for a in sys.argv[1:4])
x, y = torch.randn(batch, 64), torch.randn(batch, 8)
VARIANTS = {  # (seed, flag, found_inf)
    "no guard": (False, False, False), "seed only": (True, False, False), "flag only": (False, True, False),
    "flag + found_inf": (False, True, True), "whole guard": (True, True, True)}


def make():
    torch.manual_seed(0)
    net = build_mlp(64, hidden, 8, 3)
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, fused=True)
    return net, params, opt, StepGuard(opt, active=True, max_in_row=10**9)


setups = {k: make() for k in VARIANTS}


def step(k):
    net, params, opt, guard = setups[k]
    seed_on, flag_on, found_inf_on = VARIANTS[k]
    loss = (net(x) - y).pow(2).mean()
    loss.backward(guard.backward_seed(loss) if seed_on else None)
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True).detach()
    if flag_on:
        guard.flag(norm)
        if not found_inf_on:
            opt.found_inf = None
    opt.step()
    opt.zero_grad(set_to_none=True)
    if len(guard._flags) >= 50:
        guard.read()


times = {k: [] for k in VARIANTS}
keys = list(VARIANTS)
for i in range(steps + 100):
    for k in keys[i % 5:] + keys[:i % 5]:
        t0 = time.thread_time_ns()
        step(k)
        if i >= 100:
            times[k].append(time.thread_time_ns() - t0)
base = statistics.median(times["no guard"])
for k, v in times.items():
    print(f"{k:18s} {statistics.median(v) / 1e3:8.1f} us  {100 * (statistics.median(v) / base - 1):+5.1f}%")

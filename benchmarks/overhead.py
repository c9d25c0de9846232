"""Per-step training overhead of our Trainer, against a plain PyTorch loop and transformers.Trainer.

One process on CPU, fp32. Three ways train the same MLP (`build_mlp` of the regression task,
identical initial weights from the same seed) on the same `SyntheticRegression` data with the same
optimizer (AdamW fused, weight decay 0, lr 1e-3 constant, no warm-up), batch size and gradient
clipping at 1.0:

  (a) plain  a hand-written loop: DataLoader, forward, MSE, backward, clip_grad_norm_,
             optimizer.step(), scheduler.step(), zero_grad(set_to_none=True); no host sync.
  (b) ours   `trainer.core.trainer.Trainer(cfg).fit()` (log.every_steps=50, no eval/checkpoint during
             the run). We time `fit()` itself, not a copy of its loop, so every per-step cost of
             the real loop counts (data, train_step, window bookkeeping, progress bar, preemption
             check, logging at every 50th step). `evaluate` and `save` are replaced by no-ops so the
             final eval/checkpoint cost nothing, and `train_step` is wrapped to read the clock as
             step warmup+1 and step warmup+steps+1 begin: the time between is exactly `steps`
             iterations of fit's loop (max_steps = warmup+steps+1, so the last-step log is outside).
  (b0)       as (b) with train.skip_nonfinite=false: b/b0 is the cost of the non-finite-step guard
             (a backward seed, one flag from the clipped norm, the fused optimizer's `found_inf`),
             which the plain loop and HF Trainer do not have.
  (c) hf     `transformers.Trainer.train()` (logging_steps=50, no save/eval, PrinterCallback
             removed); a callback reads the clock at the end of step warmup and step warmup+steps.

Each (config, method) is measured `--repeats` times, a/b/c interleaved, each with a fresh model,
optimizer and run; the tables give the median steps/s. Each timed window is read by two clocks: the
CPU time of this process (`time.process_time`; one torch thread, no loader workers, so it is the
work of the loop, and it does not count the time other processes of a shared machine hold the
core) and the wall clock (what a user waits; on an otherwise idle machine both agree). Three
configs, from a step where the math dominates (`compute`) to a small model and batch where the
frameworks' per-step Python work dominates (`overhead`, the tiny one), with `medium` between.

Separate runs of a shared machine differ by more than the guard costs; so b/a and the guard are also
measured in one process (`--guard-steps`): the plain loop's step and two of our Trainers, with and
without the guard, their steps taking turns one by one, each timed by the thread's CPU time.

Paired mode (`--paired N`) ranks versions on a noisy machine. Each measurement is a fresh process
that times one (config, method): the thread CPU time of each step alone (for (b) and (b0) the
`train_step` that `fit()` calls, for (a) the same work of the plain loop: forward to zero_grad,
not fetching the batch), the median over the timed steps, and the process CPU time of the whole
loop window per step. N pairs alternate a, b, b0 (and the other tree's b) in turns, reversing the
order every pair, so the machine's load drifts over all sides alike; the tables give the median of
the per-pair ratios and their spread (min-max and the inter-quartile range). `--versus PATH` adds
(v): (b) run with PYTHONPATH=PATH, another checkout of this package, so "before and after a
change" is measured paired: b/v > 1 means this tree's step is cheaper.

Targets: b/a >= 0.97 on every config (our loop costs at most 3% over hand-written PyTorch), b/c >=
1.0, and the non-finite guard at most 2% of the tiny (`overhead`) config's step.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import accelerate
import torch
from accelerate.utils import set_seed
from bench_report import command_line, cpu_model, utc_now, write_section
from torch import nn
from torch.utils.data import DataLoader

from trainer.config import load_config
from trainer.core.trainer import Trainer
from trainer.families.regression.task import RegressionConfig, SyntheticRegression, build_mlp

TOPIC = "Loop overhead: against a hand-written loop and the HF Trainer"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

SEED = 0
GUARD_BLOCK = 250  # steps per block of the guard measurement: its spread is that of the blocks' ratios
ROOT = Path(__file__).resolve().parents[1]  # the checkout this script belongs to
LR, CLIP, LOG_EVERY = 1e-3, 1.0, 50
CONFIGS = {  # name: model and batch; num_train is a multiple of every batch (no partial batches)
    "compute": dict(in_dim=64, hidden=512, depth=3, out_dim=8, batch=128, num_train=4096),
    "medium": dict(in_dim=64, hidden=256, depth=3, out_dim=8, batch=64, num_train=4096),
    "overhead": dict(in_dim=64, hidden=32, depth=3, out_dim=8, batch=16, num_train=4096),
}


def stamp() -> tuple[float, float]:
    """(wall clock, CPU time of this process): the CPU time does not count the time other processes of
    a shared machine hold the core, the wall clock does."""
    return time.perf_counter(), time.process_time()


def rates(steps: int, start: tuple[float, float], end: tuple[float, float]) -> dict[str, float]:
    """Steps/s between two stamps, by each clock."""
    return {"cpu": steps / (end[1] - start[1]), "wall": steps / (end[0] - start[0])}


def describe(c: dict) -> str:
    return f"{c['in_dim']}-{c['hidden']}x{c['depth']}-{c['out_dim']} MLP, batch {c['batch']}"


def dataset(c: dict) -> SyntheticRegression:
    rc = RegressionConfig(num_train=c["num_train"], in_dim=c["in_dim"], hidden=c["hidden"],
                          depth=c["depth"], out_dim=c["out_dim"])
    return SyntheticRegression(rc, rc.num_train, 0)


def model(c: dict) -> nn.Sequential:
    set_seed(SEED)  # what our Trainer does before task.build_model()
    return build_mlp(c["in_dim"], c["hidden"], c["out_dim"], c["depth"])


def plain_loop(c: dict):
    """(endless batches, step(batch)): the hand-written loop (a), its batch fetch apart from its step."""
    net = model(c)
    loader = DataLoader(dataset(c), batch_size=c["batch"], shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(SEED))
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    def endless():
        while True:
            yield from loader

    batches = endless()
    net.train()

    def step(batch: dict) -> None:
        loss = (net(batch["x"]) - batch["y"]).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    return batches, step


def run_plain(c: dict, steps: int, warmup: int, workdir: str) -> dict[str, float]:  # noqa: ARG001
    batches, step = plain_loop(c)
    for _ in range(warmup):
        step(next(batches))
    start = stamp()
    for _ in range(steps):
        step(next(batches))
    return rates(steps, start, stamp())


def time_plain(c: dict, steps: int, warmup: int, workdir: str) -> tuple[dict[str, float], list[int]]:  # noqa: ARG001
    """As `run_plain`, and the thread CPU time (ns) of each timed step without its batch fetch."""
    batches, step = plain_loop(c)
    for _ in range(warmup):
        step(next(batches))
    per_step = []
    start = stamp()
    for _ in range(steps):
        batch = next(batches)
        t0 = time.thread_time_ns()
        step(batch)
        per_step.append(time.thread_time_ns() - t0)
    return rates(steps, start, stamp()), per_step


def our_trainer(c: dict, max_steps: int, output_dir: str, extra: tuple[str, ...] = ()) -> Trainer:
    return Trainer(load_config(None, [
        *extra, "task.name=regression", f"task.num_train={c['num_train']}", f"task.in_dim={c['in_dim']}",
        f"task.hidden={c['hidden']}", f"task.depth={c['depth']}", f"task.out_dim={c['out_dim']}",
        "task.num_eval=8", f"train.max_steps={max_steps}", f"train.per_device_batch_size={c['batch']}",
        "train.grad_accum_steps=1", f"optim.lr={LR}", "optim.scheduler=constant", "optim.warmup_steps=0",
        f"train.grad_clip_norm={CLIP}", "eval.every_steps=0", "ckpt.every_steps=0",
        f"log.every_steps={LOG_EVERY}", "log.tensorboard=false", "log.progress_bar=false",
        f"run.output_dir={output_dir}", "run.resume=none", f"run.seed={SEED}"]))


def run_ours(c: dict, steps: int, warmup: int, workdir: str, extra: tuple[str, ...] = ()) -> dict[str, float]:
    return time_ours(c, steps, warmup, workdir, extra)[0]


def time_ours(c: dict, steps: int, warmup: int, workdir: str,
              extra: tuple[str, ...] = ()) -> tuple[dict[str, float], list[int]]:
    """Steps/s of `fit()`'s loop, and the thread CPU time (ns) of each timed `train_step` call."""
    trainer = our_trainer(c, warmup + steps + 1, f"{workdir}/ours", extra)
    clock: dict[str, tuple[float, float]] = {}
    calls = 0
    per_step: list[int] = []
    train_step = trainer.train_step

    def timed_train_step(batches):
        nonlocal calls
        calls += 1
        if calls == warmup + 1:
            clock["start"] = stamp()
        elif calls == warmup + steps + 1:
            clock["end"] = stamp()
        t0 = time.thread_time_ns()
        stats = train_step(batches)
        if warmup < calls <= warmup + steps:
            per_step.append(time.thread_time_ns() - t0)
        return stats

    trainer.train_step = timed_train_step
    trainer.evaluate = lambda split="eval": {}
    trainer.save = lambda best=False: None
    trainer.fit()
    return rates(steps, clock["start"], clock["end"]), per_step


def alternating_cost(c: dict, steps: int, workdir: str) -> dict[str, list[int]]:
    """Thread CPU ns of each step of (a) the plain loop's step, (b) our `train_step` and (b0) ours without the
    non-finite guard, in this process, their steps taking turns one by one (the order rotating): all sides
    see the same machine at the same moments, which separate runs of a shared machine do not."""
    trainers = {k: our_trainer(c, 10**9, f"{workdir}/alternating-{k}", extra)
                for k, extra in (("b", ()), ("b0", ("train.skip_nonfinite=false",)))}
    batches = {k: t.data.micro_batches(0) for k, t in trainers.items()}
    plain_batches, plain_step = plain_loop(c)
    sides = ["a", *trainers]
    times: dict[str, list[int]] = {k: [] for k in sides}
    for i in range(steps + 20):
        for k in sides[i % 3:] + sides[:i % 3]:
            if k == "a":
                batch = next(plain_batches)
                t0 = time.thread_time_ns()
                plain_step(batch)
            else:
                batch = [next(batches[k])]
                t0 = time.thread_time_ns()
                trainers[k].train_step(batch)
            if i >= 20:  # warm-up
                times[k].append(time.thread_time_ns() - t0)
            if k != "a" and i % LOG_EVERY == 0:
                trainers[k].engine.guard.read()  # what a logging step does; the flags do not pile up
    return times


def block_ratios(times: dict[str, list[int]], x: str, y: str) -> list[float]:
    """Median time of y over median time of x in each block of GUARD_BLOCK alternating steps."""
    return [statistics.median(times[y][i:i + GUARD_BLOCK]) / statistics.median(times[x][i:i + GUARD_BLOCK])
            for i in range(0, len(times[x]), GUARD_BLOCK)]


def run_hf(c: dict, steps: int, warmup: int, workdir: str) -> dict[str, float]:
    import transformers  # here, not at the top: a paired-mode child process never needs it
    from transformers import Trainer as HFTrainer
    from transformers import TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    class Clock(TrainerCallback):
        def __init__(self, first: int, last: int):
            self.first, self.last, self.times = first, last, {}

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (self.first, self.last):
                self.times[state.global_step] = stamp()

    transformers.logging.set_verbosity_error()
    args = TrainingArguments(
        output_dir=f"{workdir}/hf", max_steps=warmup + steps, per_device_train_batch_size=c["batch"],
        learning_rate=LR, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=CLIP, optim="adamw_torch_fused", logging_steps=LOG_EVERY, save_strategy="no",
        eval_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        seed=SEED, remove_unused_columns=False)
    clock = Clock(warmup, warmup + steps)
    trainer = HFTrainer(model=_MSE(model(c)), args=args, train_dataset=dataset(c), callbacks=[clock])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return rates(steps, clock.times[warmup], clock.times[warmup + steps])


class _MSE(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y, index=None):  # noqa: ARG002
        return {"loss": (self.net(x) - y).pow(2).mean()}


CLOCKS = ("cpu", "wall")
METHODS = {"a": run_plain, "b": run_ours, "b0": functools.partial(run_ours, extra=("train.skip_nonfinite=false",)),
           "c": run_hf}
STEP_TIMERS = {"a": time_plain, "b": time_ours, "b0": functools.partial(time_ours, extra=("train.skip_nonfinite=false",))}


def machine() -> str:
    import transformers

    cpu = cpu_model()
    return (f"{cpu}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"accelerate {accelerate.__version__}, transformers {transformers.__version__}")


def load() -> str:
    """The load averages (1, 5, 15 min), as `uptime` shows them."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def measure_in_child(method: str, name: str, steps: int, warmup: int, threads: int) -> None:
    """Paired mode's child process: print one JSON line, the median thread CPU us of a step and the
    process CPU us per step of the whole loop window."""
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="overhead-") as workdir:
        sps, per_step = STEP_TIMERS[method](CONFIGS[name], steps, warmup, workdir)
    print(json.dumps({"step_us": statistics.median(per_step) / 1e3, "loop_us": 1e6 / sps["cpu"]}))


def run_child(side: str, tree: Path, name: str, a: argparse.Namespace) -> dict[str, float]:
    """One paired-mode measurement in a fresh process that imports `trainer` from `tree`."""
    method = "b" if side == "v" else side
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(a.threads))
    cmd = [sys.executable, __file__, "--child", method, "--configs", name, "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--threads", str(a.threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"paired measurement ({side}) of {name} with trainer from {tree} failed "
                 f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spread(values: list[float], fmt: str = ".3f") -> str:
    """`median (min-max; IQR q1-q3)` of per-pair values."""
    if len(values) < 2:
        return f"{values[0]:{fmt}}"
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (f"{statistics.median(values):{fmt}} ({min(values):{fmt}} to {max(values):{fmt}}; "
            f"IQR {q1:{fmt}} to {q3:{fmt}})")


def paired(names: list[str], a: argparse.Namespace) -> tuple[str, str]:
    """(table, notes) of `--paired` pairs of child processes per config, sides alternating."""
    sides = ["a", "b", "b0"] + (["v"] * bool(a.versus))
    trees = {"a": ROOT, "b": ROOT, "b0": ROOT, "v": Path(a.versus).resolve() if a.versus else ROOT}
    # times[config][side][clock]: us of each pair
    times = {n: {s: {"step_us": [], "loop_us": []} for s in sides} for n in names}
    for i in range(a.paired):
        for name in names:
            for side in sides if i % 2 == 0 else sides[::-1]:
                got = run_child(side, trees[side], name, a)
                for k, v in got.items():
                    times[name][side][k].append(v)
                print(f"pair {i + 1}/{a.paired} {name:8s} ({side}) train_step {got['step_us']:8.1f} us thread CPU, "
                      f"loop {got['loop_us']:8.1f} us/step process CPU", file=sys.stderr)
    # Each ratio is steps/s over steps/s, i.e. the inverse of the times' ratio, taken within each pair.
    ratios = {"b/a": ("a", "b"), "b0/a": ("a", "b0"), "b/b0": ("b0", "b")} | ({"b/v": ("v", "b")} if a.versus else {})
    head = ["config", *(f"({s}) step us" for s in sides), *(f"{r} step" for r in ratios), "guard % of the step",
            "b/a whole loop"]
    rows = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for name in names:
        t = times[name]
        per = {r: [t[x]["step_us"][i] / t[y]["step_us"][i] for i in range(a.paired)] for r, (x, y) in ratios.items()}
        guard = [100 * (t["b"]["step_us"][i] / t["b0"]["step_us"][i] - 1) for i in range(a.paired)]
        loop = [t["a"]["loop_us"][i] / t["b"]["loop_us"][i] for i in range(a.paired)]
        rows.append(f"| {name}: {describe(CONFIGS[name])} | "
                    + " | ".join(f"{statistics.median(t[s]['step_us']):.1f}" for s in sides) + " | "
                    + " | ".join(spread(v) for v in per.values()) + f" | {spread(guard, '+.1f')} | {spread(loop)} |")
    notes = (f"{a.paired} pairs of processes per config, each process one measurement: {a.steps} timed steps after "
             f"{a.warmup} warm-up; the order of the sides alternates ({' '.join(sides)}, then reversed). "
             "Step: median thread CPU time of `train_step` (of the plain loop's step for (a)). Whole loop: process CPU "
             "time per step of fit's loop window (data, bookkeeping and logging steps included). Ratios: steps/s over "
             "steps/s within each pair, median (min to max; IQR q1 to q3); guard: b over b0 of the step, in per cent.")
    if a.versus:
        notes += f" (v): (b) with `trainer` imported from {trees['v']}; b/v > 1: this tree's step is cheaper."
    return "\n".join(rows), notes


def interleaved(names: list[str], a: argparse.Namespace) -> tuple[str, str]:
    """(table, notes) of `--repeats` runs of a, b, b0 and c in this process, interleaved."""
    # results[clock][config][method]: steps/s of each repeat
    results = {clk: {n: {m: [] for m in METHODS} for n in names} for clk in CLOCKS}
    with tempfile.TemporaryDirectory(prefix="overhead-") as workdir:
        for r in range(a.repeats):
            for name in names:
                for key, fn in METHODS.items():
                    torch.set_num_threads(a.threads)  # frameworks must not change it between runs
                    sps = fn(CONFIGS[name], a.steps, a.warmup, workdir)
                    for clk in CLOCKS:
                        results[clk][name][key].append(sps[clk])
                    print(f"repeat {r + 1}/{a.repeats} {name:8s} ({key}) {sps['cpu']:8.1f} steps/s CPU time, "
                          f"{sps['wall']:8.1f} wall", file=sys.stderr)

    rows = ["| config | (a) plain steps/s | (b) ours steps/s | (b0) ours, no non-finite guard "
            "| (c) HF Trainer steps/s | b/a | b0/a | b/b0 | b/c |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    wall, spreads = [], []
    for name in names:
        med = {k: statistics.median(v) for k, v in results["cpu"][name].items()}
        rows.append(f"| {name}: {describe(CONFIGS[name])} | {med['a']:.1f} | {med['b']:.1f} | {med['b0']:.1f} "
                    f"| {med['c']:.1f} | {med['b'] / med['a']:.3f} | {med['b0'] / med['a']:.3f} "
                    f"| {med['b'] / med['b0']:.3f} | {med['b'] / med['c']:.3f} |")
        w = {k: statistics.median(v) for k, v in results["wall"][name].items()}
        wall.append(f"{name} b/a {w['b'] / w['a']:.3f}, b/b0 {w['b'] / w['b0']:.3f}, b/c {w['b'] / w['c']:.3f}")
        # The noise: each method's repeats as (max - min) / median.
        spreads.append(f"{name} " + ", ".join(f"{k} {(max(v) - min(v)) / statistics.median(v):.0%}"
                                              for k, v in results["cpu"][name].items()))
    notes = ("Spread of the repeats (CPU time), (max - min) / median: " + "; ".join(spreads)
             + ".\n\nThe same windows by the wall clock: " + "; ".join(wall) + ".")
    return "\n".join(rows), notes


def alternating_line(names: list[str], a: argparse.Namespace) -> str:
    """b/a and the guard's cost per config, a, b and b0 in this process, steps alternating."""
    parts = []
    with tempfile.TemporaryDirectory(prefix="overhead-") as workdir:
        for name in names:
            torch.set_num_threads(a.threads)
            times = alternating_cost(CONFIGS[name], a.guard_steps, workdir)
            med = {k: statistics.median(v) / 1e3 for k, v in times.items()}
            ba, guard = block_ratios(times, "b", "a"), block_ratios(times, "b0", "b")
            parts.append(f"{name}: a {med['a']:.0f} us, b {med['b']:.0f} us, b0 {med['b0']:.0f} us; "
                         f"b/a {med['a'] / med['b']:.3f} (blocks {min(ba):.3f} to {max(ba):.3f}); guard "
                         f"{med['b'] - med['b0']:+.1f} us ({med['b'] / med['b0'] - 1:+.1%}; blocks "
                         f"{min(guard) - 1:+.1%} to {max(guard) - 1:+.1%})")
    return (f"In one process, steps alternating (a's step, b's and b0's `train_step` in turn, {a.guard_steps} each; "
            f"medians of the thread's CPU time; blocks of {GUARD_BLOCK} steps give the spread): "
            + "; ".join(parts) + ".")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="timed optimizer steps per measurement")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before each measurement")
    p.add_argument("--repeats", type=int, default=3, help="measurements per (config, method); median reported")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for stable numbers")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    p.add_argument("--guard-steps", type=int, default=2000,
                   help="steps per side of the in-process measurement (a, b, b0 steps alternating: b/a and the "
                        "guard's cost) per config (0: skip it)")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="paired mode: N pairs of processes per config, a, b and b0 alternating, train_step's CPU time "
                        "(instead of --repeats in this process; no (c))")
    p.add_argument("--versus", metavar="PATH",
                   help="with --paired: also (v), our Trainer imported from another checkout at PATH")
    p.add_argument("--child", choices=sorted(STEP_TIMERS), help=argparse.SUPPRESS)  # one paired-mode measurement
    p.add_argument("--out", help="add this benchmark's section (machine, command, table) atop its topic in this markdown file")
    p.add_argument("--smoke", action="store_true",
                   help="a few steps of the smallest config, one repeat (one pair), nothing written: checks the script "
                        "runs")
    a = p.parse_args()
    if a.versus and not a.paired:
        p.error("--versus needs --paired N")
    if a.versus and not (Path(a.versus) / "trainer" / "__init__.py").is_file():
        p.error(f"--versus {a.versus}: no trainer package there (expected {Path(a.versus) / 'trainer' / '__init__.py'})")
    if a.smoke:
        a.steps, a.warmup, a.repeats, a.configs, a.out, a.guard_steps = 3, 2, 1, "overhead", None, 5
        a.paired = min(a.paired, 1)
    elif a.steps <= LOG_EVERY and not a.child:
        p.error(f"--steps must exceed {LOG_EVERY} so that (b) and (c) log inside the timed steps")
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    if unknown := [n for n in names if n not in CONFIGS]:
        p.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")

    warnings.filterwarnings("ignore")
    logging.getLogger("trainer").setLevel(logging.WARNING)
    if a.child:
        measure_in_child(a.child, names[0], a.steps, a.warmup, a.threads)
        return
    started, load_before = time.perf_counter(), load()
    table, notes = paired(names, a) if a.paired else interleaved(names, a)
    if a.guard_steps:
        notes += "\n\n" + alternating_line(names, a)
    elapsed = time.perf_counter() - started
    print(table)
    how = (f"{a.paired} pairs" if a.paired else f"median of {a.repeats}")
    print(f"\n{notes}\n{a.steps} timed steps after {a.warmup} warm-up, {how}, {a.threads} thread(s); "
          f"load average {load_before} before, {load()} after; total {elapsed:.0f} s")
    if a.smoke:
        print("smoke run: nothing written")
    elif a.out:
        title = "Overhead benchmark (paired processes)" if a.paired else "Overhead benchmark"
        setup = (f"{a.paired} pairs of processes per config, sides alternating, {a.steps} timed optimizer steps "
                 f"after {a.warmup} warm-up steps each" if a.paired else
                 f"{a.steps} timed optimizer steps after {a.warmup} warm-up steps, median of {a.repeats} interleaved "
                 f"repeats")
        clock = ("thread CPU time of the step, process CPU time of the whole loop" if a.paired else
                 "steps/s by the process's CPU time (the wall clock below)")
        write_section(a.out, f"## {title}, {utc_now()}\n\n- Machine: {machine()}\n"
                             f"- Load average (1, 5, 15 min): {load_before} before, {load()} after\n"
                             f"- Command: `{command_line()}`\n"
                             f"- {setup}, torch threads = {a.threads}, fp32; {clock}\n"
                             f"- Targets: b/a >= 0.97 on every config, b/c >= 1.0, the guard <= 2% of the "
                             f"`overhead` config's step\n\n{table}\n\n{notes}\n", topic=TOPIC)


if __name__ == "__main__":
    main()

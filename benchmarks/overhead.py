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
configs: `compute` (~7 ms of compute per step on one thread: the math dominates), `medium` (~2 ms)
and `overhead` (a small model and batch, ~0.6 ms: the frameworks' per-step Python work dominates).

Separate runs of a shared machine differ by several per cent, more than the guard costs; so the
guard is also measured on its own (`--guard-steps`): two of our Trainers, with and without it, in one
process, their `train_step`s alternating one by one, each timed by the thread's CPU time.

Targets: b/a >= 0.98 (our loop costs at most 2% over hand-written PyTorch) and b/c >= 1.0.
"""

from __future__ import annotations

import argparse
import functools
import logging
import platform
import statistics
import sys
import tempfile
import time
import warnings

import accelerate
import torch
import transformers
from accelerate.utils import set_seed
from bench_report import command_line, cpu_model, utc_now, write_section
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer as HFTrainer
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from trainer.config import load_config
from trainer.core.trainer import Trainer
from trainer.families.regression.task import RegressionConfig, SyntheticRegression, build_mlp

SEED = 0
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


def run_plain(c: dict, steps: int, warmup: int, workdir: str) -> dict[str, float]:  # noqa: ARG001
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

    def step() -> None:
        batch = next(batches)
        loss = (net(batch["x"]) - batch["y"]).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    start = stamp()
    for _ in range(steps):
        step()
    return rates(steps, start, stamp())


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
    trainer = our_trainer(c, warmup + steps + 1, f"{workdir}/ours", extra)
    clock: dict[str, tuple[float, float]] = {}
    calls = 0
    train_step = trainer.train_step

    def timed_train_step(batches):
        nonlocal calls
        calls += 1
        if calls == warmup + 1:
            clock["start"] = stamp()
        elif calls == warmup + steps + 1:
            clock["end"] = stamp()
        return train_step(batches)

    trainer.train_step = timed_train_step
    trainer.evaluate = lambda split="eval": {}
    trainer.save = lambda best=False: None
    trainer.fit()
    return rates(steps, clock["start"], clock["end"])


def guard_cost(c: dict, steps: int, workdir: str) -> tuple[float, float]:
    """(us a `train_step` with the non-finite guard, without it): two Trainers in this process whose
    steps alternate one by one, each timed by the thread's CPU time; medians. Both sides see the same
    machine at the same moments, which separate runs of a shared machine do not."""
    trainers = [our_trainer(c, 10**9, f"{workdir}/guard-{k}", extra)
                for k, extra in (("on", ()), ("off", ("train.skip_nonfinite=false",)))]
    batches = [t.data.micro_batches(0) for t in trainers]
    times: list[list[int]] = [[], []]
    for i in range(steps + 20):
        for k in (0, 1) if i % 2 else (1, 0):
            batch = [next(batches[k])]
            t0 = time.thread_time_ns()
            trainers[k].train_step(batch)
            if i >= 20:  # warm-up
                times[k].append(time.thread_time_ns() - t0)
            if i % LOG_EVERY == 0:
                trainers[k].engine.guard.read()  # what a logging step does; the flags do not pile up
    return statistics.median(times[0]) / 1e3, statistics.median(times[1]) / 1e3


class _MSE(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y, index=None):  # noqa: ARG002
        return {"loss": (self.net(x) - y).pow(2).mean()}


class _Clock(TrainerCallback):
    def __init__(self, first: int, last: int):
        self.first, self.last, self.times = first, last, {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (self.first, self.last):
            self.times[state.global_step] = stamp()


def run_hf(c: dict, steps: int, warmup: int, workdir: str) -> dict[str, float]:
    args = TrainingArguments(
        output_dir=f"{workdir}/hf", max_steps=warmup + steps, per_device_train_batch_size=c["batch"],
        learning_rate=LR, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=CLIP, optim="adamw_torch_fused", logging_steps=LOG_EVERY, save_strategy="no",
        eval_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        seed=SEED, remove_unused_columns=False)
    clock = _Clock(warmup, warmup + steps)
    trainer = HFTrainer(model=_MSE(model(c)), args=args, train_dataset=dataset(c), callbacks=[clock])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return rates(steps, clock.times[warmup], clock.times[warmup + steps])


CLOCKS = ("cpu", "wall")
METHODS = {"a": run_plain, "b": run_ours, "b0": functools.partial(run_ours, extra=("train.skip_nonfinite=false",)),
           "c": run_hf}


def machine() -> str:
    cpu = cpu_model()
    return (f"{cpu}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"accelerate {accelerate.__version__}, transformers {transformers.__version__}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="timed optimizer steps per measurement")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before each measurement")
    p.add_argument("--repeats", type=int, default=3, help="measurements per (config, method); median reported")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for stable numbers")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    p.add_argument("--guard-steps", type=int, default=2000,
                   help="steps of the step-interleaved guard measurement per config (0: skip it)")
    p.add_argument("--out", help="replace this benchmark's section (machine, command, table) in this markdown file")
    p.add_argument("--smoke", action="store_true",
                   help="a few steps of the smallest config, one repeat, nothing written: checks the script runs")
    a = p.parse_args()
    if a.smoke:
        a.steps, a.warmup, a.repeats, a.configs, a.out, a.guard_steps = 3, 2, 1, "overhead", None, 5
    elif a.steps <= LOG_EVERY:
        p.error(f"--steps must exceed {LOG_EVERY} so that (b) and (c) log inside the timed steps")
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    if unknown := [n for n in names if n not in CONFIGS]:
        p.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger("trainer").setLevel(logging.WARNING)
    started = time.perf_counter()
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
    table = "\n".join(rows)
    noise = ("Spread of the repeats (CPU time), (max - min) / median: " + "; ".join(spreads)
             + ".\n\nThe same windows by the wall clock: " + "; ".join(wall) + ".")
    guard = []
    if a.guard_steps:
        with tempfile.TemporaryDirectory(prefix="overhead-") as workdir:
            for name in names:
                torch.set_num_threads(a.threads)
                on, off = guard_cost(CONFIGS[name], a.guard_steps, workdir)
                guard.append(f"{name} {on - off:+.1f} us on {off:.0f} us ({on / off - 1:+.1%})")
        noise += (f"\n\nCost of the non-finite guard, `train_step` alone with and without it, two Trainers in one "
                  f"process, steps alternating ({a.guard_steps} each, medians of the thread's CPU time): "
                  + "; ".join(guard) + ".")
    elapsed = time.perf_counter() - started
    print(table)
    print(f"\n{noise}\n{a.steps} timed steps after {a.warmup} warm-up, median of {a.repeats}, "
          f"{a.threads} thread(s); total {elapsed:.0f} s")
    if a.smoke:
        print("smoke run: nothing written")
    elif a.out:
        write_section(a.out, f"## Overhead benchmark, {utc_now()}\n\n- Machine: {machine()}\n"
                             f"- Command: `{command_line()}`\n"
                             f"- {a.steps} timed optimizer steps after {a.warmup} warm-up steps, median of "
                             f"{a.repeats} interleaved repeats, torch threads = {a.threads}, fp32, one process; "
                             f"steps/s by the process's CPU time (the wall clock below)\n"
                             f"- Targets: b/a >= 0.98, b/c >= 1.0\n\n{table}\n\n{noise}\n")


if __name__ == "__main__":
    main()

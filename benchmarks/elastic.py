"""Elastic membership under faults, and the cost of checkpointing every step.

Faults: agents (`trainer train --nnodes 1:2 --nproc-per-node 1`, one a "node", each in a process group of its own)
on this host around a standalone store (`trainer rendezvous`), the regression task slowed by task.delay_s per
micro-batch, a checkpoint every step (ckpt.async_save). `--faults` times, after a random wait of 0.5-1.5 x
`--interval` seconds, the run loses a node (SIGKILL of a random agent's group: 2 -> 1) or gains one (a new agent:
1 -> 2), in turn. Measured: recovery (a kill to the first step completed at the new size, from the membership
records' times; a join from the new agent's start), steps redone per fault, throughput kept (the steps done at
each size over the fault-free rates at that size, against the wall time) and the final weights' distance to a
fault-free run of the same steps and global batch.

Checkpoint cost: one process, the regression MLP at --hidden x 3 layers, batch 64 (the overhead benchmark's
`medium`), --ckpt-steps steps without checkpoints, with a synchronous one every step and an asynchronous one every
step (the writer process, at the default ckpt.async_cpu_share and at 0.25), --repeats rounds in turn. The same
with `--nproc` processes launched by `trainer train --nproc` (DDP over gloo), where each save attempt is agreed by
every rank: without checkpoints and with ckpt.async_save every step, for this tree and, with `--compare TREE`, for
another checkout of the package (e.g. `git worktree add /tmp/before HEAD~3`) in the same rounds.

    python benchmarks/elastic.py [--faults 20 --interval 10] [--out BENCHMARKS.md] [--smoke]
    python benchmarks/elastic.py --only checkpoints-launched --nproc 2 --compare /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_report import command_line, cpu_model, publish_section, utc_now  # noqa: E402

TOPIC = "Elastic training"

TINY = str(ROOT / "configs" / "regression" / "tiny.yaml")
TRAINER = str(Path(sys.executable).parent / "trainer")
RUN = ["train.global_batch_size=32", "train.per_device_batch_size=16", "train.ema_decay=0", "eval.every_steps=0",
       "ckpt.every_steps=1", "ckpt.async_save=true", "ckpt.keep_last=2", "log.every_steps=10",
       "log.progress_bar=false", "log.tensorboard=false", "optim.lr=0.01", "optim.scheduler=constant"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    from trainer.core.elastic_launch import reachable

    return reachable(f"127.0.0.1:{port}")


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def progress(out: Path) -> dict:
    try:
        return json.loads((out / "elastic.json").read_text())
    except (OSError, ValueError):
        return {}


class Job:
    """A store and the agents of one elastic run."""

    def __init__(self, out: Path, steps: int, delay: float):
        self.out, self.port = out, free_port()
        self.args = [TINY, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv", f"127.0.0.1:{self.port}",
                     "--max-restarts", "100", *RUN, f"train.max_steps={steps}", f"task.delay_s={delay}",
                     f"run.output_dir={out}", "run.resume=none"]
        # elastic.json at every step: the steps a fault redoes are counted from it
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TRAINER_ELASTIC_PROGRESS_S": "0"}
        self.store = subprocess.Popen([TRAINER, "rendezvous", "--host", "127.0.0.1", "--port", str(self.port)],
                                      env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not listening(self.port):
            time.sleep(0.05)
        self.agents: list[subprocess.Popen] = []
        self.logs = 0

    def start_agent(self) -> subprocess.Popen:
        log = open(f"{self.out}.agent{self.logs}.log", "w")  # noqa: SIM115 - the agent's whole life
        self.logs += 1
        proc = subprocess.Popen([TRAINER, "train", *self.args], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.agents.append(proc)
        return proc

    def live(self) -> list[subprocess.Popen]:
        return [a for a in self.agents if a.poll() is None]

    def kill(self, agent: subprocess.Popen) -> None:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()

    def done(self) -> bool:
        return any(a.poll() == 0 for a in self.agents) and not self.live()

    def close(self) -> None:
        for agent in self.live():
            self.kill(agent)
        self.store.send_signal(signal.SIGTERM)
        self.store.wait(timeout=30)


def fault_free(out: Path, steps: int, delay: float, nodes: int) -> float:
    """Run the job on `nodes` agents without faults; its seconds per step (after the first step)."""
    job = Job(out, steps, delay)
    try:
        for _ in range(nodes):
            job.start_agent()
            if nodes > 1:
                time.sleep(0.5)
        while not job.done():
            if any(a.poll() not in (None, 0) for a in job.agents):
                raise SystemExit(f"the fault-free run on {nodes} nodes failed: see {out}.agent*.log")
            time.sleep(0.2)
    finally:
        job.close()
    return seconds_per_step(out)


def seconds_per_step(out: Path) -> float:
    times = [r["step_time_s"] for r in records(out) if "step_time_s" in r]
    return statistics.median(times)


def faulty(out: Path, steps: int, delay: float, faults: int, interval: float, rng: random.Random) -> dict:
    job = Job(out, steps, delay)
    events = []  # (kind, wall time, nodes after)
    try:
        job.start_agent()
        time.sleep(0.5)
        job.start_agent()
        while progress(out).get("world_size") != 2:
            time.sleep(0.1)
        first = progress(out)  # from the first step at 2 nodes: the agents' start-up is no fault's
        started, start_step = first["time"], first["step"]
        for _ in range(faults):
            deadline = time.monotonic() + rng.uniform(0.5, 1.5) * interval
            while time.monotonic() < deadline and not job.done():
                time.sleep(0.05)
            if job.done() or progress(out).get("step", 0) >= steps - 2:
                break
            live = job.live()
            if len(live) == 2:
                job.kill(rng.choice(live))
                events.append(("kill", time.time(), 1))
            else:
                job.start_agent()
                events.append(("join", time.time(), 2))
            # the next fault only once the group runs at the new size
            target = events[-1][2]
            while progress(out).get("nodes") != target or progress(out).get("time", 0) < events[-1][1]:
                if job.done():
                    break
                time.sleep(0.05)
        while not job.done():
            if not job.live():
                raise SystemExit(f"the faulty run failed: see {out}.agent*.log")
            time.sleep(0.2)
    finally:
        job.close()
    return {"events": events, "wall_s": time.time() - started, "start_step": start_step}


def distance(a: Path, b: Path) -> float:
    from trainer.core.checkpoint import latest_checkpoint
    from trainer.core.checkpoint.export import load_model_weights

    x, y = (load_model_weights(latest_checkpoint(p / "checkpoints")) for p in (a, b))
    return max((x[k].float() - y[k].float()).abs().max().item() for k in x)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def fault_section(args: argparse.Namespace, work: Path) -> list[str]:
    rng = random.Random(args.seed)
    rate2 = fault_free(work / "free2", args.steps, args.delay, 2)
    rate1 = fault_free(work / "free1", min(args.steps, 300), args.delay, 1)  # its rate only
    run = faulty(work / "faulty", args.steps, args.delay, args.faults, args.interval, rng)
    changes = [r for r in records(work / "faulty") if r.get("event") == "membership"]
    kills = [e for e in run["events"] if e[0] == "kill"]
    joins = [e for e in run["events"] if e[0] == "join"]

    def first_after(when: float, nodes: int) -> dict | None:
        return next((r for r in changes if r["time"] > when and r["nodes"] == nodes), None)

    kill_recovery = [r["time"] - t for _, t, n in kills if (r := first_after(t, n))]
    join_recovery = [r["time"] - t for _, t, n in joins if (r := first_after(t, n))]
    redone = [r["steps_redone"] for r in changes]
    # Useful time: each segment's steps at the fault-free rate of its size; the rest of the wall time is lost.
    starts = [r for r in records(work / "faulty") if r.get("event") == "start"]
    steps_at = {1: 0, 2: 0}
    bounds = [(r["step"], r.get("world_size", 2)) for r in starts] + [(args.steps, None)]
    for (step, world), (next_step, _) in zip(bounds, bounds[1:]):
        step = max(step, run["start_step"])
        steps_at[world] = steps_at.get(world, 0) + max(0, next_step - step)
    useful = steps_at.get(2, 0) * rate2 + steps_at.get(1, 0) * rate1
    wall = run["wall_s"]
    lost_per_fault = (wall - useful) / max(1, len(run["events"]))
    dist = distance(work / "free2", work / "faulty")

    def fmt(values: list[float]) -> str:
        return (f"median {statistics.median(values):.1f} s, p95 {percentile(values, 0.95):.1f} s "
                f"(n={len(values)})") if values else "none"

    return [
        f"- Run: regression tiny, global batch 32 (16 per device), {args.steps} steps, task.delay_s={args.delay} "
        f"(fault-free: {rate2 * 1e3:.0f} ms a step on 2 nodes, {rate1 * 1e3:.0f} ms on 1), a checkpoint every step "
        f"(ckpt.async_save), `trainer rendezvous` store; {len(run['events'])} faults ({len(kills)} kills, "
        f"{len(joins)} joins) at 0.5-1.5 x {args.interval:g} s",
        "",
        "| figure | value | target |",
        "|---|---|---|",
        f"| recovery, kill -> first step at 1 node | {fmt(kill_recovery)} | median <= 10 s, p95 <= 20 s |",
        f"| recovery, join -> first step at 2 nodes (the new agent's start-up included) | {fmt(join_recovery)} | |",
        f"| steps redone per fault | max {max(redone) if redone else 0}, mean "
        f"{statistics.mean(redone) if redone else 0:.2f} | <= 1 |",
        f"| time lost per fault (wall - steps at the fault-free rates) | {lost_per_fault:.1f} s | |",
        f"| throughput kept at this run's fault rate (one per {wall / max(1, len(run['events'])):.0f} s) | "
        f"{useful / wall:.1%} | |",
        f"| throughput kept at a fault every 60 s (1 - lost / 60) | {max(0.0, 1 - lost_per_fault / 60):.1%} | >= 80 % |",
        f"| final weights, max difference to the fault-free run on 2 nodes | {dist:.2e} | <= 1e-5 |",
        ""]


def checkpoint_section(args: argparse.Namespace, work: Path) -> list[str]:
    """One process, in this interpreter: wall time per step of the whole fit without checkpoints, with a synchronous
    one every step and with ckpt.async_save every step, in `--repeats` rounds (the order turns each round).

    With ckpt.async_save on one process the step hands each checkpoint to the writer process (host copies) and
    skips the steps' saves while it writes the last one: checkpoints come as often as the writer completes them,
    which the section reports (steps per completed checkpoint), with the step's share (ms on the step per save)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from trainer.config import CkptConfig, load_config
    from trainer.core.checkpoint.manager import Checkpointer
    from trainer.core.trainer import Trainer

    saves: list[tuple[float, bool]] = []
    save = Checkpointer.save

    def timed_save(self, *a, **k):
        begin = time.perf_counter()
        path = save(self, *a, **k)
        saves.append((time.perf_counter() - begin, path is not None))
        return path

    Checkpointer.save = timed_save
    startup: list[float] = []
    modes = {"none": ["ckpt.every_steps=0"], "sync": ["ckpt.every_steps=1", "ckpt.async_save=false"],
             "async": ["ckpt.every_steps=1", "ckpt.async_save=true"],
             "async_rest": ["ckpt.every_steps=1", "ckpt.async_save=true", "ckpt.async_cpu_share=0.25"],
             "async10": ["ckpt.every_steps=10", "ckpt.async_save=true"]}
    figures: dict[str, list[dict]] = {name: [] for name in modes}
    for round_ in range(args.repeats):
        order = list(modes) if round_ % 2 == 0 else list(reversed(modes))
        for name in order:
            steps = args.ckpt_steps if name != "sync" else min(args.ckpt_steps, 300)  # ~80 ms a save
            out = work / f"ckpt-{name}"
            cfg = load_config(TINY, [f"run.output_dir={out}", "run.resume=none", f"train.max_steps={steps}",
                                     "eval.every_steps=0", "log.progress_bar=false", "log.tensorboard=false",
                                     "log.every_steps=1000000", f"task.hidden={args.hidden}", "task.depth=3",
                                     "train.per_device_batch_size=64", "train.grad_accum_steps=1",
                                     "train.ema_decay=0.99", "ckpt.keep_last=2", *modes[name]])
            started = time.perf_counter()
            trainer = Trainer(cfg)
            writer = trainer.checkpointer._writer
            while writer is not None and not writer.ready():  # steady state: its start-up is reported apart
                time.sleep(0.01)
            startup.append(time.perf_counter() - started) if writer is not None else None
            saves.clear()
            begin = time.perf_counter()
            trainer.fit()
            wall = time.perf_counter() - begin
            writer_cpu = writer.jobs_cpu_s if writer is not None else 0.0
            done = [t for t, saved in saves[:-1] if saved]  # the last: fit's final, synchronous save
            skipped = [t for t, saved in saves if not saved]
            figures[name].append({"step": wall / steps, "saves": len(done), "steps": steps,
                                  "writer_cpu_s": writer_cpu / max(len(done), 1),
                                  "save_s": statistics.median(done) if done else 0.0,
                                  "skip_s": statistics.median(skipped) if skipped else 0.0})
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            PartialState._reset_state()
            shutil.rmtree(out, ignore_errors=True)
    Checkpointer.save = save

    def med(name: str, key: str) -> float:
        return statistics.median(f[key] for f in figures[name])

    share = CkptConfig().async_cpu_share
    base = med("none", "step")
    spread = {name: f"{min(f['step'] for f in figures[name]) * 1e3:.2f}-{max(f['step'] for f in figures[name]) * 1e3:.2f}"
              for name in modes}
    every = {name: statistics.median(f["steps"] / max(f["saves"], 1) for f in figures[name]) for name in modes}
    cost = {name: med(name, "step") / base - 1 for name in modes}
    return [f"- One process, regression MLP {args.hidden} x 3 layers, batch 64, EMA on (the overhead benchmark's "
            f"`medium`), {args.ckpt_steps} steps ({min(args.ckpt_steps, 300)} with synchronous saves), "
            f"{args.repeats} rounds in turn; wall time per step of the whole fit (final eval and checkpoint "
            f"included), median of the rounds (range). With ckpt.async_save the fit starts once the writer process "
            f"is ready: from the Trainer's construction (which starts it) {statistics.median(startup):.1f} s "
            f"(median), during which a run's first saves write on the step", "",
            "| checkpoints | ms a step | cost over none | a checkpoint completed every | on the step per checkpoint "
            "| target |", "|---|---|---|---|---|---|",
            f"| none | {base * 1e3:.2f} ({spread['none']}) | | | | |",
            f"| every step, synchronous | {med('sync', 'step') * 1e3:.2f} ({spread['sync']}) | {cost['sync']:+.1%} | "
            f"{every['sync']:.1f} steps | {med('sync', 'save_s') * 1e3:.2f} ms | |",
            f"| every step, ckpt.async_save (the writer process, ckpt.async_cpu_share={share}, the default; "
            f"asked while it writes or rests: skipped, "
            f"{med('async', 'skip_s') * 1e6:.0f} us) | {med('async', 'step') * 1e3:.2f} ({spread['async']}) | "
            f"{cost['async']:+.1%} | {every['async']:.1f} steps | {med('async', 'save_s') * 1e3:.2f} ms | <= +5 % |",
            f"| every step, ckpt.async_save, ckpt.async_cpu_share=0.25 | {med('async_rest', 'step') * 1e3:.2f} "
            f"({spread['async_rest']}) | {cost['async_rest']:+.1%} | {every['async_rest']:.1f} steps | "
            f"{med('async_rest', 'save_s') * 1e3:.2f} ms | |",
            f"| every 10 steps, ckpt.async_save | {med('async10', 'step') * 1e3:.2f} ({spread['async10']}) | "
            f"{cost['async10']:+.1%} | {every['async10']:.1f} steps | {med('async10', 'save_s') * 1e3:.2f} ms | |",
            "", f"The writer process's CPU time per checkpoint (another core's, where one is free): "
            f"{med('async', 'writer_cpu_s') * 1e3:.1f} ms at the default share, "
            f"{med('async_rest', 'writer_cpu_s') * 1e3:.1f} ms at 0.25.", ""]


def launched_checkpoint_section(args: argparse.Namespace, work: Path) -> list[str]:
    """`--nproc` processes (`trainer train --nproc`): the step's wall time (metrics.jsonl's step_time_s, median past
    the first logged steps) without checkpoints and with ckpt.async_save every step, for this tree and
    `--compare`'s, `--repeats` rounds with the order turned each round."""
    trees = {"this tree": ROOT}
    if args.compare:
        trees[f"{args.compare}"] = Path(args.compare).resolve()
    modes = {"none": ["ckpt.every_steps=0"], "async": ["ckpt.every_steps=1", "ckpt.async_save=true"]}
    times: dict[tuple[str, str], list[float]] = {(t, m): [] for t in trees for m in modes}
    for round_ in range(args.repeats):
        order = [(t, m) for t in trees for m in modes]
        for tree, mode in order if round_ % 2 == 0 else reversed(order):
            out = work / f"launched-{len(trees)}-{mode}"
            shutil.rmtree(out, ignore_errors=True)
            env = {**os.environ, "PYTHONPATH": str(trees[tree]), "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "trainer", "train", str(trees[tree] / "configs" / "regression" / "tiny.yaml"),
                   "--nproc", str(args.nproc), f"train.max_steps={args.ckpt_steps}", f"task.hidden={args.hidden}",
                   "task.depth=3", "train.per_device_batch_size=64", "train.grad_accum_steps=1",
                   "train.ema_decay=0.99", "eval.every_steps=0", "log.every_steps=50", "log.progress_bar=false",
                   "log.tensorboard=false", "ckpt.keep_last=2", f"run.output_dir={out}", "run.resume=none",
                   *modes[mode]]
            done = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{tree} {mode}: exit {done.returncode}\n{done.stderr[-3000:]}")
            steps = [r["step_time_s"] for r in records(out) if "step_time_s" in r][2:]  # past the writer's start
            times[(tree, mode)].append(statistics.median(steps))
            shutil.rmtree(out, ignore_errors=True)

    def fmt(tree: str, mode: str) -> str:
        values = times[(tree, mode)]
        return f"{statistics.median(values) * 1e3:.2f} ({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})"

    lines = [f"- {args.nproc} processes (`trainer train --nproc {args.nproc}`, DDP over gloo), regression MLP "
             f"{args.hidden} x 3 layers, batch 64 a process, EMA on, {args.ckpt_steps} steps, {args.repeats} rounds "
             f"in turn; ms a step: median of the rounds of each run's median step_time_s (range)", "",
             "| code | no checkpoints | ckpt.async_save every step | cost |", "|---|---|---|---|"]
    for tree in trees:
        cost = statistics.median(times[(tree, "async")]) / statistics.median(times[(tree, "none")]) - 1
        lines.append(f"| {tree} | {fmt(tree, 'none')} | {fmt(tree, 'async')} | {cost:+.1%} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--interval", type=float, default=10.0, help="mean seconds between faults")
    parser.add_argument("--steps", type=int, default=4000, help="enough for the faults: the run must outlast them")
    parser.add_argument("--delay", type=float, default=0.05, help="task.delay_s: seconds per micro-batch")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ckpt-steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the checkpoint-cost runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["faults", "checkpoints", "checkpoints-launched"], default=None)
    parser.add_argument("--nproc", type=int, default=2, help="processes of the launched checkpoint-cost runs")
    parser.add_argument("--compare", default=None, help="another checkout of the package to time beside this one")
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="2 faults, a short run; nothing written")
    args = parser.parse_args()
    if args.smoke:
        args.faults, args.interval, args.steps, args.ckpt_steps, args.repeats = 2, 4.0, 300, 30, 1
    work = Path(tempfile.mkdtemp(prefix="elastic-bench-"))
    lines = [f"## Elastic membership benchmark, {utc_now()}", "",
             f"- Machine: {cpu_model()}, torch's gloo on CPU, 1 thread a process",
             f"- Command: `{command_line()}`", ""]
    try:
        if args.only in (None, "faults"):
            lines += fault_section(args, work)
        if args.only in (None, "checkpoints"):
            lines += checkpoint_section(args, work)
        if args.only in (None, "checkpoints-launched"):
            lines += launched_checkpoint_section(args, work)
        load = os.getloadavg()[0]
        lines.append(f"Load average {load:.1f} at the end.")
        publish_section("\n".join(lines), args.out, args.smoke, topic=TOPIC)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""The protein data path at UniRef50-like sizes: what each quantity costs as the data (N records) and the number of
processes (W) grow.

For each N (`--sizes`): a UniRef50-shaped FASTA (`uniref_fasta.py`), then

  I/O limit     `cat F | wc -c` (and `zcat F.gz | wc -c` with `--gzip`): the floor of any conversion. The file
                was just written, so it is mostly in the page cache: a lower bound, not a cold read
  conversion    `trainer data prepare CONFIG ...` (the Arrow caches of the job, once per job): its wall time,
                its own "took:" figure (the build without the start-up) and its peak RSS; then the same command
                again (what a second job pays: a cache hit)

and for each W (`--worlds`), real launches of `trainer train CONFIG --nproc W` (gloo on CPU; the config is
`--config`, sedd_uniref50.yaml by default, with `task.streaming=false`, the `tiny` DDiT and a small batch):

  first step    wall time from the launch to the first step's record in the run's metrics.jsonl (the data
                caches already built)
  rank RSS      each rank's peak resident memory (VmHWM of the rank processes, read from /proc while they run),
                and its peak private memory (RssAnon: without the memory-mapped shards' page-cache pages);
                the largest over ranks is reported
  resume @90%   the same run's checkpoint moved to the step at 90 % of the epoch (its trainer_state.json step,
                and its manifest), resumed: launch to the first step after it. Map-style data computes its
                position from the step, so this is what a resume at that point of a real epoch pays
  data rate     W processes at once, each iterating its rank's training DataLoader (`TrainBatches`, no model)
                over `--loader-samples` samples: samples/s per rank, against the samples/s per rank the
                training step consumed (the run's logged `samples_per_s` / W)
  eval          the run's end-of-run evaluation (eval.max_samples fixed), at each of `--val-fractions` (the
                smallest W): its time should not grow with the validation split past eval.max_samples

Then a table of the cost per doubling of N (the ratio between consecutive sizes, per doubling) and an
extrapolation (a power law in N fitted to the measured sizes, and one in W) to UniRef50's 60 M records and to
W = 64 (extrapolated, not measured). Prints markdown; `--out FILE` files it into FILE (`bench_report`).

    .venv/bin/python benchmarks/scale.py --sizes 1000000 3000000 10000000 --worlds 1 2 4 --workdir /scratch/scale
    .venv/bin/python benchmarks/scale.py --smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_report import command_line, cpu_model, publish_section, utc_now  # noqa: E402
from uniref_fasta import write_uniref_fasta  # noqa: E402

TOPIC = "Data ingest and streaming"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""
UNIREF50_RECORDS = 60_315_044
TRAINER = [str(Path(sys.executable).with_name("trainer"))]
if not Path(TRAINER[0]).exists():
    TRAINER = [sys.executable, "-m", "trainer"]


# ---------------------------------------------------------------- watching a command and its processes


def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(entry))
    return out


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(tree.get(p, []))
    return out


def _peak_kib(pid: int) -> tuple[int, int] | None:
    """(VmHWM, RssAnon) of a process in KiB: its peak resident memory, file pages it maps included, and its
    private memory now."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                      if k in ("VmHWM", "RssAnon")}
        return fields["VmHWM"], fields["RssAnon"]
    except (OSError, KeyError, ValueError):
        return None


def _rank(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env else None


@dataclass
class Watched:
    """What `watch` saw of one command."""

    rc: int
    wall_s: float
    output: str
    lines: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    """metrics.jsonl records, each with the seconds since the launch at which it was first seen."""
    rank_peak_mib: dict[int, float] = field(default_factory=dict)
    """Peak RSS of each rank process (RANK in its environment, its parent without); rank 0 = the command itself
    when nothing set RANK (one process)."""
    rank_anon_mib: dict[int, float] = field(default_factory=dict)
    """Peak private memory (RssAnon) of each rank process: what it holds itself, without the memory-mapped
    shards' page-cache pages (shared by the node's processes and reclaimable; how many a read maps depends on the
    kernel's page-cache folio size)."""
    any_peak_mib: float = 0.0
    """The largest peak RSS of any process of the command (conversion workers included)."""

    def first(self, pred) -> tuple[float, dict[str, Any]] | None:
        return next(((t, r) for t, r in self.lines if pred(r)), None)


def watch(cmd: list[str], metrics: Path | None = None, poll_s: float = 0.05, env: dict | None = None) -> Watched:
    """Run `cmd`, recording when each metrics.jsonl record appears and the peak RSS of its processes."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, **(env or {})})
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    seen: list[tuple[float, dict[str, Any]]] = []
    peaks: dict[int, int] = {}
    anon: dict[int, int] = {}
    ranks: dict[int, int] = {}
    offset, polls = 0, 0
    while True:
        done = proc.poll() is not None
        if metrics is not None and metrics.exists():
            with open(metrics) as f:
                f.seek(offset)
                chunk = f.read()
            whole = chunk[:chunk.rfind("\n") + 1]
            offset += len(whole)
            now = time.perf_counter() - t0
            seen += [(now, json.loads(line)) for line in whole.splitlines() if line.strip()]
        if polls % 5 == 0 and not done:  # the process tree: every fifth poll (a walk of /proc)
            for pid in _descendants(proc.pid):
                kib = _peak_kib(pid)
                if kib is not None:
                    peaks[pid] = max(peaks.get(pid, 0), kib[0])
                    anon[pid] = max(anon.get(pid, 0), kib[1])
                    if pid not in ranks:
                        r = _rank(pid)
                        if r is not None:
                            ranks[pid] = r
        if done:
            break
        polls += 1
        time.sleep(poll_s)
    reader.join()
    wall = time.perf_counter() - t0
    rank_procs = {pid: r for pid, r in ranks.items() if _parent_rank(pid, ranks) is None}
    by_rank: dict[int, float] = {}
    anon_by_rank: dict[int, float] = {}
    for pid, r in rank_procs.items():
        by_rank[r] = max(by_rank.get(r, 0.0), peaks.get(pid, 0) / 1024)
        anon_by_rank[r] = max(anon_by_rank.get(r, 0.0), anon.get(pid, 0) / 1024)
    if not by_rank and proc.pid in peaks:
        by_rank[0] = peaks[proc.pid] / 1024
        anon_by_rank[0] = anon[proc.pid] / 1024
    return Watched(proc.returncode, wall, "".join(out), seen, by_rank, anon_by_rank,
                   max(peaks.values(), default=0) / 1024)


_PARENTS: dict[int, int] = {}


def _parent_rank(pid: int, ranks: dict[int, int]) -> int | None:
    """The rank of `pid`'s parent if it is a rank process too (a DataLoader worker's parent), else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            _PARENTS[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        pass
    return ranks.get(_PARENTS.get(pid, -1))


def check(w: Watched, what: str) -> Watched:
    if w.rc != 0:
        raise SystemExit(f"{what} failed (exit {w.rc}):\n{w.output[-4000:]}")
    return w


# ---------------------------------------------------------------- the measurements


def overrides(a: argparse.Namespace, fasta: Path, val_fraction: float) -> list[str]:
    """The job's data and model settings (the same for prepare, the runs and the loader measurement)."""
    return [f"task.data_path={fasta}", f"task.cache_dir={a.workdir / 'cache'}", "task.streaming=false",
            f"task.model_preset={a.model_preset}", f"task.max_length={a.max_length}", "task.dropout=0.0",
            f"task.val_fraction={val_fraction}", f"train.per_device_batch_size={a.batch}", "train.grad_accum_steps=1",
            "train.mixed_precision=no", "optim.warmup_steps=1", f"data.num_workers={a.num_workers}",
            f"eval.max_samples={a.eval_max_samples}", "eval.batch_size=32", "log.every_steps=1",
            "log.progress_bar=false", "log.tensorboard=false"]


def io_limit(path: Path, tool: str) -> float:
    """Seconds of `tool PATH | wc -c` (cat or zcat): reading (and inflating) the file, nothing else."""
    t0 = time.perf_counter()
    subprocess.run(f"{tool} {path} | wc -c", shell=True, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def launch(a: argparse.Namespace, world: int, run_dir: Path, extra: list[str]) -> Watched:
    """`trainer train CONFIG [--nproc W] ...` into run_dir, watched."""
    cmd = [*TRAINER, "train", str(a.config), *(["--nproc", str(world)] if world > 1 else []), *extra,
           f"run.output_dir={run_dir}"]
    return check(watch(cmd, run_dir / "metrics.jsonl"), f"trainer train (W={world})")


def first_step_s(w: Watched, after: int = 0) -> float:
    hit = w.first(lambda r: "loss" in r and r.get("step", 0) > after)
    if hit is None:
        raise SystemExit(f"no training step after {after} in the run's metrics.jsonl:\n{w.output[-3000:]}")
    return hit[0]


def eval_s(w: Watched) -> float:
    """Seconds between the last training record and the eval record after it (the end-of-run evaluation)."""
    k = next(k for k, (_, r) in enumerate(w.lines) if "eval/loss" in r)
    before = max(t for t, r in w.lines[:k] if "loss" in r)
    return w.lines[k][0] - before


def move_checkpoint(run_dir: Path, step: int) -> Path:
    """Make the run's latest checkpoint claim `step` (its trainer_state.json and manifest entry): a map-style
    run resumed from it starts at that step's data position, without training up to it."""
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    state_path = ckpt / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state["step"] = step
    state_path.write_text(json.dumps(state, indent=1))
    manifest_path = ckpt / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = state_path.read_bytes()
    manifest["files"]["trainer_state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return ckpt


LOADER_CHILD = r"""
import json, sys, time, resource
import torch
from trainer.config import load_config
from trainer.registry import get_task
from trainer.core.batch_plan import plan_batch
from trainer.core.loaders import TrainBatches
config, rank, world, samples, overrides = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
cfg = load_config(config, overrides)
task = get_task(cfg.task.name)(cfg.task, seed=cfg.run.seed)
data = task.build_data()
plan = plan_batch(cfg, world=world)
batches = TrainBatches(cfg, plan, task, data.train, rank, world, torch.device("cpu")).micro_batches(0)
next(batches)  # the loader's start (workers, the epoch's order) is the launch's cost, measured there
n, t0, c0 = 0, time.perf_counter(), time.process_time()
while n < samples:
    n += task.batch_size(next(batches).batch)  # budget batching: micro-batches differ in size
print(json.dumps({"samples": n, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def data_rate(a: argparse.Namespace, world: int, extra: list[str]) -> tuple[float, float, float]:
    """(mean samples/s per rank, samples/s of all W ranks together, mean CPU µs per sample of a rank) of W loader
    processes run at once. The CPU time per sample is what a rank's reading costs whatever the cores it shares: W
    ranks with a core each read W x 1e6 / it samples/s."""
    procs = [subprocess.Popen([sys.executable, "-c", LOADER_CHILD, str(a.config), str(r), str(world),
                               str(a.loader_samples), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    rates, cpu_us = [], []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"the loader measurement failed (exit {p.returncode}):\n{err[-3000:]}")
        r = json.loads(out.strip().splitlines()[-1])
        rates.append(r["samples"] / r["seconds"])
        cpu_us.append(1e6 * r["cpu_seconds"] / r["samples"])
    return sum(rates) / len(rates), sum(rates), sum(cpu_us) / len(cpu_us)


def took_s(w: Watched) -> float:
    """The seconds `trainer data prepare` says its build took (NaN when it does not say)."""
    m = re.search(r"took:\s+([0-9.]+) s", w.output)
    return float(m.group(1)) if m else float("nan")


def val_count(output: str) -> int | None:
    m = re.search(r"validation=(\d+)", output)
    return int(m.group(1)) if m else None


def measure_size(a: argparse.Namespace, n: int) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """Every quantity at N = n: (the size's row, one row per W, the eval rows)."""
    work = a.workdir
    fasta = work / f"uniref50_like_{n}.fasta"
    t0 = time.perf_counter()
    write_uniref_fasta(fasta, n, seed=0)
    row: dict[str, Any] = {"N": n, "gen_s": time.perf_counter() - t0, "MiB": fasta.stat().st_size / 2**20}
    row["cat_s"] = io_limit(fasta, "cat")
    if a.gzip:
        gz = write_uniref_fasta(fasta, n, seed=0, gzip=True)
        row["gz_MiB"] = gz.stat().st_size / 2**20
        row["zcat_s"] = io_limit(gz, "zcat")
        gz.unlink()
    vf = a.val_fractions[0]
    common = overrides(a, fasta, vf)
    prep = check(watch([*TRAINER, "data", "prepare", str(a.config), *common]), "trainer data prepare")
    again = check(watch([*TRAINER, "data", "prepare", str(a.config), *common]), "trainer data prepare (again)")
    row["prepare_s"], row["prepare_peak_MiB"], row["prepare_again_s"] = prep.wall_s, prep.any_peak_mib, again.wall_s
    # The command's own figure (its "took:" line: the build, without the interpreter's start-up and imports); the
    # second prepare is a cache hit, so its figure is what every later job's start pays for the data.
    row["convert_s"], row["cached_s"] = took_s(prep), took_s(again)
    row["convert_over_cat"] = row["convert_s"] / row["cat_s"]
    if "zcat_s" in row:
        row["convert_over_zcat"] = row["convert_s"] / row["zcat_s"]
    log(f"N={n:,}: {row}")
    worlds, evals = [], []
    for world in a.worlds:
        run_dir = work / f"run_w{world}"
        shutil.rmtree(run_dir, ignore_errors=True)
        steps = a.steps
        w = launch(a, world, run_dir, [*common, f"train.max_steps={steps}", f"eval.every_steps={steps}",
                                       f"ckpt.every_steps={steps}"])
        train = [r for _, r in w.lines if "loss" in r]
        per_rank_step = train[-1]["samples_per_s"] / world  # the job's samples/s, as logged, per rank
        wr: dict[str, Any] = {"N": n, "W": world, "first_step_s": first_step_s(w),
                              "rank_peak_MiB": max(w.rank_peak_mib.values(), default=float("nan")),
                              "rank_private_MiB": max(w.rank_anon_mib.values(), default=float("nan")),
                              "ranks_seen": len(w.rank_peak_mib),
                              "rank0_logged_MiB": train[-1].get("peak_memory_mb", float("nan")),
                              "eval_s": eval_s(w), "step_samples_per_s_rank": per_rank_step}
        if world == min(a.worlds):
            evals.append({"N": n, "W": world, "val_fraction": vf, "validation": val_count(w.output),
                          "max_samples": a.eval_max_samples, "eval_s": wr["eval_s"]})
        plan = json.loads((run_dir / "plan.json").read_text())
        target = max(steps + 1, int(0.9 * plan["steps_per_epoch"]))
        move_checkpoint(run_dir, target)
        r = launch(a, world, run_dir, [*common, f"train.max_steps={target + 2}", f"eval.every_steps={10**9}",
                                       f"ckpt.every_steps={10**9}", "run.resume=auto"])
        resumed = r.first(lambda rec, after=target: "loss" in rec and rec.get("step", 0) > after)
        wr["resume_s"] = first_step_s(r, after=target)
        wr["resume_epoch"] = resumed[1].get("epoch", float("nan")) if resumed else float("nan")
        wr["loader_rank"], wr["loader_job"], wr["loader_cpu_us"] = data_rate(a, world, common)
        wr["loader_job_vs_w1"] = wr["loader_job"] / worlds[0]["loader_job"] if worlds else 1.0
        worlds.append(wr)
        log(f"N={n:,} W={world}: {wr}")
        shutil.rmtree(run_dir, ignore_errors=True)
    for vf2 in a.val_fractions[1:]:
        more = overrides(a, fasta, vf2)
        check(watch([*TRAINER, "data", "prepare", str(a.config), *more]), "trainer data prepare (eval split)")
        run_dir = work / "run_eval"
        shutil.rmtree(run_dir, ignore_errors=True)
        w = launch(a, min(a.worlds), run_dir, [*more, "train.max_steps=1", "eval.every_steps=1", "ckpt.every_steps=1"])
        evals.append({"N": n, "W": min(a.worlds), "val_fraction": vf2, "validation": val_count(w.output),
                      "max_samples": a.eval_max_samples, "eval_s": eval_s(w)})
        shutil.rmtree(run_dir, ignore_errors=True)
    if not a.keep:
        fasta.unlink()
        shutil.rmtree(work / "cache", ignore_errors=True)
    return row, worlds, evals


# ---------------------------------------------------------------- tables


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def table(rows: list[dict[str, Any]], cols: list[tuple[str, str]]) -> str:
    out = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---:|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(k, float("nan"))) for k, _ in cols) + " |" for r in rows]
    return "\n".join(out)


SIZE_COLS = [("N", "N"), ("MiB", "FASTA MiB"), ("gen_s", "generate s"), ("cat_s", "cat s (I/O limit)"),
             ("zcat_s", "zcat s (.gz)"), ("prepare_s", "prepare s (wall)"), ("convert_s", "conversion s (its took:)"),
             ("prepare_again_s", "prepare again s (wall)"), ("cached_s", "cached load s (its took:)"),
             ("convert_over_cat", "conversion / cat"),
             ("convert_over_zcat", "conversion / zcat"), ("prepare_peak_MiB", "prepare peak RSS MiB")]
WORLD_COLS = [("N", "N"), ("W", "W"), ("first_step_s", "launch to 1st step s"), ("rank_peak_MiB", "rank peak RSS MiB"),
              ("rank_private_MiB", "rank peak private (anon) MiB"),
              ("ranks_seen", "ranks seen"), ("rank0_logged_MiB", "rank 0 logged MiB"),
              ("resume_s", "resume @90% to 1st step s"),
              ("resume_epoch", "resumed at epoch"), ("loader_rank", "loader samples/s/rank"),
              ("loader_job", "loader samples/s all ranks"), ("loader_job_vs_w1", "all ranks / first W"),
              ("loader_cpu_us", "loader CPU µs/sample/rank"),
              ("step_samples_per_s_rank", "step consumes samples/s/rank"), ("eval_s", "eval s")]
EVAL_COLS = [("N", "N"), ("W", "W"), ("val_fraction", "val_fraction"), ("validation", "validation seqs"),
             ("max_samples", "eval.max_samples"), ("eval_s", "eval s")]
SCALED = ["cat_s", "prepare_s", "convert_s", "prepare_peak_MiB", "cached_s", "first_step_s", "rank_peak_MiB", "rank_private_MiB",
          "resume_s",
          "loader_rank", "loader_cpu_us", "eval_s"]


def per_doubling(sizes: list[dict[str, Any]], worlds: list[dict[str, Any]],
                 scaled: list[str] | None = None) -> list[dict[str, Any]]:
    """`doubling_ratios` of the sizes' rows joined with their launches at the smallest W measured."""
    w0 = min(r["W"] for r in worlds)
    merged = [{**s, **next(r for r in worlds if r["N"] == s["N"] and r["W"] == w0)} for s in sizes]
    return doubling_ratios(merged, SCALED if scaled is None else scaled)


def doubling_ratios(rows: list[dict[str, Any]], scaled: list[str]) -> list[dict[str, Any]]:
    """For consecutive rows (by N): each quantity's ratio per doubling of N, (b / a) ** (1 / log2(N_b / N_a))."""
    out = []
    for x, y in zip(rows, rows[1:]):
        d = math.log2(y["N"] / x["N"])
        row = {"N": f"{x['N']:,} -> {y['N']:,}"}
        for k in scaled:
            if x.get(k) and y.get(k) and x[k] > 0 and y[k] > 0:
                row[k] = (y[k] / x[k]) ** (1 / d)
        out.append(row)
    return out


def power_law(points: list[tuple[float, float]], at: float) -> float:
    """y at x = `at` of the least-squares line through (log x, log y) of `points` (NaN under two distinct x)."""
    if len({x for x, _ in points}) < 2:
        return float("nan")
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return math.exp(my + slope * (math.log(at) - mx))


def extrapolate(sizes: list[dict[str, Any]], worlds: list[dict[str, Any]], n_to: int, w_to: int) -> list[dict]:
    """Each quantity at N = n_to (a least-squares power law in N over the measured sizes, smallest W) and at
    W = w_to (a power law in W over the measured W, largest N): extrapolated, not measured."""
    w0, n1 = min(r["W"] for r in worlds), max(s["N"] for s in sizes)
    by_n = [{**s, **next(r for r in worlds if r["N"] == s["N"] and r["W"] == w0)} for s in sizes]
    by_w = [r for r in worlds if r["N"] == n1]
    rows = []
    for k in SCALED:
        pts = [(r["N"], r[k]) for r in by_n if r.get(k) and r[k] > 0]
        at_n = power_law(pts, n_to)
        wpts = [(r["W"], r[k]) for r in by_w if r.get(k) and r[k] > 0]
        rows.append({"quantity": k, f"N={n_to:,} (W={w0})": at_n, f"W={w_to} (N={n1:,})": power_law(wpts, w_to)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 3_000_000, 10_000_000])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/scale_bench"))
    p.add_argument("--keep", action="store_true", help="keep each size's FASTA and caches (default: removed)")
    p.add_argument("--gzip", action="store_true", help="also write F.gz and time zcat of it")
    p.add_argument("--config", type=Path, default=ROOT / "configs/protein_sedd/sedd_uniref50.yaml")
    p.add_argument("--model-preset", default="tiny")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="per-device batch of the runs")
    p.add_argument("--steps", type=int, default=20, help="training steps of each launch")
    p.add_argument("--num-workers", type=int, default=0, help="data.num_workers of the runs")
    p.add_argument("--loader-samples", type=int, default=4000, help="samples per rank of the data-rate measurement")
    p.add_argument("--val-fractions", type=float, nargs="+", default=[0.002, 0.008],
                   help="the runs' validation share, then more shares whose eval time is measured at W = 1")
    p.add_argument("--eval-max-samples", type=int, default=256)
    p.add_argument("--extrapolate-to", type=int, nargs=2, default=[UNIREF50_RECORDS, 64], metavar=("N", "W"))
    p.add_argument("--out", type=Path, help="file the section into this markdown file (BENCHMARKS.md)")
    p.add_argument("--smoke", action="store_true", help="3,000 records, W = 1, 2 steps: checks the script runs")
    a = p.parse_args()
    if a.smoke:
        import tempfile

        a.sizes, a.worlds, a.steps, a.loader_samples, a.out = [3000], [1], 2, 64, None
        a.val_fractions, a.eval_max_samples = [0.02], 16
        with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
            a.workdir = Path(tmp)
            run(a)
        return
    run(a)


def run(a: argparse.Namespace) -> None:
    a.workdir = a.workdir.resolve()
    a.workdir.mkdir(parents=True, exist_ok=True)
    sizes, worlds, evals = [], [], []
    for n in a.sizes:
        row, w, e = measure_size(a, n)
        sizes.append(row)
        worlds += w
        evals += e
    n_to, w_to = a.extrapolate_to
    config = a.config.relative_to(ROOT) if a.config.is_relative_to(ROOT) else a.config
    parts = [f"## Scale benchmark, {utc_now()}", "",
             f"Machine: {cpu_model()}. Command: `{command_line()}`. Config: `{config}` with task.streaming=false, "
             f"the `{a.model_preset}` DDiT, "
             f"max_length {a.max_length}, {a.batch} per device, data.num_workers={a.num_workers}, gloo on CPU.", "",
             "Conversion and its I/O limit (the file was just written: `cat` reads it mostly from the page cache):",
             "", table(sizes, SIZE_COLS), "", "Per size and number of processes W:", "", table(worlds, WORLD_COLS), "",
             "Evaluation against the validation split's size (eval.max_samples fixed, the smallest W):", "",
             table(evals, EVAL_COLS)]
    if len(sizes) > 1:
        heads = [("N", "N")] + [(k, k) for k in SCALED]
        ext = extrapolate(sizes, worlds, n_to, w_to)
        parts += ["", "Cost per doubling of N (ratio per doubling; 1.0 is flat, 2.0 linear in N):", "",
                  table(per_doubling(sizes, worlds), heads), "",
                  f"Extrapolated (not measured) from the sizes above: to N = {n_to:,} (a power law in N) and to "
                  f"W = {w_to} (a power law in W):", "", table(ext, [(k, k) for k in ext[0]])]
    cores = len(os.sched_getaffinity(0))
    if max(a.worlds) > cores:
        parts += ["", f"This machine has {cores} cores: from W = {cores + 1} on, the ranks share cores, so what grows "
                  "with W here (launch, resume, the rate per rank) is contention for them, and the extrapolation in W "
                  "says nothing of a cluster, where each rank has its own; the loader's CPU µs per sample is the "
                  "per-rank cost of reading whatever the cores."]
    publish_section("\n".join(parts) + "\n", a.out, a.smoke, topic=TOPIC)


if __name__ == "__main__":
    main()

"""Molecules (EDM) benchmark: training and sampling throughput, guided-sampling cost, and quality.

1. Training throughput (molecules/s) of the `tiny` and `paper` EGNN on CPU (one process).
2. EDM's data row on the bundled 3,000 and the full shared 10,000 QM9 molecules.
3. A tiny model trained for `--train-minutes` on CPU (2 processes): its NLL and sample quality.
4. Sampling throughput with 1 and 2 processes (sampling time only, start-up excluded).
5. The guidance sweep (baseline and `--scales`) with GFN2-xTB on that model: the metric table, the
   share of sampling time spent in the force field, and the worker pool's speed-up over one worker.

    python benchmarks/molecules.py --out BENCHMARKS.md            # the whole benchmark (long on CPU)
    python benchmarks/molecules.py --smoke                         # seconds; writes nothing
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_report import command_line, cpu_model, utc_now, write_section  # noqa: E402

TOPIC = "Molecules: training and sampling throughput"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

BIN = Path(sys.executable).parent
CONFIG = ROOT / "configs" / "molecules_edm" / "edm_tiny.yaml"
SHARED_QM9 = ROOT.parent / "shared" / "data" / "molecules" / "qm9_random_10k.extxyz.gz"


def env() -> dict[str, str]:
    # CPU figures (a 2-core laptop's): the Trainer and `trainer sample` take a GPU whenever they see one.
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")


def run(cmd: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


def launch(nproc: int, *args: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "trainer", *args]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"),
            "--num_processes", str(nproc), "--main_process_port", str(port), "-m", "trainer", *args]


def training_throughput(preset: str, steps: int, batch: int, work: Path) -> float:
    """Molecules per second of `preset` on CPU, one process, after two warm-up steps."""
    out = work / f"thr_{preset}"
    run(launch(1, "train", str(CONFIG), f"run.output_dir={out}", f"task.model_preset={preset}", "train.epochs=0",
               f"train.max_steps={steps}", f"train.per_device_batch_size={batch}", "eval.every_epochs=0",
               "eval.every_steps=0", "eval.sample_every=0", f"log.every_steps={max(1, steps - 2)}",
               "log.progress_bar=false", "log.tensorboard=false", "run.resume=none", f"task.cache_dir={work / 'cache'}"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r]
    return float(rates[-1])


def data_row(path: Path) -> dict:
    from trainer.families.molecules_edm.evaluate import evaluate_file

    return evaluate_file(path)


def sample_stats(run_dir: Path, out: Path, nproc: int, options: list[str]) -> dict:
    run(launch(nproc, "sample", str(run_dir), f"out={out}", *options))
    return json.loads(out.with_name(out.name + ".stats.json").read_text())


def sampling_rates(model: Path, n: int, work: Path, guided: float | None = None) -> tuple[float, float]:
    """Molecules per second with 1 and 2 processes (sampling time only; batches of n / 4). `guided`: also a set
    guided by GFN2-xTB at that scale over the last ~100 steps (sigma <= 0.3), so 2n molecules a run; one process
    evaluates the forces in a pool of 2 workers, each of 2 processes in itself (default_workers)."""
    options = [f"num_samples={n}", f"batch_size={max(1, n // 4)}", "evaluation_forcefield=none", "chains=0"]
    if guided is not None:
        options += [f"guidance.scales=[{guided}]", "guidance.forcefield=gfn2", "guidance.noise_threshold=0.3"]
    molecules = n * (2 if guided is not None else 1)
    one = sample_stats(model, work / "thr1", 1, options)
    two = sample_stats(model, work / "thr2", 2, options)
    return molecules / one["sampling_seconds"], molecules / two["sampling_seconds"]


def sampling_throughput_only(model: Path, args: argparse.Namespace, work: Path) -> None:
    n = 4 if args.smoke else args.throughput_samples
    repeats = 1 if args.smoke else args.repeats
    rates = [sampling_rates(model, n, work / f"repeat{k}", args.guided) for k in range(repeats)]
    ratios = sorted(two / one for one, two in rates)
    what = (f"{n} molecules unguided plus {n} guided by GFN2-xTB at scale {args.guided} over the last ~100 steps "
            f"(sigma <= 0.3; one process evaluates forces in a pool of 2 workers, each of 2 processes in itself)"
            if args.guided is not None else f"{n} molecules")
    title = "Molecules guided sampling throughput" if args.guided is not None else "Molecules sampling throughput"
    lines = [f"## {title}, {utc_now()}", "",
             f"Machine: {cpu_model()}, CPU only, nothing else running. Command: `{command_line()}`.", "",
             f"EDM `tiny` (T = 1000), {what}, in batches of {max(1, n // 4)}; sampling time only (start-up and model "
             f"loading excluded), {repeats} repeat(s):", "",
             "| repeat | 1 process, molecules/s | 2 processes, molecules/s | 2 / 1 |", "|---|---:|---:|---:|"]
    lines += [f"| {k + 1} | {one:.2f} | {two:.2f} | {two / one:.2f}x |" for k, (one, two) in enumerate(rates)]
    lines += ["", f"**Median {ratios[len(ratios) // 2]:.2f}x, spread {ratios[0]:.2f}x-{ratios[-1]:.2f}x** "
                  f"(target >= 1.8x)."]
    section = "\n".join(lines)
    print(section)
    if args.smoke:
        print("smoke run: nothing written")
    elif args.out:
        write_section(args.out, section, topic=TOPIC)


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-minutes", type=float, default=10.0, help="CPU training time of the tiny model")
    parser.add_argument("--samples", type=int, default=64, help="molecules per set in the guidance sweep")
    parser.add_argument("--throughput-samples", type=int, default=64, help="molecules for the 1 vs 2 process timing")
    parser.add_argument("--scales", default="0.0005,0.0007,0.008")
    parser.add_argument("--smoke", action="store_true", help="a few steps and molecules, T = 20; writes nothing")
    parser.add_argument("--out", default=None, help="write the section into this markdown file")
    parser.add_argument("--work", default=None, help="working folder (default: a temp folder)")
    parser.add_argument("--sampling-throughput-only", default=None, metavar="RUN_DIR",
                        help="only time sampling with 1 and 2 processes on this trained run (its own section)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the 1 vs 2 process timing")
    parser.add_argument("--guided", type=float, default=None, metavar="SCALE",
                        help="with --sampling-throughput-only: time guided sampling (GFN2-xTB at SCALE) instead")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_molecules_"))
    if args.sampling_throughput_only:
        sampling_throughput_only(Path(args.sampling_throughput_only), args, work)
        return
    smoke = args.smoke
    fast = ["task.timesteps=20"] if smoke else []

    # 1. training throughput
    thr = {p: training_throughput(p, 4 if smoke else 12, 8 if smoke else 64, work) for p in
           (("tiny",) if smoke else ("tiny", "paper"))}

    # 2. data rows
    rows = {"bundled 3k": data_row(Path(ROOT / "trainer/families/molecules_edm/samples/qm9_3k.extxyz.gz"))} \
        if not smoke else {}
    if not smoke and SHARED_QM9.is_file():
        rows["shared 10k"] = data_row(SHARED_QM9)

    # 3. a tiny model trained for a fixed time (2 processes)
    model = work / "edm_tiny"
    # Steps for the time budget: each of the 2 processes runs at about the one-process rate (2 cores).
    steps = 4 if smoke else max(10, int(args.train_minutes * 60 * thr["tiny"] / 64))
    budget = ["train.epochs=0", f"train.max_steps={steps}"]
    started = time.time()
    run(launch(2, "train", str(CONFIG), f"run.output_dir={model}", "run.resume=none", *budget, *fast,
               "eval.every_epochs=0", f"eval.every_steps={2 if smoke else 200}", "eval.sample_every=0",
               "log.progress_bar=false", f"task.cache_dir={work / 'cache'}"))
    train_s = time.time() - started
    records = [json.loads(line) for line in (model / "metrics.jsonl").read_text().splitlines()]
    final_eval = [r for r in records if "eval/nll" in r][-1]
    final_step = max(r.get("step", 0) for r in records)

    # 4. sampling throughput, 1 vs 2 processes
    n_thr = 4 if smoke else args.throughput_samples
    rate1, rate2 = sampling_rates(model, n_thr, work)

    # 5. guidance sweep with GFN2-xTB (2 processes), then the pool's speed-up on one guided set
    scales = [float(s) for s in args.scales.split(",")]
    n = 4 if smoke else args.samples
    sweep = sample_stats(model, work / "sweep", 2, [f"num_samples={n}", f"batch_size={max(1, n // 8)}",
                                                    f"guidance.scales=[{','.join(map(str, scales))}]",
                                                    "guidance.forcefield=gfn2", "evaluation_forcefield=gfn2",
                                                    "chains=1"])
    pool = {}
    for workers in (1, 2):
        stats = sample_stats(model, work / f"pool{workers}", 1,
                             [f"num_samples={min(n, 8)}", f"batch_size={min(n, 8)}", f"guidance.scales=[{scales[-1]}]",
                              "guidance.forcefield=gfn2", f"guidance.forcefield_kwargs={{workers: {workers}}}",
                              "evaluation_forcefield=none", "chains=0"])
        row = stats["sets"][f"guided_scale_{scales[-1]:g}"]
        pool[workers] = row.get("guidance_forcefield_seconds", float("nan"))

    lines = [f"## Molecules (EDM) benchmark, {utc_now()}", "",
             f"Machine: {cpu_model()}, CPU only. Command: `{command_line()}`.", "",
             "Training throughput (one process, CPU, batch 64, molecules/s after warm-up): "
             + ", ".join(f"`{p}` {v:.1f}" for p, v in thr.items()) + ".", ""]
    if rows:
        lines += ["EDM's data row (EDM paper, all of QM9: atom stability 99.0 %, molecule stability 95.2 %, "
                  "validity 97.7 %; GFN2-xTB forces at the DFT minima):", "",
                  "| set | molecules | atom stab. % | mol. stab. % | validity % | uniqueness % | force RMS eV/Å (mean) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for name, r in rows.items():
            lines.append(f"| {name} | {r['num_molecules']} | {pct(r['atom_stability'])} | {pct(r['molecule_stability'])} | "
                         f"{pct(r['validity'])} | {pct(r['uniqueness'])} | {r.get('force_rms_mean', float('nan')):.3f} |")
        lines.append("")
    lines += [f"Tiny model: {final_step} optimizer steps in {train_s / 60:.1f} min (2 processes, T = "
              f"{20 if smoke else 1000}); validation NLL {final_eval['eval/nll']:.1f} nats per molecule.", "",
              f"Sampling throughput ({n_thr} molecules, sampling time only): 1 process {rate1:.2f} molecules/s, "
              f"2 processes {rate2:.2f} molecules/s: **{rate2 / rate1:.2f}x** (target >= 1.8x).", "",
              f"Guidance sweep ({n} molecules per set, same noise per molecule in every set, GFN2-xTB guiding and "
              "evaluating; 2 processes):", "",
              "| set | atom stab. % | mol. stab. % | validity % | uniqueness % | force RMS (mean / median) | "
              "E/atom eV (mean) | FF failures | FF share of time |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in sweep["sets"].items():
        lines.append(f"| {name} | {pct(r['atom_stability'])} | {pct(r['molecule_stability'])} | {pct(r['validity'])} | "
                     f"{pct(r['uniqueness'])} | {r.get('force_rms_mean', float('nan')):.2f} / "
                     f"{r.get('force_rms_median', float('nan')):.2f} | {r.get('energy_per_atom_mean', float('nan')):.2f} | "
                     f"{r.get('forcefield_failures', 0)} | {r.get('guidance_forcefield_share', 0.0):.2f} |")
    lines += ["", f"GFN2-xTB worker pool on one guided set (8 molecules, one process): force-field seconds with 1 worker "
              f"{pool[1]:.1f}, with 2 workers {pool[2]:.1f}: {pool[1] / max(pool[2], 1e-9):.2f}x."]
    section = "\n".join(lines)
    print(section)
    if smoke:
        print("smoke run: nothing written")
    elif args.out:
        write_section(args.out, section, topic=TOPIC)


if __name__ == "__main__":
    main()

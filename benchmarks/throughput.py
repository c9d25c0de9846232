"""Training throughput (tokens/s) and model FLOP utilisation of `protein_sedd` DDiT presets.

One process. For each preset, `Trainer(load_config("configs/protein_sedd/sedd_tiny.yaml", overrides)).fit()`
runs `warmup + steps + 1` optimizer steps on the bundled 3,000-sequence UniProt sample (parsed into
a fresh temp cache, outside the timed window). As in benchmarks/overhead.py we time `fit()` itself:
`evaluate` and `save` are no-ops and `train_step` is wrapped to read the clock as step warmup+1 and
step warmup+steps+1 begin, so the window is exactly `steps` iterations of the real loop (data
loading, collation, forward, backward, optimizer, bookkeeping); logging happens only at the last
step, outside it. On CUDA the clock reads synchronise the device first.

tokens/s counts real (non-padding) residues, the batches' `num_tokens`. Model FLOPs per batch are
`num_tokens * count_flops_per_token(preset, seq_len=<padded batch length>, vocab)` (forward +
backward, attention included, padding not credited); MFU = achieved FLOP/s / `--peak-tflops`.
CPU peak default: an estimate, cores x clock (/proc/cpuinfo "cpu MHz") x fp32 FLOP/cycle/core
(64 with AVX-512 and two FMA units, 32 with AVX2+FMA); pass your own with --peak-tflops.
`--device cuda` trains in bf16 (`train.mixed_precision=bf16`) against 989 TFLOP/s (H100 SXM dense
bf16) by default.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

from bench_report import command_line, cpu_model, utc_now, write_section

TOPIC = "Training throughput and MFU"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

# (device, preset): (max_length, per-device batch, warm-up steps, timed steps)
SETTINGS = {
    ("cpu", "tiny"): (128, 16, 10, 60),
    ("cpu", "small"): (128, 4, 2, 8),
    ("cuda", "tiny"): (512, 64, 20, 100),
    ("cuda", "small"): (512, 32, 10, 50),
    ("cuda", "medium"): (512, 16, 10, 30),
}


def cpu_peak_tflops() -> tuple[float, str]:
    """(fp32 peak estimate in TFLOP/s, how it was computed) from /proc/cpuinfo."""
    mhz, flags = 0.0, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz") and not mhz:
                    mhz = float(line.split(":", 1)[1])
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    per_cycle = 64 if "avx512f" in flags else 32 if {"avx2", "fma"} <= flags else 8
    cores = os.cpu_count() or 1
    peak = cores * mhz * 1e6 * per_cycle / 1e12
    return peak, f"{cores} cores x {mhz / 1000:.2f} GHz x {per_cycle} fp32 FLOP/cycle = {peak * 1000:.0f} GFLOP/s"


def run(preset: str, device: str, workdir: str, threads: int) -> dict[str, float]:
    import torch

    from trainer.config import load_config
    from trainer.core.trainer import Trainer
    from trainer.families.protein_sedd.ddit import DDIT_PRESETS, count_flops_per_token

    max_length, batch, warmup, steps = SETTINGS[(device, preset)]
    torch.set_num_threads(threads)
    cfg = load_config("configs/protein_sedd/sedd_tiny.yaml", [
        f"task.model_preset={preset}", f"task.max_length={max_length}", f"task.cache_dir={workdir}/cache",
        f"train.per_device_batch_size={batch}", f"train.max_steps={warmup + steps + 1}", "train.grad_accum_steps=1",
        "eval.every_steps=0", "ckpt.every_steps=0",
        f"log.every_steps={warmup + steps + 1}", "log.tensorboard=false", "log.progress_bar=false",
        f"run.output_dir={workdir}/{preset}", "run.resume=none",
        *(["train.mixed_precision=bf16"] if device == "cuda" else [])])  # default "no" (fp32)
    trainer = Trainer(cfg)
    vocab = trainer.task.graph.dim
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    clock: dict[str, float] = {}
    counted = {"tokens": 0, "flops": 0.0}
    calls = 0
    train_step = trainer.train_step

    def timed_train_step(batches):
        nonlocal calls
        calls += 1
        if calls in (warmup + 1, warmup + steps + 1):
            sync()
            clock["start" if calls == warmup + 1 else "end"] = time.perf_counter()
        if warmup < calls <= warmup + steps:
            for b, _rng in batches:
                counted["tokens"] += b["num_tokens"]
                counted["flops"] += b["num_tokens"] * count_flops_per_token(DDIT_PRESETS[preset], b["states"].shape[1],
                                                                            vocab)
        return train_step(batches)

    trainer.train_step = timed_train_step
    trainer.evaluate = lambda split="eval": {}
    trainer.save = lambda best=False: None
    trainer.fit()
    seconds = clock["end"] - clock["start"]
    params = sum(p.numel() for p in trainer.model.parameters())
    return {"tokens_per_s": counted["tokens"] / seconds, "step_s": seconds / steps, "flops_per_s": counted["flops"] / seconds,
            "params": params, "max_length": max_length, "batch": batch, "warmup": warmup, "steps": steps,
            "tokens_per_step": counted["tokens"] / steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--presets", default="tiny,small", help="comma-separated DDiT presets")
    p.add_argument("--repeats", type=int, default=3, help="measurements per preset; median reported")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak for MFU (default: 989 bf16 dense on cuda, H100 SXM; an fp32 estimate on cpu)")
    p.add_argument("--out", help="add this benchmark's section (machine, command, table) atop its topic in this markdown file")
    p.add_argument("--smoke", action="store_true", help="the tiny preset for a few short steps on CPU, one repeat, "
                   "nothing written: checks the script runs")
    a = p.parse_args()
    if a.smoke:
        a.device, a.presets, a.repeats, a.out = "cpu", "tiny", 1, None
        SETTINGS[("cpu", "tiny")] = (32, 4, 1, 2)  # short sequences, a few steps
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the Trainer picks CUDA whenever it sees one
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible")
    presets = [s.strip() for s in a.presets.split(",") if s.strip()]
    if unknown := [s for s in presets if (a.device, s) not in SETTINGS]:
        p.error(f"no settings for {unknown} on {a.device}; choose from {[k[1] for k in SETTINGS if k[0] == a.device]}")
    threads = a.threads or os.cpu_count() or 1
    if a.device == "cuda":
        peak, peak_note = a.peak_tflops or 989.0, f"{a.peak_tflops or 989.0:g} TFLOP/s bf16 dense"
        hw = f"{torch.cuda.get_device_name()} (bf16), host {cpu_model()}"
    else:
        est, how = cpu_peak_tflops()
        peak = a.peak_tflops or est
        peak_note = f"{peak * 1000:.0f} GFLOP/s fp32" + ("" if a.peak_tflops else f" (estimate: {how})")
        hw = f"{cpu_model()} (fp32, torch threads = {threads})"

    warnings.filterwarnings("ignore")
    logging.getLogger("trainer").setLevel(logging.WARNING)
    import datasets
    datasets.disable_progress_bars()
    started = time.perf_counter()
    results: dict[str, list[dict[str, float]]] = {s: [] for s in presets}
    with tempfile.TemporaryDirectory(prefix="throughput-") as workdir:
        for r in range(a.repeats):
            for preset in presets:
                t0 = time.perf_counter()
                res = run(preset, a.device, workdir, threads)
                results[preset].append(res)
                print(f"repeat {r + 1}/{a.repeats} {preset}: {res['tokens_per_s']:,.0f} tokens/s, "
                      f"{res['step_s'] * 1000:.1f} ms/step ({time.perf_counter() - t0:.0f} s incl. setup)", file=sys.stderr)
    rows = ["| preset | params | max_length x batch | timed steps (warm-up) | real tokens/step | step time ms "
            "| tokens/s | achieved GFLOP/s | MFU |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for preset in presets:
        runs = results[preset]
        med = {k: statistics.median(x[k] for x in runs) for k in ("tokens_per_s", "step_s", "flops_per_s", "tokens_per_step")}
        x = runs[0]
        rows.append(f"| {preset} | {x['params'] / 1e6:.2f} M | {x['max_length']} x {x['batch']} | {x['steps']} ({x['warmup']}) "
                    f"| {med['tokens_per_step']:.0f} | {med['step_s'] * 1000:.1f} | {med['tokens_per_s']:,.0f} "
                    f"| {med['flops_per_s'] / 1e9:,.1f} | {100 * med['flops_per_s'] / (peak * 1e12):.1f} % |")
    table = "\n".join(rows)
    elapsed = time.perf_counter() - started
    print(table)
    print(f"\npeak {peak_note}; median of {a.repeats}; total {elapsed:.0f} s")
    if a.smoke:
        print("smoke run: nothing written")
    if a.out:
        now, command = utc_now(), command_line()
        versions = f"Python {platform.python_version()}, torch {torch.__version__}"
        write_section(a.out, (f"## Training throughput benchmark (protein_sedd, {a.device}), {now}\n\n"
                    f"- Machine: {hw}; {versions}\n- Command: `{command}`\n"
                    f"- `Trainer.fit()` on the bundled 3k UniProt sample, one process, "
                    f"timed steps after warm-up steps, median of {a.repeats}; tokens = real residues (`num_tokens`); "
                    f"FLOPs from `count_flops_per_token` at the padded batch length; MFU peak = {peak_note}\n\n"
                    f"{table}\n\nTotal wall time {elapsed:.0f} s (setup included).\n"), topic=TOPIC)


if __name__ == "__main__":
    main()

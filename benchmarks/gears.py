"""GEARS (`perturbation_gears`) on simulated Perturb-seq data: quality against the four baselines per
subgroup, CPU training throughput (cells/s, s/epoch), peak RSS on a Norman-size set, and, with the JSON of
`benchmarks/gears_original.py`, the side-by-side table with GEARS itself (cell-gears).

1. Quality and speed: `Trainer.fit()` in this process with `configs/perturbation_gears/gears_norman.yaml`
   (GEARS' recipe: hidden 64, batch 32, Adam 1e-3 / wd 5e-4, StepLR 0.5 per epoch) on the simulated set of
   `gears_original.BENCH_DATA` (the same file, split and epochs as the original's run), one process,
   `data.num_workers=0` (GEARS' loaders have no workers either), 1 torch thread (`gears_original.THREADS`).
   The test table (RUN/test/metrics.json) has the model (the best checkpoint by validation mse_de,
   `eval.test_weights=best`, as GEARS tests its best model) and the no-change, training-mean, additive and
   linear baselines per subgroup. An epoch is timed between the Trainer's evaluations: training steps, the
   validation pass and any checkpoint (wall and process CPU seconds); cells/s = training cells of an
   epoch / its training seconds.
2. Memory: a Norman-size set (`NORMAN_DATA`: 88,880 cells x 5,000 genes, 105 singles, 131 doubles, as
   Norman et al. 2019) is simulated in a child process, then another fresh process builds the Trainer
   (read, split, graphs), trains `--norman-steps` steps and runs the final validation and test passes (at
   most `NORMAN_EVAL_CELLS` cells per condition, to keep the run short); it reports its peak RSS (VmHWM)
   and the peak of each phase. Target: peak RSS <= 2 x (bytes of the sparse matrix X: data +
   indices + indptr, + the model's parameters and buffers).
3. Side by side (`--original-results FILE...` from `gears_original.py --seed S --json FILE`, one per
   seed): the same metrics of GEARS' best model (scored by the same `metrics.py` code) and s/epoch, as
   means over GEARS' seeds and over ours (`--seeds`); the per-seed counts are reported too. Targets: our
   metrics at least as good, our epoch at least 2x faster on CPU.

    for s in 0 1 2; do python benchmarks/gears_original.py --epochs 10 --seed $s --json /tmp/gears_s$s.json; done
    python benchmarks/gears.py --epochs 10 --seeds 0 1 2 --original-results /tmp/gears_s{0,1,2}.json [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from bench_report import command_line, utc_now, write_section  # noqa: E402
from gears_original import (  # noqa: E402
    GROUPS,
    HEADLINE,
    RECIPE,
    SPLIT,
    THREADS,
    epoch_summary,
    load_benchmark_split,
    machine,
    simulate_benchmark_data,
)

TOPIC = "GEARS: against GEARS itself (cell-gears)"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

CONFIG = ROOT / "configs" / "perturbation_gears" / "gears_norman.yaml"
NORMAN_DATA: dict[str, Any] = {"num_genes": 5000, "num_perturbed_genes": 105, "num_doubles": 131, "cells_per_condition": 330,
                               "num_control_cells": 11000, "counts_per_gene": 1.0, "scale_sd": 1.5, "seed": 0}
"""Norman et al. 2019's shape (88,880 cells x 5,000 genes); counts_per_gene 1 gives a Norman-like sparsity."""
NORMAN_EVAL_CELLS = 128
"""Validation/test cells per condition in the memory run (one forward chunk; all 330 would multiply the run's
time and change only the eval batch's dense x/y, ~2 x 8 x 200 x 5,000 x 4 B = 64 MB)."""
PREDICTORS = ("model", "no_change", "train_mean", "additive", "linear")


def overrides(data_folder: Path, out: Path, cache: Path) -> list[str]:
    """The benchmark's settings on top of gears_norman.yaml (GEARS' recipe), spelled out so both runs match."""
    return [f"run.output_dir={out}", "run.resume=none", "log.progress_bar=false", "log.tensorboard=false",
            f"task.data_path={data_folder}", f"task.gene2go_path={data_folder / 'gene2go.tsv'}", f"task.cache_dir={cache}",
            f"task.split={SPLIT['mode']}", f"task.split_seed={SPLIT['seed']}",
            f"task.train_gene_set_size={SPLIT['train_gene_set_size']}",
            f"task.combo_seen2_train_frac={SPLIT['combo_seen2_train_frac']}", f"task.hidden_size={RECIPE['hidden_size']}",
            f"task.eval_cells_per_forward={RECIPE['test_batch_size']}", f"train.per_device_batch_size={RECIPE['batch_size']}",
            f"optim.lr={RECIPE['lr']}", f"optim.weight_decay={RECIPE['weight_decay']}", "data.num_workers=0",
            "log.every_steps=20", *SMOKE_OVERRIDES]


SMOKE_OVERRIDES: list[str] = []
"""Set by --smoke: no torch.compile (its one-off compile is most of a smoke run's time, and --smoke checks the
script, not the speed-up)."""


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state so that another Trainer can start in this process."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def run_ours(data_folder: Path, work: Path, epochs: int, seed: int = 0) -> dict[str, Any]:
    """Train and test on the benchmark set with run.seed=`seed`; metrics of the model and baselines, epoch
    times, cells/s."""
    import torch

    from trainer.config import load_config
    from trainer.core.trainer import Trainer

    torch.set_num_threads(THREADS)
    out = work / f"run_seed{seed}"
    cfg = load_config(str(CONFIG), [*overrides(data_folder, out, work / "cache"), f"train.epochs={epochs}", f"run.seed={seed}"])
    t0 = (time.perf_counter(), time.process_time())
    trainer = Trainer(cfg)
    t1 = (time.perf_counter(), time.process_time())
    marks: list[tuple[str, float, float, float, float]] = []  # (split, start wall, start cpu, end wall, end cpu)
    evaluate = trainer.evaluate

    def timed_evaluate(split: str = "eval") -> dict[str, float]:
        w, c = time.perf_counter(), time.process_time()
        metrics = evaluate(split)
        marks.append((split, w, c, time.perf_counter(), time.process_time()))
        return metrics

    trainer.evaluate = timed_evaluate
    trainer.fit()
    epochs_timed, start = [], t1
    for _, w0, c0, w1, c1 in [m for m in marks if m[0] == "eval"]:
        epochs_timed.append({"wall_s": w1 - start[0], "cpu_s": c1 - start[1], "train_wall_s": w0 - start[0],
                             "train_cpu_s": c0 - start[1], "eval_wall_s": w1 - w0, "eval_cpu_s": c1 - c0})
        start = (w1, c1)
    train_cells = len(trainer.data.dataset)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    windows = [r["cells_per_s"] for r in records if "cells_per_s" in r]
    windows = windows[1:] or windows  # the first window has the warm-up
    test = json.loads((out / "test" / "metrics.json").read_text())
    final = test_metrics_of(out, "latest")  # the last step's weights, next to the selected best's
    tested = next(r["test/weights_step"] for r in records if "test/weights_step" in r)
    split = json.loads((out / "test" / "split.json").read_text())
    reset_accelerate()
    return {"prepare_wall_s": t1[0] - t0[0], "epochs": epochs_timed, "train_cells": train_cells,
            "cells_per_s_windows": statistics.median(windows) if windows else float("nan"),
            "model": test["model"], "model_final": final, "baselines": test["baselines"], "split": split,
            "steps": trainer.plan.max_steps, "tested_step": tested, "seed": seed, "torch": torch.__version__,
            "eval_controls": cfg.task.eval_controls,
            "scheduler": f"{cfg.optim.scheduler}" + (f" x{cfg.optim.decay_gamma:g} every {trainer.plan.decay_every_steps} steps"
                                                     if cfg.optim.scheduler == "step" else "")}


# --------------------------------------------------------------------------- Norman-size memory
_SIMULATE_CHILD = """
import json, sys
from trainer.families.perturbation_gears.simulate import simulate_perturbation_data
print(json.dumps(simulate_perturbation_data(sys.argv[1], **json.loads(sys.argv[2])), default=str))
"""


def test_metrics_of(run_dir: Path, checkpoint: str) -> dict[str, float]:
    """The test metrics of one checkpoint of a finished run, computed as the Trainer's test pass does."""
    import torch
    from torch.utils.data import DataLoader

    from trainer.frontends.perturbation import load_gears_model

    model, task = load_gears_model(run_dir, checkpoint=checkpoint)
    loader = DataLoader(task.build_data().test, batch_size=8, collate_fn=task.collate)
    with torch.no_grad():
        outs = [task.eval_step(model, batch) for batch in loader]
    return task.reduce_metrics({k: torch.cat([o[k].float() for o in outs]) for k in outs[0]})


def vm_hwm_mb() -> float:
    """This process's peak RSS (VmHWM). Not ru_maxrss: Linux carries that over exec from the forking parent."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


class PhasePeaks:
    """Samples this process's RSS every 50 ms in a thread and keeps the maximum of each named phase."""

    def __init__(self) -> None:
        import threading

        self.page = os.sysconf("SC_PAGE_SIZE")
        self.phase, self.peaks = "imports", {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss_mb(self) -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page / 2**20

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), self.rss_mb())

    def enter(self, phase: str) -> None:
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), self.rss_mb())
        self.phase = phase

    def stop(self) -> dict[str, float]:
        self.enter("done")
        self._stop.set()
        self._thread.join()
        return {k: v for k, v in self.peaks.items() if k != "done"}


def norman_child(data_folder: Path, work: Path, steps: int) -> None:
    """Child process: build the Trainer, train `steps` steps, final eval + test; print RSS peaks (JSON)."""
    peaks = PhasePeaks()
    import torch

    from trainer.config import load_config
    from trainer.core.trainer import Trainer

    torch.set_num_threads(THREADS)
    after_imports = peaks.rss_mb()
    cfg = load_config(str(CONFIG), [*overrides(data_folder, work / "run", work / "cache"), "train.epochs=0",
                                    f"train.max_steps={steps}", "eval.every_epochs=0", "eval.every_steps=0",
                                    "ckpt.every_epochs=0", f"ckpt.every_steps={steps}",
                                    f"task.eval_max_cells={NORMAN_EVAL_CELLS}",
                                    "task.eval_cells_per_forward=0"])  # the default, not GEARS' 128 of the side-by-side
    peaks.enter("build")
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    built_s = time.perf_counter() - t0
    after_build = peaks.rss_mb()
    evaluate = trainer.evaluate

    def phased_evaluate(split: str = "eval") -> dict[str, float]:
        peaks.enter(split)
        return evaluate(split)

    trainer.evaluate = phased_evaluate
    peaks.enter("train")
    t1 = time.perf_counter()
    trainer.fit()
    fit_s = time.perf_counter() - t1
    phase_peaks = peaks.stop()
    train = trainer.data.dataset
    X = train.pairs.data.X  # TrainingPairs(PerturbationPairs)
    model = trainer.model
    x_bytes = X.data.nbytes + X.indices.nbytes + X.indptr.nbytes
    model_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line]
    windows = [r["cells_per_s"] for r in records if "cells_per_s" in r]
    windows = windows[1:] or windows
    print(json.dumps({"rss_after_imports_mb": after_imports, "rss_after_build_mb": after_build, "phase_peaks_mb": phase_peaks,
                      "peak_mb": vm_hwm_mb(), "build_s": built_s,
                      "fit_s": fit_s, "steps": steps, "x_mb": x_bytes / 2**20, "x_shape": list(X.shape), "x_nnz": int(X.nnz),
                      "model_mb": model_bytes / 2**20, "cells_per_s": statistics.median(windows) if windows else None}))


def run_norman(work: Path, steps: int, settings: dict[str, Any], smoke: bool = False) -> dict[str, Any]:
    """Simulate the Norman-size set (child 1), then measure a training run's peak RSS (child 2, fresh)."""
    data_folder = work / "norman"
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    t0 = time.perf_counter()
    sim = subprocess.run([sys.executable, "-c", _SIMULATE_CHILD, str(data_folder), json.dumps(settings)],
                         capture_output=True, text=True, check=True, env=env)
    simulate_s = time.perf_counter() - t0
    child = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--norman-child", str(data_folder),
                            "--work", str(work / "norman_work"), "--norman-steps", str(steps),
                            *(["--smoke"] if smoke else [])],
                           capture_output=True, text=True, env=env)
    if child.returncode != 0:
        raise RuntimeError(f"Norman-size child failed (exit {child.returncode}):\n{child.stderr[-4000:]}")
    result = json.loads(child.stdout.strip().splitlines()[-1])
    result.update({"simulate_s": simulate_s, "simulated": json.loads(sim.stdout.strip().splitlines()[-1]),
                   "file_mb": (data_folder / "perturb_processed.h5ad").stat().st_size / 2**20, "settings": settings})
    return result


# --------------------------------------------------------------------------- report
def fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else ""


def mean_metrics(tables: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over the runs that have it (all runs have the same keys here)."""
    keys = set.intersection(*(set(t) for t in tables))
    return {k: statistics.fmean(t[k] for t in tables) for k in sorted(keys)}


def combine_ours(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record of several seeds' runs: mean model metrics, every epoch's times, per-seed metrics kept."""
    if any(r["baselines"] != runs[0]["baselines"] for r in runs):
        raise RuntimeError("the baselines differ between seeds: they depend on the data and split only")
    return {**runs[0], "model": mean_metrics([r["model"] for r in runs]), "per_seed": [r["model"] for r in runs],
            "model_final": mean_metrics([r["model_final"] for r in runs]),
            "per_seed_final": [r["model_final"] for r in runs],
            "seeds": [r["seed"] for r in runs], "tested_steps": [r["tested_step"] for r in runs],
            "epochs": [e for r in runs for e in r["epochs"]],
            "prepare_wall_s": statistics.median(r["prepare_wall_s"] for r in runs),
            "cells_per_s_windows": statistics.median(r["cells_per_s_windows"] for r in runs)}


def combine_original(results: list[dict[str, Any]], eval_controls: str = "mean") -> dict[str, Any]:
    """One record of several GEARS runs (seeds): mean metrics, every epoch's times, per-seed metrics kept.

    `eval_controls` picks the GEARS scores made the way ours were: `mean` (its predictions moved to the control
    mean: `metrics_control_mean`) or `paired` (as GEARS predicted them, from its paired controls: `metrics`)."""
    key = "metrics_control_mean" if eval_controls == "mean" else "metrics"
    missing = [r["settings"]["seed"] for r in results if key not in r]
    if missing:
        raise RuntimeError(f"GEARS results of seed(s) {missing} have no '{key}': rerun benchmarks/gears_original.py")
    results = [{**r, "metrics": r[key]} for r in results]
    for r in results[1:]:
        if (r.get("data"), r.get("split"), r["settings"]["epochs"]) != (results[0].get("data"), results[0].get("split"),
                                                                       results[0]["settings"]["epochs"]):
            raise RuntimeError("the GEARS results differ in data, split or epochs: only the seed may differ")
    return {**results[0], "metrics": mean_metrics([r["metrics"] for r in results]),
            "per_seed": [r["metrics"] for r in results], "seeds": [r["settings"]["seed"] for r in results],
            "epochs": [e for r in results for e in r["epochs"]],
            "prepare_wall_s": statistics.median(r["prepare_wall_s"] for r in results)}


def quality_table(ours: dict[str, Any]) -> str:
    """Rows: subgroup x headline metric; columns: the model and the four baselines."""
    tables = {"model": ours["model"], **ours["baselines"]}
    rows = ["| subgroup (conditions) | metric | " + " | ".join(PREDICTORS) + " |", "|---|---|" + "---:|" * len(PREDICTORS)]
    for group in GROUPS:
        prefix = "" if group == "all" else f"{group}/"
        n = ours["model"].get(prefix + "n_conditions")
        if not n:
            continue
        for metric in ("mse_de", "pearson_delta", "pearson_delta_de", "frac_correct_direction_20"):
            values = [tables[p].get(prefix + metric) for p in PREDICTORS]
            best = (min if metric == "mse_de" else max)(v for v in values if v is not None)
            cells = [f"**{fmt(v)}**" if v == best else fmt(v) for v in values]
            rows.append(f"| {group} ({int(n)}) | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def standard_error(values: list[float]) -> float:
    """Standard error of the mean over seeds (nan with one seed)."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")


def compare(a: float, se_a: float, b: float, se_b: float, lower_better: bool) -> tuple[float, float, str]:
    """(ours - GEARS with better > 0, its standard error, "yes" / "within noise" / "no"); see side_by_side."""
    gain = (b - a) if lower_better else (a - b)
    se_gain = (se_a ** 2 + se_b ** 2) ** 0.5
    return gain, se_gain, "yes" if gain >= 0 else "within noise" if -gain < 2 * se_gain else "no"


def side_by_side(ours: dict[str, Any], original: dict[str, Any]) -> tuple[str, str]:
    """The table ours vs GEARS per subgroup and headline metric, plus the epoch times; and the verdict.

    Seeds of the two sides are unrelated (independent initialisations and data orders), so the comparison is of
    means over seeds with their standard errors, not seed against seed. A pair is "yes" when our mean is at least
    as good, "within noise" when it is worse by less than twice the standard error of the difference of the
    means (a non-inferiority reading), "no" otherwise. The last two columns score our final weights instead of
    the best checkpoint by validation mse_de (GEARS' protocol, the headline), to show what that selection costs."""
    lower_better = {"mse_de", "mse"}
    rows = ["| subgroup | metric | ours (mean ± SE) | GEARS (mean ± SE) | ours - GEARS, better > 0 | ours at least as good "
            "| ours, final weights | at least as good |", "|---|---|---:|---:|---:|---|---:|---|"]
    wins = within = total = 0
    final_counts = {"yes": 0, "within noise": 0, "no": 0}
    for group in GROUPS:
        prefix = "" if group == "all" else f"{group}/"
        if not ours["model"].get(prefix + "n_conditions"):
            continue
        for metric in HEADLINE:
            key = prefix + metric
            a, b = ours["model"].get(key), original["metrics"].get(key)
            if a is None or b is None:
                continue
            se_a = standard_error([r[key] for r in ours.get("per_seed", []) if key in r])
            se_b = standard_error([r[key] for r in original.get("per_seed", []) if key in r])
            gain, se_gain, verdict = compare(a, se_a, b, se_b, metric in lower_better)
            wins, within, total = wins + (gain >= 0), within + (verdict == "within noise"), total + 1
            a_final = ours.get("model_final", {}).get(key)
            final_cells = "| |"
            if a_final is not None:
                se_final = standard_error([r[key] for r in ours.get("per_seed_final", []) if key in r])
                final_verdict = compare(a_final, se_final, b, se_b, metric in lower_better)[2]
                final_counts[final_verdict] += 1
                final_cells = f"| {fmt(a_final)} ± {se_final:.4f} | {final_verdict} |"
            rows.append(f"| {group} | {metric} | {fmt(a)} ± {se_a:.4f} | {fmt(b)} ± {se_b:.4f} | {gain:+.4f} ± {se_gain:.4f} "
                        f"| {verdict} {final_cells}")
    ep_ours, ep_orig = epoch_summary(ours["epochs"]), epoch_summary(original["epochs"])
    rows += ["", "| per epoch (median) | ours | GEARS (cell-gears) | GEARS / ours |", "|---|---:|---:|---:|"]
    for key, label in (("wall_s", "epoch, wall s"), ("cpu_s", "epoch, CPU s"), ("train_wall_s", "training steps, wall s"),
                       ("train_cpu_s", "training steps, CPU s"), ("eval_wall_s", "its evaluation passes, wall s")):
        rows.append(f"| {label} | {ep_ours[key]:.1f} | {ep_orig[key]:.1f} | {ep_orig[key] / ep_ours[key]:.2f} |")
    # The mean keeps the first epoch, which carries one-off costs (ours: train.compile's compile, cold cache).
    mean_ours, mean_orig = (statistics.fmean(e["wall_s"] for e in r["epochs"]) for r in (ours, original))
    rows.append(f"| epoch, wall s, mean with the first (compile) | {mean_ours:.1f} | {mean_orig:.1f} | "
                f"{mean_orig / mean_ours:.2f} |")
    rows.append(f"| data preparation, wall s | {ours['prepare_wall_s']:.1f} | {original['prepare_wall_s']:.1f} | "
                f"{original['prepare_wall_s'] / ours['prepare_wall_s']:.2f} |")
    speed_wall, speed_cpu, speed_mean = (ep_orig["wall_s"] / ep_ours["wall_s"], ep_orig["cpu_s"] / ep_ours["cpu_s"],
                                         mean_orig / mean_ours)
    speed_met = "met" if min(speed_wall, speed_cpu, speed_mean) >= 2 else "NOT met"
    seeds = (len(ours.get("per_seed", [])) or 1, len(original.get("per_seed", [])) or 1)
    verdict = (f"Ours (mean of {seeds[0]} seed(s)) at least as good as GEARS' (mean of {seeds[1]}) on {wins} of {total} "
               f"(subgroup, metric) pairs, and behind by less than 2 standard errors on {within} more "
               f"(target: all at least as good: {'met' if wins == total else 'NOT met'}; within the seed noise: "
               f"{'met' if wins + within == total else 'NOT met'}). With our final weights instead of the best checkpoint by "
               f"validation mse_de: at least as good on {final_counts['yes']}, within noise on {final_counts['within noise']}, "
               f"behind on {final_counts['no']}. Epoch speed-up {speed_wall:.2f}x wall, {speed_cpu:.2f}x CPU "
               f"(medians), {speed_mean:.2f}x wall with the first epochs' one-off costs (target >= 2x: {speed_met}).")
    return "\n".join(rows), verdict


def check_same_run(ours: dict[str, Any], original: dict[str, Any], settings: dict[str, Any], epochs: int) -> list[str]:
    """Differences between the two runs' data, split and epochs (empty: comparable)."""
    problems = []
    if original.get("data") != settings:
        problems.append(f"data settings differ: ours {settings}, GEARS' {original.get('data')}")
    if original["settings"]["epochs"] != epochs:
        problems.append(f"epochs differ: ours {epochs}, GEARS' {original['settings']['epochs']}")
    if original.get("split") != SPLIT or original.get("split_counts", {}).get("test") != len(ours["split"]["test"]):
        problems.append(f"split differs: ours {SPLIT} ({len(ours['split']['test'])} test), GEARS' {original.get('split')} "
                        f"({original.get('split_counts')})")
    if original.get("test_conditions_missing"):
        problems.append(f"GEARS predicted no cells of {original['test_conditions_missing']}")
    return problems


def build_section(args: argparse.Namespace, settings: dict[str, Any], ours: dict[str, Any], norman: dict[str, Any] | None,
                  original: dict[str, Any] | None, host: str) -> str:
    d = settings
    cells = d["cells_per_condition"] * (d["num_perturbed_genes"] + d["num_doubles"]) + d["num_control_cells"]
    ep = epoch_summary(ours["epochs"])
    split_counts = {k: len(ours["split"][k]) for k in ("train", "val", "test")}
    text = [f"## GEARS (perturbation_gears) benchmark, {utc_now()}", "",
            f"- Machine: {host}; torch {ours['torch']}", f"- Command: `{command_line()}`",
            f"- Data: simulated ({d['num_genes']} genes, {d['num_perturbed_genes']} singles, {d['num_doubles']} doubles, "
            f"{d['cells_per_condition']} cells each, {d['num_control_cells']} controls: {cells:,} cells; counts_per_gene "
            f"{d['counts_per_gene']:g}, seed {d['seed']}); GEARS' simulation split, seed 1: {split_counts} conditions, "
            f"{ours['train_cells']:,} training cells",
            f"- Run: `configs/perturbation_gears/gears_norman.yaml` (hidden {RECIPE['hidden_size']}, batch "
            f"{RECIPE['batch_size']}, Adam {RECIPE['lr']:g}, wd {RECIPE['weight_decay']:g}, {ours['scheduler']}), "
            f"{args.epochs} epochs "
            f"({ours['steps']} steps), one process, no loader workers, {THREADS} torch thread(s); run.seed "
            f"{', '.join(map(str, ours['seeds']))} (model metrics: their mean); test = the best checkpoint by validation "
            f"mse_de (steps {', '.join(map(str, ours['tested_steps']))}), as GEARS", "",
            "### Quality against the baselines (test set, per subgroup; best in bold)", "", quality_table(ours), "",
            "### Training throughput on CPU", "",
            f"Median epoch {ep['wall_s']:.1f} s wall / {ep['cpu_s']:.1f} s CPU, of which training steps "
            f"{ep['train_wall_s']:.1f} s wall / {ep['train_cpu_s']:.1f} s CPU and the validation pass {ep['eval_wall_s']:.1f} s: "
            f"**{ours['train_cells'] / ep['train_wall_s']:,.0f} training cells/s** (wall; "
            f"{ours['train_cells'] / ep['train_cpu_s']:,.0f} per CPU second; median of the logged windows "
            f"{ours['cells_per_s_windows']:,.0f}); data preparation (read, split, graphs) {ours['prepare_wall_s']:.1f} s. "
            f"The first epoch of the first seed took {ours['epochs'][0]['wall_s']:.1f} s: it includes train.compile's compile "
            f"(inductor cache dir: {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'the default, possibly warm')})."]
    if norman is not None:
        target = 2 * (norman["x_mb"] + norman["model_mb"])
        n = norman["settings"]
        shape = norman["x_shape"]
        text += ["", "### Peak RSS on a Norman-size simulated set", "",
                 f"{shape[0]:,} cells x {shape[1]:,} genes ({n['num_perturbed_genes']} singles, {n['num_doubles']} doubles, "
                 f"{n['cells_per_condition']} cells each, {n['num_control_cells']:,} controls; counts_per_gene "
                 f"{n['counts_per_gene']:g}, scale_sd {n['scale_sd']:g}); simulated in {norman['simulate_s']:.0f} s "
                 f"({norman['file_mb']:.0f} MiB h5ad). A fresh process builds the Trainer ({norman['build_s']:.0f} s: read, "
                 f"split, graphs), trains {norman['steps']} steps of 32 cells and runs the final validation and test passes "
                 f"(at most {NORMAN_EVAL_CELLS} cells per condition; {norman['fit_s']:.0f} s; "
                 f"{norman['cells_per_s'] or float('nan'):,.0f} training cells/s).", "",
                 "| X (CSR: data + indices + indptr) MiB | model MiB | target 2 x (X + model) MiB | RSS after imports MiB "
                 "| RSS after building MiB | peak RSS (VmHWM) MiB | peak / (X + model) |",
                 "|---:|---:|---:|---:|---:|---:|---:|",
                 f"| {norman['x_mb']:,.0f} (nnz {norman['x_nnz']:,}) | {norman['model_mb']:.1f} | {target:,.0f} | "
                 f"{norman['rss_after_imports_mb']:,.0f} | {norman['rss_after_build_mb']:,.0f} | {norman['peak_mb']:,.0f} | "
                 f"{norman['peak_mb'] / (norman['x_mb'] + norman['model_mb']):.2f} |", "",
                 "Peak RSS of each phase (sampled every 50 ms), MiB: " + ", ".join(
                     f"{k} {v:,.0f}" for k, v in norman["phase_peaks_mb"].items()) + ".", "",
                 f"Target peak <= 2 x (X + model): {'met' if norman['peak_mb'] <= target else 'NOT met'} "
                 f"(GEARS' users report > 128 GB for Norman)."]
    if original is not None:
        table, verdict = side_by_side(ours, original)
        problems = check_same_run(ours, original, settings, args.epochs)
        text += ["", "### Side by side with GEARS itself (cell-gears)", "",
                 f"GEARS {original['gears_version']} (torch {original['torch']}, torch_geometric {original['torch_geometric']}) "
                 f"from `benchmarks/gears_original.py` ({original['machine']}; seeds {', '.join(map(str, original['seeds']))}, "
                 f"metrics: their mean): the same h5ad, split and epochs, GEARS' "
                 f"defaults, StepLR, its best model by validation mse_de; its test predictions scored by the same "
                 f"`metrics.py`, " + ("at the control mean as ours (`task.eval_controls=mean`): GEARS' mean prediction "
                                      "minus the mean of the controls it paired, plus the control mean" if ours["eval_controls"]
                                      == "mean" else "both from paired control cells (GEARS' protocol)")
                 + ". GEARS' epoch includes its evaluation of the whole training set; ours the validation pass.",
                 "", table, "", verdict]
        if problems:
            text += ["", "**Not comparable:** " + "; ".join(problems)]
    return "\n".join(text) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10, help="training epochs (the same as gears_original.py's)")
    p.add_argument("--original-results", type=Path, nargs="+", default=None,
                   help="JSON file(s) of gears_original.py --json (one per seed): add the side-by-side (means over seeds)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="run.seed of our runs (metrics: their mean)")
    p.add_argument("--norman-steps", type=int, default=20, help="training steps of the Norman-size memory run")
    p.add_argument("--skip-norman", action="store_true", help="leave out the Norman-size memory run (the longest part)")
    p.add_argument("--work", type=Path, default=None, help="working folder (default: a temp dir)")
    p.add_argument("--out", help="add this benchmark's section to this markdown file, at the top of its topic")
    p.add_argument("--smoke", action="store_true", help="a tiny set, 1 epoch, a tiny 'Norman' set, nothing written")
    p.add_argument("--norman-child", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        SMOKE_OVERRIDES.append("train.compile=false")
    if a.norman_child is not None:
        norman_child(a.norman_child, a.work, a.norman_steps)
        return
    if a.smoke:
        a.epochs, a.norman_steps = 1, 2
    with tempfile.TemporaryDirectory(prefix="gears-bench-") as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        host = machine()
        data_folder = work / "data"
        settings = simulate_benchmark_data(data_folder, smoke=a.smoke)
        _, _, split = load_benchmark_split(data_folder)
        ours = combine_ours([run_ours(data_folder, work, a.epochs, seed) for seed in a.seeds])
        exported = {"train": split.train, "val": split.val, "test": split.test}
        if {k: ours["split"][k] for k in exported} != exported:
            raise RuntimeError("the run's split differs from the split exported to GEARS (gears_original.load_benchmark_split)")
        norman = None
        if not a.skip_norman:
            norman_settings = dict(NORMAN_DATA)
            if a.smoke:
                norman_settings.update(num_genes=80, num_perturbed_genes=10, num_doubles=8, cells_per_condition=6,
                                       num_control_cells=40)
            norman = run_norman(work, a.norman_steps, norman_settings, smoke=a.smoke)
    originals = [json.loads(path.read_text()) for path in a.original_results or []]
    original = combine_original(originals, ours["eval_controls"]) if originals else None
    text = build_section(a, settings, ours, norman, original, host)
    print(text)
    if a.smoke:
        print("smoke run: nothing written")
        return
    if a.out:
        write_section(a.out, text, topic=TOPIC)


if __name__ == "__main__":
    main()

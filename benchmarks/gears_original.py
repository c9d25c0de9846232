"""GEARS itself (PyPI `cell-gears`) on our simulated data, split and epochs: test metrics per subgroup, s/epoch.

The original runs in its own virtual environment (default /tmp/gears_env), never in ours. Create it with

    python benchmarks/gears_original.py --setup [--env /tmp/gears_env]

which runs `python -m venv ENV`, installs `torch==2.13.0` first (the CPU build of this machine's
index / wheel folder), then `cell-gears` with the pins of `GEARS_PINS`: cell-gears 0.1.2 (the latest on
PyPI; it pins nothing itself and imports `torch_geometric`), torch-geometric 2.8.1 (still has the
deprecated `torch_geometric.data.DataLoader` GEARS imports) and scipy 1.14.1: with scipy >= 1.15 GEARS
fails at `GEARS(pert_data)` (`adata.X[adata.obs.condition == 'ctrl']`: "'Series' object has no attribute
'nonzero'", scipy's sparse indexing no longer takes a pandas boolean Series). pip resolves the rest.

Offline: GEARS downloads from Harvard Dataverse, relative to `PertData(data_path)` (gears/pertdata.py,
gears/utils.py of cell-gears 0.1.2), unless the file is already there:
  - `data_path/gene2go_all.pkl` (PertData.__init__): a pickle of {gene: set of GO ids};
  - `data_path/essential_all_data_pert_genes.pkl` (set_pert_genes, default_pert_graph=True): a pickle of a
    gene list, the perturbable genes (their GO graph nodes);
  - `data_path/go_essential_all/go_essential_all.csv` (get_similarity_network('go'), a folder checked by
    tar_data_download_wrapper): columns source,target,importance = the GO-term Jaccard similarity of every
    gene pair above 0.1, self-pairs included (GEARS' make_GO rule); GEARS keeps the top k+1 per target.
We write all three from the simulated data's gene2go (perturbable genes = every read-out gene with GO terms,
our `pert_gene_set: var`), copy the simulated `perturb_processed.h5ad` to `data_path/sim/`, load it with
GEARS' own `PertData.load(data_path=...)` (its DE fields are the file's, the same our reader uses) and pass
our split (`split_conditions(mode='simulation', seed=1)`) as GEARS' custom split pickle
{'train', 'val', 'test'}. GEARS builds its co-expression graph itself (from train conditions with 'ctrl').

The GEARS part runs as `ENV/bin/python benchmarks/gears_original.py --worker DIR` (this file's worker needs
only GEARS' environment): `GEARS.train(epochs)` with GEARS' defaults (hidden 64, batch 32, Adam 1e-3, weight
decay 5e-4, StepLR 0.5 per epoch, value clipping 1.0, best model by validation mse_de), CPU, seeded. An epoch
is timed from GEARS' own `evaluate` calls: training steps, then its evaluation of the train and validation
sets (wall and process CPU seconds). Test: the best model's per-cell predictions (GEARS' `evaluate`) are
averaged per condition and scored here with our metric code (`metrics.condition_metrics`, the same numbers
the Trainer reports), per subgroup; GEARS' own `compute_metrics` / `deeper_analysis` values are kept beside
them as a cross-check.

    python benchmarks/gears_original.py [--epochs 10] [--json gears_original.json] [--out BENCHMARKS.md]
    python benchmarks/gears.py --original-results gears_original.json ...   # the side-by-side table
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
from typing import Any

TOPIC = "GEARS: against GEARS itself (cell-gears)"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

HERE = Path(__file__).resolve().parent
DEFAULT_ENV = Path("/tmp/gears_env")
TORCH_PIN = "torch==2.13.0"
GEARS_PINS = ("cell-gears==0.1.2", "torch-geometric==2.8.1", "scipy==1.14.1")
BENCH_DATA: dict[str, Any] = {"num_genes": 500, "num_perturbed_genes": 100, "num_doubles": 100, "cells_per_condition": 50,
                              "num_control_cells": 600, "counts_per_gene": 10.0, "seed": 0}
"""The simulated set both scripts train on (10,600 cells x 500 genes, 100 singles, 100 doubles): sized so that
both runs of 10 epochs fit one sitting on 2 CPU cores."""
SMOKE_DATA: dict[str, Any] = {"num_genes": 60, "num_perturbed_genes": 12, "num_doubles": 10, "cells_per_condition": 8,
                              "num_control_cells": 40, "counts_per_gene": 10.0, "seed": 0}
SPLIT = {"mode": "simulation", "seed": 1, "train_gene_set_size": 0.75, "combo_seen2_train_frac": 0.75}
"""Both: GEARS' simulation split (our implementation; GEARS gets the lists as its custom split)."""
RECIPE = {"hidden_size": 64, "batch_size": 32, "test_batch_size": 128, "lr": 1e-3, "weight_decay": 5e-4}
"""GEARS' defaults (model_initialize / train / the README's batch sizes); our run uses the same values."""
THREADS = 1
"""Torch threads of both runs. One: on a shared 2-core machine two OpenMP threads spin-wait whenever the other
is descheduled, which inflated both implementations' step times and CPU seconds several-fold in trials
(BENCHMARKS.md, "Figures moved from code comments")."""
HEADLINE = ("mse_de", "pearson_delta", "pearson_delta_de", "pearson_de", "mse", "frac_correct_direction_20")
GROUPS = ("all", "unseen_single", "combo_seen0", "combo_seen1", "combo_seen2")


# --------------------------------------------------------------------------- environment
def setup_env(env: Path) -> None:
    """Create GEARS' virtual environment: venv, torch first (this index's CPU build), then cell-gears and pins."""
    if not (env / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_PIN], check=True)
    subprocess.run([*pip, *GEARS_PINS], check=True)
    check = subprocess.run([str(env / "bin" / "python"), "-c", "import gears, torch, torch_geometric, scipy; "
                            "print('gears ok: torch', torch.__version__, 'pyg', torch_geometric.__version__, "
                            "'scipy', scipy.__version__)"], capture_output=True, text=True, cwd="/")
    print(check.stdout.strip() or check.stderr.strip()[-2000:])


def env_ready(env: Path) -> bool:
    return (env / "bin" / "python").exists()


# --------------------------------------------------------------------------- data (our environment)
def simulate_benchmark_data(folder: Path, smoke: bool = False) -> dict[str, Any]:
    """The simulated GEARS-format set of this benchmark in `folder` (made once; deterministic for its settings)."""
    from trainer.families.perturbation_gears.simulate import simulate_perturbation_data

    settings = SMOKE_DATA if smoke else BENCH_DATA
    marker = folder / "bench_settings.json"
    if not (marker.is_file() and json.loads(marker.read_text()) == settings):
        simulate_perturbation_data(folder, **settings)
        marker.write_text(json.dumps(settings))
    return settings


def load_benchmark_split(folder: Path) -> tuple[Any, Any, Any]:
    """(PerturbationData, gene2go, SplitResult) of the simulated set, with the benchmark's split."""
    from trainer.families.perturbation_gears.anndata_reader import read_perturbation_data
    from trainer.families.perturbation_gears.gene_ontology import read_gene2go
    from trainer.families.perturbation_gears.splits import split_conditions

    gene2go = read_gene2go(folder / "gene2go.tsv")
    data = read_perturbation_data(folder, gene2go)
    split = split_conditions(data.condition_strings, mode=SPLIT["mode"], seed=SPLIT["seed"],
                             train_gene_set_size=SPLIT["train_gene_set_size"],
                             combo_seen2_train_frac=SPLIT["combo_seen2_train_frac"])
    return data, gene2go, split


def go_jaccard_rows(genes: list[str], gene2go: dict[str, frozenset[str]], threshold: float = 0.1) -> list[tuple]:
    """(source, target, Jaccard) of every gene pair (self-pairs too) whose GO-term Jaccard is above `threshold`."""
    import numpy as np
    import scipy.sparse as sp

    terms = sorted({t for g in genes for t in gene2go[g]})
    column = {t: i for i, t in enumerate(terms)}
    rows = [i for i, g in enumerate(genes) for _ in gene2go[g]]
    cols = [column[t] for g in genes for t in gene2go[g]]
    member = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(genes), len(terms)))
    shared = (member @ member.T).toarray()
    sizes = np.asarray(member.sum(axis=1)).ravel()
    jaccard = shared / (sizes[:, None] + sizes[None, :] - shared)
    src, dst = np.nonzero(jaccard > threshold)
    return [(genes[a], genes[b], float(jaccard[a, b])) for a, b in zip(src, dst)]


def export_for_gears(data_folder: Path, gears_root: Path, data: Any, gene2go: Any, split: Any, epochs: int,
                     seed: int = 0) -> None:
    """Write what GEARS reads (see the module docstring) plus the worker's settings into `gears_root`."""
    import csv
    import pickle
    import shutil

    (gears_root / "go_essential_all").mkdir(parents=True, exist_ok=True)
    (gears_root / "sim").mkdir(exist_ok=True)
    with open(gears_root / "gene2go_all.pkl", "wb") as f:
        pickle.dump({g: set(terms) for g, terms in gene2go.items()}, f)
    genes = [g for g in data.gene_names.tolist() if g in gene2go]
    with open(gears_root / "essential_all_data_pert_genes.pkl", "wb") as f:
        pickle.dump(genes, f)
    with open(gears_root / "go_essential_all" / "go_essential_all.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["source", "target", "importance"])
        writer.writerows((a, b, repr(w)) for a, b, w in go_jaccard_rows(sorted(genes), gene2go))
    with open(gears_root / "split.pkl", "wb") as f:  # GEARS' custom split format
        pickle.dump({"train": list(split.train), "val": list(split.val), "test": list(split.test)}, f)
    shutil.copyfile(data_folder / "perturb_processed.h5ad", gears_root / "sim" / "perturb_processed.h5ad")
    (gears_root / "worker.json").write_text(json.dumps({"epochs": epochs, "seed": seed, "threads": THREADS, **RECIPE}))


def score_predictions(data: Any, split: Any, conditions: list[str], pred_means: Any, true_means: Any) -> dict[str, Any]:
    """Our metrics (as the Trainer's test report) of per-condition mean predictions, per test subgroup."""
    import numpy as np

    from trainer.families.perturbation_gears.conditions import as_condition
    from trainer.families.perturbation_gears.metrics import aggregate_metrics, condition_metrics, top_expressed_genes

    ctrl = np.asarray(data.ctrl_mean, dtype=np.float64)
    top = top_expressed_genes(ctrl)
    per_condition = {}
    for name, pred, true in zip(conditions, pred_means, true_means):
        cond = as_condition(name)
        de = data.de_idx.get(cond)
        per_condition[name] = condition_metrics(np.asarray(pred, np.float64), np.asarray(true, np.float64), ctrl,
                                                None if de is None else de.tolist(),
                                                ranked_de_idx=data.ranked_de_idx.get(cond), top_expressed_idx=top)
    return aggregate_metrics(per_condition, split.subgroups.get("test", {}))


def run_original(args: argparse.Namespace, work: Path, smoke: bool) -> dict[str, Any] | None:
    """Simulate, export, run GEARS' worker in its environment, score its test predictions; None when skipped."""
    import numpy as np

    data_folder = work / "data"
    settings = simulate_benchmark_data(data_folder, smoke=smoke)
    data, gene2go, split = load_benchmark_split(data_folder)
    gears_root = work / "gears_root"
    export_for_gears(data_folder, gears_root, data, gene2go, split, args.epochs, args.seed)
    exported = sorted(p.relative_to(gears_root).as_posix() for p in gears_root.rglob("*") if p.is_file())
    print(f"exported for GEARS: {', '.join(exported)}; split {split.counts()}", file=sys.stderr)
    if not env_ready(args.env):
        print(f"GEARS skipped: no environment at {args.env} (create it: python benchmarks/gears_original.py --setup)")
        return None
    host = machine()  # before the run: its load average says how busy the machine was
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    started = time.perf_counter()
    proc = subprocess.run([str(args.env / "bin" / "python"), str(Path(__file__).resolve()), "--worker", str(gears_root)],
                          env=env, cwd=str(gears_root), capture_output=True, text=True)
    log = (proc.stdout + proc.stderr).replace("\r", "\n")
    (work / "gears_worker.log").write_text(log)
    if proc.returncode != 0:
        tail = "\n".join(line for line in log.splitlines()[-40:] if "it/s]" not in line)
        raise RuntimeError(f"GEARS worker failed (exit {proc.returncode}); log {work / 'gears_worker.log'}:\n{tail}")
    result = json.loads((gears_root / "result.json").read_text())
    arrays = np.load(gears_root / "test_means.npz")
    conditions = [str(c) for c in arrays["conditions"]]
    missing = sorted(set(split.test) - set(conditions))
    result.update({"data": settings, "data_fingerprint": data.fingerprint, "split": SPLIT,
                   "split_counts": split.counts(), "test_conditions_missing": missing,
                   "subgroup_members": {g: list(v) for g, v in split.subgroups.get("test", {}).items()},
                   "metrics": score_predictions(data, split, conditions, arrays["pred"], arrays["true"]),
                   "metrics_control_mean": score_predictions(data, split, conditions, arrays["pred"] - arrays["paired_x"]
                                                             + np.asarray(data.ctrl_mean)[None, :], arrays["true"]),
                   "worker_wall_s": time.perf_counter() - started, "machine": host})
    return result


# --------------------------------------------------------------------------- worker (GEARS' environment)
def worker(gears_root: Path) -> None:
    """Train and test GEARS on the exported set (runs under ENV/bin/python; imports nothing of ours)."""
    # benchmarks/gears.py would shadow the `gears` package: drop this script's folder from the path.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    import random

    import numpy as np
    import torch

    settings = json.loads((gears_root / "worker.json").read_text())
    torch.set_num_threads(settings["threads"])
    random.seed(settings["seed"])
    np.random.seed(settings["seed"])
    torch.manual_seed(settings["seed"])
    import gears
    import gears.gears as gears_module
    from gears import GEARS, PertData
    from gears.inference import compute_metrics, deeper_analysis

    marks: list[tuple[str, float, float]] = []  # (event, wall, cpu)
    original_evaluate = gears_module.evaluate

    def timed_evaluate(loader, *a, **k):
        marks.append(("eval_start", time.perf_counter(), time.process_time()))
        out = original_evaluate(loader, *a, **k)
        marks.append(("eval_end", time.perf_counter(), time.process_time()))
        return out

    gears_module.evaluate = timed_evaluate
    t0 = (time.perf_counter(), time.process_time())
    pert_data = PertData(str(gears_root))
    pert_data.load(data_path=str(gears_root / "sim"))
    pert_data.prepare_split(split="custom", seed=1, split_dict_path=str(gears_root / "split.pkl"))
    pert_data.get_dataloader(batch_size=settings["batch_size"], test_batch_size=settings["test_batch_size"])
    model = GEARS(pert_data, device="cpu")
    model.model_initialize(hidden_size=settings["hidden_size"])
    t1 = (time.perf_counter(), time.process_time())
    model.train(epochs=settings["epochs"], lr=settings["lr"], weight_decay=settings["weight_decay"])
    t2 = (time.perf_counter(), time.process_time())
    epochs = []
    start = t1
    for e in range(settings["epochs"]):  # per epoch: evaluate(train), evaluate(val); then one evaluate(test)
        (_, w0, c0), (_, w1, c1), (_, w2, c2), (_, w3, c3) = marks[4 * e: 4 * e + 4]
        epochs.append({"wall_s": w3 - start[0], "cpu_s": c3 - start[1], "train_wall_s": w0 - start[0],
                       "train_cpu_s": c0 - start[1], "eval_wall_s": (w1 - w0) + (w3 - w2), "eval_cpu_s": (c1 - c0) + (c3 - c2)})
        start = (w3, c3)
    test_res = original_evaluate(pert_data.dataloader["test_loader"], model.best_model, False, "cpu")
    own, own_per_pert = compute_metrics(test_res)
    deeper = deeper_analysis(pert_data.adata, test_res)
    conditions = sorted(set(test_res["pert_cat"]))
    cats = np.asarray(test_res["pert_cat"])
    pred = np.stack([test_res["pred"][cats == c].mean(axis=0) for c in conditions])
    true = np.stack([test_res["truth"][cats == c].mean(axis=0) for c in conditions])
    # The control cells GEARS paired with the test cells (its test loader is not shuffled: the same order as
    # test_res): their per-condition mean lets the report also score GEARS' expected prediction over pairings,
    # pred - mean(x) + control mean, as our task.eval_controls=mean does (the model is a residual on x).
    xs = torch.cat([batch.x.reshape(len(batch.pert), -1) for batch in pert_data.dataloader["test_loader"]]).numpy()
    paired = np.stack([xs[cats == c].mean(axis=0) for c in conditions])
    np.savez(gears_root / "test_means.npz", conditions=np.asarray(conditions), pred=pred, true=true, paired_x=paired)
    own_per_condition = {c: {"pearson_delta": float(deeper.get(c, {}).get("pearson_delta", float("nan"))),
                             **{k: float(v) for k, v in own_per_pert.get(c, {}).items()}} for c in conditions}
    result = {"gears_version": getattr(gears, "__version__", None) or _dist_version("cell-gears"),
              "torch": torch.__version__, "torch_geometric": _dist_version("torch-geometric"),
              "scipy": _dist_version("scipy"), "settings": settings,
              "train_cells": len(pert_data.dataloader["train_loader"].dataset),
              "prepare_wall_s": t1[0] - t0[0], "train_call_wall_s": t2[0] - t1[0], "epochs": epochs,
              "gears_own_overall": {k: float(v) for k, v in own.items()},
              "gears_own_per_condition": own_per_condition,
              "peak_rss_mb": _vm_hwm_mb()}
    (gears_root / "result.json").write_text(json.dumps(result, indent=1))


def _vm_hwm_mb() -> float:
    """Peak RSS of this process (VmHWM; ru_maxrss would include the forking parent's RSS)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- report
def machine() -> str:
    from bench_report import cpu_model

    return f"{cpu_model()}, {THREADS} torch thread(s); 1-min load average {os.getloadavg()[0]:.1f} at the start"


def epoch_summary(epochs: list[dict[str, float]]) -> dict[str, float]:
    """Median wall / CPU seconds of an epoch and of its training steps."""
    import statistics

    return {k: statistics.median(e[k] for e in epochs) for k in epochs[0]}


def original_table(result: dict[str, Any]) -> str:
    """Test metrics of GEARS per subgroup (our metric code), and GEARS' own values of two of them as a check."""
    m = result["metrics"]
    own = result["gears_own_per_condition"]
    members = {"all": list(own), **result["subgroup_members"]}
    rows = ["| subgroup | conditions | " + " | ".join(HEADLINE) + " | GEARS' own pearson_delta | GEARS' own mse_de |",
            "|---|---:|" + "---:|" * (len(HEADLINE) + 2)]
    for group in GROUPS:
        prefix = "" if group == "all" else f"{group}/"
        n = m.get(prefix + "n_conditions")
        if not n:
            continue
        cells = " | ".join(f"{m[prefix + k]:.4f}" if prefix + k in m else "" for k in HEADLINE)
        own_vals = [[own[c][k] for c in members.get(group, []) if k in own.get(c, {})] for k in ("pearson_delta", "mse_de")]
        own_cells = " | ".join(f"{sum(v) / len(v):.4f}" if v else "" for v in own_vals)
        rows.append(f"| {group} | {int(n)} | {cells} | {own_cells} |")
        exact = result.get("metrics_control_mean")
        if exact:  # the same predictions moved to the control mean (how gears.py compares them with ours)
            cells = " | ".join(f"{exact[prefix + k]:.4f}" if prefix + k in exact else "" for k in HEADLINE)
            rows.append(f"| {group}, at the control mean | {int(n)} | {cells} | | |")
    return "\n".join(rows)


def section(result: dict[str, Any], command: str, now: str) -> str:
    ep = epoch_summary(result["epochs"])
    s = result["settings"]
    d = result["data"]
    cells = d["cells_per_condition"] * (d["num_perturbed_genes"] + d["num_doubles"]) + d["num_control_cells"]
    return (f"## GEARS original (cell-gears) benchmark, {now}\n\n- Machine: {result['machine']}\n- Command: `{command}`\n"
            f"- GEARS: cell-gears {result['gears_version']}, torch {result['torch']}, torch_geometric "
            f"{result['torch_geometric']}, scipy {result['scipy']} in its own venv (`--setup`), offline (gene2go_all.pkl, "
            f"essential_all_data_pert_genes.pkl and go_essential_all.csv written from the simulated gene2go)\n"
            f"- Data: simulated ({d['num_genes']} genes, {d['num_perturbed_genes']} singles, {d['num_doubles']} doubles, "
            f"{d['cells_per_condition']} cells each, {d['num_control_cells']} controls: {cells:,} cells; counts_per_gene "
            f"{d['counts_per_gene']:g}, seed {d['seed']}), loaded by `PertData.load`; our simulation split (seed 1) "
            f"passed as GEARS' custom split: {result['split_counts']}; {result['train_cells']:,} training cells\n"
            f"- Recipe: GEARS' defaults: hidden {s['hidden_size']}, batch {s['batch_size']}, Adam lr {s['lr']:g}, wd "
            f"{s['weight_decay']:g}, StepLR 0.5/epoch, {s['epochs']} epochs, best model by validation mse_de; CPU\n"
            f"- Time: data preparation (PertData.load: one PyG graph per cell) {result['prepare_wall_s']:.1f} s; median "
            f"epoch {ep['wall_s']:.1f} s wall / {ep['cpu_s']:.1f} s CPU, of which training steps {ep['train_wall_s']:.1f} s "
            f"wall / {ep['train_cpu_s']:.1f} s CPU and GEARS' per-epoch evaluation of the train and validation sets "
            f"{ep['eval_wall_s']:.1f} s; peak RSS {result['peak_rss_mb']:.0f} MiB\n\n"
            f"Test metrics of GEARS' best model per subgroup (cell-mean profiles per condition, then the mean over "
            f"conditions, scored by our `metrics.py`; the last two columns: GEARS' own `deeper_analysis` / "
            f"`compute_metrics` values). The rows 'at the control mean' score the same predictions with the mean of "
            f"the control cells GEARS paired replaced by the control mean, as `task.eval_controls=mean` evaluates "
            f"ours:\n\n"
            f"{original_table(result)}\n")


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10, help="GEARS training epochs (use the same in benchmarks/gears.py)")
    p.add_argument("--env", type=Path, default=DEFAULT_ENV, help="GEARS' virtual environment")
    p.add_argument("--setup", action="store_true", help="create --env (venv, torch, cell-gears and pins) and exit")
    p.add_argument("--work", type=Path, default=None, help="working folder (data, GEARS files, logs; default: a temp dir)")
    p.add_argument("--seed", type=int, default=0, help="GEARS' training seed (torch, numpy, random); the data and split stay")
    p.add_argument("--json", type=Path, default=None, help="write the results here (read by gears.py --original-results)")
    p.add_argument("--out", help="add this benchmark's section to this markdown file, at the top of its topic")
    p.add_argument("--smoke", action="store_true", help="a tiny set, 1 epoch, nothing written; without --env only the "
                   "data export is checked and GEARS is skipped")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        worker(a.worker)
        return
    if a.setup:
        setup_env(a.env)
        return
    sys.path.insert(0, str(HERE))
    from bench_report import command_line, utc_now, write_section

    if a.smoke:
        a.epochs = 1
    with tempfile.TemporaryDirectory(prefix="gears-original-") as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = run_original(a, work, smoke=a.smoke)
    if result is None:
        if a.smoke:
            print("smoke run: nothing written")
        return
    text = section(result, command_line(), utc_now())
    print(text)
    if result["test_conditions_missing"]:
        print(f"warning: GEARS gave no prediction for {result['test_conditions_missing']}", file=sys.stderr)
    if a.smoke:
        print("smoke run: nothing written")
        return
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    if a.out:
        write_section(a.out, text, topic=TOPIC)


if __name__ == "__main__":
    main()

"""The GEARS data path at Replogle-like sizes: what the set-up costs as the cells (N) grow.

For each N (`--sizes`): a Replogle-shaped sparse AnnData (`write_replogle_like`: CSR float32 log1p(CP10k)-like
values, `--genes` genes, `--groups` single-gene perturbation groups plus controls, uncompressed .h5ad and a
gene<TAB>GO TSV), then, in a fresh process per size (its peak RSS is the set-up's):

  read + DE     `read_perturbation_data` on the raw file: X read, GEARS' DE fields (the vectorised Welch t-test
                over every group) and the dropout fields computed (in a child process above the task's
                `READ_APART_BYTES`, as a rank reads it; its CPU and peak RSS are counted)
  DE alone      `rank_genes_by_cell_type` again on the loaded X (one pass over X)
  group means   `group_means` over every condition (the baselines' fit)
  fingerprint   `PerturbationData.fingerprint` (the graph cache key)
  split         `split_conditions` (simulation mode)
  graphs        `cached_graphs`: the GO and co-expression graphs, built into the runs' cache
  (and the set-up's CPU seconds, user + system: the figure to read when the machine is shared)

then, in another fresh process, one rank's private (anonymous) memory stage by stage (`memory_stage`): after
torch and the task import, after the model and its Adam state (built from the statistics the set-up wrote, as
many steps on zero batches as are measured below), after importing the reader's modules (anndata, h5py, scipy:
the rank "before any data is opened"), after `build_data` (every cache built: X mapped, DE fields and
graphs read back), after the first step and after 10 steps of gears_tiny's model at the launch's batch (drawn by
the trainer's `EpochSampler`). The
data's cost is steady minus before-data, set against 2x the batch's share of X (x and y rows densified, float32)
plus the model's parameters, gradients and Adam state.

And for each W (`--worlds`), `trainer train gears_tiny.yaml --nproc W` on the file with those caches built (X's
memory-mapped CSR, the DE fields and the graphs): launch to the first step's record, and each rank's peak RSS
and peak private (anonymous) memory (`scale.watch`).

Then the cost per doubling of N and a power law fitted to the measured sizes, extrapolated (not measured) to
Replogle K562 essential (308,646 cells) and genome-wide (2.5 M cells). Tables in benchmarks/scale.py's format.

    .venv/bin/python benchmarks/scale_perturbation.py --sizes 75000 150000 300000 --worlds 1 2 4 \
        --workdir /tmp/scale54/perturbation
    .venv/bin/python benchmarks/scale_perturbation.py --smoke
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from scale import doubling_ratios, power_law, table  # noqa: E402

REPLOGLE_K562 = 308_646
GENOME_WIDE = 2_500_000
COLS = [("N", "N"), ("nnz_M", "nnz M"), ("file_MiB", "h5ad MiB"), ("gen_s", "generate s"), ("read_s", "read + DE s"),
        ("de_s", "DE alone s"), ("means_s", "group means s"), ("fingerprint_s", "fingerprint s"),
        ("split_s", "split s"), ("graphs_s", "graphs s"), ("setup_s", "set-up s (read+split+graphs)"),
        ("cpu_s", "set-up CPU s"), ("peak_MiB", "set-up peak RSS MiB"), ("x_MiB", "X CSR MiB")]
MEMORY_COLS = [("N", "N"), ("import_MiB", "torch + task"), ("model_steps_MiB", "+ model, Adam, steps on zeros"),
               ("before_data_MiB", "+ reader modules (before data)"),
               ("data_MiB", "+ build_data"), ("first_step_MiB", "1st step"), ("steady_MiB", "steady (10 steps)"),
               ("data_cost_MiB", "steady - before data"), ("target_MiB", "target: 2x batch of X + model state"),
               ("met", "met")]
WORLD_COLS = [("N", "N"), ("W", "W"), ("first_step_s", "launch to 1st step s"), ("rank_peak_MiB", "rank peak RSS MiB"),
              ("rank_private_MiB", "rank peak private (anon) MiB"), ("ranks_seen", "ranks seen")]
SCALED = ["read_s", "de_s", "means_s", "fingerprint_s", "graphs_s", "setup_s", "cpu_s", "peak_MiB"]
BATCH = 64
"""gears_tiny's global batch in the launches and the memory stage (cells; each has an x and a y row)."""


def write_replogle_like(path: Path, num_cells: int, num_genes: int = 8000, num_groups: int = 2000,
                        control_fraction: float = 0.05, density: float = 0.1, seed: int = 0,
                        chunk: int = 8192) -> dict[str, Any]:
    """A Replogle-shaped raw AnnData at `path` (X/obs/var only: the reader computes GEARS' fields) and a gene2go.tsv
    beside it. Cells: `control_fraction` controls, the rest spread evenly over `num_groups` single perturbations
    of the first `num_groups` genes; each group shifts its own gene down and 20 other genes up or down."""
    import anndata
    import pandas as pd
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    genes = [f"G{i:05d}" for i in range(num_genes)]
    num_ctrl = max(2, int(num_cells * control_fraction))
    labels = np.concatenate([np.full(num_ctrl, -1), np.arange(num_cells - num_ctrl) % num_groups])
    rng.shuffle(labels)
    base = rng.gamma(1.0, 1.0, num_genes)  # per-gene scale: a few highly, most lowly expressed
    effect_genes = rng.integers(0, num_genes, (num_groups, 20))
    effect_sign = rng.choice([-0.5, 0.5], (num_groups, 20))
    blocks = []
    for start in range(0, num_cells, chunk):
        lab = labels[start:start + chunk]
        n = len(lab)
        nnz_row = rng.binomial(num_genes, density, n)
        indptr = np.concatenate([[0], np.cumsum(nnz_row)])
        cols = np.concatenate([np.sort(rng.choice(num_genes, k, replace=False)) for k in nnz_row]) if n else []
        vals = np.log1p(rng.gamma(2.0, base[cols])).astype(np.float32)
        block = sp.csr_matrix((vals, cols, indptr), shape=(n, num_genes))
        row_of = np.repeat(np.arange(n), nnz_row)
        pert = lab[row_of]
        hit = pert >= 0
        shift = np.zeros(len(vals), dtype=np.float32)
        for k in range(20):  # the group's own effects
            m = hit & (effect_genes[np.maximum(pert, 0), k] == cols)
            shift[m] += effect_sign[pert[m], k]
        own = hit & (cols == pert)  # the knocked-down gene
        shift[own] -= 1.0
        block.data = np.maximum(block.data + shift, 0).astype(np.float32)
        block.eliminate_zeros()
        blocks.append(block)
    X = sp.vstack(blocks, format="csr")
    del blocks
    condition = np.where(labels < 0, "ctrl", np.array([f"{g}+ctrl" for g in genes[:num_groups]] + [""])[labels])
    obs = pd.DataFrame({"condition": pd.Categorical(condition), "cell_type": pd.Categorical(["K562"] * num_cells)},
                       index=pd.Index([f"cell{i}" for i in range(num_cells)]))
    var = pd.DataFrame({"gene_name": genes}, index=pd.Index([f"ID{i:05d}" for i in range(num_genes)]))
    path.parent.mkdir(parents=True, exist_ok=True)
    anndata.AnnData(X=X, obs=obs, var=var).write_h5ad(path)
    terms = rng.integers(0, num_genes // 10, (num_genes, 3))
    lines = [f"{g}\tGO:{t:07d}" for g, row in zip(genes, terms) for t in row]
    (path.parent / "gene2go.tsv").write_text("\n".join(lines) + "\n")
    return {"nnz_M": X.nnz / 1e6, "x_MiB": (X.data.nbytes + X.indices.nbytes + X.indptr.nbytes) / 2**20,
            "file_MiB": path.stat().st_size / 2**20}


def setup_stage(path: Path, cache: Path) -> dict[str, Any]:
    """The task's set-up in this process, stage by stage, into the runs' cache: seconds and the peak RSS (MiB)."""
    from trainer.families.perturbation_gears.anndata_reader import group_means, rank_genes_by_cell_type
    from trainer.families.perturbation_gears.gene_graphs import cached_graphs
    from trainer.families.perturbation_gears.spec import PerturbationGearsConfig
    from trainer.families.perturbation_gears.task import PerturbationGearsTask, load_perturbation_data

    cfg = PerturbationGearsConfig(data_path=str(path), gene2go_path=str(path.parent / "gene2go.tsv"),
                                  cache_dir=str(cache), split="simulation", split_seed=1)
    out: dict[str, Any] = {}
    t = time.perf_counter()
    data, gene2go = load_perturbation_data(cfg)
    out["read_s"] = time.perf_counter() - t
    t = time.perf_counter()
    rank_genes_by_cell_type(data.X, np.asarray(data.condition_names)[data.cell_condition], data.cell_type,
                            data.var_names)
    out["de_s"] = time.perf_counter() - t
    t = time.perf_counter()
    group_means(data.X, data.cell_condition, len(data.conditions))
    out["means_s"] = time.perf_counter() - t
    t = time.perf_counter()
    _ = data.fingerprint
    out["fingerprint_s"] = time.perf_counter() - t
    t = time.perf_counter()
    split = PerturbationGearsTask(cfg).split(data)
    out["split_s"] = time.perf_counter() - t
    t = time.perf_counter()
    cached_graphs(data, split, gene2go, cache, go_threshold=cfg.go_threshold, go_top_k=cfg.go_top_k,
                  coexpression_threshold=cfg.coexpression_threshold, coexpression_top_k=cfg.coexpression_top_k)
    out["graphs_s"] = time.perf_counter() - t
    out["setup_s"] = out["read_s"] + out["split_s"] + out["graphs_s"]
    # a large file is read in a child process (`read_process`): its CPU counts, and the peak is the larger one
    usage, child = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    out["cpu_s"] = usage.ru_utime + usage.ru_stime + child.ru_utime + child.ru_stime
    out["peak_MiB"] = max(usage.ru_maxrss, child.ru_maxrss) / 1024
    graphs = cached_graphs(data, split, gene2go, cache, go_threshold=cfg.go_threshold, go_top_k=cfg.go_top_k,
                           coexpression_threshold=cfg.coexpression_threshold, coexpression_top_k=cfg.coexpression_top_k)
    (cache / "stats.json").write_text(json.dumps(PerturbationGearsTask.statistics(data, split, graphs)))
    return out


def _anon_mib() -> float:
    """This process's private anonymous memory (smaps_rollup `Anonymous`), MiB."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def memory_stage(path: Path, cache: Path, world: int = 1, steps: int = 10) -> dict[str, Any]:
    """One rank's private memory stage by stage (MiB), its caches built (see the module docstring)."""
    import gc

    import torch

    from trainer.core.samplers import EpochSampler
    from trainer.families.perturbation_gears.spec import PerturbationGearsConfig
    from trainer.families.perturbation_gears.task import PerturbationGearsTask, build_gears_model

    out: dict[str, Any] = {"import_MiB": _anon_mib()}
    cfg = PerturbationGearsConfig(data_path=str(path), gene2go_path=str(path.parent / "gene2go.tsv"),
                                  cache_dir=str(cache), split="simulation", split_seed=1, hidden_size=32)
    task = PerturbationGearsTask(cfg)
    stats = json.loads((cache / "stats.json").read_text())
    model = build_gears_model(cfg, stats)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    num_genes = len(stats["gene_names"])
    batch = BATCH // world

    def step(x: torch.Tensor, y: torch.Tensor, pert_idx: torch.Tensor) -> None:
        out_ = model(x, pert_idx)
        pred = out_[0] if isinstance(out_, tuple) else out_
        loss = ((pred - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    # as many steps on zero batches as the measured ones, each cell a different single perturbation as in real
    # batches: the model's own heap keeps growing over its first steps whatever the data (its activations'
    # allocations settle), and that growth is the model's, not the data's
    num_perts = len(stats["pert_genes"])
    zero_pert = torch.stack([torch.arange(batch) * 7 % num_perts, torch.full((batch,), -1)], 1)
    for _ in range(steps):
        step(torch.zeros(batch, num_genes), torch.zeros(batch, num_genes), zero_pert)
    del stats
    gc.collect()
    out["model_steps_MiB"] = _anon_mib()
    import anndata  # noqa: F401  (the reader's modules: code, counted apart from the data)
    import h5py  # noqa: F401
    import scipy.sparse  # noqa: F401

    gc.collect()
    out["before_data_MiB"] = _anon_mib()
    task_data = task.build_data()
    gc.collect()
    out["data_MiB"] = _anon_mib()
    # the trainer's sampler, which holds no permutation of the cells (`shuffle=True`'s RandomSampler holds a list of
    # every training index for the epoch: a Python int per cell, which is the sampler's cost, not the data's)
    sampler = EpochSampler(len(task_data.train), seed=0, multiple_of=batch)
    loader = torch.utils.data.DataLoader(task_data.train, batch_size=batch, sampler=sampler, collate_fn=task.collate)
    for i, b in enumerate(loader):
        step(b["x"], b["y"], b["pert_idx"])
        if i == 0:
            out["first_step_MiB"] = _anon_mib()
        if i + 1 == steps:
            break
    out["steady_MiB"] = _anon_mib()
    out["data_cost_MiB"] = out["steady_MiB"] - out["before_data_MiB"]
    params = sum(p.numel() for p in model.parameters())
    # 2x the batch's share of X (x and y rows, float32, densified) + parameters, gradients, Adam's two moments
    out["batch_x_MiB"] = 2 * batch * num_genes * 4 / 2**20
    out["model_state_MiB"] = 4 * params * 4 / 2**20
    out["target_MiB"] = 2 * out["batch_x_MiB"] + out["model_state_MiB"]
    out["met"] = "yes" if out["data_cost_MiB"] <= out["target_MiB"] else "NO"
    out["params"] = params
    return out


def launch_row(path: Path, cache: Path, world: int, run_dir: Path, steps: int) -> dict[str, Any]:
    """`trainer train gears_tiny.yaml` on the file (its caches built), watched: launch to the first step, rank RSS."""
    from scale import TRAINER, check, first_step_s, watch

    cmd = [*TRAINER, "train", str(ROOT / "configs/perturbation_gears/gears_tiny.yaml"),
           *(["--nproc", str(world)] if world > 1 else []), f"task.data_path={path}",
           f"task.gene2go_path={path.parent / 'gene2go.tsv'}", f"task.cache_dir={cache}", "train.epochs=0",
           f"train.max_steps={steps}", f"train.per_device_batch_size={64 // world}", "train.global_batch_size=64",
           "eval.max_samples=2", "task.eval_max_cells=2", "log.every_steps=1", "log.progress_bar=false",
           "log.tensorboard=false", "run.resume=none", f"run.output_dir={run_dir}"]
    w = check(watch(cmd, run_dir / "metrics.jsonl"), f"trainer train (W={world})")
    return {"W": world, "first_step_s": first_step_s(w), "rank_peak_MiB": max(w.rank_peak_mib.values()),
            "rank_private_MiB": max(w.rank_anon_mib.values()), "ranks_seen": len(w.rank_peak_mib)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[37_500, 75_000, 150_000])
    ap.add_argument("--genes", type=int, default=8000)
    ap.add_argument("--groups", type=int, default=2000)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/scale54/perturbation"))
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs")
    ap.add_argument("--worlds", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per launch")
    ap.add_argument("--memory-steps", type=int, default=10, help="steps of the memory stage")
    ap.add_argument("--stage-setup", type=Path, nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--stage-memory", type=Path, nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.stage_setup:
        print(json.dumps(setup_stage(*a.stage_setup)))
        return
    if a.stage_memory:
        print(json.dumps(memory_stage(*a.stage_memory, steps=a.memory_steps)))
        return
    if a.smoke:
        import tempfile

        a.sizes, a.genes, a.groups, a.worlds, a.steps, a.memory_steps = [2000, 4000], 300, 50, [1, 2], 2, 2
        a.workdir = Path(tempfile.mkdtemp(prefix="scale_perturbation_smoke."))
    rows: list[dict[str, Any]] = []
    worlds: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    for n in a.sizes:
        path = a.workdir / f"n{n}" / "perturb_raw.h5ad"
        t = time.perf_counter()
        row: dict[str, Any] = {"N": n, **write_replogle_like(path, n, a.genes, a.groups, density=a.density)}
        row["gen_s"] = time.perf_counter() - t
        cache = a.workdir / f"n{n}" / "cache"
        res = subprocess.run([sys.executable, __file__, "--stage-setup", str(path), str(cache)], capture_output=True,
                             text=True, check=True)
        row.update(json.loads(res.stdout.strip().splitlines()[-1]))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        res = subprocess.run([sys.executable, __file__, "--stage-memory", str(path), str(cache), "--memory-steps",
                              str(a.memory_steps)], capture_output=True, text=True, check=True)
        memory.append({"N": n, **json.loads(res.stdout.strip().splitlines()[-1])})
        print(json.dumps(memory[-1]), file=sys.stderr, flush=True)
        for world in a.worlds:
            launched = {"N": n, **launch_row(path, cache, world, a.workdir / f"n{n}" / f"run_w{world}", a.steps)}
            worlds.append(launched)
            print(json.dumps(launched), file=sys.stderr, flush=True)
        shutil.rmtree(cache / "expression", ignore_errors=True)
        if not a.keep:
            path.unlink()
    print(f"GEARS set-up, {a.genes:,} genes, {a.groups:,} groups, density {a.density}\n")
    print(table(rows, COLS) + "\n")
    print("One rank's private (anonymous) memory, MiB, by stage (W = 1, batch 64, gears_tiny's model, caches "
          f"built)\n\n{table(memory, MEMORY_COLS)}\n")
    print(f"Launches (gears_tiny, hidden 32, global batch 64, caches built)\n\n{table(worlds, WORLD_COLS)}\n")
    print("Per doubling of N\n\n" + table(doubling_ratios(rows, SCALED), [("N", "N"), *[(k, k) for k in SCALED]]) + "\n")
    if len(rows) >= 2:
        extra = [{"N": target, **{k: power_law([(r["N"], r[k]) for r in rows], target) for k in SCALED}}
                 for target in (REPLOGLE_K562, GENOME_WIDE)]
        print("Extrapolated (a power law in N over the measured sizes; not measured)\n\n"
              + table(extra, [("N", "N"), *[(k, k) for k in SCALED]]))
    if a.smoke:
        shutil.rmtree(a.workdir, ignore_errors=True)
        print("smoke run: nothing written")


if __name__ == "__main__":
    main()

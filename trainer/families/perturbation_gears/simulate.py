"""Simulated Perturb-seq data with a known gene-regulatory network (GEARS format, ground truth beside it).

The model (numpy, all draws from one seeded Generator):

- A random DAG over `num_genes` genes in a random topological order. Every gene but the first has 1-3
  regulators drawn from earlier genes, mostly from the first ~1/8 of the order ("transcription
  factors"), preferring regulators that already have many targets (hubs). Signed weights W[i, j]
  (regulator i -> target j), |W| in [1.5, 3], positive with probability 0.6.
- Activity of gene j in a cell: a_j = sigmoid(b_j + sum_i W[i, j] a_i + e_j), e_j ~ N(0, noise),
  computed layer by layer in topological order. b_j centres the unperturbed gene near a = 0.5 (where
  knockouts move it most). A knockout clamps a_k = 0 before any target of k is computed; a double
  clamps two genes.
- Latent expression x_j = s_j a_j with per-gene scale s_j ~ LogNormal(0, scale_sd); counts ~
  Poisson(L_c x / sum(x)) with library size L_c ~ LogNormal(log(counts_per_gene * num_genes), library_sd)
  (library_sd = 0: every cell exactly counts_per_gene * num_genes, multinomial);
  X = log1p(CP10k), stored CSR float32.
- Perturbable genes: the `num_perturbed_genes` genes with the most targets; every one is perturbed
  alone, and `num_doubles` random pairs of them together.

Files written to `out_dir`:
- `perturb_processed.h5ad`: GEARS format (obs condition / cell_type and GEARS' obs and uns fields
  computed by `anndata_reader.add_gears_fields`; var index = gene ids, var['gene_name'] = symbols).
- `gene2go.tsv`: `gene<TAB>GO id` pairs. Every regulator's regulon (itself and its targets, each
  target kept with probability 0.9) is one synthetic term (GO:9xxxxxx), plus num_genes // 4 random
  terms of 3-11 genes (GO:8xxxxxx); every gene has a term.
- `ground_truth.npz`: the network (edge_regulator, edge_target, edge_weight; `dense_weights` rebuilds W),
  bias, scale, topological order, and the true means over `mc_cells` noise draws shared by all conditions
  (common random numbers, so an effect is never Monte Carlo noise): true_expression_* (latent x) and
  true_log_expression_* (log1p(CP10k) of x, no counting noise) for ctrl [G], singles [S, G], doubles [D, G],
  and the doubles' interaction = true log effect of AB - effect of A - effect of B ([D, G]).
- `ground_truth.json`: parameters, gene names, singles, doubles, each double's interaction score
  (||interaction|| / (||effect A|| + ||effect B||)) and its 5 most interacting genes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from trainer.atomic_io import atomic_write_json
from trainer.errors import ConfigError
from trainer.families.perturbation_gears.anndata_reader import DATA_FILE, add_gears_fields
from trainer.families.perturbation_gears.conditions import format_condition

logger = logging.getLogger(__name__)

CELL_CHUNK = 2048
"""Cells simulated together (bounds the dense working set to CELL_CHUNK x num_genes)."""


class GeneNetwork:
    """The DAG, its weights and per-gene bias/scale, stored by layer for vectorised simulation."""

    def __init__(self, num_genes: int, regulators: list[np.ndarray], weights: list[np.ndarray], order: np.ndarray,
                 scale: np.ndarray, num_tf: int, rng: np.random.Generator):
        self.num_genes = num_genes
        self.order = order
        self.num_tf = num_tf
        """The first num_tf genes of `order` are the likely regulators ("transcription factors")."""
        src = np.concatenate([r for r in regulators if len(r)]) if any(len(r) for r in regulators) else np.zeros(0, int)
        dst = np.concatenate([np.full(len(r), j) for j, r in enumerate(regulators) if len(r)]) if len(src) else src
        self.edge_regulator = src.astype(np.int64)
        self.edge_target = dst.astype(np.int64)
        self.edge_weight = np.concatenate([w for w in weights if len(w)]) if len(src) else np.zeros(0)
        self.W = sp.csc_matrix((self.edge_weight, (self.edge_regulator, self.edge_target)), shape=(num_genes, num_genes))
        depth = np.zeros(num_genes, dtype=np.int64)
        for j in order:  # regulators come earlier in `order`, so their depth is final
            if len(regulators[j]):
                depth[j] = depth[regulators[j]].max() + 1
        self.layers = [np.flatnonzero(depth == d) for d in range(int(depth.max()) + 1)]
        self.layer_weights = [self.W[:, layer].T.tocsr() for layer in self.layers]  # [|layer|, G]
        self.scale = scale
        # centre each gene's baseline pre-activation near 0 (plus spread) given its regulators' baseline
        self.bias = np.zeros(num_genes)
        baseline = np.zeros(num_genes)
        for layer, lw in zip(self.layers, self.layer_weights):
            drive = lw @ baseline
            self.bias[layer] = -drive + rng.normal(0.0, 0.5, len(layer))
            baseline[layer] = 1.0 / (1.0 + np.exp(-(self.bias[layer] + drive)))

    def activity(self, noise: np.ndarray, knockout: tuple[int, ...] | np.ndarray) -> np.ndarray:
        """[n, G] activities for per-cell intrinsic noise [n, G], with `knockout` genes clamped to 0."""
        a = np.zeros_like(noise)
        clamp = np.zeros(self.num_genes, dtype=bool)
        clamp[list(knockout)] = True
        for layer, lw in zip(self.layers, self.layer_weights):
            pre = (lw @ a.T).T + self.bias[layer] + noise[:, layer]
            a[:, layer] = 1.0 / (1.0 + np.exp(-pre))
            a[:, layer[clamp[layer]]] = 0.0  # before any later layer (the targets) reads them
        return a


def build_network(num_genes: int, rng: np.random.Generator, scale_sd: float = 1.0) -> GeneNetwork:
    """A random DAG with 1-3 signed regulators per gene, hub-biased towards the first ~1/8 of the order."""
    order = rng.permutation(num_genes)
    num_tf = max(8, num_genes // 8)
    outdeg = np.zeros(num_genes)
    regulators: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * num_genes
    weights: list[np.ndarray] = [np.zeros(0)] * num_genes
    for t in range(1, num_genes):
        pool = order[: min(t, num_tf)] if rng.random() < 0.85 else order[:t]
        k = min(int(rng.integers(1, 4)), len(pool))
        p = (1.0 + outdeg[pool]) / (1.0 + outdeg[pool]).sum()
        chosen = rng.choice(pool, size=k, replace=False, p=p)
        outdeg[chosen] += 1
        sign = np.where(rng.random(k) < 0.6, 1.0, -1.0)
        regulators[order[t]] = np.sort(chosen).astype(np.int64)
        weights[order[t]] = (sign * rng.uniform(1.5, 3.0, k))[np.argsort(chosen)]
    scale = rng.lognormal(0.0, scale_sd, num_genes)
    return GeneNetwork(num_genes, regulators, weights, order, scale, num_tf, rng)


def _log_cp10k(counts: np.ndarray) -> np.ndarray:
    total = counts.sum(axis=1, keepdims=True)
    return np.log1p(counts / np.maximum(total, 1.0) * 1e4)


def _expected_log(x: np.ndarray) -> np.ndarray:
    return np.log1p(x / x.sum(axis=1, keepdims=True) * 1e4)


def _gene2go_pairs(net: GeneNetwork, gene_names: list[str], rng: np.random.Generator) -> list[tuple[str, str]]:
    g = net.num_genes
    pairs: set[tuple[int, str]] = set()
    for r in np.unique(net.edge_regulator):
        term = f"GO:9{r:06d}"
        pairs.add((int(r), term))
        for t in net.edge_target[net.edge_regulator == r]:
            if rng.random() < 0.9:
                pairs.add((int(t), term))
    random_terms = [f"GO:8{k:06d}" for k in range(max(1, g // 4))]
    for term in random_terms:
        for gene in rng.choice(g, size=min(g, int(rng.integers(3, 12))), replace=False):
            pairs.add((int(gene), term))
    covered = {gene for gene, _ in pairs}
    for gene in range(g):
        if gene not in covered:
            pairs.add((gene, random_terms[int(rng.integers(len(random_terms)))]))
    return sorted((gene_names[gene], term) for gene, term in pairs)


def simulate_perturbation_data(out_dir: str | Path, num_genes: int = 200, num_perturbed_genes: int = 40,
                               cells_per_condition: int = 40, num_control_cells: int = 500, num_doubles: int = 40,
                               seed: int = 0, noise: float = 0.2, regulator_noise: float = 1.5,
                               counts_per_gene: float = 20.0, library_sd: float = 0.3, scale_sd: float = 1.0,
                               mc_cells: int = 256,
                               cell_type: str = "simulated", gears_fields: bool = True,
                               compression: str | None = "gzip") -> dict[str, Any]:
    """Write a simulated GEARS-format data set and its ground truth to `out_dir`; returns a summary.

    See the module docstring for the model and the files. noise / regulator_noise: sd of the intrinsic
    noise of ordinary genes / of the likely regulators (their variation drives co-expression).
    library_sd: sd of log library size; 0 gives every cell the same depth (multinomial counts).
    scale_sd: sd of the log per-gene expression scale (wider: more lowly expressed genes, sparser X).
    gears_fields: write GEARS' obs/uns DE fields (False: X/var/obs only, a much smaller file; the reader
    computes them on load). compression: of the h5ad ("gzip", "lzf" or None).
    """
    if not 2 <= num_perturbed_genes <= num_genes:
        raise ConfigError(f"num_perturbed_genes must be in [2, num_genes={num_genes}], got {num_perturbed_genes}")
    max_doubles = num_perturbed_genes * (num_perturbed_genes - 1) // 2
    if not 0 <= num_doubles <= max_doubles:
        raise ConfigError(f"num_doubles must be in [0, {max_doubles}] for {num_perturbed_genes} perturbed genes")
    if cells_per_condition < 2 or num_control_cells < 2:
        raise ConfigError("cells_per_condition and num_control_cells must be >= 2 (GEARS' DE test needs 2 cells)")
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    net = build_network(num_genes, rng, scale_sd)
    width = len(str(num_genes))
    gene_names = [f"G{i:0{width}d}" for i in range(num_genes)]
    gene_ids = [f"SIMID{i:0{width}d}" for i in range(num_genes)]

    outdeg = np.bincount(net.edge_regulator, minlength=num_genes)
    ranked = np.lexsort((rng.random(num_genes), -outdeg))
    pert = np.sort(ranked[:num_perturbed_genes])
    pair_codes = rng.choice(max_doubles, size=num_doubles, replace=False) if num_doubles else np.zeros(0, int)
    all_pairs = [(int(pert[i]), int(pert[j])) for i in range(len(pert)) for j in range(i + 1, len(pert))]
    doubles = sorted(all_pairs[k] for k in pair_codes)
    conditions: list[tuple[int, ...]] = [()] + [(int(g),) for g in pert] + doubles

    # cells, a chunk at a time (the only dense arrays are CELL_CHUNK x num_genes)
    library_mean = np.log(counts_per_gene * num_genes)
    noise_sd = np.full(num_genes, noise)
    noise_sd[net.order[: net.num_tf]] = regulator_noise
    blocks: list[sp.csr_matrix] = []
    labels: list[np.ndarray] = []
    for cond in conditions:
        n_cells = num_control_cells if cond == () else cells_per_condition
        text = format_condition(tuple(sorted(gene_names[g] for g in cond)))
        for start in range(0, n_cells, CELL_CHUNK):
            n = min(CELL_CHUNK, n_cells - start)
            a = net.activity(rng.normal(0.0, 1.0, (n, num_genes)) * noise_sd, cond)
            x = a * net.scale
            share = x / np.maximum(x.sum(axis=1, keepdims=True), 1e-12)
            if library_sd > 0:
                counts = rng.poisson(rng.lognormal(library_mean, library_sd, (n, 1)) * share)
            else:  # every cell the same depth: log1p(CP10k) then takes one value per count (compresses well)
                counts = rng.multinomial(int(round(np.exp(library_mean))), share)
            blocks.append(sp.csr_matrix(_log_cp10k(counts).astype(np.float32)))
            labels.append(np.full(n, text, dtype=object))
    X = sp.vstack(blocks, format="csr")  # cells grouped by condition (nothing downstream relies on the order)
    del blocks
    condition = np.concatenate(labels)

    import anndata

    obs = pd.DataFrame({"condition": pd.Categorical(condition), "cell_type": pd.Categorical([cell_type] * len(condition))},
                       index=pd.Index([f"cell{i}" for i in range(X.shape[0])]))
    var = pd.DataFrame({"gene_name": gene_names}, index=pd.Index(gene_ids))
    adata = anndata.AnnData(X=X, obs=obs, var=var)
    if gears_fields:
        add_gears_fields(adata)
    # gzip -9 for small sets (the bundled sample), -1 for large ones (a Norman-size X at -9 takes minutes)
    level = (9 if X.nnz < 5_000_000 else 1) if compression == "gzip" else None
    adata.write_h5ad(out_dir / DATA_FILE, compression=compression, compression_opts=level)

    go_pairs = _gene2go_pairs(net, gene_names, rng)
    lines = ["# synthetic gene -> GO mapping (regulons GO:9xxxxxx, random terms GO:8xxxxxx); gene<TAB>GO id"]
    lines += [f"{g}\t{t}" for g, t in go_pairs]
    (out_dir / "gene2go.tsv").write_text("\n".join(lines) + "\n")

    truth = ground_truth(net, pert, doubles, mc_cells, noise_sd, seed)
    np.savez_compressed(out_dir / "ground_truth.npz", edge_regulator=net.edge_regulator, edge_target=net.edge_target,
                        edge_weight=net.edge_weight.astype(np.float32), bias=net.bias.astype(np.float32),
                        scale=net.scale.astype(np.float32), topological_order=net.order,
                        pert_gene_idx=pert.astype(np.int64), double_gene_idx=np.asarray(doubles, dtype=np.int64).reshape(-1, 2),
                        **{k: v.astype(np.float32) for k, v in truth.items()})
    singles_text = [format_condition((gene_names[g],)) for g in pert]
    doubles_text = [format_condition(tuple(sorted((gene_names[a], gene_names[b])))) for a, b in doubles]
    effect_a = truth["true_log_expression_single"] - truth["true_log_expression_ctrl"]
    pos = {int(g): k for k, g in enumerate(pert)}
    scores = {}
    for d, (a, b) in enumerate(doubles):
        inter = truth["interaction"][d]
        denom = np.linalg.norm(effect_a[pos[a]]) + np.linalg.norm(effect_a[pos[b]])
        scores[doubles_text[d]] = {"score": float(np.linalg.norm(inter) / max(denom, 1e-12)),
                                   "top_genes": [gene_names[i] for i in np.argsort(-np.abs(inter))[:5]]}
    params = {"num_genes": num_genes, "num_perturbed_genes": num_perturbed_genes,
              "cells_per_condition": cells_per_condition, "num_control_cells": num_control_cells,
              "num_doubles": num_doubles, "seed": seed, "noise": noise, "regulator_noise": regulator_noise,
              "counts_per_gene": counts_per_gene, "library_sd": library_sd, "scale_sd": scale_sd,
              "mc_cells": mc_cells, "cell_type": cell_type, "gears_fields": gears_fields}
    atomic_write_json(out_dir / "ground_truth.json", {
        "description": "synthetic data: a known gene-regulatory network; see trainer/families/perturbation_gears/simulate.py",
        "params": params, "genes": gene_names, "gene_ids": gene_ids, "pert_genes": [gene_names[g] for g in pert],
        "singles": singles_text, "doubles": doubles_text, "interaction": scores}, durable=False)
    seconds = time.perf_counter() - started
    summary = {"out_dir": str(out_dir), "cells": int(X.shape[0]), "genes": num_genes, "conditions": len(conditions),
               "nnz": int(X.nnz), "density": float(X.nnz / max(X.shape[0] * X.shape[1], 1)),
               "regulatory_edges": int(len(net.edge_weight)), "layers": len(net.layers), "seconds": round(seconds, 2)}
    logger.info("simulated perturbation data: %s", summary)
    return summary


def ground_truth(net: GeneNetwork, pert: np.ndarray, doubles: list[tuple[int, int]], mc_cells: int,
                 noise_sd: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """True mean latent and log1p(CP10k) profiles of ctrl, every single and double, and the doubles' interaction.

    All conditions share one set of `mc_cells` noise draws (common random numbers).
    """
    shared = np.random.default_rng([seed, 1]).normal(0.0, 1.0, (mc_cells, net.num_genes)) * noise_sd

    def means(knockout: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        x = net.activity(shared, knockout) * net.scale
        return x.mean(axis=0), _expected_log(x).mean(axis=0)

    ctrl_x, ctrl_log = means(())
    singles = [means((int(g),)) for g in pert]
    pairs = [means(d) for d in doubles]
    num_genes = net.num_genes
    single_log = np.array([s[1] for s in singles]).reshape(-1, num_genes)
    double_log = np.array([p[1] for p in pairs]).reshape(-1, num_genes)
    pos = {int(g): k for k, g in enumerate(pert)}
    interaction = np.array([double_log[d] - single_log[pos[a]] - single_log[pos[b]] + ctrl_log
                            for d, (a, b) in enumerate(doubles)]).reshape(-1, num_genes)
    return {"true_expression_ctrl": ctrl_x, "true_log_expression_ctrl": ctrl_log,
            "true_expression_single": np.array([s[0] for s in singles]).reshape(-1, num_genes),
            "true_log_expression_single": single_log,
            "true_expression_double": np.array([p[0] for p in pairs]).reshape(-1, num_genes),
            "true_log_expression_double": double_log, "interaction": interaction}


def dense_weights(truth: Any) -> np.ndarray:
    """The [G, G] weight matrix W[regulator, target] from a loaded `ground_truth.npz`."""
    g = len(truth["scale"])
    W = np.zeros((g, g), dtype=np.float32)
    W[truth["edge_regulator"], truth["edge_target"]] = truth["edge_weight"]
    return W


def _parse_value(key: str, text: str, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except ValueError as e:
        raise ConfigError(f"{key}={text!r}: expected {type(default).__name__}") from e
    return None if text.lower() in ("none", "null", "") else text


def main(argv: list[str] | None = None) -> int:
    """`trainer simulate-perturbations OUT key=value ...`: write a simulated data set (keys: the options
    of `simulate_perturbation_data`)."""
    options = {k: p.default for k, p in inspect.signature(simulate_perturbation_data).parameters.items() if k != "out_dir"}
    parser = argparse.ArgumentParser(
        prog="trainer simulate-perturbations",
        description="Write simulated GEARS-format perturbation data with a known gene-regulatory network.",
        epilog="options (key=value): " + ", ".join(f"{k}={v}" for k, v in options.items()))
    parser.add_argument("out", help="output folder (perturb_processed.h5ad, gene2go.tsv, ground_truth.npz/json)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    kwargs: dict[str, Any] = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"expected key=value, got {item!r}")
        if key not in options:
            raise ConfigError(f"unknown option {key!r}; options: {', '.join(options)}")
        kwargs[key] = _parse_value(key, value, options[key])
    summary = simulate_perturbation_data(args.out, **kwargs)
    print(json.dumps(summary, indent=1))
    return 0

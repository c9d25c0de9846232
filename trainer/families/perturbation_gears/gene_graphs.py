"""GEARS' two gene graphs: GO similarity over the perturbable genes, co-expression over all genes.

Both are returned as (edge_index int64 [2, E] with row 0 = source and row 1 = target, edge_weight
float32 [E]) numpy arrays, grouped by target in increasing order and, within a target, by decreasing
weight (PyTorch Geometric's flow: messages go source -> target, so each target aggregates its own
top neighbours).

- GO graph (GEARS' `make_GO` + `get_similarity_network('go')`): weight = Jaccard index of the two
  genes' GO-term sets; pairs with Jaccard > threshold are kept (a gene with itself scores 1), then for
  every target the `top_k + 1` largest (self usually among them). Ties keep the lower source index
  first (pandas `nlargest(keep='first')` over GEARS' source-major edge list, whose genes are sorted).
- Co-expression graph (GEARS' `get_coexpression_network_from_train`): weight = |Pearson r| between
  genes over the given cells (GEARS: control cells + training singles), NaN (a constant gene) -> 0;
  for every target the `top_k + 1` largest (self included when the gene varies), then kept if > threshold.
  Ties keep the lower source index (GEARS' unstable argsort leaves them unspecified).
  Pearson comes from a Gram matrix accumulated over dense blocks of rows, so only `block` rows are
  ever dense.

`cached_graphs` builds both once per (data fingerprint, split, seed, thresholds, k) and keeps them as
.npz under a cache folder (atomic write).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse as sp

from trainer.atomic_io import atomic_write_bytes
from trainer.families.perturbation_gears.anndata_reader import dense_rows

if TYPE_CHECKING:
    from trainer.families.perturbation_gears.anndata_reader import PerturbationData
    from trainer.families.perturbation_gears.splits import SplitResult

logger = logging.getLogger(__name__)

GRAPH_FORMAT_VERSION = "gears-graphs-v1"
"""Part of the cache key: bump when graph building changes its output."""


def _top_per_target(weights: np.ndarray, targets: np.ndarray, top_k: int, threshold: float,
                    sources: list[np.ndarray], targets_out: list[np.ndarray], weights_out: list[np.ndarray],
                    band: int = 256) -> None:
    """Append, for each row of `weights` ([len(targets), S]: similarity of each source to that target), the
    top_k + 1 sources with weight > threshold (ties: lower source index first).

    The same sources as a stable argsort of each whole row, found from a partition (linear in S, a band of rows
    at a time): the candidates are the sources at or above the row's (top_k + 1)-th largest weight, ties at
    that value included, and only they are sorted."""
    keep = top_k + 1
    num_sources = weights.shape[1]
    if keep >= num_sources:  # nothing to partition: sort whole rows
        for row, target in zip(weights, targets):
            order = np.argsort(-row, kind="stable")[:keep]
            order = order[row[order] > threshold]
            sources.append(order.astype(np.int64))
            targets_out.append(np.full(len(order), target, dtype=np.int64))
            weights_out.append(row[order].astype(np.float32))
        return
    for start in range(0, len(weights), band):
        rows = weights[start:start + band]
        # the keep-th largest of each row (NaN-free: the weights are finite)
        kth = -np.partition(-rows, keep - 1, axis=1)[:, keep - 1]
        for row, target, cut in zip(rows, targets[start:start + band], kth):
            candidates = np.flatnonzero(row >= max(cut, np.nextafter(threshold, np.inf)))
            order = candidates[np.argsort(-row[candidates], kind="stable")[:keep]]
            sources.append(order.astype(np.int64))
            targets_out.append(np.full(len(order), target, dtype=np.int64))
            weights_out.append(row[order].astype(np.float32))


def _pack(sources: list[np.ndarray], targets: list[np.ndarray], weights: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    if not sources:
        return np.zeros((2, 0), dtype=np.int64), np.zeros(0, dtype=np.float32)
    edge_index = np.stack([np.concatenate(sources), np.concatenate(targets)]).astype(np.int64)
    return edge_index, np.concatenate(weights).astype(np.float32)


def build_go_graph(pert_genes: Sequence[str], gene2go: Mapping[str, frozenset[str] | set[str] | Sequence[str]],
                   threshold: float = 0.1, top_k: int = 20, block: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """GO-similarity graph over `pert_genes` (node i = pert_genes[i]): Jaccard > threshold, top_k + 1 per target.

    A gene without GO terms has no edges (GEARS would divide by zero). Jaccard is computed from a
    sparse gene x term incidence matrix in blocks of `block` targets.
    """
    terms: dict[str, int] = {}
    rows, cols = [], []
    for i, gene in enumerate(pert_genes):
        for t in sorted(gene2go.get(gene, ())):
            rows.append(i)
            cols.append(terms.setdefault(t, len(terms)))
    n = len(pert_genes)
    incidence = sp.csr_matrix((np.ones(len(rows), dtype=np.float64), (rows, cols)), shape=(n, max(len(terms), 1)))
    sizes = np.asarray(incidence.sum(axis=1)).ravel()
    incidence_t = incidence.T.tocsc()
    sources: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    for start in range(0, n, block):
        stop = min(start + block, n)
        inter = np.asarray((incidence[start:stop] @ incidence_t).todense())
        union = sizes[start:stop, None] + sizes[None, :] - inter
        with np.errstate(invalid="ignore", divide="ignore"):
            jaccard = np.where(union > 0, inter / union, 0.0)
        _top_per_target(jaccard, np.arange(start, stop), top_k, threshold, sources, targets, weights)
    return _pack(sources, targets, weights)


FLOAT32_PRODUCTS_ABOVE = 1e12
"""Multiply-adds (rows x genes^2 / 2) above which `abs_pearson`'s "auto" forms the products in float32: high enough
that the bundled set and Norman-size sets (5,000 genes, tens of thousands of training cells) keep float64's
graph, low enough that a Replogle-size one (8,000 genes, hundreds of thousands) gets the faster products."""
FLOAT32_BLOCK = 2048
"""Rows per float32 product block: each block's sums are float32 over this many rows, then added in float64."""


def abs_pearson(X: sp.spmatrix | np.ndarray, rows: np.ndarray | None = None, block: int = 1024,
                precision: str = "auto") -> np.ndarray:
    """|Pearson r| between the columns of X over `rows` (all rows if None), [G, G] float64, NaN -> 0.

    The centred Gram matrix is accumulated in place (BLAS syrk) over dense blocks of `block` rows, and
    normalised in place: the peak is one [G, G] float64 matrix plus a block (X is never dense as a
    whole). A constant gene (variance below 1e-12 of its mean square) correlates 0 with everything.

    precision: "float64" (every product and sum in float64), "float32" (each block of `FLOAT32_BLOCK` rows
    multiplied in float32, half the arithmetic and twice BLAS's rate, its sums added in float64: |r| within
    about 1e-5 of float64's) or "auto" (float32 above `FLOAT32_PRODUCTS_ABOVE` multiply-adds).
    """
    from scipy.linalg.blas import dsyrk, ssyrk

    if precision not in ("auto", "float32", "float64"):
        raise ValueError(f"precision must be 'auto', 'float32' or 'float64', got {precision!r}")
    rows = np.arange(X.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
    csr = sp.csr_matrix(X) if sp.issparse(X) else None
    num_genes = X.shape[1]
    if precision == "auto":
        precision = "float32" if len(rows) * num_genes**2 / 2 > FLOAT32_PRODUCTS_ABOVE else "float64"
    single = precision == "float32"
    step = FLOAT32_BLOCK if single else block

    def chunks(dtype=np.float64):
        for start in range(0, len(rows), step):
            chunk_rows = rows[start:start + step]
            chunk = dense_rows(csr, chunk_rows) if csr is not None else np.asarray(X[chunk_rows], dtype=np.float32)
            yield chunk.astype(dtype, copy=False)

    n = max(len(rows), 1)
    mean = np.zeros(num_genes)
    square = np.zeros(num_genes, dtype=np.float64)
    cov = np.zeros((num_genes, num_genes), dtype=np.float64, order="F")  # Fortran order: syrk updates it in place
    if single:
        # sums and squares from the non-zeros alone (float64, no dense pass), then float32 products of centred blocks
        for start in range(0, len(rows), step):
            part = csr[rows[start:start + step]] if csr is not None else sp.csr_matrix(
                np.asarray(X[rows[start:start + step]], dtype=np.float32))
            values = part.data.astype(np.float64)
            mean += np.bincount(part.indices, weights=values, minlength=num_genes)
            square += np.bincount(part.indices, weights=values * values, minlength=num_genes)
        mean /= n
        mean32 = mean.astype(np.float32)
        for chunk in chunks(np.float32):
            chunk -= mean32
            cov += ssyrk(1.0, chunk.T, trans=0, lower=0)  # float32 upper triangle, added in float64
    else:
        for chunk in chunks():
            mean += chunk.sum(axis=0)
        mean /= n
        for chunk in chunks():
            square += np.einsum("ij,ij->j", chunk, chunk)
            chunk -= mean
            # cov += chunk.T @ chunk on the upper triangle; chunk.T is Fortran-ordered, so nothing is copied
            cov = dsyrk(1.0, chunk.T, beta=1.0, c=cov, trans=0, lower=0, overwrite_c=1)
    for start in range(0, num_genes, 512):  # mirror the upper triangle, a band of rows at a time
        stop = min(start + 512, num_genes)
        cov[start:stop, :start] = cov[:start, start:stop].T
        diagonal = cov[start:stop, start:stop]
        cov[start:stop, start:stop] = np.triu(diagonal) + np.triu(diagonal, 1).T
    var = np.diag(cov).copy()
    constant = var <= 1e-12 * square
    scale = np.zeros(num_genes)
    scale[~constant] = 1.0 / np.sqrt(var[~constant])
    cov *= scale[:, None]  # constant genes' rows and columns become 0
    cov *= scale[None, :]
    np.nan_to_num(cov, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
    np.abs(cov, out=cov)
    np.minimum(cov, 1.0, out=cov)  # rounding can push |r| a hair above 1 (GEARS clips too)
    return cov.T  # symmetric: the transpose is the same matrix, C-ordered, and no copy


def build_coexpression_graph(X: sp.spmatrix | np.ndarray, cell_rows: np.ndarray | None, gene_names: Sequence[str] | None = None,
                             threshold: float = 0.4, top_k: int = 20, block: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """Co-expression graph over all genes (node i = column i): |Pearson| over `cell_rows`, top_k + 1 per
    target, kept if > threshold. `gene_names` is only checked against the number of columns."""
    if gene_names is not None and len(gene_names) != X.shape[1]:
        raise ValueError(f"{len(gene_names)} gene names for {X.shape[1]} columns")
    weights_all = abs_pearson(X, cell_rows, block=block)
    sources: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    _top_per_target(weights_all, np.arange(X.shape[1]), top_k, threshold, sources, targets, weights)
    return _pack(sources, targets, weights)


# --------------------------------------------------------------------------------------------------
# cache


@dataclass
class GeneGraphs:
    """The two graphs of a run (edge_index [2, E] source -> target, edge_weight [E])."""

    go_edge_index: np.ndarray
    go_edge_weight: np.ndarray
    coexpression_edge_index: np.ndarray
    coexpression_edge_weight: np.ndarray
    pert_genes: list[str]
    key: str = ""


def coexpression_rows(data: PerturbationData, train_conditions: Sequence) -> np.ndarray:
    """Rows of the cells GEARS builds the co-expression graph from: control and training singles (not doubles)."""
    from trainer.families.perturbation_gears.conditions import as_condition

    wanted = [as_condition(c) for c in train_conditions]
    wanted = [c for c in wanted if len(c) <= 1 and c in data.condition_index]
    if () not in wanted:
        wanted.append(())
    return np.sort(np.concatenate([data.rows_of(c) for c in wanted]))


def graph_cache_key(data: PerturbationData, split: SplitResult, go_threshold: float, go_top_k: int,
                    coexpression_threshold: float, coexpression_top_k: int, gene2go_digest: str) -> str:
    """Hex key of (data fingerprint, split mode/seed/train set, thresholds, k, GO mapping, format version)."""
    payload = {"version": GRAPH_FORMAT_VERSION, "data": data.fingerprint, "mode": split.mode, "seed": split.seed,
               "train": sorted(split.train), "go": [go_threshold, go_top_k], "gene2go": gene2go_digest,
               "coexpression": [coexpression_threshold, coexpression_top_k]}
    return hashlib.blake2b(json.dumps(payload, sort_keys=True).encode(), digest_size=16).hexdigest()


def gene2go_digest(pert_genes: Sequence[str], gene2go: Mapping) -> str:
    """A digest of `gene2go` over `pert_genes` (each gene's sorted GO ids): the GO graph's part of the cache key."""
    known = getattr(gene2go, "digests", None)  # `PackedGeneToGo`: computed where it was packed
    if known and tuple(pert_genes) in known:
        return known[tuple(pert_genes)]
    h = hashlib.blake2b(digest_size=16)
    for g in pert_genes:
        h.update(g.encode() + b"\0" + "\1".join(sorted(gene2go.get(g, ()))).encode() + b"\n")
    return h.hexdigest()


def cached_graphs(data: PerturbationData, split: SplitResult, gene2go: Mapping, cache_dir: str | Path | None,
                  go_threshold: float = 0.1, go_top_k: int = 20, coexpression_threshold: float = 0.4,
                  coexpression_top_k: int = 20) -> GeneGraphs:
    """Both graphs for (data, split), read from `cache_dir/gears_graphs_<key>.npz` or built and saved there.

    `cache_dir=None` builds without caching. The GO graph is over `data.pert_genes`, the co-expression
    graph over all genes from the control and training-single cells of `split`.
    """
    key = graph_cache_key(data, split, go_threshold, go_top_k, coexpression_threshold, coexpression_top_k,
                          gene2go_digest(data.pert_genes, gene2go))
    path = Path(cache_dir) / f"gears_graphs_{key}.npz" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                cached = GeneGraphs(z["go_edge_index"], z["go_edge_weight"], z["coexpression_edge_index"],
                                    z["coexpression_edge_weight"], z["pert_genes"].tolist(), key)
            if cached.pert_genes == list(data.pert_genes):
                return cached
        except (OSError, KeyError, ValueError) as e:  # a damaged cache file is rebuilt, not trusted
            logger.warning("%s: unreadable graph cache (%s), rebuilding", path, e)
    go_index, go_weight = build_go_graph(data.pert_genes, gene2go, go_threshold, go_top_k)
    co_index, co_weight = build_coexpression_graph(data.X, coexpression_rows(data, split.train), data.gene_names,
                                                   coexpression_threshold, coexpression_top_k)
    graphs = GeneGraphs(go_index, go_weight, co_index, co_weight, list(data.pert_genes), key)
    logger.info("gene graphs: GO %d edges over %d genes, co-expression %d edges over %d genes",
                go_index.shape[1], len(data.pert_genes), co_index.shape[1], data.num_genes)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.savez(buffer, go_edge_index=go_index, go_edge_weight=go_weight, coexpression_edge_index=co_index,
                 coexpression_edge_weight=co_weight, pert_genes=np.asarray(data.pert_genes, dtype=str))
        atomic_write_bytes(path, buffer.getvalue(), durable=False)
    return graphs

"""Read GEARS-format perturbation data (`perturb_processed.h5ad`) or raw AnnData into `PerturbationData`.

A GEARS file is read unchanged: sparse `X` (log-normalised expression), `var['gene_name']`,
`obs['condition']` ('ctrl', 'A+ctrl', 'ctrl+A', 'A+B'), `obs['cell_type']` and the `uns` fields GEARS'
processing adds. Raw AnnData with only X/var/obs gets those fields computed the way GEARS does
(`add_gears_fields`, GEARS' `get_DE_genes` + `get_dropout_non_zero_genes`):

- `obs['dose_val']` = '1+1' for any condition with a '+' (singles too), else '1'; `obs['control']` =
  1 for 'ctrl'; `obs['condition_name']` = f"{cell_type}_{condition}_{dose_val}".
- `uns['rank_genes_groups_cov_all']`: per cell type, scanpy `rank_genes_groups` of every
  condition_name against f"{cell_type}_ctrl_1" (Welch t-test, `rankby_abs=True`, all genes), the
  ranked var names per condition_name. Groups of fewer than 2 cells (scanpy refuses them; GEARS
  crashes) and cell types without 2 control cells are skipped and reported. Computed without scanpy, in
  one pass over X (`rank_genes_by_cell_type`): scanpy's statistic and ranking, ties included.
- Per condition, over all its cells: `non_zeros_gene_idx` = genes whose mean is non-zero;
  `non_dropout_gene_idx` = those plus the genes zero both in the condition and in the control mean;
  `top_non_dropout_de_20` / `top_non_zero_de_20` = the first 20 ranked genes in those sets.

`PerturbationData.de_idx` is what GEARS trains and evaluates with (`mse_de`, `pearson_de`): the
first 20 genes of `rank_genes_groups_cov_all` (GEARS keeps them in gene order, we keep rank order:
the same set). With several cell types a condition takes the DE fields of its first cell's
condition_name, as GEARS does.

Conditions are canonical gene tuples (`conditions.py`): 'A+ctrl' and 'ctrl+A' are merged. A
condition string outside GEARS' grammar, a gene missing from `var` (or, given a gene2go mapping,
from it; snap-stanford/GEARS#54, snap-stanford/GEARS#77), a condition without cells or without a DE ranking
is dropped and counted (`PerturbationData.dropped`, logged once with examples), or with `on_invalid="error"`
raises a DataError naming the condition and reason. Nothing is densified: X stays CSR float32.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import warnings
import zipfile
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from trainer.errors import ConfigError, DataError
from trainer.families.perturbation_gears.conditions import (
    CTRL,
    Condition,
    condition_genes,
    condition_name,
    dose_value,
    format_condition,
    parse_condition,
)
from trainer.families.perturbation_gears.gene_ontology import GeneToGo, gene2go_from_mapping, read_gene2go

if TYPE_CHECKING:
    import anndata

logger = logging.getLogger(__name__)

NUM_DE_GENES = 20
"""GEARS' number of top differentially expressed genes per condition."""
NUM_RANKED_DE_GENES = 200
"""Genes of the DE ranking kept per condition (`ranked_de_idx`: frac_correct_direction_{50,100,200})."""
GEARS_UNS_FIELDS = ("rank_genes_groups_cov_all", "non_zeros_gene_idx", "non_dropout_gene_idx",
                    "top_non_dropout_de_20", "top_non_zero_de_20")
DATA_FILE = "perturb_processed.h5ad"
_SAMPLES = Path(__file__).resolve().parent / "samples"
FULL_HASH_BYTES = 256 * 2**20
"""X (values + columns) up to this size is hashed whole by `PerturbationData.fingerprint`; above, sampled."""
FINGERPRINT_WINDOWS = 64
FINGERPRINT_WINDOW = 4096
"""Non-zeros per sampled window of a large X's values and columns in `PerturbationData.fingerprint`."""
GENE_SET_FIELDS = ("non_zeros_gene_idx", "non_dropout_gene_idx")
"""uns fields kept as `ConditionGeneSets` (bits) in `PerturbationData`."""
DROP_REASONS = ("missing_condition", "malformed_condition", "gene_not_in_var", "gene_not_in_go", "no_cells",
                "no_de_ranking")
"""Why a condition (or, for missing_condition, a cell) is dropped, in the order they are checked."""


def bundled_perturbation_path() -> Path:
    """Folder of the bundled simulated set (perturb_processed.h5ad, gene2go.tsv, ground_truth.npz/json).

    Synthetic data from `simulate.py`; how it was made: trainer/families/perturbation_gears/samples/README.md.
    """
    return _SAMPLES


# --------------------------------------------------------------------------------------------------
# the data


@dataclass
class PerturbationData:
    """Cells x genes expression (sparse) with canonical per-cell conditions and GEARS' per-condition fields.

    Per-condition fields are mappings keyed by the canonical condition (a sorted gene tuple; () is the control)
    to int64 gene positions into `gene_names`; the control has no DE entries. The reader stores them packed
    (`ConditionArrays`, `ConditionGeneSets`: every rank holds them for the whole run); any mapping works.
    """

    X: sp.csr_matrix
    """cells x genes, CSR float32 (log-normalised expression as in the file)."""
    gene_names: np.ndarray
    """[G] var['gene_name']."""
    var_names: np.ndarray
    """[G] the var index (the names GEARS' uns fields use)."""
    conditions: list[Condition]
    """Every condition with cells, control first, then singles and doubles sorted."""
    cell_condition: np.ndarray
    """[N] position of each cell's condition in `conditions`, in the smallest integer type holding them (int16 up to
    32,767 conditions; any integer array given is converted)."""
    cell_type: pd.Categorical
    """[N] each cell's type: codes (int8 for up to 127 types) and the distinct names (any [N] array of str given is
    converted; `np.asarray(cell_type)` is the [N] object array)."""
    condition_names: list[str]
    """GEARS' condition_name (f"{cell_type}_{condition}_{dose}") of each condition's first cell."""
    pert_genes: list[str]
    """The perturbable genes (sorted): the nodes of the GO graph; `pert_idx` points into this list."""
    de_idx: Mapping[Condition, np.ndarray]
    """Top-20 genes of the DE ranking (GEARS' training/eval `de_idx`), rank order."""
    top_non_dropout_de_20: Mapping[Condition, np.ndarray]
    top_non_zero_de_20: Mapping[Condition, np.ndarray]
    non_zeros_gene_idx: Mapping[Condition, np.ndarray]
    """Genes with a non-zero mean in the condition (GEARS' loss uses only these); a `ConditionGeneSets` (bits)."""
    non_dropout_gene_idx: Mapping[Condition, np.ndarray]
    ctrl_rows: np.ndarray
    """Rows of the control cells (int64)."""
    ctrl_mean: np.ndarray
    """[G] float32 mean expression of the control cells."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Dropped conditions by reason (missing_condition counts cells)."""
    dropped_cells: dict[str, int] = field(default_factory=dict)
    dropped_examples: dict[str, list[str]] = field(default_factory=dict)
    source: str = ""
    ranked_de_idx: Mapping[Condition, np.ndarray] = field(default_factory=dict)
    """The first `NUM_RANKED_DE_GENES` genes of the DE ranking (rank order; its first 20 are `de_idx`)."""

    def __post_init__(self) -> None:
        # per cell and in every rank for the whole run: codes in the smallest type, not a str pointer per cell
        self.cell_condition = np.asarray(self.cell_condition).astype(index_dtype(max(len(self.conditions) - 1, 0)),
                                                                      copy=False)
        if not isinstance(self.cell_type, pd.Categorical):
            self.cell_type = coded_strings(self.cell_type)
        # one array of rows grouped by condition plus offsets (not a list of per-condition arrays), in the
        # smallest integer type holding a row
        counts = np.bincount(self.cell_condition, minlength=len(self.conditions))
        self._row_order = np.argsort(self.cell_condition, kind="stable").astype(index_dtype(max(self.num_cells - 1, 0)))
        self._row_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=self._row_offsets[1:])
        self.condition_index: dict[Condition, int] = {c: i for i, c in enumerate(self.conditions)}
        self.pert_index: dict[str, int] = {g: i for i, g in enumerate(self.pert_genes)}

    # ---------------------------------------------------------------- lookups
    @property
    def num_cells(self) -> int:
        return int(self.X.shape[0])

    @property
    def num_genes(self) -> int:
        return int(self.X.shape[1])

    @property
    def condition_strings(self) -> list[str]:
        """GEARS strings of `conditions` ('ctrl', 'A+ctrl', 'A+B')."""
        return [format_condition(c) for c in self.conditions]

    def rows_of(self, condition: Condition) -> np.ndarray:
        """Row indices (int64, increasing) of the cells of `condition` (a new array)."""
        i = self.condition_index[condition]
        return self._row_order[self._row_offsets[i]:self._row_offsets[i + 1]].astype(np.int64)

    def condition_span(self, condition: Condition) -> tuple[int, int]:
        """(a, b): the rows of `condition` are `row_order[a:b]`."""
        i = self.condition_index[condition]
        return int(self._row_offsets[i]), int(self._row_offsets[i + 1])

    @property
    def row_order(self) -> np.ndarray:
        """[N] every row, grouped by condition in `conditions` order and increasing within one (read-only)."""
        view = self._row_order.view()
        view.flags.writeable = False
        return view

    def pert_idx(self, condition: Condition) -> list[int]:
        """Positions of the condition's genes in `pert_genes` ([] for the control)."""
        return [self.pert_index[g] for g in condition]

    def dense_rows(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """[len(rows), G] float32 copy of those rows (only these rows are densified)."""
        return dense_rows(self.X, rows)

    @cached_property
    def fingerprint(self) -> str:
        """Hash of the expression, gene names and per-cell conditions (keys graph caches), the same in every process.

        Up to `FULL_HASH_BYTES` of X the whole of X is hashed. Above, every row's length (indptr), the per-cell
        conditions and `FINGERPRINT_WINDOWS` evenly spaced windows of X's values and columns: linear in the
        cells, not in the non-zeros, so no process reads all of X at each start to key a cache. An edit that
        keeps every row's length and misses every window goes unseen: pass a new cache_dir after such an edit.
        """
        h = hashlib.blake2b(digest_size=16)
        X = self.X
        cell_condition = self.cell_condition.astype(np.int32)  # hashed as the int32 it was stored as: same keys
        if X.data.nbytes + X.indices.nbytes <= FULL_HASH_BYTES:
            parts = [X.indptr, X.indices, X.data, cell_condition]
        else:
            h.update(f"sampled:{X.shape}:{X.nnz}".encode())
            starts = np.linspace(0, X.nnz - FINGERPRINT_WINDOW, FINGERPRINT_WINDOWS).astype(np.int64)
            parts = [X.indptr, cell_condition, *(X.data[a:a + FINGERPRINT_WINDOW] for a in starts),
                     *(X.indices[a:a + FINGERPRINT_WINDOW] for a in starts)]
        for arr in parts:
            h.update(np.ascontiguousarray(arr).view(np.uint8))
        h.update("\0".join(self.gene_names.tolist()).encode())
        h.update("\0".join(self.condition_strings).encode())
        h.update("\0".join(self.pert_genes).encode())
        return h.hexdigest()

    def __getstate__(self) -> dict[str, Any]:
        # a memory-mapped X (`read_x_rows`' cache) travels as its folder and is mapped again on unpickling: the
        # pickle of a data set read in another process (`read_process`) carries no copy of X
        state = dict(self.__dict__)
        folder = mapped_folder(self.X)
        if folder is not None:
            state["X"] = _MappedX(str(folder), (int(self.X.shape[0]), int(self.X.shape[1])))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state.get("X"), _MappedX):
            state = {**state, "X": _mapped_csr(Path(state["X"].folder), state["X"].shape)}
        self.__dict__.update(state)

    def summary(self) -> dict[str, Any]:
        """JSON-able counts (cells, genes, conditions by kind, drops)."""
        kinds = Counter(len(c) for c in self.conditions)
        return {"cells": self.num_cells, "genes": self.num_genes, "control_cells": int(len(self.ctrl_rows)),
                "singles": kinds[1], "doubles": kinds[2], "pert_genes": len(self.pert_genes),
                "dropped": dict(self.dropped), "source": self.source}


def dense_rows(X: sp.csr_matrix, rows: Sequence[int] | np.ndarray) -> np.ndarray:
    """Rows of a CSR matrix as a dense float32 array, filled straight from its buffers."""
    rows = np.asarray(rows, dtype=np.int64)
    out = np.zeros((len(rows), X.shape[1]), dtype=np.float32)
    indptr, indices, data = X.indptr, X.indices, X.data
    for k, r in enumerate(rows):
        a, b = indptr[r], indptr[r + 1]
        out[k, indices[a:b]] = data[a:b]
    return out


def _packed_row(positions: np.ndarray, num_genes: int) -> np.ndarray:
    """[ceil(G / 8)] uint8: the bits of a gene-position set."""
    row = np.zeros(num_genes, dtype=bool)
    row[np.asarray(positions, dtype=np.int64)] = True
    return np.packbits(row)


@dataclass(frozen=True)
class _MappedX:
    """A memory-mapped X in a pickle: its `read_x_rows` folder and shape."""

    folder: str
    shape: tuple[int, int]


def mapped_folder(X: Any) -> Path | None:
    """The `read_x_rows` cache folder a CSR's values and columns are memory-mapped from, else None."""
    data, indices = getattr(X, "data", None), getattr(X, "indices", None)
    if not (isinstance(data, np.memmap) and isinstance(indices, np.memmap) and data.filename and indices.filename):
        return None
    folder = Path(data.filename).parent
    if Path(indices.filename).parent != folder or not (folder / "done").is_file():
        return None
    return folder


def coded_strings(column: Any) -> pd.Categorical:
    """[N] per-cell text (as `astype(str)` writes it) as codes in the smallest integer type plus its distinct values
    in first-seen order: a per-cell str object (or even a pointer per cell to a shared one) costs every rank 8-60
    bytes a cell for the whole run, a code one byte for up to 127 values."""
    codes, uniques = pd.factorize(pd.Series(column).astype(str), sort=False)
    return pd.Categorical.from_codes(codes.astype(index_dtype(max(len(uniques) - 1, 0)), copy=False),
                                     categories=pd.Index(np.asarray(uniques, dtype=object), dtype=object))


def index_dtype(largest: int) -> np.dtype:
    """The smallest of int16 / int32 / int64 holding 0..`largest` (gene or perturbation positions)."""
    for dtype in (np.int16, np.int32):
        if largest <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


class ConditionRows(Mapping):
    """A read-only {condition: value} whose conditions are rows of packed storage (`_row`: {condition: row},
    shared between the fields of one data set)."""

    _row: Mapping[Condition, int]

    def __contains__(self, key: object) -> bool:
        return key in self._row

    def __iter__(self) -> Iterator[Condition]:
        return iter(self._row)

    def __len__(self) -> int:
        return len(self._row)


class ConditionGeneSets(ConditionRows):
    """{condition: int64 gene positions} kept as one bit-packed [conditions, G] matrix (a bit per gene).

    GEARS' `non_zeros_gene_idx` / `non_dropout_gene_idx` hold most genes of every condition: as int64 arrays that
    is conditions x genes x 8 bytes in every rank (hundreds of MB at Replogle's 2,000 groups x 8,000 genes); as
    bits, conditions x genes / 8. A lookup unpacks one row. `extra` (a packed row, or None) is OR-ed into every
    row: GEARS' non-dropout genes are each condition's non-zero genes plus the genes zero in the control mean, so
    they share the non-zero set's bits and keep one row of their own (`with_extra`).
    """

    def __init__(self, keys: Sequence[Condition] | Mapping[Condition, int], bits: np.ndarray, num_genes: int,
                 extra: np.ndarray | None = None):
        # a {condition: row} given as is is shared, not copied: every per-condition field has the same keys
        self._row = keys if isinstance(keys, Mapping) else {k: i for i, k in enumerate(keys)}
        self.bits = bits
        self.num_genes = int(num_genes)
        self.extra = extra

    @classmethod
    def from_packed_rows(cls, rows: Sequence[tuple[Condition, np.ndarray]], num_genes: int,
                         index: Mapping[Condition, int] | None = None) -> ConditionGeneSets:
        """From (condition, `_packed_row` bits) pairs, packed one at a time by the caller; `index`: the shared
        {condition: row} of these keys in this order (built when None)."""
        bits = np.stack([b for _, b in rows]) if rows else np.zeros((0, (num_genes + 7) // 8), dtype=np.uint8)
        return cls(index if index is not None else [k for k, _ in rows], bits, num_genes)

    @classmethod
    def from_positions(cls, items: Mapping[Condition, np.ndarray] | Iterable[tuple[Condition, np.ndarray]],
                       num_genes: int) -> ConditionGeneSets:
        """Pack {condition: gene positions} (or (condition, positions) pairs)."""
        pairs = items.items() if isinstance(items, Mapping) else items
        return cls.from_packed_rows([(k, _packed_row(p, num_genes)) for k, p in pairs], num_genes)

    def with_extra(self, other: ConditionGeneSets) -> ConditionGeneSets:
        """`other` as this set's bits OR-ed with one common row, sharing this set's bits, when that is exactly
        `other` (same keys in the same order, every row); else `other` unchanged."""
        if (self.extra is not None or other.extra is not None or list(self._row) != list(other._row)
                or self.bits.shape != other.bits.shape or self.num_genes != other.num_genes):
            return other
        common = np.bitwise_or.reduce(other.bits & ~self.bits, axis=0) if len(self.bits) else None
        if common is None or not np.array_equal(other.bits, self.bits | common):
            return other
        return ConditionGeneSets(self._row, self.bits, self.num_genes, extra=common)

    def row(self, key: Condition) -> int:
        """The row of `key` in `bits`."""
        return self._row[key]

    def packed(self, key: Condition) -> np.ndarray:
        """[ceil(G / 8)] uint8: the condition's bits (`extra` included)."""
        bits = self.bits[self._row[key]]
        return bits if self.extra is None else bits | self.extra

    def mask(self, key: Condition) -> np.ndarray:
        """[G] bool: the condition's genes."""
        return np.unpackbits(self.packed(key), count=self.num_genes).view(bool)

    def __getitem__(self, key: Condition) -> np.ndarray:
        return np.flatnonzero(self.mask(key)).astype(np.int64)


class ConditionArrays(ConditionRows):
    """{condition: int64 gene positions} kept as one packed array of positions plus offsets, not a dict of arrays.

    GEARS' per-condition gene lists (the DE ranking's first 200 and 20, the top non-zero / non-dropout 20) are
    short: as a dict of int64 arrays each costs an array object's header plus 8 bytes a gene, for every
    condition in every rank; here they are one array of the smallest integer type holding the gene positions
    (`index_dtype`). A lookup returns a new int64 array. `limit` cuts each list to its first `limit` genes, so a
    top-20 field can share the storage of the ranking it is the head of (`head`).
    """

    def __init__(self, keys: Sequence[Condition] | Mapping[Condition, int], values: np.ndarray, offsets: np.ndarray,
                 limit: int | None = None):
        self._row = keys if isinstance(keys, Mapping) else {k: i for i, k in enumerate(keys)}
        self.flat = values  # not `values`: Mapping.values() is the mapping's
        self.offsets = offsets
        self.limit = limit

    @classmethod
    def from_items(cls, items: Mapping[Condition, Any] | Iterable[tuple[Condition, Any]],
                   index: Mapping[Condition, int] | None = None) -> ConditionArrays:
        """Pack {condition: gene positions} (or (condition, positions) pairs; `index`: the shared {condition: row}
        of these keys in this order, built when None)."""
        pairs = [(k, np.asarray(v, dtype=np.int64)) for k, v in (items.items() if isinstance(items, Mapping) else items)]
        largest = max((int(v.max()) for _, v in pairs if v.size), default=0)
        smallest = min((int(v.min()) for _, v in pairs if v.size), default=0)
        lengths = np.fromiter((len(v) for _, v in pairs), dtype=np.int64, count=len(pairs))
        offsets = np.zeros(len(pairs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.empty(int(offsets[-1]), dtype=index_dtype(largest) if smallest >= 0 else np.int64)
        for (_, v), a, b in zip(pairs, offsets[:-1], offsets[1:]):
            values[a:b] = v
        return cls(index if index is not None else [k for k, _ in pairs], values, offsets)

    def head(self, limit: int) -> ConditionArrays:
        """The same lists cut to their first `limit` genes, sharing this storage."""
        return ConditionArrays(self._row, self.flat, self.offsets, limit if self.limit is None else min(limit, self.limit))

    def __getitem__(self, key: Condition) -> np.ndarray:
        i = self._row[key]
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        if self.limit is not None:
            b = min(b, a + self.limit)
        return self.flat[a:b].astype(np.int64)


# --------------------------------------------------------------------------------------------------
# GEARS' processing


def group_sums(X: Any, codes: np.ndarray, num_groups: int, block: int = 4096, squares: bool = False
               ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(sums [num_groups, G] float64, sums of squares or None, counts [num_groups]) of the rows of X by group code.

    One pass over X, `block` rows at a time: each block's sums are a sparse group-indicator matrix times the
    block (float64), added into the dense totals at the block's distinct (group, gene) entries, so the work is
    the block's non-zeros, not groups x genes. X is CSR, dense, or anything whose row slices `X[a:b]` give one
    (an h5py-backed AnnData X), so X need not be in memory. A code < 0 leaves its row out. Squares are of the
    float32 values, as scanpy's variance takes them.
    """
    codes = np.asarray(codes, dtype=np.int64)
    n = len(codes)
    if X.shape[0] != n:
        raise ValueError(f"{n} group codes for {X.shape[0]} rows")
    num_genes = int(X.shape[1])
    sums = np.zeros(num_groups * num_genes, dtype=np.float64)
    sq = np.zeros(num_groups * num_genes, dtype=np.float64) if squares else None
    for start in range(0, n, block):
        stop = min(start + block, n)
        part = X[start:stop]
        part = sp.csr_matrix(part) if not sp.issparse(part) else part.tocsr()
        part_codes = np.maximum(codes[start:stop], -1)
        present, local = np.unique(part_codes, return_inverse=True)
        keep = part_codes >= 0
        if not keep.any():
            continue
        if present[0] < 0:
            present, local = present[1:], local - 1
        indicator = sp.csr_matrix((np.ones(int(keep.sum())), (local[keep], np.flatnonzero(keep))),
                                  shape=(len(present), stop - start))
        for total, values in ((sums, part.data), (sq, None if sq is None else part.data * part.data)):
            if total is None:
                continue
            block_x = sp.csr_matrix((values.astype(np.float64), part.indices, part.indptr), shape=part.shape)
            # a sparse product holds each (group, gene) once (unsorted), so the fancy-index add below is exact
            product = (indicator @ block_x).tocsr()
            rows = np.repeat(present, np.diff(product.indptr))
            total[rows * num_genes + product.indices] += product.data
    counts = np.bincount(codes[codes >= 0], minlength=num_groups)
    return (sums.reshape(num_groups, num_genes), None if sq is None else sq.reshape(num_groups, num_genes), counts)


def group_means(X: Any, codes: np.ndarray, num_groups: int, block: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """(means [num_groups, G] float64, counts [num_groups]) of the rows of X by group code, without densifying X.

    Float64 sums from `group_sums` (one pass, a sparse indicator product per block of `block` rows); an
    empty group has NaN means.
    """
    sums, _, counts = group_sums(X, codes, num_groups, block=block)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums / counts[:, None]
    return means, counts


def mean_of_rows(X: sp.csr_matrix, rows: np.ndarray, block: int = 4096) -> np.ndarray:
    """[G] float64 mean of the given rows of a CSR matrix, summed `block` rows at a time (no float64 copy)."""
    rows = np.asarray(rows, dtype=np.int64)
    total = np.zeros(X.shape[1], dtype=np.float64)
    for start in range(0, len(rows), block):
        part = X[rows[start:start + block]]
        total += np.bincount(part.indices, weights=part.data, minlength=X.shape[1])
    return total / max(len(rows), 1)


def _rank_by_abs(scores: np.ndarray) -> np.ndarray:
    """Gene positions by decreasing |score|, ties in the order scanpy's `_select_top_n` gives them (the same numpy
    calls: argpartition, then argsort reversed; a comparison sort's permutation depends only on the comparisons)."""
    scores = np.abs(scores)
    n = scores.shape[0]
    partition = np.argpartition(scores, -n)[-n:]
    return partition[np.argsort(scores[partition])[::-1]]


def _de_groups(names: np.ndarray, cell_types: np.ndarray) -> tuple[list[tuple[str, int, int]], np.ndarray, Counter]:
    """The condition_names to rank, each against its cell type's control: ([(name, group code, control's code)],
    per-cell group code (-1: not needed), skipped counts), with GEARS' rules (see `rank_genes_by_cell_type`)."""
    names = np.asarray(names, dtype=object)
    cell_types = np.asarray(cell_types, dtype=object)
    pairs = pd.MultiIndex.from_arrays([pd.Index(cell_types, dtype=object), pd.Index(names, dtype=object)])
    codes, uniq = pd.factorize(pairs)
    counts = np.bincount(codes, minlength=len(uniq))
    skipped: Counter = Counter()
    groups: list[tuple[str, str, int]] = []
    wanted = np.zeros(len(uniq), dtype=bool)
    code_of = {pair: k for k, pair in enumerate(uniq)}
    for cell_type in pd.unique(cell_types):
        reference = f"{cell_type}_{CTRL}_1"
        mine = [(name, k) for k, (ct, name) in enumerate(uniq) if ct == cell_type and name != reference]
        ok = [(name, k) for name, k in mine if counts[k] >= 2]
        skipped["single_cell_group"] += len(mine) - len(ok)
        ref = code_of.get((cell_type, reference))
        if ref is None or counts[ref] < 2:
            skipped["no_control_in_cell_type"] += len(ok)
            continue
        if not ok:
            continue
        wanted[ref] = True
        for name, k in ok:
            wanted[k] = True
            groups.append((cell_type, name, k))
    remap = np.full(len(uniq), -1, dtype=np.int64)
    remap[wanted] = np.arange(int(wanted.sum()))
    out = [(name, int(remap[k]), int(remap[code_of[(ct, f"{ct}_{CTRL}_1")]])) for ct, name, k in groups]
    return out, remap[codes], skipped


def _welch_t(X: Any, names: np.ndarray, cell_types: np.ndarray, block: int, skipped: Counter
             ) -> Iterator[tuple[str, np.ndarray]]:
    """(condition_name, t) per ranked group, one at a time (see `welch_t_scores`); fills `skipped`."""
    groups, codes, counted = _de_groups(names, cell_types)
    skipped.update(counted)
    if not groups:
        return
    num_groups = int(codes.max()) + 1
    sums, sq, counts = group_sums(X, codes, num_groups, block=block, squares=True)
    n = counts.astype(np.float64)[:, None]
    # in place, in scanpy's order of operations: means, then (E[x^2] - mean^2) * n / (n - 1), then its root
    means = sums
    means /= n
    sq /= n
    sq -= means ** 2
    sq *= n / (n - 1)
    std = np.sqrt(sq, out=sq)
    for name, k, r in groups:
        with np.errstate(invalid="ignore", divide="ignore"):
            denom = np.sqrt(std[k] ** 2 / counts[k] + std[r] ** 2 / counts[r])
            t = (means[k] - means[r]) / denom
        t[np.isnan(t)] = 0
        yield name, t


def welch_t_scores(X: Any, names: np.ndarray, cell_types: np.ndarray, block: int = 4096
                   ) -> tuple[dict[str, np.ndarray], Counter]:
    """{condition_name: [G] float64 Welch t statistic against its cell type's control}, and the skipped groups.

    scanpy's `rank_genes_groups(method="t-test")` statistic, vectorised: the per-group means and unbiased (n - 1)
    variances come from one pass over X (`group_sums`, float32 squares as scanpy's), then
    t = (m1 - m2) / sqrt(s1^2 / n1 + s2^2 / n2), NaN (0 / 0) -> 0.
    """
    skipped: Counter = Counter()
    scores = dict(_welch_t(X, names, cell_types, block, skipped))
    return scores, skipped


def rank_genes_by_cell_type(X: Any, names: np.ndarray, cell_types: np.ndarray, var_names: np.ndarray,
                            block: int = 4096) -> tuple[dict[str, np.ndarray], Counter]:
    """GEARS' `rank_genes_groups_by_cov`: {condition_name: var names ranked by |t|} and the skipped groups.

    Per cell type, every condition_name is ranked against f"{cell_type}_ctrl_1" by scanpy's t-test statistic
    (Welch, rankby_abs, all genes), computed in one pass over X (`welch_t_scores`): the ranking scanpy gives,
    ties included (`rank_genes_by_cell_type_scanpy` is scanpy's own path, kept as the reference). Skipped
    (counted): groups of one cell ('single_cell_group') and every group of a cell type without 2 control cells
    ('no_control_in_cell_type').
    """
    skipped: Counter = Counter()
    # object arrays: a pointer per ranked gene, not a fixed-width copy of its name (groups x genes of them)
    var_names = np.asarray(var_names, dtype=object)
    ranking = {name: var_names[_rank_by_abs(t)] for name, t in _welch_t(X, names, cell_types, block, skipped)}
    return ranking, skipped


def rank_genes_by_cell_type_scanpy(X: sp.spmatrix | np.ndarray, names: np.ndarray, cell_types: np.ndarray,
                                   var_names: np.ndarray) -> tuple[dict[str, np.ndarray], Counter]:
    """scanpy's path to `rank_genes_by_cell_type` (a `rank_genes_groups` per cell type): the reference for tests.

    Per cell type, every condition_name is ranked against f"{cell_type}_ctrl_1" with scanpy's
    `rank_genes_groups` (t-test, rankby_abs, all genes). Skipped (counted): groups of one cell
    ('single_cell_group') and every group of a cell type without 2 control cells
    ('no_control_in_cell_type').
    """
    import anndata
    import scanpy as sc

    names = np.asarray(names, dtype=object)
    cell_types = np.asarray(cell_types, dtype=object)
    num_genes = X.shape[1]
    positional = pd.Index([str(i) for i in range(num_genes)])
    ranking: dict[str, np.ndarray] = {}
    skipped: Counter = Counter()
    for cell_type in pd.unique(cell_types):
        rows = np.flatnonzero(cell_types == cell_type)
        reference = f"{cell_type}_{CTRL}_1"
        counts = pd.Series(names[rows]).value_counts()
        groups = [g for g, n in counts.items() if g != reference and n >= 2]
        skipped["single_cell_group"] += int(((counts < 2) & (counts.index != reference)).sum())
        if counts.get(reference, 0) < 2:
            skipped["no_control_in_cell_type"] += len(groups)
            continue
        if not groups:
            continue
        X_ct = X if len(rows) == X.shape[0] else X[rows]
        obs = pd.DataFrame({"group": pd.Categorical(names[rows])}, index=pd.Index([str(i) for i in range(len(rows))]))
        adata_ct = anndata.AnnData(X=X_ct, obs=obs, var=pd.DataFrame(index=positional))
        with warnings.catch_warnings():  # scanpy warns about log bases and fragmented frames; not actionable here
            warnings.simplefilter("ignore")
            sc.tl.rank_genes_groups(adata_ct, groupby="group", groups=sorted(groups) + [reference], reference=reference,
                                    method="t-test", rankby_abs=True, n_genes=num_genes, use_raw=False)
        ranked = adata_ct.uns["rank_genes_groups"]["names"]
        for group in ranked.dtype.names:
            ranking[group] = np.asarray(var_names)[np.asarray(ranked[group]).astype(np.int64)]
    return ranking, skipped


class _NameLookup:
    """Names -> positions through a {name: position} dict, for whole arrays at once (a hash index, not a loop)."""

    def __init__(self, position: Mapping[str, int]):
        self.index = pd.Index(list(position))
        self.values = np.fromiter(position.values(), dtype=np.int64, count=len(position))

    def __call__(self, names: Any) -> np.ndarray:
        """Positions of `names` (int64); KeyError naming the first name not in the dict."""
        found = self.index.get_indexer(np.asarray(names, dtype=object))
        if (found < 0).any():
            raise KeyError(np.asarray(names, dtype=object)[np.flatnonzero(found < 0)[0]])
        return self.values[found]


def dropout_fields(X: sp.spmatrix, conditions: np.ndarray, names: np.ndarray, ranking: Mapping[str, np.ndarray],
                   var_names: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
    """GEARS' `get_dropout_non_zero_genes`: the four per-condition_name uns fields from the DE ranking.

    Means are over all cells of the condition string (every cell type), as GEARS computes them.
    """
    conditions = np.asarray(conditions, dtype=object)
    uniq, codes = np.unique(conditions, return_inverse=True)
    means, _ = group_means(X, codes, len(uniq))
    code_of = {c: i for i, c in enumerate(uniq)}
    if CTRL not in code_of:
        raise DataError("no 'ctrl' cells: GEARS' non-dropout genes need the control mean")
    ctrl_zero = means[code_of[CTRL]] == 0
    name_to_condition = dict(zip(np.asarray(names, dtype=object), conditions))
    lookup = _NameLookup({n: i for i, n in enumerate(np.asarray(var_names).tolist())})
    out: dict[str, dict[str, np.ndarray]] = {k: {} for k in GEARS_UNS_FIELDS[1:]}
    for group, ranked_names in ranking.items():
        mean = means[code_of[name_to_condition[group]]]
        non_zero = mean != 0
        non_dropout = non_zero | ctrl_zero
        ranked = lookup(ranked_names)
        out["non_zeros_gene_idx"][group] = np.flatnonzero(non_zero)
        out["non_dropout_gene_idx"][group] = np.flatnonzero(non_dropout)
        out["top_non_dropout_de_20"][group] = np.asarray(var_names)[ranked[non_dropout[ranked]][:NUM_DE_GENES]]
        out["top_non_zero_de_20"][group] = np.asarray(var_names)[ranked[non_zero[ranked]][:NUM_DE_GENES]]
    return out


def add_gears_fields(adata: anndata.AnnData, recompute: bool = False, X: Any = None,
                     cache: str | Path | None = None) -> Counter:
    """GEARS' processing of `adata` in place: obs dose_val/control/condition_name and the uns DE fields.

    Fields already present are kept unless `recompute`. Returns the counts of groups that could not
    be ranked (see `rank_genes_by_cell_type`), also logged. `X` (default `adata.X`) is read in row blocks
    only, so it may be a backed matrix (`RowBlocks`).

    cache: an .npz file for the uns fields this call has to compute: read from it when it exists, else
    computed and written there (`save_de_fields`). The caller keys its name by the data's content; what is kept
    is what the reader uses (the first `NUM_RANKED_DE_GENES` of each ranking, as gene positions).
    """
    X = adata.X if X is None else X
    obs = adata.obs
    condition = obs["condition"].astype(str)
    # each value is computed once per distinct condition (and cell type) and spread by codes: a string made per
    # cell is a small object per cell, and those freed between the rank's lasting objects keep its heap grown
    text_codes, texts = pd.factorize(condition.to_numpy(dtype=object))
    if recompute or "dose_val" not in obs:
        obs["dose_val"] = np.asarray([dose_value(c) for c in texts], dtype=object)[text_codes]
    if recompute or "control" not in obs:
        obs["control"] = np.asarray([0 if len(c.split("+")) == 2 else 1 for c in texts], dtype=np.int64)[text_codes]
    if recompute or "condition_name" not in obs:
        type_codes, types = pd.factorize(obs["cell_type"].astype(str).to_numpy(dtype=object))
        pairs, pair_codes = np.unique(type_codes.astype(np.int64) * max(len(texts), 1) + text_codes, return_inverse=True)
        pair_names = [condition_name(types[k // max(len(texts), 1)], texts[k % max(len(texts), 1)]) for k in pairs.tolist()]
        obs["condition_name"] = np.asarray(pair_names, dtype=object)[pair_codes.ravel()]
    names = obs["condition_name"].astype(str).to_numpy()
    var_names = adata.var_names.to_numpy().astype(str)
    skipped: Counter = Counter()
    ranking_missing = recompute or "rank_genes_groups_cov_all" not in adata.uns
    needed = [k for k in GEARS_UNS_FIELDS if ranking_missing or k not in adata.uns]
    if needed and cache is not None:  # what is computed (the rest comes from the file) is part of the content
        cache = Path(cache)
        cache = cache.with_name(f"{cache.stem}_{hashlib.sha256(','.join(needed).encode()).hexdigest()[:8]}"
                                f"{cache.suffix}")
    if needed and cache is not None and cache.is_file():
        loaded = load_de_fields(cache)
        if loaded is not None:
            fields, skipped = loaded
            adata.uns.update({k: fields[k] for k in needed})
            if sum(skipped.values()):
                logger.warning("DE ranking (cached in %s): skipped %s", cache,
                               ", ".join(f"{k}={v}" for k, v in sorted(skipped.items()) if v))
            return skipped
    if ranking_missing:
        ranking, skipped = rank_genes_by_cell_type(X, names, obs["cell_type"].astype(str).to_numpy(), var_names)
        adata.uns["rank_genes_groups_cov_all"] = ranking
        if sum(skipped.values()):
            logger.warning("DE ranking: skipped %s (scanpy needs 2 cells per group and 2 control cells per cell type)",
                           ", ".join(f"{k}={v}" for k, v in sorted(skipped.items()) if v))
    if ranking_missing or any(k not in adata.uns for k in GEARS_UNS_FIELDS[1:]):
        adata.uns.update(dropout_fields(X, condition.to_numpy(), names,
                                        adata.uns["rank_genes_groups_cov_all"], var_names))
    if needed and cache is not None:
        save_de_fields(cache, adata.uns, var_names, skipped)
    return skipped


DE_CACHE_FORMAT = "gears-de-v1"
"""Part of the DE cache's file name: bump when the DE fields or their storage change."""


def save_de_fields(path: str | Path, uns: Mapping[str, Mapping[str, Any]], var_names: np.ndarray,
                   skipped: Mapping[str, int]) -> None:
    """Write GEARS' uns DE fields to `path` (.npz, atomic): per field the condition_names, and the gene positions
    (int32, concatenated with offsets; rankings cut to `NUM_RANKED_DE_GENES`, all the reader uses)."""
    from trainer.atomic_io import atomic_write_bytes

    lookup = _NameLookup({n: i for i, n in enumerate(np.asarray(var_names).tolist())})
    arrays: dict[str, np.ndarray] = {}
    for name in GEARS_UNS_FIELDS:
        table = uns[name]
        keys = list(table)
        parts = []
        for key in keys:
            values = np.asarray(table[key])
            if name == "rank_genes_groups_cov_all":
                values = values[:NUM_RANKED_DE_GENES]
            parts.append(values.astype(np.int64) if values.dtype.kind in "iu" else lookup(values))
        lengths = np.fromiter((len(v) for v in parts), dtype=np.int64, count=len(parts))
        arrays[f"{name}__keys"] = np.asarray(keys, dtype=str)
        arrays[f"{name}__offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        arrays[f"{name}__values"] = (np.concatenate(parts) if parts else np.zeros(0)).astype(np.int32)
        del parts
    arrays["skipped"] = np.asarray(json.dumps(dict(skipped), sort_keys=True))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(path), buffer.getvalue(), durable=False)


def load_de_fields(path: str | Path) -> tuple[dict[str, dict[str, np.ndarray]], Counter] | None:
    """The fields `save_de_fields` wrote ({field: {condition_name: int32 positions}}, views into one array per
    field) and the skipped-group counts; None (logged) for an unreadable file, which is then recomputed."""
    try:
        with np.load(path, allow_pickle=False) as z:
            fields = {}
            for name in GEARS_UNS_FIELDS:
                keys = z[f"{name}__keys"].tolist()
                offsets, values = z[f"{name}__offsets"], z[f"{name}__values"]
                fields[name] = {k: values[offsets[i]:offsets[i + 1]] for i, k in enumerate(keys)}
            skipped = Counter(json.loads(str(z["skipped"])))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:  # damaged: recomputed, not trusted
        logger.warning("%s: unreadable DE cache (%s), recomputing", path, e)
        return None
    return fields, skipped


# --------------------------------------------------------------------------------------------------
# reading


class RowBlocks:
    """Some rows (increasing) of a matrix that may stay on disk (an h5py-backed AnnData X), read in row blocks.

    `block[a:b]` reads the stretch of source rows from the a-th to the (b-1)-th selected row once and keeps the
    selected ones: what `group_sums` and the X conversion need, without holding the matrix.
    """

    def __init__(self, source: Any, rows: np.ndarray):
        self.source = source
        self.rows = np.asarray(rows, dtype=np.int64)
        self.shape = (len(self.rows), int(source.shape[1]))

    def __getitem__(self, key: slice) -> sp.csr_matrix:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("RowBlocks reads contiguous row slices only")
        wanted = self.rows[key]
        if not len(wanted):
            return sp.csr_matrix((0, self.shape[1]), dtype=np.float32)
        first, last = int(wanted[0]), int(wanted[-1]) + 1
        part = self.source[first:last]
        part = sp.csr_matrix(part) if not sp.issparse(part) else sp.csr_matrix(part.tocsr())
        if last - first != len(wanted):
            part = part[wanted - first]
        return part


X_BLOCK_ROWS = 8192
"""Rows per block when X is read from a file (DE, group sums, the conversion to CSR)."""
X_CACHE_FORMAT = 1


def _x_cache_key(path: Path, rows: np.ndarray) -> str:
    """The file's identity (resolved path, size, mtime, inode) and the kept rows: no read of X."""
    st = path.stat()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{X_CACHE_FORMAT}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}".encode())
    h.update(np.ascontiguousarray(rows, dtype=np.int64).view(np.uint8))
    return h.hexdigest()


def _check_finite(part: sp.csr_matrix, offset: int, rows: np.ndarray, obs_names: Any, where: str) -> None:
    bad = np.flatnonzero(~np.isfinite(part.data))
    if len(bad):
        local = int(np.searchsorted(part.indptr, bad[0], side="right") - 1)
        row = int(rows[offset + local])
        raise DataError(f"{where}: X has a non-finite value in cell {obs_names[row]!r} (row {row})")


def read_x_rows(source: Any, rows: np.ndarray, obs_names: Any, where: str, cache_dir: str | Path | None = None,
                key: str | None = None, block: int = X_BLOCK_ROWS) -> sp.csr_matrix:
    """The given rows of a (backed) X as one CSR float32 matrix, read `block` rows at a time.

    With `cache_dir` and `key`, the CSR buffers are written there once (`x_<key>/`, renamed into place
    whole, so concurrent processes agree) and memory-mapped: every process of a node then shares one copy in the
    page cache instead of holding X privately. A non-finite value is a DataError naming the cell.
    """
    blocks = RowBlocks(source, rows)
    n, num_genes = blocks.shape
    target = Path(cache_dir) / f"x_{key}" if cache_dir is not None and key else None
    if target is not None and (target / "done").is_file():
        return _mapped_csr(target, (n, num_genes))
    if target is None:
        parts = []
        for start in range(0, n, block):
            part = blocks[start:start + block]
            _check_finite(part, start, blocks.rows, obs_names, where)
            parts.append(sp.csr_matrix(part, dtype=np.float32))
        if not parts:
            return sp.csr_matrix((0, num_genes), dtype=np.float32)
        return sp.csr_matrix(sp.vstack(parts, format="csr"), dtype=np.float32)
    import os
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".x_{key}.", dir=target.parent))
    import shutil

    indptr = np.zeros(n + 1, dtype=np.int64)
    try:
        with open(tmp / "data.f32", "wb") as fd, open(tmp / "indices.i32", "wb") as fi:
            for start in range(0, n, block):
                part = blocks[start:start + block]
                _check_finite(part, start, blocks.rows, obs_names, where)
                np.asarray(part.data, dtype=np.float32).tofile(fd)
                np.asarray(part.indices, dtype=np.int32).tofile(fi)
                indptr[start + 1:start + part.shape[0] + 1] = (indptr[start]
                                                               + np.asarray(part.indptr[1:], dtype=np.int64))
        np.save(tmp / "indptr.npy", indptr)
        (tmp / "done").write_text(json.dumps({"shape": [n, num_genes], "nnz": int(indptr[-1])}))
    except BaseException:  # a bad value, a full disk, Ctrl-C: no partial copy of X is left in the cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, target)
    except OSError:  # another process published it first (the same content: use theirs), or the rename failed
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "done").is_file():
            raise
    return _mapped_csr(target, (n, num_genes))


def _mapped_csr(folder: Path, shape: tuple[int, int]) -> sp.csr_matrix:
    """The CSR of `read_x_rows`' folder: values and columns memory-mapped, row offsets (small) in memory, all of
    one index dtype as scipy wants (int32 up to 2^31 non-zeros; above, the columns are copied to int64)."""
    indptr = np.load(folder / "indptr.npy")
    nnz = int(indptr[-1])
    data = np.memmap(folder / "data.f32", dtype=np.float32, mode="r", shape=(nnz,)) if nnz else np.zeros(0, np.float32)
    indices = np.memmap(folder / "indices.i32", dtype=np.int32, mode="r", shape=(nnz,)) if nnz else np.zeros(0, np.int32)
    if nnz < 2**31:
        indptr = indptr.astype(np.int32)
    else:
        indices = np.asarray(indices, dtype=np.int64)
    X = sp.csr_matrix(shape, dtype=np.float32)
    X.data, X.indices, X.indptr = data, indices, indptr  # set, not passed: the constructor would copy a memmap
    return X


def _load(source: str | Path | anndata.AnnData, backed: bool = False) -> tuple[anndata.AnnData, str]:
    import anndata

    if isinstance(source, anndata.AnnData):
        # a private shell: obs/var/uns are edited below, X is shared (not copied)
        shell = anndata.AnnData(X=source.X, obs=source.obs.copy(), var=source.var.copy(), uns=dict(source.uns))
        return shell, "AnnData"
    path = Path(source)
    if path.is_dir():
        path = path / DATA_FILE
    if not path.is_file():
        raise DataError(f"{path}: perturbation data not found (a GEARS folder with {DATA_FILE} or an .h5ad file)")
    try:
        return anndata.read_h5ad(path, backed="r" if backed else None), str(path)
    except (OSError, KeyError, ValueError) as e:
        raise DataError(f"{path}: not a readable .h5ad file ({type(e).__name__}: {e})") from e


def _as_gene2go(gene2go: str | Path | Mapping | None) -> GeneToGo | None:
    if gene2go is None:
        return None
    if isinstance(gene2go, Mapping):
        return gene2go_from_mapping(gene2go)
    return read_gene2go(gene2go)


def _check_columns(adata: anndata.AnnData, where: str) -> None:
    for frame, column, hint in ((adata.obs, "condition", "'ctrl', 'A+ctrl' or 'A+B' per cell"),
                                (adata.obs, "cell_type", "one label per cell, e.g. 'K562'"),
                                (adata.var, "gene_name", "the gene symbol of each column")):
        if column not in frame.columns:
            kind = "obs" if frame is adata.obs else "var"
            raise DataError(f"{where}: {kind}['{column}'] is missing ({hint}; GEARS needs it)")
    if adata.obs["cell_type"].isna().any():
        first = adata.obs_names[np.flatnonzero(adata.obs["cell_type"].isna().to_numpy())[0]]
        raise DataError(f"{where}: obs['cell_type'] is missing for cell {first!r}")


def _condition_problem(text: str, count: int, gene_set: set[str], go: GeneToGo | None,
                       require_genes_in_var: bool) -> tuple[str, str] | None:
    """(reason, detail) why a condition string cannot be used, or None."""
    if count == 0:
        return "no_cells", "no cell has it"
    try:
        cond = parse_condition(text)
    except DataError as e:
        return "malformed_condition", str(e)
    if require_genes_in_var:
        missing = [g for g in cond if g not in gene_set]
        if missing:
            return "gene_not_in_var", f"gene {missing[0]!r} is not in var['gene_name']"
    if go is not None:
        missing = [g for g in cond if g not in go]
        if missing:
            return "gene_not_in_go", f"gene {missing[0]!r} has no GO terms in the gene2go mapping"
    return None


class _Drops:
    def __init__(self, where: str, on_invalid: str):
        self.where, self.on_invalid = where, on_invalid
        self.conditions: Counter = Counter()
        self.cells: Counter = Counter()
        self.examples: dict[str, list[str]] = {}

    def add(self, name: str, reason: str, detail: str, cells: int, count: int = 1) -> None:
        if self.on_invalid == "error":
            raise DataError(f"{self.where}: condition {name!r}: {reason}: {detail}")
        self.conditions[reason] += count
        self.cells[reason] += cells
        self.examples.setdefault(reason, [])
        if len(self.examples[reason]) < 5:
            self.examples[reason].append(name)

    def log(self, total: int) -> None:
        if not self.conditions:
            return
        parts = [f"{r}={self.conditions[r]} ({self.cells[r]} cells; e.g. {', '.join(map(repr, self.examples[r]))})"
                 for r in DROP_REASONS if self.conditions[r]]
        logger.warning("%s: dropped %d of %d conditions, %d cells: %s", self.where,
                       sum(v for r, v in self.conditions.items() if r != "missing_condition"), total,
                       sum(self.cells.values()), "; ".join(parts))


def _index_conditions(adata: anndata.AnnData):
    """(distinct condition strings, their canonical forms, per-cell code, first cell of each canonical
    condition, per-cell condition_name)."""
    text = adata.obs["condition"].astype(str).to_numpy()
    names = adata.obs["condition_name"].astype(str).to_numpy()
    uniq_text, first_cell, text_codes = np.unique(text, return_index=True, return_inverse=True)
    canon_of_text = [parse_condition(t) for t in uniq_text]
    first_of: dict[Condition, int] = {}
    for k, cond in enumerate(canon_of_text):
        first_of[cond] = min(first_of.get(cond, len(text)), int(first_cell[k]))
    return uniq_text.tolist(), canon_of_text, text_codes.ravel(), first_of, names


def read_perturbation_data(source: str | Path | anndata.AnnData, gene2go: str | Path | Mapping | None = None, *,
                           on_invalid: str = "drop", require_genes_in_var: bool = True, pert_gene_set: str = "var",
                           recompute_de: bool = False, x_cache_dir: str | Path | None = None) -> PerturbationData:
    """Read a GEARS `perturb_processed.h5ad` (a file, its folder or an AnnData) into `PerturbationData`.

    A file is opened backed: obs/var/uns are read, X only in row blocks (`X_BLOCK_ROWS`) for the DE fields and
    then once more for the kept cells' CSR, so X is never held twice nor densified. With `x_cache_dir`, that CSR
    is written there once per (file identity, kept cells) and memory-mapped (`read_x_rows`): the processes
    of a node share it.

    gene2go: a gene -> GO terms mapping (path or dict); conditions with a gene outside it are dropped.
    on_invalid: "drop" (count and log unusable conditions) or "error" (DataError naming the first).
    require_genes_in_var: a perturbed gene must be a column of X (GEARS itself only needs it in the GO graph).
    pert_gene_set: the perturbable genes (GO graph nodes): "var" = every var gene and every perturbed
        gene (with GO terms, given a mapping; GEARS' `default_pert_graph=False`), "conditions" = the
        perturbed genes only.
    recompute_de: recompute GEARS' obs/uns fields even if the file has them.
    x_cache_dir: where a file's X is kept as memory-mapped CSR (None: X in this process's memory).
    """
    if on_invalid not in ("drop", "error"):
        raise ConfigError(f"on_invalid must be 'drop' or 'error', got {on_invalid!r}")
    if pert_gene_set not in ("var", "conditions"):
        raise ConfigError(f"pert_gene_set must be 'var' or 'conditions', got {pert_gene_set!r}")
    import anndata

    backed = not isinstance(source, anndata.AnnData)
    adata, where = _load(source, backed=backed)
    try:
        return _read(adata, where, backed, gene2go, on_invalid, require_genes_in_var, pert_gene_set, recompute_de,
                     x_cache_dir)
    finally:
        if backed:
            adata.file.close()


def _read(adata: anndata.AnnData, where: str, backed: bool, gene2go: str | Path | Mapping | None, on_invalid: str,
          require_genes_in_var: bool, pert_gene_set: str, recompute_de: bool, x_cache_dir: str | Path | None
          ) -> PerturbationData:
    import anndata

    _check_columns(adata, where)
    go = _as_gene2go(gene2go)
    gene_names = adata.var["gene_name"].astype(str).to_numpy()
    duplicated = pd.Index(gene_names)[pd.Index(gene_names).duplicated()].unique()
    if len(duplicated):
        logger.warning("%s: %d duplicated var['gene_name'] (e.g. %s): a perturbed gene maps to its first column",
                       where, len(duplicated), ", ".join(map(repr, duplicated[:5])))
    gene_set = set(gene_names.tolist())
    drops = _Drops(where, on_invalid)

    # conditions: one check per distinct string, then one boolean mask over cells
    raw = adata.obs["condition"]
    categorical = raw if isinstance(raw.dtype, pd.CategoricalDtype) else raw.astype("category")
    codes = categorical.cat.codes.to_numpy()
    categories = [str(c) for c in categorical.cat.categories]
    counts = np.bincount(codes[codes >= 0], minlength=len(categories))
    if (codes < 0).any():
        first = adata.obs_names[np.flatnonzero(codes < 0)[0]]
        drops.add(f"<missing> (cell {first!r})", "missing_condition", "obs['condition'] is empty", int((codes < 0).sum()),
                  count=int((codes < 0).sum()))
    usable = np.zeros(len(categories), dtype=bool)
    for k, text in enumerate(categories):
        problem = _condition_problem(text, int(counts[k]), gene_set, go, require_genes_in_var)
        if problem is None:
            usable[k] = True
        else:
            drops.add(text, problem[0], problem[1], int(counts[k]))
    if not any(usable[k] and categories[k] == CTRL for k in range(len(categories))):
        raise DataError(f"{where}: no 'ctrl' cells: GEARS pairs every perturbed cell with a control cell")
    keep = np.zeros(len(codes), dtype=bool)
    keep[codes >= 0] = usable[codes[codes >= 0]]
    kept = np.flatnonzero(keep)
    if backed:  # X stays in the file: an in-memory AnnData of obs/var/uns, X read through `RowBlocks`
        file_x, file_obs_names = adata.X, adata.obs_names
        adata = anndata.AnnData(obs=adata.obs.iloc[kept].copy(), var=adata.var.copy(), uns=dict(adata.uns))
        # computed once per (file identity, kept cells) and read back at the next start (every rank, every run)
        de_cache = (Path(x_cache_dir) / f"de_{DE_CACHE_FORMAT}_{_x_cache_key(Path(where), kept)}.npz"
                    if x_cache_dir is not None else None)
        add_gears_fields(adata, recompute=recompute_de, X=RowBlocks(file_x, kept), cache=de_cache)
    else:
        if not keep.all():
            adata = adata[keep].copy()
        add_gears_fields(adata, recompute=recompute_de)

    # canonical conditions; the DE fields of each condition are those of its first cell's condition_name
    uniq_text, canon_of_text, text_codes, first_of, names = _index_conditions(adata)
    ranking = adata.uns["rank_genes_groups_cov_all"]
    unranked = [k for k, cond in enumerate(canon_of_text) if cond and names[first_of[cond]] not in ranking]
    for k in unranked:
        key = names[first_of[canon_of_text[k]]]
        drops.add(uniq_text[k], "no_de_ranking", f"no DE ranking for {key!r} (fewer than 2 cells, or fewer than 2 "
                  "control cells in its cell type)", int((text_codes == k).sum()))
    if unranked:
        ranked_cells = ~np.isin(text_codes, unranked)
        kept = kept[ranked_cells]
        adata = adata[ranked_cells].copy()
        uniq_text, canon_of_text, text_codes, first_of, names = _index_conditions(adata)
    drops.log(len(categories))
    if len(first_of) < len(uniq_text):
        logger.info("%s: %d condition strings are written two ways ('A+ctrl'/'ctrl+A', 'A+B'/'B+A'): merged",
                    where, len(uniq_text) - len(first_of))

    conditions = sorted(first_of, key=lambda c: (len(c), c))
    index = {c: i for i, c in enumerate(conditions)}
    code_to_condition = np.array([index.get(c, -1) for c in canon_of_text], dtype=np.int32)
    cell_condition = code_to_condition[text_codes]

    var_names = adata.var_names.to_numpy().astype(str)
    position = {n: i for i, n in enumerate(var_names.tolist())}
    for i, g in enumerate(gene_names.tolist()):
        position.setdefault(g, i)

    lookup = _NameLookup(position)

    def positions(field_name: str, key: str, values: Any) -> np.ndarray:
        values = np.asarray(values)
        if values.dtype.kind in "iu":
            return np.asarray(values, dtype=np.int64)  # no copy when the field is int64 already
        if values.dtype.kind in "UO" and len(values):
            try:
                return lookup(values)
            except KeyError:  # a name not in var, or ints among names: the loop below says which
                pass
        out = []
        for v in np.asarray(values).tolist():
            if isinstance(v, (int, np.integer)):
                out.append(int(v))
            elif v in position:
                out.append(position[v])
            else:
                raise DataError(f"{where}: uns['{field_name}'][{key!r}]: gene {v!r} is not in var")
        return np.asarray(out, dtype=np.int64)

    lists: dict[str, list[tuple[Condition, np.ndarray]]] = {k: [] for k in (*GEARS_UNS_FIELDS[1:], "ranked")}
    gene_sets: dict[str, list[tuple[Condition, np.ndarray]]] = {k: [] for k in GENE_SET_FIELDS}
    num_genes = len(gene_names)
    keyed = conditions[1:] if conditions[0] == () else conditions
    shared_index = {c: i for i, c in enumerate(keyed)}  # one {condition: row} for every per-condition field
    for cond in keyed:
        key = names[first_of[cond]]
        for field_name in GEARS_UNS_FIELDS:
            table = adata.uns[field_name]
            if key not in table:
                raise DataError(f"{where}: uns['{field_name}'] has no entry {key!r} (condition "
                                f"{format_condition(cond)!r}); pass recompute_de=True to recompute GEARS' fields")
            values = np.asarray(table[key])
            if field_name == "rank_genes_groups_cov_all":  # de_idx is the head of this list (ConditionArrays.head)
                lists["ranked"].append((cond, positions(field_name, key, values[:NUM_RANKED_DE_GENES])))
            elif field_name in gene_sets:  # most genes of every condition: packed as bits, a row at a time
                gene_sets[field_name].append((cond, _packed_row(positions(field_name, key, values), num_genes)))
            else:
                lists[field_name].append((cond, positions(field_name, key, values)))
    per_condition: dict[str, Mapping[Condition, np.ndarray]] = {
        k: ConditionArrays.from_items(v, index=shared_index) for k, v in lists.items()}
    del lists
    per_condition["rank_genes_groups_cov_all"] = per_condition["ranked"].head(NUM_DE_GENES)  # type: ignore[attr-defined]
    for field_name, rows in gene_sets.items():
        per_condition[field_name] = ConditionGeneSets.from_packed_rows(rows, num_genes, index=shared_index)
    del gene_sets
    non_zeros = per_condition["non_zeros_gene_idx"]
    per_condition["non_dropout_gene_idx"] = non_zeros.with_extra(per_condition["non_dropout_gene_idx"])  # type: ignore

    if backed:
        X = read_x_rows(file_x, kept, file_obs_names, where, x_cache_dir,
                        _x_cache_key(Path(where), kept) if x_cache_dir is not None else None)
    else:
        X = adata.X
        if not sp.issparse(X):
            X = sp.csr_matrix(np.asarray(X, dtype=np.float32))
        elif X.format == "csr" and X.dtype == np.float32:
            X = sp.csr_matrix(X)  # a csr_array becomes a csr_matrix sharing its buffers (no copy)
        else:
            X = sp.csr_matrix(X, dtype=np.float32)
        if not np.isfinite(X.data).all():
            bad = int(np.searchsorted(X.indptr, np.flatnonzero(~np.isfinite(X.data))[0], side="right") - 1)
            raise DataError(f"{where}: X has a non-finite value in cell {adata.obs_names[bad]!r} (row {bad})")

    ctrl_rows = np.flatnonzero(cell_condition == index[()]).astype(np.int64)
    ctrl_mean = mean_of_rows(X, ctrl_rows).astype(np.float32)
    perturbed = condition_genes(conditions)
    universe = set(perturbed) | (gene_set if pert_gene_set == "var" else set())
    pert_genes = sorted(g for g in universe if go is None or g in go)
    return PerturbationData(
        X=X, gene_names=gene_names, var_names=var_names, conditions=conditions, cell_condition=cell_condition,
        cell_type=coded_strings(adata.obs["cell_type"]),
        condition_names=[names[first_of[c]] for c in conditions], pert_genes=pert_genes,
        de_idx=per_condition["rank_genes_groups_cov_all"], top_non_dropout_de_20=per_condition["top_non_dropout_de_20"],
        top_non_zero_de_20=per_condition["top_non_zero_de_20"], non_zeros_gene_idx=per_condition["non_zeros_gene_idx"],
        non_dropout_gene_idx=per_condition["non_dropout_gene_idx"], ctrl_rows=ctrl_rows, ctrl_mean=ctrl_mean,
        dropped={r: int(drops.conditions[r]) for r in DROP_REASONS if drops.conditions[r]},
        dropped_cells={r: int(drops.cells[r]) for r in DROP_REASONS if drops.cells[r]},
        dropped_examples={r: list(v) for r, v in drops.examples.items()}, source=where,
        ranked_de_idx=per_condition["ranked"])

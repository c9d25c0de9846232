"""`perturbation_gears`: GEARS (Roohani, Huang and Leskovec 2023) on GEARS-format Perturb-seq data.

Data: a GEARS `perturb_processed.h5ad` (or raw AnnData; `anndata_reader.py`) and a gene -> GO terms
mapping; conditions split by one of GEARS' modes (`splits.py`); the GO and co-expression graphs built
once per (data, split, seed, thresholds) and cached (`gene_graphs.py`). Training items are lazy
(control, perturbed) cell pairs drawn per (seed, epoch, cell) (`PerturbationPairs`, an
`EpochAwareDataset`); validation and test items are whole conditions (`ConditionMeans`: one item per
condition), so the core's `gather_for_metrics` sees every condition exactly once at any world size and
batch size and each metric is computed on cell-mean profiles, per condition, then averaged (`metrics.py`).

Statistics (`TaskData.stats`, saved as `task_stats.json` and inside every export) hold what the model,
eval, report and `predict` need without the data: gene names, perturbable genes, the condition list,
the control mean, each condition's DE genes, the split with its subgroups, and both graphs' edges. The graphs
go through the statistics because `build_model(stats)` must rebuild the model from an export alone; their
size is ~21 edges a gene (Norman: ~5k genes -> about 2 x 100k edges), small next to the model's per-gene
weights. Edges and DE genes are stored as arrays (`encode_array`: the smallest integer type holding the genes /
float32 bytes in base64, still JSON), not lists of Python numbers: every rank holds the statistics for the whole
run, and a list costs an int object and a pointer per element. Each per-condition DE field is one matrix, a row per
condition (`encode_condition_rows`). Readers go through `decode_array` / `per_condition_stats`, which also
read the lists that older exports hold. The split is also written as the artifact `split.json`.

The test report (`write_report`) scores the four baselines (`baselines.py`, fit on the training
conditions) on the same test conditions and writes them next to the model per subgroup.
"""

from __future__ import annotations

import base64
import csv
import io
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from trainer.atomic_io import atomic_write_json, atomic_write_text
from trainer.errors import ConfigError, DataError
from trainer.families.perturbation_gears.anndata_reader import (
    DATA_FILE,
    ConditionGeneSets,
    PerturbationData,
    bundled_perturbation_path,
    group_means,
    index_dtype,
    read_perturbation_data,
)
from trainer.families.perturbation_gears.baselines import BASELINE_NAMES, fit_baselines
from trainer.families.perturbation_gears.conditions import Condition, as_condition
from trainer.families.perturbation_gears.dataset import (
    ConditionMeans,
    PerturbationPairs,
    collate_conditions,
    collate_pairs,
)
from trainer.families.perturbation_gears.gene_graphs import GeneGraphs, cached_graphs
from trainer.families.perturbation_gears.gene_ontology import read_gene2go
from trainer.families.perturbation_gears.loss import gears_loss
from trainer.families.perturbation_gears.metrics import (
    aggregate_metrics,
    baselines_that_beat,
    condition_metrics,
    top_expressed_genes,
)
from trainer.families.perturbation_gears.model import GEARSModel
from trainer.families.perturbation_gears.spec import CONDITION_METRICS, SPEC, PerturbationGearsConfig
from trainer.families.perturbation_gears.splits import SplitResult, split_conditions
from trainer.registry import register_task
from trainer.task import LossOutput, Task, TaskData

if TYPE_CHECKING:
    from trainer.sample_random import SampleRandom

logger = logging.getLogger(__name__)

GENE2GO_NAMES = ("gene2go.tsv", "gene2go.tsv.gz", "gene2go.gaf", "gene2go.gaf.gz", "gene2go_all.pkl", "gene2go.pkl")
"""File names `gene2go_path=""` looks for in the data folder, then in its parent (GEARS keeps gene2go_all.pkl there)."""
CACHE_ENV = "TRAINER_CACHE_DIR"
REPORT_CONDITIONS = 4
"""Test conditions drawn in the report's plot of predicted vs true change."""
class TrainingPairs(Dataset):
    """`PerturbationPairs` plus each cell's loss mask (its condition's non-zero genes; all genes for control).

    The masks are a bit per (condition, gene), unpacked per item. Without `nonzero_masks` they are the bits the
    data already holds (`PerturbationData.non_zeros_gene_idx` as `ConditionGeneSets`), shared, not copied;
    a dense [conditions, G] bool `nonzero_masks` is packed here."""

    def __init__(self, pairs: PerturbationPairs, nonzero_masks: np.ndarray | None = None):
        self.pairs = pairs
        data = pairs.data
        if nonzero_masks is None:
            self.num_genes = data.num_genes
            self.packed_masks, self.mask_row = packed_nonzero_masks(data)
        else:
            self.num_genes = int(nonzero_masks.shape[1])
            self.packed_masks = np.packbits(np.asarray(nonzero_masks, dtype=bool), axis=1)
            self.mask_row = np.arange(len(self.packed_masks), dtype=np.int32)

    def __len__(self) -> int:
        return len(self.pairs)

    def get_item(self, index: int, epoch: int) -> dict[str, Any]:
        item = self.pairs.get_item(index, epoch)
        row = int(self.mask_row[item["condition"]])
        if row < 0:  # the control (or a condition without a non-zero set): every gene
            mask = np.ones(self.num_genes, dtype=bool)
        else:
            mask = np.unpackbits(self.packed_masks[row], count=self.num_genes).view(bool)
        item["nonzero_mask"] = torch.from_numpy(mask)
        return item

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.get_item(index, 0)


def packed_nonzero_masks(data: PerturbationData) -> tuple[np.ndarray, np.ndarray]:
    """(bits [R, ceil(G / 8)] uint8, [conditions] int32 row of each condition's loss mask, -1 for every gene): the
    masks of `nonzero_masks`, packed. Bits the data holds already (`ConditionGeneSets`) are returned as they are."""
    gene_sets = data.non_zeros_gene_idx
    row_of = np.full(len(data.conditions), -1, dtype=np.int32)
    if isinstance(gene_sets, ConditionGeneSets) and gene_sets.extra is None:
        for code, cond in enumerate(data.conditions):
            if cond and cond in gene_sets:
                row_of[code] = gene_sets.row(cond)
        return gene_sets.bits, row_of
    rows = []
    for code, cond in enumerate(data.conditions):
        if cond and cond in gene_sets:
            row_of[code] = len(rows)
            if isinstance(gene_sets, ConditionGeneSets):
                rows.append(gene_sets.packed(cond))
            else:
                mask = np.zeros(data.num_genes, dtype=bool)
                mask[gene_sets[cond]] = True
                rows.append(np.packbits(mask))
    bits = np.stack(rows) if rows else np.zeros((0, (data.num_genes + 7) // 8), dtype=np.uint8)
    return bits, row_of


def nonzero_masks(data: PerturbationData) -> np.ndarray:
    """[conditions, G] bool: the genes GEARS' loss keeps per condition (non-zero mean; every gene for control)."""
    masks = np.ones((len(data.conditions), data.num_genes), dtype=bool)
    for code, cond in enumerate(data.conditions):
        if cond and cond in data.non_zeros_gene_idx:
            gene_sets = data.non_zeros_gene_idx
            if isinstance(gene_sets, ConditionGeneSets):
                masks[code] = gene_sets.mask(cond)
            else:
                masks[code] = False
                masks[code, gene_sets[cond]] = True
    return masks


def default_cache_dir() -> Path:
    """$TRAINER_CACHE_DIR/perturbation_gears, else ~/.cache/trainer/perturbation_gears."""
    root = os.environ.get(CACHE_ENV) or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainer")
    return Path(root) / "perturbation_gears"


def find_gene2go(data_path: str | Path) -> Path:
    """The gene2go file of a GEARS data folder (or of an .h5ad's folder), else of its parent folder."""
    path = Path(data_path)
    folder = path if path.is_dir() else path.parent
    tried = []
    for place in (folder, folder.parent):
        for name in GENE2GO_NAMES:
            candidate = place / name
            tried.append(str(candidate))
            if candidate.is_file():
                return candidate
    raise DataError(f"{data_path}: no gene -> GO mapping found (tried {', '.join(tried[:3])}, ... in {folder} and "
                    f"{folder.parent}); set task.gene2go_path to GEARS' gene2go_all.pkl, a gene<TAB>GO TSV or a GAF file")


READ_APART_BYTES = 64 * 2**20
"""Data files larger than this are read in a short-lived child process (`read_process.read_apart`)."""


def load_perturbation_data(cfg: PerturbationGearsConfig) -> tuple[PerturbationData, Mapping[str, frozenset[str]]]:
    """Read the configured data and GO mapping (the bundled set when data_path is empty).

    The file's X is read in row blocks and kept as memory-mapped CSR under the cache folder (the graphs'), which
    the processes of a node share instead of each holding its own copy. A file above `READ_APART_BYTES` is read in
    a child process that hands back only the result (the mapping packed over the perturbable genes): the read's
    short-lived objects would otherwise stay as grown heap in every rank for the whole run."""
    data_path = Path(cfg.data_path) if cfg.data_path else bundled_perturbation_path()
    gene2go_path = Path(cfg.gene2go_path) if cfg.gene2go_path else find_gene2go(data_path)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    options = {"on_invalid": "error" if cfg.on_invalid == "error" else "drop", "pert_gene_set": cfg.pert_gene_set,
               "recompute_de": cfg.recompute_de}
    data_file = data_path / DATA_FILE if data_path.is_dir() else data_path
    if data_file.is_file() and data_file.stat().st_size > READ_APART_BYTES:
        from trainer.families.perturbation_gears.read_process import read_apart

        return read_apart(data_path, gene2go_path, x_cache_dir=cache / "expression", **options)
    gene2go = read_gene2go(gene2go_path)
    data = read_perturbation_data(data_path, gene2go, x_cache_dir=cache / "expression", **options)
    return data, gene2go


ARRAY_KEY = "base64"
"""Key of an array in the statistics (`encode_array`): dtype, shape and the little-endian bytes in base64."""


def encode_array(values: np.ndarray | Sequence[Any], dtype: str) -> dict[str, Any]:
    """A JSON-able array (dtype, shape, base64 bytes): the statistics are JSON, and a Python list holds a 28-byte int
    object and an 8-byte pointer per element where the array needs 4 bytes (`decode_array` reads it back)."""
    arr = np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<"))
    return {"dtype": np.dtype(dtype).name, "shape": list(arr.shape), ARRAY_KEY: base64.b64encode(arr.tobytes()).decode("ascii")}


def decode_array(value: Any, dtype: str | np.dtype | None = None) -> np.ndarray:
    """The array of a statistics field: an `encode_array` dict, or a list (statistics written before they were
    encoded, e.g. an older export's task_stats.json); cast to `dtype` when given."""
    if isinstance(value, Mapping) and ARRAY_KEY in value:
        try:
            raw = base64.b64decode(value[ARRAY_KEY], validate=True)
            arr = np.frombuffer(raw, dtype=np.dtype(value["dtype"]).newbyteorder("<")).reshape(value["shape"])
        except (ValueError, TypeError, KeyError) as err:
            raise DataError(f"statistics: malformed encoded array (dtype {value.get('dtype')!r}, shape "
                            f"{value.get('shape')!r}): {err}") from err
    else:
        arr = np.asarray(value)
    return arr if dtype is None else arr.astype(dtype, copy=False)


def _index_dtype_name(values: np.ndarray) -> str:
    """The smallest signed integer type holding `values` (and -1), by name."""
    return index_dtype(max(int(np.max(values, initial=0)), 0)).name


def graphs_to_stats(graphs: GeneGraphs) -> dict[str, Any]:
    """The graphs' edges as encoded arrays (gene indices in the smallest integer type holding them, float32
    weights; `decode_array`)."""
    return {"key": graphs.key,
            "go_edge_index": encode_array(graphs.go_edge_index, _index_dtype_name(graphs.go_edge_index)),
            "go_edge_weight": encode_array(graphs.go_edge_weight, "float32"),
            "coexpression_edge_index": encode_array(graphs.coexpression_edge_index,
                                                    _index_dtype_name(graphs.coexpression_edge_index)),
            "coexpression_edge_weight": encode_array(graphs.coexpression_edge_weight, "float32")}


def _edges(stats_graphs: Mapping[str, Any], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.from_numpy(decode_array(stats_graphs[f"{name}_edge_index"], np.int64).reshape(2, -1).copy())
    return index, torch.from_numpy(decode_array(stats_graphs[f"{name}_edge_weight"], np.float32).copy())


CONDITION_ROWS = "conditions"
EMPTY_ROW = -2
"""First value of a one-matrix row that holds an entry with no genes (-1 pads, and a row of -1 is no entry)."""
"""`rows` of a per-condition statistics field stored as one matrix (`encode_condition_rows`)."""


def encode_condition_rows(conditions: Sequence[Condition], table: Mapping[Condition, np.ndarray]) -> dict[str, Any]:
    """A per-condition field of gene lists as ONE encoded [len(conditions), width] matrix, a row per position in
    `conditions` (the statistics' condition list), padded with -1; a row of -1 only: no entry (the control); a row
    starting with -2: an entry with no genes (read back as an empty list, which the metrics refuse, as before).

    A dict of one small encoded array per condition costs a dict, a shape list and a string per condition in every
    rank; one matrix is one string. `per_condition_stats` decodes a single row from it (no copy of the matrix)."""
    width = max((len(v) for v in table.values()), default=0)
    if width == 0 and any(cond in table for cond in conditions):
        width = 1  # room for the marker of an empty list
    largest = max((int(np.max(v)) for v in table.values() if len(v)), default=0)
    dtype = index_dtype(largest)
    matrix = np.full((len(conditions), width), -1, dtype=dtype)
    for row, cond in enumerate(conditions):
        if cond in table:
            genes = table[cond]
            matrix[row, :len(genes)] = genes
            if len(genes) == 0:
                matrix[row, 0] = EMPTY_ROW
    return {**encode_array(matrix, dtype.name), "rows": CONDITION_ROWS}


def _decode_row(value: Mapping[str, Any], row: int) -> np.ndarray:
    """Row `row` of an `encode_condition_rows` matrix, decoded from its slice of the base64 text."""
    try:
        dtype = np.dtype(value["dtype"]).newbyteorder("<")
        num_rows, width = (int(n) for n in value["shape"])
        if not 0 <= row < num_rows:
            raise ValueError(f"row {row} of {num_rows}")
        start, stop = row * width * dtype.itemsize, (row + 1) * width * dtype.itemsize
        text = value[ARRAY_KEY][start // 3 * 4:-(-stop // 3) * 4]  # whole 4-character groups of 3 bytes
        raw = base64.b64decode(text, validate=True)[start % 3:start % 3 + stop - start]
        out = np.frombuffer(raw, dtype=dtype)
        if out.size != width:
            raise ValueError(f"{out.size} values for a row of {width}")
    except (ValueError, TypeError, KeyError) as err:
        raise DataError(f"statistics: malformed per-condition matrix (dtype {value.get('dtype')!r}, shape "
                        f"{value.get('shape')!r}): {err}") from err
    return out


def per_condition_stats(stats: Mapping[str, Any], field: str, condition: str, code: int | None = None
                        ) -> np.ndarray | None:
    """A condition's genes of a per-condition statistics field (`de_idx`, `ranked_de_idx`) as int64, or None.

    `code`: the condition's position in stats["conditions"] when the caller has it (else looked up). Reads the
    one-matrix form (`encode_condition_rows`) and the per-condition dicts older statistics hold (each an encoded
    array or a list)."""
    value = stats[field]
    if isinstance(value, Mapping) and ARRAY_KEY in value:
        if code is None:
            try:
                code = stats["conditions"].index(condition)
            except ValueError:
                return None
        genes = _decode_row(value, code)
        if genes.size and genes[0] == EMPTY_ROW:
            return np.zeros(0, np.int64)
        genes = genes[genes >= 0]
        return genes.astype(np.int64) if genes.size else None
    value = value.get(condition)
    return None if value is None else decode_array(value, np.int64)


def build_gears_model(cfg: PerturbationGearsConfig, stats: Mapping[str, Any]) -> GEARSModel:
    """The GEARS network for the statistics of a data set (genes, perturbable genes, graphs)."""
    graphs = stats["graphs"]
    return GEARSModel(num_genes=len(stats["gene_names"]), num_perts=len(stats["pert_genes"]),
                      coexpress_graph=_edges(graphs, "coexpression"), go_graph=_edges(graphs, "go"),
                      hidden_size=cfg.hidden_size, num_go_gnn_layers=cfg.num_go_gnn_layers,
                      num_gene_gnn_layers=cfg.num_gene_gnn_layers, uncertainty=cfg.uncertainty,
                      coexpress_first_cell_only=cfg.coexpress_first_cell_only)


ACTIVATION_BUDGET = 8 * 2**20
"""Elements of one [cells x genes x hidden] activation that `eval_cells_per_forward=0` aims at (32 MB in fp32)."""


def cells_per_forward(cfg: PerturbationGearsConfig, num_genes: int) -> int:
    """Cells per eval forward: `eval_cells_per_forward`, or (0) as many as ACTIVATION_BUDGET allows (1 to 512)."""
    if cfg.eval_cells_per_forward:
        return cfg.eval_cells_per_forward
    return int(min(512, max(1, ACTIVATION_BUDGET // (max(num_genes, 1) * cfg.hidden_size))))


def predict_cells(model: nn.Module, x: torch.Tensor, pert_idx: torch.Tensor, chunk: int
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Predictions [N, G] (and log-variances, or None) for N cells, `chunk` cells per forward pass.

    The chunks are written into one preallocated output: a list of small chunk results kept alive between
    each forward's large activations fragments the host heap (hundreds of MB per batch at 5,000 genes)."""
    pred = logvar = None
    for start in range(0, x.size(0), chunk):
        out = model(x[start:start + chunk], pert_idx[start:start + chunk])
        part, part_logvar = out if isinstance(out, tuple) else (out, None)
        if pred is None:
            pred = part.new_empty((x.size(0), part.size(1)))
            logvar = part.new_empty((x.size(0), part.size(1))) if part_logvar is not None else None
        pred[start:start + part.size(0)] = part
        if logvar is not None:
            logvar[start:start + part.size(0)] = part_logvar
        del out, part, part_logvar
    if pred is None:  # no cells
        return x.new_empty((0, x.size(1))), None
    return pred, logvar


def plot_de_changes(ax: Any, gene_names: Sequence[str], true_delta: np.ndarray, pred_delta: np.ndarray, title: str,
                    extra: Mapping[str, np.ndarray] | None = None, cell_deltas: np.ndarray | None = None) -> None:
    """Predicted vs true change from control of some genes (one x position a gene) on a matplotlib axis."""
    positions = np.arange(len(gene_names))
    if cell_deltas is not None and len(cell_deltas):
        lo, hi = np.percentile(cell_deltas, [25, 75], axis=0)
        ax.vlines(positions, lo, hi, color="lightgrey", lw=6, label="true cells (IQR)")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.scatter(positions, true_delta, color="black", marker="o", s=22, label="true mean", zorder=3)
    ax.scatter(positions, pred_delta, color="tab:red", marker="x", s=30, label="GEARS", zorder=4)
    for (name, values), marker in zip((extra or {}).items(), ("^", "s", "v", "d")):
        ax.scatter(positions, values, marker=marker, s=14, alpha=0.7, label=name, zorder=2)
    ax.set_xticks(positions)
    ax.set_xticklabels(gene_names, rotation=90, fontsize=6)
    ax.set_ylabel("change from control")
    ax.set_title(title, fontsize=9)


@register_task(SPEC)  # options, presets, unit and metrics: spec.py
class PerturbationGearsTask(Task):
    cfg: PerturbationGearsConfig

    def __init__(self, cfg: PerturbationGearsConfig, seed: int = 0):
        super().__init__(cfg, seed)  # checks the options (PerturbationGearsConfig.validate)
        self._ctrl_mean = torch.zeros(0)

    def attach_stats(self, stats: Mapping[str, Any]) -> None:
        super().attach_stats(stats)
        self._ctrl_mean = torch.tensor(stats.get("ctrl_mean", []), dtype=torch.float32)

    # ------------------------------------------------------------------ data
    def split(self, data: PerturbationData) -> SplitResult:
        """GEARS' split of the data's conditions by the configured mode."""
        c = self.cfg
        return split_conditions(data.condition_strings, mode=c.split, seed=c.split_seed,
                                train_gene_set_size=c.train_gene_set_size, combo_seen2_train_frac=c.combo_seen2_train_frac,
                                custom_path=c.custom_split_path or None, test_fraction=c.test_fraction,
                                val_fraction=c.val_fraction)

    def build_data(self) -> TaskData:
        c = self.cfg
        data, gene2go = load_perturbation_data(c)
        split = self.split(data)
        cache = Path(c.cache_dir) if c.cache_dir else default_cache_dir()
        graphs = cached_graphs(data, split, gene2go, cache, go_threshold=c.go_threshold, go_top_k=c.go_top_k,
                               coexpression_threshold=c.coexpression_threshold, coexpression_top_k=c.coexpression_top_k)
        logger.info("%s: %s; split %s (seed %d): %s", data.source, data.summary(), split.mode, split.seed, split.counts())
        pairs = PerturbationPairs(data, split.conditions("train"), seed=self.seed,
                                  fixed_controls=c.control_pairing == "fixed")
        if len(pairs) == 0:
            raise DataError(f"{data.source}: the training split ({split.mode}, seed {split.seed}) has no cells")
        options = {"seed": self.seed, "max_cells": c.eval_max_cells or None, "paired_controls": c.eval_controls == "paired"}
        val = ConditionMeans(data, split.conditions("val"), **options) if split.val else None
        test = ConditionMeans(data, split.conditions("test"), **options) if split.test else None
        return TaskData(train=TrainingPairs(pairs), eval=val, test=test,
                        stats=self.statistics(data, split, graphs))

    @staticmethod
    def statistics(data: PerturbationData, split: SplitResult, graphs: GeneGraphs) -> dict[str, Any]:
        """Everything the model, eval, report and predict need, JSON-able (see the module docstring)."""
        conditions = data.condition_strings
        return {"gene_names": data.gene_names.tolist(), "pert_genes": list(data.pert_genes),
                "conditions": conditions, "ctrl_mean": data.ctrl_mean.astype(np.float32).tolist(),
                "de_idx": encode_condition_rows(data.conditions, data.de_idx),
                "ranked_de_idx": encode_condition_rows(data.conditions, data.ranked_de_idx),
                "split": {"mode": split.mode, "seed": split.seed, "train": split.train, "val": split.val,
                          "test": split.test, "subgroups": split.subgroups, "held_out": split.held_out,
                          "params": split.params},
                "graphs": graphs_to_stats(graphs), "data_report": data.summary()}

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "cells" in samples[0]:  # ConditionMeans items (eval / test)
            return collate_conditions(samples)
        batch = collate_pairs(samples)
        batch["nonzero_mask"] = torch.stack([s["nonzero_mask"] for s in samples])
        return batch

    def batch_size(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["x"].shape[0])

    # ------------------------------------------------------------------ model
    def build_model(self, stats: Mapping[str, Any]) -> nn.Module:
        return build_gears_model(self.cfg, stats)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], rng: SampleRandom | None = None) -> LossOutput:
        """GEARS' loss; it draws nothing (`rng` unused): the one random choice, each cell's control, is drawn
        when the item is loaded, from (seed, epoch, cell) (`PerturbationPairs`)."""
        out = model(batch["x"], batch["pert_idx"])
        pred, logvar = out if isinstance(out, tuple) else (out, None)
        ctrl = self._ctrl_mean.to(pred.device)
        loss = gears_loss(pred, batch["y"], ctrl, batch["condition"], batch["nonzero_mask"],
                          direction_lambda=self.cfg.direction_lambda, logvar=logvar,
                          uncertainty_reg=self.cfg.uncertainty_reg)
        return LossOutput(loss)

    # ------------------------------------------------------------------ eval
    def eval_step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per condition of the batch: its index, cell count, mean predicted and mean observed profile [G]."""
        y, num_items = batch["y"], batch["condition"].size(0)
        chunk = cells_per_forward(self.cfg, y.size(-1))
        item = batch["item"].to(y.device)
        counts = batch["num_cells"].to(y.device, torch.float32).clamp(min=1.0)[:, None]
        true_mean = y.new_zeros(num_items, y.size(1), dtype=torch.float32).index_add_(0, item, y.float()) / counts
        if self.cfg.eval_controls == "mean":
            # pred = x + f(perturbation): fed the control mean, one row per condition is the exact mean over pairings.
            first_cell = torch.cumsum(batch["num_cells"], 0) - batch["num_cells"]
            x = self._ctrl_mean.to(y.device)[None].expand(num_items, -1)
            pred_mean, _ = predict_cells(model, x, batch["pert_idx"][first_cell.to(y.device)], chunk)
            pred_mean = pred_mean.float()
        else:
            pred, _ = predict_cells(model, batch["x"], batch["pert_idx"], chunk)
            pred_mean = pred.new_zeros(num_items, pred.size(1), dtype=torch.float32).index_add_(0, item, pred.float()) / counts
        return {"condition": batch["condition"], "num_cells": batch["num_cells"], "pred_mean": pred_mean, "true_mean": true_mean}

    def per_condition_metrics(self, values: Mapping[str, torch.Tensor], predictions: Mapping[str, np.ndarray] | None = None
                              ) -> dict[str, dict[str, float]]:
        """{condition: metrics} of the evaluated conditions (`predictions` replaces the model's mean profiles)."""
        names = self.stats["conditions"]
        codes = values["condition"].round().long().tolist()
        seen: set[int] = set()
        for code in codes:
            if code in seen:  # gather_for_metrics must hand over every condition once: a duplicate is a bug
                raise RuntimeError(f"condition {names[code]!r} was evaluated twice in one evaluation")
            seen.add(code)
        ctrl = np.asarray(self.stats["ctrl_mean"], dtype=np.float64)
        top = top_expressed_genes(ctrl)
        pred = values["pred_mean"].double().numpy()
        true = values["true_mean"].double().numpy()
        out = {}
        for row, code in enumerate(codes):
            name = names[code]
            de = per_condition_stats(self.stats, "de_idx", name, code)
            profile = pred[row] if predictions is None else predictions[name]
            ranked = per_condition_stats(self.stats, "ranked_de_idx", name, code)
            out[name] = condition_metrics(profile, true[row], ctrl, de, ranked_de_idx=ranked, top_expressed_idx=top)
        return out

    def subgroups_of(self, evaluated: Sequence[str]) -> dict[str, list[str]]:
        """Subgroups of the split set the evaluated conditions come from (test or val)."""
        split = self.stats["split"]
        which = "test" if set(evaluated) <= set(split["test"]) and split["test"] else "val"
        return split["subgroups"].get(which, {})

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        per_condition = self.per_condition_metrics(values)
        return aggregate_metrics(per_condition, self.subgroups_of(list(per_condition)))

    # ------------------------------------------------------------------ report
    def write_report(self, values: dict[str, torch.Tensor], metrics: dict[str, float], directory: Path,
                     dataset: ConditionMeans) -> None:
        """metrics.json, metrics_table.csv (model and the four baselines per subgroup), per_condition.csv,
        split.json and top_de_changes.png (predicted vs true change of the top DE genes)."""
        directory.mkdir(parents=True, exist_ok=True)
        data = dataset.data
        per_model = self.per_condition_metrics(values)
        evaluated = list(per_model)
        subgroups = self.subgroups_of(evaluated)
        baselines = fit_training_baselines(data, self.stats["split"]["train"])
        per_baseline = {}
        for name in BASELINE_NAMES:
            profiles = {c: baselines.predict(c, name) for c in evaluated}
            per_baseline[name] = self.per_condition_metrics(values, predictions=profiles)
        aggregates = {"model": metrics, **{n: aggregate_metrics(per_baseline[n], subgroups) for n in BASELINE_NAMES}}
        fallbacks = baselines.fallback_counts()
        if any(fallbacks.values()):
            logger.info("test baselines: %s of %d conditions predicted by the training mean (their genes have no "
                        "training single / no embedding)", ", ".join(f"{k} {v}" for k, v in fallbacks.items()), len(evaluated))
        headline = [m for m in ("mse_de", "pearson_delta", "mse", "pearson_delta_de") if m in metrics]
        beaten_by = baselines_that_beat(metrics, {n: aggregates[n] for n in BASELINE_NAMES}, headline)
        for metric, better in beaten_by.items():  # said, not only tabulated: a baseline that wins is news
            logger.info("test: %s beat%s the model on %s (%.4g): %s", " and ".join(better), "" if len(better) > 1 else "s",
                        metric, metrics[metric], ", ".join(f"{n} {v:.4g}" for n, v in better.items()))
        if headline and not beaten_by:
            logger.info("test: the model beats all %d baselines on %s", len(BASELINE_NAMES), ", ".join(headline))
        atomic_write_json(directory / "metrics.json",
                          {"model": metrics, "baselines": {n: aggregates[n] for n in BASELINE_NAMES},
                           "beaten_by": beaten_by,
                           "baseline_fallbacks": fallbacks,
                           "split": {k: len(v) for k, v in self.stats["split"].items() if isinstance(v, list)},
                           "data": self.stats.get("data_report", {})}, durable=False)
        atomic_write_json(directory / "split.json", self.stats["split"], durable=False)
        atomic_write_text(directory / "metrics_table.csv", metrics_table(aggregates, subgroups), durable=False)
        atomic_write_text(directory / "per_condition.csv", per_condition_table(per_model, per_baseline, subgroups),
                          durable=False)
        self._plot_report(values, data, baselines, directory / "top_de_changes.png")

    def _plot_report(self, values: Mapping[str, torch.Tensor], data: PerturbationData, baselines: Any, out: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = self.stats["conditions"]
        codes = values["condition"].round().long().tolist()
        order = sorted(range(len(codes)), key=lambda i: names[codes[i]])
        picks = [order[int(k)] for k in np.linspace(0, len(order) - 1, min(REPORT_CONDITIONS, len(order)))] if order else []
        if not picks:
            return
        ctrl = np.asarray(self.stats["ctrl_mean"], dtype=np.float64)
        gene_names = np.asarray(self.stats["gene_names"])
        fig, axes = plt.subplots(len(picks), 1, figsize=(7, 2.6 * len(picks)), squeeze=False)
        for ax, row in zip(axes[:, 0], picks):
            name = names[codes[row]]
            de = per_condition_stats(self.stats, "de_idx", name, codes[row])
            de = np.zeros(0, dtype=np.int64) if de is None else de
            if de.size == 0:
                ax.set_axis_off()
                continue
            cells = data.dense_rows(data.rows_of(as_condition(name)))[:, de] - ctrl[de]
            extra = {"no change": np.zeros(de.size), "additive": baselines.predict(name, "additive")[de] - ctrl[de]}
            plot_de_changes(ax, gene_names[de].tolist(), values["true_mean"][row].double().numpy()[de] - ctrl[de],
                            values["pred_mean"][row].double().numpy()[de] - ctrl[de], f"{name}: top {de.size} DE genes",
                            extra=extra, cell_deltas=cells)
        axes[0, 0].legend(fontsize=7, loc="best")
        fig.tight_layout()
        fig.savefig(out, dpi=110)
        plt.close(fig)

    # ------------------------------------------------------------------ artifacts
    def save_artifacts(self, directory: Path) -> list[str]:
        atomic_write_json(Path(directory) / "split.json", self.stats["split"], durable=False)
        return ["split.json"]


def fit_training_baselines(data: PerturbationData, train_conditions: Sequence[str]) -> Any:
    """The four baselines of `baselines.py` fit on the mean profiles of the training conditions."""
    wanted = [as_condition(c) for c in train_conditions]
    wanted = [c for c in wanted if c in data.condition_index]
    codes = np.asarray(data.cell_condition, dtype=np.int64)
    means, _ = group_means(data.X, codes, len(data.conditions))
    train_means = {c: means[data.condition_index[c]] for c in wanted}
    return fit_baselines(train_means, data.ctrl_mean, data.gene_names.tolist())


def metrics_table(aggregates: Mapping[str, Mapping[str, float]], subgroups: Mapping[str, Sequence[str]]) -> str:
    """CSV: one row per (subgroup, metric), one column per predictor (model, then the baselines)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    predictors = list(aggregates)
    writer.writerow(["subgroup", "metric", *predictors])
    for group in ["all", *[g for g in subgroups if subgroups[g]]]:
        prefix = "" if group == "all" else f"{group}/"
        for metric in (*CONDITION_METRICS, "n_conditions"):
            row = [aggregates[p].get(prefix + metric) for p in predictors]
            if all(v is None for v in row):
                continue
            writer.writerow([group, metric, *("" if v is None else f"{v:.6g}" for v in row)])
    return buffer.getvalue()


def per_condition_table(per_model: Mapping[str, Mapping[str, float]],
                        per_baseline: Mapping[str, Mapping[str, Mapping[str, float]]],
                        subgroups: Mapping[str, Sequence[str]]) -> str:
    """CSV: one row per evaluated condition with its subgroup, the model's metrics and the baselines' headline ones."""
    group_of = {c: g for g, members in subgroups.items() for c in members}
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    headline = ("mse_de", "pearson_delta")
    writer.writerow(["condition", "subgroup", *CONDITION_METRICS,
                     *(f"{b}/{m}" for b in per_baseline for m in headline)])
    for name in sorted(per_model):
        row = [name, group_of.get(name, "")]
        row += [f"{per_model[name][m]:.6g}" if m in per_model[name] else "" for m in CONDITION_METRICS]
        row += [f"{per_baseline[b][name][m]:.6g}" if m in per_baseline[b][name] else ""
                for b in per_baseline for m in headline]
        writer.writerow(row)
    return buffer.getvalue()


def check_perturbation(genes: Sequence[str], pert_genes: Sequence[str] | Mapping[str, int]) -> None:
    """A ConfigError naming the first gene that is not a perturbable gene of the model."""
    known = pert_genes if isinstance(pert_genes, Mapping) else set(pert_genes)
    if not genes:
        raise ConfigError("a perturbation needs at least one gene (the control is the input itself)")
    for gene in genes:
        if gene not in known:
            raise DataError(f"perturbation {list(genes)}: gene {gene!r} is not a perturbable gene of this model "
                            f"(not in its GO graph: no GO terms, or not in the training data's genes)")

"""`crystal_property`: crystal property regression with ComFormer (Yan et al., ICLR 2024).

Data: any source `trainer.families.crystals.readers` reads (extxyz, a POSCAR/CIF folder with
`id_prop.csv`, mlearn JSON, or structures saved by `trainer.frontends.crystals.train_from_list`), turned into
periodic k-NN (or radius) graphs cached in Arrow (`dataset.py`). The bundled default is mlearn Si
(train + test files).

Targets are standardised with the training mean and standard deviation, kept as buffers of the
model so a checkpoint or export predicts in physical units. The loss is L1 (the paper) or MSE in
standardised units; metrics are MAE and RMSE in physical units next to a per-element linear
baseline (least squares on element counts or fractions), so a number is never read without its
reference. The test split is evaluated at the end of a run, with a parity plot.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from trainer.atomic_io import atomic_write_json, atomic_write_pieces
from trainer.data.arrow_cache import ListColumn, digest, selected_column, selected_rows
from trainer.data.splits import hashed_split_rows, split_indices
from trainer.families.crystals.comformer import build_comformer, comformer_config
from trainer.families.crystals.dataset import (
    CrystalRows,
    atom_counts,
    build_crystal_dataset,
    collate_graphs,
    column_rows,
    edge_counts,
    select_rows,
    strings_at,
)
from trainer.families.crystals.graphs import GraphSpec
from trainer.families.crystals.readers import bundled_crystal_path
from trainer.families.crystals.spec import SPEC, CrystalPropertyConfig
from trainer.registry import register_task
from trainer.task import LossOutput, Task, TaskData

if TYPE_CHECKING:
    from trainer.sample_random import SampleRandom

logger = logging.getLogger(__name__)

NUM_ELEMENTS = 119


class StandardizedModel(nn.Module):
    """A property model with the target statistics as buffers.

    `forward` gives standardised predictions (what the loss sees; it must be the call that goes
    through a DDP/DeepSpeed wrapper), `predict` physical units (what a user of an export wants).
    """

    def __init__(self, model: nn.Module, num_targets: int):
        super().__init__()
        self.model = model
        self.register_buffer("target_mean", torch.zeros(num_targets))
        self.register_buffer("target_std", torch.ones(num_targets))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch)

    def to_physical(self, standardized: torch.Tensor) -> torch.Tensor:
        return standardized * self.target_std + self.target_mean

    @torch.no_grad()
    def predict(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.to_physical(self.model(batch))


def element_fractions(numbers: list[np.ndarray] | ListColumn) -> np.ndarray:
    """Element fractions of each structure, [n, 119] (the features of the per-element baseline): from
    per-structure arrays, or from an `atomic_numbers` ListColumn in one vectorised pass."""
    if not isinstance(numbers, ListColumn):
        numbers = [np.asarray(z, dtype=np.int64) for z in numbers]
        counts = np.array([len(z) for z in numbers], dtype=np.int64)
        flat = np.concatenate(numbers) if numbers else np.zeros(0, np.int64)
    else:
        counts = numbers.lengths()
        flat = numbers.flat().astype(np.int64)
    out = np.zeros((len(counts), NUM_ELEMENTS))
    row = np.repeat(np.arange(len(counts)), counts)
    # np.add.at adds in element order, as one add.at per structure did: the same floating-point sums
    np.add.at(out, (row, flat), np.repeat(1.0 / np.maximum(1, counts), counts))
    return out


BASELINE_BLOCK_ROWS = 16384
"""Structures per block of the element-fraction baseline's normal equations: the dense fractions of one block
([rows, 119] float64) are all that is ever materialised, whatever the number of structures."""


def _fraction_blocks(numbers: list[np.ndarray] | ListColumn, block: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, element fractions [rows, 119]) of consecutive blocks of `block` structures."""
    if not isinstance(numbers, ListColumn):
        for lo in range(0, len(numbers), block):
            yield lo, element_fractions(numbers[lo:lo + block])
        return
    rows = numbers.rows  # the selection's table rows (None: all, in order)
    for lo in range(0, len(numbers), block):
        r = (rows[lo:lo + block] if rows is not None else np.arange(lo, min(lo + block, len(numbers)))).astype(np.int64)
        chunk = np.searchsorted(numbers.chunk_starts, r, side="right") - 1
        parts = []
        for c in np.unique(chunk):  # each Arrow chunk's rows of the block, gathered from its offsets
            at = np.flatnonzero(chunk == c)
            local = r[at] - numbers.chunk_starts[c]
            starts = numbers.offsets[c][local].astype(np.int64)
            n = numbers.offsets[c][local + 1].astype(np.int64) - starts
            flat = numbers.values[c][np.repeat(starts - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))]
            parts.append((at, n, flat))
        counts = np.zeros(len(r), np.int64)
        for at, n, _ in parts:
            counts[at] = n
        out = np.zeros((len(r), NUM_ELEMENTS))
        for at, n, flat in parts:
            np.add.at(out, (np.repeat(at, n), flat.astype(np.int64)),
                      np.repeat(1.0 / np.maximum(1, counts[at]), n))
        yield lo, out


def fit_element_baseline(numbers: list[np.ndarray] | ListColumn, targets: np.ndarray) -> np.ndarray:
    """Per-element linear baseline for intensive targets: y ~ sum_e fraction_e * c_e, least squares.

    Returns the coefficients [119, T] (zero for elements absent from training). With one element
    (mlearn Si) it is the training mean; with several it is the composition-only model that any
    structure-aware model must beat. Solved from the normal equations (X^T X [119, 119], X^T y), summed
    over blocks of `BASELINE_BLOCK_ROWS` structures, so the memory does not grow with the data; the
    minimum-norm solution, as a least-squares solve of X itself gives (elements whose fractions are
    collinear share their coefficient the same way)."""
    targets = np.asarray(targets, dtype=np.float64)
    xtx = np.zeros((NUM_ELEMENTS, NUM_ELEMENTS))
    xty = np.zeros((NUM_ELEMENTS, targets.shape[1]))
    for lo, x in _fraction_blocks(numbers, BASELINE_BLOCK_ROWS):
        xtx += x.T @ x
        xty += x.T @ targets[lo:lo + len(x)]
    used = np.diag(xtx) > 0
    coef = np.zeros((NUM_ELEMENTS, targets.shape[1]))
    if used.any():
        coef[used] = np.linalg.lstsq(xtx[np.ix_(used, used)], xty[used], rcond=None)[0]
    return coef


REPORT_BLOCK_ROWS = 8192
"""Test rows written to predictions.csv at a time (their ids read together): the report's memory is one block."""

STATS_VERSION = "crystal-stats-v1"
"""Bump when `_statistics` changes what it computes, so that stored statistics are not reused."""

SPLIT_BLOCK_ROWS = 1 << 20
"""Ids decoded to Python strings at a time when the splits are assigned: a rank never holds every id as a string."""


def _split_rows(ds: Any, fractions: dict[str, float], key: int) -> dict[str, np.ndarray]:
    """`split_indices` of the dataset's ids: from the split hashes stored at build time (`ds.split_hashes`, keyed
    by `key`) when the dataset has them, else from its ids read `SPLIT_BLOCK_ROWS` at a time (the same rows
    either way: the rule is per id)."""
    hashes = getattr(ds, "split_hashes", None)
    if hashes is not None and getattr(ds, "split_key", None) == key and selected_rows(ds) is None:
        names = list(fractions)  # the rows as narrow ints, found block by block: a rank keeps them for the run
        return dict(zip(names, hashed_split_rows(hashes, [fractions[n] for n in names])))
    ids = selected_column(ds, "id")
    found: dict[str, list[np.ndarray]] = {name: [] for name in fractions}
    for lo in range(0, len(ids), SPLIT_BLOCK_ROWS):
        for name, rows in split_indices(ids.slice(lo, SPLIT_BLOCK_ROWS).to_pylist(), fractions, key=key).items():
            found[name].append(rows + lo)
    return {name: np.concatenate(parts) if parts else np.zeros(0, np.int64) for name, parts in found.items()}


@register_task(SPEC)  # options, presets, unit and metrics: spec.py
class CrystalPropertyTask(Task):
    cfg: CrystalPropertyConfig

    def __init__(self, cfg: CrystalPropertyConfig, seed: int = 0):
        super().__init__(cfg, seed)  # checks the options (CrystalPropertyConfig.validate)
        self.attach_stats({"num_targets": 1, "target_mean": [0.0], "target_std": [1.0],
                           "baseline_coef": np.zeros((NUM_ELEMENTS, 1)).tolist()})

    def attach_stats(self, stats: dict[str, Any]) -> None:
        super().attach_stats(stats)
        self.target_mean = torch.tensor(stats["target_mean"], dtype=torch.float32)
        self.target_std = torch.tensor(stats["target_std"], dtype=torch.float32)
        self.baseline = torch.tensor(stats["baseline_coef"], dtype=torch.float32)

    # ------------------------------------------------------------------ data
    def _build(self, source: Any, target: str, per_atom: bool, split_key: int | None = None) -> Any:
        c = self.cfg
        spec = GraphSpec(kind=c.graph, cutoff=c.cutoff, k=c.max_neighbors, use_lattice=c.use_lattice)
        ds = build_crystal_dataset(source, graph=spec, target=target, per_atom=per_atom, on_invalid=c.on_invalid,
                                   id_key=c.id_key or None, num_proc=c.num_proc or None,
                                   cache_dir=c.cache_dir or None, split_key=split_key)
        logger.info("%s: %s", source, ds.crystal_report.summary())
        return ds

    def _sources(self) -> tuple[Any, Any]:
        c = self.cfg
        if c.data_path:
            return c.data_path, c.test_path or None
        return bundled_crystal_path("mlearn_Si_training"), c.test_path or bundled_crystal_path("mlearn_Si_test")

    def build_data(self) -> TaskData:
        c = self.cfg
        train_source, test_source = self._sources()
        full = self._build(train_source, c.target, c.per_atom, split_key=self.seed)
        hold_test = 0.0 if test_source is not None else c.test_fraction
        # Each id goes to a split by its own hash (keyed by the seed): the split of a structure does
        # not depend on the others, the file order or the world size; sizes are close to the fractions.
        fractions = {"train": 1.0 - c.val_fraction - hold_test, "validation": c.val_fraction, "test": hold_test}
        parts = _split_rows(full, fractions, key=self.seed)
        if len(parts["train"]) == 0:
            raise ValueError(f"{train_source}: no training structures left after the validation/test split")
        # narrow: a rank keeps these selections for the run (4-byte indices); the task never concatenates them
        train = select_rows(full, parts["train"], narrow=True)
        if test_source is not None:
            test_target = c.test_target or c.target
            test_per_atom = c.per_atom if c.test_per_atom is None else c.test_per_atom
            test = self._build(test_source, test_target, test_per_atom)
        else:
            test = select_rows(full, parts["test"], narrow=True) if len(parts["test"]) else None
        val = select_rows(full, parts["validation"], narrow=True) if len(parts["validation"]) else None
        reports = {str(train_source): full.crystal_report}
        if test_source is not None:
            reports[str(test_source)] = test.crystal_report
        data_report = {src: {"kept": r.kept, "records": r.records, "skipped": r.skipped} for src, r in reports.items()}
        return TaskData(train=CrystalRows(train), eval=CrystalRows(val) if val is not None else None,
                        test=CrystalRows(test, row_index=True) if test is not None else None,
                        stats={**self._stored_statistics(full, train, fractions), "data_report": data_report})

    def _stored_statistics(self, full: Any, train: Any, fractions: dict[str, float]) -> dict[str, Any]:
        """`_statistics(train)`, computed once per graph cache, seed and split and stored beside the shards
        (`<fingerprint>.stats-<key>.json`): the first process computes them (a scan of the target and element
        columns of every training row, CPU and mapped pages in proportion to N), the other ranks and later launches
        read a few numbers. JSON keeps every float exactly; a damaged or foreign file is recomputed."""
        key = {"version": STATS_VERSION, "seed": self.seed, "fractions": fractions,
               "standardize": bool(self.cfg.standardize), "train_rows": len(train)}
        files = getattr(full, "cache_files", None) or []
        path = (Path(files[0]["filename"]).parent / f"{full._fingerprint}.stats-{digest(key)[:16]}.json"
                if files and selected_rows(full) is None else None)
        if path is not None and path.exists():
            try:
                stored = json.loads(path.read_text())
                if stored.get("key") == key:
                    return stored["stats"]
            except (OSError, ValueError, AttributeError, KeyError):
                pass  # recomputed and rewritten below
        stats = self._statistics(train)
        if path is not None:
            try:
                atomic_write_json(path, {"key": key, "stats": stats}, durable=False)
            except OSError as err:  # a read-only cache folder: every start computes them, as before
                logger.warning("crystal statistics not stored (%s): computed at every start", err)
        return stats

    def _statistics(self, train) -> dict[str, Any]:
        """Target mean/std (standardisation) and the per-element baseline, fit on the training split."""
        # the column's values in the split's order, gathered shard by shard (no Arrow copy of the whole column)
        targets = column_rows(train, "target").astype(np.float64).reshape(len(train), -1)
        numbers = ListColumn(train, "atomic_numbers")
        std = targets.std(axis=0)
        standardize = self.cfg.standardize
        return {"num_targets": int(targets.shape[1]),
                "target_mean": targets.mean(axis=0).tolist() if standardize else [0.0] * targets.shape[1],
                "target_std": np.where(std > 0, std, 1.0).tolist() if standardize else [1.0] * targets.shape[1],
                "baseline_coef": fit_element_baseline(numbers, targets).tolist()}

    def unit_sizes(self, dataset: Dataset) -> np.ndarray:
        return atom_counts(dataset) if self.cfg.batch_unit == "atoms" else edge_counts(dataset)

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        # collate_graphs carries the lattice coefficients the graphs were built with (`lattice_coeffs`):
        # the model reads them from the batch, the same as an exported model fed by collate_graphs.
        batch = collate_graphs(samples)
        if batch["target"].ndim == 1:
            batch["target"] = batch["target"][:, None]
        return batch

    def batch_size(self, batch: dict[str, Any]) -> int:
        return int(batch["num_atoms"].shape[0])

    def batch_weight(self, batch: dict[str, Any]) -> float:
        return float(batch["num_atoms"].shape[0])  # the loss is a mean over structures

    # ------------------------------------------------------------------ model
    def build_model(self, stats: dict[str, Any]) -> nn.Module:
        c = self.cfg
        num_targets = int(stats["num_targets"])
        model_cfg = comformer_config(c.model_preset, variant=c.variant, output_features=num_targets)
        model = StandardizedModel(build_comformer(model_cfg), num_targets)
        model.target_mean.copy_(torch.tensor(stats["target_mean"]))
        model.target_std.copy_(torch.tensor(stats["target_std"]))
        return model

    def _to_physical(self, standardized: torch.Tensor) -> torch.Tensor:
        return standardized * self.target_std.to(standardized.device) + self.target_mean.to(standardized.device)

    def loss(self, model: nn.Module, batch: dict[str, Any], rng: SampleRandom | None = None) -> LossOutput:
        """L1 or MSE in standardised units; draws nothing (`rng` unused: no augmentation, dropout 0 by default)."""
        device = batch["target"].device
        target = (batch["target"] - self.target_mean.to(device)) / self.target_std.to(device)
        err = model(batch) - target
        per = err.abs() if self.cfg.loss == "l1" else err.square()
        return LossOutput(loss=per.mean(dim=1).mean(), logs={"mae_std_units": err.detach().abs().mean()})

    def eval_step(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        pred = self._to_physical(model(batch))
        target = batch["target"]
        base = self._baseline_predictions(batch)
        out = {"num_atoms": batch["num_atoms"].float()}
        if "row" in batch:  # test rows: the report maps predictions back to structure ids
            out["row"] = batch["row"]
        for t in range(target.shape[1]):
            suffix = "" if target.shape[1] == 1 else f"_{t}"
            out[f"pred{suffix}"] = pred[:, t]
            out[f"target{suffix}"] = target[:, t]
            out[f"baseline{suffix}"] = base[:, t]
        return out

    def _baseline_predictions(self, batch: dict[str, Any]) -> torch.Tensor:
        coef = self.baseline.to(batch["positions"].device)
        per_atom = coef[batch["atomic_numbers"]]
        sums = torch.zeros(batch["num_atoms"].shape[0], coef.shape[1], device=coef.device).index_add_(
            0, batch["batch"], per_atom)
        return sums / batch["num_atoms"][:, None].to(sums.dtype)

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        metrics: dict[str, float] = {"num_structures": float(values["num_atoms"].numel())}
        for key in [k for k in values if k.startswith("pred")]:
            suffix = key[len("pred"):]
            target = values[f"target{suffix}"].double()
            err = values[key].double() - target
            base = values[f"baseline{suffix}"].double() - target
            metrics[f"mae{suffix}"] = float(err.abs().mean())
            metrics[f"rmse{suffix}"] = float(err.square().mean().sqrt())
            metrics[f"baseline_mae{suffix}"] = float(base.abs().mean())
        return metrics

    def write_report(self, values: dict[str, torch.Tensor], metrics: dict[str, float], directory: Path,
                     dataset: CrystalRows) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        directory.mkdir(parents=True, exist_ok=True)
        unit = f"{self.cfg.target}{' per atom' if self.cfg.per_atom else ''}"
        for key in [k for k in values if k.startswith("pred")]:
            suffix = key[len("pred"):]
            pred, target = values[key].numpy(), values[f"target{suffix}"].numpy()
            fig, ax = plt.subplots(figsize=(4.5, 4.5))
            lo, hi = float(min(pred.min(), target.min())), float(max(pred.max(), target.max()))
            ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
            ax.scatter(target, pred, s=12, alpha=0.7)
            ax.set_xlabel(f"true {unit}")
            ax.set_ylabel(f"predicted {unit}")
            ax.set_title(f"test: MAE {metrics[f'mae{suffix}']:.4g} (per-element baseline "
                         f"{metrics[f'baseline_mae{suffix}']:.4g})", fontsize=9)
            fig.tight_layout()
            fig.savefig(directory / f"parity{suffix}.png", dpi=120)
            plt.close(fig)
        atomic_write_json(directory / "metrics.json", {**metrics, "data": self.stats.get("data_report", {})},
                          durable=False)
        pred_key = next(k for k in values if k.startswith("pred"))
        suffix = pred_key[len("pred"):]
        # each prediction back to its structure id through the `row` column of the evaluated rows (their ids
        # only, read from the shards holding them), a block of rows at a time,
        # in test-row order, whatever order the batches came in (eval.balanced_batches) and on any world size
        rows, order = values["row"].round().long().sort()
        columns = [values[k][order] for k in (pred_key, f"target{suffix}", f"baseline{suffix}", "num_atoms")]

        def blocks() -> Iterator[bytes]:
            yield b"id,pred,target,baseline,num_atoms\n"
            for lo in range(0, len(rows), REPORT_BLOCK_ROWS):
                hi = lo + REPORT_BLOCK_ROWS
                buffer = io.StringIO()
                writer = csv.writer(buffer, lineterminator="\n")
                ids = strings_at(dataset, "id", rows[lo:hi].tolist())
                for rid, p, t, b, n in zip(ids, *(c[lo:hi].tolist() for c in columns)):
                    writer.writerow([rid, f"{p:.8g}", f"{t:.8g}", f"{b:.8g}", int(n)])
                yield buffer.getvalue().encode("utf-8")

        atomic_write_pieces(directory / "predictions.csv", blocks(), durable=False)

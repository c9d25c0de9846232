"""Lazy control/perturbed pairs for training, and one-item-per-condition sets for evaluation.

GEARS builds one dense graph object per (control, perturbed) pair up front (8 x genes bytes a
cell: more than memory holds on a data set of Norman's size, snap-stanford/GEARS#35). Here the expression
matrix stays sparse and a pair is drawn when an item is read:

- `PerturbationPairs.get_item(index, epoch)`: cell `rows[index]` is the target y; its control x is
  drawn by a generator seeded with `derive_seed(seed, epoch, cell_row)`: the same pair on a resumed
  run and in any worker or process, a fresh pair each epoch (or, with `fixed_controls`, the epoch-0 pair in
  every epoch, as GEARS' pairs drawn once). A control cell is its own input (x = y),
  as in GEARS.
- `ConditionMeans`: one item per condition (the eval unit: every condition counted exactly once at
  any world size and batch size), holding its cells (all, or `max_cells` drawn with a seed) each with
  a seeded control; `collate_conditions` concatenates the cells of a batch of conditions.

Padding: `pert_idx` is [2] with -1 for "no gene" (a single has one -1, the control two); `de_idx`
is [20] with -1 where a condition has fewer DE genes (and all -1 for the control).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.families.perturbation_gears.anndata_reader import NUM_DE_GENES, PerturbationData, dense_rows, index_dtype
from trainer.families.perturbation_gears.conditions import Condition, as_condition, format_condition
from trainer.seeding import derive_seed

MAX_PERTURBED_GENES = 2


def _padded(values: Sequence[int] | np.ndarray, length: int) -> np.ndarray:
    out = np.full(length, -1, dtype=np.int64)
    values = np.asarray(values, dtype=np.int64)[:length]
    out[: len(values)] = values
    return out


class _ConditionTables:
    """Per-condition pert_idx / de_idx arrays, padded once (-1), in the smallest integer type holding them; a
    row is read back as int64 (`pert_idx_of`, `de_idx_of`)."""

    def __init__(self, data: PerturbationData, de_field: str):
        table = getattr(data, de_field)
        pert_idx = np.stack([_padded(data.pert_idx(c), MAX_PERTURBED_GENES) for c in data.conditions])
        de_idx = np.stack([_padded(table.get(c, ()), NUM_DE_GENES) for c in data.conditions])
        self.pert_idx = pert_idx.astype(index_dtype(max(int(pert_idx.max(initial=0)), 0)))
        self.de_idx = de_idx.astype(index_dtype(max(int(de_idx.max(initial=0)), 0)))

    def pert_idx_of(self, code: int) -> torch.Tensor:
        return torch.from_numpy(self.pert_idx[code].astype(np.int64))

    def de_idx_of(self, code: int) -> torch.Tensor:
        return torch.from_numpy(self.de_idx[code].astype(np.int64))


def condition_tables(data: PerturbationData, de_field: str) -> _ConditionTables:
    """The padded tables of `data` for `de_field`, built once and shared by every dataset over the same data (the
    training pairs and the val and test sets each held their own copy)."""
    cache = data.__dict__.setdefault("_condition_tables", {})
    if de_field not in cache:
        cache[de_field] = _ConditionTables(data, de_field)
    return cache[de_field]


class PerturbationPairs(Dataset):
    """Training items over the cells of `conditions`: (control x, perturbed y) pairs drawn lazily per epoch.

    Item: {"x": float32 [G], "y": float32 [G], "pert_idx": int64 [2], "condition": int (position in
    data.conditions), "de_idx": int64 [20], "cell": int (row in data.X)}.
    `de_field` picks the DE list ("de_idx", GEARS' choice, or "top_non_dropout_de_20", "top_non_zero_de_20").
    """

    def __init__(self, data: PerturbationData, conditions: Sequence[str | Condition], seed: int,
                 de_field: str = "de_idx", fixed_controls: bool = False):
        self.data = data
        self.seed = int(seed)
        self.fixed_controls = fixed_controls
        wanted = [as_condition(c) for c in conditions]
        unknown = [format_condition(c) for c in wanted if c not in data.condition_index]
        if unknown:
            raise KeyError(f"conditions not in the data: {unknown[:5]}")
        self.conditions = wanted
        # the items are the conditions' spans of the data's rows grouped by condition (`row_order`), one after the
        # other: an item's row is found from its span, so no array of a row per training cell is held in every rank
        spans = np.array([data.condition_span(c) for c in wanted], dtype=np.int64).reshape(-1, 2)
        self._order = data.row_order
        self._span_start = spans[:, 0]
        self._first_item = np.zeros(len(spans) + 1, dtype=np.int64)
        np.cumsum(spans[:, 1] - spans[:, 0], out=self._first_item[1:])
        self.tables = condition_tables(data, de_field)
        self.ctrl_code = data.condition_index[()]

    @property
    def rows(self) -> np.ndarray:
        """[len] the data row of each item, in item order (a new array, in the smallest integer type holding a row)."""
        order = self._order
        parts = [order[a:a + n] for a, n in zip(self._span_start.tolist(), np.diff(self._first_item).tolist())]
        rows = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return rows.astype(index_dtype(max(self.data.num_cells - 1, 0)))

    def row_at(self, index: int) -> int:
        """The data row of item `index` (negative counts from the end)."""
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"item {index} of {len(self)}")
        k = int(np.searchsorted(self._first_item, index, side="right")) - 1
        return int(self._order[int(self._span_start[k]) + index - int(self._first_item[k])])

    def __len__(self) -> int:
        return int(self._first_item[-1])

    def control_row(self, cell_row: int, epoch: int) -> int:
        """The control cell paired with `cell_row` in `epoch` (the cell itself for a control cell); with
        `fixed_controls`, the same in every epoch (GEARS draws each cell's control once, when it builds its data)."""
        if self.data.cell_condition[cell_row] == self.ctrl_code:
            return int(cell_row)
        drawn_in = 0 if self.fixed_controls else int(epoch)
        rng = np.random.default_rng(derive_seed("gears/pair", self.seed, drawn_in, int(cell_row)))
        return int(self.data.ctrl_rows[rng.integers(len(self.data.ctrl_rows))])

    def get_item(self, index: int, epoch: int = 0) -> dict[str, Any]:
        row = self.row_at(index)
        code = int(self.data.cell_condition[row])
        control = self.control_row(row, epoch)
        pair = dense_rows(self.data.X, [control, row])
        return {"x": torch.from_numpy(pair[0]), "y": torch.from_numpy(pair[1]),
                "pert_idx": self.tables.pert_idx_of(code), "condition": code,
                "de_idx": self.tables.de_idx_of(code), "cell": row}

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.get_item(index, 0)


def collate_pairs(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack `PerturbationPairs` items: x, y [B, G]; pert_idx [B, 2]; de_idx [B, 20]; condition, cell [B]."""
    return {"x": torch.stack([i["x"] for i in items]), "y": torch.stack([i["y"] for i in items]),
            "pert_idx": torch.stack([i["pert_idx"] for i in items]),
            "de_idx": torch.stack([i["de_idx"] for i in items]),
            "condition": torch.tensor([i["condition"] for i in items], dtype=torch.long),
            "cell": torch.tensor([i["cell"] for i in items], dtype=torch.long)}


class ConditionMeans(Dataset):
    """Eval items, one per condition: its cells (or `max_cells` of them, seeded) with seeded controls.

    Item: {"condition": int, "x": float32 [n, G] controls, "y": float32 [n, G] cells, "pert_idx": int64 [2],
    "de_idx": int64 [20], "cells": int64 [n] rows}. The control of cell r is drawn from
    `derive_seed("gears/eval-pair", seed, r)`: the same at every evaluation. `paired_controls=False` leaves
    the controls out (x is [n, 0]) for an evaluation that feeds the control mean instead.
    """

    def __init__(self, data: PerturbationData, conditions: Sequence[str | Condition], seed: int,
                 max_cells: int | None = None, de_field: str = "de_idx", paired_controls: bool = True):
        self.data = data
        self.seed = int(seed)
        self.max_cells = max_cells
        self.paired_controls = paired_controls
        self.conditions = [as_condition(c) for c in conditions]
        unknown = [format_condition(c) for c in self.conditions if c not in data.condition_index]
        if unknown:
            raise KeyError(f"conditions not in the data: {unknown[:5]}")
        self.tables = condition_tables(data, de_field)
        self.ctrl_code = data.condition_index[()]

    def __len__(self) -> int:
        return len(self.conditions)

    def cell_rows(self, index: int) -> np.ndarray:
        """Rows evaluated for condition `index` (all, or a seeded subset of `max_cells`, in row order)."""
        cond = self.conditions[index]
        rows = self.data.rows_of(cond)
        if self.max_cells is not None and len(rows) > self.max_cells:
            rng = np.random.default_rng(derive_seed("gears/eval-cells", self.seed, format_condition(cond)))
            rows = np.sort(rng.choice(rows, size=self.max_cells, replace=False))
        return rows

    def control_rows(self, rows: np.ndarray, code: int) -> np.ndarray:
        if code == self.ctrl_code:
            return rows
        ctrl = self.data.ctrl_rows
        return np.array([ctrl[np.random.default_rng(derive_seed("gears/eval-pair", self.seed, int(r))).integers(len(ctrl))]
                         for r in rows], dtype=np.int64)

    def __getitem__(self, index: int) -> dict[str, Any]:
        code = self.data.condition_index[self.conditions[index]]
        rows = self.cell_rows(index)
        x = (torch.from_numpy(dense_rows(self.data.X, self.control_rows(rows, code))) if self.paired_controls
             else torch.zeros(len(rows), 0))
        return {"condition": code, "x": x,
                "y": torch.from_numpy(dense_rows(self.data.X, rows)),
                "pert_idx": self.tables.pert_idx_of(code),
                "de_idx": self.tables.de_idx_of(code), "cells": torch.from_numpy(rows)}


def collate_conditions(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Concatenate `ConditionMeans` items: per cell x, y [N, G], pert_idx [N, 2], cells [N], item [N] (position of
    its condition in the batch); per condition condition [B], de_idx [B, 20], num_cells [B]."""
    sizes = [len(i["y"]) for i in items]
    return {"x": torch.cat([i["x"] for i in items]), "y": torch.cat([i["y"] for i in items]),
            "pert_idx": torch.cat([i["pert_idx"].expand(n, -1) for i, n in zip(items, sizes)]),
            "cells": torch.cat([i["cells"] for i in items]),
            "item": torch.repeat_interleave(torch.arange(len(items)), torch.tensor(sizes, dtype=torch.long)),
            "condition": torch.tensor([i["condition"] for i in items], dtype=torch.long),
            "de_idx": torch.stack([i["de_idx"] for i in items]),
            "num_cells": torch.tensor(sizes, dtype=torch.long)}

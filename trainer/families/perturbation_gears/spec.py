"""`perturbation_gears` as the registry knows it without importing torch: the task options, presets, unit and
metrics (and the split modes and metric names they are built from). The Task class (`task.py`) is imported only
when a run needs it."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.registry import register_spec
from trainer.task import TaskConfig, TaskSpec

SPLIT_MODES = ("simulation", "simulation_single", "combo_seen0", "combo_seen1", "combo_seen2", "single", "no_test",
               "no_split", "custom")
"""task.split values (splits.py)."""
SUBGROUPS = ("combo_seen0", "combo_seen1", "combo_seen2", "unseen_single", "seen_single")
"""Test subgroups of the simulation split (splits.py), each reported on its own."""
DIRECTION_TOP_K = (20, 50, 100, 200)
"""The top-k DE gene counts of ``frac_correct_direction_k`` (metrics.py)."""
CONDITION_METRICS = ("mse_de", "pearson_delta", "pearson_delta_de", "pearson_de", "mse", "pearson", "l2_top1000",
                     *(f"frac_correct_direction_{k}" for k in DIRECTION_TOP_K))
"""Per-condition metrics (see metrics.py), averaged over conditions; `mse_de` first: the default eval.metric."""
METRIC_NAMES = (*CONDITION_METRICS, "n_conditions",
                *(f"{group}/{name}" for group in SUBGROUPS for name in (*CONDITION_METRICS, "n_conditions", "n_missing")))
"""Everything `reduce_metrics` may return: overall, then per subgroup (`combo_seen0/pearson_delta`, ...)."""
CONTROL_PAIRINGS = ("per_epoch", "fixed")
"""task.control_pairing values."""
EVAL_CONTROLS = ("mean", "paired")
"""task.eval_controls values."""


@dataclass
class PerturbationGearsConfig(TaskConfig):
    name: str = "perturbation_gears"
    """Registered task name."""
    data_path: str = ""
    """GEARS data: a folder holding perturb_processed.h5ad, or an .h5ad file (GEARS format or raw AnnData with
    X/var['gene_name']/obs['condition','cell_type']); empty: the bundled simulated set."""
    gene2go_path: str = ""
    """Gene -> GO terms: GEARS' gene2go pickle, a gene<TAB>GO TSV or a GAF file; empty: a gene2go file of the data
    folder (gene2go.tsv, gene2go_all.pkl, ...) or of its parent folder."""
    split: str = "simulation"
    """Split mode: simulation, simulation_single, combo_seen0, combo_seen1, combo_seen2, single, no_test, no_split
    or custom (GEARS' modes; splits.py)."""
    split_seed: int = 1
    """Seed of the split (GEARS' `seed`, default 1); run.seed seeds the cell pairing and the model."""
    train_gene_set_size: float = 0.75
    """simulation: fraction of the perturbed genes seen in training."""
    combo_seen2_train_frac: float = 0.75
    """simulation: fraction of the doubles with both genes seen that go to training."""
    test_fraction: float = 0.1
    """single / combo_seen* / no_test: GEARS' combo_single_split_test_set_fraction."""
    val_fraction: float = 0.1
    """single / combo_seen*: fraction held out for validation (GEARS' val_size)."""
    custom_split_path: str = ""
    """split=custom: a JSON {"train": [...], "val": [...], "test": [...]} of conditions, or GEARS' split pickle."""
    go_threshold: float = 0.1
    """GO graph: keep gene pairs whose GO-term Jaccard similarity is above this."""
    go_top_k: int = 20
    """GO graph: neighbours kept per gene (plus itself; GEARS' num_similar_genes_go_graph)."""
    coexpression_threshold: float = 0.4
    """Co-expression graph: keep edges whose |Pearson| is above this (GEARS' coexpress_threshold)."""
    coexpression_top_k: int = 20
    """Co-expression graph: neighbours kept per gene (plus itself; GEARS' num_similar_genes_co_express_graph)."""
    hidden_size: int = 64
    """Width h of every embedding and MLP."""
    num_go_gnn_layers: int = 1
    """SGConv layers on the GO graph."""
    num_gene_gnn_layers: int = 1
    """SGConv layers on the co-expression graph."""
    uncertainty: bool = False
    """Add GEARS' per-gene log-variance head (and its loss term)."""
    uncertainty_reg: float = 1.0
    """Weight of the exp(-logvar) loss term with uncertainty=true."""
    direction_lambda: float = 0.1
    """Weight of the direction (sign) term of the loss; it has no gradient (logged value only, as in GEARS)."""
    eval_controls: str = "mean"
    """Validation/test input of a condition's cells: `mean` (the control mean: GEARS' prediction is a residual on
    its input, so this is the exact expectation over control pairings, the input the no-change baseline uses, and
    one forward per condition) or `paired` (each cell with a seeded random control cell, GEARS' protocol: the
    mean prediction then carries the sampled controls' noise)."""
    control_pairing: str = "per_epoch"
    """Training control cell of each perturbed cell: `per_epoch` (drawn afresh every epoch, seeded per (seed, epoch,
    cell): more control noise seen) or `fixed` (drawn once per cell and kept, as GEARS' data)."""
    coexpress_first_cell_only: bool = False
    """Reproduce GEARS' batch bug (only the first cell of a batch gets co-expression propagation); for
    side-by-side numbers with the original only (with eval_controls=paired, as GEARS evaluates: at the control
    mean the first row of each eval chunk is a condition, not a cell)."""
    on_invalid: str = "drop"
    """Unusable conditions (gene outside GO/var, malformed, no cells, no DE ranking): `drop` (counted and logged
    at start) or `error`."""
    pert_gene_set: str = "var"
    """Perturbable genes (GO graph nodes): `var` (every read-out gene with GO terms, plus the perturbed genes;
    unseen genes get GO neighbours) or `conditions` (the perturbed genes only)."""
    recompute_de: bool = False
    """Recompute GEARS' DE fields (rank_genes_groups, non-zero/non-dropout genes) even when the file has them."""
    cache_dir: str = ""
    """Folder of the cached gene graphs (empty: $TRAINER_CACHE_DIR/perturbation_gears, else
    ~/.cache/trainer/perturbation_gears)."""
    eval_max_cells: int = 0
    """Validation/test: at most this many cells per condition (a seeded subset; 0: all cells)."""
    eval_cells_per_forward: int = 0
    """Validation/test/predict: cells per forward pass (GEARS' test_batch_size); a condition's cells are split.
    0: as many as keep one [cells x genes x hidden] activation near 32 MB (26 cells for 5,000 genes at hidden
    64); results do not depend on it (BatchNorm uses its running statistics in eval)."""

    def validate(self) -> None:
        super().validate()
        for key, choices in (("split", SPLIT_MODES), ("on_invalid", ("drop", "error")),
                             ("pert_gene_set", ("var", "conditions")), ("control_pairing", CONTROL_PAIRINGS),
                             ("eval_controls", EVAL_CONTROLS)):
            if getattr(self, key) not in choices:
                raise ValueError(f"task.{key} must be one of {list(choices)}, got {getattr(self, key)!r}")
        if self.split == "custom" and not self.custom_split_path:
            raise ValueError("task.split=custom needs task.custom_split_path (a JSON or GEARS pickle of train/val/test)")
        for key in ("hidden_size", "num_go_gnn_layers", "num_gene_gnn_layers"):
            if getattr(self, key) < 1:
                raise ValueError(f"task.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("go_top_k", "coexpression_top_k", "eval_max_cells", "eval_cells_per_forward"):
            if getattr(self, key) < 0:
                raise ValueError(f"task.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("train_gene_set_size", "combo_seen2_train_frac", "test_fraction", "val_fraction"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"task.{key} must be in [0, 1], got {getattr(self, key)}")


PRESETS = {
    # Bundled simulated set (2,800 cells x 200 genes): 20 epochs of 25 steps of 64 cells, tested with the final
    # weights (7 validation conditions make the best-by-validation pick noise); configs/perturbation_gears/gears_tiny.yaml.
    "tiny": {"task": {"hidden_size": 32, "eval_max_cells": 0},
             "train": {"per_device_batch_size": 64, "epochs": 20, "grad_clip_norm": 0.0, "grad_clip_value": 1.0},
             "optim": {"name": "adam", "lr": 1e-3, "weight_decay": 5e-4, "scheduler": "cosine", "warmup_steps": 0},
             "eval": {"every_epochs": 5, "metric": "mse_de", "mode": "min", "batch_size": 8, "test_weights": "final"},
             "log": {"every_steps": 20}},
    # GEARS' recipe: hidden 64, 20 epochs, batch 32, Adam 1e-3 / weight decay 5e-4, the model tested is the
    # best by validation mse_de.
    # StepLR(1 epoch, 0.5) and clip_grad_value_(1.0) as GEARS.
    "paper": {"task": {"hidden_size": 64, "num_go_gnn_layers": 1, "num_gene_gnn_layers": 1},
              "train": {"per_device_batch_size": 32, "epochs": 20, "grad_clip_norm": 0.0, "grad_clip_value": 1.0},
              "optim": {"name": "adam", "lr": 1e-3, "weight_decay": 5e-4, "decay_all_parameters": True, "scheduler": "step",
                        "decay_every_epochs": 1.0, "decay_gamma": 0.5, "warmup_steps": 0},
              "eval": {"every_epochs": 1, "metric": "mse_de", "mode": "min", "batch_size": 8,
                       "test_weights": "best"}},
}
"""Named config layers (`task.preset=NAME`)."""

SPEC = register_spec(TaskSpec(
    name="perturbation_gears",
    task="trainer.families.perturbation_gears.task:PerturbationGearsTask",
    config_cls=PerturbationGearsConfig,
    presets=PRESETS,
    unit="cells",
    metrics=METRIC_NAMES,
    requires=("anndata",),
    extra="perturbation_gears",
))

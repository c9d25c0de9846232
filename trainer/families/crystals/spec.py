"""`crystal_property` as the registry knows it without importing torch: the task options, presets, unit,
metrics, and the `${crystals_sample:NAME}` config resolver. The Task class (`task.py`) is imported only when
a run needs it."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from trainer.errors import DataError
from trainer.registry import register_spec
from trainer.task import TaskConfig, TaskSpec


def crystal_sample_path(name: str = "mlearn_Si_training") -> str:
    """`${crystals_sample:NAME}` in a config: the path of a set bundled with the package
    (`readers.BUNDLED_SAMPLES`, e.g. `jarvis_bandgap_50`); an unknown name is a config error listing them.

    Public sets too big to bundle are `${fetch:NAME}` (trainer/data/fetch.py, `trainer data list`)."""
    from trainer.families.crystals.readers import bundled_crystal_path  # numpy: only when a config names one

    try:
        return str(bundled_crystal_path(name))
    except KeyError as err:
        raise DataError(err.args[0]) from None


# `${crystals_sample:...}` in a YAML config (load_config imports this module when the task is crystal_property).
OmegaConf.register_resolver("crystals_sample", crystal_sample_path, replace=True)


@dataclass
class CrystalPropertyConfig(TaskConfig):
    name: str = "crystal_property"
    """Registered task name."""
    data_path: str = ""
    """Training structures: .extxyz/.xyz(.gz), a folder with id_prop.csv, or mlearn .json(.gz); empty: bundled
    mlearn Si. `${fetch:NAME}` downloads a public set once (`trainer data list`), `${crystals_sample:NAME}` names
    a bundled one (e.g. jarvis_bandgap_50)."""
    test_path: str = ""
    """Held-out test structures (same formats); empty: the bundled mlearn Si test file when data_path is empty,
    else `test_fraction` of data_path."""
    test_target: str = ""
    """Target key of test_path (empty: the same as `target`); e.g. `energy` for an mlearn test file."""
    test_per_atom: bool | None = None
    """Divide the test_path target by the number of atoms (empty/null: the same as `per_atom`)."""
    val_fraction: float = 0.1
    """Share of the training structures used for validation, chosen by hashing their ids."""
    test_fraction: float = 0.0
    """Share of data_path held out as the test set when test_path is empty (by id hash)."""
    target: str = "energy"
    """Target key: extxyz info/array key or mlearn output (`energy`); ignored for id_prop folders (CSV value)."""
    id_key: str = ""
    """extxyz `info` key holding each structure's id (empty: `<folder>/<file>#<frame>`)."""
    per_atom: bool = True
    """Divide the target by the number of atoms (total energy -> energy per atom). The model pools by the mean,
    so targets must be intensive: per-atom energies, band gaps, formation energies per atom."""
    on_invalid: str = "error"
    """Bad records (NaN target, singular cell, overlapping atoms, ...): `error` or `skip` (counted and reported)."""
    cache_dir: str = ""
    """Arrow cache of the parsed graphs (empty: the `datasets` default cache)."""
    num_proc: int = 0
    """Worker processes for graph building (0: one)."""
    graph: str = "knn"
    """Graph kind: `knn` (ComFormer's k nearest neighbours, ties included) or `radius` (all within cutoff)."""
    cutoff: float = 4.0
    """Radius graph cutoff in Å (knn: only where the neighbour search starts)."""
    max_neighbors: int = 25
    """k of the knn graph (the published ComFormer runs use 25)."""
    use_lattice: bool = True
    """Add the lattice self-loop edges to the graph (the lattice-aware edge layer of iComFormer runs either way:
    it reads the three lattice vectors every batch carries)."""
    variant: str = "icomformer"
    """Model: `icomformer` (invariant, default) or `ecomformer` (equivariant, e3nn)."""
    model_preset: str = "tiny"
    """ComFormer size: `tiny` (seconds on CPU) or `paper` (the official hyperparameters)."""
    loss: str = "l1"
    """`l1` (the paper) or `mse`, on standardised targets."""
    standardize: bool = True
    """Scale targets by the training mean and standard deviation (stored as model buffers)."""
    batch_unit: str = "atoms"
    """What data.batching=balanced|budget balances: `atoms` or `edges`."""

    def validate(self) -> None:
        super().validate()
        for key, choices in (("graph", ("knn", "radius")), ("variant", ("icomformer", "ecomformer")),
                             ("loss", ("l1", "mse")), ("batch_unit", ("atoms", "edges")),
                             ("on_invalid", ("error", "skip")), ("model_preset", ("tiny", "paper"))):
            if getattr(self, key) not in choices:
                raise ValueError(f"task.{key} must be one of {list(choices)}, got {getattr(self, key)!r}")


PRESETS = {
    "tiny": {"task": {"model_preset": "tiny", "max_neighbors": 12},
             "train": {"per_device_batch_size": 16, "epochs": 30, "ema_decay": 0.0},
             "optim": {"lr": 2e-3, "scheduler": "cosine", "warmup_steps": 10},
             "eval": {"every_epochs": 5, "metric": "mae"}},
    "paper": {"task": {"model_preset": "paper", "max_neighbors": 25, "loss": "mse"},
              "train": {"per_device_batch_size": 64, "epochs": 500, "grad_clip_norm": 0.0},
              "optim": {"lr": 1e-3, "weight_decay": 1e-5, "scheduler": "onecycle", "warmup_steps": 0},
              "eval": {"every_epochs": 1, "metric": "mae"}},
}
"""Named config layers (`task.preset=NAME`)."""

SPEC = register_spec(TaskSpec(
    name="crystal_property",
    task="trainer.families.crystals.task:CrystalPropertyTask",
    config_cls=CrystalPropertyConfig,
    presets=PRESETS,
    unit="structures",
    metrics=("mae", "rmse", "baseline_mae", "num_structures"),
    extra="crystals",
))

"""The task interface: what a model family gives the Trainer.

A task is a small spec registered by name. It builds a single-device model and its datasets,
collates samples, computes the loss of a micro-batch and per-sample eval values, and names a
`tiny` preset. Nothing here knows about processes, devices or sharding: the Trainer does that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.utils.data import Dataset, default_collate

from trainer.config import TaskConfig


@dataclass
class LossOutput:
    """Loss of one micro-batch: the mean over its units (samples, tokens, atoms), plus scalar logs.

    The units themselves come from `Task.batch_weight`, which the Trainer calls before the forward
    pass: the normalisation over all micro-batches and ranks must be known before backward (DeepSpeed
    steps inside it).
    """

    loss: torch.Tensor
    logs: dict[str, torch.Tensor] = field(default_factory=dict)


class Task:
    """Base class of task specs. Subclasses set `config_cls`, `presets` and implement the hooks."""

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[TaskConfig]] = TaskConfig
    presets: ClassVar[dict[str, dict]] = {"tiny": {}}
    unit: ClassVar[str] = "samples"
    """Name of the unit `batch_weight` counts (samples, tokens, atoms, graphs) for throughput logs."""

    def __init__(self, cfg: TaskConfig, seed: int = 0):
        self.cfg = cfg
        self.seed = seed

    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        """Return (train, eval) map-style datasets; eval may be None."""
        raise NotImplementedError

    def build_test_dataset(self) -> Dataset | None:
        """A held-out test set, evaluated once at the end of a completed run (None: no test split)."""
        return None

    def collate(self, samples: list[Any]) -> Any:
        return default_collate(samples)

    def batch_size(self, batch: Any) -> int:
        """Number of samples in a collated batch (for samples/s)."""
        first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values()))
        return int(first.shape[0])

    def unit_sizes(self, dataset: Dataset) -> Any:
        """Units (`unit`) of each training sample, for data.batching=balanced|budget; None: not supported."""
        return None

    def batch_weight(self, batch: Any) -> torch.Tensor | float:
        """Units in a micro-batch; the loss of an optimizer step is their weighted mean."""
        return float(self.batch_size(batch))

    def loss(self, model: torch.nn.Module, batch: Any) -> LossOutput:
        raise NotImplementedError

    def eval_step(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per-sample values (each shaped [batch]) that `reduce_metrics` turns into metrics."""
        raise NotImplementedError

    def save_artifacts(self, directory: Path) -> None:
        """Write what a checkpoint or export needs besides weights and config (e.g. a tokenizer)."""

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """Metrics over the whole eval set; `values` holds each sample exactly once."""
        return {k: float(v.double().mean()) for k, v in values.items()}

    def write_report(self, values: dict[str, torch.Tensor], metrics: dict[str, float], directory: Path) -> None:
        """Main process, after the test evaluation: every per-sample value once (e.g. for a parity plot)."""

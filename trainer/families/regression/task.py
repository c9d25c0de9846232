"""`regression`: a synthetic linear-plus-noise problem for testing the trainer core."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import Dataset

from trainer.families.regression.spec import SPEC, RegressionConfig
from trainer.registry import register_task
from trainer.seeding import derive_seed
from trainer.task import LossOutput, Task, TaskData

if TYPE_CHECKING:
    from trainer.sample_random import SampleRandom


class SyntheticRegression(Dataset):
    """y = tanh(x A) B + noise, fixed by `data_seed`; `offset` separates train and eval draws."""

    def __init__(self, cfg: RegressionConfig, n: int, offset: int):
        g = torch.Generator().manual_seed(cfg.data_seed)
        a = torch.randn(cfg.in_dim, cfg.in_dim, generator=g) / cfg.in_dim ** 0.5
        b = torch.randn(cfg.in_dim, cfg.out_dim, generator=g) / cfg.in_dim ** 0.5
        g.manual_seed(cfg.data_seed + 1 + offset)
        self.x = torch.randn(n, cfg.in_dim, generator=g)
        self.y = torch.tanh(self.x @ a) @ b + cfg.noise * torch.randn(n, cfg.out_dim, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "index": torch.tensor(i)}


def build_mlp(in_dim: int, hidden: int, out_dim: int, depth: int, dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = in_dim
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.GELU()] + ([nn.Dropout(dropout)] if dropout else [])
        width = hidden
    layers.append(nn.Linear(width, out_dim))
    return nn.Sequential(*layers)


class StreamedRegression:
    """The training set as a stream (`trainer.task.GlobalStream`): a fresh order each epoch, a permutation
    drawn from (seed, epoch); the core shards it by global index. Its epoch need not be whole global batches."""

    def __init__(self, data: SyntheticRegression, seed: int):
        self.data, self.seed, self.epoch = data, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def iter_global(self, wanted: Callable[[int], bool]) -> Iterator[dict[str, torch.Tensor] | None]:
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "stream", self.epoch))
        for g, k in enumerate(torch.randperm(len(self.data), generator=generator).tolist()):
            yield self.data[k] if wanted(g) else None


@register_task(SPEC)  # options, presets, unit and metrics: spec.py
class RegressionTask(Task):
    cfg: RegressionConfig

    def build_model(self, stats: dict) -> nn.Module:
        c = self.cfg
        return build_mlp(c.in_dim, c.hidden, c.out_dim, c.depth, c.dropout)

    def build_data(self) -> TaskData:
        c = self.cfg
        train = SyntheticRegression(c, c.num_train, 0)
        return TaskData(train=StreamedRegression(train, self.seed) if c.streaming else train,
                        eval=SyntheticRegression(c, c.num_eval, 1),
                        test=SyntheticRegression(c, c.num_test, 2) if c.num_test else None)

    def loss(self, model: nn.Module, batch: dict, rng: SampleRandom | None = None) -> LossOutput:
        """Mean squared error; draws nothing (`rng` unused; task.dropout draws from the rank's RNG)."""
        if self.cfg.delay_s:
            time.sleep(self.cfg.delay_s)
        x = batch["x"]
        if self.cfg.nan_sample >= 0:  # a corrupt input row: NaN loss and NaN gradients, as in real life
            x = torch.where((batch["index"] == self.cfg.nan_sample)[:, None], float("nan"), x)
        err = model(x).float() - batch["y"]
        return LossOutput(loss=err.pow(2).mean())

    def eval_step(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        err = model(batch["x"]).float() - batch["y"]
        return {"loss": err.pow(2).mean(dim=1), "mae": err.abs().mean(dim=1), "index": batch["index"]}

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"loss": float(values["loss"].double().mean()), "mae": float(values["mae"].double().mean()),
                "num_samples": float(len(values["loss"])),
                "num_unique": float(values["index"].unique().numel())}

"""A third-party family: predicts the mean of a vector, registered without editing trainer."""

from dataclasses import dataclass

import torch
from torch import nn

from trainer import LossOutput, Task, TaskConfig, TaskData, register_task


@dataclass
class TinyMeanConfig(TaskConfig):
    name: str = "tiny_mean"
    """Registered task name."""
    num_train: int = 64
    """Training vectors."""


class Vectors(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.x[i].mean(0, keepdim=True)}


@register_task("tiny_mean")
class TinyMeanTask(Task):
    config_cls = TinyMeanConfig
    presets = {"tiny": {"train": {"max_steps": 4, "per_device_batch_size": 8}}}

    def build_data(self) -> TaskData:
        return TaskData(train=Vectors(self.cfg.num_train, 0), eval=Vectors(16, 1), stats={"width": 8})

    def build_model(self, stats) -> nn.Module:
        return nn.Linear(stats["width"], 1)

    def loss(self, model, batch) -> LossOutput:
        return LossOutput(loss=(model(batch["x"]) - batch["y"]).pow(2).mean())

    def eval_step(self, model, batch) -> dict:
        return {"loss": (model(batch["x"]) - batch["y"]).pow(2).mean(1)}

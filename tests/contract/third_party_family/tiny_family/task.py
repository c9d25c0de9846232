"""The Task class of `tiny_mean` (torch), imported only when a run needs it."""

import torch
from torch import nn

from tiny_family.spec import SPEC
from trainer import LossOutput, Task, TaskData, register_task


class Vectors(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.x[i].mean(0, keepdim=True)}


@register_task(SPEC)
class TinyMeanTask(Task):
    def build_data(self) -> TaskData:
        return TaskData(train=Vectors(self.cfg.num_train, 0), eval=Vectors(16, 1), stats={"width": 8})

    def build_model(self, stats) -> nn.Module:
        return nn.Linear(stats["width"], 1)

    def loss(self, model, batch, rng) -> LossOutput:  # draws nothing: rng unused
        return LossOutput(loss=(model(batch["x"]) - batch["y"]).pow(2).mean())

    def eval_step(self, model, batch) -> dict:
        return {"loss": (model(batch["x"]) - batch["y"]).pow(2).mean(1)}

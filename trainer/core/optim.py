"""The optimizer and its schedule, built from the `optim` section (the same under every backend)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import get_scheduler

from trainer.config import Config, ConfigError


def build_optimizer(cfg: Config, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Fused optimizer (sync-free skipping via `found_inf`); no weight decay on biases and norms unless
    `optim.decay_all_parameters`."""
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    if o.weight_decay and o.decay_all_parameters:
        groups = [{"params": params, "weight_decay": o.weight_decay}]
    elif o.weight_decay:
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
    else:  # one group, one fused kernel call a step (a second one is measurable on small models)
        groups = [{"params": params, "weight_decay": 0.0}]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=o.momentum, fused=True)
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(groups, lr=lr, betas=tuple(o.betas), eps=o.eps, fused=True)


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, warmup_steps: int) -> Any:
    """A `transformers.get_scheduler` schedule, or `step`: linear warm-up, then StepLR's decay."""
    o = cfg.optim
    if o.scheduler != "step":
        return get_scheduler(o.scheduler, optimizer, num_warmup_steps=warmup_steps,
                             num_training_steps=cfg.train.max_steps)
    if o.decay_every_steps < 1:
        raise ConfigError("optim.scheduler=step needs optim.decay_every_steps (or decay_every_epochs) > 0")

    def factor(step: int) -> float:
        warm = step / warmup_steps if step < warmup_steps else 1.0
        return warm * o.decay_gamma ** (step // o.decay_every_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

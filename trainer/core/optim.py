"""The optimizer and its schedule, built from the `optim` section (the same under every backend)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainer.config import Config, ConfigError

if TYPE_CHECKING:
    from trainer.core.run_plan import RunPlan


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
    return cls(groups, lr=lr, betas=tuple(o.betas), eps=o.eps, amsgrad=o.amsgrad, fused=True)


def native_schedule(name: str, warmup_steps: int, total_steps: int,
                    counts_current: bool = False) -> Callable[[int], float] | None:
    """The LR factor of a step for the common schedules, with transformers' formulas (a test checks them
    against `transformers.get_scheduler`); None for the others. Importing transformers for these would add
    about a second to every process start. `counts_current`: the warm-up counts the step being taken
    (`optim.warmup_counts_current_step`): the whole schedule is taken one step later, so it stays continuous."""
    if name not in ("constant", "constant_with_warmup", "linear", "cosine"):
        return None
    span = max(1, total_steps - warmup_steps)
    offset = int(counts_current)

    def factor(step: int) -> float:
        if name == "constant":  # transformers' `constant` has no warm-up
            return 1.0
        step += offset
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        if name == "linear":
            return max(0.0, (total_steps - step) / span)
        if name == "cosine":
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / span)))
        return 1.0

    return factor


class RunLengthOneCycleLR(torch.optim.lr_scheduler.OneCycleLR):
    """OneCycleLR over this run's steps: a checkpoint restores its position, not its length, so a run resumed with
    another train.max_steps follows the new length (as the other schedules do) instead of stepping past the old one,
    which torch's OneCycleLR refuses."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        own = {key: self.__dict__[key] for key in ("total_steps", "_schedule_phases")}
        super().load_state_dict(state_dict)
        self.__dict__.update(own)


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, plan: RunPlan) -> Any:
    """LambdaLR of linear/cosine/constant(_with_warmup), another `transformers.get_scheduler` schedule,
    `step` (linear warm-up, then StepLR's decay) or `onecycle` (torch's OneCycleLR). Steps, warm-up and decay
    interval are the run plan's."""
    o, warmup_steps, decay_every = cfg.optim, plan.warmup_steps, plan.decay_every_steps
    offset = int(o.warmup_counts_current_step)
    if o.scheduler == "onecycle":
        if warmup_steps:
            raise ConfigError("optim.scheduler=onecycle has its own rise (optim.onecycle_pct_start): set "
                              "optim.warmup_steps=0")
        # Its defaults otherwise (cosine annealing, div_factor 25, final_div_factor 1e4, momentum cycled
        # between 0.85 and 0.95 in Adam's beta1), as ComFormer calls it.
        return RunLengthOneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups],
                                   total_steps=max(1, plan.max_steps), pct_start=o.onecycle_pct_start)
    if o.scheduler != "step":
        factor = native_schedule(o.scheduler, warmup_steps, plan.max_steps, bool(offset))
        if factor is not None:
            return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        if offset and warmup_steps:
            raise ConfigError(f"optim.warmup_counts_current_step is supported with the constant, "
                              f"constant_with_warmup, linear, cosine and step schedulers, not {o.scheduler!r}")
        from transformers import get_scheduler

        return get_scheduler(o.scheduler, optimizer, num_warmup_steps=warmup_steps,
                             num_training_steps=plan.max_steps)
    if decay_every < 1:
        raise ConfigError("optim.scheduler=step needs optim.decay_every_steps (or decay_every_epochs) > 0")

    def factor(step: int) -> float:
        warm = (step + offset) / warmup_steps if step + offset < warmup_steps else 1.0
        return warm * o.decay_gamma ** (step // decay_every)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

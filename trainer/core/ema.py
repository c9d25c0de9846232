"""Exponential moving average of the weights, working on whatever each rank holds.

Under DDP and ZeRO-1/2 every rank holds full parameters; under ZeRO-3 a rank holds a flat
partition, under FSDP2 a shard of each parameter. The EMA keeps an fp32 copy of exactly the local
tensors, which the engine names (`ParamLayout`: engine.py), so its update and its swap into the model
are local operations under every backend; only saving a consolidated copy gathers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class ParamLayout(Protocol):
    """How this rank holds the model's parameters: the engine (engine.py) of the run's backend."""

    def local_tensor(self, param: torch.nn.Parameter) -> torch.Tensor: ...

    def full_tensor(self, param: torch.nn.Parameter, local: torch.Tensor, gather: Any) -> torch.Tensor: ...

    def local_part(self, param: torch.nn.Parameter, full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor: ...

    def reshard(self, model: torch.nn.Module) -> None: ...


def ema_decay(decay: float, num_updates: int, warmup: str = "standard") -> float:
    """The decay of the update after `num_updates` others (`train.ema_warmup`): min(decay, (1 + n) / (10 + n))
    with n = num_updates (`standard`) or num_updates + 1 (`sedd`: its ExponentialMovingAverage counts the update
    being made), or `decay` itself (`none`)."""
    if warmup == "none":
        return decay
    n = num_updates + (1 if warmup == "sedd" else 0)
    return min(decay, (1.0 + n) / (10.0 + n))


class EMA:
    """An fp32 copy of this rank's part of each trainable parameter, as `layout` (the engine) says it holds them."""

    def __init__(self, model: torch.nn.Module, decay: float, layout: ParamLayout, warmup: str = "standard"):
        self.decay = decay
        self.warmup = warmup
        self.num_updates = 0
        self.layout = layout
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shadow = [layout.local_tensor(p).detach().float().clone() for _, p in self._params(model)]

    def _params(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        self.layout.reshard(model)
        params = dict(model.named_parameters())
        return [(n, params[n]) for n in self.names]

    @torch.no_grad()
    def update(self, model: torch.nn.Module, skipped: torch.Tensor | None = None) -> None:
        """Move the average towards the weights. `skipped` (0/1 tensor) freezes it on skipped steps
        without a host synchronisation."""
        d = ema_decay(self.decay, self.num_updates, self.warmup)
        self.num_updates += 1
        current = [self.layout.local_tensor(p).float() for _, p in self._params(model)]
        weight = 1.0 - d if skipped is None else (1.0 - d) * (1.0 - skipped.to(self.shadow[0].device, torch.float32))
        torch._foreach_lerp_(self.shadow, current, weight)

    @contextlib.contextmanager
    @torch.no_grad()
    def applied_to(self, model: torch.nn.Module) -> Iterator[None]:
        """Temporarily put the EMA weights into `model` (for eval, export)."""
        saved = []
        for (_, p), s in zip(self._params(model), self.shadow):
            t = self.layout.local_tensor(p)
            saved.append(t.detach().clone())
            t.copy_(s)
        try:
            yield
        finally:
            for (_, p), old in zip(self._params(model), saved):
                self.layout.local_tensor(p).copy_(old)

    @torch.no_grad()
    def full_state(self, model: torch.nn.Module, gather) -> dict[str, torch.Tensor]:
        """Consolidated fp32 EMA weights by parameter name; `gather` concatenates a tensor from all
        ranks (a collective: every rank must call this)."""
        return {name: self.layout.full_tensor(p, shadow, gather)
                for (name, p), shadow in zip(self._params(model), self.shadow)}

    @torch.no_grad()
    def load_full(self, model: torch.nn.Module, full: dict[str, torch.Tensor], rank: int,
                  num_updates: int) -> None:
        """Load a consolidated EMA state dict, taking this rank's part where parameters are sharded."""
        for i, (name, p) in enumerate(self._params(model)):
            if name not in full:
                raise KeyError(f"EMA weights lack parameter '{name}'")
            self.shadow[i].copy_(self.layout.local_part(p, full[name].float(), self.shadow[i], rank))
        self.num_updates = num_updates

"""Exponential moving average of the weights, working on whatever each rank holds.

Under DDP and ZeRO-1/2 every rank holds full parameters; under ZeRO-3 a rank holds a flat
partition (`param.ds_tensor`), under FSDP2 a shard of each parameter (a DTensor's local tensor).
The EMA keeps an fp32 copy of exactly the local tensors, so its update and its swap into the model
are local operations under every backend; only saving a consolidated copy gathers.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch


def local_tensor(param: torch.nn.Parameter) -> torch.Tensor:
    """The part of `param` this rank owns: the ZeRO-3 partition or the FSDP2 shard if there is one, else the tensor."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor
    if hasattr(param, "to_local"):  # a DTensor (FSDP2): its shard, a view of the parameter's storage
        return param.data.to_local()
    return param.data


def _reshard(model: torch.nn.Module) -> None:
    """FSDP2 leaves the root's parameters whole after a forward without backward (an evaluation): shard them
    again, so that the model's parameters are the DTensors whose shards the EMA follows. Elsewhere nothing."""
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)  # imported if in use
    if fsdp_module is not None and isinstance(model, fsdp_module):
        for module in model.modules():
            if isinstance(module, fsdp_module):
                module.reshard()


def ema_decay(decay: float, num_updates: int) -> float:
    """Decay with warm-up: min(decay, (1 + n) / (10 + n))."""
    return min(decay, (1.0 + num_updates) / (10.0 + num_updates))


class EMA:
    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.num_updates = 0
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shadow = [local_tensor(p).detach().float().clone() for _, p in self._params(model)]

    def _params(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        _reshard(model)
        params = dict(model.named_parameters())
        return [(n, params[n]) for n in self.names]

    @torch.no_grad()
    def update(self, model: torch.nn.Module, skipped: torch.Tensor | None = None) -> None:
        """Move the average towards the weights. `skipped` (0/1 tensor) freezes it on skipped steps
        without a host synchronisation."""
        d = ema_decay(self.decay, self.num_updates)
        self.num_updates += 1
        current = [local_tensor(p).float() for _, p in self._params(model)]
        weight = 1.0 - d if skipped is None else (1.0 - d) * (1.0 - skipped.to(self.shadow[0].device, torch.float32))
        torch._foreach_lerp_(self.shadow, current, weight)

    @contextlib.contextmanager
    @torch.no_grad()
    def applied_to(self, model: torch.nn.Module) -> Iterator[None]:
        """Temporarily put the EMA weights into `model` (for eval, export)."""
        saved = []
        for (_, p), s in zip(self._params(model), self.shadow):
            t = local_tensor(p)
            saved.append(t.detach().clone())
            t.copy_(s)
        try:
            yield
        finally:
            for (_, p), old in zip(self._params(model), saved):
                local_tensor(p).copy_(old)

    @torch.no_grad()
    def full_state(self, model: torch.nn.Module, gather) -> dict[str, torch.Tensor]:
        """Consolidated fp32 EMA weights by parameter name; `gather` concatenates a tensor from all
        ranks (a collective: every rank must call this)."""
        full = {}
        for (name, p), shadow in zip(self._params(model), self.shadow):
            if hasattr(p, "ds_tensor"):  # ZeRO-3: flat partitions in rank order, padding at the end
                full[name] = gather(shadow.flatten())[: p.ds_numel].view(p.ds_shape).clone()
            elif hasattr(p, "to_local"):  # FSDP2: the shard laid out as the parameter's, then gathered whole
                from torch.distributed.tensor import DTensor

                full[name] = DTensor.from_local(shadow, p.device_mesh, p.placements, shape=p.shape,
                                                stride=p.stride()).full_tensor().clone()
            else:
                full[name] = shadow.clone()
        return full

    @torch.no_grad()
    def load_full(self, model: torch.nn.Module, full: dict[str, torch.Tensor], rank: int,
                  num_updates: int) -> None:
        """Load a consolidated EMA state dict, taking this rank's ZeRO-3 slice where params are partitioned."""
        for i, (name, p) in enumerate(self._params(model)):
            if name not in full:
                raise KeyError(f"EMA weights lack parameter '{name}'")
            src = full[name].float()
            if hasattr(p, "ds_tensor"):
                # ZeRO-3 layout: the flattened parameter, zero-padded, split evenly across ranks.
                size = self.shadow[i].numel()
                part = src.flatten()[rank * size:(rank + 1) * size]
                out = torch.zeros(size)
                out[: part.numel()] = part
                src = out.view_as(self.shadow[i])
            elif hasattr(p, "to_local"):  # FSDP2: this rank's shard, as the parameter's own
                from torch.distributed.tensor import distribute_tensor

                src = distribute_tensor(src.to(self.shadow[i].device), p.device_mesh, p.placements,
                                        src_data_rank=None).to_local()  # each rank cuts its own: no collective
            self.shadow[i].copy_(src)
        self.num_updates = num_updates

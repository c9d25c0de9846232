"""Gradient clipping and the non-finite step guard, with no host synchronisation.

A step whose loss or gradient is not finite is skipped: weights, optimizer moments and step counts
stay untouched because the fused optimizers honour a `found_inf` tensor, as under a GradScaler.

One flag a step, from the gradient norm that clipping computes anyway. A non-finite loss does not
always make its gradients non-finite (`loss + inf` has the gradients of `loss`), so backward is seeded
with `1 + 0 x loss`: exactly 1 for a finite loss, NaN otherwise, which turns every gradient of that
micro-batch into NaN. The norm is that of the summed gradients of all ranks (computed after DDP's
all-reduce, or globally by FSDP), so every rank derives the same flag with no extra collective.

The flags stay on the device; `read` fetches them at logging steps only. Under DeepSpeed the engine
clips and skips overflowing steps itself and its own counter is read instead.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class StepGuard:
    """Clips the global gradient norm (then, with `clip_value`, each component) and turns non-finite steps into
    skipped ones.

    `optimizer` is the torch optimizer (fused: it honours `found_inf`); `plain`: clip with torch
    directly rather than through accelerate's wrapper, which would only forward the call;
    `deepspeed`: the engine clips and skips, the guard only counts.
    """

    def __init__(self, accelerator: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], *,
                 max_norm: float, skip_nonfinite: bool, max_in_row: int, plain: bool, deepspeed: bool,
                 fp16: bool = False, clip_value: float = 0.0):
        self.accelerator = accelerator
        self.optimizer = optimizer
        self.params = params
        self.max_norm = max_norm if max_norm > 0 else math.inf  # 0: no clipping, but the norm is still logged
        self.clip_value = clip_value  # > 0: then every component is clipped to [-clip_value, clip_value]
        self.active = skip_nonfinite and not deepspeed
        self.max_in_row = max_in_row
        self.plain = plain
        self.deepspeed = deepspeed
        self.scaler_skips = accelerator.scaler is not None  # the GradScaler owns found_inf and skips by itself
        # An fp16 loss scale overflows on purpose now and then: count those steps, never abort on them.
        self.may_abort = not fp16
        self._flags: list[torch.Tensor] = []  # one 0./1. flag per step since the last `read`
        self._run = 0  # skipped steps in a row, carried across reads
        self._engine_skipped = 0  # DeepSpeed's cumulative counter at the last read
        self._zero: torch.Tensor | None = None
        self._one: torch.Tensor | None = None

    def backward_seed(self, loss: torch.Tensor) -> torch.Tensor | None:
        """The gradient to seed `loss.backward` with: exactly 1 when `loss` is finite, NaN otherwise."""
        if not self.active:
            return None
        if self._one is None:  # device constants: tensor-tensor kernels are cheaper than Python-number operands
            self._zero, self._one = (torch.tensor(v, dtype=torch.float32, device=loss.device) for v in (0.0, 1.0))
        return torch.add(self._one, loss.detach(), alpha=0)  # 1 + 0 x loss, one kernel

    def clip(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Clip the gradients; returns (global grad norm, 0./1. flag: step skipped), None under DeepSpeed.

        Call after the last backward of the step and before `optimizer.step()`.
        """
        if self.deepspeed:
            return None, None
        if self.plain:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        else:
            norm = self.accelerator.clip_grad_norm_(self.params, self.max_norm)
        if self.clip_value > 0:  # the gradients are unscaled now (accelerate did it for the norm)
            torch.nn.utils.clip_grad_value_(self.params, self.clip_value, foreach=True)
        if not self.active:
            return norm.detach(), None
        norm = norm.detach().float()  # found_inf must be fp32; a no-op for the usual fp32 norm
        if self._zero is None:
            self._zero = torch.zeros((), device=norm.device)
        # x - x is 0 for finite x and NaN otherwise; ne_ turns that into a 0./1. flag in place.
        skipped = torch.sub(norm, norm).ne_(self._zero)
        self._flags.append(skipped)
        if not self.scaler_skips:
            self.optimizer.grad_scale = None
            self.optimizer.found_inf = skipped
        return norm, skipped

    def resume(self, model: Any) -> None:
        """After loading a checkpoint: DeepSpeed's restored counter is not new skips."""
        if self.deepspeed:
            self._engine_skipped = int(getattr(model, "skipped_steps", 0))

    def read(self, model: Any = None) -> tuple[int, int]:
        """(steps skipped since the last read, longest run of skipped steps in a row); reads the device.

        Under DeepSpeed `model` is the engine, whose counter is read (it counts, it does not report runs).
        """
        if self.deepspeed:
            total = int(getattr(model, "skipped_steps", 0))
            new, self._engine_skipped = total - self._engine_skipped, total
            return new, new
        flags = torch.stack(self._flags).tolist() if self._flags else []
        self._flags.clear()
        longest = 0
        for bad in flags:
            self._run = self._run + 1 if bad else 0
            longest = max(longest, self._run)
        return int(sum(flags)), longest

    def check(self, longest: int, step: int) -> None:
        """Abort after `max_in_row` skipped steps in a row (never for fp16 loss-scaler overflows)."""
        if longest >= self.max_in_row and self.may_abort:
            raise NonFiniteLossError(
                f"{longest} optimizer steps in a row had a non-finite loss or gradient (up to step {step}); "
                f"lower optim.lr, enable train.grad_clip_norm or check the data")

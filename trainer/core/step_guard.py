"""The non-finite step guard, with no host synchronisation.

A step whose loss or gradient is not finite is skipped: weights, optimizer moments and step counts
stay untouched because the fused optimizers honour a `found_inf` tensor, as under a GradScaler.

One flag a step, from the gradient norm that clipping computes anyway. A non-finite loss does not
always make its gradients non-finite (`loss + inf` has the gradients of `loss`), so backward is seeded
with `1 + 0 x loss`: exactly 1 for a finite loss, NaN otherwise, which turns every gradient of that
micro-batch into NaN. The norm is that of the summed gradients of all ranks (computed after DDP's
all-reduce, or globally by FSDP), so every rank derives the same flag with no extra collective.

The flags stay on the device; `read` fetches them at logging steps only. Where loss and norm live in
host memory (a CPU run: `on_host`), reading them is no device synchronisation and costs less than the
flag's kernels and the fused optimizer's `found_inf` path: the guard then reads them, seeds and flags
only a non-finite step, and a finite step runs exactly as without the guard. The guard knows no backend:
the engine (engine.py) decides whether it seeds, flags and may abort.
"""

from __future__ import annotations

import math

import torch

from trainer.errors import TrainerError


class NonFiniteLossError(TrainerError, RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class StepGuard:
    """Turns non-finite steps into skipped ones and counts them.

    `optimizer` is the torch optimizer (fused: it honours `found_inf`), or None when something else
    skips steps (a GradScaler owns `found_inf`). `active=False` seeds and flags nothing.
    `may_abort=False` counts runs of skipped steps but never stops (an fp16 loss scale overflows on
    purpose now and then). `advice` ends the error message: what to change in this run's config.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None, *, active: bool, max_in_row: int,
                 may_abort: bool = True, advice: str = "check the data", on_host: bool = False):
        self.optimizer = optimizer
        self.active = active
        self.on_host = on_host
        """Loss and gradients are in host memory: read them instead of keeping flags on the device."""
        self.max_in_row = max_in_row
        self.may_abort = may_abort
        self.advice = advice
        self._flags: list[torch.Tensor | float] = []  # one 0./1. flag per step since the last `read`
        self._run = 0  # skipped steps in a row, carried across reads
        self._zero: torch.Tensor | None = None
        self._one: torch.Tensor | None = None

    def state_dict(self) -> dict[str, int]:
        """A checkpoint part: skipped steps in a row so far."""
        return {"nonfinite_in_row": self._run}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._run = int(state.get("nonfinite_in_row", 0))

    def backward_seed(self, loss: torch.Tensor) -> torch.Tensor | None:
        """The gradient to seed `loss.backward` with: exactly 1 when `loss` is finite, NaN otherwise."""
        if not self.active:
            return None
        if self.on_host:
            return None if math.isfinite(loss.item()) else torch.full_like(loss.detach(), math.nan)
        if self._one is None:  # device constants: tensor-tensor kernels are cheaper than Python-number operands
            self._zero, self._one = (torch.tensor(v, dtype=torch.float32, device=loss.device) for v in (0.0, 1.0))
        return torch.add(self._one, loss.detach(), alpha=0)  # 1 + 0 x loss, one kernel

    def flag(self, norm: torch.Tensor) -> torch.Tensor | None:
        """The 0./1. flag "this step is skipped" from the global gradient norm, handed to the optimizer.

        Call after clipping and before `optimizer.step()`; None when the guard is off.
        """
        if not self.active:
            return None
        if self.on_host:
            return self._flag_on_host(norm)
        # found_inf must be fp32 and outside autograd. The engine hands over a detached fp32 norm: checking costs
        # less than the two dispatcher calls of detach().float(), and this runs every step.
        if norm.requires_grad:
            norm = norm.detach()
        if norm.dtype != torch.float32:
            norm = norm.float()
        if self._zero is None:
            self._zero = torch.zeros((), device=norm.device)
        # x - x is 0 for finite x and NaN otherwise; ne_ turns that into a 0./1. flag in place.
        skipped = torch.sub(norm, norm).ne_(self._zero)
        self._flags.append(skipped)
        if self.optimizer is not None:
            self.optimizer.grad_scale = None
            self.optimizer.found_inf = skipped
        return skipped

    def _flag_on_host(self, norm: torch.Tensor) -> torch.Tensor | None:
        """The host path of `flag`: None for a finite norm (the optimizer steps as without a guard), else a 1.
        flag (found_inf) that makes the optimizer skip the step."""
        skipped = None if math.isfinite(norm.item()) else torch.ones((), device=norm.device)
        self._flags.append(0.0 if skipped is None else 1.0)
        if self.optimizer is not None:
            self.optimizer.grad_scale = None
            self.optimizer.found_inf = skipped
        return skipped

    def read(self) -> tuple[int, int]:
        """(steps skipped since the last read, longest run of skipped steps in a row); reads the device."""
        if self._flags and isinstance(self._flags[0], float):
            flags = list(self._flags)
        else:
            flags = torch.stack(self._flags).tolist() if self._flags else []
        self._flags.clear()
        return int(sum(flags)), self.count_runs(flags)

    def count_runs(self, flags: list[float]) -> int:
        """The longest run of skipped steps in `flags`, continuing the run the previous read ended in."""
        longest = 0
        for bad in flags:
            self._run = self._run + 1 if bad else 0
            longest = max(longest, self._run)
        return longest

    def check(self, longest: int, step: int) -> None:
        """Stop after `max_in_row` skipped steps in a row, with advice that fits the config."""
        if longest >= self.max_in_row and self.may_abort:
            raise NonFiniteLossError(
                f"{longest} optimizer steps in a row had a non-finite loss or gradient (up to step {step}); "
                f"{self.advice}")


def nonfinite_advice(lr: float, grad_clip_norm: float) -> str:
    """What to try when steps keep failing, given what the run already does."""
    if grad_clip_norm > 0:
        return (f"gradients are already clipped (train.grad_clip_norm={grad_clip_norm:g}): lower optim.lr "
                f"(now {lr:.3g}) or look for non-finite inputs or targets in the data")
    return (f"lower optim.lr (now {lr:.3g}), enable train.grad_clip_norm (e.g. 1.0) or look for non-finite "
            f"inputs or targets in the data")

"""Adaptive gradient clipping (`train.grad_clip_mode=adaptive`), EDM's rule.

The limit of a step is 1.5 x mean + 2 x std (population) of a queue of recent gradient norms, seeded with one
large value that later norms flush out; each step then adds its norm, or the limit when the norm exceeded it.
The queue is training state: a checkpoint part (JSON under its name in trainer_state.json), so a resume
continues with the same limits. It follows the global norm (after the gradients are all-reduced), so it is
the same on every rank. Kept on the device as a ring of fixed size, updated without a host synchronisation.
"""

from __future__ import annotations

from typing import Any

import torch

_EPS = 1e-6
"""What torch's clip_grad_norm_ adds to the norm before dividing (the same coefficient as the reference's)."""


class AdaptiveClip:
    """A queue of the last `history` (clipped) gradient norms and the clipping it implies."""

    def __init__(self, history: int, initial: float, device: torch.device | str = "cpu"):
        self.history = history
        self.initial = initial
        # float64: the reference computes the limit with numpy, in double precision
        self.values = torch.zeros(history, dtype=torch.float64, device=device)
        self.valid = torch.zeros(history, dtype=torch.bool, device=device)
        self.values[0], self.valid[0] = initial, True
        self.count = torch.ones((), dtype=torch.long, device=device)
        """Values written so far (the seed included); the next one goes to slot count % history."""

    def limit(self) -> torch.Tensor:
        """This step's maximum norm: 1.5 x mean + 2 x std of the queue (a float64 device scalar)."""
        weight = self.valid.to(self.values.dtype)
        n = weight.sum()
        mean = (self.values * weight).sum() / n
        std = (((self.values - mean) ** 2) * weight).sum().div(n).sqrt()
        return 1.5 * mean + 2.0 * std

    @torch.no_grad()
    def clip_(self, grads: list[torch.Tensor], norm: torch.Tensor) -> torch.Tensor:
        """Scale `grads` (whose global norm is `norm`) down to this step's limit and add the norm, or the limit
        when clipped, to the queue; a non-finite norm (a skipped step) leaves the queue as it was. Returns the
        limit."""
        limit = self.limit()
        coef = (limit.to(norm.dtype) / (norm + _EPS)).clamp(max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        keep = torch.isfinite(norm).to(self.values.device)
        added = torch.minimum(norm.to(self.values), limit)
        pos = (self.count % self.history).view(1)
        self.values.index_copy_(0, pos, torch.where(keep, added, self.values.index_select(0, pos)))
        self.valid.index_copy_(0, pos, self.valid.index_select(0, pos) | keep)
        self.count += keep.long()
        return limit

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint part: the queue as written, slot by slot (read once, at a save)."""
        return {"norms": self.values.tolist(), "valid": self.valid.tolist(), "count": int(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the queue; an empty state (a checkpoint written without adaptive clipping) keeps the seed."""
        if not state:
            return
        norms = state.get("norms")
        if not isinstance(norms, list) or len(norms) != self.history or len(state.get("valid", [])) != self.history:
            got = len(norms) if isinstance(norms, list) else norms
            raise ValueError(f"trainer_state.json: field 'grad_clip.norms' holds {got} norms, but "
                             f"train.adaptive_clip_history is {self.history}; resume with the run's own value")
        self.values.copy_(torch.tensor(norms, dtype=torch.float64))
        self.valid.copy_(torch.tensor(state["valid"], dtype=torch.bool))
        self.count.fill_(int(state["count"]))

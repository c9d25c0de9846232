"""Key map between our DDiT and the reference SEDD model (louaaron/Score-Entropy-Discrete-Diffusion, MIT).

The parameter names are the same one for one; the only difference is ``rotary_emb.inv_freq``, a persistent
buffer in the reference's ``Rotary`` and a non-persistent one in ours (it is a fixed function of the head
dimension, so our checkpoints do not carry it). Used by the parity check (``scripts/parity/sedd.py``) and by
whatever loads reference checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from trainer.state_dicts import strip_wrapper_prefixes

ROTARY_KEY = "rotary_emb.inv_freq"


def rotary_inv_freq(head_dim: int, base: float = 10_000) -> torch.Tensor:
    """The rotary frequencies both implementations compute for ``head_dim`` (fp32)."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))


def from_reference_state_dict(state_dict: Mapping[str, torch.Tensor], source: str = "reference state dict"
                              ) -> dict[str, torch.Tensor]:
    """Reference SEDD state dict -> ours (load with ``strict=True``).

    Drops ``rotary_emb.inv_freq`` after checking it equals the frequencies ours computes: a checkpoint whose
    buffer differs would give a different model, so it is an error naming ``source`` rather than a silent drop.
    """
    sd = strip_wrapper_prefixes(state_dict)
    inv_freq = sd.pop(ROTARY_KEY, None)
    if inv_freq is not None:
        expected = rotary_inv_freq(2 * inv_freq.numel())
        if not torch.allclose(inv_freq.detach().float().cpu(), expected, rtol=1e-6, atol=0.0):
            raise ValueError(f"{source}: field '{ROTARY_KEY}' is not the standard rotary frequencies for head "
                             f"dimension {2 * inv_freq.numel()} (base 10000); our DDiT cannot represent it")
    return sd


def reference_state_dict(state_dict: Mapping[str, torch.Tensor], n_heads: int) -> dict[str, torch.Tensor]:
    """Our DDiT state dict -> the reference's (``SEDD.load_state_dict(..., strict=True)`` accepts it).

    ``n_heads`` gives the head dimension (hidden size / heads) for the ``rotary_emb.inv_freq`` buffer the
    reference expects.
    """
    sd = strip_wrapper_prefixes(state_dict)
    if "vocab_embed.embedding" not in sd:
        raise ValueError("state dict has no 'vocab_embed.embedding': not a DDiT state dict")
    hidden = sd["vocab_embed.embedding"].shape[1]
    if hidden % n_heads:
        raise ValueError(f"hidden size {hidden} (from 'vocab_embed.embedding') is not divisible by n_heads {n_heads}")
    sd[ROTARY_KEY] = rotary_inv_freq(hidden // n_heads).to(sd["vocab_embed.embedding"].device)
    return sd

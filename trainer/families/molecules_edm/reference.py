"""Key map between our EDM and the reference (ehoogeboom/e3_diffusion_for_molecules, MIT).

The reference names its EGNN blocks and their layers by ``add_module`` strings (``egnn.e_block_0.gcl_1.``,
``egnn.e_block_0.gcl_equiv.``) where ours uses module lists (``egnn.blocks.0.gcls.1.``,
``egnn.blocks.0.equivariant.``); its predefined noise schedule is a frozen parameter ``gamma.gamma`` (ours: the
buffer ``gamma``), and its ``EnVariationalDiffusion`` carries an unused ``buffer`` (a zero used to find the
device). Every other name and every shape is the same. Works on a dynamics state dict (``egnn.*``) as well as on
a whole diffusion's (``dynamics.egnn.*`` + schedule). Used by the parity check (``scripts/parity/edm.py``) and by
whatever loads reference checkpoints.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from trainer.state_dicts import strip_wrapper_prefixes

REFERENCE_GAMMA = "gamma.gamma"
REFERENCE_BUFFER = "buffer"

_TO_OURS = [(re.compile(r"(^|\.)e_block_(\d+)\.gcl_(\d+)\."), r"\1blocks.\2.gcls.\3."),
            (re.compile(r"(^|\.)e_block_(\d+)\.gcl_equiv\."), r"\1blocks.\2.equivariant.")]
_TO_REFERENCE = [(re.compile(r"(^|\.)blocks\.(\d+)\.gcls\.(\d+)\."), r"\1e_block_\2.gcl_\3."),
                 (re.compile(r"(^|\.)blocks\.(\d+)\.equivariant\."), r"\1e_block_\2.gcl_equiv.")]


def _rename(key: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, repl in rules:
        key = pattern.sub(repl, key)
    return key


def from_reference_state_dict(state_dict: Mapping[str, torch.Tensor], source: str = "reference state dict"
                              ) -> dict[str, torch.Tensor]:
    """Reference EDM state dict (``EnVariationalDiffusion`` or ``EGNN_dynamics_QM9``) -> ours (strict).

    Drops ``buffer`` after checking it is the reference's zero; a learned noise schedule (``gamma.l1...``, EDM's
    ``GammaNetwork``) has no counterpart here and is an error naming ``source``.
    """
    sd = strip_wrapper_prefixes(state_dict)
    buf = sd.pop(REFERENCE_BUFFER, None)
    if buf is not None and bool(buf.ne(0).any()):
        raise ValueError(f"{source}: field '{REFERENCE_BUFFER}' is not zero; not an EnVariationalDiffusion buffer")
    learned = sorted(k for k in sd if k.startswith("gamma.") and k != REFERENCE_GAMMA)
    if learned:
        raise ValueError(f"{source}: fields {learned[:3]} are a learned noise schedule (GammaNetwork); only the "
                         f"predefined schedules ('{REFERENCE_GAMMA}') are supported")
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        out["gamma" if k == REFERENCE_GAMMA else _rename(k, _TO_OURS)] = v
    return out


def reference_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our EDM state dict (``EDMDiffusion`` or ``EGNNDynamics``) -> the reference's (its ``load_state_dict(...,
    strict=True)`` accepts it); a diffusion's also gets the reference's zero ``buffer``."""
    sd = strip_wrapper_prefixes(state_dict)
    if not any(k.startswith(("egnn.", "dynamics.egnn.")) for k in sd):
        raise ValueError("state dict has no 'egnn.*' or 'dynamics.egnn.*' keys: not an EDM state dict")
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        out[REFERENCE_GAMMA if k == "gamma" else _rename(k, _TO_REFERENCE)] = v
    if REFERENCE_GAMMA in out:
        out[REFERENCE_BUFFER] = torch.zeros(1, dtype=out[REFERENCE_GAMMA].dtype, device=out[REFERENCE_GAMMA].device)
    return out

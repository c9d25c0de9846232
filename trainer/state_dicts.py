"""Helpers for state dicts that other code wrote (a reference implementation's checkpoint, a wrapped model's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
"""What DDP (`module.`) and `torch.compile` (`_orig_mod.`) put before every key of the model they wrap."""


def strip_wrapper_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """`state_dict` without the prefix a DDP or `torch.compile` wrapper gave every key (in either nesting), so a
    checkpoint saved from a wrapped model maps like one saved from the bare model. Keys that do not all carry a
    prefix keep it."""
    out = dict(state_dict)
    for prefix in WRAPPER_PREFIXES:
        if out and all(k.startswith(prefix) for k in out):
            out = {k[len(prefix):]: v for k, v in out.items()}
    return out

"""Weights-only loading of every pickle a checkpoint holds, DeepSpeed's included.

Plain and DDP checkpoints are safetensors plus pickles that accelerate loads with
`torch.load(weights_only=True)`. DeepSpeed loads its own files (`pytorch_model/*_model_states.pt`,
`*_optim_states.pt`) with `weights_only=False`, so a pickle payload planted in a ZeRO checkpoint
would run on resume, export and sample. Inside `weights_only_loading()`, every `torch.load` call is
forced to `weights_only=True` with an explicit allow-list of the few non-tensor types DeepSpeed
stores (found by loading ZeRO-1/2/3 and offload checkpoints); anything else is refused with a
`CheckpointError` that names the file and the type.

What is trusted: the code of the installed packages. What is not: the bytes of a checkpoint directory
(the manifest's hashes catch accidents, not an attacker who can rewrite the manifest too).
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from trainer.errors import CheckpointError

# Non-tensor types found in DeepSpeed 0.15-0.19 checkpoints (ZeRO-1/2/3, CPU offload, fp16/bf16). All
# are plain data holders: constructing them runs no code beyond setting attributes.
DEEPSPEED_TYPES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

_lock = threading.Lock()


def _resolve(name: str) -> Any | None:
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def safe_globals() -> list[Any]:
    """Everything weights-only loading may construct besides tensors and builtins.

    DeepSpeed's types only once DeepSpeed is imported (the code that reads its files imports it):
    importing it for a plain checkpoint would print its "Setting accelerator to CPU" warning."""
    from accelerate.utils.other import TORCH_SAFE_GLOBALS  # numpy arrays and dtypes of the RNG states

    if "deepspeed" not in sys.modules:
        return list(TORCH_SAFE_GLOBALS)
    extra = [obj for obj in map(_resolve, DEEPSPEED_TYPES) if obj is not None]
    return [*TORCH_SAFE_GLOBALS, *extra]


@contextlib.contextmanager
def weights_only_loading() -> Iterator[None]:
    """Within the block, `torch.load` always loads weights-only with `safe_globals()`; a file that
    needs anything else raises CheckpointError instead of running its code."""
    original = torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True  # overrides DeepSpeed's explicit weights_only=False
        try:
            with torch.serialization.safe_globals(safe_globals()):  # per call: DeepSpeed may be imported since
                return original(f, *args, **kwargs)
        except pickle.UnpicklingError as err:
            # torch names the offending global in one of its middle paragraphs
            found = re.search(r"(Unsupported (global|operand)|Trying to load unsupported)[^\n]*", str(err))
            reason = found.group(0).rstrip(".") if found else "not a weights-only pickle"
            raise CheckpointError(f"refusing to load {f}: it holds objects that weights-only loading does not "
                                  f"allow, so loading it could run code ({reason})") from None

    with _lock:
        torch.load = load
        try:
            yield
        finally:
            torch.load = original

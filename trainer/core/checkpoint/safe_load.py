"""Weights-only loading of every pickle a checkpoint holds, DeepSpeed's included.

Plain and DDP checkpoints are safetensors plus pickles that accelerate loads with
`torch.load(weights_only=True)`. DeepSpeed loads its own files (`pytorch_model/*_model_states.pt`,
`*_optim_states.pt`) with `weights_only=False`, so a pickle payload planted in a ZeRO checkpoint
would run on resume, export and sample. Inside `weights_only_loading()`, every `torch.load` call is
forced to `weights_only=True` with an explicit allow-list of the few non-tensor types DeepSpeed
stores (found by loading ZeRO-1/2/3 and offload checkpoints); anything else is refused with a
`CheckpointError` that names the file and the type.

torch.distributed.checkpoint (DCP: an FSDP run's sharded checkpoint) reads its tensors weights-only, but
unpickles its `.metadata` file with plain `pickle.load` and the non-tensor entries (the optimizer's
hyper-parameters) with a full-pickle torch load. Inside `weights_only_loading()` the latter is forced
weights-only as above, and the metadata is read by `DCPMetadataUnpickler`, which constructs DCP's own
metadata records (dataclasses of sizes, offsets and file names), torch.Size, dtypes and builtins only.

What is trusted: the code of the installed packages. What is not: the bytes of a checkpoint directory
(the manifest's hashes catch accidents, not an attacker who can rewrite the manifest too).
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import dataclasses
import enum
import importlib
import os
import pickle
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from trainer.errors import CheckpointError, first_line

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
        except CheckpointError:
            raise
        except (RuntimeError, EOFError, UnicodeDecodeError, ValueError, OSError) as err:
            # Garbled or truncated bytes: torch's reader names no file, and a caller several frames up
            # (DeepSpeed's converter) does not know which one it was reading.
            name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
            if name is None or (isinstance(err, OSError) and err.filename):  # an OSError naming its file says it
                raise
            raise CheckpointError(f"checkpoint file {name} cannot be read ({first_line(err)}): it is damaged, "
                                  f"or not what its name says") from err

    with _lock:
        torch.load = load
        dcp_files = _dcp_filesystem()
        if dcp_files is not None:
            dcp_files.pickle = _SafeDCPPickle()
        try:
            yield
        finally:
            torch.load = original
            if dcp_files is not None:
                dcp_files.pickle = pickle


# DCP's metadata: dataclasses of these modules, and torch's value types.
DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
               "torch.distributed.checkpoint._extension")
OTHER_GLOBALS = {("torch.serialization", "_get_layout"),  # a layout by name, as weights-only loading allows
                 ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}  # the save's path
BUILTINS = ("set", "frozenset", "list", "dict", "tuple", "bytes", "bytearray", "slice", "complex")


class DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file constructing only DCP's metadata records and torch's value types."""

    def find_class(self, module: str, name: str) -> Any:
        obj = None
        if module in DCP_MODULES and not name.startswith("__"):
            obj = _resolve(f"{module}.{name}")
            obj = obj if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)) \
                else None
        elif module == "torch":
            obj = getattr(torch, name, None)
            obj = obj if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) \
                else None
        elif (module, name) in OTHER_GLOBALS:
            obj = _resolve(f"{module}.{name}")
        elif module == "collections" and name == "OrderedDict":
            obj = collections.OrderedDict
        elif module == "builtins" and name in BUILTINS:
            obj = getattr(builtins, name)
        if obj is None:
            raise CheckpointError(f"refusing to load a torch.distributed.checkpoint .metadata file: it holds "
                                  f"'{module}.{name}', which is no checkpoint metadata, so loading it could run code")
        return obj


def load_dcp_metadata(file: Any) -> Any:
    """`pickle.load` of a DCP `.metadata` file (an open binary file) through `DCPMetadataUnpickler`."""
    try:
        return DCPMetadataUnpickler(file).load()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - truncated or garbled bytes
        raise CheckpointError(f"a torch.distributed.checkpoint .metadata file is unreadable ({type(err).__name__}: "
                              f"{err})") from None


class _SafeDCPPickle:
    """Stands in for the `pickle` module inside torch.distributed.checkpoint.filesystem while loading."""

    load = staticmethod(load_dcp_metadata)

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)


def _dcp_filesystem() -> Any | None:
    try:
        from torch.distributed.checkpoint import filesystem
    except ImportError:  # torch without distributed support
        return None
    return filesystem if getattr(filesystem, "pickle", None) is pickle else None

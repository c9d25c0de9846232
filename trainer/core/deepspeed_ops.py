"""DeepSpeed's CPU communication op, compiled once per Python environment.

DeepSpeed compiles it on first use into torch's extension folder, which by default is shared by every
environment of the user (`~/.cache/torch_extensions`): two environments (a clone's `.venv`, a wheel
installed elsewhere) then rebuild it over each other, and a run rebuilds what set-up built. Keyed to the
environment (`<sys.prefix>/var/torch_extensions`), set-up's build (`make setup`, `build_ops`) is the one
every run of that environment loads (a run that must build it says so first: `distributed.announce_deepspeed_cpu_op_build`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

logger = logging.getLogger("trainer")

SHM_OP = "ShareMemCommBuilder"


def environment_op_dir() -> Path:
    """This Python environment's folder for compiled torch extensions."""
    return Path(sys.prefix) / "var" / "torch_extensions"


def use_environment_op_cache(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """Point torch's extension folder at this environment's (unless TORCH_EXTENSIONS_DIR is set, or the
    environment is read-only, e.g. a system Python: then torch's default stays); returns the folder used."""
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(environ["TORCH_EXTENSIONS_DIR"])
    folder = environment_op_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK):
        return None
    environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    return folder


def _shm_builder():
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(SHM_OP)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def build_ops() -> str:
    """Compile the op into this environment's folder now (set-up); returns what was done, in words."""
    folder = use_environment_op_cache()
    builder = _shm_builder()
    if builder is None:
        return "DeepSpeed's CPU communication op is not used on this machine: nothing to build"
    builder.load(verbose=False)
    return f"DeepSpeed's CPU communication op is built in {folder or 'torch default extension folder'}"


if __name__ == "__main__":
    print(build_ops())

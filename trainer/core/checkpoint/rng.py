"""Every rank's random streams in a checkpoint: `random_states_<rank>.pkl` as accelerate's `save_state` writes it,
read and checked before the backend's loader (which swallows a failure there) and applied after it (`RNGState`)."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.utils import gather_object
from accelerate.utils import load as accelerate_load

from trainer.core.checkpoint.safe_load import weights_only_loading
from trainer.errors import CheckpointError

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger("trainer")


RNG_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")
"""What accelerate saves in `random_states_<rank>.pkl` and a resume restores (plus the CUDA states on GPUs)."""


def saved_rng_states(acc: Accelerator, path: Path, saved_world_size: int | None,
                     allow_inexact: bool, warn: bool = True) -> dict[str, Any] | None:
    """This rank's RNG states, loaded and checked before `load_state`, which swallows any error there
    (logging it at INFO) and resumes with other random streams. Every rank agrees: an unloadable state
    on any rank is a CheckpointError naming the file, or with run.allow_inexact_resume a warning (None).
    A rank beyond the world size that wrote the checkpoint (DDP may grow) starts fresh streams (None), said unless
    `warn` is False (nothing will be trained from the checkpoint)."""
    name = f"random_states_{acc.process_index}.pkl"
    states, problem = None, None
    if isinstance(saved_world_size, int) and acc.process_index >= saved_world_size:
        if warn:
            logger.warning("rank %d has no saved RNG state (the checkpoint was written by %d processes): it "
                           "continues with fresh random streams", acc.process_index, saved_world_size)
    else:
        try:
            states = _load_rng_states(path / name)
        except Exception as err:  # noqa: BLE001 - whatever it is, the random streams cannot be restored
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]  # torch's are paragraphs long
            problem = (f"checkpoint {path}: {name} (rank {acc.process_index}'s RNG state) cannot be restored "
                       f"({reason})")
    problems = [problem] if problem else []
    if acc.num_processes > 1:
        problems = [p for p in gather_object([problem]) if p is not None]
    if not problems:
        return states
    if not allow_inexact:
        raise CheckpointError(f"{'; '.join(problems)}; the resume would not be exact. Set "
                              f"run.allow_inexact_resume=true to resume with fresh random streams anyway")
    if problem is not None:
        logger.warning("INEXACT RESUME (run.allow_inexact_resume=true): %s; this rank continues with fresh "
                       "random streams, so dropout and noise differ from an uninterrupted run", problem)
    return None


def _load_rng_states(file: Path) -> dict[str, Any]:
    with weights_only_loading():
        states = accelerate_load(file)
    keys = RNG_KEYS + (("torch_cuda_manual_seed",) if torch.cuda.is_available() else ())
    missing = [k for k in keys if k not in states] if isinstance(states, dict) else list(keys)
    if missing:
        raise ValueError(f"it lacks {', '.join(missing)}")
    # Applied to throwaway generators: a state of the wrong shape fails here, not after load_state.
    random.Random().setstate(states["random_state"])
    np.random.RandomState().set_state(states["numpy_random_seed"])
    torch.Generator().set_state(states["torch_manual_seed"])
    return states


def rng_file_states(acc: Accelerator) -> dict[str, Any]:
    """This rank's `random_states_<rank>.pkl` as accelerate's `save_state` writes it on CPU and CUDA devices."""
    states = {"step": acc.step, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
              "torch_manual_seed": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: dict[str, Any]) -> None:
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available():  # per visible device, as saved (fewer devices now: those there are)
        for device, state in enumerate(states["torch_cuda_manual_seed"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)



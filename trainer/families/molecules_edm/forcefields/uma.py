"""fairchem UMA (e.g. `uma-s-1p1`) as a batched force field: one `predict` per batch.

Each molecule becomes fairchem's `AtomicData` for the `omol` task with charge 0 and spin multiplicity 1
(neutral singlet), built from the sampler's tensors where they are (what `AtomicData.from_ase` builds for a
molecule without a cell; no copy to the host), the batch is collated by fairchem's own
`data_list_collater(..., otf_graph=True)` (the model builds its radius graph itself, so pymatgen is not
needed), and one `predict` returns energies [B] (eV) and forces [atoms, 3] (eV/Angstrom): `compute_tensors`,
the guidance path; `compute` is the same on numpy arrays.

Needs the `fairchem-core` package (not a dependency of trainer: `pip install fairchem-core`) and the
weights offline: a model name is looked up in the local Hugging Face hub cache only (HF_HUB_OFFLINE=1
is set before fairchem is imported unless the user set HF_HUB_OFFLINE), or pass a local checkpoint
file path. Either is missing -> ConfigError at construction, naming the package or the cache folder.

Security: fairchem unpickles its checkpoints in full (they hold pickled
configuration objects), which can run code from the file: use trusted checkpoint files only.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from trainer.errors import ConfigError
from trainer.families.molecules_edm.forcefields import validate_batch
from trainer.families.molecules_edm.forcefields.base import DeviceBatch, ForceBatch, ForceResult

logger = logging.getLogger(__name__)

UMA_TASK = "omol"
"""The UMA head for molecules (OMol25: DFT on molecules with charge and spin)."""


def _fairchem_available() -> bool:
    try:
        return importlib.util.find_spec("fairchem.core") is not None
    except ModuleNotFoundError:  # no `fairchem` namespace at all
        return False


def hub_cache_dirs() -> list[str]:
    """The folders where a UMA checkpoint downloaded by fairchem may be cached (fairchem's own cache,
    then the Hugging Face hub cache), from the same environment variables those libraries read."""
    home = os.path.expanduser("~")
    hf_home = os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.join(home, ".cache")),
                                                     "huggingface"))
    dirs = [os.environ.get("FAIRCHEM_CACHE_DIR", os.path.join(home, ".cache", "fairchem")),
            os.environ.get("HF_HUB_CACHE", os.environ.get("HUGGINGFACE_HUB_CACHE", os.path.join(hf_home, "hub")))]
    return list(dict.fromkeys(dirs))


@contextmanager
def _hub_offline(forced: bool) -> Iterator[None]:
    """The Hugging Face hub offline while a model is loaded, when we (not the user) chose HF_HUB_OFFLINE.

    huggingface_hub reads the variable when it is imported, and `datasets` may have imported it before
    us: its parsed constant is then set for the duration of the load as well.
    """
    constants = None
    if forced:
        try:
            from huggingface_hub import constants
        except ImportError:
            pass
    previous = getattr(constants, "HF_HUB_OFFLINE", None)
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        if constants is not None:
            constants.HF_HUB_OFFLINE = previous


class UMAForceField:
    """fairchem UMA energies and forces for padded batches of neutral singlet molecules (`omol` task).

    Args:
        model: a model name (`uma-s-1p1`, `uma-m-1p1`, ...: from the local hub cache only) or a path to
            a checkpoint file (trusted files only: fairchem unpickles it).
        device: `cpu` or `cuda` (default: cuda when available).
        inference_settings: fairchem's inference settings name or object; default: the general
            settings with MOLE experts not merged and no compilation (batches mix compositions).

    After each `compute`, `last_errors` maps the batch index of every failed molecule to the reason.
    """

    def __init__(self, model: str = "uma-s-1p1", device: str | None = None, inference_settings: Any = None) -> None:
        if not model:
            raise ConfigError("uma: needs a model name (e.g. uma:uma-s-1p1) or a checkpoint file path (uma:/path/to/uma.pt)")
        if not _fairchem_available():
            raise ConfigError(f"the UMA force field {model!r} needs fairchem: pip install fairchem-core "
                              "(a large install: torch, e3nn, hydra, ...), and the UMA weights as a checkpoint file "
                              "(uma:/path/to/uma-s-1p1.pt) or in the Hugging Face hub cache "
                              f"({', '.join(hub_cache_dirs())})")
        self._offline_forced = "HF_HUB_OFFLINE" not in os.environ
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before fairchem (and its huggingface_hub) is imported
        import torch

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model
        self.name = f"uma:{Path(model).stem if os.sep in model or model.endswith('.pt') else model}"
        self.predictor = self._load(model, inference_settings)
        self.last_errors: dict[int, str] = {}

    def _load(self, model: str, inference_settings: Any) -> Any:
        from fairchem.core.calculate import pretrained_mlip
        from fairchem.core.units.mlip_unit.api.inference import InferenceSettings

        if inference_settings is None:
            # merged MOLE experts assume one fixed composition: not so for a batch of generated molecules
            inference_settings = InferenceSettings(tf32=False, merge_mole=False, compile=False, external_graph_gen=False)
        path = Path(model).expanduser()
        if path.is_file():
            logger.info("loading UMA checkpoint %s (fairchem unpickles it: trusted files only)", path)
            return pretrained_mlip.load_predict_unit(str(path), inference_settings=inference_settings, device=self.device)
        names = tuple(getattr(pretrained_mlip, "available_models", ()))
        if model not in names:
            raise ConfigError(f"uma:{model} is neither a checkpoint file nor a fairchem model name; "
                              f"names: {', '.join(names) or '(none listed)'}")
        try:
            with _hub_offline(self._offline_forced):
                return pretrained_mlip.get_predict_unit(model, inference_settings=inference_settings, device=self.device)
        except Exception as error:  # huggingface_hub's offline "not in cache" errors have no common base
            raise ConfigError(f"the UMA weights {model!r} are not available offline: not found in the hub cache "
                              f"({', '.join(hub_cache_dirs())}). Download them where there is internet access "
                              "(huggingface-cli download facebook/UMA, a gated repository), or pass a checkpoint "
                              f"file: uma:/path/to/{model}.pt ({type(error).__name__}: {error})") from error

    def __repr__(self) -> str:
        return f"UMAForceField({self.model!r}, device={self.device!r})"

    def _data(self, numbers: Any, positions: Any) -> Any:
        """fairchem's AtomicData of one neutral singlet molecule, built from tensors where they are (what
        `AtomicData.from_ase` builds for a molecule without a cell: no periodicity, a unit cell, no edges: the
        model makes its own radius graph)."""
        import torch
        from fairchem.core.datasets.atomic_data import AtomicData

        device, count = positions.device, int(numbers.shape[0])

        def longs(*values: int) -> Any:
            return torch.tensor(values, dtype=torch.long, device=device)

        return AtomicData(pos=positions.to(torch.float32), atomic_numbers=numbers.to(torch.long),
                          cell=torch.eye(3, device=device).unsqueeze(0), pbc=torch.zeros(1, 3, dtype=torch.bool, device=device),
                          natoms=longs(count), edge_index=torch.empty(2, 0, dtype=torch.long, device=device),
                          cell_offsets=torch.empty(0, 3, device=device), nedges=longs(0), charge=longs(0), spin=longs(1),
                          fixed=torch.zeros(count, dtype=torch.long, device=device),
                          tags=torch.zeros(count, dtype=torch.long, device=device), sid=[""], dataset=UMA_TASK)

    def _predict(self, items: list[tuple[Any, Any]]) -> tuple[Any, Any]:
        """Energies [len(items)] eV and forces [sum of atoms, 3] eV/Angstrom (tensors) from one predict call."""
        from fairchem.core.datasets import data_list_collater

        batch = data_list_collater([self._data(z, x) for z, x in items], otf_graph=True)
        prediction = self.predictor.predict(batch)
        return prediction["energy"].detach().reshape(-1), prediction["forces"].detach().reshape(-1, 3)

    def compute_tensors(self, numbers: Any, positions: Any, mask: Any) -> ForceBatch:
        """numbers [B, N], positions [B, N, 3] Angstrom, mask [B, N] (tensors) -> ForceBatch on positions' device.

        One predict for the batch, on the predictor's device; if it raises, each molecule is predicted alone
        so that only the molecules that fail are marked not ok.
        """
        import torch

        run = DeviceBatch.prepare(numbers, positions, mask, self.device, torch.float32)
        counts = run.mask.sum(dim=1)
        # an empty row is another force field's molecule (routing); UMA does not model isolated atoms (fairchem
        # uses tabulated references for them)
        rows = run.screen([(counts > 0, None), (counts > 1, "fewer than 2 atoms"),
                           (run.finite_positions(), "non-finite positions")]).tolist()
        self.last_errors = run.errors
        items = [(run.numbers[b, run.mask[b]], run.positions[b, run.mask[b]]) for b in rows]
        try:
            results = [self._predict(items)] if items else []
            groups = [rows]
        except Exception as error:  # isolate the molecules that make the batch fail
            logger.debug("%s: batched predict failed (%s); predicting molecule by molecule", self.name, error)
            results, groups = [], []
            for b, item in zip(rows, items):
                try:
                    results.append(self._predict([item]))
                    groups.append([b])
                except Exception as single_error:
                    self.last_errors[b] = f"{type(single_error).__name__}: {single_error}"
        sizes = counts.tolist()
        for (group_energy, group_forces), group in zip(results, groups):
            start = 0
            for k, b in enumerate(group):
                run.forces[b, run.mask[b]] = group_forces[start:start + sizes[b]].to(run.forces)
                start += sizes[b]
                run.energy[b] = group_energy[k].to(run.energy)
                run.ok[b] = True
        return run.result("non-finite energy or forces")

    def compute(self, numbers: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> ForceResult:
        """numbers [B, N] int, positions [B, N, 3] Angstrom, mask [B, N] bool -> ForceResult (eV, eV/Angstrom)."""
        import torch

        numbers, positions, mask = validate_batch(numbers, positions, mask, name=self.name)
        return self.compute_tensors(torch.as_tensor(numbers), torch.as_tensor(positions),
                                    torch.as_tensor(mask)).to_numpy()

    def close(self) -> None:
        """Drop the model (idempotent)."""
        self.predictor = None

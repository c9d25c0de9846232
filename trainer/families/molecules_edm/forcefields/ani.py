"""ANI-1x (Smith et al. 2018; wB97x/6-31G(d); H C N O) as a batched force field on the caller's device.

The model is torchani 2.9's `ANI` built from the NeuroChem parameter files of the 8-network ensemble, which
`trainer data fetch ani1x` extracts (checksummed) into the data cache; nothing is downloaded at run time and a
missing cache is one line naming that command. torchani is the `molecules_mlff` extra.

One call evaluates the whole padded batch: species [B, N] (-1 at padding), positions in Angstrom, fp32, energy
in Hartree converted to eV (the constants of `ase.units`, as the xTB adapter), forces = -d(energy)/d(positions)
by autograd, on the device of the positions (CPU or GPU: no copy to the host). With the ensemble (the default),
the energy and forces are the members' mean, and the same forward gives the spread of the members' energies
(`energy_spread`: their standard deviation divided by the atom count, eV/atom; torchani's QBC divides by the
square root instead); `force_spread` (members' forces, one backward each) is computed by `compute`, the
evaluation path, and by `compute_tensors(..., force_spread=True)`. `model_index=k` evaluates network k alone
(no spread). Guided sampling pushes with one network (`guidance_network`, default 0: one network's work instead
of the whole ensemble's, with molecules of the same quality in the MLFF guidance benchmark) unless it needs the spread
(`max_uncertainty`); the members are evaluated together, one batched matmul per element and layer
(`FusedEnsemble`).

ANI-1x barely repels atoms pushed closer than any bond it was trained on, so by default torchani's ZBL screened
nuclear repulsion is added below 0.8 Å (`repulsion_cutoff`; every QM9 bond is longer, so energies and forces of
real molecules are the published model's).

A molecule is not ok (left unguided by guidance, counted by the metrics) when it holds an element outside
H C N O (`supported_numbers`; routing.py sends it to a fallback), has non-finite positions, or gives non-finite
values (coincident atoms).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.errors import ConfigError
from trainer.families.molecules_edm.forcefields import validate_batch
from trainer.families.molecules_edm.forcefields.base import (
    DeviceBatch,
    ForceBatch,
    ForceResult,
    closest_pair_distance,
    modelled_atoms,
)

ANI1X_ELEMENTS = ("H", "C", "N", "O")
ANI1X_NUMBERS = frozenset({1, 6, 7, 8})
ENSEMBLE_SIZE = 8
REPULSION_CUTOFF = 0.8
"""Angstrom: below it ZBL nuclear repulsion is added. ANI-1x was trained near equilibrium and barely repels two
atoms pushed closer than any bond (0.15 eV/Å between two H at 0.3 Å); strong guidance then lets atoms collapse."""
MIN_DISTANCE = 0.25
"""Angstrom: a molecule with two atoms closer than this is not evaluated (not ok: left unguided, counted), as
GFN2-xTB fails there too; the repulsion's forces at such distances (thousands of eV/Å) would throw atoms apart."""
DATA_SET = "ani1x"
"""The `trainer data` entry holding the parameter files."""


class FusedEnsemble(torch.nn.Module):
    """torchani's ensemble of per-element networks with the members stacked: one batched matmul per element and
    layer for all members at once, instead of one small matmul per member (the same function and values to float
    rounding; far fewer operations, which is what a small batch pays for). Called as torchani calls its
    `AtomicContainer`: (element indices [B, A] with -1 at padding, AEVs [B, A, F], atomic, ensemble_values)."""

    def __init__(self, ensemble: Any) -> None:
        super().__init__()
        members = list(ensemble.members)
        self.num_species = ensemble.num_species
        self.symbols = tuple(members[0].atomics.keys())
        self.members = len(members)
        self.weights = torch.nn.ParameterList()
        self.biases = torch.nn.ParameterList()
        self.depth = 0
        for symbol in self.symbols:
            nets = [m.atomics[symbol] for m in members]
            layers = [[*net.layers, net.final_layer] for net in nets]
            if {len(stack) for stack in layers} != {len(layers[0])} or (self.depth and len(layers[0]) != self.depth) \
                    or any(type(net.activation).__name__ != "TightCELU" for net in nets):
                raise ConfigError("ani1x: the fused ensemble expects equally deep CELU(0.1) networks for every "
                                  "element and member (ANI-1x's)")
            self.depth = len(layers[0])
            for depth in range(self.depth):
                weight = torch.stack([layer[depth].weight.detach().t() for layer in layers])  # [M, in, out]
                bias = torch.stack([layer[depth].bias.detach() for layer in layers]).unsqueeze(1)  # [M, 1, out]
                self.weights.append(torch.nn.Parameter(weight, requires_grad=False))
                self.biases.append(torch.nn.Parameter(bias, requires_grad=False))

    def forward(self, elem_idxs: torch.Tensor, aevs: torch.Tensor | None = None, atomic: bool = False,
                ensemble_values: bool = False) -> torch.Tensor:
        """Per-molecule energies ([B], or per atom [B, A] with `atomic`), the members' mean or each member's
        ([M, ...] with `ensemble_values`)."""
        flat = elem_idxs.flatten()
        features = aevs.flatten(0, 1)
        out = features.new_zeros(self.members, flat.numel())
        for species in range(len(self.symbols)):
            rows = (flat == species).nonzero().view(-1)
            if rows.numel() == 0:
                continue
            h = features.index_select(0, rows).unsqueeze(0)  # [1, n, F]: shared by every member
            for depth in range(self.depth):
                k = species * self.depth + depth
                h = torch.baddbmm(self.biases[k], h.expand(self.members, -1, -1), self.weights[k])
                if depth + 1 < self.depth:
                    h = torch.nn.functional.celu(h, alpha=0.1)  # torchani's TightCELU
            out = out.index_add(1, rows, h.squeeze(-1))
        out = out.view(self.members, *elem_idxs.shape)
        if not atomic:
            out = out.sum(-1)
        return out if ensemble_values else out.mean(0)


def build_ani1x_model(model_index: int | None = None, cache: str | Path | None = None,
                      repulsion_cutoff: float = 0.0) -> Any:
    """torchani's `ANI` for ANI-1x from the fetched parameter files (the ensemble, or network `model_index`);
    with `repulsion_cutoff` > 0, plus torchani's ZBL screened nuclear repulsion, smoothly cut off there."""
    if importlib.util.find_spec("torchani") is None:
        raise ConfigError("the ani1x force field needs torchani 2.9: pip install 'sciml-trainer[molecules_mlff]' "
                          "(make setup installs it), then `trainer data fetch ani1x`")
    from trainer.data.fetch import locate

    root = locate(DATA_SET, cache)
    os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")  # its CUDA extensions are optional
    from torchani.arch import ANI
    from torchani.neurochem import NeurochemInfo, modules_from_info

    lines = (root / "ani-1x_8x.info").read_text(encoding="utf-8").split()
    info = NeurochemInfo(const=root / lines[0], sae=root / lines[1], ensemble_prefix=root / lines[2],
                         ensemble_size=int(lines[3]))
    aev, networks, self_energies, symbols = modules_from_info(info, model_index)
    potentials = None
    if repulsion_cutoff > 0:
        from torchani.potentials.zbl import RepulsionZBL

        potentials = {"repulsion_zbl": RepulsionZBL(symbols, cutoff=float(repulsion_cutoff))}
    model = ANI(symbols, aev, networks, self_energies, potentials=potentials, periodic_table_index=True)
    if model_index is None:
        model.potentials["nnp"].neural_networks = FusedEnsemble(networks)
    return model


class ANIForceField:
    """ANI-1x energies, forces and ensemble spread for padded batches of H/C/N/O molecules.

    Args:
        model_index: None (default): the 8-network ensemble's mean, with its spread; 0-7: that network alone.
        device: where the model runs; default: the device of each batch's positions (`compute`: CPU).
        cache: the data cache holding `ani1x` (default: $TRAINER_DATA_CACHE or the user cache).
        dtype: `float32` (the model's own precision) or `float64` (for numerical checks).
        guidance_network: the network whose forces push guided molecules (`for_guidance()`; 0-7), or None for the
            ensemble mean (all 8 networks' work); guidance with `max_uncertainty` always uses the ensemble (its
            spread).
            Evaluation (`compute`) always uses the ensemble.
        repulsion_cutoff: Angstrom; > 0 adds the ZBL screened nuclear repulsion below it (smoothly cut off), which
            ANI-1x lacks (0: the published model alone). The default leaves every bond of QM9 (>= 0.96 Å) unchanged.

    After each call, `last_errors` maps the batch index of every failed molecule to the reason.
    """

    supported_numbers = ANI1X_NUMBERS

    def __init__(self, model_index: int | None = None, device: str | None = None, cache: str | None = None,
                 dtype: str = "float32", repulsion_cutoff: float = REPULSION_CUTOFF,
                 guidance_network: int | None = 0) -> None:
        if model_index is not None and (isinstance(model_index, bool) or not isinstance(model_index, int)
                                        or not 0 <= model_index < ENSEMBLE_SIZE):
            raise ConfigError(f"ani1x model_index must be empty (the ensemble) or 0-{ENSEMBLE_SIZE - 1}, got {model_index!r}")
        if dtype not in ("float32", "float64"):
            raise ConfigError(f"ani1x dtype must be float32 or float64, got {dtype!r}")
        from ase.units import Hartree

        self.dtype = getattr(torch, dtype)
        self.model_index = model_index
        self.ensemble = model_index is None
        self.name = "ani1x" if self.ensemble else f"ani1x[{model_index}]"
        self.device = None if device is None else torch.device(device)
        if isinstance(repulsion_cutoff, bool) or not isinstance(repulsion_cutoff, int | float) or repulsion_cutoff < 0:
            raise ConfigError(f"ani1x repulsion_cutoff must be a number >= 0 (Angstrom; 0: none), got {repulsion_cutoff!r}")
        if guidance_network is not None and (isinstance(guidance_network, bool) or not isinstance(guidance_network, int)
                                             or not 0 <= guidance_network < ENSEMBLE_SIZE):
            raise ConfigError(f"ani1x guidance_network must be 0-{ENSEMBLE_SIZE - 1} or empty (the ensemble mean), "
                              f"got {guidance_network!r}")
        self.repulsion_cutoff = float(repulsion_cutoff)
        self.guidance_network = guidance_network
        self._options = {"device": device, "cache": cache, "dtype": dtype, "repulsion_cutoff": repulsion_cutoff}
        self._pusher: ANIForceField | None = None
        self.model = build_ani1x_model(model_index, cache, self.repulsion_cutoff).eval().to(self.dtype)
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self._on = torch.device("cpu")
        self.model.to(self.device or self._on)
        self._on = self.device or self._on
        self._hartree = float(Hartree)
        self.last_errors: dict[int, str] = {}

    def __repr__(self) -> str:
        return f"ANIForceField(model_index={self.model_index}, device={self.device})"

    def _model_on(self, device: Any) -> Any:
        if device != self._on:
            self.model.to(device)
            self._on = device
        return self.model

    def compute_tensors(self, numbers: Any, positions: Any, mask: Any, force_spread: bool = False) -> ForceBatch:
        """numbers [B, N] int, positions [B, N, 3] Angstrom, mask [B, N] bool (tensors) -> ForceBatch on
        positions' device (eV, eV/Angstrom). One forward (and one backward; `force_spread`: one per member)."""
        device = self.device or positions.device
        run = DeviceBatch.prepare(numbers, positions, mask, device, self.dtype, energy_spread=self.ensemble,
                                  force_spread=self.ensemble and force_spread)
        numbers, mask = run.numbers, run.mask
        supported = modelled_atoms(numbers, mask, ANI1X_NUMBERS)

        def outside(b: int) -> str:
            return f"atomic number(s) {sorted(set(numbers[b][mask[b] & ~supported[b]].tolist()))} outside ANI-1x (H C N O)"

        rows = run.screen([(mask.any(dim=1), "no atoms"), (supported.all(dim=1), outside),
                           (run.finite_positions(), "non-finite positions"),
                           (closest_pair_distance(run.positions, mask) >= MIN_DISTANCE,
                            f"two atoms closer than {MIN_DISTANCE} Å")])
        self.last_errors = run.errors
        if len(rows):
            sub_mask = mask[rows]
            n = int(sub_mask.nonzero()[:, 1].max()) + 1  # up to the last real atom (a mask need not be a prefix)
            sub_mask = sub_mask[:, :n]
            counts = sub_mask.sum(dim=1).double()
            species = torch.where(sub_mask, numbers[rows, :n], torch.full_like(numbers[rows, :n], -1))
            x = run.positions[rows, :n]
            coords = torch.where(sub_mask.unsqueeze(-1), x, torch.zeros_like(x))
            with torch.enable_grad():
                coords.requires_grad_(True)
                _, members = self._model_on(device)((species, coords), ensemble_values=True)  # [M, b] Hartree
                if run.force_spread is not None:
                    grads = torch.stack([torch.autograd.grad(members[m].sum(), coords, retain_graph=True)[0]
                                         for m in range(members.shape[0])])
                    member_forces = -grads.double() * self._hartree
                    sub_forces = member_forces.mean(dim=0)
                    variance = (member_forces.var(dim=0) * sub_mask.unsqueeze(-1)).sum(dim=(1, 2)) / (3 * counts)
                    run.force_spread[rows] = variance.sqrt()
                else:
                    sub_forces = -torch.autograd.grad(members.mean(dim=0).sum(), coords)[0].double() * self._hartree
            members = members.detach().double() * self._hartree
            run.energy[rows] = members.mean(dim=0)
            run.forces[rows, :n] = sub_forces * sub_mask.unsqueeze(-1)
            run.ok[rows] = True
            if run.energy_spread is not None:
                run.energy_spread[rows] = members.std(dim=0) / counts
        return run.result("non-finite energy or forces (coincident atoms?)")

    def compute(self, numbers: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> ForceResult:
        """numbers [B, N] int, positions [B, N, 3] Angstrom, mask [B, N] bool -> ForceResult (eV, eV/Angstrom),
        with the ensemble's energy and force spread. Runs on `device` (default CPU)."""
        numbers, positions, mask = validate_batch(numbers, positions, mask, name=self.name)
        device = self.device or torch.device("cpu")
        result = self.compute_tensors(torch.as_tensor(numbers, device=device), torch.as_tensor(positions, device=device),
                                      torch.as_tensor(mask, device=device), force_spread=self.ensemble)
        return result.to_numpy()

    def for_guidance(self, needs_spread: bool = False) -> ANIForceField:
        """The evaluator of guided sampling: network `guidance_network` alone (built once), or this ensemble when
        `guidance_network` is None or the spread is needed (`max_uncertainty`). Its name stays this one's."""
        if needs_spread or self.guidance_network is None or not self.ensemble:
            return self
        if self._pusher is None:
            self._pusher = ANIForceField(model_index=self.guidance_network, guidance_network=None, **self._options)
            self._pusher.name = self.name
        return self._pusher

    def close(self) -> None:
        """Nothing to release (the model is freed with the object)."""

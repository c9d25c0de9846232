"""Force-field guidance of EDM's sampler: the rule of the seed's system (liyy2/Elign), as an explicit step.

What this follows: `edm_source/mlff_modules/mlff_guided_diffusion_core.py::apply_mlff_guidance` of
liyy2/Elign. After each ancestral step z_s ~ p(z_s | z_t) with sigma_t <= `noise_threshold` (sigma of
the noisier time t), for each of `iterations` iterations: decode the types (argmax, done by the sampler),
compute forces F (eV/Angstrom) at the current positions (Angstrom), optionally clip each atom's force
norm, displacement = (scale / iterations) * (1 - sigma_t) * F, optionally clip each atom's displacement
norm, x += displacement, re-centre on the masked mean.

Added by default (the seed has neither; `displacement_clip=None, hh_distance=None` is its rule): each atom's
displacement is clipped at 0.005 Angstrom per iteration, and two atoms the force field sees as hydrogen are pushed
out to 1.4 Angstrom apart after the move (`hold_floor`), so a strong scale does not tear the molecule into
fragments, H2 pairs and lone atoms (why: the fields' docstrings). Other bounds, kept as settings: a per-step bound
proportional to sigma_t (`step_bound`), a floor for every pair (`min_distance`), a push fading out towards the end
(`schedule="fade"`).

Deliberately different from the reference (its bugs): a molecule whose force evaluation fails
(`ok = False`) is left unguided on that step and counted, instead of getting a constant fake force;
scale 0.0 returns the positions tensor itself, so the sampler's output equals the baseline bit for bit;
nothing here draws random numbers; statistics are counters, not per-step INFO logs.

Forces come through `compute_on_device`: an MLFF (ani1x) evaluates the batch where the sampler's tensors are,
a numpy force field (tblite) through one host round trip. A force field that models fewer elements than the
sampler decodes is routed with a fallback (forcefields/routing.py): counted per force field (`scored_<name>`),
or, without a fallback, left unguided and counted (`unsupported`); with `types="forcefield"` (and with the default
`types="auto"` when the force field does not model every type the sampler makes) the sampler decodes the types for
this hook among the force field's elements (`decode_among`), so none needs the fallback. With
`max_uncertainty`, a molecule whose ensemble energy spread exceeds it on a step is not pushed (`uncertain_skips`).

A force field with `for_guidance()` (GFN-xTB) is evaluated through that evaluator: an electronic-temperature
ladder with a per-rung SCF cap and warm starts (forcefields/xtb.py), whose rung per result is counted
(`evaluations_<rung label>`), so a set reports how many of its forces came from each rung.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer.errors import ConfigError
from trainer.families.molecules_edm.egnn import remove_mean_with_mask
from trainer.families.molecules_edm.forcefields.base import (
    ForceField,
    compute_on_device,
    guidance_evaluator,
    modelled_atoms,
    scoring_forcefield,
)

log = logging.getLogger(__name__)


GUIDANCE_TYPES: tuple[str, ...] = ("auto", "argmax", "forcefield")
"""The values of `GuidanceConfig.types` (`guidance.types`)."""


def types_seen(types: str, atomic_numbers_of_types: Sequence[int], supported_numbers: Sequence[int] | None) -> str:
    """`types` with `auto` resolved: `forcefield` when the force field models only some of the sampler's types
    (ANI-1x and QM9's F: under `argmax` most molecules of the noisy guided steps hold an F and would all go to the
    fallback, at the fallback's speed), else `argmax` (the two agree there). None: the force field models every
    element."""
    if types != "auto":
        return types
    missing = supported_numbers is not None and any(int(z) not in supported_numbers for z in atomic_numbers_of_types)
    return "forcefield" if missing else "argmax"


def evaluations_line(total: int, forcefield: ForceField, types: str, atomic_numbers_of_types: Sequence[int]) -> str:
    """`total` guidance force evaluations as the start line names them: which force field takes them, and with
    `types=auto` resolved to `forcefield` why (said once, before sampling)."""
    from ase.data import chemical_symbols

    name = str(getattr(forcefield, "name", "?"))
    supported = getattr(forcefield, "supported_numbers", None)
    names = list(getattr(forcefield, "names", [name]))
    primary = names[0]
    if supported is None:
        return f"{total:,} {name} force evaluations"
    modelled = " ".join(chemical_symbols[int(z)] for z in atomic_numbers_of_types if int(z) in supported)
    others = " ".join(chemical_symbols[int(z)] for z in atomic_numbers_of_types if int(z) not in supported)
    seen = types_seen(types, atomic_numbers_of_types, supported)
    if seen == "forcefield" or not others:
        why = ""
        if types == "auto" and others:
            why = (f" (guidance.types=auto: {primary} models {modelled}, not {others}, so it sees each atom as the most "
                   f"likely of {modelled}; the sampler's own types are unchanged; guidance.types=argmax would send a "
                   f"molecule holding {others} to {names[1] if len(names) > 1 else 'the fallback'})")
        return f"{total:,} {primary} force evaluations{why}"
    if len(names) > 1 and names[1] != "none":
        return (f"{total:,} force evaluations, by {primary} for a molecule of {modelled} only and by {names[1]} for one "
                f"holding {others} (guidance.types=argmax: most molecules of the noisier guided steps, at {names[1]}'s "
                f"speed)")
    return (f"{total:,} force evaluations by {primary}, a molecule holding {others} left unguided on that step "
            f"(guidance.types=argmax, no fallback force field)")


DISPLACEMENT_CLIP = 0.005
"""Angstrom: the default `GuidanceConfig.displacement_clip` (why: its docstring)."""
HH_DISTANCE = 1.4
"""Angstrom: the default `GuidanceConfig.hh_distance` (why: its docstring)."""

GUIDANCE_SCHEDULES: tuple[str, ...] = ("seed", "fade")
"""The values of `GuidanceConfig.schedule`."""


@dataclass
class GuidanceConfig:
    """Options of force-field guidance (units: Angstrom per eV/Angstrom for `scale`)."""

    scale: float
    iterations: int = 1
    noise_threshold: float = 0.8
    """Guide only steps whose sigma_t is at most this (0.8: the last 632 of 1000 steps of polynomial_2)."""
    force_clip: float | None = None
    """Largest per-atom force norm (eV/Angstrom) used; None: no clip."""
    displacement_clip: float | None = DISPLACEMENT_CLIP
    """Largest per-atom displacement norm (Angstrom) per iteration; None: no clip (the seed's rule). On by default
    with `hh_distance` (`guidance.displacement_clip=0 guidance.hh_distance=0` is the seed's rule): the push is an
    explicit gradient step, and on a distorted geometry the stiff short-range repulsion gives forces of hundreds of
    eV/Angstrom, so a strong scale throws atoms Angstroms in one step and the molecule falls apart into fragments
    and lone atoms, which GFN2-xTB cannot score (its SCF does not converge); the clip bounds every step whatever
    the force, at a small fraction of a bond length."""
    max_uncertainty: float | None = None
    """Skip the push for a molecule whose ensemble energy spread (eV/atom) is above this on that step; None: never."""
    step_bound: float | None = None
    """Largest move of an atom per guided step, as a multiple of sigma_t (Angstrom at sigma_t = 1): each
    iteration's displacement norm is clipped at step_bound * sigma_t / iterations. None: no bound."""
    min_distance: float | None = None
    """Angstrom: a distance floor for the guided move: after the push, every pair of atoms the push brought below
    it is set back to the floor (or to its distance before the push, if that was already shorter); with
    `floor_push`, every pair below it is pushed out to it. None: no floor."""
    hh_distance: float | None = HH_DISTANCE
    """Angstrom: the floor for pairs of two atoms the force field sees as hydrogen (instead of `min_distance`).
    None: `min_distance` for them too. On by default (1.4; QM9's closest H-H pair is 1.61): the force field's
    lowest-energy answer to hydrogens crowded by the sampler is H2 (0.74 Angstrom), which a strong scale pulls them
    into, splitting the molecule; organic molecules hold no H-H bond, so the guided move keeps hydrogens apart."""
    floor_push: bool = True
    """With a floor: push every pair below it out to it (default), not only hold the pairs the push moved (False:
    a pair the sampler itself made shorter stays as short, and the force field can still pull it into H2)."""
    schedule: str = "seed"
    """How the push varies over the guided steps: `seed`: scale * (1 - sigma_t); `fade`: scale * (1 - sigma_t) *
    sigma_t / noise_threshold (zero at the end of sampling, so the model places the atoms last)."""
    types: str = "auto"
    """How the force field sees the atom types: `argmax` over all types (the seed's rule), `forcefield`:
    the argmax over the types the force field models (ani1x: no F), so no molecule needs the fallback, or
    `auto`: `forcefield` when the force field does not model every type, else `argmax` (`types_seen`)."""

    def __post_init__(self) -> None:
        if not np.isfinite(self.scale) or self.scale < 0:
            raise ConfigError(f"guidance scale must be a finite number >= 0, got {self.scale}")
        if int(self.iterations) != self.iterations or self.iterations < 1:
            raise ConfigError(f"guidance iterations must be an integer >= 1, got {self.iterations}")
        if not np.isfinite(self.noise_threshold) or self.noise_threshold < 0:
            raise ConfigError(f"guidance noise_threshold must be a finite number >= 0, got {self.noise_threshold}")
        if self.types not in GUIDANCE_TYPES:
            raise ConfigError(f"guidance types must be one of {', '.join(GUIDANCE_TYPES)}, got {self.types!r}")
        if self.schedule not in GUIDANCE_SCHEDULES:
            raise ConfigError(f"guidance schedule must be one of {', '.join(GUIDANCE_SCHEDULES)}, got {self.schedule!r}")
        for name in ("force_clip", "displacement_clip", "max_uncertainty", "step_bound", "min_distance",
                     "hh_distance"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"guidance {name} must be > 0 or None, got {value}")


def clip_norm(vectors: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """Scale each [..., 3] vector down to norm `max_norm` where it is longer (None: unchanged)."""
    if max_norm is None:
        return vectors
    norm = torch.linalg.vector_norm(vectors, dim=-1, keepdim=True)
    factor = torch.where(norm > max_norm, max_norm / norm.clamp(min=1e-30), torch.ones_like(norm))
    return vectors * factor


def hold_floor(before: torch.Tensor, after: torch.Tensor, mask: torch.Tensor, floor: torch.Tensor | float,
               push: bool = False, sweeps: int = 4) -> torch.Tensor:
    """`after` [B, N, 3] with each pair of masked atoms that ended closer than its `floor` (Angstrom; a number or
    [B, N, N] per pair) set back apart, symmetrically along the line joining them: to the floor, or (`push` False)
    to the pair's distance in `before` where that was already shorter, so the move never brings a pair closer than
    either. Pairs are corrected together (`sweeps` Jacobi sweeps), which is exact for an isolated pair."""
    valid = mask.unsqueeze(2) & mask.unsqueeze(1) & ~torch.eye(mask.shape[1], dtype=torch.bool, device=mask.device)
    target = torch.as_tensor(floor, dtype=after.dtype, device=after.device).expand(*mask.shape, mask.shape[1])
    if not push:
        target = torch.minimum(target, torch.cdist(before, before))
    y = after
    for _ in range(sweeps):
        diff = y.unsqueeze(2) - y.unsqueeze(1)
        r = torch.linalg.vector_norm(diff, dim=-1)
        # a tolerance so float rounding of a pair already set back does not count as a violation
        short = valid & (r < target * (1 - 1e-9)) & (r > 0)
        if not bool(short.any()):
            break
        gap = torch.where(short, (target - r) / 2 / r.clamp(min=1e-30), torch.zeros_like(r))
        y = y + (gap.unsqueeze(-1) * diff).sum(dim=2)
    return y


def pair_floors(numbers: torch.Tensor, min_distance: float | None, hh_distance: float | None) -> torch.Tensor:
    """[B, N, N] distance floors (Angstrom) for atomic numbers [B, N]: `hh_distance` between two hydrogens,
    `min_distance` between any other pair (0 where either is None)."""
    hydrogen = numbers == 1
    both = hydrogen.unsqueeze(2) & hydrogen.unsqueeze(1)
    other = torch.full(both.shape, float(min_distance or 0.0), dtype=torch.float64, device=numbers.device)
    return torch.where(both, torch.full_like(other, float(hh_distance if hh_distance is not None else
                                                          (min_distance or 0.0))), other)


class ForceGuidance:
    """The guidance hook of `EDMDiffusion.sample`: `hook(positions, type_index, node_mask, sigma_t, step_index)`.

    `atomic_numbers_of_types[i]` is the atomic number of type index i (the diffusion's
    `atomic_numbers_of_types`). Counters: `steps_guided` (sampler steps where it acted),
    `force_evaluations` (molecules evaluated), `failures` (evaluations with ok False: that molecule is
    left unguided on that step), `forcefield_seconds` (time inside the force field), with a ladder
    `rung_counts[i]` (successful evaluations on rung i, named by `rung_labels[i]`), with a routed force field
    `scored[name]` and `unsupported`, with `max_uncertainty` `uncertain_skips`.
    """

    def __init__(self, forcefield: ForceField, config: GuidanceConfig, atomic_numbers_of_types: Sequence[int]) -> None:
        self.forcefield = forcefield
        self.config = config
        self.atomic_numbers_of_types = np.asarray(atomic_numbers_of_types, dtype=np.int64)
        self.evaluator = guidance_evaluator(forcefield, needs_spread=config.max_uncertainty is not None)
        if config.max_uncertainty is not None and not _reports_spread(self.evaluator):
            raise ConfigError(f"guidance.max_uncertainty needs a force field that reports an ensemble spread (ani1x "
                              f"with its 8 networks); {getattr(forcefield, 'name', '?')} reports none")
        supported = getattr(forcefield, "supported_numbers", None)
        self.decode_among: list[int] | None = None
        """Type indices the sampler decodes among for this hook (`types: forcefield`), None: all."""
        if types_seen(config.types, self.atomic_numbers_of_types.tolist(), supported) == "forcefield" \
                and supported is not None:
            self.decode_among = [i for i, z in enumerate(self.atomic_numbers_of_types.tolist()) if z in supported]
            if not self.decode_among:
                raise ConfigError(f"guidance types=forcefield: {getattr(forcefield, 'name', '?')} models none of the "
                                  f"atom types {self.atomic_numbers_of_types.tolist()}")
        self.rung_labels: list[str] = [str(label) for label in getattr(self.evaluator, "rung_labels", ())]
        self.rung_counts = [0] * len(self.rung_labels)
        self.steps_guided = 0
        self.force_evaluations = 0
        self.failures = 0
        self.forcefield_seconds = 0.0
        self.scored: dict[str, int] = {}
        self.unsupported = 0
        self.uncertain_skips = 0

    def counters(self) -> dict[str, float]:
        """The counters as a dict (for logs and metric files)."""
        out = {"steps_guided": self.steps_guided, "force_evaluations": self.force_evaluations,
               "failures": self.failures, "forcefield_seconds": self.forcefield_seconds,
               **{f"evaluations_{label}": count for label, count in zip(self.rung_labels, self.rung_counts)}}
        if hasattr(self.evaluator, "names"):  # a routed force field
            out.update({f"scored_{name}": self.scored.get(name, 0) for name in self.evaluator.names if name != "none"},
                       unsupported=self.unsupported)
        if self.config.max_uncertainty is not None:
            out["uncertain_skips"] = self.uncertain_skips
        return out

    def active(self, sigma_t: float) -> bool:
        """Whether a step at noise level sigma_t is guided."""
        return self.config.scale != 0 and sigma_t <= self.config.noise_threshold

    def __call__(self, positions: torch.Tensor, type_index: torch.Tensor, node_mask: torch.Tensor, sigma_t: float,
                 step_index: int) -> torch.Tensor:
        """Guided positions [B, N, 3] (Angstrom); `positions` itself when the step is not guided."""
        if not self.active(sigma_t):
            return positions
        cfg = self.config
        mask = node_mask.squeeze(-1) if node_mask.dim() == 3 else node_mask
        mask = mask.bool()
        table = torch.as_tensor(self.atomic_numbers_of_types, device=mask.device)
        numbers = torch.where(mask, table[type_index.clamp(min=0)], torch.zeros_like(type_index))
        real = mask.any(dim=1)
        step_size = cfg.scale / cfg.iterations * (1.0 - sigma_t)
        if cfg.schedule == "fade":
            step_size *= sigma_t / cfg.noise_threshold if cfg.noise_threshold > 0 else 0.0
        bound = cfg.displacement_clip
        if cfg.step_bound is not None:
            per_step = cfg.step_bound * sigma_t / cfg.iterations
            bound = per_step if bound is None else min(bound, per_step)
        floors = None
        if cfg.min_distance is not None or cfg.hh_distance is not None:
            floors = pair_floors(numbers, cfg.min_distance, cfg.hh_distance).to(positions.dtype)
        x = positions
        self.steps_guided += 1
        for _ in range(cfg.iterations):
            started = time.perf_counter()
            result = compute_on_device(self.evaluator, numbers, x.detach(), mask)
            self.forcefield_seconds += time.perf_counter() - started
            ok = result.ok.to(x.device) & real
            evaluated = real
            if result.source is not None:  # a routed force field: count who scored what, and what nobody could
                source = result.source.to(x.device)
                names = getattr(self.evaluator, "names", [])
                supported = getattr(self.evaluator, "supported_numbers", None)
                unsupported = real & ~modelled_atoms(numbers, mask, supported).all(dim=1)
                if getattr(self.evaluator, "has_fallback", False):
                    unsupported = torch.zeros_like(unsupported)
                self.unsupported += int(unsupported.sum())
                evaluated = real & ~unsupported
                for index, name in enumerate(names):
                    scored = int((ok & (source == index)).sum())
                    if scored:
                        self.scored[name] = self.scored.get(name, 0) + scored
            self.force_evaluations += int(evaluated.sum())
            if not self.rung_labels and getattr(self.evaluator, "rung_labels", None):  # a fallback with a ladder, built late
                self.rung_labels = [str(label) for label in self.evaluator.rung_labels]
                self.rung_counts = [0] * len(self.rung_labels)
            if result.rung is not None and self.rung_counts:
                used = result.rung.to(x.device)[ok]
                for rung in used[(used >= 0) & (used < len(self.rung_counts))].tolist():
                    self.rung_counts[rung] += 1
            failed = int((evaluated & ~ok).sum())
            if failed:
                self.failures += failed
                log.debug("guidance step %d: force field %s failed on %d molecule(s); left unguided",
                          step_index, getattr(self.forcefield, "name", "?"), failed)
            if cfg.max_uncertainty is not None:
                if result.energy_spread is None:
                    raise ConfigError(f"guidance.max_uncertainty needs a force field that reports an ensemble spread "
                                      f"(ani1x with its 8 networks); {getattr(self.forcefield, 'name', '?')} reports none")
                uncertain = ok & (result.energy_spread.to(x.device) > cfg.max_uncertainty)
                self.uncertain_skips += int(uncertain.sum())
                ok = ok & ~uncertain
            if not bool(ok.any()):
                continue
            forces = clip_norm(torch.nan_to_num(result.forces.to(device=x.device, dtype=x.dtype)), cfg.force_clip)
            displacement = clip_norm(step_size * forces, bound)
            keep = (ok.unsqueeze(1) & mask).unsqueeze(-1)
            moved = x + displacement * keep
            if floors is not None:
                moved = hold_floor(x, moved, mask, floors, cfg.floor_push)
            moved = remove_mean_with_mask(moved, mask)
            x = torch.where(ok.reshape(-1, 1, 1), moved, x)
        return x


def _reports_spread(evaluator: object) -> bool:
    """Whether a guidance evaluator (a routed one: its primary) is an ensemble that reports its spread."""
    return bool(getattr(scoring_forcefield(evaluator, 0), "ensemble", False))

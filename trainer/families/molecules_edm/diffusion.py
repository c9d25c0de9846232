"""EDM: E(3)-equivariant diffusion of molecules (Hoogeboom et al., ICML 2022): schedule, losses, sampler.

What this follows: `ehoogeboom/e3_diffusion_for_molecules`, `equivariant_diffusion/en_diffusion.py`
(`polynomial_schedule`, `clip_noise_schedule`, `PredefinedNoiseSchedule`, `EnVariationalDiffusion`) with
the QM9 settings: `polynomial_2` schedule, T = 1000, precision 1e-5, normalisation (1, 4, 10), biases 0,
charges included, parametrisation eps, l2 training loss.

State. z = [x, h] per atom, x in R^3 (positions / norm_values[0], zero centre of mass over the real
atoms), h = [one_hot / 4, Z / 10] (continuous). gamma(t) = log(sigma_t^2 / alpha_t^2) is a lookup table
over t = 0..T; alpha_t = sqrt(sigmoid(-gamma)), sigma_t = sqrt(sigmoid(gamma)).
z_t = alpha_t z + sigma_t eps, with eps_x a zero-centre-of-mass Gaussian (3(N - 1) dimensions).

`training_loss` is EDM's `forward()` in training mode with `loss_type='l2'` (t0_always False), per
molecule: t ~ U{0, ..., T};

* t > 0: 0.5 * ||eps - eps_hat||^2 / ((3 + F) * N_max), summed over every atom and feature of the
  padded batch (padding is zero in both), N_max = the batch's padded size, as EDM's `compute_error`;
* t = 0: EDM's `log_pxh_given_z0_without_constants` at gamma_0 on the same z_t, negated: the same
  normalised x error (0.5 * ||eps_x - eps_hat_x||^2 / ((3 + F) N_max)) minus the discretised
  log-likelihoods of the one-hot and charges;
* plus the prior KL(q(z_T | x, h) || N(0, I)) (EDM adds it in training too; ~1e-5, constant here);
* no log-det of the normalisation, no x constants (EDM zeroes both in training with l2) and no
  -log p(N) (EDM's training script subtracts it; it does not depend on the parameters: the caller adds it).

`nll` is EDM's `forward()` in evaluation mode (t0_always True), the variational bound in nats per molecule:
kl_prior + T * 0.5 * (SNR(s)/SNR(t) - 1) * ||eps - eps_hat||^2 at one t ~ U{1..T} (s = t - 1)
+ (N - 1) * 3 * (0.5 gamma_0 + 0.5 log 2 pi) (the constants of p(x | z_0))
- log p(x, h | z_0) without constants at a second draw z_0 = alpha_0 z + sigma_0 eps_0
+ (N - 1) * 3 * log(norm_values[0]) (the log-det of the position scaling). It excludes -log p(N).

`sample` is EDM's `sample()` with one generator per molecule: every draw of molecule k (its initial
noise and each step's noise, x and h together, shape [n_k, 3 + F]) comes from `generators[k]`, so a
molecule does not depend on the batch it is drawn in. Each step z_s = mu + sigma * noise with
mu = z_t / alpha_{t|s} - sigma_{t|s}^2 / (alpha_{t|s} sigma_t) * eps_hat and sigma = sigma_{t|s} sigma_s /
sigma_t, then x is re-centred; the optional guidance hook runs right after (see `GuidanceHook`).
Finally x ~ N(x0_hat, sigma_0 / alpha_0) and, as EDM's `sample_p_xh_given_z0`, the types are the argmax
of z_0's one-hot block and the charges are round(z_0 charge * 10) (from z_0, not from x0_hat).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from trainer.errors import ConfigError, DataError

if TYPE_CHECKING:
    from trainer.sample_random import SampleRandom as RowRandom
from trainer.families.molecules_edm.egnn import remove_mean_with_mask
from trainer.families.molecules_edm.molecule import QM9_ELEMENTS, Molecule

__all__ = [
    "ChainFrame",
    "EDMDiffusion",
    "GuidanceHook",
    "SampleOutput",
    "atomic_number",
    "build_edm_diffusion",
    "polynomial_alphas2",
    "polynomial_gamma",
    "remove_mean_with_mask",
    "sample_center_gravity_zero_gaussian_with_mask",
    "sample_gaussian_with_mask",
]

GuidanceHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor]
"""`hook(positions [B, N, 3] Angstrom, type_index [B, N] long, node_mask [B, N] bool, sigma_t, step_index)
-> positions`. Called after every ancestral step z_s ~ p(z_s | z_t); sigma_t is the noise level of the
noisier time t of that step and step_index counts the steps done before it (0 .. T - 1). It must not
draw random numbers nor modify its inputs in place; returning `positions` itself means "unchanged".
A hook with a `decode_among` attribute (type indices, or None) gets types decoded by the argmax over those
types only (a force field that models fewer elements); the sampler's own types are unchanged."""

_ATOMIC_NUMBERS = {"H": 1, "He": 2, "Li": 3, "Be": 4, "B": 5, "C": 6, "N": 7, "O": 8, "F": 9, "Ne": 10,
                   "Na": 11, "Mg": 12, "Al": 13, "Si": 14, "P": 15, "S": 16, "Cl": 17, "Ar": 18, "K": 19,
                   "Ca": 20, "Br": 35, "I": 53}


def atomic_number(symbol: str) -> int:
    """Atomic number of an element symbol (common elements built in, others through RDKit)."""
    if symbol in _ATOMIC_NUMBERS:
        return _ATOMIC_NUMBERS[symbol]
    try:
        from rdkit import Chem

        number = int(Chem.GetPeriodicTable().GetAtomicNumber(symbol))
    except Exception as exc:  # RDKit missing or an unknown symbol (RDKit raises RuntimeError)
        raise ConfigError(f"unknown element symbol {symbol!r} in the element vocabulary") from exc
    if number <= 0:
        raise ConfigError(f"unknown element symbol {symbol!r} in the element vocabulary")
    return number


# ---------------------------------------------------------------------------------------------------------
# Schedule


def polynomial_alphas2(timesteps: int, power: float = 2.0, precision: float = 1e-5,
                       clip_value: float = 1e-3) -> np.ndarray:
    """EDM's `polynomial_schedule`: alpha_t^2 for t = 0..T (float64, [T + 1]).

    alpha^2 = (1 - (t/T)^power)^2, step ratios alpha_t^2 / alpha_{t-1}^2 clipped to >= clip_value
    (this only bites at t = T, where alpha^2 would be 0), then alpha^2 <- (1 - 2 precision) alpha^2 + precision.
    """
    if timesteps < 1:
        raise ConfigError(f"diffusion timesteps must be >= 1, got {timesteps}")
    steps = timesteps + 1
    grid = np.linspace(0, steps, steps)
    alphas2 = (1 - np.power(grid / steps, power)) ** 2
    alphas2 = np.concatenate([np.ones(1), alphas2])
    ratios = np.clip(alphas2[1:] / alphas2[:-1], a_min=clip_value, a_max=1.0)
    alphas2 = np.cumprod(ratios)
    return (1 - 2 * precision) * alphas2 + precision


def polynomial_gamma(timesteps: int, power: float = 2.0, precision: float = 1e-5) -> torch.Tensor:
    """gamma_t = log(sigma_t^2 / alpha_t^2) for t = 0..T, float32 [T + 1] (computed in float64, as EDM)."""
    alphas2 = polynomial_alphas2(timesteps, power, precision)
    sigmas2 = 1 - alphas2
    return torch.from_numpy(np.log(sigmas2) - np.log(alphas2)).float()


def _parse_schedule(noise_schedule: str) -> float:
    name, _, power = noise_schedule.partition("_")
    try:
        if name != "polynomial":
            raise ValueError(name)
        return float(power)
    except ValueError as exc:
        raise ConfigError(f"noise_schedule {noise_schedule!r}: only 'polynomial_<power>' (EDM: polynomial_2) "
                          "is supported") from exc


# ---------------------------------------------------------------------------------------------------------
# Noise


def _randn(shape: Sequence[int], generator: torch.Generator | None, device: torch.device,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal draws from `generator` (on its own device, then moved), or the global stream."""
    if generator is None:
        return torch.randn(tuple(shape), device=device, dtype=dtype)
    return torch.randn(tuple(shape), generator=generator, device=generator.device, dtype=dtype).to(device)


def sample_center_gravity_zero_gaussian_with_mask(shape: Sequence[int], node_mask: torch.Tensor,
                                                  generator: torch.Generator | None = None) -> torch.Tensor:
    """A [B, N, D] Gaussian, zero at padding, projected to zero mean over each molecule's real atoms."""
    noise = _randn(shape, generator, node_mask.device)
    return remove_mean_with_mask(noise, node_mask)


def sample_gaussian_with_mask(shape: Sequence[int], node_mask: torch.Tensor,
                              generator: torch.Generator | None = None) -> torch.Tensor:
    """A [B, N, D] standard Gaussian, zero at padding."""
    noise = _randn(shape, generator, node_mask.device)
    mask = node_mask.squeeze(-1) if node_mask.dim() == 3 else node_mask
    return noise * mask.to(noise.dtype).unsqueeze(-1)


def _cdf_standard_gaussian(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(x / math.sqrt(2)))


# ---------------------------------------------------------------------------------------------------------
# Outputs


@dataclass
class ChainFrame:
    """One frame of a sampling chain of one molecule."""

    step: int
    """Ancestral steps done: 0 is the prior draw z_T, T is the final decoded sample."""
    positions: torch.Tensor
    """[n, 3] float32 positions in Angstrom (CPU)."""
    type_index: torch.Tensor
    """[n] long index into the element vocabulary (argmax of the one-hot block)."""


@dataclass
class SampleOutput:
    """A batch of sampled molecules, padded to the largest; padding has type 0, number 0, position 0."""

    positions: torch.Tensor
    """[B, N, 3] float32 positions in Angstrom, zero centre of mass over the real atoms."""
    type_index: torch.Tensor
    """[B, N] long index into the element vocabulary."""
    atomic_numbers: torch.Tensor
    """[B, N] long atomic numbers of the types (0 at padding)."""
    charges: torch.Tensor
    """[B, N] long decoded charge feature (EDM: round(z_0 charge * 10); 0 at padding)."""
    node_mask: torch.Tensor
    """[B, N] bool real atoms."""
    chains: list[list[ChainFrame]] | None = None
    """For the first `chain_for` molecules, their frames in step order; None when not asked for."""

    @property
    def types(self) -> torch.Tensor:
        """Alias of `type_index`."""
        return self.type_index

    def to_molecules(self) -> list[Molecule]:
        """One `Molecule` per sample (atomic numbers from the decoded types, positions in Angstrom)."""
        out = []
        positions = self.positions.detach().cpu().double().numpy()
        numbers = self.atomic_numbers.detach().cpu().numpy()
        mask = self.node_mask.detach().cpu().numpy()
        for k in range(len(mask)):
            out.append(Molecule(numbers[k][mask[k]], positions[k][mask[k]]))
        return out


# ---------------------------------------------------------------------------------------------------------
# The model


class EDMDiffusion(nn.Module):
    """EDM's `EnVariationalDiffusion` (eps parametrisation, predefined polynomial schedule) around a dynamics.

    `dynamics(x [B, N, 3], h [B, N, F], t [B] in [0, 1], node_mask [B, N]) -> (eps_x, eps_h)` (e.g.
    `egnn.EGNNDynamics`); F = len(elements) + include_charges.
    """

    n_dims = 3

    def __init__(self, dynamics: nn.Module, elements: Sequence[str] = QM9_ELEMENTS, timesteps: int = 1000,
                 noise_schedule: str = "polynomial_2", noise_precision: float = 1e-5,
                 norm_values: Sequence[float] = (1.0, 4.0, 10.0), norm_biases: Sequence[float] = (0.0, 0.0),
                 include_charges: bool = True) -> None:
        super().__init__()
        if len(elements) < 1 or len(set(elements)) != len(elements):
            raise ConfigError(f"the element vocabulary must be non-empty and without repeats, got {list(elements)}")
        if len(norm_values) != 3 or min(norm_values) <= 0:
            raise ConfigError(f"norm_values must be three positive numbers (x, one-hot, charge), got {norm_values}")
        if len(norm_biases) != 2:
            raise ConfigError(f"norm_biases must be two numbers (one-hot, charge), got {norm_biases}")
        self.dynamics = dynamics
        self.elements = tuple(elements)
        self.atomic_numbers_of_types = tuple(atomic_number(e) for e in self.elements)
        self.num_classes = len(self.elements)
        self.include_charges = bool(include_charges)
        self.num_features = self.num_classes + int(self.include_charges)
        dyn_features = getattr(dynamics, "num_features", None)
        if dyn_features is not None and dyn_features != self.num_features:
            raise ConfigError(f"the dynamics takes {dyn_features} node features but the diffusion has "
                              f"{self.num_features} ({self.num_classes} types + {int(self.include_charges)} charge)")
        self.T = int(timesteps)
        power = _parse_schedule(noise_schedule)
        self.register_buffer("gamma", polynomial_gamma(self.T, power, noise_precision))
        self.norm_values = tuple(float(v) for v in norm_values)
        self.norm_biases = tuple(float(b) for b in norm_biases)
        self._check_norm_values()

    # --- schedule -----------------------------------------------------------------------------------------

    def _check_norm_values(self, num_stdevs: int = 8) -> None:
        """EDM's check that sigma_0 is small against the spacing of the scaled one-hot / charge values."""
        sigma_0 = float(torch.sqrt(torch.sigmoid(self.gamma[0])))
        largest = max(self.norm_values[1], self.norm_values[2])
        if sigma_0 * num_stdevs > 1.0 / largest:
            raise ConfigError(f"norm value {largest} is too large for sigma_0 = {sigma_0:.5f}: "
                              f"8 sigma_0 > 1 / {largest}")

    @staticmethod
    def _sigma(gamma: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(torch.sigmoid(gamma))

    @staticmethod
    def _alpha(gamma: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(torch.sigmoid(-gamma))

    def sigma_at(self, t_int: int | torch.Tensor) -> torch.Tensor:
        """sigma_t of integer time(s) t."""
        return self._sigma(self.gamma[t_int])

    # --- inputs -------------------------------------------------------------------------------------------

    def normalize(self, x: torch.Tensor, one_hot: torch.Tensor, charges: torch.Tensor,
                  node_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Validate and scale a batch -> (x, h, mask [B, N, 1] float, delta_log_px [B]).

        x is re-centred over the real atoms (EDM's training script does it before the model) and divided by
        norm_values[0]; h = [(one_hot - b1) / 4, (charges - b2) / 10], zero at padding.
        """
        if x.dim() != 3 or x.shape[-1] != 3:
            raise DataError(f"EDM batch: positions must be [B, N, 3], got {tuple(x.shape)}")
        batch, nodes = x.shape[:2]
        if tuple(node_mask.shape[:2]) != (batch, nodes):
            raise DataError(f"EDM batch: node_mask has shape {tuple(node_mask.shape)}, positions {tuple(x.shape)}")
        if tuple(one_hot.shape) != (batch, nodes, self.num_classes):
            raise DataError(f"EDM batch: one_hot must be [B, N, {self.num_classes}] for elements {self.elements}, "
                            f"got {tuple(one_hot.shape)}")
        if charges.dim() == 3:
            charges = charges.squeeze(-1)
        if self.include_charges and tuple(charges.shape) != (batch, nodes):
            raise DataError(f"EDM batch: charges must be [B, N], got {tuple(charges.shape)}")
        mask = (node_mask.squeeze(-1) if node_mask.dim() == 3 else node_mask).to(torch.float32).unsqueeze(-1)
        counts = mask.sum(dim=(1, 2))
        empty = torch.nonzero(counts == 0).flatten().tolist()
        if empty:
            raise DataError(f"EDM batch: molecule(s) at batch index {empty[:5]} have no atoms")
        x = remove_mean_with_mask(x.to(torch.float32), mask) / self.norm_values[0]
        h_cat = (one_hot.to(torch.float32) - self.norm_biases[0]) / self.norm_values[1] * mask
        parts = [h_cat]
        if self.include_charges:
            parts.append((charges.to(torch.float32).unsqueeze(-1) - self.norm_biases[1]) / self.norm_values[2] * mask)
        delta_log_px = -(counts - 1) * self.n_dims * math.log(self.norm_values[0])
        return x, torch.cat(parts, dim=-1), mask, delta_log_px

    def combined_noise(self, batch: int, nodes: int, mask: torch.Tensor,
                       generator: torch.Generator | None = None) -> torch.Tensor:
        """EDM's `sample_combined_position_feature_noise`: [B, N, 3 + F], x part zero-CoM, zero at padding."""
        z_x = sample_center_gravity_zero_gaussian_with_mask((batch, nodes, self.n_dims), mask, generator)
        z_h = sample_gaussian_with_mask((batch, nodes, self.num_features), mask, generator)
        return torch.cat([z_x, z_h], dim=-1)

    def noise_from_normals(self, normals: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`combined_noise` from given standard normals [B, N, 3 + F]: zero at padding, x part zero-CoM."""
        mask = mask if mask.dim() == 3 else mask.unsqueeze(-1)
        normals = normals.to(torch.float32) * mask.to(torch.float32)
        return torch.cat([remove_mean_with_mask(normals[..., :self.n_dims], mask), normals[..., self.n_dims:]], dim=-1)

    def phi(self, z: torch.Tensor, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The dynamics on z = [x, h] at continuous time t [B] -> eps_hat [B, N, 3 + F]."""
        eps_x, eps_h = self.dynamics(z[..., :self.n_dims], z[..., self.n_dims:], t, mask.squeeze(-1))
        return torch.cat([eps_x, eps_h], dim=-1)

    # --- terms of the bound -------------------------------------------------------------------------------

    def kl_prior(self, xh: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """KL(q(z_T | x, h) || N(0, I)) per molecule, x on its 3(N - 1)-dimensional subspace."""
        gamma_T = self.gamma[self.T]
        alpha_T, sigma_T = self._alpha(gamma_T), self._sigma(gamma_T)
        mu = alpha_T * xh
        mu_x, mu_h = mu[..., :self.n_dims], mu[..., self.n_dims:]
        kl_h = ((-torch.log(sigma_T) + 0.5 * (sigma_T ** 2 + mu_h ** 2) - 0.5) * mask).sum(dim=(1, 2))
        dims = (mask.sum(dim=(1, 2)) - 1) * self.n_dims
        kl_x = dims * -torch.log(sigma_T) + 0.5 * (dims * sigma_T ** 2 + (mu_x ** 2).sum(dim=(1, 2))) - 0.5 * dims
        return kl_x + kl_h

    def log_constants_p_x_given_z0(self, mask: torch.Tensor) -> torch.Tensor:
        """The normalising constants of N(x | x0_hat, sigma_0 / alpha_0) on 3(N - 1) dimensions, per molecule."""
        dims = (mask.sum(dim=(1, 2)) - 1) * self.n_dims
        log_sigma_x = 0.5 * self.gamma[0]
        return dims * (-log_sigma_x - 0.5 * math.log(2 * math.pi))

    @staticmethod
    def _squared_error(net_out: torch.Tensor, eps: torch.Tensor, denominator: float | None) -> torch.Tensor:
        error = ((eps - net_out) ** 2).flatten(1).sum(dim=1)
        return error if denominator is None else error / denominator

    def log_pxh_given_z0_without_constants(self, h: torch.Tensor, z: torch.Tensor, gamma_0: torch.Tensor,
                                           eps: torch.Tensor, net_out: torch.Tensor, mask: torch.Tensor,
                                           denominator: float | None = None, epsilon: float = 1e-10) -> torch.Tensor:
        """EDM's log p(x, h | z_0) without the x constants, per molecule.

        x: -0.5 * ||eps_x - eps_hat_x||^2 (divided by `denominator` in l2 training, as EDM); charges: log of
        the N(z * 10, sigma_0 * 10) mass of [Z - 0.5, Z + 0.5]; types: log-softmax over classes of the
        N(z * 4, sigma_0 * 4) mass of [0.5, 1.5], read at the true class.
        """
        gamma_0 = gamma_0.reshape(-1, 1, 1)
        sigma_0 = self._sigma(gamma_0)
        sigma_0_cat = sigma_0 * self.norm_values[1]
        sigma_0_int = sigma_0 * self.norm_values[2]
        k = self.num_classes
        log_p_x = -0.5 * self._squared_error(net_out[..., :self.n_dims], eps[..., :self.n_dims], denominator)

        onehot = h[..., :k] * self.norm_values[1] + self.norm_biases[0]
        estimated_cat = z[..., self.n_dims:self.n_dims + k] * self.norm_values[1] + self.norm_biases[0]
        centered_cat = estimated_cat - 1
        log_cat_proportional = torch.log(_cdf_standard_gaussian((centered_cat + 0.5) / sigma_0_cat)
                                         - _cdf_standard_gaussian((centered_cat - 0.5) / sigma_0_cat) + epsilon)
        log_probabilities = log_cat_proportional - torch.logsumexp(log_cat_proportional, dim=-1, keepdim=True)
        log_p_h = (log_probabilities * onehot * mask).sum(dim=(1, 2))

        if self.include_charges:
            charges = torch.round(h[..., k:] * self.norm_values[2] + self.norm_biases[1])
            estimated = z[..., self.n_dims + k:] * self.norm_values[2] + self.norm_biases[1]
            centered = charges - estimated
            log_p_int = torch.log(_cdf_standard_gaussian((centered + 0.5) / sigma_0_int)
                                  - _cdf_standard_gaussian((centered - 0.5) / sigma_0_int) + epsilon)
            log_p_h = log_p_h + (log_p_int * mask).sum(dim=(1, 2))
        return log_p_x + log_p_h

    def _times(self, batch: int, t_int: torch.Tensor | None, low: int, generator: torch.Generator | None,
               device: torch.device) -> torch.Tensor:
        if t_int is None:
            gen_device = generator.device if generator is not None else device
            return torch.randint(low, self.T + 1, (batch,), generator=generator, device=gen_device).to(device)
        t_int = torch.as_tensor(t_int, device=device).long().reshape(-1)
        if t_int.numel() == 1:
            t_int = t_int.expand(batch)
        if t_int.numel() != batch or int(t_int.min()) < low or int(t_int.max()) > self.T:
            raise ConfigError(f"t_int must hold {batch} integers in [{low}, {self.T}], got {t_int.tolist()}")
        return t_int

    def _check_eps(self, eps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if tuple(eps.shape) != tuple(like.shape):
            raise ConfigError(f"eps must have shape {tuple(like.shape)}, got {tuple(eps.shape)}")
        return eps.to(like)

    # --- losses -------------------------------------------------------------------------------------------

    def training_loss(self, x: torch.Tensor, one_hot: torch.Tensor, charges: torch.Tensor, node_mask: torch.Tensor,
                      t_int: torch.Tensor | None = None, generator: torch.Generator | None = None,
                      eps: torch.Tensor | None = None, rng: RowRandom | None = None) -> torch.Tensor:
        """EDM's l2 training loss per molecule [B] (see the module docstring; excludes -log p(N)).

        x [B, N, 3] Angstrom, one_hot [B, N, K], charges [B, N] atomic numbers, node_mask [B, N]. `t_int`
        ([B] or one integer in 0..T) and `eps` ([B, N, 3 + F], x part zero-CoM) fix the random draws;
        otherwise they come from `rng` (per row: t from its "time" stream, eps from its "noise" stream, so a
        molecule's draws depend on it alone, not on its batch or its padding), else t then eps from
        `generator` (or the global stream).
        """
        x, h, mask, _ = self.normalize(x, one_hot, charges, node_mask)
        batch, nodes = x.shape[:2]
        if rng is not None and t_int is None:
            t_int = rng.randint("time", 0, self.T + 1, device=x.device)
        t_int = self._times(batch, t_int, 0, generator, x.device)
        xh = torch.cat([x, h], dim=-1)
        if rng is not None and eps is None:
            eps = self.noise_from_normals(rng.randn("noise", nodes, xh.shape[-1], device=x.device), mask)
        eps = self.combined_noise(batch, nodes, mask, generator) if eps is None else self._check_eps(eps, xh)
        gamma_t = self.gamma[t_int].reshape(-1, 1, 1)
        z_t = self._alpha(gamma_t) * xh + self._sigma(gamma_t) * eps
        net_out = self.phi(z_t, t_int.to(x.dtype) / self.T, mask)
        denominator = float((self.n_dims + self.num_features) * nodes)
        loss_positive_t = 0.5 * self._squared_error(net_out, eps, denominator)
        # at t = 0 gamma_t is gamma_0, so this is EDM's L_0 on the same z_t ("selected via masking")
        loss_zero_t = -self.log_pxh_given_z0_without_constants(h, z_t, gamma_t, eps, net_out, mask, denominator)
        loss_t = torch.where(t_int == 0, loss_zero_t, loss_positive_t)
        return self.kl_prior(xh, mask) + loss_t

    def nll_terms(self, x: torch.Tensor, one_hot: torch.Tensor, charges: torch.Tensor, node_mask: torch.Tensor,
                  generator: torch.Generator | None = None, t_int: torch.Tensor | None = None,
                  eps: torch.Tensor | None = None, eps_0: torch.Tensor | None = None,
                  rng: RowRandom | None = None) -> dict[str, torch.Tensor]:
        """The terms of EDM's evaluation bound per molecule [B] (nats), which `nll` sums.

        Keys: `kl_prior`, `diffusion` (T * 0.5 * (SNR(s)/SNR(t) - 1) * ||eps - eps_hat||^2 at t ~ U{1..T}),
        `neg_log_constants` (of p(x | z_0)), `reconstruction` (-log p(x, h | z_0) without constants, at a
        fresh z_0), `neg_log_det` (-delta_log_px of the position scaling). Draws t, eps, eps_0 in that
        order from `generator` unless given; with `rng`, per row from its "time", "noise" and "noise_0" streams
        (so a molecule's terms do not depend on the batch it is evaluated in).
        """
        x, h, mask, delta_log_px = self.normalize(x, one_hot, charges, node_mask)
        batch, nodes = x.shape[:2]
        if rng is not None:
            width = x.shape[-1] + h.shape[-1]
            t_int = rng.randint("time", 1, self.T + 1, device=x.device) if t_int is None else t_int
            eps = self.noise_from_normals(rng.randn("noise", nodes, width, device=x.device), mask) if eps is None else eps
            eps_0 = (self.noise_from_normals(rng.randn("noise_0", nodes, width, device=x.device), mask)
                     if eps_0 is None else eps_0)
        t_int = self._times(batch, t_int, 1, generator, x.device)
        xh = torch.cat([x, h], dim=-1)
        eps = self.combined_noise(batch, nodes, mask, generator) if eps is None else self._check_eps(eps, xh)
        gamma_s = self.gamma[t_int - 1].reshape(-1, 1, 1)
        gamma_t = self.gamma[t_int].reshape(-1, 1, 1)
        z_t = self._alpha(gamma_t) * xh + self._sigma(gamma_t) * eps
        net_out = self.phi(z_t, t_int.to(x.dtype) / self.T, mask)
        snr_weight = torch.expm1(gamma_t - gamma_s).reshape(-1)  # SNR(s) / SNR(t) - 1
        diffusion = self.T * 0.5 * snr_weight * self._squared_error(net_out, eps, None)

        if eps_0 is None:
            eps_0 = self.combined_noise(batch, nodes, mask, generator)
        else:
            eps_0 = self._check_eps(eps_0, xh)
        gamma_0 = self.gamma[0].expand(batch).reshape(-1, 1, 1)
        z_0 = self._alpha(gamma_0) * xh + self._sigma(gamma_0) * eps_0
        net_out_0 = self.phi(z_0, torch.zeros(batch, dtype=x.dtype, device=x.device), mask)
        reconstruction = -self.log_pxh_given_z0_without_constants(h, z_0, gamma_0, eps_0, net_out_0, mask)
        return {"kl_prior": self.kl_prior(xh, mask), "diffusion": diffusion,
                "neg_log_constants": -self.log_constants_p_x_given_z0(mask), "reconstruction": reconstruction,
                "neg_log_det": -delta_log_px}

    def nll(self, x: torch.Tensor, one_hot: torch.Tensor, charges: torch.Tensor, node_mask: torch.Tensor,
            generator: torch.Generator | None = None, rng: RowRandom | None = None) -> torch.Tensor:
        """EDM's variational bound -log p(x, h | N) per molecule [B] in nats (excludes -log p(N))."""
        terms = self.nll_terms(x, one_hot, charges, node_mask, generator, rng=rng)
        return sum(terms.values())

    # --- sampling -----------------------------------------------------------------------------------------

    def molecule_noise(self, num_atoms: Sequence[int], generators: Sequence[torch.Generator],
                        mask: torch.Tensor) -> torch.Tensor:
        """[B, N, 3 + F]: molecule k's block [n_k, 3 + F] drawn from generators[k] alone, x part zero-CoM."""
        width = self.n_dims + self.num_features
        draws = []
        for n, generator in zip(num_atoms, generators):
            draw = torch.randn((n, width), generator=generator, device=generator.device, dtype=torch.float32)
            positions = draw[:, :self.n_dims]
            draws.append(torch.cat([positions - positions.sum(dim=0, keepdim=True) / n, draw[:, self.n_dims:]], dim=1))
        flat = torch.cat(draws).to(mask.device)
        noise = torch.zeros((*mask.shape, width), dtype=torch.float32, device=mask.device)
        noise[mask] = flat  # row-major order of a prefix mask == concatenation order
        return noise

    def _decode_types(self, z: torch.Tensor, mask: torch.Tensor, among: Sequence[int] | None = None) -> torch.Tensor:
        scores = z[..., self.n_dims:self.n_dims + self.num_classes]
        if among is not None:
            allowed = torch.zeros(self.num_classes, dtype=torch.bool, device=z.device)
            allowed[list(among)] = True
            scores = scores.masked_fill(~allowed, float("-inf"))
        types = torch.argmax(scores, dim=-1)
        return torch.where(mask, types, torch.zeros_like(types))

    def _chain_steps(self, chain_frames: int) -> list[int]:
        if chain_frames <= 0:
            return []
        count = min(chain_frames, self.T + 1)
        if count == 1:
            return [self.T]
        return sorted({int(round(v)) for v in np.linspace(0, self.T, count)})

    @torch.no_grad()
    def sample(self, num_atoms: Sequence[int], generators: Sequence[torch.Generator],
               guidance: GuidanceHook | None = None, chain_frames: int = 0, chain_for: int = 0,
               on_step: Callable[[int], None] | None = None) -> SampleOutput:
        """Draw len(num_atoms) molecules; molecule k has num_atoms[k] atoms and all its noise from generators[k].

        `guidance` runs after every ancestral step (see `GuidanceHook`); `on_step(steps_done)` after each
        step (guidance included), e.g. for a progress bar. `chain_frames` frames (evenly spaced
        over steps 0..T, the last being the final sample) are kept for the first `chain_for` molecules.
        The final positions are always re-centred (EDM re-projects only when the drift exceeds 0.05; the
        drift is rounding error, so this changes nothing but the last bits).
        """
        num_atoms = [int(n) for n in num_atoms]
        if len(num_atoms) == 0:
            raise ConfigError("sample: num_atoms is empty")
        if len(generators) != len(num_atoms):
            raise ConfigError(f"sample: {len(num_atoms)} molecules but {len(generators)} generators (one each)")
        if min(num_atoms) < 1:
            raise ConfigError(f"sample: every molecule needs >= 1 atom, got num_atoms={num_atoms}")
        if not 0 <= chain_for <= len(num_atoms):
            raise ConfigError(f"sample: chain_for={chain_for} must be in [0, {len(num_atoms)}]")
        device = self.gamma.device
        nodes = max(num_atoms)
        mask = torch.arange(nodes, device=device).unsqueeze(0) < torch.tensor(num_atoms, device=device).unsqueeze(1)
        mask_f = mask.to(torch.float32).unsqueeze(-1)
        frame_steps = set(self._chain_steps(chain_frames)) if chain_for > 0 else set()
        chains: list[list[ChainFrame]] | None = [[] for _ in range(chain_for)] if frame_steps else None

        def record(step: int, positions: torch.Tensor, types: torch.Tensor) -> None:
            if chains is None or step not in frame_steps:
                return
            positions, types = positions.detach().cpu(), types.detach().cpu()
            for j in range(chain_for):
                n = num_atoms[j]
                chains[j].append(ChainFrame(step, positions[j, :n].clone(), types[j, :n].clone()))

        z = self.molecule_noise(num_atoms, generators, mask)
        record(0, z[..., :self.n_dims] * self.norm_values[0], self._decode_types(z, mask))
        for step_index, s in enumerate(reversed(range(self.T))):
            z, _, _ = self.ancestral_step(z, s, mask, num_atoms, generators)
            sigma_t = self._sigma(self.gamma[s + 1])
            if guidance is not None:
                positions = z[..., :self.n_dims] * self.norm_values[0]
                types = self._decode_types(z, mask, getattr(guidance, "decode_among", None))
                guided = guidance(positions, types, mask, float(sigma_t), step_index)
                if guided is not positions:
                    if tuple(guided.shape) != tuple(positions.shape):
                        raise ValueError(f"guidance returned shape {tuple(guided.shape)}, expected {tuple(positions.shape)}")
                    z = torch.cat([guided.to(z) * mask_f / self.norm_values[0], z[..., self.n_dims:]], dim=-1)
            if step_index + 1 < self.T:
                record(step_index + 1, z[..., :self.n_dims] * self.norm_values[0], self._decode_types(z, mask))
            if on_step is not None:
                on_step(step_index + 1)

        out = self.decode(z, num_atoms, generators, mask)
        positions, type_index = out.positions, out.type_index
        record(self.T, positions, type_index)
        out.chains = chains
        return out

    def reverse_step(self, z: torch.Tensor, s: int | torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and standard deviation of the ancestral step p(z_s | z_t), t = s + 1 (the policy of reward
        post-training): mu = z_t / alpha_t|s - sigma_t|s^2 / (alpha_t|s sigma_t) eps_hat(z_t, t / T) and
        sigma = sigma_t|s sigma_s / sigma_t.

        z: [B, N, 3 + F]; s: an int (every molecule at the same step) or [B] integers; mask: [B, N, 1] float.
        Returns mu [B, N, 3 + F] and sigma (a 0-d tensor for an int s, else [B]); gradients flow through eps_hat.
        """
        batch = z.shape[0]
        per_row = isinstance(s, torch.Tensor) and s.dim() > 0
        if per_row and tuple(s.shape) != (batch,):
            raise ValueError(f"reverse_step: s has shape {tuple(s.shape)} for {batch} molecules")
        s_index = s.to(self.gamma.device, torch.long) if per_row else int(s)
        gamma_s, gamma_t = self.gamma[s_index], self.gamma[s_index + 1]
        sigma2_t_given_s = -torch.expm1(F.softplus(gamma_s) - F.softplus(gamma_t))
        alpha_t_given_s = torch.exp(0.5 * (F.logsigmoid(-gamma_t) - F.logsigmoid(-gamma_s)))
        sigma_t_given_s = torch.sqrt(sigma2_t_given_s)
        sigma_s, sigma_t = self._sigma(gamma_s), self._sigma(gamma_t)
        if per_row:
            t = (s_index + 1).to(torch.float32) / self.T
        else:
            t = torch.full((batch,), (s_index + 1) / self.T, dtype=torch.float32, device=z.device)
        eps_t = self.phi(z, t.to(z.device), mask)
        ratio = sigma2_t_given_s / alpha_t_given_s / sigma_t
        sigma = sigma_t_given_s * sigma_s / sigma_t
        if per_row:
            mu = z / alpha_t_given_s.view(-1, 1, 1) - ratio.view(-1, 1, 1) * eps_t
        else:
            mu = z / alpha_t_given_s - ratio * eps_t
        return mu, sigma

    def predict_clean(self, z: torch.Tensor, s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The model's prediction of the clean state from z_t (t = s + 1): x0_hat = (z_t - sigma_t eps_hat) / alpha_t.

        z: [B, N, 3 + F]; s: [B] integers; mask: [B, N, 1] float. Returns [B, N, 3 + F]."""
        s_index = s.to(self.gamma.device, torch.long)
        gamma_t = self.gamma[s_index + 1].view(-1, 1, 1)
        eps_t = self.phi(z, ((s_index + 1).to(torch.float32) / self.T).to(z.device), mask)
        return (z - self._sigma(gamma_t) * eps_t) / self._alpha(gamma_t)

    def clean_molecules(self, x0: torch.Tensor, mask: torch.Tensor) -> SampleOutput:
        """Molecules read from predicted clean states [B, N, 3 + F] (`predict_clean`): positions in Angstrom, types by
        argmax (charges not read: zero). mask: [B, N] bool."""
        positions = x0[..., :self.n_dims] * self.norm_values[0] * mask.unsqueeze(-1).to(x0.dtype)
        type_index = self._decode_types(x0, mask)
        table = torch.tensor(self.atomic_numbers_of_types, dtype=torch.long, device=x0.device)
        atomic_numbers = torch.where(mask, table[type_index], torch.zeros_like(type_index))
        return SampleOutput(positions=positions, type_index=type_index, atomic_numbers=atomic_numbers,
                            charges=torch.zeros_like(type_index), node_mask=mask, chains=None)

    def ancestral_step(self, z: torch.Tensor, s: int, mask: torch.Tensor, num_atoms: Sequence[int],
                       generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step of the sampler, z_t -> z_s ~ p(z_s | z_t) (t = s + 1): mu + sigma * noise, molecule k's noise
        from generators[k], then x re-centred. mask: [B, N] bool. Returns (z_s, mu, sigma) (`reverse_step`'s)."""
        mask_f = mask.to(torch.float32).unsqueeze(-1)
        mu, sigma = self.reverse_step(z, s, mask_f)
        z_s = mu + sigma * self.molecule_noise(num_atoms, generators, mask)
        z_s = torch.cat([remove_mean_with_mask(z_s[..., :self.n_dims], mask_f), z_s[..., self.n_dims:]], dim=-1)
        return z_s, mu, sigma

    def decode(self, z: torch.Tensor, num_atoms: Sequence[int], generators: Sequence[torch.Generator],
               mask: torch.Tensor) -> SampleOutput:
        """p(x, h | z_0): positions ~ N(x0_hat, sigma_0 / alpha_0) with the noise from each molecule's generator,
        re-centred; types by argmax and charges rounded, read from z_0 itself. mask: [B, N] bool."""
        device, batch = z.device, z.shape[0]
        mask_f = mask.to(torch.float32).unsqueeze(-1)
        gamma_0 = self.gamma[0]
        sigma_x = torch.exp(0.5 * gamma_0)
        eps_0 = self.phi(z, torch.zeros(batch, dtype=torch.float32, device=device), mask_f)
        x0_hat = (z - self._sigma(gamma_0) * eps_0) / self._alpha(gamma_0)
        xh = x0_hat + sigma_x * self.molecule_noise(num_atoms, generators, mask)
        positions = remove_mean_with_mask(xh[..., :self.n_dims] * self.norm_values[0], mask_f)
        type_index = self._decode_types(z, mask)
        if self.include_charges:
            charges = torch.round(z[..., self.n_dims + self.num_classes] * self.norm_values[2] + self.norm_biases[1]).long()
            charges = torch.where(mask, charges, torch.zeros_like(charges))
        else:
            charges = torch.zeros_like(type_index)
        table = torch.tensor(self.atomic_numbers_of_types, dtype=torch.long, device=device)
        atomic_numbers = torch.where(mask, table[type_index], torch.zeros_like(type_index))
        return SampleOutput(positions=positions, type_index=type_index, atomic_numbers=atomic_numbers,
                            charges=charges, node_mask=mask, chains=None)


def build_edm_diffusion(elements: Sequence[str] = QM9_ELEMENTS, hidden: int = 256, layers: int = 9,
                        timesteps: int = 1000, noise_schedule: str = "polynomial_2", noise_precision: float = 1e-5,
                        norm_values: Sequence[float] = (1.0, 4.0, 10.0), include_charges: bool = True,
                        inv_sublayers: int = 1) -> EDMDiffusion:
    """EDM on QM9 (paper: hidden 256, 9 layers, T 1000): EGNN dynamics wrapped in the diffusion."""
    from trainer.families.molecules_edm.egnn import build_egnn_dynamics

    dynamics = build_egnn_dynamics(len(elements) + int(include_charges), hidden=hidden, layers=layers,
                                   inv_sublayers=inv_sublayers)
    return EDMDiffusion(dynamics, elements=elements, timesteps=timesteps, noise_schedule=noise_schedule,
                        noise_precision=noise_precision, norm_values=norm_values, include_charges=include_charges)

"""Score Entropy Discrete Diffusion (SEDD; Lou, Meng, Ermon, ICML 2024).

Port of ``noise_lib.py``, ``graph_lib.py``, ``losses.py``, ``sampling.py`` and ``catsample.py`` of
github.com/louaaron/Score-Entropy-Discrete-Diffusion with the same semantics, plus explicit
``torch.Generator`` plumbing so that sampling and corruption are reproducible. Every random draw
accepts ``generator``: ``None`` (global RNG), one ``torch.Generator``, or a sequence of generators,
one per batch row (row ``b`` then draws only from ``generator[b]``, so a row's result does not
depend on which other rows share its batch).

Conventions. States are ``0 .. dim-1``. The forward CTMC has generator ``Q`` in row convention,
``Q[i, j]`` = rate of jumping i -> j, and ``p(x_t = j | x_0 = i) = expm(sigma_bar(t) Q)[i, j]``.
``AbsorbingGraph(dim)`` counts the mask in ``dim`` (mask = ``dim - 1``; the reference's
``Absorbing(tokens)`` has ``dim = tokens + 1``). Sigma arguments of graph methods may be a scalar,
``[B]`` or anything broadcastable to the index tensor after appending trailing singleton dims.

Model contract: ``model(x_t, sigma) -> log_score [B, L, dim]`` where ``sigma`` is ``[B]``.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

GeneratorLike = None | torch.Generator | Sequence[torch.Generator]


# --------------------------------------------------------------------------------------------
# Randomness
# --------------------------------------------------------------------------------------------


def _per_row(generator: GeneratorLike) -> bool:
    return generator is not None and not isinstance(generator, torch.Generator)


def _rand(shape: Sequence[int], generator: GeneratorLike, device: torch.device) -> torch.Tensor:
    """U[0, 1) fp32 draws of ``shape``; with a generator list, row b comes from ``generator[b]``."""
    shape = tuple(shape)
    if generator is None:
        return torch.rand(shape, device=device)
    if isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, device=generator.device).to(device)
    gens = list(generator)
    if len(gens) != shape[0]:
        raise ValueError(f"got {len(gens)} generators for a batch of {shape[0]} rows")
    rows = [torch.rand(shape[1:], generator=g, device=g.device).to(device) for g in gens]
    return torch.stack(rows) if rows else torch.empty(shape, device=device)


def _randint(high: int, shape: Sequence[int], generator: GeneratorLike, device: torch.device) -> torch.Tensor:
    """Uniform integers in [0, high) as int64, with the same generator semantics as ``_rand``."""
    shape = tuple(shape)
    if generator is None:
        return torch.randint(0, high, shape, device=device)
    if isinstance(generator, torch.Generator):
        return torch.randint(0, high, shape, generator=generator, device=generator.device).to(device)
    gens = list(generator)
    if len(gens) != shape[0]:
        raise ValueError(f"got {len(gens)} generators for a batch of {shape[0]} rows")
    rows = [torch.randint(0, high, shape[1:], generator=g, device=g.device).to(device) for g in gens]
    return torch.stack(rows) if rows else torch.empty(shape, dtype=torch.long, device=device)


def sample_categorical(probs: torch.Tensor, generator: GeneratorLike = None) -> torch.Tensor:
    """Sample ``argmax_k p_k / E_k`` with E_k ~ Exp(1) (reference ``catsample``, method "hard").

    Equivalent to a categorical draw from unnormalised non-negative ``probs`` (exponential race);
    like the reference it tolerates slightly negative entries (they never win).
    """
    u = _rand(probs.shape, generator, probs.device).to(probs.dtype)
    gumbel_norm = 1e-10 - (u + 1e-10).log()
    return (probs / gumbel_norm).argmax(dim=-1)


# --------------------------------------------------------------------------------------------
# Noise schedules
# --------------------------------------------------------------------------------------------


class Noise(nn.Module, abc.ABC):
    """Noise schedule: ``forward(t) -> (sigma_bar(t), d sigma_bar / dt)`` for t in [0, 1]."""

    @abc.abstractmethod
    def total_noise(self, t: torch.Tensor) -> torch.Tensor:
        """sigma_bar(t) = integral_0^t sigma(s) ds."""

    @abc.abstractmethod
    def rate_noise(self, t: torch.Tensor) -> torch.Tensor:
        """sigma(t) = d sigma_bar / dt."""

    def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.as_tensor(t)
        if not t.is_floating_point():
            t = t.float()
        return self.total_noise(t), self.rate_noise(t)


class LogLinearNoise(Noise):
    """sigma_bar(t) = -log(1 - (1 - eps) t): the masking probability 1 - e^{-sigma_bar} is ~linear in t."""

    def __init__(self, eps: float = 1e-3):
        super().__init__()
        self.eps = eps

    def total_noise(self, t: torch.Tensor) -> torch.Tensor:
        return -torch.log1p(-(1 - self.eps) * t)

    def rate_noise(self, t: torch.Tensor) -> torch.Tensor:
        return (1 - self.eps) / (1 - (1 - self.eps) * t)


class GeometricNoise(Noise):
    """sigma_bar(t) = sigma_min^(1-t) sigma_max^t."""

    def __init__(self, sigma_min: float = 1e-3, sigma_max: float = 1.0):
        super().__init__()
        self.sigma_min = float(sigma_min)
        self.sigma_max = float(sigma_max)

    def total_noise(self, t: torch.Tensor) -> torch.Tensor:
        return self.sigma_min ** (1 - t) * self.sigma_max**t

    def rate_noise(self, t: torch.Tensor) -> torch.Tensor:
        return self.total_noise(t) * (math.log(self.sigma_max) - math.log(self.sigma_min))


def build_noise(name: str, **kw: float) -> Noise:
    """``"loglinear"`` -> LogLinearNoise(**kw); ``"geometric"`` -> GeometricNoise(**kw)."""
    if name == "loglinear":
        return LogLinearNoise(**kw)
    if name == "geometric":
        return GeometricNoise(**kw)
    raise ValueError(f"unknown noise schedule {name!r} (expected 'loglinear' or 'geometric')")


# --------------------------------------------------------------------------------------------
# Graphs (forward CTMCs)
# --------------------------------------------------------------------------------------------


def _unsqueeze_as(sigma: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Append trailing singleton dims so ``sigma`` broadcasts against ``ref``."""
    sigma = torch.as_tensor(sigma, device=ref.device)
    if not sigma.is_floating_point():
        sigma = sigma.float()
    return sigma.reshape(*sigma.shape, *((1,) * (ref.dim() - sigma.dim())))


def _esigm1(sigma: torch.Tensor) -> torch.Tensor:
    # expm1 keeps precision for small sigma; the reference switches at 0.5.
    return torch.where(sigma < 0.5, torch.expm1(sigma), torch.exp(sigma) - 1)


class Graph(abc.ABC):
    """Forward diffusion over ``dim`` states; see module docstring for conventions."""

    dim: int

    @property
    @abc.abstractmethod
    def absorb(self) -> bool:
        """Whether state ``dim - 1`` is absorbing (dropped at the final denoising step)."""

    @abc.abstractmethod
    def rate(self, i: torch.Tensor) -> torch.Tensor:
        """Row i of Q (rates out of i): [*i.shape, dim]."""

    @abc.abstractmethod
    def transp_rate(self, i: torch.Tensor) -> torch.Tensor:
        """Column i of Q (rates into i): [*i.shape, dim]. Used for the reverse rate."""

    @abc.abstractmethod
    def transition(self, i: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """Row i of expm(sigma Q): p(x_t = j | x_0 = i), [*i.shape, dim]."""

    @abc.abstractmethod
    def transp_transition(self, i: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """Column i of expm(sigma Q): p(x_t = i | x_0 = j) as a function of j, [*i.shape, dim]."""

    def sample_transition(self, i: torch.Tensor, sigma: torch.Tensor, generator: GeneratorLike = None) -> torch.Tensor:
        """Draw x_t ~ p(. | x_0 = i) (forward corruption)."""
        return sample_categorical(self.transition(i, sigma), generator)

    def reverse_rate(self, i: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """Reverse rate Q^T(i, y) s(i)_y off the diagonal, diagonal set so rows sum to zero."""
        normalized_rate = self.transp_rate(i) * score
        normalized_rate = normalized_rate.scatter(-1, i[..., None], torch.zeros_like(normalized_rate[..., :1]))
        return normalized_rate.scatter(-1, i[..., None], -normalized_rate.sum(dim=-1, keepdim=True))

    def sample_rate(self, i: torch.Tensor, rate: torch.Tensor, generator: GeneratorLike = None) -> torch.Tensor:
        """One Euler (tau-leaping) step: sample from onehot(i) + rate (rate already times dt)."""
        return sample_categorical(F.one_hot(i, num_classes=self.dim).to(rate) + rate, generator)

    @abc.abstractmethod
    def staggered_score(self, score: torch.Tensor, dsigma: torch.Tensor) -> torch.Tensor:
        """Approximates p_{sigma - dsigma}(z) / p_sigma(x) as expm(-dsigma Q) applied to the score."""

    @abc.abstractmethod
    def sample_limit(
        self, *batch_dims: int, generator: GeneratorLike = None, device: torch.device | None = None
    ) -> torch.Tensor:
        """Sample the limiting (t = 1) distribution, int64 of shape ``batch_dims``."""

    @abc.abstractmethod
    def score_entropy(self, score: torch.Tensor, sigma: torch.Tensor, x: torch.Tensor,
                      x0: torch.Tensor) -> torch.Tensor:
        """Per-position denoising score entropy for log-score ``score`` [*x.shape, dim] (>= 0)."""


class UniformGraph(Graph):
    """Q = 11^T / dim - I: every state jumps to every other at rate 1/dim."""

    def __init__(self, dim: int):
        if dim < 2:
            raise ValueError("UniformGraph needs dim >= 2")
        self.dim = dim

    @property
    def absorb(self) -> bool:
        return False

    def rate(self, i: torch.Tensor) -> torch.Tensor:
        edge = torch.ones(*i.shape, self.dim, device=i.device) / self.dim
        return edge.scatter(-1, i[..., None], -(self.dim - 1) / self.dim)

    def transp_rate(self, i: torch.Tensor) -> torch.Tensor:
        return self.rate(i)

    def transition(self, i: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        sigma = _unsqueeze_as(sigma, i)
        move = -torch.expm1(-sigma[..., None])  # 1 - e^{-sigma}, accurate for tiny sigma
        trans = torch.ones(*i.shape, self.dim, device=i.device, dtype=sigma.dtype) * move / self.dim
        trans = trans.scatter(-1, i[..., None], torch.zeros_like(trans[..., :1]))
        return trans.scatter(-1, i[..., None], 1 - trans.sum(dim=-1, keepdim=True))

    def transp_transition(self, i: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return self.transition(i, sigma)

    def sample_transition(self, i: torch.Tensor, sigma: torch.Tensor, generator: GeneratorLike = None) -> torch.Tensor:
        sigma = _unsqueeze_as(sigma, i)
        move_chance = 1 - (-sigma).exp()
        # One uniform pair per position (move?, target), drawn together: a row's draws are then prefix-stable
        # in its length (padding does not shift them), as the absorbing graph's single uniform is.
        u = _rand((*i.shape, 2), generator, i.device)
        target = (u[..., 1] * self.dim).long().clamp_(max=self.dim - 1)
        # A "move" may land on i itself, which gives exactly the (1 - e^{-sigma}) / dim off-diagonal.
        return torch.where(u[..., 0] < move_chance, target, i)

    def staggered_score(self, score: torch.Tensor, dsigma: torch.Tensor) -> torch.Tensor:
        dim = score.shape[-1]
        epow = (-_unsqueeze_as(dsigma, score[..., 0])).exp()[..., None]
        return ((epow - 1) / (dim * epow)) * score.sum(dim=-1, keepdim=True) + score / epow

    def sample_limit(
        self, *batch_dims: int, generator: GeneratorLike = None, device: torch.device | None = None
    ) -> torch.Tensor:
        return _randint(self.dim, batch_dims, generator, torch.device(device or "cpu"))

    def score_entropy(self, score: torch.Tensor, sigma: torch.Tensor, x: torch.Tensor,
                      x0: torch.Tensor) -> torch.Tensor:
        sigma = _unsqueeze_as(sigma, x)
        esigm1 = _esigm1(sigma)
        ratio = 1 - self.dim / (esigm1 + self.dim)

        # x == x0: every y != x has ratio p(y|x0)/p(x|x0) = `ratio`; x != x0: all ratios are 1
        # except y = x0, whose ratio is 1 + dim / (e^sigma - 1) = 1 / ratio.
        neg_term = score.mean(dim=-1) - torch.gather(score, -1, x[..., None]).squeeze(-1) / self.dim
        neg_term = torch.where(
            x == x0,
            ratio * neg_term,
            torch.gather(score, -1, x0[..., None]).squeeze(-1) / esigm1 + neg_term,
        )
        const = torch.where(
            x == x0,
            (self.dim - 1) / self.dim * ratio * (ratio.log() - 1),
            ((-ratio.log() - 1) / ratio - (self.dim - 2)) / self.dim,
        )
        sexp = score.exp()
        pos_term = sexp.mean(dim=-1) - torch.gather(sexp, -1, x[..., None]).squeeze(-1) / self.dim
        return pos_term - neg_term + const


class AbsorbingGraph(Graph):
    """Every non-mask state jumps to the mask ``dim - 1`` at rate 1; the mask is absorbing.

    ``dim`` includes the mask (the reference's ``Absorbing(tokens)`` is ``AbsorbingGraph(tokens + 1)``).
    """

    def __init__(self, dim: int):
        if dim < 2:
            raise ValueError("AbsorbingGraph needs dim >= 2 (at least one token plus the mask)")
        self.dim = dim

    @property
    def absorb(self) -> bool:
        return True

    def rate(self, i: torch.Tensor) -> torch.Tensor:
        return F.one_hot(torch.full_like(i, self.dim - 1), num_classes=self.dim) - F.one_hot(i, num_classes=self.dim)

    def transp_rate(self, i: torch.Tensor) -> torch.Tensor:
        edge = -F.one_hot(i, num_classes=self.dim)
        edge[i == self.dim - 1] += 1
        return edge

    def transition(self, i: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        # Not implemented in the reference (it samples directly); this is row i of expm(sigma Q):
        # stay with e^{-sigma}, be masked with 1 - e^{-sigma}; the mask row is onehot(mask).
        sigma = _unsqueeze_as(sigma, i)[..., None]
        edge = (-sigma).exp() * F.one_hot(i, num_classes=self.dim)
        move = -torch.expm1(-sigma)  # 1 - e^{-sigma}, accurate for tiny sigma
        return torch.cat([edge[..., :-1], edge[..., -1:] + move], dim=-1)

    def transp_transition(self, i: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        sigma = _unsqueeze_as(sigma, i)[..., None]
        edge = (-sigma).exp() * F.one_hot(i, num_classes=self.dim)
        edge = edge + torch.where(i == self.dim - 1, -torch.expm1(-sigma.squeeze(-1)), 0)[..., None]
        return edge

    def sample_transition(self, i: torch.Tensor, sigma: torch.Tensor, generator: GeneratorLike = None) -> torch.Tensor:
        sigma = _unsqueeze_as(sigma, i)
        move_chance = 1 - (-sigma).exp()
        move_indices = _rand(i.shape, generator, i.device) < move_chance
        return torch.where(move_indices, self.dim - 1, i)

    def staggered_score(self, score: torch.Tensor, dsigma: torch.Tensor) -> torch.Tensor:
        dsigma = _unsqueeze_as(dsigma, score[..., 0])
        extra_const = (1 - dsigma.exp()) * score.sum(dim=-1)
        score = score * dsigma.exp()[..., None]
        return torch.cat([score[..., :-1], score[..., -1:] + extra_const[..., None]], dim=-1)

    def sample_limit(
        self, *batch_dims: int, generator: GeneratorLike = None, device: torch.device | None = None
    ) -> torch.Tensor:
        return torch.full(batch_dims, self.dim - 1, dtype=torch.int64, device=torch.device(device or "cpu"))

    def score_entropy(self, score: torch.Tensor, sigma: torch.Tensor, x: torch.Tensor,
                      x0: torch.Tensor) -> torch.Tensor:
        # Only masked positions have incoming forward rates (Q[y, mask] = 1), so only they count.
        rel_ind = x == self.dim - 1
        sigma = _unsqueeze_as(sigma, x)
        esigm1 = _esigm1(sigma)
        ratio = 1 / esigm1.expand_as(x)[rel_ind]  # p(x0 | x0) / p(mask | x0)
        other_ind = x0[rel_ind]
        neg_term = ratio * torch.gather(score[rel_ind], -1, other_ind[..., None]).squeeze(-1)
        pos_term = score[rel_ind][:, :-1].exp().sum(dim=-1)
        const = ratio * (ratio.log() - 1)
        vals = pos_term - neg_term + const
        entropy = torch.zeros(*x.shape, device=x.device, dtype=vals.dtype)
        entropy[rel_ind] = vals
        return entropy


def build_diffusion_graph(name: str, dim: int) -> Graph:
    """``"absorb"`` -> AbsorbingGraph(dim) (dim includes the mask); ``"uniform"`` -> UniformGraph(dim)."""
    if name == "absorb":
        return AbsorbingGraph(dim)
    if name == "uniform":
        return UniformGraph(dim)
    raise ValueError(f"unknown graph {name!r} (expected 'absorb' or 'uniform')")


# --------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------


def score_entropy_loss(
    model: Callable[..., torch.Tensor],
    graph: Graph,
    noise: Noise,
    x0: torch.Tensor,
    t: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    sampling_eps: float = 1e-3,
    generator: GeneratorLike = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Diffusion-weighted denoising score entropy (reference ``losses.get_loss_fn``).

    Draws t ~ U(sampling_eps, 1) per sequence (unless ``t`` [B] is given), corrupts ``x0`` [B, L]
    to x_t, and weights the per-position score entropy by sigma'(t).

    Returns ``(loss_per_seq [B], n_tokens [B])``: the loss summed over positions where
    ``loss_mask`` (bool [B, L], default all True) holds, and how many positions were counted.
    ``loss_per_seq.sum() / n_tokens.sum()`` is a one-sample Monte Carlo estimate of the NELBO in
    nats per token: the t-integral of this quantity upper-bounds -log p(x0) / L up to the prior
    term KL(p_1(.|x0) || p_limit) (~0 for the absorbing graph; the sampling_eps cut-off is the
    usual small approximation), so its exp upper-bounds perplexity.
    ``attention_mask`` [B, L], if given, is forwarded to the model as ``attention_mask=``.
    """
    b = x0.shape[0]
    if t is None:
        t = (1 - sampling_eps) * _rand((b,), generator, x0.device) + sampling_eps
    sigma, dsigma = noise(t)
    x_t = graph.sample_transition(x0, sigma[:, None], generator=generator)
    if attention_mask is None:
        log_score = model(x_t, sigma)
    else:
        log_score = model(x_t, sigma, attention_mask=attention_mask)
    per_pos = dsigma[:, None] * graph.score_entropy(log_score, sigma[:, None], x_t, x0)
    if loss_mask is None:
        loss_mask = torch.ones_like(x0, dtype=torch.bool)
    loss_mask = loss_mask.to(torch.bool)
    # where, not multiply: a non-finite value at an ignored position must not poison the sum.
    per_pos = torch.where(loss_mask, per_pos, torch.zeros_like(per_pos))
    return per_pos.sum(dim=-1), loss_mask.sum(dim=-1)


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def _score_fn(model: Callable[..., torch.Tensor], x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    # Sampling works with the ratio itself, not its log (reference get_score_fn(sampling=True)).
    return model(x, sigma.reshape(-1)).float().exp()


def _euler_step(
    model: Callable[..., torch.Tensor], graph: Graph, noise: Noise, x: torch.Tensor, t: torch.Tensor,
    step_size: float, generator: GeneratorLike,
) -> torch.Tensor:
    sigma, dsigma = noise(t)
    score = _score_fn(model, x, sigma)
    rev_rate = step_size * dsigma[..., None] * graph.reverse_rate(x, score)
    return graph.sample_rate(x, rev_rate, generator)


def _analytic_step(
    model: Callable[..., torch.Tensor], graph: Graph, noise: Noise, x: torch.Tensor, t: torch.Tensor,
    step_size: float, generator: GeneratorLike,
) -> torch.Tensor:
    curr_sigma = noise(t)[0]
    next_sigma = noise(t - step_size)[0]
    dsigma = curr_sigma - next_sigma
    score = _score_fn(model, x, curr_sigma)
    probs = graph.staggered_score(score, dsigma) * graph.transp_transition(x, dsigma)
    return sample_categorical(probs, generator)


_PREDICTORS = {"euler": _euler_step, "analytic": _analytic_step}


def _denoise_step(
    model: Callable[..., torch.Tensor], graph: Graph, noise: Noise, x: torch.Tensor, t: torch.Tensor,
    generator: GeneratorLike, allowed_states: torch.Tensor | None,
) -> torch.Tensor:
    sigma = noise(t)[0]
    score = _score_fn(model, x, sigma)
    probs = graph.staggered_score(score, sigma) * graph.transp_transition(x, sigma)
    allowed = None if allowed_states is None else allowed_states.to(device=probs.device, dtype=torch.bool)
    if graph.absorb:
        probs = probs[..., :-1]
        allowed = None if allowed is None else allowed[:-1]
    if allowed is not None:
        probs = probs.masked_fill(~allowed, 0.0)
        # A position already decoded to a disallowed state has no allowed mass left (absorbing
        # reverse never changes unmasked tokens); fall back to uniform over the allowed states.
        dead = probs.clamp_min(0).sum(dim=-1, keepdim=True) <= 0
        probs = torch.where(dead, allowed.to(probs.dtype).expand_as(probs), probs)
    return sample_categorical(probs, generator)


@torch.no_grad()
def sample(
    model: nn.Module,
    graph: Graph,
    noise: Noise,
    batch_size: int,
    length: int,
    steps: int,
    predictor: str = "euler",
    denoise: bool = True,
    eps: float = 1e-5,
    generator: GeneratorLike = None,
    allowed_states: torch.Tensor | None = None,
    device: torch.device | None = None,
    proj_fun: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reverse-diffusion sampler (reference ``get_pc_sampler``); returns int64 [batch_size, length].

    Starts from ``graph.sample_limit``, runs ``steps`` predictor steps on
    ``linspace(1, eps, steps + 1)`` ("euler": tau-leaping with the reverse rate; "analytic":
    Tweedie tau-leaping), then (if ``denoise``) one analytic denoising step with the remaining
    sigma(eps), dropping the mask column for the absorbing graph.

    ``generator``: a Generator, or a list of ``batch_size`` generators (one per row: row b's result
    depends only on ``generator[b]``, up to floating-point differences in batched matmuls).
    ``allowed_states``: bool [graph.dim]; disallowed states get probability 0 in the final draw
    (requires ``denoise=True``). ``proj_fun`` is applied to x before every step (e.g. infilling).
    The model is put in eval mode for the call and its previous mode restored.
    """
    if predictor not in _PREDICTORS:
        raise ValueError(f"unknown predictor {predictor!r} (expected one of {sorted(_PREDICTORS)})")
    if allowed_states is not None and not denoise:
        raise ValueError("allowed_states is applied at the final denoising step; pass denoise=True")
    if _per_row(generator) and len(list(generator)) != batch_size:  # type: ignore[arg-type]
        raise ValueError(f"got {len(list(generator))} generators for batch_size={batch_size}")  # type: ignore[arg-type]
    if device is None:
        p = next(iter(model.parameters()), None) if isinstance(model, nn.Module) else None
        device = p.device if p is not None else torch.device("cpu")
    project = proj_fun if proj_fun is not None else (lambda z: z)
    step_fn = _PREDICTORS[predictor]

    was_training = model.training if isinstance(model, nn.Module) else False
    if isinstance(model, nn.Module):
        model.eval()
    try:
        x = graph.sample_limit(batch_size, length, generator=generator, device=device)
        timesteps = torch.linspace(1, eps, steps + 1, device=device)
        dt = (1 - eps) / steps
        for i in range(steps):
            t = timesteps[i] * torch.ones(batch_size, 1, device=device)
            x = step_fn(model, graph, noise, project(x), t, dt, generator)
        if denoise:
            t = timesteps[-1] * torch.ones(batch_size, 1, device=device)
            x = _denoise_step(model, graph, noise, project(x), t, generator, allowed_states)
    finally:
        if isinstance(model, nn.Module):
            model.train(was_training)
    return x


def sample_one_per_generator(
    model: nn.Module,
    graph: Graph,
    noise: Noise,
    generators: Sequence[torch.Generator],
    length: int,
    steps: int,
    predictor: str = "euler",
    denoise: bool = True,
    eps: float = 1e-5,
    allowed_states: torch.Tensor | None = None,
    device: torch.device | None = None,
    proj_fun: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``sample`` with one row per generator: sample k is a function of ``generators[k]`` alone."""
    return sample(
        model, graph, noise, len(generators), length, steps, predictor=predictor, denoise=denoise,
        eps=eps, generator=list(generators), allowed_states=allowed_states, device=device, proj_fun=proj_fun,
    )

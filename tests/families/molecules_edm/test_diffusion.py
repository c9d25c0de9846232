"""EDM's diffusion (trainer/families/molecules_edm/diffusion.py): the polynomial_2 schedule against its closed
form, zero centre of mass through noising and every sampler step, the l2 training loss and every term of the
evaluation bound against hand computations (float64, closed-form schedule, erf), the ancestral sampler against
a hand replay of its formulas and its per-molecule random streams, batch-composition independence, chains."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.families.molecules_edm.diffusion import (
    EDMDiffusion,
    build_edm_diffusion,
    polynomial_gamma,
)

F = 6  # H C N O F one-hot + charge
Z = (1, 6, 7, 8, 9)


def closed_alpha2(T: int, s: float = 1e-5) -> np.ndarray:
    """(1 - (t/T)^2)^2; only the last step ratio (0 -> clipped to 1e-3) bites; then the precision mix."""
    t = np.arange(T + 1)
    a2 = (1 - (t / T) ** 2) ** 2
    a2[T] = 1e-3 * a2[T - 1]
    return (1 - 2 * s) * a2 + s


def closed_gamma(T: int) -> np.ndarray:
    a2 = closed_alpha2(T)
    return np.log(1 - a2) - np.log(a2)


class Recorder(nn.Module):
    """Wraps a dynamics (or returns fixed outputs) and records its inputs."""

    num_features = F

    def __init__(self, inner: nn.Module | None = None, fixed: torch.Tensor | None = None, linear: float | None = None):
        super().__init__()
        self.inner, self.fixed, self.linear = inner, fixed, linear
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x, h, t, node_mask):
        self.calls.append((x.clone(), torch.as_tensor(t).clone()))
        m = node_mask.float().unsqueeze(-1)
        if self.inner is not None:
            return self.inner(x, h, t, node_mask)
        if self.linear is not None:
            return self.linear * x * m, self.linear * h * m
        return self.fixed[..., :3] * m, self.fixed[..., 3:] * m


def _molecules():
    """Two molecules padded to 4 atoms: CH3-O... (C, O, H, H) and (N, H, F)."""
    types = torch.tensor([[1, 3, 0, 0], [2, 0, 4, 0]])
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    one_hot = torch.nn.functional.one_hot(types, 5).float() * mask.unsqueeze(-1)
    charges = torch.tensor(Z)[types] * mask
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 3, generator=gen) * 1.2 + 0.7  # not centred: the model centres
    x = x * mask.unsqueeze(-1)
    return x, one_hot, charges, mask


def _centred_noise(mask: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    eps = torch.randn(*mask.shape, 3 + F, generator=gen) * mask.unsqueeze(-1)
    m = mask.float().unsqueeze(-1)
    ex = eps[..., :3]
    eps[..., :3] = ex - ex.sum(1, keepdim=True) / m.sum(1, keepdim=True) * m
    return eps


def _hand_inputs(x, one_hot, charges, mask, norm_x: float = 1.0):
    x, one_hot, charges, m = (a.double().numpy() for a in (x, one_hot, charges, mask))
    m = m[..., None]
    n = m.sum(axis=(1, 2))
    xc = (x - (x * m).sum(1, keepdims=True) / n[:, None, None]) * m / norm_x
    h = np.concatenate([one_hot / 4, charges[..., None] / 10], axis=-1) * m
    return np.concatenate([xc, h], axis=-1), m, n


def _hand_kl_prior(xh, m, n, gamma_T):
    a2, s2 = 1 / (1 + np.exp(gamma_T)), 1 / (1 + np.exp(-gamma_T))
    d = (n - 1) * 3
    kl_x = d * -0.5 * np.log(s2) + 0.5 * (d * s2 + a2 * (xh[..., :3] ** 2).sum((1, 2))) - 0.5 * d
    kl_h = ((-0.5 * np.log(s2) + 0.5 * (s2 + a2 * xh[..., 3:] ** 2) - 0.5) * m).sum((1, 2))
    return kl_x + kl_h


def _phi(v):
    return 0.5 * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))


def _hand_log_p_h(xh, z, m, gamma_0):
    """Discretised likelihood of the one-hot (softmax over classes) and the charge, per molecule."""
    s0 = math.sqrt(1 / (1 + math.exp(-gamma_0)))
    centred_cat = z[..., 3:8] * 4 - 1
    prop = np.log(_phi((centred_cat + 0.5) / (4 * s0)) - _phi((centred_cat - 0.5) / (4 * s0)) + 1e-10)
    logp = prop - np.log(np.exp(prop).sum(-1, keepdims=True))
    log_cat = (logp * xh[..., 3:8] * 4 * m).sum((1, 2))
    centred_int = np.round(xh[..., 8:] * 10) - z[..., 8:] * 10
    log_int = (np.log(_phi((centred_int + 0.5) / (10 * s0)) - _phi((centred_int - 0.5) / (10 * s0)) + 1e-10) * m)
    return log_cat + log_int.sum((1, 2))


def test_schedule_matches_closed_form() -> None:
    for T in (1000, 10):
        gamma = polynomial_gamma(T).double().numpy()
        ref = closed_gamma(T)
        for t in (0, 1, T // 2, T - 1, T):
            assert gamma[t] == pytest.approx(ref[t], rel=1e-6, abs=1e-5), (T, t)
    gamma = closed_gamma(1000)
    sigma = np.sqrt(1 / (1 + np.exp(-gamma)))
    assert sigma[0] == pytest.approx(math.sqrt(1e-5), rel=1e-6)
    # the design note: sigma_t <= 0.8 on the last 632 of 1000 steps (t = 1..632)
    model = EDMDiffusion(Recorder(fixed=torch.zeros(1)), timesteps=1000)
    assert int((model.sigma_at(torch.arange(1, 1001)) <= 0.8).sum()) == 632


def test_noising_keeps_zero_centre_of_mass() -> None:
    torch.manual_seed(0)
    inner = build_edm_diffusion(hidden=16, layers=2, timesteps=10).dynamics
    rec = Recorder(inner=inner)
    model = EDMDiffusion(rec, timesteps=10)
    x, one_hot, charges, mask = _molecules()
    loss = model.training_loss(x, one_hot, charges, mask, generator=torch.Generator().manual_seed(1))
    assert loss.shape == (2,) and torch.isfinite(loss).all()
    z_x, _ = rec.calls[-1]
    com = (z_x * mask.unsqueeze(-1)).sum(1)
    assert com.abs().max() < 1e-5 and z_x.abs().max() > 0.1


def test_training_loss_matches_hand_computation() -> None:
    T = 10
    x, one_hot, charges, mask = _molecules()
    fixed = torch.randn(2, 4, 3 + F, generator=torch.Generator().manual_seed(7)) * 0.3
    rec = Recorder(fixed=fixed)
    model = EDMDiffusion(rec, timesteps=T)
    eps = _centred_noise(mask, 11)
    t_int = torch.tensor([7, 0])
    loss = model.training_loss(x, one_hot, charges, mask, t_int=t_int, eps=eps).double().numpy()

    xh, m, n = _hand_inputs(x, one_hot, charges, mask)
    gamma = closed_gamma(T)
    net = (fixed.double().numpy()) * m
    eps_np = eps.double().numpy()
    kl = _hand_kl_prior(xh, m, n, gamma[T])
    denom = (3 + F) * 4
    # molecule 0, t = 7: 0.5 ||eps - eps_hat||^2 / ((3 + F) N_max)
    expected0 = kl[0] + 0.5 * ((eps_np[0] - net[0]) ** 2).sum() / denom
    # molecule 1, t = 0: the same x error, minus the discretised log-likelihood of one-hot and charges at z_0
    a0, s0 = math.sqrt(1 / (1 + math.exp(gamma[0]))), math.sqrt(1 / (1 + math.exp(-gamma[0])))
    z0 = a0 * xh + s0 * eps_np
    log_h = _hand_log_p_h(xh, z0, m, gamma[0])
    expected1 = kl[1] + 0.5 * ((eps_np[1, :, :3] - net[1, :, :3]) ** 2).sum() / denom - log_h[1]
    np.testing.assert_allclose(loss, [expected0, expected1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rec.calls[-1][1], torch.tensor([0.7, 0.0]))  # t / T goes to the dynamics
    assert log_h[1] > -1.0  # z_0 is near the data: types and charge are likely


def test_nll_terms_match_hand_computation() -> None:
    T = 10
    x, one_hot, charges, mask = _molecules()
    fixed = torch.randn(2, 4, 3 + F, generator=torch.Generator().manual_seed(8)) * 0.3
    model = EDMDiffusion(Recorder(fixed=fixed), timesteps=T, norm_values=(2.0, 4.0, 10.0))
    eps, eps_0 = _centred_noise(mask, 12), _centred_noise(mask, 13)
    t_int = torch.tensor([3, 10])
    terms = model.nll_terms(x, one_hot, charges, mask, t_int=t_int, eps=eps, eps_0=eps_0)
    terms = {k: v.double().numpy() for k, v in terms.items()}

    xh, m, n = _hand_inputs(x, one_hot, charges, mask, norm_x=2.0)
    gamma = closed_gamma(T)
    net = fixed.double().numpy() * m
    eps_np, eps0_np = eps.double().numpy(), eps_0.double().numpy()
    d = (n - 1) * 3
    t = t_int.numpy()
    diffusion = T * 0.5 * (np.exp(gamma[t] - gamma[t - 1]) - 1) * ((eps_np - net) ** 2).sum((1, 2))
    neg_log_constants = -d * (-0.5 * gamma[0] - 0.5 * math.log(2 * math.pi))
    a0, s0 = math.sqrt(1 / (1 + math.exp(gamma[0]))), math.sqrt(1 / (1 + math.exp(-gamma[0])))
    z0 = a0 * xh + s0 * eps0_np
    reconstruction = 0.5 * ((eps0_np[..., :3] - net[..., :3]) ** 2).sum((1, 2)) - _hand_log_p_h(xh, z0, m, gamma[0])
    expected = {"kl_prior": _hand_kl_prior(xh, m, n, gamma[T]), "diffusion": diffusion,
                "neg_log_constants": neg_log_constants, "reconstruction": reconstruction,
                "neg_log_det": d * math.log(2.0)}
    assert set(terms) == set(expected)
    for key, value in expected.items():
        atol = 1e-6 if key == "kl_prior" else 1e-4  # the prior KL is ~1e-4 nats: check it at its own scale
        np.testing.assert_allclose(terms[key], value, rtol=5e-3 if key == "kl_prior" else 1e-4, atol=atol, err_msg=key)
    assert terms["kl_prior"].min() > 1e-5


def test_nll_is_finite_and_sums_its_terms() -> None:
    torch.manual_seed(0)
    model = build_edm_diffusion(hidden=16, layers=2, timesteps=10)
    x, one_hot, charges, mask = _molecules()
    nll = model.nll(x, one_hot, charges, mask, generator=torch.Generator().manual_seed(5))
    terms = model.nll_terms(x, one_hot, charges, mask, generator=torch.Generator().manual_seed(5))
    assert nll.shape == (2,) and torch.isfinite(nll).all()
    torch.testing.assert_close(nll, sum(terms.values()))


@pytest.mark.numerics
def test_nll_with_row_streams_depends_on_the_molecule_alone() -> None:
    """Evaluation keys each molecule's t, eps and eps_0 by the molecule (SampleRandom rows): its NLL is the same
    alone or in a batch, padded wider or not, and the global RNG is not touched."""
    from trainer.sample_random import SampleRandom

    torch.manual_seed(0)
    model = build_edm_diffusion(hidden=16, layers=2, timesteps=10).eval()
    x, one_hot, charges, mask = _molecules()
    rng = SampleRandom([11, 22])
    state = torch.get_rng_state()
    with torch.no_grad():
        both = model.nll(x, one_hot, charges, mask, rng=rng)
        alone = torch.cat([model.nll(x[k:k + 1], one_hot[k:k + 1], charges[k:k + 1], mask[k:k + 1], rng=rng[[k]])
                           for k in range(2)])
        swapped = model.nll(x.flip(0), one_hot.flip(0), charges.flip(0), mask.flip(0), rng=SampleRandom([22, 11]))
        narrow = model.nll(x[1:, :3], one_hot[1:, :3], charges[1:, :3], mask[1:, :3], rng=rng[[1]])  # no padding
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(both, alone, rtol=0, atol=1e-4)
    torch.testing.assert_close(both, swapped.flip(0), rtol=0, atol=1e-4)
    torch.testing.assert_close(narrow, both[1:], rtol=0, atol=1e-4)
    assert not torch.allclose(both, model.nll(x, one_hot, charges, mask, rng=SampleRandom([12, 23])))


def _hand_sample(num_atoms, seeds, T, linear):
    """The sampler's formulas in float64 with eps_hat = linear * z, replaying each molecule's draws."""
    gamma = closed_gamma(T)
    a2 = 1 / (1 + np.exp(gamma))
    s2 = 1 - a2
    out = []
    for n, seed in zip(num_atoms, seeds):
        gen = torch.Generator().manual_seed(seed)

        def draw(n=n, gen=gen):
            d = torch.randn((n, 3 + F), generator=gen).double().numpy()
            d[:, :3] -= d[:, :3].mean(0)
            return d

        z = draw()
        for s in reversed(range(T)):
            t = s + 1
            alpha_ts = math.sqrt(a2[t] / a2[s])
            sigma2_ts = 1 - a2[t] / a2[s]
            sigma_t, sigma_s = math.sqrt(s2[t]), math.sqrt(s2[s])
            mu = z / alpha_ts - sigma2_ts / (alpha_ts * sigma_t) * (linear * z)
            z = mu + math.sqrt(sigma2_ts) * sigma_s / sigma_t * draw()
            z[:, :3] -= z[:, :3].mean(0)
        x0 = (z - math.sqrt(s2[0]) * linear * z) / math.sqrt(a2[0])
        x = x0[:, :3] + math.sqrt(s2[0] / a2[0]) * draw()[:, :3]
        out.append((x - x.mean(0), z[:, 3:8].argmax(1), np.round(z[:, 8] * 10)))
    return out


def test_sampler_replays_by_hand_with_per_molecule_streams() -> None:
    T, linear = 4, 0.5
    model = EDMDiffusion(Recorder(linear=linear), timesteps=T)
    num_atoms, seeds = [2, 5, 3], [21, 22, 23]
    out = model.sample(num_atoms, [torch.Generator().manual_seed(s) for s in seeds])
    for k, (x, types, charges) in enumerate(_hand_sample(num_atoms, seeds, T, linear)):
        n = num_atoms[k]
        np.testing.assert_allclose(out.positions[k, :n].double().numpy(), x, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(out.type_index[k, :n].numpy(), types)
        np.testing.assert_array_equal(out.charges[k, :n].numpy(), charges)
        np.testing.assert_array_equal(out.atomic_numbers[k, :n].numpy(), np.asarray(Z)[types])
        assert torch.all(out.positions[k, n:] == 0) and torch.all(out.atomic_numbers[k, n:] == 0)


@pytest.mark.numerics
def test_sample_is_independent_of_batch_composition_and_centred_every_step() -> None:
    torch.manual_seed(0)
    model = build_edm_diffusion(hidden=16, layers=2, timesteps=8)
    seen = []

    def hook(positions, types, node_mask, sigma_t, step_index):
        seen.append((positions.clone(), node_mask.clone(), sigma_t, step_index))
        return positions

    batch = model.sample([3, 6, 4], [torch.Generator().manual_seed(s) for s in (5, 6, 7)], guidance=hook)
    alone = model.sample([6], [torch.Generator().manual_seed(6)])
    other = model.sample([6, 9], [torch.Generator().manual_seed(s) for s in (6, 8)])
    for out, k in ((alone, 0), (other, 0)):
        torch.testing.assert_close(out.positions[k, :6], batch.positions[1, :6], atol=1e-5, rtol=1e-5)
        assert torch.equal(out.type_index[k, :6], batch.type_index[1, :6])
        assert torch.equal(out.charges[k, :6], batch.charges[1, :6])
    # the hook saw every step once, in order, with sigma_t of the noisier time, all centred
    assert [s[3] for s in seen] == list(range(8))
    assert [s[2] for s in seen] == pytest.approx(model.sigma_at(torch.arange(8, 0, -1)).tolist())
    for positions, node_mask, _, _ in seen + [(batch.positions, batch.node_mask, 0, 0)]:
        com = (positions * node_mask.unsqueeze(-1)).sum(1)
        assert com.abs().max() < 1e-4 * max(1.0, positions.abs().max().item())


def test_chain_frames() -> None:
    torch.manual_seed(0)
    model = build_edm_diffusion(hidden=16, layers=2, timesteps=9)
    num_atoms, seeds = [4, 3, 5], [1, 2, 3]
    out = model.sample(num_atoms, [torch.Generator().manual_seed(s) for s in seeds], chain_frames=4, chain_for=2)
    assert out.chains is not None and len(out.chains) == 2
    for k, chain in enumerate(out.chains):
        n = num_atoms[k]
        assert [f.step for f in chain] == [0, 3, 6, 9]
        assert all(f.positions.shape == (n, 3) and f.type_index.shape == (n,) for f in chain)
        assert torch.equal(chain[-1].positions, out.positions[k, :n])
        assert torch.equal(chain[-1].type_index, out.type_index[k, :n])
        first = torch.randn((n, 3 + F), generator=torch.Generator().manual_seed(seeds[k]))[:, :3]
        torch.testing.assert_close(chain[0].positions, first - first.sum(0) / n)  # the prior draw z_T
        for frame in chain:
            assert frame.positions.sum(0).abs().max() < 1e-4 * max(1.0, frame.positions.abs().max().item())
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    assert [f.step for f in model.sample(num_atoms, gens, chain_frames=1, chain_for=1).chains[0]] == [9]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    assert len(model.sample(num_atoms, gens, chain_frames=50, chain_for=1).chains[0]) == 10
    assert model.sample([2], [torch.Generator()]).chains is None
    mols = out.to_molecules()
    assert [m.num_atoms for m in mols] == num_atoms


def test_bad_inputs_raise() -> None:
    model = build_edm_diffusion(hidden=8, layers=1, timesteps=4)
    x, one_hot, charges, mask = _molecules()
    with pytest.raises(ConfigError):
        model.sample([3, 4], [torch.Generator()])
    with pytest.raises(ConfigError):
        model.sample([0], [torch.Generator()])
    with pytest.raises(ConfigError):
        model.training_loss(x, one_hot, charges, mask, t_int=torch.tensor([5, 0]))
    from trainer.errors import DataError

    with pytest.raises(DataError, match="one_hot"):
        model.training_loss(x, one_hot[..., :4], charges, mask)
    empty = mask.clone()
    empty[1] = False
    with pytest.raises(DataError, match="no atoms"):
        model.nll(x, one_hot, charges, empty)
    with pytest.raises(ConfigError):
        EDMDiffusion(Recorder(fixed=torch.zeros(1)), timesteps=10, norm_values=(1.0, 4.0, 100.0))

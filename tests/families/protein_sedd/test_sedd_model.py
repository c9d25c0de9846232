"""SEDD (score entropy discrete diffusion) graphs, noise, loss, samplers and the DDiT network.

Kernels are checked against torch.matrix_exp of the explicit generator Q (row convention,
Q[i, j] = rate i -> j), and the score entropy against a loop-by-loop evaluation of the paper's
definition: sum_{y != x} Q[y, x] (s_y - r_y log s_y + K(r_y)), r_y = p_t(y|x0) / p_t(x|x0),
K(a) = a (log a - 1).
"""

import math

import pytest
import torch

from trainer.families.protein_sedd.ddit import DDIT_PRESETS, DDiT, count_flops_per_token
from trainer.families.protein_sedd.sedd import (
    AbsorbingGraph,
    GeometricNoise,
    LogLinearNoise,
    UniformGraph,
    build_diffusion_graph,
    build_noise,
    sample,
    sample_one_per_generator,
    score_entropy_loss,
)

DIM = 4
SIGMAS = [1e-6, 1e-3, 0.3, 0.7, 2.0, 10.0]


def q_matrix(name: str, dim: int) -> torch.Tensor:
    """Explicit forward generator, row convention, float64."""
    if name == "absorb":
        q = torch.zeros(dim, dim, dtype=torch.float64)
        for y in range(dim - 1):
            q[y, dim - 1] = 1.0
            q[y, y] = -1.0
        return q
    return torch.full((dim, dim), 1.0 / dim, dtype=torch.float64) - torch.eye(dim, dtype=torch.float64)


def graphs():
    return [("absorb", AbsorbingGraph(DIM)), ("uniform", UniformGraph(DIM))]


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> torch.nn.Module:
    """Break adaLN-zero (which makes a fresh DDiT input-independent) so the network does something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return model


def tiny_model(vocab: int, absorbing: bool = True, dropout: float = 0.0) -> DDiT:
    return DDiT(vocab, **DDIT_PRESETS["tiny"], dropout=dropout, scale_by_sigma=absorbing, absorbing=absorbing)


# ------------------------------------------------------------------------------ kernels


@pytest.mark.parametrize("name,graph", graphs())
def test_rates_and_transitions_match_matrix_exp(name, graph):
    q = q_matrix(name, DIM)
    idx = torch.arange(DIM)
    assert torch.equal(graph.rate(idx).double(), q)
    assert torch.equal(graph.transp_rate(idx).double(), q.T)
    for s in SIGMAS:
        sigma = torch.tensor(s, dtype=torch.float64)
        expm = torch.matrix_exp(s * q)
        trans = graph.transition(idx, sigma)
        assert torch.allclose(trans.sum(-1), torch.ones(DIM, dtype=torch.float64), atol=1e-12), s
        assert torch.allclose(trans, expm, atol=1e-10), s
        assert torch.allclose(graph.transp_transition(idx, sigma), expm.T, atol=1e-10), s
        # float32 with a batch-shaped sigma, as used in training
        trans32 = graph.transition(idx[None].expand(2, DIM), torch.tensor([s, s], dtype=torch.float32))
        assert torch.allclose(trans32.sum(-1), torch.ones(2, DIM), atol=1e-6)
        assert torch.allclose(trans32[0].double(), expm, atol=1e-6)


@pytest.mark.parametrize("name,graph", graphs())
def test_staggered_score_and_reverse_rate(name, graph):
    q = q_matrix(name, DIM)
    g = torch.Generator().manual_seed(0)
    score = torch.rand(3, DIM, generator=g, dtype=torch.float64) + 0.1
    dsigma = torch.tensor([0.05, 0.3, 1.0], dtype=torch.float64)
    stag = graph.staggered_score(score, dsigma)
    for b in range(3):
        assert torch.allclose(stag[b], score[b] @ torch.matrix_exp(-dsigma[b] * q), atol=1e-10)
    i = torch.tensor([0, DIM - 1, 2])
    rr = graph.reverse_rate(i, score)
    assert torch.allclose(rr.sum(-1), torch.zeros(3, dtype=torch.float64), atol=1e-12)
    for b in range(3):
        for y in range(DIM):
            if y != i[b]:
                assert rr[b, y].item() == pytest.approx((q[y, i[b]] * score[b, y]).item())


@pytest.mark.parametrize("name,graph", graphs())
def test_sample_transition_marginals(name, graph):
    n, sigma = 20000, torch.tensor(0.7)
    g = torch.Generator().manual_seed(1)
    for x0 in (0, 2):
        xs = graph.sample_transition(torch.full((n,), x0), sigma, generator=g)
        freq = torch.bincount(xs, minlength=DIM).float() / n
        expected = graph.transition(torch.tensor([x0]), sigma)[0]
        assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


@pytest.mark.parametrize("noise", [LogLinearNoise(), LogLinearNoise(eps=1e-2), GeometricNoise(),
                                   GeometricNoise(1e-4, 20.0)])
def test_noise_rate_is_derivative_of_total(noise):
    t = torch.linspace(0.01, 0.99, 25, dtype=torch.float64)
    h = 1e-6
    numeric = (noise(t + h)[0] - noise(t - h)[0]) / (2 * h)
    total, rate = noise(t)
    assert torch.allclose(rate, numeric, rtol=1e-5)
    assert torch.all(total > 0) and torch.all(torch.diff(total) > 0)


def test_builders():
    assert isinstance(build_noise("loglinear"), LogLinearNoise)
    assert isinstance(build_noise("geometric", sigma_min=1e-4, sigma_max=20), GeometricNoise)
    absorbing = build_diffusion_graph("absorb", 5)
    assert isinstance(absorbing, AbsorbingGraph) and absorbing.dim == 5
    assert isinstance(build_diffusion_graph("uniform", 5), UniformGraph)
    with pytest.raises(ValueError):
        build_diffusion_graph("nope", 3)
    with pytest.raises(ValueError):
        build_noise("nope")


# ------------------------------------------------------------------------------ score entropy


def explicit_score_entropy(name, log_score, sigma, x, x0):
    """The paper's DWDSE integrand per position, by explicit loops (no vectorised graph code)."""
    dim = log_score.shape[-1]
    q = q_matrix(name, dim)
    p = torch.matrix_exp(sigma * q)  # p[a, b] = p_sigma(b | a)
    out = []
    for pos in range(len(x)):
        xi, x0i = int(x[pos]), int(x0[pos])
        total = 0.0
        for y in range(dim):
            if y == xi:
                continue
            w = q[y, xi].item()  # forward rate y -> x
            if w == 0:
                continue
            r = (p[x0i, y] / p[x0i, xi]).item()
            s = log_score[pos, y].item()
            term = math.exp(s)
            if r > 0:
                term += -r * s + r * (math.log(r) - 1)
            total += w * term
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("sigma", [0.3, 0.7, 2.5])
@pytest.mark.parametrize(
    "name,graph,x",
    [("absorb", AbsorbingGraph(DIM), [3, 1, 3]), ("uniform", UniformGraph(DIM), [0, 2, 3])],
)
def test_score_entropy_matches_hand_computation(name, graph, x, sigma):
    x0 = torch.tensor([[0, 1, 2]])
    x = torch.tensor([x])
    g = torch.Generator().manual_seed(3)
    log_score = torch.randn(1, 3, DIM, generator=g, dtype=torch.float64)
    got = graph.score_entropy(log_score, torch.tensor([[sigma]], dtype=torch.float64), x, x0)
    want = explicit_score_entropy(name, log_score[0], sigma, x[0], x0[0])
    assert got.shape == (1, 3)
    assert torch.allclose(got[0], want, atol=1e-10), (got, want)


@pytest.mark.parametrize("name,graph", graphs())
def test_score_entropy_nonnegative_and_zero_at_true_ratio(name, graph):
    q = q_matrix(name, DIM)
    pairs = [(a, b) for a in range(DIM - (name == "absorb")) for b in range(DIM)]
    x0 = torch.tensor([[a for a, _ in pairs]])
    for sigma in [1e-3, 0.3, 0.7, 3.0]:
        x = x0.clone()
        x[0] = torch.tensor([b for _, b in pairs])
        if name == "absorb":  # reachable states only: x = x0 or mask
            x = torch.where(x == x0, x0, torch.full_like(x0, DIM - 1))
        s = torch.tensor([[sigma]], dtype=torch.float64)
        g = torch.Generator().manual_seed(4)
        rand_scores = torch.randn(50, *x.shape[1:], DIM, generator=g, dtype=torch.float64) * 2
        ent = graph.score_entropy(rand_scores, s, x.expand(50, -1), x0.expand(50, -1))
        assert torch.all(ent >= -1e-9)
        p = torch.matrix_exp(sigma * q)
        true = torch.zeros(1, x.shape[1], DIM, dtype=torch.float64)
        for pos in range(x.shape[1]):
            xi, x0i = int(x[0, pos]), int(x0[0, pos])
            ratio = p[x0i] / p[x0i, xi]
            true[0, pos] = torch.where(ratio > 0, ratio.log(), torch.full_like(ratio, -torch.inf))
            true[0, pos, xi] = 0.0
        ent_true = graph.score_entropy(true, s, x, x0)
        assert torch.allclose(ent_true, torch.zeros_like(ent_true), atol=1e-5), (sigma, ent_true)


def test_score_entropy_loss_mask_and_counts():
    graph, noise = AbsorbingGraph(5), LogLinearNoise()
    model = tiny_model(5)
    x0 = torch.randint(0, 4, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 3:] = False
    loss, n = score_entropy_loss(model, graph, noise, x0, loss_mask=mask, generator=torch.Generator().manual_seed(5))
    loss_all, n_all = score_entropy_loss(model, graph, noise, x0, generator=torch.Generator().manual_seed(5))
    assert loss.shape == (3,) and n.tolist() == [6, 3, 6] and n_all.tolist() == [6, 6, 6]
    assert torch.all(loss >= 0) and torch.all(loss <= loss_all + 1e-6)
    assert torch.allclose(loss[[0, 2]], loss_all[[0, 2]])


# ------------------------------------------------------------------------------ DDiT


def test_ddit_shape_current_token_zero_and_determinism():
    torch.manual_seed(0)
    model = randomize(tiny_model(5, dropout=0.1)).eval()
    x = torch.randint(0, 5, (2, 7))
    sigma = torch.tensor([0.2, 1.5])
    out = model(x, sigma)
    assert out.shape == (2, 7, 5)
    assert torch.all(out.gather(-1, x[..., None]) == 0)
    assert torch.equal(out, model(x, sigma))
    assert torch.isfinite(out).all()


def test_ddit_padding_mask_isolates_real_positions():
    torch.manual_seed(0)
    model = randomize(tiny_model(6)).eval()
    x = torch.randint(0, 5, (2, 8))
    attn = torch.ones(2, 8, dtype=torch.bool)
    attn[0, 5:] = False
    attn[1, 6:] = False
    x_other = x.clone()
    x_other[0, 5:] = (x[0, 5:] + 1) % 5
    x_other[1, 6:] = (x[1, 6:] + 2) % 5
    sigma = torch.tensor([0.5, 0.5])
    a, b = model(x, sigma, attention_mask=attn), model(x_other, sigma, attention_mask=attn)
    assert torch.allclose(a[attn], b[attn], atol=1e-5)
    # and without the mask the padded tokens do leak, so the check above is not vacuous
    assert not torch.allclose(model(x, sigma)[attn], model(x_other, sigma)[attn], atol=1e-5)


def test_ddit_adaln_zero_init():
    model = tiny_model(5).eval()
    x = torch.randint(0, 5, (2, 4))
    sigma = torch.tensor([0.01, 2.0])
    seen = {}
    model.output_layer.register_forward_hook(lambda m, i, o: seen.setdefault("out", o))
    out = model(x, sigma)
    assert torch.all(seen["out"] == 0)
    expected = (-torch.expm1(sigma).log() - math.log(4))[:, None, None].expand(2, 4, 5)
    expected = torch.scatter(expected, -1, x[..., None], 0.0)
    assert torch.allclose(out, expected, atol=1e-6)


def test_ddit_config_errors_and_flops():
    with pytest.raises(ValueError):
        DDiT(5, 64, 4, 1, 32, scale_by_sigma=True, absorbing=False)
    small = count_flops_per_token(DDIT_PRESETS["small"], 1024, vocab_size=50258)
    # ~6 * 124M params (85M blocks + 38.6M head) plus attention: ~ 0.8 GFLOP/token
    assert 6e8 < small < 1.1e9
    assert count_flops_per_token(DDIT_PRESETS["tiny"], 16, vocab_size=5) > 0


# ------------------------------------------------------------------------------ samplers


@pytest.mark.parametrize("predictor", ["euler", "analytic"])
@pytest.mark.parametrize("name", ["absorb", "uniform"])
def test_sampler_shape_allowed_and_reproducible(name, predictor):
    dim = 5
    graph = build_diffusion_graph(name, dim)
    noise = LogLinearNoise() if name == "absorb" else GeometricNoise(1e-3, 5.0)
    torch.manual_seed(0)
    model = randomize(tiny_model(dim, absorbing=name == "absorb"), std=0.3)
    allowed = torch.tensor([True, True, True, False, False])
    kw = dict(steps=6, predictor=predictor, allowed_states=allowed)

    def gens(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    a = sample(model, graph, noise, 3, 6, generator=torch.Generator().manual_seed(0), **kw)
    b = sample(model, graph, noise, 3, 6, generator=torch.Generator().manual_seed(0), **kw)
    assert a.shape == (3, 6) and a.dtype == torch.int64
    assert torch.equal(a, b)
    assert allowed[a].all()
    assert model.training  # mode restored

    rows = sample_one_per_generator(model, graph, noise, gens([10, 11, 12]), 6, **kw)
    alone = sample_one_per_generator(model, graph, noise, gens([11]), 6, **kw)
    again = sample(model, graph, noise, 3, 6, generator=gens([10, 11, 12]), **kw)
    assert allowed[rows].all()
    assert torch.equal(rows[1], alone[0])
    assert torch.equal(rows, again)


def test_sampler_argument_errors():
    graph, noise = AbsorbingGraph(5), LogLinearNoise()
    model = tiny_model(5)
    with pytest.raises(ValueError):
        sample(model, graph, noise, 2, 4, 2, predictor="nope")
    with pytest.raises(ValueError):
        sample(model, graph, noise, 2, 4, 2, generator=[torch.Generator()])
    with pytest.raises(ValueError):
        sample(model, graph, noise, 2, 4, 2, denoise=False, allowed_states=torch.ones(5, dtype=torch.bool))
    x = sample(model, graph, noise, 2, 4, 2, denoise=False, generator=torch.Generator().manual_seed(0))
    assert x.shape == (2, 4) and int(x.max()) <= 4


# ------------------------------------------------------------------------------ training


def test_tiny_model_learns_toy_data():
    torch.manual_seed(0)
    graph, noise = AbsorbingGraph(5), LogLinearNoise()  # A C G T + mask
    model = tiny_model(5)
    data = torch.tensor([[0, 1] * 4, [1, 0] * 4, [2, 3] * 4])  # ACACACAC, CACACACA, GTGTGTGT
    eval_x0 = data[torch.randint(0, 3, (256,), generator=torch.Generator().manual_seed(1))]

    def eval_loss():
        model.eval()
        with torch.no_grad():
            loss, n = score_entropy_loss(model, graph, noise, eval_x0, generator=torch.Generator().manual_seed(2))
        model.train()
        return (loss.sum() / n.sum()).item()

    before = eval_loss()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(3)
    for _ in range(100):
        x0 = data[torch.randint(0, 3, (32,), generator=g)]
        loss, n = score_entropy_loss(model, graph, noise, x0, generator=g)
        opt.zero_grad()
        (loss.sum() / n.sum()).backward()
        opt.step()
    after = eval_loss()
    print("toy loss before/after", before, after)
    assert after < 0.6 * before, (before, after)


# ------------------------------------------------------------------------------ exact-score oracle

TOY = torch.tensor([[0, 1] * 4, [1, 0] * 4, [2, 3] * 4])  # data: uniform over these 3 sequences


class OracleScore(torch.nn.Module):
    """Exact log ratios log p_t(x with x_i -> y) / p_t(x) for data uniform over TOY (float64)."""

    def __init__(self, graph):
        super().__init__()
        self.graph = graph

    def forward(self, x, sigma):
        sigma = sigma.reshape(-1).double()
        k, length = TOY.shape
        trans = self.graph.transition(TOY[None].expand(len(x), k, length), sigma[:, None, None])  # [B,K,L,D]
        tx = trans.gather(-1, x[:, None, :, None].expand(-1, k, length, 1))  # p(x_i | seq_k)
        possible = (tx.squeeze(-1) > 0).all(-1)
        logw = torch.where(possible, tx.squeeze(-1).clamp_min(1e-300).log().sum(-1), -math.inf)
        w = torch.softmax(logw, -1)[..., None, None]  # posterior over the 3 sequences
        r = torch.where(w > 0, w * trans / tx.clamp_min(1e-300), 0.0).sum(1)
        logr = torch.where(r > 0, r.clamp_min(1e-300).log(), -60.0)
        return torch.scatter(logr, -1, x[..., None], 0.0)


@pytest.mark.parametrize(
    "name,dim,noise,steps",
    [("absorb", 5, LogLinearNoise(), 128), ("uniform", 4, GeometricNoise(1e-4, 20.0), 32)],
)
def test_exact_score_gives_true_nll_and_valid_samples(name, dim, noise, steps):
    """With the exact score the NELBO is tight: it must equal -log p(x0) / L = log(3) / 8, and the
    samplers must reproduce the data distribution."""
    graph = build_diffusion_graph(name, dim)
    oracle = OracleScore(graph)
    g = torch.Generator().manual_seed(0)
    x0 = TOY[torch.randint(0, 3, (4000,), generator=g)]
    loss, n = score_entropy_loss(oracle, graph, noise, x0, generator=g)
    per_token = loss / n
    stderr = (per_token.std() / math.sqrt(len(per_token))).item()
    assert abs(per_token.mean().item() - math.log(3) / 8) < 4 * stderr + 1e-3
    for predictor in ["euler", "analytic"]:
        s = sample(oracle, graph, noise, 300, 8, steps, predictor=predictor, generator=torch.Generator().manual_seed(1))
        hits = (s[:, None, :] == TOY[None]).all(-1).float()
        assert hits.amax(-1).mean() > 0.9
        assert torch.all(hits.mean(0) > 0.2)  # all three modes, roughly balanced

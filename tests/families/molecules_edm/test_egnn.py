"""EDM's EGNN dynamics (trainer/families/molecules_edm/egnn.py): E(3) equivariance of eps_x and invariance of
eps_h, permutation equivariance, padding invariance, and agreement with an edge-list restatement of EDM's
`egnn_new.py` (concatenated edge inputs, `unsorted_segment_sum`), which checks the dense rewrite."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.errors import ConfigError
from trainer.families.molecules_edm.egnn import EGNNDynamics, build_egnn_dynamics

FEATURES = 6


def _model(seed: int = 0, hidden: int = 16, layers: int = 2) -> EGNNDynamics:
    torch.manual_seed(seed)
    model = build_egnn_dynamics(FEATURES, hidden=hidden, layers=layers).double()
    # EDM initialises the coordinate head with gain 0.001; larger weights make eps_x O(1) so the checks bite
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
    return model


def _batch(seed: int = 1, sizes: tuple[int, ...] = (5, 3), nodes: int = 6):
    gen = torch.Generator().manual_seed(seed)
    batch = len(sizes)
    x = torch.randn(batch, nodes, 3, generator=gen, dtype=torch.float64) * 1.5
    h = torch.randn(batch, nodes, FEATURES, generator=gen, dtype=torch.float64)
    mask = torch.arange(nodes).unsqueeze(0) < torch.tensor(sizes).unsqueeze(1)
    t = torch.rand(batch, generator=gen, dtype=torch.float64)
    return x, h, mask, t


def _orthogonal(seed: int, reflect: bool) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    if (torch.det(q) < 0) != reflect:
        q[:, 0] = -q[:, 0]
    return q


@pytest.mark.parametrize("reflect", [False, True])
def test_rotation_translation_equivariance(reflect: bool) -> None:
    model = _model()
    x, h, mask, t = _batch()
    eps_x, eps_h = model(x, h, t, mask)
    q = _orthogonal(3, reflect)
    shift = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
    eps_x2, eps_h2 = model(x @ q + shift, h, t, mask)
    assert eps_x.abs().max() > 1e-2  # not trivially zero
    torch.testing.assert_close(eps_x2, eps_x @ q, atol=1e-9, rtol=1e-7)
    torch.testing.assert_close(eps_h2, eps_h, atol=1e-9, rtol=1e-7)


def test_outputs_masked_and_centred() -> None:
    model = _model()
    x, h, mask, t = _batch()
    eps_x, eps_h = model(x, h, t, mask)
    m = mask.unsqueeze(-1).double()
    assert torch.all(eps_x[~mask] == 0) and torch.all(eps_h[~mask] == 0)
    assert eps_h.shape == h.shape  # the time column is sliced off
    torch.testing.assert_close((eps_x * m).sum(1), torch.zeros(2, 3, dtype=torch.float64), atol=1e-10, rtol=0)


def test_permutation_equivariance() -> None:
    model = _model()
    x, h, mask, t = _batch(sizes=(5, 5), nodes=5)
    perm = torch.tensor([3, 0, 4, 1, 2])
    eps_x, eps_h = model(x, h, t, mask)
    eps_xp, eps_hp = model(x[:, perm], h[:, perm], t, mask)
    torch.testing.assert_close(eps_xp, eps_x[:, perm], atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(eps_hp, eps_h[:, perm], atol=1e-10, rtol=1e-8)


def test_padding_invariance() -> None:
    """The same molecule padded to 4 and to 9 atoms, garbage in the padding, gives the same outputs."""
    model = _model()
    x, h, mask, t = _batch(sizes=(4,), nodes=4)
    eps_x, eps_h = model(x, h, t, mask)
    gen = torch.Generator().manual_seed(9)
    x_pad = torch.cat([x, 50 * torch.randn(1, 5, 3, generator=gen, dtype=torch.float64)], dim=1)
    h_pad = torch.cat([h, 7 * torch.randn(1, 5, FEATURES, generator=gen, dtype=torch.float64)], dim=1)
    mask_pad = torch.cat([mask, torch.zeros(1, 5, dtype=torch.bool)], dim=1)
    eps_xp, eps_hp = model(x_pad, h_pad, t, mask_pad)
    torch.testing.assert_close(eps_xp[:, :4], eps_x, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(eps_hp[:, :4], eps_h, atol=1e-12, rtol=1e-10)
    assert torch.all(eps_xp[:, 4:] == 0) and torch.all(eps_hp[:, 4:] == 0)


def _segment_sum(data: torch.Tensor, rows: torch.Tensor, count: int) -> torch.Tensor:
    return torch.zeros(count, data.shape[1], dtype=data.dtype).index_add_(0, rows, data)


def _edm_edge_list(model: EGNNDynamics, x: torch.Tensor, h: torch.Tensor, t: torch.Tensor, mask: torch.Tensor):
    """EDM's EGNN_dynamics_QM9._forward restated on flat edge lists (EDM's data layout)."""
    batch, nodes, _ = x.shape
    node_mask = mask.reshape(-1, 1).double()
    idx = torch.arange(batch * nodes).reshape(batch, nodes)
    rows = idx.unsqueeze(2).expand(batch, nodes, nodes).reshape(-1)
    cols = idx.unsqueeze(1).expand(batch, nodes, nodes).reshape(-1)
    edge_mask = (node_mask[rows] * node_mask[cols]) * (rows != cols).double().unsqueeze(1)
    xf = x.reshape(-1, 3) * node_mask
    hf = torch.cat([h.reshape(-1, FEATURES) * node_mask, t.repeat_interleave(nodes).unsqueeze(1)], dim=1)

    def coord2diff(xx, norm_constant=1.0):
        diff = xx[rows] - xx[cols]
        radial = (diff ** 2).sum(1, keepdim=True)
        return radial, diff / (torch.sqrt(radial + 1e-8) + norm_constant)

    egnn = model.egnn
    dist0, _ = coord2diff(xf)
    hh, xx = egnn.embedding(hf), xf
    for block in egnn.blocks:
        radial, cdiff = coord2diff(xx)
        edge_attr = torch.cat([radial, dist0], dim=1)
        for gcl in block.gcls:
            mij = gcl.edge_mlp(torch.cat([hh[rows], hh[cols], edge_attr], dim=1))
            out = mij * gcl.att_mlp(mij) * edge_mask
            agg = _segment_sum(out, rows, hh.shape[0]) / gcl.normalization_factor
            hh = (hh + gcl.node_mlp(torch.cat([hh, agg], dim=1))) * node_mask
        eq = block.equivariant
        trans = cdiff * torch.tanh(eq.coord_mlp(torch.cat([hh[rows], hh[cols], edge_attr], dim=1))) * eq.coords_range
        xx = (xx + _segment_sum(trans * edge_mask, rows, xx.shape[0]) / eq.normalization_factor) * node_mask
        hh = hh * node_mask
    h_final = (egnn.embedding_out(hh) * node_mask)[:, :-1].reshape(batch, nodes, FEATURES)
    vel = ((xx - xf) * node_mask).reshape(batch, nodes, 3)
    m = mask.unsqueeze(-1).double()
    vel = vel - (vel.sum(1, keepdim=True) / m.sum(1, keepdim=True)) * m
    return vel, h_final


def test_matches_edge_list_restatement_of_edm() -> None:
    model = _model(seed=4, layers=3)
    x, h, mask, t = _batch(seed=5, sizes=(6, 4, 2), nodes=6)
    eps_x, eps_h = model(x, h, t, mask)
    ref_x, ref_h = _edm_edge_list(model, x, h, t, mask)
    torch.testing.assert_close(eps_x, ref_x, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(eps_h, ref_h, atol=1e-10, rtol=1e-8)


def test_edm_defaults_and_options() -> None:
    model = build_egnn_dynamics(FEATURES, hidden=8, layers=3)
    assert len(model.egnn.blocks) == 3 and len(model.egnn.blocks[0].gcls) == 1
    update = model.egnn.blocks[0].equivariant
    assert update.coords_range == 15.0 and update.tanh and update.normalization_factor == 1.0
    assert model.egnn.blocks[0].norm_constant == 1.0 and model.egnn.blocks[0].gcls[0].attention
    assert model.egnn.embedding.in_features == FEATURES + 1  # time column
    assert update.coord_mlp[-1].bias is None
    assert update.coord_mlp[-1].weight.abs().max() < 0.001 * math.sqrt(6 / 9) + 1e-9  # xavier, gain 0.001
    with pytest.raises(ConfigError):
        build_egnn_dynamics(FEATURES, aggregation="mean")

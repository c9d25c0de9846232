"""EDM's EGNN dynamics (Hoogeboom et al., ICML 2022) on dense padded batches.

What this follows: `ehoogeboom/e3_diffusion_for_molecules`, `egnn/egnn_new.py` (`GCL`,
`EquivariantUpdate`, `EquivariantBlock`, `EGNN`, `coord2diff`) and `egnn/models.py`
(`EGNN_dynamics_QM9._forward`), with the QM9 settings of the paper: sinusoidal distance embedding off,
sum aggregation divided by `normalization_factor` 1, sigmoid attention on, tanh-bounded coordinate
updates times `coords_range` 15 in EVERY block (EDM computes `coords_range / n_layers` but passes the
undivided value to the blocks; we reproduce what runs), `norm_constant` 1, one invariant sub-layer per
block, time t in [0, 1] appended as the last node feature.

Function by function:

* `coord2diff`: d_ij^2 = |x_i - x_j|^2 and the direction (x_i - x_j) / (sqrt(d_ij^2 + 1e-8) + norm_constant).
* edge model: m_ij = SiLU(Lin(SiLU(Lin([h_i, h_j, d_ij^2, d0_ij^2])))) times sigmoid(Lin(m_ij)) and the
  edge mask (d0 is the distance at the network input); node model h_i += MLP([h_i, sum_j m_ij / Z]).
* coordinate model: x_i += sum_j dir_ij * tanh(MLP([h_i, h_j, d_ij^2, d0_ij^2])) * 15 / Z, the last
  linear without bias and initialised with xavier gain 0.001.
* output: eps_x = x_out - x_in with the centre of mass of the real atoms removed; eps_h = Lin(h) without
  the time column; a NaN in eps_x resets it to zero with a warning, as EDM does.

Dense instead of edge lists: the graph is fully connected over the real atoms with the diagonal
masked, so pair tensors [B, N, N, *] with an edge mask replace EDM's `edge_index` gathers. The first
linear layer of the edge and coordinate MLPs is applied as W_i h_i + W_j h_j + W_e e_ij (its weight
split by input block), which is the same map as the linear layer on the concatenation without
materialising [B, N, N, 2H + 2]; parameters keep EDM's shapes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from trainer.errors import ConfigError

log = logging.getLogger(__name__)

EDGE_FEATURES = 2
"""Edge inputs of every block: d_ij^2 at the block's input and at the network's input."""


def _as_mask(node_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B, N] bool/float (or [B, N, 1]) -> float [B, N, 1] in `like`'s dtype."""
    if node_mask.dim() == 3:
        node_mask = node_mask.squeeze(-1)
    return node_mask.to(like.dtype).unsqueeze(-1)


def remove_mean_with_mask(x: torch.Tensor, node_mask: torch.Tensor) -> torch.Tensor:
    """Subtract each molecule's mean over its real atoms; padding stays zero. x [B, N, D], node_mask [B, N]."""
    mask = _as_mask(node_mask, x)
    x = x * mask
    count = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    mean = x.sum(dim=1, keepdim=True) / count
    return x - mean * mask


def edge_mask_from_nodes(node_mask: torch.Tensor) -> torch.Tensor:
    """[B, N] node mask -> [B, N, N, 1] float mask of the fully connected graph without self-edges."""
    mask = node_mask.squeeze(-1) if node_mask.dim() == 3 else node_mask
    mask = mask.to(torch.float32) if not mask.is_floating_point() else mask
    pairs = mask.unsqueeze(2) * mask.unsqueeze(1)
    eye = torch.eye(mask.shape[1], dtype=pairs.dtype, device=pairs.device)
    return (pairs * (1.0 - eye)).unsqueeze(-1)


def coord2diff(x: torch.Tensor, norm_constant: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared distances [B, N, N, 1] and normalised differences [B, N, N, 3], as EDM's `coord2diff`."""
    diff = x.unsqueeze(2) - x.unsqueeze(1)
    radial = (diff * diff).sum(dim=-1, keepdim=True)
    norm = torch.sqrt(radial + 1e-8)
    return radial, diff / (norm + norm_constant)


def _pair_linear(layer: nn.Linear, h: torch.Tensor, edge_attr: torch.Tensor) -> torch.Tensor:
    """`layer` applied to [h_i, h_j, e_ij] for every pair, computed per node and broadcast."""
    hidden = h.shape[-1]
    weight = layer.weight
    out_i = h @ weight[:, :hidden].T
    out_j = h @ weight[:, hidden:2 * hidden].T
    out = out_i.unsqueeze(2) + out_j.unsqueeze(1) + edge_attr @ weight[:, 2 * hidden:].T
    if layer.bias is not None:
        out = out + layer.bias
    return out


class GCL(nn.Module):
    """EDM's invariant graph convolution (edge model with attention, residual node model)."""

    def __init__(self, hidden: int, edge_features: int, normalization_factor: float, attention: bool) -> None:
        super().__init__()
        self.normalization_factor = normalization_factor
        self.attention = attention
        self.edge_mlp = nn.Sequential(nn.Linear(2 * hidden + edge_features, hidden), nn.SiLU(),
                                      nn.Linear(hidden, hidden), nn.SiLU())
        self.node_mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        if attention:
            self.att_mlp = nn.Sequential(nn.Linear(hidden, 1), nn.Sigmoid())

    def forward(self, h: torch.Tensor, edge_attr: torch.Tensor, node_mask: torch.Tensor,
                edge_mask: torch.Tensor) -> torch.Tensor:
        first, rest = self.edge_mlp[0], self.edge_mlp[1:]
        mij = rest(_pair_linear(first, h, edge_attr))
        if self.attention:
            mij = mij * self.att_mlp(mij)
        mij = mij * edge_mask
        agg = mij.sum(dim=2) / self.normalization_factor
        h = h + self.node_mlp(torch.cat([h, agg], dim=-1))
        return h * node_mask


class EquivariantUpdate(nn.Module):
    """EDM's coordinate update: x_i += sum_j dir_ij * tanh(phi_x) * coords_range / Z."""

    def __init__(self, hidden: int, edge_features: int, normalization_factor: float, tanh: bool,
                 coords_range: float) -> None:
        super().__init__()
        self.tanh = tanh
        self.coords_range = coords_range
        self.normalization_factor = normalization_factor
        last = nn.Linear(hidden, 1, bias=False)
        nn.init.xavier_uniform_(last.weight, gain=0.001)
        self.coord_mlp = nn.Sequential(nn.Linear(2 * hidden + edge_features, hidden), nn.SiLU(),
                                       nn.Linear(hidden, hidden), nn.SiLU(), last)

    def forward(self, h: torch.Tensor, x: torch.Tensor, coord_diff: torch.Tensor, edge_attr: torch.Tensor,
                node_mask: torch.Tensor, edge_mask: torch.Tensor) -> torch.Tensor:
        first, rest = self.coord_mlp[0], self.coord_mlp[1:]
        weight = rest(_pair_linear(first, h, edge_attr))
        if self.tanh:
            trans = coord_diff * torch.tanh(weight) * self.coords_range
        else:
            trans = coord_diff * weight
        trans = trans * edge_mask
        x = x + trans.sum(dim=2) / self.normalization_factor
        return x * node_mask


class EquivariantBlock(nn.Module):
    """`inv_sublayers` GCLs then one coordinate update, on edge features [d_ij^2, d0_ij^2]."""

    def __init__(self, hidden: int, inv_sublayers: int, normalization_factor: float, attention: bool, tanh: bool,
                 coords_range: float, norm_constant: float) -> None:
        super().__init__()
        self.norm_constant = norm_constant
        self.gcls = nn.ModuleList(GCL(hidden, EDGE_FEATURES, normalization_factor, attention)
                                  for _ in range(inv_sublayers))
        self.equivariant = EquivariantUpdate(hidden, EDGE_FEATURES, normalization_factor, tanh, coords_range)

    def forward(self, h: torch.Tensor, x: torch.Tensor, input_radial: torch.Tensor, node_mask: torch.Tensor,
                edge_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        radial, coord_diff = coord2diff(x, self.norm_constant)
        edge_attr = torch.cat([radial, input_radial], dim=-1)
        for gcl in self.gcls:
            h = gcl(h, edge_attr, node_mask, edge_mask)
        x = self.equivariant(h, x, coord_diff, edge_attr, node_mask, edge_mask)
        return h * node_mask, x


class EGNN(nn.Module):
    """EDM's `egnn_new.EGNN`: embedding, `layers` equivariant blocks, output embedding (masked)."""

    def __init__(self, in_features: int, hidden: int, layers: int, inv_sublayers: int = 1,
                 normalization_factor: float = 1.0, attention: bool = True, tanh: bool = True,
                 coords_range: float = 15.0, norm_constant: float = 1.0) -> None:
        super().__init__()
        self.embedding = nn.Linear(in_features, hidden)
        self.embedding_out = nn.Linear(hidden, in_features)
        self.blocks = nn.ModuleList(
            EquivariantBlock(hidden, inv_sublayers, normalization_factor, attention, tanh, float(coords_range),
                             norm_constant)
            for _ in range(layers))

    def forward(self, h: torch.Tensor, x: torch.Tensor, node_mask: torch.Tensor,
                edge_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        input_radial, _ = coord2diff(x)
        h = self.embedding(h)
        for block in self.blocks:
            h, x = block(h, x, input_radial, node_mask, edge_mask)
        return self.embedding_out(h) * node_mask, x


class EGNNDynamics(nn.Module):
    """EDM's `EGNN_dynamics_QM9` (mode `egnn_dynamics`, no context): the noise predictor of the diffusion.

    `forward(x [B, N, 3], h [B, N, F], t [B] or scalar in [0, 1], node_mask [B, N])` returns
    `(eps_x [B, N, 3], eps_h [B, N, F])`, zero at padding, eps_x with zero mean over the real atoms.
    """

    def __init__(self, num_features: int, hidden: int = 256, layers: int = 9, inv_sublayers: int = 1,
                 normalization_factor: float = 1.0, attention: bool = True, tanh: bool = True,
                 coords_range: float = 15.0, norm_constant: float = 1.0, condition_time: bool = True) -> None:
        super().__init__()
        self.num_features = num_features
        self.condition_time = condition_time
        self.egnn = EGNN(num_features + int(condition_time), hidden, layers, inv_sublayers, normalization_factor,
                         attention, tanh, coords_range, norm_constant)

    def forward(self, x: torch.Tensor, h: torch.Tensor, t: torch.Tensor | float,
                node_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, nodes, _ = x.shape
        mask = _as_mask(node_mask, x)
        edge_mask = edge_mask_from_nodes(mask)
        x = x * mask
        h = h * mask
        if self.condition_time:
            t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
            # EDM fills the time column for padding too; padding is masked out after the first layer anyway
            h_time = t.reshape(-1, 1, 1).expand(batch, nodes, 1)
            h = torch.cat([h, h_time], dim=-1)
        h_final, x_final = self.egnn(h, x, mask, edge_mask)
        vel = (x_final - x) * mask
        if self.condition_time:
            h_final = h_final[..., :-1]
        if torch.isnan(vel).any():
            log.warning("EGNN produced NaN positions; resetting eps_x to zero (as EDM does)")
            vel = torch.zeros_like(vel)
        return remove_mean_with_mask(vel, mask), h_final


def build_egnn_dynamics(num_features: int, hidden: int = 256, layers: int = 9, inv_sublayers: int = 1,
                        attention: bool = True, tanh: bool = True, coords_range: float = 15.0,
                        norm_constant: float = 1.0, normalization_factor: float = 1.0,
                        aggregation: str = "sum") -> EGNNDynamics:
    """EDM's QM9 dynamics (paper: hidden 256, 9 layers) for `num_features` node features (one-hot + charge)."""
    if aggregation != "sum":
        raise ConfigError(f"EGNN aggregation {aggregation!r} is not supported: EDM's QM9 model uses 'sum'")
    if num_features < 1 or hidden < 1 or layers < 1 or inv_sublayers < 1:
        raise ConfigError(f"EGNN sizes must be positive: num_features={num_features}, hidden={hidden}, "
                          f"layers={layers}, inv_sublayers={inv_sublayers}")
    return EGNNDynamics(num_features, hidden=hidden, layers=layers, inv_sublayers=inv_sublayers,
                        normalization_factor=normalization_factor, attention=attention, tanh=tanh,
                        coords_range=coords_range, norm_constant=norm_constant)

"""ComFormer: graph transformers for crystal property prediction (Yan et al., ICLR 2024).

"Complete and Efficient Graph Transformers for Crystal Material Property Prediction",
K. Yan, C. Fu, X. Qian, X. Qian, S. Ji, ICLR 2024. Two variants:

* ``icomformer`` (default, SE(3)-invariant): node-wise transformer layers (``ComformerConv``)
  over the crystal graph, plus the lattice-aware edge-wise transformer layer
  (``ComformerConv_edge``). That layer updates every edge feature from the three lattice
  vectors: their lengths and the cosines between the edge vector and each lattice vector.
* ``ecomformer`` (SE(3)-equivariant): the same node-wise layers, plus an equivariant update
  (``ComformerConvEqui``). It runs two e3nn tensor-product convolutions with spherical
  harmonics of the edge vectors (l <= 2) through ``64x0e + 8x1o + 8x2e`` hidden irreps and
  returns invariant (``0e``) node features.

What this follows. The official code is ``divelab/AIRS``, ``OpenMat/ComFormer`` (commit
949e70b3): ``comformer/models/comformer.py`` (iComformer, eComformer and their configs),
``comformer/models/transformer.py`` (ComformerConv, ComformerConv_edge,
TensorProductConvLayer, ComformerConvEqui) and ``comformer/graphs.py`` (edge features,
``edge_nei`` lattice vectors, ``use_lattice`` self-loops, the "lattice correction" that picks
the three lattice vectors). ``RBFExpansion`` comes from ``comformer/models/utils.py``
(read in the ``jwchen25/comformer`` fork; it is the ALIGNN/Matformer class). This file
reproduces the following, in plain torch with ``index_add_`` scatters instead of
torch_geometric/torch_scatter:

* Edge features: ``-0.75/|r|`` is expanded in 256 RBFs on ``[-4, 0]``, then ``Linear`` and
  ``Softplus``. The RBF is ``exp(-gamma (x - mu)^2)`` with ``gamma = 1/spacing``, as in the
  official code. The same RBF+Linear is shared with the lattice-vector lengths. The cosines
  between each edge and the three lattice vectors use RBF on ``[-1, 1]`` (bins =
  ``triplet_features``) followed by Linear and Softplus.
* Node layer: ``q = W_q x_i``, ``k = W_k x``, ``v = W_v x``, ``e = W_e f_ij``,
  ``k_ij = MLP_k([k_i, k_j, e])``, ``alpha = q_i * k_ij / sqrt(C)``,
  ``m_ij = MLP_m([v_i, v_j, e]) * sigmoid(BN(alpha))``. Messages are summed at ``i`` and go
  through ``lin_concate``. The output is ``softplus(x_i + BN(out))``.
* Edge layer: the same gated attention between each edge feature (the query) and its three
  lattice "neighbours". Each neighbour has a key and value from the RBF of its own length,
  with separate weights per lattice vector, and a pair term from the cosine features. The
  three messages are summed, and the output is ``softplus(f_ij + BN(out))``.
* Equivariant layer: ``Linear(C, 64)`` -> TP-conv (residual) -> TP-conv -> BN -> softplus ->
  Linear -> softplus, plus ``Linear`` skip. The TP weights come per edge from
  ``Linear-Softplus-Linear`` of the edge features. Messages are mean-aggregated.
* Layer order: node layer 0, then the edge layer (iComFormer) or the equivariant layer
  (eComFormer), then the remaining node layers. Readout is a mean over atoms, then
  ``Linear + SiLU`` and ``Linear``. The official defaults are iComFormer with
  4 node layers + 1 edge layer and eComFormer with 3 + 1, both with 256 features, 1 head and
  92 CGCNN atom features.
* Lattice vectors (``edge_nei``): the official graph builder does not use the cell rows. It
  takes the three shortest linearly independent lattice vectors (shortest self-image of
  atom 0, then the next one not collinear, then the next one not coplanar). It flips the
  2nd and 3rd to make an angle <= 90 deg with the 1st, and negates all three if they are
  left-handed. The family's one lattice rule, ``lattice.canonical_lattice_coeffs``, does the
  same from ``cell``; the data layer stores its result with every graph and ``collate_graphs``
  puts it in every batch (``lattice_coeffs``), which the model uses as given. Only a batch
  without it makes the model compute it, with the same function.

Conventions. Edge ``e`` goes from ``edge_src`` (neighbour j) to ``edge_dst`` (centre i), and
messages flow src -> dst. The model computes ``edge_vec = pos[src] + shift @ cell - pos[dst]``
(centre -> neighbour image) itself, so rotating the inputs rotates it and forces by autograd
are possible. The official ``edge_attr`` points sender -> receiver, which is ``-edge_vec``.
That sign is used for the lattice cosines, and the spherical harmonics use ``edge_vec``
(receiver -> sender, as in the official TP layer that gathers from ``edge_index[1]`` and
scatters to ``edge_index[0]``). Both are therefore exactly the official quantities.

Deviations and additions (all documented in ``docs/families/crystals.md``, ComFormer):

* Ties in the lattice-vector choice (equal lengths, exactly orthogonal vectors, as in cubic or
  orthorhombic cells) are broken deterministically with relative tolerance ``1e-6`` by the
  integer coefficients in the given basis: the largest coefficient tuple in
  lexicographic order wins. Orthogonal 2nd/3rd vectors keep their positive-first-coefficient
  sign. The official choice depends on pymatgen's neighbour ordering and floating-point noise
  at exactly 90 deg. So rotation, translation and permutation invariance are exact here, but
  basis independence holds only without such ties.
* Unused official parameters are dropped: ``lemb`` and ``lin_edge_len`` of
  ``ComformerConv_edge`` (74,080 parameters at the paper size).
* The first ``Linear`` of the key/message MLPs is applied in pieces (node-only terms per node,
  lattice-only terms per graph, then gathered; see :func:`_split3`). This is the same function
  with the same parameters as the official per-edge ``cat`` + ``Linear``, with fewer multiplies: the
  node and lattice terms are computed once per node and per graph, not once per edge.
* ``edge_layers`` generalises the single official edge/equivariant layer: edge layer ``l`` runs
  after node layer ``l``. ``edge_layers=1`` is the official model.
* Options not in the official code: ``pooling="sum"``, ``dropout`` on node features after each
  node layer (default 0 = official), ``atom_features="embedding"`` (learned ``nn.Embedding``
  instead of CGCNN features), ``lattice_basis="cell"`` (use the cell rows as given).
* The official forward ``squeeze()``s the output. Here it is always ``[B, output_features]``.
* Atomic numbers outside the CGCNN table (1-100) raise a ``ValueError``. The official code
  silently used an all-zero feature row.

BatchNorm layers normalise over the edges/atoms of the whole batch in training mode, so per-graph
results depend on the batch composition unless the model is in evaluation mode (``train(False)``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.families.crystals.lattice import canonical_lattice

Tensor = torch.Tensor

__all__ = [
    "COMFORMER_PRESETS",
    "ComFormer",
    "ComFormerConfig",
    "ComformerConv",
    "ComformerConvEdge",
    "ComformerConvEqui",
    "RBFExpansion",
    "build_comformer",
    "comformer_config",
    "count_parameters",
    "load_cgcnn_features",
]

CGCNN_FEATURES_PATH = Path(__file__).resolve().parent / "assets" / "cgcnn_atom_init.json"
CGCNN_MAX_Z = 100


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass
class ComFormerConfig:
    """Hyperparameters. Defaults are the official iComFormer defaults (``iComformerConfig``)."""

    variant: str = "icomformer"  # "icomformer" | "ecomformer"
    conv_layers: int = 4  # node-wise transformer layers (official: 4 iComFormer, 3 eComFormer)
    edge_layers: int = 1  # edge-wise (iComFormer) / equivariant (eComFormer) layers
    node_features: int = 256
    edge_features: int = 256  # RBF bins for -0.75/|r|
    triplet_features: int = 256  # RBF bins for the edge/lattice cosines (triplet_input_features)
    fc_features: int = 256
    heads: int = 1  # node_layer_head (the official edge layer uses it as well)
    atom_features: str = "cgcnn"  # "cgcnn" (92-dim CGCNN features) | "embedding"
    max_atomic_number: int = CGCNN_MAX_Z  # size of the learned embedding (atom_features="embedding")
    output_features: int = 1
    pooling: str = "mean"  # "mean" (official) | "sum"
    dropout: float = 0.0
    equi_scalars: int = 64  # eComFormer hidden 0e channels (official ns)
    equi_vectors: int = 8  # eComFormer hidden 1o/2e channels (official nv)
    lattice_basis: str = "canonical"  # "canonical" (official lattice correction) | "cell"

    def __post_init__(self) -> None:
        self.variant = self.variant.lower()
        if self.variant not in ("icomformer", "ecomformer"):
            raise ValueError(f"variant must be 'icomformer' or 'ecomformer', got {self.variant!r}")
        if self.atom_features not in ("cgcnn", "embedding"):
            raise ValueError(f"atom_features must be 'cgcnn' or 'embedding', got {self.atom_features!r}")
        if self.pooling not in ("mean", "sum"):
            raise ValueError(f"pooling must be 'mean' or 'sum', got {self.pooling!r}")
        if self.lattice_basis not in ("canonical", "cell"):
            raise ValueError(f"lattice_basis must be 'canonical' or 'cell', got {self.lattice_basis!r}")
        if self.conv_layers < 1:
            raise ValueError("conv_layers must be >= 1")
        if self.edge_layers < 0 or self.edge_layers > self.conv_layers:
            raise ValueError("edge_layers must be in [0, conv_layers]")
        if self.variant == "icomformer" and self.edge_layers >= self.conv_layers and self.edge_layers > 0:
            raise ValueError(
                "iComFormer needs edge_layers < conv_layers: edge layer l runs after node layer l, "
                "and a last edge layer would feed nothing"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: Presets as keyword dicts for :class:`ComFormerConfig`. ``paper`` is the official iComFormer
#: default (``iComformerConfig``), ``paper_ecomformer`` the official eComFormer default.
COMFORMER_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        variant="icomformer", conv_layers=2, edge_layers=1, node_features=32, edge_features=32,
        triplet_features=32, fc_features=32, heads=1, equi_scalars=16, equi_vectors=4,
    ),
    "paper": dict(
        variant="icomformer", conv_layers=4, edge_layers=1, node_features=256, edge_features=256,
        triplet_features=256, fc_features=256, heads=1, atom_features="cgcnn", pooling="mean",
    ),
    "paper_ecomformer": dict(
        variant="ecomformer", conv_layers=3, edge_layers=1, node_features=256, edge_features=256,
        triplet_features=256, fc_features=256, heads=1, atom_features="cgcnn", pooling="mean",
        equi_scalars=64, equi_vectors=8,
    ),
}


def comformer_config(preset: str = "paper", **overrides: Any) -> ComFormerConfig:
    """A :class:`ComFormerConfig` from a preset name, with keyword overrides.

    ``comformer_config("paper", variant="ecomformer")`` gives the official eComFormer (it
    switches to ``paper_ecomformer``, whose ``conv_layers`` is 3) unless ``conv_layers`` is given.
    """
    if preset not in COMFORMER_PRESETS:
        raise KeyError(f"unknown ComFormer preset {preset!r}; choose from {sorted(COMFORMER_PRESETS)}")
    if preset == "paper" and str(overrides.get("variant", "")).lower() == "ecomformer":
        preset = "paper_ecomformer"
    kw = dict(COMFORMER_PRESETS[preset])
    kw.update(overrides)
    return ComFormerConfig(**kw)


# --------------------------------------------------------------------------------------------
# Atom features
# --------------------------------------------------------------------------------------------


def load_cgcnn_features(path: str | Path = CGCNN_FEATURES_PATH) -> Tensor:
    """The CGCNN table as ``[max_z + 1, 92]``. Row ``z`` holds element ``z``; row 0 is zeros."""
    with open(path) as fh:
        raw = json.load(fh)
    table = {int(k): v for k, v in raw.items()}
    max_z = max(table)
    dim = len(next(iter(table.values())))
    out = torch.zeros(max_z + 1, dim)
    for z, feat in table.items():
        out[z] = torch.tensor(feat, dtype=torch.float32)
    return out


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


class RBFExpansion(nn.Module):
    """``exp(-gamma (x - mu_k)^2)`` with ``mu = linspace(vmin, vmax, bins)`` and ``gamma = 1/spacing``.

    Same as ``comformer/models/utils.py`` (ALIGNN style: gamma is 1/lengthscale, not squared).
    """

    def __init__(self, vmin: float = 0.0, vmax: float = 8.0, bins: int = 40, lengthscale: float | None = None):
        super().__init__()
        self.vmin, self.vmax, self.bins = vmin, vmax, bins
        self.register_buffer("centers", torch.linspace(vmin, vmax, bins))
        if lengthscale is None:
            self.gamma = 1.0 / float(np.diff(np.linspace(vmin, vmax, bins)).mean())
        else:
            self.gamma = 1.0 / lengthscale**2

    def forward(self, x: Tensor) -> Tensor:
        return torch.exp(-self.gamma * (x.unsqueeze(-1) - self.centers) ** 2)


def _mlp3(c: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(3 * c, c), nn.SiLU(), nn.Linear(c, c))


def _split3(mlp: nn.Sequential) -> tuple[Tensor, Tensor, Tensor]:
    """The three ``[C, C]`` column blocks of the first Linear of a ``_mlp3``.

    ``Linear([a, b, c]) = a Wa^T + b Wb^T + c Wc^T + bias``, so the parts that depend only on a
    node (or a graph) can be computed once per node and then gathered, instead of once per edge.
    This is the same function with the same parameters as the official ``cat`` + ``Linear``.
    """
    c = mlp[0].out_features
    wa, wb, wc = mlp[0].weight.split(c, dim=1)
    return wa, wb, wc


def _scatter_sum(src: Tensor, index: Tensor, n: int) -> Tensor:
    out = src.new_zeros((n,) + tuple(src.shape[1:]))
    return out.index_add_(0, index, src)


def _scatter_mean(src: Tensor, index: Tensor, n: int) -> Tensor:
    total = _scatter_sum(src, index, n)
    count = torch.bincount(index, minlength=n).clamp_(min=1).to(src.dtype)
    return total / count.view((n,) + (1,) * (src.dim() - 1))


class ComformerConv(nn.Module):
    """Node-wise transformer layer (official ``ComformerConv``).

    For every edge j -> i it computes ``k_ij = MLP([k_i, k_j, W_e f_ij])`` and
    ``alpha = q_i * k_ij / sqrt(C)`` (a per-channel score, not a softmax), and the message
    ``MLP([v_i, v_j, W_e f_ij]) * sigmoid(BN(alpha))``. Messages are summed at i. The update
    is ``softplus(x_i + BN(W_o m_i))``.
    """

    def __init__(self, channels: int, heads: int = 1, edge_dim: int | None = None):
        super().__init__()
        edge_dim = channels if edge_dim is None else edge_dim
        self.channels, self.heads = channels, heads
        hc = heads * channels
        self.lin_key = nn.Linear(channels, hc)
        self.lin_query = nn.Linear(channels, hc)
        self.lin_value = nn.Linear(channels, hc)
        self.lin_edge = nn.Linear(edge_dim, hc)
        self.lin_concate = nn.Linear(hc, channels)
        self.lin_msg_update = _mlp3(channels)
        self.key_update = _mlp3(channels)
        self.bn = nn.BatchNorm1d(channels)
        self.bn_att = nn.BatchNorm1d(channels)

    def forward(self, x: Tensor, edge_src: Tensor, edge_dst: Tensor, edge_attr: Tensor) -> Tensor:
        H, C = self.heads, self.channels
        query = self.lin_query(x).view(-1, H, C)
        key = self.lin_key(x).view(-1, H, C)
        value = self.lin_value(x).view(-1, H, C)
        edge = self.lin_edge(edge_attr).view(-1, H, C)

        # key_update(cat(k_i, k_j, e)) and lin_msg_update(cat(v_i, v_j, e)), with the node parts
        # of the first Linear computed per node (see _split3)
        ka, kb, kc = _split3(self.key_update)
        va, vb, vc = _split3(self.lin_msg_update)
        h_key = (key @ ka.T)[edge_dst] + (key @ kb.T)[edge_src] + F.linear(edge, kc, self.key_update[0].bias)
        key_ij = self.key_update[2](self.key_update[1](h_key))
        h_msg = (value @ va.T)[edge_dst] + (value @ vb.T)[edge_src] + F.linear(edge, vc, self.lin_msg_update[0].bias)
        msg = self.lin_msg_update[2](self.lin_msg_update[1](h_msg))

        alpha = query[edge_dst] * key_ij / math.sqrt(C)
        msg = msg * torch.sigmoid(self.bn_att(alpha.reshape(-1, C)).view(-1, H, C))

        out = _scatter_sum(msg, edge_dst, x.shape[0]).reshape(-1, H * C)
        out = self.lin_concate(out)
        return F.softplus(x + self.bn(out))


class ComformerConvEdge(nn.Module):
    """Lattice-aware edge-wise transformer layer (official ``ComformerConv_edge``).

    Each edge feature ``f_ij`` (the query) attends to its three lattice "neighbours" ``l_1..3``.
    Keys and values come from the RBF-embedded lattice lengths, with separate weights per
    lattice vector. The pair term comes from the RBF-embedded cosine between the edge and the
    lattice vector. The three gated messages are summed, and the update is
    ``softplus(f_ij + BN(out))``.
    """

    def __init__(self, channels: int, heads: int = 1, edge_dim: int | None = None):
        super().__init__()
        edge_dim = channels if edge_dim is None else edge_dim
        self.channels, self.heads = channels, heads
        hc = heads * channels
        self.lin_key = nn.Linear(channels, hc)
        self.lin_query = nn.Linear(channels, hc)
        self.lin_value = nn.Linear(channels, hc)
        self.lin_key_e1 = nn.Linear(channels, hc)
        self.lin_value_e1 = nn.Linear(channels, hc)
        self.lin_key_e2 = nn.Linear(channels, hc)
        self.lin_value_e2 = nn.Linear(channels, hc)
        self.lin_key_e3 = nn.Linear(channels, hc)
        self.lin_value_e3 = nn.Linear(channels, hc)
        self.lin_edge = nn.Linear(edge_dim, hc, bias=False)
        self.lin_concate = nn.Linear(hc, channels)
        self.lin_msg_update = _mlp3(channels)
        self.key_update = _mlp3(channels)
        self.bn_att = nn.BatchNorm1d(channels)
        self.bn = nn.BatchNorm1d(channels)

    def forward(self, edge: Tensor, nei_len: Tensor, nei_angle: Tensor, nei_index: Tensor | None = None) -> Tensor:
        """``edge`` [E, C] edge features; ``nei_angle`` [E, 3, C] (embedded cosines between the edge
        and the lattice vectors); ``nei_len`` [E, 3, C] (embedded lattice lengths), or ``[G, 3, C]``
        per graph with ``nei_index`` [E] giving each edge's graph (cheaper, same result)."""
        H, C = self.heads, self.channels
        E = edge.shape[0]
        query_x = self.lin_query(edge).view(E, 1, H, C)
        key_x = self.lin_key(edge).view(E, 1, H, C)
        value_x = self.lin_value(edge).view(E, 1, H, C)
        key_y = torch.stack((self.lin_key_e1(nei_len[:, 0]), self.lin_key_e2(nei_len[:, 1]),
                             self.lin_key_e3(nei_len[:, 2])), dim=1).view(-1, 3, H, C)
        value_y = torch.stack((self.lin_value_e1(nei_len[:, 0]), self.lin_value_e2(nei_len[:, 1]),
                               self.lin_value_e3(nei_len[:, 2])), dim=1).view(-1, 3, H, C)
        edge_xy = self.lin_edge(nei_angle).view(E, 3, H, C)

        # key_update(cat(key_x, key_y, edge_xy)) / lin_msg_update(cat(value_x, value_y, edge_xy)):
        # the edge part once per edge (not per lattice vector), the lattice part once per graph
        ka, kb, kc = _split3(self.key_update)
        va, vb, vc = _split3(self.lin_msg_update)
        ky, vy = key_y @ kb.T, value_y @ vb.T
        if nei_index is not None:
            ky, vy = ky[nei_index], vy[nei_index]
        h_key = key_x @ ka.T + ky + F.linear(edge_xy, kc, self.key_update[0].bias)
        key = self.key_update[2](self.key_update[1](h_key))
        h_msg = value_x @ va.T + vy + F.linear(edge_xy, vc, self.lin_msg_update[0].bias)
        out = self.lin_msg_update[2](self.lin_msg_update[1](h_msg))

        alpha = query_x * key / math.sqrt(C)
        out = out * torch.sigmoid(self.bn_att(alpha.reshape(-1, C)).view(E, 3, H, C))
        out = self.lin_concate(out.reshape(E, 3, H * C)).sum(dim=1)
        return F.softplus(edge + self.bn(out))


class TensorProductConvLayer(nn.Module):
    """e3nn tensor-product convolution (official ``TensorProductConvLayer``, from torsional diffusion).

    ``out_i = mean_j TP(x_j, Y(r_ij); w(f_ij))`` plus the zero-padded input if ``residual``.
    The per-edge weights ``w`` come from ``Linear-Softplus-Linear`` of the edge features.
    """

    def __init__(self, in_irreps: str, sh_irreps: str, out_irreps: str, n_edge_features: int, residual: bool = True):
        super().__init__()
        from e3nn import o3

        self.in_irreps, self.sh_irreps, self.out_irreps = in_irreps, sh_irreps, out_irreps
        self.residual = residual
        self.tp = o3.FullyConnectedTensorProduct(in_irreps, sh_irreps, out_irreps, shared_weights=False)
        self.fc = nn.Sequential(
            nn.Linear(n_edge_features, n_edge_features), nn.Softplus(),
            nn.Linear(n_edge_features, self.tp.weight_numel),
        )

    def forward(self, node_attr: Tensor, edge_src: Tensor, edge_dst: Tensor, edge_attr: Tensor,
                edge_sh: Tensor) -> Tensor:
        tp = self.tp(node_attr[edge_src], edge_sh, self.fc(edge_attr))
        out = _scatter_mean(tp, edge_dst, node_attr.shape[0])
        if self.residual:
            out = out + F.pad(node_attr, (0, out.shape[-1] - node_attr.shape[-1]))
        return out


class ComformerConvEqui(nn.Module):
    """Equivariant node update of eComFormer (official ``ComformerConvEqui``).

    ``x -> Linear(C, ns)`` -> TP-conv to ``ns x 0e + nv x 1o + nv x 2e`` (residual) -> TP-conv back
    to ``ns x 0e`` -> BN -> softplus -> Linear(ns, C) -> softplus, plus ``Linear(C, C)`` skip.
    The spherical harmonics ``Y_{l<=2}`` of the edge vectors use e3nn's ``component``
    normalisation.
    """

    def __init__(self, channels: int, edge_dim: int | None = None, ns: int = 64, nv: int = 8, residual: bool = True):
        super().__init__()
        from e3nn import o3

        edge_dim = channels if edge_dim is None else edge_dim
        self.ns, self.nv = ns, nv
        self.sh_irreps = "1x0e + 1x1o + 1x2e"
        self.hidden_irreps = o3.Irreps(f"{ns}x0e + {nv}x1o + {nv}x2e")
        self.node_linear = nn.Linear(channels, ns)
        self.skip_linear = nn.Linear(channels, channels)
        self.nlayer_1 = TensorProductConvLayer(f"{ns}x0e", self.sh_irreps, str(self.hidden_irreps), edge_dim, residual)
        self.nlayer_2 = TensorProductConvLayer(str(self.hidden_irreps), self.sh_irreps, f"{ns}x0e", edge_dim, False)
        self.bn = nn.BatchNorm1d(ns)
        self.node_linear_2 = nn.Linear(ns, channels)

    def forward(self, x: Tensor, edge_src: Tensor, edge_dst: Tensor, edge_attr: Tensor, edge_vec: Tensor,
                intermediates: list[Tensor] | None = None) -> Tensor:
        from e3nn import o3

        edge_sh = o3.spherical_harmonics(self.sh_irreps, edge_vec, normalize=True, normalization="component")
        h = self.node_linear(x)
        h = self.nlayer_1(h, edge_src, edge_dst, edge_attr, edge_sh)
        if intermediates is not None:
            intermediates.append(h)
        h = self.nlayer_2(h, edge_src, edge_dst, edge_attr, edge_sh)
        h = F.softplus(self.node_linear_2(F.softplus(self.bn(h))))
        return h + self.skip_linear(x)


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


class ComFormer(nn.Module):
    """iComFormer / eComFormer. ``forward(batch) -> [B, output_features]``.

    ``batch`` is a dict of tensors: ``atomic_numbers`` [N], ``positions`` [N, 3] (Å), ``cell``
    [B, 3, 3] (rows are lattice vectors), ``batch`` [N], ``num_atoms`` [B] (optional),
    ``edge_src``/``edge_dst`` [E] and ``edge_shift`` [E, 3] (integer cell shifts of the src
    image) and ``lattice_coeffs`` Long [B, 3, 3], the integer coefficients of ComFormer's lattice
    vectors (``collate_graphs`` always adds them). A batch without them gets them from
    :func:`~trainer.families.crystals.lattice.canonical_lattice`, the same rule, on the host.
    """

    def __init__(self, cfg: ComFormerConfig):
        super().__init__()
        self.cfg = cfg
        nf = cfg.node_features
        if cfg.atom_features == "cgcnn":
            table = load_cgcnn_features()
            self.register_buffer("atom_table", table, persistent=False)
            self.max_z = table.shape[0] - 1
            self.atom_embedding: nn.Module = nn.Linear(table.shape[1], nf)
        else:
            self.atom_table = None
            self.max_z = cfg.max_atomic_number
            self.atom_embedding = nn.Embedding(cfg.max_atomic_number + 1, nf)

        self.rbf = nn.Sequential(RBFExpansion(-4.0, 0.0, cfg.edge_features), nn.Linear(cfg.edge_features, nf),
                                 nn.Softplus())
        self.att_layers = nn.ModuleList([ComformerConv(nf, cfg.heads, nf) for _ in range(cfg.conv_layers)])
        if cfg.variant == "icomformer":
            self.rbf_angle = nn.Sequential(
                RBFExpansion(-1.0, 1.0, cfg.triplet_features), nn.Linear(cfg.triplet_features, nf), nn.Softplus())
            self.edge_update_layers = nn.ModuleList(
                [ComformerConvEdge(nf, cfg.heads, nf) for _ in range(cfg.edge_layers)])
            self.equi_update_layers = nn.ModuleList()
        else:
            self.rbf_angle = None
            self.edge_update_layers = nn.ModuleList()
            self.equi_update_layers = nn.ModuleList(
                [ComformerConvEqui(nf, nf, cfg.equi_scalars, cfg.equi_vectors) for _ in range(cfg.edge_layers)])
        self.fc = nn.Sequential(nn.Linear(nf, cfg.fc_features), nn.SiLU())
        self.fc_out = nn.Linear(cfg.fc_features, cfg.output_features)

    # ---------------------------------------------------------------------------------------

    @property
    def equivariant_irreps(self) -> str | None:
        """Irreps of the intermediate features returned by :meth:`forward_with_intermediates`."""
        if not self.equi_update_layers:
            return None
        return str(self.equi_update_layers[0].hidden_irreps)

    def _atom_input(self, z: Tensor) -> Tensor:
        bad = (z < 1) | (z > self.max_z)
        if bool(bad.any()):
            vals = sorted(set(z[bad].tolist()))
            raise ValueError(
                f"ComFormer: atomic number(s) {vals} outside the supported range 1-{self.max_z} "
                f"(atom_features={self.cfg.atom_features!r})")
        if self.atom_table is not None:
            return self.atom_embedding(self.atom_table[z].to(self.atom_embedding.weight.dtype))
        return self.atom_embedding(z)

    def lattice_vectors(self, cell: Tensor, batch: Mapping[str, Tensor] | None = None) -> Tensor:
        """The three lattice vectors per graph ``[B, 3, 3]`` that the edge-wise layer sees:
        ``batch["lattice_coeffs"] @ cell``, or the family's lattice rule when the batch lacks them."""
        if self.cfg.lattice_basis == "cell":
            return cell
        coeffs = None if batch is None else batch.get("lattice_coeffs")
        if coeffs is None:
            return canonical_lattice(cell)[1]
        return torch.einsum("bij,bjk->bik", coeffs.to(cell.dtype), cell)

    def forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        return self._forward(batch, None)

    def forward_with_intermediates(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        """``(output, extras)``. ``extras`` holds ``node_features`` [N, C] (before pooling),
        ``edge_vec`` [E, 3] and ``equivariant``, a list with one ``[N, irreps.dim]`` tensor per
        eComFormer layer (the output of its first tensor-product conv; irreps in
        :attr:`equivariant_irreps`)."""
        extras: dict[str, Any] = {"equivariant": []}
        out = self._forward(batch, extras)
        return out, extras

    def _forward(self, batch: Mapping[str, Tensor], extras: dict[str, Any] | None) -> Tensor:
        z = batch["atomic_numbers"].long()
        pos = batch["positions"]
        cell = batch["cell"].to(pos.dtype)
        graph = batch["batch"].long()
        src = batch["edge_src"].long()
        dst = batch["edge_dst"].long()
        shift = batch["edge_shift"].to(pos.dtype)
        n_graphs = cell.shape[0]
        n_atoms = pos.shape[0]

        # centre (dst) -> neighbour image (src); official edge_attr is sender -> receiver = -edge_vec
        edge_vec = pos[src] + torch.einsum("ek,ekd->ed", shift, cell[graph[src]]) - pos[dst]
        r = -edge_vec
        r_len = r.norm(dim=-1)

        x = self._atom_input(z)
        edge_feat = self.rbf(-0.75 / r_len)

        nei_len = nei_angle = None
        if self.edge_update_layers:
            lat = self.lattice_vectors(cell, batch)  # [B, 3, 3]
            lat_len = lat.norm(dim=-1)  # [B, 3]
            lat_e = lat[graph[dst]]  # [E, 3, 3]
            nei_len = self.rbf(-0.75 / lat_len)  # [B, 3, C] (official shares self.rbf), per graph
            cos = (lat_e * r.unsqueeze(1)).sum(-1) / (lat_len[graph[dst]] * r_len.unsqueeze(-1))
            nei_angle = self.rbf_angle(cos.clamp(-1.0, 1.0))  # [E, 3, C]

        equi_store = extras["equivariant"] if extras is not None else None
        for layer, att in enumerate(self.att_layers):
            x = att(x, src, dst, edge_feat)
            if self.cfg.dropout > 0:
                x = F.dropout(x, self.cfg.dropout, self.training)
            if layer < len(self.edge_update_layers):
                edge_feat = self.edge_update_layers[layer](edge_feat, nei_len, nei_angle, graph[dst])
            if layer < len(self.equi_update_layers):
                x = self.equi_update_layers[layer](x, src, dst, edge_feat, edge_vec, equi_store)

        pooled = _scatter_sum(x, graph, n_graphs)
        if self.cfg.pooling == "mean":
            counts = batch.get("num_atoms")
            if counts is None:
                counts = torch.bincount(graph, minlength=n_graphs)
            pooled = pooled / counts.to(pooled.dtype).clamp(min=1).unsqueeze(-1)
        out = self.fc_out(self.fc(pooled))
        if extras is not None:
            extras["node_features"] = x
            extras["edge_vec"] = edge_vec
            extras["num_atoms_total"] = n_atoms
        return out


def build_comformer(cfg: ComFormerConfig | Mapping[str, Any] | str | None = None) -> ComFormer:
    """Build a ComFormer from a config, a dict of config fields (may name a ``preset``) or a preset name."""
    if cfg is None:
        cfg = ComFormerConfig()
    elif isinstance(cfg, str):
        cfg = comformer_config(cfg)
    elif isinstance(cfg, Mapping):
        kw = dict(cfg)
        preset = kw.pop("preset", None)
        cfg = comformer_config(preset, **kw) if preset else ComFormerConfig(**kw)
    return ComFormer(cfg)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

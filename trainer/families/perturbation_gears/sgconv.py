"""Simple graph convolution (SGConv; Wu et al., ICML 2019) on `torch.sparse`.

GEARS uses ``torch_geometric.nn.SGConv(h, h, K=1)`` on its two gene graphs. torch_geometric is a heavy
optional install for two ~30-line operations, so this module reimplements it on a `torch.sparse` matrix
product; it matches PyG 2.8's SGConv to about 2e-7 (float32). Semantics copied from PyG:

* Messages flow ``edge_index[0]`` (source) -> ``edge_index[1]`` (target): ``out[i] = sum_j A[i, j] x[j]``
  over the edges ``j -> i``, as PyG's default ``flow="source_to_target"``.
* Normalisation is PyG's ``gcn_norm(add_self_loops=True, improved=False)``: first
  ``add_remaining_self_loops`` with fill value 1. A node that already has a self loop keeps it with its
  own weight (it is not doubled; with several self loops on one node the last one's weight is kept), and
  only nodes without one get a loop of weight 1. Then ``deg[i] = sum of the weights of edges into i`` and
  ``w_ij <- deg[j]^-1/2 w_ij deg[i]^-1/2`` (a zero degree gives 0, not inf).
* Duplicate edges add up (the sparse matrix is coalesced, as PyG's scatter-add).
* ``num_nodes`` is ``x.size(0)``: rows of ``x`` that no edge touches get only their self loop, so they pass
  through unchanged before the linear layer (this is what makes GEARS' batch bug reproducible, see
  ``model.py``).
* ``K`` propagation steps, then ``Linear(in, out)``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SGConv", "build_normalized_adjacency"]


def build_normalized_adjacency(edge_index: torch.Tensor, edge_weight: torch.Tensor | None, num_nodes: int) -> torch.Tensor:
    """Symmetric GCN normalisation with remaining self loops, as a coalesced sparse [N, N] matrix (target, source)."""
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must have shape [2, E], got {tuple(edge_index.shape)}")
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= num_nodes):
        raise ValueError(f"edge_index holds node indices outside [0, {num_nodes}): min {int(edge_index.min())}, "
                         f"max {int(edge_index.max())}")
    if edge_weight is not None and edge_weight.shape != (edge_index.size(1),):
        raise ValueError(f"edge_weight must have shape [{edge_index.size(1)}] (one per edge), got {tuple(edge_weight.shape)}")
    device = edge_index.device
    dtype = edge_weight.dtype if edge_weight is not None else torch.get_default_dtype()
    if edge_weight is None:
        edge_weight = torch.ones(edge_index.size(1), dtype=dtype, device=device)
    source, target = edge_index[0], edge_index[1]
    not_loop = source != target
    # Remaining self loops: weight 1 unless the node already has a loop, whose weight is kept (last one wins).
    loop_weight = torch.ones(num_nodes, dtype=dtype, device=device)
    loop_weight[source[~not_loop]] = edge_weight[~not_loop]
    loop_index = torch.arange(num_nodes, device=device)
    source = torch.cat([source[not_loop], loop_index])
    target = torch.cat([target[not_loop], loop_index])
    weight = torch.cat([edge_weight[not_loop], loop_weight])
    degree = torch.zeros(num_nodes, dtype=dtype, device=device).index_add_(0, target, weight)
    inv_sqrt = degree.pow(-0.5)
    inv_sqrt = inv_sqrt.masked_fill(torch.isinf(inv_sqrt), 0.0)
    # Indices were range-checked above, so torch's own (slower) invariant check is redundant.
    norm_weight = inv_sqrt[source] * weight * inv_sqrt[target]
    indices = torch.stack([target, source])
    return torch.sparse_coo_tensor(indices, norm_weight, (num_nodes, num_nodes), check_invariants=False).coalesce()


class SGConv(nn.Module):
    """``x -> Linear((D^-1/2 (A + I) D^-1/2)^K x)``; the same parameters (``lin.weight``, ``lin.bias``) as PyG's."""

    def __init__(self, in_channels: int, out_channels: int, K: int = 1, bias: bool = True) -> None:
        super().__init__()
        if K < 1:
            raise ValueError(f"SGConv needs K >= 1 propagation steps, got {K}")
        self.K = K
        self.lin = nn.Linear(in_channels, out_channels, bias=bias)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor | None = None, edge_weight: torch.Tensor | None = None,
                adjacency: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, in] -> [N, out]; edges index rows of x. `adjacency`: the normalised sparse [N, N] matrix of
        `build_normalized_adjacency`, built once by the caller, instead of `edge_index`/`edge_weight`."""
        if adjacency is None:
            if edge_index is None:
                raise ValueError("SGConv needs edge_index (and edge_weight) or a prebuilt adjacency")
            weight = edge_weight.to(x.dtype) if edge_weight is not None else None
            adjacency = build_normalized_adjacency(edge_index, weight, x.size(0))
            if weight is None:
                adjacency = adjacency.to(x.dtype)
        # The propagation runs in the adjacency's precision with autocast off: under half-precision weights
        # (DeepSpeed fp16/bf16) the embeddings arrive in half while the adjacency stays fp32, and autocast would
        # cast the dense side of the sparse product alone (its backward then mixes the two).
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(adjacency.dtype)
            for _ in range(self.K):
                x = torch.sparse.mm(adjacency, x)
        return self.lin(x)

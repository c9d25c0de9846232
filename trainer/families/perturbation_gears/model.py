"""GEARS (Roohani, Huang and Leskovec, Nat. Biotech. 2023): the network, single-device, on plain tensors.

Follows ``GEARS_Model`` of ``snap-stanford/GEARS`` (``gears/model.py``, release code at commit df0b0e2),
with hidden size h, G genes (the expression read-out) and P perturbable genes (the GO graph's nodes):

1. Gene embedding ``gene_emb`` (G x h, ``max_norm=1``) -> ``bn_emb`` -> ReLU. Positional embedding
   ``emb_pos`` (G x h, max_norm) -> ``num_gene_gnn_layers`` SGConv(K=1) on the co-expression graph (ReLU
   between layers, none after the last). ``base = gene + 0.2 * positional`` -> ``emb_trans_v2`` = MLP(h, h, h).
2. Perturbation embedding ``pert_emb`` (P x h, max_norm) -> ``num_go_gnn_layers`` SGConv(K=1) on the GO graph
   (edge-weighted; ReLU between layers).
3. Per cell, the sum of its perturbed genes' GO embeddings -> ``pert_fuse`` = MLP(h, h, h), added to every
   gene's embedding of that cell. Only perturbed cells go through ``pert_fuse`` (its BatchNorm statistics
   are over the batch's perturbed cells, as in GEARS; one perturbed cell in training mode is duplicated so
   BatchNorm has two rows, as GEARS does). A control cell (all indices -1) gets nothing added.
4. ``bn_pert_base`` -> ReLU -> ``recovery_w`` = MLP(h, 2h, h) -> gene-specific linear (``indv_w1``,
   ``indv_b1``): one scalar per gene. ``cross_gene_state`` = MLP(G, h, h) over a cell's G scalars gives one
   h-vector per cell, concatenated to each gene's scalar -> second gene-specific linear (``indv_w2``,
   ``indv_b2``) -> ``+ x`` (residual on the control cell's expression).
5. Optional uncertainty head ``uncertainty_w`` = MLP(h, 2h, h, 1) on the embedding that enters
   ``recovery_w``: a per-gene log-variance.

GEARS' ``MLP(sizes)`` is ``Linear-BN-ReLU-...-Linear-BN``: every Linear is followed by BatchNorm, and the
ReLU after the last one is dropped. Its ``last_layer_act`` argument is ignored by the release's ``forward``,
so ``emb_trans_v2`` and ``pert_fuse`` (built with ``last_layer_act='ReLU'``) end in BatchNorm too; this class
does the same. Parameter names are GEARS' own (``gene_emb.weight``, ``layers_emb_pos.0.lin.weight``,
``emb_trans_v2.network.0.weight``, ...), so a GEARS ``model.pt`` state dict loads with ``strict=False``;
only its two unused entries ``pert_w.*`` and ``bn_pert_base_trans.*`` are left out.

Differences from the original, on purpose:

* Co-expression propagation. GEARS runs the co-expression SGConv on the B x G stacked rows of a batch, while
  the graph's edges index only rows 0..G-1: only the first cell of each batch gets propagated positional
  embeddings, the other cells get ``lin(emb_pos)`` with no neighbours, so a cell's prediction depends on
  its place in the batch. Here the positional embedding does not depend on the cell, so it is computed
  once on G rows and broadcast to every cell. ``coexpress_first_cell_only=True`` reproduces the original
  (including its B x G rows through ``bn_emb`` and ``emb_trans_v2``) for side-by-side numbers.
* Cost. In the default mode the gene and positional branches (embeddings, ``bn_emb``, the co-expression
  SGConv, ``emb_trans_v2``) run once on G rows instead of B x G. Their batch statistics are those of the G
  distinct rows (GEARS' B identical copies give the same mean and biased variance); only BatchNorm's
  running variance differs by the unbiasing factor G/(G-1) instead of BG/(BG-1).
* Speed. The max-norm embeddings renormalise their rows in one vectorised op (``MaxNormEmbedding``; torch's
  CPU kernel loops over rows). ``compile_regions`` compiles the dense decoder for training (``train.compile``).
* No unused parameters. GEARS creates ``pert_w`` and ``bn_pert_base_trans`` and never uses them, and a batch
  of only control cells leaves ``pert_emb``, the GO SGConv and ``pert_fuse`` out of the graph: DDP then
  needs ``find_unused_parameters=True``. Here the two are not created, and an all-control batch adds
  ``0 *`` those parameters to the output, so every parameter gets a (zero) gradient in every step.
  ``uncertainty_w`` exists only with ``uncertainty=True`` and is then always used.
* GEARS' ``decoder_hidden_size`` option is stored but never used by its model; it is not an argument here.
* The perturbation indices are a padded [B, K] tensor (-1 = none) instead of a Python list per cell; the
  sum over a cell's perturbations is a masked sum, not a per-cell loop.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.errors import ConfigError, DataError
from trainer.families.perturbation_gears.sgconv import SGConv, build_normalized_adjacency

__all__ = ["GEARSModel", "GearsMLP", "MaxNormEmbedding"]

POSITIONAL_WEIGHT = 0.2
"""GEARS' fixed weight of the positional (co-expression) embedding in the base gene embedding."""


class GearsMLP(nn.Module):
    """GEARS' ``MLP``: ``Linear-BN-ReLU-...-Linear-BN`` (BatchNorm after every Linear, no ReLU at the end)."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        if len(sizes) < 2:
            raise ConfigError(f"an MLP needs at least an input and an output size, got {sizes}")
        layers: list[nn.Module] = []
        for index, (size_in, size_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers += [nn.Linear(size_in, size_out), nn.BatchNorm1d(size_out)]
            if index < len(sizes) - 2:
                layers.append(nn.ReLU())
        # Named `network` as in GEARS so its state dict keys match (network.0, network.1, network.3, ...).
        self.network = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


class MaxNormEmbedding(nn.Embedding):
    """``nn.Embedding(max_norm=...)`` whose in-place renormalisation of the looked-up rows is one vectorised op.

    Same rule as torch's ``embedding_renorm_``: each distinct looked-up row whose p-norm exceeds ``max_norm`` is
    scaled by ``max_norm / (norm + 1e-7)``, in place and outside autograd, before the lookup. Torch's CPU kernel
    does this row by row (a norm, an ``.item()`` and a multiply per row), and GEARS looks up every row of its three
    tables each step (three times the gene count), so that loop is a visible share of a CPU training step.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm: float = 1.0, norm_type: float = 2.0) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.max_norm, self.norm_type = float(max_norm), float(norm_type)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            rows = index.unique()
            # the scale in float64 from the weight-dtype norm, as torch's kernel (`.item<double>()`)
            norms = self.weight[rows].norm(p=self.norm_type, dim=1).double()
            over = norms > self.max_norm
            if bool(over.any()):
                rows, scale = rows[over], (self.max_norm / (norms[over] + 1e-7)).to(self.weight.dtype)
                self.weight.index_copy_(0, rows, self.weight[rows] * scale.unsqueeze(1))
        return nn.functional.embedding(index, self.weight)


def _check_graph(name: str, edge_index: torch.Tensor, edge_weight: torch.Tensor | None, num_nodes: int) -> torch.Tensor:
    """Validate one graph and return its weights (ones when none are given)."""
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise DataError(f"{name} graph: edge_index must have shape [2, E], got {tuple(edge_index.shape)}")
    if edge_index.dtype not in (torch.int64, torch.int32):
        raise DataError(f"{name} graph: edge_index must be an integer tensor, got {edge_index.dtype}")
    if edge_index.numel():
        bad = torch.nonzero((edge_index < 0) | (edge_index >= num_nodes))
        if bad.numel():
            row, edge = (int(v) for v in bad[0])
            raise DataError(f"{name} graph: edge {edge} has node index {int(edge_index[row, edge])} outside "
                            f"[0, {num_nodes}) ({bad.size(0)} such entries)")
    if edge_weight is None:
        return torch.ones(edge_index.size(1))
    if edge_weight.shape != (edge_index.size(1),):
        raise DataError(f"{name} graph: edge_weight must have shape [{edge_index.size(1)}] (one per edge), "
                        f"got {tuple(edge_weight.shape)}")
    if not torch.isfinite(edge_weight).all():
        raise DataError(f"{name} graph: edge_weight has non-finite values at edges "
                        f"{torch.nonzero(~torch.isfinite(edge_weight)).flatten()[:5].tolist()}")
    return edge_weight.float()


def _recache_adjacencies(model: nn.Module, incompatible_keys: object) -> None:
    """load_state_dict post-hook: the loaded graphs may be another run's."""
    model._cache_adjacencies()


class GEARSModel(nn.Module):
    """The GEARS network: control expression + perturbed genes -> predicted expression (see the module docstring).

    Args:
        num_genes: G, the genes of the expression profile (rows of the co-expression graph).
        num_perts: P, the perturbable genes (rows of the GO graph); ``pert_idx`` indexes these.
        coexpress_graph: ``(edge_index [2, E] long, edge_weight [E] or None)`` over the G genes; messages flow
            ``edge_index[0] -> edge_index[1]`` (GEARS' source -> target).
        go_graph: the same over the P perturbable genes.
        hidden_size: h (GEARS default 64).
        num_go_gnn_layers: SGConv layers on the GO graph (default 1).
        num_gene_gnn_layers: SGConv layers on the co-expression graph (default 1).
        uncertainty: add the per-gene log-variance head.
        coexpress_first_cell_only: reproduce GEARS' batch bug (only the first cell of a batch gets
            co-expression propagation); for side-by-side comparisons only.
    """

    def __init__(
        self,
        num_genes: int,
        num_perts: int,
        coexpress_graph: tuple[torch.Tensor, torch.Tensor | None],
        go_graph: tuple[torch.Tensor, torch.Tensor | None],
        hidden_size: int = 64,
        num_go_gnn_layers: int = 1,
        num_gene_gnn_layers: int = 1,
        uncertainty: bool = False,
        coexpress_first_cell_only: bool = False,
    ) -> None:
        super().__init__()
        for option, value, minimum in (("num_genes", num_genes, 1), ("num_perts", num_perts, 1), ("hidden_size", hidden_size, 1),
                                       ("num_go_gnn_layers", num_go_gnn_layers, 1),
                                       ("num_gene_gnn_layers", num_gene_gnn_layers, 1)):
            if int(value) != value or value < minimum:
                raise ConfigError(f"GEARS model: {option} must be an integer >= {minimum}, got {value!r}")
        self.num_genes = num_genes
        self.num_perts = num_perts
        self.hidden_size = hidden_size
        self.uncertainty = uncertainty
        self.coexpress_first_cell_only = coexpress_first_cell_only
        h = hidden_size

        self.register_buffer("coexpress_edge_index", coexpress_graph[0].long().clone())
        self.register_buffer("coexpress_edge_weight", _check_graph("co-expression", *coexpress_graph, num_genes).clone())
        self.register_buffer("go_edge_index", go_graph[0].long().clone())
        self.register_buffer("go_edge_weight", _check_graph("GO", *go_graph, num_perts).clone())
        self._cache_adjacencies()
        self.register_load_state_dict_post_hook(_recache_adjacencies)
        self.register_buffer("gene_index", torch.arange(num_genes), persistent=False)
        self.register_buffer("pert_index", torch.arange(num_perts), persistent=False)

        # GEARS' nn.Embedding(max_norm=True), i.e. max_norm=1.0: rows are renormalised in place at each lookup.
        self.gene_emb = MaxNormEmbedding(num_genes, h, max_norm=1.0)
        self.pert_emb = MaxNormEmbedding(num_perts, h, max_norm=1.0)
        self.emb_pos = MaxNormEmbedding(num_genes, h, max_norm=1.0)
        self.emb_trans_v2 = GearsMLP([h, h, h])
        self.pert_fuse = GearsMLP([h, h, h])
        self.layers_emb_pos = nn.ModuleList(SGConv(h, h, 1) for _ in range(num_gene_gnn_layers))
        self.sim_layers = nn.ModuleList(SGConv(h, h, 1) for _ in range(num_go_gnn_layers))
        self.recovery_w = GearsMLP([h, 2 * h, h])
        # Shapes as GEARS' so xavier_normal_ draws with the same fan-in/fan-out (and checkpoints load).
        self.indv_w1 = nn.Parameter(torch.empty(num_genes, h, 1))
        self.indv_b1 = nn.Parameter(torch.empty(num_genes, 1))
        self.cross_gene_state = GearsMLP([num_genes, h, h])
        self.indv_w2 = nn.Parameter(torch.empty(1, num_genes, h + 1))
        self.indv_b2 = nn.Parameter(torch.empty(1, num_genes))
        for parameter in (self.indv_w1, self.indv_b1, self.indv_w2, self.indv_b2):
            nn.init.xavier_normal_(parameter)
        self.bn_emb = nn.BatchNorm1d(h)
        self.bn_pert_base = nn.BatchNorm1d(h)
        if uncertainty:
            self.uncertainty_w = GearsMLP([h, 2 * h, h, 1])
        self._compiled_decode = None

    CHECKPOINT_SHAPED_BUFFERS = ("coexpress_edge_index", "coexpress_edge_weight", "go_edge_index", "go_edge_weight")
    """Buffers whose shapes a state dict brings (a checkpoint carries its own graphs, e.g. one imported from GEARS'
    config.pkl, whose edge count need not be the one this data set's graph builder gives)."""

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        # Resize the graph buffers to the incoming graphs so that the copy that follows takes them whole.
        graphs = {name: state_dict[prefix + name] for name in self.CHECKPOINT_SHAPED_BUFFERS if prefix + name in state_dict}
        for name, value in graphs.items():
            if torch.is_tensor(value) and value.shape != getattr(self, name).shape:
                if name.endswith("_edge_index") and (value.dim() != 2 or value.size(0) != 2):
                    break  # not a graph: the copy reports the shape
                setattr(self, name, torch.empty_like(getattr(self, name)).resize_(value.shape))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _cache_adjacencies(self) -> None:
        """Both graphs' normalised adjacencies as (non-persistent) buffers: built once, not every forward."""
        with torch.no_grad():
            for name, num_nodes in (("coexpress", self.num_genes), ("go", self.num_perts)):
                adjacency = build_normalized_adjacency(getattr(self, f"{name}_edge_index"),
                                                       getattr(self, f"{name}_edge_weight"), num_nodes)
                self.register_buffer(f"{name}_adjacency_index", adjacency.indices(), persistent=False)
                self.register_buffer(f"{name}_adjacency_weight", adjacency.values(), persistent=False)

    def _adjacency(self, name: str, num_nodes: int) -> torch.Tensor:
        index, weight = getattr(self, f"{name}_adjacency_index"), getattr(self, f"{name}_adjacency_weight")
        return torch.sparse_coo_tensor(index, weight, (num_nodes, num_nodes), is_coalesced=True, check_invariants=False)

    # -- gene branch -------------------------------------------------------------------------------------------
    def _propagate_positional(self, positional: torch.Tensor) -> torch.Tensor:
        if positional.size(0) == self.num_genes:
            graph = {"adjacency": self._adjacency("coexpress", self.num_genes)}
        else:  # the original's B x G stacked rows: the adjacency depends on B
            graph = {"edge_index": self.coexpress_edge_index, "edge_weight": self.coexpress_edge_weight}
        for index, layer in enumerate(self.layers_emb_pos):
            positional = layer(positional, **graph)
            if index < len(self.layers_emb_pos) - 1:
                positional = positional.relu()
        return positional

    def _gene_embeddings(self, batch_size: int) -> torch.Tensor:
        """Base gene embeddings: [G, h] shared by every cell, or [B*G, h] in the original's first-cell-only mode."""
        if self.coexpress_first_cell_only:
            # GEARS: B stacked copies of the G rows; the graph's edges only reach the first copy.
            rows = self.gene_index.repeat(batch_size)
            genes = torch.relu(self.bn_emb(self.gene_emb(rows)))
            positional = self._propagate_positional(self.emb_pos(rows))
        else:
            genes = torch.relu(self.bn_emb(self.gene_emb(self.gene_index)))
            positional = self._propagate_positional(self.emb_pos(self.gene_index))
        return self.emb_trans_v2(genes + POSITIONAL_WEIGHT * positional)

    # -- perturbation branch -----------------------------------------------------------------------------------
    def _perturbation_shift(self, pert_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per cell [B, h]: pert_fuse(sum of its perturbed genes' GO embeddings), zero for control cells.

        Also returns a zero-valued term that ties the perturbation parameters into the graph when the batch
        has no perturbed cell (None otherwise), so DDP sees a gradient for every parameter.
        """
        global_emb = self.pert_emb(self.pert_index)
        for index, layer in enumerate(self.sim_layers):
            global_emb = layer(global_emb, adjacency=self._adjacency("go", self.num_perts))
            if index < len(self.sim_layers) - 1:
                global_emb = global_emb.relu()
        batch_size = pert_idx.size(0)
        shift = global_emb.new_zeros(batch_size, self.hidden_size)
        present = pert_idx >= 0
        perturbed = torch.nonzero(present.any(dim=1)).flatten()
        if perturbed.numel() == 0:
            tie = global_emb.sum() + sum(p.sum() for p in self.pert_fuse.parameters())
            return shift, 0.0 * tie
        rows = pert_idx[perturbed]
        mask = present[perturbed].unsqueeze(-1).to(global_emb.dtype)
        summed = (global_emb[rows.clamp(min=0)] * mask).sum(dim=1)
        if summed.size(0) == 1 and self.training:
            # GEARS feeds a single perturbed cell twice so that BatchNorm has two rows.
            fused = self.pert_fuse(summed.repeat(2, 1))[:1]
        else:
            fused = self.pert_fuse(summed)
        return shift.index_copy(0, perturbed, fused), None

    # -- forward -----------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, pert_idx: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Predict expression after perturbation.

        Args:
            x: [B, G] float, the (control) cells' expression; the prediction is a residual on it.
            pert_idx: [B, K] long, indices into the P perturbable genes, padded with -1 (a control cell: all -1).

        Returns:
            pred [B, G], or (pred [B, G], logvar [B, G]) with ``uncertainty=True``.
        """
        if x.dim() != 2 or x.size(1) != self.num_genes:
            raise ValueError(f"x must have shape [B, {self.num_genes}], got {tuple(x.shape)}")
        if pert_idx.dim() != 2 or pert_idx.size(0) != x.size(0):
            raise ValueError(f"pert_idx must have shape [B={x.size(0)}, K] (padded with -1), got {tuple(pert_idx.shape)}")
        batch_size, num_genes, h = x.size(0), self.num_genes, self.hidden_size
        base = self._gene_embeddings(batch_size).reshape(-1, num_genes, h)  # [1 or B, G, h]
        shift, tie = self._perturbation_shift(pert_idx.long())
        decode = self._compiled_decode if self._compiled_decode is not None and self.training else GEARSModel._decode
        pred, logvar = decode(self, base, shift, x)
        if tie is not None:
            pred = pred + tie
        return pred if logvar is None else (pred, logvar)

    def _decode(self, base: torch.Tensor, shift: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps 4-5 on [B, G, h] rows: the dense bulk of a step, what `compile_regions` compiles."""
        batch_size, num_genes, h = x.size(0), self.num_genes, self.hidden_size
        base = (base + shift.unsqueeze(1)).reshape(batch_size * num_genes, h)
        base = torch.relu(self.bn_pert_base(base))

        out = self.recovery_w(base).reshape(batch_size, num_genes, h)
        out = (out * self.indv_w1.squeeze(-1)).sum(dim=2, keepdim=True) + self.indv_b1  # [B, G, 1]
        cross = self.cross_gene_state(out.squeeze(2))  # [B, h]
        out = torch.cat([out, cross.unsqueeze(1).expand(batch_size, num_genes, h)], dim=2)  # [B, G, h+1]
        pred = (out * self.indv_w2).sum(dim=2) + self.indv_b2 + x
        logvar = self.uncertainty_w(base).reshape(batch_size, num_genes) if self.uncertainty else None
        return pred, logvar

    def compile_regions(self) -> None:
        """torch.compile (inductor) the dense decoder `_decode` for training steps (the core's `train.compile`).

        Only that region: the sparse graph products and the data-dependent perturbation sum stay eager (dynamo
        cannot trace sparse COO construction), and evaluation stays eager (its varying chunk sizes would each
        compile). BatchNorm, ReLU and the gene-specific products fuse, which pays for the one-off compile over a
        run (BENCHMARKS.md, "Figures moved from code comments"). Parameter names and checkpoints are unchanged.
        The compiled function is unbound (``self`` is an argument), so a deep copy (EMA) stays right.
        """
        self._compiled_decode = torch.compile(GEARSModel._decode, dynamic=False)

"""GEARS network: SGConv normalisation by hand, shapes, gradients of every parameter, batch independence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.errors import DataError
from trainer.families.perturbation_gears.model import GearsMLP, GEARSModel, MaxNormEmbedding
from trainer.families.perturbation_gears.sgconv import SGConv, build_normalized_adjacency
from trainer.task import CompilableModel

G, P, H = 12, 6, 8


# ---------------------------------------------------------------------------------------------------------------
# SGConv
# ---------------------------------------------------------------------------------------------------------------
# 4 nodes; edges source -> target with weights. Node 1 already has a self loop (0.5, kept, not doubled);
# nodes 0, 2, 3 get one of weight 1. Node 3 has no incoming edge but its loop, so it passes through unchanged.
EDGES = [(0, 1, 0.5), (2, 1, 2.0), (1, 1, 0.5), (1, 0, 1.0), (3, 2, 0.25), (0, 2, 1.0)]


def _hand_adjacency() -> np.ndarray:
    """Dense (target, source) matrix with remaining self loops, normalised by hand."""
    a = np.zeros((4, 4))
    a[1, 0], a[1, 2], a[1, 1], a[0, 1], a[2, 3], a[2, 0] = 0.5, 2.0, 0.5, 1.0, 0.25, 1.0
    a[0, 0] = a[2, 2] = a[3, 3] = 1.0  # added loops; node 1 keeps its own 0.5
    degree = a.sum(axis=1)  # in-degree of each target: [2.0, 3.0, 2.25, 1.0]
    np.testing.assert_allclose(degree, [2.0, 3.0, 2.25, 1.0])
    return a / np.sqrt(degree)[:, None] / np.sqrt(degree)[None, :]


def _edge_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    edge_index = torch.tensor([[s for s, _, _ in EDGES], [t for _, t, _ in EDGES]])
    return edge_index, torch.tensor([w for _, _, w in EDGES], dtype=torch.float64)


def test_normalized_adjacency_matches_hand_computation() -> None:
    edge_index, weight = _edge_tensors()
    dense = build_normalized_adjacency(edge_index, weight, 4).to_dense().numpy()
    np.testing.assert_allclose(dense, _hand_adjacency(), rtol=0, atol=1e-12)
    # one entry written out: edge 2 -> 1 of weight 2, deg(1) = 3, deg(2) = 2.25
    assert dense[1, 2] == pytest.approx(2.0 / np.sqrt(3.0 * 2.25))
    # unweighted: existing self loops are replaced by one loop of weight 1 (PyG's behaviour)
    unweighted = build_normalized_adjacency(edge_index, None, 4).to_dense().double().numpy()
    a = np.zeros((4, 4))
    for s, t, _ in EDGES:
        a[t, s] = 1.0
    np.fill_diagonal(a, 1.0)
    d = a.sum(axis=1)
    np.testing.assert_allclose(unweighted, a / np.sqrt(np.outer(d, d)), atol=1e-7)


@pytest.mark.parametrize("hops", [1, 2])
def test_sgconv_equals_dense_propagation_then_linear(hops: int) -> None:
    torch.manual_seed(0)
    edge_index, weight = _edge_tensors()
    conv = SGConv(3, 2, K=hops).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    adjacency = torch.from_numpy(_hand_adjacency())
    expected = conv.lin(torch.linalg.matrix_power(adjacency, hops) @ x)
    torch.testing.assert_close(conv(x, edge_index, weight), expected)
    # node 3 has only its self loop: after one hop its features are unchanged
    if hops == 1:
        torch.testing.assert_close(conv(x, edge_index, weight)[3], conv.lin(x[3]))


def test_sgconv_extra_rows_pass_through_and_bad_index_is_rejected() -> None:
    edge_index, weight = _edge_tensors()
    conv = SGConv(3, 2).double()
    x = torch.randn(7, 3, dtype=torch.float64)  # rows 4..6 are touched by no edge
    out = conv(x, edge_index, weight)
    torch.testing.assert_close(out[4:], conv.lin(x[4:]))
    with pytest.raises(ValueError, match="outside"):
        conv(x[:3], edge_index, weight)


def test_sgconv_matches_torch_geometric_when_installed() -> None:
    pyg = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(1)
    edge_index = torch.randint(0, 20, (2, 80))
    weight = torch.rand(80)
    reference = pyg.SGConv(5, 4, K=2)
    ours = SGConv(5, 4, K=2)
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(25, 5)
    torch.testing.assert_close(ours(x, edge_index, weight), reference(x, edge_index, weight), atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# GEARS model
# ---------------------------------------------------------------------------------------------------------------
def _graph(num_nodes: int, neighbours: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node gets `neighbours` random sources plus itself (as GEARS' top-k graphs include self)."""
    generator = torch.Generator().manual_seed(seed)
    sources = torch.randint(0, num_nodes, (num_nodes * neighbours,), generator=generator)
    targets = torch.arange(num_nodes).repeat_interleave(neighbours)
    loops = torch.arange(num_nodes)
    edge_index = torch.stack([torch.cat([sources, loops]), torch.cat([targets, loops])])
    weight = 0.4 + 0.6 * torch.rand(edge_index.size(1), generator=generator)
    weight[-num_nodes:] = 1.0
    return edge_index, weight


def _model(**options) -> GEARSModel:
    torch.manual_seed(0)
    return GEARSModel(G, P, _graph(G, 3, 1), _graph(P, 2, 2), hidden_size=H, **options)


PERT_IDX = torch.tensor([[1, -1], [-1, -1], [2, 4], [5, -1], [0, 3]])


def _inputs(batch: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.rand(batch, G, generator=generator), PERT_IDX[:batch]


def _warm_up(model: GEARSModel) -> GEARSModel:
    """One training-mode pass so BatchNorm running statistics are not the defaults, then eval mode."""
    model.train()
    with torch.no_grad():
        model(*_inputs())
    return model.eval()


def test_forward_shapes_and_optional_uncertainty_head() -> None:
    x, pert = _inputs()
    plain = _model()
    assert plain(x, pert).shape == (5, G)
    assert not any(name.startswith("uncertainty_w") for name, _ in plain.named_parameters())
    pred, logvar = _model(uncertainty=True)(x, pert)
    assert pred.shape == logvar.shape == (5, G)


def test_mlp_is_gears_linear_bn_relu_linear_bn() -> None:
    kinds = [type(layer).__name__ for layer in GearsMLP([4, 5, 6]).network]
    assert kinds == ["Linear", "BatchNorm1d", "ReLU", "Linear", "BatchNorm1d"]


@pytest.mark.parametrize("uncertainty", [False, True])
@pytest.mark.parametrize("pert_rows", [slice(0, 5), slice(1, 2)], ids=["mixed", "controls_only"])
def test_every_parameter_gets_a_gradient(uncertainty: bool, pert_rows: slice) -> None:
    """DDP without find_unused_parameters needs every parameter in the graph, even for an all-control batch."""
    model = _model(uncertainty=uncertainty).train()
    x, pert = _inputs()
    if pert_rows == slice(1, 2):
        pert = torch.full((3, 2), -1)
        x = x[:3]
    out = model(x, pert)
    loss = out[0].square().sum() + out[1].sum() if uncertainty else out.square().sum()
    loss.backward()
    missing = [name for name, parameter in model.named_parameters() if parameter.grad is None]
    assert missing == []
    if pert_rows == slice(0, 5):
        # a mixed batch really trains every part: no parameter has an all-zero gradient
        zero = [name for name, parameter in model.named_parameters() if not parameter.grad.abs().sum() > 0]
        assert zero == []


def test_each_cell_in_a_batch_is_predicted_as_if_alone() -> None:
    """Guards GEARS' propagation bug: the co-expression propagation must reach every cell, not only the first."""
    model = _warm_up(_model(uncertainty=True))
    x, pert = _inputs()
    with torch.no_grad():
        batch_pred, batch_logvar = model(x, pert)
        for cell in range(x.size(0)):
            alone_pred, alone_logvar = model(x[cell : cell + 1], pert[cell : cell + 1])
            torch.testing.assert_close(batch_pred[cell], alone_pred[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(batch_logvar[cell], alone_logvar[0], atol=1e-5, rtol=1e-5)


def test_first_cell_only_option_reproduces_the_original_bug() -> None:
    fixed = _warm_up(_model())
    original = _model(coexpress_first_cell_only=True)
    original.load_state_dict(fixed.state_dict())
    original.eval()
    x, pert = _inputs()
    with torch.no_grad():
        batch = original(x, pert)
        alone = torch.cat([original(x[c : c + 1], pert[c : c + 1]) for c in range(x.size(0))])
        # a single cell is always "the first cell": both modes agree on it
        torch.testing.assert_close(alone, torch.cat([fixed(x[c : c + 1], pert[c : c + 1]) for c in range(x.size(0))]))
    torch.testing.assert_close(batch[0], alone[0], atol=1e-5, rtol=1e-5)
    for cell in range(1, x.size(0)):
        assert (batch[cell] - alone[cell]).abs().max() > 1e-4, f"cell {cell} unexpectedly got the propagation"


def test_control_and_perturbation_indexing() -> None:
    model = _warm_up(_model())
    x, _ = _inputs(1)
    with torch.no_grad():
        control_padded = model(x, torch.tensor([[-1, -1]]))
        control_empty = model(x, torch.zeros(1, 0, dtype=torch.long))
        double = model(x, torch.tensor([[2, 4]]))
        swapped = model(x, torch.tensor([[4, 2]]))
        single = model(x, torch.tensor([[2, -1]]))
    torch.testing.assert_close(control_padded, control_empty)
    torch.testing.assert_close(double, swapped)
    assert (double - single).abs().max() > 1e-4
    assert (single - control_padded).abs().max() > 1e-4


def test_residual_on_the_control_expression() -> None:
    model = _warm_up(_model())
    x, pert = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(x + 1.0, pert), model(x, pert) + 1.0)


def test_invalid_graphs_and_inputs_are_rejected() -> None:
    edge_index, weight = _graph(G, 2, 0)
    bad = edge_index.clone()
    bad[0, 3] = G
    with pytest.raises(DataError, match="co-expression graph: edge 3"):
        GEARSModel(G, P, (bad, weight), _graph(P, 2, 1), hidden_size=H)
    with pytest.raises(DataError, match="GO graph: edge_weight"):
        GEARSModel(G, P, (edge_index, weight), (_graph(P, 2, 1)[0], torch.ones(3)), hidden_size=H)
    model = _model()
    with pytest.raises(ValueError, match="x must have shape"):
        model(torch.zeros(2, G + 1), torch.full((2, 1), -1))
    with pytest.raises(ValueError, match="pert_idx must have shape"):
        model(torch.zeros(2, G), torch.full((2,), -1))


def test_one_training_step_reduces_the_loss_and_keeps_embeddings_max_norm() -> None:
    model = _model()
    x, pert = _inputs()
    target = x + 0.5 * torch.sin(torch.arange(G, dtype=torch.float32))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = (model(x, pert) - target).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with torch.no_grad():
        model(x, pert)  # a lookup renormalises the rows in place (max_norm=1, as GEARS)
    assert model.gene_emb.weight.norm(dim=1).max() <= 1.0 + 1e-5


def test_cached_adjacency_follows_loaded_graphs() -> None:
    """The normalised adjacencies are built once; loading a state dict with other graphs rebuilds them."""
    x, pert = _inputs()
    model, other = _warm_up(_model()), _model()
    other.coexpress_edge_weight.mul_(0.5)
    other.go_edge_weight.mul_(0.3)
    state = other.state_dict()
    for key in [k for k in state if "edge" not in k]:
        state[key] = model.state_dict()[key]  # same weights, other graph weights
    model.load_state_dict(state)
    with torch.no_grad():
        cached = model(x, pert)
        for name in ("coexpress", "go"):  # what an uncached forward would build
            expected = build_normalized_adjacency(getattr(model, f"{name}_edge_index"), getattr(model, f"{name}_edge_weight"),
                                                  G if name == "coexpress" else P)
            torch.testing.assert_close(getattr(model, f"{name}_adjacency_weight"), expected.values())
        positional = model.emb_pos(model.gene_index)
        direct = model.layers_emb_pos[0](positional, model.coexpress_edge_index, model.coexpress_edge_weight)
        torch.testing.assert_close(model._propagate_positional(positional), direct)
    assert not torch.equal(cached, _warm_up(_model())(x, pert))


def test_max_norm_embedding_matches_torch_renormalisation_bit_for_bit() -> None:
    """The vectorised renorm rescales exactly the rows torch's embedding_renorm_ would (repeats, rows left alone)."""
    torch.manual_seed(1)
    reference, ours = torch.nn.Embedding(30, 8, max_norm=1.0), MaxNormEmbedding(30, 8, max_norm=1.0)
    weight = torch.randn(30, 8) * torch.rand(30, 1) * 0.7
    weight[[3, 29, 1]] *= 10.0 / weight[[3, 29, 1]].norm(dim=1, keepdim=True)  # over the max norm; 1 is not looked up
    weight[[0, 7]] *= 0.5 / weight[[0, 7]].norm(dim=1, keepdim=True)  # under it
    reference.weight.data.copy_(weight)
    ours.weight.data.copy_(weight)
    index = torch.tensor([[3, 7, 3], [0, 29, 7]])
    assert torch.equal(ours(index), reference(index))
    assert torch.equal(ours.weight, reference.weight)  # in place, only looked-up rows over the norm changed
    changed = (ours.weight != weight).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3, 29]


def test_compiled_decoder_matches_eager() -> None:
    """compile_regions (train.compile): the same predictions, gradients and BatchNorm statistics as eager, the
    same parameter names; evaluation stays eager. With the uncertainty head, the region's largest form."""
    uncertainty = True
    eager, compiled = _model(uncertainty=uncertainty), _model(uncertainty=uncertainty)
    assert isinstance(compiled, CompilableModel)  # what the core's train.compile checks
    compiled.compile_regions()
    x, pert = _inputs()
    outputs = []
    for model in (eager, compiled):
        model.train()
        out = model(x, pert)
        pred, logvar = out if uncertainty else (out, out)
        (pred.square().mean() + logvar.exp().mean()).backward()
        outputs.append((pred, logvar))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)  # fused kernels sum in another order
    assert list(compiled.state_dict()) == list(eager.state_dict())
    for (name, theirs), ours in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-3, atol=1e-5, msg=name)
    torch.testing.assert_close(compiled.recovery_w.network[1].running_var, eager.recovery_w.network[1].running_var)
    compiled._compiled_decode = None  # evaluation must not call it: eager gives the same numbers
    torch.testing.assert_close(_warm_up(compiled)(x, pert), _warm_up(eager)(x, pert), rtol=1e-5, atol=1e-6)

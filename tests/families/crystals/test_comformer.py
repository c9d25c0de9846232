"""ComFormer (trainer/families/crystals/comformer.py, lattice.py): symmetry, batching, gradients, lattice rule.

Test graphs are built here with ``ase.neighborlist.neighbor_list("ijS")`` (edge j -> i, shift S;
the model's edge vector then equals ase's ``D``), plus optional ``use_lattice`` self-loops.
The structures are real ones bundled with the package (mlearn Si, JARVIS POSCARs; see
trainer/families/crystals/samples/README.md).
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

ase = pytest.importorskip("ase")
from ase import Atoms  # noqa: E402
from ase.io import read  # noqa: E402
from ase.neighborlist import neighbor_list  # noqa: E402

from trainer.families.crystals.comformer import (  # noqa: E402
    COMFORMER_PRESETS,
    ComFormerConfig,
    build_comformer,
    comformer_config,
    count_parameters,
    load_cgcnn_features,
)
from trainer.families.crystals.lattice import (  # noqa: E402
    canonical_lattice,
    canonical_lattice_coeffs,
    lattice_self_loop_shifts,
)
from trainer.families.crystals.readers import bundled_crystal_path  # noqa: E402

MLEARN_SI = bundled_crystal_path("mlearn_Si_training")
JARVIS = bundled_crystal_path("jarvis_bandgap_50")
CUTOFF = 4.0
VARIANTS = ["icomformer", "ecomformer"]


# --------------------------------------------------------------------------------------------
# Structures and graphs
# --------------------------------------------------------------------------------------------


def _mlearn_si(n: int) -> list[Atoms]:
    entries = json.loads(gzip.decompress(MLEARN_SI.read_bytes()))[:n]
    out = []
    for e in entries:
        s = e["structure"]
        out.append(Atoms([site["species"][0]["element"] for site in s["sites"]],
                         positions=[site["xyz"] for site in s["sites"]],
                         cell=s["lattice"]["matrix"], pbc=True))
    return out


def _poscar(jid: str) -> Atoms:
    return read(str(JARVIS / f"POSCAR-{jid}.vasp"))


def graph(atoms: Atoms, self_loops: str = "canonical", cutoff: float = CUTOFF) -> dict:
    """One structure as the model's sparse dict (float64).

    ``self_loops``: "none", "canonical" (official use_lattice: ±lat1..3 of the canonical
    lattice) or "unit" (shifts (1,0,0), (0,1,0), (0,0,1), (0,1,1), (1,0,1), (1,1,0)).
    """
    i, j, S = neighbor_list("ijS", atoms, cutoff)
    src, dst, shift = [j], [i], [S.astype(np.float64)]
    n = len(atoms)
    cell = torch.tensor(np.array(atoms.cell), dtype=torch.float64)
    if self_loops != "none":
        if self_loops == "canonical":
            loops = lattice_self_loop_shifts(cell).numpy().astype(np.float64)
        else:
            loops = np.array([(1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 0)], dtype=np.float64)
        atom = np.repeat(np.arange(n), len(loops))
        src.append(atom)
        dst.append(atom)
        shift.append(np.tile(loops, (n, 1)))
    return dict(
        atomic_numbers=torch.tensor(atoms.numbers, dtype=torch.long),
        positions=torch.tensor(atoms.positions, dtype=torch.float64),
        cell=cell.unsqueeze(0),
        batch=torch.zeros(n, dtype=torch.long),
        num_atoms=torch.tensor([n]),
        edge_src=torch.tensor(np.concatenate(src), dtype=torch.long),
        edge_dst=torch.tensor(np.concatenate(dst), dtype=torch.long),
        edge_shift=torch.tensor(np.concatenate(shift), dtype=torch.float64),
    )


def collate(graphs: list[dict]) -> dict:
    offsets = np.cumsum([0] + [len(g["atomic_numbers"]) for g in graphs])[:-1]
    return dict(
        atomic_numbers=torch.cat([g["atomic_numbers"] for g in graphs]),
        positions=torch.cat([g["positions"] for g in graphs]),
        cell=torch.cat([g["cell"] for g in graphs]),
        batch=torch.cat([torch.full_like(g["batch"], k) for k, g in enumerate(graphs)]),
        num_atoms=torch.cat([g["num_atoms"] for g in graphs]),
        edge_src=torch.cat([g["edge_src"] + int(o) for g, o in zip(graphs, offsets)]),
        edge_dst=torch.cat([g["edge_dst"] + int(o) for g, o in zip(graphs, offsets)]),
        edge_shift=torch.cat([g["edge_shift"] for g in graphs]),
    )


def rotation(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    if torch.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def model(variant: str = "icomformer", seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = build_comformer(comformer_config("tiny", variant=variant, **kw)).double().eval()
    _randomise_bn(m, seed)
    return m


def _randomise_bn(m: torch.nn.Module, seed: int) -> None:
    """Non-trivial BatchNorm statistics/affine so eval mode is not a near-identity."""
    g = torch.Generator().manual_seed(seed + 1)
    for mod in m.modules():
        if isinstance(mod, torch.nn.BatchNorm1d):
            c = mod.num_features
            mod.running_mean.copy_(0.3 * torch.randn(c, generator=g, dtype=torch.float64))
            mod.running_var.copy_(0.5 + torch.rand(c, generator=g, dtype=torch.float64))
            with torch.no_grad():
                mod.weight.copy_(1 + 0.2 * torch.randn(c, generator=g, dtype=torch.float64))
                mod.bias.copy_(0.2 * torch.randn(c, generator=g, dtype=torch.float64))


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-9) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def si():
    return _mlearn_si(3)


# --------------------------------------------------------------------------------------------
# Basics
# --------------------------------------------------------------------------------------------


def test_edge_vectors_follow_ase_convention(si):
    atoms = si[0]
    g = graph(atoms, self_loops="none")
    _, extras = model().forward_with_intermediates(g)
    D = neighbor_list("D", atoms, CUTOFF)
    assert_close(extras["edge_vec"], torch.tensor(D))


def test_cgcnn_table_and_unknown_elements(si):
    table = load_cgcnn_features()
    assert table.shape == (101, 92)
    assert torch.all(table[0] == 0) and torch.all(table[1:].sum(1) > 0)
    g = graph(si[0], self_loops="none")
    g["atomic_numbers"] = g["atomic_numbers"].clone()
    g["atomic_numbers"][3] = 101
    with pytest.raises(ValueError, match="101"):
        model()(g)


def test_presets_build_and_count():
    assert set(COMFORMER_PRESETS) >= {"tiny", "paper"}
    tiny = build_comformer("tiny")
    paper = build_comformer("paper")
    assert count_parameters(tiny) < 100_000 < 4_000_000 < count_parameters(paper) < 6_000_000
    assert paper.cfg == ComFormerConfig()  # "paper" = the official iComformerConfig defaults
    assert comformer_config("paper", variant="ecomformer").conv_layers == 3
    with pytest.raises(ValueError):
        ComFormerConfig(variant="icomformer", conv_layers=2, edge_layers=2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_output_shape_and_gradients_reach_every_parameter(si, variant):
    torch.manual_seed(0)
    m = build_comformer(comformer_config("tiny", variant=variant, output_features=3)).double().train()
    batch = collate([graph(a, self_loops="canonical") for a in si[:2]])
    out = m(batch)
    assert out.shape == (2, 3)
    (out ** 2).sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        # a bias directly in front of a train-mode BatchNorm gets an exactly-cancelling gradient
        if not name.endswith("lin_concate.bias"):
            assert p.grad.abs().sum() > 0, name


def _naive_node_layer(layer, x, src, dst, edge_attr):
    """ComformerConv.forward/message of the official transformer.py, literally (cat + Linear per edge)."""
    H, C = layer.heads, layer.channels
    q, k, v = (lin(x).view(-1, H, C) for lin in (layer.lin_query, layer.lin_key, layer.lin_value))
    e = layer.lin_edge(edge_attr).view(-1, H, C)
    key_j = layer.key_update(torch.cat((k[dst], k[src], e), dim=-1))
    alpha = q[dst] * key_j / np.sqrt(C)
    out = layer.lin_msg_update(torch.cat((v[dst], v[src], e), dim=-1))
    out = out * torch.sigmoid(layer.bn_att(alpha.view(-1, C)).view(-1, H, C))
    agg = torch.zeros(x.shape[0], H, C, dtype=x.dtype).index_add_(0, dst, out).view(-1, H * C)
    return torch.nn.functional.softplus(x + layer.bn(layer.lin_concate(agg)))


def _naive_edge_layer(layer, edge, nei_len, nei_angle):
    """ComformerConv_edge.forward of the official transformer.py, literally."""
    H, C = layer.heads, layer.channels
    query_x = layer.lin_query(edge).view(-1, H, C).unsqueeze(1).repeat(1, 3, 1, 1)
    key_x = layer.lin_key(edge).view(-1, H, C).unsqueeze(1).repeat(1, 3, 1, 1)
    value_x = layer.lin_value(edge).view(-1, H, C).unsqueeze(1).repeat(1, 3, 1, 1)
    key_y = torch.cat((layer.lin_key_e1(nei_len[:, 0, :]).view(-1, 1, H, C),
                       layer.lin_key_e2(nei_len[:, 1, :]).view(-1, 1, H, C),
                       layer.lin_key_e3(nei_len[:, 2, :]).view(-1, 1, H, C)), dim=1)
    value_y = torch.cat((layer.lin_value_e1(nei_len[:, 0, :]).view(-1, 1, H, C),
                         layer.lin_value_e2(nei_len[:, 1, :]).view(-1, 1, H, C),
                         layer.lin_value_e3(nei_len[:, 2, :]).view(-1, 1, H, C)), dim=1)
    edge_xy = layer.lin_edge(nei_angle).view(-1, 3, H, C)
    key = layer.key_update(torch.cat((key_x, key_y, edge_xy), dim=-1))
    alpha = (query_x * key) / np.sqrt(C)
    out = layer.lin_msg_update(torch.cat((value_x, value_y, edge_xy), dim=-1))
    out = out * torch.sigmoid(layer.bn_att(alpha.view(-1, C)).view(-1, 3, H, C))
    out = layer.lin_concate(out.view(-1, 3, H * C)).sum(dim=1)
    return torch.nn.functional.softplus(edge + layer.bn(out))


@pytest.mark.parametrize("heads", [1, 2])
def test_layers_match_literal_official_formulas(heads):
    """The node/edge layers compute the node-only (and graph-only) parts of the first MLP Linear
    before gathering. They must agree with the official per-edge ``cat`` + ``Linear``."""
    from trainer.families.crystals.comformer import ComformerConv, ComformerConvEdge

    torch.manual_seed(0)
    C, N, E, G = 8, 11, 40, 3
    node = ComformerConv(C, heads, C).double().eval()
    edge_layer = ComformerConvEdge(C, heads, C).double().eval()
    _randomise_bn(node, 0)
    _randomise_bn(edge_layer, 1)
    x = torch.randn(N, C, dtype=torch.float64)
    src, dst = torch.randint(0, N, (E,)), torch.randint(0, N, (E,))
    f = torch.randn(E, C, dtype=torch.float64)
    assert_close(node(x, src, dst, f), _naive_node_layer(node, x, src, dst, f))
    graph_of_edge = torch.randint(0, G, (E,))
    nei_len = torch.randn(G, 3, C, dtype=torch.float64)
    nei_angle = torch.randn(E, 3, C, dtype=torch.float64)
    ref = _naive_edge_layer(edge_layer, f, nei_len[graph_of_edge], nei_angle)
    assert_close(edge_layer(f, nei_len, nei_angle, graph_of_edge), ref)
    assert_close(edge_layer(f, nei_len[graph_of_edge], nei_angle), ref)


# --------------------------------------------------------------------------------------------
# Symmetries (eval mode, float64)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_rotation_and_translation_invariance(si, variant):
    m = model(variant)
    for atoms, loops in ((si[0], "canonical"), (_poscar("JVASP-1372"), "unit")):
        g = graph(atoms, self_loops=loops)
        ref = m(g)
        R = rotation(7)
        rot = dict(g, positions=g["positions"] @ R.T, cell=g["cell"] @ R.T)
        assert_close(m(rot), ref)
        shifted = dict(g, positions=g["positions"] + torch.tensor([0.37, -1.21, 2.9], dtype=torch.float64))
        assert_close(m(shifted), ref)
    # translate, wrap the atoms back into the cell and rebuild the neighbour list: the periodic
    # crystal is unchanged, the edge list is a different one (other shifts, order)
    atoms = si[1].copy()
    ref = m(graph(atoms))
    atoms.translate([1.7, -0.4, 3.3])
    atoms.wrap()
    assert_close(m(graph(atoms)), ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_permutation_invariance(si, variant):
    m = model(variant)
    g = graph(si[0])
    ref = m(g)
    n, e = len(g["atomic_numbers"]), len(g["edge_src"])
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    inv = torch.argsort(perm)  # new index of old atom k is inv[k]
    eperm = torch.randperm(e, generator=torch.Generator().manual_seed(4))
    permuted = dict(
        g,
        atomic_numbers=g["atomic_numbers"][perm],
        positions=g["positions"][perm],
        edge_src=inv[g["edge_src"]][eperm],
        edge_dst=inv[g["edge_dst"]][eperm],
        edge_shift=g["edge_shift"][eperm],
    )
    assert_close(m(permuted), ref)


@pytest.mark.numerics
@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_equals_separate(si, variant):
    m = model(variant)
    graphs = [graph(si[0]), graph(_poscar("JVASP-97570"))]
    batch = collate(graphs)
    together = m(batch)
    alone = torch.cat([m(g) for g in graphs])
    assert_close(together, alone)
    # precomputed lattice coefficients (what a data pipeline may pass) give the same result
    coeffs, _ = canonical_lattice(batch["cell"])
    assert_close(m(dict(batch, lattice_coeffs=coeffs)), together)


@pytest.mark.parametrize("variant,kw", [("ecomformer", {}), ("icomformer", {"edge_layers": 0})])
def test_supercell_gives_same_intensive_output(si, variant, kw):
    """Holds exactly when the model sees no lattice: eComFormer, or iComFormer without its edge
    layer, on graphs without lattice self-loops."""
    m = model(variant, **kw)
    atoms = si[2]
    ref = m(graph(atoms, self_loops="none"))
    assert_close(m(graph(atoms.repeat((2, 1, 1)), self_loops="none")), ref)


def test_icomformer_lattice_features_see_the_supercell(si):
    """The lattice-aware edge layer (default iComFormer) does not treat a supercell as the same
    input: its lattice vectors are the supercell's. This is documented, not a bug."""
    m = model("icomformer")
    atoms = si[2]
    a = m(graph(atoms, self_loops="none"))
    b = m(graph(atoms.repeat((2, 1, 1)), self_loops="none"))
    assert not torch.allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_unimodular_change_of_basis(variant):
    """Same lattice, different basis (a' = a + b, c' = c - a): same crystal, same output.
    This holds because the lattice vectors are the canonical ones (the official lattice
    correction), and the self-loops are built from them. It needs a cell without
    length/orthogonality ties (here triclinic JVASP-97570)."""
    atoms = _poscar("JVASP-97570")
    m = model(variant)
    ref = m(graph(atoms))
    U = np.array([[1, 1, 0], [0, 1, 0], [-1, 0, 1]])
    other = atoms.copy()
    other.set_cell(U @ np.array(atoms.cell), scale_atoms=False)
    other.wrap()
    assert_close(m(graph(other)), ref)
    if variant == "icomformer":
        # with the raw cell rows as lattice vectors the model is basis-dependent
        mc = model(variant, lattice_basis="cell")
        assert not torch.allclose(mc(graph(atoms)), mc(graph(other)), rtol=1e-6, atol=1e-6)


def test_canonical_lattice():
    rng = np.random.default_rng(0)
    cell = np.array(_poscar("JVASP-97570").cell)
    base = canonical_lattice_coeffs(cell) @ cell
    # successive minima: compare with brute force over a large coefficient box
    grid = np.array([(a, b, c) for a in range(-4, 5) for b in range(-4, 5) for c in range(-4, 5)
                     if (a, b, c) != (0, 0, 0)])
    lengths = np.sort(np.linalg.norm(grid @ cell, axis=1))
    assert np.isclose(np.linalg.norm(base[0]), lengths[0])
    assert np.linalg.det(base) > 0
    assert base[0] @ base[1] >= 0 and base[0] @ base[2] >= 0
    for _ in range(5):  # random unimodular bases of the same lattice give the same vectors
        U = np.eye(3, dtype=int)
        for _ in range(4):
            i, j = rng.choice(3, 2, replace=False)
            U[i] += rng.integers(-2, 3) * U[j]
        assert round(abs(np.linalg.det(U))) == 1
        other = U @ cell
        np.testing.assert_allclose(canonical_lattice_coeffs(other) @ other, base, atol=1e-9)
    # ties (fcc primitive: all lengths equal) are broken by the integer coefficients, so a
    # rotation gives the same coefficients
    fcc = torch.tensor(np.array(_poscar("JVASP-1372").cell))
    R = rotation(5)
    c0, v0 = canonical_lattice(fcc)
    c1, v1 = canonical_lattice(fcc @ R.T)
    assert torch.equal(c0, c1)
    assert_close(v1, v0 @ R.T)


def _official_lattice_correction(structure) -> np.ndarray:
    """The lattice correction of ``nearest_neighbor_edges_submit`` in the official
    ``comformer/graphs.py`` (divelab/AIRS OpenMat/ComFormer), restated with pymatgen."""
    lat = structure.lattice
    nbrs = sorted(structure.get_all_neighbors(r=max(lat.a, lat.b, lat.c) + 1e-2)[0], key=lambda n: n.nn_distance)
    images = np.array([n.image for n in nbrs if n.index == 0])

    def unit(v):
        return v / np.linalg.norm(v)

    lat1, start = images[0], 1
    for k in range(start, len(images)):
        lat2 = images[k]
        if abs(abs(unit(lat1) @ unit(lat2)) - 1.0) >= 1e-5:
            start = k
            break
    for k in range(start, len(images)):
        lat3 = images[k]
        if abs(np.cross(lat1, lat2) @ lat3) >= 1e-5:
            break
    m = lat.matrix
    if (lat1 @ m) @ (lat2 @ m) < 0:
        lat2 = -lat2
    if (lat1 @ m) @ (lat3 @ m) < 0:
        lat3 = -lat3
    if np.cross(lat1 @ m, lat2 @ m) @ (lat3 @ m) < 0:
        lat1, lat2, lat3 = -lat1, -lat2, -lat3
    return np.stack([lat1, lat2, lat3]) @ m


def test_canonical_lattice_matches_official_lattice_correction(si):
    """On cells without ties (no equal lengths, no right angles with lat1) the lattice vectors
    are exactly the official ones."""
    adaptor = pytest.importorskip("pymatgen.io.ase").AseAtomsAdaptor
    for atoms in (si[0], _poscar("JVASP-97570"), _poscar("JVASP-76549"), _poscar("JVASP-76567")):
        cell = np.array(atoms.cell)
        official = _official_lattice_correction(adaptor.get_structure(atoms))
        np.testing.assert_allclose(canonical_lattice_coeffs(cell) @ cell, official, atol=1e-8)


# --------------------------------------------------------------------------------------------
# Equivariance of eComFormer internals and autograd forces
# --------------------------------------------------------------------------------------------


def test_ecomformer_features_rotate_with_wigner_d(si):
    o3 = pytest.importorskip("e3nn.o3")
    m = model("ecomformer")
    g = graph(si[0])
    R = rotation(11)
    _, ex = m.forward_with_intermediates(g)
    _, ex_rot = m.forward_with_intermediates(dict(g, positions=g["positions"] @ R.T, cell=g["cell"] @ R.T))
    irreps = o3.Irreps(m.equivariant_irreps)
    # e3nn builds D from generators in the default dtype: use float64 for a tight comparison
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        D = irreps.D_from_matrix(R)
    finally:
        torch.set_default_dtype(default)
    (h,), (h_rot,) = ex["equivariant"], ex_rot["equivariant"]
    assert h.shape[-1] == irreps.dim
    assert h[:, irreps.slices()[1]].abs().max() > 1e-3  # the l=1 part is not trivially zero
    assert_close(h_rot, h @ D.T)


def test_ecomformer_inversion_invariant(si):
    m = model("ecomformer")
    g = graph(si[0])
    assert_close(m(dict(g, positions=-g["positions"], cell=-g["cell"])), m(g))


@pytest.mark.parametrize("variant", VARIANTS)
def test_autograd_forces_rotate(si, variant):
    m = model(variant)
    g = graph(si[0])
    R = rotation(2)

    def forces(batch):
        pos = batch["positions"].clone().requires_grad_(True)
        energy = m(dict(batch, positions=pos)).sum()
        return -torch.autograd.grad(energy, pos)[0]

    f = forces(g)
    assert f.abs().max() > 0
    assert_close(forces(dict(g, positions=g["positions"] @ R.T, cell=g["cell"] @ R.T)), f @ R.T)

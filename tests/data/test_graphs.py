"""Shared neighbour lists and sparse batches (trainer/data/graphs.py) against brute force: periodic
(all images, and the minimum image when the cutoff allows only one), mixed and non-periodic
boundaries, k nearest neighbours with ties, edge de-duplication and the collate offsets."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

pytest.importorskip("vesin")

from trainer.data.graphs import (  # noqa: E402
    collate_sparse_graphs,
    directed_edges,
    edge_vectors,
    knn_pairs,
    neighbor_pairs,
    unique_edges,
)

BACKENDS = ["vesin", "ase"]  # ase: ASE's numpy search, the benchmarks' reference


def random_cell(rng: np.random.Generator, n: int, size: float = 4.0) -> tuple[np.ndarray, np.ndarray]:
    """A triclinic cell and n atoms inside it, at least 0.5 Å apart (images included)."""
    cell = np.diag(rng.uniform(0.8, 1.2, 3) * size) + rng.uniform(-0.3, 0.3, (3, 3)) * size
    while True:
        frac = rng.random((n, 3))
        pos = frac @ cell
        i, j, S, d = brute_periodic(pos, cell, 0.5, (True, True, True))
        if not len(d):
            return cell, pos


def brute_periodic(positions: np.ndarray, cell: np.ndarray, cutoff: float, pbc: tuple[bool, bool, bool]):
    """Every (i, j, S, d) with |positions[j] + S @ cell - positions[i]| < cutoff, by enumerating shifts."""
    recip = np.linalg.inv(cell).T
    bound = [int(math.ceil(cutoff * np.linalg.norm(recip[k]))) + 1 if pbc[k] else 0 for k in range(3)]
    out = []
    for S in itertools.product(*[range(-b, b + 1) for b in bound]):
        shift = np.array(S) @ cell
        d = np.linalg.norm(positions[None, :, :] + shift - positions[:, None, :], axis=-1)  # [i, j]
        for i, j in zip(*np.nonzero(d < cutoff)):
            if i == j and not any(S):
                continue
            out.append((int(i), int(j), S, float(d[i, j])))
    return ([o[0] for o in out], [o[1] for o in out], [o[2] for o in out], [o[3] for o in out]) if out else \
        ([], [], [], [])


def as_dict(i, j, S, d) -> dict[tuple, float]:
    return {(int(a), int(b), tuple(int(x) for x in s)): float(x) for a, b, s, x in zip(i, j, S, d)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed,n,cutoff", [(0, 6, 3.0), (1, 3, 7.5), (2, 1, 5.0)])
def test_periodic_pairs_match_brute_force(backend, seed, n, cutoff):
    """Cutoffs up to twice the cell size: many images of each atom, the atom's own images included."""
    rng = np.random.default_rng(seed)
    cell, pos = random_cell(rng, n)
    ours = as_dict(*neighbor_pairs(pos, cell, cutoff, backend))
    ref = as_dict(*brute_periodic(pos, cell, cutoff, (True, True, True)))
    assert ours.keys() == ref.keys() and len(ref) > 0
    np.testing.assert_allclose([ours[k] for k in ref], [ref[k] for k in ref], rtol=0, atol=1e-9)


def test_periodic_pairs_are_the_minimum_image_below_half_the_width():
    """With a cutoff under half the smallest cell width each pair is found once, through the image
    the minimum-image convention picks (fractional differences wrapped to [-0.5, 0.5))."""
    rng = np.random.default_rng(3)
    cell, pos = random_cell(rng, 12, size=8.0)
    widths = np.abs(np.linalg.det(cell)) / np.linalg.norm(np.cross(cell[[1, 2, 0]], cell[[2, 0, 1]]), axis=1)
    cutoff = 0.45 * widths.min()
    i, j, S, d = neighbor_pairs(pos, cell, cutoff)
    pairs = list(zip(i.tolist(), j.tolist()))
    assert len(pairs) == len(set(pairs)) > 0
    frac = np.linalg.solve(cell.T, pos.T).T
    diff = frac[None, :, :] - frac[:, None, :]
    wrapped = diff - np.round(diff)
    dmin = np.linalg.norm(wrapped @ cell, axis=-1)
    expected = {(a, b) for a, b in zip(*np.nonzero(dmin < cutoff)) if a != b}
    assert set(pairs) == expected
    np.testing.assert_allclose(d, dmin[i, j], atol=1e-9)
    np.testing.assert_allclose(pos[j] + S @ cell - pos[i], (wrapped @ cell)[i, j], atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_periodic_pairs_match_brute_force(backend):
    rng = np.random.default_rng(4)
    pos = rng.uniform(0, 6, (25, 3))
    i, j, S, d = neighbor_pairs(pos, None, 2.5, backend)
    assert not S.any()  # no images without a cell
    full = np.linalg.norm(pos[None] - pos[:, None], axis=-1)
    ref = {(a, b) for a, b in zip(*np.nonzero(full < 2.5)) if a != b}
    assert set(zip(i.tolist(), j.tolist())) == ref and len(i) == len(ref) > 0
    np.testing.assert_allclose(d, full[i, j], atol=1e-12)


def test_mixed_boundaries_match_brute_force():
    """A slab: periodic in x and y, open in z (the cell's z row only spans the box)."""
    rng = np.random.default_rng(5)
    cell = np.array([[3.5, 0.0, 0.0], [0.8, 3.2, 0.0], [0.0, 0.0, 10.0]])
    pos = rng.random((5, 3)) @ cell
    ours = as_dict(*neighbor_pairs(pos, cell, 4.0, pbc=(True, True, False)))
    ref = as_dict(*brute_periodic(pos, cell, 4.0, (True, True, False)))
    assert ours.keys() == ref.keys() and all(k[2][2] == 0 for k in ours)
    np.testing.assert_allclose([ours[k] for k in ref], [ref[k] for k in ref], atol=1e-9)


def _brute_knn(pairs: dict[tuple, float], n: int, k: int, tol: float) -> set[tuple]:
    keep = set()
    for c in range(n):
        mine = {key: d for key, d in pairs.items() if key[0] == c}
        if not mine:
            continue
        kth = sorted(mine.values())[min(k, len(mine)) - 1]
        keep |= {key for key, d in mine.items() if d <= kth + tol}
    return keep


@pytest.mark.parametrize("k", [1, 5, 14])
def test_knn_periodic_matches_brute_force(k):
    rng = np.random.default_rng(6)
    cell, pos = random_cell(rng, 4)
    tol = 1e-4
    i, j, S, d = knn_pairs(pos, cell, k, start_radius=1.0, tie_tol=tol)
    ours = as_dict(i, j, S, d)
    ref_pairs = as_dict(*brute_periodic(pos, cell, 12.0, (True, True, True)))
    assert set(ours) == _brute_knn(ref_pairs, len(pos), k, tol)
    assert np.all(np.bincount(i, minlength=len(pos)) >= k)


def test_knn_ties_are_kept():
    """Simple cubic, one atom: 6 neighbours at a and 12 at a sqrt(2); k=7 keeps all 18."""
    i, j, S, d = knn_pairs(np.zeros((1, 3)), np.eye(3) * 3.0, 7, start_radius=1.0)
    assert len(d) == 18 and np.allclose(sorted(set(np.round(d, 9))), [3.0, 3.0 * math.sqrt(2)])


@pytest.mark.parametrize("k", [3, 50])
def test_knn_non_periodic_matches_brute_force(k):
    """Non-periodic: k is capped at n - 1 (k=50 keeps every pair); no shifts."""
    rng = np.random.default_rng(7)
    pos = rng.uniform(0, 5, (12, 3))
    i, j, S, d = knn_pairs(pos, None, k, start_radius=0.5)
    full = np.linalg.norm(pos[None] - pos[:, None], axis=-1)
    pairs = {(a, b, (0, 0, 0)): full[a, b] for a in range(12) for b in range(12) if a != b}
    assert set(as_dict(i, j, S, d)) == _brute_knn(pairs, 12, k, 1e-4)
    if k >= 11:
        assert len(i) == 12 * 11
    assert knn_pairs(pos[:1], None, 3)[0].size == 0  # a lone atom has no neighbours


def test_directed_unique_edges_and_vectors():
    i = np.array([0, 0, 1, 1])
    j = np.array([1, 1, 0, 0])
    S = np.array([[0, 0, 0], [0, 0, 0], [0, 0, 0], [-1, 0, 0]])
    src, dst, shift = directed_edges(i, j, S, symmetric=True)
    assert len(src) == 8
    src, dst, shift = unique_edges(src, dst, shift, num_nodes=2)
    edges = list(zip(dst.tolist(), src.tolist(), map(tuple, shift.tolist())))
    assert edges == sorted(set(edges))  # unique, sorted by (dst, src, shift)
    assert set(edges) == {(0, 1, (0, 0, 0)), (1, 0, (0, 0, 0)), (1, 0, (-1, 0, 0)), (0, 1, (1, 0, 0))}
    pos = np.array([[0.0, 0.0, 0.0], [1.0, 0.5, 0.0]])
    cell = np.eye(3) * 4.0
    vec = edge_vectors(pos, cell, {"edge_src": src, "edge_dst": dst, "edge_shift": shift})
    np.testing.assert_allclose(vec, pos[src] + shift @ cell - pos[dst])
    np.testing.assert_allclose(edge_vectors(pos, None, {"edge_src": src, "edge_dst": dst}), pos[src] - pos[dst])


def test_collate_offsets_edges_and_numbers_graphs():
    rows = [
        {"z": np.array([6, 8]), "x": np.zeros((2, 3)), "edge_src": np.array([1, 0]), "edge_dst": np.array([0, 1]),
         "w": np.array([0.5, 0.25]), "y": 1.0},
        {"z": np.array([1]), "x": np.ones((1, 3)), "edge_src": np.zeros(0, int), "edge_dst": np.zeros(0, int),
         "w": np.zeros(0), "y": 2.0},
        {"z": np.array([7, 7, 1]), "x": np.full((3, 3), 2.0), "edge_src": np.array([2, 0, 1]),
         "edge_dst": np.array([0, 2, 2]), "w": np.array([1.0, 2.0, 3.0]), "y": 3.0},
    ]
    b = collate_sparse_graphs(rows, size_key="z", node_keys={"z": np.int64, "x": np.float32},
                              edge_keys={"w": np.float32}, graph_keys={"y": np.float32}, shapes={"x": (3,)})
    assert b["z"].tolist() == [6, 8, 1, 7, 7, 1] and b["x"].shape == (6, 3) and b["x"].dtype == torch.float32
    assert b["batch"].tolist() == [0, 0, 1, 2, 2, 2]
    assert b["num_nodes"].tolist() == [2, 1, 3] and b["num_edges"].tolist() == [2, 0, 3]
    # graph 2's edges are offset by the 3 atoms of graphs 0 and 1
    assert b["edge_src"].tolist() == [1, 0, 5, 3, 4] and b["edge_dst"].tolist() == [0, 1, 3, 5, 5]
    assert b["edge_src"].dtype == torch.long and b["w"].tolist() == [0.5, 0.25, 1.0, 2.0, 3.0]
    assert b["y"].tolist() == [1.0, 2.0, 3.0]
    # every edge stays inside its graph
    assert torch.equal(b["batch"][b["edge_src"]], b["batch"][b["edge_dst"]])
    only = collate_sparse_graphs(rows[1:2], size_key="z", node_keys={"x": np.float32}, shapes={"x": (3,)},
                                 num_nodes_key="num_atoms")
    assert only["edge_src"].shape == (0,) and only["x"].shape == (1, 3) and only["num_atoms"].tolist() == [1]

"""Neighbour lists and sparse graph batches: the family-independent part of atomistic graphs.

Shared by every family whose samples are atoms (crystals today, molecules next). Nothing here knows
a file format, a model or a lattice rule.

Conventions (the models rely on them):

* A neighbour list is `(i, j, S, d)` as in `ase.neighborlist.neighbor_list("ijSd")`: for every
  ordered pair closer than the cutoff, the vector from atom i to the image of atom j is
  `positions[j] + S @ cell - positions[i]` and `d` is its length. Periodic structures give
  integer image shifts S; non-periodic ones (`cell=None`) give S = 0 and no images.
* An edge e goes from `src[e]` = j (the neighbour) to `dst[e]` = i (the centre): messages flow
  src -> dst, and the edge vector (centre -> neighbour image) is
  `positions[src] + shift @ cell - positions[dst]` (`edge_vectors`).
* A sparse batch concatenates the atoms of its graphs, offsets each graph's edge indices by the
  number of atoms before it, and gives every atom its graph number (`batch`).

Neighbour search is vesin (C++ cell lists); `backend="ase"` is ASE's numpy search, kept as the
reference the benchmarks compare against.
"""

from __future__ import annotations

import math
import multiprocessing
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch only where a batch is made: processes that build graphs (shard workers) never load it
    import torch

MAX_SEARCH_RADIUS = 100.0
"""Å: the k-NN search gives up beyond this radius (only reachable with absurd inputs)."""

Pairs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _pbc(cell: np.ndarray | None, pbc: bool | Sequence[bool] | None) -> np.ndarray:
    if cell is None:
        return np.zeros(3, dtype=bool)
    return np.broadcast_to(np.asarray(True if pbc is None else pbc, dtype=bool), (3,))


_VESIN_IMPORT = threading.Lock()


def _vesin() -> Any:
    """The vesin module. In a worker process of a build (a child started by multiprocessing) that has not loaded
    torch, it is imported with torch unavailable: vesin imports torch when it can, only to accept torch tensors,
    which this module never passes, and that import costs a worker more than its own start-up. Anywhere else
    (a trainer, a notebook, a process that loaded torch) vesin is imported as it is, so code that hands it tensors
    later keeps working."""
    with _VESIN_IMPORT:
        if "vesin" in sys.modules or "torch" in sys.modules or multiprocessing.parent_process() is None:
            import vesin

            return vesin
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError meanwhile
        try:
            import vesin
        finally:
            sys.modules.pop("torch", None)
        return vesin


def neighbor_pairs(positions: np.ndarray, cell: np.ndarray | None, cutoff: float, backend: str = "vesin",
                   pbc: bool | Sequence[bool] | None = None) -> Pairs:
    """(i, j, S, d) of every ordered pair closer than `cutoff` (see the module docstring).

    `cell=None` is a non-periodic structure (molecule, cluster); with a cell, `pbc` (default: all
    three axes periodic) chooses the periodic axes. Indices are int64, S int64 [P, 3], d float64.
    """
    positions = np.ascontiguousarray(positions, dtype=np.float64).reshape(-1, 3)
    periodic = _pbc(cell, pbc)
    box = np.zeros((3, 3)) if cell is None else np.ascontiguousarray(cell, dtype=np.float64)
    if backend == "vesin":
        vesin = _vesin()
        i, j, S, d = vesin.NeighborList(cutoff=float(cutoff), full_list=True).compute(
            positions, box, bool(periodic[0]) if periodic.all() or not periodic.any() else periodic.tolist(),
            quantities="ijSd", copy=True)
    elif backend == "ase":
        from ase.neighborlist import primitive_neighbor_list

        i, j, S, d = primitive_neighbor_list("ijSd", tuple(bool(p) for p in periodic), box, positions, float(cutoff))
    else:
        raise ValueError(f"unknown neighbour-list backend {backend!r} (use 'vesin' or 'ase')")
    return i.astype(np.int64), j.astype(np.int64), S.astype(np.int64).reshape(-1, 3), np.asarray(d, np.float64)


def knn_pairs(positions: np.ndarray, cell: np.ndarray | None, k: int, *, start_radius: float = 4.0,
              tie_tol: float = 1e-4, backend: str = "vesin", pbc: bool | Sequence[bool] | None = None) -> Pairs:
    """(i centre, j neighbour, S, d) of every atom's k nearest neighbours, ties included.

    An atom keeps every neighbour (image) with distance <= its k-th distance + `tie_tol`. The
    search starts at max(`start_radius`, a density estimate for ~1.5 k neighbours) and doubles until
    every atom has k neighbours and every tie of its k-th distance lies inside the radius, so the
    result depends on k and `tie_tol` only, not on `start_radius`. Non-periodic structures have at
    most n - 1 neighbours per atom: k is capped there.
    """
    positions = np.ascontiguousarray(positions, dtype=np.float64).reshape(-1, 3)
    n = len(positions)
    periodic = _pbc(cell, pbc)
    k_eff = k if periodic.any() else min(k, n - 1)
    if n == 0 or k_eff < 1:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros((0, 3), dtype=np.int64), np.zeros(0)
    if periodic.all():
        volume = abs(float(np.linalg.det(np.asarray(cell, dtype=np.float64))))
    else:  # bounding box, at least 1 Å thick along each axis
        volume = float(np.prod(np.maximum(np.ptp(positions, axis=0), 1.0)))
    # Start where ~1.5 k neighbours are expected at the mean density: usually one search suffices.
    radius = max(start_radius, (3.0 * 1.5 * k_eff * volume / (4.0 * math.pi * n)) ** (1.0 / 3.0))
    if not periodic.any():  # beyond the diameter every pair is found: no point searching further
        diameter = float(np.linalg.norm(np.ptp(positions, axis=0)))
        radius = min(radius, diameter + 2.0 * tie_tol + 1e-6)
    while True:
        i, j, S, d = neighbor_pairs(positions, cell, radius, backend, pbc=periodic if cell is not None else None)
        counts = np.bincount(i, minlength=n)
        if counts.min() >= k_eff:
            # Sort by (centre, distance): one stable sort of a float key (vesin lists are grouped by i).
            order = np.argsort(i * (radius * 2.0 + 1.0) + d, kind="stable")
            starts = np.cumsum(counts) - counts
            kth = d[order][starts + k_eff - 1]
            if kth.max() + tie_tol < radius:  # every tie of the k-th distance is in the list
                keep = d <= kth[i] + tie_tol
                return i[keep], j[keep], S[keep], d[keep]
        if radius > MAX_SEARCH_RADIUS:
            raise ValueError(f"fewer than k={k} neighbours within {radius:.1f} Å")
        radius *= 2.0


def directed_edges(i: np.ndarray, j: np.ndarray, S: np.ndarray, symmetric: bool = False
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edges (src, dst, shift) of neighbour pairs: j -> i with shift S; `symmetric` adds every
    reverse i -> j with shift -S (duplicates stay until `unique_edges`)."""
    if not symmetric:
        return j, i, S
    return np.concatenate([j, i]), np.concatenate([i, j]), np.concatenate([S, -S])


def unique_edges(src: np.ndarray, dst: np.ndarray, shift: np.ndarray, num_nodes: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edges without duplicates, sorted by (dst, src, shift): one np.unique over an int64 key."""
    m = int(np.abs(shift).max()) if len(shift) else 0
    base = 2 * m + 1
    s = shift + m
    key = ((dst * num_nodes + src) * base + s[:, 0]) * base * base + s[:, 1] * base + s[:, 2]
    key = np.unique(key)
    s2 = key % base
    key //= base
    s1 = key % base
    key //= base
    s0 = key % base
    key //= base
    return key % num_nodes, key // num_nodes, np.stack([s0, s1, s2], axis=1) - m


def edge_vectors(positions: np.ndarray, cell: np.ndarray | None, graph: Mapping[str, np.ndarray]) -> np.ndarray:
    """[E, 3] vectors from each edge's centre (`edge_dst`) to its neighbour's image (`edge_src`,
    shifted by `edge_shift @ cell`; no shift without a cell)."""
    positions = np.asarray(positions, dtype=np.float64)
    vec = positions[graph["edge_src"]] - positions[graph["edge_dst"]]
    if cell is not None and "edge_shift" in graph:
        vec = vec + np.asarray(graph["edge_shift"], dtype=np.float64) @ np.asarray(cell, dtype=np.float64)
    return vec


def collate_sparse_graphs(rows: Sequence[Mapping[str, Any]], *, size_key: str,
                          node_keys: Mapping[str, Any], edge_keys: Mapping[str, Any] | None = None,
                          graph_keys: Mapping[str, Any] | None = None,
                          index_keys: Sequence[str] = ("edge_src", "edge_dst"),
                          shapes: Mapping[str, tuple[int, ...]] | None = None,
                          num_nodes_key: str = "num_nodes", num_edges_key: str = "num_edges"
                          ) -> dict[str, torch.Tensor]:
    """One sparse batch from per-graph rows (dicts of numpy-convertible arrays).

    `size_key` is a per-node column whose length is the graph's node count. `node_keys` and
    `edge_keys` ({name: numpy dtype}) are concatenated over nodes / edges ([N, ...], [E, ...]),
    `index_keys` (node indices, e.g. edge_src/edge_dst) are concatenated and offset by the nodes of
    the graphs before (Long [E]), `graph_keys` are stacked ([B, ...]). `shapes` gives the trailing
    shape of a column (e.g. {"positions": (3,)}), so that empty rows keep it. Adds `batch` (Long [N],
    the graph of each node), `num_nodes_key` and `num_edges_key` (Long [B]).
    """
    import torch

    shapes = shapes or {}
    num_nodes = np.fromiter((len(r[size_key]) for r in rows), dtype=np.int64, count=len(rows))
    num_edges = np.fromiter((len(r[index_keys[0]]) for r in rows), dtype=np.int64, count=len(rows)) \
        if index_keys else np.zeros(len(rows), dtype=np.int64)
    offsets = np.repeat(np.cumsum(num_nodes) - num_nodes, num_edges)

    out: dict[str, torch.Tensor] = {}
    for key, dtype in node_keys.items():
        out[key] = torch.from_numpy(_concat(rows, key, dtype, shapes.get(key)))
    for key in index_keys:
        out[key] = torch.from_numpy(_concat(rows, key, np.int64, None) + offsets)
    for key, dtype in (edge_keys or {}).items():
        out[key] = torch.from_numpy(_concat(rows, key, dtype, shapes.get(key)))
    for key, dtype in (graph_keys or {}).items():
        stacked = np.asarray([r[key] for r in rows], dtype=dtype)
        shape = shapes.get(key)
        out[key] = torch.from_numpy(stacked.reshape((len(rows),) + tuple(shape)) if shape is not None else stacked)
    out["batch"] = torch.from_numpy(np.repeat(np.arange(len(rows)), num_nodes))
    out[num_nodes_key] = torch.from_numpy(num_nodes)
    out[num_edges_key] = torch.from_numpy(num_edges)
    return out


def _concat(rows: Sequence[Mapping[str, Any]], key: str, dtype: Any, shape: tuple[int, ...] | None) -> np.ndarray:
    """Rows' `key` arrays concatenated in their own dtype, then cast once (casting each part costs more)."""
    parts = [r[key] for r in rows]
    try:
        joined = np.concatenate(parts)
    except ValueError:  # e.g. an empty row stored without its trailing dimensions
        if shape is None:
            raise
        joined = np.concatenate([np.asarray(p).reshape((-1,) + tuple(shape)) for p in parts])
    if shape is not None:
        joined = joined.reshape((-1,) + tuple(shape))
    return np.ascontiguousarray(joined, dtype=dtype)

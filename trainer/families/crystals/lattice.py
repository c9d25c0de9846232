"""ComFormer's three lattice vectors: the ONE rule of the family.

The graph builder uses it for the `use_lattice` self-loops and stores the result with every record
(`lattice_coeffs`); `collate_graphs` puts it in every batch; the model's lattice-aware edge layer
reads it from the batch and computes it with this same function only for a batch that lacks it.
So a model sees the same lattice vectors in training, evaluation and after export.

The rule follows the "lattice correction" of the official code (divelab/AIRS, OpenMat/ComFormer at
commit 949e70b3, `comformer/graphs.py::nearest_neighbor_edges_submit`):

* lat1 is the shortest lattice vector, lat2 the shortest one not collinear with lat1, lat3 the
  shortest one not coplanar with lat1 and lat2;
* lat2 and lat3 are flipped when their angle with lat1 exceeds 90 deg, and all three are negated
  when they are left-handed.

The official code takes them from pymatgen's neighbour order of atom 0's own images, so equal
lengths and exact right angles (cubic, tetragonal, hexagonal, orthorhombic, fcc/bcc primitive
cells) are decided there by enumeration order and floating-point noise. Here ties are broken
deterministically, with relative tolerance `LATTICE_TOL`, by the integer coefficients in the given
basis: among vectors of equal length the lexicographically largest coefficient tuple wins, and an
orthogonal lat2 / lat3 keeps that sign. On cells without ties the result is the official one
(tested against a restatement of the official code); it is exactly rotation and translation
invariant always, and basis independent when the lattice has no ties (docs/families/crystals.md).

Candidates: every lattice vector no longer than the longest cell row (the three successive minima
are never longer, so this set is complete), enumerated in the given basis when that takes few
points, else in a Minkowski-reduced basis (ase), whose coefficients are at most 2 for the short
vectors. Both enumerations contain every vector that can be picked, so they give the same answer.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported where tensors are handled: graph building (shard workers) needs numpy only
    import torch

LATTICE_TOL = 1e-6
"""Relative tolerance of the length ties and of the collinearity / coplanarity / right-angle tests."""

_DIRECT_GRID_MAX = 729
"""Largest coefficient box enumerated directly in the given basis (9^3); bigger ones are reduced first."""
_REDUCED_GRID = np.array([(a, b, c) for a in range(-2, 3) for b in range(-2, 3) for c in range(-2, 3)
                          if (a, b, c) != (0, 0, 0)], dtype=np.int64)


def _cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cross product: np.cross's argument handling dominates on these small arrays, and this is the hot
    path."""
    a0, a1, a2 = a[..., 0], a[..., 1], a[..., 2]
    b0, b1, b2 = b[..., 0], b[..., 1], b[..., 2]
    return np.stack([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], axis=-1)


def _candidates(cell: np.ndarray, tol: float) -> np.ndarray:
    """Integer coefficients (given basis) of a set of lattice vectors holding every one that can be picked."""
    radius = float(np.sqrt((cell * cell).sum(axis=1)).max()) * (1.0 + 4.0 * tol)
    # |n_i| = |v . b_i| <= |v| |b_i| with b_i the reciprocal rows (a_j . b_i = delta_ij)
    recip = np.linalg.inv(cell).T
    bound = np.ceil(radius * np.sqrt((recip * recip).sum(axis=1))).astype(np.int64)
    if int(np.prod(2 * bound + 1)) <= _DIRECT_GRID_MAX:
        axes = [np.arange(-b, b + 1) for b in bound]
        grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 3)
        return grid[np.any(grid != 0, axis=1)]
    from ase.geometry import minkowski_reduce  # ase is a core dependency of the package

    _, op = minkowski_reduce(cell)  # reduced = op @ cell, op unimodular
    return _REDUCED_GRID @ np.asarray(op, dtype=np.int64)


def _lex_max(rows: np.ndarray) -> int:
    """Index of the lexicographically largest integer row."""
    order = np.lexsort(rows.T[::-1])  # ascending by column 0, then 1, then 2
    return int(order[-1])


def canonical_lattice_coeffs(cell: np.ndarray | torch.Tensor, tol: float = LATTICE_TOL) -> np.ndarray:
    """Integer [3, 3] coefficients C (int64) such that the rows of `C @ cell` are lat1, lat2, lat3.

    `cell` rows are the lattice vectors (Å). Raises ValueError for a singular cell.
    """
    torch = sys.modules.get("torch")  # a tensor exists only once torch is loaded: no import for numpy cells
    if torch is not None and isinstance(cell, torch.Tensor):
        cell = cell.detach().to("cpu", torch.float64).numpy()
    cell = np.asarray(cell, dtype=np.float64).reshape(3, 3)
    if not np.isfinite(cell).all() or abs(np.linalg.det(cell)) < 1e-12:
        raise ValueError(f"cell {cell.tolist()} is singular; ComFormer needs a 3D periodic lattice")
    coeffs = _candidates(cell, tol)
    vecs = coeffs.astype(np.float64) @ cell
    length = np.sqrt((vecs * vecs).sum(axis=1))

    def pick(mask: np.ndarray) -> int:
        shortest = length[mask].min()
        tied = np.flatnonzero(mask & (length <= shortest * (1.0 + tol)))
        return int(tied[_lex_max(coeffs[tied])])

    i1 = pick(np.ones(len(vecs), dtype=bool))
    l1 = vecs[i1]
    collinear = np.sqrt((_cross(l1[None, :], vecs) ** 2).sum(axis=1)) <= tol * length[i1] * length
    i2 = pick(~collinear)
    l2 = vecs[i2]
    triple = np.abs(vecs @ _cross(l1, l2))
    i3 = pick(triple > tol * length[i1] * length[i2] * length)

    c1, c2, c3 = coeffs[i1].copy(), coeffs[i2].copy(), coeffs[i3].copy()
    v1, v2, v3 = vecs[i1], vecs[i2], vecs[i3]
    # official: flip lat2 / lat3 when the angle to lat1 is > 90 deg; (near-)orthogonal ones keep the
    # lexicographically largest sign chosen by `pick`, so float noise at 90 deg cannot flip them
    if v1 @ v2 < -tol * length[i1] * length[i2]:
        c2, v2 = -c2, -v2
    if v1 @ v3 < -tol * length[i1] * length[i3]:
        c3, v3 = -c3, -v3
    # official: make the three right-handed by negating all of them
    if _cross(v1, v2) @ v3 < 0:
        c1, c2, c3 = -c1, -c2, -c3
    return np.stack([c1, c2, c3]).astype(np.int64)


def lattice_vectors(cell: np.ndarray, coeffs: np.ndarray | None = None) -> np.ndarray:
    """lat1, lat2, lat3 in Å ([3, 3] rows): `coeffs @ cell` (coeffs: `canonical_lattice_coeffs(cell)` if None)."""
    cell = np.asarray(cell, dtype=np.float64)
    coeffs = canonical_lattice_coeffs(cell) if coeffs is None else np.asarray(coeffs)
    return coeffs.astype(np.float64) @ cell


@functools.lru_cache(maxsize=1 << 16)
def _cached_coeffs(cell_bytes: bytes, tol: float) -> tuple[int, ...]:
    # a batch without `lattice_coeffs` recomputes them every step; cells repeat every epoch
    cell = np.frombuffer(cell_bytes, dtype=np.float64).reshape(3, 3)
    return tuple(int(v) for v in canonical_lattice_coeffs(cell, tol).reshape(-1))


def canonical_lattice(cell: torch.Tensor, tol: float = LATTICE_TOL) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched `canonical_lattice_coeffs` for a [B, 3, 3] (or [3, 3]) tensor: `(coeffs, vectors)`,
    coeffs Long, vectors = coeffs @ cell. Only the integers are found without autograd, so
    `vectors` is differentiable in `cell`."""
    import torch

    single = cell.dim() == 2
    cells = cell.unsqueeze(0) if single else cell
    host = np.ascontiguousarray(cells.detach().to("cpu", torch.float64).numpy())
    coeffs = torch.tensor([_cached_coeffs(c.tobytes(), tol) for c in host], dtype=torch.long).view(-1, 3, 3)
    coeffs = coeffs.to(cell.device)
    vectors = torch.einsum("bij,bjk->bik", coeffs.to(cells.dtype), cells)
    if single:
        return coeffs[0], vectors[0]
    return coeffs, vectors


def lattice_self_loop_shifts(cell: torch.Tensor, tol: float = LATTICE_TOL) -> torch.Tensor:
    """Integer shifts of the official `use_lattice` self-loops, +lat1..3 then -lat1..3: Long [B, 6, 3]
    ([6, 3] for one [3, 3] cell). Each atom gets one edge i -> i per shift."""
    import torch

    coeffs, _ = canonical_lattice(cell, tol)
    return torch.cat([coeffs, -coeffs], dim=-2)

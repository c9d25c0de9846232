"""One lattice rule (trainer/families/crystals/lattice.py): the graph builder's self-loops, the stored
coefficients, every collated batch and the model all see the same three lattice vectors, on the
cells where two rules used to disagree (fcc / bcc primitive, hexagonal, sheared with length ties)
and on random ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ase = pytest.importorskip("ase")
pytest.importorskip("vesin")
from ase.build import bulk  # noqa: E402

from trainer.families.crystals.comformer import build_comformer, comformer_config  # noqa: E402
from trainer.families.crystals.dataset import CrystalRows, build_crystal_dataset, collate_graphs  # noqa: E402
from trainer.families.crystals.graphs import GraphSpec, build_crystal_graph  # noqa: E402
from trainer.families.crystals.lattice import (  # noqa: E402
    canonical_lattice,
    canonical_lattice_coeffs,
    lattice_self_loop_shifts,
)


def _rotation(seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


def crystals() -> dict[str, ase.Atoms]:
    """Cells with length ties and right angles (where the choice among equal vectors matters) and
    random triclinic ones; some rotated, so the cell rows are not axis-aligned."""
    rng = np.random.default_rng(7)
    out = {"fcc primitive": bulk("Cu", "fcc", a=3.6), "bcc primitive": bulk("Fe", "bcc", a=2.87),
           "hexagonal": bulk("Mg", "hcp", a=3.21, c=5.21), "diamond (fcc lattice)": bulk("Si", "diamond", a=5.43)}
    for name, cell in (("sheared, |a2| = |a2 - a1|", [[3.0, 0, 0], [1.5, 3.2, 0], [0.4, 0.3, 6.0]]),
                       ("sheared, 60 deg", [[4.0, 0, 0], [2.0, 3.5, 0], [0, 0, 4.0]])):
        out[name] = ase.Atoms("Si2", cell=cell, scaled_positions=[[0, 0, 0], [0.5, 0.45, 0.5]], pbc=True)
    for k in range(3):
        cell = np.diag(rng.uniform(3.0, 5.0, 3)) + rng.uniform(-1.0, 1.0, (3, 3))
        out[f"random {k}"] = ase.Atoms("SiO", cell=cell, scaled_positions=[[0.1, 0.2, 0.3], [0.6, 0.5, 0.8]], pbc=True)
    for name in ("fcc primitive", "hexagonal"):
        rotated = out[name].copy()
        rotated.set_cell(out[name].cell.array @ _rotation(3).T, scale_atoms=True)
        out[f"{name}, rotated"] = rotated
    return out


CRYSTALS = crystals()


@pytest.mark.parametrize("name", list(CRYSTALS))
def test_graph_loops_stored_coefficients_and_model_agree(name, tmp_path):
    atoms = CRYSTALS[name]
    cell = atoms.cell.array
    coeffs = canonical_lattice_coeffs(cell)
    assert round(abs(np.linalg.det(coeffs))) >= 1  # three independent lattice vectors
    vectors = coeffs @ cell

    # the graph builder: its self-loops are +-lat1..3 of this rule, and it stores the coefficients
    g = build_crystal_graph(atoms.positions, cell, GraphSpec(kind="knn", k=8))
    np.testing.assert_array_equal(g["lattice_coeffs"], coeffs)
    loops = {tuple(s) for s, a, b in zip(g["edge_shift"].tolist(), g["edge_src"], g["edge_dst"]) if a == b == 0}
    assert {tuple(c) for c in np.concatenate([coeffs, -coeffs]).tolist()} <= loops
    np.testing.assert_array_equal(lattice_self_loop_shifts(torch.tensor(cell)).numpy(),
                                  np.concatenate([coeffs, -coeffs]))

    # the dataset and the public collate: every batch carries them, also for rows without them
    ds = build_crystal_dataset([atoms], labels=[1.0], graph=GraphSpec(kind="knn", k=8), cache_dir=tmp_path)
    row = CrystalRows(ds)[0]
    batch = collate_graphs([row])
    assert batch["lattice_coeffs"].dtype == torch.long
    np.testing.assert_array_equal(batch["lattice_coeffs"][0].numpy(), coeffs)
    bare = collate_graphs([{k: v for k, v in row.items() if k != "lattice_coeffs"}])
    assert torch.equal(bare["lattice_coeffs"], batch["lattice_coeffs"])

    # the model: from the batch, and by its own fallback for a batch without coefficients
    model = build_comformer(comformer_config("tiny")).double()
    cell64 = batch["cell"].double()
    from_batch = model.lattice_vectors(cell64, batch)
    without = model.lattice_vectors(cell64, {k: v for k, v in batch.items() if k != "lattice_coeffs"})
    np.testing.assert_allclose(from_batch[0].numpy(), vectors, atol=1e-5)  # the batch cell is float32
    torch.testing.assert_close(without, from_batch, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(canonical_lattice(torch.tensor(cell))[0].numpy(), coeffs)


def test_rotation_rotates_the_lattice_vectors():
    """Tie-breaks go by integer coefficients, never by Cartesian components: a rotated cell gives the
    same coefficients, so the vectors rotate with it (also for cells full of ties)."""
    R = _rotation(11)
    for name, atoms in CRYSTALS.items():
        cell = atoms.cell.array
        np.testing.assert_array_equal(canonical_lattice_coeffs(cell @ R.T), canonical_lattice_coeffs(cell), name)


def test_rule_is_the_shortest_independent_right_handed_triple():
    """lat1 is a shortest lattice vector, lat2 the shortest not collinear, lat3 the shortest not
    coplanar (brute force over a large coefficient box), acute with lat1, right-handed."""
    grid = np.array([(a, b, c) for a in range(-4, 5) for b in range(-4, 5) for c in range(-4, 5)
                     if (a, b, c) != (0, 0, 0)])
    for name, atoms in CRYSTALS.items():
        cell = atoms.cell.array
        v = canonical_lattice_coeffs(cell) @ cell
        all_vecs = grid @ cell
        lengths = np.linalg.norm(all_vecs, axis=1)
        assert np.isclose(np.linalg.norm(v[0]), lengths.min()), name
        not_collinear = np.linalg.norm(np.cross(v[0], all_vecs), axis=1) > 1e-6 * lengths * np.linalg.norm(v[0])
        assert np.isclose(np.linalg.norm(v[1]), lengths[not_collinear].min()), name
        not_coplanar = np.abs(all_vecs @ np.cross(v[0], v[1])) > 1e-6 * lengths * np.linalg.norm(np.cross(v[0], v[1]))
        assert np.isclose(np.linalg.norm(v[2]), lengths[not_coplanar].min()), name
        assert v[0] @ v[1] >= -1e-9 and v[0] @ v[2] >= -1e-9 and np.cross(v[0], v[1]) @ v[2] > 0, name


def test_singular_cell_is_refused():
    with pytest.raises(ValueError, match="singular"):
        canonical_lattice_coeffs(np.array([[1.0, 0, 0], [2.0, 0, 0], [0, 0, 1.0]]))

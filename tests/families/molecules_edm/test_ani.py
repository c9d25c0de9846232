"""The ani1x force field (forcefields/ani.py), its parameters (`trainer data fetch ani1x`), the routing of
molecules it does not model to a fallback (forcefields/routing.py), and what guidance does with it.

Physics: energies and forces equal torchani's own ANI-1x ensemble (loaded by torchani from the fetched
info file), forces are -dE/dx (central differences in float64), rotating / translating a molecule rotates /
leaves its forces, permuting its atoms permutes them, and a molecule's values do not depend on the batch it
is in. Guidance: F molecules take the fallback and are counted per force field, or stay unguided and are
counted without one; `max_uncertainty` skips and counts; `types=forcefield` decodes among H C N O.
The parameters load from a local mirror (no network), a corrupted file is named with the command that repairs
it, and a wrong wheel is refused with both hashes."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("torchani")

from trainer.data import fetch as F  # noqa: E402
from trainer.errors import DataError  # noqa: E402
from trainer.families.molecules_edm.forcefields import build_forcefield, compute_on_device, pad_molecules  # noqa: E402
from trainer.families.molecules_edm.forcefields.routing import RoutedForceField  # noqa: E402
from trainer.families.molecules_edm.forcefields.springs import SpringForceField  # noqa: E402
from trainer.families.molecules_edm.guidance import ForceGuidance, GuidanceConfig  # noqa: E402
from trainer.families.molecules_edm.readers import bundled_qm9_path, read_molecules  # noqa: E402

try:
    F.locate("ani1x")
except DataError as missing:  # make setup fetches them; elsewhere: trainer data fetch ani1x
    pytest.skip(str(missing), allow_module_level=True)

Z = (1, 6, 7, 8, 9)  # QM9's type order: H C N O F


def type_indices(numbers: torch.Tensor) -> torch.Tensor:
    """Atomic numbers [B, N] (0 at padding) -> QM9 type indices (0 at padding)."""
    return torch.as_tensor([[Z.index(int(z)) if z else 0 for z in row] for row in numbers.tolist()])


@pytest.fixture(scope="module")
def qm9():
    molecules, _ = read_molecules(bundled_qm9_path(), elements=None, min_distance=0.0, on_invalid="skip")
    hcno = [m for m in molecules[:80] if set(m.numbers.tolist()) <= {1, 6, 7, 8}]
    with_f = [m for m in molecules[:400] if 9 in m.numbers.tolist()]
    return hcno[:6], with_f[:2]


@pytest.fixture(scope="module")
def ani():
    return build_forcefield("ani1x")


def test_energies_and_forces_equal_torchanis_own_ensemble(ani, qm9, monkeypatch):
    import torchani

    monkeypatch.setenv("TORCHANI_DATA_DIR", str(F.locate("ani1x").parent))  # torchani's layout: <dir>/Neurochem/
    reference = torchani.neurochem.load_model_from_info_file(F.locate("ani1x") / "ani-1x_8x.info")
    molecules, _ = qm9
    result = ani.compute(*pad_molecules(molecules))
    assert result.ok.all() and np.isfinite(result.energy_spread).all() and np.isfinite(result.force_spread).all()
    hartree = 27.211386024367243
    for b, mol in enumerate(molecules[:3]):
        x = torch.tensor(mol.positions, dtype=torch.float32).unsqueeze(0).requires_grad_(True)
        _, energy = reference((torch.tensor(mol.numbers).unsqueeze(0), x))
        forces = -torch.autograd.grad(energy.sum(), x)[0][0].double().numpy() * hartree
        assert result.energy[b] == pytest.approx(float(energy.detach()) * hartree, abs=2e-3)  # fp32 sums of ~1e4 eV
        np.testing.assert_allclose(result.forces[b, :mol.num_atoms], forces, atol=1e-4)
        assert np.all(result.forces[b, mol.num_atoms:] == 0)


def test_forces_are_minus_the_energy_gradient(qm9):
    ani64 = build_forcefield("ani1x", dtype="float64")
    mol = qm9[0][0]
    numbers, positions, mask = pad_molecules([mol])
    forces = ani64.compute(numbers, positions, mask).forces[0]
    h = 1e-4
    for atom, axis in ((0, 0), (1, 2), (mol.num_atoms - 1, 1)):
        plus, minus = positions.copy(), positions.copy()
        plus[0, atom, axis] += h
        minus[0, atom, axis] -= h
        derivative = (ani64.compute(numbers, plus, mask).energy[0] - ani64.compute(numbers, minus, mask).energy[0]) / (2 * h)
        assert -derivative == pytest.approx(forces[atom, axis], abs=1e-5)


def test_forces_rotate_with_the_molecule_and_permute_with_its_atoms(ani, qm9):
    mol = qm9[0][1]
    numbers, positions, mask = pad_molecules([mol])
    base = ani.compute(numbers, positions, mask)
    angle = 0.7
    rotation = np.array([[math.cos(angle), -math.sin(angle), 0], [math.sin(angle), math.cos(angle), 0], [0, 0, 1]])
    moved = positions @ rotation.T + np.array([3.0, -1.0, 2.0])
    turned = ani.compute(numbers, moved, mask)
    np.testing.assert_allclose(turned.forces[0], base.forces[0] @ rotation.T, atol=2e-4)
    assert turned.energy[0] == pytest.approx(base.energy[0], abs=2e-3)
    order = np.random.default_rng(0).permutation(mol.num_atoms)
    permuted = ani.compute(numbers[:, order], positions[:, order], mask[:, order])
    np.testing.assert_allclose(permuted.forces[0], base.forces[0][order], atol=1e-4)
    assert permuted.energy_spread[0] == pytest.approx(base.energy_spread[0], rel=1e-3)


@pytest.mark.numerics
def test_a_molecule_gives_the_same_values_alone_and_in_a_padded_batch(ani, qm9):
    molecules, with_f = qm9
    batch = ani.compute(*pad_molecules([*molecules, with_f[0]], num_atoms=30))
    assert not batch.ok[-1] and "outside ANI-1x" in ani.last_errors[len(molecules)]  # F: not modelled, not an error
    alone = ani.compute(*pad_molecules(molecules[2:3]))
    n = molecules[2].num_atoms
    np.testing.assert_allclose(batch.forces[2, :n], alone.forces[0, :n], atol=1e-5)
    assert batch.energy[2] == pytest.approx(alone.energy[0], abs=1e-3)


def test_fluorine_molecules_take_the_fallback_or_are_counted_unguided(ani, qm9):
    molecules, with_f = qm9
    numbers, positions, mask = (torch.as_tensor(a) for a in pad_molecules([molecules[0], with_f[0], molecules[1]]))
    routed = RoutedForceField(ani, lambda: SpringForceField())
    result = compute_on_device(routed, numbers, positions, mask)
    assert result.ok.tolist() == [True, True, True] and result.source.tolist() == [0, 1, 0]
    assert torch.isnan(result.energy_spread[1]) and not torch.isnan(result.energy_spread[0])
    springs = SpringForceField().compute(*pad_molecules([with_f[0]]))
    np.testing.assert_allclose(result.forces[1, :with_f[0].num_atoms].numpy(), springs.forces[0], atol=1e-12)

    type_index = type_indices(numbers)
    for fallback, expected in ((lambda: SpringForceField(), {"scored_ani1x": 2, "scored_springs": 1, "unsupported": 0}),
                               (None, {"scored_ani1x": 2, "unsupported": 1})):
        guide = ForceGuidance(RoutedForceField(ani, fallback, fallback_name="springs"),
                              GuidanceConfig(scale=0.001), Z)
        moved = guide(positions.clone(), type_index, mask, sigma_t=0.5, step_index=0)
        counters = guide.counters()
        assert {k: counters[k] for k in expected} == expected and counters["failures"] == 0, counters
        assert torch.equal(moved[1], positions[1]) == (fallback is None)  # unguided only without a fallback


def test_uncertainty_gating_skips_and_counts(ani, qm9):
    molecules, _ = qm9
    numbers, positions, mask = (torch.as_tensor(a) for a in pad_molecules(molecules[:3]))
    type_index = type_indices(numbers)
    spread = ani.compute(*pad_molecules(molecules[:3])).energy_spread
    threshold = float(np.sort(spread)[1])  # the molecule with the largest spread is above it
    guide = ForceGuidance(ani, GuidanceConfig(scale=0.001, max_uncertainty=threshold), Z)
    moved = guide(positions.clone(), type_index, mask, sigma_t=0.5, step_index=0)
    worst = int(np.argmax(spread))
    assert guide.counters()["uncertain_skips"] == 1
    assert torch.equal(moved[worst], positions[worst])
    assert all(not torch.equal(moved[b], positions[b]) for b in range(3) if b != worst)
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="ensemble spread"):  # said before any sampling
        ForceGuidance(build_forcefield("ani1x", model_index=0), GuidanceConfig(scale=0.001, max_uncertainty=0.1), Z)


def test_types_forcefield_decodes_among_the_modelled_elements(ani):
    from trainer.families.molecules_edm.diffusion import build_edm_diffusion

    diffusion = build_edm_diffusion(hidden=8, layers=1, timesteps=10)
    guide = ForceGuidance(ani, GuidanceConfig(scale=0.001, types="forcefield"), Z)
    assert guide.decode_among == [0, 1, 2, 3]
    z = torch.zeros(1, 2, 3 + 5 + 1)
    z[0, :, 3 + 4] = 5.0  # F scores highest on both atoms
    z[0, 1, 3 + 2] = 1.0
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert diffusion._decode_types(z, mask).tolist() == [[4, 4]]
    assert diffusion._decode_types(z, mask, guide.decode_among).tolist() == [[0, 2]]


def test_parameters_from_a_local_mirror_are_checked_file_by_file(tmp_path, monkeypatch):
    entry = F.REGISTRY["ani1x"]
    wheel = F.locate("ani1x").parent / entry.wheel  # the cache `make setup` filled holds the wheel
    mirror = tmp_path / "mirror" / "ani1x"
    mirror.mkdir(parents=True)
    shutil.copyfile(wheel, mirror / entry.wheel)
    monkeypatch.setenv(F.MIRROR_ENV, str(tmp_path / "mirror"))
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="trainer data fetch ani1x"):
        F.locate("ani1x", cache)
    root = F.fetch("ani1x", cache=cache)
    assert root == cache / "ani1x" / "Neurochem" and F.locate("ani1x", cache) == root
    assert len(list(root.rglob("*.wparam"))) == 8 * 4 * 4
    (root / "ani-1x_8x" / "train3" / "networks" / "ANN-C.nnf-l2.wparam").write_bytes(b"broken")
    with pytest.raises(DataError, match=r"train3/networks/ANN-C.nnf-l2.wparam .*trainer data fetch ani1x"):
        F.locate("ani1x", cache)
    assert F.fetch("ani1x", cache=cache) == root and F.locate("ani1x", cache) == root  # extracted again
    (mirror / entry.wheel).write_bytes(b"not the wheel")
    other = tmp_path / "other"
    with pytest.raises(DataError, match=f"expected sha256 {entry.sha256}, got [0-9a-f]{{64}}"):
        F.fetch("ani1x", cache=other)
    assert not (other / "ani1x" / "Neurochem").exists() and not (other / "ani1x" / entry.wheel).exists()


def test_evaluation_reports_the_spread_and_counts_molecules_it_does_not_model(ani, qm9, tmp_path):
    from trainer.families.molecules_edm.evaluate import evaluate_file, write_molecules_extxyz

    molecules, with_f = qm9
    path = write_molecules_extxyz([*molecules[:3], *with_f], tmp_path / "mixed.extxyz")
    summary = evaluate_file(path, forcefield=ani)
    assert summary["forcefield_molecules"] == 3 and summary["forcefield_unsupported"] == 2
    assert summary["forcefield_failures"] == 0 and summary["forcefield"] == "ani1x"
    assert 0 < summary["energy_spread_mean"] < 0.05 and 0 < summary["force_spread_mean"] < 1.0  # QM9 minima
    assert 0.1 < summary["force_rms_mean"] < 1.5


def test_nuclear_repulsion_below_the_cutoff_leaves_real_bonds_alone(ani, qm9):
    from trainer.families.molecules_edm.molecule import Molecule

    bare = build_forcefield("ani1x", repulsion_cutoff=0.0)
    molecules, _ = qm9
    np.testing.assert_array_equal(ani.compute(*pad_molecules(molecules)).forces,
                                  bare.compute(*pad_molecules(molecules)).forces)  # every bond is longer than 0.8 Å
    pair = pad_molecules([Molecule(np.array([1, 1]), np.array([[0.0, 0.0, 0.0], [0.3, 0.0, 0.0]]))])
    assert ani.compute(*pair).forces[0, 0, 0] < -50 < bare.compute(*pair).forces[0, 0, 0] < 0  # pushed apart


def test_guidance_pushes_with_one_network_unless_it_needs_the_spread(ani, qm9):
    batch = pad_molecules(qm9[0][:2])
    pusher = ani.for_guidance()
    assert pusher is not ani and pusher.name == "ani1x" and pusher.for_guidance() is pusher
    assert ani.for_guidance(needs_spread=True) is ani and ani.for_guidance() is pusher  # built once
    one = build_forcefield("ani1x", model_index=0).compute(*batch)
    np.testing.assert_array_equal(pusher.compute(*batch).forces, one.forces)
    assert one.energy_spread is None and ani.compute(*batch).energy_spread is not None
    assert build_forcefield("ani1x", guidance_network=None).for_guidance().ensemble


def test_any_mask_and_atoms_too_close(ani, qm9):
    from trainer.families.molecules_edm.molecule import Molecule

    mol = qm9[0][0]
    n = mol.num_atoms
    numbers, positions, mask = pad_molecules([mol], num_atoms=n + 3)
    shifted = (np.roll(numbers, 3, axis=1), np.roll(positions, 3, axis=1), np.roll(mask, 3, axis=1))  # atoms in 3..
    prefix, moved = ani.compute(numbers, positions, mask), ani.compute(*shifted)
    assert moved.ok[0] and moved.energy[0] == pytest.approx(prefix.energy[0], abs=1e-3)
    np.testing.assert_allclose(moved.forces[0, 3:], prefix.forces[0, :n], atol=1e-4)
    clash = pad_molecules([Molecule(np.array([6, 6, 1]), np.array([[0.0, 0, 0], [0.1, 0, 0], [0, 1.1, 0]]))])
    assert not ani.compute(*clash).ok[0] and "closer than 0.25" in ani.last_errors[0]

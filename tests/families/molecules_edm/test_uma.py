"""The `uma:` adapter (forcefields/uma.py) end to end without UMA's weights: a small randomly initialised
UMA-architecture model (fairchem's eSCN-MD backbone and its conservative energy-and-force head for the `omol`
task) written as a fairchem inference checkpoint, loaded by `uma:/path`, evaluated on the batched tensor path.

Checked: the tensor path gives what fairchem's own `AtomicData.from_ase` path gives, forces rotate with the
molecule, any element is modelled (no routing), and guidance pushes through it. Needs `fairchem-core` (a large
install, not a dependency of this package: `pip install fairchem-core`), so it is an `extended` test that is
skipped where fairchem is missing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.extended
pytest.importorskip("fairchem.core")
hydra = pytest.importorskip("hydra")

from trainer.families.molecules_edm.forcefields import build_forcefield, pad_molecules  # noqa: E402
from trainer.families.molecules_edm.guidance import ForceGuidance, GuidanceConfig  # noqa: E402
from trainer.families.molecules_edm.readers import bundled_qm9_path, read_molecules  # noqa: E402


def write_tiny_uma_checkpoint(path) -> None:
    """A fairchem inference checkpoint of a tiny random UMA-architecture model (no trained weights)."""
    from fairchem.core.units.mlip_unit.api.inference import MLIPInferenceCheckpoint

    backbone = dict(model="fairchem.core.models.uma.escn_md.eSCNMDBackbone", max_num_elements=100, sphere_channels=8,
                    lmax=2, mmax=2, otf_graph=True, max_neighbors=30, cutoff=6.0, edge_channels=8,
                    num_distance_basis=16, direct_forces=False, regress_forces=True, regress_stress=False,
                    num_layers=1, hidden_channels=8, norm_type="rms_norm_sh", act_type="gate", ff_type="grid",
                    dataset_mapping={"omol": "omol"}, always_use_pbc=False)
    head = {"module": "fairchem.core.models.uma.escn_moe.DatasetSpecificSingleHeadWrapper",
            "head_cls": "fairchem.core.models.uma.escn_md.MLP_EFS_Head", "head_kwargs": {"wrap_property": False},
            "dataset_names": ["omol"]}
    model_config = {"_target_": "fairchem.core.models.base.HydraModel", "backbone": backbone,
                    "heads": {"energyandforcehead": head}, "pass_through_head_outputs": True,
                    "supports_single_atoms": True}
    normalizer = {"_target_": "fairchem.core.modules.normalization.normalizer.Normalizer", "mean": 0.0, "rmsd": 1.0}
    tasks = [{"_target_": "fairchem.core.units.mlip_unit.mlip_unit.Task", "name": f"omol_{prop}", "level": level,
              "property": prop, "out_spec": {"dim": [dim], "dtype": "float32"}, "normalizer": normalizer,
              "datasets": ["omol"]} for prop, level, dim in (("energy", "system", 1), ("forces", "atom", 3))]
    torch.manual_seed(0)
    model = hydra.utils.instantiate(model_config)
    ema = torch.optim.swa_utils.AveragedModel(model)
    torch.save(MLIPInferenceCheckpoint(model_config=model_config, model_state_dict=model.state_dict(),
                                       ema_state_dict=ema.state_dict(), tasks_config=tasks), path)


@pytest.fixture(scope="module")
def uma(tmp_path_factory):
    path = tmp_path_factory.mktemp("uma") / "tiny_uma.pt"
    write_tiny_uma_checkpoint(path)
    return build_forcefield(f"uma:{path}", device="cpu")


@pytest.fixture(scope="module")
def molecules():
    found, _ = read_molecules(bundled_qm9_path(), elements=None, min_distance=0.0, on_invalid="skip")
    return found[:3] + [m for m in found[:400] if 9 in m.numbers.tolist()][:1]


def test_tensor_path_equals_fairchems_own_atoms_path(uma, molecules):
    import ase
    from fairchem.core.datasets import data_list_collater
    from fairchem.core.datasets.atomic_data import AtomicData

    result = uma.compute(*pad_molecules(molecules))
    assert result.ok.all(), uma.last_errors  # F too: UMA models every element
    data = []
    for mol in molecules:
        item = AtomicData.from_ase(ase.Atoms(numbers=mol.numbers, positions=mol.positions), r_edges=False,
                                   task_name="omol", r_data_keys=["spin", "charge"])
        item.charge, item.spin = torch.tensor([0]), torch.tensor([1])
        data.append(item)
    reference = uma.predictor.predict(data_list_collater(data, otf_graph=True))
    np.testing.assert_allclose(result.energy, reference["energy"].detach().double().numpy(), rtol=1e-6)
    start = 0
    for b, mol in enumerate(molecules):
        forces = reference["forces"].detach().double().numpy()[start:start + mol.num_atoms]
        start += mol.num_atoms
        np.testing.assert_allclose(result.forces[b, :mol.num_atoms], forces, atol=1e-6)


def test_forces_rotate_with_the_molecule(uma, molecules):
    numbers, positions, mask = pad_molecules(molecules[:1])
    angle = 1.1
    rotation = np.array([[1, 0, 0], [0, math.cos(angle), -math.sin(angle)], [0, math.sin(angle), math.cos(angle)]])
    base, turned = uma.compute(numbers, positions, mask), uma.compute(numbers, positions @ rotation.T + 2.0, mask)
    scale = np.abs(base.forces).max()
    np.testing.assert_allclose(turned.forces[0], base.forces[0] @ rotation.T, atol=1e-3 * scale)
    assert turned.energy[0] == pytest.approx(base.energy[0], rel=1e-5)


def test_guidance_pushes_through_the_tensor_path(uma, molecules):
    numbers, positions, mask = (torch.as_tensor(a) for a in pad_molecules(molecules))
    z = (1, 6, 7, 8, 9)
    types = torch.as_tensor([[z.index(int(v)) if v else 0 for v in row] for row in numbers.tolist()])
    guide = ForceGuidance(uma, GuidanceConfig(scale=0.01), z)
    moved = guide(positions.clone(), types, mask, sigma_t=0.5, step_index=0)
    assert guide.counters()["force_evaluations"] == len(molecules) and guide.counters()["failures"] == 0
    assert all(not torch.equal(moved[b], positions[b]) for b in range(len(molecules)))

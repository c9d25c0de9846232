"""Batched force fields (trainer/families/molecules_edm/forcefields): units, padding, failures, pool, ASE, UMA.

The unit check uses a value published by tblite itself: its Python test `test_gfn2` gives the GFN2-xTB
total energy of a 22-atom alanine dipeptide conformer ("xac", positions in Bohr) at accuracy 1 as
-32.97134042392298 Hartree (tblite/tblite, python/tblite/test_interface.py). Forces are checked against
central finite differences of our own energies, so eV/Angstrom follows from eV and Angstrom.
"""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("tblite")
from ase import Atoms  # noqa: E402
from ase.build import molecule  # noqa: E402
from ase.calculators.emt import EMT  # noqa: E402

from trainer.errors import ConfigError, DataError  # noqa: E402
from trainer.families.molecules_edm.forcefields import (  # noqa: E402
    FORCEFIELD_CHOICES,
    build_forcefield,
    pad_molecules,
    scoring_forcefield,
    validate_batch,
)
from trainer.families.molecules_edm.forcefields.ase_calculator import ASECalculatorForceField  # noqa: E402
from trainer.families.molecules_edm.forcefields.base import ForceField  # noqa: E402
from trainer.families.molecules_edm.forcefields.xtb import XTBForceField, default_workers  # noqa: E402
from trainer.families.molecules_edm.molecule import Molecule  # noqa: E402

BOHR_ANGSTROM = 0.529177210903  # CODATA 2018, written out so the test does not reuse the code's constant
HARTREE_EV = 27.211386245988

ALA_NUMBERS = [7, 1, 6, 1, 6, 6, 1, 1, 1, 8, 6, 6, 1, 1, 1, 8, 7, 1, 6, 1, 1, 1]
ALA_XAC_BOHR = [
    [+0.89812994422336, -3.49785066920537, -4.04176475935607], [+0.22096411844816, -4.86653879303702, -5.16965309356488],
    [+1.50858972981055, -4.22297129418255, -1.44296740345170], [+1.26381263207546, -6.26173130725955, -1.36929929792062],
    [+4.22584479532188, -3.58094126128602, -0.72765628187693], [-0.36535595783691, -3.23105046121391, +0.53224473210756],
    [+4.59700287054853, -4.26587358691560, +1.17638157393339], [+5.53245639246579, -4.49962127256050, -2.02509339376622],
    [+4.54878065243139, -1.55600067058432, -0.78659473595735], [-1.40338188617737, -4.70093312894944, +1.99692732352687],
    [+1.19184541389054, -1.17965860262351, -5.08564964981169], [+0.66646223547991, -1.02784609220985, -7.88469520699739],
    [+2.46126071643208, -0.84993899853549, -8.87377461956087], [-0.42509529147581, +0.67053350705954, -8.25313731918547],
    [-0.33603421332938, -2.66534515804911, -8.61567815458241], [+1.87087395689416, +0.69377329947433, -3.88238849685894],
    [-0.66896549096126, -0.70041907517856, +0.57158466492815], [+0.24390855421877, +0.32329261951026, -0.76688726802653],
    [-2.34873581523733, +0.49815011834652, +2.36364902826355], [-2.51669513442034, -0.71675917183750, +4.00880640863199],
    [-1.57466603805426, +2.31572781563081, +2.92500014923521], [-4.23036142386086, +0.78917833057040, +1.57683879578790],
]
ALA_XAC_ENERGY_HARTREE = -32.97134042392298


def _mol(name: str, jitter: float = 0.0, seed: int = 0) -> Molecule:
    atoms = molecule(name)
    positions = atoms.positions + np.random.default_rng(seed).normal(scale=jitter, size=atoms.positions.shape)
    return Molecule(atoms.numbers, positions)


def _single(ff: ForceField, m: Molecule):
    return ff.compute(m.numbers[None], m.positions[None], np.ones((1, m.num_atoms), bool))


@pytest.fixture(scope="module")
def xtb() -> XTBForceField:
    ff = XTBForceField(workers=1)
    yield ff
    ff.close()


def test_gfn2_energy_matches_tblite_published_value(xtb):
    positions = np.asarray(ALA_XAC_BOHR) * BOHR_ANGSTROM
    result = xtb.compute(np.asarray([ALA_NUMBERS]), positions[None], np.ones((1, 22), bool))
    assert result.ok.tolist() == [True]
    assert result.energy[0] == pytest.approx(ALA_XAC_ENERGY_HARTREE * HARTREE_EV, abs=2e-4)  # -897.2 eV
    assert xtb.name == "gfn2-xtb" and isinstance(xtb, ForceField)


def test_gfn2_forces_are_minus_the_energy_gradient_in_ev_per_angstrom():
    ff = XTBForceField(workers=1, accuracy=0.01)  # tight SCF: smooth energies for finite differences
    water = _mol("H2O", jitter=0.08, seed=1)
    h = 1e-4
    displaced = []
    for i in range(3):
        for k in range(3):
            for sign in (1, -1):
                x = water.positions.copy()
                x[i, k] += sign * h
                displaced.append(x)
    positions = np.stack([water.positions, *displaced])
    numbers = np.repeat(water.numbers[None], len(positions), axis=0)
    result = ff.compute(numbers, positions, np.ones(numbers.shape, bool))
    assert result.ok.all()
    energy_plus, energy_minus = result.energy[1::2].reshape(3, 3), result.energy[2::2].reshape(3, 3)
    finite_difference = -(energy_plus - energy_minus) / (2 * h)
    assert np.abs(result.forces[0]).max() > 0.5  # a distorted geometry: the check is not 0 == 0
    np.testing.assert_allclose(result.forces[0], finite_difference, atol=2e-3)
    np.testing.assert_allclose(result.forces[0].sum(axis=0), 0.0, atol=1e-6)  # no net force


def test_padded_batch_equals_single_molecules_and_padding_is_ignored(xtb):
    molecules = [_mol("H2O", 0.05, 2), _mol("CH4", 0.05, 3), _mol("CH3", 0.0)]  # CH3: odd electron count
    numbers, positions, mask = pad_molecules(molecules, num_atoms=7)
    numbers[~mask] = 6  # garbage at padding must not matter
    positions[~mask] = 123.0
    batch = xtb.compute(numbers, positions, mask)
    assert batch.ok.all() and batch.forces.shape == (3, 7, 3)
    assert np.all(batch.forces[~mask] == 0)
    for b, m in enumerate(molecules):
        single = _single(xtb, m)
        assert batch.energy[b] == pytest.approx(single.energy[0], abs=1e-9)
        np.testing.assert_allclose(batch.forces[b, : m.num_atoms], single.forces[0], atol=1e-9)


def test_coincident_atoms_fail_only_that_molecule(xtb):
    broken = _mol("H2O")
    broken.positions[1] = broken.positions[0]
    molecules = [_mol("NH3", 0.03, 4), broken, _mol("CH4")]
    result = xtb.compute(*pad_molecules(molecules))
    assert result.ok.tolist() == [True, False, True]
    assert np.isnan(result.energy[1]) and np.all(result.forces[1] == 0)
    assert np.isfinite(result.energy[[0, 2]]).all()
    assert set(xtb.last_errors) == {1} and "close" in xtb.last_errors[1].lower()
    assert result.energy[2] == pytest.approx(_single(xtb, molecules[2]).energy[0], abs=1e-9)
    ghost = _mol("H2O")
    ghost.numbers[0] = 0  # tblite itself would accept Z = 0 as a ghost atom
    assert not _single(xtb, ghost).ok[0] and "1-86" in xtb.last_errors[0]


def test_pool_of_two_workers_gives_the_same_numbers_as_one_and_survives_a_dead_worker(xtb, caplog):
    broken = _mol("CH4")
    broken.positions[2] = broken.positions[1]
    molecules = [_mol(name, 0.04, seed) for seed, name in enumerate(["H2O", "CH4", "NH3", "HCN", "C2H4"])] + [broken]
    batch = pad_molecules(molecules)
    pooled = XTBForceField(workers=2)
    try:
        parallel = pooled.compute(*batch)
        processes = list(pooled._pool._processes.values())
        assert len(processes) == 2  # both workers were started before the first batch
        processes[0].kill()  # a worker dying (as a crash in native code would) between batches
        processes[0].join(timeout=30)
        with caplog.at_level("WARNING"):
            recovered = pooled.compute(*batch)  # the lost work is redone in a restarted pool
        assert "worker process died" in caplog.text
        guided = pooled.for_guidance()  # the guidance ladder in the pool: wavefunctions travel with the rows
        guided_parallel = [guided.compute(*batch) for _ in range(2)]
    finally:
        pooled.close()
        pooled.close()  # idempotent
    guided_in_process = xtb.for_guidance()  # keeps tblite's result objects, the pool their saved form: same numbers
    for result in guided_parallel:
        expected = guided_in_process.compute(*batch)
        assert result.rung.tolist() == expected.rung.tolist() == [0] * 5 + [-1]
        np.testing.assert_allclose(result.energy, expected.energy, rtol=0, atol=1e-10, equal_nan=True)
        np.testing.assert_allclose(result.forces, expected.forces, rtol=0, atol=1e-10)
    assert isinstance(guided._rows[0].restart, dict) and not isinstance(guided_in_process._rows[0].restart, dict)
    serial = xtb.compute(*batch)
    assert parallel.ok.tolist() == [True] * 5 + [False]
    for result in (parallel, recovered):
        np.testing.assert_array_equal(result.ok, serial.ok)
        np.testing.assert_allclose(result.energy, serial.energy, rtol=0, atol=1e-10, equal_nan=True)
        np.testing.assert_allclose(result.forces, serial.forces, rtol=0, atol=1e-10)


# C, N and 3 H placed at random (min distance 0.8 A): tblite's default electronic temperature (9.5e-4 Eh)
# oscillates past 250 SCF cycles, 0.01 Eh converges in a few (found by a seeded search).
DISTORTED_NUMBERS = [6, 7, 1, 1, 1]
DISTORTED = [[-0.709, -1.205, -0.375], [-0.256, 1.237, 0.451], [-0.322, -1.025, -1.35], [-0.327, -0.267, 0.994],
             [0.716, 1.334, 0.802]]


def test_guidance_ladder_converges_where_the_strict_single_point_fails():
    # max_iterations=60 keeps the strict failure fast; the default (250) fails the same way, 20x slower
    ff = XTBForceField(workers=1, max_iterations=60, guidance_probe_every=2)
    assert XTBForceField(workers=1).max_iterations == 250 and ff.guidance_temperatures[0] == 9.5e-4
    water = _mol("H2O", 0.05, 7)
    batch = pad_molecules([Molecule(np.array(DISTORTED_NUMBERS), np.array(DISTORTED)), water])
    strict = ff.compute(*batch)  # the evaluation's single point: no ladder, failures reported
    assert strict.ok.tolist() == [False, True] and strict.rung is None
    assert "converge" in ff.last_errors[0].lower()

    guidance = ff.for_guidance()
    assert guidance.rung_labels == ["etemp_0.00095", "etemp_0.01", "etemp_0.03"]
    first = guidance.compute(*batch)
    assert first.ok.tolist() == [True, True] and first.rung.tolist() == [1, 0]  # one rung up; water on the default
    assert np.isfinite(first.forces).all() and np.abs(first.forces[0]).max() > 0.1
    # the default rung is the strict single point (same temperature, converged within the cap) to guidance's
    # looser SCF thresholds (accuracy 10); at tblite's accuracy 1 it is the strict one to 1e-6 eV
    assert first.energy[1] == pytest.approx(strict.energy[1], abs=1e-3)
    np.testing.assert_allclose(first.forces[1], strict.forces[1], atol=2e-2)
    tight = XTBForceField(workers=1, guidance_accuracy=1.0).for_guidance().compute(*batch)
    assert tight.energy[1] == pytest.approx(strict.energy[1], abs=1e-6)
    np.testing.assert_allclose(tight.forces[1], strict.forces[1], atol=1e-4)
    # next steps: the distorted molecule starts on its rung (sticky), warm-started from its own wavefunction;
    # on its second step there it probes the default again, which converges from the 0.01 Eh wavefunction
    rungs = [guidance.compute(*batch).rung.tolist() for _ in range(3)]
    assert rungs == [[1, 0], [0, 0], [0, 0]]
    cold = XTBForceField(workers=1, guidance_probe_every=2, guidance_warm_start=False).for_guidance()
    assert [cold.compute(*batch).rung.tolist() for _ in range(3)] == [[1, 0]] * 3  # cold probes fail
    hot = XTBForceField(workers=1, guidance_temperatures=[0.01, 0.03]).for_guidance().compute(*batch)
    assert hot.rung.tolist() == [0, 0] and hot.energy[0] == pytest.approx(first.energy[0], abs=1e-5)
    for bad in ([], [0.03, 0.01], [0.0], "0.01"):
        with pytest.raises(ConfigError, match="guidance_temperatures"):
            XTBForceField(workers=1, guidance_temperatures=bad)
    with pytest.raises(ConfigError, match="guidance_accuracy must be a positive number"):
        XTBForceField(workers=1, guidance_accuracy=0)


def test_guidance_ladder_fails_fast_and_only_that_molecule():
    broken = _mol("H2O")
    broken.positions[1] = broken.positions[0]  # coincident atoms: no temperature helps
    ff = XTBForceField(workers=1)
    guidance = ff.for_guidance()
    result = guidance.compute(*pad_molecules([broken, _mol("CH4")]))
    assert result.ok.tolist() == [False, True] and result.rung.tolist() == [-1, 0]
    assert set(guidance.last_errors) == {0} and np.all(result.forces[0] == 0)


def test_default_workers_is_this_ranks_share_of_cores(monkeypatch):
    cores = len(__import__("os").sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_workers() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 4))
    assert default_workers() == 1
    with pytest.raises(ConfigError, match="workers"):
        XTBForceField(workers=0)


def test_ase_adapter_matches_the_calculator_called_directly():
    molecules = [_mol("CH4", 0.05, 5), _mol("H2O", 0.05, 6), _mol("CH4", 0.05, 5)]  # a repeat: no stale cache
    ff = build_forcefield("ase:ase.calculators.emt.EMT")
    assert isinstance(ff, ASECalculatorForceField) and ff.name == "ase:EMT"
    result = ff.compute(*pad_molecules(molecules))
    boxed = build_forcefield("ase:ase.calculators.emt.EMT", cell=25.0).compute(*pad_molecules(molecules))
    assert result.ok.all() and boxed.ok.all()
    for b, m in enumerate(molecules):
        atoms = Atoms(numbers=m.numbers, positions=m.positions)
        atoms.calc = EMT()
        assert result.energy[b] == pytest.approx(atoms.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(result.forces[b, : m.num_atoms], atoms.get_forces(), atol=1e-10)
        # EMT's cutoff is far below 25 Angstrom: the centred box changes nothing
        assert boxed.energy[b] == pytest.approx(result.energy[b], abs=1e-8)
        np.testing.assert_allclose(boxed.forces[b], result.forces[b], atol=1e-8)


def test_ase_adapter_missing_package_names_what_to_install():
    with pytest.raises(ConfigError, match=r"pip install no-such-ff-package"):
        build_forcefield("ase:no_such_ff_package.calculator.Calc")
    with pytest.raises(ConfigError, match="dotted import path"):
        build_forcefield("ase:EMT")
    with pytest.raises(ConfigError, match="cannot build"):
        build_forcefield("ase:fractions.Fraction", not_an_option=1)
    with pytest.raises(ConfigError, match="not an ASE calculator"):
        build_forcefield("ase:fractions.Fraction")


def test_uma_without_fairchem_fails_at_once_naming_package_and_checkpoint(monkeypatch):
    if "fairchem" not in sys.modules:
        monkeypatch.setitem(sys.modules, "fairchem", None)  # as if not installed, even where it is
    with pytest.raises(ConfigError) as info:
        build_forcefield("uma:uma-s-1p1")
    assert "pip install fairchem-core" in str(info.value) and "checkpoint" in str(info.value)


FAKE_FAIRCHEM = {
    "fairchem/__init__.py": "",
    "fairchem/core/__init__.py": "",
    "fairchem/core/units/__init__.py": "",
    "fairchem/core/units/mlip_unit/__init__.py": "",
    "fairchem/core/units/mlip_unit/api/__init__.py": "",
    "fairchem/core/units/mlip_unit/api/inference.py": """
        from dataclasses import dataclass
        @dataclass
        class InferenceSettings:
            tf32: bool = False
            merge_mole: bool = False
            compile: bool = False
            external_graph_gen: bool | None = None
    """,
    "fairchem/core/calculate/__init__.py": "",
    "fairchem/core/calculate/pretrained_mlip.py": """
        import torch
        available_models = ("uma-s-1p1",)
        class LocalEntryNotFoundError(Exception):
            pass
        def get_predict_unit(name, inference_settings=None, device=None):
            raise LocalEntryNotFoundError("offline and not in the cache")
        class Unit:  # energy = sum_i Z_i |x_i|^2 / 2 (charge 0, spin 1 required), forces = -Z_i x_i
            def predict(self, data):
                assert data.charge.tolist() == [0] * data.num and data.spin.tolist() == [1] * data.num
                energy = torch.zeros(data.num, dtype=torch.float64).index_add(
                    0, data.batch, 0.5 * data.z * (data.pos ** 2).sum(1))
                return {"energy": energy, "forces": -data.z[:, None] * data.pos}
        def load_predict_unit(path, inference_settings=None, device=None):
            assert inference_settings.merge_mole is False
            return Unit()
    """,
    "fairchem/core/datasets/atomic_data.py": """
        import torch
        class AtomicData:  # the constructor's keywords, as fairchem's AtomicData takes them
            def __init__(self, pos, atomic_numbers, cell, pbc, natoms, edge_index, cell_offsets, nedges, charge,
                         spin, fixed, tags, sid=None, dataset=None):
                assert dataset == "omol" and not pbc.any() and edge_index.shape == (2, 0)
                assert int(natoms) == len(atomic_numbers) == len(pos) and pos.dtype == torch.float32
                self.z = atomic_numbers.to(torch.float64)
                self.pos = pos.to(torch.float64)
                self.charge, self.spin = charge, spin
    """,
    "fairchem/core/datasets/__init__.py": """
        import torch
        from types import SimpleNamespace
        def data_list_collater(items, otf_graph=False):
            assert otf_graph
            batch = torch.cat([torch.full((len(d.z),), k) for k, d in enumerate(items)])
            return SimpleNamespace(num=len(items), batch=batch, z=torch.cat([d.z for d in items]),
                                   pos=torch.cat([d.pos for d in items]), charge=torch.cat([d.charge for d in items]),
                                   spin=torch.cat([d.spin for d in items]))
    """,
}


def test_uma_adapter_batches_through_fairchems_collater(tmp_path, monkeypatch):
    """Against a stand-in fairchem (the real one is not installed here): the batch bookkeeping, charge/spin
    and the offline error, on an analytic model whose forces are known."""
    pytest.importorskip("torch")
    for relative, text in FAKE_FAIRCHEM.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(textwrap.dedent(text))
    for name in [m for m in sys.modules if m == "fairchem" or m.startswith("fairchem.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    checkpoint = tmp_path / "uma-s-1p1.pt"
    checkpoint.write_bytes(b"stand-in")
    try:
        with pytest.raises(ConfigError, match="not available offline") as info:
            build_forcefield("uma:uma-s-1p1", device="cpu")
        assert "hub cache" in str(info.value) and "checkpoint" in str(info.value)
        with pytest.raises(ConfigError, match="neither a checkpoint file nor"):
            build_forcefield("uma:uma-xl-9", device="cpu")
        ff = build_forcefield(f"uma:{checkpoint}", device="cpu")
        molecules = [_mol("H2O", 0.1, 7), Molecule([1], [[0.0, 0.0, 0.0]]), _mol("CH4", 0.1, 8)]
        numbers, positions, mask = pad_molecules(molecules)
        result = ff.compute(numbers, positions, mask)
    finally:
        for name in [m for m in sys.modules if m == "fairchem" or m.startswith("fairchem.")]:
            del sys.modules[name]
    assert ff.name == "uma:uma-s-1p1"
    assert result.ok.tolist() == [True, False, True]  # a lone atom is not UMA's business
    for b in (0, 2):
        z, x = numbers[b, mask[b]], positions[b, mask[b]]
        assert result.energy[b] == pytest.approx(0.5 * (z * (x**2).sum(1)).sum(), rel=1e-6)  # positions in fp32
        np.testing.assert_allclose(result.forces[b, mask[b]], -z[:, None] * x, rtol=1e-6, atol=1e-7)
    assert np.all(result.forces[~mask] == 0)


def test_build_forcefield_specs_and_unknown_spec_lists_choices():
    with pytest.raises(ConfigError) as info:
        build_forcefield("gfn3")
    for choice in ("gfn2", "gfn1", "ase:", "uma:", "springs", "none"):
        assert choice in str(info.value)
    assert "gfn2" in FORCEFIELD_CHOICES
    assert build_forcefield("none") is None
    gfn1 = build_forcefield("GFN1-xTB", workers=1)
    assert gfn1.name == "gfn1-xtb" and gfn1.method == "GFN1-xTB"
    assert build_forcefield("gfn2-xtb", workers=1).name == "gfn2-xtb"
    springs = build_forcefield("springs")
    assert type(springs).__name__ == "SpringForceField" and isinstance(springs, ForceField)


def test_the_force_field_behind_a_source_code_routed_or_not():
    """`scoring_forcefield` names who scored a molecule from its result's `source`: a routed force field's primary
    (0) or fallback (1, built on that first need), nobody (-1); a plain force field scores everything itself."""
    import torch

    from trainer.families.molecules_edm.forcefields.routing import RoutedForceField
    from trainer.families.molecules_edm.forcefields.springs import SpringForceField

    primary = SpringForceField()
    primary.supported_numbers = frozenset({1, 6})
    built: list[SpringForceField] = []

    def make() -> SpringForceField:
        built.append(SpringForceField(stiffness=5.0))
        return built[-1]

    routed = RoutedForceField(primary, make, fallback_name="soft")
    numbers, positions, mask = pad_molecules([Molecule(np.array([6, 1]), np.array([[0, 0, 0], [1.1, 0, 0]])),
                                              Molecule(np.array([8, 1]), np.array([[0, 0, 0], [0.97, 0, 0]]))])
    result = routed.compute_tensors(torch.as_tensor(numbers), torch.as_tensor(positions), torch.as_tensor(mask))
    assert result.source.tolist() == [0, 1]
    assert scoring_forcefield(routed, 0) is primary and routed.scorer(0) is primary
    assert scoring_forcefield(routed, 1) is built[0] and len(built) == 1
    assert routed.scorer(-1) is None
    with pytest.raises(ValueError, match="source code 2"):
        routed.scorer(2)
    assert scoring_forcefield(primary, 0) is primary
    lazy = RoutedForceField(primary, make)
    assert lazy.scorer(0) is primary and len(built) == 1  # the primary's code never builds the fallback
    assert RoutedForceField(primary, None).scorer(1) is None


def test_sevennet_through_the_ase_adapter_where_installed():
    """SevenNet-0 (weights in the sevenn wheel, offline) equals its calculator called directly; NaN at
    coincident atoms becomes ok False. Skipped where sevenn is not installed (benchmarks/forcefields.py
    reports it from a separate environment)."""
    pytest.importorskip("sevenn")
    from sevenn.calculator import SevenNetCalculator

    water = _mol("H2O", 0.05, 9)
    broken = _mol("H2O")
    broken.positions[1] = broken.positions[0]
    ff = build_forcefield("ase:sevenn.calculator.SevenNetCalculator", model="7net-0", device="cpu")
    result = ff.compute(*pad_molecules([water, broken]))
    atoms = Atoms(numbers=water.numbers, positions=water.positions)
    atoms.calc = SevenNetCalculator(model="7net-0", device="cpu")
    assert result.ok.tolist() == [True, False]
    assert result.energy[0] == pytest.approx(atoms.get_potential_energy(), abs=1e-6)
    np.testing.assert_allclose(result.forces[0], atoms.get_forces(), atol=1e-6)


def test_pad_molecules_and_shape_checks():
    numbers, positions, mask = pad_molecules([_mol("H2O"), _mol("C2H6")])
    assert numbers.shape == (2, 8) and positions.shape == (2, 8, 3) and mask.sum(1).tolist() == [3, 8]
    assert numbers.dtype == np.int64 and np.all(numbers[0, 3:] == 0) and np.all(positions[0, 3:] == 0)
    with pytest.raises(DataError, match="molecule 1 has 8 atoms"):
        pad_molecules([_mol("H2O"), _mol("C2H6")], num_atoms=5)
    with pytest.raises(DataError, match="positions"):
        validate_batch(numbers, positions[:, :, :2], mask, name="test")

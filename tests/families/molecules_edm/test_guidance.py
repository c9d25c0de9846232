"""Force-field guidance (trainer/families/molecules_edm/guidance.py) and the spring test force field
(forcefields/springs.py): springs' energy and forces (finite differences), the guidance rule against a hand
computation (threshold, (1 - sigma_t) scaling, iterations, force and displacement clips, re-centring), a
failing molecule left unguided and counted, scale 0.0 equal to the baseline bit for bit, guided sampling
lowering the spring energy of the final samples against the paired baseline, and GFN2-xTB guidance counting the
rung of its temperature ladder each force came from (and the failures) as a set's summary reports them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.families.molecules_edm.diffusion import EDMDiffusion, build_edm_diffusion, polynomial_gamma
from trainer.families.molecules_edm.forcefields.base import ForceField, ForceResult
from trainer.families.molecules_edm.forcefields.springs import SpringForceField
from trainer.families.molecules_edm.guidance import ForceGuidance, GuidanceConfig

Z = (1, 6, 7, 8, 9)
SEED_RULE = {"displacement_clip": None, "hh_distance": None}
"""The seed's rule (no displacement clip, no H-H floor): what the hand computations below follow."""


class FixedForces:
    """A force field returning given forces (eV/A) and ok flags, and counting its calls."""

    name = "fixed"

    def __init__(self, forces: np.ndarray, ok: np.ndarray | None = None) -> None:
        self.forces, self.ok, self.calls = forces, ok, 0

    def compute(self, numbers, positions, mask) -> ForceResult:
        self.calls += 1
        ok = np.ones(len(numbers), dtype=bool) if self.ok is None else self.ok
        forces = np.where(ok[:, None, None] & mask[:, :, None], self.forces, 0.0)
        return ForceResult(np.zeros(len(numbers)), forces, ok)

    def close(self) -> None:
        pass


class FailsOnFirst(SpringForceField):
    """Springs, but molecule 0 of every batch fails (ok False), as an unphysical molecule would."""

    def compute(self, numbers, positions, mask) -> ForceResult:
        result = super().compute(numbers, positions, mask)
        result.ok[0], result.energy[0], result.forces[0] = False, np.nan, 0.0
        return result


class GaussianOracle(nn.Module):
    """The exact eps-predictor for data x ~ N(0, c^2 I) (zero CoM) and h ~ N(0, c_h^2 I): sensible geometry."""

    num_features = 6

    def __init__(self, T: int, c: float = 0.8, c_h: float = 0.3) -> None:
        super().__init__()
        self.T, self.c, self.c_h = T, c, c_h
        self.register_buffer("gamma", polynomial_gamma(T))

    def forward(self, x, h, t, node_mask):
        g = self.gamma[torch.round(torch.as_tensor(t) * self.T).long()].reshape(-1, 1, 1)
        a2, s2 = torch.sigmoid(-g), torch.sigmoid(g)
        m = node_mask.float().unsqueeze(-1)
        eps_x = s2.sqrt() * x / (a2 * self.c ** 2 + s2)
        eps_h = s2.sqrt() * h / (a2 * self.c_h ** 2 + s2)
        return eps_x * m, eps_h * m


def _positions(seed: int = 0, sizes=(4, 3)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nodes = max(sizes)
    mask = torch.arange(nodes).unsqueeze(0) < torch.tensor(sizes).unsqueeze(1)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(sizes), nodes, 3, generator=gen, dtype=torch.float64) * 0.9 * mask.unsqueeze(-1)
    x = x - x.sum(1, keepdim=True) / mask.sum(1).reshape(-1, 1, 1) * mask.unsqueeze(-1)
    types = torch.randint(0, 2, (len(sizes), nodes), generator=gen) * mask
    return x, types, mask


def _centre(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[..., None]
    return (x - (x * m).sum(1, keepdims=True) / m.sum(1, keepdims=True)) * m


def test_springs_energy_and_forces() -> None:
    ff = SpringForceField(stiffness=10.0, cutoff=2.0)
    assert isinstance(ff, ForceField)
    numbers = np.array([[1, 1, 0]])
    positions = np.array([[[0.0, 0, 0], [1.0, 0, 0], [9.0, 9, 9]]])
    result = ff.compute(numbers, positions, np.array([[True, True, False]]))
    assert result.ok[0] and result.energy[0] == pytest.approx(0.5 * 10.0 * (1.0 - 0.74) ** 2)
    # the stretched H-H spring pulls the atoms together; padding gets no force
    np.testing.assert_allclose(result.forces[0], [[10 * 0.26, 0, 0], [-10 * 0.26, 0, 0], [0, 0, 0]])

    x, types, mask = _positions(1, sizes=(5, 4))
    numbers = np.where(mask.numpy(), np.asarray(Z)[types.numpy()], 0)
    pos = x.numpy()
    base = ff.compute(numbers, pos, mask.numpy())
    assert base.ok.all() and (base.energy > 0).all()
    step = 1e-6
    for b, i, d in ((0, 2, 1), (1, 0, 2), (0, 4, 0)):
        plus, minus = pos.copy(), pos.copy()
        plus[b, i, d] += step
        minus[b, i, d] -= step
        grad = (ff.compute(numbers, plus, mask.numpy()).energy[b] - ff.compute(numbers, minus, mask.numpy()).energy[b])
        assert base.forces[b, i, d] == pytest.approx(-grad / (2 * step), rel=1e-5, abs=1e-6)

    unknown = ff.compute(np.array([[1, 17]]), np.array([[[0.0, 0, 0], [1.2, 0, 0]]]), np.ones((1, 2), bool))
    assert not unknown.ok[0] and np.isnan(unknown.energy[0]) and (unknown.forces == 0).all()


def test_guidance_step_matches_hand_computation() -> None:
    x, types, mask = _positions(2)
    forces = np.random.default_rng(0).normal(size=(2, 4, 3)) * 3.0
    ff = FixedForces(forces)
    sigma_t, scale, iterations = 0.3, 0.01, 2
    hook = ForceGuidance(ff, GuidanceConfig(scale=scale, iterations=iterations, **SEED_RULE), Z)
    out = hook(x, types, mask, sigma_t, 5)
    m = mask.numpy()
    expected = x.numpy()
    for _ in range(iterations):  # fixed forces: each iteration moves by (scale / iterations) (1 - sigma_t) F
        expected = _centre(expected + scale / iterations * (1 - sigma_t) * forces * m[..., None], m)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-12)
    assert hook.counters()["steps_guided"] == 1 and hook.force_evaluations == 4 and ff.calls == 2
    assert hook.failures == 0 and hook.forcefield_seconds >= 0

    # not guided: above the threshold, or scale 0 -> the very same tensor, no force-field call
    assert hook(x, types, mask, 0.81, 6) is x
    zero = ForceGuidance(ff, GuidanceConfig(scale=0.0), Z)
    assert zero(x, types, mask, 0.1, 7) is x
    assert ff.calls == 2 and hook.steps_guided == 1


def test_force_and_displacement_clips() -> None:
    x, types, mask = _positions(3)
    forces = np.zeros((2, 4, 3))
    forces[0, 1] = [30.0, 40.0, 0.0]  # norm 50
    forces[1, 2] = [0.0, 0.3, 0.4]  # norm 0.5, under both clips
    m = mask.numpy()
    sigma_t = 0.5

    out = ForceGuidance(FixedForces(forces), GuidanceConfig(scale=0.1, force_clip=5.0, **SEED_RULE), Z)(
        x, types, mask, sigma_t, 0)
    clipped = forces.copy()
    clipped[0, 1] *= 5.0 / 50.0
    np.testing.assert_allclose(out.numpy(), _centre(x.numpy() + 0.1 * 0.5 * clipped, m), atol=1e-12)

    out = ForceGuidance(FixedForces(forces), GuidanceConfig(scale=0.1, displacement_clip=0.2, hh_distance=None), Z)(
        x, types, mask, sigma_t, 0)
    disp = 0.1 * 0.5 * forces
    disp[0, 1] *= 0.2 / np.linalg.norm(disp[0, 1])  # 2.5 A -> 0.2 A
    np.testing.assert_allclose(out.numpy(), _centre(x.numpy() + disp, m), atol=1e-12)
    # before re-centring the clipped atom moved exactly 0.2 A relative to the others' common shift
    moved = out.numpy() - x.numpy()
    assert np.linalg.norm(moved[0, 1] - moved[0, 0]) == pytest.approx(0.2)

    for bad in ({"scale": -1.0}, {"scale": 0.1, "iterations": 0}, {"scale": 0.1, "force_clip": 0.0}):
        with pytest.raises(ConfigError):
            GuidanceConfig(**bad)


def test_failed_molecule_is_left_unguided_and_counted() -> None:
    x, types, mask = _positions(4)
    forces = np.random.default_rng(1).normal(size=(2, 4, 3))
    hook = ForceGuidance(FixedForces(forces, ok=np.array([False, True])), GuidanceConfig(scale=0.1, iterations=3), Z)
    out = hook(x, types, mask, 0.2, 0)
    assert torch.equal(out[0], x[0])
    assert not torch.allclose(out[1], x[1])
    assert hook.failures == 3 and hook.force_evaluations == 6


def _model(T: int) -> EDMDiffusion:
    torch.manual_seed(0)
    return build_edm_diffusion(hidden=16, layers=2, timesteps=T)


@pytest.mark.numerics
def test_scale_zero_equals_baseline_bit_for_bit() -> None:
    model = _model(10)
    num_atoms, seeds = [4, 6, 5], [31, 32, 33]
    base = model.sample(num_atoms, [torch.Generator().manual_seed(s) for s in seeds], chain_frames=3, chain_for=1)
    hook = ForceGuidance(SpringForceField(), GuidanceConfig(scale=0.0), model.atomic_numbers_of_types)
    zero = model.sample(num_atoms, [torch.Generator().manual_seed(s) for s in seeds], guidance=hook,
                        chain_frames=3, chain_for=1)
    for name in ("positions", "type_index", "atomic_numbers", "charges", "node_mask"):
        assert torch.equal(getattr(base, name), getattr(zero, name)), name
    assert all(torch.equal(a.positions, b.positions) for a, b in zip(base.chains[0], zero.chains[0]))
    assert hook.steps_guided == 0 and hook.force_evaluations == 0


def test_failing_forcefield_in_sampler_completes_and_counts() -> None:
    T = 10
    model = _model(T)
    hook = ForceGuidance(FailsOnFirst(), GuidanceConfig(scale=0.01, iterations=2), model.atomic_numbers_of_types)
    steps: list[int] = []  # the progress bar's hook: once per denoising step, guidance included
    out = model.sample([4, 5], [torch.Generator().manual_seed(s) for s in (1, 2)], guidance=hook, on_step=steps.append)
    assert torch.isfinite(out.positions).all() and steps == list(range(1, T + 1))
    guided_steps = int((model.sigma_at(torch.arange(1, T + 1)) <= 0.8).sum())
    assert hook.steps_guided == guided_steps > 0
    assert hook.failures == 2 * guided_steps and hook.force_evaluations == 2 * 2 * guided_steps


def _spring_energy(ff: SpringForceField, out) -> np.ndarray:
    result = ff.compute(out.atomic_numbers.numpy(), out.positions.double().numpy(), out.node_mask.numpy())
    assert result.ok.all()
    return result.energy


def test_guidance_lowers_spring_energy_against_paired_baseline() -> None:
    T = 40
    model = EDMDiffusion(GaussianOracle(T), timesteps=T)
    num_atoms, seeds = [5, 6, 7, 5, 6, 7], [41, 42, 43, 44, 45, 46]
    ff = SpringForceField(stiffness=10.0, cutoff=2.0)
    base = model.sample(num_atoms, [torch.Generator().manual_seed(s) for s in seeds])
    # the springs' H-H rest length is H2's, below the default H-H floor: the seed's rule
    hook = ForceGuidance(ff, GuidanceConfig(scale=0.02, iterations=2, **SEED_RULE), model.atomic_numbers_of_types)
    guided = model.sample(num_atoms, [torch.Generator().manual_seed(s) for s in seeds], guidance=hook)
    e_base, e_guided = _spring_energy(ff, base), _spring_energy(ff, guided)
    assert e_base.min() > 0.5  # the baseline geometries are strained: the test has something to relax
    assert e_guided.sum() < 0.5 * e_base.sum()
    assert (e_guided < e_base).sum() >= 5
    assert torch.equal(base.type_index, guided.type_index)  # positions-only guidance; paired h streams
    assert hook.failures == 0 and hook.steps_guided == int((model.sigma_at(torch.arange(1, T + 1)) <= 0.8).sum())
    assert math.isfinite(hook.forcefield_seconds)


def test_guidance_counts_each_rung_and_the_failures():
    pytest.importorskip("tblite")
    from ase.build import molecule
    from test_forcefields import DISTORTED, DISTORTED_NUMBERS

    from trainer.families.molecules_edm.forcefields import pad_molecules
    from trainer.families.molecules_edm.forcefields.xtb import XTBForceField
    from trainer.families.molecules_edm.molecule import Molecule
    from trainer.families.molecules_edm.sampling_report import guidance_summary

    broken, methane = molecule("H2O"), molecule("CH4")
    broken.positions[1] = broken.positions[0]  # coincident atoms: every rung fails
    numbers, positions, mask = pad_molecules([Molecule(np.array(DISTORTED_NUMBERS), np.array(DISTORTED)),
                                              Molecule(methane.numbers, methane.positions),
                                              Molecule(broken.numbers, broken.positions)])
    types = torch.as_tensor(np.searchsorted([1, 6, 7, 8, 9], numbers) * mask)  # QM9's type order H C N O F
    hook = ForceGuidance(XTBForceField(workers=1), GuidanceConfig(scale=0.001), (1, 6, 7, 8, 9))
    x = torch.as_tensor(positions)
    for step in range(2):
        x = hook(x, types, torch.as_tensor(mask), 0.5, step)
    counters = hook.counters()
    assert counters["force_evaluations"] == 6 and counters["failures"] == 2
    assert (counters["evaluations_etemp_0.00095"], counters["evaluations_etemp_0.01"],
            counters["evaluations_etemp_0.03"]) == (2, 2, 0)
    assert torch.equal(x[2], torch.as_tensor(positions[2]))  # the failed molecule is left unguided
    row = {"set": "guided_scale_0.001", "guidance_force_evaluations": 6, "guidance_failures": 2,
           "guidance_evaluations_per_second": 40.0, "guidance_forcefield_share": 0.9,
           **{f"guidance_{k}": v for k, v in counters.items() if k.startswith("evaluations_")}}
    line = guidance_summary(row)
    assert "etemp_0.00095 2, etemp_0.01 2, etemp_0.03 0" in line and "failed 2 (33.33 %" in line


class HCNOOnly(FixedForces):
    """A force field that models H C N O only (as ANI-1x), routed to a named fallback."""

    name = "hcno+fallback"
    names = ["hcno", "fallback"]
    supported_numbers = (1, 6, 7, 8)


def test_default_types_give_a_partial_force_field_its_own_types_and_say_so() -> None:
    from trainer.families.molecules_edm.guidance import evaluations_line
    from trainer.families.molecules_edm.spec import MoleculeSampleConfig

    assert GuidanceConfig(scale=0.001).types == MoleculeSampleConfig().guidance.types == "auto"
    partial = HCNOOnly(np.zeros((1, 2, 3)))
    auto = ForceGuidance(partial, GuidanceConfig(scale=0.001), Z)
    assert auto.decode_among == [0, 1, 2, 3]  # F never decoded for the force field: no molecule needs the fallback
    assert ForceGuidance(partial, GuidanceConfig(scale=0.001, types="argmax"), Z).decode_among is None
    assert ForceGuidance(FixedForces(np.zeros((1, 2, 3))), GuidanceConfig(scale=0.001), Z).decode_among is None
    line = evaluations_line(20224, partial, "auto", Z)
    assert line.startswith("20,224 hcno force evaluations") and "guidance.types=auto" in line and "not F" in line
    argmax = evaluations_line(20224, partial, "argmax", Z)
    assert "by hcno" in argmax and "by fallback" in argmax
    assert evaluations_line(7, FixedForces(np.zeros((1, 2, 3))), "auto", Z) == "7 fixed force evaluations"
    with pytest.raises(ConfigError, match="auto"):
        GuidanceConfig(scale=0.001, types="all")


class PullTogether:
    """A force field pulling atoms 0 and 1 of every molecule towards each other with `strength` eV/A, however close
    (an attraction with no repulsion: what lets strong guidance collapse a pair)."""

    name = "pull"

    def __init__(self, strength: float = 50.0) -> None:
        self.strength = strength

    def compute(self, numbers, positions, mask) -> ForceResult:
        forces = np.zeros_like(positions)
        bond = positions[:, 1] - positions[:, 0]
        unit = bond / np.maximum(np.linalg.norm(bond, axis=-1, keepdims=True), 1e-12)
        forces[:, 0], forces[:, 1] = self.strength * unit, -self.strength * unit
        return ForceResult(np.zeros(len(numbers)), forces, np.ones(len(numbers), dtype=bool))

    def close(self) -> None:
        pass


def test_step_bound_caps_each_atoms_move_at_a_multiple_of_sigma() -> None:
    x, types, mask = _positions(3)
    forces = np.zeros((2, 4, 3))
    forces[0, 1] = [30.0, 40.0, 0.0]  # a 50 eV/A push: 0.1 x 0.7 x 50 = 3.5 A unbounded
    sigma_t = 0.3
    out = ForceGuidance(FixedForces(forces), GuidanceConfig(scale=0.1, iterations=2, step_bound=0.1, **SEED_RULE), Z)(
        x, types, mask, sigma_t, 0)
    moved = out.numpy() - x.numpy()
    # two iterations of 0.1 x 0.3 / 2 A each along the force: the step's move is 0.03 A
    np.testing.assert_allclose(moved[0, 1] - moved[0, 0], 0.03 * forces[0, 1] / 50.0, atol=1e-12)
    np.testing.assert_allclose(out.numpy()[1], x.numpy()[1], atol=1e-12)  # no force, no move

    # in the sampler, under a force no bound would tame: no atom moves more than the bound per step, plus the
    # re-centring's shift (the mean of bounded moves, itself within the bound)
    model = _model(20)
    seen: list[tuple[float, float]] = []
    hook = ForceGuidance(FixedForces(np.random.default_rng(2).normal(size=(2, 5, 3)) * 100.0),
                         GuidanceConfig(scale=0.05, step_bound=0.1, **SEED_RULE),
                         model.atomic_numbers_of_types)

    def watch(positions, type_index, node_mask, sigma_t, step_index):
        out = hook(positions, type_index, node_mask, sigma_t, step_index)
        seen.append((float(torch.linalg.vector_norm(out - positions, dim=-1).max()), sigma_t))
        return out

    model.sample([4, 5], [torch.Generator().manual_seed(s) for s in (3, 4)], guidance=watch)
    guided = [(move, sigma) for move, sigma in seen if sigma <= 0.8]
    assert guided and all(move <= 2 * 0.1 * sigma * (1 + 1e-5) for move, sigma in guided)
    assert max(move / sigma for move, sigma in guided) > 0.1  # the force is strong enough to reach the bound


@pytest.mark.parametrize("push", [False, True])
def test_attracted_hydrogens_stop_at_the_floor(push: bool) -> None:
    floor = 1.4
    types = torch.tensor([[0, 0, 1]])  # H H C in QM9's type order
    mask = torch.ones(1, 3, dtype=torch.bool)
    x = torch.tensor([[[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]], dtype=torch.float64)
    hook = ForceGuidance(PullTogether(), GuidanceConfig(scale=0.01, displacement_clip=None, hh_distance=floor,
                                                            floor_push=push), Z)
    distances = []
    for step in range(40):  # 0.01 x 0.9 x 50 = 0.45 A per step towards each other
        x = hook(x, types, mask, 0.1, step)
        distances.append(float(torch.linalg.vector_norm(x[0, 1] - x[0, 0])))
    assert min(distances) >= floor * (1 - 1e-9) and distances[-1] == pytest.approx(floor)
    assert float(torch.linalg.vector_norm(x[0, 2] - x[0, 0])) > 1.0  # the bystander carbon is not dragged along

    # a pair already below the floor: never pushed closer (hold), or pushed out to it (push)
    close = torch.tensor([[[-0.3, 0.0, 0.0], [0.3, 0.0, 0.0], [0.0, 2.0, 0.0]]], dtype=torch.float64)
    out = hook(close, types, mask, 0.1, 0)
    gap = float(torch.linalg.vector_norm(out[0, 1] - out[0, 0]))
    assert gap == pytest.approx(floor if push else 0.6)


def test_floor_is_per_pair_and_off_without_a_setting() -> None:
    types = torch.tensor([[1, 0, 1]])  # C H C: the H-H floor does not hold a C-H pair
    mask = torch.ones(1, 3, dtype=torch.bool)
    x = torch.tensor([[[-0.6, 0.0, 0.0], [0.6, 0.0, 0.0], [0.0, 3.0, 0.0]]], dtype=torch.float64)
    out = ForceGuidance(PullTogether(), GuidanceConfig(scale=0.01, displacement_clip=None, hh_distance=1.4), Z)(
        x, types, mask, 0.1, 0)
    assert float(torch.linalg.vector_norm(out[0, 1] - out[0, 0])) < 1.0
    out = ForceGuidance(PullTogether(), GuidanceConfig(scale=0.01, displacement_clip=None, hh_distance=None, min_distance=1.0,
                                                         floor_push=False), Z)(
        x, types, mask, 0.1, 0)
    assert float(torch.linalg.vector_norm(out[0, 1] - out[0, 0])) == pytest.approx(1.0)  # pulled from 1.2 to the floor


def test_default_rule_clips_each_push_and_keeps_hydrogens_apart() -> None:
    from trainer.families.molecules_edm.spec import MoleculeSampleConfig

    cfg, options = GuidanceConfig(scale=0.008), MoleculeSampleConfig().guidance
    assert (cfg.displacement_clip, cfg.hh_distance, cfg.floor_push) == (
        options.displacement_clip, options.hh_distance, options.floor_push) == (0.005, 1.4, True)
    types = torch.tensor([[0, 0, 1]])  # H H C
    mask = torch.ones(1, 3, dtype=torch.bool)
    x = torch.tensor([[[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]], dtype=torch.float64)
    hook = ForceGuidance(PullTogether(strength=500.0), cfg, Z)  # unclipped: 0.008 x 0.9 x 500 = 3.6 A per step
    for step in range(150):
        out = hook(x, types, mask, 0.1, step)
        gap = float(torch.linalg.vector_norm(out[0, 1] - out[0, 0]))
        assert float(torch.linalg.vector_norm(x[0, 1] - x[0, 0])) - gap <= 2 * 0.005 + 1e-12  # 0.005 A each
        assert gap >= 1.4 * (1 - 1e-9)
        x = out
    assert gap == pytest.approx(1.4)

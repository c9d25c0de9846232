"""Parity of our molecules EDM (EGNN dynamics + l2 diffusion loss) with the reference implementation.

From the golden files (tests/families/molecules_edm/golden, written by scripts/parity/edm.py from the
reference checkout) without the reference; and live against a checkout named by TRAINER_REFERENCE_EDM.
"""

from __future__ import annotations

import pytest
import torch
from parity_support import assert_ten_steps_fail, live_parity_tests, parity_fixtures

from trainer.families.molecules_edm.reference import (
    REFERENCE_BUFFER,
    REFERENCE_GAMMA,
    from_reference_state_dict,
    reference_state_dict,
)

parity, golden, ten_step_golden = parity_fixtures("edm", __file__)


@pytest.mark.numerics
def test_golden_parity(parity, golden):
    """Our EDM, loaded from the reference's randomised weights through the key map, gives the reference's float64
    dynamics forward (eval, train) and gradients, its per-molecule l2 loss (t = 0 included), gradients and the
    parameters after one SGD and one Adam step, within the tolerances."""
    state, inputs, ref, meta = golden
    assert meta["reference"]["license"] == "MIT" and len(meta["reference"]["commit"]) == 40
    assert REFERENCE_GAMMA in state and REFERENCE_BUFFER in state  # the reference's own layout
    assert any(".e_block_1.gcl_1." in k for k in state) and 0 in meta["t_int"]
    ours = parity.ours_outputs(state, inputs, config=meta["config"])
    assert ours["round_trip"]
    assert parity.compare(ours, ref) == []


@pytest.mark.numerics
def test_golden_parity_detects_a_changed_model(parity, golden):
    """The comparison is not vacuous: one weight moved by 1e-3 fails the float64 forward and the gradients, and
    the loss taken without its t = 0 term (the l2 branch everywhere) fails the loss."""
    state, inputs, ref, meta = golden
    key = "dynamics.egnn.e_block_1.gcl_0.node_mlp.2.weight"
    moved = dict(state)
    moved[key] = state[key].clone()
    moved[key][0, 0] += 1e-3
    failures = parity.compare(parity.ours_outputs(moved, inputs, config=meta["config"]), ref)
    assert any(f.startswith("dynamics forward (eval") for f in failures), failures
    assert any(f.startswith("dynamics gradient") for f in failures), failures

    shifted = {**inputs, "t_int": inputs["t_int"].clamp(min=1)}
    failures = parity.compare(parity.ours_outputs(state, shifted, config=meta["config"]), ref)
    assert any(f.startswith("loss per molecule") for f in failures), failures


def test_key_map_round_trip_and_errors(golden):
    state = golden[0]
    ours = from_reference_state_dict(state)
    assert set(ours) == {"gamma"} | {k for k in ours if k.startswith("dynamics.egnn.")}
    assert "dynamics.egnn.blocks.1.gcls.1.edge_mlp.0.weight" in ours
    assert "dynamics.egnn.blocks.0.equivariant.coord_mlp.4.weight" in ours
    back = reference_state_dict({f"module.{k}": v for k, v in ours.items()})
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)

    # A dynamics-only state dict (EGNN_dynamics_QM9) maps the same way, without schedule or buffer.
    dyn = {k.removeprefix("dynamics."): v for k, v in state.items() if k.startswith("dynamics.")}
    dyn_ours = from_reference_state_dict(dyn)
    assert "egnn.blocks.0.gcls.0.att_mlp.0.weight" in dyn_ours
    assert reference_state_dict(dyn_ours).keys() == dyn.keys()

    with pytest.raises(ValueError, match=r"ckpt\.npy: field 'buffer'"):
        from_reference_state_dict({**state, REFERENCE_BUFFER: torch.ones(1)}, source="ckpt.npy")
    learned = {k: v for k, v in state.items() if k != REFERENCE_GAMMA}
    learned["gamma.l1.weight"] = torch.zeros(1, 1)
    with pytest.raises(ValueError, match=r"ckpt\.npy: fields \['gamma\.l1\.weight'\] are a learned noise schedule"):
        from_reference_state_dict(learned, source="ckpt.npy")
    with pytest.raises(ValueError, match="not an EDM state dict"):
        reference_state_dict({"linear.weight": torch.zeros(1)})


def test_our_model_loads_the_golden_weights_strictly(parity, golden):
    """The mapped reference weights fill our EDMDiffusion exactly (no missing or unexpected keys), and our freshly
    built noise schedule is the reference's, bit for bit."""
    state, _, _, meta = golden
    model = parity.build_ours(meta["config"])
    fresh_gamma = model.gamma.clone()
    model.load_state_dict(from_reference_state_dict(state), strict=True)
    assert torch.equal(fresh_gamma, state[REFERENCE_GAMMA])


@pytest.mark.numerics
@pytest.mark.usefixtures("fresh_accelerate")
def test_ten_paper_steps_equal_the_references(parity, ten_step_golden):
    """Ten optimizer steps of `task.preset=paper` by our loop's step (Trainer.train_step) equal ten steps of the
    reference's loop body with its own AdamW(amsgrad), adaptive gradient clipping and EMA: loss, gradient norm,
    weights, EMA and the clipping queue."""
    state, inputs, ref, meta = ten_step_golden
    assert meta["reference"]["license"] == "MIT" and meta["overrides"] == parity.TEN_OVERRIDES
    ours = parity.ours_ten_steps(state, inputs, meta["config"])
    o, t = ours["cfg"].optim, ours["cfg"].train
    assert o.amsgrad and o.decay_all_parameters and t.grad_clip_mode == "adaptive" and t.ema_warmup == "none"
    assert parity.compare_ten_steps(ours, ref) == []
    # the clipping acted: the first step's norm is far above 1.5 x the queue's seed
    assert ref["grad_norms"][0] > 10 * 1.5 * meta["ten_steps"]["clip_initial"]


@pytest.mark.numerics
@pytest.mark.parametrize(("default", "fails"), [("train.grad_clip_mode=norm", "ten steps: params"),
                                                ("train.ema_warmup=standard", "ten steps: ema")])
def test_ten_steps_tell_each_rule_of_the_recipe(parity, ten_step_golden, default, fails, fresh_accelerate):
    """The clipping and EMA rules the paper preset sets matter: our default in their place fails the comparison.
    (AMSGrad's running maximum differs from Adam only once a gradient falls far below its history, which ten steps
    do not reach; tests/core/test_reference_recipes.py checks it against torch's AdamW(amsgrad=True).)"""
    assert_ten_steps_fail(parity, ten_step_golden, fails, default)


test_live_parity_with_reference, test_live_ten_steps_with_reference = live_parity_tests(
    "edm", __file__, "TRAINER_REFERENCE_EDM", "ehoogeboom/e3_diffusion_for_molecules",
    parity_passed="parity: state dict round trip exact",
    ten_steps_passed="ten steps: loss, gradient norms, weights and EMA within tolerance")

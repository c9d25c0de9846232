"""Parity of our perturbation GEARS (model + loss) with the reference implementation (snap-stanford/GEARS).

From the golden files (tests/families/perturbation_gears/golden, written by scripts/parity/gears.py from the
reference checkout) without the reference; and live against a checkout named by TRAINER_REFERENCE_GEARS.
"""

from __future__ import annotations

import pytest
import torch
from parity_support import assert_ten_steps_fail, live_parity_tests, parity_fixtures

from trainer.families.perturbation_gears import model as gears_model
from trainer.families.perturbation_gears.reference import (
    from_reference_state_dict,
    reference_graphs,
    reference_state_dict,
)

parity, golden, ten_step_golden = parity_fixtures("gears", __file__)


def _graphs(inputs):
    return ((inputs["coexpress_edge_index"], inputs["coexpress_edge_weight"]),
            (inputs["go_edge_index"], inputs["go_edge_weight"]))


@pytest.mark.numerics
def test_golden_parity(parity, golden):
    """Our GEARSModel (first-cell-only co-expression), loaded from the reference's randomised weights through the
    key map, gives the reference's forward in eval and train mode and the state after each (renormalised
    embedding rows, BatchNorm statistics), its loss_fct value, gradients, the parameters after one SGD and one
    Adam step, its float64 forward and gradients, and with the uncertainty head its float64 forward, log-variance,
    uncertainty_loss_fct value and gradients, within the tolerances."""
    state, inputs, ref, meta = golden
    assert meta["reference"]["license"] == "MIT" and len(meta["reference"]["commit"]) == 40
    assert "pert_w.weight" in state and "bn_pert_base_trans.running_var" in state  # the reference's own layout
    # The lookups renormalised some embedding rows (the forward changed the weights) and BatchNorm counted a batch.
    assert not torch.equal(ref["state_eval"]["gene_emb.weight"], state["gene_emb.weight"])
    assert ref["state_train"]["bn_emb.num_batches_tracked"] == state["bn_emb.num_batches_tracked"] + 1
    ours = parity.ours_outputs(state, inputs, config=meta["config"])
    assert ours["round_trip"]
    assert parity.compare(ours, ref) == []


@pytest.mark.numerics
def test_golden_parity_detects_a_changed_model(parity, golden, monkeypatch):
    """The comparison is not vacuous: one weight moved by 1e-3, a positional weight of 0.21 instead of GEARS'
    0.2, our default co-expression on every cell, the loss without its direction term, or another weight of the
    uncertainty term each fail it."""
    state, inputs, ref, meta = golden
    moved = dict(state)
    moved["recovery_w.network.3.weight"] = state["recovery_w.network.3.weight"].clone()
    moved["recovery_w.network.3.weight"][0, 0] += 1e-3
    failures = parity.compare(parity.ours_outputs(moved, inputs, config=meta["config"]), ref)
    assert any(f.startswith("forward (train)") for f in failures), failures
    assert any(f.startswith("gradient (float64)") for f in failures), failures

    every_cell = parity.compare(parity.ours_outputs(state, inputs, config=meta["config"],
                                                    coexpress_first_cell_only=False), ref)
    assert any(f.startswith("forward (train)") for f in every_cell), every_cell

    no_direction = parity.compare(parity.ours_outputs(state, inputs, config={**meta["config"],
                                                                            "direction_lambda": 0.0}), ref)
    assert any(f.startswith("loss:") for f in no_direction), no_direction

    other_reg = parity.compare(parity.ours_outputs(state, inputs, config={**meta["config"], "uncertainty_reg": 0.5}),
                               ref)
    assert any(f.startswith("uncertainty head: loss") for f in other_reg), other_reg
    assert any(f.startswith("uncertainty head: gradient (float64) uncertainty_w.") for f in other_reg), other_reg

    monkeypatch.setattr(gears_model, "POSITIONAL_WEIGHT", 0.21)
    changed = parity.compare(parity.ours_outputs(state, inputs, config=meta["config"]), ref)
    assert any(f.startswith("forward (eval)") for f in changed), changed


def test_key_map_round_trip_and_errors(golden):
    state, inputs = golden[0], golden[1]
    coexpress, go = _graphs(inputs)
    ours = from_reference_state_dict({f"module.{k}": v for k, v in state.items()}, coexpress, go)
    assert not any(k.startswith(("pert_w.", "bn_pert_base_trans.")) for k in ours)
    assert torch.equal(ours["go_edge_weight"], inputs["go_edge_weight"])
    back = reference_state_dict(ours)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert torch.equal(reference_graphs(ours)["G_coexpress"], inputs["coexpress_edge_index"])

    with pytest.raises(ValueError, match=r"model\.pt: .*missing keys \['sim_layers\.1\.lin\.bias'\]"):
        from_reference_state_dict({k: v for k, v in state.items() if k != "sim_layers.1.lin.bias"}, coexpress, go,
                                  source="model.pt")
    wrong = {**state, "indv_w2": torch.zeros(1, 12, 5)}
    with pytest.raises(ValueError, match=r"model\.pt: .*shapes differ: indv_w2: \(1, 12, 5\), expected \(1, 12, 9\)"):
        from_reference_state_dict(wrong, coexpress, go, source="model.pt")
    with pytest.raises(ValueError, match=r"unexpected keys \['extra\.weight'\]"):
        from_reference_state_dict({**state, "extra.weight": torch.zeros(1)}, coexpress, go)
    with pytest.raises(ValueError, match="already our layout"):
        from_reference_state_dict(ours, coexpress, go)
    with pytest.raises(ValueError, match=r"go graph indexes nodes outside \[0, 8\)"):
        from_reference_state_dict(state, coexpress, (go[0] + 8, go[1]))
    with pytest.raises(ValueError, match="not a GEARS state dict"):
        from_reference_state_dict({"linear.weight": torch.zeros(1)}, coexpress, go)
    with pytest.raises(ValueError, match="not a GEARSModel state dict"):
        reference_state_dict(state)


def test_our_model_loads_the_golden_weights_strictly(parity, golden):
    """The mapped reference weights and graphs fill our GEARSModel exactly (no missing or unexpected keys), and a
    reference layout with the uncertainty head maps too."""
    state, inputs, _, meta = golden
    model = parity.build_ours(inputs, meta["config"])
    model.load_state_dict(from_reference_state_dict(state, *_graphs(inputs)), strict=True)
    assert torch.equal(model.indv_w1, state["indv_w1"])

    from trainer.families.perturbation_gears.model import GEARSModel

    with_head = GEARSModel(12, 8, _graphs(inputs)[0], _graphs(inputs)[1], hidden_size=8, uncertainty=True)
    ref_layout = reference_state_dict(with_head.state_dict())
    assert "uncertainty_w.network.6.weight" in ref_layout and "pert_w.bias" in ref_layout
    with_head.load_state_dict(from_reference_state_dict(ref_layout, *_graphs(inputs)), strict=True)


@pytest.mark.numerics
@pytest.mark.usefixtures("fresh_accelerate")
def test_ten_paper_steps_equal_the_references(parity, ten_step_golden):
    """Ten optimizer steps of `task.preset=paper` by our loop's step (Trainer.train_step, float64) equal ten steps
    of GEARS' train() body (Adam with weight decay on every parameter, loss_fct with its direction term,
    clip_grad_value_(1.0), StepLR(1, 0.5) per epoch) over two epochs: loss, lr, gradient norm per step, and the
    whole state after the ten steps (weights, renormalised embeddings, BatchNorm statistics)."""
    state, inputs, ref, meta = ten_step_golden
    assert meta["reference"]["license"] == "MIT" and meta["overrides"] == parity.TEN_OVERRIDES
    ours = parity.ours_ten_steps(state, inputs, meta["config"])
    o, t = ours["cfg"].optim, ours["cfg"].train
    assert o.name == "adam" and o.decay_all_parameters and o.scheduler == "step"
    assert t.grad_clip_value == 1.0 and t.grad_clip_norm == 0
    assert ours["plan"].max_steps == 10 and ours["plan"].decay_every_steps == 5
    assert parity.compare_ten_steps(ours, ref) == []
    # the StepLR halved the lr once, and the value clipping acted
    assert ref["lrs"].unique().tolist() == pytest.approx([5e-4, 1e-3]) and sum(ref["clipped"]) > 0
    # every batch has a perturbed cell (a control-only batch leaves the reference's perturbation branch without
    # gradients, which Adam then skips, where ours has zero gradients)
    assert all((inputs[f"{s}.pert_idx"] >= 0).any() for s in range(10))


@pytest.mark.numerics
@pytest.mark.parametrize(("default", "fails"), [
    (["optim.decay_all_parameters=false"], "ten steps: state"),
    (["train.grad_clip_value=0", "train.grad_clip_norm=1.0"], "ten steps: state"),
])
def test_ten_steps_tell_each_rule_of_the_recipe(parity, ten_step_golden, default, fails, fresh_accelerate):
    """The rules the paper preset sets matter: weight decay exempting biases and norm scales (our default), or
    clipping the norm instead of each component, fails the comparison."""
    assert_ten_steps_fail(parity, ten_step_golden, fails, *default)


test_live_parity_with_reference, test_live_ten_steps_with_reference = live_parity_tests(
    "gears", __file__, "TRAINER_REFERENCE_GEARS", "snap-stanford/GEARS",
    parity_passed="parity: state dict round trip exact",
    ten_steps_passed="ten steps: loss, lr, gradient norms, weights and BatchNorm statistics within tolerance")

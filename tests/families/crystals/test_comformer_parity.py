"""Parity of our ComFormer (iComFormer, eComFormer) with the reference implementation (divelab/AIRS, GPL-3.0).

From the golden files (tests/families/crystals/golden/<variant>/, written by scripts/parity/comformer.py from the
reference checkout: numbers only) without the reference; and live against a checkout named by
TRAINER_REFERENCE_COMFORMER.
"""

from __future__ import annotations

import pytest
import torch
from parity_support import assert_ten_steps_fail, live_parity_tests, parity_fixtures

from trainer.families.crystals.reference import (
    REFERENCE_UNUSED,
    from_reference_state_dict,
    load_reference_state_dict,
    reference_state_dict,
)

parity, golden, ten_step_golden = parity_fixtures("comformer", __file__, ["icomformer", "ecomformer"], "icomformer")


@pytest.mark.numerics
def test_golden_parity(parity, golden):
    """Our ComFormer, loaded with the randomised weights, gives the reference's forward in eval and train mode,
    BatchNorm running statistics, MSE loss, gradients and parameters after one SGD and one Adam step (1e-10,
    float64), on crystals whose graphs our builder made."""
    state, inputs, ref, meta = golden
    assert meta["reference"]["license"] == "GPL-3.0" and len(meta["reference"]["commit"]) == 40
    assert any(k.endswith("running_var") for k in ref["bn"]) and len(ref["names"]) > 80
    ours = parity.ours_outputs(state, inputs, meta["config"])
    assert ours["round_trip"]
    assert parity.compare(ours, ref) == []


@pytest.mark.numerics
def test_golden_parity_detects_a_changed_model(parity, golden, monkeypatch):
    """The comparison is not vacuous: one weight moved by 1e-6 fails the forward and the gradients, and an RBF
    width off by 1e-7 (relative; float32 rounding of the reference's own width) fails the forward."""
    state, inputs, ref, meta = golden
    key = "att_layers.1.lin_msg_update.2.weight"
    moved = dict(state)
    moved[key] = state[key].double().clone()
    moved[key][0, 0] += 1e-6
    failures = parity.compare(parity.ours_outputs(moved, inputs, meta["config"]), ref)
    assert any(f.startswith("forward (eval)") for f in failures), failures
    assert any(f.startswith("gradient") for f in failures), failures

    from trainer.families.crystals import comformer

    def wider(self, x):
        return torch.exp(-self.gamma * (1 + 1e-7) * (x.unsqueeze(-1) - self.centers) ** 2)

    monkeypatch.setattr(comformer.RBFExpansion, "forward", wider)
    failures = parity.compare(parity.ours_outputs(state, inputs, meta["config"]), ref)
    assert any(f.startswith("forward (train)") for f in failures), failures


def test_golden_graphs_are_symmetric(golden):
    """Every golden edge has its reverse (the reference's equivariant layer aggregates at edge_index[0], its node
    layers at edge_index[1]: the same model as ours only on such graphs, which our builder always makes)."""
    inputs = golden[1]
    fwd = {(s, d, tuple(x)) for s, d, x in zip(inputs["edge_src"].tolist(), inputs["edge_dst"].tolist(),
                                                inputs["edge_shift"].tolist())}
    assert {(d, s, tuple(-v for v in x)) for s, d, x in fwd} == fwd


def test_key_map_round_trip_and_errors(golden):
    state, _, _, meta = golden
    ref = reference_state_dict({f"module.{k}": v for k, v in state.items()})
    if meta["variant"] == "icomformer":
        assert "edge_update_layer.lin_key_e1.weight" in ref and not any(k.startswith("edge_update_layers") for k in ref)
        c = state["edge_update_layers.0.lin_key.weight"].shape[1]
        assert ref["edge_update_layer.lin_edge_len.weight"].shape == (c, c + 32)
        assert all(not ref[k].any() for k in REFERENCE_UNUSED)
    else:
        assert "equi_update.nlayer_1.fc.2.weight" in ref and not any(k in ref for k in REFERENCE_UNUSED)
    back = from_reference_state_dict({**ref, **{k: torch.ones(1) for k in REFERENCE_UNUSED if k in ref}})
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)

    with pytest.raises(ValueError, match=r"ckpt\.pt: no 'att_layers\.\*' keys"):
        from_reference_state_dict({"linear.weight": torch.zeros(1)}, source="ckpt.pt")
    with pytest.raises(ValueError, match="not a ComFormer state dict"):
        reference_state_dict({"linear.weight": torch.zeros(1)})
    layer = "edge_update_layers" if meta["variant"] == "icomformer" else "equi_update_layers"
    two = {**state, **{k.replace(f"{layer}.0.", f"{layer}.1."): v for k, v in state.items() if k.startswith(layer)}}
    with pytest.raises(ValueError, match=rf"\['{layer}\.1\..*one edge/equivariant layer"):
        reference_state_dict(two)


def test_reference_checkpoint_loads_strictly_or_names_what_differs(parity, golden):
    """A reference state dict fills our model of the same config exactly; into another config, the error names
    the file, the missing keys and each shape that differs."""
    state, _, _, meta = golden
    ref = reference_state_dict(state)
    model = parity.build_ours(meta["config"])
    load_reference_state_dict(model, ref, source="model.pt")
    assert all(torch.equal(model.state_dict()[k], v.to(model.state_dict()[k].dtype)) for k, v in state.items())

    other = parity.build_ours({**meta["config"], "node_features": 16})
    with pytest.raises(ValueError, match=r"model\.pt: does not match this ComFormer config: 'atom_embedding\.bias': "
                                         r"shape \(8,\) where the model has \(16,\);.* more keys with other shapes$"):
        load_reference_state_dict(other, ref, source="model.pt")
    del ref["fc_out.bias"]
    with pytest.raises(ValueError, match=r"missing keys \['fc_out\.bias'\]"):
        load_reference_state_dict(parity.build_ours(meta["config"]), ref, source="model.pt")


@pytest.mark.numerics
@pytest.mark.usefixtures("fresh_accelerate")
def test_ten_paper_steps_equal_the_references(parity, ten_step_golden):
    """Ten optimizer steps of `task.preset=paper` by our loop's step (Trainer.train_step, float64) equal ten steps
    of the reference's recipe (its own group_decay + setup_optimizer AdamW, OneCycleLR per batch, MSE on
    standardised targets, no clipping) over one whole cycle: loss, lr, gradient norm per step, and every weight
    and BatchNorm running statistic after the ten steps."""
    state, inputs, ref, meta = ten_step_golden
    assert meta["reference"]["license"] == "GPL-3.0" and meta["overrides"] == parity.TEN_OVERRIDES
    ours = parity.ours_ten_steps(state, inputs, meta["config"])
    t, o = ours["cfg"].task, ours["cfg"].optim
    assert t.loss == "mse" and o.scheduler == "onecycle" and ours["cfg"].train.grad_clip_norm == 0
    assert not o.decay_all_parameters and o.weight_decay == meta["ten_steps"]["weight_decay"]
    assert parity.compare_ten_steps(ours, ref) == []
    # the whole cycle was taken: the lr rose to its peak and annealed, and clipping at 1 would have acted
    lrs = ref["lrs"].tolist()
    assert lrs.index(max(lrs)) == 2 and max(lrs) == pytest.approx(1e-3) and lrs[-1] < 1e-6
    assert ref["grad_norms"].min() > 2.0


@pytest.mark.numerics
@pytest.mark.parametrize(("default", "fails"), [("task.loss=l1", "ten steps: loss per step"),
                                                ("optim.scheduler=cosine", "ten steps: lr per step"),
                                                ("train.grad_clip_norm=1.0", "ten steps: params"),
                                                ("optim.decay_all_parameters=true", "ten steps: params")])
def test_ten_steps_tell_each_rule_of_the_recipe(parity, ten_step_golden, default, fails, fresh_accelerate):
    """Each rule the paper preset sets matters: our default in its place (L1, cosine, clipping at norm 1, or
    weight decay on biases and norm scales, which the reference's group_decay exempts) fails the comparison."""
    assert_ten_steps_fail(parity, ten_step_golden, fails, default)


test_live_parity_with_reference, test_live_ten_steps_with_reference = live_parity_tests(
    "comformer", __file__, "TRAINER_REFERENCE_COMFORMER", "divelab/AIRS (OpenMat/ComFormer)",
    parity_passed="parity: state dict round trips exact",
    ten_steps_passed="ten steps: loss, lr, gradient norms, weights and BatchNorm statistics within tolerance")

"""The non-finite step guard on its own: one flag a step from the clipped gradient norm, a non-finite
loss made visible in the gradients by the backward seed, skipped steps leave weights and optimizer
state untouched, runs of skipped steps are counted across reads. (Cross-rank agreement is tested with
real launchers in test_launchers.py; the absence of host syncs in test_loop.py.)"""

from types import SimpleNamespace

import pytest
import torch

from trainer.core.step_guard import NonFiniteLossError, StepGuard


def setup(skip_nonfinite=True, max_in_row=3, fp16=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = StepGuard(SimpleNamespace(scaler=None), optimizer, list(model.parameters()), max_norm=1.0,
                      skip_nonfinite=skip_nonfinite, max_in_row=max_in_row, plain=True, deepspeed=False, fp16=fp16)
    return model, optimizer, guard


def step(model, optimizer, guard, corrupt=lambda loss: loss):
    loss = corrupt(model(torch.ones(2, 4)).pow(2).mean())
    loss.backward(guard.backward_seed(loss))
    norm, skipped = guard.clip()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, skipped


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("corrupt", [lambda loss: loss * float("nan"), lambda loss: loss + float("inf")],
                         ids=["nan-gradients", "inf-loss-finite-gradients"])
def test_nonfinite_step_leaves_weights_and_optimizer_untouched(corrupt):
    model, optimizer, guard = setup()
    step(model, optimizer, guard)  # one good step: Adam has state to protect
    before = weights(model)
    norm, skipped = step(model, optimizer, guard, corrupt)
    assert float(skipped) == 1.0 and not torch.isfinite(norm)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), before))
    assert all(float(s["step"]) == 1 for s in optimizer.state.values())  # the skipped step did not count
    step(model, optimizer, guard)
    assert all(float(s["step"]) == 2 for s in optimizer.state.values())
    assert guard.read() == (1, 1)


def test_seed_of_a_finite_loss_changes_nothing():
    model, _, guard = setup()
    loss = model(torch.ones(2, 4)).pow(2).mean()
    seed = guard.backward_seed(loss)
    assert seed.item() == 1.0
    loss.backward(seed, retain_graph=True)
    seeded = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(seeded, model.parameters()))


def test_clip_matches_torch_and_flags_finite_steps_as_taken():
    model, optimizer, guard = setup()
    reference, _, _ = setup()
    loss = reference(torch.ones(2, 4)).pow(2).mean()
    loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    norm, skipped = step(model, optimizer, guard)
    assert torch.equal(norm, expected) and float(skipped) == 0.0


def test_value_clipping_after_the_norm():
    """grad_clip_value (GEARS' clip_grad_value_): every component clipped, the logged norm is the unclipped one."""
    model, optimizer, _ = setup()
    guard = StepGuard(SimpleNamespace(scaler=None), optimizer, list(model.parameters()), max_norm=0.0, clip_value=0.05,
                      skip_nonfinite=True, max_in_row=3, plain=True, deepspeed=False)
    reference, _, _ = setup()
    reference(torch.ones(2, 4)).pow(2).mean().backward()
    unclipped = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    torch.nn.utils.clip_grad_value_(reference.parameters(), 0.05)
    model(torch.ones(2, 4)).pow(2).mean().backward()
    norm, skipped = guard.clip()
    assert torch.equal(norm, unclipped) and float(skipped) == 0.0
    assert any(p.grad.abs().max() == 0.05 for p in model.parameters())  # some component was cut
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours.grad, theirs.grad) and ours.grad.abs().max() <= 0.05


def test_runs_of_skipped_steps_carry_across_reads_and_abort():
    model, optimizer, guard = setup(max_in_row=3)
    nan = lambda loss: loss * float("nan")  # noqa: E731
    for corrupt in (nan, nan, None, nan):
        step(model, optimizer, guard, corrupt or (lambda loss: loss))
    assert guard.read() == (3, 2)
    step(model, optimizer, guard, nan)
    step(model, optimizer, guard, nan)
    skipped, longest = guard.read()
    assert (skipped, longest) == (2, 3)  # the run began before the previous read
    with pytest.raises(NonFiniteLossError, match="3 optimizer steps in a row"):
        guard.check(longest, step=6)
    setup(fp16=True)[2].check(longest, step=6)  # fp16 loss-scale overflows never abort


def test_disabled_guard_adds_nothing():
    model, optimizer, guard = setup(skip_nonfinite=False)
    loss = model(torch.ones(2, 4)).pow(2).mean()
    assert guard.backward_seed(loss) is None
    norm, skipped = step(model, optimizer, guard, lambda loss: loss * float("nan"))
    assert skipped is None and getattr(optimizer, "found_inf", None) is None
    assert guard.read() == (0, 0)

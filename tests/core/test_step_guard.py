"""The non-finite step guard and the plain engine's step: one flag a step from the clipped gradient
norm, a non-finite loss made visible in the gradients by the backward seed, skipped steps leave weights
and optimizer state untouched, runs of skipped steps are counted across reads, and the stop is one
line whose advice fits the config. (Cross-rank agreement is tested with real launchers in
test_launchers.py; the absence of host syncs in test_loop.py.)"""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from conftest import ROOT, child_env

from trainer.config import load_config
from trainer.core.engine import TorchEngine
from trainer.core.step_guard import NonFiniteLossError, StepGuard, nonfinite_advice
from trainer.errors import TrainerError


def setup(skip_nonfinite=True, max_in_row=3, fp16=False, *overrides):
    """A small model and the engine a one-process run would build for it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    cfg = load_config(None, [f"train.skip_nonfinite={skip_nonfinite}", f"train.max_nonfinite_in_row={max_in_row}",
                             "train.grad_clip_norm=1.0", *overrides])
    accelerator = SimpleNamespace(scaler=None, distributed_type=DistributedType.NO, num_processes=1)
    engine = TorchEngine(accelerator, model, SimpleNamespace(optimizer=optimizer, param_groups=optimizer.param_groups),
                         cfg)
    engine.guard.may_abort = not fp16
    return model, optimizer, engine


def step(model, optimizer, engine, corrupt=lambda loss: loss):
    loss = corrupt(model(torch.ones(2, 4)).pow(2).mean())
    engine.backward(loss)
    return engine.step()


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("corrupt", [lambda loss: loss * float("nan"), lambda loss: loss + float("inf")],
                         ids=["nan-gradients", "inf-loss-finite-gradients"])
def test_nonfinite_step_leaves_weights_and_optimizer_untouched(corrupt):
    model, optimizer, engine = setup()
    step(model, optimizer, engine)  # one good step: Adam has state to protect
    before = weights(model)
    norm, skipped = step(model, optimizer, engine, corrupt)
    assert float(skipped) == 1.0 and not torch.isfinite(norm)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), before))
    assert all(float(s["step"]) == 1 for s in optimizer.state.values())  # the skipped step did not count
    step(model, optimizer, engine)
    assert all(float(s["step"]) == 2 for s in optimizer.state.values())
    assert engine.guard.read() == (1, 1)


@pytest.mark.parametrize("corrupt", [lambda loss: loss * float("nan"), lambda loss: loss + float("inf")],
                         ids=["nan-gradients", "inf-loss-finite-gradients"])
def test_host_path_skips_the_same_steps_and_leaves_finite_ones_alone(corrupt):
    """CPU runs read loss and norm on the host: a finite step gets no seed and no found_inf (it runs as without a
    guard), a non-finite one is skipped with weights and optimizer state untouched, as on the device path."""
    model, optimizer, engine = setup()
    engine.guard.on_host = True
    reference, ref_optimizer, ref_engine = setup(False)
    for m, o, e in ((model, optimizer, engine), (reference, ref_optimizer, ref_engine)):
        assert step(m, o, e)[1] is None
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(reference)))  # bit-equal to no guard
    assert engine.guard.backward_seed(model(torch.ones(2, 4)).pow(2).mean()) is None
    before = weights(model)
    norm, skipped = step(model, optimizer, engine, corrupt)
    assert float(skipped) == 1.0 and not torch.isfinite(norm)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), before))
    assert all(float(s["step"]) == 1 for s in optimizer.state.values())
    step(model, optimizer, engine)
    assert all(float(s["step"]) == 2 for s in optimizer.state.values())
    assert engine.guard.read() == (1, 1)


def test_seed_of_a_finite_loss_changes_nothing():
    model, _, engine = setup()
    loss = model(torch.ones(2, 4)).pow(2).mean()
    seed = engine.guard.backward_seed(loss)
    assert seed.item() == 1.0
    loss.backward(seed, retain_graph=True)
    seeded = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(seeded, model.parameters()))


def test_clip_matches_torch_and_flags_finite_steps_as_taken():
    model, optimizer, engine = setup()
    reference, _, _ = setup()
    loss = reference(torch.ones(2, 4)).pow(2).mean()
    loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    norm, skipped = step(model, optimizer, engine)
    assert torch.equal(norm, expected) and float(skipped) == 0.0


def test_value_clipping_after_the_norm():
    """grad_clip_value (GEARS' clip_grad_value_): every component clipped, the logged norm is the unclipped one."""
    model, optimizer, engine = setup(True, 3, False, "train.grad_clip_norm=0", "train.grad_clip_value=0.05")
    reference, _, _ = setup()
    reference(torch.ones(2, 4)).pow(2).mean().backward()
    unclipped = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    torch.nn.utils.clip_grad_value_(reference.parameters(), 0.05)
    clipped = [p.grad.clone() for p in reference.parameters()]
    grads = []
    optimizer.step = lambda: grads.extend(p.grad.clone() for p in model.parameters())  # what the step gets
    norm, skipped = step(model, optimizer, engine)
    assert torch.equal(norm, unclipped) and float(skipped) == 0.0
    assert any(g.abs().max() == 0.05 for g in grads)  # some component was cut
    for ours, theirs in zip(grads, clipped):
        assert torch.equal(ours, theirs) and ours.abs().max() <= 0.05


def test_runs_of_skipped_steps_carry_across_reads_and_abort():
    model, optimizer, engine = setup(max_in_row=3)
    nan = lambda loss: loss * float("nan")  # noqa: E731
    for corrupt in (nan, nan, None, nan):
        step(model, optimizer, engine, corrupt or (lambda loss: loss))
    assert engine.guard.read() == (3, 2)
    step(model, optimizer, engine, nan)
    step(model, optimizer, engine, nan)
    skipped, longest = engine.guard.read()
    assert (skipped, longest) == (2, 3)  # the run began before the previous read
    with pytest.raises(NonFiniteLossError, match="3 optimizer steps in a row"):
        engine.guard.check(longest, step=6)
    setup(fp16=True)[2].guard.check(longest, step=6)  # fp16 loss-scale overflows never abort


def test_disabled_guard_adds_nothing():
    model, optimizer, engine = setup(skip_nonfinite=False)
    loss = model(torch.ones(2, 4)).pow(2).mean()
    assert engine.guard.backward_seed(loss) is None
    norm, skipped = step(model, optimizer, engine, lambda loss: loss * float("nan"))
    assert skipped is None and getattr(optimizer, "found_inf", None) is None
    assert engine.guard.read() == (0, 0)


def test_stop_advice_fits_the_config():
    """With clipping on, the advice is not "enable clipping"."""
    assert "enable train.grad_clip_norm" in nonfinite_advice(1e-3, 0.0)
    clipped = nonfinite_advice(1e-3, 1.0)
    assert "already clipped" in clipped and "enable" not in clipped and "0.001" in clipped
    guard = StepGuard(None, active=True, max_in_row=2, advice=clipped)
    with pytest.raises(TrainerError, match="already clipped"):  # a TrainerError: the CLI prints one line
        guard.check(2, step=4)


def test_nonfinite_stop_is_one_line_with_exit_status_2(tmp_path):
    """Every step NaN: `trainer train` ends with one line on stderr, no traceback, status 2."""
    config = ROOT / "configs" / "regression" / "tiny.yaml"
    proc = subprocess.run([sys.executable, "-m", "trainer", "train", str(config), "task.num_train=8", "task.nan_sample=0",
                           f"run.output_dir={tmp_path}", "train.max_steps=6", "train.grad_accum_steps=1",
                           "train.max_nonfinite_in_row=2", "log.every_steps=1", "log.progress_bar=false",
                           "log.tensorboard=false", "eval.every_steps=0", "ckpt.every_steps=0"],
                          capture_output=True, text=True, env=child_env(), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("trainer: ")]
    assert len(errors) == 1 and "2 optimizer steps in a row" in errors[0] and "already clipped" in errors[0]

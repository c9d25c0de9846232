"""The options that let a preset be a paper's recipe: AMSGrad, warm-up counting the current step, OneCycle, the
EMA's warm-up rules and EDM's adaptive gradient clipping (its queue checkpointed, so a resume is exact)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from trainer.config import ConfigError, load_config
from trainer.core.adaptive_clip import AdaptiveClip
from trainer.core.ema import ema_decay
from trainer.core.optim import build_optimizer, build_scheduler

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def _plan(max_steps: int, warmup: int = 0, decay_every: int = 0) -> SimpleNamespace:
    return SimpleNamespace(max_steps=max_steps, warmup_steps=warmup, decay_every_steps=decay_every)


def _lrs(scheduler, optimizer, steps: int) -> list[float]:
    """The lr each optimizer step used (the scheduler steps after the optimizer, as in the loop)."""
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_amsgrad_option_reaches_the_optimizer():
    model = torch.nn.Linear(3, 2)
    for name in ("adamw", "adam"):
        cfg = load_config(None, [f"optim.name={name}", "optim.amsgrad=true", "optim.weight_decay=1e-12",
                                 "optim.decay_all_parameters=true"])
        opt = build_optimizer(cfg, model, 1e-3)
        assert opt.defaults["amsgrad"] is True
    assert build_optimizer(load_config(None, []), model, 1e-3).defaults["amsgrad"] is False
    # the same steps as EDM's AdamW(amsgrad=True, weight_decay=1e-12) (unfused) on changing gradients
    ours, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref.load_state_dict(ours.state_dict())
    cfg = load_config(None, ["optim.amsgrad=true", "optim.weight_decay=1e-12", "optim.decay_all_parameters=true"])
    opt_ours = build_optimizer(cfg, ours, 1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, amsgrad=True, weight_decay=1e-12)
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 0.1, 3.0, 0.01):
        for p, q in zip(ours.parameters(), ref.parameters()):
            p.grad = scale * torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt_ours.step()
        opt_ref.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert "max_exp_avg_sq" in opt_ours.state[next(ours.parameters())]


@pytest.mark.parametrize("scheduler", ["constant_with_warmup", "linear", "cosine"])
def test_warmup_counting_the_current_step(scheduler):
    """SEDD's rule: step k (from 1) has lr peak x min(k / warmup, 1); ours by default is (k - 1) / warmup."""
    model = torch.nn.Linear(2, 1)
    for counts, want in ((True, [0.25, 0.5, 0.75, 1.0]), (False, [0.0, 0.25, 0.5, 0.75])):
        cfg = load_config(None, [f"optim.scheduler={scheduler}", "optim.warmup_steps=4",
                                 f"optim.warmup_counts_current_step={str(counts).lower()}"])
        opt = build_optimizer(cfg, model, 2.0)
        lrs = _lrs(build_scheduler(cfg, opt, _plan(1000, warmup=4)), opt, 4)
        assert lrs == pytest.approx([2.0 * w for w in want], rel=1e-3)


def test_warmup_counting_the_current_step_with_step_decay_and_unsupported_schedulers():
    model = torch.nn.Linear(2, 1)
    cfg = load_config(None, ["optim.scheduler=step", "optim.warmup_steps=2", "optim.decay_every_steps=3",
                             "optim.decay_gamma=0.5", "optim.warmup_counts_current_step=true"])
    opt = build_optimizer(cfg, model, 1.0)
    assert _lrs(build_scheduler(cfg, opt, _plan(10, warmup=2, decay_every=3)), opt, 7) == pytest.approx(
        [0.5, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25])
    cfg = load_config(None, ["optim.scheduler=inverse_sqrt", "optim.warmup_steps=2",
                             "optim.warmup_counts_current_step=true"])
    with pytest.raises(ConfigError, match="warmup_counts_current_step.*not 'inverse_sqrt'"):
        build_scheduler(cfg, build_optimizer(cfg, model, 1.0), _plan(10, warmup=2))


def test_onecycle_is_torchs_as_comformer_calls_it():
    """lr and Adam's beta1 at every step equal OneCycleLR(max_lr, epochs, steps_per_epoch, pct_start=0.3)."""
    ours, ref = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    cfg = load_config(None, ["optim.scheduler=onecycle", "optim.warmup_steps=0"])
    opt = build_optimizer(cfg, ours, 1e-3)
    sched = build_scheduler(cfg, opt, _plan(5 * 7))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    sched_ref = torch.optim.lr_scheduler.OneCycleLR(opt_ref, max_lr=1e-3, epochs=5, steps_per_epoch=7,
                                                    pct_start=0.3)
    for _ in range(35):
        assert opt.param_groups[0]["lr"] == opt_ref.param_groups[0]["lr"]
        assert opt.param_groups[0]["betas"] == opt_ref.param_groups[0]["betas"]
        opt.step(), sched.step(), opt_ref.step(), sched_ref.step()
    with pytest.raises(ConfigError, match="onecycle has its own rise"):
        build_scheduler(cfg, opt, _plan(35, warmup=3))
    with pytest.raises(ConfigError, match="onecycle_pct_start"):
        load_config(None, ["optim.scheduler=onecycle", "optim.onecycle_pct_start=1.5"])


def test_ema_warmup_rules():
    assert ema_decay(0.999, 0) == pytest.approx(1 / 10)
    assert ema_decay(0.999, 0, "sedd") == pytest.approx(2 / 11)  # SEDD's counter is incremented first
    assert ema_decay(0.999, 9, "sedd") == pytest.approx(11 / 20)
    assert ema_decay(0.999, 0, "none") == 0.999  # EDM's EMA has no warm-up
    assert ema_decay(0.9, 10_000, "sedd") == 0.9
    with pytest.raises(ConfigError, match="train.ema_warmup"):
        load_config(None, ["train.ema_warmup=edm"])


class _EDMQueue:
    """EDM's rule (utils.Queue + gradient_clipping) on host floats, in numpy: the expected values."""

    def __init__(self, history: int, initial: float):
        self.items, self.history = [initial], history

    def step(self, norm: float) -> tuple[float, float]:
        """(limit, the norm after clipping) for a gradient of norm `norm`."""
        limit = 1.5 * np.mean(self.items) + 2 * np.std(self.items)
        self.items.insert(0, limit if norm > limit else norm)
        if len(self.items) > self.history:
            self.items.pop()
        return limit, norm * min(1.0, limit / (norm + 1e-6))


def test_adaptive_clip_follows_edms_rule_and_skips_nonfinite_norms():
    g = torch.Generator().manual_seed(3)
    scales = [float(x) for x in torch.rand(40, generator=g) * 4 + 1]
    scales[10] = scales[25] = 500.0  # spikes: clipped to the limit, and the limit enters the queue
    clip, ref = AdaptiveClip(history=8, initial=3000.0), _EDMQueue(8, 3000.0)
    clipped = []
    for i, n in enumerate(scales):
        grad = torch.randn(5, generator=g)
        grad *= n / grad.norm()
        if i == 20:  # a skipped step: the queue is left as it was
            before = clip.state_dict()
            clip.clip_([torch.full((5,), math.nan)], torch.tensor(math.nan))
            assert clip.state_dict() == before
        want_limit, want_norm = ref.step(float(grad.norm()))
        limit = clip.clip_([grad], grad.norm())
        assert float(limit) == pytest.approx(want_limit, rel=1e-12)
        assert float(grad.norm()) == pytest.approx(want_norm, rel=1e-5)
        clipped.append(want_norm < float(n) * (1 - 1e-3))
    assert clipped[10] and clipped[25] and sum(clipped) < 10  # the spikes (and the first steps' few) were clipped
    state = json.loads(json.dumps(clip.state_dict()))
    again = AdaptiveClip(history=8, initial=3000.0)
    again.load_state_dict(state)
    assert float(again.limit()) == float(clip.limit())
    with pytest.raises(ValueError, match="'grad_clip.norms' holds 8 norms, but train.adaptive_clip_history is 4"):
        AdaptiveClip(history=4, initial=1.0).load_state_dict(state)


def test_adaptive_clip_config_errors():
    from accelerate.utils import DistributedType

    from trainer.core.engine import check_backend_supports

    cfg = load_config(None, ["train.grad_clip_mode=adaptive"])
    check_backend_supports(cfg, DistributedType.NO)
    for backend in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        with pytest.raises(ConfigError, match="grad_clip_mode=adaptive is supported in"):
            check_backend_supports(cfg, backend)
    with pytest.raises(ConfigError, match="adaptive_clip_history"):
        load_config(None, ["train.adaptive_clip_history=0"])


def _trainer(out, *overrides):
    from trainer.core.trainer import Trainer

    cfg = load_config(None, ["task.preset=tiny", f"run.output_dir={out}", "log.progress_bar=false",
                             "log.tensorboard=false", "optim.lr=0.05", "train.grad_clip_mode=adaptive",
                             "train.adaptive_clip_initial=0.05", "train.adaptive_clip_history=10",
                             "train.max_steps=6", "ckpt.keep_last=10", *overrides])
    return Trainer(cfg)


def test_adaptive_clip_clips_in_the_loop_and_its_queue_survives_a_resume(tmp_path):
    """A run resumed at step 3 ends with the uninterrupted run's queue and weights: the queue is a checkpoint
    part (a fresh queue would clip steps 4-6 to other limits)."""
    whole = _trainer(tmp_path / "a", "ckpt.every_steps=3")
    seeded = whole.engine.adaptive_clip.state_dict()
    whole.fit()
    final = whole.engine.adaptive_clip.state_dict()
    assert final != seeded and final["count"] == 7
    assert final["norms"][1] == pytest.approx(0.075)  # the first step clipped to 1.5 x the small seed
    saved = json.loads((tmp_path / "a" / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert saved["grad_clip"]["count"] == 4

    resumed = _trainer(tmp_path / "b", f"run.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000003'}")
    assert resumed.state.step == 3 and resumed.engine.adaptive_clip.state_dict() == saved["grad_clip"]
    resumed.fit()
    assert resumed.engine.adaptive_clip.state_dict() == final
    a = load_file(tmp_path / "a" / "checkpoints" / "step_00000006" / "model.safetensors")
    b = load_file(tmp_path / "b" / "checkpoints" / "step_00000006" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_onecycle_in_the_loop_resumes_exactly(tmp_path):
    """The schedule (and the beta1 it cycles) continues after a resume as in the uninterrupted run."""
    common = ["train.grad_clip_mode=norm", "optim.scheduler=onecycle", "optim.warmup_steps=0"]
    whole = _trainer(tmp_path / "a", *common, "ckpt.every_steps=3")
    whole.fit()
    resumed = _trainer(tmp_path / "b", *common, f"run.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000003'}")
    assert resumed.state.step == 3
    resumed.fit()
    group, again = whole.optimizer.param_groups[0], resumed.optimizer.param_groups[0]
    assert group["lr"] == again["lr"] and group["betas"] == again["betas"]
    assert group["lr"] < 0.05 * 0.2  # annealed well below the peak (optim.lr 0.05) by the last step
    a = load_file(tmp_path / "a" / "checkpoints" / "step_00000006" / "model.safetensors")
    b = load_file(tmp_path / "b" / "checkpoints" / "step_00000006" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_onecycle_resumed_with_a_longer_run_follows_the_new_length(tmp_path):
    """A checkpoint restores OneCycle's position, not its length: a run resumed with a larger train.max_steps
    anneals over the new length (torch's OneCycleLR restored whole raises once it steps past its old total)."""
    common = ["train.grad_clip_mode=norm", "optim.scheduler=onecycle", "optim.warmup_steps=0"]
    _trainer(tmp_path / "a", *common, "ckpt.every_steps=3").fit()
    longer = _trainer(tmp_path / "b", *common, "train.max_steps=9",
                      f"run.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000006'}")
    assert longer.state.step == 6 and longer.scheduler.total_steps == 9
    longer.fit()
    assert longer.state.step == 9 and longer.optimizer.param_groups[0]["lr"] < 0.05 * 0.2

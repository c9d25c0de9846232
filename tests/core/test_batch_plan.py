"""The global batch is the invariant: train.global_batch_size sets the accumulation, and a resume on
another number of processes keeps the checkpoint's global batch or says in one line why it cannot."""

import pytest

from trainer.config import load_config
from trainer.core.batch_plan import plan_batch
from trainer.errors import ConfigError


def cfg(*overrides):
    return load_config(None, ["run.resume=none", *overrides])


def layout(plan):
    return plan.per_device_batch_size, plan.grad_accum_steps


def test_global_batch_size_sets_the_accumulation():
    c = cfg("train.per_device_batch_size=8", "train.global_batch_size=64")
    plan = plan_batch(c, world=2, saved={})
    assert plan.global_batch == 64 and layout(plan) == (8, 4)
    c = cfg("train.per_device_batch_size=48", "train.global_batch_size=64")  # 48 does not divide 32 per rank
    assert layout(plan_batch(c, world=2, saved={})) == (32, 1)
    with pytest.raises(ConfigError, match="global batch of 64 cannot be split evenly over 3 processes"):
        plan_batch(cfg("train.global_batch_size=64"), world=3, saved={})


def test_resume_on_another_world_size_keeps_the_global_batch():
    saved = {"per_device_batch_size": 8, "grad_accum_steps": 2, "world_size": 2, "lr_world_size": 2}
    c = cfg("train.per_device_batch_size=8", "train.grad_accum_steps=2")
    plan = plan_batch(c, world=1, saved=saved)
    assert (plan.global_batch, plan.lr_world_size, layout(plan)) == (32, 2, (8, 4))
    assert "train.grad_accum_steps 2 -> 4" in plan.changes[0] and "8 x 2 x 2 processes" in plan.changes[0]
    plan = plan_batch(c, world=4, saved=saved)
    assert plan.changes and layout(plan) == (8, 1)
    plan = plan_batch(c, world=2, saved=saved)
    assert not plan.changes and layout(plan) == (8, 2)  # nothing to change
    assert layout(c.train) == (8, 2)  # the config stays as loaded


def test_resume_refuses_what_cannot_keep_the_global_batch():
    saved = {"per_device_batch_size": 8, "grad_accum_steps": 2, "world_size": 2}
    with pytest.raises(ConfigError, match="cannot be split evenly over 3 processes"):
        plan_batch(cfg("train.per_device_batch_size=8"), world=3, saved=saved)
    with pytest.raises(ConfigError, match="train.global_batch_size=64, but the checkpoint .* global batch of 32"):
        plan_batch(cfg("train.global_batch_size=64", "train.per_device_batch_size=8"), world=2, saved=saved)


def test_an_epoch_is_whole_global_batches():
    """However the global batch is split, step s reads the same samples of the (seed, epoch) order."""
    from trainer.core.samplers import EpochSampler, RankBatchSampler

    def step_samples(per_device, accum, world, step):
        sampler = EpochSampler(100, seed=3, multiple_of=per_device * accum * world)
        out = set()
        for rank in range(world):
            batches = RankBatchSampler(sampler, per_device, rank, world)
            epoch, skip = batches.position(step * accum)
            batches.set_epoch(epoch, skip)
            it = iter(batches)
            for _ in range(accum):
                out.update(next(it))
        return out

    for step in range(6):  # 100 samples, global batch 24: 4 steps an epoch, steps 4 and 5 in the next one
        layouts = [step_samples(24, 1, 1, step), step_samples(6, 2, 2, step), step_samples(4, 3, 2, step),
                   step_samples(8, 1, 3, step)]
        assert all(len(s) == 24 for s in layouts) and all(s == layouts[0] for s in layouts), step

"""Reward post-training pieces (trainer/families/molecules_edm/alignment.py): the PPO clipped objective against a
hand computation (a clipped and an unclipped case, the clip fraction), group-normalised advantages (zero mean
and unit std over each group's valid members, failed rollouts excluded and counted, clipping at +-5), the KL to
the reference (zero when the means agree, a hand value otherwise, padding ignored), the transition
log-density against torch.distributions.Normal over the real atoms, the force RMS reward by hand with padding
ignored and failures marked, and the objective's gradient reaching logp_new only."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.families.molecules_edm.alignment import (
    clipped_objective,
    force_rms_reward,
    gaussian_log_prob,
    group_advantages,
    kl_to_reference,
)

pytestmark = pytest.mark.numerics  # compares log-probabilities and runs' weights (make test: every vector unit)


def test_clipped_objective_matches_a_hand_computation_with_one_clipped_transition():
    clip = 0.2
    # ratios 1.0 (inside), e^0.5 ~ 1.6487 (above 1 + clip, A > 0: clipped), e^-0.5 ~ 0.6065 (below 1 - clip,
    # A > 0: min takes the unclipped ratio), e^0.5 with A < 0 (min takes the unclipped ratio * A)
    logp_old = torch.tensor([0.0, 0.0, 0.0, 0.0])
    logp_new = torch.tensor([0.0, 0.5, -0.5, 0.5])
    advantages = torch.tensor([1.0, 2.0, 1.0, -1.0])
    loss, clip_fraction = clipped_objective(logp_new, logp_old, advantages, clip)
    e = math.exp(0.5)
    terms = [1.0 * 1.0, 1.2 * 2.0, math.exp(-0.5) * 1.0, e * -1.0]
    assert loss.item() == pytest.approx(-sum(terms) / 4, rel=1e-6)
    assert clip_fraction.item() == pytest.approx(3 / 4)


def test_clipped_objective_broadcasts_one_advantage_over_a_rollouts_transitions():
    logp_old = torch.zeros(2, 3)
    logp_new = torch.tensor([[0.0, 0.1, -0.1], [0.0, 0.0, 0.0]])
    loss, clip_fraction = clipped_objective(logp_new, logp_old, torch.tensor([1.0, -2.0]), clip=0.05)
    ratios = [1.0, min(math.exp(0.1), 1.05), math.exp(-0.1)]
    expected = -(sum(ratios) * 1.0 + 3 * 1.0 * -2.0) / 6
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert clip_fraction.item() == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="must be one"):
        clipped_objective(logp_new, logp_old[:, :2], torch.ones(2), clip=0.1)


def test_the_objectives_gradient_flows_to_logp_new_only():
    logp_new = torch.tensor([0.1, -0.05, 0.3], requires_grad=True)
    logp_old = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    advantages = torch.tensor([1.0, -1.0, 2.0], requires_grad=True)
    loss, _ = clipped_objective(logp_new, logp_old, advantages, clip=0.2)
    loss.backward()
    assert logp_old.grad is None and advantages.grad is None
    # d/dlogp of -mean(min(r A, clip(r) A)): -r A / n where unclipped is the min, 0 where the clip binds
    # (third: r = e^0.3 > 1.2 with A > 0)
    expected = torch.tensor([-math.exp(0.1) * 1.0 / 3, math.exp(-0.05) * 1.0 / 3, 0.0])
    torch.testing.assert_close(logp_new.grad, expected)


def test_group_advantages_normalise_each_group_over_its_valid_members():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, -1.0, float("nan"), 5.0, 0.5, 10.0, 10.0, 10.0, 10.0])
    valid = torch.tensor([True, True, True, True, True, False, True, False, True, True, True, True])
    out = group_advantages(rewards, group_size=4, valid_mask=valid)
    adv = out.advantages.reshape(3, 4)
    # group 0: all valid -> mean 0, population std 1
    assert adv[0].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert adv[0].std(unbiased=False).item() == pytest.approx(1.0, rel=1e-5)
    # group 1: members 0 and 2 valid (NaN and a flagged failure excluded and given 0)
    torch.testing.assert_close(adv[1], torch.tensor([-1.0, 0.0, 1.0, 0.0]), atol=1e-6, rtol=0)
    # group 2: equal rewards carry no signal
    assert torch.equal(adv[2], torch.zeros(4))
    assert out.excluded.tolist() == [0, 2, 0] and out.total_excluded == 2
    assert torch.isfinite(out.advantages).all()


def test_group_advantages_clip_at_five_and_check_their_input():
    rewards = torch.tensor([100.0] + [0.0] * 99)  # the outlier sits sqrt(99) ~ 9.95 std above the mean
    out = group_advantages(rewards, group_size=100)
    assert out.advantages[0].item() == pytest.approx(5.0)
    assert out.advantages[1].item() == pytest.approx(-1 / math.sqrt(99), rel=1e-4)
    assert out.total_excluded == 0
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), group_size=3)
    with pytest.raises(ValueError, match="valid_mask"):
        group_advantages(torch.zeros(4), group_size=2, valid_mask=torch.ones(3, dtype=torch.bool))


def _states(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 9, generator=gen)
    mean = torch.randn(2, 4, 9, generator=gen)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    return x, mean, mask


def test_gaussian_log_prob_matches_torch_normal_over_the_real_atoms():
    x, mean, mask = _states()
    sigma = torch.tensor([0.3, 0.05])
    expected = torch.stack([torch.distributions.Normal(mean[b, mask[b]], sigma[b]).log_prob(x[b, mask[b]]).sum()
                            for b in range(2)])
    torch.testing.assert_close(gaussian_log_prob(x, mean, sigma, mask), expected)
    # EDM's [B, N, 1] float mask and a scalar sigma give the same as the bool mask and a per-molecule sigma
    scalar = gaussian_log_prob(x, mean, 0.3, mask.float().unsqueeze(-1))
    torch.testing.assert_close(scalar, gaussian_log_prob(x, mean, torch.tensor([0.3, 0.3]), mask))
    # padding values do not matter
    x_padded = x.clone()
    x_padded[~mask] = 1e6
    torch.testing.assert_close(gaussian_log_prob(x_padded, mean, sigma, mask), expected)


def test_kl_to_reference_is_zero_when_the_means_agree_and_matches_a_hand_value():
    _, mean, mask = _states()
    sigma = torch.tensor([0.5, 2.0])
    assert torch.equal(kl_to_reference(mean, mean.clone(), sigma, mask), torch.zeros(2))
    shifted = mean.clone()
    shifted[0, 1, 4] += 0.3  # a real atom of molecule 0
    shifted[1, 3, 0] += 5.0  # padding of molecule 1: ignored
    kl = kl_to_reference(shifted, mean, sigma, mask)
    torch.testing.assert_close(kl, torch.tensor([0.3 ** 2 / (2 * 0.5 ** 2), 0.0]), atol=1e-6, rtol=1e-5)


def test_force_rms_reward_by_hand_with_padding_ignored_and_failures_marked():
    forces = torch.zeros(4, 3, 3)
    forces[0, 0] = torch.tensor([3.0, 4.0, 0.0])  # |F| 5
    forces[0, 1] = torch.tensor([0.0, 0.0, 1.0])  # |F| 1
    forces[0, 2] = torch.tensor([100.0, 0.0, 0.0])  # padding
    forces[1, :, 0] = 2.0
    forces[2, 1, 1] = float("nan")  # a real atom's force is NaN
    forces[3, 2, 2] = float("inf")  # padding: ignored
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, False], [True, True, False]])
    reward, valid = force_rms_reward(forces, mask)
    assert valid.tolist() == [True, True, False, True]
    assert reward[0].item() == pytest.approx(-math.sqrt((25 + 1) / 2))
    assert reward[1].item() == pytest.approx(-2.0)
    assert math.isnan(reward[2].item())
    assert reward[3].item() == 0.0
    # a force field's failure flag (its failed molecules come back with zero forces) marks the molecule invalid
    reward, valid = force_rms_reward(forces, mask, ok=torch.tensor([True, False, True, True]))
    assert valid.tolist() == [True, False, False, True] and math.isnan(reward[1].item())
    # and the failures drop out of the group statistics
    out = group_advantages(reward, group_size=4, valid_mask=valid)
    assert out.total_excluded == 2 and out.advantages[1].item() == 0.0 and out.advantages[2].item() == 0.0


def test_clash_rule_gives_the_groups_worst_sound_reward_and_never_a_better_one():
    from trainer.families.molecules_edm.alignment import apply_clash_rule

    nan = float("nan")
    rewards = torch.tensor([-1.0, -2.0, -9.0, nan, -4.0, -5.0, -1.0, nan, nan])
    scored = torch.tensor([True, True, True, False, True, True, True, False, False])
    clash = torch.tensor([False, False, True, True, False, False, True, True, False])
    out = apply_clash_rule(rewards, scored, clash, group_size=3)
    # group 0: row 2 clashes and scored -9, worse than the sound worst (-2): it keeps its own
    # group 1: row 3 clashes unscored: the sound worst (-5)
    # group 2: row 6 clashes with nothing sound beside it, row 7 too, row 8 is unscored: all excluded
    assert out[:6].tolist() == [-1.0, -2.0, -9.0, -5.0, -4.0, -5.0]
    assert torch.isnan(out[6:]).all()


def test_close_pair_penalty_grows_linearly_below_its_distance_and_is_zero_beyond():
    from trainer.families.molecules_edm.alignment import close_pair_penalty

    closest = torch.tensor([0.0, 0.45, 0.9, 1.5, float("inf")])  # inf: a molecule of one atom
    torch.testing.assert_close(close_pair_penalty(closest, 0.9), torch.tensor([1.0, 0.5, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="distance must be > 0"):
        close_pair_penalty(closest, 0.0)


def _training_batch(seed: int):
    from trainer.families.molecules_edm.alignment import TrainingBatch

    gen = torch.Generator().manual_seed(seed)
    return TrainingBatch(z_t=torch.randn(4, 2, 3, 5, generator=gen), z_s=torch.randn(4, 2, 3, 5, generator=gen),
                         steps=torch.tensor([[5, 1]] * 4), node_mask=torch.ones(4, 3, dtype=torch.bool),
                         logp_old=torch.randn(4, 2, generator=gen), advantages=torch.randn(4, 2, generator=gen),
                         logs={"reward_mean": torch.tensor(float(seed))}, group_size=2)


def test_the_rollout_buffer_keeps_a_cycle_and_restores_it_from_its_state():
    from trainer.families.molecules_edm.alignment import RolloutBuffer

    buffer = RolloutBuffer(epochs=3)
    assert buffer.drawing  # without step hooks every call draws
    buffer.start_step(0, micro_batches=2)
    assert buffer.drawing and [buffer.next_call(), buffer.next_call()] == [0, 1]
    buffer.keep(_training_batch(1))
    buffer.keep(_training_batch(2))
    buffer.start_step(1, micro_batches=2)
    assert not buffer.drawing and buffer.next_call() == 0
    state = buffer.state_dict()  # one step of the cycle left after step 1: kept
    restored = RolloutBuffer(epochs=3)
    assert restored.load_state_dict(state) is None
    restored.start_step(2, micro_batches=2)
    assert not restored.drawing and restored.cycle_start == 0
    for kept, back in zip(buffer.entries, restored.entries):
        assert all(torch.equal(getattr(kept, f), getattr(back, f)) for f in kept.FIELDS)
        assert kept.logs == back.logs and back.group_size == 2
    assert restored.state_dict() == {}  # after the cycle's last step: nothing left to keep
    restored.start_step(3, micro_batches=2)
    assert restored.drawing and restored.entries == []
    # Another batch layout (or number of epochs) drops the cycle, and says why.
    other = RolloutBuffer(epochs=3)
    other.load_state_dict(state)
    assert "2 micro-batches" in other.start_step(2, micro_batches=1) and other.drawing
    assert "kept for 3" in RolloutBuffer(epochs=2).load_state_dict(state)
    # One epoch keeps nothing.
    single = RolloutBuffer(epochs=1)
    single.start_step(0, 1)
    single.keep(_training_batch(1))
    assert single.entries == [] and single.state_dict() == {}


def test_shaped_rewards_telescope_to_the_discounted_final_minus_the_initial_potential():
    from trainer.families.molecules_edm.alignment import shaped_advantages, shaped_returns, shaped_rewards

    potentials = torch.tensor([[-3.0, -1.0, -2.5, 0.5, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    gamma, n = 0.9, potentials.shape[1] - 1
    rewards = shaped_rewards(potentials, gamma)
    assert rewards.shape == (2, n)
    torch.testing.assert_close(rewards[0, :2], torch.tensor([0.9 * -1.0 + 3.0, 0.9 * -2.5 + 1.0], dtype=torch.float64))
    for k in range(n):  # the discounted sum from transition k telescopes
        discount = gamma ** torch.arange(n - k, dtype=torch.float64)
        tail = (rewards[:, k:] * discount).sum(dim=1)
        torch.testing.assert_close(tail, gamma ** (n - k) * potentials[:, -1] - potentials[:, k])
    # The returns-to-go of stored transitions: transition at step s (t = s + 1 steps left) of a chain whose state at
    # t has potential Phi_t: gamma^t Phi_final - Phi_t, the same telescoped sum.
    steps = torch.tensor([[3, 0], [2, 1]])
    chain = potentials[0]  # chain[j] is the state with n - j steps left
    stored = torch.stack([chain[n - (steps[0] + 1)], chain[n - (steps[1] + 1)]])
    returns = shaped_returns(stored, torch.stack([chain[-1], chain[-1]]), steps, gamma)
    for b in range(2):
        for j in range(2):
            k = n - int(steps[b, j] + 1)
            expected = (rewards[0, k:] * gamma ** torch.arange(n - k, dtype=torch.float64)).sum()
            torch.testing.assert_close(returns[b, j], expected)
    # gamma = 1: the plain difference; normalised within each group over its transitions, NaN left out
    torch.testing.assert_close(shaped_returns(stored, stored[:, 0], steps, 1.0)[:, 0], torch.zeros(2, dtype=torch.float64))
    adv = shaped_advantages(torch.tensor([[1.0, 3.0], [float("nan"), 2.0], [5.0, 5.0], [5.0, 5.0]]), group_size=2)
    torch.testing.assert_close(adv[0], torch.tensor([-1.0 / (2 / 3) ** 0.5, 1.0 / (2 / 3) ** 0.5]), rtol=1e-5, atol=1e-6)
    assert adv[1, 0].item() == 0.0 and torch.equal(adv[2:], torch.zeros(2, 2))

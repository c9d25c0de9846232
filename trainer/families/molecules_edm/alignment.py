"""Reward post-training of EDM with a force field as reward: the policy-gradient pieces.

What this follows: liyy2/Elign (arXiv 2601.21985), which treats EDM's Gaussian reverse step
p(z_s | z_t) = N(mu, sigma^2 I) as a policy and trains it with a PPO / GRPO objective:

* `elign/trainer/fed_grpo_trainer.py::compute_advantage`: rewards normalised within each group of K rollouts
  (population std, eps 1e-8), then clipped to +-`adv_clip_max` (5);
* `elign/utils/math.py::policy_step_logprob` (called by `elign/model/edm_model.py::compute_log_p_zs_given_zt`
  from `sample_p_zs_given_zt`): the log-density of z_s under N(mu, sigma^2 I), summed over every feature of
  the real atoms;
* `elign/worker/actor/edm_actor.py::EDMActor.loss` / `calculate_loss`: the PPO clipped surrogate of the
  per-transition ratio exp(logp_new - logp_old), its clip fraction |ratio - 1| > clip, and
  `_compute_reference_kl`: ||mu_new - mu_ref||^2 / (2 sigma^2) over the real atoms against a frozen copy;
* `elign/worker/reward/force.py::_aggregate_force_metric` (aggregation "rms"): sqrt(mean over real atoms of
  |F_i|^2), negated as the reward.

Two departures from the reference, on purpose: a failed force evaluation is marked invalid, excluded from its
group's statistics, given advantage 0 and counted (the reference scores failures with a constant fake force),
and `force_rms_reward` takes the force field's `ok` flags, since `forcefields.base.compute_on_device` returns
zero forces for a failed molecule (which would otherwise read as the best possible reward).

Everything here is single-device tensor code without parameters; `align_task.py` (`trainer align`) composes it:

* `draw_rollouts(diffusion, RolloutPlan)`: G groups of K rollouts (rollout r of group p is row p * K + r). A group
  shares its start z_T and the first T - trained_steps reverse steps (one chain, from the group's generator), then
  each rollout branches with its own generator, which also picks the `transitions` branched steps it stores as
  (z_t, z_s, s, log p(z_s | z_t)). The steps are `EDMDiffusion.reverse_step` and `decode`, as `sample` takes.
* Rewards of the decoded molecules (`force_rms_reward` and the task's other terms), then `group_advantages`
  (K per group), `step_advantages` (no advantage on the final steps), `clipped_objective` of the policy forward's
  `gaussian_log_prob` and `kl_to_reference` against the frozen start's mean.
* Optionally, potential-based shaping per transition (`shaped_rewards`, `shaped_returns`, `shaped_advantages`) on
  the predicted clean molecules `draw_rollouts` reads at the stored transitions (`RolloutPlan.clean_predictions`).
* `TrainingBatch` and `RolloutBuffer`: what a drawing step keeps for the steps that reuse its rollouts (PPO epochs),
  with the state a checkpoint holds while a cycle has steps left.

The reference's paper settings, and how ours differ: docs/families/molecules_edm.md (force-field alignment).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer.families.molecules_edm.diffusion import EDMDiffusion, SampleOutput

__all__ = [
    "apply_clash_rule",
    "close_pair_penalty",
    "GroupAdvantages",
    "RolloutBuffer",
    "RolloutPlan",
    "Rollouts",
    "TrainingBatch",
    "draw_rollouts",
    "clipped_objective",
    "force_rms_reward",
    "gaussian_log_prob",
    "group_advantages",
    "kl_to_reference",
    "logp_rounding",
    "shaped_advantages",
    "shaped_returns",
    "shaped_rewards",
    "step_advantages",
]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class GroupAdvantages:
    """Output of `group_advantages` for B rollouts in G = B / K groups."""

    advantages: torch.Tensor
    """[B] float: group-normalised, clipped advantages; 0 for an excluded rollout."""
    excluded: torch.Tensor
    """[G] int64: rollouts of each group left out of its statistics (invalid or non-finite reward)."""
    spread: torch.Tensor
    """[G] the population standard deviation of each group's valid rewards (0 with fewer than two)."""

    @property
    def total_excluded(self) -> int:
        """Excluded rollouts over all groups."""
        return int(self.excluded.sum())


def group_advantages(rewards: torch.Tensor, group_size: int, valid_mask: torch.Tensor | None = None,
                     clip: float = 5.0, eps: float = 1e-8) -> GroupAdvantages:
    """GRPO advantages: (r - mean) / (std + eps) within each group of `group_size` consecutive rollouts.

    Mean and std (population std, as the reference) are over the group's valid members only: a rollout with
    `valid_mask` False or a non-finite reward is excluded, gets advantage 0 and is counted in `excluded`. A
    group with fewer than two valid members carries no signal: its advantages are 0. Advantages are clipped
    to [-clip, clip].
    """
    if rewards.dim() != 1:
        raise ValueError(f"group_advantages: rewards must be [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"group_advantages: {rewards.numel()} rollouts do not split into groups of {group_size}")
    if clip <= 0:
        raise ValueError(f"group_advantages: clip must be positive, got {clip}")
    valid = torch.isfinite(rewards)
    if valid_mask is not None:
        if tuple(valid_mask.shape) != tuple(rewards.shape):
            raise ValueError(f"group_advantages: valid_mask has shape {tuple(valid_mask.shape)}, "
                             f"rewards {tuple(rewards.shape)}")
        valid = valid & valid_mask.to(torch.bool)
    grouped = rewards.reshape(-1, group_size)
    weight = valid.reshape(-1, group_size).to(rewards.dtype)
    values = torch.where(weight > 0, grouped, torch.zeros_like(grouped))  # drops NaN/inf of excluded rows
    count = weight.sum(dim=1, keepdim=True)
    mean = (values * weight).sum(dim=1, keepdim=True) / count.clamp(min=1.0)
    var = (((values - mean) * weight) ** 2).sum(dim=1, keepdim=True) / count.clamp(min=1.0)
    normalised = (values - mean) / (var.sqrt() + eps) * weight
    advantages = normalised.clamp(-clip, clip).reshape(-1)
    excluded = (group_size - count.squeeze(1)).to(torch.int64)
    spread = torch.where(count.squeeze(1) >= 2, var.squeeze(1).sqrt(), torch.zeros_like(var.squeeze(1)))
    return GroupAdvantages(advantages=advantages, excluded=excluded, spread=spread)


def apply_clash_rule(rewards: torch.Tensor, scored: torch.Tensor, clash: torch.Tensor, group_size: int) -> torch.Tensor:
    """Rewards [B] after the clash rule: a rollout whose atoms clash gets the lowest reward of its group's sound
    rollouts (scored, no clash), or its own if that is lower, so collapsing atoms (which a force field may refuse to
    evaluate) is never a way out of a bad score; an unscored rollout without a clash is NaN (excluded). A clashing
    rollout in a group with nothing sound is NaN too: there is nothing to rank it against."""
    sound = scored & ~clash
    worst = torch.where(sound, rewards, torch.full_like(rewards, math.inf)).view(-1, group_size).amin(dim=1)
    worst = torch.where(torch.isfinite(worst), worst, torch.full_like(worst, math.nan)).repeat_interleave(group_size)
    broken = torch.where(scored, torch.minimum(rewards, worst), worst)
    return torch.where(sound, rewards, torch.where(clash, broken, torch.full_like(rewards, math.nan)))


def close_pair_penalty(closest: torch.Tensor, distance: float) -> torch.Tensor:
    """[B] (1 - d / distance) for a molecule whose closest two atoms are d < distance apart, 0 from `distance` on:
    graded, so that a rollout which comes near a clash is told so before its atoms collapse (the clash rule only
    ranks rollouts below `clash_distance`). `closest` [B] in Angstrom (inf for fewer than two atoms)."""
    if distance <= 0:
        raise ValueError(f"close_pair_penalty: distance must be > 0, got {distance}")
    return (1.0 - closest / distance).clamp(min=0.0)


def step_advantages(advantages: torch.Tensor, steps: torch.Tensor, lowest_step: int) -> torch.Tensor:
    """[B, S] per-transition advantages: each rollout's advantage [B] on its transitions at step s >= `lowest_step`,
    0 on the final steps below it (their log-probability gradients are the largest while they move atoms least:
    noise in the estimate; the KL still covers them)."""
    return advantages[:, None] * (steps >= lowest_step).to(advantages.dtype)


def shaped_rewards(potentials: torch.Tensor, gamma: float) -> torch.Tensor:
    """Potential-based shaping (Ng, Harada and Russell 1999): the reward of each transition k -> k + 1 of a chain
    of states with potentials Phi_0 .. Phi_n ([..., n + 1]) is gamma Phi_{k+1} - Phi_k ([..., n]).

    Their gamma-discounted sum from transition k to the end telescopes to gamma^(n - k) Phi_n - Phi_k (`shaped_returns`
    of the same chain): it depends on the chain only through its last state beyond Phi_k, a function of the state the
    action is taken from, so it leaves the best policy unchanged while rewarding each step's progress."""
    return gamma * potentials[..., 1:] - potentials[..., :-1]


def shaped_returns(potentials: torch.Tensor, final: torch.Tensor, steps: torch.Tensor, gamma: float) -> torch.Tensor:
    """[B, S] return-to-go of the shaped rewards from each stored transition to the end of its rollout:
    gamma^t Phi_final - Phi(z_t), t = s + 1 the reverse steps left (Elign's G_t = gamma^t Psi_0 - Psi_t).

    potentials: [B, S] Phi of the state each stored transition starts from; final: [B] Phi of the final molecule;
    steps: [B, S] s of each transition. NaN where either potential is."""
    discount = torch.pow(torch.full_like(potentials, float(gamma)), (steps + 1).to(potentials.dtype))
    return discount * final[:, None].to(potentials.dtype) - potentials


def shaped_advantages(returns: torch.Tensor, group_size: int, clip: float = 5.0) -> torch.Tensor:
    """[B, S] shaped returns normalised within each group over all its stored transitions with a finite return
    (zero mean, unit population std; the rest 0), clipped to +-clip. A group's rollouts store different steps, so
    its transitions are pooled rather than compared step by step."""
    batch, transitions = returns.shape
    return group_advantages(returns.reshape(-1), group_size * transitions, clip=clip).advantages.view(batch, transitions)


def _node_mask(node_mask: torch.Tensor, batch: int, nodes: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, N] bool or [B, N, 1] float mask -> [B, N, 1] of `dtype`."""
    mask = node_mask.squeeze(-1) if node_mask.dim() == 3 else node_mask
    if tuple(mask.shape) != (batch, nodes):
        raise ValueError(f"node_mask has shape {tuple(node_mask.shape)}, expected [{batch}, {nodes}] (or [.., 1])")
    return (mask > 0).to(dtype).unsqueeze(-1)


def _per_molecule(sigma: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A scalar or [B] (or [B, 1], [B, 1, 1]) standard deviation -> broadcastable to [B, N, D]."""
    sigma = torch.as_tensor(sigma, dtype=like.dtype, device=like.device)
    if sigma.numel() == 1:
        return sigma.reshape(1, 1, 1)
    if sigma.numel() != like.shape[0]:
        raise ValueError(f"sigma has {sigma.numel()} values for {like.shape[0]} molecules (one, or one each)")
    return sigma.reshape(-1, 1, 1)


def _check_pair(a: torch.Tensor, b: torch.Tensor, names: str) -> None:
    if a.dim() != 3 or tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{names}: expected two [B, N, D] tensors of one shape, got {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, sigma: torch.Tensor | float,
                      node_mask: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, sigma^2 I) per molecule [B], summed over every feature of the real atoms.

    x, mean: [B, N, D] EDM states z = [positions, h] (D = 3 + F); sigma: scalar or [B]; node_mask: [B, N] bool
    or EDM's [B, N, 1] float. Padded atoms contribute nothing. As the reference, the density is the full-rank
    one over N * D dimensions although the position part of EDM's noise lies in the zero-centre-of-mass
    subspace: the two differ by 3 log(sigma sqrt(2 pi)) per molecule, which depends on sigma alone (fixed by the
    schedule), so the ratio of two policies' densities is the same either way.
    """
    _check_pair(x, mean, "gaussian_log_prob(x, mean)")
    mask = _node_mask(node_mask, x.shape[0], x.shape[1], x.dtype)
    sigma = _per_molecule(sigma, x)
    log_density = -0.5 * ((x - mean) / sigma) ** 2 - torch.log(sigma) - _LOG_SQRT_2PI
    return (log_density * mask).sum(dim=(1, 2))


def clipped_objective(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                      clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate to minimise, and the fraction of transitions whose ratio left [1 - clip, 1 + clip].

    ratio = exp(logp_new - logp_old) per transition; loss = mean(-min(ratio * A, clamp(ratio, 1 - clip,
    1 + clip) * A)). logp_new, logp_old: [B] or [B, S] (S transitions of each rollout); advantages: the same
    shape or [B] (one per rollout, shared by its transitions). `logp_old` and `advantages` are treated as
    constants: the gradient flows to `logp_new` only. The clip fraction (|ratio - 1| > clip, as the reference
    logs it) is detached.
    """
    if tuple(logp_new.shape) != tuple(logp_old.shape) or logp_new.dim() not in (1, 2):
        raise ValueError(f"clipped_objective: logp_new {tuple(logp_new.shape)} and logp_old "
                         f"{tuple(logp_old.shape)} must be one [B] or [B, S] shape")
    if clip <= 0:
        raise ValueError(f"clipped_objective: clip must be positive, got {clip}")
    advantages = advantages.detach().to(logp_new.dtype)
    if advantages.dim() == 1 and logp_new.dim() == 2:
        advantages = advantages.unsqueeze(1)
    if advantages.shape[0] != logp_new.shape[0] or (advantages.dim() == 2 and advantages.shape[1] not in
                                                    (1, logp_new.shape[1])):
        raise ValueError(f"clipped_objective: advantages {tuple(advantages.shape)} do not match the log-probs "
                         f"{tuple(logp_new.shape)}")
    ratio = torch.exp(logp_new - logp_old.detach())
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip) * advantages
    loss = -torch.minimum(unclipped, clipped).mean()
    clip_fraction = ((ratio.detach() - 1.0).abs() > clip).to(logp_new.dtype).mean()
    return loss, clip_fraction


def kl_to_reference(mean_new: torch.Tensor, mean_ref: torch.Tensor, sigma: torch.Tensor | float,
                    node_mask: torch.Tensor) -> torch.Tensor:
    """KL(N(mean_new, sigma^2 I) || N(mean_ref, sigma^2 I)) per transition [B]: sum of (mean_new - mean_ref)^2 /
    (2 sigma^2) over every feature of the real atoms. `mean_ref` (the frozen model's) is treated as a constant."""
    _check_pair(mean_new, mean_ref, "kl_to_reference(mean_new, mean_ref)")
    mask = _node_mask(node_mask, mean_new.shape[0], mean_new.shape[1], mean_new.dtype)
    sigma = _per_molecule(sigma, mean_new)
    diff = mean_new - mean_ref.detach().to(mean_new.dtype)
    return ((diff ** 2) / (2.0 * sigma ** 2) * mask).sum(dim=(1, 2))


def force_rms_reward(forces: torch.Tensor, node_mask: torch.Tensor,
                     ok: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-sqrt(mean over real atoms of |F_i|^2) per molecule, and which molecules are valid.

    forces: [B, N, 3] eV/Angstrom; node_mask: [B, N] bool (or [B, N, 1]); ok: optional [B] bool from the
    force field (`ForceBatch.ok`), whose failed molecules carry zero forces. A molecule is invalid when `ok`
    says so, a real atom's force is not finite, or it has no atoms; its reward is NaN so that it cannot pass
    for a real value (`group_advantages` excludes it). Values at padding are ignored, whatever they are.
    """
    if forces.dim() != 3 or forces.shape[-1] != 3:
        raise ValueError(f"force_rms_reward: forces must be [B, N, 3], got {tuple(forces.shape)}")
    mask = _node_mask(node_mask, forces.shape[0], forces.shape[1], torch.bool).squeeze(-1)
    finite = torch.isfinite(forces).all(dim=-1) | ~mask
    counts = mask.sum(dim=1)
    valid = finite.all(dim=1) & (counts > 0)
    if ok is not None:
        if tuple(ok.shape) != (forces.shape[0],):
            raise ValueError(f"force_rms_reward: ok must be [{forces.shape[0]}], got {tuple(ok.shape)}")
        valid = valid & ok.to(device=valid.device, dtype=torch.bool)
    keep = mask & finite
    squared = torch.where(keep.unsqueeze(-1), forces, torch.zeros_like(forces)).pow(2).sum(dim=-1)
    rms = torch.sqrt(squared.sum(dim=1) / counts.clamp(min=1).to(forces.dtype))
    reward = torch.where(valid, -rms, torch.full_like(rms, float("nan")))
    return reward, valid


@dataclass(frozen=True)
class RolloutPlan:
    """What one micro-batch of groups draws: G groups of `group_size` rollouts (rollout r of group p is row
    p * group_size + r). A group's rollouts share their start z_T and the first T - `trained_steps` reverse steps
    (drawn from the group's generator), then branch: each draws its own noise, and the `transitions` steps
    it stores for training, from its own generator."""

    num_atoms: Sequence[int]
    """[G] atoms of each group's molecules."""
    group_generators: Sequence[torch.Generator]
    """[G] the shared start and prefix of each group."""
    rollout_generators: Sequence[torch.Generator]
    """[G * group_size] each rollout's branch: which steps it stores, its noise, its decoding."""
    group_size: int
    trained_steps: int
    """The last this many reverse steps are branched and may be trained (the reference: 400 of 1000)."""
    transitions: int
    """Transitions stored per rollout, drawn without replacement among the trained steps."""
    clean_predictions: bool = False
    """Also read the model's predicted clean molecule at each stored transition's z_t (`Rollouts.clean`), for
    potential-based shaping: one more forward of the stored transitions per group."""

    def check(self, timesteps: int) -> None:
        groups = len(self.num_atoms)
        if groups < 1 or len(self.group_generators) != groups:
            raise ValueError(f"RolloutPlan: {groups} groups but {len(self.group_generators)} group generators")
        if len(self.rollout_generators) != groups * self.group_size:
            raise ValueError(f"RolloutPlan: {groups} groups of {self.group_size} need {groups * self.group_size} "
                             f"rollout generators, got {len(self.rollout_generators)}")
        if not 1 <= self.trained_steps <= timesteps:
            raise ValueError(f"RolloutPlan: trained_steps must be in [1, {timesteps}], got {self.trained_steps}")
        if not 1 <= self.transitions <= self.trained_steps:
            raise ValueError(f"RolloutPlan: transitions must be in [1, trained_steps={self.trained_steps}], "
                             f"got {self.transitions}")


@dataclass
class Rollouts:
    """B = G * K rollouts of `draw_rollouts`, with S stored transitions (z_t -> z_s) each, padded to the largest
    group's atoms (rollout r of group p is row p * K + r)."""

    z_t: torch.Tensor
    """[B, S, N, D] the state before each stored transition."""
    z_s: torch.Tensor
    """[B, S, N, D] the state drawn from it (re-centred, as the sampler keeps it)."""
    steps: torch.Tensor
    """[B, S] long: s of each transition (t = s + 1)."""
    logp_old: torch.Tensor
    """[B, S] log p(z_s | z_t) under the policy that drew them (`gaussian_log_prob`)."""
    final: SampleOutput
    """The decoded molecules."""
    group_size: int = 1
    """K: rollouts per group."""
    clean: SampleOutput | None = None
    """With `RolloutPlan.clean_predictions`: the predicted clean molecule at each stored transition's z_t, B * S
    molecules (row b * S + j: rollout b's transition j)."""

    @property
    def node_mask(self) -> torch.Tensor:
        """[B, N] bool real atoms."""
        return self.final.node_mask

    @property
    def num_groups(self) -> int:
        return self.steps.shape[0] // self.group_size

    def group_transitions(self, group: int) -> dict[str, torch.Tensor]:
        """Group `group`'s K * S transitions without padding (its own atom count), as the policy forward takes them:
        {"z": [K S, n, D] z_t, "s": [K S], "mask": [K S, n] bool, "z_s": [K S, n, D]}."""
        return _group_transitions(self.z_t, self.z_s, self.steps, self.node_mask, self.group_size, group)


def _group_transitions(z_t: torch.Tensor, z_s: torch.Tensor, steps: torch.Tensor, node_mask: torch.Tensor,
                       group_size: int, group: int) -> dict[str, torch.Tensor]:
    rows = slice(group * group_size, (group + 1) * group_size)
    atoms = int(node_mask[group * group_size].sum())
    transitions = steps.shape[1]
    return {"z": z_t[rows, :, :atoms].flatten(0, 1), "s": steps[rows].flatten(),
            "mask": node_mask[rows, :atoms].repeat_interleave(transitions, dim=0),
            "z_s": z_s[rows, :, :atoms].flatten(0, 1)}


@dataclass
class TrainingBatch:
    """What the loss trains on from one micro-batch of rollouts, kept for the optimizer steps that reuse it
    (`RolloutBuffer`): the stored transitions, their log-probabilities under the policy that drew them (as the
    training forward computed them at the drawing step), their advantages, and the logs of the rollouts' rewards."""

    z_t: torch.Tensor
    """[B, S, N, D] the state before each stored transition."""
    z_s: torch.Tensor
    """[B, S, N, D] the state drawn from it."""
    steps: torch.Tensor
    """[B, S] long: s of each transition."""
    node_mask: torch.Tensor
    """[B, N] bool real atoms."""
    logp_old: torch.Tensor
    """[B, S] log p(z_s | z_t) under the drawing policy (the importance ratio's denominator)."""
    advantages: torch.Tensor
    """[B, S] per-transition advantages."""
    logs: dict[str, torch.Tensor]
    """Scalars logged at every step that trains on the batch (reward statistics of its rollouts)."""
    group_size: int = 1

    FIELDS = ("z_t", "z_s", "steps", "node_mask", "logp_old", "advantages")

    @property
    def num_groups(self) -> int:
        return self.steps.shape[0] // self.group_size

    def group_transitions(self, group: int) -> dict[str, torch.Tensor]:
        """As `Rollouts.group_transitions`."""
        return _group_transitions(self.z_t, self.z_s, self.steps, self.node_mask, self.group_size, group)

    def to(self, device: torch.device) -> TrainingBatch:
        """On `device` (itself when already there)."""
        if self.z_t.device == torch.device(device):
            return self
        return TrainingBatch(**{f: getattr(self, f).to(device) for f in self.FIELDS},
                             logs={k: v.to(device) for k, v in self.logs.items()}, group_size=self.group_size)

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """Flat tensors under `prefix` (scalars as [1], as safetensors keeps them)."""
        out = {f"{prefix}{f}": getattr(self, f).detach() for f in self.FIELDS}
        out.update({f"{prefix}log.{k}": v.detach().reshape(1) for k, v in self.logs.items()})
        return out

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], prefix: str, group_size: int) -> TrainingBatch:
        logs = {k[len(prefix) + 4:]: v.reshape(()) for k, v in state.items() if k.startswith(f"{prefix}log.")}
        return cls(**{f: state[f"{prefix}{f}"] for f in cls.FIELDS}, logs=logs, group_size=group_size)


class RolloutBuffer:
    """The micro-batches of rollouts one optimizer step drew, trained on for `epochs` consecutive optimizer steps
    (PPO's epochs over a batch of rollouts; `task.ppo_epochs`).

    The step that draws (the first of a cycle) keeps each micro-batch's `TrainingBatch` in the order the loss sees
    them; the next `epochs - 1` steps take them back in the same order, whatever micro-batches the data gives them.
    `state_dict` holds the cycle while steps of it remain, so a run stopped inside a cycle resumes it exactly. With
    `epochs` = 1 nothing is kept. Used outside the core's step hooks (no `start_step`), every call draws."""

    def __init__(self, epochs: int):
        self.epochs = int(epochs)
        self.entries: list[TrainingBatch] = []
        self.cycle_start = -1
        self.step: int | None = None
        self._calls = 0

    def start_step(self, step: int, micro_batches: int) -> str | None:
        """Before optimizer step `step` (steps done so far) of `micro_batches` loss calls; returns why a kept cycle
        was dropped before its end (another batch layout), else None."""
        self.step, self._calls = int(step), 0
        dropped = None
        if self.entries:
            position = self.step - self.cycle_start
            if not 0 < position < self.epochs:
                self.entries = []
            elif len(self.entries) != micro_batches:
                dropped = (f"the kept rollouts hold {len(self.entries)} micro-batches per step, this step has "
                           f"{micro_batches}")
                self.entries = []
        if not self.entries:
            self.cycle_start = self.step
        return dropped

    @property
    def drawing(self) -> bool:
        """Whether the next loss call draws fresh rollouts (the first step of a cycle, or no step hooks)."""
        return self.step is None or self.step == self.cycle_start

    def next_call(self) -> int:
        """The index of this loss call within its step."""
        index, self._calls = self._calls, self._calls + 1
        return index

    def keep(self, batch: TrainingBatch) -> None:
        """Keep a drawing step's micro-batch for the cycle's later steps (nothing with one epoch)."""
        if self.epochs > 1 and self.step is not None:
            self.entries.append(batch)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The cycle's micro-batches and position while steps of it remain after the last started step; else {}."""
        if not self.entries or self.step is None or self.step + 1 - self.cycle_start >= self.epochs:
            return {}
        out = {"cycle_start": torch.tensor([self.cycle_start]), "epochs": torch.tensor([self.epochs]),
               "micro_batches": torch.tensor([len(self.entries)]),
               "group_size": torch.tensor([self.entries[0].group_size])}
        for i, entry in enumerate(self.entries):
            out.update(entry.state_dict(f"{i}."))
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> str | None:
        """Restore `state_dict`'s cycle ({}: none); returns why a saved cycle was not restored (another number of
        epochs), else None."""
        self.entries, self.cycle_start, self.step = [], -1, None
        if not state:
            return None
        if int(state["epochs"]) != self.epochs:
            return f"they were kept for {int(state['epochs'])} optimizer steps, this run takes {self.epochs}"
        group_size = int(state["group_size"])
        self.cycle_start = int(state["cycle_start"])
        self.entries = [TrainingBatch.from_state_dict(state, f"{i}.", group_size)
                        for i in range(int(state["micro_batches"]))]
        return None


def _pad_nodes(tensor: torch.Tensor, nodes: int, dim: int) -> torch.Tensor:
    """Zero-pad (False for bool) `tensor` along `dim` to `nodes`."""
    missing = nodes - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)], dim=dim)


def _stack_groups(groups: Sequence[Rollouts]) -> Rollouts:
    """One Rollouts of several groups', padded to the largest group's atoms."""
    from trainer.families.molecules_edm.diffusion import SampleOutput

    nodes = max(g.z_t.shape[2] for g in groups)

    def cat(get, dim: int | None = None) -> torch.Tensor:
        return torch.cat([get(g) if dim is None else _pad_nodes(get(g), nodes, dim) for g in groups])

    names = ("positions", "type_index", "atomic_numbers", "charges", "node_mask")
    final = SampleOutput(**{name: cat(lambda g, name=name: getattr(g.final, name), 1) for name in names})
    clean = None
    if groups[0].clean is not None:
        clean = SampleOutput(**{name: cat(lambda g, name=name: getattr(g.clean, name), 1) for name in names})
    return Rollouts(z_t=cat(lambda g: g.z_t, 2), z_s=cat(lambda g: g.z_s, 2), steps=cat(lambda g: g.steps),
                    logp_old=cat(lambda g: g.logp_old), final=final,
                    group_size=groups[0].group_size, clean=clean)


@torch.no_grad()
def draw_rollouts(diffusion: EDMDiffusion, plan: RolloutPlan) -> Rollouts:
    """Sample `plan`'s groups of rollouts with EDM's ancestral sampler, storing the transitions to train.

    Each group is drawn in a batch of its own, at its own atom count: floating-point sums depend on the shapes a
    kernel sees, so a group drawn beside others (padded, in a larger batch) would differ from itself drawn alone in
    the last bits, and the sampler's chain carries such bits into different molecules. Alone, a group is the same
    on every rank, world size and split of the global batch. The steps are `EDMDiffusion.ancestral_step` and
    `decode`, as `sample` takes them, so a group of one rollout with trained_steps = T and generator g for both its
    group and its rollout draws what `sample` draws from g, apart from the draw of the stored steps before the
    first step.
    """
    plan.check(diffusion.T)
    K = plan.group_size
    return _stack_groups([
        _draw_group(diffusion, int(atoms), plan.group_generators[g], plan.rollout_generators[g * K:(g + 1) * K],
                    plan.trained_steps, plan.transitions, plan.clean_predictions)
        for g, atoms in enumerate(plan.num_atoms)])


def _draw_group(diffusion: EDMDiffusion, atoms: int, group_generator: torch.Generator,
                rollout_generators: Sequence[torch.Generator], trained_steps: int, transitions: int,
                clean_predictions: bool = False) -> Rollouts:
    """One group of K = len(rollout_generators) rollouts of `atoms` atoms (no padding)."""
    T, K = diffusion.T, len(rollout_generators)
    device = diffusion.gamma.device
    width = diffusion.n_dims + diffusion.num_features
    # Each rollout's stored steps, as indices among the trained steps (0 = the first trained step).
    picks = torch.stack([torch.randperm(trained_steps, generator=g, device=g.device)[:transitions].cpu()
                         for g in rollout_generators]).sort(dim=1).values
    slot = torch.full((K, trained_steps), -1, dtype=torch.long)
    slot.scatter_(1, picks, torch.arange(transitions).expand(K, -1).contiguous())
    slot = slot.to(device)
    shape = (K, transitions, atoms, width)
    z_t_store, z_s_store = torch.zeros(shape, device=device), torch.zeros(shape, device=device)
    logp_store = torch.zeros((K, transitions), device=device)
    steps_store = torch.zeros((K, transitions), dtype=torch.long, device=device)

    mask = torch.ones((1, atoms), dtype=torch.bool, device=device)
    z = diffusion.molecule_noise([atoms], [group_generator], mask)
    generators, branch_at = [group_generator], T - trained_steps
    for step_index, s in enumerate(reversed(range(T))):
        if step_index == branch_at:  # every rollout continues the group's chain with its own noise
            z, mask, generators = z.expand(K, -1, -1).contiguous(), mask.expand(K, -1), rollout_generators
        z_next, mu, sigma = diffusion.ancestral_step(z, s, mask, [atoms] * len(generators), generators)
        if step_index >= branch_at:
            where = slot[:, step_index - branch_at]
            stored = torch.nonzero(where >= 0).flatten()
            if stored.numel():
                at = where[stored]
                z_t_store[stored, at] = z[stored]
                z_s_store[stored, at] = z_next[stored]
                logp_store[stored, at] = gaussian_log_prob(z_next[stored], mu[stored], sigma, mask[stored])
                steps_store[stored, at] = s
        z = z_next
    final = diffusion.decode(z, [atoms] * K, rollout_generators, mask)
    clean = None
    if clean_predictions:  # the group's transitions in one batch of their own, as the policy forward takes them
        flat_mask = mask.repeat_interleave(transitions, dim=0)
        x0 = diffusion.predict_clean(z_t_store.flatten(0, 1), steps_store.flatten(),
                                     flat_mask.to(torch.float32).unsqueeze(-1))
        clean = diffusion.clean_molecules(x0, flat_mask)
    return Rollouts(z_t=z_t_store, z_s=z_s_store, steps=steps_store, logp_old=logp_store, final=final,
                    group_size=K, clean=clean)


def logp_rounding(z_s: torch.Tensor, mean: torch.Tensor, sigma: torch.Tensor | float,
                  node_mask: torch.Tensor) -> torch.Tensor:
    """[B] how much rounding alone moves `gaussian_log_prob(z_s, mean, sigma)`: its change to first order when every
    element of `mean` moves by one unit in the last place of its float type, sum over the real atoms' features of
    |z_s - mean| ulp(mean) / sigma^2. Two computations of the mean that differ only in the order of their sums (other
    batch shapes, other vector units) give log-probabilities about this far apart: of the order of float32's 1e-7
    relative precision times |z| / sigma per feature, which is large when states are large or steps small."""
    _check_pair(z_s, mean, "logp_rounding(z_s, mean)")
    mask = _node_mask(node_mask, z_s.shape[0], z_s.shape[1], z_s.dtype)
    sigma = _per_molecule(sigma, z_s)
    magnitude = mean.detach().abs()
    ulp = torch.nextafter(magnitude, torch.full_like(magnitude, math.inf)) - magnitude
    return ((z_s - mean.detach()).abs() * ulp / sigma ** 2 * mask).sum(dim=(1, 2))

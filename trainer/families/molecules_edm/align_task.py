"""`molecules_edm_align`: reward post-training of a trained EDM with a force field (`trainer align RUN_DIR`).

The task is the molecules task with another training set and loss. Its training "samples" are prompts: group i of
the pool draws its atom count, its shared start and its rollouts from the seeds of its row (run.seed, epoch, i:
`trainer.sample_random`), so a group is the same on any rank and world size and after a resume. A micro-batch of G
groups draws G * K rollouts through the model (no gradient), scores the final molecules with the reward force field,
normalises the rewards within each group and takes the group-relative clipped policy gradient of the stored
transitions plus the KL to the frozen starting model (`alignment.py`). With task.ppo_epochs > 1 the drawn
transitions are kept (and checkpointed, `StatefulTask`) for the next optimizer steps of their cycle; with
task.shaping_weight > 0 each transition's advantage also gets its potential-based shaped return. Validation and test
are the molecules task's (NLL of the held-out molecules, and samples' stability and validity), so an aligned run
reports how far it moved from the data; `trainer sample` and `trainer export` read an aligned run like any molecules
run.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from trainer.errors import TrainerError
from trainer.families.molecules_edm import alignment as align
from trainer.families.molecules_edm.spec import ALIGN_SPEC, GuidanceOptions, MoleculesEDMAlignConfig
from trainer.families.molecules_edm.task import MoleculesEDMTask
from trainer.registry import register_task
from trainer.sample_random import SampleRandom
from trainer.seeding import derive_seeds
from trainer.task import LossOutput, TaskData

logger = logging.getLogger(__name__)

LOG_RMS_FLOOR = 1e-3
"""eV/Angstrom: force RMS values below it count as it under `task.force_reward=log_rms`."""


class NonFiniteRewardError(TrainerError):
    """A rollout the force field scored has a reward that is not a finite number."""


class PromptPool(Dataset):
    """Group indices 0 .. size - 1: the training set of an alignment (a group's randomness is keyed by its index)."""

    def __init__(self, size: int) -> None:
        self.size = int(size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, int]:
        return {"group": int(index)}


@register_task(ALIGN_SPEC)
class MoleculesEDMAlignTask(MoleculesEDMTask):
    cfg: MoleculesEDMAlignConfig
    progress_logs = ("reward_mean", "force_rms_mean", "kl")

    def __init__(self, cfg: MoleculesEDMAlignConfig, seed: int = 0):
        super().__init__(cfg, seed)
        self.reference: nn.Module | None = None
        self.buffer = align.RolloutBuffer(cfg.ppo_epochs)
        """The rollouts reused for task.ppo_epochs optimizer steps (checkpointed while a cycle has steps left)."""
        self._atom_energies: dict[tuple[str, int], float] = {}

    # ------------------------------------------------------------------ data and model
    def build_data(self) -> TaskData:
        """The molecules task's validation and test molecules and statistics; the prompts to train on."""
        data = super().build_data()
        return TaskData(train=PromptPool(self.cfg.num_groups), eval=data.eval, test=data.test, stats=data.stats)

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if samples and "group" in samples[0]:
            return {"group": torch.tensor([s["group"] for s in samples], dtype=torch.long)}
        return super().collate(samples)  # validation / test molecules

    def batch_size(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["group"].shape[0]) if "group" in batch else super().batch_size(batch)

    def unit_sizes(self, dataset: Dataset) -> None:
        return None  # every group costs the same: fixed batches only

    def keep_reference_model(self, model: nn.Module) -> None:
        """The KL penalty's frozen copy of the starting weights (single-device, never trained)."""
        self.reference = copy.deepcopy(model).eval().requires_grad_(False)

    # ------------------------------------------------------------------ loss
    def rollout_plan(self, rng: SampleRandom) -> align.RolloutPlan:
        """The groups of a micro-batch: each one's atom count and shared start from its "group" stream, rollout r's
        branch from derive_seeds(its "rollouts" stream seed, r)."""
        c = self.cfg
        group_generators = rng.generators("group")
        num_atoms = self._draw_num_atoms(group_generators, self.sample_config_cls())
        rollout_seeds = derive_seeds(rng.stream_seeds("rollouts")[:, None], np.arange(c.group_size)[None, :])
        rollout_generators = [torch.Generator().manual_seed(int(s)) for s in np.asarray(rollout_seeds).reshape(-1)]
        return align.RolloutPlan(num_atoms=num_atoms, group_generators=group_generators,
                                 rollout_generators=rollout_generators, group_size=c.group_size,
                                 trained_steps=c.branched_steps, transitions=c.trained_transitions,
                                 clean_predictions=bool(c.shaping_weight))

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], rng: SampleRandom) -> LossOutput:
        """Rollouts of the micro-batch's groups (through the prepared model, no gradient), their rewards and
        group-normalised advantages, then the clipped policy gradient of the stored transitions plus
        kl_weight x the KL to the frozen start. With task.ppo_epochs = E > 1 the first step of each cycle of E draws
        and keeps its micro-batches' transitions (`alignment.RolloutBuffer`); the next E - 1 steps train on them
        again, in the same order, with the ratio to the drawing step's log-probabilities."""
        c = self.cfg
        if self.reference is None:
            raise RuntimeError("molecules_edm_align: no reference model (the core calls keep_reference_model)")
        call = self.buffer.next_call()
        if self.buffer.drawing:
            kept, logp, policy = self._draw(model, batch, rng)
            # The drawing step's ratio is taken against this forward's own value (exactly 1): the rollout's value is
            # the same density computed in other batch shapes (`logp_drift`), and a later step of the cycle compares
            # with this forward, taken in the batch shapes it takes.
            logp_old = logp.detach()
        else:
            kept = self.buffer.entries[call].to(batch["group"].device)
            groups = [kept.group_transitions(g) for g in range(kept.num_groups)]
            policy = model(groups, mode="policy")
            logp = self._log_probs(groups, policy, kept.steps.shape)
            logp_old = kept.logp_old
        policy_loss, clip_fraction = align.clipped_objective(logp, logp_old, kept.advantages, c.clip)
        device = logp.device
        if c.kl_weight:
            groups = [kept.group_transitions(g) for g in range(kept.num_groups)]
            with torch.no_grad():
                reference = self.reference.to(device)(groups, mode="policy")
            kl = torch.cat([align.kl_to_reference(mu, mu_ref, sigma, g["mask"])
                            for g, (mu, sigma), (mu_ref, _) in zip(groups, policy, reference)]).mean()
            loss = policy_loss + c.kl_weight * kl
        else:
            kl, loss = torch.zeros((), device=device), policy_loss
        evaluations = kept.logs["force_evals_per_group"] if self.buffer.drawing else torch.zeros((), device=device)
        logs = {**kept.logs, "kl": kl.detach(), "clip_fraction": clip_fraction, "policy_loss": policy_loss.detach(),
                "force_evals_per_group": evaluations}
        return LossOutput(loss=loss, logs=logs)

    def _draw(self, model: nn.Module, batch: dict[str, torch.Tensor],
              rng: SampleRandom) -> tuple[align.TrainingBatch, torch.Tensor, list]:
        """Draw and score the micro-batch's rollouts and take the policy forward of their transitions: what the loss
        trains on (kept for the cycle's later steps), the log-probabilities [B, S] (with gradient) and the forward."""
        c = self.cfg
        with torch.no_grad():
            rollouts: align.Rollouts = model(self.rollout_plan(rng), mode="rollout")
            reward, force_rms, valid, clash, scored = self._score(rollouts.final, batch["group"])
            advantages = align.group_advantages(reward, c.group_size, valid, clip=c.advantage_clip)
            evaluations = c.group_size
            shaped = None
            if c.shaping_weight:
                shaped = self._shaped_advantages(rollouts, scored, valid & ~clash)
                evaluations += c.group_size * rollouts.steps.shape[1]
        # The policy forward takes each group alone, as the rollouts drew it (`draw_rollouts`): a group's gradient is
        # then the same whichever groups share its micro-batch, on any number of processes.
        groups = [rollouts.group_transitions(g) for g in range(rollouts.num_groups)]
        policy = model(groups, mode="policy")
        logp = self._log_probs(groups, policy, rollouts.steps.shape)
        # How far the rollout's log-probabilities are from this forward's, in units of what rounding alone makes
        # (`logp_rounding`): the same density computed in other batch shapes.
        rounding = torch.cat([align.logp_rounding(g["z_s"], mu, sigma, g["mask"]) for g, (mu, sigma) in zip(groups, policy)])
        drift = ((logp.detach() - rollouts.logp_old).abs() / rounding.view(logp.shape).clamp(min=1e-30)).mean()
        per_transition = align.step_advantages(advantages.advantages, rollouts.steps, c.lowest_trained_step)
        if shaped is not None:  # on the trained steps only, as the final reward's advantage
            trained = (rollouts.steps >= c.lowest_trained_step).to(shaped.dtype)
            per_transition = (per_transition + c.shaping_weight * shaped.to(per_transition) * trained).clamp(-c.advantage_clip,
                                                                                          c.advantage_clip)
        zero = torch.zeros((), device=logp.device)
        logs = self.step_logs(reward, force_rms, valid, clash, advantages, zero, zero, zero)
        logs = {k: v for k, v in logs.items() if k not in ("kl", "clip_fraction", "policy_loss")}
        logs["logp_drift"] = drift
        logs["force_evals_per_group"] = torch.tensor(float(evaluations), device=logp.device)
        kept = align.TrainingBatch(z_t=rollouts.z_t, z_s=rollouts.z_s, steps=rollouts.steps,
                                   node_mask=rollouts.node_mask, logp_old=logp.detach(), advantages=per_transition,
                                   logs=logs, group_size=c.group_size)
        self.buffer.keep(kept)
        return kept, logp, policy

    @staticmethod
    def _log_probs(groups: list[dict[str, torch.Tensor]], policy: list, shape: torch.Size) -> torch.Tensor:
        """[B, S] log p(z_s | z_t) of the groups' transitions under the policy forward's means."""
        return torch.cat([align.gaussian_log_prob(g["z_s"], mu, sigma, g["mask"])
                          for g, (mu, sigma) in zip(groups, policy)]).view(shape)

    # ------------------------------------------------------------------ state between optimizer steps
    def start_step(self, step: int, micro_batches: int) -> None:
        """Whether this step draws or reuses the kept rollouts (`StatefulTask`)."""
        dropped = self.buffer.start_step(step, micro_batches)
        if dropped:
            logger.warning("task.ppo_epochs: the rollouts kept for the steps after step %d are dropped (%s): step %d "
                           "draws afresh (the resume is not exact)", self.buffer.cycle_start, dropped, step + 1)

    def task_state_dict(self) -> dict[str, torch.Tensor]:
        """The kept rollouts while a reuse cycle has steps left (`StatefulTask`); {} otherwise."""
        return self.buffer.state_dict()

    def load_task_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Restore the kept rollouts of a checkpoint taken inside a reuse cycle (`StatefulTask`)."""
        if state is None:
            self.buffer.load_state_dict({})
            if self.cfg.ppo_epochs > 1:
                logger.warning("task.ppo_epochs: the checkpoint was written by another number of processes, whose "
                               "kept rollouts do not follow this run's micro-batches: if it stopped inside a reuse "
                               "cycle, the first resumed step draws afresh (the resume is not exact)")
            return
        problem = self.buffer.load_state_dict(state)
        if problem:
            logger.warning("task.ppo_epochs: the checkpoint's kept rollouts are dropped (%s): the first resumed step "
                           "draws afresh (the resume is not exact)", problem)

    def step_logs(self, reward: torch.Tensor, force_rms: torch.Tensor, valid: torch.Tensor, clash: torch.Tensor,
                  advantages: align.GroupAdvantages, kl: torch.Tensor, clip_fraction: torch.Tensor,
                  policy_loss: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rewards over the rollouts that count in their groups, force RMS over the sound ones (no clash), fractions
        over all (NaN-free: an all-excluded micro-batch logs 0)."""
        def mean(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            kept = values[rows]
            return kept.mean() if kept.numel() else torch.zeros((), device=values.device)

        scored = self.cfg.group_size - advantages.excluded >= 2
        spread = advantages.spread[scored].mean() if bool(scored.any()) else torch.zeros((), device=reward.device)
        return {"reward_mean": mean(reward, valid), "reward_group_std": spread,
                "force_rms_mean": mean(force_rms, valid & ~clash), "excluded_fraction": (~valid).to(reward.dtype).mean(),
                "clash_fraction": clash.to(reward.dtype).mean(), "kl": kl.detach(),
                "clip_fraction": clip_fraction, "policy_loss": policy_loss.detach()}

    # ------------------------------------------------------------------ reward
    def reward_forcefield(self) -> Any:
        """The reward force field, routed to the fallback for elements it does not model (as guidance does)."""
        c = self.cfg
        return self._guiding_forcefield(GuidanceOptions(
            forcefield=c.reward_forcefield, forcefield_kwargs=dict(c.reward_forcefield_kwargs),
            fallback_forcefield=c.reward_fallback_forcefield))

    def _shaped_advantages(self, rollouts: align.Rollouts, scored: Any, final_ok: torch.Tensor) -> torch.Tensor:
        """[B, S] group-normalised shaped returns of the stored transitions (`alignment.shaped_returns`): the
        potentials of the predicted clean molecules at each z_t (one force evaluation each) and of the final
        molecules (their reward's evaluation). A potential the force field could not give, or of a molecule whose
        atoms clash (whose energy would swamp its group's), leaves its transitions out (shaped advantage 0)."""
        from trainer.families.molecules_edm.forcefields.base import compute_on_device

        c, clean = self.cfg, rollouts.clean
        result = compute_on_device(self.reward_forcefield(), clean.atomic_numbers, clean.positions, clean.node_mask)
        ok = result.ok.to(torch.bool) & ~self._clashes(clean)
        potentials = self._potential(clean, result, ok).view(rollouts.steps.shape)
        final = self._potential(rollouts.final, scored, scored.ok.to(torch.bool) & final_ok)
        returns = align.shaped_returns(potentials, final.to(potentials), rollouts.steps, c.shaping_gamma)
        return align.shaped_advantages(returns, c.group_size, clip=c.advantage_clip)

    def _potential(self, molecules: Any, result: Any, ok: torch.Tensor) -> torch.Tensor:
        """[M] Phi of `task.shaping_potential` for molecules the force field scored (`result`); NaN where not `ok`."""
        if self.cfg.shaping_potential == "energy":
            return -self._energy_per_atom(molecules, result, ok)
        forces = torch.nan_to_num(result.forces, nan=float("inf"))
        potential, _ = align.force_rms_reward(forces, molecules.node_mask, ok)
        if self.cfg.force_reward == "log_rms":
            potential = -torch.log((-potential).clamp(min=LOG_RMS_FLOOR))
        return potential

    def rewards(self, final: Any, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per rollout: the reward, the force RMS (eV/Angstrom), whether it counts in its group and whether its atoms
        clash. With task.close_pair_weight, a molecule whose closest atoms are nearer than `task.close_pair_distance`
        loses that weight times its close-pair penalty. A molecule with two atoms closer than `task.clash_distance`
        is broken: it gets the lowest reward of its group's sound molecules (never better than its own), so
        collapsing atoms, which a force field may refuse to evaluate, is never a way out of a bad score. Any other
        molecule the force field could not evaluate is excluded from its group and counted. A scored molecule whose
        reward is not finite stops the run (NonFiniteRewardError)."""
        return self._score(final, groups)[:4]

    def _score(self, final: Any, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                                Any]:
        """`rewards`, and the force field's result on the final molecules."""
        from trainer.families.molecules_edm.forcefields.base import compute_on_device

        c = self.cfg
        mask = final.node_mask
        result = compute_on_device(self.reward_forcefield(), final.atomic_numbers, final.positions, mask)
        ok = result.ok.to(torch.bool)
        force_reward, _ = align.force_rms_reward(torch.nan_to_num(result.forces, nan=float("inf")), mask)
        force_rms = -force_reward
        if c.force_reward == "log_rms":  # a molecule with no force at all (isolated atoms) gets the floor's log
            force_reward = -torch.log(force_rms.clamp(min=LOG_RMS_FLOOR))
        reward = c.force_weight * force_reward
        if c.energy_weight:
            reward = reward - c.energy_weight * self._energy_per_atom(final, result, ok)
        if c.stability_weight:
            reward = reward + c.stability_weight * self._stable_share(final).to(reward)
        closest = self._closest_pairs(final)
        if c.close_pair_weight:
            reward = reward - c.close_pair_weight * align.close_pair_penalty(closest, c.close_pair_distance).to(reward)
        bad = ok & ~torch.isfinite(reward)
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0])
            group = int(groups[row // c.group_size])
            raise NonFiniteRewardError(
                f"molecules_edm_align: the reward of rollout {row % c.group_size} of group {group} is {float(reward[row])} "
                f"(force RMS {float(force_rms[row])} eV/A from {c.reward_forcefield}): stopping rather than training on it")
        clash = closest < c.clash_distance
        reward = align.apply_clash_rule(reward, ok, clash, c.group_size)
        return reward, force_rms, torch.isfinite(reward), clash, result

    def _clashes(self, final: Any) -> torch.Tensor:
        """[B] bool: two real atoms closer than `task.clash_distance`."""
        return self._closest_pairs(final) < self.cfg.clash_distance

    @staticmethod
    def _closest_pairs(final: Any) -> torch.Tensor:
        """[B] Angstrom between the closest two real atoms of each molecule."""
        from trainer.families.molecules_edm.forcefields.base import closest_pair_distance

        return closest_pair_distance(final.positions.float(), final.node_mask)

    def _energy_per_atom(self, final: Any, result: Any, scored: torch.Tensor) -> torch.Tensor:
        """(E - sum of the isolated atoms' energies) / atoms of each scored molecule (NaN elsewhere), the atoms'
        energies from the force field that scored the molecule (the reward's, or its fallback), each evaluated once."""
        from trainer.families.molecules_edm.forcefields.base import scoring_forcefield

        forcefield = self.reward_forcefield()
        source = result.source.cpu().numpy() if result.source is not None else np.zeros(len(scored), dtype=np.int64)
        numbers, mask = final.atomic_numbers.cpu().numpy(), final.node_mask.cpu().numpy()
        reference = np.full(len(numbers), np.nan)
        for b in np.flatnonzero(scored.cpu().numpy()):
            scorer = scoring_forcefield(forcefield, int(source[b]))
            reference[b] = sum(self._atom_energy(scorer, int(z)) for z in numbers[b][mask[b]])
        atoms = final.node_mask.sum(dim=1).clamp(min=1).to(result.energy)
        return (result.energy - torch.as_tensor(reference, dtype=result.energy.dtype, device=result.energy.device)) / atoms

    def _atom_energy(self, forcefield: Any, number: int) -> float:
        key = (getattr(forcefield, "name", "?"), number)
        if key not in self._atom_energies:
            one = forcefield.compute(np.array([[number]]), np.zeros((1, 1, 3)), np.ones((1, 1), bool))
            if not bool(one.ok[0]):
                raise TrainerError(f"molecules_edm_align: task.energy_weight needs the energy of an isolated atom of "
                                   f"element {number}, which {key[0]} could not evaluate")
            self._atom_energies[key] = float(one.energy[0])
        return self._atom_energies[key]

    @staticmethod
    def _stable_share(final: Any) -> torch.Tensor:
        """Each molecule's share of atoms whose bond orders sum to their valence (EDM's rule)."""
        from trainer.families.molecules_edm.metrics import check_stability

        numbers, positions = final.atomic_numbers.cpu().numpy(), final.positions.double().cpu().numpy()
        mask = final.node_mask.cpu().numpy()
        shares = [float(np.mean(check_stability(numbers[b][mask[b]], positions[b][mask[b]])[0]))
                  for b in range(len(numbers))]
        return torch.tensor(shares, device=final.positions.device)

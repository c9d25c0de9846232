"""`trainer align` (molecules_edm_align): rollouts, rewards and the alignment run through the Trainer.

The objective's pieces (clipped surrogate, group normalisation, KL, force reward) have their hand computations
in test_alignment.py. Here: the rollouts share their group's start and store on-policy transitions; a failed
force evaluation is excluded and counted, a non-finite reward stops with one error; one iteration starts at KL 0,
changes the weights and keeps them finite, and the aligned run samples and exports like any run; 1 and 2
processes give the same update; a run resumed from a checkpoint ends where the uninterrupted one does. With
task.ppo_epochs=2, a run stopped between the two steps that train on one batch of rollouts resumes bit for bit
(the kept rollouts are checkpointed), and 1 and 2 processes still agree.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import ROOT, assert_run_matches, cut_run_back, read_jsonl, reset_accelerate
from safetensors.torch import load_file

from trainer.config import align_config, load_config
from trainer.families.molecules_edm import alignment as align
from trainer.families.molecules_edm.diffusion import build_edm_diffusion

pytestmark = pytest.mark.numerics  # compares log-probabilities and runs' weights (make test: every vector unit)

CONFIG = str(ROOT / "configs" / "molecules_edm" / "edm_tiny.yaml")
QUIET = ["log.progress_bar=false", "log.tensorboard=false"]
# Small and fast: T = 20, 8 trained steps, 3 transitions, groups of 3; springs as the reward (it scores every element),
# its cutoff beyond the barely trained model's atoms (hundreds of Angstrom apart).
ALIGN = ["task.trained_steps=8", "task.transitions=3", "task.group_size=3", "train.per_device_batch_size=2",
         "task.reward_forcefield=springs", "task.reward_forcefield_kwargs.cutoff=10000.0",
         "task.reward_fallback_forcefield=none", "eval.sample_every=0",
         "train.max_steps=2", "ckpt.every_steps=1", *QUIET]


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    """A molecules run of 2 steps (T = 20, with an EMA) to align."""
    from trainer.core.trainer import Trainer

    tmp = tmp_path_factory.mktemp("align")
    cfg = load_config(CONFIG, [f"run.output_dir={tmp / 'source'}", "task.timesteps=20", "train.max_steps=2",
                               "train.epochs=0", "train.per_device_batch_size=8", "eval.every_steps=0",
                               "eval.every_epochs=0", "eval.sample_every=0", "task.val_fraction=0.01",
                               "task.test_fraction=0", f"task.cache_dir={tmp / 'cache'}", *QUIET])
    try:
        Trainer(cfg).fit()
    finally:
        reset_accelerate()
    return tmp / "source"


def aligned(source, out, *extra):
    from trainer.core.trainer import Trainer

    try:
        Trainer(align_config(source, [f"out={out}", *ALIGN, *extra])).fit()
    finally:
        reset_accelerate()
    return out


# ------------------------------------------------------------------ rollouts
def small_diffusion(timesteps: int = 12):
    torch.manual_seed(0)
    return build_edm_diffusion(hidden=16, layers=1, timesteps=timesteps)


def generators(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_reverse_step_per_molecule_steps_equal_one_step_for_all():
    diffusion = small_diffusion()
    z = torch.randn(3, 4, 3 + diffusion.num_features)
    mask = torch.ones(3, 4, 1)
    mu_all, sigma_all = diffusion.reverse_step(z, 5, mask)
    mu_rows, sigma_rows = diffusion.reverse_step(z, torch.tensor([5, 5, 5]), mask)
    torch.testing.assert_close(mu_rows, mu_all, rtol=0, atol=1e-6)
    assert torch.allclose(sigma_rows, sigma_all.expand(3))


def test_rollouts_share_their_group_start_and_store_on_policy_transitions():
    diffusion = small_diffusion()
    trained, K = 5, 3
    plan = align.RolloutPlan(num_atoms=[4, 6], group_generators=generators(1, 2),
                             rollout_generators=generators(*range(10, 16)), group_size=K, trained_steps=trained,
                             transitions=trained)
    out = align.draw_rollouts(diffusion, plan)
    assert out.z_t.shape == (6, trained, 6, 3 + diffusion.num_features)
    # Every stored step is a trained one (s < trained_steps), once per rollout, in sampling order.
    assert torch.equal(out.steps, torch.arange(trained - 1, -1, -1).expand(6, -1))
    # The first trained step starts from the group's shared state; the branches then differ.
    first = out.z_t[:, 0]
    assert torch.equal(first[0], first[1]) and torch.equal(first[1], first[2])
    assert not torch.equal(first[0, :4], first[3, :4])
    assert not torch.equal(out.z_s[0, 0], out.z_s[1, 0])
    # The stored log-probabilities are the policy's: recomputing them at the same weights gives ratio 1.
    mask = out.node_mask.repeat_interleave(trained, dim=0)
    mu, sigma = diffusion.reverse_step(out.z_t.flatten(0, 1), out.steps.flatten(), mask.float().unsqueeze(-1))
    logp = align.gaussian_log_prob(out.z_s.flatten(0, 1), mu, sigma, mask).view(6, trained)
    torch.testing.assert_close(logp, out.logp_old, rtol=1e-5, atol=1e-3)
    # A subset: distinct steps among the trained ones, drawn per rollout.
    few = align.draw_rollouts(diffusion, align.RolloutPlan([4, 6], generators(1, 2), generators(*range(10, 16)),
                                                           K, trained, 2))
    assert few.steps.shape == (6, 2) and bool((few.steps[:, 0] > few.steps[:, 1]).all())
    assert int(few.steps.max()) < trained


def test_clean_predictions_for_shaping_leave_the_rollouts_as_they_are():
    """The shaping's predicted clean molecules come from a forward of their own: the chain, the stored transitions and
    the final molecules are the same bits with and without them (shaping off draws what it drew before)."""
    diffusion = small_diffusion()
    plans = [align.RolloutPlan([4, 6], generators(1, 2), generators(*range(10, 16)), 3, 5, 2, clean_predictions=flag)
             for flag in (False, True)]
    plain, shaped = (align.draw_rollouts(diffusion, plan) for plan in plans)
    for name in ("z_t", "z_s", "steps", "logp_old"):
        assert torch.equal(getattr(plain, name), getattr(shaped, name)), name
    assert torch.equal(plain.final.positions, shaped.final.positions) and plain.clean is None
    clean = shaped.clean  # one molecule per stored transition, rollout b's transition j at row b * S + j
    assert clean.positions.shape == (12, 6, 3) and torch.equal(clean.node_mask, shaped.node_mask.repeat_interleave(2, 0))
    x0 = diffusion.predict_clean(shaped.z_t[4, 1].unsqueeze(0), shaped.steps[4, 1:2], torch.ones(1, 6, 1))
    torch.testing.assert_close(clean.positions[9], x0[0, :, :3], rtol=1e-4, atol=1e-4)


def test_the_final_steps_get_no_advantage_and_groups_report_their_spread():
    steps = torch.tensor([[7, 3, 1], [5, 2, 0]])
    per_transition = align.step_advantages(torch.tensor([1.5, -2.0]), steps, lowest_step=2)
    assert per_transition.tolist() == [[1.5, 1.5, 0.0], [-2.0, -2.0, -0.0]]
    out = align.group_advantages(torch.tensor([1.0, 3.0, float("nan"), 5.0, 5.0, 5.0, 2.0, float("nan"), float("nan")]), 3)
    torch.testing.assert_close(out.spread, torch.tensor([1.0, 0.0, 0.0]))  # population std; one member: no spread


# ------------------------------------------------------------------ rewards
class FakeForceField:
    """Fails the molecules in `failing`; forces of norm `scale` on every atom; energy `energy` (ok or not)."""

    name = "fake"
    supported_numbers = None

    def __init__(self, failing=(), energy=0.0):
        self.failing, self.energy = set(failing), energy

    def compute(self, numbers, positions, mask):
        from trainer.families.molecules_edm.forcefields.base import ForceResult

        batch = len(numbers)
        forces = np.zeros(positions.shape)
        forces[..., 0] = np.arange(1, batch + 1)[:, None] * mask
        ok = np.array([b not in self.failing for b in range(batch)])
        energy = np.where(ok, self.energy, np.nan)
        return ForceResult(energy=energy, forces=np.where(ok[:, None, None], forces, 0.0), ok=ok)

    def close(self):
        pass


def align_task(**options):
    from trainer.families.molecules_edm.align_task import MoleculesEDMAlignTask
    from trainer.families.molecules_edm.spec import MoleculesEDMAlignConfig

    return MoleculesEDMAlignTask(MoleculesEDMAlignConfig(group_size=3, **options))


def final_molecules(batch: int):
    from trainer.families.molecules_edm.diffusion import SampleOutput

    mask = torch.ones(batch, 2, dtype=torch.bool)
    positions = torch.tensor([[0.0, 0.0, 0.0], [1.1, 0.0, 0.0]]).expand(batch, 2, 3).clone()
    numbers = torch.full((batch, 2), 6)
    return SampleOutput(positions=positions, type_index=torch.ones(batch, 2, dtype=torch.long), atomic_numbers=numbers,
                        charges=torch.zeros(batch, 2, dtype=torch.long), node_mask=mask)


def test_failed_evaluations_are_excluded_and_counted():
    task = align_task()
    task.reward_forcefield = lambda: FakeForceField(failing={1, 4, 5})
    reward, force_rms, scored, clash = task.rewards(final_molecules(6), torch.tensor([7, 8]))
    assert not clash.any()
    assert scored.tolist() == [True, False, True, True, False, False]
    assert torch.isnan(reward[~scored]).all()
    torch.testing.assert_close(reward[scored], -force_rms[scored])
    torch.testing.assert_close(force_rms[[0, 2, 3]], torch.tensor([1.0, 3.0, 4.0]))
    advantages = align.group_advantages(reward, 3, scored)
    assert advantages.excluded.tolist() == [1, 2] and advantages.total_excluded == 3
    # Group 2 has one scored rollout left: nothing to compare it with, no signal.
    assert advantages.advantages[3:].abs().sum() == 0 and advantages.advantages[[0, 2]].abs().sum() > 0
    logs = task.step_logs(reward, force_rms, scored, clash, advantages, torch.zeros(()), torch.zeros(()), torch.zeros(()))
    assert float(logs["excluded_fraction"]) == pytest.approx(0.5)
    assert float(logs["force_rms_mean"]) == pytest.approx((1 + 3 + 4) / 3)


def test_clashing_atoms_get_the_worst_reward_of_their_group_not_an_exclusion():
    """Collapsed atoms, which a force field may refuse (ANI-1x below 0.25 A), must not be a way out of a bad score."""
    task = align_task()
    task.reward_forcefield = lambda: FakeForceField(failing={0, 5})
    final = final_molecules(6)
    final.positions[[0, 2], 1] = torch.tensor([0.1, 0.0, 0.0])  # row 0: refused and clashing; row 2: scored, clashing
    final.positions[5, 1] = torch.tensor([0.1, 0.0, 0.0])  # row 5: refused, clashing, in a group with sound rollouts
    reward, force_rms, counted, clash = task.rewards(final, torch.tensor([7, 8]))
    assert clash.tolist() == [True, False, True, False, False, True]
    # Group 1: row 1 (RMS 2) is its only sound rollout; rows 0 and 2 get its reward, row 2 its own if worse (RMS 3).
    assert reward[:3].tolist() == [-2.0, -2.0, -3.0] and counted.all()
    assert reward[5] == -5.0  # the worst of rows 3 and 4 (RMS 4 and 5)


def test_close_pairs_lower_the_reward_before_and_after_the_clash_rule():
    """The close-pair term reaches the near misses the clash rule does not see, and ranks a clash below them."""
    task = align_task(close_pair_weight=2.0, close_pair_distance=1.0)
    task.reward_forcefield = lambda: FakeForceField()
    final = final_molecules(6)  # forces of RMS 1 .. 6; atoms 1.1 A apart
    final.positions[1, 1] = torch.tensor([0.8, 0.0, 0.0])  # a near miss: penalty 0.2
    final.positions[2, 1] = torch.tensor([0.4, 0.0, 0.0])  # a clash: penalty 0.6, and the clash rule
    reward, _, counted, clash = task.rewards(final, torch.tensor([7, 8]))
    assert clash.tolist() == [False, False, True, False, False, False] and counted.all()
    torch.testing.assert_close(reward, torch.tensor([-1.0, -2.4, -4.2, -4.0, -5.0, -6.0]))
    plain = align_task()
    plain.reward_forcefield = lambda: FakeForceField()
    reward, *_ = plain.rewards(final, torch.tensor([7, 8]))
    torch.testing.assert_close(reward[:3], torch.tensor([-1.0, -2.0, -3.0]))  # the clash: its own RMS, below row 1's


def test_a_reward_that_is_not_finite_stops_the_run():
    from trainer.families.molecules_edm.align_task import NonFiniteRewardError

    task = align_task(energy_weight=0.1)
    task.reward_forcefield = lambda: FakeForceField(energy=float("inf"))
    with pytest.raises(NonFiniteRewardError, match="rollout 0 of group 7"):
        task.rewards(final_molecules(3), torch.tensor([7]))


def test_align_config_layers_the_preset_the_aligned_run_and_the_command_line(tmp_path):
    from trainer.errors import ConfigError

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000009").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000009\n")
    (run / "config.yaml").write_text("run: {seed: 7}\ntask: {name: molecules_edm, preset: tiny, timesteps: 50, "
                                     "hidden: 16, val_fraction: 0.2}\ntrain: {max_steps: 999}\n")
    cfg = align_config(run, [f"out={tmp_path / 'new'}", "task.group_size=4"])
    assert (cfg.task.name, cfg.task.timesteps, cfg.task.hidden, cfg.task.val_fraction) == ("molecules_edm_align", 50, 16, 0.2)
    assert cfg.task.group_size == 4 and cfg.train.max_steps == 40  # the alignment's tiny preset, not the run's training
    # The reference is pinned to the checkpoint that was latest when the alignment started.
    pinned = str((run / "checkpoints" / "step_00000009").resolve())
    assert (cfg.run.init_from, cfg.run.seed, cfg.run.output_dir) == (pinned, 7, str(tmp_path / "new"))
    # Another alignment seed keeps the aligned run's split, hence its node-count histogram (sample k's atom count).
    assert align_config(run, [f"out={tmp_path / 'new'}", "run.seed=3"]).task.split_seed == 7
    assert align_config(run, [f"out={tmp_path / 'new'}", "task.split_seed=5"]).task.split_seed == 5
    with pytest.raises(ConfigError, match="needs out=NEW_RUN_DIR"):
        align_config(run, [])
    for same in ([f"out={run}"], [f"out={tmp_path / 'new'}", f"run.output_dir={run}"]):
        with pytest.raises(ConfigError, match="is the aligned run itself"):
            align_config(run, same)
    with pytest.raises(ConfigError, match="untrained_final_steps"):
        align_config(run, [f"out={tmp_path / 'new'}", "task.trained_steps=10", "task.untrained_final_steps=10"])
    with pytest.raises(ConfigError, match="close_pair_distance > 0"):
        align_config(run, [f"out={tmp_path / 'new'}", "task.close_pair_weight=1", "task.close_pair_distance=0"])
    with pytest.raises(ConfigError, match="not a run directory"):
        align_config(tmp_path / "nothing", [f"out={tmp_path / 'new'}"])
    (run / "config.yaml").write_text("task: {name: regression}\n")
    with pytest.raises(ConfigError, match="task 'regression' .* has no alignment task"):
        align_config(run, [f"out={tmp_path / 'new'}"])


# ------------------------------------------------------------------ through the Trainer
def test_one_iteration_starts_at_kl_zero_changes_the_weights_and_samples_like_any_run(source_run, tmp_path):
    out = aligned(source_run, tmp_path / "aligned", "train.max_steps=1", "optim.warmup_steps=0")
    cfg = (out / "config.yaml").read_text()
    assert "molecules_edm_align" in cfg and str(source_run) in cfg and "timesteps: 20" in cfg
    first = next(r for r in read_jsonl(out) if r.get("step") == 1 and "reward_mean" in r)
    assert first["kl"] == 0.0  # the reference is the starting model
    assert np.isfinite(first["reward_mean"]) and first["force_rms_mean"] > 0 and first["excluded_fraction"] == 0
    assert first["grad_norm"] > 0 and first["clip_fraction"] == 0.0  # on-policy: every ratio is 1
    # The rollout's log-probabilities are this forward's to rounding: less than one ulp of the mean apart. This model's
    # states are ~1e5 (untrained), so that is some hundredths of a nat: bits, not a different model or precision.
    assert first["logp_drift"] < 1.0
    start = load_file(source_run / "checkpoints" / "step_00000002" / "ema.safetensors")
    after = load_file(out / "checkpoints" / "step_00000001" / "model.safetensors")
    assert start.keys() <= after.keys()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert max(float((after[k] - start[k]).abs().max()) for k in start) > 0
    from trainer.cli import main

    assert main(["sample", str(out), "num_samples=2", "batch_size=2", "evaluation_forcefield=none", "chains=0",
                 "progress=false", f"out={tmp_path / 'samples'}"]) == 0
    stats = json.loads((tmp_path / "samples.stats.json").read_text())
    assert stats["num_samples"] == 2
    assert main(["export", str(out), "--out", str(tmp_path / "model.safetensors")]) == 0


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_align_like_one(source_run, tmp_path):
    """Global batch of 2 groups: 2 gloo processes x 1 group against 1 process x 2 groups: the same update."""
    from trainer.api import train

    try:
        two = train(align_config(source_run, [f"out={tmp_path / 'two'}", *ALIGN, "train.per_device_batch_size=1",
                                              "train.global_batch_size=2", "eval.every_steps=0"]), num_processes=2)
    finally:
        reset_accelerate()
    assert two.world_size == 2
    one = aligned(source_run, tmp_path / "one")
    weights_one = load_file(one / "checkpoints" / "step_00000002" / "model.safetensors")
    weights_two = load_file(two.latest_checkpoint / "model.safetensors")
    assert max(float((weights_one[k] - weights_two[k]).abs().max()) for k in weights_one) <= 1e-5
    rewards = [{r["step"]: r["reward_mean"] for r in read_jsonl(run) if "reward_mean" in r} for run in (one, two.run_dir)]
    assert rewards[0] == pytest.approx(rewards[1], rel=1e-5)


def test_resume_from_a_checkpoint_ends_where_the_uninterrupted_run_does(source_run, tmp_path):
    """A kill after step 1's checkpoint (`cut_run_back` leaves the run as SIGKILL would): the resumed run redraws the
    same rollouts and ends with the same weights, EMA and per-step losses, bit for bit."""
    reference = aligned(source_run, tmp_path / "reference", "train.ema_decay=0.9")
    killed = cut_run_back(reference, tmp_path / "killed", step=1)
    aligned(source_run, killed, "train.ema_decay=0.9")
    assert_run_matches(reference, killed, tolerance=0.0, steps=2)


def test_rollouts_reused_for_two_steps_resume_bit_for_bit_between_them(source_run, tmp_path):
    """task.ppo_epochs=2: steps 1 and 3 draw, steps 2 and 4 train on the same rollouts again; a kill after step 3's
    checkpoint (inside a cycle) resumes from the checkpointed rollouts and ends with the uninterrupted run's weights,
    bit for bit."""
    reuse = ["task.ppo_epochs=2", "train.max_steps=4", "train.ema_decay=0.9"]
    reference = aligned(source_run, tmp_path / "reference", *reuse)
    records = {r["step"]: r for r in read_jsonl(reference) if "reward_mean" in r}
    # A reusing step logs its rollouts' rewards and evaluates nothing.
    assert [records[s]["force_evals_per_group"] for s in (1, 2, 3, 4)] == [3.0, 0.0, 3.0, 0.0]
    assert records[2]["reward_mean"] == records[1]["reward_mean"] != records[3]["reward_mean"]
    checkpoints = reference / "checkpoints"
    assert (checkpoints / "step_00000003" / "task_state_0.safetensors").is_file()  # inside a cycle: kept
    assert not list((checkpoints / "step_00000004").glob("task_state_*"))  # the cycle is over: nothing to keep
    killed = cut_run_back(reference, tmp_path / "killed", step=3)
    aligned(source_run, killed, *reuse)
    assert_run_matches(reference, killed, tolerance=0.0, steps=4)
    resumed = {r["step"]: r for r in read_jsonl(killed) if "reward_mean" in r}
    assert resumed[4]["force_evals_per_group"] == 0.0 and resumed[4]["reward_mean"] == records[4]["reward_mean"]


def test_one_epoch_keeps_no_rollouts_and_trains_as_before(source_run, tmp_path):
    """task.ppo_epochs=1 (the default) writes no task state and draws at every step."""
    out = aligned(source_run, tmp_path / "one", "task.ppo_epochs=1")
    assert not list((out / "checkpoints").glob("step_*/task_state_*"))
    assert [r["force_evals_per_group"] for r in read_jsonl(out) if "reward_mean" in r] == [3.0, 3.0]


@pytest.mark.parametrize("potential", ["energy", "force"])
def test_shaping_counts_its_force_evaluations_and_trains(source_run, tmp_path, potential):
    """task.shaping_weight > 0: one more force evaluation per stored transition (3 rollouts x (1 + 3 transitions) per
    group), a finite update away from the unshaped one."""
    out = aligned(source_run, tmp_path / potential, "train.max_steps=1", "task.shaping_weight=0.5",
                  f"task.shaping_potential={potential}", "task.shaping_gamma=0.9")
    first = next(r for r in read_jsonl(out) if r.get("step") == 1 and "reward_mean" in r)
    assert first["force_evals_per_group"] == 12.0 and np.isfinite(first["policy_loss"]) and first["grad_norm"] > 0
    after = load_file(out / "checkpoints" / "step_00000001" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in after.values())


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_reusing_rollouts_align_like_one(source_run, tmp_path):
    """task.ppo_epochs=2, global batch of 2 groups: 2 gloo processes x 1 group against 1 process x 2 groups."""
    from trainer.api import train

    reuse = ["task.ppo_epochs=2"]
    try:
        two = train(align_config(source_run, [f"out={tmp_path / 'two'}", *ALIGN, *reuse,
                                              "train.per_device_batch_size=1", "train.global_batch_size=2",
                                              "eval.every_steps=0"]), num_processes=2)
    finally:
        reset_accelerate()
    assert two.world_size == 2
    assert (two.run_dir / "checkpoints" / "step_00000001" / "task_state_1.safetensors").is_file()  # one per rank
    one = aligned(source_run, tmp_path / "one", *reuse)
    weights_one = load_file(one / "checkpoints" / "step_00000002" / "model.safetensors")
    weights_two = load_file(two.latest_checkpoint / "model.safetensors")
    assert max(float((weights_one[k] - weights_two[k]).abs().max()) for k in weights_one) <= 1e-5
    for key in ("reward_mean", "clip_fraction", "force_evals_per_group"):
        logs = [{r["step"]: r[key] for r in read_jsonl(run) if key in r} for run in (one, two.run_dir)]
        assert logs[0] == pytest.approx(logs[1], rel=1e-5), key


def test_a_start_that_does_not_fit_the_model_is_one_error(source_run):
    from trainer.core.checkpoint.export import load_initial_weights
    from trainer.errors import CheckpointError
    from trainer.families.molecules_edm.task import EDMModel

    other = EDMModel(build_edm_diffusion(hidden=16, layers=2, timesteps=20))
    with pytest.raises(CheckpointError, match=r"holds another model than this run's: parameter 'diffusion\.dynamics.* "
                                              r"has shape .*run\.init_from="):
        load_initial_weights(other, source_run)
    fits = EDMModel(build_edm_diffusion(hidden=32, layers=2, timesteps=20))
    assert load_initial_weights(fits, source_run).name == "step_00000002"

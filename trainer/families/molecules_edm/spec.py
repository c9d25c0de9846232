"""`molecules_edm` as the registry knows it without importing torch: the task options, the sampling options
(`trainer sample`, with force-field guidance), presets, unit and metrics. The Task class (`task.py`) is
imported only when a run needs it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainer.errors import ConfigError
from trainer.registry import register_spec
from trainer.task import SampleConfig, TaskConfig, TaskSpec

QM9_ELEMENTS: tuple[str, ...] = ("H", "C", "N", "O", "F")
"""QM9's element vocabulary, in EDM's one-hot order."""
MODEL_PRESETS = {"tiny": {"hidden": 32, "layers": 2}, "small": {"hidden": 128, "layers": 6},
                 "paper": {"hidden": 256, "layers": 9}}
"""EGNN sizes of `task.model_preset`."""


@dataclass
class MoleculesEDMConfig(TaskConfig):
    name: str = "molecules_edm"
    """Registered task name."""
    data_path: str = ""
    """Molecules: .extxyz/.xyz(.gz) or .sdf; GEOM's drugs_crude .msgpack (EDM's 30 lowest-energy conformers per
    molecule, converted in parallel, split by a seeded permutation of the conformers as EDM; set `elements` to
    GEOM-Drugs' 16); empty: the bundled 3,000 QM9 molecules."""
    elements: list = field(default_factory=lambda: list(QM9_ELEMENTS))
    """Element vocabulary in one-hot order (QM9: H C N O F); another element in the data is an error."""
    on_invalid: str = "error"
    """`error`: a bad record (element outside `elements`, NaN, no atoms, atoms too close) stops with its
    file, record and reason; `skip`: it is counted, reported and left out."""
    min_distance: float = 0.5
    """Two atoms closer than this (Angstrom) make a record invalid."""
    val_fraction: float = 0.1
    """Share of molecules (by id hash) for validation."""
    test_fraction: float = 0.1
    """Share of molecules (by id hash) held out for the final test evaluation."""
    split_seed: int = -1
    """Key of the train/validation/test split (-1: run.seed). The training split gives the node-count histogram
    p(N) that sampling draws atom counts from, so `trainer align` keeps the aligned run's split whatever its own
    run.seed: an aligned model samples sample k with sample k's atom count."""
    cache_dir: str = ""
    """Arrow cache folder (empty: the `datasets` cache)."""
    model_preset: str = "tiny"
    """EGNN size: tiny (32 x 2), small (128 x 6) or paper (256 x 9)."""
    hidden: int = 0
    """EGNN width (0: from model_preset)."""
    layers: int = 0
    """EGNN equivariant blocks (0: from model_preset)."""
    timesteps: int = 1000
    """Diffusion steps T (EDM: 1000)."""
    noise_precision: float = 1e-5
    """s of the polynomial_2 schedule: alpha^2 <- (1 - 2s) alpha^2 + s."""

    def validate(self) -> None:
        super().validate()
        if self.on_invalid not in ("error", "skip"):
            raise ConfigError(f"task.on_invalid must be 'error' or 'skip', got {self.on_invalid!r}")
        if self.model_preset not in MODEL_PRESETS:
            raise ConfigError(f"task.model_preset must be one of {sorted(MODEL_PRESETS)}, got {self.model_preset!r}")


@dataclass
class GuidanceOptions:
    scales: list = field(default_factory=list)
    """Guidance scales (Angstrom per eV/Angstrom), e.g. [0.0005,0.0007,0.008]; each set starts from the
    baseline's noise. Empty: the baseline only."""
    forcefield: str = "gfn2"
    """Guiding force field: gfn2 (GFN2-xTB via tblite, a process pool), ani1x (the ANI-1x ensemble, batched on
    the sampler's device; H C N O; `trainer data fetch ani1x`), gfn1, ase:<module.Class>, uma:<name or file>,
    springs."""
    forcefield_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the force field (e.g. {model_index: 0} for one ANI-1x network, {model: 7net-0} for an
    ASE calculator)."""
    fallback_forcefield: str = "gfn2"
    """Guides the molecules with an element the guiding force field does not model (F under ani1x); each set
    counts them (`guidance_scored_<name>`). `none`: they stay unguided (counted as `guidance_unsupported`)."""
    fallback_forcefield_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the fallback force field."""
    types: str = "auto"
    """Atom types the force field sees (the sampler's own types are unchanged): `auto` (default): the argmax over
    the types the guiding force field models when it does not model them all (ani1x: H C N O, not QM9's F; said in
    the start line), else over all of them; `argmax`: over all of them (the seed's rule; in the noisy part of the
    guided phase most molecules then hold an F, which ani1x routes to `fallback_forcefield`, at its speed);
    `forcefield`: over the types the guiding force field models, so the fallback is never needed."""
    max_uncertainty: float = 0.0
    """Skip the push for a molecule whose ensemble energy spread (eV/atom; ani1x's 8 networks) is above this
    on that step, counted as `guidance_uncertain_skips` (0: never skip)."""
    iterations: int = 1
    """Force evaluations per guided step; each moves the atoms by scale/iterations x (1 - sigma_t) x F.
    The cost: molecules x guided steps x iterations x scales force evaluations (printed at the start)."""
    noise_threshold: float = 0.8
    """Guide only steps whose sigma_t is at most this (0.8: the last 632 of 1000 steps)."""
    force_clip: float = 0.0
    """Clip each atom's force norm to this (eV/Angstrom) before the update (0: no clip)."""
    displacement_clip: float = 0.005
    """Clip each atom's displacement per iteration to this (Angstrom; 0: no clip, the seed's rule with
    hh_distance=0). The default keeps strong scales from throwing atoms out of the molecule (`GuidanceConfig`)."""
    step_bound: float = 0.0
    """Bound each atom's move per guided step at step_bound x sigma_t (Angstrom; 0: no bound)."""
    min_distance: float = 0.0
    """Distance floor of the guided move between any two atoms (Angstrom; 0: none)."""
    hh_distance: float = 1.4
    """Distance floor of the guided move between two atoms the force field sees as hydrogen (Angstrom; 0:
    min_distance): keeps strong guidance from pulling hydrogens into H2 (`GuidanceConfig`)."""
    floor_push: bool = True
    """Push every pair below its floor out to it (false: only hold the pairs the push brought closer)."""
    schedule: str = "seed"
    """seed: scale x (1 - sigma_t); fade: that x sigma_t / noise_threshold."""


@dataclass
class MoleculeSampleConfig(SampleConfig):
    """`trainer sample RUN_DIR key=value ...` for molecules_edm."""

    num_samples: int = 64
    """Molecules per set, split over the ranks with exact counts."""
    batch_size: int = 32
    """Molecules sampled together per rank."""
    out: str = ""
    """Output folder (empty: RUN_DIR/samples/molecules)."""
    num_atoms: int = 0
    """Atoms per molecule (0: drawn from the training node-count histogram with the sample's generator)."""
    guidance: GuidanceOptions = field(default_factory=GuidanceOptions)
    """Force-field guidance of the late sampling steps."""
    evaluation_forcefield: str = "gfn2"
    """Force field for the per-molecule force RMS/max and energy metrics (`none`: skip them)."""
    evaluation_forcefield_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the evaluation force field."""
    evaluation_mlff: str = "auto"
    """A machine-learned force field whose view of the final molecules is reported beside the strict one, as
    `mlff_force_rms_mean`, `mlff_energy_spread_mean`, ... per set (ani1x, uma:...). `auto`: the guiding force
    field when it is one (ani1x, uma:) and scales are given; `none`: skip."""
    chains: int = 1
    """Keep the full trajectory of the first this many samples of every set (xyz + PNG strip)."""
    chain_frames: int = 20
    """Frames kept per trajectory (evenly spaced, the final molecule last)."""
    xyz_per_molecule: bool = False
    """Also write one xyz file per molecule."""
    progress: bool = True
    """A progress bar per set and batch on the main process: denoising steps, the guided phase, force
    evaluations per second and failures, with an ETA."""

    def validate(self) -> None:
        super().validate()
        g = self.guidance
        if any(not isinstance(s, (int, float)) or s < 0 for s in g.scales):
            raise ValueError(f"guidance.scales must be numbers >= 0, got {g.scales}")
        if any(s > 0 for s in g.scales) and g.forcefield == "none":
            raise ValueError("guidance.scales > 0 need a guidance.forcefield (gfn2, ani1x, ase:..., uma:..., springs)")
        if g.types not in ("auto", "argmax", "forcefield"):
            raise ValueError(f"guidance.types must be 'auto', 'argmax' or 'forcefield', got {g.types!r}")
        if g.max_uncertainty < 0:
            raise ValueError(f"guidance.max_uncertainty must be >= 0 (eV/atom; 0: never skip), got {g.max_uncertainty}")
        if g.iterations < 1 or not 0 < g.noise_threshold <= 1:
            raise ValueError("guidance.iterations must be >= 1 and guidance.noise_threshold in (0, 1]")
        if self.chains < 0 or self.chain_frames < 2 or self.num_atoms < 0:
            raise ValueError("chains must be >= 0, chain_frames >= 2 and num_atoms >= 0")


@dataclass
class MoleculesEDMAlignConfig(MoleculesEDMConfig):
    """`trainer align RUN_DIR out=NEW_RUN_DIR`: reward post-training of a trained EDM with a force field (Elign's
    group-relative clipped policy gradient, `alignment.py`). The model options come from the aligned run; a
    micro-batch holds `train.per_device_batch_size` groups of `group_size` rollouts."""

    name: str = "molecules_edm_align"
    """Registered task name."""
    group_size: int = 8
    """Rollouts per group (K): they share their start and first reverse steps, and their rewards are normalised
    within the group (the reference: 24)."""
    trained_steps: int = 0
    """The last this many of the T reverse steps branch into the group's rollouts and are trained; the steps before
    are shared by the group. 0: two fifths of `timesteps` (the reference: 400 of 1000)."""
    transitions: int = 32
    """Transitions per rollout in the loss, drawn without replacement among the trained steps (at most all of them,
    as the reference; fewer is an unbiased, cheaper estimate)."""
    untrained_final_steps: int = -1
    """The last this many reverse steps get no advantage (only the KL to the start, which anchors them): they move
    atoms by thousandths of an Angstrom but carry the largest log-probability gradients, which would drown the
    estimate in noise. -1: a tenth of `timesteps`; 0: every branched step, as the reference."""
    clip: float = 2e-3
    """PPO clip of the per-transition probability ratio (the reference: 2e-3)."""
    advantage_clip: float = 5.0
    """Group-normalised advantages are clipped to +-this."""
    kl_weight: float = 0.04
    """Weight of the KL divergence of each trained step to the frozen starting model's step."""
    reward_forcefield: str = "ani1x"
    """Force field of the reward (as `guidance.forcefield`: ani1x, gfn2, gfn1, ase:<module.Class>, uma:<name or
    file>, springs)."""
    reward_forcefield_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the reward force field."""
    reward_fallback_forcefield: str = "gfn2"
    """Scores the molecules with an element the reward force field does not model (F under ani1x); `none`: such a
    molecule is excluded from its group and counted, like a failed evaluation."""
    force_weight: float = 1.0
    """Weight of the force term: minus the RMS of the final molecule's forces (eV/Angstrom), or of its log."""
    force_reward: str = "rms"
    """`rms`: minus the force RMS (the reference); `log_rms`: minus its natural log, so that halving a molecule's
    forces counts the same at 100 and at 1 eV/Angstrom (for a model whose molecules range over decades, where a
    group's few worst molecules would otherwise set every advantage)."""
    energy_weight: float = 0.0
    """Weight of minus the final molecule's energy per atom above its isolated atoms (eV/atom, from the reward force
    field; the reference uses 0.1 on a per-step variant)."""
    stability_weight: float = 0.0
    """Weight of the final molecule's share of stable atoms (EDM's bond-order rule), a bonus in [0, 1]."""
    clash_distance: float = 0.5
    """Angstrom: a rollout with two atoms closer than this is broken and gets the lowest reward of its group's sound
    rollouts (counted as `clash_fraction`) rather than being excluded like a failed evaluation."""
    close_pair_weight: float = 0.0
    """Weight of minus the close-pair penalty of the final molecule, 1 - d / close_pair_distance where its closest two
    real atoms are d < close_pair_distance apart (0 from there on): a graded push away from clashes that also reaches
    the near misses the clash rule does not see (0: off)."""
    close_pair_distance: float = 0.9
    """Angstrom where the close-pair penalty starts: shorter than any bond of the molecules EDM learns (QM9's
    shortest, O-H, is 0.96), and longer than `clash_distance` so that it reaches the near misses."""
    ppo_epochs: int = 1
    """Optimizer steps per batch of rollouts (PPO's epochs): the first step of each cycle draws the rollouts, the
    next ppo_epochs - 1 train on the same transitions again, the probability ratio to the drawing policy clipped at
    `task.clip`. The force field scores each batch once, so rollouts and force evaluations per optimizer step drop
    by this factor; train.max_steps counts optimizer steps. 1: every step draws (the default)."""
    shaping_weight: float = 0.0
    """Weight of potential-based shaping per transition (0: off). Each stored transition's advantage gets this times
    its shaped return-to-go, gamma^t Phi(final molecule) - Phi(predicted clean molecule at z_t) (the telescoped sum of
    the per-transition rewards gamma Phi(s') - Phi(s)), normalised within its group and clipped like the reward's;
    Phi is `task.shaping_potential` under the reward force field. Costs `task.transitions` more force evaluations
    per rollout (logged as `force_evals_per_group`) and one more forward of the stored transitions."""
    shaping_potential: str = "energy"
    """Phi of the shaping: `energy`, minus the energy per atom above the isolated atoms (eV/atom; Elign's); `force`,
    the force term as the reward takes it (minus the force RMS, or minus its log under force_reward=log_rms)."""
    shaping_gamma: float = 1.0
    """Discount of the shaping, in (0, 1] (Elign: 1)."""
    num_groups: int = 1048576
    """Prompts in the pool: the group with index i draws its atom count, start and rollouts from (run.seed, i), so
    step s of a run with global batch G reads groups s * G .. s * G + G - 1 (data.shuffle=false)."""

    @property
    def branched_steps(self) -> int:
        """`trained_steps`, 0 resolved to two fifths of `timesteps` (at least 1)."""
        return self.trained_steps or max(1, (2 * self.timesteps) // 5)

    @property
    def lowest_trained_step(self) -> int:
        """`untrained_final_steps`; -1: a tenth of `timesteps` when fewer than the branched steps, else 0."""
        if self.untrained_final_steps >= 0:
            return self.untrained_final_steps
        tenth = self.timesteps // 10
        return tenth if tenth < self.branched_steps else 0

    @property
    def trained_transitions(self) -> int:
        """`transitions`, at most the branched steps."""
        return min(self.transitions, self.branched_steps)

    def validate(self) -> None:
        super().validate()
        if self.group_size < 2:
            raise ConfigError(f"task.group_size must be >= 2 (advantages compare the rollouts of a group), got {self.group_size}")
        if not 0 <= self.trained_steps <= self.timesteps:
            raise ConfigError(f"task.trained_steps must be in [0, task.timesteps={self.timesteps}], got {self.trained_steps}")
        if self.untrained_final_steps < -1:
            raise ConfigError(f"task.untrained_final_steps must be >= 0 (or -1: a tenth of timesteps), got "
                              f"{self.untrained_final_steps}")
        if self.untrained_final_steps >= self.branched_steps:
            raise ConfigError(f"task.untrained_final_steps={self.untrained_final_steps} leaves none of the "
                              f"{self.branched_steps} branched steps (task.trained_steps) to train")
        if self.transitions < 1:
            raise ConfigError(f"task.transitions must be >= 1, got {self.transitions}")
        if self.clip <= 0 or self.advantage_clip <= 0 or self.kl_weight < 0:
            raise ConfigError("task.clip and task.advantage_clip must be > 0 and task.kl_weight >= 0")
        if self.force_reward not in ("rms", "log_rms"):
            raise ConfigError(f"task.force_reward must be 'rms' or 'log_rms', got {self.force_reward!r}")
        if self.reward_forcefield.strip().lower() in ("", "none"):
            raise ConfigError("task.reward_forcefield must name a force field (ani1x, gfn2, gfn1, ase:..., uma:..., springs)")
        if min(self.force_weight, self.energy_weight, self.stability_weight) < 0 or not (
                self.force_weight or self.energy_weight or self.stability_weight):
            raise ConfigError("task.force_weight, energy_weight and stability_weight must be >= 0, one of them > 0")
        if self.shaping_weight < 0 or self.shaping_potential not in ("energy", "force") or not (
                0 < self.shaping_gamma <= 1):
            raise ConfigError(f"task.shaping_weight must be >= 0, task.shaping_potential 'energy' or 'force' and "
                              f"task.shaping_gamma in (0, 1], got {self.shaping_weight}, {self.shaping_potential!r} "
                              f"and {self.shaping_gamma}")
        if self.close_pair_weight < 0 or self.close_pair_distance <= 0:
            raise ConfigError(f"task.close_pair_weight must be >= 0 and task.close_pair_distance > 0, got "
                              f"{self.close_pair_weight} and {self.close_pair_distance}")
        if self.ppo_epochs < 1:
            raise ConfigError(f"task.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if self.num_groups < 1:
            raise ConfigError(f"task.num_groups must be >= 1, got {self.num_groups}")


PRESETS = {
    "tiny": {"task": {"model_preset": "tiny"},
             "train": {"per_device_batch_size": 64, "epochs": 20, "ema_decay": 0.999, "grad_clip_norm": 1.0},
             "optim": {"lr": 1e-3, "scheduler": "cosine", "warmup_steps": 20, "weight_decay": 1e-12},
             "eval": {"every_epochs": 5, "metric": "nll", "sample_every": 4, "num_samples": 32}},
    # EDM's recipe (main_qm9.py): AdamW(amsgrad, weight decay 1e-12 on every parameter) at a constant lr, its
    # adaptive gradient clipping, an EMA without warm-up.
    "paper": {"task": {"model_preset": "paper"},
              "train": {"per_device_batch_size": 64, "epochs": 3000, "ema_decay": 0.9999, "ema_warmup": "none",
                        "grad_clip_mode": "adaptive", "adaptive_clip_history": 50, "adaptive_clip_initial": 3000.0},
              "optim": {"name": "adamw", "lr": 1e-4, "weight_decay": 1e-12, "decay_all_parameters": True,
                        "amsgrad": True, "scheduler": "constant", "warmup_steps": 0},
              "eval": {"every_epochs": 20, "metric": "nll", "sample_every": 5, "num_samples": 500}},
}
"""Named config layers (`task.preset=NAME`)."""

SPEC = register_spec(TaskSpec(
    name="molecules_edm",
    task="trainer.families.molecules_edm.task:MoleculesEDMTask",
    config_cls=MoleculesEDMConfig,
    presets=PRESETS,
    unit="molecules",
    metrics=("nll", "loss"),
    sample_config_cls=MoleculeSampleConfig,
    requires=("rdkit",),
    extra="molecules_edm",
    aligned_by="molecules_edm_align",
))

_ALIGN_COMMON = {"train": {"ema_decay": 0.0, "grad_clip_norm": 1.0, "epochs": 0.0},
                 "data": {"shuffle": False},
                 "optim": {"weight_decay": 1e-4, "scheduler": "cosine"},
                 "eval": {"every_steps": 0, "every_epochs": 0.0, "metric": "nll", "sample_every": 1},
                 "log": {"every_steps": 1}}

ALIGN_PRESETS = {
    # The tiny model's molecules range over decades of force (log_rms) and a third of its rollouts clash; the KL and
    # stability terms keep a short run from trading structure for force (BENCHMARKS.md, "settings explored").
    "tiny": {"task": {"model_preset": "tiny", "reward_fallback_forcefield": "none", "force_reward": "log_rms",
                      "transitions": 16, "kl_weight": 1.0, "stability_weight": 3.0},
             "train": {**_ALIGN_COMMON["train"], "max_steps": 40, "per_device_batch_size": 8},
             "optim": {**_ALIGN_COMMON["optim"], "lr": 1e-4, "warmup_steps": 5},
             "eval": {**_ALIGN_COMMON["eval"], "num_samples": 32},
             "ckpt": {"every_steps": 20},
             "data": _ALIGN_COMMON["data"], "log": _ALIGN_COMMON["log"]},
    "paper": {"task": {"model_preset": "paper", "group_size": 24, "untrained_final_steps": 0, "transitions": 50},
              "train": {**_ALIGN_COMMON["train"], "max_steps": 1500, "per_device_batch_size": 1, "grad_accum_steps": 4},
              "optim": {**_ALIGN_COMMON["optim"], "lr": 4e-6, "warmup_steps": 60},
              "eval": {**_ALIGN_COMMON["eval"], "num_samples": 256},
              "ckpt": {"every_steps": 100},
              "data": _ALIGN_COMMON["data"], "log": _ALIGN_COMMON["log"]},
}
"""Named layers of `trainer align` (the aligned run's preset when the alignment has one of that name, else `tiny`):
on top of them the aligned run's model options, then the command line."""

ALIGN_SPEC = register_spec(replace(  # sampling, metrics and requirements as the molecules task's
    SPEC, name="molecules_edm_align", task="trainer.families.molecules_edm.align_task:MoleculesEDMAlignTask",
    config_cls=MoleculesEDMAlignConfig, presets=ALIGN_PRESETS, unit="groups", aligned_by=""))

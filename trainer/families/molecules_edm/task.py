"""`molecules_edm`: E(3)-equivariant diffusion (EDM, Hoogeboom et al. 2022) of 3D molecules, with
force-field-guided sampling and EDM's own quality metrics.

Data: extxyz/xyz(.gz), SDF or in-memory `ase.Atoms` (`readers.py`) in the shared Arrow cache
(`dataset.py`); the bundled default is 3,000 QM9 molecules. Training is EDM's l2 noise-prediction
loss; validation reports EDM's variational bound as NLL per molecule (including log p(N) of the
node-count histogram) and, every `eval.sample_every` evaluations, the stability and validity of a
small sample. `trainer sample RUN key=value` draws N molecules split over the ranks, optionally
guided by a force field at several scales from the same noise (paired), and evaluates every set
(`sampling_report.py` writes the files).
"""

from __future__ import annotations

import gzip
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from trainer.data.splits import split_indices
from trainer.errors import ConfigError
from trainer.families.molecules_edm import sampling_report as report
from trainer.families.molecules_edm.dataset import (
    MoleculeRows,
    build_molecule_dataset,
    collate_molecules,
    node_count_histogram,
    training_smiles,
)
from trainer.families.molecules_edm.diffusion import EDMDiffusion
from trainer.families.molecules_edm.egnn import build_egnn_dynamics
from trainer.families.molecules_edm.guidance import ForceGuidance, GuidanceConfig
from trainer.families.molecules_edm.molecule import QM9_ELEMENTS, Molecule
from trainer.families.molecules_edm.readers import bundled_qm9_path
from trainer.registry import register_task
from trainer.task import LossOutput, SampleConfig, Task, TaskConfig, TaskData

logger = logging.getLogger(__name__)

MODEL_PRESETS = {"tiny": {"hidden": 32, "layers": 2}, "small": {"hidden": 128, "layers": 6},
                 "paper": {"hidden": 256, "layers": 9}}
SMILES_ARTIFACT = "training_smiles.txt.gz"


@dataclass
class MoleculesEDMConfig(TaskConfig):
    name: str = "molecules_edm"
    """Registered task name."""
    data_path: str = ""
    """Molecules: .extxyz/.xyz(.gz) or .sdf; empty: the bundled 3,000 QM9 molecules."""
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


@dataclass
class GuidanceOptions:
    scales: list = field(default_factory=list)
    """Guidance scales (Angstrom per eV/Angstrom), e.g. [0.0005,0.0007,0.008]; each set starts from the
    baseline's noise. Empty: the baseline only."""
    forcefield: str = "gfn2"
    """Guiding force field: gfn2 (GFN2-xTB via tblite), gfn1, ase:<module.Class>, uma:<name or file>, springs."""
    forcefield_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the force field (e.g. {model: 7net-0} for an ASE calculator)."""
    iterations: int = 1
    """Force evaluations per guided step; each moves the atoms by scale/iterations x (1 - sigma_t) x F."""
    noise_threshold: float = 0.8
    """Guide only steps whose sigma_t is at most this (0.8: the last 632 of 1000 steps)."""
    force_clip: float = 0.0
    """Clip each atom's force norm to this (eV/Angstrom) before the update (0: no clip)."""
    displacement_clip: float = 0.0
    """Clip each atom's displacement per iteration to this (Angstrom; 0: no clip)."""


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
    chains: int = 1
    """Keep the full trajectory of the first this many samples of every set (xyz + PNG strip)."""
    chain_frames: int = 20
    """Frames kept per trajectory (evenly spaced, the final molecule last)."""
    xyz_per_molecule: bool = False
    """Also write one xyz file per molecule."""

    def validate(self) -> None:
        super().validate()
        g = self.guidance
        if any(not isinstance(s, (int, float)) or s < 0 for s in g.scales):
            raise ValueError(f"guidance.scales must be numbers >= 0, got {g.scales}")
        if any(s > 0 for s in g.scales) and g.forcefield == "none":
            raise ValueError("guidance.scales > 0 need a guidance.forcefield (gfn2, ase:..., uma:..., springs)")
        if g.iterations < 1 or not 0 < g.noise_threshold <= 1:
            raise ValueError("guidance.iterations must be >= 1 and guidance.noise_threshold in (0, 1]")
        if self.chains < 0 or self.chain_frames < 2 or self.num_atoms < 0:
            raise ValueError("chains must be >= 0, chain_frames >= 2 and num_atoms >= 0")


class EDMModel(nn.Module):
    """The diffusion model behind one `forward`, so DDP / DeepSpeed see every call that needs gradients."""

    def __init__(self, diffusion: EDMDiffusion):
        super().__init__()
        self.diffusion = diffusion

    def forward(self, batch: dict[str, torch.Tensor], mode: str = "loss") -> torch.Tensor:
        args = (batch["positions"], batch["one_hot"], batch["charges"], batch["node_mask"])
        if mode == "loss":
            return self.diffusion.training_loss(*args)
        if mode == "nll":
            return self.diffusion.nll(*args)
        raise ValueError(f"mode must be 'loss' or 'nll', got {mode!r}")


@register_task("molecules_edm")
class MoleculesEDMTask(Task):
    config_cls = MoleculesEDMConfig
    sample_config_cls = MoleculeSampleConfig
    unit = "molecules"
    metrics = ("nll", "loss")
    presets = {
        "tiny": {"task": {"model_preset": "tiny"},
                 "train": {"per_device_batch_size": 64, "epochs": 20, "ema_decay": 0.999, "grad_clip_norm": 1.0},
                 "optim": {"lr": 1e-3, "scheduler": "cosine", "warmup_steps": 20, "weight_decay": 1e-12},
                 "eval": {"every_epochs": 5, "metric": "nll", "sample_every": 4, "num_samples": 32}},
        "paper": {"task": {"model_preset": "paper"},
                  "train": {"per_device_batch_size": 64, "epochs": 3000, "ema_decay": 0.9999, "grad_clip_norm": 1.0},
                  "optim": {"lr": 1e-4, "weight_decay": 1e-12},
                  "eval": {"every_epochs": 20, "metric": "nll", "sample_every": 5, "num_samples": 500}},
    }

    def __init__(self, cfg: MoleculesEDMConfig, seed: int = 0):
        super().__init__(cfg, seed)
        if cfg.on_invalid not in ("error", "skip"):
            raise ConfigError(f"task.on_invalid must be 'error' or 'skip', got {cfg.on_invalid!r}")
        if cfg.model_preset not in MODEL_PRESETS:
            raise ConfigError(f"task.model_preset must be one of {sorted(MODEL_PRESETS)}, got {cfg.model_preset!r}")
        self.elements = tuple(str(e) for e in cfg.elements)
        self.train_smiles: set[str] = set()
        self._forcefields: dict[str, Any] = {}

    # ------------------------------------------------------------------ data
    def build_data(self) -> TaskData:
        c = self.cfg
        source = c.data_path or str(bundled_qm9_path())
        full = build_molecule_dataset(source, self.elements, cache_dir=c.cache_dir or None, on_invalid=c.on_invalid,
                                      min_distance=c.min_distance)
        ids = [str(i) for i in full["id"]]
        parts = split_indices(ids, {"train": 1.0 - c.val_fraction - c.test_fraction, "validation": c.val_fraction,
                                    "test": c.test_fraction}, key=self.seed)
        if len(parts["train"]) == 0:
            raise ConfigError(f"{source}: no training molecules left after the validation/test split")
        train = full.select(parts["train"])
        val = full.select(parts["validation"]) if len(parts["validation"]) else None
        test = full.select(parts["test"]) if len(parts["test"]) else None
        self.train_smiles = set(training_smiles(train))
        histogram = node_count_histogram(train)
        stats = {"elements": list(self.elements), "node_count_histogram": {str(n): int(c) for n, c in histogram.items()},
                 "num_train": len(train), "max_atoms": max(int(n) for n in histogram)}
        return TaskData(train=MoleculeRows(train), eval=MoleculeRows(val) if val is not None else None,
                        test=MoleculeRows(test) if test is not None else None, stats=stats)

    def attach_stats(self, stats: dict[str, Any]) -> None:
        super().attach_stats(stats)
        if "elements" in stats and tuple(stats["elements"]) != self.elements:
            raise ConfigError(f"the run was trained on elements {stats['elements']}, task.elements is "
                              f"{list(self.elements)}")
        histogram = {int(n): int(c) for n, c in stats.get("node_count_histogram", {}).items()}
        self.node_counts = np.array(sorted(histogram), dtype=np.int64)
        counts = np.array([histogram[n] for n in self.node_counts], dtype=np.float64)
        self.node_probs = counts / counts.sum() if counts.size else counts
        self.log_p_num_atoms = dict(zip(self.node_counts.tolist(), np.log(self.node_probs).tolist()))

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate_molecules(samples, self.elements)

    def batch_size(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["node_mask"].shape[0])

    def unit_sizes(self, dataset: Dataset) -> np.ndarray:
        return np.asarray(dataset.num_atoms, dtype=np.int64)

    # ------------------------------------------------------------------ model
    def build_model(self, stats: dict[str, Any]) -> nn.Module:
        c = self.cfg
        preset = MODEL_PRESETS[c.model_preset]
        num_types = len(self.elements)
        dynamics = build_egnn_dynamics(num_types + 1, hidden=c.hidden or preset["hidden"],
                                       layers=c.layers or preset["layers"])
        diffusion = EDMDiffusion(dynamics, elements=self.elements, timesteps=c.timesteps,
                                 noise_precision=c.noise_precision)
        return EDMModel(diffusion)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        per_molecule = model(batch, mode="loss")
        return LossOutput(loss=per_molecule.mean())

    def eval_step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        nll = model(batch, mode="nll") - self._log_p_num_atoms(batch["num_atoms"]).to(batch["positions"].device)
        return {"nll": nll, "loss": model(batch, mode="loss")}

    def _log_p_num_atoms(self, num_atoms: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.log_p_num_atoms.get(int(n), -math.inf) for n in num_atoms.tolist()],
                            dtype=torch.float32)

    # ------------------------------------------------------------------ artifacts
    def save_artifacts(self, directory: Path) -> list[str]:
        with gzip.open(directory / SMILES_ARTIFACT, "wt") as f:
            f.writelines(s + "\n" for s in sorted(self.train_smiles))
        return [SMILES_ARTIFACT]

    def load_artifacts(self, directory: Path) -> None:
        path = Path(directory) / SMILES_ARTIFACT
        if path.is_file():
            with gzip.open(path, "rt") as f:
                self.train_smiles = {line.strip() for line in f if line.strip()}

    # ------------------------------------------------------------------ sampling
    def _forcefield(self, spec: str, kwargs: dict[str, Any]) -> Any:
        """Force fields are loaded once per process and reused by every batch and set."""
        from trainer.families.molecules_edm.forcefields import build_forcefield

        key = f"{spec}|{sorted(kwargs.items())}"
        if key not in self._forcefields:
            forcefield = build_forcefield(spec, **kwargs)
            if forcefield is not None:  # start worker pools / load weights now, not inside the timed sampling
                forcefield.compute(np.array([[1, 1]]), np.array([[[0.0, 0.0, 0.0], [0.74, 0.0, 0.0]]]),
                                   np.ones((1, 2), dtype=bool))
            self._forcefields[key] = forcefield
        return self._forcefields[key]

    def _draw_num_atoms(self, generators: list[torch.Generator], options: MoleculeSampleConfig) -> list[int]:
        if options.num_atoms:
            return [options.num_atoms] * len(generators)
        if not self.node_counts.size:
            raise ValueError("the run has no node-count histogram (task_stats.json): pass num_atoms=N")
        cdf = torch.tensor(np.cumsum(self.node_probs), dtype=torch.float64)
        picks = [int(torch.searchsorted(cdf, torch.rand(1, generator=g, device=g.device, dtype=torch.float64).cpu()))
                 for g in generators]
        return [int(self.node_counts[min(i, len(self.node_counts) - 1)]) for i in picks]

    def generate(self, model: nn.Module, generators: list[torch.Generator], options: MoleculeSampleConfig,
                 indices: Any = ()) -> list[dict[str, Any]]:
        """Every set (baseline, then each guidance scale) for the same samples, each set starting from the
        generators' same state: sample k's noise is identical across sets (a paired comparison), and a
        scale of 0 is the baseline bit for bit. Per-molecule force metrics are computed here, on this rank."""
        diffusion: EDMDiffusion = model.diffusion
        num_atoms = self._draw_num_atoms(generators, options)
        start_states = [g.get_state() for g in generators]
        chain_for = sum(1 for k in indices if k < options.chains) if options.chains else 0
        g_opt = options.guidance
        evaluator = (None if options.evaluation_forcefield == "none"
                     else self._forcefield(options.evaluation_forcefield, dict(options.evaluation_forcefield_kwargs)))
        results: list[dict[str, Any]] = [{} for _ in generators]
        for scale in [None, *g_opt.scales]:
            name = report.set_name(scale)
            for g, state in zip(generators, start_states):
                g.set_state(state)
            guide = None
            if scale is not None and scale > 0:
                guide = ForceGuidance(self._forcefield(g_opt.forcefield, dict(g_opt.forcefield_kwargs)),
                                      GuidanceConfig(scale=float(scale), iterations=g_opt.iterations,
                                                     noise_threshold=g_opt.noise_threshold,
                                                     force_clip=g_opt.force_clip or None,
                                                     displacement_clip=g_opt.displacement_clip or None),
                                      self.atomic_numbers)
            started = time.perf_counter()
            out = diffusion.sample(num_atoms, generators, guidance=guide,
                                   chain_frames=options.chain_frames if chain_for else 0, chain_for=chain_for)
            seconds = time.perf_counter() - started
            molecules = self._molecules(out)
            if evaluator is not None:
                from trainer.families.molecules_edm.metrics import forcefield_values

                for mol, values in zip(molecules, forcefield_values(molecules, evaluator)):
                    mol.info.update(values)
            counters = guide.counters() if guide is not None else {}
            for i, mol in enumerate(molecules):
                mol.info["set"] = name
                entry = {"molecule": mol, "seconds": seconds / len(molecules),
                         "counters": {k: v / len(molecules) for k, v in counters.items()}}
                if i < chain_for and out.chains is not None:
                    numbers_of = np.asarray(self.atomic_numbers)
                    entry["chain"] = [Molecule(numbers_of[frame.type_index.cpu().numpy()],
                                               frame.positions.double().cpu().numpy(), {"step": int(frame.step)})
                                      for frame in out.chains[i]]
                results[i][name] = entry
        return results

    @property
    def atomic_numbers(self) -> list[int]:
        from ase.data import atomic_numbers

        return [atomic_numbers[e] for e in self.elements]

    def _molecules(self, out: Any) -> list[Molecule]:
        numbers_of = np.asarray(self.atomic_numbers)
        molecules = []
        for b in range(out.positions.shape[0]):
            mask = out.node_mask[b].bool().cpu().numpy()
            types = out.type_index[b].cpu().numpy()[mask]
            molecules.append(Molecule(numbers_of[types], out.positions[b].double().cpu().numpy()[mask]))
        return molecules

    def eval_sample_config(self, num_samples: int, seed: int) -> MoleculeSampleConfig:
        """Evaluation-time samples: EDM's stability and validity only (no force field, no chains)."""
        return MoleculeSampleConfig(num_samples=num_samples, seed=seed, evaluation_forcefield="none", chains=0)

    def score_samples(self, samples: list[dict[str, Any]], options: MoleculeSampleConfig) -> dict[str, float]:
        from trainer.families.molecules_edm.metrics import evaluate_molecules

        summary, _ = evaluate_molecules([s["baseline"]["molecule"] for s in samples], self.train_smiles or None)
        return {k: float(v) for k, v in summary.items()
                if k in ("atom_stability", "molecule_stability", "validity", "uniqueness", "novelty")}

    def write_samples(self, samples: list[dict[str, Any]], options: MoleculeSampleConfig, out: Path) -> dict[str, Any]:
        from trainer.families.molecules_edm.evaluate import write_molecules_extxyz, write_xyz_per_molecule
        from trainer.families.molecules_edm.metrics import evaluate_molecules, summarize_forcefield_values

        out.mkdir(parents=True, exist_ok=True)
        rows = []
        for scale in [None, *options.guidance.scales]:
            name = report.set_name(scale)
            entries = [s[name] for s in samples]
            molecules = [e["molecule"] for e in entries]
            summary, per_molecule = evaluate_molecules(molecules, self.train_smiles or None)
            for mol, values in zip(molecules, per_molecule):
                mol.info.update({k: v for k, v in values.items() if v is not None})
            write_molecules_extxyz(molecules, out / name / "molecules.extxyz")
            if options.xyz_per_molecule:
                write_xyz_per_molecule(molecules, out / name / "xyz")
            for k, entry in enumerate(entries):
                if "chain" in entry:
                    path = out / "chains" / name / f"sample_{k}.xyz"
                    report.write_xyz_frames(entry["chain"], path, comment=f"{name} sample {k}")
                    report.plot_chain_strip(entry["chain"], path.with_suffix(".png"), title=f"{name}, sample {k}")
            seconds = sum(e["seconds"] for e in entries)
            counters: dict[str, float] = {}
            for e in entries:
                for key, value in e["counters"].items():
                    counters[key] = counters.get(key, 0.0) + value
            row = {"set": name, "scale": 0.0 if scale is None else float(scale), **summary,
                   **summarize_forcefield_values(molecules),
                   "sampling_seconds_per_molecule": seconds / len(entries),
                   **{f"guidance_{k}": round(v, 6) for k, v in counters.items()}}
            if counters.get("forcefield_seconds"):
                row["guidance_forcefield_share"] = counters["forcefield_seconds"] / max(seconds, 1e-12)
                row["guidance_evaluations_per_second"] = counters.get("force_evaluations", 0.0) / counters["forcefield_seconds"]
            rows.append(row)
        report.write_metrics_tables(rows, out)
        report.plot_summary(rows, out / "summary.png")
        return {"out": str(out), "sets": {row["set"]: row for row in rows}}

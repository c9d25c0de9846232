"""`molecules_edm`: E(3)-equivariant diffusion (EDM, Hoogeboom et al. 2022) of 3D molecules, with
force-field-guided sampling and EDM's own quality metrics.

Data: extxyz/xyz(.gz), SDF or in-memory `ase.Atoms` (`readers.py`) in the shared Arrow cache
(`dataset.py`); the bundled default is 3,000 QM9 molecules. Training is EDM's l2 noise-prediction
loss, each molecule's t and noise drawn from the micro-batch's `SampleRandom` (keyed by the molecule: the
same at any world size and accumulation split; the loss's 1 / N_max normalisation still follows the
micro-batch's padded size, as EDM's); validation reports EDM's variational bound as NLL per molecule (including log p(N) of the
node-count histogram; its t, eps and eps_0 keyed by (run seed, molecule id), so an evaluation gives the same
numbers at any eval batch size and world size) and, every `eval.sample_every` evaluations, the stability and validity of a
small sample. `trainer sample RUN key=value` draws N molecules split over the ranks, optionally
guided by a force field at several scales from the same noise (paired), and evaluates every set
(`sampling_report.py` writes the files).
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import sys
import time
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from trainer.data.arrow_cache import column_array, select_rows
from trainer.data.splits import split_indices
from trainer.errors import ConfigError
from trainer.families.molecules_edm import sampling_report as report
from trainer.families.molecules_edm.dataset import (
    MoleculeRows,
    build_molecule_dataset,
    collate_molecules,
    node_count_histogram,
    training_smiles_set,
)
from trainer.families.molecules_edm.diffusion import EDMDiffusion
from trainer.families.molecules_edm.egnn import build_egnn_dynamics
from trainer.families.molecules_edm.geom import build_geom_dataset, geom_split
from trainer.families.molecules_edm.guidance import ForceGuidance, GuidanceConfig, evaluations_line
from trainer.families.molecules_edm.molecule import Molecule
from trainer.families.molecules_edm.readers import bundled_qm9_path
from trainer.families.molecules_edm.spec import MODEL_PRESETS, SPEC, MoleculeSampleConfig, MoleculesEDMConfig
from trainer.registry import register_task
from trainer.sample_random import SampleRandom
from trainer.seeding import derive_seeds
from trainer.task import LossOutput, Task, TaskData

logger = logging.getLogger(__name__)

SMILES_ARTIFACT = "training_smiles.txt.gz"


class EDMModel(nn.Module):
    """The diffusion model behind one `forward`, so DDP / DeepSpeed see every call that needs gradients."""

    def __init__(self, diffusion: EDMDiffusion):
        super().__init__()
        self.diffusion = diffusion

    def forward(self, batch: Any, mode: str = "loss", rng: Any = None) -> Any:
        """`loss` / `nll` of a molecule batch; for reward post-training (`align_task.py`), `rollout` draws the
        rollouts of an `alignment.RolloutPlan` (no gradient) and `policy` gives the reverse step's mean and standard
        deviation of each part of a list of {"z": [M, N, D], "s": [M] steps, "mask": [M, N] bool} (one call, so that
        a wrapped model sees one forward per loss)."""
        if mode == "rollout":
            from trainer.families.molecules_edm.alignment import draw_rollouts

            return draw_rollouts(self.diffusion, batch)
        if mode == "policy":
            return [self.diffusion.reverse_step(part["z"], part["s"], part["mask"].to(torch.float32).unsqueeze(-1))
                    for part in batch]
        args = (batch["positions"], batch["one_hot"], batch["charges"], batch["node_mask"])
        if mode == "loss":
            return self.diffusion.training_loss(*args, rng=rng)
        if mode == "nll":
            return self.diffusion.nll(*args, rng=rng)
        raise ValueError(f"mode must be 'loss', 'nll', 'rollout' or 'policy', got {mode!r}")


@register_task(SPEC)  # options, presets, unit, metrics and sampling options: spec.py
class MoleculesEDMTask(Task):
    cfg: MoleculesEDMConfig

    def __init__(self, cfg: MoleculesEDMConfig, seed: int = 0):
        super().__init__(cfg, seed)  # checks the options (MoleculesEDMConfig.validate)
        self.elements = tuple(str(e) for e in cfg.elements)
        self.train_smiles: AbstractSet[str] = set()  # SortedStrings once the data is built
        self._forcefields: dict[str, Any] = {}

    # ------------------------------------------------------------------ data
    def build_data(self) -> TaskData:
        c = self.cfg
        source = c.data_path or str(bundled_qm9_path())
        split_key = self.seed if c.split_seed < 0 else c.split_seed
        if source.lower().endswith(".msgpack"):  # GEOM (drugs_crude.msgpack): EDM's conformer rule and split
            full = build_geom_dataset(source, self.elements, cache_dir=c.cache_dir or None, on_invalid=c.on_invalid)
            parts = geom_split(len(full), split_key, c.val_fraction, c.test_fraction)
        else:
            full = build_molecule_dataset(source, self.elements, cache_dir=c.cache_dir or None,
                                          on_invalid=c.on_invalid, min_distance=c.min_distance, num_proc=None)
            ids = [str(i) for i in column_array(full, "id").tolist()]  # one Arrow read, not row by row
            parts = split_indices(ids, {"train": 1.0 - c.val_fraction - c.test_fraction,
                                        "validation": c.val_fraction, "test": c.test_fraction}, key=split_key)
        if len(parts["train"]) == 0:
            raise ConfigError(f"{source}: no training molecules left after the validation/test split")
        # narrow (4-byte) indices: a rank keeps these selections for the run and never concatenates them
        train = select_rows(full, parts["train"], narrow=True)
        val = select_rows(full, parts["validation"], narrow=True) if len(parts["validation"]) else None
        test = select_rows(full, parts["test"], narrow=True) if len(parts["test"]) else None
        self.train_smiles = training_smiles_set(train)
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

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], rng: SampleRandom) -> LossOutput:
        """EDM's l2 loss; each molecule's t and noise come from its rows' "time" and "noise" streams."""
        per_molecule = model(batch, mode="loss", rng=rng)
        return LossOutput(loss=per_molecule.mean())

    def eval_step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per molecule: EDM's NLL bound (minus log p(N)) and the training loss, each drawn from the molecule's own
        streams keyed by (run seed, molecule id): the same at every evaluation, batch size and world size."""
        nll_rng = loss_rng = None
        if "molecule_key" in batch:
            keys = batch["molecule_key"].cpu().numpy()
            nll_rng = SampleRandom(derive_seeds(self.seed, "molecules_edm/eval-nll", keys))
            loss_rng = SampleRandom(derive_seeds(self.seed, "molecules_edm/eval-loss", keys))
        nll = model(batch, mode="nll", rng=nll_rng) - self._log_p_num_atoms(batch["num_atoms"]).to(
            batch["positions"].device)
        return {"nll": nll, "loss": model(batch, mode="loss", rng=loss_rng)}

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

    def _guiding_forcefield(self, g_opt: Any) -> Any:
        """The guidance force field; one that models only some elements (ani1x) is routed with the fallback
        (built on the first molecule that needs it)."""
        from trainer.families.molecules_edm.forcefields.routing import RoutedForceField

        primary = self._forcefield(g_opt.forcefield, dict(g_opt.forcefield_kwargs))
        if getattr(primary, "supported_numbers", None) is None:
            return primary
        key = f"routed|{g_opt.forcefield}|{sorted(g_opt.forcefield_kwargs.items())}|{g_opt.fallback_forcefield}|" \
              f"{sorted(g_opt.fallback_forcefield_kwargs.items())}"
        if key not in self._forcefields:
            spec, kwargs = g_opt.fallback_forcefield, dict(g_opt.fallback_forcefield_kwargs)
            fallback = None if spec.strip().lower() == "none" else (lambda: self._forcefield(spec, kwargs))
            name = {"gfn2": "gfn2-xtb", "gfn1": "gfn1-xtb"}.get(spec.strip().lower(), spec.strip())
            self._forcefields[key] = RoutedForceField(primary, fallback, fallback_name=name)
        return self._forcefields[key]

    def _mlff_spec(self, options: MoleculeSampleConfig) -> str | None:
        """The force field of the `mlff_` metrics (`evaluation_mlff`; `auto`: the guiding one when it is an MLFF)."""
        spec = options.evaluation_mlff.strip()
        if spec.lower() == "auto":
            guiding = options.guidance.forcefield.strip()
            is_mlff = guiding.lower() == "ani1x" or guiding.lower().startswith("uma:")
            spec = guiding if is_mlff and any(s > 0 for s in options.guidance.scales) else "none"
        return None if spec.lower() in ("none", "") or spec.lower() == options.evaluation_forcefield.strip().lower() else spec

    @staticmethod
    def _mlff_kwargs(options: MoleculeSampleConfig, spec: str) -> dict[str, Any]:
        """The guiding force field's options when the MLFF view is the same force field, less those that pick
        one network for the pushes (the view is the whole ensemble's, with its spread)."""
        g_opt = options.guidance
        if spec.strip().lower() != g_opt.forcefield.strip().lower():
            return {}
        return {k: v for k, v in g_opt.forcefield_kwargs.items() if k not in ("model_index", "guidance_network")}

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
        guided_steps = int((diffusion.sigma_at(torch.arange(1, diffusion.T + 1)) <= g_opt.noise_threshold).sum())
        first = 0 in indices
        if first:
            self._log_workload(options, guided_steps)
        evaluator = (None if options.evaluation_forcefield == "none"
                     else self._forcefield(options.evaluation_forcefield, dict(options.evaluation_forcefield_kwargs)))
        mlff_spec = self._mlff_spec(options)
        mlff = None if mlff_spec is None else self._forcefield(mlff_spec, self._mlff_kwargs(options, mlff_spec))
        show = bool(options.progress) and _main_process()
        label = f"{indices[0]}-{indices[-1]}" if len(indices) else ""
        results: list[dict[str, Any]] = [{} for _ in generators]
        for scale in [None, *g_opt.scales]:
            name = report.set_name(scale)
            for g, state in zip(generators, start_states):
                g.set_state(state)
            guide = None
            if scale is not None and scale > 0:
                guide = ForceGuidance(self._guiding_forcefield(g_opt),
                                      GuidanceConfig(scale=float(scale), iterations=g_opt.iterations,
                                                     noise_threshold=g_opt.noise_threshold,
                                                     force_clip=g_opt.force_clip or None,
                                                     displacement_clip=g_opt.displacement_clip or None,
                                                     step_bound=g_opt.step_bound or None,
                                                     min_distance=g_opt.min_distance or None,
                                                     hh_distance=g_opt.hh_distance or None,
                                                     floor_push=g_opt.floor_push, schedule=g_opt.schedule,
                                                     max_uncertainty=g_opt.max_uncertainty or None,
                                                     types=g_opt.types),
                                      self.atomic_numbers)
            bar = _StepBar(f"{name} {label}".strip(), diffusion.T, guide, guided_steps) if show else None
            started = time.perf_counter()
            try:
                out = diffusion.sample(num_atoms, generators, guidance=guide,
                                       chain_frames=options.chain_frames if chain_for else 0, chain_for=chain_for,
                                       on_step=bar.step if bar is not None else None)
            finally:
                if bar is not None:
                    bar.close()
            seconds = time.perf_counter() - started
            molecules = self._molecules(out)
            if evaluator is not None:
                from trainer.families.molecules_edm.metrics import forcefield_values

                for mol, values in zip(molecules, forcefield_values(molecules, evaluator)):
                    mol.info.update(values)
            if mlff is not None:
                from trainer.families.molecules_edm.metrics import forcefield_values

                for mol, values in zip(molecules, forcefield_values(molecules, mlff, prefix="mlff_")):
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

    def _log_workload(self, options: MoleculeSampleConfig, guided_steps: int) -> None:
        """At the start (main process): what the sampling will cost, in force evaluations."""
        g = options.guidance
        scales = [s for s in g.scales if s > 0]
        sets = 1 + len(g.scales)
        final = options.num_samples * sets if options.evaluation_forcefield != "none" else 0
        if scales:
            total = options.num_samples * guided_steps * g.iterations * len(scales)
            evaluations = evaluations_line(total, self._guiding_forcefield(g), g.types, self.atomic_numbers)
            logger.info("guided sampling: %d molecules x %d guided steps (sigma_t <= %g) x %d iteration(s) x %d scale(s) "
                        "(the cost grows with each factor) = %s, then %d final-molecule evaluations (%s)",
                        options.num_samples, guided_steps, g.noise_threshold, g.iterations, len(scales), evaluations,
                        final, options.evaluation_forcefield)
        elif final:
            logger.info("sampling: %d molecules x %d set(s), then %d final-molecule evaluations (%s)",
                        options.num_samples, sets, final, options.evaluation_forcefield)

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
        return MoleculeSampleConfig(num_samples=num_samples, seed=seed, evaluation_forcefield="none", chains=0,
                                    progress=False)

    def score_samples(self, samples: list[dict[str, Any]], options: MoleculeSampleConfig) -> dict[str, float]:
        from trainer.families.molecules_edm.metrics import evaluate_molecules

        summary, _ = evaluate_molecules([s["baseline"]["molecule"] for s in samples], self.train_smiles or None)
        return {k: float(v) for k, v in summary.items()
                if k in ("atom_stability", "molecule_stability", "validity", "uniqueness", "novelty")}

    def write_samples(self, samples: list[dict[str, Any]], options: MoleculeSampleConfig, out: Path) -> dict[str, Any]:
        from trainer.families.molecules_edm.evaluate import write_molecules_extxyz, write_xyz_per_molecule
        from trainer.families.molecules_edm.metrics import evaluate_molecules, summarize_forcefield_values
        from trainer.families.molecules_edm.paired import INDEX_KEY

        out.mkdir(parents=True, exist_ok=True)
        rows = []
        for scale in [None, *options.guidance.scales]:
            name = report.set_name(scale)
            entries = [s[name] for s in samples]
            molecules = [e["molecule"] for e in entries]
            summary, per_molecule = evaluate_molecules(molecules, self.train_smiles or None)
            for k, (mol, values) in enumerate(zip(molecules, per_molecule)):
                mol.info.update({key: v for key, v in values.items() if v is not None})
                # Sample k of every set (and of any run sampled with this seed) shares its noise: the key
                # `evaluate-molecules versus=` pairs two files by, whatever was filtered or reordered since.
                mol.info[INDEX_KEY] = k
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
                   **summarize_forcefield_values(molecules, prefix="mlff_"),
                   "sampling_seconds_per_molecule": seconds / len(entries),
                   **{f"guidance_{k}": round(v, 6) if k.endswith("seconds") else int(round(v))
                      for k, v in counters.items()}}
            mlff_spec = self._mlff_spec(options)
            if mlff_spec is not None:
                row["mlff_forcefield"] = mlff_spec
            if counters.get("force_evaluations"):
                row["guidance_failure_rate"] = row["guidance_failures"] / row["guidance_force_evaluations"]
            if counters.get("forcefield_seconds"):
                row["guidance_forcefield_share"] = counters["forcefield_seconds"] / max(seconds, 1e-12)
                row["guidance_evaluations_per_second"] = counters.get("force_evaluations", 0.0) / counters["forcefield_seconds"]
                logger.info("%s", report.guidance_summary(row))
            rows.append(row)
        report.write_metrics_tables(rows, out)
        report.plot_summary(rows, out / "summary.png")
        for row in rows:
            logger.info("%s", report.set_headline(row, options.evaluation_forcefield))
        return {"out": str(out), "sets": {row["set"]: row for row in rows}}


def _main_process() -> bool:
    """Rank 0 by the launcher's environment (the family does not import the distributed machinery)."""
    return os.environ.get("RANK", "0") == "0"


class _StepBar:
    """A progress bar over one set's denoising steps (one sampling call): the guided phase, force evaluations
    per second (force-field time) and failures in its postfix; tqdm's ETA follows the current rate."""

    def __init__(self, name: str, total: int, guide: ForceGuidance | None, guided_steps: int) -> None:
        from tqdm.auto import tqdm

        self.guide, self.guided_steps = guide, guided_steps
        # Below the sample bar on a terminal; in a log file (no cursor moves) one bar after another, each left as
        # its final line (a nested bar there wrote blank lines and cursor-up codes).
        nested = bool(getattr(sys.stderr, "isatty", lambda: False)())  # no stderr at all under pythonw
        self.bar = tqdm(total=total, desc=name, unit="step", leave=not nested, position=1 if nested else 0,
                        dynamic_ncols=True)

    def step(self, done: int) -> None:
        guide = self.guide
        if guide is not None and guide.steps_guided:
            rate = guide.force_evaluations / max(guide.forcefield_seconds, 1e-9)
            self.bar.set_postfix_str(f"guided {guide.steps_guided}/{self.guided_steps}, {rate:.1f} evals/s, "
                                     f"failed {guide.failures}", refresh=False)
        elif guide is not None:
            self.bar.set_postfix_str(f"unguided phase, guided from step {self.bar.total - self.guided_steps + 1}",
                                     refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

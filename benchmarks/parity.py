"""Speed side by side with the reference codes: our training step and loop against SEDD's, EDM's and ComFormer's own,
on one CPU.

Each side runs in a process of its own (importing SEDD's reference changes global TorchScript flags), with the
same torch threads (`--threads`, default 1 and 2), batch, precision (float32) and model size, and the two sides'
runs alternate (ours, reference, ours, reference, ...: `--repeats` pairs) so that a drift of the machine's load
hits both alike. Every run warms up (`--warmup` steps), then times `--steps` steps; the table gives the median.

* **step**: one optimizer step: forward, loss, backward, clipping, optimizer, EMA.
  Ours: `Trainer.train_step` as `Trainer.fit` calls it (a timer wrapped around the bound method of a real
  Trainer built from the family's yaml, ComFormer's from `task.preset=paper` alone; nothing re-implemented).
  SEDD's reference: `losses.get_step_fn(noise, graph, True, optimization_manager(cfg), accum=1)` with its AdamW,
  GradScaler (disabled on CPU) and
  `ExponentialMovingAverage`, called as `run_train.py` calls it. EDM's reference: `train_test.train_epoch` itself,
  from `optim.zero_grad()` to the end of `ema.update_model_average` (loss via `losses.compute_loss_and_nll`,
  backward, `utils.gradient_clipping`, AdamW(amsgrad) step, EMA). ComFormer's reference: the step of ignite's
  `create_supervised_trainer` written out (ignite is not installed: `model.train()`, `zero_grad`, its
  `prepare_pyg_line_graph_batch`, forward, `nn.MSELoss`, backward, AdamW step) and the `scheduler.step()` of its
  ITERATION_COMPLETED handler, with `comformer/train.py`'s own `group_decay` / `setup_optimizer` and the OneCycleLR
  `train_main` builds (scripts/parity/comformer.py loads them).
* **loop**: from one step's start to the next one's: the whole loop, data loading and bookkeeping included.
  Ours: `Trainer.fit` (its DataLoader, collation, logging, checkpoint and stop checks; evaluation and saving off).
  SEDD's reference: `run_train.py`'s loop body (`next(train_iter)['input_ids']`, `train_step_fn(state, batch)`,
  its logging check) over a DataLoader of full-length token blocks (the packed layout its `data.py` makes; the
  token values do not change the cost). EDM's reference: `train_test.train_epoch` over a DataLoader of its own
  `ProcessedDataset` and `PreprocessQM9.collate_fn`, holding the same training molecules ours reads (the bundled
  QM9 sample, exported by our run); wandb, sampling and plotting modules are stubbed (the sampling branch is
  never taken at these settings). ComFormer's reference: that step over a DataLoader of `PygStructureDataset`
  items `(g, g, g, label)` batched by its own `collate_line_graph`, one PyG graph per training crystal of OUR
  dataset (its data pipeline needs jarvis-tools): our graph builder's graphs (the same cache our run reads),
  converted as scripts/parity/comformer.py converts them, targets standardised as its loader gives them.

Both sides run the same recipe where it costs time: SEDD AdamW, norm clipping 1.0, EMA 0.9999, dropout 0.1,
`task.packing=true` on ours (no padding, as the reference's blocks); EDM the paper recipe on both (AdamW with
amsgrad, the adaptive clipping rule, EMA 0.9999 without warm-up: `EDM_PAPER_RECIPE`), l2 loss, T = 1000;
ComFormer `task.preset=paper` against the reference's `train_props.py` recipe (MSE on standardised targets, AdamW
with no decay on biases and norms, OneCycle, no clipping, no EMA), float32 on both. Neither side wraps the model
in DDP (one process).

    TRAINER_REFERENCE_SEDD=/tmp/ref_sedd TRAINER_REFERENCE_EDM=/tmp/ref_edm \
        TRAINER_REFERENCE_COMFORMER=/tmp/ref_comformer \
        python benchmarks/parity.py [--families sedd,edm,comformer] [--threads 1,2] [--out BENCHMARKS.md]
    python benchmarks/parity.py --smoke        # tiny sizes, a few steps, nothing written

A family whose checkout is not named is skipped (said on stderr). `--profile` adds, per family, the top entries
of a `torch.profiler` run of each side's step (one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PARITY_SCRIPTS = ROOT / "scripts" / "parity"

TOPIC = "Speed against the reference implementations"
"""The `## ` topic of BENCHMARKS.md this benchmark's sections go under (`bench_report.write_section`)."""

ENVS = {"sedd": "TRAINER_REFERENCE_SEDD", "edm": "TRAINER_REFERENCE_EDM", "comformer": "TRAINER_REFERENCE_COMFORMER"}
NAMES = {"sedd": "SEDD (protein_sedd)", "edm": "EDM (molecules_edm)", "comformer": "iComFormer (crystals)"}

SEDD = {"hidden_size": 256, "n_heads": 4, "n_blocks": 4, "cond_dim": 128, "dropout": 0.1, "length": 128,
        "batch_size": 8, "lr": 3e-4, "warmup": 2500, "ema": 0.9999, "grad_clip": 1.0}
"""A shrunk `small` DDiT (12 x 768 in the paper) that times in minutes on 2 cores: 4 blocks x 256, 128 tokens x 8."""
SEDD_SMOKE = {**SEDD, "hidden_size": 32, "n_heads": 2, "n_blocks": 1, "cond_dim": 16, "length": 16, "batch_size": 2}

EDM = {"hidden": 128, "layers": 6, "inv_sublayers": 1, "batch_size": 32, "lr": 1e-4, "ema": 0.9999,
       "timesteps": 1000, "noise_schedule": "polynomial_2", "noise_precision": 1e-5,
       "norm_values": [1.0, 4.0, 10.0], "elements": ["H", "C", "N", "O", "F"], "include_charges": True}
"""EDM's QM9 defaults (`main_qm9.py`: nf 128, 6 layers, one sublayer) at batch 32 (QM9: up to 29 atoms)."""
EDM_SMOKE = {**EDM, "hidden": 16, "layers": 1, "batch_size": 4}
EDM_PAPER_RECIPE = ["train.grad_clip_mode=adaptive", "train.adaptive_clip_history=50",
                    "train.adaptive_clip_initial=3000", "train.ema_warmup=none", "optim.amsgrad=true",
                    "optim.weight_decay=1e-12", "optim.decay_all_parameters=true", "optim.scheduler=constant",
                    "optim.warmup_steps=0"]
"""`task.preset=paper`'s optimisation (the reference's `get_optim`, `gradient_clipping` and EMA) over
edm_tiny.yaml's own choices, so both sides do the same work per step."""

COMFORMER_MODEL = ("conv_layers", "edge_layers", "node_features", "edge_features", "triplet_features", "fc_features",
                   "heads")
COMFORMER_PAPER = {"variant": "icomformer", "conv_layers": 4, "edge_layers": 1, "node_features": 256,
                   "edge_features": 256, "triplet_features": 256, "fc_features": 256, "heads": 1, "k": 25,
                   "batch_size": 16, "lr": 1e-3, "weight_decay": 1e-5}
"""The paper's iComFormer (`iComformerConfig`'s defaults: 4 node layers + 1 edge layer, 256 features, k = 25) on
16 crystals of the bundled mlearn Si set, with `task.preset=paper`'s recipe (MSE, AdamW, OneCycle, no clipping).
Seconds a step on one core, too slow for repeated runs of 25 steps on 2 cores: `--comformer-paper` times it."""
COMFORMER = {**COMFORMER_PAPER, "node_features": 64, "edge_features": 64, "triplet_features": 64, "fc_features": 64}
"""The default: the paper's layers, graph (k = 25) and a batch of 16, at 64 features on both sides."""
COMFORMER_SMOKE = {**COMFORMER, "node_features": 16, "edge_features": 16, "triplet_features": 16, "fc_features": 16,
                   "k": 6, "batch_size": 2}
CONFIGS = {"sedd": (SEDD, SEDD_SMOKE), "edm": (EDM, EDM_SMOKE), "comformer": (COMFORMER, COMFORMER_SMOKE)}


# --------------------------------------------------------------------------- timing helpers (workers)
def now() -> tuple[float, float]:
    """(wall, this process's CPU) seconds. With one thread the CPU time of a step is what it computes, whatever
    else the machine runs; the wall time also holds the waits for a core that other jobs took."""
    return time.perf_counter(), time.process_time()


class StepClock:
    """Start and end times of each step (calls of a wrapped function, or marks set by hand): steps from
    (end - start), loop periods from the starts of consecutive steps."""

    def __init__(self) -> None:
        self.starts: list[tuple[float, float]] = []
        self.ends: list[tuple[float, float]] = []

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.starts.append(now())
            out = fn(*args, **kwargs)
            self.ends.append(now())
            return out
        return timed

    def result(self, warmup: int) -> dict[str, list[float]]:
        """Milliseconds (wall: `step_ms`, `loop_ms`; CPU: `step_cpu_ms`, `loop_cpu_ms`) of the steps after
        `warmup`, and of the loop periods that start at them (the last step has no next start: one period fewer)."""
        out = {}
        for suffix, i in (("", 0), ("_cpu", 1)):
            out[f"step{suffix}_ms"] = [(e[i] - s[i]) * 1e3 for s, e in zip(self.starts, self.ends)][warmup:]
            out[f"loop{suffix}_ms"] = [(b[i] - a[i]) * 1e3 for a, b in zip(self.starts, self.starts[1:])][warmup:]
        return out


def trainable(model: Any) -> int:
    """Trainable parameters (EDM's reference keeps its noise schedule as a frozen parameter)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    torch.manual_seed(0)


# --------------------------------------------------------------------------- SEDD workers
def sedd_ours(job: dict[str, Any]) -> dict[str, Any]:
    """Our Trainer on the bundled protein sample (packed blocks), its `train_step` timed; returns the times."""
    from trainer.config import load_config
    from trainer.core.trainer import Trainer
    from trainer.families.protein_sedd import ddit

    c, work = job["config"], Path(job["work"])
    # A preset of this benchmark's size, registered in this process only (the task reads its presets by name).
    ddit.DDIT_PRESETS["parity_bench"] = {k: c[k] for k in ("hidden_size", "n_heads", "n_blocks", "cond_dim")}
    total = job["warmup"] + job["steps"] + 1
    cfg = load_config(str(ROOT / "configs/protein_sedd/sedd_tiny.yaml"), [
        "task.model_preset=parity_bench", f"task.max_length={c['length']}", "task.packing=true",
        f"task.dropout={c['dropout']}", f"task.cache_dir={work}/cache", f"train.per_device_batch_size={c['batch_size']}",
        f"train.max_steps={total}", "train.grad_accum_steps=1", f"train.ema_decay={c['ema']}",
        f"train.grad_clip_norm={c['grad_clip']}", f"optim.lr={c['lr']}", f"optim.warmup_steps={c['warmup']}",
        "eval.every_steps=0", "ckpt.every_steps=0", "log.every_steps=50", "log.tensorboard=false",
        "log.progress_bar=false", f"run.output_dir={work}/ours_run", "run.resume=none"])
    _threads(job["threads"])
    return time_our_trainer(Trainer(cfg), job, lambda trainer: {"vocab": int(trainer.task.graph.dim)})


def iter_batches(trainer: Any) -> Any:
    """One more micro-batch of a Trainer's loader (for the profile)."""
    return trainer.data.micro_batches(trainer.state.step)


def _sedd_reference_parts(job: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(PARITY_SCRIPTS))
    import sedd as parity_sedd  # scripts/parity/sedd.py: the CPU flash-attn stub and the reference's import
    import torch
    from omegaconf import OmegaConf

    c = job["config"]
    ref = parity_sedd.load_reference(job["reference"])
    sys.path.insert(0, job["reference"])
    import losses  # type: ignore[import-not-found]
    from model.ema import ExponentialMovingAverage  # type: ignore[import-not-found]

    cfg = OmegaConf.create({
        "tokens": job["vocab"] - 1, "graph": {"type": "absorb"}, "noise": {"type": "loglinear"},
        "model": {k: c[k] for k in ("hidden_size", "n_heads", "n_blocks", "cond_dim", "dropout")} | {
            "scale_by_sigma": True, "length": c["length"]},
        "optim": {"weight_decay": 0, "optimizer": "AdamW", "lr": c["lr"], "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                  "warmup": c["warmup"], "grad_clip": c["grad_clip"]},
        "training": {"accum": 1, "ema": c["ema"], "log_freq": 50}})
    _threads(job["threads"])
    model = ref["SEDD"](cfg)
    noise = ref["noise_lib"].get_noise(cfg)
    graph = ref["graph_lib"].get_graph(cfg, torch.device("cpu"))
    ema = ExponentialMovingAverage(model.parameters(), decay=cfg.training.ema)
    optimizer = losses.get_optimizer(cfg, [*model.parameters(), *noise.parameters()])
    scaler = torch.cuda.amp.GradScaler()  # as run_train.py; disabled without CUDA
    state = {"optimizer": optimizer, "scaler": scaler, "model": model, "noise": noise, "ema": ema, "step": 0}
    step_fn = losses.get_step_fn(noise, graph, True, losses.optimization_manager(cfg), cfg.training.accum)
    return {"cfg": cfg, "state": state, "step_fn": step_fn, "model": model}


def sedd_reference(job: dict[str, Any]) -> dict[str, Any]:
    """SEDD's step function in `run_train.py`'s loop body over a DataLoader of token blocks; returns the times."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    parts = _sedd_reference_parts(job)
    c, cfg, state = job["config"], parts["cfg"], parts["state"]
    total = job["warmup"] + job["steps"] + 1
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, cfg.tokens, (total * c["batch_size"], c["length"]), generator=g)
    loader = torch.utils.data.DataLoader([{"input_ids": b} for b in blocks], batch_size=c["batch_size"],
                                         shuffle=True, drop_last=True)
    train_iter = iter(loader)
    clock = StepClock()
    train_step_fn = clock.wrap(parts["step_fn"])
    device = torch.device("cpu")
    parts["model"].train()
    if job.get("profile"):
        batch = next(train_iter)["input_ids"].to(device)
        return {"profile": _profile(lambda: parts["step_fn"](state, batch))}
    while state["step"] < total:  # run_train.py's loop body (its evaluation, snapshot and sampling branches off)
        step = state["step"]
        batch = next(train_iter)["input_ids"].to(device)
        loss = train_step_fn(state, batch)
        if step != state["step"] and step % cfg.training.log_freq == 0:
            print(f"step: {step}, training_loss: {loss.item():.5e}")
    return {**clock.result(job["warmup"]), "params": trainable(parts["model"])}


# --------------------------------------------------------------------------- EDM workers
def _edm_config(job: dict[str, Any]) -> Any:
    """Our config: edm_tiny.yaml at the benchmark's sizes, with the paper recipe (`EDM_PAPER_RECIPE`)."""
    from trainer.config import load_config

    c, work = job["config"], Path(job["work"])
    total = job["warmup"] + job["steps"] + 1
    return load_config(str(ROOT / "configs/molecules_edm/edm_tiny.yaml"), [
        f"task.hidden={c['hidden']}", f"task.layers={c['layers']}", f"task.timesteps={c['timesteps']}",
        f"task.cache_dir={work}/cache", f"train.per_device_batch_size={c['batch_size']}", "train.epochs=0",
        f"train.max_steps={total}", f"train.ema_decay={c['ema']}", *EDM_PAPER_RECIPE,
        f"optim.lr={c['lr']}", "eval.every_epochs=0", "eval.every_steps=0", "eval.sample_every=0",
        "ckpt.every_steps=0", "log.every_steps=50", "log.tensorboard=false", "log.progress_bar=false",
        f"run.output_dir={work}/ours_run", "run.resume=none"])


def edm_ours(job: dict[str, Any]) -> dict[str, Any]:
    """Our Trainer on the bundled QM9 sample, its `train_step` timed; also exports the training molecules for the
    reference's loader. Returns the times."""
    import numpy as np
    from safetensors.numpy import save_file

    from trainer.core.trainer import Trainer

    work = Path(job["work"])
    cfg = _edm_config(job)
    _threads(job["threads"])
    trainer = Trainer(cfg)
    molecules = work / "edm_molecules.safetensors"
    if not molecules.is_file():  # the same training molecules, in the reference's padded layout
        rows = trainer.task.build_data().train
        width = max(len(rows[i]["numbers"]) for i in range(len(rows)))
        charges = np.zeros((len(rows), width), np.int64)
        positions = np.zeros((len(rows), width, 3), np.float32)
        for i in range(len(rows)):
            r = rows[i]
            charges[i, :len(r["numbers"])] = r["numbers"]
            positions[i, :len(r["numbers"])] = r["positions"]
        save_file({"charges": charges, "positions": positions,
                   "num_atoms": (charges > 0).sum(1).astype(np.int64)}, str(molecules))
    return time_our_trainer(trainer, job)


def _stub_modules(names: dict[str, list[str]]) -> None:
    """Empty modules with no-op callables under `names` in sys.modules (what `train_test.py` imports but the
    training branch timed here never calls)."""
    import types

    for name, attrs in names.items():
        mod = types.ModuleType(name)
        for a in attrs:
            setattr(mod, a, lambda *args, **kwargs: None)
        sys.modules[name] = mod


def edm_reference(job: dict[str, Any]) -> dict[str, Any]:
    """EDM's `train_test.train_epoch` on the same molecules; returns the times."""
    import contextlib
    import copy
    import io
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(PARITY_SCRIPTS))
    import edm as parity_edm  # scripts/parity/edm.py: the reference's import and its QM9 model builder

    c = job["config"]
    ref = parity_edm.load_reference(job["reference"])
    _stub_modules({"wandb": ["log", "init", "save"], "imageio": [],
                   "qm9.visualizer": ["visualize", "visualize_chain"],
                   "qm9.analyze": ["analyze_stability_for_molecules", "check_stability"],
                   "qm9.sampling": ["sample_chain", "sample", "sample_sweep_conditional"]})
    import train_test  # type: ignore[import-not-found]
    import utils as ref_utils  # type: ignore[import-not-found]
    from equivariant_diffusion import utils as flow_utils  # type: ignore[import-not-found]
    from qm9.data.collate import PreprocessQM9  # type: ignore[import-not-found]
    from qm9.data.dataset_class import ProcessedDataset  # type: ignore[import-not-found]
    from qm9.models import DistributionNodes  # type: ignore[import-not-found]

    _threads(job["threads"])
    model = parity_edm.build_reference(ref, {**c, "layers": c["layers"]})
    model_ema = copy.deepcopy(model)
    ema = flow_utils.EMA(c["ema"])
    optim = torch.optim.AdamW(model.parameters(), lr=c["lr"], amsgrad=True, weight_decay=1e-12)  # qm9.models.get_optim
    queue = ref_utils.Queue()
    queue.add(3000)  # main_qm9.py seeds the adaptive clipping's history so

    data = load_file(str(Path(job["work"]) / "edm_molecules.safetensors"))
    total = job["warmup"] + job["steps"] + 1
    g = torch.Generator().manual_seed(0)
    pick = torch.randperm(len(data["charges"]), generator=g)[: total * c["batch_size"]]
    data = {k: v[pick] for k, v in data.items()}
    histogram = {int(n): int((data["num_atoms"] == n).sum()) for n in data["num_atoms"].unique()}
    with contextlib.redirect_stdout(io.StringIO()):
        nodes_dist = DistributionNodes(histogram)
        dataset = ProcessedDataset(data, included_species=torch.tensor([1, 6, 7, 8, 9]), shuffle=False,
                                   subtract_thermo=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=c["batch_size"], shuffle=True, num_workers=0,
                                         collate_fn=PreprocessQM9(load_charges=True).collate_fn, drop_last=True)
    args = SimpleNamespace(include_charges=True, augment_noise=0, data_augmentation=False, conditioning=[],
                           probabilistic_model="diffusion", ode_regularization=1e-3, clip_grad=True,
                           ema_decay=c["ema"], n_report_steps=1, test_epochs=10, visualize_every_batch=int(1e8),
                           break_train_epoch=False, exp_name="parity_bench")
    if job.get("profile"):
        one = [next(iter(loader))]
        return {"profile": _profile(lambda: _edm_reference_one_step(train_test, args, one, model, model_ema, ema,
                                                                  optim, nodes_dist, queue))}
    # The step: from optim.zero_grad() (the first thing of its step, after the batch's preparation) to the end of
    # the EMA update; the loop period: from one zero_grad to the next.
    clock = StepClock()
    zero_grad, update = optim.zero_grad, ema.update_model_average

    def timed_zero_grad(*a: Any, **k: Any) -> Any:
        clock.starts.append(now())
        return zero_grad(*a, **k)

    def timed_update(*a: Any, **k: Any) -> Any:
        out = update(*a, **k)
        clock.ends.append(now())
        return out

    optim.zero_grad, ema.update_model_average = timed_zero_grad, timed_update
    with contextlib.redirect_stdout(io.StringIO()):  # its per-step report line (n_report_steps 1)
        train_test.train_epoch(args, loader, 1, model, model, model_ema, ema, torch.device("cpu"), torch.float32,
                               None, optim, nodes_dist, queue, None, None)
    return {**clock.result(job["warmup"]), "params": trainable(model)}


def _edm_reference_one_step(train_test: Any, args: Any, one: list[Any], model: Any, model_ema: Any, ema: Any,
                            optim: Any, nodes_dist: Any, queue: Any) -> None:
    import contextlib
    import io

    import torch

    with contextlib.redirect_stdout(io.StringIO()):
        train_test.train_epoch(args, one, 1, model, model, model_ema, ema, torch.device("cpu"), torch.float32, None,
                               optim, nodes_dist, queue, None, None)


# --------------------------------------------------------------------------- ComFormer workers
def _comformer_config(job: dict[str, Any]) -> Any:
    """Our config: `task.preset=paper` on the bundled mlearn Si set, at the benchmark's batch and k; the model's
    sizes are set by :func:`_comformer_sizes`."""
    from trainer.config import load_config

    c, work = job["config"], Path(job["work"])
    total = job["warmup"] + job["steps"] + 1
    return load_config(None, [
        "task.name=crystal_property", "task.preset=paper", f"task.max_neighbors={c['k']}",
        f"task.cache_dir={work}/cache", f"train.per_device_batch_size={c['batch_size']}", "train.epochs=0",
        f"train.max_steps={total}", "train.ema_decay=0", f"optim.lr={c['lr']}",
        f"optim.weight_decay={c['weight_decay']}", "eval.every_epochs=0", "eval.every_steps=0",
        "ckpt.every_steps=0", "ckpt.every_epochs=0", "log.every_steps=50", "log.tensorboard=false",
        "log.progress_bar=false", f"run.output_dir={work}/ours_run", "run.resume=none"])


def _comformer_sizes(config: dict[str, Any]) -> None:
    """Our `paper` model preset at this benchmark's sizes, in this process only (the task builds its model from
    the preset named by `task.model_preset`, which accepts `tiny` and `paper`)."""
    from trainer.families.crystals import comformer

    comformer.COMFORMER_PRESETS["paper"] = {**comformer.COMFORMER_PRESETS["paper"],
                                            **{k: config[k] for k in COMFORMER_MODEL}}


def comformer_ours(job: dict[str, Any]) -> dict[str, Any]:
    """Our Trainer (`task.preset=paper`) on the bundled mlearn Si set, its `train_step` timed; returns the times."""
    from trainer.core.trainer import Trainer

    _comformer_sizes(job["config"])
    cfg = _comformer_config(job)
    _threads(job["threads"])
    return time_our_trainer(Trainer(cfg), job)


def time_our_trainer(trainer: Any, job: dict[str, Any],
                     extra: Callable[[Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run `trainer.fit()` with its `train_step` timed (evaluation and saving off); the times, or with
    job["profile"] the profile of one step."""
    clock = StepClock()
    trainer.train_step = clock.wrap(trainer.train_step)
    trainer.evaluate = lambda split="eval": {}
    trainer.save = lambda best=False, wait=True: None
    trainer.fit()
    if job.get("profile"):
        batch = next(iter_batches(trainer))
        return {"profile": _profile(lambda: trainer.train_step([batch]))}
    return {**clock.result(job["warmup"]), "params": trainable(trainer.model), **(extra(trainer) if extra else {})}


def _load_by_path(name: str, path: Path) -> Any:
    sys.path.insert(0, str(PARITY_SCRIPTS))
    from parity_common import load_module

    return load_module(path, name, register=True)


def _comformer_reference_graphs(parity_comformer: Any, ref: dict[str, Any], job: dict[str, Any]) -> tuple[Any, list]:
    """(the reference's `comformer/graphs.py`, its dataset items `(g, g, g, label)` as `PygStructureDataset`
    returns them): one PyG `Data` per training crystal of OUR dataset (the rows ours trains on, from the same
    cache), converted as scripts/parity/comformer.py converts a batch (`reference_data`), float32, with the
    targets standardised by the training mean and standard deviation (as the reference's loader gives them)."""
    import numpy as np
    import torch
    from torch_geometric.data import Data

    from trainer.families.crystals.dataset import collate_graphs
    from trainer.families.crystals.task import CrystalPropertyTask

    # Its graphs.py imports jarvis-tools at its top (for its graph construction, not used here): stubbed for the
    # import only.
    stubbed = ("jarvis", "jarvis.core", "jarvis.core.specie")
    saved = {name: sys.modules.get(name) for name in stubbed}
    sys.modules.update({name: parity_comformer._stub_module(name) for name in stubbed})
    try:
        graphs = _load_by_path("comformer_reference_graphs",
                               Path(ref["comformer"].__file__).resolve().parents[1] / "graphs.py")
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    cfg = _comformer_config(job)
    rows = CrystalPropertyTask(cfg.task, seed=cfg.run.seed).build_data().train
    targets = np.array([float(np.asarray(rows[i]["target"]).reshape(-1)[0]) for i in range(len(rows))])
    mean, std = targets.mean(), targets.std()
    items = []
    for i in range(len(rows)):
        batch = collate_graphs([rows[i]])
        inputs = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()
                  if isinstance(v, torch.Tensor)}
        data, _, _ = parity_comformer.reference_data(inputs)
        g = Data(x=data.x.float(), edge_index=data.edge_index, edge_attr=data.edge_attr.float(),
                 edge_nei=data.edge_nei.float())
        label = torch.tensor((targets[i] - mean) / std, dtype=torch.float32)
        items.append((g, g, g, label))
    return graphs, items


def comformer_reference(job: dict[str, Any]) -> dict[str, Any]:
    """ComFormer's training step (ignite's `create_supervised_trainer` step written out, ignite not installed:
    `model.train()`, `zero_grad`, `prepare_pyg_line_graph_batch`, forward, `nn.MSELoss`, backward, AdamW step;
    then `scheduler.step()` as its ITERATION_COMPLETED handler) with its own `group_decay` / `setup_optimizer`
    AdamW and the OneCycleLR `train_main` builds, over a DataLoader of its `PygStructureDataset` items and its
    `collate_line_graph`; returns the times."""
    import math
    from types import SimpleNamespace

    import torch
    from torch import nn

    from trainer.families.crystals.reference import REFERENCE_UNUSED

    c = job["config"]
    pc = _load_by_path("parity_comformer", PARITY_SCRIPTS / "comformer.py")
    ref = pc.load_reference(job["reference"])
    train = pc.load_reference_training(ref)
    graphs, items = _comformer_reference_graphs(pc, ref, job)
    _threads(job["threads"])
    model = pc.build_reference(ref, {k: c[k] for k in ("variant", *COMFORMER_MODEL)}).float()
    total = job["warmup"] + job["steps"] + 1
    loader = torch.utils.data.DataLoader(items, batch_size=c["batch_size"], shuffle=True, drop_last=True,
                                         collate_fn=graphs.PygStructureDataset.collate_line_graph, num_workers=0)
    settings = SimpleNamespace(optimizer="adamw", learning_rate=c["lr"], weight_decay=c["weight_decay"])
    optimizer = train.setup_optimizer(train.group_decay(model), settings)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=settings.learning_rate,
                                                    epochs=math.ceil(total / len(loader)),
                                                    steps_per_epoch=len(loader), pct_start=0.3)
    criterion = nn.MSELoss()
    device = torch.device("cpu")

    def update(batch: Any) -> float:  # ignite's supervised training step, then the scheduler's handler
        model.train()
        optimizer.zero_grad()
        x, y = graphs.prepare_pyg_line_graph_batch(batch, device=device)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.item()

    if job.get("profile"):
        batch = next(iter(loader))
        return {"profile": _profile(lambda: update(batch))}
    clock = StepClock()
    step_fn = clock.wrap(update)
    done = 0
    while done < total:  # ignite's epochs: the loader over and over
        for batch in loader:
            step_fn(batch)
            done += 1
            if done == total:
                break
    params = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and n not in REFERENCE_UNUSED)
    return {**clock.result(job["warmup"]), "params": params}


# --------------------------------------------------------------------------- profile
def _profile(step: Any, rows: int = 12) -> str:
    """Top operators (self CPU time) of 5 calls of `step` after 2 warm-up calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


WORKERS = {("sedd", "ours"): sedd_ours, ("sedd", "reference"): sedd_reference,
           ("edm", "ours"): edm_ours, ("edm", "reference"): edm_reference,
           ("comformer", "ours"): comformer_ours, ("comformer", "reference"): comformer_reference}


# --------------------------------------------------------------------------- the parent
def run_worker(job: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run one side in a fresh process with `job['threads']` threads; its result (times, load before and after)."""
    name = f"{job['family']}_{job['side']}_{job['threads']}t_{job.get('rep', 0)}"
    job_file = work / f"{name}.job.json"
    out_file = work / f"{name}.result.json"
    job_file.write_text(json.dumps({**job, "out": str(out_file)}))
    n = str(job["threads"])
    env = {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false"}
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(job_file)], env=env,
                          cwd=str(ROOT), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} worker failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    result = json.loads(out_file.read_text())
    result.update({"load_before": load_before, "load_after": os.getloadavg()[0],
                   "wall_s": time.perf_counter() - started})
    return result


def worker_main(job_file: Path) -> None:
    job = json.loads(job_file.read_text())
    result = WORKERS[(job["family"], job["side"])](job)
    Path(job["out"]).write_text(json.dumps(result))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure(family: str, reference: str, threads: list[int], repeats: int, warmup: int, steps: int, smoke: bool,
            work: Path, log: Any, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Alternate ours and the reference's runs (`repeats` pairs per thread count); the pooled times per side.
    `config`: the family's sizes (default: `CONFIGS`, its smoke sizes with `smoke`)."""
    config = config or CONFIGS[family][1 if smoke else 0]
    base = {"family": family, "config": config, "warmup": warmup, "steps": steps, "work": str(work / family),
            "reference": reference}
    (work / family).mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"config": config, "threads": {}}
    extra: dict[str, Any] = {}
    for n in threads:
        runs: dict[str, list[dict[str, Any]]] = {"ours": [], "reference": []}
        for rep in range(repeats):
            for side in ("ours", "reference"):
                res = run_worker({**base, **extra, "side": side, "threads": n, "rep": rep}, work)
                if side == "ours" and family == "sedd":
                    extra["vocab"] = res["vocab"]
                runs[side].append(res)
                log(f"{family} {side} threads={n} rep={rep}: step {median(res['step_ms']):.1f} ms "
                    f"(CPU {median(res['step_cpu_ms']):.1f}), loop {median(res['loop_ms']):.1f} ms (CPU "
                    f"{median(res['loop_cpu_ms']):.1f}); load {res['load_before']:.1f} -> {res['load_after']:.1f}")
        out["threads"][n] = summarise(runs)
        out["vocab"] = extra.get("vocab")
    return out


MEASURES = ("step_ms", "loop_ms", "step_cpu_ms", "loop_cpu_ms")


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per side: each measure's median over all runs' steps and per run; per measure the speed ours/reference
    (reference ms / ours ms) of each ours-reference pair (the two runs next to each other in time)."""
    out: dict[str, Any] = {side: {"params": rs[0]["params"],
                                  "loads": [(r["load_before"], r["load_after"]) for r in rs],
                                  **{m: median([x for r in rs for x in r[m]]) for m in MEASURES},
                                  **{f"per_run_{m}": [median(r[m]) for r in rs] for m in MEASURES}}
                           for side, rs in runs.items()}
    out["pair_speed"] = {m: [median(r[m]) / median(o[m]) for o, r in zip(runs["ours"], runs["reference"])]
                         for m in MEASURES}
    return out


def profiles(family: str, reference: str, config: dict[str, Any], work: Path, extra: dict[str, Any]) -> dict[str, str]:
    """torch.profiler tables of each side's step (one thread)."""
    base = {"family": family, "config": config, "warmup": 1, "steps": 2, "work": str(work / family),
            "reference": reference, "threads": 1, "profile": True, **extra}
    return {side: run_worker({**base, "side": side, "rep": "profile"}, work)["profile"] for side in ("ours", "reference")}


def describe(family: str, config: dict[str, Any], vocab: int | None) -> str:
    if family == "comformer":
        return (f"iComFormer {config['conv_layers']} node layers + {config['edge_layers']} edge layer x "
                f"{config['node_features']} features ({config['heads']} head), k = {config['k']} with lattice "
                f"self-loops, batch {config['batch_size']} crystals of the bundled mlearn Si set (our graph builder's "
                f"graphs on both sides), `task.preset=paper`'s recipe on both: MSE on standardised targets, AdamW "
                f"lr {config['lr']:g} (weight decay {config['weight_decay']:g}, none on biases and norms), "
                "OneCycle, no clipping, no EMA")
    if family == "sedd":
        return (f"DDiT {config['n_blocks']} blocks x {config['hidden_size']} ({config['n_heads']} heads, cond "
                f"{config['cond_dim']}), vocabulary {vocab} (protein residues + mask), batch {config['batch_size']} x "
                f"{config['length']} tokens, dropout {config['dropout']}, AdamW lr {config['lr']:g}, clip norm "
                f"{config['grad_clip']:g}, EMA {config['ema']:g}")
    return (f"EGNN {config['layers']} blocks x {config['hidden']} ({config['inv_sublayers']} sublayer), batch "
            f"{config['batch_size']} QM9 molecules (bundled sample, up to 29 atoms, padded to each batch's largest), "
            f"T {config['timesteps']}, both sides the paper recipe: AdamW (amsgrad, weight decay 1e-12) lr "
            f"{config['lr']:g}, adaptive clipping (1.5 x mean + 2 x std of the last 50 norms), EMA {config['ema']:g} "
            "without warm-up")


def table(results: dict[str, Any]) -> str:
    """One row per family, thread count and measure (step, loop): wall and CPU ms per side and their speed
    ours/reference, and the speed of each ours-reference pair of runs."""
    rows = ["| family | threads | what | ours ms | reference ms | speed ours/ref | ours CPU ms | reference CPU ms | "
            "speed ours/ref (CPU) | speed per pair (wall; CPU) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for family, res in results.items():
        for n, sides in res["threads"].items():
            o, r = sides["ours"], sides["reference"]
            for what in ("step", "loop"):
                wall, cpu = f"{what}_ms", f"{what}_cpu_ms"
                pairs = "; ".join(", ".join(f"{v:.2f}x" for v in sides["pair_speed"][m]) for m in (wall, cpu))
                rows.append(f"| {NAMES[family]} | {n} | {what} | {o[wall]:.1f} | {r[wall]:.1f} | {r[wall] / o[wall]:.2f}x "
                            f"| {o[cpu]:.1f} | {r[cpu]:.1f} | {r[cpu] / o[cpu]:.2f}x | {pairs} |")
    return "\n".join(rows)


def section(results: dict[str, Any], commits: dict[str, str], args: argparse.Namespace, command: str, now: str,
            cpu: str, loads: list[float], profile_text: dict[str, dict[str, str]]) -> str:
    import torch

    lines = [f"## Parity speed benchmark, {now}", "",
             f"- Machine: {cpu}; torch {torch.__version__}, float32, CPU; 1-min load average {min(loads):.1f} to "
             f"{max(loads):.1f} over the runs (other jobs shared the machine)",
             f"- Command: `{command}`",
             f"- Method: each side in its own process, the two alternating ({args.repeats} pairs per thread count); "
             f"{args.warmup} warm-up steps, then the median of {args.steps} steps per run, pooled over the runs. "
             "step: forward, loss, backward, clipping, optimizer, EMA (ours: `Trainer.train_step`; references: "
             "their own step code); loop: one step's start to the next, data loading included (ours: "
             "`Trainer.fit`; references: their loop bodies). Speed ours/ref = reference ms / ours ms (above 1: "
             "ours faster). CPU ms: the process's CPU time (with one thread it is unaffected by other jobs "
             "taking the cores; with two it also counts OpenMP's spin-waits)."]
    for family, res in results.items():
        p = res["threads"][next(iter(res["threads"]))]
        lines.append(f"- {NAMES[family]} against `{commits[family]}`: {describe(family, res['config'], res.get('vocab'))}; "
                     f"trainable parameters ours {p['ours']['params']:,}, reference {p['reference']['params']:,}")
    lines += ["", table(results), ""]
    for family, prof in profile_text.items():
        for side, text in prof.items():
            lines += [f"{NAMES[family]}, {side}: top operators of 5 steps (one thread, self CPU time):", "", "```",
                      text.strip(), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="sedd,edm,comformer", help="comma-separated: sedd, edm, comformer")
    p.add_argument("--threads", default="1,2", help="torch threads of both sides, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="ours/reference run pairs per thread count")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each run")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (the median is reported)")
    p.add_argument("--comformer-paper", action="store_true",
                   help="ComFormer at the paper's 256 features (default 64: seconds a step at 256)")
    p.add_argument("--profile", action="store_true", help="add torch.profiler tables of each side's step")
    p.add_argument("--json", type=Path, help="write the raw results here")
    p.add_argument("--out", help="add the section to this markdown file (BENCHMARKS.md)")
    p.add_argument("--smoke", action="store_true", help="tiny models, 1 thread, 1 pair, 2+3 steps; nothing written")
    p.add_argument("--work", type=Path, help="working folder (default: a temporary one)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker_main(a.worker)
        return 0
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(PARITY_SCRIPTS))
    from bench_report import command_line, cpu_model, publish_section, utc_now
    from parity_common import reference_commit

    if a.smoke:
        a.threads, a.repeats, a.warmup, a.steps = "1", 1, 2, 3
    threads = [int(t) for t in a.threads.split(",")]
    families = [f.strip() for f in a.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(ENVS))
    if unknown:
        p.error(f"--families: unknown {unknown}; choose from {sorted(ENVS)}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results: dict[str, Any] = {}
    commits: dict[str, str] = {}
    profile_text: dict[str, dict[str, str]] = {}
    loads: list[float] = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="parity-bench-") as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for family in families:
            reference = os.environ.get(ENVS[family])
            if not reference:
                log(f"{family}: skipped ({ENVS[family]} names no reference checkout)")
                continue
            commits[family] = f"{reference_commit(reference)[:7]}"
            config = COMFORMER_PAPER if family == "comformer" and a.comformer_paper and not a.smoke else None
            results[family] = measure(family, reference, threads, a.repeats, a.warmup, a.steps, a.smoke, work, log,
                                      config)
            for sides in results[family]["threads"].values():
                loads += [x for side in ("ours", "reference") for pair in sides[side]["loads"] for x in pair]
            if a.profile:
                extra = {"vocab": results[family]["vocab"]} if family == "sedd" else {}
                profile_text[family] = profiles(family, reference, results[family]["config"], work, extra)
    if not results:
        log("no family measured")
        if a.smoke:
            print("smoke run: nothing written")
        return 0
    text = section(results, commits, a, command_line(), utc_now(), cpu_model(), loads, profile_text)
    if a.json:
        a.json.write_text(json.dumps({"results": results, "commits": commits, "loads": loads}, indent=1))
    publish_section(text, a.out, a.smoke, topic=TOPIC)
    return 0


if __name__ == "__main__":
    sys.exit(main())

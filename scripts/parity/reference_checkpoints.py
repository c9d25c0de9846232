"""Checkpoints in the reference implementations' layouts, written by the reference code, for `trainer import` and
`trainer export --format reference`.

The references are read from checkouts named by ``TRAINER_REFERENCE_SEDD`` (louaaron/Score-Entropy-Discrete-Diffusion,
MIT) and ``TRAINER_REFERENCE_EDM`` (ehoogeboom/e3_diffusion_for_molecules, MIT); nothing is fetched. Each builds its
model from a small config, randomises it (``scripts/parity/sedd.py`` / ``edm.py``), takes two optimizer steps on a
random batch with its own optimizer and EMA, and saves them as its training script does: SEDD's
``checkpoints-meta/checkpoint.pth`` (``utils.save_checkpoint``: optimizer, model, EMA, step) with
``.hydra/config.yaml``, and its hub layout (``save_pretrained``: ``config.json`` + ``model.safetensors``, the EMA
weights as the released models hold); EDM's ``generative_model.npy``, ``generative_model_ema.npy``, ``optim.npy``
(``utils.save_model``) and ``args.pickle`` (the pickled ``argparse.Namespace``). GEARS (snap-stanford/GEARS, MIT,
``TRAINER_REFERENCE_GEARS``): its own ``model_initialize`` builds a ``GEARS_Model`` at the bundled simulated set's
sizes on seeded graphs of its own, randomised (``scripts/parity/gears.py``; no training step), and its
``save_model`` writes ``model.pt`` and ``config.pkl``. ComFormer (divelab/AIRS OpenMat/ComFormer, GPL-3.0, loaded
from ``TRAINER_REFERENCE_COMFORMER``, never copied): the reference's model (``scripts/parity/comformer.py``),
randomised, after two AdamW steps in its train.py's parameter groups with OneCycleLR, saved in ignite's
``checkpoint_N.pt`` layout with ``config.json`` and ``target_stats.json``.

    TRAINER_REFERENCE_SEDD=/tmp/ref_sedd python scripts/parity/reference_checkpoints.py sedd --check
    TRAINER_REFERENCE_SEDD=/tmp/ref_sedd python scripts/parity/reference_checkpoints.py sedd \\
        --write-golden tests/families/protein_sedd/golden_checkpoint
    TRAINER_REFERENCE_EDM=/tmp/ref_edm python scripts/parity/reference_checkpoints.py edm --check
    TRAINER_REFERENCE_EDM=/tmp/ref_edm python scripts/parity/reference_checkpoints.py edm \\
        --write-golden tests/families/molecules_edm/golden_checkpoint
    TRAINER_REFERENCE_GEARS=/tmp/ref_gears python scripts/parity/reference_checkpoints.py gears \\
        --write-golden tests/families/perturbation_gears/golden_checkpoint
    TRAINER_REFERENCE_COMFORMER=/tmp/ref_comformer python scripts/parity/reference_checkpoints.py comformer \\
        --write-golden tests/families/crystals/golden_checkpoint

``--check`` writes a reference checkpoint at a size our task builds, imports it into a run folder (``trainer
import``), checks the run's weights, EMA, optimizer state and step against the source, exports the run back
(``trainer export --format reference``) and loads that with the reference's own loaders (SEDD: ``load_model_local``,
``restore_checkpoint`` with its optimizer, ``SEDD.from_pretrained``; EDM: ``qm9.models.get_model`` from the
exported ``args.pickle``, then ``load_state_dict(strict=True)``; GEARS: ``GEARS.load_pretrained``; ComFormer:
its model from the exported ``config.json``), comparing every tensor. ``--write-golden DIR`` writes the small
golden checkpoint the tests read without the reference, with ``meta.json`` (repository, commit, licence).
Importing SEDD changes global TorchScript flags: run this in a process of its own.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from parity_common import reference_commit  # noqa: E402

# The golden checkpoints: small (tens of KB), every layer kind of the parity configs.
SEDD_CONFIG: dict[str, Any] = {
    "ngpus": 1, "tokens": 23,
    "model": {"name": "custom", "type": "ddit", "hidden_size": 8, "cond_dim": 4, "length": 12, "n_blocks": 2,
              "n_heads": 2, "scale_by_sigma": True, "dropout": 0.0},
    "graph": {"type": "absorb", "file": "data", "report_all": False},
    "noise": {"type": "loglinear", "sigma_min": 1e-4, "sigma_max": 20},
    "training": {"batch_size": 4, "accum": 1, "n_iters": 10, "ema": 0.9, "weight": "standard"},
    "optim": {"weight_decay": 0.0, "optimizer": "AdamW", "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
              "warmup": 5, "grad_clip": 1.0},
}
EDM_ARGS: dict[str, Any] = {
    "exp_name": "golden", "model": "egnn_dynamics", "probabilistic_model": "diffusion", "diffusion_steps": 50,
    "diffusion_noise_schedule": "polynomial_2", "diffusion_noise_precision": 1e-5, "diffusion_loss_type": "l2",
    "n_epochs": 10, "batch_size": 4, "lr": 1e-3, "condition_time": True, "clip_grad": True, "n_layers": 2,
    "inv_sublayers": 1, "nf": 16, "tanh": True, "attention": True, "norm_constant": 1, "sin_embedding": False,
    "dataset": "qm9", "remove_h": False, "include_charges": True, "normalize_factors": [1, 4, 10],
    "normalization_factor": 1, "aggregation_method": "sum", "conditioning": [], "ema_decay": 0.9,
    "context_node_nf": 0, "current_epoch": 1,
}
STEPS = 2
SEED = 1234


def _load_script(name: str) -> Any:
    return _load_file(HERE / f"{name}.py", f"_{name}_parity")


def _load_file(path: Path, name: str) -> Any:
    sys.path.insert(0, str(HERE))
    from parity_common import load_module

    return load_module(path, name)


# ----------------------------------------------------------------------------------------------------------
# SEDD
# ----------------------------------------------------------------------------------------------------------


def sedd_tiny_config() -> dict[str, Any]:
    """SEDD_CONFIG at our `tiny` preset's sizes and our protein vocabulary: a checkpoint `trainer import` can load."""
    from trainer.families.protein_sedd.ddit import DDIT_PRESETS
    from trainer.families.protein_sedd.task import NUM_RESIDUES

    config = copy.deepcopy(SEDD_CONFIG)
    config["tokens"] = NUM_RESIDUES + 1  # residues and pad (the absorbing graph adds its mask)
    config["model"].update(name="tiny", length=32, **DDIT_PRESETS["tiny"])
    return config


def write_sedd(reference: str | os.PathLike[str], out: Path, config: Mapping[str, Any] = SEDD_CONFIG) -> None:
    """A reference SEDD run folder in `out`: `.hydra/config.yaml`, `checkpoints-meta/checkpoint.pth` after STEPS
    steps of its AdamW and EMA, and `hub/` (save_pretrained of the EMA weights)."""
    from itertools import chain

    from omegaconf import OmegaConf

    sedd = _load_script("sedd")
    ref = sedd.load_reference(reference)
    utils = _load_file(Path(reference) / "utils.py", "sedd_utils")
    from model.ema import ExponentialMovingAverage  # type: ignore[import-not-found]

    cfg = OmegaConf.create(dict(config))
    torch.manual_seed(SEED)
    model = ref["SEDD"](copy.deepcopy(dict(config)))
    sedd.randomise_(model, SEED)
    noise = ref["noise_lib"].get_noise(cfg)
    graph = ref["graph_lib"].get_graph(cfg, "cpu")
    ema = ExponentialMovingAverage(model.parameters(), decay=cfg.training.ema)
    optimizer = ref["losses"].get_optimizer(cfg, chain(model.parameters(), noise.parameters()))
    loss_fn = ref["losses"].get_loss_fn(noise, graph, train=True)
    g = torch.Generator().manual_seed(SEED + 1)
    for _ in range(STEPS):
        batch = torch.randint(0, config["tokens"], (config["training"]["batch_size"], config["model"]["length"]),
                              generator=g)
        optimizer.zero_grad()
        loss_fn(model, batch).mean().backward()
        optimizer.step()
        ema.update(model.parameters())
    state = {"optimizer": optimizer, "model": SimpleNamespace(module=model), "ema": ema, "step": STEPS}
    (out / "checkpoints-meta").mkdir(parents=True, exist_ok=True)
    (out / ".hydra").mkdir(parents=True, exist_ok=True)
    utils.save_checkpoint(str(out / "checkpoints-meta" / "checkpoint.pth"), state)
    OmegaConf.save(cfg, out / ".hydra" / "config.yaml")
    ema.store(model.parameters())
    ema.copy_to(model.parameters())
    model.save_pretrained(str(out / "hub"))
    ema.restore(model.parameters())


def check_sedd(reference: str, work: Path) -> list[str]:
    """Reference checkpoint -> `trainer import` -> our run equals it -> `export --format reference` -> the
    reference's loaders read it back equal. Returns the failures."""
    from safetensors.torch import load_file

    from trainer.core.reference_checkpoints import export_reference, import_reference
    from trainer.families.protein_sedd.reference import ROTARY_KEY

    source = work / "reference"
    config = sedd_tiny_config()
    write_sedd(reference, source, config)
    saved = torch.load(source / "checkpoints-meta" / "checkpoint.pth", weights_only=True)
    failures: list[str] = []
    names = [k for k in saved["model"] if k != ROTARY_KEY]
    for layout, src in (("checkpoint.pth", source), ("hub", source / "hub")):
        run = work / f"run_{layout}"
        result = import_reference("sedd", src, run, ["train.max_steps=4", "train.per_device_batch_size=4",
                                                     "train.global_batch_size=4", "task.max_length=32"])
        ckpt = result.checkpoint
        model, ema = load_file(ckpt / "model.safetensors"), load_file(ckpt / "ema.safetensors")
        if layout == "hub":
            hub = load_file(source / "hub" / "model.safetensors")
            failures += [f"hub import: '{n}' differs" for n in names if not torch.equal(model[n], hub[n])]
            continue
        failures += [f"import: model '{n}' differs" for n in names if not torch.equal(model[n], saved["model"][n])]
        failures += [f"import: EMA '{n}' differs" for n, s in zip(names, saved["ema"]["shadow_params"])
                     if not torch.equal(ema[n], s)]
        if result.step != saved["step"]:
            failures.append(f"import: step {result.step}, the source's {saved['step']}")
        out = work / "export"
        export_reference(run, out)
        failures += _sedd_reference_reads(reference, out, saved, config)
    return failures


def _sedd_reference_reads(reference: str, out: Path, saved: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    from itertools import chain

    from omegaconf import OmegaConf

    sys.path.insert(0, str(reference))
    import load_model  # type: ignore[import-not-found]
    from model.ema import ExponentialMovingAverage  # type: ignore[import-not-found]

    ref = _load_script("sedd").load_reference(reference)
    utils = _load_file(Path(reference) / "utils.py", "sedd_utils")
    failures = []
    names = [k for k in saved["model"] if k != "rotary_emb.inv_freq"]
    model, _, _ = load_model.load_model_local(str(out), "cpu")  # the EMA weights copied in, as the reference samples
    got = model.state_dict()
    failures += [f"load_model_local: '{n}' is not the source's EMA" for n, s in zip(names, saved["ema"]["shadow_params"])
                 if not torch.equal(got[n], s)]
    hub, _, _ = load_model.load_model_hf(str(out / "hub"), "cpu")
    got = hub.state_dict()
    failures += [f"from_pretrained: '{n}' is not the source's EMA" for n, s in zip(names, saved["ema"]["shadow_params"])
                 if not torch.equal(got[n], s)]
    # Its training resume: model, EMA, step and the optimizer (its parameters: the model's, then the noise's).
    cfg = OmegaConf.create(dict(config))
    fresh = ref["SEDD"](copy.deepcopy(dict(config)))
    noise = ref["noise_lib"].get_noise(cfg)
    state = {"optimizer": ref["losses"].get_optimizer(cfg, chain(fresh.parameters(), noise.parameters())),
             "model": SimpleNamespace(module=fresh), "ema": ExponentialMovingAverage(fresh.parameters(), 0.9),
             "step": 0}
    state = utils.restore_checkpoint(str(out / "checkpoints-meta" / "checkpoint.pth"), state, "cpu")
    if state["step"] != saved["step"]:
        failures.append(f"restore_checkpoint: step {state['step']}, the source's {saved['step']}")
    failures += [f"restore_checkpoint: model '{n}' differs" for n in names
                 if not torch.equal(fresh.state_dict()[n], saved["model"][n])]
    opt, src = state["optimizer"].state_dict()["state"], saved["optimizer"]["state"]
    failures += [f"restore_checkpoint: optimizer state {i}.{k} differs" for i in src for k in src[i]
                 if not torch.equal(torch.as_tensor(opt[i][k]).float(), torch.as_tensor(src[i][k]).float())]
    return failures


# ----------------------------------------------------------------------------------------------------------
# EDM
# ----------------------------------------------------------------------------------------------------------


def _edm_parity_config(args: Mapping[str, Any]) -> dict[str, Any]:
    edm = _load_script("edm")
    return {**edm.CONFIG, "hidden": args["nf"], "layers": args["n_layers"], "inv_sublayers": args["inv_sublayers"],
            "timesteps": args["diffusion_steps"], "noise_precision": args["diffusion_noise_precision"],
            "norm_values": list(args["normalize_factors"])}


def write_edm(reference: str | os.PathLike[str], out: Path, args: Mapping[str, Any] = EDM_ARGS) -> None:
    """A reference EDM output folder in `out` after STEPS steps of its AdamW (amsgrad) and EMA: the model, its EMA
    and optimizer as `utils.save_model` writes them, and `args.pickle`."""
    edm = _load_script("edm")
    ref = edm.load_reference(reference)
    utils = _load_file(Path(reference) / "utils.py", "edm_utils")
    from equivariant_diffusion.utils import EMA  # type: ignore[import-not-found]

    config = _edm_parity_config(args)
    torch.manual_seed(SEED)
    model = edm.build_reference(ref, config)
    edm.randomise_(model, SEED)
    model_ema = copy.deepcopy(model)
    ema = EMA(args["ema_decay"])
    optim = torch.optim.AdamW(model.parameters(), lr=args["lr"], amsgrad=True, weight_decay=1e-12)
    inputs = edm.make_inputs(config)
    m = inputs["node_mask"]
    h = {"categorical": inputs["one_hot"], "integer": inputs["charges"].unsqueeze(-1)}
    model.train()
    for _ in range(STEPS):
        optim.zero_grad()
        model(inputs["x"], h, m.unsqueeze(-1), edm._edge_mask(m), None).mean().backward()
        optim.step()
        ema.update_model_average(model_ema, model)
    out.mkdir(parents=True, exist_ok=True)
    utils.save_model(optim, str(out / "optim.npy"))
    utils.save_model(model, str(out / "generative_model.npy"))
    utils.save_model(model_ema, str(out / "generative_model_ema.npy"))
    with open(out / "args.pickle", "wb") as f:
        pickle.dump(argparse.Namespace(**args), f)


def check_edm(reference: str, work: Path) -> list[str]:
    """Reference checkpoint -> `trainer import` -> our run equals it -> `export --format reference` -> the
    reference's `get_model` from the exported args.pickle loads the exported weights strictly, equal. Failures."""
    from safetensors.torch import load_file

    from trainer.core.reference_checkpoints import export_reference, import_reference
    from trainer.families.molecules_edm.reference import from_reference_state_dict

    source = work / "reference"
    write_edm(reference, source)
    failures: list[str] = []
    model_src = torch.load(source / "generative_model.npy", weights_only=True)
    ema_src = torch.load(source / "generative_model_ema.npy", weights_only=True)
    run = work / "run"
    result = import_reference("edm", source, run, ["train.max_steps=2", "train.epochs=0", "eval.every_epochs=0",
                                                   "eval.sample_every=0", "train.per_device_batch_size=8"])
    model, ema = load_file(result.checkpoint / "model.safetensors"), load_file(result.checkpoint / "ema.safetensors")
    for name, src, got in (("model", model_src, model), ("EMA", ema_src, ema)):
        ours = from_reference_state_dict(src)
        failures += [f"import: {name} '{k}' differs" for k, v in ours.items()
                     if f"diffusion.{k}" in got and not torch.equal(got[f"diffusion.{k}"], v)]
    out = work / "export"
    export_reference(run, out)
    sys.path.insert(0, str(reference))
    from qm9.models import get_model  # type: ignore[import-not-found]

    with open(out / "args.pickle", "rb") as f:
        args = pickle.load(f)  # the reference's own reading of its file
    dataset_info = {"n_nodes": {3: 1, 4: 1}, "atom_decoder": ["H", "C", "N", "O", "F"]}
    import contextlib
    import io

    for file, src in (("generative_model.npy", model_src), ("generative_model_ema.npy", ema_src)):
        with contextlib.redirect_stdout(io.StringIO()):
            flow, _, _ = get_model(args, "cpu", dataset_info, None)
        flow.load_state_dict(torch.load(out / file, weights_only=True), strict=True)
        got = flow.state_dict()
        failures += [f"{file} in get_model: '{k}' differs" for k, v in src.items()
                     if not torch.equal(got[k], v) and k != "gamma.gamma"]
        # The reference's EMA averages its frozen schedule parameter too, which only rounds it (x beta + (1 - beta)
        # x the same); ours keeps the schedule as a buffer outside the EMA, so the export carries the model's.
        if not torch.allclose(got["gamma.gamma"], src["gamma.gamma"], rtol=1e-6, atol=1e-6):
            failures.append(f"{file} in get_model: 'gamma.gamma' is not the source's schedule")
    return failures


# ----------------------------------------------------------------------------------------------------------
# GEARS
# ----------------------------------------------------------------------------------------------------------

GEARS_OPTIONS: dict[str, Any] = {
    # model_initialize's options at the bundled simulated set's sizes (200 genes, 200 perturbable genes), hidden
    # 8 and two co-expression layers (a layer feeding a layer), so the checkpoint imports into a run on that set.
    "hidden_size": 8, "num_go_gnn_layers": 1, "num_gene_gnn_layers": 2, "decoder_hidden_size": 16,
    "num_similar_genes_go_graph": 20, "num_similar_genes_co_express_graph": 20, "coexpress_threshold": 0.4,
    "uncertainty": False, "uncertainty_reg": 1, "direction_lambda": 1e-1, "no_perturb": False,
}
GEARS_SIZES = {"num_genes": 200, "num_perts": 200}


def _gears_class(reference: str | os.PathLike[str]) -> Any:
    """The reference's ``GEARS`` class (``gears/gears.py``: its save_model / load_pretrained / model_initialize);
    ``gears/utils.py`` imports ``dcor`` for a metric not used here: stubbed when absent."""
    import importlib.util
    import types

    if "dcor" not in sys.modules and importlib.util.find_spec("dcor") is None:
        stub = types.ModuleType("dcor")
        stub.distance_correlation = None  # type: ignore[attr-defined]
        sys.modules["dcor"] = stub
    sys.path.insert(0, str(reference))
    from gears.gears import GEARS  # type: ignore[import-not-found]

    return GEARS


def _gears_self(reference: str | os.PathLike[str]) -> Any:
    """A stand-in for a ``GEARS`` object with what model_initialize / save_model / load_pretrained read (no
    PertData: the graphs come with the options)."""
    import functools

    cls = _gears_class(reference)
    self = SimpleNamespace(wandb=None, device="cpu", config=None, **GEARS_SIZES)
    self.model_initialize = functools.partial(cls.model_initialize, self)
    return self, cls


def gears_graphs(seed: int = SEED) -> dict[str, torch.Tensor]:
    """Seeded gene graphs (three sources per target and a few self loops) that differ from the ones the bundled
    set's graph builder makes, so that an import shows the checkpoint's graphs are the ones kept."""
    g = torch.Generator().manual_seed(seed + 2)
    out = {}
    for name, nodes in (("G_coexpress", GEARS_SIZES["num_genes"]), ("G_go", GEARS_SIZES["num_perts"])):
        src = torch.randint(0, nodes, (3 * nodes,), generator=g)
        dst = torch.arange(nodes).repeat_interleave(3)
        loops = torch.arange(0, nodes, 17)
        out[name] = torch.stack([torch.cat([src, loops]), torch.cat([dst, loops])])
        out[f"{name}_weight"] = 0.4 + 0.6 * torch.rand(out[name].shape[1], generator=g)
    return out


def write_gears(reference: str | os.PathLike[str], out: Path) -> None:
    """A reference ``GEARS.save_model`` folder in `out`: its ``model_initialize`` builds ``GEARS_Model`` from
    GEARS_OPTIONS and the seeded graphs, every parameter and buffer is randomised (``scripts/parity/gears.py``)
    and its ``save_model`` writes ``model.pt`` and ``config.pkl``."""
    gears = _load_script("gears")
    self, cls = _gears_self(reference)
    torch.manual_seed(SEED)
    cls.model_initialize(self, **GEARS_OPTIONS, **gears_graphs())
    gears.randomise_(self.model, SEED)
    self.best_model = self.model
    out.mkdir(parents=True, exist_ok=True)
    cls.save_model(self, str(out))


def check_gears(reference: str, work: Path) -> list[str]:
    """Reference save_model folder -> `trainer import gears` (the bundled set) -> our run equals it -> `export
    --format reference` -> the reference's own ``load_pretrained`` reads it back equal. Returns the failures."""
    from safetensors.torch import load_file

    from trainer.core.reference_checkpoints import export_reference, import_reference
    from trainer.families.perturbation_gears.reference import GRAPH_BUFFERS, UNUSED_REFERENCE_PREFIXES

    source = work / "reference"
    write_gears(reference, source)
    saved = torch.load(source / "model.pt", weights_only=True)
    with open(source / "config.pkl", "rb") as f:
        config = pickle.load(f)  # the reference's own reading of its file
    failures: list[str] = []
    run = work / "run"
    result = import_reference("gears", source, run, ["train.max_steps=1", "log.progress_bar=false"])
    model = load_file(result.checkpoint / "model.safetensors")
    failures += [f"import: '{k}' differs" for k, v in saved.items()
                 if not k.startswith(UNUSED_REFERENCE_PREFIXES) and not torch.equal(model[k], v)]
    failures += [f"import: graph '{ours}' is not config.pkl's '{ref}'" for ours, ref in GRAPH_BUFFERS.items()
                 if not torch.equal(model[ours], config[ref].to(model[ours].dtype))]
    out = work / "export"
    export_reference(run, out)
    self, cls = _gears_self(reference)
    cls.load_pretrained(self, str(out))  # its model_initialize, then load_state_dict (strict)
    got = self.model.state_dict()
    failures += [f"load_pretrained: '{k}' differs" for k, v in saved.items() if not torch.equal(got[k], v)]
    failures += [f"load_pretrained: graph '{ref}' differs" for ref in GRAPH_BUFFERS.values()
                 if not torch.equal(self.config[ref].to(config[ref].dtype), config[ref])]
    failures += [f"load_pretrained: option '{k}' is {self.config.get(k)!r}, the source's {v!r}"
                 for k, v in GEARS_OPTIONS.items() if self.config.get(k) != v]
    return failures


# ----------------------------------------------------------------------------------------------------------
# ComFormer
# ----------------------------------------------------------------------------------------------------------

COMFORMER_TRAINING: dict[str, Any] = {
    # TrainingConfig fields its train.py reads (the rest of config.json is data-set bookkeeping).
    "atom_features": "cgcnn", "cutoff": 4.0, "max_neighbors": 12, "criterion": "mse", "learning_rate": 1e-3,
    "weight_decay": 1e-5, "batch_size": 4, "epochs": 3, "optimizer": "adamw", "scheduler": "onecycle",
}
COMFORMER_STATS = {"mean": -4.25, "std": 0.75}
"""The target statistics the reference's log prints ('normalize using training mean M and std S')."""
COMFORMER_ITERATIONS = 2


def _comformer_config(variant: str, paper: bool) -> dict[str, Any]:
    """The parity script's small config of `variant` (golden), or the same at our `paper` preset's sizes."""
    comformer = _load_script("comformer")
    config = dict(comformer.CONFIGS[variant])
    if paper:
        from trainer.families.crystals.comformer import comformer_config

        ours = comformer_config("paper", variant=variant)
        config.update(node_features=ours.node_features, edge_features=ours.edge_features,
                      triplet_features=ours.triplet_features, fc_features=ours.fc_features, heads=ours.heads,
                      equi_scalars=ours.equi_scalars, equi_vectors=ours.equi_vectors)
    return config


def write_comformer(reference: str | os.PathLike[str], out: Path, variant: str = "icomformer", paper: bool = False
                    ) -> None:
    """A reference ComFormer output folder in `out`: the reference's model (randomised, ``scripts/parity/
    comformer.py``) after COMFORMER_ITERATIONS AdamW steps on seeded gradients, with its train.py's parameter groups
    (no decay for 'bias', 'bn', 'norm') and OneCycleLR, saved as ignite's ``Checkpoint`` of {model, optimizer,
    lr_scheduler, trainer} saves them (``checkpoint_N.pt``, one ``torch.save`` of their state dicts; ignite itself
    is not needed for that); ``config.json`` with the reference's model config (its pydantic class) and training
    options; ``target_stats.json``, which a user writes from the reference's log; and ``reference_parameters.json``
    (the model's ``named_parameters()`` order, which the optimizer's indices count: what the tests check against)."""
    comformer = _load_script("comformer")
    ref = comformer.load_reference(reference)
    config = _comformer_config(variant, paper)
    torch.manual_seed(SEED)
    model = comformer.build_reference(ref, config).float()
    comformer.randomise_(model, SEED)
    named = list(model.named_parameters())
    unused = ("edge_update_layer.lemb.", "edge_update_layer.lin_edge_len.")  # its forward never calls them
    no_decay = [p for n, p in named if "bias" in n or "bn" in n or "norm" in n]
    decay = [p for n, p in named if not ("bias" in n or "bn" in n or "norm" in n)]
    t = COMFORMER_TRAINING
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0}], lr=t["learning_rate"],
                                  weight_decay=t["weight_decay"])
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=t["learning_rate"], epochs=t["epochs"],
                                                    steps_per_epoch=COMFORMER_ITERATIONS, pct_start=0.3)
    g = torch.Generator().manual_seed(SEED + 3)
    for _ in range(COMFORMER_ITERATIONS):
        for name, p in named:
            p.grad = None if name.startswith(unused) else torch.randn(p.shape, generator=g) * 0.1
        optimizer.step()
        scheduler.step()
    mod = ref["comformer"]
    kw = {"conv_layers": config["conv_layers"], "edge_layers": config["edge_layers"],
          "node_features": config["node_features"], "edge_features": config["edge_features"],
          "triplet_input_features": config["triplet_features"], "fc_features": config["fc_features"],
          "node_layer_head": config["heads"], "edge_layer_head": config["heads"]}
    model_config = (mod.iComformerConfig(name="iComformer", **kw) if variant == "icomformer"
                    else mod.eComformerConfig(name="eComformer", **kw))
    out.mkdir(parents=True, exist_ok=True)
    trainer = {"epoch_length": COMFORMER_ITERATIONS, "max_epochs": t["epochs"], "iteration": COMFORMER_ITERATIONS}
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "lr_scheduler": scheduler.state_dict(),
                "trainer": trainer}, out / "checkpoint_1.pt")
    (out / "config.json").write_text(json.dumps({**t, "model": model_config.dict()}, indent=4) + "\n")
    (out / "target_stats.json").write_text(json.dumps(COMFORMER_STATS) + "\n")
    # The reference's own parameter order, what its optimizer's indices count (tests check the reader against it).
    (out / "reference_parameters.json").write_text(json.dumps([n for n, _ in named]) + "\n")


def check_comformer(reference: str, work: Path) -> list[str]:
    """For each variant at our `paper` sizes: reference checkpoint -> `trainer import comformer` (the bundled set)
    -> the run's weights, AdamW state, step and target statistics are the source's -> `export --format reference`
    -> the reference's model, built from the exported config.json, loads model.pt strictly, equal. Failures."""
    from safetensors.torch import load_file

    from trainer.core.reference_checkpoints import export_reference, import_reference
    from trainer.families.crystals.reference import (
        REFERENCE_UNUSED,
        from_reference_state_dict,
        reference_key_to_ours,
    )

    comformer = _load_script("comformer")
    ref = comformer.load_reference(reference)
    failures: list[str] = []
    for variant in ("icomformer", "ecomformer"):
        source = work / f"reference_{variant}"
        write_comformer(reference, source, variant, paper=True)
        saved = torch.load(source / "checkpoint_1.pt", weights_only=True)
        run = work / f"run_{variant}"
        result = import_reference("comformer", source, run, ["train.max_steps=8", "log.progress_bar=false"])
        if result.step != COMFORMER_ITERATIONS:
            failures.append(f"{variant} import: step {result.step}, the source's {COMFORMER_ITERATIONS}")
        model = load_file(result.checkpoint / "model.safetensors")
        failures += [f"{variant} import: '{k}' differs" for k, v in from_reference_state_dict(saved["model"]).items()
                     if f"model.{k}" in model and not torch.equal(model[f"model.{k}"], v)]  # shared: saved once
        if model["target_std"].tolist() != [COMFORMER_STATS["std"]]:
            failures.append(f"{variant} import: target_std {model['target_std'].tolist()}")
        # The AdamW state by name, as the reference's own model names its parameters (its train.py's two groups).
        names = [n for n, _ in comformer.build_reference(ref, _comformer_config(variant, paper=False)).named_parameters()]
        grouped = ([n for n in names if not ("bias" in n or "bn" in n or "norm" in n)]
                   + [n for n in names if "bias" in n or "bn" in n or "norm" in n])
        expected = {f"model.{reference_key_to_ours(n)}": saved["optimizer"]["state"][i] for i, n in enumerate(grouped)
                    if i in saved["optimizer"]["state"] and n not in REFERENCE_UNUSED}
        if not expected:
            failures.append(f"{variant}: the reference's checkpoint holds no AdamW state to compare")
        opt = torch.load(result.checkpoint / "optimizer.bin", weights_only=True)
        param_names = json.loads((result.checkpoint / "trainer_state.json").read_text())["param_names"]
        got_state = {n: opt["state"][i] for group, group_names in zip(opt["param_groups"], param_names)
                     for i, n in zip(group["params"], group_names) if i in opt["state"]}
        if set(got_state) != set(expected):
            failures.append(f"{variant} import: optimizer state for {sorted(set(got_state) ^ set(expected))[:4]} "
                            f"differs in presence")
        failures += [f"{variant} import: optimizer '{n}'.{k} differs" for n in set(got_state) & set(expected)
                     for k in ("exp_avg", "exp_avg_sq") if not torch.equal(got_state[n][k], expected[n][k])]
        out = work / f"export_{variant}"
        export_reference(run, out)
        exported = json.loads((out / "config.json").read_text())
        mod = ref["comformer"]
        cls = mod.iComformerConfig if variant == "icomformer" else mod.eComformerConfig
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            back = (mod.iComformer if variant == "icomformer" else mod.eComformer)(cls(**exported["model"]))
        back.load_state_dict(torch.load(out / "model.pt", weights_only=True), strict=True)
        got = back.state_dict()
        failures += [f"{variant} export in the reference: '{k}' differs" for k, v in saved["model"].items()
                     if k not in REFERENCE_UNUSED and not torch.equal(got[k], v)]
        stats = json.loads((out / "target_stats.json").read_text())
        if stats != COMFORMER_STATS:
            failures.append(f"{variant} export: target_stats.json {stats}, the source's {COMFORMER_STATS}")
    return failures


# ----------------------------------------------------------------------------------------------------------


FAMILIES: dict[str, tuple[str, str, Callable[..., None], Callable[[str, Path], list[str]]]] = {
    "sedd": ("TRAINER_REFERENCE_SEDD", "louaaron/Score-Entropy-Discrete-Diffusion", write_sedd, check_sedd),
    "edm": ("TRAINER_REFERENCE_EDM", "ehoogeboom/e3_diffusion_for_molecules", write_edm, check_edm),
    "gears": ("TRAINER_REFERENCE_GEARS", "snap-stanford/GEARS", write_gears, check_gears),
    "comformer": ("TRAINER_REFERENCE_COMFORMER", "divelab/AIRS", write_comformer, check_comformer),
}


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("family", choices=sorted(FAMILIES))
    p.add_argument("--reference", default=None, help="reference checkout (default: $TRAINER_REFERENCE_<FAMILY>)")
    p.add_argument("--check", action="store_true", help="import, export and reload through the reference (live)")
    p.add_argument("--write-golden", type=Path, metavar="DIR", help="write the small golden checkpoint into DIR")
    args = p.parse_args(argv)
    env, repo, write, check = FAMILIES[args.family]
    reference = args.reference or os.environ.get(env)
    if not reference:
        p.error(f"name the reference checkout with {env}=/path or --reference")
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            failures = check(reference, Path(tmp))
        for f in failures:
            log(f"FAIL {f}")
        if failures:
            return 1
        log(f"{args.family}: reference checkpoint imported, exported and read back by the reference, every tensor equal")
    if args.write_golden:
        import shutil

        shutil.rmtree(args.write_golden, ignore_errors=True)
        write(reference, args.write_golden)
        licence = "GPL-3.0" if args.family == "comformer" else "MIT"
        meta = {"reference": {"repository": repo, "commit": reference_commit(reference), "license": licence},
                "written_by": "scripts/parity/reference_checkpoints.py",
                "steps": {"gears": 0, "comformer": COMFORMER_ITERATIONS}.get(args.family, STEPS), "seed": SEED}
        (args.write_golden / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        log(f"golden checkpoint written to {args.write_golden}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

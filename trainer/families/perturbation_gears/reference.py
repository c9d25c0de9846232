"""Key map between our ``GEARSModel`` and the reference ``GEARS_Model`` (snap-stanford/GEARS, MIT).

The parameter and buffer names are the same one for one (ours keep GEARS' names). Two differences remain:

* The reference creates ``pert_w`` (``Linear(1, h)``) and ``bn_pert_base_trans`` (``BatchNorm1d(h)``) and never
  uses them in its forward; ours does not create them. Going to ours they are dropped; going to the reference
  fresh ones are written (``pert_w`` zeros, the BatchNorm at its initial state), which changes no output.
* The reference keeps its two graphs (``G_coexpress``/``G_coexpress_weight``, ``G_go``/``G_go_weight``) as plain
  attributes, saved in its ``config.pkl`` rather than in ``model.pt``; ours keeps them as buffers
  (``coexpress_edge_index``, ``coexpress_edge_weight``, ``go_edge_index``, ``go_edge_weight``) so a checkpoint
  rebuilds the model alone. Going to ours the graphs are arguments; ``reference_graphs`` gives them back in the
  reference's config form.

Both directions check the whole key set and every shape against the layout the state dict's own sizes imply
(gene count, perturbable genes, hidden size, GNN layer counts, uncertainty head), so a state dict that would not
load says which keys and shapes differ. Used by the parity check (``scripts/parity/gears.py``) and by whatever
loads reference checkpoints.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainer.reference_formats import ReferenceFormat
from trainer.state_dicts import strip_wrapper_prefixes

__all__ = ["CONFIG_FILE", "GRAPH_BUFFERS", "MODEL_FILE", "REFERENCE_FORMAT", "UNUSED_REFERENCE_PREFIXES",
           "from_reference_state_dict", "read_reference_checkpoint", "reference_config", "reference_graphs",
           "reference_shapes", "reference_state_dict", "write_reference_checkpoint"]

UNUSED_REFERENCE_PREFIXES = ("pert_w.", "bn_pert_base_trans.")
"""Modules the reference creates and never uses in its forward (ours does not have them)."""

GRAPH_BUFFERS = {"coexpress_edge_index": "G_coexpress", "coexpress_edge_weight": "G_coexpress_weight",
                 "go_edge_index": "G_go", "go_edge_weight": "G_go_weight"}
"""Our graph buffers -> the reference's ``args``/``config.pkl`` entries holding the same tensors."""

Graph = tuple[torch.Tensor, "torch.Tensor | None"]


def _mlp_shapes(prefix: str, sizes: list[int]) -> dict[str, tuple[int, ...]]:
    # GEARS' MLP: network.{3i} Linear, network.{3i+1} BatchNorm1d (a ReLU between, none after the last).
    out: dict[str, tuple[int, ...]] = {}
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        out[f"{prefix}.network.{3 * i}.weight"] = (n_out, n_in)
        out[f"{prefix}.network.{3 * i}.bias"] = (n_out,)
        out.update(_batchnorm_shapes(f"{prefix}.network.{3 * i + 1}", n_out))
    return out


def _batchnorm_shapes(prefix: str, size: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (size,), f"{prefix}.bias": (size,), f"{prefix}.running_mean": (size,),
            f"{prefix}.running_var": (size,), f"{prefix}.num_batches_tracked": ()}


def reference_shapes(num_genes: int, num_perts: int, hidden_size: int, num_go_gnn_layers: int = 1,
                     num_gene_gnn_layers: int = 1, uncertainty: bool = False) -> dict[str, tuple[int, ...]]:
    """Every key of the reference ``GEARS_Model``'s state dict for these sizes, with its shape."""
    g, p, h = num_genes, num_perts, hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "indv_w1": (g, h, 1), "indv_b1": (g, 1), "indv_w2": (1, g, h + 1), "indv_b2": (1, g),
        "pert_w.weight": (h, 1), "pert_w.bias": (h,),
        "gene_emb.weight": (g, h), "pert_emb.weight": (p, h), "emb_pos.weight": (g, h),
    }
    shapes.update(_mlp_shapes("emb_trans_v2", [h, h, h]))
    shapes.update(_mlp_shapes("pert_fuse", [h, h, h]))
    for name, count in (("layers_emb_pos", num_gene_gnn_layers), ("sim_layers", num_go_gnn_layers)):
        for i in range(count):
            shapes[f"{name}.{i}.lin.weight"] = (h, h)
            shapes[f"{name}.{i}.lin.bias"] = (h,)
    shapes.update(_mlp_shapes("recovery_w", [h, 2 * h, h]))
    shapes.update(_mlp_shapes("cross_gene_state", [g, h, h]))
    for name in ("bn_emb", "bn_pert_base", "bn_pert_base_trans"):
        shapes.update(_batchnorm_shapes(name, h))
    if uncertainty:
        shapes.update(_mlp_shapes("uncertainty_w", [h, 2 * h, h, 1]))
    return shapes


def _implied_shapes(sd: Mapping[str, torch.Tensor], source: str) -> dict[str, tuple[int, ...]]:
    """The reference layout implied by the sizes `sd` itself carries (its embedding tables and layer keys)."""
    for key in ("gene_emb.weight", "pert_emb.weight"):
        if key not in sd:
            raise ValueError(f"{source}: no '{key}': not a GEARS state dict")
        if sd[key].dim() != 2:
            raise ValueError(f"{source}: '{key}' must be [rows, hidden], got shape {tuple(sd[key].shape)}")

    def layers(name: str) -> int:
        found = [int(m.group(1)) for k in sd if (m := re.match(rf"{name}\.(\d+)\.", k))]
        return max(found) + 1 if found else 0

    g, h = sd["gene_emb.weight"].shape
    return reference_shapes(g, sd["pert_emb.weight"].shape[0], h, num_go_gnn_layers=layers("sim_layers"),
                            num_gene_gnn_layers=layers("layers_emb_pos"),
                            uncertainty=any(k.startswith("uncertainty_w.") for k in sd))


def _check_layout(sd: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], source: str) -> None:
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    differ = [f"{k}: {tuple(sd[k].shape)}, expected {expected[k]}" for k in sorted(set(sd) & set(expected))
              if tuple(sd[k].shape) != expected[k]]
    if missing or unexpected or differ:
        parts = [f"missing keys {missing}" if missing else "", f"unexpected keys {unexpected}" if unexpected else "",
                 f"shapes differ: {'; '.join(differ)}" if differ else ""]
        raise ValueError(f"{source}: not the GEARS_Model layout its own sizes imply (genes "
                         f"{sd['gene_emb.weight'].shape[0]}, perturbable genes {sd['pert_emb.weight'].shape[0]}, "
                         f"hidden {sd['gene_emb.weight'].shape[1]}): " + "; ".join(p for p in parts if p))


def _graph_tensors(name: str, graph: Graph, num_nodes: int, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    edge_index, edge_weight = graph
    if edge_index.dim() != 2 or edge_index.size(0) != 2 or edge_index.is_floating_point():
        raise ValueError(f"{source}: {name} graph edge_index must be an integer [2, E] tensor, got "
                         f"{edge_index.dtype} {tuple(edge_index.shape)}")
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= num_nodes):
        raise ValueError(f"{source}: {name} graph indexes nodes outside [0, {num_nodes}) (min "
                         f"{int(edge_index.min())}, max {int(edge_index.max())})")
    if edge_weight is None:
        edge_weight = torch.ones(edge_index.size(1))
    if edge_weight.shape != (edge_index.size(1),):
        raise ValueError(f"{source}: {name} graph edge_weight must have shape [{edge_index.size(1)}] (one per "
                         f"edge), got {tuple(edge_weight.shape)}")
    return edge_index.detach().long().clone(), edge_weight.detach().clone()


def from_reference_state_dict(state_dict: Mapping[str, torch.Tensor], coexpress_graph: Graph, go_graph: Graph,
                              source: str = "reference state dict") -> dict[str, torch.Tensor]:
    """Reference ``GEARS_Model`` state dict (``model.pt``) -> ours (``GEARSModel.load_state_dict(..., strict=True)``).

    ``coexpress_graph`` and ``go_graph`` are ``(edge_index [2, E], edge_weight [E] or None)``: the reference's
    ``G_coexpress``/``G_coexpress_weight`` and ``G_go``/``G_go_weight`` (its ``config.pkl``). The unused
    ``pert_w`` and ``bn_pert_base_trans`` are dropped. A key set or shape other than the layout the state dict's
    own sizes imply is an error naming ``source`` and the keys.
    """
    sd = strip_wrapper_prefixes(state_dict)
    ours_only = sorted(k for k in sd if k in GRAPH_BUFFERS)
    if ours_only:
        raise ValueError(f"{source}: has {ours_only}, the graph buffers of our GEARSModel: already our layout")
    _check_layout(sd, _implied_shapes(sd, source), source)
    out = {k: v for k, v in sd.items() if not k.startswith(UNUSED_REFERENCE_PREFIXES)}
    for name, graph, nodes in (("coexpress", coexpress_graph, sd["gene_emb.weight"].shape[0]),
                               ("go", go_graph, sd["pert_emb.weight"].shape[0])):
        out[f"{name}_edge_index"], out[f"{name}_edge_weight"] = _graph_tensors(name, graph, nodes, source)
    return out


def reference_state_dict(state_dict: Mapping[str, torch.Tensor], source: str = "state dict"
                         ) -> dict[str, torch.Tensor]:
    """Our ``GEARSModel`` state dict -> the reference's (``GEARS_Model.load_state_dict(..., strict=True)``).

    The graph buffers are left out (the reference takes them as ``args``: see ``reference_graphs``); the
    reference's unused ``pert_w`` (zeros) and ``bn_pert_base_trans`` (a fresh BatchNorm: weight 1, bias 0,
    running mean 0, variance 1, no batches tracked) are written.
    """
    sd = strip_wrapper_prefixes(state_dict)
    missing_graphs = sorted(k for k in GRAPH_BUFFERS if k not in sd)
    if missing_graphs:
        raise ValueError(f"{source}: no {missing_graphs}: not a GEARSModel state dict")
    out = {k: v for k, v in sd.items() if k not in GRAPH_BUFFERS}
    unused = sorted(k for k in out if k.startswith(UNUSED_REFERENCE_PREFIXES))
    if unused:
        raise ValueError(f"{source}: has {unused}, keys only the reference's GEARS_Model has")
    if "gene_emb.weight" not in out:
        raise ValueError(f"{source}: no 'gene_emb.weight': not a GEARSModel state dict")
    like = out["gene_emb.weight"]
    h = like.shape[1]
    fresh = {"pert_w.weight": torch.zeros(h, 1), "pert_w.bias": torch.zeros(h),
             "bn_pert_base_trans.weight": torch.ones(h), "bn_pert_base_trans.bias": torch.zeros(h),
             "bn_pert_base_trans.running_mean": torch.zeros(h), "bn_pert_base_trans.running_var": torch.ones(h)}
    out.update({k: v.to(dtype=like.dtype, device=like.device) for k, v in fresh.items()})
    out["bn_pert_base_trans.num_batches_tracked"] = torch.tensor(0, dtype=torch.long, device=like.device)
    _check_layout(out, _implied_shapes(out, source), source)
    return out


def reference_graphs(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The graphs of our state dict under the reference's names (``G_coexpress``, ``G_coexpress_weight``,
    ``G_go``, ``G_go_weight``: what its ``GEARS_Model(args)`` and ``config.pkl`` hold)."""
    sd = strip_wrapper_prefixes(state_dict)
    missing = sorted(k for k in GRAPH_BUFFERS if k not in sd)
    if missing:
        raise ValueError(f"state dict has no {missing}: not a GEARSModel state dict")
    return {ref: sd[ours] for ours, ref in GRAPH_BUFFERS.items()}


# ----------------------------------------------------------------------------------------------------------
# Checkpoint layout (trainer import gears / trainer export --format reference)
# ----------------------------------------------------------------------------------------------------------

MODEL_FILE, CONFIG_FILE = "model.pt", "config.pkl"
"""What ``GEARS.save_model(path)`` writes: the best model's state dict (``torch.save``) and ``self.config``
(``pickle.dump`` of a dict: the model options, the two graphs as tensors, the device and the sizes)."""

# config.pkl field -> our task option (the same meaning; GEARS' model_initialize names).
_CONFIG_OPTIONS = (("hidden_size", "hidden_size", int), ("num_go_gnn_layers", "num_go_gnn_layers", int),
                   ("num_gene_gnn_layers", "num_gene_gnn_layers", int), ("uncertainty", "uncertainty", bool),
                   ("uncertainty_reg", "uncertainty_reg", float), ("direction_lambda", "direction_lambda", float),
                   ("coexpress_threshold", "coexpression_threshold", float),
                   ("num_similar_genes_co_express_graph", "coexpression_top_k", int),
                   ("num_similar_genes_go_graph", "go_top_k", int))
_REQUIRED = ("hidden_size", "num_go_gnn_layers", "num_gene_gnn_layers", "G_coexpress", "G_go", "num_genes",
             "num_perts")
RECIPE = ["optim.name=adam", "optim.lr=0.001", "optim.weight_decay=0.0005", "optim.decay_all_parameters=true",
          "train.grad_clip_norm=0.0", "train.grad_clip_value=1.0", "optim.scheduler=step",
          "optim.decay_every_epochs=1.0", "optim.decay_gamma=0.5", "optim.warmup_steps=0"]
"""GEARS' ``train()`` recipe (its defaults: config.pkl does not record them): Adam 1e-3 decaying every parameter
by 5e-4, ``clip_grad_value_(1.0)``, StepLR(1 epoch, 0.5)."""


def _read_config(path: Path) -> dict[str, Any]:
    from trainer.reference_formats import restricted_unpickle, tensor_globals

    config = restricted_unpickle(path, tensor_globals())
    if not isinstance(config, dict):
        raise ValueError(f"{path}: holds a {type(config).__name__}, not GEARS' config dict")
    missing = [k for k in _REQUIRED if config.get(k) is None]
    if missing:
        raise ValueError(f"{path}: field '{missing[0]}' is missing (GEARS.save_model writes it)")
    if config.get("no_perturb"):
        raise ValueError(f"{path}: field 'no_perturb' is True (a model that ignores the perturbation): our "
                         f"GEARS has no such mode")
    for name in ("G_coexpress", "G_go"):
        for key in (name, f"{name}_weight"):
            if config.get(key) is not None and not torch.is_tensor(config[key]):
                raise ValueError(f"{path}: field '{key}' is a {type(config[key]).__name__}, not a tensor")
    return config


def read_reference_checkpoint(source: Path) -> Any:
    """A GEARS ``save_model`` folder (or its ``model.pt`` / ``config.pkl``) as a `ReferenceCheckpoint`: the weights
    of ``model.pt`` (weights-only) through the key map, the two graphs of ``config.pkl`` (a restricted unpickler:
    builtin data and tensors only) as our graph buffers, and the model options as task overrides."""
    from trainer.reference_formats import ReferenceCheckpoint, load_weights_only, override

    source = Path(source)
    folder = source.parent if source.is_file() else source
    model_path, config_path = folder / MODEL_FILE, folder / CONFIG_FILE
    for path, what in ((config_path, "the model options and its two gene graphs"), (model_path, "the weights")):
        if not path.is_file():
            raise ValueError(f"{folder}: no {path.name} there ({what}; GEARS.save_model writes both)")
    config = _read_config(config_path)
    state = load_weights_only(model_path)
    sd = strip_wrapper_prefixes(state)
    for field, key in (("num_genes", "gene_emb.weight"), ("num_perts", "pert_emb.weight")):
        if key in sd and sd[key].dim() == 2 and int(config[field]) != sd[key].shape[0]:
            raise ValueError(f"{config_path}: field '{field}' is {config[field]}, but {model_path.name}'s '{key}' "
                             f"has {sd[key].shape[0]} rows")
    model = from_reference_state_dict(state, (config["G_coexpress"], config.get("G_coexpress_weight")),
                                      (config["G_go"], config.get("G_go_weight")), source=str(model_path))
    overrides = [override("task.name", "perturbation_gears")]
    for field, option, kind in _CONFIG_OPTIONS:
        if config.get(field) is not None:
            overrides.append(override(f"task.{option}", kind(config[field])))
    notes = [f"{CONFIG_FILE} names no genes: the weights' rows are the reference data set's {config['num_genes']} "
             f"genes and {config['num_perts']} perturbable genes in its order, so task.data_path must be that data "
             f"set (perturbable genes as GEARS' default_pert_graph=False: task.pert_gene_set=var)",
             "the model's gene graphs are the source's (config.pkl), not rebuilt from the data",
             "GEARS propagates co-expression for the first cell of a batch only: task.coexpress_first_cell_only=true "
             "reproduces its outputs exactly"]
    return ReferenceCheckpoint(task="perturbation_gears", model=model, step=0, overrides=overrides, recipe=list(RECIPE),
                               files=[model_path, config_path], notes=notes)


def reference_config(config: Any, state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The dict GEARS pickles as ``config.pkl`` for a run of ours (`config`: its resolved Config): the model
    options, the run's graphs (as tensors) and the sizes; ``device`` is ``cpu`` (``load_pretrained`` moves it)."""
    t = config.task
    sd = strip_wrapper_prefixes(state_dict)
    graphs = reference_graphs(sd)
    return {"hidden_size": int(t.hidden_size), "num_go_gnn_layers": int(t.num_go_gnn_layers),
            "num_gene_gnn_layers": int(t.num_gene_gnn_layers), "decoder_hidden_size": 16,
            "num_similar_genes_go_graph": int(t.go_top_k), "num_similar_genes_co_express_graph":
            int(t.coexpression_top_k), "coexpress_threshold": float(t.coexpression_threshold),
            "uncertainty": bool(t.uncertainty), "uncertainty_reg": float(t.uncertainty_reg),
            "direction_lambda": float(t.direction_lambda),
            "G_go": graphs["G_go"].detach().long().cpu().clone(),
            "G_go_weight": graphs["G_go_weight"].detach().float().cpu().clone(),
            "G_coexpress": graphs["G_coexpress"].detach().long().cpu().clone(),
            "G_coexpress_weight": graphs["G_coexpress_weight"].detach().float().cpu().clone(),
            "device": "cpu", "num_genes": int(sd["gene_emb.weight"].shape[0]),
            "num_perts": int(sd["pert_emb.weight"].shape[0]), "no_perturb": False}


def write_reference_checkpoint(out: Path, weights: Any) -> list[str]:
    """Our run's weights as ``GEARS.save_model`` writes them: ``model.pt`` and ``config.pkl``. Returns notes."""
    import pickle

    model = {k: v.detach().cpu().contiguous() for k, v in strip_wrapper_prefixes(weights.model).items()}
    for key in ("coexpress_edge_weight", "go_edge_weight"):
        model[key] = model[key].float()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(reference_state_dict(model, source="the run's model"), out / MODEL_FILE)
    with open(out / CONFIG_FILE, "wb") as f:
        pickle.dump(reference_config(weights.config, model), f)
    notes = []
    if weights.ema is not None:
        notes.append(f"{MODEL_FILE} holds the model's weights, not the run's EMA (GEARS keeps none)")
    notes.append("GEARS saves no optimizer state: the reference resumes training with fresh moments")
    return notes


REFERENCE_FORMAT = ReferenceFormat(
    name="gears", task="perturbation_gears", read=read_reference_checkpoint, write=write_reference_checkpoint,
    description="GEARS (snap-stanford/GEARS): model.pt + config.pkl of a GEARS.save_model folder")
"""`trainer import gears` / `trainer export --format reference` for perturbation_gears runs."""

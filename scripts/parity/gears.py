"""Parity of our perturbation GEARS (model and loss) with the reference implementation, on CPU.

The reference is snap-stanford/GEARS (MIT), read from a checkout named by ``TRAINER_REFERENCE_GEARS=/path/to/checkout``
(nothing is fetched). ``import gears`` seeds torch's global generator and imports scanpy, so the two files needed
are loaded by path instead: ``gears/model.py`` (``GEARS_Model(args)``; its SGConv is torch_geometric's) and
``gears/utils.py`` (``loss_fct``, ``uncertainty_loss_fct``; the ``dcor`` package it imports for something else is
stubbed when absent).

Both sides are built from one small config (12 genes on a co-expression graph, 8 perturbable genes on a GO graph,
each with a few self loops of their own weight as GEARS' graphs have, two GNN layers on each so a layer feeds a
layer, hidden 8) and ours with ``coexpress_first_cell_only=True``: the reference propagates co-expression only
for the first cell of a batch (see ``trainer/families/perturbation_gears/model.py``), our default does it for
every cell. Every
parameter and buffer is randomised (seeded: embedding rows on both sides of the ``max_norm`` 1 the lookups
renormalise to, BatchNorm affine parameters and running statistics, counters), the unused ``pert_w`` and
``bn_pert_base_trans`` set to what ``reference_state_dict`` writes, the state dict mapped both ways with
``strict=True`` (the round trip exact), and then compared on a batch of five cells (control, two singles of one
condition, two doubles; each condition keeps its own genes, as GEARS' ``dict_filter``):

* the forward in eval and in train mode, and the whole state after each (the embeddings the lookups renormalised,
  BatchNorm running statistics and counters); the train-mode forward of a batch with a single perturbed cell
  (both duplicate it for ``pert_fuse``'s BatchNorm) and of a batch of control cells only;
* the loss: the reference's ``loss_fct`` (autofocus power 4 and its direction term, ``direction_lambda`` 0.1,
  GEARS' default) against our ``gears_loss``; the gradients; the parameters after one SGD and one Adam step;
* the same forward and gradients in float64 (both sides run in it) at 1e-10;
* with the uncertainty head (its weights randomised with the inputs), in float64: the forward and log-variance,
  ``uncertainty_loss_fct`` against ``gears_loss(logvar=...)`` (``uncertainty_reg`` 1, GEARS' default) and the
  gradients. ``uncertainty_loss_fct`` adds in place to ``torch.tensor(0.0, requires_grad=True).to(device)``,
  a copy on a GPU but the leaf itself on a CPU, which torch refuses: it runs with a ``torch`` whose ``tensor``
  makes that copy (its code unchanged). That accumulator keeps its loss value in float32.

    TRAINER_REFERENCE_GEARS=/tmp/ref_gears python scripts/parity/gears.py            # compare, exit 1 on a failure
    TRAINER_REFERENCE_GEARS=/tmp/ref_gears python scripts/parity/gears.py --write-golden tests/families/perturbation_gears/golden

``--ten-steps`` compares ten optimizer steps of our ``task.preset=paper`` (through ``Trainer.train_step``, in
float64) with ten steps of the body of GEARS' ``train()`` (Adam with weight decay on every parameter, ``loss_fct``,
``clip_grad_value_(1.0)``, ``StepLR(1, 0.5)`` per epoch: two epochs of five batches) on pinned batches that each
hold a perturbed cell; its golden files are ``ten_steps.safetensors`` and ``ten_steps.json``.

``--write-golden DIR`` writes what ``tests/families/perturbation_gears/test_gears_parity.py`` checks without the
reference: ``weights.safetensors`` (the randomised reference state dict), ``io.safetensors`` (inputs, graphs and the
reference's outputs) and ``meta.json`` (repository, commit, licence, config); ``--check-golden DIR`` also checks that
the golden files are what this checkout computes. The commit is ``git rev-parse HEAD`` of the checkout, or the
``REFERENCE_COMMIT`` file in it (for a ``git archive`` copy).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parity_common  # noqa: E402
from parity_common import add_prefix, close, report  # noqa: E402

REPO = "snap-stanford/GEARS"
LICENSE = "MIT"
ENV = "TRAINER_REFERENCE_GEARS"

# A tiny config: golden files of tens of KB that still exercise every layer kind (three max-norm embeddings,
# two SGConv layers per graph so the ReLU between them runs, the MLPs, the gene-specific decoders).
CONFIG: dict[str, Any] = {
    "num_genes": 12,
    "num_perts": 8,
    "hidden_size": 8,
    "num_go_gnn_layers": 2,
    "num_gene_gnn_layers": 2,
    "direction_lambda": 0.1,  # GEARS' model_initialize default, which its train() passes to loss_fct
    "uncertainty_reg": 1.0,  # the same, for uncertainty_loss_fct
    "seed": 1234,
    "sgd_lr": 0.1,
    "adam_lr": 1e-3,
}
# Five cells: a single (cell 0, the one whose co-expression the reference propagates), a control, a double, the
# first single again (one condition, two cells) and another double. -1 pads, as our batches do.
PERTS = [[2, -1], [-1, -1], [1, 4], [2, -1], [3, 6]]
# A batch with one perturbed cell: both sides feed it twice to pert_fuse in training mode.
PERTS_SINGLE = [[-1, -1], [5, -1]]
# A batch of control cells only (the first three cells' expression): the perturbation branch adds nothing.
CONTROLS = 3

TOL_OUT = {"rtol": 1e-5, "atol": 1e-5}  # float32 outputs and the state after a forward
TOL_LOSS_REL = 1e-6
# Gradients: elementwise rtol 1e-4, plus an absolute 1e-4 of the tensor's largest element (float32 sums reach
# an element far smaller than its tensor's scale with the rounding of that scale) and a floor of 1e-6: the
# biases that feed a training-mode BatchNorm have a gradient of exactly zero (the float64 comparison shows it),
# which float32 leaves at rounding noise on both sides.
TOL_GRAD = {"rtol": 1e-4, "atol": 1e-6, "of_max": 1e-4}
TOL_PARAM = {"rtol": 1e-5, "atol": 1e-6}  # parameters after one step: p - lr * update
TOL_F64 = {"rtol": 1e-10, "atol": 1e-10}

UNUSED = ("pert_w.", "bn_pert_base_trans.")
HEAD = "uncertainty_w."  # the uncertainty head's randomised weights travel with the inputs
# Float64 gradients of the uncertainty loss kept whole in the golden files (the others: one norm per tensor).
UNC_FULL = ("uncertainty_w.network.6.weight", "uncertainty_w.network.0.weight", "indv_w1")


# ----------------------------------------------------------------------------------------------------------
# Our side (no reference needed: the golden test uses these too)
# ----------------------------------------------------------------------------------------------------------


def condition_names(perts: list[list[int]]) -> list[str]:
    """GEARS' condition name per cell ('ctrl', 'P2+ctrl', 'P1+P4'), from its padded perturbation indices."""
    names = []
    for row in perts:
        genes = [f"P{i}" for i in row if i >= 0]
        names.append("ctrl" if not genes else "+".join(genes + ["ctrl"] * (2 - len(genes))))
    return names


def make_inputs(config: Mapping[str, Any] = CONFIG) -> dict[str, torch.Tensor]:
    """Seeded graphs (float32 weights), control expression, targets, the control mean, the genes each condition
    keeps (GEARS' ``dict_filter``: all for 'ctrl') and the uncertainty head's weights (``uncertainty_w.*``)."""
    g = torch.Generator().manual_seed(config["seed"] + 1)
    n_genes, n_perts = config["num_genes"], config["num_perts"]

    def graph(nodes: int, edges_per_node: int, loops: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # Each target gets `edges_per_node` distinct other sources (GEARS keeps the top k per target); a few nodes
        # also have a self loop of their own weight (GEARS' similarity lists hold the self pair).
        src, dst = [], []
        for target in range(nodes):
            others = [s for s in torch.randperm(nodes, generator=g).tolist() if s != target][:edges_per_node]
            src += others
            dst += [target] * edges_per_node
        src += loops
        dst += loops
        weight = 0.4 + 0.6 * torch.rand(len(src), generator=g)
        return torch.tensor([src, dst], dtype=torch.int64), weight

    co_index, co_weight = graph(n_genes, 3, [0, 5, 7])
    go_index, go_weight = graph(n_perts, 2, [1, 6])
    b = len(PERTS)
    x = torch.relu(torch.randn((b, n_genes), generator=g) + 0.5)
    y = x + 0.5 * torch.randn((b, n_genes), generator=g)
    names = condition_names(PERTS)
    kept = {}
    for name in dict.fromkeys(names):
        kept[name] = (torch.ones(n_genes, dtype=torch.bool) if name == "ctrl"
                      else torch.rand(n_genes, generator=g) > 0.25)
    ids = {name: i for i, name in enumerate(dict.fromkeys(names))}
    from trainer.families.perturbation_gears.model import GearsMLP

    h = config["hidden_size"]
    head = GearsMLP([h, 2 * h, h, 1])  # the same layout as the reference's MLP
    randomise_(head, config["seed"] + 2)
    return {**{f"{HEAD}{k}": v.detach().clone() for k, v in head.state_dict().items()},
            "coexpress_edge_index": co_index, "coexpress_edge_weight": co_weight, "go_edge_index": go_index,
            "go_edge_weight": go_weight, "x": x, "y": y, "ctrl_mean": torch.relu(torch.randn(n_genes, generator=g)),
            "pert_idx": torch.tensor(PERTS), "condition": torch.tensor([ids[n] for n in names]),
            "nonzero_mask": torch.stack([kept[n] for n in names]),
            "x_single": torch.relu(torch.randn((len(PERTS_SINGLE), n_genes), generator=g) + 0.5),
            "pert_idx_single": torch.tensor(PERTS_SINGLE), "pert_idx_control": torch.full((CONTROLS, 2), -1)}


def graphs(inputs: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32
           ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(co-expression, GO) graphs as (edge_index, edge_weight in ``dtype``)."""
    return ((inputs["coexpress_edge_index"], inputs["coexpress_edge_weight"].to(dtype)),
            (inputs["go_edge_index"], inputs["go_edge_weight"].to(dtype)))


def build_ours(inputs: Mapping[str, torch.Tensor], config: Mapping[str, Any] = CONFIG,
               coexpress_first_cell_only: bool = True, uncertainty: bool = False) -> nn.Module:
    """Our GEARSModel for ``config`` on the inputs' graphs (first-cell-only co-expression, as the reference)."""
    from trainer.families.perturbation_gears.model import GEARSModel

    coexpress, go = graphs(inputs)
    return GEARSModel(num_genes=config["num_genes"], num_perts=config["num_perts"], coexpress_graph=coexpress,
                      go_graph=go, hidden_size=config["hidden_size"], num_go_gnn_layers=config["num_go_gnn_layers"],
                      num_gene_gnn_layers=config["num_gene_gnn_layers"], uncertainty=uncertainty,
                      coexpress_first_cell_only=coexpress_first_cell_only)


def step_params(params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], kind: str,
                config: Mapping[str, Any] = CONFIG) -> dict[str, torch.Tensor]:
    """Parameters after one ``kind`` ("sgd" or "adam") step from ``params`` with ``grads`` (copies)."""
    return parity_common.step_params(params, grads, kind, config["sgd_lr"], config["adam_lr"])


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ours_outputs(ref_state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                 config: Mapping[str, Any] = CONFIG, coexpress_first_cell_only: bool = True) -> dict[str, Any]:
    """Everything compared, computed by our code from the reference's state dict (through our key map). States
    after a forward are in the reference's layout (through ``reference_state_dict``)."""
    from trainer.families.perturbation_gears.loss import gears_loss
    from trainer.families.perturbation_gears.reference import from_reference_state_dict, reference_state_dict

    def fresh(dtype: torch.dtype = torch.float32, head: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
        model = build_ours(inputs, config, coexpress_first_cell_only, uncertainty=head is not None).to(dtype)
        coexpress, go = graphs(inputs, dtype)
        model.load_state_dict(from_reference_state_dict({**ref_state, **(head or {})}, coexpress, go), strict=True)
        return model

    model = fresh()
    back = reference_state_dict(model.state_dict())
    round_trip = set(back) == set(ref_state) and all(torch.equal(back[k], ref_state[k]) for k in ref_state)

    x, pert_idx = inputs["x"], inputs["pert_idx"]
    with torch.no_grad():
        pred_eval = model.eval()(x, pert_idx)
    state_eval = reference_state_dict(_state(model))
    model = fresh().train()
    pred_train = model(x, pert_idx)
    state_train = reference_state_dict(_state(model))
    loss = gears_loss(pred_train, inputs["y"], inputs["ctrl_mean"], inputs["condition"], inputs["nonzero_mask"],
                      direction_lambda=config["direction_lambda"])
    loss.backward()
    params = dict(model.named_parameters())
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    single = fresh().train()(inputs["x_single"], inputs["pert_idx_single"])
    control = fresh().train()(x[:CONTROLS], inputs["pert_idx_control"])

    model64 = fresh(torch.float64).train()
    pred64 = model64(x.double(), pert_idx)
    loss64 = gears_loss(pred64, inputs["y"].double(), inputs["ctrl_mean"].double(), inputs["condition"],
                        inputs["nonzero_mask"], direction_lambda=config["direction_lambda"])
    loss64.backward()

    unc = fresh(torch.float64, {k: v for k, v in inputs.items() if k.startswith(HEAD)}).train()
    unc_pred, unc_logvar = unc(x.double(), pert_idx)
    unc_loss = gears_loss(unc_pred, inputs["y"].double(), inputs["ctrl_mean"].double(), inputs["condition"],
                          inputs["nonzero_mask"], direction_lambda=config["direction_lambda"], logvar=unc_logvar,
                          uncertainty_reg=config["uncertainty_reg"])
    unc_loss.backward()
    return {"unc_pred": unc_pred.detach(), "unc_logvar": unc_logvar.detach(), "unc_loss": unc_loss.detach(),
            "unc_grads": {n: p.grad.detach().clone() for n, p in unc.named_parameters()},
            "round_trip": round_trip, "pred_eval": pred_eval, "state_eval": state_eval,
            "pred_train": pred_train.detach(), "state_train": state_train, "pred_single": single.detach(),
            "pred_control": control.detach(), "loss": loss.detach(), "grads": grads,
            "sgd": step_params(params, grads, "sgd", config),
            "adam": step_params(params, grads, "adam", config), "pred_train64": pred64.detach(),
            "loss64": loss64.detach(), "grads64": {n: p.grad.detach().clone() for n, p in model64.named_parameters()}}


def randomise_(model: nn.Module, seed: int) -> None:
    """Seeded values for every parameter and buffer of the reference model, in place.

    Linear weights ~ N(0, 1 / fan_in), biases and the gene-specific decoders ~ 0.1 N(0, 1); embedding rows with
    norms from 0.5 to 2 (so the lookups renormalise some rows and leave others); BatchNorm weights 1 + 0.1 N,
    running means 0.1 N, running variances in [0.5, 1.5] and counters in [1, 100]. The reference's unused
    ``pert_w`` and ``bn_pert_base_trans`` get what ``reference_state_dict`` writes for them, so the round trip
    through our layout is exact on every key.
    """
    g = torch.Generator().manual_seed(seed)
    embeddings = {n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    norms = {n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            module, _, field = name.rpartition(".")
            if name.startswith(UNUSED):
                continue
            if t.dtype == torch.int64:
                t.copy_(torch.randint(1, 101, t.shape, generator=g))
                continue
            r = torch.randn(t.shape, generator=g, dtype=torch.float64)
            if module in embeddings:
                rows = r / r.norm(dim=1, keepdim=True)
                r = rows * (0.5 + 1.5 * torch.rand((t.shape[0], 1), generator=g, dtype=torch.float64))
            elif module in norms:
                r = {"weight": 1 + 0.1 * r, "bias": 0.1 * r, "running_mean": 0.1 * r,
                     "running_var": 0.5 + torch.rand(t.shape, generator=g, dtype=torch.float64)}[field]
            elif field == "weight" and t.ndim == 2:
                r = r / t.shape[1] ** 0.5
            else:
                r = 0.1 * r
            t.copy_(r.to(t.dtype))
        # What our map writes for the unused modules: the round trip checks it stays so.
        for name, t in model.state_dict().items():
            if name.startswith(UNUSED):
                t.copy_(_unused_value(name, t))


def _unused_value(name: str, like: torch.Tensor) -> torch.Tensor:
    # As trainer.families.perturbation_gears.reference.reference_state_dict writes them.
    ones = name.endswith(("bn_pert_base_trans.weight", "running_var"))
    return torch.ones_like(like) if ones else torch.zeros_like(like)


# ----------------------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------------------


def compare(ours: Mapping[str, Any], ref: Mapping[str, Any]) -> list[str]:
    """Differences between our outputs and the reference's beyond the tolerances (empty: parity).

    ``ref`` holds ``pred_eval``, ``state_eval``, ``pred_train``, ``state_train``, ``pred_single``,
    ``pred_control``, ``loss``,
    ``grads``, ``sgd``, ``adam`` (float32) and ``pred_train64``, ``loss64``, ``grads64`` (float64); the states
    in the reference's layout, parameter names ours (the same).
    """
    failures: list[str] = []
    if not ours["round_trip"]:
        failures.append("state dict round trip (reference -> ours -> reference) is not exact")
    close("forward (eval)", ours["pred_eval"], ref["pred_eval"], **TOL_OUT, failures=failures)
    close("forward (train)", ours["pred_train"], ref["pred_train"], **TOL_OUT, failures=failures)
    close("forward (train, one perturbed cell)", ours["pred_single"], ref["pred_single"], **TOL_OUT,
          failures=failures)
    close("forward (train, control cells only)", ours["pred_control"], ref["pred_control"], **TOL_OUT,
          failures=failures)
    for when in ("eval", "train"):
        got, want = ours[f"state_{when}"], ref[f"state_{when}"]
        if set(got) != set(want):
            failures.append(f"state after the {when} forward: keys differ: {sorted(set(got) ^ set(want))}")
            continue
        for key in sorted(want):
            close(f"state after the {when} forward: {key}", got[key], want[key], **TOL_OUT, failures=failures)
    close("loss", ours["loss"], ref["loss"], rtol=TOL_LOSS_REL, atol=0.0, failures=failures)
    for name, want in ref["grads"].items():
        atol = TOL_GRAD["atol"] + TOL_GRAD["of_max"] * want.abs().max().item()
        close(f"gradient {name}", ours["grads"][name], want, rtol=TOL_GRAD["rtol"], atol=atol, failures=failures)
    for name, want in ref["sgd"].items():
        close(f"sgd step {name}", ours["sgd"][name], want, **TOL_PARAM, failures=failures)
    for name, want in ref["adam"].items():
        # Adam's first step is lr * g / (|g| + eps): ~lr * sign(g). Where the gradient is at float32 noise (the
        # zero gradients above) its sign is a coin toss on either side, so there the step may differ by 2 lr.
        noise = ref["grads"][name].abs() <= TOL_GRAD["atol"]
        got = ours["adam"][name]
        close(f"adam step {name}", got[~noise], want[~noise], **TOL_PARAM, failures=failures)
        bound = 2 * float(ref.get("adam_lr", CONFIG["adam_lr"])) + TOL_PARAM["atol"]
        if noise.any() and (got[noise] - want[noise]).abs().max().item() > bound:
            failures.append(f"adam step {name}: where the gradient is at float32 noise the step differs by more "
                            f"than 2 lr ({bound:.3g})")
    close("forward (train, float64)", ours["pred_train64"], ref["pred_train64"], **TOL_F64, failures=failures)
    close("loss (float64)", ours["loss64"], ref["loss64"], **TOL_F64, failures=failures)
    for name, want in ref["grads64"].items():
        close(f"gradient (float64) {name}", ours["grads64"][name], want, **TOL_F64, failures=failures)
    close("uncertainty head: forward (train, float64)", ours["unc_pred"], ref["unc_pred"], **TOL_F64,
          failures=failures)
    close("uncertainty head: log-variance (train, float64)", ours["unc_logvar"], ref["unc_logvar"], **TOL_F64,
          failures=failures)
    # The reference adds its terms in place into a float32 `torch.tensor(0.0)`, so its value is float32 whatever the
    # inputs' precision (its gradients are not rounded: d loss / d term is 1 / conditions).
    close("uncertainty head: loss (float32 accumulator)", ours["unc_loss"].float(), ref["unc_loss"],
          rtol=TOL_LOSS_REL, atol=0.0, failures=failures)
    for name, want in ref["unc_grads"].items():
        close(f"uncertainty head: gradient (float64) {name}", ours["unc_grads"][name], want, **TOL_F64,
              failures=failures)
    if "unc_grad_norms" in ref:
        got = torch.stack([ours["unc_grads"][n].norm() for n in ref["unc_grad_names"]])
        close("uncertainty head: gradient norms (float64)", got, ref["unc_grad_norms"], **TOL_F64, failures=failures)
    missing = sorted(set(ref["grads"]) ^ set(ours["grads"]))
    if missing:
        failures.append(f"gradients: parameters on one side only: {missing}")
    return failures


# ----------------------------------------------------------------------------------------------------------
# The reference (only with a checkout)
# ----------------------------------------------------------------------------------------------------------


def load_reference(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``GEARS_Model`` and ``loss_fct`` from a checkout, loaded by file path (not ``import gears``: its package
    ``__init__`` imports scanpy and the training module seeds torch)."""
    root = Path(path)
    if not (root / "gears" / "model.py").is_file() or not (root / "gears" / "utils.py").is_file():
        raise SystemExit(f"{ENV}={root}: no gears/model.py and gears/utils.py there (expected a checkout of {REPO})")
    stubbed = []
    # utils.py imports dcor at module level for a metric the loss does not use.
    if importlib.util.find_spec("dcor") is None:
        stub = types.ModuleType("dcor")
        stub.distance_correlation = None  # type: ignore[attr-defined]
        sys.modules["dcor"] = stub
        stubbed.append("dcor")
    try:
        model = parity_common.load_module(root / "gears" / "model.py", "gears_reference_model")
        utils = parity_common.load_module(root / "gears" / "utils.py", "gears_reference_utils")
    finally:
        for name in stubbed:
            sys.modules.pop(name, None)
    # uncertainty_loss_fct adds in place to `torch.tensor(0.0, requires_grad=True).to(pred.device)`: on a GPU that
    # is a copy, on a CPU the leaf itself, which torch refuses. It runs here with a torch whose `tensor` makes that
    # copy on a CPU too (the function's code unchanged, only the name it looks torch up by).
    shimmed = dict(utils.uncertainty_loss_fct.__globals__, torch=_TorchCopyingLeaves())
    uncertainty_loss_fct = types.FunctionType(utils.uncertainty_loss_fct.__code__, shimmed,
                                              utils.uncertainty_loss_fct.__name__,
                                              utils.uncertainty_loss_fct.__defaults__)
    return {"GEARS_Model": model.GEARS_Model, "loss_fct": utils.loss_fct, "uncertainty_loss_fct": uncertainty_loss_fct}


class _TorchCopyingLeaves:
    """``torch``, except that ``tensor(..., requires_grad=True)`` returns a copy (not a leaf), as ``.to('cuda')``
    of a CPU tensor does."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = torch.tensor(*args, **kwargs)
        return t.clone() if t.requires_grad else t


def build_reference(ref: Mapping[str, Any], inputs: Mapping[str, torch.Tensor], config: Mapping[str, Any] = CONFIG,
                    dtype: torch.dtype = torch.float32, uncertainty: bool = False) -> nn.Module:
    """The reference ``GEARS_Model`` with the ``args`` GEARS' ``model_initialize`` gives it, on the inputs' graphs
    (edge weights in ``dtype``: its SGConv normalises in the weights' precision)."""
    coexpress, go = graphs(inputs, dtype)
    args = {"num_genes": config["num_genes"], "num_perts": config["num_perts"], "hidden_size": config["hidden_size"],
            "uncertainty": uncertainty, "num_go_gnn_layers": config["num_go_gnn_layers"], "decoder_hidden_size": 16,
            "num_gene_gnn_layers": config["num_gene_gnn_layers"], "no_perturb": False,
            "G_coexpress": coexpress[0], "G_coexpress_weight": coexpress[1], "G_go": go[0], "G_go_weight": go[1],
            "device": "cpu"}
    return ref["GEARS_Model"](args).to(dtype)


def _batch(x: torch.Tensor, pert_idx: torch.Tensor) -> types.SimpleNamespace:
    # What GEARS' PyG DataLoader hands its forward: x stacked [B*G, 1], pert_idx a list per cell, batch ids.
    b, n = x.shape
    return types.SimpleNamespace(x=x.reshape(-1, 1), pert_idx=pert_idx.tolist(),
                                 batch=torch.arange(b).repeat_interleave(n))


def _loss(ref: Mapping[str, Any], pred: torch.Tensor, inputs: Mapping[str, torch.Tensor],
          config: Mapping[str, Any], logvar: torch.Tensor | None = None) -> torch.Tensor:
    names = condition_names(inputs["pert_idx"].tolist())
    dict_filter = {}
    for name, mask in zip(names, inputs["nonzero_mask"]):
        if name != "ctrl":
            dict_filter[name] = torch.nonzero(mask).flatten().numpy()
    y, ctrl = inputs["y"].to(pred.dtype), inputs["ctrl_mean"].to(pred.dtype)
    if logvar is not None:  # as GEARS.train calls it with the uncertainty head
        return ref["uncertainty_loss_fct"](pred, logvar, y, names, reg=config["uncertainty_reg"], ctrl=ctrl,
                                           dict_filter=dict_filter, direction_lambda=config["direction_lambda"])
    return ref["loss_fct"](pred, y, names, ctrl=ctrl, direction_lambda=config["direction_lambda"],
                           dict_filter=dict_filter)


def reference_outputs(ref: Mapping[str, Any], inputs: Mapping[str, torch.Tensor],
                      config: Mapping[str, Any] = CONFIG) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the randomised reference state dict, the reference's outputs for ``inputs``)."""
    torch.manual_seed(config["seed"])
    model = build_reference(ref, inputs, config)
    randomise_(model, config["seed"])
    state = _state(model)

    def fresh(dtype: torch.dtype = torch.float32, head: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
        m = build_reference(ref, inputs, config, dtype, uncertainty=head is not None)
        m.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in {**state, **(head or {})}.items()},
                          strict=True)
        return m

    x, pert_idx = inputs["x"], inputs["pert_idx"]
    model = fresh().eval()
    with torch.no_grad():
        pred_eval = model(_batch(x, pert_idx))
    state_eval = _state(model)
    model = fresh().train()
    pred_train = model(_batch(x, pert_idx))
    state_train = _state(model)
    loss = _loss(ref, pred_train, inputs, config)
    loss.backward()
    params = {n: p for n, p in model.named_parameters() if p.grad is not None}
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    single = fresh().train()(_batch(inputs["x_single"], inputs["pert_idx_single"]))
    with warnings.catch_warnings():  # its `torch.tensor([]).T` of the empty perturbation list warns
        warnings.simplefilter("ignore", UserWarning)
        control = fresh().train()(_batch(x[:CONTROLS], inputs["pert_idx_control"]))

    model64 = fresh(torch.float64).train()
    pred64 = model64(_batch(x.double(), pert_idx))
    loss64 = _loss(ref, pred64, inputs, config)
    loss64.backward()

    unc = fresh(torch.float64, {k: v for k, v in inputs.items() if k.startswith(HEAD)}).train()
    unc_pred, unc_logvar = unc(_batch(x.double(), pert_idx))
    unc_loss = _loss(ref, unc_pred, inputs, config, logvar=unc_logvar)
    unc_loss.backward()
    out = {"unc_pred": unc_pred.detach(), "unc_logvar": unc_logvar.detach(), "unc_loss": unc_loss.detach(),
           "unc_grads": {n: p.grad.detach().clone() for n, p in unc.named_parameters() if p.grad is not None},
           "pred_eval": pred_eval, "state_eval": state_eval, "pred_train": pred_train.detach(),
           "state_train": state_train, "pred_single": single.detach(), "pred_control": control.detach(),
           "loss": loss.detach(), "grads": grads,
           "sgd": step_params(params, grads, "sgd", config), "adam": step_params(params, grads, "adam", config),
           "pred_train64": pred64.detach(), "loss64": loss64.detach(),
           "grads64": {n: p.grad.detach().clone() for n, p in model64.named_parameters() if p.grad is not None}}
    return state, out


def round_trip_into_reference(ref: Mapping[str, Any], state: Mapping[str, torch.Tensor],
                              inputs: Mapping[str, torch.Tensor], config: Mapping[str, Any] = CONFIG) -> bool:
    """Reference -> ours -> reference, each loaded with strict=True (a fresh reference model last): exact?"""
    from trainer.families.perturbation_gears.reference import from_reference_state_dict, reference_state_dict

    coexpress, go = graphs(inputs)
    return parity_common.round_trip_exact(state, build_ours(inputs, config), build_reference(ref, inputs, config),
                                          lambda sd: from_reference_state_dict(sd, coexpress, go),
                                          reference_state_dict)


# ----------------------------------------------------------------------------------------------------------
# Golden files
# ----------------------------------------------------------------------------------------------------------

_TENSORS = ("pred_eval", "pred_train", "pred_single", "pred_control", "loss", "pred_train64", "loss64", "unc_pred",
            "unc_logvar", "unc_loss")
_GROUPS = ("state_eval", "state_train", "grads", "sgd", "adam", "grads64")


def write_golden(out_dir: Path, state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                 ref_out: Mapping[str, Any], commit: str) -> None:
    """The golden files: weights.safetensors, io.safetensors and meta.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    parity_common.save_tensors(out_dir / "weights.safetensors", state)
    tensors = {**add_prefix("input.", inputs), **{k: ref_out[k] for k in _TENSORS}}
    for group in _GROUPS:
        # A state after a forward keeps only what the forward changed; load_golden fills in the rest.
        kept = {k: v for k, v in ref_out[group].items()
                if not (group.startswith("state_") and torch.equal(v, state[k]))}
        tensors.update({f"{group}.{k}": v for k, v in kept.items()})
    unc_names = sorted(ref_out["unc_grads"])
    tensors["unc_grad_norms"] = torch.stack([ref_out["unc_grads"][n].norm() for n in unc_names])
    tensors.update({f"unc_grads.{n}": ref_out["unc_grads"][n] for n in UNC_FULL})
    parity_common.save_tensors(out_dir / "io.safetensors", tensors)
    meta = {"reference": parity_common.reference_meta(REPO, commit, LICENSE),
            "config": CONFIG, "perts": PERTS, "perts_single": PERTS_SINGLE, "controls": CONTROLS,
            "unc_grad_names": unc_names, "written_by": "scripts/parity/gears.py --write-golden",
            "model": "GEARS_Model (gears/model.py) vs GEARSModel(coexpress_first_cell_only=True)",
            "loss": "gears/utils.py loss_fct (autofocus + direction) vs gears_loss, direction_lambda 0.1"}
    parity_common.save_json(out_dir / "meta.json", meta)


def load_golden(golden_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], dict]:
    """(reference weights, inputs, the reference's outputs in ``compare``'s layout, meta) from golden files."""
    state, saved, meta, inputs = parity_common.read_golden_files(golden_dir, "gears.py")
    ref: dict[str, Any] = {k: saved[k] for k in _TENSORS}
    for group in _GROUPS:
        ref[group] = {k.removeprefix(group + "."): v for k, v in saved.items() if k.startswith(group + ".")}
        if group.startswith("state_"):
            ref[group] = {**state, **ref[group]}
    ref["adam_lr"] = meta["config"]["adam_lr"]
    ref["unc_grads"] = {k.removeprefix("unc_grads."): v for k, v in saved.items() if k.startswith("unc_grads.")}
    ref["unc_grad_norms"], ref["unc_grad_names"] = saved["unc_grad_norms"], meta["unc_grad_names"]
    return state, inputs, ref, meta


# ----------------------------------------------------------------------------------------------------------
# Ten optimizer steps of the `paper` recipe (--ten-steps)
# ----------------------------------------------------------------------------------------------------------

# GEARS' train(): Adam(model.parameters(), lr 1e-3, weight_decay 5e-4) (every parameter decayed), the loss_fct
# with its direction term, clip_grad_value_(1.0) and StepLR(step_size=1, gamma=0.5) stepped after each epoch.
# Ten steps are two "epochs" of five batches (ours: train.epochs=2 on five batches an epoch), so the StepLR
# halves the lr once. The preset's lr, weight decay, clipping and schedule; only the run's length and the batch
# are scaled. In float64 (both sides run in it): at float32's tolerances a weight decay of 5e-4 on the biases
# over ten steps would not show.
TEN_STEPS: dict[str, Any] = {"steps": 10, "epochs": 2, "steps_per_epoch": 5, "cells": 5, "lr": 1e-3,
                             "weight_decay": 5e-4, "clip_value": 1.0, "step_size": 1, "gamma": 0.5, "seed": 5353}
TEN_OVERRIDES = ["task.name=perturbation_gears", "task.preset=paper", f"train.epochs={TEN_STEPS['epochs']}",
                 f"train.per_device_batch_size={TEN_STEPS['cells']}"]
"""The command-line overrides on top of `task.preset=paper` (the run's length and the batch: scales, not rules)."""
# The conditions the ten batches draw from: singles and doubles of the perturbable genes, and control.
TEN_CONDITIONS = [[2, -1], [1, 4], [3, 6], [5, -1], [0, 7], [-1, -1]]
TOL_TEN = {"rtol": 1e-10, "atol": 1e-10}


def ten_step_inputs(config: Mapping[str, Any] = CONFIG) -> dict[str, torch.Tensor]:
    """The graphs and control mean of `make_inputs`, and ten seeded batches of five cells (``"<step>.<field>"``:
    x, y, pert_idx, condition, nonzero_mask), each with at least one perturbed cell.

    A batch of control cells only is left out on purpose: the reference then leaves the perturbation branch
    without gradients (None), which its Adam skips (no step, no weight decay), while ours has zero gradients
    there, which Adam's momentum and weight decay still move (a documented difference, not this comparison's)."""
    one = make_inputs(config)
    g = torch.Generator().manual_seed(TEN_STEPS["seed"])
    n_genes = config["num_genes"]
    names = condition_names(TEN_CONDITIONS)
    kept = [torch.ones(n_genes, dtype=torch.bool) if name == "ctrl" else torch.rand(n_genes, generator=g) > 0.25
            for name in names]
    out = {k: one[k] for k in ("coexpress_edge_index", "coexpress_edge_weight", "go_edge_index", "go_edge_weight",
                               "ctrl_mean")}
    control = len(TEN_CONDITIONS) - 1
    for step in range(TEN_STEPS["steps"]):
        cond = torch.randint(0, len(TEN_CONDITIONS), (TEN_STEPS["cells"],), generator=g)
        if bool((cond == control).all()):
            cond[0] = step % control
        x = torch.relu(torch.randn((TEN_STEPS["cells"], n_genes), generator=g, dtype=torch.float64) + 0.5)
        out.update({f"{step}.x": x, f"{step}.y": x + 0.5 * torch.randn(x.shape, generator=g, dtype=torch.float64),
                    f"{step}.pert_idx": torch.tensor([TEN_CONDITIONS[c] for c in cond.tolist()]),
                    f"{step}.condition": cond, f"{step}.nonzero_mask": torch.stack([kept[c] for c in cond.tolist()])})
    return out


def ten_step_batch(inputs: Mapping[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s batch as our collate gives it (x, y, pert_idx, condition, nonzero_mask) plus the control
    mean (`ctrl_mean`, float64)."""
    batch = {k: inputs[f"{step}.{k}"] for k in ("x", "y", "pert_idx", "condition", "nonzero_mask")}
    return {**batch, "ctrl_mean": inputs["ctrl_mean"].double()}


def paper_config(overrides: list[str] = TEN_OVERRIDES) -> Any:
    """Our config: `task.preset=paper` with the ten steps' overrides."""
    from trainer.config import load_config

    return load_config(None, [*overrides, "log.progress_bar=false", "log.tensorboard=false"])


def ours_ten_steps(ref_state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                   config: Mapping[str, Any] = CONFIG, overrides: list[str] = TEN_OVERRIDES) -> dict[str, Any]:
    """Ten optimizer steps by our loop's own step (`Trainer.train_step`: the task's GEARS loss, the engine's
    backward, clipping and optimizer step, the scheduler) from the reference's weights, in float64; the run plan
    (`build_run_plan`) turns the preset's decay every epoch into steps for five batches an epoch. The state after
    the ten steps is in the reference's layout. Needs a fresh accelerate state."""
    from types import SimpleNamespace

    from trainer.core.loaders import MicroBatch
    from trainer.core.run_plan import build_run_plan
    from trainer.core.trainer import Trainer
    from trainer.families.perturbation_gears.reference import from_reference_state_dict, reference_state_dict
    from trainer.families.perturbation_gears.task import PerturbationGearsTask

    cfg = paper_config(overrides)
    task = PerturbationGearsTask(cfg.task, seed=cfg.run.seed)
    task.attach_stats({"ctrl_mean": inputs["ctrl_mean"].tolist()})
    coexpress, go = graphs(inputs, torch.float64)
    model = build_ours(inputs, config).to(torch.float64)
    model.load_state_dict(from_reference_state_dict(
        {k: v.double() if v.is_floating_point() else v for k, v in ref_state.items()}, coexpress, go), strict=True)
    plan = build_run_plan(cfg, SimpleNamespace(grad_accum_steps=1, lr_world_size=1),  # type: ignore[arg-type]
                          batches_per_epoch=TEN_STEPS["steps_per_epoch"])
    loop = parity_common.stand_in_loop(cfg, task, model, plan)
    model, optimizer = loop.model, loop.optimizer
    losses, norms, lrs = [], [], []
    for step in range(plan.max_steps):
        batch = {k: v for k, v in ten_step_batch(inputs, step).items() if k != "ctrl_mean"}
        lrs.append(optimizer.param_groups[0]["lr"])
        stats = Trainer.train_step(loop, [MicroBatch(batch, None)])  # type: ignore[arg-type]
        losses.append(stats["loss"].detach().double())
        norms.append(stats["grad_norm"].double())
        loop.state.step += 1
    return {"losses": torch.stack(losses), "grad_norms": torch.stack(norms), "lrs": torch.tensor(lrs, dtype=torch.float64),
            "state": reference_state_dict(_state(model)), "cfg": cfg, "plan": plan}


def reference_ten_steps(ref: Mapping[str, Any], inputs: Mapping[str, torch.Tensor], config: Mapping[str, Any] = CONFIG
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the randomised initial reference state dict, the reference's ten steps).

    GEARS' ``train`` is a method of its ``GEARS`` object, which needs its data pipeline (scanpy, a PertData);
    its body is written out here as it reads: ``optim.Adam(model.parameters(), lr, weight_decay)``,
    ``StepLR(optimizer, step_size=1, gamma=0.5)``, and per batch ``zero_grad``, the forward, the reference's own
    ``loss_fct`` (ctrl, dict_filter, direction_lambda), ``backward``, ``nn.utils.clip_grad_value_(...,
    clip_value=1.0)`` and ``optimizer.step()``; ``scheduler.step()`` after each epoch. The gradient norm (before
    clipping) and the number of clipped components are measured beside it."""
    torch.manual_seed(config["seed"])
    model = build_reference(ref, inputs, config, torch.float64)
    randomise_(model, TEN_STEPS["seed"])
    state = {k: v.detach().clone().float() if v.is_floating_point() else v.detach().clone()
             for k, v in model.state_dict().items()}
    # The float32 weights are the initial state on both sides (the golden files keep them in float32).
    model.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=TEN_STEPS["lr"], weight_decay=TEN_STEPS["weight_decay"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=TEN_STEPS["step_size"], gamma=TEN_STEPS["gamma"])
    losses, norms, lrs, clipped = [], [], [], []
    step = 0
    for _epoch in range(TEN_STEPS["epochs"]):
        model.train()
        for _ in range(TEN_STEPS["steps_per_epoch"]):
            batch = ten_step_batch(inputs, step)
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.zero_grad()
            pred = model(_batch(batch["x"], batch["pert_idx"]))
            loss = _loss(ref, pred, batch, config)
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            clipped.append(sum(int((g.abs() > TEN_STEPS["clip_value"]).sum()) for g in grads))
            nn.utils.clip_grad_value_(model.parameters(), clip_value=TEN_STEPS["clip_value"])
            optimizer.step()
            losses.append(loss.detach())
            step += 1
        scheduler.step()
    return state, {"losses": torch.stack(losses), "grad_norms": torch.stack(norms),
                   "lrs": torch.tensor(lrs, dtype=torch.float64), "state": _state(model), "clipped": clipped}


def compare_ten_steps(ours: Mapping[str, Any], ref: Mapping[str, Any]) -> list[str]:
    """Differences of our ten steps from the reference's beyond 1e-10 (empty: parity): the loss (our step reports
    it in float32: relative 1e-6), the lr and the gradient norm of each step, and the whole state after the ten
    steps (parameters, BatchNorm running statistics and counters), in the reference's layout."""
    failures: list[str] = []
    close("ten steps: loss per step", ours["losses"], ref["losses"], rtol=TOL_LOSS_REL, atol=0.0, failures=failures)
    close("ten steps: lr per step", ours["lrs"], ref["lrs"], **TOL_TEN, failures=failures)
    close("ten steps: gradient norm per step", ours["grad_norms"], ref["grad_norms"], **TOL_TEN, failures=failures)
    got, want = ours["state"], ref["state"]
    for key in sorted(set(want) | set(got)):
        if key.startswith(UNUSED):
            continue  # no counterpart in ours (reference_state_dict writes fixed values; the reference never steps them)
        if key not in got or key not in want:
            failures.append(f"ten steps: state key {key!r} on one side only")
            continue
        w = want[key]
        close(f"ten steps: state {key}", got[key].to(w.dtype), w, **TOL_TEN, failures=failures)
    return failures


def _used(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the reference's parameters that no output depends on (`UNUSED`): what the golden files
    keep."""
    return {k: v for k, v in state.items() if not k.startswith(UNUSED)}


TEN_STEP_LAYOUT = (("losses", "lrs", "grad_norms"), ("state",))
"""What ten_steps.safetensors keeps of the reference's ten steps: (tensors, dicts of tensors)."""


def write_ten_step_golden(out_dir: Path, state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                          ref_out: Mapping[str, Any], commit: str) -> None:
    """ten_steps.safetensors (initial reference weights, the ten batches, the reference's losses, lrs, gradient
    norms and state after ten steps) and ten_steps.json."""
    meta = {"reference": parity_common.reference_meta(REPO, commit, LICENSE),
            "config": CONFIG, "ten_steps": TEN_STEPS, "conditions": TEN_CONDITIONS, "overrides": TEN_OVERRIDES,
            "clipped_components": ref_out["clipped"],
            "written_by": "scripts/parity/gears.py --ten-steps --write-golden",
            "recipe": "reference: the body of gears/gears.py GEARS.train written out as it reads (the method needs "
                      "GEARS' data pipeline): Adam(model.parameters(), lr 1e-3, weight_decay 5e-4), StepLR(1, 0.5) "
                      "stepped per epoch (two epochs of five batches), per batch loss_fct (gears/utils.py, "
                      "direction_lambda 0.1), backward, clip_grad_value_(1.0), optimizer.step; float64; every batch "
                      "has a perturbed cell. Ours: Trainer.train_step with task.preset=paper"}
    parity_common.write_ten_step_files(out_dir, state, inputs, {**ref_out, "state": _used(ref_out["state"])},
                                       TEN_STEP_LAYOUT, meta)


def load_ten_step_golden(golden_dir: Path) -> parity_common.Golden:
    """(initial reference weights, inputs, the reference's ten steps in `compare_ten_steps`' layout, meta)."""
    return parity_common.read_ten_step_files(golden_dir, "gears.py", TEN_STEP_LAYOUT,
                                             from_meta={"clipped": "clipped_components"})


def main_ten_steps(args: Any, ref: Mapping[str, Any], commit: str, log: Callable[[str], None]) -> int:
    """--ten-steps: the reference's ten steps against ours (and the golden files written or checked)."""
    inputs = ten_step_inputs()
    state, ref_out, ours, failures = parity_common.run_both(inputs, lambda x: reference_ten_steps(ref, x),
                                                            ours_ten_steps, compare_ten_steps)
    failures += parity_common.check_golden(args, load_ten_step_golden, state, inputs,
                                           {**ref_out, "state": _used(ref_out["state"])}, compare_ten_steps)
    log(f"reference {REPO}@{commit[:7]}; ten steps of the paper recipe ({' '.join(TEN_OVERRIDES[2:])})")
    parity_common.log_losses(log, ref_out["losses"], ours["losses"])
    log("lr per step " + " ".join(f"{v:.3g}" for v in ref_out["lrs"].tolist()))
    log("gradient norms (before clipping) " + " ".join(f"{v:.4g}" for v in ref_out["grad_norms"].tolist())
        + "; components clipped to 1 " + " ".join(str(c) for c in ref_out["clipped"]))
    diffs = [(ours["state"][k].double() - v.double()).abs().max().item() for k, v in ref_out["state"].items()
             if not k.startswith(UNUSED) and v.is_floating_point()]
    log(f"max |state diff| after ten steps {max(diffs):.3g}")
    return report(failures, "ten steps: loss, lr, gradient norms, weights and BatchNorm statistics within tolerance",
                  args, lambda out: write_ten_step_golden(out, state, inputs, ref_out, commit), log)


def main_parity(args: Any, ref: Mapping[str, Any], commit: str, log: Callable[[str], None]) -> int:
    """One forward and backward of the reference's against ours (and the golden files written or checked)."""
    inputs = make_inputs()
    state, ref_out, ours, failures = parity_common.run_both(
        inputs, lambda x: reference_outputs(ref, x), ours_outputs, compare,
        lambda st: round_trip_into_reference(ref, st, inputs))
    # The committed golden files must still be what this checkout computes (not stale, same inputs).
    failures += parity_common.check_golden(args, load_golden, state, inputs, {**ref_out, "round_trip": True},
                                           compare)
    log(f"reference {REPO}@{commit[:7]}; {CONFIG['num_genes']} genes, {CONFIG['num_perts']} perturbable, hidden "
        f"{CONFIG['hidden_size']}, GNN layers {CONFIG['num_gene_gnn_layers']} + {CONFIG['num_go_gnn_layers']}, "
        f"batch {len(PERTS)} cells")
    dout = max((ours[k] - ref_out[k]).abs().max().item() for k in ("pred_eval", "pred_train", "pred_single",
                                                                     "pred_control"))
    lrel = ((ours["loss"] - ref_out["loss"]).abs() / ref_out["loss"].abs()).item()
    gmax = parity_common.max_relative_diff(ours["grads"], ref_out["grads"],
                                            keep=lambda n, g: bool(g.abs().max() > TOL_GRAD["atol"]))
    d64 = max([(ours[k] - ref_out[k]).abs().max().item() for k in ("pred_train64", "unc_pred", "unc_logvar")]
              + [(ours["grads64"][n] - g).abs().max().item() for n, g in ref_out["grads64"].items()]
              + [(ours["unc_grads"][n] - g).abs().max().item() for n, g in ref_out["unc_grads"].items()])
    log(f"float32: max |output diff| {dout:.3g}; loss reference {ref_out['loss'].item():.6g}, relative diff "
        f"{lrel:.3g}; max gradient diff / tensor max {gmax:.3g} (tensors above float32 noise); float64: max |output "
        f"or gradient diff| {d64:.3g}")
    return report(failures, "parity: state dict round trip exact; forward (eval, train, one perturbed cell, controls "
                  "only) and the "
                  "state after it, loss, gradients, SGD and Adam steps, float64 forward and gradients within "
                  "tolerance; uncertainty head (float64) forward, log-variance, loss and gradients within tolerance", args,
                  lambda out: write_golden(out, state, inputs, ref_out, commit), log)


main = functools.partial(parity_common.main, __doc__, ENV, load_reference, main_parity, main_ten_steps)
"""main(argv=None, log=print) -> exit status."""


if __name__ == "__main__":
    sys.exit(main())

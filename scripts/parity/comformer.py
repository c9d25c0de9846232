"""Parity of our crystals ComFormer (iComFormer and eComFormer) with the reference implementation, on CPU.

The reference is divelab/AIRS, ``OpenMat/ComFormer`` (GPL-3.0: loaded from a checkout named by
``TRAINER_REFERENCE_COMFORMER=/path/to/checkout``, never copied; nothing is fetched). As committed it does not
import (a ``comforemr`` module typo, ``super(MatformerConv, self)`` with no ``MatformerConv`` defined, torch_scatter
/ torch_sparse, pydantic v1's ``BaseSettings``); :func:`load_reference` makes it import without touching its files:
stub ``torch_scatter`` (``scatter`` from torch_geometric) and ``torch_sparse`` modules, pydantic v1 (``pydantic.v1``)
in place of ``pydantic`` while its modules import, ``torch.jit.script`` a no-op for that time (its unused sparse
softmax helpers are scripted against torch_scatter's CSR ops), ``comforemr`` an alias of its own package, and
``MatformerConv`` bound to its ``ComformerConv``. All of that lives in ``sys.modules`` and module attributes for the
running process only.

Both sides are built from one small config under float64 default dtype (the reference's RBF width comes from
``np.diff`` of its float32 centres when built in float32: see the docs' parity section), every parameter and
buffer randomised (seeded; BatchNorm affine parameters and running statistics included; the RBF centres and e3nn's
output masks are fixed functions of the config), the state dict mapped both ways with ``strict=True`` (round trips
exact), and compared on three small crystals whose graphs come from OUR builder (``build_crystal_graph``, k = 6
with lattice self-loops, collated by ``collate_graphs``), handed to the reference as its PyG inputs
(``edge_index = [src; dst]``, ``edge_attr = -edge_vec``, ``edge_nei`` = the three lattice vectors of each edge's
crystal, ``x`` = the CGCNN rows):

* the forward in eval and in train mode, and the BatchNorm running statistics after the train-mode forward;
* the MSE loss against fixed targets (the reference trains with ``nn.MSELoss`` on its squeezed output; ours is
  the same formula on our ``[B, 1]`` output), its gradients, and the parameters after one SGD and one Adam step;

all at 1e-10 (float64). The reference's iComformer and eComformer forwards hard-code their layer indices, so the
layer counts are theirs (4 node layers + 1 edge layer; 3 + 1); its eComformer builds its equivariant layer with
``ns=64, nv=8`` fixed, which the golden files replace by the reference's own ``ComformerConvEqui`` at ``ns=8,
nv=2`` (a constructor argument of that class) to keep them small.

    TRAINER_REFERENCE_COMFORMER=/tmp/ref_comformer python scripts/parity/comformer.py     # compare; exit 1 on a failure
    TRAINER_REFERENCE_COMFORMER=/tmp/ref_comformer python scripts/parity/comformer.py \\
        --write-golden tests/families/crystals/golden

``--ten-steps`` compares ten optimizer steps of our ``task.preset=paper`` (through ``Trainer.train_step``, in
float64) with ten steps of the reference's recipe on ten pinned batches (iComFormer): its own ``group_decay`` and
``setup_optimizer`` from ``comformer/train.py`` (imported with its ignite, jarvis and data-pipeline imports
stubbed), its OneCycleLR built as ``train_main`` builds it, and the step of ignite's ``create_supervised_trainer``
(MSE on standardised targets, no clipping); its golden files are ``DIR/icomformer/ten_steps.safetensors`` and
``ten_steps.json``.

``--write-golden DIR`` writes, per variant, ``DIR/<variant>/``: ``weights.safetensors`` (the randomised weights in
OUR key layout; float32-representable values), ``io.safetensors`` (inputs and the reference's outputs, running
statistics, loss, gradient norms and a few full gradients and stepped parameters) and ``meta.json`` (repository,
commit, licence, config). Numbers only: no reference code. ``--check-golden DIR`` also checks that the golden
files are what this checkout computes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import os
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parity_common  # noqa: E402
from parity_common import add_prefix, close, report  # noqa: E402

REPO = "divelab/AIRS"
SUBDIR = "OpenMat/ComFormer"
LICENSE = "GPL-3.0"
ENV = "TRAINER_REFERENCE_COMFORMER"
VARIANTS = ("icomformer", "ecomformer")
LIVE_ONLY = ("ecomformer_ns64",)  # compared live only: its equivariant layer is too large for golden files

# Small enough for golden files of tens of KB, with every layer kind: the reference's own layer counts (its
# forwards index att_layers[0..3] / [0..2]), 8 channels, 8 RBF bins.
CONFIGS: dict[str, dict[str, Any]] = {
    "icomformer": {"variant": "icomformer", "conv_layers": 4, "edge_layers": 1, "node_features": 8,
                   "edge_features": 8, "triplet_features": 8, "fc_features": 8, "heads": 1},
    "ecomformer": {"variant": "ecomformer", "conv_layers": 3, "edge_layers": 1, "node_features": 8,
                   "edge_features": 8, "triplet_features": 8, "fc_features": 8, "heads": 1,
                   "equi_scalars": 8, "equi_vectors": 2},
    # The reference's eComformer exactly as it builds itself (equivariant layer at its fixed ns=64, nv=8).
    "ecomformer_ns64": {"variant": "ecomformer", "conv_layers": 3, "edge_layers": 1, "node_features": 8,
                        "edge_features": 8, "triplet_features": 8, "fc_features": 8, "heads": 1,
                        "equi_scalars": 64, "equi_vectors": 8},
}
RUN: dict[str, Any] = {"seed": 53, "k": 6, "sgd_lr": 0.1, "adam_lr": 1e-3}

TOL = {"rtol": 1e-10, "atol": 1e-10}  # float64 throughout

# Biases right before a train-mode BatchNorm (the output projection of every node and edge layer): BatchNorm
# subtracts the batch mean, so their gradient is zero in exact arithmetic and rounding noise in either
# code. Adam's first step there is lr * noise / (|noise| + eps), not comparable between two correct codes; their
# gradients (zero on both sides) and SGD steps are compared, their Adam steps are not.
ZERO_GRADIENT_SUFFIX = "lin_concate.bias"

# Full tensors the golden files keep for gradients and stepped parameters (the others: norms).
GOLDEN_TENSORS = {
    "icomformer": ["atom_embedding.bias", "att_layers.0.key_update.0.weight", "edge_update_layers.0.lin_key_e2.weight",
                   "edge_update_layers.0.bn_att.weight", "rbf_angle.1.weight", "fc_out.bias"],
    "ecomformer": ["atom_embedding.bias", "att_layers.2.lin_msg_update.0.weight",
                   "equi_update_layers.0.nlayer_1.fc.2.bias", "equi_update_layers.0.nlayer_2.fc.0.weight",
                   "equi_update_layers.0.bn.weight", "fc_out.bias"],
}

# Three small crystals (atomic numbers, Cartesian positions in Angstrom, cell rows): rock salt, a perturbed diamond
# Si and a triclinic oxide, so the lattice cosines take generic values and the batch mixes graph sizes.
CRYSTALS: list[tuple[list[int], list[list[float]], list[list[float]]]] = [
    ([11, 17], [[0.0, 0.0, 0.0], [2.82, 0.0, 0.0]], [[0.0, 2.82, 2.82], [2.82, 0.0, 2.82], [2.82, 2.82, 0.0]]),
    ([14, 14], [[0.02, -0.01, 0.0], [1.36, 1.35, 1.37]],
     [[0.0, 2.715, 2.715], [2.715, 0.0, 2.715], [2.76, 2.69, 0.0]]),
    ([3, 8, 8], [[0.1, 0.2, 0.3], [1.6, 1.9, 2.0], [2.6, 0.9, 3.4]],
     [[3.1, 0.2, 0.1], [0.4, 3.6, -0.2], [0.3, 0.5, 4.2]]),
]


# ----------------------------------------------------------------------------------------------------------
# Our side (no reference needed: the golden test uses these too)
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def default_float64():
    """Build under float64 default dtype (RBF centres and widths computed in float64 on both sides)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_ours(config: Mapping[str, Any]) -> nn.Module:
    """Our ComFormer for ``config`` in float64."""
    from trainer.families.crystals.comformer import build_comformer

    with default_float64():
        return build_comformer(dict(config)).double()


def make_inputs(seed: int = RUN["seed"], k: int = RUN["k"]) -> dict[str, torch.Tensor]:
    """The crystals through our graph builder and collate (float64), and seeded targets."""
    from trainer.families.crystals.dataset import collate_graphs
    from trainer.families.crystals.graphs import GraphSpec, build_crystal_graph

    rows = []
    for numbers, positions, cell in CRYSTALS:
        pos, lat = np.asarray(positions, np.float64), np.asarray(cell, np.float64)
        g = build_crystal_graph(pos, lat, GraphSpec(k=k), check_overlap=True)
        rows.append({"atomic_numbers": np.asarray(numbers, np.int64), "positions": pos, "cell": lat,
                     "num_atoms": len(numbers), "num_edges": len(g["edge_src"]), **g})
    batch = collate_graphs(rows)
    keep = ("atomic_numbers", "positions", "cell", "batch", "num_atoms", "edge_src", "edge_dst", "edge_shift",
            "lattice_coeffs")
    out = {key: (batch[key].double() if batch[key].is_floating_point() else batch[key]) for key in keep}
    gen = torch.Generator().manual_seed(seed + 1)
    out["target"] = torch.randn(len(CRYSTALS), generator=gen, dtype=torch.float64)
    return out


def bn_buffers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The BatchNorm running statistics in a state dict."""
    return {k: v.detach().clone() for k, v in state.items()
            if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


def step_params(params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], kind: str
                ) -> dict[str, torch.Tensor]:
    """Parameters after one ``kind`` ("sgd" or "adam") step from ``params`` with ``grads`` (copies)."""
    return parity_common.step_params(params, grads, kind, RUN["sgd_lr"], RUN["adam_lr"])


def ours_outputs(state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                 config: Mapping[str, Any]) -> dict[str, Any]:
    """Everything compared, computed by our code from ``state`` (our key layout)."""
    from trainer.families.crystals.reference import from_reference_state_dict, reference_state_dict

    model = build_ours(config)
    model.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    back = from_reference_state_dict(reference_state_dict(model.state_dict()))
    round_trip = set(back) == set(model.state_dict()) and all(
        torch.equal(back[k], v) for k, v in model.state_dict().items())
    batch = dict(inputs)
    with torch.no_grad():
        out_eval = model.eval()(batch)[:, 0]
    model.train()
    out_train = model(batch)[:, 0]
    loss = F.mse_loss(out_train, inputs["target"])
    loss.backward()
    params = {n: p for n, p in model.named_parameters() if p.grad is not None}
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    return {"round_trip": round_trip, "out_eval": out_eval, "out_train": out_train.detach(),
            "bn": bn_buffers(model.state_dict()), "loss": loss.detach(), "grads": grads,
            "sgd": step_params(params, grads, "sgd"), "adam": step_params(params, grads, "adam")}


def compare(ours: Mapping[str, Any], ref: Mapping[str, Any]) -> list[str]:
    """Differences between our outputs and the reference's beyond 1e-10 (empty: parity).

    ``ref`` (names ours) holds ``out_eval``, ``out_train``, ``bn`` (running statistics after the train-mode
    forward), ``loss`` and ``grads`` / ``sgd`` / ``adam`` (full tensors, some or all), optionally with
    ``<kind>_norms`` over ``names`` (every parameter).
    """
    failures: list[str] = []
    if not ours["round_trip"]:
        failures.append("state dict round trip (ours -> reference -> ours) is not exact")
    close("forward (eval)", ours["out_eval"], ref["out_eval"], **TOL, failures=failures)
    close("forward (train)", ours["out_train"], ref["out_train"], **TOL, failures=failures)
    if set(ours["bn"]) != set(ref["bn"]):
        failures.append(f"BatchNorm buffers differ in names: {sorted(set(ours['bn']) ^ set(ref['bn']))[:4]}")
    for name, want in ref["bn"].items():
        if name in ours["bn"]:
            close(f"BatchNorm {name} after the train forward", ours["bn"][name], want, **TOL, failures=failures)
    close("loss (MSE)", ours["loss"], ref["loss"], **TOL, failures=failures)
    for kind, label in (("grads", "gradient"), ("sgd", "sgd step"), ("adam", "adam step")):
        if "names" not in ref and set(ours[kind]) != set(ref[kind]):
            failures.append(f"{label}: parameter names differ: {sorted(set(ours[kind]) ^ set(ref[kind]))[:4]}")
        for name, want in ref[kind].items():
            if kind == "adam" and name.endswith(ZERO_GRADIENT_SUFFIX):
                continue
            close(f"{label} {name}", ours[kind][name], want, **TOL, failures=failures)
        if f"{kind}_norms" in ref:
            missing = [n for n in ref["names"] if n not in ours[kind]]
            if missing:
                failures.append(f"{label}: no value for {missing[:4]}")
                continue
            keep = [i for i, n in enumerate(ref["names"])
                    if not (kind == "adam" and n.endswith(ZERO_GRADIENT_SUFFIX))]
            got = torch.stack([ours[kind][ref["names"][i]].norm() for i in keep])
            close(f"{label} norms", got, ref[f"{kind}_norms"][keep], **TOL, failures=failures)
    return failures


def randomise_(model: nn.Module, seed: int) -> None:
    """Seeded random values for every parameter and buffer but the RBF centres and e3nn's output masks (fixed
    functions of the config). Drawn in float32 (so the golden files store them exactly in float32) and scaled
    so activations stay O(1): weights ~ N(0, 1/fan_in), biases ~ 0.1 N(0, 1), BatchNorm scales around 1,
    running means around 0, running variances in [0.5, 1.5), step counts small integers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted({**dict(model.named_parameters()), **dict(model.named_buffers())}.items()):
            if name.endswith(("centers", "output_mask")) or t.numel() == 0:
                continue
            if name.endswith("num_batches_tracked"):
                t.fill_(int(torch.randint(1, 10, (), generator=g)))
                continue
            r = torch.randn(t.shape, generator=g, dtype=torch.float32)
            if name.endswith("running_var"):
                v = 0.5 + torch.rand(t.shape, generator=g, dtype=torch.float32)
            elif (".bn" in name or name.startswith("bn")) and name.endswith("weight"):
                v = 1.0 + 0.2 * r
            elif t.ndim >= 2:
                v = r / t.shape[-1] ** 0.5
            else:
                v = 0.1 * r
            t.copy_(v.to(t.dtype))


# ----------------------------------------------------------------------------------------------------------
# The reference (only with a checkout)
# ----------------------------------------------------------------------------------------------------------


def _torch_scatter_stub() -> types.ModuleType:
    from torch_geometric.utils import scatter as pyg_scatter

    def scatter(src: torch.Tensor, index: torch.Tensor, dim: int = -1, out: torch.Tensor | None = None,
                dim_size: int | None = None, reduce: str = "sum") -> torch.Tensor:
        if out is not None:
            raise NotImplementedError("torch_scatter stub (scripts/parity/comformer.py): out= is not supported")
        return pyg_scatter(src, index, dim=dim, dim_size=dim_size, reduce=reduce)

    def csr_unsupported(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("torch_scatter stub (scripts/parity/comformer.py): CSR ops are not used by "
                                  "ComFormer's forward")

    mod = types.ModuleType("torch_scatter")
    mod.scatter, mod.gather_csr, mod.segment_csr = scatter, csr_unsupported, csr_unsupported  # type: ignore[attr-defined]
    return mod


def _torch_sparse_stub() -> types.ModuleType:
    mod = types.ModuleType("torch_sparse")

    class SparseTensor:  # only named by the reference's imports and annotations
        pass

    mod.SparseTensor = SparseTensor  # type: ignore[attr-defined]
    return mod


def load_reference(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Import the reference's ``comformer.models.comformer`` and ``transformer`` from a checkout (the repository
    root or its ``OpenMat/ComFormer`` folder), patched to import on this machine (see the module docstring)."""
    root = Path(path).resolve()
    if not (root / "comformer" / "models" / "comformer.py").is_file() and (root / SUBDIR).is_dir():
        root = root / SUBDIR
    if not (root / "comformer" / "models" / "comformer.py").is_file():
        raise SystemExit(f"{ENV}={path}: no comformer/models/comformer.py there (expected a checkout of "
                         f"{REPO}, {SUBDIR})")
    import pydantic.v1
    import pydantic.v1.typing

    shims = {"torch_scatter": _torch_scatter_stub(), "torch_sparse": _torch_sparse_stub(),
             "pydantic": pydantic.v1, "pydantic.typing": pydantic.v1.typing}
    # Another module imported as "comformer" (this script, imported by that name from scripts/parity) would shadow
    # the checkout's package. The reference's modules stay registered afterwards: PyG's MessagePassing looks its
    # subclass's module up in sys.modules when a layer is built.
    for name in [n for n in sys.modules if n.split(".")[0] in ("comformer", "comforemr")]:
        if not str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(root)):
            del sys.modules[name]
    saved = {name: sys.modules.get(name) for name in shims}
    sys.modules.update(shims)
    script = torch.jit.script
    torch.jit.script = lambda fn, *args, **kwargs: fn  # type: ignore[assignment]
    sys.path.insert(0, str(root))
    try:
        pkg = importlib.import_module("comformer")
        models = importlib.import_module("comformer.models")
        utils = importlib.import_module("comformer.models.utils")
        # transformer.py imports its own package as "comforemr".
        sys.modules.update({"comforemr": pkg, "comforemr.models": models, "comforemr.models.utils": utils})
        transformer = importlib.import_module("comformer.models.transformer")
        # ComformerConv.__init__ calls super(MatformerConv, self): the class was renamed, the call was not.
        transformer.MatformerConv = transformer.ComformerConv
        comformer = importlib.import_module("comformer.models.comformer")
    finally:
        torch.jit.script = script  # type: ignore[assignment]
        sys.path.remove(str(root))
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    return {"comformer": comformer, "transformer": transformer}


def build_reference(ref: Mapping[str, Any], config: Mapping[str, Any]) -> nn.Module:
    """The reference's iComformer / eComformer for ``config`` (float64), quiet (its layers print when built)."""
    mod = ref["comformer"]
    kw = {"conv_layers": config["conv_layers"], "edge_layers": config["edge_layers"],
          "node_features": config["node_features"], "edge_features": config["edge_features"],
          "triplet_input_features": config["triplet_features"], "fc_features": config["fc_features"],
          "node_layer_head": config["heads"], "edge_layer_head": config["heads"]}
    with contextlib.redirect_stdout(io.StringIO()), default_float64():
        if config["variant"] == "icomformer":
            model = mod.iComformer(mod.iComformerConfig(name="iComformer", **kw))
        else:
            model = mod.eComformer(mod.eComformerConfig(name="eComformer", **kw))
            if (config["equi_scalars"], config["equi_vectors"]) != (64, 8):  # its fixed size otherwise
                nf = config["node_features"]
                model.equi_update = ref["transformer"].ComformerConvEqui(
                    in_channels=nf, out_channels=nf, edge_dim=nf, use_second_order_repr=True,
                    ns=config["equi_scalars"], nv=config["equi_vectors"])
    return model.double()


def reference_data(inputs: Mapping[str, torch.Tensor]) -> tuple[Any, None, None]:
    """Our collated graph as the reference's ``(data, ldata, lattice)`` input: PyG fields ``x`` (CGCNN rows),
    ``edge_index = [src; dst]`` (messages src -> dst), ``edge_attr = -edge_vec`` (the reference's edge vector
    points the other way), ``edge_nei`` (each edge's three lattice vectors) and ``batch``."""
    from trainer.families.crystals.comformer import load_cgcnn_features

    pos, cell, graph = inputs["positions"], inputs["cell"], inputs["batch"]
    src, dst, shift = inputs["edge_src"], inputs["edge_dst"], inputs["edge_shift"]
    edge_vec = pos[src] + torch.einsum("ek,ekd->ed", shift, cell[graph[src]]) - pos[dst]
    lattice = torch.einsum("bij,bjk->bik", inputs["lattice_coeffs"].double(), cell)
    data = types.SimpleNamespace(x=load_cgcnn_features()[inputs["atomic_numbers"]].double(),
                                 edge_index=torch.stack([src, dst]), edge_attr=-edge_vec,
                                 edge_nei=lattice[graph[dst]], batch=graph)
    return data, None, None


def reference_outputs(ref: Mapping[str, Any], inputs: Mapping[str, torch.Tensor], config: Mapping[str, Any]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the randomised weights in our key layout, the reference's outputs with names mapped to ours)."""
    from trainer.families.crystals.reference import from_reference_state_dict

    torch.manual_seed(RUN["seed"])
    model = build_reference(ref, config)
    randomise_(model, RUN["seed"])
    ref_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = reference_data(inputs)
    with torch.no_grad():
        out_eval = model.eval()(data)
    model.train()
    out_train = model(data)
    loss = nn.MSELoss()(out_train, inputs["target"])  # the reference's criterion "mse"
    loss.backward()
    params = {n: p for n, p in model.named_parameters() if p.grad is not None}
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    out = {"ref_state": ref_state, "out_eval": out_eval, "out_train": out_train.detach(),
           "bn": from_reference_state_dict(bn_buffers(model.state_dict())), "loss": loss.detach(),
           "grads": from_reference_state_dict(grads),
           "sgd": from_reference_state_dict(step_params(params, grads, "sgd")),
           "adam": from_reference_state_dict(step_params(params, grads, "adam"))}
    return {k: _compact(v) for k, v in from_reference_state_dict(ref_state).items()}, out


def _compact(t: torch.Tensor) -> torch.Tensor:
    # The randomised values are float32 numbers: stored as float32 (half the bytes); the RBF centres (float64
    # linspace) are not, and stay float64.
    if t.dtype == torch.float64 and torch.equal(t.float().double(), t):
        return t.float()
    return t


def round_trips_in_reference(ref: Mapping[str, Any], ref_state: Mapping[str, torch.Tensor],
                             config: Mapping[str, Any]) -> list[str]:
    """Reference -> ours -> a fresh reference, both loaded strictly: every key equal but the unused ones (which
    come back as zeros)."""
    from trainer.families.crystals.reference import (
        REFERENCE_UNUSED,
        from_reference_state_dict,
        reference_state_dict,
    )

    ours = build_ours(config)
    ours.load_state_dict(from_reference_state_dict(ref_state), strict=True)
    fresh = build_reference(ref, config)
    fresh.load_state_dict(reference_state_dict(ours.state_dict()), strict=True)
    back = fresh.state_dict()
    failures = [f"round trip reference -> ours -> reference: '{k}' differs" for k, v in ref_state.items()
                if k not in REFERENCE_UNUSED and not torch.equal(back[k], v)]
    failures += [f"round trip: unused '{k}' is not zero" for k in REFERENCE_UNUSED if k in back and back[k].any()]
    return failures


def rbf_width_difference(vmin: float, vmax: float, bins: int = 256) -> float:
    """Relative difference between the reference's RBF ``gamma`` and ours when built in float32 (the default
    dtype): the reference takes ``np.diff`` of its float32 centres, ours of a float64 ``np.linspace``."""
    from trainer.families.crystals.comformer import RBFExpansion

    theirs = float(sys.modules["comformer.models.utils"].RBFExpansion(vmin=vmin, vmax=vmax, bins=bins).gamma)
    ours = RBFExpansion(vmin, vmax, bins).gamma
    return abs(theirs - ours) / ours


# ----------------------------------------------------------------------------------------------------------
# Golden files
# ----------------------------------------------------------------------------------------------------------


def write_golden(out_dir: Path, variant: str, state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                 ref_out: Mapping[str, Any], commit: str) -> None:
    """``out_dir/<variant>/``: weights.safetensors (ours layout), io.safetensors and meta.json."""
    d = out_dir / variant
    d.mkdir(parents=True, exist_ok=True)
    parity_common.save_tensors(d / "weights.safetensors", state)
    names = sorted(ref_out["grads"])
    tensors = {**add_prefix("input.", inputs),
               **{k: ref_out[k] for k in ("out_eval", "out_train", "loss")},
               **add_prefix("bn.", ref_out["bn"])}
    for kind in ("grads", "sgd", "adam"):
        tensors[f"{kind}_norms"] = torch.stack([ref_out[kind][n].norm() for n in names])
        tensors.update({f"{kind}.{n}": ref_out[kind][n] for n in GOLDEN_TENSORS[variant]})
    parity_common.save_tensors(d / "io.safetensors", tensors)
    meta = {"reference": parity_common.reference_meta(REPO, commit, LICENSE, path=SUBDIR),
            "variant": variant, "config": CONFIGS[variant], "run": RUN, "names": names,
            "written_by": "scripts/parity/comformer.py --write-golden",
            "weights": "randomised reference weights in our key layout (float32 values; compared in float64)",
            "loss": "nn.MSELoss on the reference's squeezed output in train mode = F.mse_loss on ours"}
    parity_common.save_json(d / "meta.json", meta)


def load_golden(golden_dir: Path, variant: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                         dict[str, Any], dict[str, Any]]:
    """(weights in our layout, inputs, the reference's outputs in ``compare``'s layout, meta) of one variant."""
    state, saved, meta, inputs = parity_common.read_golden_files(golden_dir / variant, "comformer.py")
    ref: dict[str, Any] = {k: saved[k] for k in ("out_eval", "out_train", "loss")}
    ref["bn"] = {k.removeprefix("bn."): v for k, v in saved.items() if k.startswith("bn.")}
    for kind in ("grads", "sgd", "adam"):
        ref[kind] = {k.removeprefix(kind + "."): v for k, v in saved.items() if k.startswith(kind + ".")}
        ref[f"{kind}_norms"] = saved[f"{kind}_norms"]
    ref["names"] = meta["names"]
    return state, inputs, ref, meta


# ----------------------------------------------------------------------------------------------------------
# Ten optimizer steps of the `paper` recipe (--ten-steps)
# ----------------------------------------------------------------------------------------------------------

# The reference's recipe (comformer/train.py, with train_props.py's settings): MSE on standardised targets,
# AdamW (lr 1e-3, weight decay 1e-5, none on parameters named bias / bn / norm), OneCycleLR(max_lr, epochs,
# steps_per_epoch, pct_start=0.3) stepped after every batch, no clipping. Ten steps are one whole cycle here (two
# "epochs" of five batches: ours `train.max_steps=10`), so the rise, the peak and the anneal of the lr and of
# Adam's beta1 are all taken. The preset's own lr and weight decay; only the cycle's length is scaled.
TEN_STEPS: dict[str, Any] = {"steps": 10, "epochs": 2, "steps_per_epoch": 5, "lr": 1e-3, "weight_decay": 1e-5,
                             "pct_start": 0.3, "target_mean": 0.25, "target_std": 1.5, "jitter": 0.05,
                             "seed": 5353}
TEN_OVERRIDES = ["task.name=crystal_property", "task.preset=paper", "train.epochs=0",
                 f"train.max_steps={TEN_STEPS['steps']}", f"train.per_device_batch_size={len(CRYSTALS)}"]
"""The command-line overrides on top of `task.preset=paper` (the cycle's length and the batch: scales, not rules)."""
TEN_VARIANTS = ("icomformer",)  # eComFormer's layers are compared above; the recipe is the model's outside
TEN_BATCH_KEYS = ("atomic_numbers", "positions", "cell", "batch", "num_atoms", "edge_src", "edge_dst", "edge_shift",
                  "lattice_coeffs", "target")
TOL_TEN_LOSS_REL = 1e-6  # our step's loss is reported in float32 (Trainer.train_step); the weights stay float64
# The biases right before a train-mode BatchNorm (ZERO_GRADIENT_SUFFIX) have a gradient of rounding noise on
# both sides; Adam turns noise into steps of lr x noise / eps, so after ten steps they differ by far more than
# 1e-10 between two correct codes, and with them the running mean of the BatchNorm they feed (the bias shifts the
# batch mean; the normalised output does not see it). Those are compared to 1e-7, under a thousandth of what the
# steps move a weight here; everything else to 1e-10.
TOL_TEN_NOISE = {"rtol": 0.0, "atol": 1e-7}


def _noise_driven(name: str) -> bool:
    """A bias in front of a BatchNorm, or that BatchNorm's running mean (see TOL_TEN_NOISE)."""
    return name.endswith(ZERO_GRADIENT_SUFFIX) or (name.endswith(".bn.running_mean")  # what lin_concate feeds
                                                   and name.startswith(("att_layers.", "edge_update_layers.")))


def ten_step_inputs(k: int = RUN["k"]) -> dict[str, torch.Tensor]:
    """Ten seeded batches of the three crystals, their atoms moved by up to `jitter` Angstrom (so each batch has
    its own graph), with physical-unit targets around `target_mean`; keys ``"<step>.<field>"``."""
    from trainer.families.crystals.dataset import collate_graphs
    from trainer.families.crystals.graphs import GraphSpec, build_crystal_graph

    g = torch.Generator().manual_seed(TEN_STEPS["seed"])
    out: dict[str, torch.Tensor] = {}
    for step in range(TEN_STEPS["steps"]):
        rows = []
        for numbers, positions, cell in CRYSTALS:
            shake = TEN_STEPS["jitter"] * (2 * torch.rand((len(numbers), 3), generator=g, dtype=torch.float64) - 1)
            pos, lat = np.asarray(positions, np.float64) + shake.numpy(), np.asarray(cell, np.float64)
            graph = build_crystal_graph(pos, lat, GraphSpec(k=k), check_overlap=True)
            rows.append({"atomic_numbers": np.asarray(numbers, np.int64), "positions": pos, "cell": lat,
                         "num_atoms": len(numbers), "num_edges": len(graph["edge_src"]), **graph})
        batch = collate_graphs(rows)
        target = (TEN_STEPS["target_mean"]
                  + TEN_STEPS["target_std"] * torch.randn(len(CRYSTALS), generator=g, dtype=torch.float64))
        for key in TEN_BATCH_KEYS[:-1]:
            v = batch[key]
            out[f"{step}.{key}"] = v.double() if v.is_floating_point() else v
        out[f"{step}.target"] = target
    return out


def ten_step_batch(inputs: Mapping[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s batch as our collate gives it (target ``[B, 1]``, physical units)."""
    batch = {key: inputs[f"{step}.{key}"] for key in TEN_BATCH_KEYS}
    batch["target"] = batch["target"][:, None]
    return batch


def paper_config(overrides: list[str] = TEN_OVERRIDES) -> Any:
    """Our config: `task.preset=paper` with the ten steps' overrides."""
    from trainer.config import load_config

    return load_config(None, [*overrides, "log.progress_bar=false", "log.tensorboard=false"])


def ours_ten_steps(state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                   overrides: list[str] = TEN_OVERRIDES) -> dict[str, Any]:
    """Ten optimizer steps by our loop's own step (`Trainer.train_step`: the task's loss on standardised targets,
    the engine's backward, clipping and optimizer step, the scheduler) from ``state`` (our layout), in float64;
    names are ours (without the ``model.`` of StandardizedModel). Needs a fresh accelerate state."""
    from trainer.core.loaders import MicroBatch
    from trainer.core.trainer import Trainer
    from trainer.families.crystals.task import NUM_ELEMENTS, CrystalPropertyTask, StandardizedModel

    cfg = paper_config(overrides)
    task = CrystalPropertyTask(cfg.task, seed=cfg.run.seed)
    stats = {"num_targets": 1, "target_mean": [TEN_STEPS["target_mean"]], "target_std": [TEN_STEPS["target_std"]],
             "baseline_coef": np.zeros((NUM_ELEMENTS, 1)).tolist()}
    task.attach_stats(stats)
    net = build_ours(config)
    net.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    model = StandardizedModel(net, 1).double()
    model.target_mean.fill_(TEN_STEPS["target_mean"])
    model.target_std.fill_(TEN_STEPS["target_std"])
    loop = parity_common.stand_in_loop(cfg, task, model)
    model, optimizer = loop.model, loop.optimizer
    losses, norms, lrs = [], [], []
    for step in range(TEN_STEPS["steps"]):
        lrs.append(optimizer.param_groups[0]["lr"])
        stats = Trainer.train_step(loop, [MicroBatch(ten_step_batch(inputs, step), None)])  # type: ignore[arg-type]
        losses.append(stats["loss"].detach().double())
        norms.append(stats["grad_norm"].double())
        loop.state.step += 1
    net_state = {k.removeprefix("model."): v.detach().clone() for k, v in model.state_dict().items()}
    params = {n.removeprefix("model."): p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": torch.stack(losses), "grad_norms": torch.stack(norms), "lrs": torch.tensor(lrs, dtype=torch.float64),
            "params": params, "bn": bn_buffers(net_state), "cfg": cfg}


def compare_ten_steps(ours: Mapping[str, Any], ref: Mapping[str, Any]) -> list[str]:
    """Differences of our ten steps from the reference's beyond the tolerances (empty: parity): the loss of each
    step (float32 on our side), the lr each step used, the gradient norms, and after ten steps every parameter
    and BatchNorm running statistic (1e-10)."""
    failures: list[str] = []
    close("ten steps: loss per step", ours["losses"], ref["losses"], rtol=TOL_TEN_LOSS_REL, atol=0.0,
          failures=failures)
    close("ten steps: lr per step", ours["lrs"], ref["lrs"], **TOL, failures=failures)
    close("ten steps: gradient norm per step", ours["grad_norms"], ref["grad_norms"], **TOL, failures=failures)
    for kind in ("params", "bn"):
        if set(ours[kind]) != set(ref[kind]):
            failures.append(f"ten steps: {kind} names differ: {sorted(set(ours[kind]) ^ set(ref[kind]))[:4]}")
            continue
        for name, want in ref[kind].items():
            tol = TOL_TEN_NOISE if _noise_driven(name) else TOL
            close(f"ten steps: {kind} {name}", ours[kind][name], want, **tol, failures=failures)
    return failures


def _stub_module(name: str) -> types.ModuleType:
    """A module whose every attribute is a placeholder class: what the reference's train.py imports at its top
    for its ignite loop, its data pipeline and its logging, none of which the functions used here touch."""
    class Stub(types.ModuleType):
        def __getattr__(self, attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {})

    return Stub(name)


_TRAIN_IMPORTS = ("ignite", "ignite.contrib", "ignite.contrib.handlers", "ignite.contrib.handlers.stores",
                  "ignite.contrib.handlers.tensorboard_logger", "ignite.contrib.handlers.tqdm_logger",
                  "ignite.contrib.metrics", "ignite.handlers", "ignite.handlers.stores", "ignite.engine",
                  "ignite.metrics", "jarvis", "jarvis.db", "jarvis.db.jsonutils", "comformer.data", "comformer.config")


def load_reference_training(ref: Mapping[str, Any]) -> types.ModuleType:
    """The reference's ``comformer/train.py`` as a module (after :func:`load_reference`), for its own
    ``group_decay`` and ``setup_optimizer``. Its top-level imports of ignite, jarvis-tools and its data pipeline
    are stubbed for the import only (placeholders, see :func:`_stub_module`); it sets the default dtype to
    float32 when imported, which is restored."""
    path = Path(ref["comformer"].__file__).resolve().parents[1] / "train.py"
    saved = {name: sys.modules.get(name) for name in _TRAIN_IMPORTS}
    sys.modules.update({name: _stub_module(name) for name in _TRAIN_IMPORTS})
    dtype = torch.get_default_dtype()
    try:
        module = parity_common.load_module(path, "comformer_reference_train")
    finally:
        torch.set_default_dtype(dtype)
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    return module


def reference_ten_steps(ref: Mapping[str, Any], inputs: Mapping[str, torch.Tensor], config: Mapping[str, Any]
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the randomised initial weights in our layout, the reference's ten steps with names mapped to ours).

    The reference's own ``group_decay`` and ``setup_optimizer`` (comformer/train.py) build its AdamW; its
    OneCycleLR is built as ``train_main`` builds it inline (``max_lr=learning_rate``, ``epochs``,
    ``steps_per_epoch``, ``pct_start=0.3``); the step is what ignite's ``create_supervised_trainer`` runs
    (ignite is not needed: zero_grad, forward in train mode, ``nn.MSELoss`` on the squeezed output against the
    standardised target, backward, ``optimizer.step()``), then ``scheduler.step()`` as its ITERATION_COMPLETED
    handler does."""
    from trainer.families.crystals.reference import REFERENCE_UNUSED, from_reference_state_dict

    train = load_reference_training(ref)
    torch.manual_seed(RUN["seed"])
    model = build_reference(ref, config)
    randomise_(model, TEN_STEPS["seed"])
    state = {k: _compact(v.detach().clone()) for k, v in from_reference_state_dict(model.state_dict()).items()}
    settings = types.SimpleNamespace(optimizer="adamw", learning_rate=TEN_STEPS["lr"],
                                     weight_decay=TEN_STEPS["weight_decay"])  # train_props.py's values
    optimizer = train.setup_optimizer(train.group_decay(model), settings)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=settings.learning_rate,
                                                    epochs=TEN_STEPS["epochs"],
                                                    steps_per_epoch=TEN_STEPS["steps_per_epoch"],
                                                    pct_start=TEN_STEPS["pct_start"])
    criterion = nn.MSELoss()
    losses, norms, lrs = [], [], []
    for step in range(TEN_STEPS["steps"]):
        batch = ten_step_batch(inputs, step)
        target = (batch["target"][:, 0] - TEN_STEPS["target_mean"]) / TEN_STEPS["target_std"]
        lrs.append(optimizer.param_groups[0]["lr"])
        model.train()
        optimizer.zero_grad()
        loss = criterion(model(reference_data(batch)), target)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach())
    # Unused reference parameters (no gradient, never stepped) have no counterpart in ours.
    params = from_reference_state_dict({n: p.detach().clone() for n, p in model.named_parameters()
                                        if n not in REFERENCE_UNUSED})
    return state, {"losses": torch.stack(losses), "grad_norms": torch.stack(norms),
                   "lrs": torch.tensor(lrs, dtype=torch.float64), "params": params,
                   "bn": from_reference_state_dict(bn_buffers(model.state_dict()))}


TEN_STEP_LAYOUT = (("losses", "lrs", "grad_norms"), ("params", "bn"))
"""What ten_steps.safetensors keeps of the reference's ten steps: (tensors, dicts of tensors)."""


def write_ten_step_golden(out_dir: Path, variant: str, state: Mapping[str, torch.Tensor],
                          inputs: Mapping[str, torch.Tensor], ref_out: Mapping[str, Any], commit: str) -> None:
    """``out_dir/<variant>/ten_steps.safetensors`` (initial weights in our layout, the ten batches, the reference's
    losses, lrs, gradient norms, parameters and running statistics after ten steps) and ``ten_steps.json``."""
    meta = {"reference": parity_common.reference_meta(REPO, commit, LICENSE, path=SUBDIR),
            "variant": variant, "config": CONFIGS[variant], "run": RUN, "ten_steps": TEN_STEPS,
            "overrides": TEN_OVERRIDES, "written_by": "scripts/parity/comformer.py --ten-steps --write-golden",
            "recipe": "reference: comformer/train.py's own group_decay and setup_optimizer (AdamW, "
                      "train_props.py's lr 1e-3 and weight decay 1e-5); OneCycleLR(max_lr, epochs=2, "
                      "steps_per_epoch=5, pct_start=0.3) built as train_main builds it inline (not callable "
                      "without its data loaders); the step of ignite's create_supervised_trainer written out "
                      "(ignite is not installed here: zero_grad, MSELoss on the squeezed output against "
                      "standardised targets, backward, optimizer.step) and scheduler.step() after each batch; "
                      "no clipping; float64. "
                      "Ours: Trainer.train_step with task.preset=paper"}
    parity_common.write_ten_step_files(out_dir / variant, state, inputs, ref_out, TEN_STEP_LAYOUT, meta)


def load_ten_step_golden(golden_dir: Path, variant: str) -> parity_common.Golden:
    """(initial weights in our layout, the ten batches, the reference's ten steps in `compare_ten_steps`' layout,
    meta) of one variant."""
    return parity_common.read_ten_step_files(golden_dir / variant, "comformer.py", TEN_STEP_LAYOUT, golden_dir)


def main_ten_steps(args: Any, ref: Mapping[str, Any], commit: str, log: Callable[[str], None]) -> int:
    """--ten-steps: the reference's ten steps against ours (and the golden files written or checked)."""
    inputs = ten_step_inputs()
    failures: list[str] = []
    results = {}
    log(f"reference {REPO}/{SUBDIR}@{commit[:7]}; ten steps of the paper recipe ({' '.join(TEN_OVERRIDES[2:])})")
    for variant in TEN_VARIANTS:
        state, ref_out = reference_ten_steps(ref, inputs, CONFIGS[variant])
        ours = ours_ten_steps(state, inputs, CONFIGS[variant])
        fails = compare_ten_steps(ours, ref_out)
        fails += parity_common.check_golden(args, load_ten_step_golden, state, inputs, ref_out, compare_ten_steps,
                                            variant)
        failures += [f"{variant}: {f}" for f in fails]
        results[variant] = (state, ref_out)
        parity_common.log_losses(log, ref_out["losses"], ours["losses"], prefix=f"{variant}: ")
        log(f"{variant}: lr per step " + " ".join(f"{v:.3g}" for v in ref_out["lrs"].tolist()))
        log(f"{variant}: gradient norms " + " ".join(f"{v:.4g}" for v in ref_out["grad_norms"].tolist()))
        diffs = {n: (ours["params"][n] - w).abs().max().item() for n, w in ref_out["params"].items()}
        worst = max(d for n, d in diffs.items() if not _noise_driven(n))
        noise = max(d for n, d in diffs.items() if _noise_driven(n))
        moved = max((ref_out["params"][n] - state[n].double()).abs().max().item() for n in ref_out["params"])
        log(f"{variant}: max |weight diff| after ten steps {worst:.3g}, {noise:.3g} on the biases before a "
            f"BatchNorm (the weights moved by up to {moved:.3g})")

    def write(out_dir: Path) -> None:
        for variant, (state, ref_out) in results.items():
            write_ten_step_golden(out_dir, variant, state, inputs, ref_out, commit)

    return report(failures, "ten steps: loss, lr, gradient norms, weights and BatchNorm statistics within tolerance",
                  args, write, log)


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------


def main_parity(args: Any, ref: Mapping[str, Any], commit: str, log: Callable[[str], None]) -> int:
    """One forward and backward of the reference's against ours (and the golden files written or checked)."""
    inputs = make_inputs()
    failures: list[str] = []
    results = {}
    log(f"reference {REPO}/{SUBDIR}@{commit[:7]}; {len(CRYSTALS)} crystals, {inputs['atomic_numbers'].numel()} "
        f"atoms, {inputs['edge_src'].numel()} edges (k={RUN['k']}, lattice self-loops)")
    for variant in VARIANTS + LIVE_ONLY:
        config = CONFIGS[variant]
        state, ref_out = reference_outputs(ref, inputs, config)
        ours = ours_outputs(state, inputs, config)
        fails = compare(ours, ref_out)
        fails += round_trips_in_reference(ref, ref_out["ref_state"], config)
        if variant in VARIANTS:
            fails += parity_common.check_golden(args, load_golden, state, inputs, {**ref_out, "round_trip": True},
                                                compare, variant)
        failures += [f"{variant}: {f}" for f in fails]
        if variant in VARIANTS:
            results[variant] = (state, ref_out)
        dout = max((ours["out_eval"] - ref_out["out_eval"]).abs().max().item(),
                   (ours["out_train"] - ref_out["out_train"]).abs().max().item())
        dg = parity_common.max_relative_diff(ours["grads"], ref_out["grads"],
                                              keep=lambda n, g: not n.endswith(ZERO_GRADIENT_SUFFIX))
        log(f"{variant}: loss {ref_out['loss'].item():.6g}, |loss diff| "
            f"{(ours['loss'] - ref_out['loss']).abs().item():.3g}, max |output diff| {dout:.3g}, max gradient "
            f"diff / tensor max {dg:.3g}, {len(ref_out['grads'])} parameter tensors")
    log(f"float32 builds: relative difference of the RBF gamma (reference's vs ours), 256 bins on [-4, 0]: "
        f"{rbf_width_difference(-4.0, 0.0):.3g}; on [-1, 1]: {rbf_width_difference(-1.0, 1.0):.3g}")

    def write(out_dir: Path) -> None:
        for variant, (state, ref_out) in results.items():
            write_golden(out_dir, variant, state, inputs, ref_out, commit)

    return report(failures, "parity: state dict round trips exact; forward (eval, train), BatchNorm running "
                  "statistics, MSE loss, gradients, SGD and Adam steps within 1e-10 (float64)", args, write, log)


main = functools.partial(parity_common.main, __doc__, ENV, load_reference, main_parity, main_ten_steps)
"""main(argv=None, log=print) -> exit status."""


if __name__ == "__main__":
    sys.exit(main())

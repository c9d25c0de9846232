"""Parity of our molecules EDM (EGNN dynamics and l2 diffusion loss) with the reference implementation, on CPU.

The reference is ehoogeboom/e3_diffusion_for_molecules (MIT), read from a checkout named by
``TRAINER_REFERENCE_EDM=/path/to/checkout`` (nothing is fetched). Both sides are built from one small config
(QM9's five elements plus charge, two equivariant blocks of two GCLs each, the paper's attention, tanh,
coords_range 15, norm_constant 1, sum / 1), every dynamics parameter randomised (seeded; the reference's last
coordinate layer starts at xavier gain 1e-3, so a comparison at initialisation proves little), the state dict
mapped both ways with ``strict=True`` (the round trip exact), and then compared:

* the dynamics in float64 (both sides allow it): the forward (eps_x, eps_h) on a padded batch with a different
  time per molecule, in eval and train mode, and the gradients of a fixed random projection of it (1e-10);
* the diffusion's training loss per molecule (l2, train mode: ``EnVariationalDiffusion.forward``) in float32
  with t and the noise pinned (the reference's ``torch.randint`` and ``sample_combined_position_feature_noise``
  patched to return them; one molecule at t = 0 so the L_0 branch is exercised), its gradients, and the
  parameters after one SGD and one Adam step from the batch mean.

    TRAINER_REFERENCE_EDM=/tmp/ref_edm python scripts/parity/edm.py            # compare, exit 1 on a failure
    TRAINER_REFERENCE_EDM=/tmp/ref_edm python scripts/parity/edm.py --write-golden tests/families/molecules_edm/golden

``--ten-steps`` compares ten optimizer steps of our ``task.preset=paper`` (through ``Trainer.train_step``) with
ten steps of the reference's ``train_epoch`` body (its ``get_optim``, ``Queue`` + ``gradient_clipping`` and
``EMA``) on ten pinned batches; its golden files are ``ten_steps.safetensors`` and ``ten_steps.json``.

``--write-golden DIR`` writes what ``tests/families/molecules_edm/test_edm_parity.py`` checks without the reference:
``weights.safetensors`` (the randomised reference state dict, schedule and buffer included), ``io.safetensors``
(inputs and the reference's outputs) and ``meta.json`` (repository, commit, licence, config); ``--check-golden
DIR`` also checks that the golden files are what this checkout computes. The commit is ``git rev-parse HEAD`` of
the checkout, or the ``REFERENCE_COMMIT`` file in it (for a ``git archive`` copy). The reference needs nothing
beyond torch and numpy for these modules (``egnn/``, ``equivariant_diffusion/``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parity_common  # noqa: E402
from parity_common import add_prefix, close, report  # noqa: E402

REPO = "ehoogeboom/e3_diffusion_for_molecules"
LICENSE = "MIT"
ENV = "TRAINER_REFERENCE_EDM"

# A tiny config: golden files of tens of KB that still exercise every layer kind (embedding, two blocks so a
# block feeds a block, two GCLs per block so a GCL feeds a GCL, the coordinate update, the output embedding).
CONFIG: dict[str, Any] = {
    "elements": ["H", "C", "N", "O", "F"],
    "include_charges": True,
    "hidden": 16,
    "layers": 2,
    "inv_sublayers": 2,
    "timesteps": 1000,
    "noise_schedule": "polynomial_2",
    "noise_precision": 1e-5,
    "norm_values": [1.0, 4.0, 10.0],
    "batch_size": 4,
    "nodes": 6,
    "atoms": [6, 4, 3, 5],  # real atoms per molecule: padding in three rows
    "seed": 1234,
    "sgd_lr": 0.1,
    "adam_lr": 1e-3,
}
# t = 0 takes the reference's L_0 branch (log p(x, h | z_0)); the others the l2 branch, over the schedule.
T_INT = [0, 7, 500, 1000]

TOL_F64 = {"rtol": 1e-10, "atol": 1e-10}  # float64 dynamics: forward and gradients
# Float32 loss, relative: a molecule's loss sums hundreds of float32 terms, and the CPU kernels (AVX2, AVX-512,
# default) order those sums differently, which moves it by tens of ulps (over 1e-6 under AVX2 on some CPUs); a
# wrong term moves it by orders of magnitude more.
TOL_LOSS_REL = 5e-6
# Float32 loss gradients, per tensor: max |difference| <= GRAD_F32 x max |reference|. Elementwise rtol 1e-4 is
# below float32's reach here: the t = 0 term divides by sigma_0 (~3e-3), and the reference's own float32
# gradients differ from its float64 ones by more than 1e-4 of the tensor's max (ours are closer to float64 than
# the reference's float32 is; the float64 dynamics gradients are the tight check, at 1e-10 elementwise).
GRAD_F32 = 1e-3
TOL_PARAM = {"rtol": 1e-5, "atol": 1e-6}  # parameters after one step: p - lr * update

# Full tensors the golden files keep for the float32 loss gradients and stepped parameters (others: norms).
GOLDEN_TENSORS = ["dynamics.egnn.embedding.weight", "dynamics.egnn.blocks.0.gcls.1.edge_mlp.0.weight",
                  "dynamics.egnn.blocks.1.equivariant.coord_mlp.4.weight", "dynamics.egnn.embedding_out.bias"]


# The last coordinate layer (no bias): tanh of it times coords_range 15, summed over neighbours, moves atoms.
# At this scale each block moves them by O(1) Angstrom, as a trained model does, rather than by tens.
COORD_OUT = "coord_mlp.4.weight"
COORD_OUT_SCALE = 0.1


def num_features(config: Mapping[str, Any] = CONFIG) -> int:
    """Node features F: one-hot element types plus the charge column."""
    return len(config["elements"]) + int(config["include_charges"])


# ----------------------------------------------------------------------------------------------------------
# Our side (no reference needed: the golden test uses these too)
# ----------------------------------------------------------------------------------------------------------


def build_ours(config: Mapping[str, Any] = CONFIG) -> nn.Module:
    """Our EDMDiffusion (EGNN dynamics inside) for ``config``."""
    from trainer.families.molecules_edm.diffusion import build_edm_diffusion

    return build_edm_diffusion(elements=config["elements"], hidden=config["hidden"], layers=config["layers"],
                               timesteps=config["timesteps"], noise_schedule=config["noise_schedule"],
                               noise_precision=config["noise_precision"], norm_values=config["norm_values"],
                               include_charges=config["include_charges"], inv_sublayers=config["inv_sublayers"])


def make_inputs(config: Mapping[str, Any] = CONFIG) -> dict[str, torch.Tensor]:
    """Seeded padded batch (positions centred over the real atoms, as EDM's training script does before the
    model), pinned times and noise, and float64 dynamics inputs with a projection for their gradients."""
    g = torch.Generator().manual_seed(config["seed"] + 1)
    b, n, k = config["batch_size"], config["nodes"], len(config["elements"])
    mask = (torch.arange(n)[None, :] < torch.tensor(config["atoms"])[:, None]).float()  # [B, N]
    m = mask[..., None]
    x = torch.randn((b, n, 3), generator=g) * 1.5 * m
    x = (x - x.sum(1, keepdim=True) / m.sum(1, keepdim=True)) * m
    types = torch.randint(0, k, (b, n), generator=g)
    one_hot = torch.nn.functional.one_hot(types, k).float() * m
    charges = torch.tensor([1.0, 6.0, 7.0, 8.0, 9.0])[types] * mask
    eps = torch.randn((b, n, 3 + num_features(config)), generator=g) * m
    ex = eps[..., :3]
    eps[..., :3] = (ex - ex.sum(1, keepdim=True) / m.sum(1, keepdim=True)) * m  # zero centre of mass
    f = num_features(config)
    dyn_x = torch.randn((b, n, 3), generator=g, dtype=torch.float64) * m.double()
    dyn_x = (dyn_x - dyn_x.sum(1, keepdim=True) / m.double().sum(1, keepdim=True)) * m.double()
    dyn_h = torch.randn((b, n, f), generator=g, dtype=torch.float64) * m.double()
    return {"x": x, "one_hot": one_hot, "charges": charges, "node_mask": mask,
            "t_int": torch.tensor(T_INT[:b], dtype=torch.int64), "eps": eps,
            "dyn_x": dyn_x, "dyn_h": dyn_h, "dyn_t": torch.rand((b,), generator=g, dtype=torch.float64),
            "dyn_proj": torch.randn((b, n, 3 + f), generator=g, dtype=torch.float64)}


def step_params(params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], kind: str,
                config: Mapping[str, Any] = CONFIG) -> dict[str, torch.Tensor]:
    """Parameters after one ``kind`` ("sgd" or "adam") step from ``params`` with ``grads`` (copies)."""
    return parity_common.step_params(params, grads, kind, config["sgd_lr"], config["adam_lr"])


def ours_outputs(ref_state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                 config: Mapping[str, Any] = CONFIG) -> dict[str, Any]:
    """Everything compared, computed by our code from the reference's state dict (through our key map).
    Gradient and step names are ours (``dynamics.egnn.blocks...``)."""
    from trainer.families.molecules_edm.reference import (
        from_reference_state_dict,
        reference_state_dict,
    )

    model = build_ours(config)
    model.load_state_dict(from_reference_state_dict(ref_state), strict=True)
    back = reference_state_dict(model.state_dict())
    round_trip = set(back) == set(ref_state) and all(torch.equal(back[k], ref_state[k]) for k in ref_state)

    # Dynamics in float64.
    dyn = build_ours(config).dynamics.double()
    dyn.load_state_dict({k.removeprefix("dynamics."): v.double() for k, v in model.state_dict().items()
                         if k.startswith("dynamics.")}, strict=True)
    x, h, t, mask = inputs["dyn_x"], inputs["dyn_h"], inputs["dyn_t"], inputs["node_mask"].double()
    with torch.no_grad():
        dyn_eval = torch.cat(dyn.eval()(x, h, t, mask), dim=-1)
    dyn_train = torch.cat(dyn.train()(x, h, t, mask), dim=-1)
    (dyn_train * inputs["dyn_proj"]).sum().backward()
    dyn_grads = {f"dynamics.{n}": p.grad.detach().clone() for n, p in dyn.named_parameters()}

    # The l2 training loss in float32, t and noise pinned.
    model.train()
    loss_per_mol = model.training_loss(inputs["x"], inputs["one_hot"], inputs["charges"], inputs["node_mask"],
                                       t_int=inputs["t_int"], eps=inputs["eps"])
    loss = loss_per_mol.mean()
    loss.backward()
    params = dict(model.named_parameters())
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    return {"round_trip": round_trip, "dyn_eval": dyn_eval, "dyn_train": dyn_train.detach(),
            "dyn_grads": dyn_grads, "loss_per_mol": loss_per_mol.detach(), "loss": loss.detach(), "grads": grads,
            "sgd": step_params(params, grads, "sgd", config), "adam": step_params(params, grads, "adam", config)}


def randomise_(model: nn.Module, seed: int) -> None:
    """Seeded random values for every trainable parameter, scaled so activations stay O(1) through the blocks.

    The noise schedule (the reference's frozen ``gamma.gamma``) and its zero ``buffer`` are left as built: they
    are fixed functions of the config, not weights.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if not p.requires_grad:
                continue
            r = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            scale = COORD_OUT_SCALE if name.endswith(COORD_OUT) else 1.0
            p.copy_(scale * r / p.shape[-1] ** 0.5 if p.ndim >= 2 else 0.1 * r)


# ----------------------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------------------


def config_lr(ref: Mapping[str, Any]) -> float:
    """The SGD learning rate the reference's step used (from the golden meta, else CONFIG)."""
    return float(ref.get("sgd_lr", CONFIG["sgd_lr"]))


def compare(ours: Mapping[str, Any], ref: Mapping[str, Any]) -> list[str]:
    """Differences between our outputs and the reference's beyond the tolerances (empty: parity).

    ``ref`` (names already ours) holds ``dyn_eval``, ``dyn_train``, ``dyn_grads`` (full) or ``dyn_grad_norms``
    (with ``dyn_grad_names``), ``loss_per_mol``, ``loss``, ``grads`` (full tensors; or ``grad_norms`` with
    ``grad_names``) and ``sgd`` (optionally ``adam``) parameters after one step.
    """
    failures: list[str] = []
    if not ours["round_trip"]:
        failures.append("state dict round trip (reference -> ours -> reference) is not exact")
    close("dynamics forward (eval, float64)", ours["dyn_eval"], ref["dyn_eval"], **TOL_F64, failures=failures)
    close("dynamics forward (train, float64)", ours["dyn_train"], ref["dyn_train"], **TOL_F64, failures=failures)
    for name, want in ref.get("dyn_grads", {}).items():
        close(f"dynamics gradient (float64) {name}", ours["dyn_grads"][name], want, **TOL_F64, failures=failures)
    if "dyn_grad_norms" in ref:
        got = torch.stack([ours["dyn_grads"][n].norm() for n in ref["dyn_grad_names"]])
        close("dynamics gradient norms (float64)", got, ref["dyn_grad_norms"], **TOL_F64, failures=failures)
    close("loss per molecule", ours["loss_per_mol"], ref["loss_per_mol"], rtol=TOL_LOSS_REL, atol=0.0,
           failures=failures)
    close("loss (batch mean)", ours["loss"], ref["loss"], rtol=TOL_LOSS_REL, atol=0.0, failures=failures)
    for name, want in ref["grads"].items():
        close(f"gradient {name}", ours["grads"][name], want, rtol=0.0,
               atol=GRAD_F32 * want.abs().max().item(), failures=failures)
    if "grad_norms" in ref:
        got = torch.stack([ours["grads"][n].norm() for n in ref["grad_names"]])
        close("gradient norms", got, ref["grad_norms"], rtol=GRAD_F32, atol=0.0, failures=failures)
    for name, want in ref.get("sgd", {}).items():
        # p - lr * g: the gradient's tolerance times lr, plus the parameters' own float32 rounding.
        atol = TOL_PARAM["atol"] + config_lr(ref) * GRAD_F32 * ref["grads"][name].abs().max().item()
        close(f"sgd step {name}", ours["sgd"][name], want, rtol=TOL_PARAM["rtol"], atol=atol, failures=failures)
    for name, want in ref.get("adam", {}).items():
        # Adam's first step is ~lr * sign(g): it agrees exactly unless a gradient element is at float32 noise.
        close(f"adam step {name}", ours["adam"][name], want, **TOL_PARAM, failures=failures)
    return failures


# ----------------------------------------------------------------------------------------------------------
# The reference (only with a checkout)
# ----------------------------------------------------------------------------------------------------------


def load_reference(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Import the reference's dynamics and diffusion modules from a checkout."""
    root = Path(path)
    if not (root / "equivariant_diffusion" / "en_diffusion.py").is_file():
        raise SystemExit(f"{ENV}={root}: no equivariant_diffusion/en_diffusion.py there (expected a checkout of "
                         f"{REPO})")
    sys.path.insert(0, str(root))
    from egnn import models  # type: ignore[import-not-found]
    from equivariant_diffusion import en_diffusion  # type: ignore[import-not-found]

    return {"models": models, "en_diffusion": en_diffusion}


def build_reference(ref: Mapping[str, Any], config: Mapping[str, Any] = CONFIG) -> nn.Module:
    """The reference's ``EnVariationalDiffusion`` as ``qm9/models.get_model`` builds it for QM9 (l2 loss)."""
    f = num_features(config)
    dynamics = ref["models"].EGNN_dynamics_QM9(
        in_node_nf=f + 1, context_node_nf=0, n_dims=3, hidden_nf=config["hidden"], device="cpu",
        act_fn=torch.nn.SiLU(), n_layers=config["layers"], attention=True, tanh=True, mode="egnn_dynamics",
        norm_constant=1, inv_sublayers=config["inv_sublayers"], sin_embedding=False, normalization_factor=1,
        aggregation_method="sum")
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its whole noise schedule when built
        return ref["en_diffusion"].EnVariationalDiffusion(
            dynamics=dynamics, in_node_nf=f, n_dims=3, timesteps=config["timesteps"], parametrization="eps",
            noise_schedule=config["noise_schedule"], noise_precision=config["noise_precision"], loss_type="l2",
            norm_values=tuple(config["norm_values"]), norm_biases=(None, 0.0, 0.0),
            include_charges=config["include_charges"])


def _edge_mask(node_mask: torch.Tensor) -> torch.Tensor:
    # As EDM's training loop builds it: pairs of real atoms without the diagonal, flattened to [B N N, 1].
    b, n = node_mask.shape
    edge = node_mask.unsqueeze(1) * node_mask.unsqueeze(2)
    edge = edge * (1 - torch.eye(n, dtype=node_mask.dtype)).unsqueeze(0)
    return edge.view(b * n * n, 1)


def _to_ours(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from trainer.families.molecules_edm.reference import from_reference_state_dict

    return from_reference_state_dict({k: v for k, v in tensors.items()})


def reference_outputs(ref: Mapping[str, Any], inputs: Mapping[str, torch.Tensor],
                      config: Mapping[str, Any] = CONFIG) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the randomised reference state dict, the reference's outputs for ``inputs``, names mapped to ours)."""
    torch.manual_seed(config["seed"])
    model = build_reference(ref, config)
    randomise_(model, config["seed"])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # Dynamics in float64: its _forward(t [B, 1], xh [B, N, 3 + F], node_mask [B N, 1], edge_mask, context).
    dyn = build_reference(ref, config).dynamics.double()
    dyn.load_state_dict({k.removeprefix("dynamics."): v.double() for k, v in state.items()
                         if k.startswith("dynamics.")}, strict=True)
    mask = inputs["node_mask"].double()
    xh = torch.cat([inputs["dyn_x"], inputs["dyn_h"]], dim=-1)
    t = inputs["dyn_t"].view(-1, 1)
    with torch.no_grad():
        dyn_eval = dyn.eval()._forward(t, xh, mask.unsqueeze(-1), _edge_mask(mask), None)
    dyn_train = dyn.train()._forward(t, xh, mask.unsqueeze(-1), _edge_mask(mask), None)
    (dyn_train * inputs["dyn_proj"]).sum().backward()
    dyn_grads = _to_ours({f"dynamics.{n}": p.grad.detach().clone() for n, p in dyn.named_parameters()})

    # The l2 training loss, t and noise pinned: EDM draws t with torch.randint and the noise with
    # sample_combined_position_feature_noise inside compute_loss.
    m = inputs["node_mask"]
    x = inputs["x"]
    h = {"categorical": inputs["one_hot"], "integer": inputs["charges"].unsqueeze(-1)}
    pinned_t = inputs["t_int"].view(-1, 1)
    model.sample_combined_position_feature_noise = lambda n_samples, n_nodes, node_mask: inputs["eps"].clone()
    randint = torch.randint
    torch.randint = lambda *a, **k: pinned_t.clone()  # type: ignore[assignment]
    try:
        model.train()
        loss_per_mol = model(x, h, m.unsqueeze(-1), _edge_mask(m), None)
    finally:
        torch.randint = randint  # type: ignore[assignment]
    loss = loss_per_mol.mean()  # EDM's step: the batch mean (its -log p(N) term has no parameters)
    loss.backward()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    out = {"dyn_eval": dyn_eval, "dyn_train": dyn_train.detach(), "dyn_grads": dyn_grads,
           "loss_per_mol": loss_per_mol.detach(), "loss": loss.detach(), "grads": _to_ours(grads),
           "sgd": _to_ours(step_params(params, grads, "sgd", config)),
           "adam": _to_ours(step_params(params, grads, "adam", config))}
    return state, out


def round_trip_into_reference(ref: Mapping[str, Any], state: Mapping[str, torch.Tensor],
                              config: Mapping[str, Any] = CONFIG) -> bool:
    """Reference -> ours -> reference, loaded with strict=True into a fresh reference model: exact?"""
    from trainer.families.molecules_edm.reference import (
        from_reference_state_dict,
        reference_state_dict,
    )

    return parity_common.round_trip_exact(state, build_ours(config), build_reference(ref, config), from_reference_state_dict,
                            reference_state_dict)


def schedule_matches(ref: Mapping[str, Any], config: Mapping[str, Any] = CONFIG) -> float:
    """Max |difference| between our freshly built noise schedule and the reference's (both float32)."""
    fresh = build_reference(ref, config).state_dict()["gamma.gamma"]
    return (build_ours(config).state_dict()["gamma"] - fresh).abs().max().item()


def write_golden(out_dir: Path, state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                 ref_out: Mapping[str, Any], commit: str) -> None:
    """The golden files: weights.safetensors, io.safetensors and meta.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    parity_common.save_tensors(out_dir / "weights.safetensors", state)
    names = sorted(ref_out["grads"])
    dyn_names = sorted(ref_out["dyn_grads"])
    tensors = {**add_prefix("input.", inputs),
          **{k: ref_out[k] for k in ("dyn_eval", "dyn_train", "loss_per_mol", "loss")},
          "dyn_grad_norms": torch.stack([ref_out["dyn_grads"][n].norm() for n in dyn_names]),
          "grad_norms": torch.stack([ref_out["grads"][n].norm() for n in names]),
          **{f"dyn_grad.{n}": ref_out["dyn_grads"][n] for n in GOLDEN_TENSORS},
          **{f"grad.{n}": ref_out["grads"][n] for n in GOLDEN_TENSORS},
          **{f"sgd.{n}": ref_out["sgd"][n] for n in GOLDEN_TENSORS},
          **{f"adam.{n}": ref_out["adam"][n] for n in GOLDEN_TENSORS}}
    parity_common.save_tensors(out_dir / "io.safetensors", tensors)
    meta = {"reference": parity_common.reference_meta(REPO, commit, LICENSE),
            "config": CONFIG, "t_int": T_INT, "grad_names": names, "dyn_grad_names": dyn_names,
            "written_by": "scripts/parity/edm.py --write-golden",
            "loss": "per molecule: EnVariationalDiffusion.forward in train mode (l2), = our training_loss"}
    parity_common.save_json(out_dir / "meta.json", meta)


def load_golden(golden_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], dict]:
    """(reference weights, inputs, the reference's outputs in ``compare``'s layout, meta) from golden files."""
    state, saved, meta, inputs = parity_common.read_golden_files(golden_dir, "edm.py")
    ref: dict[str, Any] = {k: saved[k] for k in ("dyn_eval", "dyn_train", "loss_per_mol", "loss")}
    for kind in ("dyn_grad", "grad", "sgd", "adam"):
        ref[kind + "s" if kind.endswith("grad") else kind] = {
            k.removeprefix(kind + "."): v for k, v in saved.items() if k.startswith(kind + ".")}
    ref["grad_norms"], ref["grad_names"] = saved["grad_norms"], meta["grad_names"]
    ref["sgd_lr"] = meta["config"]["sgd_lr"]
    ref["dyn_grad_norms"], ref["dyn_grad_names"] = saved["dyn_grad_norms"], meta["dyn_grad_names"]
    return state, inputs, ref, meta


# ----------------------------------------------------------------------------------------------------------
# Ten optimizer steps of the `paper` recipe (--ten-steps)
# ----------------------------------------------------------------------------------------------------------

# The paper preset's rules at a scale where ten steps move the weights and clip: the small model above, lr 1e-3
# (the preset's 1e-4 moves them ten times less), EMA decay 0.9 (0.9999 would leave the EMA at its start), and the
# adaptive clipping queue seeded with 1 instead of 3000 (which no norm reaches in ten steps). Everything else is
# the preset's: AdamW with amsgrad and weight decay 1e-12 on every parameter, a constant lr, EDM's adaptive
# clipping rule over 50 norms, an EMA without warm-up.
TEN_STEPS: dict[str, Any] = {"steps": 10, "lr": 1e-3, "ema": 0.9, "clip_initial": 1.0, "clip_history": 50,
                             "seed": 4321}
TEN_OVERRIDES = ["task.name=molecules_edm", "task.preset=paper", "train.epochs=0",
                 f"train.max_steps={TEN_STEPS['steps']}", f"train.per_device_batch_size={CONFIG['batch_size']}",
                 f"optim.lr={TEN_STEPS['lr']}", f"train.ema_decay={TEN_STEPS['ema']}",
                 f"train.adaptive_clip_initial={TEN_STEPS['clip_initial']}"]
"""The command-line overrides on top of `task.preset=paper` (each one a scale, not a rule, of the recipe)."""
TOL_TEN = {"rtol": 1e-5, "atol": 1e-5}  # float32 weights after ten steps
TOL_TEN_LOSS_REL = 1e-5


def ten_step_inputs(config: Mapping[str, Any] = CONFIG) -> dict[str, torch.Tensor]:
    """Ten seeded padded batches (positions centred over the real atoms), their times (1..T: the float32 L_0
    branch's gradients agree to 1e-3 of a tensor's max only, see GRAD_F32) and noise as our task draws it (the
    standard normals, masked and centred: `noise_from_normals`)."""
    g = torch.Generator().manual_seed(TEN_STEPS["seed"] + 1)
    one = make_inputs(config)  # the mask and layout of the one-step comparison
    mask, m = one["node_mask"], one["node_mask"][..., None]
    n, (b, nodes), k = TEN_STEPS["steps"], mask.shape, len(config["elements"])
    x = torch.randn((n, b, nodes, 3), generator=g) * 1.5 * m
    x = (x - x.sum(2, keepdim=True) / m.sum(1, keepdim=True)) * m
    types = torch.randint(0, k, (n, b, nodes), generator=g)
    one_hot = torch.nn.functional.one_hot(types, k).float() * m
    charges = torch.tensor([1.0, 6.0, 7.0, 8.0, 9.0])[types] * mask
    normals = torch.randn((n, b, nodes, 3 + num_features(config)), generator=g)
    diffusion = build_ours(config)
    eps = torch.stack([diffusion.noise_from_normals(normals[i], mask) for i in range(n)])
    t_int = torch.randint(1, config["timesteps"] + 1, (n, b), generator=g)
    return {"x": x, "one_hot": one_hot, "charges": charges, "node_mask": mask, "t_int": t_int, "normals": normals,
            "eps": eps}


class _PinnedDraws:
    """A micro-batch's random streams with the "time" and "noise" draws given."""

    def __init__(self, t_int: torch.Tensor, normals: torch.Tensor):
        self.t_int, self.normals = t_int, normals

    def randint(self, name: str, low: int, high: int, *shape: int, device: Any = None) -> torch.Tensor:
        if name != "time":
            raise KeyError(f"the ten-step comparison pins 'time' and 'noise' only, not {name!r}")
        return self.t_int.to(device)

    def randn(self, name: str, *shape: int, device: Any = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name != "noise":
            raise KeyError(f"the ten-step comparison pins 'time' and 'noise' only, not {name!r}")
        return self.normals.to(device)


def paper_config(overrides: list[str] = TEN_OVERRIDES) -> Any:
    """Our config: `task.preset=paper` with the ten steps' scale overrides."""
    from trainer.config import load_config

    return load_config(None, [*overrides, "log.progress_bar=false", "log.tensorboard=false"])


def ours_ten_steps(ref_state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                   config: Mapping[str, Any] = CONFIG, overrides: list[str] = TEN_OVERRIDES) -> dict[str, Any]:
    """Ten optimizer steps by our loop's own step (`Trainer.train_step`: the task's loss, the engine's backward,
    adaptive clipping and optimizer step, the scheduler, the EMA) from the reference's weights, on the pinned
    batches; names are ours. Needs a fresh accelerate state (it creates an Accelerator)."""
    from trainer.core.loaders import MicroBatch
    from trainer.core.trainer import Trainer
    from trainer.families.molecules_edm.reference import from_reference_state_dict
    from trainer.families.molecules_edm.task import EDMModel, MoleculesEDMTask

    cfg = paper_config(overrides)
    task = MoleculesEDMTask(cfg.task, seed=cfg.run.seed)
    diffusion = build_ours(config)
    diffusion.load_state_dict(from_reference_state_dict(ref_state), strict=True)
    model = EDMModel(diffusion)
    loop = parity_common.stand_in_loop(cfg, task, model)
    model, engine, ema = loop.model, loop.engine, loop.ema
    losses, norms = [], []
    for i in range(inputs["x"].shape[0]):
        batch = {"positions": inputs["x"][i], "one_hot": inputs["one_hot"][i], "charges": inputs["charges"][i],
                 "node_mask": inputs["node_mask"]}
        draws = _PinnedDraws(inputs["t_int"][i], inputs["normals"][i])
        stats = Trainer.train_step(loop, [MicroBatch(batch, draws)])  # type: ignore[arg-type]
        losses.append(stats["loss"].detach())
        norms.append(stats["grad_norm"])
        loop.state.step += 1
    strip = "diffusion."
    params = {n.removeprefix(strip): p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    shadow = {n.removeprefix(strip): s.clone() for n, s in zip(ema.names, ema.shadow)}
    return {"losses": torch.stack(losses), "grad_norms": torch.stack(norms), "params": params, "ema": shadow,
            "cfg": cfg, "clip_queue": engine.adaptive_clip.state_dict() if engine.adaptive_clip else None}


def reference_ten_steps(ref: Mapping[str, Any], inputs: Mapping[str, torch.Tensor],
                        config: Mapping[str, Any] = CONFIG) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the randomised initial reference state dict, the reference's ten steps, names mapped to ours): the body
    of its train_epoch with its own `get_optim` (qm9/models.py), `utils.Queue` + `utils.gradient_clipping` and
    `EMA` on a deep copy of the model, as main_qm9.py builds them; only its draws of t and noise are pinned.
    The loss is the batch mean of the l2 loss (its -log p(N) term has no parameters)."""
    import copy

    root = Path(ref["en_diffusion"].__file__).resolve().parents[1]

    def module(name: str, rel: str) -> Any:
        return parity_common.load_module(root / rel, name)

    utils = module("edm_reference_utils", "utils.py")
    qm9_models = module("edm_reference_qm9_models", "qm9/models.py")
    flow_utils = module("edm_reference_flow_utils", "equivariant_diffusion/utils.py")
    torch.manual_seed(config["seed"])
    model = build_reference(ref, config)
    randomise_(model, TEN_STEPS["seed"])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optim = qm9_models.get_optim(types_namespace(lr=TEN_STEPS["lr"]), model)
    gradnorm_queue = utils.Queue(max_len=TEN_STEPS["clip_history"])
    gradnorm_queue.add(TEN_STEPS["clip_initial"])  # main_qm9.py: 3000
    model_ema = copy.deepcopy(model)
    ema = flow_utils.EMA(TEN_STEPS["ema"])
    mask = inputs["node_mask"]
    pinned: dict[str, torch.Tensor] = {}
    model.sample_combined_position_feature_noise = lambda n_samples, n_nodes, node_mask: pinned["eps"].clone()
    losses, norms = [], []
    randint = torch.randint
    torch.randint = lambda *a, **k: pinned["t"].clone()  # type: ignore[assignment]
    try:
        model.train()
        for i in range(inputs["x"].shape[0]):
            pinned["t"], pinned["eps"] = inputs["t_int"][i].view(-1, 1), inputs["eps"][i]
            h = {"categorical": inputs["one_hot"][i], "integer": inputs["charges"][i].unsqueeze(-1)}
            optim.zero_grad()
            loss = model(inputs["x"][i], h, mask.unsqueeze(-1), _edge_mask(mask), None).mean()
            loss.backward()
            with contextlib.redirect_stdout(io.StringIO()):  # it prints every clipped step
                norms.append(utils.gradient_clipping(model, gradnorm_queue).detach())
            optim.step()
            ema.update_model_average(model_ema, model)
            losses.append(loss.detach())
    finally:
        torch.randint = randint  # type: ignore[assignment]
    params = _to_ours({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    shadow = _to_ours({n: p.detach().clone() for n, p in model_ema.named_parameters() if p.requires_grad})
    return state, {"losses": torch.stack(losses), "grad_norms": torch.stack(norms), "params": params, "ema": shadow,
                   "clip_queue": list(gradnorm_queue.items)}


def types_namespace(**kwargs: Any) -> Any:
    """An argparse-like namespace (what the reference's functions read their settings from)."""
    from types import SimpleNamespace

    return SimpleNamespace(**kwargs)


def compare_ten_steps(ours: Mapping[str, Any], ref: Mapping[str, Any]) -> list[str]:
    """Differences of our ten steps from the reference's beyond the tolerances (empty: parity)."""
    failures: list[str] = []
    close("ten steps: loss per step", ours["losses"], ref["losses"], rtol=TOL_TEN_LOSS_REL, atol=0.0,
          failures=failures)
    close("ten steps: gradient norm per step", ours["grad_norms"], ref["grad_norms"], rtol=1e-4, atol=0.0,
          failures=failures)
    for kind in ("params", "ema"):
        parity_common.close_each(f"ten steps: {kind}", ours[kind], ref[kind], **TOL_TEN, failures=failures)
    if ours.get("clip_queue") is None:
        failures.append("ten steps: our run has no adaptive clipping queue (train.grad_clip_mode is not adaptive)")
    elif ref.get("clip_queue") is not None:  # the same norms in the queue (ours a ring, the reference's newest first)
        close("ten steps: adaptive clipping queue", _queue_values(ours["clip_queue"]),
              _queue_values(ref["clip_queue"]), rtol=1e-4, atol=0.0, failures=failures)
    return failures


def _queue_values(queue: Any) -> torch.Tensor:
    """The sorted norms of a clipping queue: our `AdaptiveClip.state_dict()` or the reference's `Queue.items`."""
    if isinstance(queue, dict):
        queue = [v for v, ok in zip(queue["norms"], queue["valid"]) if ok]
    return torch.tensor(sorted(queue), dtype=torch.float64)


TEN_STEP_LAYOUT = (("losses", "grad_norms"), ("params", "ema"))
"""What ten_steps.safetensors keeps of the reference's ten steps: (tensors, dicts of tensors)."""


def write_ten_step_golden(out_dir: Path, state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                          ref_out: Mapping[str, Any], commit: str) -> None:
    """ten_steps.safetensors (initial weights, inputs, the reference's losses, norms, weights and EMA after ten
    steps) and ten_steps.json."""
    meta = {"reference": parity_common.reference_meta(REPO, commit, LICENSE),
            "config": CONFIG, "ten_steps": TEN_STEPS, "overrides": TEN_OVERRIDES,
            "clip_queue": ref_out["clip_queue"], "written_by": "scripts/parity/edm.py --ten-steps --write-golden",
            "recipe": "reference: train_epoch's body with get_optim, Queue + gradient_clipping and EMA; "
                      "ours: Trainer.train_step with task.preset=paper"}
    parity_common.write_ten_step_files(out_dir, state, inputs, ref_out, TEN_STEP_LAYOUT, meta)


def load_ten_step_golden(golden_dir: Path) -> parity_common.Golden:
    """(initial reference weights, inputs, the reference's ten steps in `compare_ten_steps`' layout, meta)."""
    return parity_common.read_ten_step_files(golden_dir, "edm.py", TEN_STEP_LAYOUT, from_meta={"clip_queue": "clip_queue"})


def main_ten_steps(args: Any, ref: Mapping[str, Any], commit: str, log: Callable[[str], None]) -> int:
    """--ten-steps: the reference's ten steps against ours (and the golden files written or checked)."""
    inputs = ten_step_inputs()
    state, ref_out, ours, failures = parity_common.run_both(inputs, lambda x: reference_ten_steps(ref, x),
                                                            ours_ten_steps, compare_ten_steps)
    failures += parity_common.check_golden(args, load_ten_step_golden, state, inputs, ref_out, compare_ten_steps)
    log(f"reference {REPO}@{commit[:7]}; ten steps of the paper recipe ({' '.join(TEN_OVERRIDES[2:])})")
    parity_common.log_losses(log, ref_out["losses"], ours["losses"])
    log("gradient norms (reference, before clipping): " + " ".join(f"{v:.4g}" for v in ref_out["grad_norms"].tolist()))
    log(f"max |weight diff| after ten steps {parity_common.max_abs_diff(ours['params'], ref_out['params']):.3g}, "
        f"EMA {parity_common.max_abs_diff(ours['ema'], ref_out['ema']):.3g}")
    return report(failures, "ten steps: loss, gradient norms, weights and EMA within tolerance", args,
                  lambda out: write_ten_step_golden(out, state, inputs, ref_out, commit), log)


def main_parity(args: Any, ref: Mapping[str, Any], commit: str, log: Callable[[str], None]) -> int:
    """One forward and backward of the reference's against ours (and the golden files written or checked)."""
    inputs = make_inputs()
    state, ref_out, ours, failures = parity_common.run_both(
        inputs, lambda x: reference_outputs(ref, x), ours_outputs, compare,
        lambda st: round_trip_into_reference(ref, st))
    sched = schedule_matches(ref)
    if sched > 0:
        failures.append(f"noise schedule: ours differs from the reference's by up to {sched:.3g}")
    # The committed golden files must still be what this checkout computes (not stale, same inputs).
    failures += parity_common.check_golden(args, load_golden, state, inputs, {**ref_out, "round_trip": True},
                                           compare)
    log(f"reference {REPO}@{commit[:7]}; hidden {CONFIG['hidden']}, {CONFIG['layers']} blocks x "
        f"{CONFIG['inv_sublayers']} GCLs, batch {CONFIG['batch_size']}x{CONFIG['nodes']} atoms {CONFIG['atoms']}")
    dmax = max((ours["dyn_eval"] - ref_out["dyn_eval"]).abs().max().item(),
               (ours["dyn_train"] - ref_out["dyn_train"]).abs().max().item())
    dg = parity_common.max_relative_diff(ours["dyn_grads"], ref_out["dyn_grads"], floor=1e-300)
    lrel = ((ours["loss_per_mol"] - ref_out["loss_per_mol"]).abs() / ref_out["loss_per_mol"].abs()).max().item()
    gmax = parity_common.max_relative_diff(ours["grads"], ref_out["grads"], floor=1e-30)
    log(f"float64 dynamics: max |output diff| {dmax:.3g}, max gradient diff / tensor max {dg:.3g}")
    log(f"float32 loss per molecule: reference {ref_out['loss_per_mol'].tolist()}, max relative diff {lrel:.3g}; "
        f"max gradient diff / tensor max {gmax:.3g}")
    return report(failures, "parity: state dict round trip exact; float64 dynamics forward (eval, train) and "
                  "gradients, loss, gradients, SGD and Adam steps within tolerance", args,
                  lambda out: write_golden(out, state, inputs, ref_out, commit), log)


main = functools.partial(parity_common.main, __doc__, ENV, load_reference, main_parity, main_ten_steps)
"""main(argv=None, log=print) -> exit status."""


if __name__ == "__main__":
    sys.exit(main())

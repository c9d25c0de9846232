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

``--write-golden DIR`` writes what ``tests/families/molecules_edm/test_edm_parity.py`` checks without the reference:
``weights.safetensors`` (the randomised reference state dict, schedule and buffer included), ``io.safetensors``
(inputs and the reference's outputs) and ``meta.json`` (repository, commit, licence, config); ``--check-golden
DIR`` also checks that the golden files are what this checkout computes. The commit is ``git rev-parse HEAD`` of
the checkout, or the ``REFERENCE_COMMIT`` file in it (for a ``git archive`` copy). The reference needs nothing
beyond torch and numpy for these modules (``egnn/``, ``equivariant_diffusion/``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parity_common  # noqa: E402
from parity_common import (  # noqa: E402
    close,
    parse_arguments,
    read_golden_files,
    reference_commit,
    report,
    round_trip_exact,
    stale_golden,
)

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
TOL_LOSS_REL = 1e-6
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

    return round_trip_exact(state, build_ours(config), build_reference(ref, config), from_reference_state_dict,
                            reference_state_dict)


def schedule_matches(ref: Mapping[str, Any], config: Mapping[str, Any] = CONFIG) -> float:
    """Max |difference| between our freshly built noise schedule and the reference's (both float32)."""
    fresh = build_reference(ref, config).state_dict()["gamma.gamma"]
    return (build_ours(config).state_dict()["gamma"] - fresh).abs().max().item()


def write_golden(out_dir: Path, state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                 ref_out: Mapping[str, Any], commit: str) -> None:
    """The golden files: weights.safetensors, io.safetensors and meta.json."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "weights.safetensors"))
    names = sorted(ref_out["grads"])
    dyn_names = sorted(ref_out["dyn_grads"])
    tensors = {**{f"input.{k}": v for k, v in inputs.items()},
          **{k: ref_out[k] for k in ("dyn_eval", "dyn_train", "loss_per_mol", "loss")},
          "dyn_grad_norms": torch.stack([ref_out["dyn_grads"][n].norm() for n in dyn_names]),
          "grad_norms": torch.stack([ref_out["grads"][n].norm() for n in names]),
          **{f"dyn_grad.{n}": ref_out["dyn_grads"][n] for n in GOLDEN_TENSORS},
          **{f"grad.{n}": ref_out["grads"][n] for n in GOLDEN_TENSORS},
          **{f"sgd.{n}": ref_out["sgd"][n] for n in GOLDEN_TENSORS},
          **{f"adam.{n}": ref_out["adam"][n] for n in GOLDEN_TENSORS}}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "io.safetensors"))
    meta = {"reference": {"repository": f"https://github.com/{REPO}", "commit": commit, "license": LICENSE},
            "config": CONFIG, "t_int": T_INT, "grad_names": names, "dyn_grad_names": dyn_names,
            "written_by": "scripts/parity/edm.py --write-golden",
            "loss": "per molecule: EnVariationalDiffusion.forward in train mode (l2), = our training_loss"}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def load_golden(golden_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], dict]:
    """(reference weights, inputs, the reference's outputs in ``compare``'s layout, meta) from golden files."""
    state, saved, meta, inputs = read_golden_files(golden_dir, "edm.py")
    ref: dict[str, Any] = {k: saved[k] for k in ("dyn_eval", "dyn_train", "loss_per_mol", "loss")}
    for kind in ("dyn_grad", "grad", "sgd", "adam"):
        ref[kind + "s" if kind.endswith("grad") else kind] = {
            k.removeprefix(kind + "."): v for k, v in saved.items() if k.startswith(kind + ".")}
    ref["grad_norms"], ref["grad_names"] = saved["grad_norms"], meta["grad_names"]
    ref["sgd_lr"] = meta["config"]["sgd_lr"]
    ref["dyn_grad_norms"], ref["dyn_grad_names"] = saved["dyn_grad_norms"], meta["dyn_grad_names"]
    return state, inputs, ref, meta


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    args = parse_arguments(__doc__.split("\n\n")[0], ENV, argv)
    torch.set_num_threads(1)  # one reduction order on every machine the golden files are checked on
    ref = load_reference(args.reference)
    commit = reference_commit(args.reference)
    inputs = make_inputs()
    state, ref_out = reference_outputs(ref, inputs)
    ours = ours_outputs(state, inputs)
    failures = compare(ours, ref_out)
    if not round_trip_into_reference(ref, state):
        failures.append("state dict round trip into a fresh reference model (strict) is not exact")
    sched = schedule_matches(ref)
    if sched > 0:
        failures.append(f"noise schedule: ours differs from the reference's by up to {sched:.3g}")
    if args.check_golden:
        # The committed golden files must still be what this checkout computes (not stale, same inputs).
        g_state, g_inputs, g_ref, _ = load_golden(args.check_golden)
        failures += stale_golden(args.check_golden, g_state, g_inputs, state, inputs)
        failures += [f"golden {f}" for f in compare({**ref_out, "round_trip": True}, g_ref)]
    log(f"reference {REPO}@{commit[:7]}; hidden {CONFIG['hidden']}, {CONFIG['layers']} blocks x "
        f"{CONFIG['inv_sublayers']} GCLs, batch {CONFIG['batch_size']}x{CONFIG['nodes']} atoms {CONFIG['atoms']}")
    dmax = max((ours["dyn_eval"] - ref_out["dyn_eval"]).abs().max().item(),
               (ours["dyn_train"] - ref_out["dyn_train"]).abs().max().item())
    dg = max(((ours["dyn_grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-300)).item()
             for n, g in ref_out["dyn_grads"].items())
    lrel = ((ours["loss_per_mol"] - ref_out["loss_per_mol"]).abs() / ref_out["loss_per_mol"].abs()).max().item()
    gmax = max(((ours["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
               for n, g in ref_out["grads"].items())
    log(f"float64 dynamics: max |output diff| {dmax:.3g}, max gradient diff / tensor max {dg:.3g}")
    log(f"float32 loss per molecule: reference {ref_out['loss_per_mol'].tolist()}, max relative diff {lrel:.3g}; "
        f"max gradient diff / tensor max {gmax:.3g}")
    return report(failures, "parity: state dict round trip exact; float64 dynamics forward (eval, train) and "
                  "gradients, loss, gradients, SGD and Adam steps within tolerance", args,
                  lambda out: write_golden(out, state, inputs, ref_out, commit), log)


if __name__ == "__main__":
    sys.exit(main())

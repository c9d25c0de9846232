"""Parity of our protein SEDD model and loss with the reference implementation, on CPU.

The reference is louaaron/Score-Entropy-Discrete-Diffusion (MIT), read from a checkout named by
``TRAINER_REFERENCE_SEDD=/path/to/checkout`` (nothing is fetched). Both models are built from one small config,
every parameter randomised (seeded; the reference zero-initialises adaLN and the output layer, so a comparison
at initialisation proves little), the state dict mapped both ways with ``strict=True`` (the round trip exact),
and then, with t and the perturbed batch pinned and dropout off, compared: the forward in eval and train mode,
the loss, the gradients, and the parameters after one SGD and one Adam step; also the train-mode forward with
dropout 0.1, both sides drawing their masks from one seed.

Loss conversion: the reference's ``loss_fn`` returns each sequence's sum of dsigma-weighted score entropy and
its training step takes the batch mean; our task's loss is the same sum over all sequences divided by the token
count. With every row full length (L tokens) the reference's objective is ``L x`` ours, so our loss is
compared multiplied by L and our gradients are taken of that product.

    TRAINER_REFERENCE_SEDD=/tmp/ref_sedd python scripts/parity/sedd.py            # compare, exit 1 on a failure
    TRAINER_REFERENCE_SEDD=/tmp/ref_sedd python scripts/parity/sedd.py --write-golden tests/families/protein_sedd/golden

``--write-golden DIR`` writes what ``tests/families/protein_sedd/test_sedd_parity.py`` checks without the reference:
``weights.safetensors`` (the randomised reference state dict), ``io.safetensors`` (inputs and the reference's
outputs) and ``meta.json`` (repository, commit, licence, config); ``--check-golden DIR`` also checks that the
golden files are what this checkout computes. The commit is ``git rev-parse HEAD`` of the checkout, or the
``REFERENCE_COMMIT`` file in it (for a ``git archive`` copy).

The reference imports flash-attn at module level; on CPU a stub in ``sys.modules`` computes
``flash_attn_varlen_qkvpacked_func`` with ``F.scaled_dot_product_attention`` (default scale, the same as
flash-attn's), which is exact here because every row has the full length. Its rotary falls back to the
TorchScript rule when ``flash_attn.layers.rotary`` is missing, and ``torch.cuda.amp.autocast`` disables itself
without CUDA. Importing the reference changes global TorchScript flags, so run it in a process of its own.
"""

from __future__ import annotations

import json
import os
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

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

REPO = "louaaron/Score-Entropy-Discrete-Diffusion"
LICENSE = "MIT"
ENV = "TRAINER_REFERENCE_SEDD"

# A tiny config: the golden files stay tens of KB, and every layer kind (embedding, sigma MLP, two blocks so
# that a block feeds a block, the final adaLN layer) is still exercised.
CONFIG: dict[str, Any] = {
    "tokens": 23,  # the reference's vocabulary without the mask; the absorbing graph adds it (dim 24)
    "graph": {"type": "absorb"},
    "noise": {"type": "loglinear"},
    "model": {"hidden_size": 16, "cond_dim": 8, "n_blocks": 2, "n_heads": 2, "scale_by_sigma": True,
              "dropout": 0.0},
    "batch_size": 4,
    "length": 12,
    "seed": 1234,
    "sgd_lr": 0.1,
    "adam_lr": 1e-3,
}
# Times on both sides of the reference's sigma < 0.5 switch (t ~ 0.39) in its e^sigma - 1.
TIMES = [0.05, 0.3, 0.6, 0.97]

TOL_OUT = {"rtol": 1e-5, "atol": 1e-5}  # float32 outputs
TOL_LOSS_REL = 1e-6
TOL_GRAD = {"rtol": 1e-4, "atol": 1e-6}
TOL_PARAM = {"rtol": 1e-5, "atol": 1e-6}  # parameters after one step: p - lr * update

# Full tensors the golden files keep for gradients and stepped parameters (the rest: gradient norms).
GOLDEN_TENSORS = ["vocab_embed.embedding", "blocks.0.attn_qkv.weight", "blocks.1.adaLN_modulation.weight",
                  "output_layer.linear.weight", "output_layer.adaLN_modulation.bias"]


# ----------------------------------------------------------------------------------------------------------
# Our side (no reference needed: the golden test uses these too)
# ----------------------------------------------------------------------------------------------------------


def build_ours(config: Mapping[str, Any] = CONFIG) -> nn.Module:
    """Our DDiT for ``config`` (vocabulary = tokens + the absorbing mask)."""
    from trainer.families.protein_sedd.ddit import DDiT

    m = config["model"]
    return DDiT(vocab_size=config["tokens"] + 1, hidden_size=m["hidden_size"], n_heads=m["n_heads"],
                n_blocks=m["n_blocks"], cond_dim=m["cond_dim"], dropout=m["dropout"],
                scale_by_sigma=m["scale_by_sigma"], absorbing=True)


class _PinnedGraph:
    """Our graph with ``sample_transition`` returning a given perturbed batch (the rest delegated)."""

    def __init__(self, graph: Any, perturbed: torch.Tensor):
        self._graph, self._perturbed = graph, perturbed

    def sample_transition(self, i: torch.Tensor, sigma: torch.Tensor, generator: Any = None) -> torch.Tensor:
        return self._perturbed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._graph, name)


def ours_loss(model: nn.Module, x0: torch.Tensor, t: torch.Tensor, perturbed: torch.Tensor,
              config: Mapping[str, Any] = CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sequence sums [B], our task's loss: their total over the token count) with t and x_t pinned."""
    from trainer.families.protein_sedd.sedd import (
        AbsorbingGraph,
        LogLinearNoise,
        score_entropy_loss,
    )

    graph = _PinnedGraph(AbsorbingGraph(config["tokens"] + 1), perturbed)
    per_seq, tokens = score_entropy_loss(model, graph, LogLinearNoise(), x0, t=t)  # type: ignore[arg-type]
    return per_seq, per_seq.sum() / tokens.sum()


def ours_outputs(ref_state: Mapping[str, torch.Tensor], x0: torch.Tensor, t: torch.Tensor,
                 perturbed: torch.Tensor, config: Mapping[str, Any] = CONFIG) -> dict[str, Any]:
    """Everything compared, computed by our code from the reference's state dict (through our key map)."""
    from trainer.families.protein_sedd.reference import (
        from_reference_state_dict,
        reference_state_dict,
    )
    from trainer.families.protein_sedd.sedd import LogLinearNoise

    model = build_ours(config)
    model.load_state_dict(from_reference_state_dict(ref_state), strict=True)
    back = reference_state_dict(model.state_dict(), config["model"]["n_heads"])
    round_trip = set(back) == set(ref_state) and all(torch.equal(back[k], ref_state[k]) for k in ref_state)

    sigma = LogLinearNoise()(t)[0]
    with torch.no_grad():
        logits_eval = model.eval()(perturbed, sigma)
        logits_train = model.train()(perturbed, sigma)
    per_seq, loss = ours_loss(model.train(), x0, t, perturbed, config)
    length = x0.shape[1]
    # The reference's objective is the batch mean of per-sequence sums: L x our per-token loss (full rows).
    (loss * length).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"round_trip": round_trip, "logits_eval": logits_eval, "logits_train": logits_train,
            "loss_per_seq": per_seq.detach(), "loss": loss.detach(), "grads": grads,
            "sgd": step_params(model, grads, "sgd", config), "adam": step_params(model, grads, "adam", config)}


def step_params(model: nn.Module, grads: Mapping[str, torch.Tensor], kind: str,
                config: Mapping[str, Any] = CONFIG) -> dict[str, torch.Tensor]:
    """Parameters after one ``kind`` ("sgd" or "adam") step from the model's current weights with ``grads``
    (the model itself is left unchanged)."""
    return parity_common.step_params(dict(model.named_parameters()), grads, kind, config["sgd_lr"], config["adam_lr"])


def make_inputs(config: Mapping[str, Any] = CONFIG) -> dict[str, torch.Tensor]:
    """Seeded clean batch, pinned times and a perturbed batch with masked and unmasked positions in every row."""
    from trainer.families.protein_sedd.sedd import LogLinearNoise

    g = torch.Generator().manual_seed(config["seed"] + 1)
    b, length, mask = config["batch_size"], config["length"], config["tokens"]
    x0 = torch.randint(0, config["tokens"], (b, length), generator=g)
    t = torch.tensor(TIMES[:b], dtype=torch.float32)
    sigma = LogLinearNoise()(t)[0]
    masked = torch.rand((b, length), generator=g) < -torch.expm1(-sigma)[:, None]
    masked[:, 0], masked[:, 1] = True, False  # both cases in every row, whatever the draw
    return {"x0": x0, "t": t, "perturbed": torch.where(masked, mask, x0)}


def randomise_(model: nn.Module, seed: int) -> None:
    """Seeded random values for every parameter, scaled so activations stay O(1) through the blocks.

    The reference's only buffer, ``rotary_emb.inv_freq``, is left as built: it is a fixed function of the head
    dimension that our model computes rather than stores (``from_reference_state_dict`` checks it).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * r)
            elif p.ndim >= 2:
                p.copy_(r / p.shape[-1] ** 0.5)
            else:
                p.copy_(0.1 * r)


# ----------------------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------------------


def compare(ours: Mapping[str, Any], ref: Mapping[str, Any], length: int, full_grads: bool = True) -> list[str]:
    """Differences between our outputs and the reference's beyond the tolerances (empty: parity).

    ``ref`` holds the reference's ``logits_eval``, ``logits_train``, ``loss_per_seq``, ``loss`` (their mean),
    gradients (``grads``: full tensors; or ``grad_norms`` with ``grad_names``) and ``sgd`` (and optionally
    ``adam``) parameters after one step.
    """
    failures: list[str] = []
    if not ours["round_trip"]:
        failures.append("state dict round trip (reference -> ours -> reference) is not exact")
    close("forward (eval)", ours["logits_eval"], ref["logits_eval"], **TOL_OUT, failures=failures)
    close("forward (train)", ours["logits_train"], ref["logits_train"], **TOL_OUT, failures=failures)
    close("loss per sequence", ours["loss_per_seq"], ref["loss_per_seq"], rtol=TOL_LOSS_REL, atol=0.0,
           failures=failures)
    close("loss (ours x L vs the reference's mean)", ours["loss"] * length, ref["loss"], rtol=TOL_LOSS_REL,
           atol=0.0, failures=failures)
    for name, want in ref["grads"].items():
        close(f"gradient {name}", ours["grads"][name], want, **TOL_GRAD, failures=failures)
    if "grad_norms" in ref:
        got = torch.stack([ours["grads"][n].norm() for n in ref["grad_names"]])
        close("gradient norms", got, ref["grad_norms"], **TOL_GRAD, failures=failures)
    for kind in ("sgd", "adam"):
        for name, want in ref.get(kind, {}).items():
            close(f"{kind} step {name}", ours[kind][name], want, **TOL_PARAM, failures=failures)
    return failures


# ----------------------------------------------------------------------------------------------------------
# The reference (only with a checkout)
# ----------------------------------------------------------------------------------------------------------


def _flash_attn_stub() -> types.ModuleType:
    def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                         dropout_p: float = 0.0, softmax_scale: float | None = None,
                                         causal: bool = False, **_: Any) -> torch.Tensor:
        # Packed [(B S), 3, H, D] with equal lengths S: one dense attention per row gives the same result.
        lengths = cu_seqlens.diff()
        if not bool((lengths == max_seqlen).all()):
            raise NotImplementedError("the CPU flash-attn stub handles full-length rows only")
        if dropout_p:
            raise NotImplementedError("the CPU flash-attn stub has no attention dropout")
        b = lengths.numel()
        q, k, v = qkv.view(b, max_seqlen, *qkv.shape[1:]).permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, S, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)
        return out.transpose(1, 2).reshape(b * max_seqlen, *qkv.shape[2:])

    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface.flash_attn_varlen_qkvpacked_func = flash_attn_varlen_qkvpacked_func  # type: ignore[attr-defined]
    root = types.ModuleType("flash_attn")
    root.flash_attn_interface = interface  # type: ignore[attr-defined]
    return root


def load_reference(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Import the reference's model, losses, graph and noise from a checkout, with the CPU shims."""
    root = Path(path)
    if not (root / "model" / "transformer.py").is_file():
        raise SystemExit(f"{ENV}={root}: no model/transformer.py there (expected a checkout of {REPO})")
    stub = _flash_attn_stub()
    # The stub even where flash-attn is installed: its kernels need CUDA tensors, and this comparison is on CPU.
    sys.modules["flash_attn"] = stub
    sys.modules["flash_attn.flash_attn_interface"] = stub.flash_attn_interface
    sys.path.insert(0, str(root))
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.cuda.amp.* deprecations
    warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
    import graph_lib  # type: ignore[import-not-found]
    import losses  # type: ignore[import-not-found]
    import noise_lib  # type: ignore[import-not-found]
    from model.transformer import SEDD  # type: ignore[import-not-found]

    return {"SEDD": SEDD, "losses": losses, "graph_lib": graph_lib, "noise_lib": noise_lib}


def reference_outputs(ref: Mapping[str, Any], inputs: Mapping[str, torch.Tensor],
                      config: Mapping[str, Any] = CONFIG) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the randomised reference state dict, the reference's outputs) for ``inputs``."""
    torch.manual_seed(config["seed"])
    model = ref["SEDD"]({k: v for k, v in config.items() if k in ("tokens", "graph", "model")})
    randomise_(model, config["seed"])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    noise = ref["noise_lib"].LogLinearNoise()
    graph = ref["graph_lib"].Absorbing(config["tokens"])
    x0, t, perturbed = inputs["x0"], inputs["t"], inputs["perturbed"]
    sigma = noise(t)[0].detach()
    with torch.no_grad():
        logits_eval = model.eval()(perturbed, sigma)
        logits_train = model.train()(perturbed, sigma)
    loss_fn = ref["losses"].get_loss_fn(noise, graph, train=True)
    per_seq = loss_fn(model, x0, t=t, perturbed_batch=perturbed)
    loss = per_seq.mean()  # the reference's step: loss_fn(...).mean() / accum, accum 1
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    out = {"logits_eval": logits_eval, "logits_train": logits_train, "loss_per_seq": per_seq.detach(),
           "loss": loss.detach(), "grads": grads, "sgd": step_params(model, grads, "sgd", config),
           "adam": step_params(model, grads, "adam", config)}
    return state, out


def round_trip_into_reference(ref: Mapping[str, Any], state: Mapping[str, torch.Tensor],
                              config: Mapping[str, Any] = CONFIG) -> bool:
    """Reference -> ours -> reference, loaded with strict=True into a fresh reference model: exact?"""
    from trainer.families.protein_sedd.reference import (
        from_reference_state_dict,
        reference_state_dict,
    )

    fresh = ref["SEDD"]({k: v for k, v in config.items() if k in ("tokens", "graph", "model")})
    return round_trip_exact(state, build_ours(config), fresh, from_reference_state_dict,
                            lambda sd: reference_state_dict(sd, config["model"]["n_heads"]))


def dropout_parity(ref: Mapping[str, Any], inputs: Mapping[str, torch.Tensor], p: float = 0.1,
                   config: Mapping[str, Any] = CONFIG) -> float:
    """Max |difference| of the train-mode forward with dropout ``p`` on, both sides drawing their masks from
    the same global seed (both apply F.dropout at the same points in the same order, so the masks match)."""
    from trainer.families.protein_sedd.reference import from_reference_state_dict

    cfg = {**config, "model": {**config["model"], "dropout": p}}
    model = ref["SEDD"]({k: v for k, v in cfg.items() if k in ("tokens", "graph", "model")})
    randomise_(model, cfg["seed"])
    ours = build_ours(cfg)
    ours.load_state_dict(from_reference_state_dict(model.state_dict()), strict=True)
    sigma = ref["noise_lib"].LogLinearNoise()(inputs["t"])[0].detach()
    with torch.no_grad():
        torch.manual_seed(cfg["seed"] + 2)
        want = model.train()(inputs["perturbed"], sigma)
        torch.manual_seed(cfg["seed"] + 2)
        got = ours.train()(inputs["perturbed"], sigma)
    return (got - want).abs().max().item()


def write_golden(out_dir: Path, state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                 ref_out: Mapping[str, Any], commit: str) -> None:
    """The golden files: weights.safetensors, io.safetensors and meta.json."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "weights.safetensors"))
    names = sorted(ref_out["grads"])
    io = {**{f"input.{k}": v for k, v in inputs.items()},
          **{k: ref_out[k] for k in ("logits_eval", "logits_train", "loss_per_seq", "loss")},
          "grad_norms": torch.stack([ref_out["grads"][n].norm() for n in names]),
          **{f"grad.{n}": ref_out["grads"][n] for n in GOLDEN_TENSORS},
          **{f"sgd.{n}": ref_out["sgd"][n] for n in GOLDEN_TENSORS}}
    save_file({k: v.contiguous() for k, v in io.items()}, str(out_dir / "io.safetensors"))
    meta = {"reference": {"repository": f"https://github.com/{REPO}", "commit": commit, "license": LICENSE},
            "config": CONFIG, "times": TIMES, "grad_names": names,
            "written_by": "scripts/parity/sedd.py --write-golden",
            "loss": "reference: batch mean of per-sequence sums; ours: total over token count (x L to compare)"}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def load_golden(golden_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], dict]:
    """(reference weights, inputs, the reference's outputs in ``compare``'s layout, meta) from golden files."""
    state, io, meta, inputs = read_golden_files(golden_dir, "sedd.py")
    ref = {k: io[k] for k in ("logits_eval", "logits_train", "loss_per_seq", "loss")}
    ref["grads"] = {k.removeprefix("grad."): v for k, v in io.items() if k.startswith("grad.")}
    ref["grad_norms"], ref["grad_names"] = io["grad_norms"], meta["grad_names"]
    ref["sgd"] = {k.removeprefix("sgd."): v for k, v in io.items() if k.startswith("sgd.")}
    return state, inputs, ref, meta


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    args = parse_arguments(__doc__.split("\n\n")[0], ENV, argv)
    torch.set_num_threads(1)  # one reduction order on every machine the golden files are checked on
    ref = load_reference(args.reference)
    commit = reference_commit(args.reference)
    inputs = make_inputs()
    state, ref_out = reference_outputs(ref, inputs)
    ours = ours_outputs(state, **inputs)
    failures = compare(ours, ref_out, CONFIG["length"])
    if not round_trip_into_reference(ref, state):
        failures.append("state dict round trip into a fresh reference model (strict) is not exact")
    drop = dropout_parity(ref, inputs)
    if drop > TOL_OUT["atol"]:
        failures.append(f"forward (train, dropout 0.1, same seed): max |difference| {drop:.3g}")
    if args.check_golden:
        # The committed golden files must still be what this checkout computes (not stale, same inputs).
        g_state, g_inputs, g_ref, _ = load_golden(args.check_golden)
        failures += stale_golden(args.check_golden, g_state, g_inputs, state, inputs)
        failures += [f"golden {f}" for f in compare({**ref_out, "round_trip": True}, g_ref, length=1)]
    length = CONFIG["length"]
    log(f"reference {REPO}@{commit[:7]}; config {CONFIG['model']}, batch {CONFIG['batch_size']}x{length}")
    log(f"loss: reference mean {ref_out['loss'].item():.8g}, ours {ours['loss'].item():.8g} x L={length} "
        f"= {(ours['loss'] * length).item():.8g}")
    worst = max((ours["logits_eval"] - ref_out["logits_eval"]).abs().max().item(),
                (ours["logits_train"] - ref_out["logits_train"]).abs().max().item())
    gmax = max(((ours["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
               for n, g in ref_out["grads"].items())
    log(f"max |logit diff| {worst:.3g} (with dropout 0.1, same seed: {drop:.3g}); "
        f"max gradient diff / tensor max {gmax:.3g}")
    return report(failures, "parity: state dict round trip exact; forward (eval, train, train with dropout), loss, "
                  "gradients, SGD and Adam steps within tolerance", args,
                  lambda out: write_golden(out, state, inputs, ref_out, commit), log)


if __name__ == "__main__":
    sys.exit(main())

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

``--ten-steps`` compares ten optimizer steps of our ``task.preset=paper`` (through ``Trainer.train_step``) with
ten steps of the reference's own ``get_step_fn`` / ``get_optimizer`` / ``optimization_manager`` /
``ExponentialMovingAverage`` on ten pinned batches; its golden files are ``ten_steps.safetensors`` and
``ten_steps.json`` (``--ten-steps --write-golden DIR``, ``--ten-steps --check-golden DIR``).

The reference imports flash-attn at module level; on CPU a stub in ``sys.modules`` computes
``flash_attn_varlen_qkvpacked_func`` with ``F.scaled_dot_product_attention`` (default scale, the same as
flash-attn's), which is exact here because every row has the full length. Its rotary falls back to the
TorchScript rule when ``flash_attn.layers.rotary`` is missing, and ``torch.cuda.amp.autocast`` disables itself
without CUDA. Importing the reference changes global TorchScript flags, so run it in a process of its own.
"""

from __future__ import annotations

import functools
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
from parity_common import add_prefix, close, report  # noqa: E402

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


def _randomised_reference(ref: Mapping[str, Any], config: Mapping[str, Any]
                          ) -> tuple[nn.Module, dict[str, torch.Tensor], Any, Any]:
    """The reference's SEDD of `config`, randomised from its seed, a copy of its state dict, and the reference's
    log-linear noise and absorbing graph."""
    torch.manual_seed(config["seed"])
    model = ref["SEDD"]({k: v for k, v in config.items() if k in ("tokens", "graph", "model")})
    randomise_(model, config["seed"])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    noise = ref["noise_lib"].LogLinearNoise()
    graph = ref["graph_lib"].Absorbing(config["tokens"])
    return model, state, noise, graph


def reference_outputs(ref: Mapping[str, Any], inputs: Mapping[str, torch.Tensor],
                      config: Mapping[str, Any] = CONFIG) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the randomised reference state dict, the reference's outputs) for ``inputs``."""
    model, state, noise, graph = _randomised_reference(ref, config)
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
    return parity_common.round_trip_exact(state, build_ours(config), fresh, from_reference_state_dict,
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
    out_dir.mkdir(parents=True, exist_ok=True)
    parity_common.save_tensors(out_dir / "weights.safetensors", state)
    names = sorted(ref_out["grads"])
    io = {**add_prefix("input.", inputs),
          **{k: ref_out[k] for k in ("logits_eval", "logits_train", "loss_per_seq", "loss")},
          "grad_norms": torch.stack([ref_out["grads"][n].norm() for n in names]),
          **{f"grad.{n}": ref_out["grads"][n] for n in GOLDEN_TENSORS},
          **{f"sgd.{n}": ref_out["sgd"][n] for n in GOLDEN_TENSORS}}
    parity_common.save_tensors(out_dir / "io.safetensors", io)
    meta = {"reference": parity_common.reference_meta(REPO, commit, LICENSE),
            "config": CONFIG, "times": TIMES, "grad_names": names,
            "written_by": "scripts/parity/sedd.py --write-golden",
            "loss": "reference: batch mean of per-sequence sums; ours: total over token count (x L to compare)"}
    parity_common.save_json(out_dir / "meta.json", meta)


def load_golden(golden_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], dict]:
    """(reference weights, inputs, the reference's outputs in ``compare``'s layout, meta) from golden files."""
    state, io, meta, inputs = parity_common.read_golden_files(golden_dir, "sedd.py")
    ref = {k: io[k] for k in ("logits_eval", "logits_train", "loss_per_seq", "loss")}
    ref["grads"] = {k.removeprefix("grad."): v for k, v in io.items() if k.startswith("grad.")}
    ref["grad_norms"], ref["grad_names"] = io["grad_norms"], meta["grad_names"]
    ref["sgd"] = {k.removeprefix("sgd."): v for k, v in io.items() if k.startswith("sgd.")}
    return state, inputs, ref, meta


# ----------------------------------------------------------------------------------------------------------
# Ten optimizer steps of the `paper` recipe (--ten-steps)
# ----------------------------------------------------------------------------------------------------------

# The paper preset's rules at a scale where ten steps move the weights: the small model above, warm-up shortened
# to 4 steps and a larger lr (the preset's 2,500 steps at 3e-4 would leave ten steps' updates near 1e-7), dropout
# off. Everything else is the preset's: AdamW, the loss as a batch mean of per-sequence sums, norm clip 1, SEDD's
# warm-up and EMA counting, EMA 0.9999.
TEN_STEPS: dict[str, Any] = {"steps": 10, "lr": 3e-3, "warmup": 4, "ema": 0.9999, "grad_clip": 1.0,
                             "batch_size": 4, "length": 12, "seed": 4321}
TEN_OVERRIDES = ["task.name=protein_sedd", "task.preset=paper", "task.dropout=0.0", "train.global_batch_size=0",
                 "train.grad_accum_steps=1", f"train.per_device_batch_size={TEN_STEPS['batch_size']}",
                 f"train.max_steps={TEN_STEPS['steps']}", f"optim.lr={TEN_STEPS['lr']}",
                 f"optim.warmup_steps={TEN_STEPS['warmup']}", f"train.ema_decay={TEN_STEPS['ema']}",
                 f"train.grad_clip_norm={TEN_STEPS['grad_clip']}"]
"""The command-line overrides on top of `task.preset=paper` (each one a scale, not a rule, of the recipe)."""
TOL_TEN = {"rtol": 1e-5, "atol": 1e-5}  # float32 weights after ten steps
TOL_TEN_LOSS_REL = 1e-5  # the later steps' losses carry the earlier steps' rounding


def ten_step_config() -> dict[str, Any]:
    """The model config of the ten steps: our task's vocabulary (residues and pad; the absorbing graph adds the
    mask), so that the task's own loss runs on it."""
    from trainer.families.protein_sedd.task import NUM_RESIDUES

    return {**CONFIG, "tokens": NUM_RESIDUES + 1, "seed": TEN_STEPS["seed"]}


def ten_step_inputs(config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Ten seeded full-length batches, their uniform draws `u` (t = eps + (1 - eps) u, as our task draws it) and
    perturbed batches with masked and unmasked positions in every row."""
    from trainer.families.protein_sedd.sedd import LogLinearNoise
    from trainer.families.protein_sedd.task import NUM_RESIDUES

    g = torch.Generator().manual_seed(TEN_STEPS["seed"] + 1)
    n, b, length, mask = TEN_STEPS["steps"], TEN_STEPS["batch_size"], TEN_STEPS["length"], config["tokens"]
    x0 = torch.randint(0, NUM_RESIDUES, (n, b, length), generator=g)
    u = torch.rand((n, b), generator=g)
    t = ten_step_times(u)
    sigma = LogLinearNoise()(t.flatten())[0].view(n, b)
    masked = torch.rand((n, b, length), generator=g) < -torch.expm1(-sigma)[..., None]
    masked[..., 0], masked[..., 1] = True, False
    return {"x0": x0, "u": u, "perturbed": torch.where(masked, mask, x0)}


def ten_step_times(u: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """Our task's diffusion time from its uniform draw (task.loss), in float32: both sides use these times."""
    return eps + (1 - eps) * u


class _PinnedTimes:
    """A micro-batch's random streams with the "time" draws given (the corruption is pinned by `_PinnedGraph`)."""

    def __init__(self, u: torch.Tensor):
        self.u = u

    def rand(self, name: str, device: Any = None) -> torch.Tensor:
        if name != "time":
            raise KeyError(f"the ten-step comparison pins the 'time' draws only, not {name!r}")
        return self.u.to(device)

    def generators(self, name: str) -> None:
        return None


def paper_config(overrides: list[str] = TEN_OVERRIDES) -> Any:
    """Our config: `task.preset=paper` with the ten steps' scale overrides."""
    from trainer.config import load_config

    return load_config(None, [*overrides, "log.progress_bar=false", "log.tensorboard=false"])


def ours_ten_steps(ref_state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                   config: Mapping[str, Any] | None = None, overrides: list[str] = TEN_OVERRIDES) -> dict[str, Any]:
    """Ten optimizer steps by our loop's own step (`Trainer.train_step`: the task's loss, the engine's backward,
    clipping and optimizer step, the scheduler, the EMA), from the reference's weights, on the pinned batches.
    Needs a fresh accelerate state (it creates an Accelerator)."""
    from trainer.core.loaders import MicroBatch
    from trainer.core.trainer import Trainer
    from trainer.families.protein_sedd.reference import from_reference_state_dict
    from trainer.families.protein_sedd.task import ProteinSEDDTask

    config = config or ten_step_config()
    cfg = paper_config(overrides)
    task = ProteinSEDDTask(cfg.task, seed=cfg.run.seed)
    graph = task.graph
    model = build_ours(config)
    if model.vocab_size != graph.dim:
        raise ValueError(f"model vocabulary {model.vocab_size} is not the task graph's {graph.dim}")
    model.load_state_dict(from_reference_state_dict(ref_state), strict=True)
    loop = parity_common.stand_in_loop(cfg, task, model)
    model, optimizer, ema = loop.model, loop.optimizer, loop.ema
    losses, lrs = [], []
    for i in range(inputs["x0"].shape[0]):
        x0 = inputs["x0"][i]
        task.graph = _PinnedGraph(graph, inputs["perturbed"][i])  # type: ignore[assignment]
        batch = {"states": x0, "mask": torch.ones_like(x0, dtype=torch.bool), "index": torch.arange(x0.shape[0]),
                 "num_tokens": x0.numel()}
        lrs.append(optimizer.param_groups[0]["lr"])
        stats = Trainer.train_step(loop, [MicroBatch(batch, _PinnedTimes(inputs["u"][i]))])  # type: ignore[arg-type]
        losses.append(stats["loss"].detach())
        loop.state.step += 1
    task.graph = graph
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": torch.stack(losses), "lrs": torch.tensor(lrs, dtype=torch.float64), "params": params,
            "ema": dict(zip(ema.names, [s.clone() for s in ema.shadow])), "cfg": cfg}


def reference_ten_steps(ref: Mapping[str, Any], inputs: Mapping[str, torch.Tensor],
                        config: Mapping[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the randomised initial reference state dict, the reference's ten steps): its own `get_step_fn` with its
    `get_optimizer`, `optimization_manager` (warm-up, clipping), GradScaler (disabled on CPU) and
    ExponentialMovingAverage, as run_train.py builds them; only its loss draws are pinned to the inputs'."""
    import importlib

    config = config or ten_step_config()
    losses_mod = ref["losses"]
    ema_mod = importlib.import_module("model.ema")
    model, state, noise, graph = _randomised_reference(ref, config)
    optim_cfg = types.SimpleNamespace(optimizer="AdamW", lr=TEN_STEPS["lr"], beta1=0.9, beta2=0.999, eps=1e-8,
                                      weight_decay=0.0, warmup=TEN_STEPS["warmup"], grad_clip=TEN_STEPS["grad_clip"])
    rcfg = types.SimpleNamespace(optim=optim_cfg)
    optimizer = losses_mod.get_optimizer(rcfg, list(model.parameters()) + list(noise.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.cuda.amp.GradScaler()  # as run_train.py; disabled without CUDA
    ema = ema_mod.ExponentialMovingAverage(model.parameters(), decay=TEN_STEPS["ema"])
    pinned: dict[str, torch.Tensor] = {}
    original = losses_mod.get_loss_fn

    def pinned_loss_fn(noise: Any, graph: Any, train: bool, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        inner = original(noise, graph, train, *args, **kwargs)
        return lambda model, batch, cond=None: inner(model, batch, cond=cond, t=pinned["t"],
                                                     perturbed_batch=pinned["perturbed"])

    losses_mod.get_loss_fn = pinned_loss_fn
    try:
        step_fn = losses_mod.get_step_fn(noise, graph, True, losses_mod.optimization_manager(rcfg), 1)
    finally:
        losses_mod.get_loss_fn = original
    train_state = {"optimizer": optimizer, "scaler": scaler, "model": model, "noise": noise, "ema": ema, "step": 0}
    losses, lrs = [], []
    for i in range(inputs["x0"].shape[0]):
        pinned["t"], pinned["perturbed"] = ten_step_times(inputs["u"][i]), inputs["perturbed"][i]
        losses.append(step_fn(train_state, inputs["x0"][i]).detach())
        lrs.append(optimizer.param_groups[0]["lr"])  # set by optimize_fn before its step
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    out = {"losses": torch.stack(losses), "lrs": torch.tensor(lrs, dtype=torch.float64),
           "params": {n: p.detach().clone() for n, p in model.named_parameters()},
           "ema": {n: s.detach().clone() for n, s in zip(names, ema.shadow_params)}}
    return state, out


def compare_ten_steps(ours: Mapping[str, Any], ref: Mapping[str, Any]) -> list[str]:
    """Differences of our ten steps from the reference's beyond the tolerances (empty: parity)."""
    failures: list[str] = []
    close("ten steps: lr per step", ours["lrs"], ref["lrs"], rtol=1e-12, atol=0.0, failures=failures)
    close("ten steps: loss per step", ours["losses"], ref["losses"], rtol=TOL_TEN_LOSS_REL, atol=0.0,
          failures=failures)
    for kind in ("params", "ema"):
        parity_common.close_each(f"ten steps: {kind}", ours[kind], ref[kind], **TOL_TEN, failures=failures)
    return failures


TEN_STEP_LAYOUT = (("losses", "lrs"), ("params", "ema"))
"""What ten_steps.safetensors keeps of the reference's ten steps: (tensors, dicts of tensors)."""


def write_ten_step_golden(out_dir: Path, state: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                          ref_out: Mapping[str, Any], commit: str) -> None:
    """ten_steps.safetensors (initial weights, inputs, the reference's losses, lrs, weights and EMA after ten
    steps) and ten_steps.json."""
    meta = {"reference": parity_common.reference_meta(REPO, commit, LICENSE),
            "config": ten_step_config(), "ten_steps": TEN_STEPS, "overrides": TEN_OVERRIDES,
            "written_by": "scripts/parity/sedd.py --ten-steps --write-golden",
            "recipe": "reference: get_step_fn + get_optimizer + optimization_manager + ExponentialMovingAverage; "
                      "ours: Trainer.train_step with task.preset=paper"}
    parity_common.write_ten_step_files(out_dir, state, inputs, ref_out, TEN_STEP_LAYOUT, meta)


def load_ten_step_golden(golden_dir: Path) -> parity_common.Golden:
    """(initial reference weights, inputs, the reference's ten steps in `compare_ten_steps`' layout, meta)."""
    return parity_common.read_ten_step_files(golden_dir, "sedd.py", TEN_STEP_LAYOUT)


def main_ten_steps(args: Any, ref: Mapping[str, Any], commit: str, log: Callable[[str], None]) -> int:
    """--ten-steps: the reference's ten steps against ours (and the golden files written or checked)."""
    inputs = ten_step_inputs(ten_step_config())
    state, ref_out, ours, failures = parity_common.run_both(inputs, lambda x: reference_ten_steps(ref, x),
                                                            ours_ten_steps, compare_ten_steps)
    failures += parity_common.check_golden(args, load_ten_step_golden, state, inputs, ref_out, compare_ten_steps)
    log(f"reference {REPO}@{commit[:7]}; ten steps of the paper recipe ({' '.join(TEN_OVERRIDES[2:])})")
    parity_common.log_losses(log, ref_out["losses"], ours["losses"])
    log(f"max |weight diff| after ten steps {parity_common.max_abs_diff(ours['params'], ref_out['params']):.3g}, "
        f"EMA {parity_common.max_abs_diff(ours['ema'], ref_out['ema']):.3g}")
    return report(failures, "ten steps: lr, loss, weights and EMA within tolerance", args,
                  lambda out: write_ten_step_golden(out, state, inputs, ref_out, commit), log)


def main_parity(args: Any, ref: Mapping[str, Any], commit: str, log: Callable[[str], None]) -> int:
    """One forward and backward of the reference's against ours (and the golden files written or checked)."""
    inputs = make_inputs()
    state, ref_out, ours, failures = parity_common.run_both(
        inputs, lambda x: reference_outputs(ref, x), lambda st, x: ours_outputs(st, **x),
        lambda got, want: compare(got, want, CONFIG["length"]), lambda st: round_trip_into_reference(ref, st))
    drop = dropout_parity(ref, inputs)
    if drop > TOL_OUT["atol"]:
        failures.append(f"forward (train, dropout 0.1, same seed): max |difference| {drop:.3g}")
    # The committed golden files must still be what this checkout computes (not stale, same inputs).
    failures += parity_common.check_golden(args, load_golden, state, inputs, {**ref_out, "round_trip": True},
                                           lambda got, want: compare(got, want, length=1))
    length = CONFIG["length"]
    log(f"reference {REPO}@{commit[:7]}; config {CONFIG['model']}, batch {CONFIG['batch_size']}x{length}")
    log(f"loss: reference mean {ref_out['loss'].item():.8g}, ours {ours['loss'].item():.8g} x L={length} "
        f"= {(ours['loss'] * length).item():.8g}")
    worst = max((ours["logits_eval"] - ref_out["logits_eval"]).abs().max().item(),
                (ours["logits_train"] - ref_out["logits_train"]).abs().max().item())
    gmax = parity_common.max_relative_diff(ours["grads"], ref_out["grads"], floor=1e-30)
    log(f"max |logit diff| {worst:.3g} (with dropout 0.1, same seed: {drop:.3g}); "
        f"max gradient diff / tensor max {gmax:.3g}")
    return report(failures, "parity: state dict round trip exact; forward (eval, train, train with dropout), loss, "
                  "gradients, SGD and Adam steps within tolerance", args,
                  lambda out: write_golden(out, state, inputs, ref_out, commit), log)


main = functools.partial(parity_common.main, __doc__, ENV, load_reference, main_parity, main_ten_steps)
"""main(argv=None, log=print) -> exit status."""


if __name__ == "__main__":
    sys.exit(main())

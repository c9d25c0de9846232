"""Key map between our DDiT and the reference SEDD model (louaaron/Score-Entropy-Discrete-Diffusion, MIT).

The parameter names are the same one for one; the only difference is ``rotary_emb.inv_freq``, a persistent
buffer in the reference's ``Rotary`` and a non-persistent one in ours (it is a fixed function of the head
dimension, so our checkpoints do not carry it). Used by the parity check (``scripts/parity/sedd.py``) and by
``REFERENCE_FORMAT``: the reference's checkpoint layouts for ``trainer import sedd`` and ``trainer export
--format reference`` (``checkpoints-meta/checkpoint.pth`` with its ``.hydra/config.yaml``, and the hub layout
``config.json`` + weights that ``SEDD.from_pretrained`` reads).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainer.reference_formats import ReferenceFormat
from trainer.state_dicts import strip_wrapper_prefixes

ROTARY_KEY = "rotary_emb.inv_freq"


def rotary_inv_freq(head_dim: int, base: float = 10_000) -> torch.Tensor:
    """The rotary frequencies both implementations compute for ``head_dim`` (fp32)."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))


def from_reference_state_dict(state_dict: Mapping[str, torch.Tensor], source: str = "reference state dict"
                              ) -> dict[str, torch.Tensor]:
    """Reference SEDD state dict -> ours (load with ``strict=True``).

    Drops ``rotary_emb.inv_freq`` after checking it equals the frequencies ours computes: a checkpoint whose
    buffer differs would give a different model, so it is an error naming ``source`` rather than a silent drop.
    """
    sd = strip_wrapper_prefixes(state_dict)
    inv_freq = sd.pop(ROTARY_KEY, None)
    if inv_freq is not None:
        expected = rotary_inv_freq(2 * inv_freq.numel())
        if not torch.allclose(inv_freq.detach().float().cpu(), expected, rtol=1e-6, atol=0.0):
            raise ValueError(f"{source}: field '{ROTARY_KEY}' is not the standard rotary frequencies for head "
                             f"dimension {2 * inv_freq.numel()} (base 10000); our DDiT cannot represent it")
    return sd


def reference_state_dict(state_dict: Mapping[str, torch.Tensor], n_heads: int) -> dict[str, torch.Tensor]:
    """Our DDiT state dict -> the reference's (``SEDD.load_state_dict(..., strict=True)`` accepts it).

    ``n_heads`` gives the head dimension (hidden size / heads) for the ``rotary_emb.inv_freq`` buffer the
    reference expects.
    """
    sd = strip_wrapper_prefixes(state_dict)
    if "vocab_embed.embedding" not in sd:
        raise ValueError("state dict has no 'vocab_embed.embedding': not a DDiT state dict")
    hidden = sd["vocab_embed.embedding"].shape[1]
    if hidden % n_heads:
        raise ValueError(f"hidden size {hidden} (from 'vocab_embed.embedding') is not divisible by n_heads {n_heads}")
    sd[ROTARY_KEY] = rotary_inv_freq(hidden // n_heads).to(sd["vocab_embed.embedding"].device)
    return sd


# ----------------------------------------------------------------------------------------------------------
# Checkpoint layouts (trainer import sedd / trainer export --format reference)
# ----------------------------------------------------------------------------------------------------------

META_CHECKPOINT = Path("checkpoints-meta") / "checkpoint.pth"
"""The reference's resumable checkpoint in its run folder: torch.save of {optimizer, model, ema, step}."""
HYDRA_CONFIG = Path(".hydra") / "config.yaml"
"""The reference run's resolved hydra config, in its run folder."""
HUB_CONFIG, HUB_WEIGHTS, HUB_WEIGHTS_BIN = "config.json", "model.safetensors", "pytorch_model.bin"
"""The hub layout `SEDD.from_pretrained` reads (PyTorchModelHubMixin): the config and the weights."""
NOISE_PARAMETERS = 1
"""Parameters of the reference's noise module (its unused `empty`) that its optimizer holds after the model's."""


def _load_torch(path: Path) -> Any:
    """torch.load of a reference file, weights-only (tensors and plain containers): never runs pickled code."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"refusing to load {path}: it holds objects that weights-only loading does not allow "
                         f"({str(err).splitlines()[0]})") from None
    except (RuntimeError, EOFError, OSError) as err:
        raise ValueError(f"cannot read {path}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def _field(config: Mapping[str, Any], dotted: str, source: Path, default: Any = KeyError) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is KeyError:
                raise ValueError(f"{source}: field '{dotted}' is missing")
            return default
        node = node[part]
    return node


def model_sizes(state_dict: Mapping[str, torch.Tensor], source: str) -> dict[str, int]:
    """hidden_size, n_heads, n_blocks, cond_dim and the vocabulary (rows of the embedding) of a reference SEDD
    state dict, read from its shapes (`n_heads` from the rotary buffer: hidden / head dimension)."""
    try:
        vocab, hidden = state_dict["vocab_embed.embedding"].shape
        cond = state_dict["sigma_map.mlp.0.weight"].shape[0]
        head_dim = 2 * state_dict[ROTARY_KEY].numel()
    except KeyError as err:
        raise ValueError(f"{source}: field {err} is missing: not a reference SEDD state dict") from None
    blocks = len({k.split(".")[1] for k in state_dict if k.startswith("blocks.")})
    return {"hidden_size": int(hidden), "n_heads": int(hidden) // head_dim, "n_blocks": blocks,
            "cond_dim": int(cond), "vocab": int(vocab)}


_SIZE_KEYS = ("hidden_size", "n_heads", "n_blocks", "cond_dim")


def preset_for(sizes: Mapping[str, int]) -> str | None:
    """The `task.model_preset` with these DDiT sizes, None if none has them."""
    from trainer.families.protein_sedd.ddit import DDIT_PRESETS

    return next((name for name, preset in DDIT_PRESETS.items() if all(preset[k] == sizes[k] for k in _SIZE_KEYS)),
                None)


def _no_preset(sizes: Mapping[str, int], source: str) -> str:
    from trainer.families.protein_sedd.ddit import DDIT_PRESETS

    have = ", ".join(f"{k}={sizes[k]}" for k in _SIZE_KEYS)
    known = "; ".join(f"{n}: " + ", ".join(f"{k}={p[k]}" for k in _SIZE_KEYS) for n, p in DDIT_PRESETS.items())
    return f"{source}: the model has {have}, which no task.model_preset has ({known})"


def _parameter_names(state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """The reference model's parameters in `parameters()` order: its state dict's order without the buffer."""
    return [k for k in state_dict if k != ROTARY_KEY]


def _config_overrides(config: Mapping[str, Any], source: Path) -> tuple[list[str], list[str]]:
    """(our config overrides, notes) from a reference hydra config / hub config.json."""
    from trainer.reference_formats import override

    out, notes = [], []
    graph = _field(config, "graph.type", source, "absorb")
    noise = _field(config, "noise.type", source, "loglinear")
    if graph not in ("absorb", "uniform"):
        raise ValueError(f"{source}: field 'graph.type' is {graph!r}; ours has 'absorb' and 'uniform'")
    if noise not in ("loglinear", "geometric"):
        raise ValueError(f"{source}: field 'noise.type' is {noise!r}; ours has 'loglinear' and 'geometric'")
    if noise == "geometric" and (_field(config, "noise.sigma_min", source, 1e-3), _field(
            config, "noise.sigma_max", source, 1.0)) != (1e-3, 1.0):
        raise ValueError(f"{source}: fields 'noise.sigma_min' / 'noise.sigma_max' are not 1e-3 / 1.0, the geometric "
                         f"schedule ours has")
    scale = _field(config, "model.scale_by_sigma", source, graph == "absorb")
    if bool(scale) != (graph == "absorb"):
        raise ValueError(f"{source}: field 'model.scale_by_sigma' is {scale} with graph {graph!r}; ours scales by "
                         f"sigma exactly when the graph is 'absorb'")
    out += [override("task.graph", graph), override("task.noise", noise)]
    if "dropout" in (config.get("model") or {}):
        out.append(override("task.dropout", float(config["model"]["dropout"])))
    if "length" in (config.get("model") or {}):
        out.append(override("task.max_length", int(config["model"]["length"])))
    training, optim = config.get("training") or {}, config.get("optim") or {}
    if "ema" in training:
        out.append(override("train.ema_decay", float(training["ema"])))
    if "n_iters" in training:
        out.append(override("train.max_steps", int(training["n_iters"])))
    if optim:
        name = str(optim.get("optimizer", "AdamW")).lower()
        if name not in ("adam", "adamw"):
            raise ValueError(f"{source}: field 'optim.optimizer' is {optim.get('optimizer')!r}; ours has Adam and AdamW")
        out += [override("optim.name", name), override("optim.scheduler", "constant_with_warmup")]
        for key, ours in (("lr", "optim.lr"), ("eps", "optim.eps"), ("weight_decay", "optim.weight_decay")):
            if key in optim:
                out.append(override(ours, float(optim[key])))
        if "beta1" in optim or "beta2" in optim:
            out.append(override("optim.betas", [float(optim.get("beta1", 0.9)), float(optim.get("beta2", 0.999))]))
        if "warmup" in optim:
            out.append(override("optim.warmup_steps", int(optim["warmup"])))
        if "grad_clip" in optim:
            out.append(override("train.grad_clip_norm", max(0.0, float(optim["grad_clip"]))))
    if "batch_size" in training:
        accum = max(1, int(training.get("accum", 1)))
        gpus = max(1, int(config.get("ngpus", 1)))
        out += [override("train.global_batch_size", int(training["batch_size"])),
                override("train.per_device_batch_size", max(1, int(training["batch_size"]) // (accum * gpus)))]
    return out, notes


RECIPE = ["task.loss_reduction=sequence_sum", "train.ema_warmup=sedd"]
"""The reference's loss scale (the batch mean of per-sequence sums) and EMA warm-up (its first decay 2/11), where
this version's config has those options."""


def _find_layout(source: Path) -> tuple[str, Path, Path | None]:
    """('meta', checkpoint.pth, hydra config or None) or ('hub', folder, config.json) for `source`."""
    if source.is_file():
        if source.name == HUB_CONFIG or source.suffix == ".safetensors":
            return "hub", source.parent, source.parent / HUB_CONFIG
        config = source.parent.parent / HYDRA_CONFIG  # checkpoints-meta/checkpoint.pth or checkpoints/checkpoint_N.pth
        return "meta", source, config if config.is_file() else None
    if (source / META_CHECKPOINT).is_file():
        config = source / HYDRA_CONFIG
        return "meta", source / META_CHECKPOINT, config if config.is_file() else None
    if (source / HUB_CONFIG).is_file():
        return "hub", source, source / HUB_CONFIG
    raise ValueError(f"{source}: no reference SEDD checkpoint there (looked for {META_CHECKPOINT} and the hub "
                     f"layout's {HUB_CONFIG})")


def read_reference_checkpoint(source: Path) -> Any:
    """A reference SEDD checkpoint (a run folder with `checkpoints-meta/checkpoint.pth`, that file or another
    `checkpoint_N.pth` of the run, or a hub folder with `config.json` + weights) as a `ReferenceCheckpoint`."""
    import yaml

    from trainer.reference_formats import ReferenceCheckpoint, override

    source = Path(source)
    kind, path, config_path = _find_layout(source)
    config: dict[str, Any] = {}
    if config_path is not None:
        if not config_path.is_file():
            raise ValueError(f"{source}: the hub layout needs {config_path}")
        text = config_path.read_text()
        config = (json.loads(text) if config_path.suffix == ".json" else yaml.safe_load(text)) or {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: not a mapping of config sections")
    files = [path] + ([config_path] if config_path else [])
    notes: list[str] = []
    if kind == "hub":
        weights = path / HUB_WEIGHTS
        if weights.is_file():
            from safetensors.torch import load_file

            state = load_file(str(weights))
        elif (path / HUB_WEIGHTS_BIN).is_file():
            weights = path / HUB_WEIGHTS_BIN
            state = _load_torch(weights)
        else:
            raise ValueError(f"{path}: the hub layout has no {HUB_WEIGHTS} or {HUB_WEIGHTS_BIN}")
        files[0] = weights
        saved: dict[str, Any] = {"model": state, "step": 0}
        notes.append(f"{weights.name} holds weights only: the run starts at step 0 with a fresh optimizer, its EMA "
                     f"at these weights")
    else:
        saved = _load_torch(path)
        if not isinstance(saved, dict) or "model" not in saved:
            raise ValueError(f"{path}: field 'model' is missing: not a reference SEDD checkpoint")
    ref_model = strip_wrapper_prefixes(saved["model"])
    sizes = model_sizes(ref_model, str(files[0]))
    overrides = [override("task.name", "protein_sedd")]
    preset = preset_for(sizes)
    if preset is None:  # the import then fails naming the shapes that differ; this says why
        notes.append(_no_preset(sizes, str(files[0])))
    else:
        overrides.append(override("task.model_preset", preset))
    if config:
        more, config_notes = _config_overrides(config, config_path or path)
        overrides += more
        notes += config_notes
    else:
        notes.append(f"no {HYDRA_CONFIG} beside {path}: model sizes from the weights, graph 'absorb', the recipe "
                     f"from the config given")
    model = from_reference_state_dict(ref_model, str(files[0]))
    names = _parameter_names(ref_model)
    ema = None
    if "ema" in saved:
        ema_state = saved["ema"]
        shadow = ema_state.get("shadow_params") if isinstance(ema_state, dict) else None
        if not isinstance(shadow, (list, tuple)) or len(shadow) != len(names):
            raise ValueError(f"{path}: field 'ema.shadow_params' must list one tensor per model parameter "
                             f"({len(names)}), got {type(shadow).__name__} of {len(shadow) if shadow is not None else 0}")
        ema = {n: t for n, t in zip(names, shadow)}
        if not config and "decay" in ema_state:
            overrides.append(override("train.ema_decay", float(ema_state["decay"])))
    optimizer = None
    if isinstance(saved.get("optimizer"), dict):
        optimizer = _optimizer_by_name(saved["optimizer"], names, path)
    return ReferenceCheckpoint(task="protein_sedd", model=model, ema=ema, step=int(saved.get("step", 0)),
                               optimizer=optimizer, overrides=overrides, recipe=list(RECIPE), files=files, notes=notes)


def _optimizer_by_name(optimizer: Mapping[str, Any], names: list[str], path: Path) -> dict[str, dict[str, Any]]:
    """The reference optimizer's per-parameter state by our names: its first len(names) parameters are the
    model's (`parameters()` order), the rest the noise module's (no state: they never get a gradient)."""
    order = [i for group in optimizer.get("param_groups", []) for i in group.get("params", [])]
    if len(order) < len(names):
        raise ValueError(f"{path}: field 'optimizer.param_groups' holds {len(order)} parameters, fewer than the "
                         f"model's {len(names)}")
    state = optimizer.get("state", {})
    return {name: dict(state[index]) for name, index in zip(names, order) if index in state}


def _hydra_config(weights: Any) -> dict[str, Any]:
    """The reference's config (hydra config.yaml / hub config.json) for a run of ours."""
    from trainer.families.protein_sedd.ddit import DDIT_PRESETS

    cfg = weights.config
    t, o, tr = cfg.task, cfg.optim, cfg.train
    hidden = int(weights.model["vocab_embed.embedding"].shape[1])
    if ROTARY_KEY in weights.model:  # a reference state dict read back: its buffer gives the head dimension
        n_heads = hidden // (2 * weights.model[ROTARY_KEY].numel())
    else:  # our runs' models come from a preset
        n_heads = DDIT_PRESETS[t.model_preset]["n_heads"]
    sizes = {"hidden_size": hidden, "n_heads": int(n_heads),
             "n_blocks": len({k.split(".")[1] for k in weights.model if k.startswith("blocks.")}),
             "cond_dim": int(weights.model["sigma_map.mlp.0.weight"].shape[0])}
    vocab = weights.model["vocab_embed.embedding"].shape[0]
    return {
        "tokens": int(vocab - (1 if t.graph == "absorb" else 0)),
        "model": {"name": preset_for(sizes) or "custom", "type": "ddit", **sizes,
                  "length": int(t.max_length), "scale_by_sigma": t.graph == "absorb", "dropout": float(t.dropout)},
        "graph": {"type": t.graph, "file": "data", "report_all": False},
        "noise": {"type": t.noise, "sigma_min": 1e-3 if t.noise == "geometric" else 1e-4,
                  "sigma_max": 1.0 if t.noise == "geometric" else 20},
        "training": {"batch_size": int(tr.global_batch_size or tr.per_device_batch_size * tr.grad_accum_steps),
                     "accum": 1, "n_iters": int(tr.max_steps), "ema": float(tr.ema_decay or 0.9999),
                     "weight": "standard"},
        "optim": {"weight_decay": float(o.weight_decay), "optimizer": "Adam" if o.name == "adam" else "AdamW",
                  "lr": float(o.lr), "beta1": float(o.betas[0]), "beta2": float(o.betas[1]), "eps": float(o.eps),
                  "warmup": int(o.warmup_steps), "grad_clip": float(tr.grad_clip_norm or -1.0)},
    }


def _module_order(config: Mapping[str, Any]) -> list[str]:
    """Parameter names of the DDiT `config` describes, in `parameters()` order (built on the meta device: no
    memory), which is the reference's order too: its modules are registered alike."""
    from trainer.families.protein_sedd.ddit import DDiT

    m = config["model"]
    absorb = config["graph"]["type"] == "absorb"
    with torch.device("meta"):
        model = DDiT(vocab_size=config["tokens"] + int(absorb), hidden_size=m["hidden_size"], n_heads=m["n_heads"],
                     n_blocks=m["n_blocks"], cond_dim=m["cond_dim"], dropout=m["dropout"], absorbing=absorb,
                     scale_by_sigma=m["scale_by_sigma"])
    return [n for n, _ in model.named_parameters()]


def _reference_order(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` in the reference's `state_dict()` order: its rotary buffer sits between `sigma_map` and `blocks`."""
    keys = [k for k in state if k != ROTARY_KEY]
    at = next((i for i, k in enumerate(keys) if k.startswith("blocks.")), len(keys))
    return {k: state[k] for k in [*keys[:at], ROTARY_KEY, *keys[at:]]}


def write_reference_checkpoint(out: Path, weights: Any) -> list[str]:
    """Our run's weights in the reference's layouts under `out`: `.hydra/config.yaml` and
    `checkpoints-meta/checkpoint.pth` (what the reference's `load_model_local` and its training resume read), and
    `hub/` (`config.json` + `model.safetensors`, the EMA weights where kept, as the released models are) for
    `SEDD.from_pretrained`. Returns notes on what the reference gets in place of what the run lacks."""
    import yaml
    from safetensors.torch import save_file

    notes: list[str] = []
    config = _hydra_config(weights)
    n_heads = config["model"]["n_heads"]
    names = _module_order(config)  # the reference's parameters() order (a run's files are sorted by name)
    missing = sorted(set(names) - set(weights.model))
    if missing:
        raise ValueError(f"the run's weights lack {missing[:5]}: not a DDiT of these sizes")
    model = {k: weights.model[k].detach().float().cpu().contiguous() for k in names}
    ema_weights = {**model, **weights.ema} if weights.ema is not None else model
    if weights.ema is None:
        notes.append(f"the run kept no EMA: the reference's EMA is the weights, decay {config['training']['ema']}")
    if getattr(weights.config.task, "loss_reduction", "sequence_sum") != "sequence_sum":
        notes.append("this run's loss is per token, the reference's the per-sequence sum: the same lr and grad_clip "
                     "in its config are a different optimisation there")
    o = weights.config.optim
    params = [torch.nn.Parameter(torch.zeros(0)) for _ in range(len(names) + NOISE_PARAMETERS)]
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    template = cls(params, lr=weights.lr if weights.lr is not None else o.lr, betas=tuple(o.betas), eps=o.eps,
                   weight_decay=o.weight_decay).state_dict()
    if weights.optimizer is not None:
        template["state"] = {i: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in
                                 weights.optimizer[n].items()} for i, n in enumerate(names) if n in weights.optimizer}
    else:
        notes.append("the checkpoint's layout gives no per-parameter optimizer state: checkpoint.pth's optimizer "
                     "has none (the reference's Adam moments start afresh)")
    checkpoint = {
        "optimizer": template,
        "model": _reference_order(reference_state_dict(model, n_heads)),
        "ema": {"decay": config["training"]["ema"], "num_updates": int(weights.step),
                "shadow_params": [ema_weights[n].detach().float().cpu().clone() for n in names]},
        "step": int(weights.step),
    }
    (out / META_CHECKPOINT).parent.mkdir(parents=True, exist_ok=True)
    (out / HYDRA_CONFIG).parent.mkdir(parents=True, exist_ok=True)
    (out / "hub").mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, out / META_CHECKPOINT)
    (out / HYDRA_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))
    (out / "hub" / HUB_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    hub = _reference_order(reference_state_dict({k: ema_weights[k].contiguous() for k in names}, n_heads))
    save_file({k: v.contiguous() for k, v in hub.items()}, str(out / "hub" / HUB_WEIGHTS), metadata={"format": "pt"})
    return notes


REFERENCE_FORMAT = ReferenceFormat(
    name="sedd", task="protein_sedd", read=read_reference_checkpoint, write=write_reference_checkpoint,
    description="SEDD (louaaron/Score-Entropy-Discrete-Diffusion): a run folder's checkpoints-meta/checkpoint.pth "
                "(+ .hydra/config.yaml), or the hub layout (config.json + model.safetensors)")
"""`trainer import sedd` / `trainer export --format reference` for protein_sedd runs."""

"""Key map between our ComFormer and the reference (divelab/AIRS, ``OpenMat/ComFormer``; GPL-3.0, never copied).

The reference's iComformer has one edge-wise layer ``edge_update_layer.`` and its eComformer one equivariant layer
``equi_update.``, where ours has module lists (``edge_update_layers.0.``, ``equi_update_layers.0.``). Its edge layer
also carries two modules its forward never uses (``edge_update_layer.lemb``, an ``Embedding(3, 32)``, and
``edge_update_layer.lin_edge_len``, a ``Linear(C + 32, C)``): they are dropped on the way in and written as zeros on
the way out, so the reference's ``load_state_dict(..., strict=True)`` accepts our weights. Every other name and
every shape is the same. Used by the parity check (``scripts/parity/comformer.py``) and by ``REFERENCE_FORMAT``:
the reference's checkpoints (ignite's ``checkpoint_N.pt`` or a state dict, with ``config.json``) for ``trainer
import comformer`` and ``trainer export --format reference``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainer.reference_formats import ReferenceFormat
from trainer.state_dicts import strip_wrapper_prefixes

REFERENCE_UNUSED = ("edge_update_layer.lemb.weight", "edge_update_layer.lin_edge_len.weight",
                    "edge_update_layer.lin_edge_len.bias")
"""Reference keys whose modules its forward never calls (dropped by :func:`from_reference_state_dict`)."""

LEMB_DIM = 32
"""The reference edge layer's unused lattice-index embedding width (hard-coded there)."""

_TO_OURS = [(re.compile(r"^edge_update_layer\."), "edge_update_layers.0."),
            (re.compile(r"^equi_update\."), "equi_update_layers.0.")]
_TO_REFERENCE = [(re.compile(r"^edge_update_layers\.0\."), "edge_update_layer."),
                 (re.compile(r"^equi_update_layers\.0\."), "equi_update.")]
_EXTRA_LAYER = re.compile(r"^(edge_update_layers|equi_update_layers)\.([1-9]\d*)\.")


def _rename(key: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, repl in rules:
        key = pattern.sub(repl, key)
    return key


def reference_key_to_ours(key: str) -> str:
    """A reference parameter name as ours (the layers that differ only in name)."""
    return _rename(key, _TO_OURS)


def from_reference_state_dict(state_dict: Mapping[str, torch.Tensor], source: str = "reference state dict"
                              ) -> dict[str, torch.Tensor]:
    """Reference ``iComformer`` / ``eComformer`` state dict -> ours (load it with ``strict=True``).

    Drops the unused ``edge_update_layer.lemb`` / ``lin_edge_len``; a state dict with neither ComFormer layer
    (``att_layers.*``) is an error naming ``source``.
    """
    sd = strip_wrapper_prefixes(state_dict)
    if not any(k.startswith("att_layers.") for k in sd):
        raise ValueError(f"{source}: no 'att_layers.*' keys: not a ComFormer state dict (keys start "
                         f"{sorted(sd)[:3]})")
    return {_rename(k, _TO_OURS): v for k, v in sd.items() if k not in REFERENCE_UNUSED}


def reference_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our ComFormer state dict -> the reference's (its ``load_state_dict(..., strict=True)`` accepts it).

    The reference has exactly one edge-wise (or equivariant) layer: a model with ``edge_layers`` > 1 has no
    reference counterpart and is an error naming the keys. An iComFormer gets zero ``lemb`` / ``lin_edge_len``.
    """
    sd = strip_wrapper_prefixes(state_dict)
    if not any(k.startswith("att_layers.") for k in sd):
        raise ValueError("state dict has no 'att_layers.*' keys: not a ComFormer state dict")
    extra = sorted(k for k in sd if _EXTRA_LAYER.match(k))
    if extra:
        raise ValueError(f"keys {extra[:3]}: the reference ComFormer has one edge/equivariant layer "
                         f"(edge_layers=1); this model has more")
    out = {_rename(k, _TO_REFERENCE): v for k, v in sd.items()}
    key = out.get("edge_update_layer.lin_key.weight")
    if key is not None:
        c = key.shape[1]
        out["edge_update_layer.lemb.weight"] = key.new_zeros(3, LEMB_DIM)
        out["edge_update_layer.lin_edge_len.weight"] = key.new_zeros(c, c + LEMB_DIM)
        out["edge_update_layer.lin_edge_len.bias"] = key.new_zeros(c)
    return out


def state_dict_mismatch(expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> list[str]:
    """What keeps ``got`` from loading strictly where ``expected`` (a model's state dict) is wanted: missing and
    unexpected keys, and keys whose shapes differ (each with both shapes). Empty: it loads."""
    out = []
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing:
        out.append(f"missing keys {missing[:5]}" + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    if unexpected:
        out.append(f"unexpected keys {unexpected[:5]}"
                   + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""))
    shapes = [f"'{k}': shape {tuple(got[k].shape)} where the model has {tuple(expected[k].shape)}"
              for k in sorted(set(expected) & set(got)) if tuple(expected[k].shape) != tuple(got[k].shape)]
    out += shapes[:5] + ([f"{len(shapes) - 5} more keys with other shapes"] if len(shapes) > 5 else [])
    return out


def load_reference_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor],
                              source: str = "reference state dict") -> None:
    """Load a reference ComFormer state dict into our ``model`` (strict); a mismatch is one error naming
    ``source`` and every key and shape that differs."""
    mapped = from_reference_state_dict(state_dict, source)
    problems = state_dict_mismatch(model.state_dict(), mapped)
    if problems:
        raise ValueError(f"{source}: does not match this ComFormer config: " + "; ".join(problems))
    model.load_state_dict(mapped, strict=True)


# ----------------------------------------------------------------------------------------------------------
# Checkpoint layout (trainer import comformer / trainer export --format reference)
# ----------------------------------------------------------------------------------------------------------

CONFIG_FILE, STATS_FILE, MODEL_FILE = "config.json", "target_stats.json", "model.pt"
"""The reference's ``train.py`` writes ``config.json`` (its TrainingConfig) into its output folder; the target
statistics have no file there (see ``STATS_FILE`` in the docs: the user writes it); ``model.pt`` is what the export
writes (the model's state dict, which ignite's ``Checkpoint.load_objects({"model": net}, ...)`` and
``load_state_dict`` read)."""
TASK_PREFIX = "model."
"""Our task's model (``StandardizedModel``) holds the ComFormer under this name, the target statistics beside it."""
_NAMES = {"icomformer": "iComformer", "ecomformer": "eComformer"}
# The reference's model config field -> ours (ComFormerConfig): the paper preset must have the same value.
_SIZE_FIELDS = (("conv_layers", "conv_layers"), ("edge_layers", "edge_layers"), ("node_features", "node_features"),
                ("edge_features", "edge_features"), ("triplet_input_features", "triplet_features"),
                ("fc_features", "fc_features"), ("node_layer_head", "heads"), ("output_features", "output_features"))
# What our ComFormer is: the reference's config must say the same (field, value).
_FIXED = (("atom_input_features", 92), ("fc_layers", 1), ("link", "identity"), ("zero_inflated", False),
          ("classification", False))


def _checkpoint_file(source: Path) -> Path:
    """The file to read: `source` itself, else the folder's newest ignite ``checkpoint_N.pt``, else its newest
    ``best_model_N_*.pt``, else its ``model.pt``."""
    if source.is_file():
        return source

    def number(path: Path, prefix: str) -> int:
        digits = re.match(rf"{prefix}_(\d+)", path.name)
        return int(digits.group(1)) if digits else -1

    for prefix in ("checkpoint", "best_model"):
        found = sorted(source.glob(f"{prefix}_*.pt"), key=lambda p: number(p, prefix))
        if found:
            return found[-1]
    if (source / MODEL_FILE).is_file():
        return source / MODEL_FILE
    raise ValueError(f"{source}: no checkpoint_N.pt, best_model_N_*.pt or {MODEL_FILE} there (what the reference's "
                     f"train.py and `trainer export --format reference` write)")


def _variant_of(sd: Mapping[str, torch.Tensor], config: Mapping[str, Any] | None, path: Path) -> str:
    name = (config or {}).get("model", {}).get("name")
    if name is not None:
        variant = {v: k for k, v in _NAMES.items()}.get(str(name))
        if variant is None:
            raise ValueError(f"{path}: field 'model.name' is {name!r}: only {sorted(_NAMES.values())} are ComFormers")
        return variant
    return "ecomformer" if any(k.startswith("equi_update.") for k in sd) else "icomformer"


def _parameter_names(variant: str) -> set[str]:
    """The reference's parameter names (not buffers) for `variant`: ours through the key map, plus the modules
    only the reference has (the names do not depend on the sizes: a small model gives them)."""
    from trainer.families.crystals.comformer import build_comformer, comformer_config

    small = dict(node_features=4, edge_features=4, triplet_features=4, fc_features=4, equi_scalars=4, equi_vectors=2)
    model = build_comformer(comformer_config("paper", variant=variant, **small))
    return {_rename(n, _TO_REFERENCE) for n, _ in model.named_parameters()} | set(REFERENCE_UNUSED)


def _optimizer_by_name(optimizer: Mapping[str, Any], sd: Mapping[str, torch.Tensor], variant: str, path: Path
                       ) -> dict[str, dict[str, Any]] | None:
    """The reference's AdamW state by our parameter names: its train.py groups ``named_parameters()`` into those
    with weight decay and those without ('bias', 'bn' or 'norm' in the name), in that order."""
    params = _parameter_names(variant)
    names = [k for k in strip_wrapper_prefixes(sd) if k in params]
    no_decay = [n for n in names if "bias" in n or "bn" in n or "norm" in n]
    order = [n for n in names if n not in no_decay] + no_decay
    indices = [i for group in optimizer.get("param_groups", []) for i in group.get("params", [])]
    if len(indices) != len(order):
        raise ValueError(f"{path}: field 'optimizer' holds {len(indices)} parameters, the model {len(order)}")
    state = optimizer.get("state", {})
    return {TASK_PREFIX + _rename(n, _TO_OURS): dict(state[i]) for n, i in zip(order, indices)
            if i in state and n not in REFERENCE_UNUSED}


def _read_json(path: Path) -> dict[str, Any]:
    import json

    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path} as JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: holds a {type(value).__name__}, not an object")
    return value


def _target_stats(path: Path, outputs: int) -> tuple[list[float], list[float]]:
    if not path.is_file():
        raise ValueError(f"{path.parent}: no {path.name}: the reference standardises its targets outside the model "
                         f"with the training set's mean and std (its log prints 'normalize using training mean M and "
                         f"std S'), which neither its checkpoint nor config.json holds; write them there as "
                         f'{{"mean": M, "std": S}}')
    stats = _read_json(path)
    out = []
    for key in ("mean", "std"):
        if key not in stats:
            raise ValueError(f"{path}: field '{key}' is missing")
        value = stats[key] if isinstance(stats[key], list) else [stats[key]]
        if len(value) != outputs or not all(isinstance(v, (int, float)) for v in value):
            raise ValueError(f"{path}: field '{key}' must be a number (or {outputs} numbers), got {stats[key]!r}")
        out.append([float(v) for v in value])
    if any(s <= 0 for s in out[1]):
        raise ValueError(f"{path}: field 'std' must be positive, got {stats['std']!r}")
    return out[0], out[1]


def _config_overrides(config: Mapping[str, Any], variant: str, path: Path) -> tuple[list[str], list[str], list[str]]:
    """(overrides, recipe, notes) from the reference's config.json."""
    from trainer.families.crystals.comformer import comformer_config
    from trainer.reference_formats import override

    model = config.get("model") or {}
    for field, value in _FIXED:
        if field in model and model[field] != value:
            raise ValueError(f"{path}: field 'model.{field}' is {model[field]!r}; our ComFormer has {value!r}")
    if config.get("atom_features", "cgcnn") != "cgcnn":
        raise ValueError(f"{path}: field 'atom_features' is {config['atom_features']!r}; our ComFormer reads CGCNN "
                         f"features ('cgcnn')")
    paper = comformer_config("paper", variant=variant)
    notes = [f"{path.name}: field 'model.{field}' is {model[field]}; task.model_preset=paper (the only size of the "
             f"reference's depth) has {getattr(paper, ours)}: the import names the shapes that differ"
             for field, ours in _SIZE_FIELDS if field in model and model[field] != getattr(paper, ours)]
    overrides = []
    for key, field, kind in (("task.cutoff", "cutoff", float), ("task.max_neighbors", "max_neighbors", int),
                             ("optim.lr", "learning_rate", float), ("optim.weight_decay", "weight_decay", float),
                             ("train.per_device_batch_size", "batch_size", int), ("train.epochs", "epochs", int)):
        if config.get(field) is not None:
            overrides.append(override(key, kind(config[field])))
    if config.get("criterion") in ("mse", "l1"):
        overrides.append(override("task.loss", config["criterion"]))
    recipe = ["train.grad_clip_norm=0.0", "optim.warmup_steps=0"]
    if config.get("optimizer", "adamw") == "adamw":
        recipe.append("optim.name=adamw")
    if config.get("scheduler", "onecycle") == "onecycle":
        recipe.append("optim.scheduler=onecycle")
    return overrides, recipe, notes


def read_reference_checkpoint(source: Path) -> Any:
    """A reference ComFormer checkpoint as a `ReferenceCheckpoint`: ignite's ``checkpoint_N.pt`` ({model,
    optimizer, lr_scheduler, trainer}: weights, AdamW state by name, the iteration as the step) or a plain state
    dict (``best_model_*.pt``, ``model.pt``), all weights-only; ``config.json`` beside it (the variant, the training
    options) where present; the target mean and std from ``target_stats.json`` (the reference keeps them nowhere)."""
    from trainer.reference_formats import ReferenceCheckpoint, load_weights_only, override

    source = Path(source)
    path = _checkpoint_file(source)
    folder = path.parent
    saved = load_weights_only(path)
    files, notes = [path], []
    optimizer_state, step = None, 0
    if isinstance(saved.get("model"), dict):  # ignite's Checkpoint of several objects
        sd = saved["model"]
        trainer = saved.get("trainer") or {}
        step = int(trainer.get("iteration", int(trainer.get("epoch", 0)) * int(trainer.get("epoch_length", 0))))
        if "lr_scheduler" in saved:
            notes.append(f"{path.name}'s lr_scheduler is not read: the run's schedule is put at step {step}")
    else:
        sd = saved
    config_path = folder / CONFIG_FILE
    config = _read_json(config_path) if config_path.is_file() else None
    variant = _variant_of(strip_wrapper_prefixes(sd), config, config_path)
    model = {TASK_PREFIX + k: v for k, v in from_reference_state_dict(sd, str(path)).items()}
    outputs = model[TASK_PREFIX + "fc_out.bias"].shape[0] if TASK_PREFIX + "fc_out.bias" in model else 1
    mean, std = _target_stats(folder / STATS_FILE, outputs)
    files.append(folder / STATS_FILE)
    model["target_mean"], model["target_std"] = torch.tensor(mean), torch.tensor(std)
    if isinstance(saved.get("optimizer"), dict) and saved["optimizer"].get("state"):
        optimizer_state = _optimizer_by_name(saved["optimizer"], sd, variant, path)
    overrides = [override("task.name", "crystal_property"), override("task.variant", variant),
                 override("task.model_preset", "paper")]
    recipe: list[str] = ["train.grad_clip_norm=0.0", "optim.name=adamw", "optim.scheduler=onecycle",
                         "optim.warmup_steps=0"]
    if config is not None:
        more, recipe, config_notes = _config_overrides(config, variant, config_path)
        overrides += more
        notes += config_notes
        files.append(config_path)
    else:
        notes.append(f"no {CONFIG_FILE} beside {path.name}: the training options are this config's")
    notes.append("task.data_path chooses the data; the target mean and std are the source's (target_stats.json), "
                 "kept by the run in place of the data's")
    return ReferenceCheckpoint(task="crystal_property", model=model, step=step, optimizer=optimizer_state,
                               overrides=overrides, recipe=recipe, files=files, notes=notes,
                               stats={"target_mean": mean, "target_std": std})


def reference_config(config: Any, outputs: int) -> dict[str, Any]:
    """The fields of the reference's ``config.json`` (TrainingConfig) for a run of ours (`config`: its resolved
    Config): the model's sizes and name, and the training options that have a counterpart."""
    from trainer.families.crystals.comformer import comformer_config

    t = config.task
    if t.model_preset != "paper":
        raise ValueError(f"task.model_preset is {t.model_preset!r}: the reference's forwards are built for its own "
                         f"depth (4 node layers iComFormer, 3 eComFormer), which only the 'paper' preset has")
    ours = comformer_config("paper", variant=t.variant)
    model = {"name": _NAMES[t.variant], **{field: getattr(ours, mine) for field, mine in _SIZE_FIELDS},
             "edge_layer_head": ours.heads, "output_features": outputs, **dict(_FIXED)}
    return {"atom_features": "cgcnn", "cutoff": float(t.cutoff), "max_neighbors": int(t.max_neighbors),
            "criterion": t.loss, "learning_rate": float(config.optim.lr),
            "weight_decay": float(config.optim.weight_decay), "batch_size": int(config.train.per_device_batch_size),
            "epochs": int(config.train.epochs), "optimizer": "adamw",
            "scheduler": "onecycle" if config.optim.scheduler == "onecycle" else "none", "model": model}


def _empty_aliases(variant: str, outputs: int, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's empty tensors that `sd` lacks: e3nn's unused tensor-product weights share one empty storage,
    which safetensors keeps once (as one of their names), and the reference's strict load wants each name."""
    from trainer.families.crystals.comformer import build_comformer, comformer_config

    with torch.device("meta"):
        model = build_comformer(comformer_config("paper", variant=variant, output_features=outputs))
    return {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()
            if k not in sd and v.numel() == 0}


def write_reference_checkpoint(out: Path, weights: Any) -> list[str]:
    """Our run's weights in the reference's layout: ``model.pt`` (the ComFormer's state dict, reference names),
    ``config.json`` (its TrainingConfig fields) and ``target_stats.json`` (the run's target mean and std, which the
    reference applies outside its model). Returns notes."""
    import json

    sd = {k: v.detach().cpu().contiguous() for k, v in strip_wrapper_prefixes(weights.model).items()}
    inner = {k.removeprefix(TASK_PREFIX): v for k, v in sd.items() if k.startswith(TASK_PREFIX)}
    if not inner or "target_mean" not in sd:
        raise ValueError("the run's model has no 'model.*' ComFormer and target statistics: not a crystal_property run")
    config = reference_config(weights.config, int(sd["target_mean"].numel()))
    inner.update(_empty_aliases(weights.config.task.variant, config["model"]["output_features"], inner))
    out.mkdir(parents=True, exist_ok=True)
    torch.save(reference_state_dict(inner), out / MODEL_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=4) + "\n")
    mean, std = sd["target_mean"].double().tolist(), sd["target_std"].double().tolist()
    stats = {"mean": mean[0] if len(mean) == 1 else mean, "std": std[0] if len(std) == 1 else std}
    (out / STATS_FILE).write_text(json.dumps(stats) + "\n")
    notes = [f"{MODEL_FILE} is the model's state dict, not ignite's checkpoint_N.pt: the reference resumes "
             f"training with fresh optimizer and schedule state"]
    if weights.ema is not None:
        notes.append(f"{MODEL_FILE} holds the model's weights, not the run's EMA (the reference keeps none)")
    return notes


REFERENCE_FORMAT = ReferenceFormat(
    name="comformer", task="crystal_property", read=read_reference_checkpoint, write=write_reference_checkpoint,
    description="ComFormer (divelab/AIRS OpenMat/ComFormer): ignite's checkpoint_N.pt or a state dict, with "
                "config.json and target_stats.json")
"""`trainer import comformer` / `trainer export --format reference` for crystal_property runs."""

"""Key map between our EDM and the reference (ehoogeboom/e3_diffusion_for_molecules, MIT).

The reference names its EGNN blocks and their layers by ``add_module`` strings (``egnn.e_block_0.gcl_1.``,
``egnn.e_block_0.gcl_equiv.``) where ours uses module lists (``egnn.blocks.0.gcls.1.``,
``egnn.blocks.0.equivariant.``); its predefined noise schedule is a frozen parameter ``gamma.gamma`` (ours: the
buffer ``gamma``), and its ``EnVariationalDiffusion`` carries an unused ``buffer`` (a zero used to find the
device). Every other name and every shape is the same. Works on a dynamics state dict (``egnn.*``) as well as on
a whole diffusion's (``dynamics.egnn.*`` + schedule). Used by the parity check (``scripts/parity/edm.py``) and by
``REFERENCE_FORMAT``: the reference's checkpoint layout (``generative_model.npy`` / ``generative_model_ema.npy``,
``torch.save``d state dicts, with ``args.pickle``) for ``trainer import edm`` and ``trainer export --format
reference``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainer.reference_formats import ReferenceFormat, load_weights_only
from trainer.state_dicts import strip_wrapper_prefixes

REFERENCE_GAMMA = "gamma.gamma"
REFERENCE_BUFFER = "buffer"

_TO_OURS = [(re.compile(r"(^|\.)e_block_(\d+)\.gcl_(\d+)\."), r"\1blocks.\2.gcls.\3."),
            (re.compile(r"(^|\.)e_block_(\d+)\.gcl_equiv\."), r"\1blocks.\2.equivariant.")]
_TO_REFERENCE = [(re.compile(r"(^|\.)blocks\.(\d+)\.gcls\.(\d+)\."), r"\1e_block_\2.gcl_\3."),
                 (re.compile(r"(^|\.)blocks\.(\d+)\.equivariant\."), r"\1e_block_\2.gcl_equiv.")]


def _rename(key: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, repl in rules:
        key = pattern.sub(repl, key)
    return key


def from_reference_state_dict(state_dict: Mapping[str, torch.Tensor], source: str = "reference state dict"
                              ) -> dict[str, torch.Tensor]:
    """Reference EDM state dict (``EnVariationalDiffusion`` or ``EGNN_dynamics_QM9``) -> ours (strict).

    Drops ``buffer`` after checking it is the reference's zero; a learned noise schedule (``gamma.l1...``, EDM's
    ``GammaNetwork``) has no counterpart here and is an error naming ``source``.
    """
    sd = strip_wrapper_prefixes(state_dict)
    buf = sd.pop(REFERENCE_BUFFER, None)
    if buf is not None and bool(buf.ne(0).any()):
        raise ValueError(f"{source}: field '{REFERENCE_BUFFER}' is not zero; not an EnVariationalDiffusion buffer")
    learned = sorted(k for k in sd if k.startswith("gamma.") and k != REFERENCE_GAMMA)
    if learned:
        raise ValueError(f"{source}: fields {learned[:3]} are a learned noise schedule (GammaNetwork); only the "
                         f"predefined schedules ('{REFERENCE_GAMMA}') are supported")
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        out["gamma" if k == REFERENCE_GAMMA else _rename(k, _TO_OURS)] = v
    return out


def reference_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our EDM state dict (``EDMDiffusion`` or ``EGNNDynamics``) -> the reference's (its ``load_state_dict(...,
    strict=True)`` accepts it); a diffusion's also gets the reference's zero ``buffer``."""
    sd = strip_wrapper_prefixes(state_dict)
    if not any(k.startswith(("egnn.", "dynamics.egnn.")) for k in sd):
        raise ValueError("state dict has no 'egnn.*' or 'dynamics.egnn.*' keys: not an EDM state dict")
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        out[REFERENCE_GAMMA if k == "gamma" else _rename(k, _TO_REFERENCE)] = v
    if REFERENCE_GAMMA in out:
        out[REFERENCE_BUFFER] = torch.zeros(1, dtype=out[REFERENCE_GAMMA].dtype, device=out[REFERENCE_GAMMA].device)
    return out


# ----------------------------------------------------------------------------------------------------------
# Checkpoint layout (trainer import edm / trainer export --format reference)
# ----------------------------------------------------------------------------------------------------------

MODEL_FILE, EMA_FILE, ARGS_FILE, OPTIM_FILE = ("generative_model.npy", "generative_model_ema.npy", "args.pickle",
                                                "optim.npy")
"""What the reference's `main_qm9.py` writes into `outputs/EXP/` (the .npy files are torch.save'd state dicts)."""
TASK_PREFIX = "diffusion."
"""Our task's model (`EDMModel`) holds the diffusion under this name."""
DATASET_ELEMENTS = {("qm9", False): ["H", "C", "N", "O", "F"], ("qm9", True): ["C", "N", "O", "F"]}
"""The reference's QM9 atom decoders (with and without hydrogens), the element order of its one-hot features."""

# What our EDM is (egnn.py, diffusion.py): the reference's args.pickle must say the same. (field, value)
_FIXED: tuple[tuple[str, Any], ...] = (
    ("model", "egnn_dynamics"), ("probabilistic_model", "diffusion"), ("diffusion_noise_schedule", "polynomial_2"),
    ("diffusion_loss_type", "l2"), ("inv_sublayers", 1), ("attention", True), ("tanh", True), ("norm_constant", 1),
    ("sin_embedding", False), ("normalization_factor", 1), ("aggregation_method", "sum"), ("condition_time", True),
    ("include_charges", True), ("normalize_factors", [1, 4, 10]), ("conditioning", []),
)
_ARGS_DEFAULTS: dict[str, Any] = {
    # The reference's main_qm9.py options beside the model's, at their defaults, so its scripts read the file.
    "exp_name": "trainer_export", "n_epochs": 200, "brute_force": False, "actnorm": True, "break_train_epoch": False,
    "dp": True, "clip_grad": True, "trace": "hutch", "ode_regularization": 1e-3, "datadir": "qm9/temp",
    "filter_n_atoms": None, "dequantization": "argmax_variational", "n_report_steps": 1, "wandb_usr": None,
    "no_wandb": True, "online": True, "no_cuda": False, "save_model": True, "generate_epochs": 1, "num_workers": 0,
    "test_epochs": 10, "data_augmentation": False, "resume": None, "start_epoch": 0, "augment_noise": 0,
    "n_stability_samples": 500, "visualize_every_batch": 100000000, "cuda": False, "context_node_nf": 0,
    "current_epoch": 0,
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, list):
        return isinstance(a, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(b, bool) or isinstance(a, bool):
        return a is b or a == b
    if isinstance(b, (int, float)) and isinstance(a, (int, float)):
        return float(a) == float(b)
    return a == b


def _args_overrides(args: Mapping[str, Any], path: Path) -> list[str]:
    from trainer.reference_formats import override

    for name, value in _FIXED:
        if name in args and not _same(args[name], value):
            raise ValueError(f"{path}: field '{name}' is {args[name]!r}; our EDM has {value!r}")
    dataset, remove_h = str(args.get("dataset", "qm9")), bool(args.get("remove_h", False))
    key = ("qm9" if dataset.startswith("qm9") else dataset, remove_h)
    if key not in DATASET_ELEMENTS:
        raise ValueError(f"{path}: field 'dataset' is {dataset!r}: only QM9's element sets are known here "
                         f"(set task.elements to the reference's atom decoder yourself for another)")
    try:
        out = [override("task.name", "molecules_edm"), override("task.elements", DATASET_ELEMENTS[key]),
               override("task.hidden", int(args["nf"])), override("task.layers", int(args["n_layers"])),
               override("task.timesteps", int(args["diffusion_steps"]))]
    except KeyError as err:
        raise ValueError(f"{path}: field {err} is missing") from None
    if "diffusion_noise_precision" in args:
        out.append(override("task.noise_precision", float(args["diffusion_noise_precision"])))
    if "ema_decay" in args:
        out.append(override("train.ema_decay", float(args["ema_decay"])))
    if "lr" in args:
        out.append(override("optim.lr", float(args["lr"])))
    return out


def read_reference_checkpoint(source: Path) -> Any:
    """A reference EDM checkpoint (its output folder, or one .npy file in it) as a `ReferenceCheckpoint`: the
    weights of `generative_model.npy` (else the EMA file's), the EMA of `generative_model_ema.npy`, the Adam
    state of `optim.npy` where present, and the config from `args.pickle` (read with a restricted unpickler)."""
    from trainer.reference_formats import ReferenceCheckpoint, namespace_fields

    source = Path(source)
    folder = source.parent if source.is_file() else source
    args_path = folder / ARGS_FILE
    if not args_path.is_file():
        raise ValueError(f"{folder}: no {ARGS_FILE} there (the reference's run options: model sizes and schedule)")
    model_path, ema_path = folder / MODEL_FILE, folder / EMA_FILE
    if source.is_file() and source.name not in (MODEL_FILE, EMA_FILE, ARGS_FILE):
        model_path, ema_path = source, folder / source.name.replace("generative_model_", "generative_model_ema_")
    if not model_path.is_file() and not ema_path.is_file():
        raise ValueError(f"{folder}: neither {MODEL_FILE} nor {EMA_FILE} there")
    args = namespace_fields(args_path)
    overrides = _args_overrides(args, args_path)
    notes = [f"{ARGS_FILE} records epochs, not optimizer steps (current_epoch {args.get('current_epoch', '?')}): "
             f"the run starts at step 0 with these weights"]
    files = [args_path]
    ema = None
    if ema_path.is_file():
        ema = _from_file(ema_path)
        files.append(ema_path)
    if model_path.is_file():
        model = _from_file(model_path)
        files.append(model_path)
    else:
        model = dict(ema or {})
        notes.append(f"no {MODEL_FILE}: the model weights are the EMA's")
    optimizer = None
    optim_path = folder / OPTIM_FILE
    if optim_path.is_file() and model_path.is_file():
        optimizer = _optimizer_by_name(load_weights_only(optim_path), load_weights_only(model_path), optim_path)
        files.append(optim_path)
    if ema is not None:
        ema = {k: v for k, v in ema.items() if k != TASK_PREFIX + "gamma"}  # the EMA covers parameters only
    recipe = ["optim.name=adamw", "optim.amsgrad=true", "optim.weight_decay=1e-12", "train.ema_warmup=none"]
    if args.get("clip_grad", True):
        recipe.append("train.grad_clip_mode=adaptive")
    return ReferenceCheckpoint(task="molecules_edm", model=model, ema=ema, step=0, optimizer=optimizer,
                               overrides=overrides, recipe=recipe, files=files, notes=notes)


def _from_file(path: Path) -> dict[str, torch.Tensor]:
    return {TASK_PREFIX + k: v for k, v in from_reference_state_dict(load_weights_only(path), str(path)).items()}


def _optimizer_by_name(optimizer: Mapping[str, Any], ref_state: Mapping[str, torch.Tensor], path: Path
                       ) -> dict[str, dict[str, Any]]:
    """The reference's Adam state by our parameter names: it optimises `model.parameters()`, the state dict's order
    without the buffer (the frozen schedule `gamma.gamma` is one of them, without state: it has no gradient)."""
    names = [k for k in strip_wrapper_prefixes(ref_state) if k != REFERENCE_BUFFER]
    order = [i for group in optimizer.get("param_groups", []) for i in group.get("params", [])]
    if len(order) != len(names):
        raise ValueError(f"{path}: field 'param_groups' holds {len(order)} parameters, the model {len(names)}")
    state = optimizer.get("state", {})
    ours = {REFERENCE_GAMMA: "gamma"}
    return {TASK_PREFIX + ours.get(n, _rename(n, _TO_OURS)): dict(state[i]) for n, i in zip(names, order)
            if i in state}


def reference_args(config: Any, step: int) -> dict[str, Any]:
    """The fields of the reference's `args.pickle` for a run of ours (`config`: its resolved Config)."""
    from trainer.families.molecules_edm.spec import MODEL_PRESETS

    t = config.task
    elements = list(t.elements)
    dataset = next((key for key, els in DATASET_ELEMENTS.items() if els == elements), None)
    if dataset is None:
        raise ValueError(f"task.elements {elements} is none of the reference's QM9 element sets "
                         f"({list(DATASET_ELEMENTS.values())}): its scripts could not rebuild the model")
    preset = MODEL_PRESETS[t.model_preset]
    fields = {**_ARGS_DEFAULTS, **{name: (list(v) if isinstance(v, list) else v) for name, v in _FIXED}}
    fields.update(nf=int(t.hidden or preset["hidden"]), n_layers=int(t.layers or preset["layers"]),
                  diffusion_steps=int(t.timesteps), diffusion_noise_precision=float(t.noise_precision),
                  dataset=dataset[0], remove_h=dataset[1], ema_decay=float(config.train.ema_decay),
                  lr=float(config.optim.lr), batch_size=int(config.train.per_device_batch_size))
    return fields


def write_reference_checkpoint(out: Path, weights: Any) -> list[str]:
    """Our run's weights as the reference writes them into `outputs/EXP/`: `generative_model.npy`,
    `generative_model_ema.npy` (where the run kept an EMA) and `args.pickle`. Returns notes."""
    import argparse
    import pickle

    def reference(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inner = {k.removeprefix(TASK_PREFIX): v.detach().float().cpu().contiguous() for k, v in state.items()}
        return reference_state_dict(inner)

    fields = reference_args(weights.config, weights.step)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(reference(weights.model), out / MODEL_FILE)
    notes = [f"{OPTIM_FILE} is not written: the reference's AdamW keeps amsgrad's max_exp_avg_sq, which this run's "
             f"optimizer state may lack (the reference resumes with fresh moments)"]
    if weights.ema is not None:
        torch.save(reference({**weights.model, **weights.ema}), out / EMA_FILE)
    else:
        notes.append(f"the run kept no EMA: no {EMA_FILE}")
    with open(out / ARGS_FILE, "wb") as f:
        pickle.dump(argparse.Namespace(**fields), f)
    return notes


REFERENCE_FORMAT = ReferenceFormat(
    name="edm", task="molecules_edm", read=read_reference_checkpoint, write=write_reference_checkpoint,
    description="EDM (ehoogeboom/e3_diffusion_for_molecules): generative_model(_ema).npy + args.pickle "
                "(+ optim.npy) of an outputs/EXP folder")
"""`trainer import edm` / `trainer export --format reference` for molecules_edm runs."""

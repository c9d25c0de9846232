"""The topology-free form of a checkpoint, produced on demand: any backend resumes under any other.

A checkpoint is written in its backend's own files (fast, and exactly what the same layout reads back).
When the resuming run has another layout (plain/DDP <-> DeepSpeed, another ZeRO stage, another number of
DeepSpeed processes, FSDP's shards -> anything but FSDP), `convert` writes DeepSpeed's universal checkpoint
form (Lian et al. 2024): one folder per parameter name with the fp32 weights, the optimizer's moments and the step
(`zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`, each tensor whole), and the optimizer's
hyper-parameters per group (`zero/optimizer_state.pt`). A ZeRO checkpoint is converted by DeepSpeed's
`ds_to_universal` (`--inject_missing_state`), a plain or DDP one (`model.safetensors`, `optimizer.bin`)
by naming the optimizer's parameters with the names the checkpoint recorded. The running backend's engine
(engine.py) fills itself from that folder: `load_into_deepspeed` (DeepSpeed's own universal loader under
ZeRO-1/2/3 at any number of processes) or `load_into_torch` (`load_state_dict` of the model and the torch
optimizer under one process or DDP, and under FSDP2 torch.distributed.checkpoint's `set_state_dict` with
whole tensors, each rank keeping its shards).
An FSDP2 run writes accelerate's sharded checkpoint (torch.distributed.checkpoint, DCP: every rank writes
its own shards, `pytorch_model_fsdp_0/` and `optimizer_0/`), which FSDP reads back at any number of
processes (DCP reshards); one process, DDP and DeepSpeed resume it through `convert`, which reads the
shards whole on the main process (`read_dcp`) and writes the universal form from them. An older FSDP2
checkpoint in a plain run's files (`FULL_STATE`) is read as a plain one.

Every file is read weights-only (safe_load.py). A checkpoint of another model is refused before anything
is converted (`check_same_model`), and a part that cannot be converted is named in a CheckpointError.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from trainer.core.checkpoint.safe_load import weights_only_loading
from trainer.disk_space import no_space_reason, require_space
from trainer.errors import CheckpointError, first_line

DEEPSPEED = "DEEPSPEED"
FSDP = "FSDP"
DS_FOLDER = "pytorch_model"
"""Where accelerate has DeepSpeed write its files inside a checkpoint."""
WEIGHTS, OPTIMIZER = "model.safetensors", "optimizer.bin"
"""accelerate's files of a plain or DDP checkpoint (one model, one optimizer)."""
OPTIMIZER_STATE = "optimizer_state.pt"
FULL_STATE = "full_state"
"""Set in trainer_state.json by an FSDP2 run before its checkpoints were sharded: whole tensors in a plain run's
files."""
SHARDED = "fsdp_sharded"
"""Set in trainer_state.json by an FSDP2 run: accelerate's sharded DCP folders (`FSDP_MODEL`, `FSDP_OPTIMIZER`)."""
FSDP_MODEL, FSDP_OPTIMIZER = "pytorch_model_fsdp_0", "optimizer_0"
"""accelerate's DCP folders of a sharded FSDP checkpoint (state dicts under "model" and "optimizer")."""


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each optimizer group, in the optimizer's order (before `prepare`)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def saved_zero_stage(path: Path, saved: dict[str, Any]) -> int | None:
    """The ZeRO stage of a DeepSpeed checkpoint: recorded, or for older checkpoints 3 when its files say so
    (ZeRO-3 writes model states per rank), else None (1 or 2: the same files)."""
    if saved.get("backend") != DEEPSPEED:
        return 0
    if saved.get("zero_stage") is not None:
        return int(saved["zero_stage"])
    return 3 if any((path / DS_FOLDER).glob("zero_pp_rank_*_model_states.pt")) else None


def needs_conversion(saved: dict[str, Any], backend: str, world: int, zero_stage: int) -> bool:
    """Whether the checkpoint's own files cannot be loaded by this run's backend as they are.

    accelerate loads a plain or DDP checkpoint at any number of processes (FSDP too: whole tensors, each rank
    keeping its shards), and a sharded FSDP checkpoint under FSDP at any number of processes (DCP reshards);
    one process, DDP and DeepSpeed read a sharded FSDP checkpoint through the conversion. DeepSpeed loads its
    own files only at the same number of processes and ZeRO stage (`saved["zero_stage"]`: `saved_zero_stage`)."""
    was = saved.get("backend", "")
    if is_sharded_fsdp(saved):
        return backend != FSDP
    if (was == DEEPSPEED) != (backend == DEEPSPEED):
        return True
    if backend != DEEPSPEED:
        return False
    stage = saved.get("zero_stage")
    if stage is None:  # an older ZeRO-1/2 checkpoint: its files load under either
        return saved.get("world_size") != world or zero_stage == 3
    return saved.get("world_size") != world or stage != zero_stage


# ------------------------------------------------------------------ the same model?
def is_sharded_fsdp(saved: dict[str, Any]) -> bool:
    """Whether a checkpoint (its trainer_state.json) holds FSDP's sharded DCP folders rather than whole tensors."""
    return saved.get("backend") == FSDP and not saved.get(FULL_STATE)


def saved_param_shapes(path: Path, saved: dict[str, Any]) -> tuple[dict[str, tuple], bool]:
    """(name -> shape of what the checkpoint holds, whether buffers are included), without loading tensors
    where the format allows it (safetensors' header, DCP's metadata)."""
    if is_sharded_fsdp(saved):
        metadata = read_dcp_metadata(path / FSDP_MODEL)
        return {k.removeprefix("model."): tuple(v.size) for k, v in metadata.state_dict_metadata.items()
                if k.startswith("model.") and hasattr(v, "size")}, True
    if saved.get("backend") != DEEPSPEED:
        with safe_open(str(path / WEIGHTS), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, True
    shapes = {}
    for group in _deepspeed_model_states(path).get("param_shapes") or []:
        shapes.update({k: tuple(v) for k, v in group.items()})
    return shapes, False


def _deepspeed_model_states(path: Path) -> dict[str, Any]:
    """Rank 0's DeepSpeed model states (parameter shapes; the module's buffers, and weights under ZeRO-1/2)."""
    files = sorted((path / DS_FOLDER).glob("*model_states.pt"))
    if not files:
        raise CheckpointError(f"checkpoint {path}: no DeepSpeed model states in {DS_FOLDER}/")
    with weights_only_loading():
        return torch.load(files[0], map_location="cpu", weights_only=True)


RESUME_HINT = "did the task or model settings change? start over with run.resume=none or a new run.output_dir"


def check_same_model(path: Path, saved: dict[str, Any], model: torch.nn.Module, hint: str = RESUME_HINT) -> None:
    """Refuse a checkpoint of another model, naming the first differences (parameter names and shapes) and `hint`."""
    shapes, with_buffers = saved_param_shapes(path, saved)
    now = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}
    carried = set(getattr(model, "CHECKPOINT_SHAPED_BUFFERS", ()))  # the model takes these buffers' saved shapes
    shapes = {n: s for n, s in shapes.items() if n not in carried}
    if with_buffers:  # the persistent ones: those a state dict holds
        persistent = set(model.state_dict()) - carried
        now.update({n: tuple(b.shape) for n, b in model.named_buffers() if n in persistent})
    problems = [f"parameter '{n}' has shape {tuple(shapes[n])} there and {now[n]} here"
                for n in now if n in shapes and tuple(shapes[n]) != now[n]]
    # safetensors keeps one of tensors that share storage, and empty ones all do (e3nn's weightless tensor
    # products): an empty tensor missing from the file holds nothing to restore
    problems += [f"'{n}' is not in the checkpoint" for n in now if n not in shapes and math.prod(now[n]) > 0]
    problems += [f"'{n}' is not in this model" for n in shapes if n not in now]
    if problems:
        more = f" and {len(problems) - 3} more differences" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint {path} holds another model than this run's: {'; '.join(problems[:3])}{more} "
                              f"({hint})")


# ------------------------------------------------------------------ into the topology-free form
def convert(path: Path, out: Path, saved: dict[str, Any], param_names: list[list[str]]) -> None:
    """Write checkpoint `path` in the universal form into `out` (one process). Raises CheckpointError naming the
    part that cannot be converted."""
    shutil.rmtree(out, ignore_errors=True)
    (out / "zero").mkdir(parents=True)
    if saved.get("backend") == DEEPSPEED:
        _from_deepspeed(path, out)
    elif is_sharded_fsdp(saved):
        names = saved.get("param_names") or param_names
        _to_universal(path, out, *sharded_fsdp_state(path, names), names)
    else:
        _from_torch(path, out, saved.get("param_names") or param_names)


@contextlib.contextmanager
def deepspeed_reading() -> Iterator[None]:
    """Around DeepSpeed's own checkpoint readers (ZeRO merge, universal conversion): weights-only unpickling, and
    their print() lines and tqdm bars dropped (every rank of `trainer sample` merges, each narrated it). Import the
    DeepSpeed module before entering, so its logger keeps the real stream; errors still raise."""
    chatter = io.StringIO()
    with weights_only_loading(), contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
        yield


def _from_deepspeed(path: Path, out: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(path / DS_FOLDER), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    try:
        with deepspeed_reading():
            ds_to_universal.main(args)
    except CheckpointError:
        raise
    except KeyError as err:  # its extractor knows Adam's moments only
        raise CheckpointError(f"checkpoint {path}: the optimizer state cannot be converted (DeepSpeed's "
                              f"ds_to_universal found no {err} in it: it converts Adam/AdamW moments only)") from err
    except Exception as err:  # noqa: BLE001 - whatever DeepSpeed raises, one line naming the part
        if no_space_reason(err, out) is not None:  # the disk's fault, not the checkpoint's: said by the caller
            raise
        raise CheckpointError(f"checkpoint {path}: its DeepSpeed files cannot be converted to the universal form "
                              f"({first_line(err)})") from err
    zero = out / "zero"
    with weights_only_loading():
        state = torch.load(zero / OPTIMIZER_STATE, map_location="cpu", weights_only=True)
        steps = [torch.load(f, weights_only=True) for f in sorted(zero.glob("*/step.pt"))[:1]]
    step = steps[0] if steps else (state.get("optimizer_state_dict") or {}).get("state", {}).get(0, {}).get("step")
    _normalise(path, zero, step)
    _write_common_state(zero, state.get("param_groups") or [], step, state)


def _normalise(path: Path, zero: Path, step: Any) -> None:
    """One form whatever the ZeRO stage: ds_to_universal writes ZeRO-3's tensors flat and bare, without a
    step file or the module's buffers; ZeRO-1/2's loader (and ours) read `{"param": tensor of the parameter's
    shape}` and a step per parameter."""
    states = _deepspeed_model_states(path)
    shapes = {}
    for group in states.get("param_shapes") or []:
        shapes.update({k: tuple(v) for k, v in group.items()})
    with weights_only_loading():
        for name, shape in shapes.items():
            folder = zero / name
            for file in folder.glob("*.pt"):
                value = torch.load(file, map_location="cpu", weights_only=True) if file.stem != "step" else None
                if torch.is_tensor(value):
                    torch.save({"param": value.reshape(shape), "cat_dim": 0}, file)
            if folder.is_dir() and not (folder / "step.pt").exists() and step is not None:
                torch.save(torch.as_tensor(step, dtype=torch.float32), folder / "step.pt")
    for name, tensor in (states.get("module") or {}).items():  # buffers (and ZeRO-3's empty placeholders)
        if name not in shapes and torch.is_tensor(tensor) and not (zero / name / "fp32.pt").exists():
            (zero / name).mkdir(parents=True, exist_ok=True)
            torch.save({"param": tensor.float(), "cat_dim": 0}, zero / name / "fp32.pt")


def _from_torch(path: Path, out: Path, param_names: list[list[str]]) -> None:
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    with weights_only_loading():
        optim = torch.load(path / OPTIMIZER, map_location="cpu", weights_only=True)
    _to_universal(path, out, weights, optim, param_names)


def _to_universal(path: Path, out: Path, weights: dict[str, torch.Tensor], optim: dict[str, Any],
                  param_names: list[list[str]]) -> None:
    """The universal form of whole tensors: the model's state dict and the optimizer's (`optimizer.bin`'s form)."""
    groups, state = optim.get("param_groups", []), optim.get("state", {})
    if len(groups) != len(param_names) or any(len(g["params"]) != len(n) for g, n in zip(groups, param_names)):
        raise CheckpointError(f"checkpoint {path}: the optimizer state cannot be converted: it has "
                              f"{[len(g['params']) for g in groups]} parameters per group, the recorded names "
                              f"{[len(n) for n in param_names]}")
    # Every tensor in fp32, known before the first is written: a disk without room is said before it is filled.
    require_space(out, sum(4 * t.numel() for t in [*weights.values(), *(v for s in state.values() for v in s.values())]
                           if torch.is_tensor(t)))
    zero, step = out / "zero", None
    for group, names in zip(groups, param_names):
        for index, name in zip(group["params"], names):
            folder = zero / name
            folder.mkdir(parents=True, exist_ok=True)
            for key, value in state.get(index, {}).items():
                if key == "step":
                    value = torch.as_tensor(value, dtype=torch.float32)  # fused Adam keeps a tensor
                    step = value if step is None else step
                    torch.save(value, folder / "step.pt")
                elif torch.is_tensor(value) and value.shape == weights[name].shape:
                    torch.save({"param": value.float(), "cat_dim": 0}, folder / f"{key}.pt")
                else:
                    raise CheckpointError(f"checkpoint {path}: the optimizer state '{key}' of parameter '{name}' "
                                          f"cannot be converted (not a tensor of the parameter's shape)")
    for name, tensor in weights.items():  # parameters, and buffers, which DeepSpeed's loader leaves alone
        (zero / name).mkdir(parents=True, exist_ok=True)
        torch.save({"param": tensor.float(), "cat_dim": 0}, zero / name / "fp32.pt")
    _write_common_state(zero, [{k: v for k, v in g.items() if k != "params"} for g in groups], step, {})


def _write_common_state(zero: Path, groups: list[dict], step: Any, base: dict) -> None:
    """`optimizer_state.pt` as both of DeepSpeed's universal loaders read it (ZeRO-1/2 and ZeRO-3)."""
    # A DeepSpeed target has imported it; a plain/DDP one reads only the groups and the step (no import: it is slow
    # and warns on CPU-only machines).
    version = getattr(sys.modules.get("deepspeed"), "__version__", "0")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    # Plain values only, so a process without DeepSpeed reads it weights-only (a loss scaler object restarts).
    base = {k: base[k] for k in ("dynamic_loss_scale", "overflow", "clip_grad", "ds_version") if k in base}
    torch.save({**base, "ds_version": base.get("ds_version", version), "param_groups": groups,
                "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": groups}}, zero / OPTIMIZER_STATE)


# ------------------------------------------------------------------ out of it, into this run
def read_common_state(folder: Path, param_names: list[list[str]]) -> dict[str, Any]:
    """The universal form's `optimizer_state.pt` in `folder`, checked against this run's parameter groups."""
    with weights_only_loading():
        common = torch.load(folder / "zero" / OPTIMIZER_STATE, map_location="cpu", weights_only=True)
    groups = common.get("param_groups") or []
    if len(groups) != len(param_names):
        raise CheckpointError(f"the optimizer of the checkpoint has {len(groups)} parameter groups, this run's "
                              f"{len(param_names)} (did optim.weight_decay or optim.decay_all_parameters change?)")
    return common


def load_into_deepspeed(folder: Path, engine: Any, param_names: list[list[str]]) -> None:
    """Fill a DeepSpeed engine (any ZeRO stage, any number of processes) from the universal form in `folder`."""
    common = read_common_state(folder, param_names)
    with weights_only_loading():
        _into_deepspeed(folder / "zero", engine, common.get("param_groups") or [])


def load_into_torch(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    param_names: list[list[str]], sharded: bool = False) -> None:
    """Fill a plain, DDP or FSDP2 model (unwrapped) and its torch optimizer from the universal form in `folder`;
    `sharded`: the model's parameters are FSDP2's DTensors (the engine knows)."""
    common = read_common_state(folder, param_names)
    with weights_only_loading():
        _into_torch(folder / "zero", model, optimizer, param_names, common.get("param_groups") or [], common, sharded)


def _into_deepspeed(zero: Path, engine: Any, groups: list[dict]) -> None:
    zero_optimizer = engine.optimizer
    try:
        zero_optimizer.load_state_dict(state_dict_list=None, load_optimizer_states=True, load_from_fp32_weights=True,
                                       checkpoint_folder=str(zero.parent))
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - DeepSpeed's loader asserts; name the part
        raise CheckpointError(f"the universal checkpoint could not be loaded into DeepSpeed's optimizer "
                              f"({first_line(err)})") from err
    if not engine.zero_optimization_partition_weights():
        zero_optimizer.update_lp_params()  # fp32 master -> the model's weights (ZeRO-3 copies them itself)
    for group, saved in zip(zero_optimizer.optimizer.param_groups, groups):  # ZeRO-3 applies group 0's to all
        group.update({k: v for k, v in saved.items() if k != "params"})
    with torch.no_grad():
        for name, buffer in engine.module.named_buffers():
            file = zero / name / "fp32.pt"
            if file.is_file():
                buffer.copy_(torch.load(file, map_location="cpu", weights_only=True)["param"])


def _into_torch(zero: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, param_names: list[list[str]],
                groups: list[dict], common: dict, sharded: bool) -> None:
    weights = {}
    for name, tensor in model.state_dict().items():  # under FSDP2: DTensors, whose shape is the whole tensor's
        file = zero / name / "fp32.pt"
        if not file.is_file():
            raise CheckpointError(f"the checkpoint has no weights for '{name}'")
        weights[name] = torch.load(file, map_location="cpu", weights_only=True)["param"].to(tensor.dtype)
    fallback = (common.get("optimizer_state_dict") or {}).get("state", {}).get(0, {}).get("step")
    state, index = {}, 0
    for names in param_names:
        for name in names:
            entry = {}
            for file in (zero / name).glob("*.pt"):
                if file.stem == "step":
                    entry["step"] = torch.load(file, weights_only=True)
                elif file.stem != "fp32":
                    entry[file.stem] = torch.load(file, map_location="cpu", weights_only=True)["param"]
            if entry and "step" not in entry and fallback is not None:
                entry["step"] = fallback
            if entry:
                entry["step"] = torch.as_tensor(entry["step"], dtype=torch.float32)
                state[index] = entry
            index += 1
    params, start = [], 0
    for names in param_names:
        params.append(list(range(start, start + len(names))))
        start += len(names)
    load_full_state(model, optimizer, weights, {"state": state, "param_groups": [
        {**{k: v for k, v in g.items() if k != "params"}, "params": p} for g, p in zip(groups, params)]}, param_names,
        sharded)


# ------------------------------------------------------------------ whole tensors in and out of any torch layout
def read_dcp_metadata(folder: Path) -> Any:
    """The metadata of a DCP folder (tensor names and shapes), unpickled by safe_load's restricted unpickler."""
    from trainer.core.checkpoint.safe_load import load_dcp_metadata

    file = folder / ".metadata"
    if not file.is_file():
        raise CheckpointError(f"checkpoint {folder.parent}: {folder.name}/.metadata is missing (not a sharded FSDP "
                              f"checkpoint)")
    with open(file, "rb") as f:
        return load_dcp_metadata(f)


def read_dcp(folder: Path) -> dict[str, Any]:
    """A whole DCP checkpoint as one state dict of whole tensors, in this process (no process group):
    torch.distributed.checkpoint.format_utils' `dcp_to_torch_save` without the file, read weights-only."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    read_dcp_metadata(folder)  # a missing or unsafe file is named before DCP opens it
    state: dict[str, Any] = {}
    try:
        with weights_only_loading():
            _load_state_dict(state, storage_reader=FileSystemReader(str(folder)), planner=_EmptyStateDictLoadPlanner(),
                             no_dist=True)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - DCP raises its own exception types; one line naming the folder
        raise CheckpointError(f"checkpoint {folder.parent}: {folder.name}/ cannot be read ({first_line(err)})") from err
    return state


def sharded_fsdp_state(path: Path, param_names: list[list[str]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model state dict and optimizer state (`optimizer.bin`'s form: parameters indexed in the optimizer's
    order, `param_names` names them) of a sharded FSDP checkpoint, read on one process."""
    weights = read_dcp(path / FSDP_MODEL).get("model", {})
    named = read_dcp(path / FSDP_OPTIMIZER).get("optimizer", {})
    index = {name: i for i, name in enumerate(n for names in param_names for n in names)}
    try:
        return weights, {"state": {index[name]: entry for name, entry in named.get("state", {}).items()},
                         "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                                          for group in named.get("param_groups", [])]}
    except KeyError as err:
        raise CheckpointError(f"checkpoint {path}: the optimizer state names parameter {err} that the checkpoint's "
                              f"parameter names do not hold") from None


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                    optim_state: dict[str, Any], param_names: list[list[str]], sharded: bool = False) -> None:
    """Load whole tensors (a plain run's form, every rank holding all of it) into a plain, DDP or FSDP2 model and
    its torch optimizer; `sharded` (FSDP2): each rank keeps its shards (`set_state_dict`, full_state_dict)."""
    try:
        if not sharded:
            model.load_state_dict(weights, strict=True)
            optimizer.load_state_dict(optim_state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        flat = [n for names in param_names for n in names]
        named = {"state": {flat[i]: entry for i, entry in optim_state.get("state", {}).items()},
                 "param_groups": [{**group, "params": [flat[i] for i in group["params"]]}
                                  for group in optim_state.get("param_groups", [])]}
        set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=named,
                       options=StateDictOptions(full_state_dict=True))
    except (ValueError, KeyError, IndexError, RuntimeError) as err:
        raise CheckpointError(f"the checkpoint's weights or optimizer state could not be loaded into this run's "
                              f"model and optimizer ({first_line(err)})") from err


def load_torch_files(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     param_names: list[list[str]], sharded: bool = True) -> None:
    """Load a plain or DDP checkpoint's `model.safetensors` and `optimizer.bin` into an FSDP2 run (an older FSDP
    checkpoint's too: whole tensors in the same files)."""
    from safetensors.torch import load_file

    weights = load_file(str(path / WEIGHTS))
    with weights_only_loading():
        optim_state = torch.load(path / OPTIMIZER, map_location="cpu", weights_only=True)
    load_full_state(model, optimizer, weights, optim_state, param_names, sharded)


def describe(saved: dict[str, Any], backend: str, world: int, zero_stage: int) -> str:
    """'ZeRO-2 x 2 -> 1 process' for the start log."""
    def name(kind: str, n: Any, stage: Any) -> str:
        label = f"ZeRO-{stage}" if kind == DEEPSPEED and stage is not None else (
            "DeepSpeed" if kind == DEEPSPEED else "FSDP" if kind == FSDP else ("1 process" if n == 1 else "DDP"))
        return label if label == "1 process" else f"{label} x {n}"
    return f"{name(saved.get('backend', ''), saved.get('world_size'), saved.get('zero_stage'))} -> " \
           f"{name(backend, world, zero_stage)}"

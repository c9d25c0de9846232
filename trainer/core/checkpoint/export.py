"""Consolidate a checkpoint of any backend into one fp32 safetensors file loadable without DeepSpeed."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file

from trainer.atomic_io import temp_path
from trainer.core.checkpoint.convert import DS_FOLDER, FSDP_MODEL, WEIGHTS, check_same_model, deepspeed_reading, read_dcp
from trainer.core.checkpoint.store import EMA_FILE, STATE, TASK_STATS, resolve_checkpoint, verify_checkpoint
from trainer.disk_space import disk_bytes, no_space_reason, require_space, space_report
from trainer.errors import CheckpointError


def load_model_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 model state dict from an accelerate checkpoint (plain, sharded, DeepSpeed or FSDP)."""
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / WEIGHTS).is_file():
        return load_file(ckpt_dir / WEIGHTS)
    index = ckpt_dir / f"{WEIGHTS}.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(ckpt_dir / shard).items()}
    if (ckpt_dir / DS_FOLDER).is_dir():
        # ZeRO-1/2/3: merge the per-rank fp32 partitions (any stage) on one CPU process.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with deepspeed_reading():  # DeepSpeed itself would unpickle with weights_only=False
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=DS_FOLDER)
    fsdp = sorted(ckpt_dir.glob(f"{FSDP_MODEL.removesuffix('0')}*"))
    if fsdp:  # FSDP's shards (torch.distributed.checkpoint), read whole on this process, weights-only
        return read_dcp(fsdp[0]).get("model", {})
    raise CheckpointError(f"checkpoint {ckpt_dir} holds no model weights this exporter knows "
                          f"({WEIGHTS}, {DS_FOLDER}/ or {FSDP_MODEL.removesuffix('0')}*/)")


def consolidated_weights(run_dir: str | Path, checkpoint: str = "latest",
                         weights: str = "auto") -> tuple[dict[str, torch.Tensor], Path]:
    """Full fp32 state dict of a run's checkpoint (EMA parameters when kept, unless weights='model')."""
    run_dir = Path(run_dir)
    named = checkpoint in ("latest", "best")
    ckpt_dir = resolve_checkpoint(run_dir if named else checkpoint, checkpoint if named else "latest")
    verify_checkpoint(ckpt_dir)
    ema_file = ckpt_dir / EMA_FILE
    if weights == "ema" and not ema_file.is_file():
        raise CheckpointError(f"checkpoint {ckpt_dir} has no EMA weights (train.ema_decay was 0)")
    state_dict = load_model_weights(ckpt_dir)
    if weights != "model" and ema_file.is_file():
        # The EMA covers the parameters; buffers (e.g. norm statistics) come from the model.
        state_dict.update(load_file(ema_file))
    return {k: v.float().contiguous() if v.is_floating_point() else v.contiguous()
            for k, v in state_dict.items()}, ckpt_dir


def load_initial_weights(model: torch.nn.Module, source: str | Path, weights: str = "auto") -> Path:
    """`run.init_from`: load a run's (latest) or a checkpoint folder's full weights into `model`, after checking from
    the file headers that it holds this model (names and shapes). Returns the checkpoint folder read."""
    ckpt_dir = resolve_checkpoint(source, "latest")
    saved = json.loads((ckpt_dir / STATE).read_text())
    check_same_model(ckpt_dir, saved, model, hint=f"run.init_from={str(source)!r}: start from a run with the same "
                                                  f"model options")
    params, _ = consolidated_weights(ckpt_dir, weights=weights)
    try:
        model.load_state_dict(params, strict=True)
    except RuntimeError as err:  # a buffer the header check does not see (DeepSpeed records parameters only)
        raise CheckpointError(f"run.init_from={str(source)!r}: the weights of {ckpt_dir} do not fit this task's model: "
                              f"{str(err).splitlines()[-1].strip()}") from None
    return ckpt_dir


def export_run(run_dir: str | Path, out: str | Path | None = None, checkpoint: str = "latest",
               weights: str = "auto") -> Path:
    """Write RUN's weights (EMA when kept, unless weights='model') as fp32 safetensors plus its config.

    The export is a function of the checkpoint alone (sorted tensors and metadata, no time stamps, the
    checkpoint named relative to its run), so two exports of it are byte-identical and compare by hash.
    All files are written beside their targets first and then renamed over them: a failure (a full disk)
    leaves the previous export as it was."""
    run_dir = Path(run_dir)
    state_dict, ckpt_dir = consolidated_weights(run_dir, checkpoint, weights)
    state = json.loads((ckpt_dir / STATE).read_text())
    step = state.get("step")
    out = Path(out) if out else run_dir / "export" / "model.safetensors"
    used_ema = weights != "model" and (ckpt_dir / EMA_FILE).is_file()
    # The statistics the model is built from travel inside the file too: another export into the same
    # folder may replace the task_stats.json beside it.
    stats_text = (ckpt_dir / TASK_STATS).read_text() if (ckpt_dir / TASK_STATS).is_file() else "{}"
    metadata = {"checkpoint": f"{ckpt_dir.parent.name}/{ckpt_dir.name}", "step": str(step),
                "weights": "ema" if used_ema else "model", "task_stats": stats_text}
    copies = []  # (source, target): the run's config, then what the manifest lists (task_stats.json, ...)
    config = ckpt_dir.parent.parent / "config.yaml"
    if config.is_file():
        copies.append((config, out.with_name(out.stem + ".config.yaml")))
    for artifact in state.get("artifacts", []):
        source = ckpt_dir / artifact
        # Checkpoint contents are not trusted: an artifact is a plain name inside the checkpoint.
        if Path(artifact).name != artifact or artifact in ("", ".", "..") or not source.exists():
            raise CheckpointError(f"checkpoint {ckpt_dir} lists the artifact {artifact!r}, which is not a file or "
                                  f"folder directly inside it")
        copies.append((source, out.parent / artifact))
    header, ordered = safetensors_layout(state_dict, metadata)
    needed = len(header) + sum(t.numel() * t.element_size() for _, t in ordered)
    needed += sum(disk_bytes(source) for source, _ in copies)
    previous = out.is_file()
    staged: list[tuple[Path, Path]] = []  # (temp, target)
    target, replaced = out, 0
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        require_space(out.parent, needed)
        staged.append((temp_path(out), out))
        write_safetensors(staged[-1][0], header, ordered)
        for source, target in copies:
            staged.append((temp_path(target), target))
            if source.is_dir():
                shutil.copytree(source, staged[-1][0])
            else:
                shutil.copyfile(source, staged[-1][0])
        for tmp, target in staged:  # renames: no space needed, nothing half-written is ever visible
            _replace(tmp, target)
            replaced += 1
    except OSError as err:
        full = no_space_reason(err, out.parent)  # while the temp files are there: a full disk shows
        for tmp, _ in staged:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        if full:  # named by the target: shutil's copies name their source, our writes a temp file
            why = f"{full} writing {target} ({space_report(out.parent, needed, reason=full)})"
        else:
            named = err.filename and not Path(err.filename).name.startswith(".")
            why = f"{err.filename if named else target}: {err.strerror or err}"
        kept = (f"{replaced} of its {len(staged)} files were replaced already: export again" if replaced else
                f"the previous export {out} is intact" if previous else "nothing was written")
        raise CheckpointError(f"could not export checkpoint {ckpt_dir} to {out}: {why}; {kept}") from err
    return out


def _replace(tmp: Path, target: Path) -> None:
    """Rename `tmp` over `target`; a folder replaces a folder (the old one renamed aside, then removed)."""
    if target.is_dir() and not target.is_symlink():
        aside = temp_path(target.with_name(target.name + ".old"))
        os.rename(target, aside)
        os.rename(tmp, target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, target)


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}
SAFETENSORS_DTYPES.update({getattr(torch, name): code for name, code in (("uint16", "U16"), ("uint32", "U32"),
                                                                         ("uint64", "U64")) if hasattr(torch, name)})


def safetensors_layout(tensors: dict[str, torch.Tensor],
                       metadata: dict[str, str]) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    """The header (8-byte length + JSON) of a safetensors file and its tensors in file order, both fixed by
    the contents alone: safetensors' own writer orders its metadata by a per-process hash seed."""
    ordered = sorted(((k, v.detach().cpu().contiguous()) for k, v in tensors.items()),
                     key=lambda kv: (-kv[1].element_size(), kv[0]))  # larger items first: every tensor aligned
    entries: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name, tensor in ordered:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}, which the exporter cannot write")
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, ordered


def write_safetensors(path: Path, header: bytes, ordered: list[tuple[str, torch.Tensor]]) -> None:
    """Write (and fsync) a safetensors file from `safetensors_layout`'s header and tensors, one at a time
    (their bytes as this little-endian machine holds them, as safetensors expects)."""
    with open(path, "wb") as f:
        f.write(header)
        for _, tensor in ordered:
            if tensor.numel():
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def read_task_stats(directory: Path) -> dict:
    """The task statistics saved beside a checkpoint's or an export's weights (`TaskData.stats`)."""
    path = Path(directory) / TASK_STATS
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {TASK_STATS} (the task statistics the model is built from); "
                              f"it was written by an older version: export the run again")
    return json.loads(path.read_text())


def load_exported(path: str | Path) -> tuple[torch.nn.Module, object]:
    """Rebuild the task's model from an export (weights + config) on one device, no DeepSpeed."""
    import yaml

    from trainer.config import config_from_dict
    from trainer.registry import get_task

    path = Path(path)
    cfg = config_from_dict(yaml.safe_load(path.with_name(path.stem + ".config.yaml").read_text()))
    task = get_task(cfg.task.name)(cfg.task, seed=cfg.run.seed)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        embedded = (f.metadata() or {}).get("task_stats")
    stats = json.loads(embedded) if embedded else read_task_stats(path.parent)
    task.attach_stats(stats)
    model = task.build_model(stats)
    model.load_state_dict(load_file(path), strict=True)
    return model, cfg

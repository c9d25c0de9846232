"""Consolidate a checkpoint of any backend into one fp32 safetensors file loadable without DeepSpeed."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer.core.checkpoint import STATE, TASK_STATS, CheckpointError, resolve_checkpoint, verify_checkpoint


def load_model_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 model state dict from an accelerate checkpoint (plain, sharded, DeepSpeed or FSDP)."""
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / "model.safetensors").is_file():
        return load_file(ckpt_dir / "model.safetensors")
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(ckpt_dir / shard).items()}
    if (ckpt_dir / "pytorch_model").is_dir():
        # ZeRO-1/2/3: merge the per-rank fp32 partitions (any stage) on one CPU process.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        from trainer.core.safe_load import weights_only_loading

        with weights_only_loading():  # DeepSpeed itself would unpickle with weights_only=False
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag="pytorch_model")
    fsdp = sorted(ckpt_dir.glob("pytorch_model_fsdp_*"))
    if fsdp:
        from accelerate.utils import merge_fsdp_weights

        with tempfile.TemporaryDirectory() as tmp:
            merge_fsdp_weights(str(fsdp[0]), tmp, safe_serialization=True)
            return load_model_weights(Path(tmp))
    raise CheckpointError(f"checkpoint {ckpt_dir} holds no model weights this exporter knows "
                          f"(model.safetensors, pytorch_model/ or pytorch_model_fsdp_*/)")


def consolidated_weights(run_dir: str | Path, checkpoint: str = "latest",
                         weights: str = "auto") -> tuple[dict[str, torch.Tensor], Path]:
    """Full fp32 state dict of a run's checkpoint (EMA parameters when kept, unless weights='model')."""
    run_dir = Path(run_dir)
    named = checkpoint in ("latest", "best")
    ckpt_dir = resolve_checkpoint(run_dir if named else checkpoint, checkpoint if named else "latest")
    verify_checkpoint(ckpt_dir)
    ema_file = ckpt_dir / "ema.safetensors"
    if weights == "ema" and not ema_file.is_file():
        raise CheckpointError(f"checkpoint {ckpt_dir} has no EMA weights (train.ema_decay was 0)")
    state_dict = load_model_weights(ckpt_dir)
    if weights != "model" and ema_file.is_file():
        # The EMA covers the parameters; buffers (e.g. norm statistics) come from the model.
        state_dict.update(load_file(ema_file))
    return {k: v.float().contiguous() if v.is_floating_point() else v.contiguous()
            for k, v in state_dict.items()}, ckpt_dir


def export_run(run_dir: str | Path, out: str | Path | None = None, checkpoint: str = "latest",
               weights: str = "auto") -> Path:
    """Write RUN's weights (EMA when kept, unless weights='model') as fp32 safetensors plus its config."""
    run_dir = Path(run_dir)
    state_dict, ckpt_dir = consolidated_weights(run_dir, checkpoint, weights)
    state = json.loads((ckpt_dir / STATE).read_text())
    step = state.get("step")
    out = Path(out) if out else run_dir / "export" / "model.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    used_ema = weights != "model" and (ckpt_dir / "ema.safetensors").is_file()
    # The statistics the model is built from travel inside the file too: another export into the same
    # folder may replace the task_stats.json beside it.
    stats_text = (ckpt_dir / TASK_STATS).read_text() if (ckpt_dir / TASK_STATS).is_file() else "{}"
    save_file(state_dict, str(out), metadata={"checkpoint": str(ckpt_dir), "step": str(step),
                                              "weights": "ema" if used_ema else "model", "task_stats": stats_text})
    config = ckpt_dir.parent.parent / "config.yaml"
    if config.is_file():
        shutil.copyfile(config, out.with_name(out.stem + ".config.yaml"))
    for artifact in state.get("artifacts", []):  # what the manifest lists (task_stats.json, Task.save_artifacts)
        source = ckpt_dir / artifact
        # Checkpoint contents are not trusted: an artifact is a plain name inside the checkpoint.
        if Path(artifact).name != artifact or artifact in ("", ".", "..") or not source.exists():
            raise CheckpointError(f"checkpoint {ckpt_dir} lists the artifact {artifact!r}, which is not a file or "
                                  f"folder directly inside it")
        if source.is_dir():
            shutil.copytree(source, out.parent / artifact, dirs_exist_ok=True)
        else:
            shutil.copyfile(source, out.parent / artifact)
    return out


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

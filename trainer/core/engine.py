"""What one optimizer step does differently under each backend, behind one small interface.

The loop calls `engine.backward(share)` for each micro-batch and `engine.step()` once per optimizer
step, and reads `engine.check_skips(step)` and `engine.logged_grad_norm(norm)` at logging steps. Three
engines cover every launch:

- `TorchEngine`, plain PyTorch (one process, DDP on CPU or GPU): backward, `clip_grad_norm_`, the
  torch optimizer's step; accelerate's wrappers are bypassed where they would only forward the call
  (their per-step Python work is measurable on small models: BENCHMARKS.md, overhead).
- `TorchEngine` through accelerate (FSDP, or an fp16 GradScaler): `accelerator.backward`, its
  `clip_grad_norm_` (which unscales) and the wrapped optimizer (which skips overflowing steps).
- `DeepSpeedEngine`: the DeepSpeed engine scales, clips and steps inside `accelerator.backward`; skipped
  steps are its own counter, the gradient norm its `get_global_grad_norm()`.

Each engine also owns its backend's checkpoint files (`save_checkpoint`, `load_checkpoint`, `load_universal`):
accelerate's `save_state`/`load_state` (plain, DDP, DeepSpeed), its sharded DCP form under FSDP2
(`FSDPEngine`), and filling itself from the topology-free form of another layout's checkpoint
(checkpoint/convert.py). The backend is decided once, by `build_engine`.

Gradient scaling: the step's loss is the global weighted mean (each rank's share already divided by
the global units), but accelerate divides by the accumulation steps and DDP/ZeRO average over ranks,
so backward is given the share times what those undo.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from types import MethodType
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from trainer.config import Config, ConfigError
from trainer.core.adaptive_clip import AdaptiveClip
from trainer.core.checkpoint.writer import StagedFile
from trainer.core.step_guard import StepGuard, nonfinite_advice

logger = logging.getLogger("trainer")

_PLAIN_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def check_backend_supports(cfg: Config, distributed_type: DistributedType) -> None:
    """Refuse, before any data or model is built, what this backend cannot do."""
    t = cfg.train
    if distributed_type == DistributedType.DEEPSPEED and t.grad_clip_value > 0:
        # Often not the user's own setting (GEARS' presets clip by value, as GEARS does): say what to add.
        preset = f", or task preset '{cfg.task.preset}'" if getattr(cfg.task, "preset", "") else ""
        raise ConfigError(f"train.grad_clip_value={t.grad_clip_value:g} (from the command line, the config{preset}) is "
                          f"not supported under DeepSpeed, whose engine clips by norm only: add train.grad_clip_value=0 "
                          f"train.grad_clip_norm={t.grad_clip_value:g} (or another norm; a norm clip changes the steps)")
    if t.grad_clip_mode == "adaptive" and distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise ConfigError(f"train.grad_clip_mode=adaptive is supported in single-process, DDP and fp16 runs, not "
                          f"under {distributed_type.value} (its gradients are clipped by the backend or sharded): "
                          f"use train.grad_clip_mode=norm")
    if t.compile and distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise ConfigError(f"train.compile is supported in single-process and DDP runs, not under {distributed_type.value}")


class Engine:
    """The backend-specific part of a training step (see the module docstring)."""

    may_sample_in_eval = True
    """Whether every rank holds the whole model, so evaluation may draw samples from it."""
    zero_stage = 0
    """The DeepSpeed ZeRO stage (0: not DeepSpeed)."""
    guard: StepGuard
    adaptive_clip: AdaptiveClip | None = None
    """With train.grad_clip_mode=adaptive: the queue of recent norms (a checkpoint part)."""

    def __init__(self, accelerator: Accelerator, model: Any, optimizer: Any, cfg: Config,
                 grad_accum_steps: int | None = None):
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.world = accelerator.num_processes
        self.accum = cfg.train.grad_accum_steps if grad_accum_steps is None else grad_accum_steps
        """Micro-batches per optimizer step: the run plan's (default: the config's)."""

    def sampling_context(self) -> contextlib.AbstractContextManager:
        """Where evaluation draws samples from the unwrapped model (its methods, not only `forward`): as it is,
        since the weights are fp32 outside DeepSpeed."""
        return contextlib.nullcontext()

    def backward(self, share: torch.Tensor) -> None:
        """Backward of this micro-batch's share of the step's global mean loss."""
        raise NotImplementedError

    def step(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Clip, step the optimizer and clear the gradients; returns (global grad norm, 0./1. skipped flag),
        device tensors or None where the backend keeps them to itself."""
        raise NotImplementedError

    def check_skips(self, step: int) -> int:
        """Non-finite steps skipped since the last call (reads the device); raises NonFiniteLossError after
        too many in a row."""
        raise NotImplementedError

    def logged_grad_norm(self, norm: torch.Tensor | None) -> float | None:
        """The gradient norm to log for the last step (None: not finite or not known)."""
        return float(norm) if norm is not None else None

    def after_resume(self) -> None:
        """Called once the backend's checkpoint files are loaded (counters the backend restored are not new events)."""

    # ------------------------------------------------------------------ the backend's checkpoint files
    checks_same_model = True
    """Whether a checkpoint of this backend's own layout is checked against the model before its loader runs
    (DeepSpeed's loader reads only its own files, whose shapes it checks itself)."""

    def checkpoint_layout(self) -> dict[str, Any]:
        """What trainer_state.json records of how the backend wrote its files (beyond backend and world size)."""
        return {}

    def save_checkpoint(self, directory: Path) -> None:
        """Write the model, optimizer and every rank's RNG in the backend's own files (every rank)."""
        self.accelerator.save_state(str(directory), safe_serialization=True)

    def can_stage_checkpoint(self) -> bool:
        """Whether `stage_checkpoint` can hand the backend's files over (not where each rank writes its shards)."""
        return False

    def stage_checkpoint(self) -> list[StagedFile]:
        """What `save_checkpoint` writes, as host data for the checkpoint writer process (this rank's share:
        writer.py); only where `can_stage_checkpoint`."""
        raise NotImplementedError(f"{type(self).__name__} writes its checkpoint files itself")

    def load_checkpoint(self, path: Path, saved: dict[str, Any], param_names: list[list[str]]) -> None:
        """Read a checkpoint this backend's own loader can read (checkpoint/convert.py: `needs_conversion`)."""
        from trainer.core.checkpoint.safe_load import weights_only_loading

        # accelerate's safetensors save keeps one of the tensors it takes for shared, and takes every empty one
        # for shared (e3nn's weightless tensor products), which safetensors' loader then misses: such a model is
        # loaded non-strictly, its names and shapes checked before (convert.check_same_model) but for the empties
        empties = self.checks_same_model and any(t.numel() == 0 for t in self.unwrapped.state_dict().values())
        # DeepSpeed unpickles its own files with weights_only=False, DCP its metadata with pickle
        with weights_only_loading():
            self.accelerator.load_state(str(path), **({"strict": False} if empties else {}))

    def load_universal(self, folder: Path, saved: dict[str, Any], param_names: list[list[str]]) -> None:
        """Fill the model and optimizer from the topology-free form in `folder` (another layout's checkpoint)."""
        from trainer.core.checkpoint.convert import load_into_torch

        load_into_torch(folder, self.unwrapped, self.torch_optimizer, param_names, sharded=self.sharded)

    sharded = False
    """Whether the parameters are FSDP2's sharded DTensors (whole tensors are then loaded shard by shard)."""

    @property
    def unwrapped(self) -> torch.nn.Module:
        from trainer.core.distributed import unwrap_model

        return unwrap_model(self.accelerator, self.model)

    # ------------------------------------------------------------------ how a rank holds the parameters (ema.py)
    def local_tensor(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The part of `param` this rank owns (here the whole tensor)."""
        return param.data

    def full_tensor(self, param: torch.nn.Parameter, local: torch.Tensor, gather: Any) -> torch.Tensor:
        """The whole tensor of `param`'s shape from this rank's `local` part (a collective where it is sharded:
        `gather` concatenates a tensor from all ranks). Where nothing is sharded it is `local` itself, read by the
        checkpoint before the next update: no copy."""
        return local

    def local_part(self, param: torch.nn.Parameter, full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's part of the whole tensor `full`, laid out as `local` (no collective)."""
        return full

    def reshard(self, model: torch.nn.Module) -> None:
        """Make the model's parameters those whose local parts `local_tensor` gives (nothing to do here)."""


class TorchEngine(Engine):
    """Plain PyTorch and DDP (FSDP2: `FSDPEngine`), with or without an fp16 GradScaler (see the module docstring)."""

    def __init__(self, accelerator: Accelerator, model: Any, optimizer: Any, cfg: Config,
                 grad_accum_steps: int | None = None):
        super().__init__(accelerator, model, optimizer, cfg, grad_accum_steps)
        t = cfg.train
        self.plain = accelerator.scaler is None and accelerator.distributed_type in _PLAIN_TYPES
        self.torch_optimizer = optimizer.optimizer  # accelerate's wrapper holds the torch optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.max_norm = t.grad_clip_norm if t.grad_clip_norm > 0 else math.inf  # 0: no clipping, norm still logged
        self.clip_value = t.grad_clip_value  # > 0: then every component is clipped to [-clip_value, clip_value]
        if t.grad_clip_mode == "adaptive":  # the norm is measured unclipped, then scaled to the queue's limit
            self.max_norm = math.inf
            self.adaptive_clip = AdaptiveClip(t.adaptive_clip_history, t.adaptive_clip_initial,
                                              getattr(accelerator, "device", "cpu"))
        # The GradScaler owns found_inf and skips by itself; an fp16 loss scale overflows on purpose now and then.
        self.guard = StepGuard(None if accelerator.scaler is not None else self.torch_optimizer,
                               active=t.skip_nonfinite, max_in_row=t.max_nonfinite_in_row,
                               may_abort=t.mixed_precision != "fp16",
                               advice=nonfinite_advice(_peak_lr(optimizer), t.grad_clip_norm),
                               on_host=getattr(getattr(accelerator, "device", None), "type", None) == "cpu")

    def backward(self, share: torch.Tensor) -> None:
        seed = self.guard.backward_seed(share)
        if self.plain:
            (share * self.world if self.world > 1 else share).backward(seed)
        else:
            self.accelerator.backward(share * (self.world * self.accum), **({} if seed is None else {"gradient": seed}))

    def step(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # After the last backward: gradients are synchronised, the norm is global.
        if self.plain:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        else:
            norm = self.accelerator.clip_grad_norm_(self.params, self.max_norm)
        norm = norm.detach()
        if hasattr(norm, "full_tensor"):  # FSDP2: the norm of sharded gradients is a (replicated) DTensor
            norm = norm.full_tensor()
        if self.adaptive_clip is not None:  # the gradients are unscaled now (accelerate did it for the norm)
            self.adaptive_clip.clip_([p.grad for p in self.params if p.grad is not None], norm)
        if self.clip_value > 0:
            torch.nn.utils.clip_grad_value_(self.params, self.clip_value, foreach=True)
        skipped = self.guard.flag(norm)
        optimizer = self.torch_optimizer if self.plain else self.optimizer
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm, skipped

    def check_skips(self, step: int) -> int:
        new, longest = self.guard.read()
        self.guard.check(longest, step)
        return new

    def can_stage_checkpoint(self) -> bool:
        """The plain and DDP layouts, where save_state writes nothing beyond model, optimizer and RNG (no
        GradScaler, registered schedulers, objects or hooks, sampler or stateful loader state)."""
        return self.plain and _holds_only_model_and_optimizer(self.accelerator)

    def stage_checkpoint(self) -> list[StagedFile]:
        """accelerate's `save_state` files: the model (main process), the optimizer (main process) and this rank's
        RNG, in the same formats."""
        acc = self.accelerator
        from accelerate.utils.other import clean_state_dict_for_safetensors

        from trainer.core.checkpoint.rng import rng_file_states

        files = [StagedFile(f"random_states_{acc.process_index}.pkl", "torch", rng_file_states(acc))]
        if acc.is_main_process:
            state = clean_state_dict_for_safetensors(acc.get_state_dict(acc._models[0], unwrap=False))  # as save_state
            files += [StagedFile("model.safetensors", "safetensors", state, metadata={"format": "pt"}),
                      StagedFile("optimizer.bin", "torch", self.optimizer.state_dict())]
        return files


def _holds_only_model_and_optimizer(acc: Accelerator) -> bool:
    """Whether accelerate's save_state would write one model, one optimizer and the RNG files, nothing else."""
    from accelerate.data_loader import IterableDatasetShard

    loaders_saved = any(isinstance(getattr(dl, "dataset", None), IterableDatasetShard)
                        or getattr(dl, "use_stateful_dataloader", False) for dl in acc._dataloaders)
    return (getattr(acc.device, "type", "cpu") in ("cpu", "cuda") and len(acc._models) == 1
            and len(acc._optimizers) == 1 and not acc._schedulers and not acc._custom_objects
            and not acc._save_model_state_pre_hook and not loaders_saved)


class FSDPEngine(TorchEngine):
    """FSDP2 (`fully_shard`): a TorchEngine whose parameters are sharded DTensors (each rank holds a shard of
    each) and whose checkpoints are accelerate's sharded form (DCP)."""

    may_sample_in_eval = False
    sharded = True

    def __init__(self, accelerator: Accelerator, model: Any, optimizer: Any, cfg: Config,
                 grad_accum_steps: int | None = None):
        log_shards(model, accelerator)
        super().__init__(accelerator, model, optimizer, cfg, grad_accum_steps)

    def local_tensor(self, param: torch.nn.Parameter) -> torch.Tensor:
        return param.data.to_local()  # the shard, a view of the parameter's storage

    def full_tensor(self, param: torch.nn.Parameter, local: torch.Tensor, gather: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        # the shard laid out as the parameter's, then gathered whole
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride()).full_tensor().clone()

    def local_part(self, param: torch.nn.Parameter, full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(local.device), param.device_mesh, param.placements,
                                 src_data_rank=None).to_local()  # each rank cuts its own: no collective

    def reshard(self, model: torch.nn.Module) -> None:
        """FSDP2 leaves the root's parameters whole after a forward without backward (an evaluation): shard them
        again, so that the model's parameters are the DTensors whose shards the EMA follows."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def checkpoint_layout(self) -> dict[str, Any]:
        from trainer.core.checkpoint.convert import SHARDED

        return {SHARDED: True}

    def _sharded_state_dicts(self) -> None:
        """Save and load accelerate's sharded form (DCP), whatever the accelerate config's fsdp_state_dict_type:
        FULL_STATE_DICT would gather the whole state onto one process and pickle it."""
        plugin = self.accelerator.state.fsdp_plugin
        if plugin.state_dict_type is None or plugin.state_dict_type.name != "SHARDED_STATE_DICT":
            plugin.state_dict_config = plugin.optim_state_dict_config = None  # the sharded defaults
            plugin.set_state_dict_type("SHARDED_STATE_DICT")

    def save_checkpoint(self, directory: Path) -> None:
        # Every rank writes its own shards with torch.distributed.checkpoint (nothing is gathered); another layout
        # converts them on demand at resume (checkpoint/convert.py).
        self._sharded_state_dicts()
        super().save_checkpoint(directory)

    def load_checkpoint(self, path: Path, saved: dict[str, Any], param_names: list[list[str]]) -> None:
        from trainer.core.checkpoint.convert import WEIGHTS, load_torch_files

        if (path / WEIGHTS).is_file():  # a plain or DDP checkpoint's whole tensors: each rank takes its shards
            load_torch_files(path, self.unwrapped, self.torch_optimizer, saved.get("param_names") or param_names,
                             sharded=True)
            return
        self._sharded_state_dicts()  # DCP's shards, resharded to this world size by DCP
        super().load_checkpoint(path, saved, param_names)


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO-1/2/3: its engine scales, clips, steps and skips overflowing steps itself."""

    def __init__(self, accelerator: Accelerator, model: Any, optimizer: Any, cfg: Config,
                 grad_accum_steps: int | None = None):
        super().__init__(accelerator, model, optimizer, cfg, grad_accum_steps)
        plugin = accelerator.state.deepspeed_plugin
        self.zero_stage = int(plugin.zero_stage) if plugin is not None else 0
        # the run plan's global batch, as filled into DeepSpeed's config (the config's own may differ)
        planned = plugin.deepspeed_config.get("train_batch_size") if plugin is not None else None
        self.global_batch = planned if isinstance(planned, int) else \
            cfg.train.per_device_batch_size * self.accum * self.world
        self.may_sample_in_eval = self.zero_stage < 3  # ZeRO-3 partitions the weights themselves
        t = cfg.train
        self.guard = StepGuard(None, active=False, max_in_row=t.max_nonfinite_in_row,
                               may_abort=t.mixed_precision != "fp16",
                               advice=nonfinite_advice(_peak_lr(optimizer), t.grad_clip_norm))
        self._engine_skipped = 0  # the engine's cumulative counter at the last read
        # DeepSpeed's fp16/bf16 modes hold the module's weights in that dtype and cast no input, so the batch's
        # floats and the task's fp32 draws (SampleRandom) would meet half weights: every float input must be cast.
        # HF Trainer casts the batch alone; a task computes more inputs than that, so the module's
        # forward autocasts, as accelerate's prepare does for native AMP. Inside its own forward the DeepSpeed
        # engine turns an outer CUDA autocast off: hence the module's forward, not a context around the loss.
        self.half = (torch.float16 if model.fp16_enabled() else torch.bfloat16 if model.bfloat16_enabled()
                     else None)
        if self.half is not None:
            _autocast_forward(model.module, accelerator.device.type, self.half)
            for module in model.module.modules():
                if type(module) in _BATCH_NORMS:
                    module.forward = MethodType(_batch_norm_with_fp32_affine, module)

    def sampling_context(self) -> contextlib.AbstractContextManager:
        """Autocast under DeepSpeed's fp16/bf16: sampling calls the module's own methods with fp32 inputs."""
        if self.half is None:
            return contextlib.nullcontext()
        return torch.autocast(self.accelerator.device.type, dtype=self.half)

    def backward(self, share: torch.Tensor) -> None:
        self.accelerator.backward(share * (self.world * self.accum))

    def step(self) -> tuple[None, None]:
        self.optimizer.step()  # the engine stepped inside backward at the accumulation boundary
        self.optimizer.zero_grad(set_to_none=True)
        return None, None

    def check_skips(self, step: int) -> int:
        total = int(getattr(self.model, "skipped_steps", 0))
        new, self._engine_skipped = total - self._engine_skipped, total
        self.guard.check(self.guard.count_runs([1.0] * new or [0.0]), step)
        return new

    def logged_grad_norm(self, norm: torch.Tensor | None) -> float | None:
        value = self.model.get_global_grad_norm()  # None or inf after an overflow
        value = float(value) if value is not None else None
        return value if value is not None and math.isfinite(value) else None

    def after_resume(self) -> None:
        self._engine_skipped = int(getattr(self.model, "skipped_steps", 0))

    # ZeRO-3 partitions each parameter: a rank holds a flat partition (`param.ds_tensor`), zero-padded at the end.
    def local_tensor(self, param: torch.nn.Parameter) -> torch.Tensor:
        return param.ds_tensor if self.zero_stage == 3 else param.data

    def full_tensor(self, param: torch.nn.Parameter, local: torch.Tensor, gather: Any) -> torch.Tensor:
        if self.zero_stage < 3:
            return local
        return gather(local.flatten())[: param.ds_numel].view(param.ds_shape).clone()  # partitions in rank order

    def local_part(self, param: torch.nn.Parameter, full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
        if self.zero_stage < 3:
            return full
        size = local.numel()
        part = full.flatten()[rank * size:(rank + 1) * size]
        out = torch.zeros(size)
        out[: part.numel()] = part
        return out.view_as(local)

    checks_same_model = False

    def load_universal(self, folder: Path, saved: dict[str, Any], param_names: list[list[str]]) -> None:
        from trainer.core.checkpoint.convert import load_into_deepspeed

        load_into_deepspeed(folder, self.model, param_names)
        step = int(saved.get("step", 0))  # the engine's own counters, as its loader sets them
        self.model.global_steps = step
        self.model.global_samples = step * self.global_batch


def _autocast_forward(module: torch.nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Make `module.forward` run under autocast to `dtype` and return fp32 floats, as accelerate's `prepare` does
    for native AMP (losses computed after the forward then see what they see without DeepSpeed)."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = module.forward
    function = getattr(forward, "__func__", forward)  # a bound method, or a function set on the instance
    wrapped = convert_outputs_to_fp32(torch.autocast(device_type, dtype=dtype)(function))
    module.forward = MethodType(wrapped, module) if hasattr(forward, "__func__") else wrapped


_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


def _batch_norm_with_fp32_affine(self: torch.nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """`_BatchNorm.forward` with its weight and bias taken in fp32: DeepSpeed casts parameters to half but keeps
    buffers, so a half weight met fp32 running statistics ("expected scalar type BFloat16 but found Float").
    batch_norm takes a half input with fp32 affine and statistics (as under native AMP, forward and backward),
    and the running statistics keep their fp32 precision."""
    self._check_input_dim(x)
    factor = 0.0 if self.momentum is None else self.momentum
    if self.training and self.track_running_stats and self.num_batches_tracked is not None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
    use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
    keep = not self.training or self.track_running_stats
    weight = self.weight.float() if self.weight is not None else None
    bias = self.bias.float() if self.bias is not None else None
    return torch.nn.functional.batch_norm(x, self.running_mean if keep else None, self.running_var if keep else None,
                                          weight, bias, use_batch_stats, factor, self.eps)


def log_shards(model: Any, accelerator: Accelerator) -> None:
    """One line (main process) saying how FSDP split the parameters: the values each rank holds (a collective)."""
    import torch.distributed as dist

    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    counts = [local]
    if accelerator.num_processes > 1:
        counts = [None] * accelerator.num_processes
        dist.all_gather_object(counts, local)
    if accelerator.is_main_process:
        logger.info("FSDP shards the model's %d parameter values over %d processes: %s per rank", total,
                    accelerator.num_processes, " + ".join(str(c) for c in counts))


def _peak_lr(optimizer: Any) -> float:
    group = optimizer.param_groups[0]
    return group.get("initial_lr", group["lr"])  # the schedule's base, not the warm-up's current value


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether `model` is sharded by FSDP2 (`fully_shard`): its parameters are DTensors, each rank holding a shard."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed support
        return False
    return isinstance(model, FSDPModule)


def build_engine(accelerator: Accelerator, model: Any, optimizer: Any, cfg: Config, grad_accum_steps: int) -> Engine:
    """The engine for this run's backend; `model` and `optimizer` as `accelerator.prepare` returned them,
    `grad_accum_steps` the run plan's."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return DeepSpeedEngine(accelerator, model, optimizer, cfg, grad_accum_steps)
    from trainer.core.distributed import unwrap_model

    if is_fsdp2(unwrap_model(accelerator, model)):
        return FSDPEngine(accelerator, model, optimizer, cfg, grad_accum_steps)
    return TorchEngine(accelerator, model, optimizer, cfg, grad_accum_steps)

"""Processes and backends: building the Accelerator, filling DeepSpeed configs, unwrapping models.

The same script runs under `python`, `accelerate launch`, `torchrun` and the `deepspeed`
launcher. The launch topology comes from the launcher's config file (accelerate yaml or
DeepSpeed json); this module only fills in what the trainer config owns ("auto" values) and
picks gloo when there is no GPU.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DeepSpeedPlugin, InitProcessGroupKwargs, PartialState
from accelerate.utils import DistributedType, GradientAccumulationPlugin, ProjectConfiguration, is_compiled_module

from trainer.config import Config, ConfigError
from trainer.core.deepspeed_ops import use_environment_op_cache
from trainer.core.run_lock import RunLockedError, acquire_run_lock, join_generation
from trainer.core.watchdog import guard_against_orphaning
from trainer.errors import CheckpointError
from trainer.task import CompilableModel

if TYPE_CHECKING:
    from trainer.core.batch_plan import BatchPlan

logger = logging.getLogger("trainer")


def load_deepspeed_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {err}") from None


def _deepspeed_config_from_accelerate_env() -> dict:
    """A DeepSpeed dict for an accelerate yaml that gives zero_stage etc. inline (no json file)."""
    env = os.environ
    stage = int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
    zero: dict[str, Any] = {"stage": stage}
    for kind in ("optimizer", "param"):
        device = env.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{kind.upper()}_DEVICE", "none")
        if device != "none" and not (kind == "param" and stage != 3):
            zero[f"offload_{kind}"] = {"device": device}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {"zero_optimization": zero, "zero_force_ds_cpu_optimizer": False}


def fill_deepspeed_config(ds: dict, cfg: Config, batch: BatchPlan | None = None) -> dict:
    """Replace DeepSpeed "auto" values by the trainer config's (batch, accumulation, clipping, lr, precision);
    the batch and accumulation are the run plan's `batch` (default: the config's, on WORLD_SIZE processes)."""
    ds = copy.deepcopy(ds)
    t = cfg.train
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device, accum = (t.per_device_batch_size, t.grad_accum_steps) if batch is None else \
        (batch.per_device_batch_size, batch.grad_accum_steps)
    values = {
        "train_micro_batch_size_per_gpu": per_device,
        "gradient_accumulation_steps": accum,
        "train_batch_size": per_device * accum * world,
        # DeepSpeed steps inside backward(), so it must do the clipping itself; 0 means off.
        "gradient_clipping": t.grad_clip_norm if t.grad_clip_norm > 0 else 0.0,
    }
    for key, value in values.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
        elif float(ds[key]) != float(value):
            raise ConfigError(f"DeepSpeed config sets {key}={ds[key]} but the trainer config implies {value}; "
                              f"write \"auto\" in the json so both agree")
    if str((ds.get("torch_autocast") or {}).get("enabled", False)).lower() == "true":
        # The trainer autocasts DeepSpeed's half modes itself (engine.py); DeepSpeed's own autocast over fp32
        # weights would be a second, unlogged precision setting (with bf16 on as well, two nested autocasts).
        raise ConfigError("DeepSpeed config enables torch_autocast: remove that section and set "
                          "train.mixed_precision=bf16 or fp16 (the json's bf16/fp16 \"auto\" follow it)")
    for key in ("bf16", "fp16"):
        section = ds.setdefault(key, {})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = t.mixed_precision == key
    if ds["bf16"]["enabled"] != (t.mixed_precision == "bf16") or ds["fp16"]["enabled"] != (t.mixed_precision == "fp16"):
        raise ConfigError(f"DeepSpeed config precision (bf16={ds['bf16']['enabled']}, fp16={ds['fp16']['enabled']}) "
                          f"contradicts train.mixed_precision={t.mixed_precision}; use \"auto\" in the json")
    _absorb_optimizer_sections(ds, cfg)
    zero = ds.setdefault("zero_optimization", {})
    for key in _HIDDEN_SIZE_KEYS:  # accelerate fills these from a transformers model.config: ours have none
        if zero.get(key) == "auto":
            del zero[key]  # DeepSpeed's own default
    if zero.get("stage") == 3 and t.ema_decay > 0:
        # The EMA lives on each rank's partition; a parameter kept whole ("persistent") is not read from it.
        if zero.get("stage3_param_persistence_threshold", 0) not in (0, "auto"):
            raise ConfigError("train.ema_decay > 0 under ZeRO-3 needs stage3_param_persistence_threshold: 0")
        zero["stage3_param_persistence_threshold"] = 0
    ds.setdefault("zero_force_ds_cpu_optimizer", False)
    ds.setdefault("steps_per_print", 10**9)
    return ds


_HIDDEN_SIZE_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")

# DeepSpeed optimizer and scheduler types (as the HF Trainer's ds_config.json examples write them) and
# the optim section's values they mean.
_DS_OPTIMIZERS = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}
_DS_SCHEDULERS = {"warmuplr": "constant_with_warmup", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}


def share_cores_among_local_processes() -> int | None:
    """Several processes on one node with OMP_NUM_THREADS unset (the `deepspeed` launcher leaves it unset unless
    --bind_cores_to_rank; torchrun and accelerate set it for several processes): each process's torch would start
    one thread per physical core and together they oversubscribe the cores (BENCHMARKS.md, "Threads per process
    under the `deepspeed` launcher on CPU"). Give each process its share of the physical cores it may run on
    instead; returns the threads set, None when nothing was changed."""
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    if local <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = min(usable, psutil.cpu_count(logical=False) or usable)  # torch's own default counts physical cores
    threads = max(1, cores // local)
    torch.set_num_threads(threads)
    if _is_first_rank():
        logger.info("OMP_NUM_THREADS is unset and %d processes share this node's %d cores: %d torch thread(s) per "
                    "process (set OMP_NUM_THREADS to choose)", local, cores, threads)
    return threads


def _is_first_rank() -> bool:
    """Which process speaks before the Accelerator (and `quiet_replica`) exists: the launcher's RANK."""
    return int(os.environ.get("RANK", "0")) == 0


def _absorb_optimizer_sections(ds: dict, cfg: Config) -> None:
    """Accept the `optimizer` / `scheduler` sections of a migrated (HF Trainer) DeepSpeed config when they
    say what the `optim` section says: every value "auto" or equal to the trainer config's. They are
    then removed (the trainer builds optimizer and schedule from `optim`, the same under every backend);
    a real contradiction is a ConfigError naming both values."""
    o, t = cfg.optim, cfg.train
    section = ds.pop("optimizer", None)
    if section is not None:
        kind = str(section.get("type", "auto"))
        if kind != "auto" and _DS_OPTIMIZERS.get(kind.lower()) != o.name:
            raise ConfigError(f"DeepSpeed config optimizer.type={kind} contradicts optim.name={o.name}; "
                              f"write \"auto\" or remove the optimizer section (the trainer builds it from optim)")
        _agree("optimizer.params", section.get("params", {}),
               {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
                "momentum": o.momentum, "torch_adam": None, "adam_w_mode": None, "bias_correction": None})
    section = ds.pop("scheduler", None)
    if section is not None:
        kind = str(section.get("type", "auto"))
        meant = _DS_SCHEDULERS.get(kind.lower()) if kind != "auto" else o.scheduler
        if meant is None:
            raise ConfigError(f"DeepSpeed config scheduler.type={kind} has no counterpart in optim.scheduler; "
                              f"remove the scheduler section and set optim.scheduler")
        if meant != o.scheduler and _is_first_rank():
            logger.warning("DeepSpeed config scheduler.type=%s means optim.scheduler=%s; this run uses "
                           "optim.scheduler=%s (the trainer's schedule, the same under every backend)",
                           kind, meant, o.scheduler)
        _agree("scheduler.params", section.get("params", {}),
               {"warmup_min_lr": 0.0, "warmup_max_lr": o.lr, "warmup_num_steps": o.warmup_steps,
                "total_num_steps": t.max_steps, "warmup_type": None, "cos_min_ratio": None})


def _agree(where: str, given: dict, implied: dict) -> None:
    for key, value in given.items():
        if value == "auto":
            continue
        if key not in implied:
            raise ConfigError(f"DeepSpeed config {where}.{key}={value} has no counterpart in the trainer config; "
                              f"remove it or write \"auto\"")
        want = implied[key]
        if want is None:  # a DeepSpeed implementation detail of its own optimizer/schedule: meaningless here
            continue
        same = ([float(v) for v in value] == [float(v) for v in want] if isinstance(want, list)
                else float(value) == float(want))
        if not same:
            raise ConfigError(f"DeepSpeed config sets {where}.{key}={value} but the trainer config implies {want}; "
                              f"write \"auto\" in the json so both agree")


def announce_deepspeed_cpu_op_build() -> None:
    """DeepSpeed on CPU compiles its shared-memory communication op on first use, silently, for a minute
    or two: say so once (main process) when it is not in torch's extension cache yet. `make setup` builds it,
    into this environment's own cache (deepspeed_ops.py), which every rank uses."""
    use_environment_op_cache()
    if not _is_first_rank():
        return
    try:
        from torch.utils.cpp_extension import _get_build_directory

        built = Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "deepspeed_shm_comm.so"
    except Exception:  # noqa: BLE001 - a private helper of torch: if it moved, say nothing rather than fail
        return
    if not built.is_file():
        logger.warning("DeepSpeed compiles its CPU communication op once (about 1-2 minutes on 2 cores; "
                       "cached in %s for later runs)", built.parent)


def quiet_deprecated_collective_warnings() -> None:
    """torch 2.13 deprecates the collectives DeepSpeed's ZeRO calls (`all_gather_into_tensor`,
    `reduce_scatter_tensor`) with a FutureWarning printed again on every call, on every rank, so that it drowns a
    run's own lines. The user cannot act on it (the calls are DeepSpeed's), so it is hidden."""
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", message=f"`torch.distributed.{name}` is deprecated", category=FutureWarning)


def launched_with_deepspeed(deepspeed_config: str | None) -> bool:
    return bool(deepspeed_config) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def build_accelerator(cfg: Config, batch: BatchPlan, deepspeed_config: str | None = None) -> Accelerator:
    """The Accelerator for this launch: DeepSpeed if a json or a DEEPSPEED yaml says so, else DDP/FSDP/single;
    its accumulation (and a DeepSpeed json's batch "auto" values) are the run plan's `batch`.

    Also the process-level protections every Trainer gets before it builds data and model: a rank
    started by a launcher dies with it (watchdog.py), and the output directory is claimed (run_lock.py).
    """
    # First, so that a rank whose launcher dies while it waits in the rendezvous does not linger either.
    guard_against_orphaning()
    share_cores_among_local_processes()
    use_cuda = torch.cuda.is_available()
    if cfg.train.mixed_precision == "fp16" and not use_cuda:
        # accelerate would silently train in fp32: refuse instead.
        raise ConfigError("train.mixed_precision=fp16 needs a CUDA GPU; on CPU use bf16 or no")
    kwargs: dict[str, Any] = dict(
        mixed_precision=cfg.train.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=batch.grad_accum_steps, sync_with_dataloader=False),
        # The trainer steps the schedule itself, once per optimizer step, whatever the world size.
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(even_batches=True),
        project_config=ProjectConfiguration(project_dir=cfg.run.output_dir,
                                            logging_dir=str(Path(cfg.run.output_dir) / "tb")),
        log_with=(["tensorboard"] if cfg.log.tensorboard else []) + list(cfg.log.trackers) or None,
    )
    group: dict[str, Any] = {}  # the process group's settings
    if cfg.run.collective_timeout_s > 0:
        group["timeout"] = datetime.timedelta(seconds=cfg.run.collective_timeout_s)
    if launched_with_deepspeed(deepspeed_config):
        env_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        source = deepspeed_config or env_file
        ds = load_deepspeed_config(source) if source else _deepspeed_config_from_accelerate_env()
        ds = fill_deepspeed_config(ds, cfg, batch)
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds)
        quiet_deprecated_collective_warnings()
        if not use_cuda:
            # cpu=True would silently drop DeepSpeed; without an explicit backend each rank runs alone.
            group["backend"] = "gloo"
            announce_deepspeed_cpu_op_build()
    else:
        # A MULTI_GPU (or FSDP) yaml on a machine without GPUs becomes MULTI_CPU over gloo this way.
        kwargs["cpu"] = not use_cuda
    if group:
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(**group)]
    accelerator = Accelerator(**kwargs)
    if not use_cuda and accelerator.num_processes > 1 and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        enable_cpu_fsdp(accelerator)
    if not accelerator.is_main_process:
        quiet_replica()
    claim_output_dir(accelerator, cfg.run.output_dir)
    return accelerator


def enable_cpu_fsdp(accelerator: Accelerator) -> None:
    """FSDP2 on CPU processes over gloo, through accelerate's own FSDP2 path.

    accelerate picks FSDP for GPU process groups only and makes an FSDP yaml on a CPU-only machine MULTI_CPU.
    torch's FSDP2 (`fully_shard`) shards over a gloo mesh as well, so the Accelerator built for MULTI_CPU is
    switched to FSDP (version 2) with the yaml's plugin: `prepare` then shards the model with `fully_shard`
    and re-points the optimizer at the sharded parameters, `backward` and `clip_grad_norm_` take their FSDP2
    branches (checkpoints: accelerate's sharded FSDP2 save, converted on demand by checkpoint/convert.py). Collectives (`gather`,
    `reduce`, barriers) take the same torch.distributed path under FSDP as under MULTI_CPU, on the CPU device
    and the gloo group already initialised."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the yaml (accelerate launch exports it as FSDP_* variables)
    if plugin.fsdp_version != 2:
        raise ConfigError("FSDP on CPU needs fsdp_version: 2 in the accelerate config (torch's fully_shard; "
                          "FSDP1 runs on GPUs only)")
    if type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy":
        raise ConfigError("fsdp_offload_params: true means nothing on a CPU-only machine; set it to false")
    accelerator.state.fsdp_plugin = plugin
    # Both singletons: every later AcceleratorState() copies the process state's type over its own.
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP


def quiet_replica() -> None:
    """Every rank but the main one logs warnings and errors only and draws no `datasets` progress bars (as
    the HF Trainer's log_level_replica), so N processes print each message once; what is per rank by
    nature (a rank's own failure) is a warning or an error and still shows."""
    logging.getLogger("trainer").setLevel(logging.WARNING)
    from datasets.utils import logging as datasets_logging

    datasets_logging.disable_progress_bar()


def claim_output_dir(accelerator: Accelerator, output_dir: str | Path) -> None:
    """The main process takes the run directory's lock (released at the end of `fit`, or at exit); if
    a live run holds it, or the directory cannot be written, every rank raises the same error, so none
    of them goes on to build data and model. Every rank joins the lock's generation (run_lock.py)."""
    error, generation = None, 0
    if accelerator.is_main_process:
        try:
            generation = acquire_run_lock(output_dir).generation
        except RunLockedError as err:
            error = ("locked", str(err))
        except CheckpointError as err:  # an unreadable generation file beside the lock
            error = ("checkpoint", str(err))
        except OSError as err:  # an unwritable directory must not leave the others waiting
            where = err.filename or output_dir
            error = ("config", f"run.output_dir {output_dir} cannot be written ({where}: "
                               f"{err.strerror or err}); give the run a writable run.output_dir")
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        box = [(error, generation)]
        dist.broadcast_object_list(box, src=0)
        error, generation = box[0]
    if error is not None:
        kind, message = error
        raise {"locked": RunLockedError, "checkpoint": CheckpointError}.get(kind, ConfigError)(message)
    join_generation(output_dir, generation)


_WRAPPERS: tuple[type, ...] | None = None


def unwrap_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """`accelerator.unwrap_model(model)`, without importing DeepSpeed when the run does not use it.

    accelerate's version imports deepspeed whenever it is installed (to test for its engine), which
    prints DeepSpeed's "Setting accelerator to CPU" warning in plain and DDP runs."""
    global _WRAPPERS
    if accelerator.distributed_type == DistributedType.DEEPSPEED or "deepspeed" in sys.modules:
        return accelerator.unwrap_model(model)
    if _WRAPPERS is None:
        wrappers: list[type] = [torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel]
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel

            wrappers.append(FullyShardedDataParallel)
        except ImportError:  # torch without distributed support
            pass
        _WRAPPERS = tuple(wrappers)
    compiled = model if is_compiled_module(model) else None
    inner = model._orig_mod if compiled is not None else model
    while isinstance(inner, _WRAPPERS):
        inner = inner.module
    if compiled is None:
        return inner
    compiled._orig_mod = inner  # what accelerate returns with keep_torch_compile=True
    return compiled


def compile_model(model: torch.nn.Module) -> None:
    """`train.compile`: let the model torch.compile its own hot regions (`model.compile_regions()`), in place.

    Regions rather than the whole module, as torchtitan compiles per block: a model knows which of its parts
    trace cleanly (sparse graph products, for one, do not), and parameter names stay unchanged. A model without
    `compile_regions` is refused rather than wrapped whole, since `nn.Module.compile()` binds the compiled
    forward to this instance and a deep copy (the EMA) would call back into it. The backends that cannot run it are
    refused before (engine.py: `check_backend_supports`)."""
    if not isinstance(model, CompilableModel):
        raise ConfigError(f"train.compile: the model {type(model).__name__} declares no compile_regions(); "
                          "set train.compile=false")
    model.compile_regions()


def scale_factor(mode: str, world_size: int, base_world_size: int) -> float:
    """LR/warm-up multiplier for `world_size` processes relative to `base_world_size`."""
    ratio = world_size / base_world_size
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[mode]


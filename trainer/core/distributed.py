"""Everything about processes and backends: building the Accelerator, DeepSpeed configs, signals.

The same script runs under `python`, `accelerate launch`, `torchrun` and the `deepspeed`
launcher. The launch topology comes from the launcher's config file (accelerate yaml or
DeepSpeed json); this module only fills in what the trainer config owns ("auto" values) and
picks gloo when there is no GPU.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import signal
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DeepSpeedPlugin, InitProcessGroupKwargs
from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration

from trainer.config import Config, ConfigError
from trainer.core.run_lock import RunLockedError, acquire_run_lock
from trainer.core.watchdog import guard_against_orphaning

logger = logging.getLogger("trainer")

PREEMPTED_EXIT_CODE = 75
"""Exit status after a SIGTERM/SIGUSR1 checkpoint (EX_TEMPFAIL: try again, i.e. requeue)."""


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


def fill_deepspeed_config(ds: dict, cfg: Config) -> dict:
    """Replace DeepSpeed "auto" values by the trainer config's (batch, accumulation, clipping, lr, precision)."""
    ds = copy.deepcopy(ds)
    t = cfg.train
    world = int(os.environ.get("WORLD_SIZE", "1"))
    values = {
        "train_micro_batch_size_per_gpu": t.per_device_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": t.per_device_batch_size * t.grad_accum_steps * world,
        # DeepSpeed steps inside backward(), so it must do the clipping itself; 0 means off.
        "gradient_clipping": t.grad_clip_norm if t.grad_clip_norm > 0 else 0.0,
    }
    for key, value in values.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
        elif float(ds[key]) != float(value):
            raise ConfigError(f"DeepSpeed config sets {key}={ds[key]} but the trainer config implies {value}; "
                              f"write \"auto\" in the json so both agree")
    for key in ("bf16", "fp16"):
        section = ds.setdefault(key, {})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = t.mixed_precision == key
    if ds["bf16"]["enabled"] != (t.mixed_precision == "bf16") or ds["fp16"]["enabled"] != (t.mixed_precision == "fp16"):
        raise ConfigError(f"DeepSpeed config precision (bf16={ds['bf16']['enabled']}, fp16={ds['fp16']['enabled']}) "
                          f"contradicts train.mixed_precision={t.mixed_precision}; use \"auto\" in the json")
    if "optimizer" in ds or "scheduler" in ds:
        raise ConfigError("DeepSpeed config must not define 'optimizer' or 'scheduler': the trainer builds them "
                          "from the optim section (one schedule under every backend)")
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("stage") == 3 and t.ema_decay > 0:
        # The EMA lives on each rank's partition; a parameter kept whole ("persistent") is not read from it.
        if zero.get("stage3_param_persistence_threshold", 0) not in (0, "auto"):
            raise ConfigError("train.ema_decay > 0 under ZeRO-3 needs stage3_param_persistence_threshold: 0")
        zero["stage3_param_persistence_threshold"] = 0
    ds.setdefault("zero_force_ds_cpu_optimizer", False)
    ds.setdefault("steps_per_print", 10**9)
    return ds


def launched_with_deepspeed(deepspeed_config: str | None) -> bool:
    return bool(deepspeed_config) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def build_accelerator(cfg: Config, deepspeed_config: str | None = None) -> Accelerator:
    """The Accelerator for this launch: DeepSpeed if a json or a DEEPSPEED yaml says so, else DDP/FSDP/single.

    Also the process-level protections every Trainer gets before it builds data and model: a rank
    started by a launcher dies with it (watchdog.py), and the output directory is claimed (run_lock.py).
    """
    # First, so that a rank whose launcher dies while it waits in the rendezvous does not linger either.
    guard_against_orphaning()
    use_cuda = torch.cuda.is_available()
    if cfg.train.mixed_precision == "fp16" and not use_cuda:
        # accelerate would silently train in fp32: refuse instead.
        raise ConfigError("train.mixed_precision=fp16 needs a CUDA GPU; on CPU use bf16 or no")
    kwargs: dict[str, Any] = dict(
        mixed_precision=cfg.train.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.train.grad_accum_steps, sync_with_dataloader=False),
        # The trainer steps the schedule itself, once per optimizer step, whatever the world size.
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(even_batches=True),
        project_config=ProjectConfiguration(project_dir=cfg.run.output_dir,
                                            logging_dir=str(Path(cfg.run.output_dir) / "tb")),
        log_with=(["tensorboard"] if cfg.log.tensorboard else []) + list(cfg.log.trackers) or None,
    )
    if launched_with_deepspeed(deepspeed_config):
        env_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        source = deepspeed_config or env_file
        ds = load_deepspeed_config(source) if source else _deepspeed_config_from_accelerate_env()
        ds = fill_deepspeed_config(ds, cfg)
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds)
        if not use_cuda:
            # cpu=True would silently drop DeepSpeed; without an explicit backend each rank runs alone.
            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    else:
        if not use_cuda and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
            logger.warning("accelerate runs FSDP only on GPUs: on this CPU-only machine the FSDP config "
                           "trains as plain DDP over gloo (same results, no sharding)")
        # A MULTI_GPU (or FSDP) yaml on a machine without GPUs becomes MULTI_CPU over gloo this way.
        kwargs["cpu"] = not use_cuda
    accelerator = Accelerator(**kwargs)
    claim_output_dir(accelerator, cfg.run.output_dir)
    return accelerator


def claim_output_dir(accelerator: Accelerator, output_dir: str | Path) -> None:
    """The main process takes the run directory's lock (kept until it exits); if a live run holds it,
    every rank raises the same RunLockedError, so none of them goes on to build data and model."""
    error, failure = None, None
    if accelerator.is_main_process:
        try:
            acquire_run_lock(output_dir)
        except (RunLockedError, OSError) as err:  # an unwritable directory must not leave the others waiting
            error, failure = str(err), err
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if failure is not None:
        raise failure
    if error is not None:
        raise RunLockedError(error)


def scale_factor(mode: str, world_size: int, base_world_size: int) -> float:
    """LR/warm-up multiplier for `world_size` processes relative to `base_world_size`."""
    ratio = world_size / base_world_size
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[mode]


class PreemptionWatcher:
    """Turns SIGTERM/SIGUSR1 into a stop request that all ranks agree on at the same step.

    With several processes the local flags are OR-reduced over a gloo group, asynchronously: the
    reduction started at step k is read at step k+1, so no step waits on the device.
    """

    signals = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, world_size: int):
        self.requested = False
        self.received: str | None = None
        self._world_size = world_size
        self._pending = None
        self._flag = torch.zeros(1)
        self._group = None
        self._previous = {}
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave handlers alone
                pass
        if world_size > 1:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.requested = True
        self.received = signal.Signals(signum).name

    def should_stop(self) -> bool:
        if self._world_size == 1:
            return self.requested
        import torch.distributed as dist

        agreed = False
        if self._pending is not None:
            self._pending.wait()
            agreed = bool(self._flag.item() > 0)
        self._flag = torch.tensor([1.0 if self.requested else 0.0])
        self._pending = dist.all_reduce(self._flag, group=self._group, async_op=True)
        return agreed

    def close(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

"""Typed run configuration: dataclass sections, YAML file, dotted CLI overrides.

Precedence is CLI > YAML > task preset > dataclass defaults. Every field carries a
docstring (the string literal under it), which `trainer config-help` prints and the key tables
of docs/configuration.md are generated from. Unknown keys and wrong types are errors that name the key
and, for unknown keys, the closest valid names.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import inspect
import logging
import math
import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException
from omegaconf.nodes import StringNode

from trainer.atomic_io import atomic_write_text
from trainer.data.fetch import resolve_fetch
from trainer.errors import ConfigError, TrainerError
from trainer.registry import get_spec
from trainer.task import TaskConfig, TaskSpec

# `${fetch:NAME}` in a config: the local path of a registered public data set, downloaded with its checksum
# on first use (trainer/data/fetch.py; `trainer data list`).
OmegaConf.register_resolver("fetch", resolve_fetch, replace=True)

__all__ = ["Config", "ConfigError", "TaskConfig", "load_config"]

logger = logging.getLogger("trainer")




@dataclass
class RunConfig:
    output_dir: str = "runs/default"
    """Run directory: checkpoints, metrics.jsonl, TensorBoard logs and the resolved config.yaml."""
    seed: int = 0
    """Base seed; data order and each sample's loss noise depend on it alone; rank r seeds its RNG (dropout) with seed + r."""
    resume: str = "auto"
    """`auto` (continue from the latest good checkpoint in output_dir if any), `none` (start over; old
    checkpoints are moved aside), or a checkpoint path."""
    allow_inexact_resume: bool = False
    """Resume even when part of the saved state (a rank's RNG state) cannot be restored, with a warning;
    by default that is an error naming the file."""
    init_from: str = ""
    """Start from another run's weights (fine-tuning, `trainer align`): a run directory (its latest checkpoint)
    or a checkpoint folder. Loaded into the freshly built model before a resume, which then takes precedence;
    empty: the task's own initialisation."""
    init_weights: str = "auto"
    """Which weights of `init_from`: `auto` (its EMA weights when it kept an EMA), `ema` or `model`."""
    collective_timeout_s: float = 0.0
    """Seconds a collective may wait for its peers before it fails (0: torch's default, its `default_pg_timeout`
    or NCCL's own). An elastic run on GPUs sets it (e.g. 120, with TORCH_NCCL_ASYNC_ERROR_HANDLING=3) so a peer that hangs
    rather than dies becomes a restart of the worker group within that time."""


@dataclass
class DataConfig:
    num_workers: int = 0
    """DataLoader worker processes per rank (each seeded from run.seed, rank and worker id)."""
    mapped_pages_mb: int = 512
    """MiB of memory-mapped data-file pages (Arrow shards, raw columns) a data-loading process keeps resident
    before it drops them from its page tables (`trainer.data.mapped_pages`). They stay in the OS page cache, so a
    read of a dropped page costs a minor fault, not I/O; without the bound a pass over a large split grows each
    rank's RSS to the size of the files it touched. 0: never dropped."""
    pin_memory: bool = True
    """Pin host memory for faster host-to-GPU copies (ignored on CPU)."""
    shuffle: bool = True
    """Shuffle the training set each epoch (order is a function of run.seed and the epoch)."""
    batching: str = "fixed"
    """`fixed`: per_device_batch_size samples per rank; `balanced`: the same counts, but each global
    batch is split across ranks so their units (atoms, tokens; `Task.unit_sizes`) are even;
    `budget`: length-bucketed batches of at most `max_units_per_batch` units per rank."""
    max_units_per_batch: int = 0
    """Unit budget per rank and micro-batch for batching=budget (e.g. tokens or atoms)."""
    bucket_size: int = 0
    """batching=budget: samples sorted by size together (default 64 global batches' worth, estimated)."""
    shuffle_block: int = 0
    """Rows per block of the block-window shuffle; 0 = a full permutation of the samples. Set it (e.g. 1024-8192 rows,
    a few MB of the file) when the training set is memory-mapped from a shared filesystem (Lustre/GPFS) or a cold
    disk: every epoch then reads runs of consecutive rows instead of one random small read per sample. Samples are
    shuffled among `shuffle_window` blocks only, so a batch draws from fewer distinct regions of the file."""
    shuffle_window: int = 64
    """data.shuffle_block > 0: blocks (each taken whole, in a keyed random order) whose rows are shuffled together.
    More blocks mix better (a global batch draws from this many places of the file, twice as many across a window's
    edge) but keep more of the file warm at once (window x block rows, read while the window is trained on); 64
    lets a global batch of hundreds of samples come from tens of places while a window of 64 x a few MB stays small
    next to the page cache."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """Optimizer: `adamw`, `adam` or `sgd` (fused implementations, sync-free step skipping)."""
    lr: float = 1e-3
    """Peak learning rate for `base_world_size` processes (scaled by `scale_lr`)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (adamw) or L2 penalty (adam, sgd)."""
    decay_all_parameters: bool = False
    """Apply weight_decay to 1-d parameters (biases, norm scales) too, as torch's plain `Adam(model.parameters(),
    weight_decay=...)` and GEARS; default false exempts them (common practice)."""
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    amsgrad: bool = False
    """Adam/AdamW: the AMSGrad variant (the running maximum of the second moment divides the step), as EDM's
    `AdamW(amsgrad=True)`."""
    eps: float = 1e-8
    """Adam epsilon."""
    momentum: float = 0.9
    """SGD momentum."""
    scheduler: str = "constant_with_warmup"
    """Any `transformers.get_scheduler` name (linear, cosine, constant, constant_with_warmup, ...), `step`
    (warm-up, then the lr times decay_gamma every decay_every_steps: torch's StepLR, e.g. GEARS' per epoch) or
    `onecycle` (torch's OneCycleLR over the run's steps with max_lr = lr and its defaults, as ComFormer; no
    warm-up: onecycle_pct_start sets its rise)."""
    onecycle_pct_start: float = 0.3
    """scheduler=onecycle: the share of the steps over which the lr rises to its peak (OneCycleLR's pct_start)."""
    decay_every_steps: int = 0
    """scheduler=step: optimizer steps between two lr decays."""
    decay_every_epochs: float = 0.0
    """When > 0, replaces decay_every_steps by this many epochs' worth of optimizer steps."""
    decay_gamma: float = 0.5
    """scheduler=step: factor applied to the lr at every decay."""
    warmup_steps: int = 0
    """Warm-up optimizer steps for `base_world_size` processes (scaled with lr when scale_warmup)."""
    warmup_counts_current_step: bool = False
    """Count the step being taken in the warm-up: optimizer step k (from 1) has lr peak x k / warmup_steps, so the
    first already moves the weights (SEDD's rule); false: step k has peak x (k - 1) / warmup_steps (transformers'
    schedules: the first step's lr is 0). constant(_with_warmup), linear and cosine are then taken one step later
throughout; `step` keeps its decay steps. Not with the other schedulers."""
    scale_lr: str = "none"
    """Scale lr with world size relative to base_world_size: `none`, `linear` or `sqrt`."""
    scale_warmup: bool = True
    """Apply the same factor as scale_lr to warmup_steps (the UniRef50 SEDD recipe)."""
    base_world_size: int = 1
    """World size the given lr and warmup_steps were tuned for."""


@dataclass
class TrainConfig:
    max_steps: int = 100
    """Number of optimizer steps."""
    epochs: float = 0.0
    """When > 0, replaces max_steps by epochs x optimizer steps per epoch (map-style data; resolved at start)."""
    per_device_batch_size: int = 32
    """Micro-batch size per process."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; effective batch = per_device x accum x world size."""
    global_batch_size: int = 0
    """Samples per optimizer step over all processes; when > 0 the accumulation follows from it (global / (per_device
    x world size)). 0: per_device x accum x world size. A resumed run keeps its checkpoint's global batch on any
    number of processes (the accumulation changes, and the start log says so)."""
    mixed_precision: str = "no"
    """`no`, `bf16` or `fp16` autocast (fp16 adds a dynamic loss scaler)."""
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    grad_clip_mode: str = "norm"
    """`norm`: clip to grad_clip_norm. `adaptive` (EDM's rule; grad_clip_norm is then unused): clip to 1.5 x mean
    + 2 x std (population) of the last adaptive_clip_history clipped norms, a queue seeded with
    adaptive_clip_initial; each step adds its norm, or the limit when clipped. The queue is checkpointed; it
    follows the global norm, the same on every rank. Plain, DDP and fp16 runs (not DeepSpeed or FSDP)."""
    adaptive_clip_history: int = 50
    """grad_clip_mode=adaptive: how many recent norms the limit is computed from (EDM: 50)."""
    adaptive_clip_initial: float = 3000.0
    """grad_clip_mode=adaptive: the value the queue starts with (EDM: 3000, a large value flushed as norms come)."""
    grad_clip_value: float = 0.0
    """Also clip every gradient component to [-v, v] after the norm clip (0: off), as torch's clip_grad_value_.
    Not under DeepSpeed, whose engine clips by norm only."""
    compile: bool = False
    """torch.compile (inductor) the model's hot regions, as its `compile_regions()` declares them (a model without
    them is refused). Costs a one-off compile at the first steps and needs a C++ compiler on CPU; single process
    and DDP only (not DeepSpeed/FSDP). Checkpoints and parameter names are unchanged."""
    ema_decay: float = 0.0
    """EMA decay of the weights (0 disables); warm-up min(decay, (1+n)/(10+n)). EMA weights are used for eval and export."""
    ema_warmup: str = "standard"
    """How the EMA's decay warms up: `standard` min(decay, (1+n)/(10+n)) with n the updates before this one (the
    first decay 1/10); `sedd` the same with n counting this one (first 2/11, SEDD's ExponentialMovingAverage);
    `none` decay from the first update (EDM's)."""
    skip_nonfinite: bool = True
    """Skip (and count) optimizer steps whose loss or gradient is not finite; a few tensor ops a step."""
    max_nonfinite_in_row: int = 10
    """With skip_nonfinite, this many skipped steps in a row abort the run (checked at logging steps)."""


@dataclass
class EvalConfig:
    every_steps: int = 0
    """Evaluate every N optimizer steps (0: only at the end)."""
    every_epochs: float = 0.0
    """When > 0, replaces every_steps by this many epochs' worth of optimizer steps."""
    batch_size: int = 0
    """Per-device eval batch size (0: train.per_device_batch_size)."""
    balanced_batches: bool = False
    """Evaluate the eval and test splits in batches of even size in units (atoms, tokens: the task's `unit_sizes`):
    the split sorted by size and dealt over its batches, so the largest batch, and the activations it needs, stay
    near the average batch however large the split. For graph tasks (no padding); the metrics are the same (each
    sample counted once), only which samples share a batch changes."""
    max_samples: int = 0
    """Evaluate at most this many validation samples (0: the whole split): a fixed subset chosen by a hash of the
    sample index, the same at every evaluation, resume and world size, each sample still counted once. The test
    split is never capped."""
    metric: str = ""
    """Metric that selects the best checkpoint (empty: the task's first metric, e.g. `loss`; resolved at start)."""
    mode: str = "min"
    """`min` or `max`: whether a lower or higher `metric` is better."""
    sample_every: int = 0
    """Generative tasks: every K-th evaluation also draws `num_samples` samples and logs their metrics (0: never)."""
    num_samples: int = 32
    """Samples drawn (split over the ranks) at an evaluation with sample metrics."""
    test_weights: str = "final"
    """Weights the test split is evaluated with at the end of a run: `final` (the last step's) or `best`
    (the checkpoint selected by eval.metric, like HF's load_best_model_at_end; GEARS' protocol)."""


@dataclass
class CkptConfig:
    every_steps: int = 0
    """Checkpoint every N optimizer steps (0: none in between); also at the end and at every eval that improves eval.metric."""
    every_epochs: float = 0.0
    """When > 0, replaces every_steps by this many epochs' worth of optimizer steps."""
    every_seconds: float = 0.0
    """Also checkpoint once this many seconds passed since the run's last checkpoint (0: no time cadence), beside
    every_steps: bounds the work a lost node costs whatever the step time. With several processes the ranks agree
    on the step (the one after the time is up)."""
    async_save: bool = False
    """Checkpoints in the loop cost the step only their hand-over: on the plain and DDP layouts a copy of the
    tensors into memory shared with a writer process, which writes, verifies and renames the checkpoint into place
    (under FSDP and DeepSpeed the ranks write their files and the main process completes them in a thread). A save
    asked for while the last is being written is skipped; the final checkpoint is waited for. For frequent
    checkpoints, e.g. every step of an elastic run."""
    async_cpu_share: float = 1.0
    """With async_save on the plain and DDP layouts: the share of one CPU the writer process may use on average, in
    (0, 1]. After a checkpoint that took it c CPU-seconds, the loop's saves are skipped for c x (1/share - 1)
    seconds. Where the writer shares a core with the step (a laptop, a small VM, SMT siblings) a share below 1
    bounds what checkpointing takes from training, at the price of checkpoints completed less often (steps
    longer than 1/share x the writer's CPU time still get one each). 1: no rest, the freshest checkpoints (a node
    with idle cores, an elastic run)."""
    keep_last: int = 2
    """Keep this many most recent checkpoints (the best one is kept in addition)."""
    verify: bool = True
    """Record sha256 of every checkpoint file and check it on resume."""


@dataclass
class LogConfig:
    every_steps: int = 10
    """Log metrics every N optimizer steps (the only steps that synchronise host and device)."""
    tensorboard: bool = True
    """Write TensorBoard event files under output_dir/tb."""
    trackers: list = field(default_factory=list)
    """Extra accelerate trackers, e.g. [wandb] or [mlflow] (the packages must be installed)."""
    project: str = "trainer"
    """Project name given to the trackers."""
    progress_bar: bool = True
    """tqdm bar with ETA on the main process."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    task: Any = field(default_factory=TaskConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    log: LogConfig = field(default_factory=LogConfig)


_CHOICES = {
    ("optim", "name"): ("adamw", "adam", "sgd"),
    ("optim", "scale_lr"): ("none", "linear", "sqrt"),
    ("train", "grad_clip_mode"): ("norm", "adaptive"),
    ("train", "ema_warmup"): ("standard", "sedd", "none"),
    ("train", "mixed_precision"): ("no", "bf16", "fp16"),
    ("eval", "mode"): ("min", "max"),
    ("eval", "test_weights"): ("final", "best"),
    ("data", "batching"): ("fixed", "balanced", "budget"),
    ("run", "init_weights"): ("auto", "ema", "model"),
}

REPLACED_BY = {
    "train.max_steps": "train.epochs",
    "train.grad_accum_steps": "train.global_batch_size",
    "eval.every_steps": "eval.every_epochs",
    "ckpt.every_steps": "ckpt.every_epochs",
    "optim.decay_every_steps": "optim.decay_every_epochs",
}
"""Keys that another key replaces when that one is > 0. Given in different layers, the later layer's wins
(`_later_layer_wins`): `train.max_steps=3` typed on the command line trains 3 steps whatever the YAML's epochs."""


def field_docs(cls: type) -> dict[str, str]:
    """Return {field: docstring} read from the string literal under each dataclass field (base classes too)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())  # one line in tables
    return docs


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    for k in node:
        keys.append(f"{prefix}{k}")
        value = node[k] if not OmegaConf.is_config(node) else node._get_node(k)
        if OmegaConf.is_dict(value):
            keys.extend(_all_keys(value, f"{prefix}{k}."))
    return keys


def _unknown_key_error(schema: Any, key: str, source: str) -> ConfigError:
    valid = _all_keys(schema)
    section = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = [k for k in valid if k.startswith(section + ".") and k.count(".") == key.count(".")] if section else []
    if siblings:  # compare the last part within the section; then list the section, so a key named
        # differently (train_file for data_path) is still found
        names = [k.rsplit(".", 1)[1] for k in siblings]
        close = [f"{section}.{n}" for n in difflib.get_close_matches(key.rsplit(".", 1)[1], names, n=3, cutoff=0.6)]
    else:
        close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    if siblings:
        hint += f" Valid keys in '{section}': {', '.join(names)}."
    return ConfigError(f"unknown config key '{key}' (from {source}).{hint}")


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _free_form(node: Any) -> bool:
    """A field typed `dict` (e.g. a force field's keyword arguments): any keys go, the user's own."""
    return OmegaConf.is_dict(node) and node._metadata.object_type in (None, dict)


def _merge(schema: Any, layer: dict, source: str, written: dict[str, str] | None = None) -> Any:
    """`layer` (from `source`, named in errors) merged over `schema`; `written`: {key: text} of the layer's values
    that YAML read as something other than text (`_as_written`)."""
    for key in _flatten(layer):
        try:
            OmegaConf.select(schema, key, throw_on_missing=False)
            parent = schema
            for part in key.split("."):
                if _free_form(parent) and parent is not schema:
                    OmegaConf.set_struct(parent, False)
                    break
                if not OmegaConf.is_dict(parent) or part not in parent:
                    raise _unknown_key_error(schema, key, source)
                parent = parent._get_node(part)
        except ConfigKeyError:
            raise _unknown_key_error(schema, key, source) from None
    if written:
        layer = _as_written(schema, layer, written)
    try:
        return OmegaConf.merge(schema, layer)
    except ConfigKeyError as err:
        raise _unknown_key_error(schema, str(err.full_key), source) from None
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "?")
        msg = str(err).splitlines()[0]
        raise ConfigError(f"bad value for config key '{key}' (from {source}): {msg}") from None


def _as_written(schema: Any, layer: dict, written: dict[str, str]) -> dict:
    """`layer` with the text as written for each key typed str whose value YAML read as another type: `no` stays
    'no' (YAML reads false), `1.50` stays '1.50' (not 1.5). A null stays None."""
    layer = copy.deepcopy(layer)
    for key, text in written.items():
        node, target, *parents, name = [schema, layer, *key.split(".")]
        for part in [*parents, name]:
            node = node._get_node(part) if OmegaConf.is_dict(node) and part in node else None
        for part in parents:  # a key YAML wrote through an alias or a merge key (`<<`) is not in `layer` as such
            target = target.get(part) if isinstance(target, dict) else None
        if (isinstance(node, StringNode) and isinstance(target, dict) and name in target
                and target[name] is not None):  # a null stays null: "no value", refused where the key needs one
            target[name] = text
    return layer


def _written_in_yaml(text: str) -> dict[str, str]:
    """{dotted key: text} of a YAML document's unquoted values that YAML reads as something other than text."""

    def walk(node: yaml.Node, prefix: str) -> dict[str, str]:
        found = {}
        for key, value in node.value if isinstance(node, yaml.MappingNode) else ():
            if not isinstance(key, yaml.ScalarNode):
                continue
            if isinstance(value, yaml.MappingNode):
                found.update(walk(value, f"{prefix}{key.value}."))
            elif isinstance(value, yaml.ScalarNode) and value.style is None and value.tag != "tag:yaml.org,2002:str":
                found[f"{prefix}{key.value}"] = value.value
        return found

    return walk(yaml.compose(text, Loader=yaml.SafeLoader), "")


def parse_overrides(overrides: Sequence[str], written: dict[str, str] | None = None) -> dict:
    """Turn ['train.max_steps=10', ...] into a nested dict (values parsed as YAML scalars). `written`, when given,
    receives {key: text} of the values YAML read as something other than text (`no`, `1.50`, `null`)."""
    nested: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command-line override '{item}' must look like section.key=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else ""
        if written is not None and not isinstance(value, (str, list, dict)):
            written[key.strip()] = raw.strip()
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with another override of '{part}'")
        node[parts[-1]] = value
    return nested


def _close_config_files(path: Path) -> str:
    """"; did you mean ..." with the YAML files nearest to a missing config path: its folder's (the first existing
    parent), or those one folder down from there (a mistyped family folder)."""
    folder = path.parent
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    candidates = {str(p.relative_to(folder)): p for pattern in ("*.yaml", "*/*.yaml", "*.yml") for p in folder.glob(pattern)}
    close = difflib.get_close_matches(str(path.relative_to(folder)), list(candidates), n=3, cutoff=0.6)
    return f"; did you mean {', '.join(str(candidates[c]) for c in close)}?" if close else ""


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}{_close_config_files(path)}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if data is None:
        raise ConfigError(f"config file {path} is empty: it must hold sections such as `task:` and `train:`")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _check_sections(layer: dict, source: str) -> None:
    """Each known section must be a mapping (`task: regression` or `task: null` is a common slip)."""
    sections = {f.name for f in dataclasses.fields(Config)}
    for name, value in layer.items():
        if name in sections and not isinstance(value, dict):
            example = f"{name}:\n  name: {value}" if name == "task" and isinstance(value, str) else f"{name}:\n  key: value"
            raise ConfigError(f"section '{name}' (from {source}) must be a mapping of keys, got "
                              f"{type(value).__name__} {value!r}; write it as\n{example}")


SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
              "warmup_stable_decay", "greedy", "step", "onecycle")
"""optim.scheduler values: `transformers.SchedulerType`'s (a test checks the list against the installed
transformers; kept here so a config is checked without importing it), our `step` and torch's `onecycle`."""


def _check_scheduler(name: str) -> None:
    if name not in SCHEDULERS:
        close = difflib.get_close_matches(name, SCHEDULERS, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"config key 'optim.scheduler': unknown scheduler {name!r}; choose from "
                          f"{', '.join(SCHEDULERS)}.{hint}")


def _check_metric(cfg: Config, spec: TaskSpec) -> None:
    """eval.metric must be one the task reports (a vector target adds _0, _1, ... suffixes)."""
    known = tuple(spec.metrics)
    metric = cfg.eval.metric
    base, _, suffix = metric.rpartition("_")
    if metric in known or (suffix.isdigit() and base in known):
        return
    raise ConfigError(f"eval.metric={metric!r} is not a metric of task '{spec.name}'; it reports: "
                      f"{', '.join(known)}")


def _validate(cfg: Config) -> None:
    lr = cfg.optim.lr
    if not math.isfinite(lr) or lr < 0:
        raise ConfigError(f"config key 'optim.lr' must be a finite number >= 0, got {lr}")
    resume = cfg.run.resume
    if resume not in ("auto", "none") and not Path(resume).exists():
        raise ConfigError(f"run.resume={resume!r}: no such checkpoint or run directory (use auto, none or a path)")
    if cfg.run.init_from and not Path(cfg.run.init_from).exists():
        raise ConfigError(f"run.init_from={cfg.run.init_from!r}: no such run directory or checkpoint")
    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            raise ConfigError(f"config key '{section}.{key}' must be one of {list(choices)}, got {value!r}")
    positive = [("train", "max_steps"), ("train", "per_device_batch_size"), ("train", "grad_accum_steps"),
                ("train", "max_nonfinite_in_row"), ("optim", "base_world_size"), ("log", "every_steps"),
                ("data", "shuffle_window")]
    for section, key in positive:
        if getattr(getattr(cfg, section), key) < 1:
            raise ConfigError(f"config key '{section}.{key}' must be >= 1")
    non_negative = [("train", "epochs"), ("eval", "every_epochs"), ("ckpt", "every_epochs"), ("eval", "every_steps"),
                    ("ckpt", "every_steps"), ("ckpt", "every_seconds"), ("run", "collective_timeout_s"),
                    ("ckpt", "keep_last"), ("optim", "warmup_steps"), ("data", "num_workers"),
                    ("data", "max_units_per_batch"), ("data", "bucket_size"), ("data", "shuffle_block"), ("eval", "batch_size"),
                    ("eval", "max_samples"), ("data", "mapped_pages_mb"),
                    ("train", "grad_clip_norm"), ("train", "grad_clip_value"), ("train", "global_batch_size")]
    for section, key in non_negative:
        if getattr(getattr(cfg, section), key) < 0:
            raise ConfigError(f"config key '{section}.{key}' must be >= 0")
    if cfg.data.batching == "budget" and cfg.data.max_units_per_batch < 1:
        raise ConfigError("data.batching=budget needs data.max_units_per_batch >= 1 (units per rank and micro-batch)")
    if cfg.train.adaptive_clip_history < 1 or not cfg.train.adaptive_clip_initial > 0:
        raise ConfigError("config keys 'train.adaptive_clip_history' and 'train.adaptive_clip_initial' must be "
                          f"> 0, got {cfg.train.adaptive_clip_history} and {cfg.train.adaptive_clip_initial}")
    if not 0.0 < cfg.optim.onecycle_pct_start < 1.0:
        raise ConfigError(f"config key 'optim.onecycle_pct_start' must be in (0, 1), got {cfg.optim.onecycle_pct_start}")
    if not 0.0 <= cfg.train.ema_decay < 1.0:
        raise ConfigError("config key 'train.ema_decay' must be in [0, 1)")
    if not 0.0 < cfg.ckpt.async_cpu_share <= 1.0:
        raise ConfigError(f"config key 'ckpt.async_cpu_share' must be in (0, 1], got {cfg.ckpt.async_cpu_share}")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *, layer: dict | None = None,
                layer_source: str = "") -> Config:
    """Resolve a Config from defaults, the task's preset, a YAML file (or `layer`, a dict in its place, named
    `layer_source` in errors) and CLI overrides.

    Works from the task's light spec (`trainer.registry.get_spec`): a config error is found without
    importing torch or the family's model code."""
    file_layer = load_yaml(path) if path else dict(layer or {})
    file_written = _written_in_yaml(Path(path).read_text()) if path else {}
    path = path or layer_source or None
    cli_written: dict[str, str] = {}
    cli_layer = parse_overrides(overrides, cli_written)
    _check_sections(file_layer, str(path))
    _check_sections(cli_layer, "command line")
    task_name = (cli_layer.get("task", {}).get("name") or file_layer.get("task", {}).get("name")
                 or TaskConfig.name)
    preset_name = (cli_layer.get("task", {}).get("preset") or file_layer.get("task", {}).get("preset") or "")
    spec = get_spec(task_name)
    schema = OmegaConf.structured(Config(task=spec.config_cls()))
    OmegaConf.set_struct(schema, True)
    layers = [(str(path), file_layer), ("command line", cli_layer)]
    if preset_name:
        if preset_name not in spec.presets:
            raise ConfigError(f"task '{task_name}' has no preset '{preset_name}'; "
                              f"available: {', '.join(sorted(spec.presets))}")
        layers.insert(0, (f"preset {task_name}:{preset_name}", spec.presets[preset_name]))
        schema = _merge(schema, spec.presets[preset_name], layers[0][0])
    schema = _merge(schema, file_layer, str(path), file_written)
    schema = _merge(schema, cli_layer, "command line", cli_written)
    schema = _later_layer_wins(schema, layers)
    if not schema.eval.metric:  # the task's first metric, a default like the others (the config is never edited)
        schema = _merge(schema, {"eval": {"metric": spec.metrics[0]}}, f"task {spec.name}'s first metric")
    try:
        cfg = OmegaConf.to_object(schema)
    except InterpolationResolutionError as err:  # a resolver's own error (e.g. `${fetch:NAME}`) as its one line
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, TrainerError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        raise ConfigError(f"config key '{getattr(err, 'full_key', '?')}': {str(err).splitlines()[0]}") from None
    _validate(cfg)
    _check_scheduler(cfg.optim.scheduler)
    _check_metric(cfg, spec)
    try:  # the task's own checks of its options (TaskConfig.validate; no torch): fail here, not later
        if isinstance(spec.task, str):
            cfg.task.validate()
        else:  # a task registered by its class checks its options when built (cheap: no data, no model)
            spec.task(cfg.task, seed=cfg.run.seed)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"task '{spec.name}': {err}") from None
    return cfg


def _later_layer_wins(schema: Any, layers: list[tuple[str, dict]]) -> Any:
    """Where a key and the key that replaces it (`REPLACED_BY`) are set in different layers (preset < YAML <
    command line), the later layer's wins: the replacing key goes back to 0 (off), said in one line. A later value
    of 0 switches nothing: 0 is each key's "not set", so `eval.every_steps=0` leaves a YAML's eval.every_epochs."""
    set_by = {key: (rank, source) for rank, (source, layer) in enumerate(layers) for key in _flatten(layer)}
    for key, replacing in REPLACED_BY.items():
        value = OmegaConf.select(schema, replacing)
        later = key in set_by and replacing in set_by and set_by[key][0] > set_by[replacing][0]
        if value and OmegaConf.select(schema, key) and later:
            OmegaConf.update(schema, replacing, type(value)(0))
            if int(os.environ.get("RANK", "0") or 0) == 0:  # one line per run, not one per rank of a launcher
                logger.info("%s=%s (from %s) wins over %s=%s (from %s), which would replace it: %s=0 for this run",
                            key, OmegaConf.select(schema, key), set_by[key][1], replacing, value, set_by[replacing][1],
                            replacing)
    return schema


def align_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The config of `trainer align RUN_DIR out=NEW_RUN_DIR [key=value ...]`: the aligned task's preset (the name
    of RUN_DIR's preset when the alignment has one, else `tiny`), under RUN_DIR's task options that the alignment
    shares (model sizes, elements, data), `run.init_from` = the absolute folder of RUN_DIR's latest checkpoint (so
    a resume starts from, and compares with, the same weights whatever RUN_DIR does later), its seed,
    `run.output_dir=NEW_RUN_DIR`, under the command line's `key=value`s. No torch is imported."""
    run_dir = Path(run_dir)
    source = run_dir / "config.yaml"
    if not source.is_file():
        raise ConfigError(f"trainer align: {run_dir} is not a run directory (no config.yaml)")
    saved = load_yaml(source)
    saved_task = saved.get("task") or {}
    spec = get_spec(str(saved_task.get("name", "")))
    if not spec.aligned_by:
        raise ConfigError(f"trainer align: task '{spec.name}' of {run_dir} has no alignment task")
    target = get_spec(spec.aligned_by)
    rest, out = [], None
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "out":
            out = value.strip()
        else:
            rest.append(item)
    out = out or parse_overrides(rest).get("run", {}).get("output_dir")
    if not out:
        raise ConfigError("trainer align needs out=NEW_RUN_DIR (the aligned run's directory)")
    if Path(out).resolve() == run_dir.resolve():
        raise ConfigError(f"trainer align: out={out} is the aligned run itself; name a new run directory")
    checkpoint = _latest_checkpoint_of(run_dir)  # pinned: the reference of a resume, whatever the run does later
    shared = ({f.name for f in dataclasses.fields(target.config_cls)}
              & {f.name for f in dataclasses.fields(spec.config_cls)})
    preset = str(saved_task.get("preset") or "")
    task = {k: v for k, v in saved_task.items() if k in shared and k not in ("name", "preset")}
    seed = (saved.get("run") or {}).get("seed", 0)
    if "split_seed" in shared and int(task.get("split_seed", -1)) < 0:
        # The aligned run's data split (and so its node-count histogram) stays RUN_DIR's under another run.seed.
        task["split_seed"] = seed
    layer = {"run": {"output_dir": out, "init_from": str(checkpoint), "seed": seed},
             "task": {**task, "name": target.name, "preset": preset if preset in target.presets else "tiny"}}
    cfg = load_config(None, rest, layer=layer, layer_source=f"trainer align {run_dir}")
    if Path(cfg.run.output_dir).resolve() == run_dir.resolve():
        raise ConfigError(f"trainer align: run.output_dir={cfg.run.output_dir} is the aligned run itself; name a new "
                          f"run directory")
    return cfg


def _latest_checkpoint_of(run_dir: Path) -> Path:
    """The absolute folder of RUN_DIR's most recently completed checkpoint (`store.latest_checkpoint`; torch-free)."""
    from trainer.core.checkpoint.store import latest_checkpoint

    folder = latest_checkpoint(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else None
    if folder is None:
        raise ConfigError(f"trainer align: {run_dir} has no complete checkpoint under {run_dir / 'checkpoints'}")
    return folder.resolve()


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    # Atomic: the agents of an elastic run each write the launch config while a restarted group may be reading it.
    atomic_write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False), durable=False)


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from a saved resolved config (e.g. a run directory's config.yaml)."""
    spec = get_spec(data.get("task", {}).get("name", TaskConfig.name))
    schema = OmegaConf.structured(Config(task=spec.config_cls()))
    OmegaConf.set_struct(schema, True)
    return OmegaConf.to_object(_merge(schema, data, "saved config"))


def describe_fields(sections: dict[str, Any]) -> str:
    """Markdown table of the fields of dataclass instances (`{prefix: instance}`; prefix '' for none)."""
    lines = ["| key | default | meaning |", "|---|---|---|"]

    def add(name: str, obj: Any) -> None:
        docs = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            key = f"{name}.{f.name}" if name else f.name
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a nested section: its own keys
                add(key, value)
            else:
                lines.append(f"| `{key}` | `{value!r}` | {docs.get(f.name, '')} |")

    for name, obj in sections.items():
        add(name, obj)
    return "\n".join(lines)


def describe_config(task_name: str | None = None) -> str:
    """Markdown table of every config key with its default and docstring."""
    sections = {f.name: f.default_factory() for f in dataclasses.fields(Config)}
    if task_name:
        sections["task"] = get_spec(task_name).config_cls()
    return describe_fields(sections)


def parse_options(cls: type, overrides: Sequence[str], source: str = "command line") -> Any:
    """An options dataclass (e.g. a task's SampleConfig) from `key=value` strings, with the training
    config's machinery: defaults, YAML-typed values checked against the fields, and "did you mean"
    errors for unknown keys."""
    schema = OmegaConf.structured(cls())
    OmegaConf.set_struct(schema, True)
    written: dict[str, str] = {}
    return OmegaConf.to_object(_merge(schema, parse_overrides(overrides, written), source, written))

"""The task contract: what a model family gives the Trainer.

A task is a small spec registered by name (`trainer.registry`): a `TaskSpec` holds what the registry, the
config loader and the command line need without importing torch (the options dataclass, presets, unit,
metrics, sampling options) and names the `Task` class, imported only when a run needs it. The task builds
its data (`build_data`)
and then a single-device model from the statistics of that data (`build_model(stats)`), collates
samples, computes the loss of a micro-batch and per-sample eval values, and names a `tiny` preset.
Nothing here knows about processes, devices or sharding: the core does that. `loss` and `eval_step`
receive the model as the core prepared it (DDP / DeepSpeed may wrap it: call it, never walk
`.module`); `generate` receives the plain single-device module. Statistics a hook needs come from
`self.stats`, never from model attributes read through a wrapper.

Order of calls the core guarantees: `build_data()` first; then `attach_stats(data.stats)`; then
`build_model(data.stats)`. Sampling and export skip `build_data`: they read the statistics back from
the run artifact `task_stats.json` and call `attach_stats` and `build_model` with them. So nothing a
later call needs is left behind as a side effect of another call.

Randomness of the loss. `loss(model, batch, rng)` gets the micro-batch's `rng`, a
`trainer.sample_random.SampleRandom` with one seed per row that is a function of (run.seed, epoch, the
sample's dataset index) only. Everything the loss draws (diffusion times, corruption, noise, augmentations
drawn in the loss) comes from `rng`, row by row: `rng.rand("time")`, `rng.randn("noise", n, 3)`,
`rng.generators("mask")`, one stream name per quantity; never from the global RNG (`torch.rand` without a
generator). Then a sample draws the same numbers whichever rank, micro-batch or accumulation step reads
it, and 1, 2 or N processes with the same global batch train the same weights up to float summation
order (tested per family, `tests/core/test_sample_randomness.py`); a resumed run draws what the
uninterrupted one drew. Randomness a dataset draws when it loads an item keys itself the same way (an
`EpochAwareDataset` drawing from `derive_seed(seed, epoch, index)`). The exception is dropout (and any other
draw inside the model's forward): it uses the rank's global RNG, seeded `run.seed + rank`, so it differs
between world sizes; it is restored exactly on a resume at the same world size.

Optional capabilities are `typing.Protocol`s checked with `isinstance`, never `hasattr`:
`GenerativeTask` (has a `SampleConfig` and `generate`/`write_samples`), `ReferenceModelTask` (a loss that
compares the model with its starting point, e.g. a KL penalty of reward post-training), `StatefulTask` (a loss
that carries state from one optimizer step to the next, e.g. rollouts reused for several steps), `EpochAwareDataset`
(a map-style dataset whose item depends on the epoch), `GlobalStream` (a training stream in one order
that the core shards by global sample index), `EpochAwareStream` and `CompilableModel` (a model that
compiles its own hot regions for `train.compile`).

Streams. A `GlobalStream` gives an epoch's samples in one order, the same in every process and DataLoader
worker; it never learns about ranks or workers. The core asks for the samples one process needs with
`iter_global(wanted)`: the stream yields one item per sample of the epoch, in order, the decoded sample
where `wanted(global_index)` is true and None elsewhere, so a sample another process reads costs a scan, not a
decode. Global sample g of an epoch then goes where it would go in a map-style epoch (rank (g // B) % W for
per-device batch B and W processes), the data position is (epoch, global samples read), the same on every
rank, and a run resumed at any world size reads exactly the samples the uninterrupted run would have read.
The loss's randomness is keyed by (run.seed, epoch, global index).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is imported where it is used: `trainer tasks` and config-help stay fast
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from trainer.sample_random import SampleRandom


@dataclass
class TaskConfig:
    name: str = "regression"
    """Registered task name (`trainer tasks` lists them)."""
    preset: str = ""
    """Named preset of the task (e.g. `tiny`) applied under the YAML and CLI values."""

    def validate(self) -> None:
        """Raise ValueError for values the task cannot use (a subclass adds its own checks). The config
        loader calls it (a config error, before torch is imported); so does `Task.__init__`."""


@dataclass
class SampleConfig:
    """Options of `trainer sample RUN_DIR key=value ...` shared by every generative task.

    A generative task subclasses this with its own options; the same override machinery as training
    parses them (defaults, types, "did you mean" errors).
    """

    num_samples: int = 16
    """Samples to draw, split over the ranks with exact counts."""
    out: str = ""
    """Output file or folder (empty: a default under RUN_DIR/samples)."""
    seed: int = 0
    """Sample k draws all its randomness from a generator seeded by (seed, k): same samples at any world size."""
    batch_size: int = 16
    """Samples generated together per rank."""
    checkpoint: str = "latest"
    """`latest`, `best` or a checkpoint directory."""
    weights: str = "auto"
    """`auto` (EMA weights when the run kept an EMA), `ema` or `model`."""

    def validate(self) -> None:
        """Raise ValueError for values no sampler can use (a subclass adds its own checks)."""
        if self.num_samples < 1 or self.batch_size < 1:
            raise ValueError(f"num_samples and batch_size must be >= 1, got {self.num_samples} and {self.batch_size}")
        if self.weights not in ("auto", "ema", "model"):
            raise ValueError(f"weights must be auto, ema or model, got {self.weights!r}")


@dataclass(frozen=True)
class TaskSpec:
    """A task as the registry knows it before the task's module is imported: everything `trainer tasks`,
    `trainer config-help` and the config loader need (no torch), and where the `Task` class lives.

    A family declares one in a light module (`trainer/families/<family>/spec.py`: the options dataclasses,
    presets and metadata, importing neither torch nor the family's model code) with
    `SPEC = register_spec(TaskSpec(...))`, and decorates its Task class with `@register_task(SPEC)`, which
    sets the class's `name`, `config_cls`, `presets`, `unit`, `metrics` and `sample_config_cls` from it.
    """

    name: str
    """Registered task name (`task.name` in a config)."""
    task: str | type[Task]
    """The Task class as `"package.module:Class"`, imported by `trainer.registry.get_task`; or the class
    itself (a task registered the older way, by decorating the class with `@register_task(name)`)."""
    config_cls: type[TaskConfig] = TaskConfig
    """The `task:` section's dataclass (a TaskConfig subclass with a docstring per field)."""
    presets: Mapping[str, dict] = field(default_factory=lambda: {"tiny": {}})
    """Named config layers (`task.preset=NAME`) under the YAML and command-line values; `tiny` is required."""
    unit: str = "samples"
    """What `Task.batch_weight` counts (samples, tokens, atoms, graphs), for throughput logs."""
    metrics: tuple[str, ...] = ("loss",)
    """Names `Task.reduce_metrics` returns (eval.metric must be one of them)."""
    sample_config_cls: type[SampleConfig] | None = None
    """Options of `trainer sample` when the task generates (a `GenerativeTask`); None when it does not."""
    requires: tuple[str, ...] = ()
    """Top-level modules the task needs beyond the core install (checked without importing them)."""
    extra: str = ""
    """The pip extra that installs `requires` (`pip install 'sciml-trainer[EXTRA]'`)."""
    aligned_by: str = ""
    """The registered task that post-trains this task's runs with a reward (`trainer align RUN_DIR`); empty: none."""
    baselines: Mapping[str, str] = field(default_factory=dict)
    """Eval metric -> the metric of its trivial baseline (e.g. perplexity_bound -> unigram_perplexity):
    `trainer plot` draws the pair in one panel, without importing the task's module."""

    @property
    def generates(self) -> bool:
        """Whether `trainer sample` can draw from the task."""
        return self.sample_config_cls is not None

    @property
    def task_path(self) -> str:
        """`"package.module:Class"` of the Task class."""
        return self.task if isinstance(self.task, str) else f"{self.task.__module__}:{self.task.__qualname__}"


@dataclass
class LossOutput:
    """Loss of one micro-batch: the mean over its units (samples, tokens, atoms), plus scalar logs.

    The units themselves come from `Task.batch_weight`, which the Trainer calls before the forward
    pass: the normalisation over all micro-batches and ranks must be known before backward (DeepSpeed
    steps inside it).
    """

    loss: torch.Tensor
    logs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Scalars of the micro-batch (means over its units, every micro-batch the same names): the core logs their
    mean over the step's micro-batches and ranks at each logging step."""


@dataclass
class TaskData:
    """What `Task.build_data` returns."""

    train: Dataset
    """Training set: map-style (the core shards and shuffles it) or a `GlobalStream` (the core shards it)."""
    eval: Dataset | None = None
    """Validation set (map-style), evaluated every eval.every_steps and at the end."""
    test: Dataset | None = None
    """Held-out test set (map-style), evaluated once at the end of a completed run."""
    stats: dict[str, Any] = field(default_factory=dict)
    """JSON-able statistics of the training data that `build_model`, eval or a sampler needs (target
    mean and std, length histogram, ...); saved as the run artifact `task_stats.json`."""


class Task:
    """Base class of tasks. Subclasses implement the hooks; `@register_task(spec)` sets the class attributes
    below from the task's `TaskSpec` (a task registered by name sets them in its class body)."""

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[TaskConfig]] = TaskConfig
    presets: ClassVar[dict[str, dict]] = {"tiny": {}}
    unit: ClassVar[str] = "samples"
    """Name of the unit `batch_weight` counts (samples, tokens, atoms, graphs) for throughput logs."""
    metrics: ClassVar[tuple[str, ...]] = ("loss",)
    """Names of the metrics `reduce_metrics` returns (eval.metric must be one of them)."""
    baselines: ClassVar[dict[str, str]] = {}  # from the TaskSpec (trainer plot pairs these metrics)
    """Metric -> the metric holding its trivial baseline on the same eval data (both among `metrics`), e.g.
    {"perplexity_bound": "unigram_perplexity"}: `trainer plot` draws the baseline in the metric's panel. A metric
    `baseline_X` is paired with `X` without being declared."""
    sample_config_cls: ClassVar[type[SampleConfig]] = SampleConfig
    """Options of `trainer sample` for a `GenerativeTask` (a subclass of SampleConfig)."""
    progress_logs: ClassVar[tuple[str, ...]] = ()
    """Names of `LossOutput.logs` shown beside the loss in the training progress bar (e.g. a reward)."""

    def __init__(self, cfg: TaskConfig, seed: int = 0):
        if isinstance(cfg, TaskConfig):
            cfg.validate()
        self.cfg = cfg
        self.seed = seed
        self.stats: dict[str, Any] = {}

    # ------------------------------------------------------------------ data and model
    def build_data(self) -> TaskData:
        """Datasets and the statistics of the training data."""
        raise NotImplementedError

    def prepare_data(self) -> dict[str, Any]:
        """Build every cache `build_data` would build, ahead of a job (`trainer data prepare CONFIG`), and
        return a JSON-able summary of what was built.

        Called in one process, under the same build lock as a run's `build_data`, so a later run with the
        same config finds everything built. The default runs `build_data()` and counts each split's
        records; a family may override it to skip what only a run needs (a training order, per-rank
        arrays). Summary keys the command prints: `records` ({split: count}), and where known
        `cache_files` (paths: their total size is printed) and `cache_dir` (the folder they are in)."""
        data = self.build_data()
        records = {name: len(ds) for name, ds in (("train", data.train), ("eval", data.eval), ("test", data.test))
                   if ds is not None and hasattr(ds, "__len__")}
        return {"records": records}

    def attach_stats(self, stats: Mapping[str, Any]) -> None:
        """Called by the core with the statistics of `build_data` (or of the run artifact) before any
        other hook that may need them (eval, sampling)."""
        self.stats = dict(stats)

    def build_model(self, stats: Mapping[str, Any]) -> nn.Module:
        """A single-device model; `stats` are those of `build_data` (e.g. target mean and std)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ batches
    def collate(self, samples: list[Any]) -> Any:
        from torch.utils.data import default_collate

        return default_collate(samples)

    def batch_size(self, batch: Any) -> int:
        """Number of samples in a collated batch (for samples/s)."""
        first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values()))
        return int(first.shape[0])

    def unit_sizes(self, dataset: Dataset) -> Any:
        """Units (`unit`) of each training sample, for data.batching=balanced|budget; None: not supported."""
        return None

    def batch_weight(self, batch: Any) -> torch.Tensor | float:
        """Units in a micro-batch; the loss of an optimizer step is their weighted mean."""
        return float(self.batch_size(batch))

    # ------------------------------------------------------------------ loss and metrics
    def loss(self, model: nn.Module, batch: Any, rng: SampleRandom) -> LossOutput:
        """Mean loss of a training micro-batch. Everything it draws comes from `rng` (one seeded stream set per
        row, keyed by the sample: see the module docstring), never from the global RNG; dropout inside the
        model is the one exception. A loss that draws nothing ignores `rng`."""
        raise NotImplementedError

    def eval_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per-sample values (each shaped [batch]) that `reduce_metrics` turns into metrics."""
        raise NotImplementedError

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """Metrics over the whole eval set; `values` holds each sample exactly once."""
        return {k: float(v.double().mean()) for k, v in values.items()}

    def write_report(self, values: dict[str, torch.Tensor], metrics: dict[str, float], directory: Path,
                     dataset: Dataset) -> None:
        """Main process, after the test evaluation: every per-sample value once (e.g. for a parity plot), and
        the evaluated dataset (to name records, e.g. by an index the task put in the values)."""

    # ------------------------------------------------------------------ artifacts
    def save_artifacts(self, directory: Path) -> list[str]:
        """Write what a checkpoint or export needs besides weights, config and `task_stats.json` (e.g. a
        tokenizer); return the names written (files or folders in `directory`). The core lists them in
        the checkpoint manifest and export copies exactly those."""
        return []

    def eval_sample_config(self, num_samples: int, seed: int) -> SampleConfig:
        """Sampling options of the small sample scored at evaluations (eval.sample_every): cheap defaults."""
        return self.sample_config_cls(num_samples=num_samples, seed=seed)

    def load_artifacts(self, directory: Path) -> None:
        """Read back what `save_artifacts` wrote (sampling and export call it with the checkpoint folder)."""


@runtime_checkable
class GenerativeTask(Protocol):
    """A task that can draw samples (`trainer sample`); its options are its `sample_config_cls`."""

    def generate(self, model: nn.Module, generators: list[torch.Generator], options: Any,
                 indices: Sequence[int]) -> list[Any]:
        """One sample per generator; all randomness of sample k = indices[i] comes from generators[i]."""

    def write_samples(self, samples: list[Any], options: Any, out: Path) -> dict[str, Any]:
        """Main process: write all samples (in order) under `out`; return their statistics."""

    def score_samples(self, samples: list[Any], options: Any) -> dict[str, float]:
        """Main process: metrics of a set of samples, logged at evaluations with eval.sample_every."""


@runtime_checkable
class ReferenceModelTask(Protocol):
    """A task whose loss compares the model with a frozen copy of its starting point (the KL penalty of reward
    post-training, `trainer align`)."""

    def keep_reference_model(self, model: nn.Module) -> None:
        """Called once by the core with the single-device model holding the run's initial weights (`run.init_from`'s,
        before any resume and before the model is wrapped): keep a frozen copy (the core never trains it)."""


@runtime_checkable
class StatefulTask(Protocol):
    """A task whose loss carries state from one optimizer step to the next (reward post-training's batch of rollouts,
    drawn once and trained on for several steps). The state is each rank's own (it follows the rank's micro-batches)
    and is checkpointed per rank (`task_state_<rank>.safetensors`), so that a run stopped between two such steps
    resumes exactly.

    The core calls `start_step(step, micro_batches)` before each optimizer step (`step`: optimizer steps done so
    far; `micro_batches`: the `loss` calls of this rank that the step makes). At a checkpoint it saves
    `task_state_dict()` (CPU or device tensors; empty: no file), and on a resume hands `load_task_state_dict` this
    rank's saved tensors ({} when the checkpoint holds none), or None when the checkpoint was written by another
    number of processes (the state does not follow the micro-batches then: the task starts afresh, and says so)."""

    def start_step(self, step: int, micro_batches: int) -> None: ...

    def task_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_task_state_dict(self, state: dict[str, torch.Tensor] | None) -> None: ...


@runtime_checkable
class EpochAwareDataset(Protocol):
    """A map-style dataset whose item depends on the epoch (e.g. a random crop drawn from (seed, epoch, index))."""

    def __len__(self) -> int: ...

    def get_item(self, index: int, epoch: int) -> Any: ...


@runtime_checkable
class GlobalStream(Protocol):
    """A training stream whose epoch has one order, the same in every process and worker (see the module
    docstring): the core shards it by global sample index and resumes it at any world size.

    `iter_global(wanted)` yields one item per sample of the current epoch, in that order: the decoded sample
    where `wanted(g)` is true for its index g (0, 1, 2, ... counting the samples the stream gives, after any
    filter), None elsewhere. A sample not wanted should be skipped without its expensive decoding (reading
    past it is fine); yielding it decoded anyway is allowed, only slower. An epoch may have any length;
    the core drops its tail shorter than one global batch (and logs how many samples that was).
    """

    def iter_global(self, wanted: Callable[[int], bool]) -> Iterator[Any | None]: ...


@runtime_checkable
class EpochAwareStream(Protocol):
    """A stream with a different order each epoch: the core calls `set_epoch(epoch)` before `iter_global`."""

    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class CompilableModel(Protocol):
    """A model that knows which of its parts torch.compile can trace, for `train.compile`.

    `compile_regions()` compiles those parts in place (e.g. a dense block, leaving data-dependent or sparse
    code eager) and keeps parameter names, so checkpoints are the same with and without it. What it compiles
    must stay right in a deep copy of the model (the EMA): compile unbound functions, not `self.forward`.
    The core calls it once, on the single-device model, before wrapping it for DDP; a model without it is
    refused for `train.compile` rather than compiled whole.
    """

    def compile_regions(self) -> None: ...

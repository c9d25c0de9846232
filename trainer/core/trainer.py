"""The Trainer: plain PyTorch plus Accelerator verbs.

Read top to bottom: `__init__` builds task, model, data and optimizer and prepares them;
`fit` runs optimizer steps (`train_step`), evaluates (`evaluate`) and checkpoints (`save`).
The loop never branches on the task; backend differences (DeepSpeed steps and clips inside
backward and counts its own skipped steps) stay in the step and logging helpers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from accelerate.utils import DistributedType, gather_object, send_to_device, set_seed
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, IterableDataset
from tqdm.auto import tqdm
from transformers import get_scheduler

from trainer.core import checkpoint as ckpt
from trainer.config import Config, ConfigError, config_to_dict, save_config
from trainer.core.samplers import BalancedBatchSampler, EpochIndexed, EpochSampler, RankBatchSampler, WorkerSeeder
from trainer.core.distributed import PREEMPTED_EXIT_CODE, PreemptionWatcher, build_accelerator, scale_factor
from trainer.core.ema import EMA
from trainer.core.metrics_log import MetricsLog, peak_memory_mb
from trainer.registry import get_task
from trainer.task import EpochAwareDataset, EpochAwareStream, ShardedStream

logger = logging.getLogger("trainer")


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


@dataclass
class TrainState:
    """What a checkpoint records besides model/optimizer/scheduler/RNG (the data position is step x accum)."""

    step: int = 0
    best_metric: float | None = None
    best_step: int | None = None
    nonfinite_skipped: int = 0
    world_size: int = 1
    backend: str = ""
    grad_accum_steps: int = 1


def build_optimizer(cfg: Config, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Fused optimizer (sync-free skipping via `found_inf`); no weight decay on biases and norms."""
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=o.momentum, fused=True)
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(groups, lr=lr, betas=tuple(o.betas), eps=o.eps, fused=True)


class Trainer:
    def __init__(self, cfg: Config, deepspeed_config: str | None = None):
        self.cfg = cfg
        self.accelerator = acc = build_accelerator(cfg, deepspeed_config)
        self.is_deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
        if acc.distributed_type == DistributedType.FSDP and cfg.train.ema_decay > 0:
            raise ConfigError("train.ema_decay > 0 is not supported under FSDP yet (DDP and ZeRO-1/2/3 are)")
        self.run_dir = Path(cfg.run.output_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        world, t = acc.num_processes, cfg.train

        self.task = get_task(cfg.task.name)(cfg.task, seed=cfg.run.seed)
        with acc.main_process_first():  # the main process fills the data caches, the others read them
            data = self.task.build_data()
        train_set, eval_set, test_set = data.train, data.eval, data.test
        self.task.attach_stats(data.stats)
        set_seed(cfg.run.seed)  # identical initial weights on every rank
        model = self.task.build_model(data.stats)

        loader_args = dict(collate_fn=self.task.collate, num_workers=cfg.data.num_workers,
                           pin_memory=cfg.data.pin_memory and torch.cuda.is_available(),
                           worker_init_fn=WorkerSeeder(), persistent_workers=cfg.data.num_workers > 0)
        # Its own generator, reseeded every epoch: iterators must not draw from the global RNG (which
        # a resumed run restores) and worker seeds must be a function of (seed, rank, epoch).
        self._loader_generator = torch.Generator()
        self.streaming = isinstance(train_set, IterableDataset)
        if self.streaming:
            # A stream shards itself over (rank, worker); its position is saved per rank.
            if not isinstance(train_set, ShardedStream):
                raise ConfigError(f"{type(train_set).__name__} is an IterableDataset without set_shard(rank, world_size)")
            train_set.set_shard(acc.process_index, world)
            self.train_sampler = self.batch_sampler = None
            self.train_loader = DataLoader(train_set, batch_size=t.per_device_batch_size, drop_last=True,
                                           generator=self._loader_generator, **loader_args)
        else:
            # Our own rank sharding rather than a prepared loader: the data position is then a pure
            # function of the step (exact resume without loading skipped batches), no wrapper in the loop.
            epoch_aware = isinstance(train_set, EpochAwareDataset)
            self.batch_sampler = self._build_batch_sampler(train_set, epoch_aware)
            train_set = EpochIndexed(train_set) if epoch_aware else train_set
            self.train_loader = DataLoader(train_set, batch_sampler=self.batch_sampler,
                                           generator=self._loader_generator, **loader_args)
        self._data_position = (0, 0)  # (epoch, batches of it consumed) of this rank: saved for streams
        self._resolve_epochs()
        factor = scale_factor(cfg.optim.scale_lr, world, cfg.optim.base_world_size)
        self.lr = cfg.optim.lr * factor
        self.warmup_steps = round(cfg.optim.warmup_steps * (factor if cfg.optim.scale_warmup else 1.0))
        optimizer = build_optimizer(cfg, model, self.lr)
        self.scheduler = get_scheduler(cfg.optim.scheduler, optimizer, num_warmup_steps=self.warmup_steps,
                                       num_training_steps=t.max_steps)

        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.eval_loader = self.test_loader = None
        for name, dataset in (("eval_loader", eval_set), ("test_loader", test_set)):
            if dataset is not None:
                # Its own generator too: a (re)created iterator would otherwise draw from the global RNG.
                loader = DataLoader(dataset, batch_size=cfg.eval.batch_size or t.per_device_batch_size,
                                    shuffle=False, generator=torch.Generator().manual_seed(cfg.run.seed),
                                    **loader_args)
                setattr(self, name, acc.prepare(loader))
        set_seed(cfg.run.seed + acc.process_index)  # independent noise/dropout streams per rank

        self.ema = EMA(acc.unwrap_model(self.model), t.ema_decay) if t.ema_decay > 0 else None
        self.state = TrainState(world_size=world, backend=str(acc.distributed_type.value),
                                grad_accum_steps=t.grad_accum_steps)
        # Plain PyTorch calls where accelerate's wrappers would only forward them (they cost ~0.3 ms a step).
        self._plain_step = (not self.is_deepspeed and acc.scaler is None
                            and acc.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU,
                                                         DistributedType.MULTI_GPU))
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        self._bad_flags: list[torch.Tensor] = []  # one 0./1. flag per step since the last logging step
        self._bad_run = 0
        self._ds_skipped = 0
        self.last_eval: dict[str, float] = {}

        self.resumed_from = resumed_from = self._resume()
        if acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
            self.metrics = MetricsLog(self.run_dir, self.state.step if resumed_from else None)
            if acc.log_with:
                acc.init_trackers(cfg.log.project, config=_flat_hparams(config_to_dict(cfg)))
        self._log_start(resumed_from)

    # ------------------------------------------------------------------ resume
    def _resume(self) -> Path | None:
        mode = self.cfg.run.resume
        if mode == "none":
            self._set_aside_old_checkpoints()
            return None
        if mode == "auto":
            candidates = ckpt.resume_candidates(self.ckpt_root)
            if not candidates:
                return None
        else:
            candidates = [ckpt.resolve_checkpoint(mode)]
        acc = self.accelerator
        for i, path in enumerate(candidates):
            saved, problem = self._verify_everywhere(path)
            if problem is None:
                break
            if mode != "auto" or i == len(candidates) - 1:
                raise ckpt.CheckpointError(problem)
            logger.warning("%s; falling back to the previous checkpoint", problem)
        if saved.get("world_size") != acc.num_processes and (self.is_deepspeed or "DEEPSPEED" in saved.get("backend", "")):
            raise ckpt.CheckpointError(f"checkpoint {path} was written by {saved.get('world_size')} DeepSpeed "
                                       f"processes; resume it with the same number (now {acc.num_processes})")
        if saved.get("grad_accum_steps", self.cfg.train.grad_accum_steps) != self.cfg.train.grad_accum_steps:
            logger.warning("train.grad_accum_steps changed from %s to %s: the data position counts optimizer steps, "
                           "so the sample order differs from the original run", saved["grad_accum_steps"],
                           self.cfg.train.grad_accum_steps)
        try:
            acc.load_state(str(path))
        except Exception as err:  # a checkpoint that passed its manifest but will not load
            raise ckpt.CheckpointError(f"checkpoint {path} could not be loaded: {err}") from err
        acc.step = 0  # accumulation boundaries restart with each optimizer step, whatever accum was
        self.scheduler.load_state_dict(saved.pop("scheduler"))
        positions = saved.pop("data_positions", None)
        saved.pop("artifacts", None)
        if self.streaming:
            if positions is None or len(positions) != acc.num_processes:
                logger.warning("the stream's position was saved for another world size: restarting the data "
                               "from the start of epoch 0 (weights, optimizer and schedule are restored)")
            else:
                self._data_position = tuple(positions[acc.process_index])
        fields = {f.name for f in dataclasses.fields(TrainState)}
        self.state = TrainState(**{k: v for k, v in saved.items() if k in fields})
        self.state.world_size, self.state.backend = acc.num_processes, str(acc.distributed_type.value)
        self.state.grad_accum_steps = self.cfg.train.grad_accum_steps
        if self.is_deepspeed:
            self._ds_skipped = int(getattr(self.model, "skipped_steps", 0))
        if self.ema is not None:
            ema_file = path / "ema.safetensors"
            if not ema_file.is_file():
                raise ckpt.CheckpointError(f"checkpoint {path} has no ema.safetensors but train.ema_decay > 0")
            self.ema.load_full(acc.unwrap_model(self.model), load_file(ema_file), acc.process_index,
                               num_updates=self.state.step)
        return path

    def _verify_everywhere(self, path: Path) -> tuple[dict, str | None]:
        """Verify on every rank (hashes on each node's main rank) and agree: one bad rank fails all."""
        acc = self.accelerator
        saved, problem = {}, None
        try:
            saved = ckpt.verify_checkpoint(path, check_hashes=self.cfg.ckpt.verify and acc.is_local_main_process)
        except ckpt.CheckpointError as err:
            problem = str(err)
        if acc.num_processes > 1:
            failed = acc.reduce(torch.tensor(float(problem is not None), device=acc.device), reduction="sum")
            if problem is None and float(failed) > 0:
                problem = f"checkpoint {path} failed verification on another rank"
        return saved, problem

    def _set_aside_old_checkpoints(self) -> None:
        """run.resume=none in a directory with checkpoints: keep them, but out of this run's way."""
        acc = self.accelerator
        if acc.is_main_process and ckpt.list_checkpoints(self.ckpt_root):
            aside = self.ckpt_root.with_name(f"checkpoints.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            self.ckpt_root.rename(aside)
            logger.warning("run.resume=none: the existing checkpoints were moved to %s", aside)
        acc.wait_for_everyone()

    def _log_start(self, resumed_from: Path | None) -> None:
        acc, t = self.accelerator, self.cfg.train
        effective = t.per_device_batch_size * t.grad_accum_steps * acc.num_processes
        lines = [f"backend={acc.distributed_type.value} processes={acc.num_processes} device={acc.device} "
                 f"precision={t.mixed_precision}",
                 f"effective batch = {t.per_device_batch_size} per device x {t.grad_accum_steps} accum x "
                 f"{acc.num_processes} processes = {effective}",
                 f"lr = {self.lr:.3g} (optim.lr {self.cfg.optim.lr:.3g}, scale_lr={self.cfg.optim.scale_lr}), "
                 f"warmup = {self.warmup_steps} steps, schedule={self.cfg.optim.scheduler}"]
        if self.train_sampler is not None and self.train_sampler.dropped_per_epoch:
            lines.append(f"{self.train_sampler.dropped_per_epoch} of {self.train_sampler.num_samples} training "
                         f"samples left out per epoch (a different remainder each epoch) so ranks stay even")
        if resumed_from:
            lines.append(f"resumed from {resumed_from} at step {self.state.step}")
        if acc.is_main_process:
            for line in lines:
                logger.info(line)
            self.metrics.write({"step": self.state.step, "event": "start", "effective_batch_size": effective,
                                "scaled_lr": self.lr, "warmup_steps": self.warmup_steps,
                                "world_size": acc.num_processes})

    # ------------------------------------------------------------------ data
    def _resolve_epochs(self) -> None:
        """Turn train.epochs, eval.every_epochs and ckpt.every_epochs into steps (saved in config.yaml)."""
        cfg = self.cfg
        if not (cfg.train.epochs or cfg.eval.every_epochs or cfg.ckpt.every_epochs):
            return
        if self.batch_sampler is None:
            raise ConfigError("train.epochs / *.every_epochs need map-style data: a stream has no epoch length")
        steps_per_epoch = max(1, len(self.batch_sampler) // cfg.train.grad_accum_steps)
        if cfg.train.epochs:
            cfg.train.max_steps = max(1, math.ceil(cfg.train.epochs * steps_per_epoch))
        for section in (cfg.eval, cfg.ckpt):
            if section.every_epochs:
                section.every_steps = max(1, round(section.every_epochs * steps_per_epoch))

    def _build_batch_sampler(self, train_set: Any, epoch_aware: bool) -> RankBatchSampler | BalancedBatchSampler:
        """This rank's batch sampler: fixed counts, or balanced/budgeted by the task's unit sizes."""
        cfg, acc = self.cfg, self.accelerator
        if cfg.data.batching == "fixed":
            self.train_sampler = EpochSampler(len(train_set), cfg.run.seed, cfg.data.shuffle,
                                              multiple_of=acc.num_processes * cfg.train.per_device_batch_size)
            return RankBatchSampler(self.train_sampler, cfg.train.per_device_batch_size, acc.process_index,
                                    acc.num_processes, with_epoch=epoch_aware)
        sizes = self.task.unit_sizes(train_set)
        if sizes is None:
            raise ConfigError(f"data.batching={cfg.data.batching} needs unit sizes, which task "
                              f"'{cfg.task.name}' does not give (Task.unit_sizes)")
        try:
            self.train_sampler = BalancedBatchSampler(
                sizes, mode=cfg.data.batching, seed=cfg.run.seed, rank=acc.process_index,
                world_size=acc.num_processes, shuffle=cfg.data.shuffle, batch_size=cfg.train.per_device_batch_size,
                max_units=cfg.data.max_units_per_batch, bucket_size=cfg.data.bucket_size, with_epoch=epoch_aware)
        except ValueError as err:
            raise ConfigError(f"data.batching={cfg.data.batching}: {err}") from err
        return self.train_sampler

    def _micro_batches(self, consumed: int) -> Iterator[Any]:
        """Endless micro-batches of this rank, starting after `consumed` of them (epochs follow one another).

        Map-style data: the position follows from `consumed` (same number of batches per epoch on every
        rank). Streams: each rank resumes from its own saved (epoch, batch) position.
        """
        device = self.accelerator.device
        if self.streaming:
            epoch, skip = self._data_position
        else:
            epoch, skip = self.batch_sampler.position(consumed)
        while True:
            self._loader_generator.manual_seed(self.cfg.run.seed * 1_000_003 + self.accelerator.process_index * 10_007 + epoch)
            if self.streaming:
                if isinstance(self.train_loader.dataset, EpochAwareStream):
                    self.train_loader.dataset.set_epoch(epoch)
                loader = itertools.islice(self.train_loader, skip, None)  # a stream can only skip by reading
            else:
                self.batch_sampler.set_epoch(epoch, skip)
                loader = self.train_loader
            for position, batch in enumerate(loader, start=skip + 1):
                self._data_position = (epoch, position)
                yield batch if device.type == "cpu" else send_to_device(batch, device, non_blocking=True)
            epoch, skip = epoch + 1, 0

    # ------------------------------------------------------------------ loop
    def fit(self) -> str:
        """Train to train.max_steps; returns `completed` or `preempted`."""
        acc, t = self.accelerator, self.cfg.train
        watcher = PreemptionWatcher(acc.num_processes)
        micro = self._micro_batches(self.state.step * t.grad_accum_steps)
        bar = tqdm(total=t.max_steps, initial=self.state.step, desc="train", dynamic_ncols=True,
                   disable=not (acc.is_main_process and self.cfg.log.progress_bar))
        window = _Window()
        status = "completed"
        saved_at = self.state.step if self.resumed_from else -1  # that step is on disk already
        self.model.train()
        while self.state.step < t.max_steps:
            batches = [next(micro) for _ in range(t.grad_accum_steps)]
            stats = self.train_step(batches)
            self.state.step += 1
            step = self.state.step
            window.add(stats, sum(self.task.batch_size(b) for b in batches))
            bar.update(1)
            if step % self.cfg.log.every_steps == 0 or step == t.max_steps:
                self._log_train(window, stats, bar)
            improved = False
            if self.cfg.eval.every_steps and step % self.cfg.eval.every_steps == 0 and step < t.max_steps:
                improved = self._track_best(self.evaluate())
            if step < t.max_steps and (improved or (self.cfg.ckpt.every_steps and step % self.cfg.ckpt.every_steps == 0)):
                self.save(best=improved)
                saved_at = step
            if watcher.should_stop():
                status = "preempted"
                break
        bar.close()
        if self.resumed_from is not None and saved_at == self.state.step and status == "completed":
            watcher.close()  # resumed a finished run: its final eval and checkpoint exist already
            acc.end_training()
            return status
        self._finish(status, saved_at, watcher)
        return status

    def _finish(self, status: str, saved_at: int, watcher: PreemptionWatcher) -> None:
        """Final eval and checkpoint of a completed run, or the checkpoint and marker of a preempted one."""
        acc = self.accelerator
        improved = self._track_best(self.evaluate()) if status == "completed" else False
        if status == "completed":
            self.evaluate("test")
        if saved_at != self.state.step or improved:
            self.save(best=improved)
        marker = self.run_dir / "preempted.json"
        if acc.is_main_process:
            marker.unlink(missing_ok=True)
            if status == "preempted":
                # Launchers (torchrun's agent) replace our exit status; batch scripts look for this file.
                ckpt.atomic_write_text(marker, json.dumps({"step": self.state.step, "signal": watcher.received}))
                logger.warning("stop requested by %s: checkpoint at step %d written, exiting with status %d",
                               watcher.received or "another rank", self.state.step, PREEMPTED_EXIT_CODE)
        watcher.close()
        acc.wait_for_everyone()
        acc.end_training()

    def train_step(self, batches: list[Any]) -> dict[str, Any]:
        """One optimizer step over `batches` (grad_accum_steps micro-batches of this rank).

        The step's loss is the weighted mean over all micro-batches of all ranks, each weighted by
        its units (`task.batch_weight`), so micro-batches of different sizes count correctly.
        """
        acc, accum = self.accelerator, len(batches)
        fractions, local_units = self._unit_fractions(batches)
        shares = []
        for batch, fraction in zip(batches, fractions):
            with acc.accumulate(self.model) if accum > 1 else contextlib.nullcontext():
                out = self.task.loss(self.model, batch)
                share = out.loss.float() if isinstance(fraction, float) and fraction == 1.0 else out.loss.float() * fraction
                self._backward(share)
                shares.append(share.detach())
                if acc.sync_gradients:
                    step_loss = shares[0] if accum == 1 else torch.stack(shares).sum()
                    grad_norm, skipped = self._clip_and_guard(step_loss)
                    self._optimizer_step()
        if self.ema is not None:
            self.ema.update(acc.unwrap_model(self.model), skipped=skipped)
        return {"loss": step_loss, "units": local_units, "grad_norm": grad_norm,
                **{k: v.detach() for k, v in out.logs.items()}}

    def _unit_fractions(self, batches: list[Any]) -> tuple[list, Any]:
        """Each micro-batch's share of the units of the whole step (all ranks), and this rank's units."""
        acc = self.accelerator
        weights = [self.task.batch_weight(b) for b in batches]
        if acc.num_processes == 1 and all(isinstance(w, (int, float)) for w in weights):
            total = float(sum(weights))  # host numbers: no device work at all
            return [w / total for w in weights], total
        weights = [w.to(acc.device, torch.float32) if isinstance(w, torch.Tensor)
                   else torch.full((), float(w), dtype=torch.float32, device=acc.device) for w in weights]
        local = weights[0] if len(weights) == 1 else torch.stack(weights).sum()
        total = acc.reduce(local, reduction="sum") if acc.num_processes > 1 else local
        return [w / total for w in weights], local

    def _backward(self, share: torch.Tensor) -> None:
        # accelerate divides by the accumulation steps and DDP/ZeRO average over ranks: undo both so the
        # gradient is that of the global weighted mean.
        acc = self.accelerator
        if self._plain_step:
            (share * acc.num_processes if acc.num_processes > 1 else share).backward()
        else:
            acc.backward(share * (acc.num_processes * self.cfg.train.grad_accum_steps))

    def _optimizer_step(self) -> None:
        if self._plain_step:
            self.optimizer.optimizer.step()
            self.optimizer.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _clip_and_guard(self, step_loss: torch.Tensor) -> tuple[Any, Any]:
        """Clip gradients, and arrange for a step with a non-finite loss or gradient to be skipped
        without a host sync (fused optimizers honour `found_inf`, as under a GradScaler).
        Returns (grad norm, 0/1 tensor: step skipped), both None under DeepSpeed."""
        acc, max_norm = self.accelerator, self.cfg.train.grad_clip_norm
        if self.is_deepspeed:
            # DeepSpeed clips (gradient_clipping) and skips overflowing steps inside its own step.
            return None, None
        max_norm = max_norm if max_norm > 0 else math.inf
        if self._plain_step:
            grad_norm = torch.nn.utils.clip_grad_norm_(self._trainable, max_norm, foreach=True)
        else:
            grad_norm = acc.clip_grad_norm_(self._trainable, max_norm)
        if not self.cfg.train.skip_nonfinite:
            return grad_norm.detach(), None
        # x * 0 is 0 for finite x and NaN otherwise; ne_(0) turns that into a 0./1. flag in place.
        if acc.num_processes == 1:
            skipped = grad_norm.add(step_loss).mul_(0).ne_(0)
        else:  # the gradient norm is global, the loss is not: every rank must take the same decision
            bad_loss = acc.reduce(step_loss.mul(0).ne_(0), reduction="sum")
            skipped = grad_norm.mul(0).ne_(0).add_(bad_loss).clamp_(max=1)
        self._bad_flags.append(skipped)
        if acc.scaler is None:  # with fp16 the GradScaler owns found_inf and skips by itself
            inner = self.optimizer.optimizer
            inner.grad_scale = None
            inner.found_inf = skipped
        return grad_norm.detach(), skipped

    def _nonfinite_counts(self) -> tuple[int, int]:
        """(skipped steps so far, longest run of skipped steps since the last check); reads the device."""
        if self.is_deepspeed:
            skipped = int(getattr(self.model, "skipped_steps", 0))
            new, self._ds_skipped = skipped - self._ds_skipped, skipped
            self.state.nonfinite_skipped += new
            return self.state.nonfinite_skipped, new  # DeepSpeed counts, it does not report runs
        flags = torch.stack(self._bad_flags).tolist() if self._bad_flags else []
        self._bad_flags.clear()
        longest = 0
        for bad in flags:
            self._bad_run = self._bad_run + 1 if bad else 0
            longest = max(longest, self._bad_run)
        self.state.nonfinite_skipped += sum(flags)
        return self.state.nonfinite_skipped, longest

    # ------------------------------------------------------------------ logging
    def _log_train(self, window: "_Window", stats: dict[str, torch.Tensor], bar: tqdm) -> None:
        acc = self.accelerator
        totals = torch.stack([torch.stack(window.losses).sum().float(),
                              torch.as_tensor(window.units, dtype=torch.float32, device=acc.device),
                              torch.tensor(float(window.samples), device=acc.device)])
        if acc.num_processes > 1:
            totals = acc.reduce(totals, reduction="sum")
        loss_sum, units, samples = totals.tolist()
        elapsed = time.perf_counter() - window.start
        total_bad, run_max = self._nonfinite_counts()
        # Under fp16 a loss scaler overflows on purpose now and then: count those steps, never abort.
        if run_max >= self.cfg.train.max_nonfinite_in_row and self.cfg.train.mixed_precision != "fp16":
            raise NonFiniteLossError(
                f"{run_max} optimizer steps in a row had a non-finite loss or gradient (up to step "
                f"{self.state.step}); lower optim.lr, enable train.grad_clip_norm or check the data")
        grad_norm = stats["grad_norm"]
        if grad_norm is None and self.is_deepspeed:
            grad_norm = self.model.get_global_grad_norm()
        record = {"step": self.state.step, "loss": loss_sum / len(window.losses), "lr": self.scheduler.get_last_lr()[0],
                  "grad_norm": float(grad_norm) if grad_norm is not None else None,
                  "samples_per_s": samples / elapsed, f"{self.task.unit}_per_s": units / elapsed,
                  "step_time_s": elapsed / len(window.losses), "peak_memory_mb": peak_memory_mb(acc.device),
                  "nonfinite_skipped": total_bad, "epoch": self._data_position[0] if self.streaming else
                  self.state.step * self.cfg.train.grad_accum_steps / len(self.batch_sampler)}
        record.update({k: float(v) for k, v in stats.items() if k not in ("loss", "units", "grad_norm")})
        if record["grad_norm"] is not None and self.is_deepspeed and not math.isfinite(record["grad_norm"]):
            record["grad_norm"] = None
        self._write(record)
        if acc.is_main_process:
            bar.set_postfix(loss=f"{record['loss']:.4g}", lr=f"{record['lr']:.2g}")
        window.reset()

    def _write(self, record: dict[str, Any]) -> None:
        if not self.accelerator.is_main_process:
            return
        self.metrics.write(record)
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.accelerator.log_with:
            self.accelerator.log(scalars, step=record["step"])

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self, split: str = "eval") -> dict[str, float]:
        """Metrics over the whole eval (or test) set, each sample once whatever world size and batch.

        The test split (`TaskData.test`) is evaluated once, at the end of a completed run;
        the main process then hands all its per-sample values to `Task.write_report` (e.g. a parity plot).
        """
        loader = self.eval_loader if split == "eval" else self.test_loader
        if loader is None:
            return {}
        acc = self.accelerator
        self.model.eval()
        values: dict[str, list[torch.Tensor]] = defaultdict(list)
        use_ema = self.ema.applied_to(acc.unwrap_model(self.model)) if self.ema else contextlib.nullcontext()
        with use_ema:
            for batch in loader:
                out = acc.gather_for_metrics(self.task.eval_step(self.model, batch))
                for key, value in out.items():
                    values[key].append(value.detach().float().cpu())
        self.model.train()
        joined = {k: torch.cat(v) for k, v in values.items()}
        metrics = self.task.reduce_metrics(joined)
        if split == "eval":
            self.last_eval = metrics
        self._write({"step": self.state.step, **{f"{split}/{k}": v for k, v in metrics.items()}})
        if split == "test" and acc.is_main_process:
            self.task.write_report(joined, metrics, self.run_dir / "test")
        return metrics

    def _track_best(self, metrics: dict[str, float]) -> bool:
        name = self.cfg.eval.metric
        if name not in metrics:
            if metrics:
                logger.warning("eval.metric '%s' is not among the eval metrics %s", name, sorted(metrics))
            return False
        value, best = metrics[name], self.state.best_metric
        better = best is None or (value < best if self.cfg.eval.mode == "min" else value > best)
        if better:
            self.state.best_metric, self.state.best_step = value, self.state.step
        return better

    # ------------------------------------------------------------------ checkpoints
    def save(self, best: bool = False) -> Path:
        """Write a complete checkpoint atomically (every rank takes part) and rotate old ones."""
        acc = self.accelerator
        name = ckpt.step_dir_name(self.state.step)
        tmp, final = self.ckpt_root / f".tmp-{name}", self.ckpt_root / name
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp), safe_serialization=True)
        if self.ema is not None:
            full = self.ema.full_state(acc.unwrap_model(self.model), acc.gather)  # fp32, collective
            if acc.is_main_process:
                save_file(full, str(tmp / "ema.safetensors"))
        acc.wait_for_everyone()
        positions = [list(self._data_position)]
        if self.streaming and acc.num_processes > 1:
            positions = gather_object(positions)  # collective: every rank is in save()
        if acc.is_main_process:
            (tmp / ckpt.TASK_STATS).write_text(json.dumps(self.task.stats, indent=1))
            artifacts = [ckpt.TASK_STATS, *self.task.save_artifacts(tmp)]
            state = {**dataclasses.asdict(self.state), "scheduler": self.scheduler.state_dict(),
                     "data_positions": positions, "artifacts": artifacts}
            ckpt.write_manifest(tmp, state, with_hashes=self.cfg.ckpt.verify)
            ckpt.finalize(tmp, final, self.ckpt_root, best=best)
            ckpt.rotate(self.ckpt_root, self.cfg.ckpt.keep_last)
        acc.wait_for_everyone()
        return final


class _Window:
    """Per-rank running totals between two logging steps (device tensors are summed only when logging)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.units: Any = 0.0
        self.samples = 0
        self.start = time.perf_counter()

    def add(self, stats: dict[str, Any], samples: int) -> None:
        self.losses.append(stats["loss"])
        self.units = self.units + stats["units"]
        self.samples += samples


def _flat_hparams(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat_hparams(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out

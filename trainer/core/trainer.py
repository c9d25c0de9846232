"""The Trainer: plain PyTorch plus Accelerator verbs.

Read top to bottom: `__init__` builds task, data, model and optimizer, prepares them and resumes;
`fit` runs optimizer steps (`train_step`), evaluates (`evaluate`) and checkpoints (`save`), then
prints a summary. Its parts live beside it: loaders.py (this rank's batches), step_guard.py
(clipping and sync-free skipping of non-finite steps), resume.py (checkpoint save and resume),
ema.py, distributed.py, metrics_log.py. The loop never branches on the task.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType, set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from trainer.atomic_io import atomic_write_text
from trainer.config import Config, ConfigError, config_to_dict, save_config
from trainer.core import checkpoint as ckpt
from trainer.core.distributed import (
    PREEMPTED_EXIT_CODE,
    PreemptionWatcher,
    build_accelerator,
    compile_model,
    scale_factor,
    unwrap_model,
)
from trainer.core.ema import EMA
from trainer.core.host_memory import HeapTrimmer
from trainer.core.loaders import TrainBatches, agreed_start, build_eval_loader, resolve_epochs
from trainer.core.metrics_log import MetricsLog, peak_memory_mb
from trainer.core.resume import TrainState, load_weights, resume, save_checkpoint
from trainer.core.run_lock import release_run_lock
from trainer.core.sampling import generate_distributed
from trainer.core.step_guard import NonFiniteLossError, StepGuard
from trainer.registry import get_task
from trainer.rundir import RunDir
from trainer.task import GenerativeTask

__all__ = ["NonFiniteLossError", "TrainState", "Trainer", "build_optimizer"]

logger = logging.getLogger("trainer")


def build_optimizer(cfg: Config, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Fused optimizer (sync-free skipping via `found_inf`); no weight decay on biases and norms unless
    `optim.decay_all_parameters`."""
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    if o.weight_decay and o.decay_all_parameters:
        groups = [{"params": params, "weight_decay": o.weight_decay}]
    elif o.weight_decay:
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
    else:  # one group, one fused kernel call a step (a second one costs ~1 % of a small model's step)
        groups = [{"params": params, "weight_decay": 0.0}]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=o.momentum, fused=True)
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(groups, lr=lr, betas=tuple(o.betas), eps=o.eps, fused=True)


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, warmup_steps: int) -> Any:
    """A `transformers.get_scheduler` schedule, or `step`: linear warm-up, then StepLR's decay."""
    o = cfg.optim
    if o.scheduler != "step":
        return get_scheduler(o.scheduler, optimizer, num_warmup_steps=warmup_steps,
                             num_training_steps=cfg.train.max_steps)
    if o.decay_every_steps < 1:
        raise ConfigError("optim.scheduler=step needs optim.decay_every_steps (or decay_every_epochs) > 0")

    def factor(step: int) -> float:
        warm = step / warmup_steps if step < warmup_steps else 1.0
        return warm * o.decay_gamma ** (step // o.decay_every_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Trainer:
    """Train `cfg`'s task under whatever launcher and backend started this process (`fit`)."""

    def __init__(self, cfg: Config, deepspeed_config: str | None = None):
        self.cfg = cfg
        self.accelerator = acc = build_accelerator(cfg, deepspeed_config)
        self.is_deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
        self.is_main = acc.is_main_process
        if self.is_deepspeed and cfg.train.grad_clip_value > 0:
            raise ConfigError("train.grad_clip_value > 0 is not supported under DeepSpeed (its engine clips by norm "
                              "only): use train.grad_clip_norm")
        if acc.distributed_type == DistributedType.FSDP and cfg.train.ema_decay > 0:
            raise ConfigError("train.ema_decay > 0 is not supported under FSDP yet (DDP and ZeRO-1/2/3 are)")
        self.run_dir = RunDir(cfg.run.output_dir)
        world, t = acc.num_processes, cfg.train

        # Task, data and model: data first, the model is built from its statistics.
        self.task = get_task(cfg.task.name)(cfg.task, seed=cfg.run.seed)
        with acc.main_process_first():  # the main process fills the data caches, the others read them
            data = self.task.build_data()
        self.task.attach_stats(data.stats)
        set_seed(cfg.run.seed)  # identical initial weights on every rank
        model = self.task.build_model(data.stats)
        if t.compile:
            compile_model(model, acc.distributed_type)
        self.data = TrainBatches(cfg, self.task, data.train, acc.process_index, world, acc.device)
        self.train_loader, self.streaming = self.data.loader, self.data.streaming
        resolve_epochs(cfg, self.data.batches_per_epoch)

        # Optimizer and schedule, with lr and warm-up scaled to the world size.
        factor = scale_factor(cfg.optim.scale_lr, world, cfg.optim.base_world_size)
        self.lr = cfg.optim.lr * factor
        self.warmup_steps = round(cfg.optim.warmup_steps * (factor if cfg.optim.scale_warmup else 1.0))
        optimizer = build_optimizer(cfg, model, self.lr)
        self.scheduler = build_scheduler(cfg, optimizer, self.warmup_steps)

        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.eval_loader = self.test_loader = None
        if data.eval is not None:
            self.eval_loader = acc.prepare(build_eval_loader(cfg, self.task, data.eval))
        if data.test is not None:
            self.test_loader = acc.prepare(build_eval_loader(cfg, self.task, data.test))
        set_seed(cfg.run.seed + acc.process_index)  # independent noise/dropout streams per rank

        self.ema = EMA(unwrap_model(acc, self.model), t.ema_decay) if t.ema_decay > 0 else None
        # Plain PyTorch calls where accelerate's wrappers would only forward them (they cost ~0.3 ms a step).
        self._plain_step = (not self.is_deepspeed and acc.scaler is None
                            and acc.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU,
                                                         DistributedType.MULTI_GPU))
        self.guard = StepGuard(acc, self.optimizer.optimizer, [p for p in self.model.parameters() if p.requires_grad],
                               max_norm=t.grad_clip_norm, clip_value=t.grad_clip_value, skip_nonfinite=t.skip_nonfinite,
                               max_in_row=t.max_nonfinite_in_row, plain=self._plain_step,
                               deepspeed=self.is_deepspeed, fp16=t.mixed_precision == "fp16")
        self.state = TrainState(world_size=world, backend=str(acc.distributed_type.value),
                                grad_accum_steps=t.grad_accum_steps)
        self.last_eval: dict[str, float] = {}
        self.test_weights_step: int | None = None
        """The step whose weights the test pass used (eval.test_weights), None: the current step."""

        self.resumed_from = resume(self)
        if acc.is_main_process:
            self.run_dir.root.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir.config)
            self.metrics = MetricsLog(self.run_dir, self.state.step if self.resumed_from else None)
            if acc.log_with:
                acc.init_trackers(cfg.log.project, config=_flat_hparams(config_to_dict(cfg)))
        self._log_start()

    # ------------------------------------------------------------------ loop
    def fit(self) -> str:
        """Train to train.max_steps; returns `completed` or `preempted`."""
        acc, cfg, t = self.accelerator, self.cfg, self.cfg.train
        watcher = PreemptionWatcher(acc.num_processes)
        micro = agreed_start(self.data.micro_batches(self.state.step * t.grad_accum_steps), acc)
        bar = tqdm(total=t.max_steps, initial=self.state.step, desc="train", dynamic_ncols=True,
                   disable=not (acc.is_main_process and cfg.log.progress_bar))
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
            if step % cfg.log.every_steps == 0 or step == t.max_steps:
                self._log_train(window, stats, bar)
            improved = False
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < t.max_steps:
                improved = self._track_best(self.evaluate())
            if step < t.max_steps and (improved or (cfg.ckpt.every_steps and step % cfg.ckpt.every_steps == 0)):
                self.save(best=improved)
                saved_at = step
            if watcher.should_stop():
                status = "preempted"
                break
        bar.close()
        # A resumed run that had finished already has its final eval and checkpoint.
        if not (self.resumed_from is not None and saved_at == self.state.step and status == "completed"):
            self._finish(status, saved_at, watcher)
        watcher.close()
        acc.wait_for_everyone()
        acc.end_training()
        if acc.is_main_process:
            self._summary(status)
            self.metrics.close()
            release_run_lock(cfg.run.output_dir)  # now, not at exit: a notebook may start another run here
        return status

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
                share = out.loss.float()
                if not (isinstance(fraction, float) and fraction == 1.0):  # skip a multiply by exactly 1
                    share = share * fraction
                self._backward(share)
                shares.append(share.detach())
        grad_norm, skipped = self.guard.clip()  # after the last backward: gradients are synchronised
        self._optimizer_step()
        if self.ema is not None:
            self.ema.update(unwrap_model(acc, self.model), skipped=skipped)
        step_loss = shares[0] if accum == 1 else torch.stack(shares).sum()
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
        acc, seed = self.accelerator, self.guard.backward_seed(share)
        if self._plain_step:
            (share * acc.num_processes if acc.num_processes > 1 else share).backward(seed)
        else:  # the seed is None under DeepSpeed, whose backward takes no gradient
            acc.backward(share * (acc.num_processes * self.cfg.train.grad_accum_steps),
                         **({} if seed is None else {"gradient": seed}))

    def _optimizer_step(self) -> None:
        optimizer = self.optimizer.optimizer if self._plain_step else self.optimizer
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

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
        use_ema = self.ema.applied_to(unwrap_model(acc, self.model)) if self.ema else contextlib.nullcontext()
        trim = HeapTrimmer()  # the kept outputs fragment the heap between large batches (host_memory.py)
        with use_ema:
            for batch in loader:
                out = acc.gather_for_metrics(self.task.eval_step(self.model, batch))
                for key, value in out.items():
                    values[key].append(value.detach().float().cpu())
                trim()
            scores = self._sample_scores() if split == "eval" else {}
        self.model.train()
        joined = {k: torch.cat(v) for k, v in values.items()}
        metrics = {**self.task.reduce_metrics(joined), **scores}
        if split == "eval":
            self.last_eval = metrics
        record = {"step": self.state.step, **{f"{split}/{k}": v for k, v in metrics.items()}}
        if split == "test":
            record["test/weights_step"] = self.state.step if self.test_weights_step is None else self.test_weights_step
        self._write(record)
        if split == "test" and acc.is_main_process:
            self.task.write_report(joined, metrics, self.run_dir.test, loader.dataset)
        return metrics

    def _sample_scores(self) -> dict[str, float]:
        """At every eval.sample_every-th evaluation (and the final one) a generative task draws
        eval.num_samples samples over the ranks (EMA weights where kept) and scores them: `sample_<name>`."""
        every, step = self.cfg.eval.sample_every, self.state.step
        if not every or not isinstance(self.task, GenerativeTask):
            return {}
        index = math.ceil(step / self.cfg.eval.every_steps) if self.cfg.eval.every_steps else 1
        if index % every and step < self.cfg.train.max_steps:
            return {}
        acc = self.accelerator
        if acc.distributed_type == DistributedType.FSDP or (self.is_deepspeed and self._zero_stage() == 3):
            logger.warning("eval.sample_every: sample metrics need whole weights on every rank; skipped under "
                           "FSDP / ZeRO-3 (run `trainer sample` on the checkpoint instead)")
            return {}
        options = self.task.eval_sample_config(self.cfg.eval.num_samples, self.cfg.run.seed)
        samples = generate_distributed(self.task, unwrap_model(acc, self.model), options, acc.process_index,
                                       acc.num_processes, acc.device)
        scores = self.task.score_samples(samples, options) if acc.is_main_process else {}
        if acc.num_processes > 1:  # every rank logs and may select the best checkpoint on the same numbers
            from accelerate.utils import broadcast_object_list

            scores = broadcast_object_list([scores])[0]
        return {f"sample_{k}": float(v) for k, v in scores.items()}

    def _zero_stage(self) -> int:
        plugin = self.accelerator.state.deepspeed_plugin
        return int(plugin.zero_stage) if plugin is not None else 0

    def _track_best(self, metrics: dict[str, float]) -> bool:
        name = self.cfg.eval.metric or self.task.metrics[0]  # load_config resolves it; a hand-built Config may not
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
        return save_checkpoint(self, best=best)

    def _finish(self, status: str, saved_at: int, watcher: PreemptionWatcher) -> None:
        """Final eval, test and checkpoint of a completed run, or the checkpoint and marker of a preempted one."""
        improved = False
        if status == "completed":
            improved = self._track_best(self.evaluate())
        if saved_at != self.state.step or improved:
            self.save(best=improved)
        if status == "completed" and self.test_loader is not None:
            self._load_test_weights()
            self.evaluate("test")
        if self.accelerator.is_main_process:
            self.run_dir.preempted.unlink(missing_ok=True)
            if status == "preempted":
                # Launchers (torchrun's agent) replace our exit status; batch scripts look for this file.
                atomic_write_text(self.run_dir.preempted,
                                  json.dumps({"step": self.state.step, "signal": watcher.received}))
                logger.warning("stop requested by %s: checkpoint at step %d written, exiting with status %d",
                               watcher.received or "another rank", self.state.step, PREEMPTED_EXIT_CODE)

    def _load_test_weights(self) -> None:
        """eval.test_weights=best: load the best checkpoint's weights (and EMA) for the test pass."""
        if self.cfg.eval.test_weights != "best" or self.state.best_step in (None, self.state.step):
            return
        path = ckpt.best_checkpoint(self.run_dir.checkpoints)
        if path is None:
            logger.warning("eval.test_weights=best: no best checkpoint under %s; testing the final weights",
                           self.run_dir.checkpoints)
            return
        load_weights(self, path)
        self.test_weights_step = self.state.best_step
        if self.is_main:
            logger.info("test with the best checkpoint's weights: %s (step %d, eval %s %.6g)", path.name,
                        self.state.best_step, self.cfg.eval.metric, self.state.best_metric)

    # ------------------------------------------------------------------ logging
    def _log_start(self) -> None:
        acc, t = self.accelerator, self.cfg.train
        effective = t.per_device_batch_size * t.grad_accum_steps * acc.num_processes
        lines = [f"backend={acc.distributed_type.value} processes={acc.num_processes} device={acc.device} "
                 f"precision={t.mixed_precision}",
                 f"effective batch = {t.per_device_batch_size} per device x {t.grad_accum_steps} accum x "
                 f"{acc.num_processes} processes = {effective}",
                 f"lr = {self.lr:.3g} (optim.lr {self.cfg.optim.lr:.3g}, scale_lr={self.cfg.optim.scale_lr}), "
                 f"warmup = {self.warmup_steps} steps, schedule={self.cfg.optim.scheduler}"]
        sampler = self.data.sampler
        if sampler is not None and sampler.dropped_per_epoch:
            lines.append(f"{sampler.dropped_per_epoch} of {sampler.num_samples} training samples left out per "
                         f"epoch (a different remainder each epoch) so ranks stay even")
        if self.resumed_from:
            lines.append(f"resumed from {self.resumed_from} at step {self.state.step}")
        if acc.is_main_process:
            for line in lines:
                logger.info(line)
            self.metrics.write({"step": self.state.step, "event": "start", "effective_batch_size": effective,
                                "scaled_lr": self.lr, "warmup_steps": self.warmup_steps,
                                "world_size": acc.num_processes})

    def _log_train(self, window: _Window, stats: dict[str, Any], bar: tqdm) -> None:
        """The logging step: the only place the loop reads the device (losses, units, skipped steps)."""
        acc = self.accelerator
        totals = torch.stack([torch.stack(window.losses).sum().float(),
                              torch.as_tensor(window.units, dtype=torch.float32, device=acc.device),
                              torch.tensor(float(window.samples), device=acc.device)])
        if acc.num_processes > 1:
            totals = acc.reduce(totals, reduction="sum")
        loss_sum, units, samples = totals.tolist()
        elapsed = time.perf_counter() - window.start
        new_skipped, longest = self.guard.read(self.model)
        self.state.nonfinite_skipped += new_skipped
        self.guard.check(longest, self.state.step)
        grad_norm = stats["grad_norm"]
        if grad_norm is None and self.is_deepspeed:
            grad_norm = self.model.get_global_grad_norm()  # the engine clipped; None or inf after an overflow
        grad_norm = float(grad_norm) if grad_norm is not None else None
        if self.is_deepspeed and grad_norm is not None and not math.isfinite(grad_norm):
            grad_norm = None
        steps = len(window.losses)
        record = {"step": self.state.step, "loss": loss_sum / steps, "lr": self.scheduler.get_last_lr()[0],
                  "grad_norm": grad_norm, "samples_per_s": samples / elapsed,
                  f"{self.task.unit}_per_s": units / elapsed,
                  "step_time_s": elapsed / steps, "peak_memory_mb": peak_memory_mb(acc.device),
                  "nonfinite_skipped": self.state.nonfinite_skipped,
                  "epoch": self.data.epoch(self.state.step * self.cfg.train.grad_accum_steps)}
        record.update({k: float(v) for k, v in stats.items() if k not in ("loss", "units", "grad_norm")})
        self._write(record)
        if self.is_main:
            bar.set_postfix(loss=f"{record['loss']:.4g}", lr=f"{record['lr']:.2g}")
        window.reset()

    def _write(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        self.metrics.write(record)
        if self.accelerator.log_with:
            scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self.accelerator.log(scalars, step=record["step"])

    def _summary(self, status: str) -> None:
        """Main process, end of fit: where the run stands and what to run next."""
        run = self.run_dir
        records = run.read_metrics(missing_ok=True)
        evals = [r for r in records if any(k.startswith("eval/") for k in r)]
        tests = [r for r in records if any(k.startswith("test/") for k in r)]
        best_eval = next((r for r in evals if r["step"] == self.state.best_step), None)
        skipped = self.state.nonfinite_skipped
        lines = [f"run {status} at step {self.state.step} of {self.cfg.train.max_steps}"
                 + (f" ({skipped} non-finite steps skipped)" if skipped else "")]
        if evals:
            lines.append(f"  final eval (step {evals[-1]['step']}): {_format_metrics(evals[-1], 'eval/')}")
        if best_eval is not None:
            lines.append(f"  best eval  (step {best_eval['step']}, {self.cfg.eval.metric} {self.cfg.eval.mode}): "
                         f"{_format_metrics(best_eval, 'eval/')}")
        if tests:
            lines.append(f"  test: {_format_metrics(tests[-1], 'test/')}  (report in {run.test})")
        best = ckpt.read_pointer(run.checkpoints, "best")
        latest = ckpt.read_pointer(run.checkpoints, "latest")
        lines.append(f"  run directory: {run.root}  (config.yaml, metrics.jsonl"
                     + (", tb/)" if self.cfg.log.tensorboard else ")"))
        lines.append(f"  checkpoints: best {best or '-'}, latest {latest or '-'}")
        if status == "preempted":
            lines.append("  resume: run the same command again (run.resume=auto continues from the latest checkpoint)")
        lines.append(f"  export: trainer export {run.root}  -> {run.exported_model}")
        lines.append(f"  plots:  trainer plot {run.root}  -> {run.plots}/")
        logger.info("\n".join(lines))


def _format_metrics(record: dict[str, Any], prefix: str) -> str:
    return ", ".join(f"{k[len(prefix):]} {v:.4g}" if isinstance(v, float) else f"{k[len(prefix):]} {v}"
                     for k, v in record.items() if k.startswith(prefix))


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

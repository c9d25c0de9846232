"""The Trainer: plain PyTorch plus Accelerator verbs.

Read top to bottom: `__init__` builds task, data, model and optimizer, prepares them and resumes;
`fit` runs optimizer steps (`train_step`), evaluates (`evaluate`) and checkpoints (`save`). Its parts
live beside it: engine.py (what differs per backend: backward scaling, clipping, the optimizer step,
skipped steps), loaders.py (this rank's batches and their shares of a step's loss), checkpoint/ (the
resume target, checkpoint save and resume), preemption.py (stop signals, agreed at a step's end or an
evaluation batch), ema.py, run_logger.py (start lines, logging steps, the summary), optim.py. The loop
never branches on the task or the backend.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, set_seed
from tqdm.auto import tqdm

from trainer.config import Config, save_config
from trainer.core.batch_plan import plan_batch
from trainer.core.checkpoint import pick_resume_target, store
from trainer.core.checkpoint.cadence import SaveClock
from trainer.core.checkpoint.convert import optimizer_param_names
from trainer.core.checkpoint.export import load_initial_weights
from trainer.core.checkpoint.manager import Checkpointer
from trainer.core.checkpoint.parts import (
    BackendState,
    DataPosition,
    EMAState,
    RNGState,
    TaskStats,
    TaskTrainingState,
    TrainState,
)
from trainer.core.command_line import already_complete_line
from trainer.core.distributed import build_accelerator, compile_model, unwrap_model
from trainer.core.elastic import MembershipWatch, restartable, resume_on_restart
from trainer.core.ema import EMA
from trainer.core.engine import build_engine, check_backend_supports
from trainer.core.generation import generate_distributed
from trainer.core.host_memory import EvalOutputs, HeapTrimmer
from trainer.core.loaders import MicroBatch, TrainBatches, agreed_start, build_eval_loader, unit_fractions
from trainer.core.optim import build_optimizer, build_scheduler
from trainer.core.preemption import PreemptionWatcher, report_stop
from trainer.core.run_lock import release_run_lock
from trainer.core.run_logger import RunLogger, StepWindow
from trainer.core.run_plan import build_run_plan
from trainer.core.step_guard import NonFiniteLossError
from trainer.data.build_lock import task_build_once
from trainer.registry import get_task
from trainer.rundir import RunDir
from trainer.task import GenerativeTask, ReferenceModelTask, StatefulTask

__all__ = ["NonFiniteLossError", "TrainState", "Trainer"]

logger = logging.getLogger("trainer")


class Trainer:
    """Train `cfg`'s task under whatever launcher and backend started this process (`fit`)."""

    def __init__(self, cfg: Config, deepspeed_config: str | None = None):
        cfg = resume_on_restart(cfg)  # a restarted elastic worker group continues from the latest checkpoint
        self.cfg = cfg  # as loaded: what the run derives from it is `self.plan` (run_plan.py)
        # The checkpoint to resume, picked and verified once; its batch layout is planned on before the Accelerator
        # (which needs the layout): the checkpoint's global batch is kept on any world size.
        target = pick_resume_target(cfg)
        batch = plan_batch(cfg, saved=target.batch_layout)
        self.accelerator = acc = build_accelerator(cfg, batch, deepspeed_config)
        check_backend_supports(cfg, acc.distributed_type)
        self.is_main = acc.is_main_process
        self.run_dir = RunDir(cfg.run.output_dir)
        world, t = acc.num_processes, cfg.train

        # Task, data and model: data first, the model is built from its statistics.
        self.task = get_task(cfg.task.name)(cfg.task, seed=cfg.run.seed)
        # The first process to take a file lock in the cache folder builds the caches, the others wait on the lock
        # (no collective: a build may outlast run.collective_timeout_s) and then load them; one builder per
        # folder, so per node where the cache folder is node-local (trainer/data/build_lock.py).
        with task_build_once(cfg.task, cfg.run.seed):  # a file lock, no collective: a build may take hours
            data = self.task.build_data()
        self.task.attach_stats(data.stats)
        set_seed(cfg.run.seed)  # identical initial weights on every rank
        model = self.task.build_model(data.stats)
        if cfg.run.init_from:  # fine-tuning: another run's weights; a resume below then takes precedence
            load_initial_weights(model, cfg.run.init_from, cfg.run.init_weights)
        if isinstance(self.task, ReferenceModelTask):
            self.task.keep_reference_model(model)
        if t.compile:
            compile_model(model)
        self.data = TrainBatches(cfg, batch, self.task, data.train, acc.process_index, world, acc.device)
        self.train_loader, self.streaming = self.data.loader, self.data.streaming
        self.plan = plan = build_run_plan(cfg, batch, self.data.batches_per_epoch, tuple(self.task.metrics),
                                          target.path)
        self.lr, self.warmup_steps = plan.lr, plan.warmup_steps  # scaled to the world size

        optimizer = build_optimizer(cfg, model, self.lr)
        self.scheduler = build_scheduler(cfg, optimizer, plan)
        param_names = optimizer_param_names(model, optimizer)  # names the optimizer state in any layout

        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.engine = build_engine(acc, self.model, self.optimizer, cfg, plan.grad_accum_steps)
        self.eval_loader = self.test_loader = None
        if data.eval is not None:
            self.eval_loader = acc.prepare(build_eval_loader(cfg, self.task, data.eval, plan.per_device_batch_size, "eval"))
        if data.test is not None:
            self.test_loader = acc.prepare(build_eval_loader(cfg, self.task, data.test, plan.per_device_batch_size, "test"))
        set_seed(cfg.run.seed + acc.process_index)  # dropout's stream per rank (loss noise: MicroBatch.rng, per sample)

        self.ema = (EMA(unwrap_model(acc, self.model), t.ema_decay, self.engine, t.ema_warmup) if t.ema_decay > 0
                    else None)
        self.state = TrainState(world_size=world, backend=str(acc.distributed_type.value),
                                grad_accum_steps=batch.grad_accum_steps, per_device_batch_size=batch.per_device_batch_size,
                                global_batch_size=batch.global_batch, lr_world_size=batch.lr_world_size,
                                zero_stage=self.engine.zero_stage, task=cfg.task.name)
        self.last_eval: dict[str, float] = {}
        self.watcher: PreemptionWatcher | None = None
        """While `fit` runs: the stop signals, asked at every step's end and every evaluation batch."""
        self.test_weights_step: int | None = None
        """The step whose weights the test pass used (eval.test_weights), None: the current step."""

        rng = RNGState(acc, cfg.run.allow_inexact_resume)
        parts = {"train": self.state, "rng": rng,
                 "backend": BackendState(acc, self.engine, param_names, self.state, self.run_dir.checkpoints),
                 "data": DataPosition(self.data, acc), "scheduler": self.scheduler, "step_guard": self.engine.guard,
                 "task_stats": TaskStats(self.task, self.is_main)}
        if self.engine.adaptive_clip is not None:
            parts["grad_clip"] = self.engine.adaptive_clip
        if self.ema is not None:
            parts["ema"] = EMAState(self.ema, acc, self.model, self.state)
        self.stateful_task = self.task if isinstance(self.task, StatefulTask) else None
        """The task, where its loss carries state between optimizer steps (a protocol check is too slow per step)."""
        if self.stateful_task is not None:
            parts["task_state"] = TaskTrainingState(self.task, acc)
        self.checkpointer = Checkpointer(cfg, acc, self.run_dir, parts, target)
        self.save_clock = SaveClock(cfg.ckpt.every_seconds, world, cfg.run.collective_timeout_s)
        resumed = self.checkpointer.resume(finished=target.step >= plan.max_steps)
        self.resumed_from = resumed.path if resumed else None
        # A run resumed at its last step that was not stopped there has its final eval, test and checkpoint:
        # a rerun trains nothing and writes nothing (its results stay those of the run that made them).
        self.already_complete = (self.resumed_from is not None and self.state.step >= plan.max_steps
                                 and not self.run_dir.preempted.is_file())
        self.log = RunLogger(acc, cfg, plan, self.run_dir, self.task.unit)
        if self.already_complete:
            return
        if self.is_main:
            self.run_dir.root.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir.config)
            plan.write(self.run_dir.plan)
        self.log.open(self.state.step if self.resumed_from else None)
        self.log.start(self.state.step, self._start_notes())
        self.membership = MembershipWatch(self.run_dir.root, self.is_main, world, self.state.step, self.log.write)

    def _start_notes(self) -> list[str]:
        sampler, notes = self.data.sampler, []
        if sampler is not None and sampler.dropped_per_epoch:
            notes.append(f"{sampler.dropped_per_epoch} of {sampler.num_samples} training samples left out per "
                         f"epoch (a different remainder each epoch) so every step has a whole global batch")
        if self.resumed_from:
            notes.append(f"resumed from {self.resumed_from} at step {self.state.step}")
        if self.cfg.eval.sample_every and isinstance(self.task, GenerativeTask) and not self.engine.may_sample_in_eval:
            notes.append("eval.sample_every: no sample metrics in evaluation under FSDP / ZeRO-3 (they need whole "
                         "weights on every rank); run `trainer sample` on a checkpoint instead")
        return [*notes, *self.plan.batch.changes]

    # ------------------------------------------------------------------ loop
    def fit(self) -> str:
        """Train to the plan's max_steps; returns `completed`, `preempted` (SIGTERM/SIGUSR1) or `interrupted` (Ctrl-C)."""
        acc, cfg, plan = self.accelerator, self.cfg, self.plan
        if self.already_complete:
            return self._say_already_complete()
        # Under an elastic agent a stop signal is the agent restarting the group: the next group says what changed.
        quiet = restartable()
        self.watcher = watcher = PreemptionWatcher(acc.num_processes, announce=acc.is_main_process and not quiet)
        micro = agreed_start(self.data.micro_batches(self.state.step * plan.grad_accum_steps), acc)
        bar = tqdm(total=plan.max_steps, initial=self.state.step, desc="train", dynamic_ncols=True,
                   disable=not (acc.is_main_process and cfg.log.progress_bar))
        window = StepWindow()
        saved_at = self.state.step if self.resumed_from else -1  # that step is on disk already
        self.model.train()
        while self.state.step < plan.max_steps:
            batches = [next(micro) for _ in range(plan.grad_accum_steps)]
            stats = self.train_step(batches)
            self.state.step += 1
            step = self.state.step
            window.add(stats["loss"], stats["units"], sum(self.task.batch_size(b.batch) for b in batches))
            bar.update(1)
            self.membership.after_step(step)
            if step % cfg.log.every_steps == 0 or step == plan.max_steps:
                self._log_train(window, stats, bar)
            improved = False
            if plan.eval_every_steps and step % plan.eval_every_steps == 0 and step < plan.max_steps:
                improved = self._track_best(self.evaluate())  # a stopped evaluation has no metrics (None)
            timed = self.save_clock.due()  # every rank, every step: the time cadence is agreed
            if step < plan.max_steps and (improved or timed or (plan.ckpt_every_steps
                                                                and step % plan.ckpt_every_steps == 0)):
                if self.save(best=improved, wait=False) is not None:  # None: the last one is still being written
                    saved_at = step
            if watcher.should_stop():
                break
        bar.close()
        self.save_clock.close()
        status = self._finish(saved_at, quiet)
        self.membership.finish(status)
        watcher.close()
        self.watcher = None
        acc.wait_for_everyone()
        acc.end_training()
        if status == "completed" or (status == "preempted" and not quiet):  # a Ctrl-C ends with its line (_finish)
            self.log.summary(status, self.state.step, self.state.best_step, self.state.nonfinite_skipped)
        self.log.close()
        if acc.is_main_process:
            release_run_lock(cfg.run.output_dir)  # now, not at exit: a notebook may start another run here
        return status

    def _say_already_complete(self) -> str:
        """One line for a rerun of a finished run (nothing trained, nothing written); returns `already_complete`."""
        acc = self.accelerator
        if acc.is_main_process:
            logger.info("%s", already_complete_line(self.run_dir, self.state.step, self.plan.max_steps,
                                                    Path(self.resumed_from)))
        acc.wait_for_everyone()
        acc.end_training()
        if acc.is_main_process:
            release_run_lock(self.cfg.run.output_dir)
        return "already_complete"

    def train_step(self, batches: list[MicroBatch]) -> dict[str, Any]:
        """One optimizer step over `batches` (grad_accum_steps micro-batches of this rank).

        The step's loss is the weighted mean over all micro-batches of all ranks, each weighted by
        its units (`task.batch_weight`), so micro-batches of different sizes count correctly. Each
        micro-batch's loss draws from its rows' own random streams (`MicroBatch.rng`).
        """
        acc, accum = self.accelerator, len(batches)
        if self.stateful_task is not None:
            self.stateful_task.start_step(self.state.step, accum)
        fractions, local_units = unit_fractions(self.task, [b.batch for b in batches], acc)
        shares, logs = [], defaultdict(list)
        for (batch, rng), fraction in zip(batches, fractions):
            with acc.accumulate(self.model) if accum > 1 else contextlib.nullcontext():
                out = self.task.loss(self.model, batch, rng)
                share = out.loss.float()
                if not (isinstance(fraction, float) and fraction == 1.0):  # skip a multiply by exactly 1
                    share = share * fraction
                self.engine.backward(share)
                shares.append(share.detach())
                for key, value in out.logs.items():
                    logs[key].append(value.detach().float())
        grad_norm, skipped = self.engine.step()
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update(unwrap_model(acc, self.model), skipped=skipped)
        step_loss = shares[0] if accum == 1 else torch.stack(shares).sum()
        return {"loss": step_loss, "units": local_units, "grad_norm": grad_norm,
                **{k: v[0] if accum == 1 else torch.stack(v).mean() for k, v in logs.items()}}

    def _log_train(self, window: StepWindow, stats: dict[str, Any], bar: tqdm) -> None:
        """The logging step: the only place the loop reads the device (losses, units, skipped steps)."""
        self.state.nonfinite_skipped += self.engine.check_skips(self.state.step)
        task_logs = {k: v for k, v in stats.items() if k not in ("loss", "units", "grad_norm")}
        if task_logs and self.accelerator.num_processes > 1:  # the step's mean over all ranks (equal micro-batches)
            values = self.accelerator.reduce(torch.stack(list(task_logs.values())), reduction="mean")
            task_logs = dict(zip(task_logs, values))
        extra = {"lr": self.scheduler.get_last_lr()[0], "grad_norm": self.engine.logged_grad_norm(stats["grad_norm"]),
                 "nonfinite_skipped": self.state.nonfinite_skipped,
                 "epoch": self.data.epoch(self.state.step * self.plan.grad_accum_steps),
                 **{k: float(v) for k, v in task_logs.items()}}
        record = self.log.train(window, self.state.step, extra)
        if self.is_main:
            bar.set_postfix(loss=f"{record['loss']:.4g}", lr=f"{record['lr']:.2g}",
                            **{k: f"{record[k]:.4g}" for k in self.task.progress_logs if k in record})

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self, split: str = "eval") -> dict[str, float] | None:
        """Metrics over the eval set (eval.max_samples of it) or the test set, each sample once at any world size and batch.

        The test split (`TaskData.test`) is evaluated once, at the end of a completed run; the main process then
        hands all its per-sample values to `Task.write_report` (e.g. a parity plot). Within `fit` a stop signal ends
        an evaluation at the next batch, the same on every rank (`PreemptionWatcher`), and it returns None: the
        metrics of part of a split are neither logged nor compared.
        """
        loader = self.eval_loader if split == "eval" else self.test_loader
        if loader is None:
            return {}
        acc = self.accelerator
        self.model.eval()
        values = EvalOutputs()
        use_ema = self.ema.applied_to(unwrap_model(acc, self.model)) if self.ema else contextlib.nullcontext()
        trim = HeapTrimmer()  # the kept outputs fragment the heap between large batches (host_memory.py)
        with use_ema:
            for batch in loader:
                if self.watcher is not None and self.watcher.should_stop():  # every rank asks at every batch
                    getattr(loader, "end", lambda: None)()  # accelerate unregisters a loader only when it runs out
                    break
                values.add(acc.gather_for_metrics(self.task.eval_step(self.model, batch)))
                trim()
            else:  # the whole split was evaluated
                with self.engine.sampling_context():
                    scores = self._sample_scores() if split == "eval" else {}
        self.model.train()
        if self.watcher is not None and self.watcher.stopping:
            return None
        joined = values.columns()
        metrics = {**self.task.reduce_metrics(joined), **scores}
        if split == "eval":
            self.last_eval = metrics
        record = {"step": self.state.step, **{f"{split}/{k}": v for k, v in metrics.items()}}
        if split == "test":
            record["test/weights_step"] = self.state.step if self.test_weights_step is None else self.test_weights_step
        self.log.write(record)
        if split == "test" and acc.is_main_process:
            self.task.write_report(joined, metrics, self.run_dir.test, loader.dataset)
        return metrics

    def _sample_scores(self) -> dict[str, float]:
        """At every eval.sample_every-th evaluation (and the final one) a generative task draws
        eval.num_samples samples over the ranks (EMA weights where kept) and scores them: `sample_<name>`."""
        every, step = self.cfg.eval.sample_every, self.state.step
        if not every or not isinstance(self.task, GenerativeTask):
            return {}
        index = math.ceil(step / self.plan.eval_every_steps) if self.plan.eval_every_steps else 1
        if index % every and step < self.plan.max_steps:
            return {}
        acc = self.accelerator
        if not self.engine.may_sample_in_eval:  # said once at the start (_start_notes)
            return {}
        options = self.task.eval_sample_config(self.cfg.eval.num_samples, self.cfg.run.seed)
        samples = generate_distributed(self.task, unwrap_model(acc, self.model), options, acc.process_index,
                                       acc.num_processes, acc.device)
        scores = self.task.score_samples(samples, options) if acc.is_main_process else {}
        if acc.num_processes > 1:  # every rank logs and may select the best checkpoint on the same numbers
            scores = broadcast_object_list([scores])[0]
        return {f"sample_{k}": float(v) for k, v in scores.items()}

    def _track_best(self, metrics: dict[str, float] | None) -> bool:
        name = self.plan.eval_metric
        if metrics is None:  # a stopped evaluation
            return False
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
    def save(self, best: bool = False, wait: bool = True) -> Path | None:
        """Write a complete checkpoint atomically (every rank takes part) and rotate old ones; wait=False (with
        ckpt.async_save) returns before it is complete, or skips it while the last one is (`Checkpointer.save`)."""
        path = self.checkpointer.save(best=best, wait=wait)
        if path is not None:
            self.save_clock.reset()
        return path

    def _finish(self, saved_at: int, quiet: bool = False) -> str:
        """Final eval, test and checkpoint of a completed run, or the checkpoint and marker of a stopped one (also
        one stopped during the final eval or the test pass); returns `completed`, `preempted` or `interrupted`."""
        improved = False
        if self.watcher.status == "completed":
            improved = self._track_best(self.evaluate())
        if saved_at != self.state.step or improved:
            self.save(best=improved)
        if self.checkpointer.wait(close=True) == self.state.step:  # the writer process died with this step's save
            self.save(best=self.state.best_step == self.state.step)  # on the step, as every save after its death
        if self.watcher.status == "completed" and self.test_loader is not None:
            self._load_test_weights()
            self.evaluate("test")
        if self.is_main:
            self.run_dir.preempted.unlink(missing_ok=True)
            if self.watcher.status != "completed":
                report_stop(self.cfg, self.run_dir, self.state.step, self.plan.max_steps, self.watcher, quiet)
        return self.watcher.status

    def _load_test_weights(self) -> None:
        """eval.test_weights=best: load the best checkpoint's weights (and EMA) for the test pass."""
        if self.cfg.eval.test_weights != "best" or self.state.best_step in (None, self.state.step):
            return
        path = store.best_checkpoint(self.run_dir.checkpoints)
        if path is None:
            logger.warning("eval.test_weights=best: no best checkpoint under %s; testing the final weights",
                           self.run_dir.checkpoints)
            return
        self.checkpointer.load_weights(path)
        self.test_weights_step = self.state.best_step
        if self.is_main:
            logger.info("test with the best checkpoint's weights: %s (step %d, eval %s %.6g)", path.name,
                        self.state.best_step, self.plan.eval_metric, self.state.best_metric)

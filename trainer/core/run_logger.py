"""What a run tells its user: the start lines, a record per logging step, the end-of-run summary.

Records go to metrics.jsonl (metrics_log.py) and accelerate's trackers, from the main process only;
the other ranks take part in the reductions and write nothing. The training loop hands over its
per-rank totals (`StepWindow`) at logging steps, the only time it reads the device.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from trainer.config import Config, config_to_dict
from trainer.core.checkpoint import store
from trainer.core.metrics_log import MetricsLog, peak_memory_mb
from trainer.rundir import RunDir

if TYPE_CHECKING:
    from accelerate import Accelerator

    from trainer.core.run_plan import RunPlan

logger = logging.getLogger("trainer")


class StepWindow:
    """Per-rank running totals between two logging steps (device tensors are summed only when logging)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.units: Any = 0.0
        self.samples = 0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, units: Any, samples: int) -> None:
        self.losses.append(loss)
        self.units = self.units + units
        self.samples += samples


class RunLogger:
    """The run's voice: one instance per process, writing on the main one."""

    def __init__(self, accelerator: Accelerator, cfg: Config, plan: RunPlan, run_dir: RunDir, unit: str):
        self.accelerator = accelerator
        self.cfg = cfg
        self.plan = plan
        self.run = run_dir
        self.unit = unit
        self.is_main = accelerator.is_main_process
        self.metrics: MetricsLog | None = None

    def open(self, resumed_step: int | None) -> None:
        """Start metrics.jsonl (truncated after `resumed_step` when resuming) and the trackers."""
        if not self.is_main:
            return
        self.metrics = MetricsLog(self.run, resumed_step)
        if self.accelerator.log_with:
            self.accelerator.init_trackers(self.cfg.log.project, config=_flat_hparams(config_to_dict(self.cfg)))

    def write(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        self.metrics.write(record)
        if self.accelerator.log_with:
            scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self.accelerator.log(scalars, step=record["step"])

    def start(self, step: int, lines: list[str]) -> None:
        """The run's set-up in a few lines: backend, the run plan (batch, lr, steps, cadence), what the loop adds."""
        acc, plan, o = self.accelerator, self.plan, self.cfg.optim
        lr, warmup_steps = plan.lr, plan.warmup_steps
        effective = plan.per_device_batch_size * plan.grad_accum_steps * acc.num_processes
        head = [f"backend={acc.distributed_type.value} processes={acc.num_processes} device={acc.device} "
                f"precision={self.cfg.train.mixed_precision}",
                f"effective batch = {plan.per_device_batch_size} per device x {plan.grad_accum_steps} accum x "
                f"{acc.num_processes} processes = {effective}",
                f"lr = {lr:.3g} (optim.lr {o.lr:.3g}, scale_lr={o.scale_lr}), warmup = {warmup_steps} steps, "
                f"schedule={o.scheduler}", plan.describe()]
        if self.is_main:
            for line in head + lines:
                logger.info(line)
        self.write({"step": step, "event": "start", "effective_batch_size": effective, "scaled_lr": lr,
                    "warmup_steps": warmup_steps, "world_size": acc.num_processes})

    def train(self, window: StepWindow, step: int, extra: dict[str, Any]) -> dict[str, Any]:
        """The record of a logging step: the window's totals summed over ranks (a collective), plus `extra`."""
        acc = self.accelerator
        totals = torch.stack([torch.stack(window.losses).sum().float(),
                              torch.as_tensor(window.units, dtype=torch.float32, device=acc.device),
                              torch.tensor(float(window.samples), device=acc.device)])
        if acc.num_processes > 1:
            totals = acc.reduce(totals, reduction="sum")
        loss_sum, units, samples = totals.tolist()
        elapsed = time.perf_counter() - window.start
        steps = len(window.losses)
        record = {"step": step, "loss": loss_sum / steps, "samples_per_s": samples / elapsed,
                  f"{self.unit}_per_s": units / elapsed, "step_time_s": elapsed / steps,
                  "peak_memory_mb": peak_memory_mb(acc.device), **extra}
        self.write(record)
        window.reset()
        return record

    def summary(self, status: str, step: int, best_step: int | None, nonfinite_skipped: int) -> None:
        """Main process, end of fit: where the run stands and what to run next."""
        if not self.is_main:
            return
        run, metric, mode = self.run, self.plan.eval_metric, self.cfg.eval.mode
        records = run.read_metrics(missing_ok=True)
        evals = [r for r in records if any(k.startswith("eval/") for k in r)]
        tests = [r for r in records if any(k.startswith("test/") for k in r)]
        best_eval = next((r for r in evals if r["step"] == best_step), None)
        lines = [f"run {status} at step {step} of {self.plan.max_steps}"
                 + (f" ({nonfinite_skipped} non-finite steps skipped)" if nonfinite_skipped else "")]
        if evals:
            lines.append(f"  final eval (step {evals[-1]['step']}): {_format_metrics(evals[-1], 'eval/', metric)}")
        if best_eval is not None:
            lines.append(f"  best eval  (step {best_eval['step']}, {metric} {mode}): "
                         + ("the final eval" if best_eval is evals[-1] else _format_metrics(best_eval, "eval/", metric)))
        if tests:
            lines.append(f"  test: {_format_metrics(tests[-1], 'test/', metric)}  (report in {run.test})")
        best = store.read_pointer(run.checkpoints, "best")
        latest = store.read_pointer(run.checkpoints, "latest")
        lines.append(f"  run directory: {run.root}  (config.yaml, plan.json, metrics.jsonl"
                     + (", tb/)" if self.cfg.log.tensorboard else ")"))
        lines.append(f"  checkpoints: best {best or '-'}, latest {latest or '-'}")
        if status == "preempted":
            lines.append("  resume: run the same command again (run.resume=auto continues from the latest checkpoint)")
        lines.append(f"  export: trainer export {run.root}  -> {run.exported_model}")
        lines.append(f"  plots:  trainer plot {run.root}  -> {run.plots}/")
        logger.info("\n".join(lines))

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def _format_metrics(record: dict[str, Any], prefix: str, first: str = "") -> str:
    """`first` (the selection metric) leads. Subgroup metrics ("group/metric", e.g. GEARS' 30 per test subgroup) are
    counted, not listed: a summary line stays readable, metrics.jsonl and the test report hold them."""
    items = sorted(((k[len(prefix):], v) for k, v in record.items() if k.startswith(prefix)), key=lambda kv: kv[0] != first)
    shown = [(k, v) for k, v in items if k == first or "/" not in k]
    text = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown)
    hidden = len(items) - len(shown)
    return text + (f" (+{hidden} subgroup metrics in metrics.jsonl)" if hidden else "")


def _flat_hparams(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat_hparams(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out

"""`trainer plot RUN_DIR`: PNG curves of training loss, learning rate, the task's own logs and eval metrics.

Axes are labelled (optimizer step; the quantity); the loss gets a log axis only when it spans a decade, and a
training quantity that never changed (a constant learning rate) is a line of text instead of a flat panel.

Each eval metric gets one panel, and its trivial baseline (the number the model has to beat) is drawn in
the same axes: a horizontal line when it is constant, else a dashed curve. A metric's baseline is either
declared by the task (`TaskSpec.baselines`, metric -> baseline metric) or found by name (`baseline_X` is the
baseline of `X`). Metrics whose curves are identical (e.g. a task that reports its loss under two names)
share one panel titled with every name. Panels without data are left out, and so is a figure with none.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on clusters
import matplotlib.pyplot as plt  # noqa: E402

from trainer.rundir import RunDir  # noqa: E402

logger = logging.getLogger(__name__)

TRAIN_KEYS = ("loss", "lr", "grad_norm", "samples_per_s")
AXIS_LABELS = {"loss": "training loss", "lr": "learning rate", "grad_norm": "gradient norm (L2, before clipping)",
               "samples_per_s": "samples per second"}
"""The y-axis label of each training panel (eval panels are labelled by their metric)."""
DECADES_FOR_LOG = 1.0
"""A panel of `log_keys` gets a log axis only when its values span at least this many decades."""
EVAL_PREFIX = "eval/"
BASELINE_PREFIX = "baseline_"

Series = tuple[list, list]


def _series(records: list[dict], keys: list[str]) -> dict[str, Series]:
    """key -> (steps, values) of the records holding a finite number under key; keys without any are absent."""
    out: dict[str, Series] = {}
    for r in records:
        for k in keys:
            value = r.get(k)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                steps, values = out.setdefault(k, ([], []))
                steps.append(r["step"])
                values.append(r[k])
    return out


def baseline_pairs(keys: list[str], declared: Mapping[str, str] = (), prefix: str = EVAL_PREFIX) -> dict[str, str]:
    """metric key -> its baseline's key, among `keys` (all under `prefix`): the task's declared pairs
    (metric names without the prefix), then every `<prefix>baseline_X` beside a `<prefix>X`."""
    present = set(keys)
    pairs = {}
    for metric, baseline in dict(declared).items():
        if prefix + metric in present and prefix + baseline in present:
            pairs[prefix + metric] = prefix + baseline
    for key in keys:
        name = key[len(prefix):]
        if name.startswith(BASELINE_PREFIX) and prefix + name[len(BASELINE_PREFIX):] in present:
            pairs.setdefault(prefix + name[len(BASELINE_PREFIX):], key)
    return pairs


def distinct_groups(series: Mapping[str, Series], keys: list[str]) -> list[list[str]]:
    """The keys (in order) grouped by identical curves (same steps and values): one panel per group."""
    groups: list[list[str]] = []
    for key in keys:
        same = next((g for g in groups if series[g[0]] == series[key]), None)
        if same is None:
            groups.append([key])
        else:
            same.append(key)
    return groups


def _label(keys: list[str], prefix: str = "") -> str:
    return " = ".join(k[len(prefix):] if prefix and k.startswith(prefix) else k for k in keys)


def _figure(series: Mapping[str, Series], groups: list[list[str]], baselines: Mapping[str, str] = (),
            log_keys: tuple = (), prefix: str = "") -> plt.Figure:
    """One panel per group of identical curves; a group member's baseline is drawn in the same axes."""
    baselines = dict(baselines)
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.2), squeeze=False)
    for ax, group in zip(axes[0], groups):
        steps, values = series[group[0]]
        ax.plot(steps, values, marker=".", label=_label(group, prefix))
        for key in group:
            if key not in baselines:
                continue
            b_steps, b_values = series[baselines[key]]
            name = _label([baselines[key]], prefix)
            if len(set(b_values)) == 1:
                ax.axhline(b_values[0], color="k", ls="--", lw=1, label=f"{name} {b_values[0]:.4g}")
            else:
                ax.plot(b_steps, b_values, color="k", ls="--", lw=1, label=name)
        if len(ax.lines) > 1:
            ax.legend(fontsize=7)
        ax.set_title(_label(group, prefix), fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(AXIS_LABELS.get(group[0], _label(group[:1], prefix)), fontsize=8)
        if group[0] in log_keys and values and min(values) > 0 and math.log10(max(values) / min(values)) >= DECADES_FOR_LOG:
            ax.set_yscale("log")
    fig.tight_layout()
    return fig


def train_figure(records: list[dict]) -> plt.Figure | None:
    """Loss (a log axis when it spans a decade), lr, grad norm and throughput against the step; a quantity that
    never changed (a constant lr) is a line of text under the panels, not a flat panel. None without any."""
    series = _series(records, list(TRAIN_KEYS))
    keys = [k for k in TRAIN_KEYS if k in series]
    constant = [k for k in keys if k != "loss" and len(series[k][1]) > 1 and len(set(series[k][1])) == 1]
    drawn = [k for k in keys if k not in constant]
    if not drawn:
        return None
    fig = _figure(series, [[k] for k in drawn], log_keys=("loss",))
    if constant:
        fig.text(0.01, 0.01, "; ".join(f"{AXIS_LABELS.get(k, k)} constant at {series[k][1][0]:.4g}" for k in constant),
                 fontsize=8)
        fig.subplots_adjust(bottom=0.25)
    return fig


BOOKKEEPING_KEYS = frozenset({"step", "epoch", "step_time_s", "peak_memory_mb", "nonfinite_skipped"})
"""Numbers of a training record that are not the task's own logs (nor TRAIN_KEYS)."""


def task_logs_figure(records: list[dict]) -> plt.Figure | None:
    """The task's own per-step logs (`LossOutput.logs`, e.g. an alignment's reward, KL and clip fraction): one panel
    each, identical curves once. None when the task logs nothing."""
    train = [r for r in records if "loss" in r and not any(k.startswith(EVAL_PREFIX) for k in r)]
    keys = sorted({k for r in train for k in r if k not in BOOKKEEPING_KEYS and k not in TRAIN_KEYS
                   and not k.endswith("_per_s") and "/" not in k})
    series = _series(train, keys)
    keys = [k for k in keys if k in series]
    if not keys:
        return None
    return _figure(series, distinct_groups(series, keys))


def eval_figure(records: list[dict], declared: Mapping[str, str] = ()) -> plt.Figure | None:
    """Every eval metric (but the eval/num_* counts) with its baseline in the same panel, identical curves
    once; `declared` is the task's metric -> baseline map. None without eval records."""
    keys = sorted({k for r in records for k in r if k.startswith(EVAL_PREFIX) and not k.startswith("eval/num_")})
    series = _series(records, keys)
    keys = [k for k in keys if k in series]
    pairs = baseline_pairs(keys, declared)
    metrics = [k for k in keys if k not in set(pairs.values())]
    if not metrics:
        return None
    return _figure(series, distinct_groups(series, metrics), baselines=pairs, prefix=EVAL_PREFIX)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def task_baselines(run: RunDir) -> dict[str, str]:
    """The baselines of the run's task spec (`TaskSpec.baselines`; the task named in its config.yaml; no
    torch imported); {} when the task is unknown (then only the `baseline_X` naming rule pairs metrics)."""
    import yaml

    from trainer.errors import ConfigError

    try:
        name = yaml.safe_load(run.config.read_text())["task"]["name"]
        from trainer.registry import get_spec

        return dict(get_spec(name).baselines)
    except (OSError, yaml.YAMLError, KeyError, TypeError, ConfigError, ImportError) as err:
        logger.info("%s: no task baselines for the plots (%s)", run.root, err)
        return {}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None,
             baselines: Mapping[str, str] | None = None) -> list[Path]:
    """Write train.png (loss, lr, grad norm, throughput), train_logs.png (the task's own logs, where it has any) and
    eval.png (every eval/* metric, each with its baseline); `baselines` (metric -> baseline metric) defaults to the
    run's `TaskSpec.baselines`."""
    run = RunDir(run_dir)
    out_dir = Path(out_dir) if out_dir else run.plots
    out_dir.mkdir(parents=True, exist_ok=True)
    records = run.read_metrics()
    written = []
    fig = train_figure(records)
    if fig is not None:
        written.append(_save(fig, out_dir / "train.png"))
    fig = task_logs_figure(records)
    if fig is not None:
        written.append(_save(fig, out_dir / "train_logs.png"))
    if any(k.startswith(EVAL_PREFIX) for r in records for k in r):
        fig = eval_figure(records, task_baselines(run) if baselines is None else baselines)
        if fig is not None:
            written.append(_save(fig, out_dir / "eval.png"))
    return written

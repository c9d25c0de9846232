"""`trainer plot RUN_DIR`: PNG curves of training loss, learning rate and eval metrics."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on clusters
import matplotlib.pyplot as plt  # noqa: E402

from trainer.rundir import RunDir  # noqa: E402


def _series(records: list[dict], keys: list[str]) -> dict[str, tuple[list, list]]:
    out: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    for r in records:
        for k in keys:
            if isinstance(r.get(k), (int, float)):
                out[k][0].append(r["step"])
                out[k][1].append(r[k])
    return out


def _figure(series: dict[str, tuple[list, list]], keys: list[str], path: Path, log_keys: tuple = ()) -> Path:
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        steps, values = series.get(key, ([], []))
        ax.plot(steps, values, marker=".")
        ax.set_title(key)
        ax.set_xlabel("step")
        if key in log_keys and values and min(values) > 0:
            ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write train.png (loss, lr, grad norm, throughput) and eval.png (every eval/* metric)."""
    run = RunDir(run_dir)
    out_dir = Path(out_dir) if out_dir else run.plots
    out_dir.mkdir(parents=True, exist_ok=True)
    records = run.read_metrics()
    written = []
    train_keys = ["loss", "lr", "grad_norm", "samples_per_s"]
    series = _series(records, train_keys)
    if series:
        written.append(_figure(series, train_keys, out_dir / "train.png", log_keys=("loss",)))
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval/") and not k.startswith("eval/num_")})
    if eval_keys:
        written.append(_figure(_series(records, eval_keys), eval_keys, out_dir / "eval.png"))
    return written

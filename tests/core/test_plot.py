"""`trainer plot`: each eval metric with its baseline in the same axes, identical curves once, no empty axes."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest

from trainer.core.plot import baseline_pairs, eval_figure, plot_run, task_baselines, task_logs_figure, train_figure
from trainer.rundir import RunDir

UNIGRAM = 18.26


def records() -> list[dict]:
    """A SEDD-like run: loss under two names, a declared baseline (unigram), a `baseline_X` pair, counts."""
    out = [{"step": 0, "event": "start", "world_size": 2}]
    for step in (20, 40, 60):
        out.append({"step": step, "loss": 3.0 - step / 100, "lr": 1e-3, "grad_norm": 0.5 + step / 1000,
                    "samples_per_s": 200.0 + step, "tokens_per_s": 1.2e4})
    for k, step in enumerate((20, 40, 60)):
        nelbo = 2.95 - 0.05 * k
        out.append({"step": step, "eval/loss": nelbo, "eval/nelbo_per_token": nelbo,
                    "eval/perplexity_bound": math.exp(nelbo), "eval/unigram_perplexity": UNIGRAM,
                    "eval/mae": 0.5 - 0.1 * k, "eval/baseline_mae": 0.6 + 0.01 * k, "eval/num_sequences": 163.0,
                    "eval/broken": float("nan")})
    return out


def panels(fig) -> dict[str, list]:
    """Axes title -> its lines, after checking that no axes of the figure is empty."""
    out = {}
    for ax in fig.axes:
        assert ax.lines and all(len(line.get_xdata()) for line in ax.lines), f"empty axes {ax.get_title()!r}"
        out[ax.get_title()] = ax.lines
    plt.close(fig)
    return out


def test_eval_metric_and_its_baseline_share_an_axes_and_duplicates_are_one_panel():
    lines = panels(eval_figure(records(), {"perplexity_bound": "unigram_perplexity"}))
    # eval/loss and eval/nelbo_per_token are one curve: one panel named by both; no panel for the counts,
    # the all-NaN metric or the baselines themselves.
    assert sorted(lines) == ["loss = nelbo_per_token", "mae", "perplexity_bound"]
    model, baseline = lines["perplexity_bound"]
    assert list(model.get_ydata()) == pytest.approx([math.exp(2.95 - 0.05 * k) for k in range(3)])
    assert set(baseline.get_ydata()) == {UNIGRAM} and "unigram_perplexity" in baseline.get_label()
    assert baseline.get_linestyle() == "--"
    model, baseline = lines["mae"]  # found by name (baseline_mae), not constant: a dashed curve over the steps
    assert list(baseline.get_xdata()) == [20, 40, 60] and list(baseline.get_ydata()) == pytest.approx([0.6, 0.61, 0.62])
    assert baseline.get_label() == "baseline_mae"
    assert len(lines["loss = nelbo_per_token"]) == 1


def test_without_a_declared_baseline_it_has_its_own_panel():
    lines = panels(eval_figure(records()))
    assert sorted(lines) == ["loss = nelbo_per_token", "mae", "perplexity_bound", "unigram_perplexity"]
    assert len(lines["perplexity_bound"]) == 1 and len(lines["mae"]) == 2


def test_baseline_pairs_need_both_keys():
    keys = ["eval/a", "eval/b", "eval/baseline_c", "eval/d", "eval/baseline_d"]
    assert baseline_pairs(keys, {"a": "b", "x": "b", "d": "a"}) == {"eval/a": "eval/b", "eval/d": "eval/a"}
    assert baseline_pairs(keys) == {"eval/d": "eval/baseline_d"}  # baseline_c has no eval/c


def test_train_figure_has_a_panel_per_logged_key_only():
    fig = train_figure(records())
    texts = [t.get_text() for t in fig.texts]
    assert [ax.get_ylabel() for ax in fig.axes] == ["training loss", "gradient norm (L2, before clipping)",
                                                   "samples per second"]
    assert {ax.get_xlabel() for ax in fig.axes} == {"optimizer step"} and fig.axes[0].get_yscale() == "linear"
    lines = panels(fig)
    assert list(lines) == ["loss", "grad_norm", "samples_per_s"] and texts == ["learning rate constant at 0.001"]
    decades = [{"step": k, "loss": 10.0 ** -k} for k in range(3)]  # a loss over decades: a log axis
    fig = train_figure(decades)
    assert fig.axes[0].get_yscale() == "log"
    plt.close(fig)
    assert list(panels(train_figure([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]))) == ["loss"]
    assert train_figure([{"step": 0, "event": "start"}]) is None
    assert eval_figure([{"step": 1, "eval/num_sequences": 3.0, "eval/x": float("nan")}]) is None


def test_task_logs_get_a_panel_each_and_bookkeeping_none():
    """An alignment's logs (reward mean and spread, KL, clip fraction) are drawn; throughput, memory, epoch and eval
    values are not (they have their own figures or are not curves of the task)."""
    logged = [{"step": s, "loss": 1.0, "lr": 1e-3, "samples_per_s": 9.0, "groups_per_s": 9.0, "peak_memory_mb": 50.0,
               "epoch": s / 10, "reward_mean": -s, "reward_group_std": 1.0 + s, "kl": 0.01 * s, "clip_fraction": 0.0}
              for s in (1, 2, 3)]
    logged.append({"step": 3, "eval/nll": 5.0})
    assert sorted(panels(task_logs_figure(logged))) == ["clip_fraction", "kl", "reward_group_std", "reward_mean"]
    assert task_logs_figure(records()) is None


def write_run(root, records_, task_name="protein_sedd"):
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(f"task:\n  name: {task_name}\n")
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records_))
    return root


def test_plot_run_writes_both_figures_with_the_task_baselines(tmp_path):
    run = write_run(tmp_path / "run", records())
    assert task_baselines(RunDir(run)) == {"perplexity_bound": "unigram_perplexity"}  # TaskSpec.baselines of the run's task
    written = plot_run(run)
    assert [p.name for p in written] == ["train.png", "eval.png"] and all(p.stat().st_size > 0 for p in written)
    only_train = write_run(tmp_path / "only_train", [r for r in records() if not any(k.startswith("eval/") for k in r)])
    assert [p.name for p in plot_run(only_train)] == ["train.png"]


def test_unknown_task_means_naming_rule_only(tmp_path):
    run = write_run(tmp_path / "run", records(), task_name="no_such_task")
    assert task_baselines(RunDir(run)) == {}
    assert [p.name for p in plot_run(run, out_dir=tmp_path / "plots")] == ["train.png", "eval.png"]


def test_plot_command_imports_no_torch(tmp_path):
    """`trainer plot` reads the task's baselines from its light spec: no torch (or the family) imported."""
    run = write_run(tmp_path / "run", records())
    code = ("import sys; from trainer.cli import main; code = main(['plot', sys.argv[1]]); "
            "print(code, [m for m in ('torch', 'datasets', 'trainer.families.protein_sedd.task') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "0 []", proc.stdout[-2000:]
    assert (run / "plots" / "eval.png").stat().st_size > 0

"""summary.png of a sampling run: a panel per metric that a guided set has, never empty axes, no file without one."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt

from trainer.families.molecules_edm.sampling_report import plot_summary, summary_figure

NAN = float("nan")


def row(name, scale, **metrics):
    return {"set": name, "scale": scale, **metrics}


def test_guided_sets_are_drawn_against_the_scale_with_the_baseline_in_the_same_axes(tmp_path):
    rows = [row("baseline", 0.0, validity=0.5, atom_stability=0.8, force_rms_mean=NAN),
            row("guided_scale_0.001", 0.001, validity=0.6, atom_stability=NAN, force_rms_mean=NAN),
            row("guided_scale_0.01", 0.01, validity=0.7, atom_stability=NAN, force_rms_mean=NAN)]
    fig = summary_figure(rows)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["validity"]  # atom_stability only in the baseline, force_rms_mean NaN everywhere: no panel
    guided, baseline = fig.axes[0].lines
    assert list(guided.get_xdata()) == [0.001, 0.01] and list(guided.get_ydata()) == [0.6, 0.7]
    assert set(baseline.get_ydata()) == {0.5} and fig.axes[0].get_xscale() == "log"
    plt.close(fig)
    assert plot_summary(rows, tmp_path / "summary.png").stat().st_size > 0


def test_no_guided_set_or_only_nan_writes_no_figure(tmp_path):
    baseline_only = [row("baseline", 0.0, validity=0.5, molecule_stability=0.1)]
    all_nan = [*baseline_only, row("guided_scale_0.001", 0.001, validity=NAN, molecule_stability=math.inf)]
    for rows in ([], baseline_only, all_nan):
        assert summary_figure(rows) is None
        assert plot_summary(rows, tmp_path / "summary.png") is None
    assert not (tmp_path / "summary.png").exists()

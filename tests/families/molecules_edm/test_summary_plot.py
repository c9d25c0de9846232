"""summary.png of a sampling run (a panel per metric that a guided set has, never empty axes, no file without one) and
the headline line of each set."""

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


def test_a_sets_headline_names_its_molecules_rates_and_who_scored_them():
    from trainer.families.molecules_edm.sampling_report import set_headline

    row = {"set": "guided_0.0005", "num_molecules": 32, "validity": 0.25, "atom_stability": 0.5, "molecule_stability": 0.0,
           "forcefield_molecules": 30, "forcefield_failures": 2, "forcefield_unsupported": 2, "force_rms_mean": 12.5,
           "force_rms_median": 4.25, "mlff_forcefield": "ani1x", "mlff_forcefield_molecules": 20,
           "mlff_forcefield_failures": 0, "mlff_forcefield_unsupported": 12, "mlff_force_rms_mean": 9.0,
           "mlff_force_rms_median": 3.0}
    line = set_headline(row, "gfn2")
    assert line.startswith("guided_0.0005: 32 molecules, valid 25.0 %, atom stability 50.0 %, molecule stability 0.0 %")
    assert "force RMS by gfn2: mean 12.5, median 4.25 eV/A over 28 scored, 2 failed, 2 with elements it does not model" in line
    assert "force RMS by ani1x: mean 9, median 3 eV/A over 20 scored, 12 with elements it does not model" in line
    assert "mlff" not in set_headline({k: v for k, v in row.items() if not k.startswith("mlff")}, "gfn2")

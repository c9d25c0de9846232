"""What the main process writes after a (guided) sampling run: molecules, metric tables, plots, chains.

Layout under OUT:
  baseline/molecules.extxyz, guided_scale_<s>/molecules.extxyz   every molecule, per-molecule metrics in `info`
  <set>/xyz/sample_<k>.xyz                                        one file per molecule (on request)
  chains/<set>/sample_<k>.xyz and .png                            the first samples' trajectories (multi-frame
                                                                  xyz, and a strip of frames)
  metrics.json, metrics.csv                                       one row per set
  summary.png                                                     each metric against the guidance scale (with
                                                                  guided sets only)
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainer.atomic_io import atomic_write_text
from trainer.families.molecules_edm.molecule import Molecule

ELEMENT_COLOURS = {1: "#d0d0d0", 6: "#303030", 7: "#3050f8", 8: "#ff0d0d", 9: "#90e050"}
SUMMARY_METRICS = ("molecule_stability", "atom_stability", "validity", "valid_and_unique", "force_rms_mean",
                   "energy_per_atom_mean")


def set_name(scale: float | None) -> str:
    """`baseline`, or `guided_scale_<s>` with the scale as the user wrote it (0.0005 -> guided_scale_0.0005)."""
    return "baseline" if scale is None else f"guided_scale_{scale:g}"


def write_xyz_frames(frames: Sequence[Molecule], path: Path, comment: str = "") -> None:
    """A multi-frame plain xyz (any viewer plays it as a trajectory), written atomically."""
    from ase.data import chemical_symbols

    buf = io.StringIO()
    for i, frame in enumerate(frames):
        buf.write(f"{frame.num_atoms}\n{comment} frame={i}\n")
        for z, (x, y, w) in zip(frame.numbers, frame.positions):
            buf.write(f"{chemical_symbols[int(z)]:2s} {x: .6f} {y: .6f} {w: .6f}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, buf.getvalue())


def plot_chain_strip(frames: Sequence[Molecule], path: Path, title: str = "") -> None:
    """A row of frames of one trajectory (projection on the x-y plane, atoms coloured by element)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(frames), figsize=(1.6 * len(frames), 1.9), squeeze=False)
    lim = max(2.0, max(float(np.abs(f.positions[:, :2]).max()) if f.num_atoms else 0.0 for f in frames) + 0.5)
    for ax, frame, i in zip(axes[0], frames, range(len(frames))):
        xy = frame.positions[:, :2]
        d = np.linalg.norm(frame.positions[:, None] - frame.positions[None], axis=-1)
        for a, b in zip(*np.nonzero(np.triu((d > 0) & (d < 1.7)))):  # a rough bond sketch for the eye only
            ax.plot(xy[[a, b], 0], xy[[a, b], 1], color="#999999", lw=0.6, zorder=1)
        ax.scatter(xy[:, 0], xy[:, 1], s=[14 if z == 1 else 30 for z in frame.numbers],
                   c=[ELEMENT_COLOURS.get(int(z), "#ff00ff") for z in frame.numbers], edgecolors="k",
                   linewidths=0.3, zorder=2)
        ax.set_xlim(-lim, lim)
        ax.set_ylim(-lim, lim)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"{i + 1}/{len(frames)}", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_metrics_tables(rows: list[dict[str, Any]], out: Path) -> None:
    """metrics.json (the rows) and metrics.csv (one row per set, the union of the keys as columns)."""
    atomic_write_text(out / "metrics.json", json.dumps(rows, indent=1))
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns and not isinstance(row[k], (dict, list)))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(out / "metrics.csv", buf.getvalue())


def summary_figure(rows: list[dict[str, Any]]):
    """Each metric against the guidance scale (log axis when every scale is > 0), the baseline as a dashed line
    in the same panel. A metric gets a panel only if a guided set has a finite value of it; None when no metric
    does (no guided set, or only NaN: there is nothing to draw against the scale; metrics.csv has the numbers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((r for r in rows if r.get("set") == "baseline"), None)
    guided = sorted((r for r in rows if r.get("set") != "baseline" and _finite(r.get("scale"))), key=lambda r: r["scale"])
    names = [m for m in SUMMARY_METRICS if any(_finite(r.get(m)) for r in guided)]
    if not names:
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.0), squeeze=False)
    for ax, name in zip(axes[0], names):
        xs = [r["scale"] for r in guided if _finite(r.get(name))]
        ys = [r[name] for r in guided if _finite(r.get(name))]
        ax.plot(xs, ys, "o-", label="guided")
        if all(x > 0 for x in xs):
            ax.set_xscale("log")
        if base is not None and _finite(base.get(name)):
            ax.axhline(base[name], color="k", ls="--", lw=1, label="baseline")
        ax.set_xlabel("guidance scale (Å per eV/Å)")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_summary(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Write `summary_figure(rows)` to `path`; None (no file) when it has nothing to draw."""
    fig = summary_figure(rows)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def set_headline(row: dict[str, Any], forcefield: str) -> str:
    """One line on a set of sampled molecules: how many, EDM's rates, and the force RMS under the evaluation force
    field `forcefield` (and the MLFF's, when one scored them too) with how many molecules each scored."""
    line = (f"{row['set']}: {row['num_molecules']} molecules, valid {100 * row['validity']:.1f} %, atom stability "
            f"{100 * row['atom_stability']:.1f} %, molecule stability {100 * row['molecule_stability']:.1f} %")
    for prefix, name in (("", forcefield), ("mlff_", row.get("mlff_forcefield"))):
        evaluated = row.get(prefix + "forcefield_molecules")
        if evaluated is None:
            continue
        failed, outside = row.get(prefix + "forcefield_failures", 0), row.get(prefix + "forcefield_unsupported", 0)
        scored = evaluated - failed
        rms = (f"mean {row[prefix + 'force_rms_mean']:.3g}, median {row[prefix + 'force_rms_median']:.3g} eV/A"
               if scored else "none scored")
        line += (f"; force RMS by {name}: {rms} over {scored} scored" + (f", {failed} failed" if failed else "")
                 + (f", {outside} with elements it does not model" if outside else ""))
    return line


def guidance_summary(row: dict[str, Any]) -> str:
    """One line on a guided set's force evaluations: rate, rungs of the ladder, failures."""
    rungs = ", ".join(f"{key.removeprefix('guidance_evaluations_')} {value:,}" for key, value in row.items()
                      if key.startswith("guidance_evaluations_") and key != "guidance_evaluations_per_second")
    evaluations = row.get("guidance_force_evaluations", 0)
    failures = row.get("guidance_failures", 0)
    scored = ", ".join(f"{key.removeprefix('guidance_scored_')} {value:,}" for key, value in row.items()
                       if key.startswith("guidance_scored_"))
    extra = ""
    if row.get("guidance_unsupported"):
        extra += f"; {row['guidance_unsupported']:,} unguided (elements outside the force field, no fallback)"
    if "guidance_uncertain_skips" in row:
        extra += f"; {row['guidance_uncertain_skips']:,} pushes skipped (ensemble spread above max_uncertainty)"
    return (f"{row['set']}: {evaluations:,} guidance force evaluations, {row['guidance_evaluations_per_second']:.1f}/s "
            f"in the force field ({100 * row['guidance_forcefield_share']:.0f} % of the sampling time)"
            + (f"; scored by {scored}" if scored else "")
            + (f"; converged per rung: {rungs}" if rungs else "")
            + f"; failed {failures:,} ({100 * failures / max(evaluations, 1):.2f} %, left unguided on that step)" + extra)



def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)

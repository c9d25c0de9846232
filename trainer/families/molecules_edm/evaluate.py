"""EDM's metrics for any molecule file, and the molecule writers (extxyz with per-molecule info, one xyz each).

`evaluate_file` reads an xyz/extxyz/SDF set (`readers.py`) and runs `metrics.evaluate_molecules`;
`main` is `trainer evaluate-molecules FILE key=value ...` (the keys: `EvaluateOptions`, listed by `--help`).
On the QM9 molecules it gives EDM's data row:

    trainer evaluate-molecules trainer/families/molecules_edm/samples/qm9_3k.extxyz.gz
"""

from __future__ import annotations

import gzip
import io
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.atomic_io import atomic_write_text
from trainer.families.molecules_edm.molecule import QM9_ELEMENTS, Molecule
from trainer.families.molecules_edm.paired import FORCE_METRICS, Comparison, compare_paired, pair_sets
from trainer.families.molecules_edm.readers import read_molecules, source_kind

HEADLINE = ("atom_stability", "molecule_stability", "validity", "uniqueness", "valid_and_unique", "novelty")


# --------------------------------------------------------------------------------------------------
# writers


def _info_for_extxyz(info: dict[str, Any]) -> dict[str, Any]:
    """Info values ASE's extxyz writer round-trips: plain scalars and strings (None dropped; a backslash
    doubled, since the reader treats it as an escape)."""
    out: dict[str, Any] = {}
    for key, value in info.items():
        if value is None:
            continue
        if isinstance(value, (bool, np.bool_)):
            out[key] = bool(value)
        elif isinstance(value, (int, np.integer)):
            out[key] = int(value)
        elif isinstance(value, (float, np.floating)):
            out[key] = float(value)
        elif isinstance(value, str):
            out[key] = value.replace("\\", "\\\\")
        else:
            out[key] = str(value).replace("\\", "\\\\")
    return out


def _extxyz_text(molecules: Sequence[Molecule]) -> str:
    import ase
    import ase.io

    buf = io.StringIO()
    for mol in molecules:
        atoms = ase.Atoms(numbers=mol.numbers, positions=mol.positions, pbc=False)
        atoms.info.update(_info_for_extxyz(mol.info))
        ase.io.write(buf, atoms, format="extxyz")
    return buf.getvalue()


def write_molecules_extxyz(molecules: Sequence[Molecule], path: str | Path) -> Path:
    """All molecules, each with its `info` on the comment line, to one extxyz file (atomically: a temp
    file renamed into place; `.gz` compresses). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = _extxyz_text(molecules)
    if path.name.endswith(".gz"):
        from trainer.atomic_io import atomic_write_bytes

        atomic_write_bytes(path, gzip.compress(text.encode("utf-8"), mtime=0))
    else:
        atomic_write_text(path, text)
    return path


def write_xyz_per_molecule(molecules: Sequence[Molecule], folder: str | Path, prefix: str = "sample") -> list[Path]:
    """One extxyz file per molecule, `folder/<prefix>_<k>.xyz` (k from 0; info on the comment line,
    readable by any xyz viewer), each written atomically. Returns the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, mol in enumerate(molecules):
        path = folder / f"{prefix}_{k}.xyz"
        atomic_write_text(path, _extxyz_text([mol]), durable=False)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------------
# evaluation


def load_training_smiles(path: str | Path) -> set[str]:
    """Training SMILES from a text file (one per line, optionally .gz: the run artifact
    `training_smiles.txt.gz`) or from a molecule file (xyz/extxyz/SDF: EDM's SMILES of each geometry)."""
    from trainer.families.molecules_edm.metrics import molecule_smiles

    path = Path(path)
    try:
        source_kind(path)
    except ValueError:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            return {line.strip() for line in f if line.strip()}
    molecules, _ = read_molecules(path, elements=None, min_distance=0.0, on_invalid="skip")
    return {s for s in (molecule_smiles(m.numbers, m.positions) for m in molecules) if s}


def evaluate_file(path: str | Path, forcefield: Any = None, training_smiles_path: str | Path | None = None,
                  elements: Sequence[str] | None = QM9_ELEMENTS, *, min_distance: float = 0.0, on_invalid: str = "error",
                  batch_size: int = 64, write_extxyz: str | Path | None = None) -> dict[str, Any]:
    """EDM's metrics (and force-field metrics with `forcefield`) of the molecules in `path`.

    `forcefield`: a `ForceField`, a spec string for `forcefields.build_forcefield` (closed afterwards), or
    None. `min_distance` defaults to 0 here: a generated molecule with clashing atoms is a result to
    score (unstable), not a record to reject. Returns the `evaluate_molecules` summary plus `file`,
    `records_read` and `skipped` (counts by reason); `write_extxyz` also writes every molecule with its
    per-molecule metrics in `info`.
    """
    molecules, report = read_molecules(path, elements=elements, min_distance=min_distance, on_invalid=on_invalid)
    return _evaluate(molecules, str(path), report.records, report.skipped, forcefield, training_smiles_path,
                     batch_size, write_extxyz)[0]


def compare_files(path: str | Path, versus: str | Path, forcefield: Any = None,
                  training_smiles_path: str | Path | None = None, elements: Sequence[str] | None = QM9_ELEMENTS, *,
                  min_distance: float = 0.0, on_invalid: str = "error", batch_size: int = 64,
                  write_extxyz: str | Path | None = None) -> tuple[dict[str, Any], dict[str, Any], Comparison]:
    """`evaluate_file` of `path` (A) and of `versus` (B), both with the same force field, and their paired
    comparison A - B (`paired.pair_sets`, `paired.compare_paired`). Returns (summary of A, summary of B,
    comparison); `write_extxyz` writes A's molecules. Sets that cannot be paired raise `paired.PairingError`
    before any molecule is scored."""
    read = [read_molecules(source, elements=elements, min_distance=min_distance, on_invalid=on_invalid)
            for source in (path, versus)]
    (mols_a, report_a), (mols_b, report_b) = read
    pairing = pair_sets([m.info for m in mols_a], [m.info for m in mols_b], [m.num_atoms for m in mols_a],
                        [m.num_atoms for m in mols_b], str(path), str(versus), sum(report_a.skipped.values()),
                        sum(report_b.skipped.values()))
    known = load_training_smiles(training_smiles_path) if training_smiles_path else None
    owned = None
    if isinstance(forcefield, str):
        from trainer.families.molecules_edm.forcefields import build_forcefield

        forcefield = owned = build_forcefield(forcefield)
    try:
        summary_a, rows_a = _evaluate(mols_a, str(path), report_a.records, report_a.skipped, forcefield, known,
                                      batch_size, write_extxyz)
        summary_b, rows_b = _evaluate(mols_b, str(versus), report_b.records, report_b.skipped, forcefield, known,
                                      batch_size, None)
    finally:
        if owned is not None:
            owned.close()
    return summary_a, summary_b, compare_paired(rows_a, rows_b, pairing)


def _evaluate(molecules: list[Molecule], name: str, records: int, skipped: dict[str, int], forcefield: Any,
              training_smiles_path: str | Path | set[str] | None, batch_size: int,
              write_extxyz: str | Path | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from trainer.families.molecules_edm.metrics import evaluate_molecules

    known = (training_smiles_path if isinstance(training_smiles_path, (set, frozenset))
             else load_training_smiles(training_smiles_path) if training_smiles_path else None)
    owned = None
    if isinstance(forcefield, str):
        from trainer.families.molecules_edm.forcefields import build_forcefield

        forcefield = owned = build_forcefield(forcefield)
    try:
        summary, per_molecule = evaluate_molecules(molecules, known, forcefield=forcefield, batch_size=batch_size)
    finally:
        if owned is not None:
            owned.close()
    if write_extxyz is not None:
        scored = [Molecule(m.numbers, m.positions, {**m.info, **{k: v for k, v in row.items() if v is not None}})
                  for m, row in zip(molecules, per_molecule)]
        write_molecules_extxyz(scored, write_extxyz)
    return {"file": name, "records_read": records, "skipped": dict(skipped), **summary}, per_molecule


def format_summary(summary: dict[str, Any]) -> str:
    """A short human-readable table of the headline rates (per cent) and counts."""
    lines = [f"{summary.get('file', '')}: {summary['num_molecules']} molecules, {summary['num_atoms']} atoms"]
    for key in HEADLINE:
        if key in summary:
            lines.append(f"  {key:20s} {100.0 * summary[key]:7.2f} %")
    for key in ("force_rms_mean", "force_rms_median", "force_max_mean", "energy_per_atom_mean", "energy_spread_mean",
                "force_spread_mean", "forcefield_failures", "forcefield_unsupported"):
        value = summary.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            lines.append(f"  {key:20s} {value:10.4f}" if isinstance(value, float) else f"  {key:20s} {value}")
    return "\n".join(lines)


def _signed(value: float, digits: int) -> str:
    return "nan" if math.isnan(value) else f"{value:+.{digits}f}"


def format_comparison(comparison: Comparison, name_a: str, name_b: str, forcefield: str | None = None) -> str:
    """The paired comparison A - B as lines: how the sets were paired and what was left out, each rate of A and
    B with A - B and its interval (and which interval), then the force metrics over the pairs scored on both
    sides with the pairs left out by reason."""
    c = comparison
    level = f"{100 * c.confidence:g} %"
    left = [f"{n} only in {side}" for n, side in ((c.only_a, "A"), (c.only_b, "B")) if n]
    lines = [f"A = {name_a}, B = {name_b}: {c.pairs} pairs by {c.paired_by}"
             + (f" ({c.note})" if c.note else "") + (f"; left out: {', '.join(left)}" if left else ""),
             f"  A - B over the pairs with its {level} interval (one that excludes 0 is a difference beyond the "
             "sampling noise); rates in %, differences in percentage points"]
    for key, r in c.rates.items():
        discordant = f"; A only {r.a_only}, B only {r.b_only}" if r.a_only is not None else ""
        lines.append(f"  {key:20s} A {100 * r.a:6.2f}  B {100 * r.b:6.2f}  A - B {_signed(100 * r.difference, 2):>6s}"
                     f"  [{_signed(100 * r.low, 2)}, {_signed(100 * r.high, 2)}]  {r.interval}{discordant}")
    if not c.forces:
        lines.append("  no force field (forcefield=none): no force or energy comparison")
        return "\n".join(lines)
    lines.append(f"  force field {forcefield or '?'}: A - B over the pairs it scored on both sides, mean ± standard "
                 f"error, {level} t-interval")
    for key, unit in FORCE_METRICS:
        d, left_out = c.forces[key], c.forces_left_out[key]
        reasons = ", ".join(f"{reason} {n}" for reason, n in left_out.items())
        lines.append(f"  {key + ' (' + unit + ')':20s} A {d.mean_a:.4f}  B {d.mean_b:.4f}  A - B {_signed(d.difference, 4)}"
                     f" ± {d.se:.4f}  [{_signed(d.low, 4)}, {_signed(d.high, 4)}]  n {d.n}: A lower in {d.lower}, "
                     f"higher in {d.higher}" + (f", equal in {d.equal}" if d.equal else "")
                     + (f"; left out {sum(left_out.values())}: {reasons}" if left_out else "; none left out"))
    return "\n".join(lines)


@dataclass
class EvaluateOptions:
    """Options of `trainer evaluate-molecules FILE key=value ...`."""

    training_smiles: str = ""
    """Training SMILES for novelty: a text file (one per line, .gz ok: the run artifact training_smiles.txt.gz)
    or a molecule file; empty: no novelty."""
    forcefield: str = "gfn2"
    """Force field of the force and energy metrics: gfn2 (GFN2-xTB), ani1x (the ANI-1x ensemble; adds
    energy_spread / force_spread, counts molecules with F as forcefield_unsupported), gfn1, ase:<module.Class>,
    uma:<name or file>, springs, or none (skip them)."""
    forcefield_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the force field, e.g. forcefield_kwargs={model: 7net-0}."""
    elements: list = field(default_factory=lambda: list(QM9_ELEMENTS))
    """Allowed elements, e.g. elements=[H,C,N,O,F]; [] allows any element."""
    min_distance: float = 0.0
    """Reject molecules with two atoms closer than this (Angstrom); 0 scores clashes (as unstable) instead."""
    on_invalid: str = "error"
    """Unreadable records: error or skip (counted in the summary)."""
    out: str = ""
    """Also write the summary as JSON here (with versus: FILE's summary and a `versus` entry)."""
    versus: str = ""
    """A second molecule file B drawn from the same noise as FILE (A): sample k of each from one seed, e.g. two
    models, or a guided set and its baseline. Adds the paired differences A - B with 95 % intervals."""
    write_extxyz: str = ""
    """Also write the molecules with their per-molecule metrics (extxyz info) here."""

    def validate(self) -> None:
        if self.on_invalid not in ("error", "skip"):
            raise ValueError(f"on_invalid must be error or skip, got {self.on_invalid!r}")


USAGE = "usage: trainer evaluate-molecules FILE [key=value ...]"


def main(argv: Sequence[str] | None = None) -> int:
    """`trainer evaluate-molecules FILE key=value ...`: EDM's metrics of an xyz/extxyz/SDF set, printed and
    as JSON. The options are `EvaluateOptions`' fields, parsed as `trainer sample`'s (`--help` lists them)."""
    from trainer.config import describe_fields, parse_options
    from trainer.errors import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or "-h" in argv or "--help" in argv:
        print(f"{USAGE}\n\nEDM's stability/validity/uniqueness/novelty metrics (and force-field metrics) of a "
              "molecule file: .xyz/.extxyz/.sdf, optionally .gz.\n")
        print(describe_fields({"": EvaluateOptions()}))
        return 0
    path, overrides = argv[0], argv[1:]
    flags = [a for a in [path, *overrides] if a.startswith("-")]
    if flags:
        raise ConfigError(f"trainer evaluate-molecules takes key=value options (e.g. forcefield=none), not "
                          f"{flags[0]}; `trainer evaluate-molecules --help` lists them")
    options = parse_options(EvaluateOptions, overrides)
    try:
        options.validate()
    except ValueError as err:
        raise ConfigError(f"trainer evaluate-molecules: {err}") from None
    forcefield = None
    if options.forcefield.strip().lower() != "none":
        from trainer.families.molecules_edm.forcefields import build_forcefield

        forcefield = build_forcefield(options.forcefield, **options.forcefield_kwargs)
    elements = tuple(str(e) for e in options.elements) or None
    try:
        if options.versus:
            summary, other, comparison = compare_files(
                path, options.versus, forcefield, options.training_smiles or None, elements,
                min_distance=options.min_distance, on_invalid=options.on_invalid,
                write_extxyz=options.write_extxyz or None)
        else:
            summary = evaluate_file(path, forcefield, options.training_smiles or None, elements,
                                    min_distance=options.min_distance, on_invalid=options.on_invalid,
                                    write_extxyz=options.write_extxyz or None)
    finally:
        if forcefield is not None:
            forcefield.close()
    print(format_summary(summary))
    if options.versus:
        print(format_summary(other))
        print(format_comparison(comparison, path, options.versus, summary.get("forcefield")))
        summary = {**summary, "versus": {"file": options.versus, "summary": other, **comparison.as_dict()}}
    if options.out:
        Path(options.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(options.out, json.dumps(summary, indent=1))
    return 0

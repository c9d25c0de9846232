"""EDM's sample-quality metrics, reproduced exactly, and per-molecule force-field metrics.

Definitions (Hoogeboom et al. 2022; reference code `qm9/bond_analyze.py`, `qm9/analyze.py`,
`qm9/rdkit_functions.py`):

- Bond order of a pair from its distance d in pm and the element pair: 1 if d < single + 10, raised to
  2 if the pair has a double-bond length and d < double + 5, to 3 if it has a triple-bond length and
  d < triple + 3; otherwise 0 (strict comparisons, as the reference). Pairs outside the H/C/N/O/F table
  never bond (the reference would raise; `check_exists` in its GEOM path returns 0 likewise).
- An atom is stable iff the sum of its bond orders equals its valence (H 1, C 4, N 3, O 2, F 1; an
  element without a valence is never stable); a molecule is stable iff all its atoms are. Atom
  stability is pooled over all atoms of the set (stable atoms / atoms), not a mean of per-molecule ratios.
- Validity: an RDKit molecule with those bonds and no explicit H counts (RDKit fills missing valence
  with implicit hydrogens, as in the reference), `SanitizeMol`; a failure is invalid. A valid
  molecule's SMILES is that of its largest fragment. We write it without explicit hydrogen atoms
  (`RemoveHs`), a one-to-one rewrite of the reference's `[H]`-laden SMILES, so uniqueness and novelty
  counts are the same and the strings compare with ordinary canonical SMILES.
- Uniqueness = unique valid SMILES / valid; valid_and_unique = unique valid / all; novelty = unique
  valid SMILES not among the training SMILES / unique valid. Every rate is a fraction in [0, 1] (0.0
  when its denominator is 0, as the reference).

Force-field metrics (with a `ForceField`): per molecule `force_rms` = sqrt(mean over atoms of |F_i|^2)
and `force_max` = max_i |F_i| (eV/Angstrom), `energy_per_atom` (eV) and `forcefield_ok`, and for an ensemble
(ani1x) `energy_spread` (members' energy std per atom) and `force_spread`; summaries take the mean and median
over the molecules the force field succeeded on, count the failures, and count apart the molecules with an
element the force field does not model (`forcefield_unsupported`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from trainer.families.molecules_edm.molecule import Molecule

logger = logging.getLogger(__name__)

MARGINS_PM: tuple[int, int, int] = (10, 5, 3)
"""Margins (pm) added to the single, double and triple bond lengths (EDM, tuned on QM9)."""

SINGLE_BOND_PM: dict[tuple[str, str], int] = {
    ("H", "H"): 74, ("H", "C"): 109, ("H", "N"): 101, ("H", "O"): 96, ("H", "F"): 92,
    ("C", "C"): 154, ("C", "N"): 147, ("C", "O"): 143, ("C", "F"): 135,
    ("N", "N"): 145, ("N", "O"): 140, ("N", "F"): 136,
    ("O", "O"): 148, ("O", "F"): 142, ("F", "F"): 142,
}
"""Typical single-bond lengths (pm) of EDM's table, for the QM9 elements."""
DOUBLE_BOND_PM: dict[tuple[str, str], int] = {
    ("C", "C"): 134, ("C", "N"): 129, ("C", "O"): 120, ("N", "N"): 125, ("N", "O"): 121, ("O", "O"): 121,
}
TRIPLE_BOND_PM: dict[tuple[str, str], int] = {("C", "C"): 120, ("C", "N"): 116, ("C", "O"): 113, ("N", "N"): 110}
VALENCE: dict[int, int] = {1: 1, 6: 4, 7: 3, 8: 2, 9: 1}
"""Allowed number of bonds (sum of bond orders) by atomic number (EDM's `allowed_bonds` for QM9)."""

_TABLE_Z = (1, 6, 7, 8, 9)
_SYMBOL_Z = {"H": 1, "C": 6, "N": 7, "O": 8, "F": 9}
_FORCE_KEYS = ("force_rms", "force_max", "energy_per_atom")
_SPREAD_KEYS = ("energy_spread", "force_spread")


def _threshold_table(lengths: dict[tuple[str, str], int], margin: int) -> np.ndarray:
    """[119, 119] thresholds in pm (length + margin) by atomic numbers; -inf where the pair has no entry."""
    table = np.full((119, 119), -np.inf)
    for (a, b), length in lengths.items():
        za, zb = _SYMBOL_Z[a], _SYMBOL_Z[b]
        table[za, zb] = table[zb, za] = length + margin
    return table


_THRESHOLDS = tuple(_threshold_table(t, m) for t, m in zip((SINGLE_BOND_PM, DOUBLE_BOND_PM, TRIPLE_BOND_PM), MARGINS_PM))
_VALENCE_BY_Z = np.full(119, -1, dtype=np.int64)
for _z, _v in VALENCE.items():
    _VALENCE_BY_Z[_z] = _v


def bond_order(z1: int, z2: int, distance_A: float) -> int:
    """EDM's bond order (0-3) of atoms with atomic numbers z1, z2 at `distance_A` Angstrom."""
    z1, z2 = int(z1), int(z2)
    if not (0 <= z1 < 119 and 0 <= z2 < 119):
        return 0
    d = 100.0 * float(distance_A)
    single, double, triple = (t[z1, z2] for t in _THRESHOLDS)
    if not d < single:
        return 0
    if not d < double:
        return 1
    return 3 if d < triple else 2


def _distances(positions: np.ndarray) -> np.ndarray:
    diff = positions[:, None, :] - positions[None, :, :]
    return np.sqrt((diff * diff).sum(-1))


def bond_order_matrix(numbers: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[n, n] int64 symmetric matrix of EDM's bond orders (zero diagonal) of one molecule."""
    z = np.asarray(numbers, dtype=np.int64).reshape(-1)
    pos = np.asarray(positions, dtype=np.float64).reshape(-1, 3)
    n = len(z)
    if n == 0:
        return np.zeros((0, 0), dtype=np.int64)
    zc = np.where((z >= 0) & (z < 119), z, 0)  # Z = 0 has no table entries: never bonds
    d_pm = 100.0 * _distances(pos)
    pair = (zc[:, None], zc[None, :])
    single, double, triple = (d_pm < t[pair] for t in _THRESHOLDS)
    order = single * (1 + double * (1 + triple))
    np.fill_diagonal(order, 0)
    return order.astype(np.int64)


def check_stability(numbers: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, bool]:
    """(stable_atom_mask [n] bool, molecule_stable) by EDM's valence rule. A molecule without atoms is
    not stable (the reference never sees one)."""
    z = np.asarray(numbers, dtype=np.int64).reshape(-1)
    bonds = bond_order_matrix(z, positions).sum(axis=1)
    valence = _VALENCE_BY_Z[np.clip(z, 0, 118)]
    stable = (valence >= 0) & (bonds == valence)
    return stable, bool(len(z) > 0 and stable.all())


def build_rdkit_molecule(numbers: np.ndarray, positions: np.ndarray) -> Any:
    """An RDKit `RWMol` with EDM's bonds (single/double/triple) and no explicit hydrogen counts (unsanitised)."""
    from rdkit import Chem

    bond_types = {1: Chem.BondType.SINGLE, 2: Chem.BondType.DOUBLE, 3: Chem.BondType.TRIPLE}
    z = np.asarray(numbers, dtype=np.int64).reshape(-1)
    order = bond_order_matrix(z, positions)
    mol = Chem.RWMol()
    for atomic_number in z.tolist():
        mol.AddAtom(Chem.Atom(int(atomic_number)))
    for i, j in zip(*np.nonzero(np.tril(order))):  # i > j, as the reference adds them
        mol.AddBond(int(i), int(j), bond_types[int(order[i, j])])
    return mol


def _sanitized_smiles(mol: Any) -> str | None:
    from rdkit import Chem

    try:
        Chem.SanitizeMol(mol)
    except Exception:  # RDKit raises several exception types for bad valences, kekulisation, ...
        return None
    return Chem.MolToSmiles(mol)


def molecule_smiles(numbers: np.ndarray, positions: np.ndarray, mol: Any = None) -> str | None:
    """Canonical SMILES (no explicit H atoms, no stereo) of the largest fragment of EDM's molecule, or
    None when RDKit cannot sanitise it (invalid). `mol`: an already built `build_rdkit_molecule`."""
    from rdkit import rdBase

    mol = build_rdkit_molecule(numbers, positions) if mol is None else mol
    with rdBase.BlockLogs():  # an invalid molecule is a result here, not a message for the log
        return _largest_fragment_smiles(mol)


def smiles_of(geometries: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[str | None]:
    """`molecule_smiles` of each (numbers, positions): the task of a SMILES pool (`dataset._perceive_smiles`),
    defined in this module because a spawned worker imports the module of its task, and this one needs
    neither torch nor `datasets`."""
    return [molecule_smiles(numbers, positions) for numbers, positions in geometries]


def _largest_fragment_smiles(mol: Any) -> str | None:
    from rdkit import Chem

    if _sanitized_smiles(mol) is None:
        return None
    fragments = Chem.GetMolFrags(mol, asMols=True, sanitizeFrags=False)
    largest = max(fragments, default=mol, key=lambda m: m.GetNumAtoms())
    if _sanitized_smiles(largest) is None:
        return None
    try:
        return Chem.MolToSmiles(Chem.RemoveHs(largest))
    except Exception:  # RemoveHs re-sanitises; keep the explicit-H form if that fails
        return Chem.MolToSmiles(largest)


# --------------------------------------------------------------------------------------------------
# force field


def forcefield_values(molecules: Sequence[Molecule], forcefield: Any, batch_size: int = 64,
                      prefix: str = "") -> list[dict[str, Any]]:
    """Per molecule {forcefield_ok, force_rms, force_max (eV/Angstrom), energy_per_atom (eV)} from one
    `ForceField`, called on padded batches of `batch_size` molecules (NaN values where not ok); an ensemble adds
    `energy_spread` (eV/atom) and `force_spread` (eV/Angstrom). A molecule with an element the force field does
    not model (`supported_numbers`) is `forcefield_unsupported`, not a failure. Keys start with `prefix`."""
    from trainer.families.molecules_edm.forcefields import pad_molecules

    supported = getattr(forcefield, "supported_numbers", None)
    out: list[dict[str, Any]] = []
    for start in range(0, len(molecules), batch_size):
        chunk = molecules[start:start + batch_size]
        numbers, positions, mask = pad_molecules(chunk)
        spreads: dict[str, np.ndarray] = {}
        try:
            result = forcefield.compute(numbers, positions, mask)
            energy, forces, ok = np.asarray(result.energy), np.asarray(result.forces), np.asarray(result.ok, dtype=bool)
            for key in _SPREAD_KEYS:
                if getattr(result, key, None) is not None:
                    spreads[key] = np.asarray(getattr(result, key), dtype=np.float64)
        except Exception as e:  # a force field must not raise, but one that does fails its batch, not the run
            logger.warning("force field %s failed on molecules %d-%d: %s: %s", getattr(forcefield, "name", "?"),
                           start, start + len(chunk) - 1, type(e).__name__, e)
            energy, forces, ok = np.full(len(chunk), np.nan), np.zeros((len(chunk), mask.shape[1], 3)), np.zeros(len(chunk), bool)
        for b, mol in enumerate(chunk):
            n = mol.num_atoms
            f = forces[b, :n] if forces.ndim == 3 else np.zeros((n, 3))
            norms = np.linalg.norm(f, axis=-1)
            good = bool(ok[b]) and n > 0 and np.isfinite(energy[b]) and np.isfinite(norms).all()
            values = {
                "forcefield_ok": good,
                "force_rms": float(np.sqrt(np.mean(norms ** 2))) if good else float("nan"),
                "force_max": float(norms.max()) if good else float("nan"),
                "energy_per_atom": float(energy[b]) / n if good else float("nan"),
                **{key: float(spread[b]) if good else float("nan") for key, spread in spreads.items()},
            }
            if supported is not None:
                values["forcefield_unsupported"] = not set(np.asarray(mol.numbers).tolist()) <= set(supported)
            out.append({prefix + key: value for key, value in values.items()})
    return out


def summarize_forcefield_values(items: Iterable[Molecule | dict[str, Any]], prefix: str = "") -> dict[str, Any]:
    """Mean and median of force_rms / force_max / energy_per_atom (and an ensemble's energy_spread /
    force_spread) over the molecules with forcefield_ok, `forcefield_molecules` (evaluated),
    `forcefield_unsupported` (elements the force field does not model; not evaluated) and `forcefield_failures`;
    reads each Molecule's `info` (or a dict), keys starting with `prefix`. Empty when no molecule carries them."""
    rows = [item.info if isinstance(item, Molecule) else item for item in items]
    rows = [r for r in rows if prefix + "forcefield_ok" in r]
    if not rows:
        return {}
    unsupported = [r for r in rows if bool(r.get(prefix + "forcefield_unsupported", False))]
    rows = [r for r in rows if not bool(r.get(prefix + "forcefield_unsupported", False))]
    ok = [r for r in rows if bool(r[prefix + "forcefield_ok"])]
    out: dict[str, Any] = {"forcefield_molecules": len(rows), "forcefield_failures": len(rows) - len(ok)}
    if unsupported:
        out["forcefield_unsupported"] = len(unsupported)
    keys = list(_FORCE_KEYS) + [k for k in _SPREAD_KEYS if any(prefix + k in r for r in ok)]
    for key in keys:
        values = np.array([float(r[prefix + key]) for r in ok], dtype=np.float64)
        out[f"{key}_mean"] = float(values.mean()) if len(values) else float("nan")
        out[f"{key}_median"] = float(np.median(values)) if len(values) else float("nan")
    return {prefix + key: value for key, value in out.items()}


# --------------------------------------------------------------------------------------------------
# the set


def _rate(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else 0.0


def evaluate_molecules(molecules: Sequence[Molecule], training_smiles: Iterable[str] | None = None,
                       forcefield: Any = None, batch_size: int = 64) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """EDM's metrics of a set of molecules, and per-molecule values.

    Summary (rates are fractions in [0, 1]): `atom_stability` (pooled over atoms), `molecule_stability`,
    `validity`, `uniqueness` (unique valid / valid), `valid_and_unique` (unique valid / all), `novelty`
    (unique valid not in `training_smiles` / unique valid; only when `training_smiles` is given, in
    `molecule_smiles`' form), and the counts `num_molecules`, `num_atoms`, `num_stable_atoms`,
    `num_stable_molecules`, `num_valid`, `num_unique_valid` (`num_novel`), `seconds`. With a
    `forcefield`: `summarize_forcefield_values` keys, `forcefield`, `forcefield_seconds`,
    `forcefield_evaluations_per_second`.

    Per molecule: `stable`, `num_stable_atoms`, `num_atoms`, `valid`, `smiles` (None when invalid) and,
    with a force field, `forcefield_ok`, `force_rms`, `force_max`, `energy_per_atom`.
    """
    started = time.perf_counter()
    per_molecule: list[dict[str, Any]] = []
    atoms = stable_atoms = stable_molecules = 0
    valid_smiles: list[str] = []
    for mol in molecules:
        stable_mask, stable = check_stability(mol.numbers, mol.positions)
        smiles = molecule_smiles(mol.numbers, mol.positions)
        atoms += mol.num_atoms
        stable_atoms += int(stable_mask.sum())
        stable_molecules += int(stable)
        if smiles is not None:
            valid_smiles.append(smiles)
        per_molecule.append({"stable": stable, "num_stable_atoms": int(stable_mask.sum()), "num_atoms": mol.num_atoms,
                             "valid": smiles is not None, "smiles": smiles})
    n = len(per_molecule)
    unique = set(valid_smiles)
    summary: dict[str, Any] = {
        "num_molecules": n, "num_atoms": atoms, "num_stable_atoms": stable_atoms,
        "num_stable_molecules": stable_molecules, "num_valid": len(valid_smiles), "num_unique_valid": len(unique),
        "atom_stability": _rate(stable_atoms, atoms), "molecule_stability": _rate(stable_molecules, n),
        "validity": _rate(len(valid_smiles), n), "uniqueness": _rate(len(unique), len(valid_smiles)),
        "valid_and_unique": _rate(len(unique), n),
    }
    if training_smiles is not None:
        known = training_smiles if isinstance(training_smiles, AbstractSet) else set(training_smiles)
        novel = sum(1 for s in unique if s not in known)
        summary.update(num_novel=novel, novelty=_rate(novel, len(unique)))
    if forcefield is not None:
        ff_started = time.perf_counter()
        values = forcefield_values(molecules, forcefield, batch_size=batch_size)
        ff_seconds = time.perf_counter() - ff_started
        for row, v in zip(per_molecule, values):
            row.update(v)
        name = str(getattr(forcefield, "name", type(forcefield).__name__))
        summary.update(summarize_forcefield_values(values), forcefield=name, forcefield_seconds=ff_seconds,
                       forcefield_evaluations_per_second=len(values) / ff_seconds if ff_seconds > 0 else float("nan"))
    summary["seconds"] = time.perf_counter() - started
    return summary, per_molecule

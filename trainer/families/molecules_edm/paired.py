"""Paired statistics of two molecule sets drawn from the same noise: sample k of A and sample k of B share their
starting noise (`trainer sample` at one seed from two models, or a guided set against the baseline of the same
run), so A - B is taken pair by pair and the noise the two share drops out of the comparison.

Every interval is a two-sided 95 % interval of A - B over the pairs (an interval that excludes 0 is a difference
beyond the sampling noise of this many pairs):

- a per-molecule value (force RMS, energy per atom) over the pairs the force field scored on both sides: the
  mean of the differences, its standard error sd / sqrt(n) and Student's t-interval;
- a per-molecule yes/no (valid, stable molecule): the difference of the two proportions with Newcombe's
  square-and-add score interval for paired proportions (Wilson intervals of each side combined with the pairs'
  continuity-corrected correlation; Newcombe 1998, method 10), which keeps its coverage near 0 and 1 where the
  Wald interval does not;
- atom stability (stable atoms over atoms, pooled over the set: a ratio, not a mean of molecules): the
  delta-method standard error over the molecule pairs and a t-interval;
- uniqueness (unique valid SMILES over valid: a set-level rate): the leave-one-pair-out jackknife standard error
  and a t-interval. A bootstrap would be biased here: resampling with replacement repeats molecules, and a
  repeat counts as a duplicate SMILES.

Intervals of a rate difference are cut to [-1, 1]; with fewer than two pairs a t-interval is NaN.

Pairing (`pair_sets`): by the `sample_index` that `trainer sample` writes in each molecule's info when both
files carry it, else by order; sets that cannot be paired are refused with a `PairingError`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from trainer.errors import DataError

CONFIDENCE = 0.95
INDEX_KEY = "sample_index"
"""The info field of a molecule's sample index (`trainer sample` writes it; k of `sample_generator(seed, k)`)."""
FORCE_METRICS = (("force_rms", "eV/A"), ("energy_per_atom", "eV"))


class PairingError(DataError):
    """Two molecule sets that cannot be paired sample for sample: the message names both files and the record."""


def _t_quantile(n: int, confidence: float = CONFIDENCE) -> float:
    """Student's t quantile with n - 1 degrees of freedom (NaN below two pairs)."""
    if n < 2:
        return math.nan
    from scipy import stats

    return float(stats.t.ppf(0.5 + confidence / 2, n - 1))


def _z(confidence: float = CONFIDENCE) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(0.5 + confidence / 2)


# --------------------------------------------------------------------------------------------------
# the statistics


@dataclass(frozen=True)
class MeanDifference:
    """A - B of a per-molecule value over the pairs scored on both sides."""

    n: int
    mean_a: float
    mean_b: float
    difference: float
    """Mean of A - B over the pairs."""
    se: float
    low: float
    high: float
    lower: int
    """Pairs where A's value is below B's."""
    higher: int
    """Pairs where A's value is above B's."""
    equal: int
    interval: str = "t-interval of the mean paired difference"


@dataclass(frozen=True)
class RateDifference:
    """A - B of a rate (a fraction in [0, 1]) over the pairs."""

    n: int
    a: float
    b: float
    difference: float
    low: float
    high: float
    interval: str
    se: float | None = None
    """Standard error where the interval is built from one (None for the score interval)."""
    a_only: int | None = None
    """Pairs where A has the property and B not (per-molecule yes/no rates only)."""
    b_only: int | None = None


def paired_mean_difference(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> MeanDifference:
    """Mean, standard error (sd / sqrt(n), ddof 1) and t-interval of a - b over pairs of finite values; the counts
    of pairs with a below, above and equal to b. Fewer than two pairs: NaN standard error and interval."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired values need two 1-D arrays of one length, got {x.shape} and {y.shape}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("paired values must be finite: leave the unscored pairs out first")
    d = x - y
    n = len(d)
    mean = float(d.mean()) if n else math.nan
    se = float(d.std(ddof=1) / math.sqrt(n)) if n >= 2 else math.nan
    half = _t_quantile(n, confidence) * se
    return MeanDifference(n=n, mean_a=float(x.mean()) if n else math.nan, mean_b=float(y.mean()) if n else math.nan,
                          difference=mean, se=se, low=mean - half, high=mean + half, lower=int((d < 0).sum()),
                          higher=int((d > 0).sum()), equal=int((d == 0).sum()))


def _wilson(successes: int, n: int, z: float) -> tuple[float, float]:
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_proportion_difference(a: Sequence[bool], b: Sequence[bool], confidence: float = CONFIDENCE) -> RateDifference:
    """Proportion of a minus proportion of b over pairs of yes/no values, with Newcombe's square-and-add score
    interval for paired proportions (method 10 of Newcombe 1998) and the discordant counts (a only, b only)."""
    x, y = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired values need two 1-D arrays of one length, got {x.shape} and {y.shape}")
    n = len(x)
    both, a_only = int((x & y).sum()), int((x & ~y).sum())
    b_only, neither = int((~x & y).sum()), int((~x & ~y).sum())
    method = "Newcombe's paired score interval"
    if n == 0:
        return RateDifference(0, math.nan, math.nan, math.nan, math.nan, math.nan, method, a_only=0, b_only=0)
    p1, p2 = (both + a_only) / n, (both + b_only) / n
    z = _z(confidence)
    l1, u1 = _wilson(both + a_only, n, z)
    l2, u2 = _wilson(both + b_only, n, z)
    margins = (both + a_only) * (b_only + neither) * (both + b_only) * (a_only + neither)
    # The pairs' correlation, continuity-corrected towards 0 as Newcombe recommends (a positive one narrows the
    # interval, so a small one is not trusted).
    cross = both * neither - a_only * b_only
    cross = cross - n / 2 if cross > n / 2 else (0.0 if cross >= 0 else cross)
    phi = cross / math.sqrt(margins) if margins else 0.0
    d = p1 - p2
    low = d - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    high = d + math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    return RateDifference(n, p1, p2, d, max(-1.0, low), min(1.0, high), method, a_only=a_only, b_only=b_only)


def paired_ratio_difference(num_a: Sequence[float], den_a: Sequence[float], num_b: Sequence[float],
                            den_b: Sequence[float], confidence: float = CONFIDENCE) -> RateDifference:
    """sum(num_a) / sum(den_a) - sum(num_b) / sum(den_b) over pairs (a pooled rate such as stable atoms over
    atoms), with the delta-method standard error over the pairs and a t-interval."""
    arrays = [np.asarray(v, dtype=np.float64) for v in (num_a, den_a, num_b, den_b)]
    if len({v.shape for v in arrays}) != 1 or arrays[0].ndim != 1:
        raise ValueError("a paired ratio needs four 1-D arrays of one length")
    na, da, nb, db = arrays
    n = len(na)
    method = "t-interval, delta-method standard error over the pairs"
    if n == 0 or da.sum() <= 0 or db.sum() <= 0:
        return RateDifference(n, math.nan, math.nan, math.nan, math.nan, math.nan, method, se=math.nan)
    ra, rb = na.sum() / da.sum(), nb.sum() / db.sum()
    # Each pair's share of the difference, linearised around the pooled rates.
    influence = (na - ra * da) / da.mean() - (nb - rb * db) / db.mean()
    se = float(influence.std(ddof=1) / math.sqrt(n)) if n >= 2 else math.nan
    d = float(ra - rb)
    half = _t_quantile(n, confidence) * se
    return RateDifference(n, float(ra), float(rb), d, max(-1.0, d - half), min(1.0, d + half), method, se=se)


def _uniqueness_leave_one_out(smiles: Sequence[str | None]) -> tuple[float, np.ndarray]:
    """Uniqueness (unique valid / valid; 0 without a valid molecule) of the set, and of the set without each one."""
    counts = Counter(s for s in smiles if s is not None)
    valid = sum(counts.values())
    unique = len(counts)
    drop_valid = np.array([s is not None for s in smiles], dtype=np.float64)
    drop_unique = np.array([s is not None and counts[s] == 1 for s in smiles], dtype=np.float64)
    rest_valid = valid - drop_valid
    with np.errstate(divide="ignore", invalid="ignore"):
        rest = np.where(rest_valid > 0, (unique - drop_unique) / np.maximum(rest_valid, 1), 0.0)
    return (unique / valid if valid else 0.0), rest


def paired_uniqueness_difference(smiles_a: Sequence[str | None], smiles_b: Sequence[str | None],
                                 confidence: float = CONFIDENCE) -> RateDifference:
    """Uniqueness of a minus uniqueness of b (each: unique valid SMILES / valid; None marks an invalid molecule)
    over pairs, with the leave-one-pair-out jackknife standard error and a t-interval."""
    if len(smiles_a) != len(smiles_b):
        raise ValueError(f"paired SMILES need one length, got {len(smiles_a)} and {len(smiles_b)}")
    n = len(smiles_a)
    method = "t-interval, jackknife standard error over the pairs"
    ua, rest_a = _uniqueness_leave_one_out(smiles_a)
    ub, rest_b = _uniqueness_leave_one_out(smiles_b)
    d = ua - ub if n else math.nan
    if n < 2:
        return RateDifference(n, ua if n else math.nan, ub if n else math.nan, d, math.nan, math.nan, method,
                              se=math.nan)
    rest = rest_a - rest_b
    se = float(math.sqrt((n - 1) / n * float(((rest - rest.mean()) ** 2).sum())))
    half = _t_quantile(n, confidence) * se
    return RateDifference(n, ua, ub, d, max(-1.0, d - half), min(1.0, d + half), method, se=se)


# --------------------------------------------------------------------------------------------------
# pairing


@dataclass(frozen=True)
class Pairing:
    """Which molecule of A goes with which of B (positions in each set's list)."""

    pairs: list[tuple[int, int]]
    by: str
    """`sample_index` or `order`."""
    only_a: int = 0
    """Molecules of A whose sample index B lacks (left out), and the reverse."""
    only_b: int = 0
    note: str = ""


def _sample_indices(infos: Sequence[Mapping[str, Any]], name: str) -> list[int] | None:
    """Every molecule's `sample_index`, None when no molecule has one; a file with it on only some molecules, or
    with a value that is not a whole number >= 0, is an error naming the record."""
    present = [INDEX_KEY in info for info in infos]
    if not any(present):
        return None
    out = []
    for k, info in enumerate(infos):
        record = f"{name}: record {k} (id {info.get('id', '?')!r})"
        if INDEX_KEY not in info:
            raise PairingError(f"{record}: no {INDEX_KEY} field, though other molecules of the file have one")
        value = info[INDEX_KEY]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
            raise PairingError(f"{record}: field {INDEX_KEY} is {value!r}, not a sample index (a whole number >= 0)")
        out.append(int(value))
    return out


def pair_sets(infos_a: Sequence[Mapping[str, Any]], infos_b: Sequence[Mapping[str, Any]], atoms_a: Sequence[int],
              atoms_b: Sequence[int], name_a: str, name_b: str, skipped_a: int = 0, skipped_b: int = 0) -> Pairing:
    """Pair two sets drawn from the same noise: by `sample_index` in the molecules' info when both files carry it
    (indices in one file only are counted as left out), else by order.

    Refused with a `PairingError` naming both files: a sample index twice in one file, no common index, sets of
    different sizes (or with skipped records) without indices, a file whose indices disagree with pairing by order,
    and a pair whose atom counts differ (from the same noise they cannot: the atom count of sample k is drawn
    first from sample k's generator, or fixed by num_atoms=N).
    """
    both = f"{name_a} versus {name_b}"
    index_a, index_b = _sample_indices(infos_a, name_a), _sample_indices(infos_b, name_b)
    if index_a is not None and index_b is not None:
        positions = []
        for name, index in ((name_a, index_a), (name_b, index_b)):
            where: dict[int, int] = {}
            for k, value in enumerate(index):
                if value in where:
                    raise PairingError(f"{both}: cannot pair: {name} has {INDEX_KEY} {value} twice "
                                       f"(records {where[value]} and {k})")
                where[value] = k
            positions.append(where)
        common = sorted(positions[0].keys() & positions[1].keys())
        if not common:
            raise PairingError(f"{both}: cannot pair: no {INDEX_KEY} is in both files")
        pairs = [(positions[0][i], positions[1][i]) for i in common]
        pairing = Pairing(pairs, INDEX_KEY, only_a=len(index_a) - len(common), only_b=len(index_b) - len(common))
    else:
        if len(infos_a) != len(infos_b):
            raise PairingError(f"{both}: cannot pair: {len(infos_a)} and {len(infos_b)} molecules, and the files "
                               f"do not both carry {INDEX_KEY} to pair them by")
        if skipped_a or skipped_b:
            raise PairingError(f"{both}: cannot pair by order: records were skipped ({skipped_a} of {name_a}, "
                               f"{skipped_b} of {name_b}) and no {INDEX_KEY} in both files says which is which")
        note = ""
        for name, index in ((name_a, index_a), (name_b, index_b)):
            if index is None:
                continue
            if index != list(range(len(index))):
                raise PairingError(f"{both}: cannot pair: only {name} has {INDEX_KEY}, and its indices are not "
                                   "0, 1, 2, ... in file order, so the order of the other file cannot be trusted")
            note = f"only {name} has {INDEX_KEY} (0, 1, 2, ... in order)"
        pairing = Pairing([(k, k) for k in range(len(infos_a))], "order", note=note)
    for i, j in pairing.pairs:
        if int(atoms_a[i]) != int(atoms_b[j]):
            label = f"{INDEX_KEY} {index_a[i]}" if pairing.by == INDEX_KEY else f"position {i}"
            raise PairingError(f"{both}: cannot pair: {label} has {atoms_a[i]} atoms in {name_a} (record {i}) and "
                               f"{atoms_b[j]} in {name_b} (record {j}); samples drawn from the same noise have the "
                               "same atom count")
    return pairing


# --------------------------------------------------------------------------------------------------
# the comparison


def _scored(row: Mapping[str, Any], key: str) -> str:
    """`ok`, `unsupported` (an element the force field does not model) or `failed`, for one molecule's row."""
    if row.get("forcefield_unsupported"):
        return "unsupported"
    value = row.get(key)
    if row.get("forcefield_ok") and isinstance(value, (int, float)) and math.isfinite(value):
        return "ok"
    return "failed"


@dataclass
class Comparison:
    """A - B of two paired sets (`compare_paired`); `as_dict` for JSON."""

    pairs: int
    paired_by: str
    only_a: int
    only_b: int
    rates: dict[str, RateDifference]
    forces: dict[str, MeanDifference] = field(default_factory=dict)
    forces_left_out: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per force metric, the pairs left out by reason (`A failed`, `B unsupported`, `A failed, B failed`, ...)."""
    note: str = ""
    confidence: float = CONFIDENCE

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_paired(rows_a: Sequence[Mapping[str, Any]], rows_b: Sequence[Mapping[str, Any]], pairing: Pairing,
                   confidence: float = CONFIDENCE) -> Comparison:
    """A - B over the pairs of per-molecule rows (`metrics.evaluate_molecules`' per-molecule output: `valid`,
    `smiles`, `stable`, `num_stable_atoms`, `num_atoms` and, with a force field, `forcefield_ok`, `force_rms`,
    `energy_per_atom`, `forcefield_unsupported`): validity, molecule stability, atom stability and uniqueness, and
    the force metrics over the pairs scored on both sides with the others counted by reason."""
    a = [rows_a[i] for i, _ in pairing.pairs]
    b = [rows_b[j] for _, j in pairing.pairs]
    rates = {
        "validity": paired_proportion_difference([r["valid"] for r in a], [r["valid"] for r in b], confidence),
        "molecule_stability": paired_proportion_difference([r["stable"] for r in a], [r["stable"] for r in b],
                                                           confidence),
        "atom_stability": paired_ratio_difference([r["num_stable_atoms"] for r in a], [r["num_atoms"] for r in a],
                                                  [r["num_stable_atoms"] for r in b], [r["num_atoms"] for r in b],
                                                  confidence),
        "uniqueness": paired_uniqueness_difference([r["smiles"] if r["valid"] else None for r in a],
                                                   [r["smiles"] if r["valid"] else None for r in b], confidence),
    }
    forces: dict[str, MeanDifference] = {}
    left_out: dict[str, dict[str, int]] = {}
    if a and all("forcefield_ok" in r for r in (*a, *b)):
        for key, _unit in FORCE_METRICS:
            kept, reasons = [], Counter()
            for ra, rb in zip(a, b):
                sa, sb = _scored(ra, key), _scored(rb, key)
                if sa == sb == "ok":
                    kept.append((float(ra[key]), float(rb[key])))
                else:
                    reasons[", ".join(f"{side} {s}" for side, s in (("A", sa), ("B", sb)) if s != "ok")] += 1
            forces[key] = paired_mean_difference([x for x, _ in kept], [y for _, y in kept], confidence)
            left_out[key] = dict(sorted(reasons.items()))
    return Comparison(len(pairing.pairs), pairing.by, pairing.only_a, pairing.only_b, rates, forces, left_out,
                      pairing.note, confidence)

"""GEARS' condition splits (`DataSplitter` of gears/data_utils.py) with numpy Generators.

Every mode splits conditions, never cells; 'ctrl' is always in train. Random draws come from numpy
Generators derived from `seed` (`trainer.seeding.derive_rng`): the same conditions and seed give the
same split in any process and at any world size, whatever the input order. (GEARS seeds numpy's
global RandomState, so the sets differ from GEARS' for the same seed; pass GEARS' own split with
mode `custom` to reproduce one.)

Modes (`split_conditions`):
- `simulation` (GEARS' default): a random `train_gene_set_size` of the perturbed genes are "seen";
  train = singles of seen genes + a random `combo_seen2_train_frac` of the doubles with both genes
  seen; test = unseen singles and the doubles with 0, 1 or the remaining 2 seen genes. Validation is
  carved from train by the same rule with 0.9 / 0.9. Test and validation subgroups: combo_seen0,
  combo_seen1, combo_seen2, unseen_single. Guarantee: no unseen gene (a gene of a test or validation
  unseen single, or of a combo_seen0 / combo_seen1 double's unseen side) appears in any train condition.
- `simulation_single`: the same on singles only; doubles are held out (counted, logged; GEARS asserts
  there are none).
- `single`: test genes = a random int(#singles x test_fraction) of the genes; test = their singles;
  doubles with a test gene are held out. `combo_seen0`: test = singles of the test genes + doubles of
  two test genes; doubles with one test gene are held out. `combo_seen1`: test = singles of the test
  genes + every double with a test gene. `combo_seen2`: test = a random test_fraction of the doubles.
  Validation is carved from train by the same rule with `val_fraction`. (GEARS draws test genes with
  replacement; we draw without, so the test set has the size asked for.)
- `no_test`: validation = a random test_fraction of the doubles, no test set. `no_split`: every
  condition in test. `custom`: a JSON {"train": [...], "val": [...], "test": [...]} or GEARS' split
  pickle (the user's own file; pickle is GEARS' format); conditions of the data that the file does not
  list are held out (counted), listed conditions absent from the data are reported.

For every mode the test and validation conditions are also grouped by how many of their genes occur
in train conditions (combo_seen0/1/2, unseen_single, seen_single); for `simulation` the subgroups are
GEARS' own (relative to the seen-gene draw).
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.atomic_io import atomic_write_json
from trainer.errors import ConfigError, DataError
from trainer.families.perturbation_gears.conditions import Condition, as_condition, format_condition
from trainer.families.perturbation_gears.spec import SPLIT_MODES, SUBGROUPS
from trainer.seeding import derive_rng

logger = logging.getLogger(__name__)


@dataclass
class SplitResult:
    """Condition lists (GEARS strings, sorted) of each set, the subgroups and what was held out."""

    mode: str
    seed: int
    train: list[str]
    val: list[str]
    test: list[str]
    subgroups: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """{"test": {subgroup: [conditions]}, "val": {...}}."""
    held_out: list[str] = field(default_factory=list)
    """Conditions in no set (by the mode's rule, or unlisted in a custom file)."""
    params: dict[str, Any] = field(default_factory=dict)

    def conditions(self, which: str) -> list[Condition]:
        """Canonical conditions of "train", "val" or "test"."""
        return [as_condition(c) for c in getattr(self, which)]

    def counts(self) -> dict[str, int]:
        return {"train": len(self.train), "val": len(self.val), "test": len(self.test), "held_out": len(self.held_out)}

    def save(self, path: str | Path) -> None:
        """Write the split as JSON (atomically)."""
        atomic_write_json(path, asdict(self))

    @classmethod
    def load(cls, path: str | Path) -> SplitResult:
        """Read a split written by `save`."""
        path = Path(path)
        try:
            obj = json.loads(path.read_text())
            return cls(**obj)
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise DataError(f"{path}: not a saved split ({type(e).__name__}: {e})") from e


# --------------------------------------------------------------------------------------------------
# helpers


def _singles(perts: Iterable[Condition]) -> list[Condition]:
    return sorted(p for p in perts if len(p) == 1)


def _doubles(perts: Iterable[Condition]) -> list[Condition]:
    return sorted(p for p in perts if len(p) == 2)


def _genes(perts: Iterable[Condition]) -> list[str]:
    return sorted({g for p in perts for g in p})


def _choose(rng: np.random.Generator, items: Sequence, n: int) -> list:
    """n distinct items drawn uniformly (items is sorted, so the draw depends on the set only)."""
    if n <= 0 or not items:
        return []
    picks = rng.choice(len(items), size=min(n, len(items)), replace=False)
    return [items[i] for i in sorted(picks)]


def _seen_count(p: Condition, seen: set[str]) -> int:
    return sum(g in seen for g in p)


def subgroups_by_seen_genes(conditions: Iterable[Condition], seen: set[str]) -> dict[str, list[Condition]]:
    """Group conditions by how many of their genes are in `seen` (GEARS' subgroup names, plus seen_single)."""
    out: dict[str, list[Condition]] = {k: [] for k in SUBGROUPS}
    for p in sorted(conditions):
        if len(p) == 2:
            out[f"combo_seen{_seen_count(p, seen)}"].append(p)
        elif len(p) == 1:
            out["seen_single" if p[0] in seen else "unseen_single"].append(p)
    return out


# --------------------------------------------------------------------------------------------------
# GEARS' rules


def _simulation(perts: list[Condition], gene_fraction: float, combo_fraction: float, seed: int, level: str,
                singles_only: bool) -> tuple[list[Condition], list[Condition], dict[str, list[Condition]], list[Condition]]:
    """(train, held-out set, subgroups, excluded) of GEARS' simulation split at one level ("test" or "val")."""
    genes = _genes(perts)
    seen = set(_choose(derive_rng("gears/split/seen-genes", seed, level), genes, int(len(genes) * gene_fraction)))
    singles, doubles = _singles(perts), _doubles(perts)
    train = [p for p in singles if p[0] in seen]
    unseen_single = [p for p in singles if p[0] not in seen]
    if singles_only:
        return train, unseen_single, {"unseen_single": unseen_single}, doubles
    by_seen = {k: [p for p in doubles if _seen_count(p, seen) == k] for k in (0, 1, 2)}
    combo_train = _choose(derive_rng("gears/split/combo-seen2", seed, level), by_seen[2],
                          int(len(by_seen[2]) * combo_fraction))
    chosen = set(combo_train)
    combo_seen2 = [p for p in by_seen[2] if p not in chosen]
    held = unseen_single + by_seen[0] + by_seen[1] + combo_seen2
    groups = {"combo_seen0": by_seen[0], "combo_seen1": by_seen[1], "combo_seen2": combo_seen2,
              "unseen_single": unseen_single}
    return sorted(train + combo_train), sorted(held), groups, []


def _gene_holdout(perts: list[Condition], mode: str, fraction: float, rng: np.random.Generator
                  ) -> tuple[list[Condition], list[Condition], list[Condition]]:
    """(train, held-out set, excluded) of GEARS' `get_split_list` for single / combo_seen{0,1,2} / no_test."""
    singles, doubles = _singles(perts), _doubles(perts)
    if mode in ("combo_seen2", "no_test"):
        chosen = set(_choose(rng, doubles, int(len(doubles) * fraction)))
        return [p for p in perts if p not in chosen], sorted(chosen), []
    test_genes = set(_choose(rng, _genes(perts), int(len(singles) * fraction)))
    held = [p for p in singles if p[0] in test_genes]
    touching = [p for p in doubles if _seen_count(p, test_genes) > 0]
    if mode == "single":
        excluded = touching
    elif mode == "combo_seen0":
        held += [p for p in touching if _seen_count(p, test_genes) == 2]
        excluded = [p for p in touching if _seen_count(p, test_genes) == 1]
    elif mode == "combo_seen1":
        held += touching
        excluded = []
    else:
        raise ValueError(mode)
    out = set(held) | set(excluded)
    return [p for p in perts if p not in out], sorted(held), sorted(excluded)


def _read_custom(path: str | Path) -> dict[str, list[str]]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: custom split file not found")
    if path.suffix in (".pkl", ".pickle"):
        with open(path, "rb") as f:
            obj = pickle.load(f)  # the user's own GEARS split file (GEARS writes splits as pickle)
    else:
        try:
            obj = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(obj, dict) or "train" not in obj:
        raise DataError(f"{path}: expected a mapping with 'train' (and 'val', 'test') lists of conditions")
    out: dict[str, list[str]] = {}
    for key in ("train", "val", "test"):
        values = obj.get(key, [])
        if isinstance(values, str) or not isinstance(values, Iterable):
            raise DataError(f"{path}: '{key}' is not a list of conditions")
        out[key] = [str(v) for v in values]
    unknown = sorted(set(obj) - {"train", "val", "test"})
    if unknown:
        raise DataError(f"{path}: unknown set(s) {unknown} (train, val, test)")
    return out


def _custom(perts: list[Condition], path: str | Path) -> tuple[dict[str, list[Condition]], list[Condition]]:
    lists = _read_custom(path)
    known = set(perts)
    owner: dict[Condition, str] = {}
    missing: list[str] = []
    sets: dict[str, list[Condition]] = {"train": [], "val": [], "test": []}
    for key, values in lists.items():
        for text in values:
            try:
                cond = as_condition(text)
            except DataError as e:
                raise DataError(f"{path}: '{key}': {e}") from e
            if cond == ():
                continue  # 'ctrl' is always in train
            if cond in owner and owner[cond] != key:
                raise DataError(f"{path}: condition {text!r} is in both '{owner[cond]}' and '{key}'")
            if cond not in known:
                missing.append(text)
                continue
            if cond not in owner:
                owner[cond] = key
                sets[key].append(cond)
    if missing:
        logger.warning("%s: %d listed conditions are not in the data (dropped by the reader or absent), e.g. %s",
                       path, len(missing), ", ".join(map(repr, missing[:5])))
    return sets, [p for p in perts if p not in owner]


# --------------------------------------------------------------------------------------------------
# entry point


def split_conditions(conditions: Iterable[str | Condition], mode: str = "simulation", seed: int = 1,
                     train_gene_set_size: float = 0.75, combo_seen2_train_frac: float = 0.75,
                     custom_path: str | Path | None = None, test_fraction: float = 0.1,
                     val_fraction: float = 0.1) -> SplitResult:
    """Split conditions (GEARS strings or canonical tuples) by one of `SPLIT_MODES`; see the module docstring.

    test_fraction / val_fraction: GEARS' `combo_single_split_test_set_fraction` / `val_size` for the
    gene hold-out modes (single, combo_seen*, no_test).
    """
    if mode not in SPLIT_MODES:
        raise ConfigError(f"split mode must be one of {', '.join(SPLIT_MODES)}; got {mode!r}")
    for name, value in (("train_gene_set_size", train_gene_set_size), ("combo_seen2_train_frac", combo_seen2_train_frac),
                        ("test_fraction", test_fraction), ("val_fraction", val_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name} must be in [0, 1], got {value}")
    if mode == "custom" and custom_path is None:
        raise ConfigError("split mode 'custom' needs custom_path (a JSON or GEARS pickle of train/val/test lists)")
    perts = sorted({as_condition(c) for c in conditions} - {()})
    excluded: list[Condition] = []
    groups: dict[str, dict[str, list[Condition]]] = {}
    params: dict[str, Any] = {}
    if mode in ("simulation", "simulation_single"):
        single = mode == "simulation_single"
        params = {"train_gene_set_size": train_gene_set_size, "combo_seen2_train_frac": combo_seen2_train_frac}
        train, test, test_groups, excluded = _simulation(perts, train_gene_set_size, combo_seen2_train_frac, seed,
                                                         "test", single)
        train, val, val_groups, _ = _simulation(train, 0.9, 0.9, seed, "val", single)
        groups = {"test": test_groups, "val": val_groups}
    elif mode in ("single", "combo_seen0", "combo_seen1", "combo_seen2"):
        params = {"test_fraction": test_fraction, "val_fraction": val_fraction}
        train, test, excluded = _gene_holdout(perts, mode, test_fraction, derive_rng("gears/split/test", seed, mode))
        train, val, more = _gene_holdout(train, mode, val_fraction, derive_rng("gears/split/val", seed, mode))
        excluded = sorted(excluded + more)
    elif mode == "no_test":
        params = {"test_fraction": test_fraction}
        train, val, _ = _gene_holdout(perts, mode, test_fraction, derive_rng("gears/split/val", seed, mode))
        test = []
    elif mode == "no_split":
        train, val, test = [], [], list(perts)
    else:
        params = {"custom_path": str(custom_path)}
        sets, excluded = _custom(perts, custom_path)
        train, val, test = sets["train"], sets["val"], sets["test"]
    seen = {g for p in train for g in p}
    for which, members in (("test", test), ("val", val)):
        if which not in groups:
            groups[which] = subgroups_by_seen_genes(members, seen)
    if excluded:
        logger.warning("split %s: %d conditions are in no set by the mode's rule (e.g. %s)", mode, len(excluded),
                       ", ".join(format_condition(c) for c in excluded[:5]))
    for which, members in (("train", train), ("val", val), ("test", test)):
        if not members and not (which == "test" and mode == "no_test") and not (which != "test" and mode == "no_split"):
            logger.warning("split %s (seed %d): the %s set has no perturbation", mode, seed, which)

    def strings(items: Iterable[Condition]) -> list[str]:
        return [format_condition(c) for c in sorted(items, key=lambda c: (len(c), c))]

    return SplitResult(mode=mode, seed=seed, train=strings([(), *train]), val=strings(val), test=strings(test),
                       subgroups={w: {k: strings(v) for k, v in g.items()} for w, g in groups.items()},
                       held_out=strings(excluded), params=params)

"""The crystal task's training statistics read whole Arrow columns: the same element fractions and
targets as the row-by-row reads they replace, under a selection."""

from __future__ import annotations

import datasets
import numpy as np

from trainer.data.arrow_cache import ListColumn, column_array
from trainer.families.crystals.task import NUM_ELEMENTS, element_fractions


def _old_fractions(numbers) -> np.ndarray:
    out = np.zeros((len(numbers), NUM_ELEMENTS))
    for row, z in enumerate(numbers):
        np.add.at(out[row], np.asarray(z, dtype=np.int64), 1.0 / max(1, len(z)))
    return out


def _structures(n: int, seed: int) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 9, n)
    return datasets.Dataset.from_dict(
        {"atomic_numbers": [rng.integers(1, 95, k).tolist() for k in counts],
         "target": rng.normal(size=n).tolist()},
        features=datasets.Features({"atomic_numbers": datasets.List(datasets.Value("int64")),
                                    "target": datasets.Value("float64")}))


def test_element_fractions_from_the_column_equal_the_per_structure_ones():
    ds = datasets.concatenate_datasets([_structures(40, 0), _structures(25, 1)])
    for view in (ds, ds.shuffle(seed=2).select(range(30)), ds.select([7, 7, 50, 0]), ds.select(range(10, 50))):
        rows = [view[i] for i in range(len(view))]
        want = _old_fractions([r["atomic_numbers"] for r in rows])
        got = element_fractions(ListColumn(view, "atomic_numbers"))
        assert got.shape == want.shape and np.array_equal(got, want)  # bit for bit
        assert np.array_equal(element_fractions([r["atomic_numbers"] for r in rows]), want)
        assert column_array(view, "target").tolist() == [r["target"] for r in rows]

"""What a molecules rank computes from the whole training selection at start-up (the node-count histogram, the
training SMILES, the atoms per row) is read chunk by chunk from the memory-mapped cache: no gather of a whole column
in Arrow's allocator (which keeps what it took) and no int64 array per row, with the same results as a decode of
the columns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.data.arrow_cache import load_arrow, select_rows
from trainer.families.molecules_edm.dataset import (
    MoleculeRows,
    SortedStrings,
    node_count_histogram,
    selected_int_column,
    training_smiles,
    training_smiles_set,
)
from trainer.families.molecules_edm.metrics import evaluate_molecules
from trainer.families.molecules_edm.molecule import Molecule

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
from molecule_shards import write_molecule_shards  # noqa: E402

ROWS, SHARDS = 24_000, 3  # in the writer's default record batches, as the xyz/SDF builds write them


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_molecule_shards(tmp_path_factory.mktemp("rank_memory"), ROWS, SHARDS)


def _decoded(ds) -> tuple[dict[int, int], list[str], np.ndarray]:
    """The reference: the table's columns decoded to Python lists, taken in the dataset's row order."""
    table = ds.with_format(None).data
    rows = range(table.num_rows) if ds._indices is None else ds._indices.column(0).to_pylist()
    all_counts, all_smiles = table.column("num_atoms").to_pylist(), table.column("edm_smiles").to_pylist()
    counts = np.array([all_counts[r] for r in rows], dtype=np.int64)
    values, freq = np.unique(counts, return_counts=True)
    return ({int(v): int(f) for v, f in zip(values, freq)}, sorted({all_smiles[r] for r in rows} - {None}), counts)


@pytest.mark.parametrize("selection", ["none", "split", "repeats", "contiguous", "composed"])
def test_rank_statistics_equal_a_decode_of_the_columns(cache, selection):
    full = load_arrow(cache, "rank-memory")
    rng = np.random.default_rng(1)
    if selection == "none":
        ds = full
    elif selection == "split":
        ds = select_rows(full, rng.permutation(len(full))[2_000:])
    elif selection == "repeats":  # a row named more than once counts each time
        ds = select_rows(full, np.concatenate([rng.integers(0, len(full), 5_000), [7, 7, 7]]))
    elif selection == "contiguous":
        ds = select_rows(full, np.arange(1_500, 9_700))
    else:
        ds = select_rows(select_rows(full, rng.permutation(len(full))[:20_000]), np.arange(0, 20_000, 3)[::-1])
    histogram, smiles, num_atoms = _decoded(ds)
    assert node_count_histogram(ds) == histogram
    assert node_count_histogram(MoleculeRows(ds)) == histogram
    assert list(node_count_histogram(ds)) == sorted(histogram)  # ascending, as before
    assert training_smiles(ds) == smiles and training_smiles(MoleculeRows(ds)) == smiles
    got = MoleculeRows(ds).num_atoms
    assert got.dtype == np.int64 and np.array_equal(got, num_atoms)
    assert np.array_equal(selected_int_column(ds, "num_atoms"), num_atoms)


CHILD = r"""
import json, sys, tracemalloc
import numpy as np, pyarrow as pa
from trainer.data.arrow_cache import load_arrow, select_rows
from trainer.families.molecules_edm.dataset import MoleculeRows, node_count_histogram, training_smiles
full = load_arrow(sys.argv[1:], "rank-memory")
train = select_rows(full, np.random.default_rng(0).permutation(len(full))[len(full) // 10:])
pool = pa.default_memory_pool()
out = {}
tracemalloc.start()
for name, call in [("histogram", lambda: node_count_histogram(train)),
                   ("rows histogram", lambda: node_count_histogram(MoleculeRows(train))),
                   ("smiles", lambda: training_smiles(train))]:
    before = pool.max_memory()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    call()
    out[name] = {"arrow_peak_growth": pool.max_memory() - before, "traced_peak": tracemalloc.get_traced_memory()[1] - base}
print(json.dumps(out))
"""


def test_rank_statistics_gather_no_column_and_hold_nothing_per_row(cache):
    """In a fresh process (Arrow's pool statistics are per process): the training SMILES and the histogram of a
    90 % selection allocate no more in Arrow's pool than a few record batches need (a whole-column gather of the
    SMILES is over 1.4 MB here), and the histogram's numpy transients stay under 4 bytes a table row (an int64
    array of the selection alone is 8 bytes a selected row)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", CHILD, *map(str, cache)], capture_output=True, text=True, env=env,
                         timeout=300, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    smiles_column = ROWS * 60
    assert out["smiles"]["arrow_peak_growth"] < smiles_column / 4, out
    for name in ("histogram", "rows histogram"):
        assert out[name]["arrow_peak_growth"] < 64 * 1024, out
        assert out[name]["traced_peak"] < 4 * ROWS + 64 * 1024, out


def test_training_smiles_set_is_compact_and_the_same_set(cache):
    """What a rank keeps for novelty: the training SMILES in one sorted Arrow array (no Python string each), equal
    to the set of the decoded column, with `in`, `len` and sorted iteration as a set's."""
    full = load_arrow(cache, "rank-memory")
    ds = select_rows(full, np.random.default_rng(2).permutation(len(full))[3_000:])
    _, reference, _ = _decoded(ds)
    got = training_smiles_set(ds)
    assert isinstance(got, SortedStrings) and not isinstance(got, (set, frozenset))
    assert got == set(reference) and len(got) == len(reference) and list(got) == reference
    assert all(s in got for s in reference[::97])
    assert "" not in got and None not in got and "C" not in got and reference[0][:-1] not in got
    assert got.nbytes < sum(len(s) + 8 for s in reference)  # the strings' bytes and their offsets, nothing more
    assert list(training_smiles_set(MoleculeRows(ds))) == reference
    assert SortedStrings.of(["b", "a", "b"]) == {"a", "b"} and list(SortedStrings.of([])) == []


def test_novelty_is_the_same_with_the_compact_set():
    """`evaluate_molecules` takes the compact set as it is (no Python set made of it) and counts the same novelty."""
    water = Molecule(np.array([8, 1, 1]), np.array([[0.0, 0.0, 0.1173], [0.0, 0.7572, -0.4692],
                                                     [0.0, -0.7572, -0.4692]]), {"id": "w"})
    methane = Molecule(np.array([6, 1, 1, 1, 1]), np.array([[0.0, 0.0, 0.0], [0.63, 0.63, 0.63], [-0.63, -0.63, 0.63],
                                                            [-0.63, 0.63, -0.63], [0.63, -0.63, -0.63]]), {"id": "m"})
    for known in (["O"], ["C"], [], ["C", "O", "CC"]):
        as_set, _ = evaluate_molecules([water, methane], set(known))
        compact, _ = evaluate_molecules([water, methane], SortedStrings.of(known))
        assert compact == {**as_set, "seconds": compact["seconds"]}

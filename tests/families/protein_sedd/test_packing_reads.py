"""`PackedBlocks` and the reference statistics read the Arrow columns in one go: the same blocks and
counts as the per-sequence implementation they replace, and no per-process copy of the residues."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, load_script

from trainer.data.arrow_cache import column_array, selected_column
from trainer.families.protein_sedd.dataset import build_fasta_dataset, select_split, tokenize_dataset
from trainer.families.protein_sedd.task import (
    PackedBlocks,
    residue_counts,
    residue_states,
)

SAMPLE = Path(__file__).resolve().parents[3] / "trainer/families/protein_sedd/samples/uniprot_sample_3k.fasta.gz"


_COLUMN_READS = load_script(ROOT / "benchmarks" / "column_reads.py", "column_reads")
"""The code the column reads replaced, kept by the benchmark that times the two against each other."""
_old_counts = _COLUMN_READS.old_counts


def _old_blocks(tokenized, max_length: int, seed: int) -> tuple[np.ndarray, int]:
    """The packing replaced (a per-process int8 copy of every residue, one slice per sequence) and what it left out."""
    blocks = _COLUMN_READS.old_packing(tokenized, max_length, seed)
    total = int(column_array(tokenized, "length").sum()) + len(tokenized)  # residues plus one separator each
    return blocks, total - blocks.size


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    records, _ = build_fasta_dataset(str(SAMPLE), cache_dir=str(tmp_path_factory.mktemp("cache")), val_fraction=0.05)
    return records


@pytest.mark.parametrize("split", ["train", "validation", "shuffled", "contiguous"])
@pytest.mark.parametrize("max_length", [7, 128])
def test_packed_blocks_are_the_per_sequence_implementations(sample, split, max_length):
    if split == "shuffled":
        ds = tokenize_dataset(select_split(sample, "train")).shuffle(seed=5).select(range(400))
    elif split == "contiguous":
        ds = tokenize_dataset(sample.select(range(100, 700)))
    else:
        ds = tokenize_dataset(select_split(sample, split))
    blocks, dropped = _old_blocks(ds, max_length, seed=11)
    packed = PackedBlocks(ds, max_length, seed=11)
    assert len(packed) == len(blocks) and packed.dropped_tokens == dropped
    got = np.stack([packed[i]["states"] for i in range(len(packed))])
    assert got.dtype == np.int64 and np.array_equal(got, blocks.astype(np.int64))
    assert [packed[i]["index"] for i in (0, len(packed) - 1)] == [0, len(packed) - 1]
    assert np.array_equal(packed[-1]["states"], got[-1])
    with pytest.raises(IndexError):
        packed[len(packed)]
    assert np.array_equal(residue_counts(ds), _old_counts(ds))


def test_packed_blocks_hold_no_copy_of_the_residues(sample):
    train = tokenize_dataset(select_split(sample, "train"))  # memory-mapped from the Arrow cache
    packed = PackedBlocks(train, 64, seed=0)
    residues = int(selected_column(train, "input_ids").flatten().nbytes)
    payload = pickle.dumps(packed)  # what a DataLoader worker receives
    assert len(payload) < residues / 2  # the packed order and offsets, not the residues
    again = pickle.loads(payload)
    assert all(np.array_equal(again[i]["states"], packed[i]["states"]) for i in range(0, len(packed), 97))


def test_reference_lengths_and_counts_of_a_selection(sample):
    from trainer.data.arrow_cache import column_array

    ds = tokenize_dataset(sample.select([3, 3, 9, 0, 41]))
    assert column_array(ds, "length").tolist() == [len(x) for x in ds["input_ids"]]
    assert np.array_equal(residue_counts(ds), _old_counts(ds))


@pytest.mark.parametrize("split", ["train", "validation", None])
def test_crops_read_each_row_of_the_selection_and_survive_a_worker_pickle(sample, split):
    """ProteinCrops reads a split's rows through zero-copy views of the Arrow buffers and of the split's
    selection: the same residues as `datasets`' own row access, in the selection's order, and the same after
    the pickle a DataLoader worker receives (which carries the dataset, not the views)."""
    from trainer.families.protein_sedd.task import ProteinCrops

    ds = tokenize_dataset(sample if split is None else select_split(sample, split))
    crops = ProteinCrops(ds, 10_000, seed=0, random_crop=False)
    expected = ds.with_format("numpy", columns=["input_ids"])
    rows = list(range(0, len(ds), max(1, len(ds) // 50))) + [len(ds) - 1, -1]
    for i in rows:
        assert np.array_equal(crops.get_item(i)["states"], residue_states(expected[i]["input_ids"]))
    again = pickle.loads(pickle.dumps(crops))
    assert all(np.array_equal(again.get_item(i)["states"], crops.get_item(i)["states"]) for i in rows)
    with pytest.raises(IndexError):
        crops.get_item(len(ds))

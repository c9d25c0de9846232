"""GEARS' per-rank data memory: the statistics hold arrays (int32 genes, float32 weights), not Python lists of ints,
read back the same by the model build and the metrics, and older statistics written as lists still load."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from trainer.errors import DataError
from trainer.families.perturbation_gears.anndata_reader import bundled_perturbation_path, read_perturbation_data
from trainer.families.perturbation_gears.conditions import format_condition
from trainer.families.perturbation_gears.gene_graphs import cached_graphs
from trainer.families.perturbation_gears.gene_ontology import read_gene2go
from trainer.families.perturbation_gears.spec import PerturbationGearsConfig
from trainer.families.perturbation_gears.splits import split_conditions
from trainer.families.perturbation_gears.task import (
    PerturbationGearsTask,
    build_gears_model,
    decode_array,
    encode_array,
    per_condition_stats,
)


@pytest.fixture(scope="module")
def bundled_stats(tmp_path_factory):
    folder = bundled_perturbation_path()
    data = read_perturbation_data(folder, gene2go=folder / "gene2go.tsv")
    split = split_conditions(data.conditions, "simulation", seed=1)
    graphs = cached_graphs(data, split, read_gene2go(folder / "gene2go.tsv"), tmp_path_factory.mktemp("graphs"))
    return data, graphs, PerturbationGearsTask.statistics(data, split, graphs)


def _as_lists(stats: dict) -> dict:
    """The statistics as they were written before the arrays were encoded (lists of ints and floats)."""
    old = json.loads(json.dumps(stats))
    for field in ("de_idx", "ranked_de_idx"):
        old[field] = {k: decode_array(v).tolist() for k, v in old[field].items()}
    old["graphs"] = {k: (decode_array(v).reshape(-1).tolist() if isinstance(v, dict) else v)
                     for k, v in old["graphs"].items()}
    return old


def test_statistics_hold_int32_and_float32_arrays_not_lists(bundled_stats):
    data, graphs, stats = bundled_stats
    for name in ("go", "coexpression"):
        index = decode_array(stats["graphs"][f"{name}_edge_index"])
        weight = decode_array(stats["graphs"][f"{name}_edge_weight"])
        assert not isinstance(stats["graphs"][f"{name}_edge_index"], list)
        assert index.dtype == np.int32 and weight.dtype == np.float32 and index.shape == (2, weight.size)
        np.testing.assert_array_equal(index, getattr(graphs, f"{name}_edge_index"))
        np.testing.assert_array_equal(weight, getattr(graphs, f"{name}_edge_weight").astype(np.float32))
    for field in ("de_idx", "ranked_de_idx"):
        table = getattr(data, field)
        assert len(stats[field]) == len(table) > 0
        for cond, genes in table.items():
            stored = stats[field][format_condition(cond)]
            assert not isinstance(stored, list) and decode_array(stored).dtype == np.int32
            got = per_condition_stats(stats, field, format_condition(cond))
            assert got.dtype == np.int64 and got.tolist() == genes.tolist()
    assert per_condition_stats(stats, "de_idx", "ctrl") is None
    assert json.loads(json.dumps(stats)) == stats  # still JSON (task_stats.json), and equal after the round trip


def test_model_from_encoded_statistics_equals_the_one_from_lists(bundled_stats):
    _, _, stats = bundled_stats
    cfg = PerturbationGearsConfig(hidden_size=8)
    torch.manual_seed(0)
    new = build_gears_model(cfg, json.loads(json.dumps(stats)))
    torch.manual_seed(0)
    old = build_gears_model(cfg, _as_lists(stats))
    new_state, old_state = new.state_dict(), old.state_dict()
    assert new_state.keys() == old_state.keys()
    for key in new_state:
        assert new_state[key].dtype == old_state[key].dtype, key
        assert torch.equal(new_state[key], old_state[key]), key
    edge_index = [v for k, v in new_state.items() if k.endswith("edge_index")]
    assert edge_index and all(v.dtype == torch.long for v in edge_index)


def test_metrics_read_encoded_and_list_statistics_alike(bundled_stats):
    _, _, stats = bundled_stats
    old = _as_lists(stats)
    for name in list(stats["ranked_de_idx"])[:5]:
        for field in ("de_idx", "ranked_de_idx"):
            assert per_condition_stats(stats, field, name).tolist() == per_condition_stats(old, field, name).tolist()


def test_encoded_array_round_trip_and_a_malformed_one():
    values = np.array([[0, 5, 7], [2, 2**31 - 1, 1]])
    enc = encode_array(values, "int32")
    assert enc["dtype"] == "int32" and enc["shape"] == [2, 3]
    assert decode_array(json.loads(json.dumps(enc))).tolist() == values.tolist()
    assert decode_array([1, 2], np.int64).dtype == np.int64
    with pytest.raises(DataError, match="malformed encoded array.*int32"):
        decode_array({**enc, "base64": enc["base64"][:-4]})


def test_cell_types_share_one_string_object_per_type(bundled_stats):
    data, _, _ = bundled_stats
    import anndata

    from trainer.families.perturbation_gears import anndata_reader as AR

    adata = anndata.read_h5ad(bundled_perturbation_path() / AR.DATA_FILE, backed="r")
    expected = adata.obs["cell_type"].astype(str).to_numpy(dtype=object)
    assert data.cell_type.dtype == object and data.cell_type.tolist() == expected.tolist()
    assert len({id(s) for s in data.cell_type}) == len(set(expected.tolist())) < len(expected)
    assert AR.shared_strings(pd.Series(["x", None, "x"])).tolist() == ["x", "None", "x"]  # as astype(str) writes it
    assert AR.shared_strings(pd.Series([], dtype=object)).shape == (0,)

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


def _per_condition(stats: dict, field: str) -> dict:
    """{condition string: int64 genes} of a per-condition field, whatever its stored form."""
    found = {name: per_condition_stats(stats, field, name) for name in stats["conditions"]}
    return {name: genes for name, genes in found.items() if genes is not None}


def _as_lists(stats: dict) -> dict:
    """The statistics as they were written before the arrays were encoded (lists of ints and floats)."""
    old = json.loads(json.dumps(stats))
    for field in ("de_idx", "ranked_de_idx"):
        old[field] = {k: v.tolist() for k, v in _per_condition(stats, field).items()}
    old["graphs"] = {k: (decode_array(v).reshape(-1).tolist() if isinstance(v, dict) else v)
                     for k, v in old["graphs"].items()}
    return old


def test_statistics_hold_small_integer_and_float32_arrays_not_lists(bundled_stats):
    data, graphs, stats = bundled_stats
    for name in ("go", "coexpression"):
        index = decode_array(stats["graphs"][f"{name}_edge_index"])
        weight = decode_array(stats["graphs"][f"{name}_edge_weight"])
        assert not isinstance(stats["graphs"][f"{name}_edge_index"], list)
        # a few hundred genes: int16 holds every gene index
        assert index.dtype == np.int16 and weight.dtype == np.float32 and index.shape == (2, weight.size)
        np.testing.assert_array_equal(index, getattr(graphs, f"{name}_edge_index"))
        np.testing.assert_array_equal(weight, getattr(graphs, f"{name}_edge_weight").astype(np.float32))
    for field, width in (("de_idx", 20), ("ranked_de_idx", 200)):
        table = getattr(data, field)
        # one matrix per field, a row per condition of stats["conditions"] (not a dict of one array per condition)
        matrix = decode_array(stats[field])
        assert matrix.dtype == np.int16 and matrix.shape == (len(stats["conditions"]), min(width, data.num_genes))
        assert (matrix[stats["conditions"].index("ctrl")] == -1).all()
        assert len(_per_condition(stats, field)) == len(table) > 0
        for cond, genes in table.items():
            code = data.condition_index[cond]
            got = per_condition_stats(stats, field, format_condition(cond))
            assert got.dtype == np.int64 and got.tolist() == genes.tolist()
            assert per_condition_stats(stats, field, "ignored", code).tolist() == genes.tolist()
    assert per_condition_stats(stats, "de_idx", "ctrl") is None
    assert per_condition_stats(stats, "de_idx", "NOT+A+CONDITION") is None
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
    for name in stats["conditions"][1:6]:
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


def test_cell_types_are_codes_over_one_string_per_type(bundled_stats):
    data, _, _ = bundled_stats
    import anndata

    from trainer.families.perturbation_gears import anndata_reader as AR

    adata = anndata.read_h5ad(bundled_perturbation_path() / AR.DATA_FILE, backed="r")
    expected = adata.obs["cell_type"].astype(str).to_numpy(dtype=object)
    assert isinstance(data.cell_type, pd.Categorical) and np.asarray(data.cell_type).tolist() == expected.tolist()
    assert data.cell_type.codes.dtype == np.int8 and len(data.cell_type.categories) == len(set(expected.tolist()))


def _encoded_per_condition(stats: dict) -> dict:
    """The statistics as the previous format wrote them: a dict of int32 encoded arrays per condition per field,
    int32 edge indices."""
    old = json.loads(json.dumps(stats))
    for field in ("de_idx", "ranked_de_idx"):
        old[field] = {k: encode_array(v, "int32") for k, v in _per_condition(stats, field).items()}
    for name in ("go", "coexpression"):
        key = f"{name}_edge_index"
        old["graphs"][key] = encode_array(decode_array(stats["graphs"][key]), "int32")
    return old


def test_statistics_of_the_previous_format_still_load_and_score_alike(bundled_stats):
    data, _, stats = bundled_stats
    old = _encoded_per_condition(stats)
    assert isinstance(next(iter(old["ranked_de_idx"].values())), dict)  # the old form: an entry per condition
    for field in ("de_idx", "ranked_de_idx"):
        assert {k: v.tolist() for k, v in _per_condition(old, field).items()} == \
            {k: v.tolist() for k, v in _per_condition(stats, field).items()}
    cfg = PerturbationGearsConfig(hidden_size=8)
    torch.manual_seed(0)
    new_model = build_gears_model(cfg, stats)
    torch.manual_seed(0)
    old_model = build_gears_model(cfg, old)
    for key, value in new_model.state_dict().items():
        assert torch.equal(value, old_model.state_dict()[key]), key
    # the metrics of a task holding either form: equal (DE genes and their ranking read alike)
    codes = [data.condition_index[c] for c in list(data.ranked_de_idx)[:6]]
    rng = np.random.default_rng(0)
    values = {"condition": torch.tensor(codes, dtype=torch.float32),
              "pred_mean": torch.from_numpy(rng.normal(size=(len(codes), data.num_genes))),
              "true_mean": torch.from_numpy(rng.normal(size=(len(codes), data.num_genes)))}
    scored = []
    for which in (stats, old):
        task = PerturbationGearsTask(cfg)
        task.attach_stats(which)
        scored.append(task.per_condition_metrics(values))
    assert scored[0] == scored[1] and len(scored[0]) == len(codes)


def test_an_empty_gene_list_reads_back_empty_not_absent():
    """A condition whose list is empty reads back as an empty list (the metrics then refuse it, as they refused
    the per-condition form's empty array), not as a condition without an entry."""
    from trainer.families.perturbation_gears.task import encode_condition_rows

    conditions = [("A",), ("B",), ()]
    for table in ({("A",): np.zeros(0, np.int64), ("B",): np.array([3, 1])}, {("A",): np.zeros(0, np.int64)}):
        stats = {"conditions": [format_condition(c) for c in conditions],
                 "de_idx": json.loads(json.dumps(encode_condition_rows(conditions, table)))}
        assert per_condition_stats(stats, "de_idx", format_condition(("A",))).tolist() == []
        assert per_condition_stats(stats, "de_idx", format_condition(())) is None
    assert per_condition_stats(stats, "de_idx", format_condition(("B",))) is None


@pytest.mark.parametrize("dtype", ["int16", "int32"])
@pytest.mark.parametrize("width", [1, 2, 3, 7, 20])
def test_one_row_decoded_from_its_slice_of_the_matrix(dtype, width):
    from trainer.families.perturbation_gears.task import _decode_row, encode_condition_rows

    rng = np.random.default_rng(width)
    conditions = [("A",), ("B",), (), ("C",), ("A", "B")]
    table = {c: rng.permutation(300)[:rng.integers(1, width + 1)] for c in conditions if c}
    enc = encode_condition_rows(conditions, table)
    if dtype == "int32":  # the same matrix as int32: a row's bytes fall on other base64 boundaries
        enc = {**encode_array(decode_array(enc), "int32"), "rows": "conditions"}
    matrix = decode_array(json.loads(json.dumps(enc)))
    for row in range(len(conditions)):
        np.testing.assert_array_equal(_decode_row(enc, row), matrix[row])
    stats = {"conditions": [format_condition(c) for c in conditions], "de_idx": enc}
    for row, cond in enumerate(conditions):
        for got in (per_condition_stats(stats, "de_idx", format_condition(cond)),
                    per_condition_stats(stats, "de_idx", "ignored", row)):
            assert (got is None) if not cond else got.tolist() == table[cond].tolist()
    with pytest.raises(DataError, match="malformed per-condition matrix"):
        _decode_row(enc, len(conditions))
    with pytest.raises(DataError, match="malformed per-condition matrix"):
        _decode_row({**enc, "base64": enc["base64"][:8]}, len(conditions) - 1)


def test_reader_keeps_per_condition_fields_packed_and_shared(bundled_stats):
    """The per-condition fields are packed arrays sharing storage (the top 20 is the ranking's head; non-dropout
    genes are the non-zero bits plus one row; the loss masks are those bits), and read back as before."""
    from trainer.families.perturbation_gears import anndata_reader as AR
    from trainer.families.perturbation_gears.dataset import ConditionMeans, PerturbationPairs
    from trainer.families.perturbation_gears.task import TrainingPairs, nonzero_masks

    data, _, _ = bundled_stats
    for field in ("de_idx", "ranked_de_idx", "top_non_zero_de_20", "top_non_dropout_de_20"):
        table = getattr(data, field)
        assert isinstance(table, AR.ConditionArrays) and table.flat.dtype == np.int16, field
        assert all(v.dtype == np.int64 for v in table.values())
    assert data.de_idx.flat is data.ranked_de_idx.flat
    for cond, ranked in data.ranked_de_idx.items():
        assert data.de_idx[cond].tolist() == ranked[:20].tolist()
    nz, nd = data.non_zeros_gene_idx, data.non_dropout_gene_idx
    assert isinstance(nd, AR.ConditionGeneSets) and nd.bits is nz.bits and nd.extra is not None
    assert data.non_dropout_gene_idx._row is data.de_idx._row  # one {condition: row} for every field
    pairs = PerturbationPairs(data, data.conditions, seed=0)
    train = TrainingPairs(pairs)
    assert train.packed_masks is nz.bits
    dense = nonzero_masks(data)
    for i in range(0, len(pairs), 7):
        item = train[i]
        assert item["nonzero_mask"].numpy().tolist() == dense[item["condition"]].tolist()
    assert TrainingPairs(pairs, dense)[3]["nonzero_mask"].tolist() == train[3]["nonzero_mask"].tolist()
    val = ConditionMeans(data, data.conditions[:3], seed=0)
    assert val.tables is pairs.tables and pairs.rows.dtype == np.int16
    assert pairs[0]["pert_idx"].dtype == torch.int64 and pairs[0]["de_idx"].dtype == torch.int64


def test_gene_sets_share_bits_only_when_exact():
    from trainer.families.perturbation_gears.anndata_reader import ConditionGeneSets

    keys = [("A",), ("B",)]
    nz = ConditionGeneSets.from_positions({("A",): [0, 2], ("B",): [1]}, 12)
    nd = ConditionGeneSets.from_positions({("A",): [0, 2, 5, 9], ("B",): [1, 5, 9]}, 12)
    shared = nz.with_extra(nd)
    assert shared.bits is nz.bits and [shared[k].tolist() for k in keys] == [[0, 2, 5, 9], [1, 5, 9]]
    assert shared.mask(("B",)).tolist() == nd.mask(("B",)).tolist()
    other = ConditionGeneSets.from_positions({("A",): [0, 2, 5], ("B",): [1, 9]}, 12)  # no common row
    assert nz.with_extra(other) is other


def test_gears_obs_fields_are_made_once_per_distinct_value():
    """dose_val / control / condition_name: one string per distinct (cell type, condition), spread by codes (a
    string per cell is a small object per cell), with the values GEARS writes."""
    import anndata

    from trainer.families.perturbation_gears.anndata_reader import add_gears_fields

    conditions = ["ctrl", "A+ctrl", "ctrl", "A+B", "A+ctrl", "B+ctrl"] * 5
    cell_types = (["K562"] * 3 + ["RPE1"] * 3) * 5
    obs = pd.DataFrame({"condition": pd.Categorical(conditions), "cell_type": cell_types},
                       index=[f"c{i}" for i in range(len(conditions))])
    adata = anndata.AnnData(X=np.zeros((len(conditions), 3), dtype=np.float32), obs=obs)
    adata.uns.update({k: {} for k in ("rank_genes_groups_cov_all", "non_zeros_gene_idx", "non_dropout_gene_idx",
                                        "top_non_dropout_de_20", "top_non_zero_de_20")})
    add_gears_fields(adata)
    expected = [f"{t}_{c}_{'1+1' if '+' in c else '1'}" for t, c in zip(cell_types, conditions)]
    assert adata.obs["condition_name"].tolist() == expected
    assert adata.obs["dose_val"].tolist() == ["1+1" if "+" in c else "1" for c in conditions]
    assert adata.obs["control"].tolist() == [1 if c == "ctrl" else 0 for c in conditions]
    assert len({id(s) for s in adata.obs["condition_name"]}) == len(set(expected)) < len(expected)

"""GEARS data layer: condition grammar, the AnnData reader (GEARS-format and raw, DE fields by hand),
gene2go formats, the GO and co-expression graphs on hand examples, splits, lazy pairing, eval items
and the simulator's ground truth."""

from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from scipy import stats

from trainer.errors import ConfigError, DataError
from trainer.families.perturbation_gears import gene_graphs as GG
from trainer.families.perturbation_gears.anndata_reader import (
    PerturbationData,
    add_gears_fields,
    bundled_perturbation_path,
    group_means,
    mean_of_rows,
    read_perturbation_data,
)
from trainer.families.perturbation_gears.conditions import format_condition, parse_condition
from trainer.families.perturbation_gears.dataset import (
    ConditionMeans,
    PerturbationPairs,
    collate_conditions,
    collate_pairs,
)
from trainer.families.perturbation_gears.gene_graphs import (
    abs_pearson,
    build_coexpression_graph,
    build_go_graph,
    cached_graphs,
)
from trainer.families.perturbation_gears.gene_ontology import read_gene2go
from trainer.families.perturbation_gears.simulate import dense_weights, main, simulate_perturbation_data
from trainer.families.perturbation_gears.splits import SplitResult, split_conditions

# --------------------------------------------------------------------------------------------------
# fixtures

# 6 genes (var index id0..id5, symbols A..F); GEARS-style conditions; values chosen so no two |t| tie
CTRL = [[1.0, 2.0, 0.0, 1.0, 0.5, 0.0],
        [1.2, 2.1, 0.0, 1.5, 0.6, 0.0],
        [0.9, 1.9, 0.0, 0.5, 0.4, 0.2],
        [1.1, 2.0, 0.0, 1.0, 0.5, 0.0]]
SINGLE_A = [[0.0, 2.5, 0.0, 1.1, 3.0, 0.1],
            [0.0, 2.6, 0.0, 0.9, 3.2, 0.0],
            [0.0, 2.4, 0.0, 1.0, 2.8, 0.0]]
DOUBLE_AB = [[0.0, 0.0, 0.0, 2.0, 1.0, 0.3],
             [0.0, 0.1, 0.0, 2.2, 1.2, 0.0],
             [0.0, 0.0, 0.0, 1.8, 0.7, 0.1]]


def raw_anndata(extra_conditions: dict[str, list[list[float]]] | None = None):
    import anndata

    blocks = {"ctrl": CTRL, "A+ctrl": SINGLE_A, "B+A": DOUBLE_AB, **(extra_conditions or {})}
    X = np.concatenate([np.asarray(v, dtype=np.float32) for v in blocks.values()])
    conditions = [c for c, v in blocks.items() for _ in v]
    obs = pd.DataFrame({"condition": conditions, "cell_type": "K562"}, index=[f"c{i}" for i in range(len(X))])
    var = pd.DataFrame({"gene_name": list("ABCDEF")}, index=[f"id{i}" for i in range(6)])
    return anndata.AnnData(X=sp.csr_matrix(X), obs=obs, var=var)


def welch_rank(group: list[list[float]]) -> np.ndarray:
    """Genes ranked by |Welch t| of group vs control (a NaN score, both constant and equal, counts as 0)."""
    t = stats.ttest_ind(np.asarray(group), np.asarray(CTRL), equal_var=False).statistic
    t = np.nan_to_num(t, nan=0.0)
    return np.argsort(-np.abs(t), kind="stable")


@pytest.fixture(scope="module")
def bundled() -> PerturbationData:
    folder = bundled_perturbation_path()
    return read_perturbation_data(folder, gene2go=folder / "gene2go.tsv")


# --------------------------------------------------------------------------------------------------
# conditions


def test_condition_grammar_and_round_trip():
    assert parse_condition("ctrl") == ()
    assert parse_condition("A+ctrl") == parse_condition("ctrl+A") == ("A",)
    assert parse_condition("B+A") == parse_condition("A+B") == ("A", "B")
    for cond in [(), ("A",), ("A", "B")]:
        assert parse_condition(format_condition(cond)) == cond
    assert format_condition(("B", "A")) == "A+B"


@pytest.mark.parametrize("text, reason", [
    ("", "empty condition"), ("A", "1 part"), ("A+", "empty gene"), ("+ctrl", "empty gene"), ("A+B+C", "3 part"),
    ("ctrl+ctrl", "ctrl+ctrl"), (" A+ctrl", "whitespace"), ("A +B", "whitespace"), ("A+A", "same gene"),
])
def test_malformed_conditions_name_condition_and_reason(text, reason):
    with pytest.raises(DataError, match=re.escape(reason)) as err:
        parse_condition(text, where="f.h5ad")
    assert repr(text) in str(err.value) and "f.h5ad" in str(err.value)


# --------------------------------------------------------------------------------------------------
# gene2go


def test_gene2go_pickle_tsv_and_gaf(tmp_path):
    expected = {"A": frozenset({"GO:1", "GO:2"}), "B": frozenset({"GO:2"})}
    with open(tmp_path / "g.pkl", "wb") as f:
        pickle.dump({"A": {"GO:1", "GO:2"}, "B": ["GO:2"]}, f)
    (tmp_path / "g.tsv").write_text("# header comment\nA\tGO:1\n\nA\tGO:2\nB\tGO:2\n")
    (tmp_path / "g2.tsv").write_text("A\tGO:1;GO:2\nB\tGO:2\n")
    gaf = ["!gaf-version: 2.2", "!comment",
           "UniProtKB\tP1\tA\t\tGO:1\tPMID:1\tIDA\t\tP\tname\t\tprotein\ttaxon:9606\t20200101\tUniProt",
           "UniProtKB\tP1\tA\tenables\tGO:2\tPMID:1\tIDA\t\tF\tname\t\tprotein\ttaxon:9606\t20200101\tUniProt",
           "UniProtKB\tP2\tB\tNOT|enables\tGO:3\tPMID:1\tIDA\t\tF\tname\t\tprotein\ttaxon:9606\t20200101\tUniProt",
           "UniProtKB\tP2\tB\tenables\tGO:2\tPMID:1\tIDA\t\tF\tname\t\tprotein\ttaxon:9606\t20200101\tUniProt"]
    (tmp_path / "g.gaf").write_text("\n".join(gaf) + "\n")
    for name in ("g.pkl", "g.tsv", "g2.tsv", "g.gaf"):
        assert read_gene2go(tmp_path / name) == expected, name


def test_gene2go_errors_name_file_and_line(tmp_path):
    (tmp_path / "bad.tsv").write_text("A\tGO:1\nB GO:2\n")
    with pytest.raises(DataError, match=r"bad\.tsv, line 2: expected"):
        read_gene2go(tmp_path / "bad.tsv")
    (tmp_path / "bad.gaf").write_text("!gaf-version: 2.2\nDB\tP1\tA\n")
    with pytest.raises(DataError, match=r"bad\.gaf, line 2: a GAF line"):
        read_gene2go(tmp_path / "bad.gaf")
    with open(tmp_path / "bad.pkl", "wb") as f:
        pickle.dump({"A": "GO:1"}, f)
    with pytest.raises(DataError, match=r"bad\.pkl: gene 'A'"):
        read_gene2go(tmp_path / "bad.pkl")


# --------------------------------------------------------------------------------------------------
# reader


def test_gears_obs_fields_match_gears_rules():
    adata = raw_anndata()
    add_gears_fields(adata)
    first = {c: i for i, c in reversed(list(enumerate(adata.obs["condition"])))}
    obs = adata.obs
    assert obs["dose_val"].iloc[first["ctrl"]] == "1" and obs["control"].iloc[first["ctrl"]] == 1
    assert obs["dose_val"].iloc[first["A+ctrl"]] == "1+1" and obs["control"].iloc[first["A+ctrl"]] == 0
    assert obs["condition_name"].iloc[first["B+A"]] == "K562_B+A_1+1"
    assert set(adata.uns["rank_genes_groups_cov_all"]) == {"K562_A+ctrl_1+1", "K562_B+A_1+1"}


def test_raw_anndata_de_fields_match_hand_check():
    adata = raw_anndata()
    data = read_perturbation_data(adata)
    assert "rank_genes_groups_cov_all" not in adata.uns  # the caller's AnnData is left alone
    assert isinstance(data.X, sp.csr_matrix) and data.X.dtype == np.float32
    single, double = ("A",), ("A", "B")
    assert data.conditions == [(), single, double]
    for cond, block in ((single, SINGLE_A), (double, DOUBLE_AB)):
        rank = welch_rank(block)
        np.testing.assert_array_equal(data.de_idx[cond], rank)  # fewer than 20 genes: all, by |t|
        mean, ctrl = np.mean(block, axis=0), np.mean(CTRL, axis=0)
        non_zero = np.flatnonzero(mean != 0)
        non_dropout = np.flatnonzero((mean != 0) | (ctrl == 0))
        np.testing.assert_array_equal(data.non_zeros_gene_idx[cond], non_zero)
        np.testing.assert_array_equal(data.non_dropout_gene_idx[cond], non_dropout)
        np.testing.assert_array_equal(data.top_non_zero_de_20[cond], [g for g in rank if g in non_zero])
        np.testing.assert_array_equal(data.top_non_dropout_de_20[cond], [g for g in rank if g in non_dropout])
    # by hand: A is knocked out in the single (zero there, not in ctrl: a dropout); C is zero everywhere (true zero)
    assert 0 not in data.non_dropout_gene_idx[single] and 2 in data.non_dropout_gene_idx[single]
    np.testing.assert_allclose(data.ctrl_mean, np.mean(CTRL, axis=0), rtol=1e-6)
    np.testing.assert_array_equal(data.ctrl_rows, [0, 1, 2, 3])
    assert data.pert_genes == list("ABCDEF")  # pert_gene_set="var": every var gene
    assert data.pert_idx(double) == [0, 1]


def gears_format_file(tmp_path: Path) -> Path:
    """A GEARS-format file whose uns fields differ from what we would compute: the reader must keep them."""
    adata = raw_anndata({"ctrl+A": SINGLE_A[:2], "ctrl+Q": SINGLE_A, "A+B+C": SINGLE_A, "C+ctrl": SINGLE_A})
    adata.obs["condition"] = pd.Categorical(adata.obs["condition"], categories=[*adata.obs["condition"].unique(), "D+ctrl"])
    add_gears_fields(adata)
    ranking = adata.uns["rank_genes_groups_cov_all"]
    ranking["K562_A+ctrl_1+1"] = np.array([f"id{i}" for i in (5, 4, 3, 2, 1, 0)], dtype=object)
    adata.uns["top_non_zero_de_20"]["K562_A+ctrl_1+1"] = np.array(["id3", "id1"], dtype=object)
    adata.uns["non_zeros_gene_idx"]["K562_A+ctrl_1+1"] = np.array([1, 3])
    path = tmp_path / "gears" / "perturb_processed.h5ad"
    path.parent.mkdir()
    adata.write_h5ad(path)
    return path


def test_gears_format_file_read_unchanged_with_counted_drops(tmp_path, caplog):
    path = gears_format_file(tmp_path)
    gene2go = {g: {"GO:1"} for g in "ABDEF"}  # C has no GO terms
    with caplog.at_level(logging.WARNING):
        data = read_perturbation_data(path.parent, gene2go=gene2go)
    assert data.dropped == {"malformed_condition": 1, "gene_not_in_var": 1, "gene_not_in_go": 1, "no_cells": 1}
    assert data.dropped_cells == {"malformed_condition": 3, "gene_not_in_var": 3, "gene_not_in_go": 3}
    assert "'ctrl+Q'" in caplog.text and "gene_not_in_go=1" in caplog.text
    # 'A+ctrl' and 'ctrl+A' are one condition; its DE fields are those of its first cell's condition_name
    assert data.conditions == [(), ("A",), ("A", "B")]
    assert len(data.rows_of(("A",))) == 5 and data.num_cells == 4 + 5 + 3
    np.testing.assert_array_equal(data.de_idx[("A",)], [5, 4, 3, 2, 1, 0])
    np.testing.assert_array_equal(data.top_non_zero_de_20[("A",)], [3, 1])
    np.testing.assert_array_equal(data.non_zeros_gene_idx[("A",)], [1, 3])
    assert data.pert_genes == list("ABDEF")
    recomputed = read_perturbation_data(path, gene2go=gene2go, recompute_de=True)
    assert recomputed.de_idx[("A",)].tolist() != [5, 4, 3, 2, 1, 0]


def test_on_invalid_error_names_condition_and_reason(tmp_path):
    path = gears_format_file(tmp_path)
    with pytest.raises(DataError, match=r"condition 'ctrl\+Q': gene_not_in_var: gene 'Q'"):
        read_perturbation_data(path, on_invalid="error", gene2go={g: {"GO:1"} for g in "ABCDEF"})
    adata = raw_anndata()
    del adata.obs["cell_type"]
    with pytest.raises(DataError, match=r"obs\['cell_type'\] is missing"):
        read_perturbation_data(adata)
    with pytest.raises(DataError, match="no 'ctrl' cells"):
        read_perturbation_data(raw_anndata()[4:].copy())


def test_single_cell_group_is_dropped_not_crashing():
    data = read_perturbation_data(raw_anndata({"E+ctrl": [[1, 1, 0, 1, 1, 1]]}))
    assert data.dropped == {"no_de_ranking": 1} and ("E",) not in data.condition_index


# --------------------------------------------------------------------------------------------------
# graphs


def test_go_graph_jaccard_topk_threshold_and_ties():
    genes = ["A", "B", "C", "D", "E"]
    go = {"A": {"t1", "t2"}, "B": {"t1", "t2", "t3"}, "C": {"t4"}, "E": {"t1", "t2"}}  # D: no terms
    index, weight = build_go_graph(genes, go, threshold=0.1, top_k=20)
    edges = {(genes[s], genes[t]): w for s, t, w in zip(*index, weight)}
    assert edges[("B", "A")] == pytest.approx(2 / 3) and edges[("A", "B")] == pytest.approx(2 / 3)
    assert edges[("A", "A")] == 1.0 and edges[("E", "A")] == 1.0
    assert ("C", "A") not in edges and not any("D" in e for e in edges)
    assert set(edges) == {(s, t) for s in "ABE" for t in "ABE"} | {("C", "C")}
    # threshold is strict: > 2/3 drops B-A
    index, _ = build_go_graph(genes, go, threshold=2 / 3, top_k=20)
    assert ("B", "A") not in {(genes[s], genes[t]) for s, t in index.T}
    # top_k + 1 per target, ties to the lower source index (GEARS: pandas nlargest keep='first')
    index, weight = build_go_graph(genes, go, threshold=0.1, top_k=0)
    chosen = {genes[t]: genes[s] for s, t in index.T}
    assert chosen == {"A": "A", "B": "B", "C": "C", "E": "A"}
    index, _ = build_go_graph(genes, go, threshold=0.1, top_k=1)
    assert sorted(genes[s] for s, t in index.T if genes[t] == "B") == ["A", "B"]
    assert np.all(np.diff(index[1]) >= 0)  # grouped by target


def test_coexpression_matches_corrcoef_and_rules():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(40, 1))
    dense = np.hstack([base, -2 * base + 0.1 * rng.normal(size=(40, 1)), rng.normal(size=(40, 1)),
                       np.full((40, 1), 3.0), base + 0.05 * rng.normal(size=(40, 1))]).astype(np.float32)
    dense[dense < -1.5] = 0.0
    X = sp.csr_matrix(dense)
    rows = np.arange(3, 37)
    with np.errstate(invalid="ignore", divide="ignore"):  # the constant gene
        expected = np.abs(np.corrcoef(dense[rows].astype(np.float64), rowvar=False))
    expected[~np.isfinite(expected)] = 0.0
    expected[3, :] = expected[:, 3] = 0.0  # constant gene
    np.testing.assert_allclose(abs_pearson(X, rows, block=7), expected, atol=1e-10)
    np.testing.assert_allclose(abs_pearson(dense, rows, block=100), expected, atol=1e-10)
    index, weight = build_coexpression_graph(X, rows, list("ABCDE"), threshold=0.4, top_k=1)
    for t in range(5):
        mine = index[0][index[1] == t]
        order = np.argsort(-expected[t], kind="stable")[:2]
        assert mine.tolist() == [s for s in order if expected[t, s] > 0.4], t
    assert 3 not in index  # constant gene: no edge, not even to itself
    np.testing.assert_allclose(weight, expected[index[1], index[0]], rtol=1e-6)


def test_pearson_and_group_means_over_blocks():
    """More genes than one band of the in-place symmetrisation (512) and more cells than one block."""
    rng = np.random.default_rng(1)
    dense = rng.poisson(0.3, size=(90, 530)).astype(np.float32)
    X = sp.csr_matrix(dense)
    expected = np.abs(np.corrcoef(dense.astype(np.float64), rowvar=False))
    np.testing.assert_allclose(abs_pearson(X, block=32), expected, atol=1e-10)
    codes = rng.integers(0, 4, size=90)
    means, counts = group_means(X, codes, 5, block=16)  # group 4 is empty: NaN means, count 0
    for g in range(4):
        np.testing.assert_allclose(means[g], dense[codes == g].astype(np.float64).mean(axis=0), rtol=1e-12)
    assert counts.tolist() == np.bincount(codes, minlength=5).tolist() and np.isnan(means[4]).all()
    np.testing.assert_allclose(mean_of_rows(X, np.arange(5, 80), block=8), dense[5:80].astype(np.float64).mean(axis=0),
                               rtol=1e-12)


def test_cached_graphs_built_once(bundled, tmp_path, monkeypatch):
    go = read_gene2go(bundled_perturbation_path() / "gene2go.tsv")
    split = split_conditions(bundled.conditions, "simulation", seed=1)
    first = cached_graphs(bundled, split, go, tmp_path)
    assert len(list(tmp_path.glob("gears_graphs_*.npz"))) == 1
    nonself = first.coexpression_edge_index[0] != first.coexpression_edge_index[1]
    assert nonself.sum() > 100  # the simulator's co-expression graph is not just self-loops
    rows = GG.coexpression_rows(bundled, split.train)
    assert all(len(bundled.conditions[c]) <= 1 for c in np.unique(bundled.cell_condition[rows]))

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a cached graph")

    monkeypatch.setattr(GG, "build_go_graph", fail)
    monkeypatch.setattr(GG, "build_coexpression_graph", fail)
    again = cached_graphs(bundled, split, go, tmp_path)
    np.testing.assert_array_equal(again.go_edge_index, first.go_edge_index)
    np.testing.assert_array_equal(again.coexpression_edge_weight, first.coexpression_edge_weight)
    with pytest.raises(AssertionError, match="rebuilt"):
        cached_graphs(bundled, split, go, tmp_path, coexpression_threshold=0.5)


# --------------------------------------------------------------------------------------------------
# splits


def synthetic_conditions(num_genes: int = 24, num_doubles: int = 60, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    genes = [f"g{i:02d}" for i in range(num_genes)]
    pairs = {tuple(sorted(rng.choice(genes, 2, replace=False))) for _ in range(num_doubles)}
    return ["ctrl"] + [f"{g}+ctrl" for g in genes] + [f"{a}+{b}" for a, b in sorted(pairs)]


def genes_of(conds: list[str]) -> set[str]:
    return {g for c in conds for g in parse_condition(c)}


def test_simulation_split_invariants_and_subgroups():
    conds = synthetic_conditions()
    split = split_conditions(conds, "simulation", seed=3)
    sets = [set(split.train), set(split.val), set(split.test), set(split.held_out)]
    assert sum(map(len, sets)) == len(conds) and set.union(*sets) == set(conds)
    assert "ctrl" in split.train
    train_genes = genes_of(split.train)
    # GEARS' guarantee: a gene of an unseen single (test or val) is in no train condition
    for which in ("test", "val"):
        for single in split.subgroups[which]["unseen_single"]:
            assert genes_of([single]).isdisjoint(train_genes)
    # test subgroups count genes seen at the test level (train + val); val subgroups genes of train
    test_level = genes_of(split.train + split.val)
    for name, members in split.subgroups["test"].items():
        for c in members:
            genes = parse_condition(c)
            if name.startswith("combo_seen"):
                assert len(genes) == 2 and sum(g in test_level for g in genes) == int(name[-1])
            else:
                assert len(genes) == 1 and genes[0] not in test_level
    assert sorted(sum(split.subgroups["test"].values(), [])) == sorted(split.test)
    assert sorted(sum(split.subgroups["val"].values(), [])) == sorted(split.val)
    assert all(parse_condition(c)[0] in train_genes for c in split.train if len(parse_condition(c)) == 1)


def test_split_is_deterministic_and_order_free(tmp_path):
    conds = synthetic_conditions()
    a = split_conditions(conds, "simulation", seed=1)
    b = split_conditions(list(reversed(conds)), "simulation", seed=1)
    c = split_conditions(conds, "simulation", seed=2)
    assert a == b and a.test != c.test
    a.save(tmp_path / "split.json")
    assert SplitResult.load(tmp_path / "split.json") == a


def test_gene_holdout_modes():
    conds = synthetic_conditions(num_genes=30, num_doubles=120)
    single = split_conditions(conds, "single", seed=0)
    assert all(len(parse_condition(c)) == 1 for c in single.test) and len(single.test) == 3
    assert genes_of(single.test).isdisjoint(genes_of(single.train + single.val))
    seen0 = split_conditions(conds, "combo_seen0", seed=0)
    test_genes = {parse_condition(c)[0] for c in seen0.test if len(parse_condition(c)) == 1}
    assert all(set(parse_condition(c)) <= test_genes for c in seen0.test)
    assert genes_of(seen0.test).isdisjoint(genes_of(seen0.train))
    val_genes = {parse_condition(c)[0] for c in seen0.val if len(parse_condition(c)) == 1}
    assert all(sum(g in test_genes for g in parse_condition(c)) == 1 or sum(g in val_genes for g in parse_condition(c)) == 1
               for c in seen0.held_out)
    seen2 = split_conditions(conds, "combo_seen2", seed=0)
    assert all(len(parse_condition(c)) == 2 for c in seen2.test) and len(seen2.test) == int(0.1 * (len(conds) - 31))
    no_test = split_conditions(conds, "no_test", seed=0)
    assert no_test.test == [] and no_test.val and all(len(parse_condition(c)) == 2 for c in no_test.val)
    no_split = split_conditions(conds, "no_split")
    assert no_split.train == ["ctrl"] and len(no_split.test) == len(conds) - 1
    with pytest.raises(ConfigError, match="split mode"):
        split_conditions(conds, "random")


def test_custom_split_json_and_pickle(tmp_path):
    conds = ["ctrl", "A+ctrl", "B+ctrl", "C+ctrl", "A+B"]
    (tmp_path / "s.json").write_text(json.dumps({"train": ["ctrl+A", "B+ctrl"], "val": ["C+ctrl"], "test": ["B+A", "Z+ctrl"]}))
    with open(tmp_path / "s.pkl", "wb") as f:
        pickle.dump({"train": ["A+ctrl", "B+ctrl", "ctrl"], "val": ["C+ctrl"], "test": ["A+B"]}, f)
    for name in ("s.json", "s.pkl"):
        split = split_conditions(conds, "custom", custom_path=tmp_path / name)
        assert (split.train, split.val, split.test) == (["ctrl", "A+ctrl", "B+ctrl"], ["C+ctrl"], ["A+B"])
        assert split.subgroups["test"]["combo_seen2"] == ["A+B"]
    (tmp_path / "bad.json").write_text(json.dumps({"train": ["A+ctrl"], "test": ["ctrl+A"]}))
    with pytest.raises(DataError, match="in both 'train' and 'test'"):
        split_conditions(conds, "custom", custom_path=tmp_path / "bad.json")


# --------------------------------------------------------------------------------------------------
# datasets


def test_lazy_pairs_reproducible_per_epoch(bundled):
    split = split_conditions(bundled.conditions, "simulation", seed=1)
    pairs = PerturbationPairs(bundled, split.train, seed=7)
    assert len(pairs) == sum(len(bundled.rows_of(c)) for c in split.conditions("train"))
    ctrl_rows = set(bundled.ctrl_rows.tolist())
    rows = pairs.rows  # a new array per access: taken once
    perturbed = [i for i in range(len(pairs)) if bundled.cell_condition[rows[i]] != 0][:40]
    again = PerturbationPairs(bundled, split.train, seed=7)
    changed = 0
    for i in perturbed:
        item = pairs.get_item(i, epoch=2)
        twin = again.get_item(i, epoch=2)
        assert torch.equal(item["x"], twin["x"]) and torch.equal(item["y"], twin["y"])
        cond = bundled.conditions[item["condition"]]
        np.testing.assert_array_equal(item["y"].numpy(), bundled.X[item["cell"]].toarray()[0])
        assert pairs.control_row(item["cell"], 2) in ctrl_rows
        np.testing.assert_array_equal(item["x"].numpy(), bundled.X[pairs.control_row(item["cell"], 2)].toarray()[0])
        assert item["pert_idx"].tolist() == (bundled.pert_idx(cond) + [-1])[:2] or len(cond) == 2
        assert item["de_idx"].tolist() == bundled.de_idx[cond].tolist()
        changed += pairs.control_row(item["cell"], 3) != pairs.control_row(item["cell"], 2)
    assert changed >= 35  # a new control for (almost) every cell each epoch
    control = next(i for i in range(len(pairs)) if bundled.cell_condition[rows[i]] == 0)
    item = pairs.get_item(control, epoch=5)
    assert torch.equal(item["x"], item["y"]) and item["pert_idx"].tolist() == [-1, -1]
    fixed = PerturbationPairs(bundled, split.train, seed=7, fixed_controls=True)  # task.control_pairing=fixed
    for i in perturbed:
        cell = int(rows[i])
        assert {fixed.control_row(cell, epoch) for epoch in range(4)} == {pairs.control_row(cell, 0)}
    assert item["de_idx"].tolist() == [-1] * 20
    batch = collate_pairs([pairs.get_item(i, 0) for i in perturbed[:4]])
    assert batch["x"].shape == (4, bundled.num_genes) and batch["pert_idx"].shape == (4, 2)


def test_condition_means_one_item_per_condition(bundled):
    split = split_conditions(bundled.conditions, "simulation", seed=1)
    full = ConditionMeans(bundled, split.test, seed=0)
    assert len(full) == len(split.test)
    item = full[0]
    cond = split.conditions("test")[0]
    np.testing.assert_array_equal(item["cells"].numpy(), bundled.rows_of(cond))
    assert set(full.control_rows(item["cells"].numpy(), item["condition"]).tolist()) <= set(bundled.ctrl_rows.tolist())
    capped = ConditionMeans(bundled, split.test, seed=0, max_cells=10)
    rows = capped.cell_rows(0)
    assert len(rows) == 10 and set(rows) <= set(bundled.rows_of(cond)) and np.array_equal(rows, capped.cell_rows(0))
    batch = collate_conditions([capped[i] for i in range(3)])
    assert batch["y"].shape == (30, bundled.num_genes) and batch["item"].tolist() == [0] * 10 + [1] * 10 + [2] * 10
    assert batch["de_idx"].shape == (3, 20) and batch["num_cells"].tolist() == [10, 10, 10]
    assert torch.equal(capped[1]["x"], capped[1]["x"])  # eval controls are fixed


# --------------------------------------------------------------------------------------------------
# simulator


def test_simulator_ground_truth_and_knockout_signs(tmp_path):
    out = tmp_path / "sim"
    summary = simulate_perturbation_data(out, num_genes=40, num_perturbed_genes=6, cells_per_condition=20,
                                         num_control_cells=60, num_doubles=4, seed=3, mc_cells=64)
    truth = np.load(out / "ground_truth.npz")
    meta = json.loads((out / "ground_truth.json").read_text())
    assert truth["true_log_expression_single"].shape == (6, 40) and truth["true_log_expression_double"].shape == (4, 40)
    assert truth["interaction"].shape == (4, 40) and len(meta["doubles"]) == 4 and len(meta["singles"]) == 6
    assert summary["cells"] == 60 + 10 * 20
    W = dense_weights(truth)
    assert (W != 0).sum() == len(truth["edge_weight"])
    data = read_perturbation_data(out, gene2go=out / "gene2go.tsv")
    assert data.dropped == {} and len(data.conditions) == 11
    ctrl_truth = truth["true_expression_ctrl"]
    checked = 0
    for k, a in enumerate(truth["pert_gene_idx"]):
        assert truth["true_expression_single"][k, a] == 0.0  # the knocked-out gene is clamped
        for j in np.flatnonzero(W[a]):
            if np.count_nonzero(W[:, j]) == 1:  # A is j's only regulator: the sign of W decides
                assert np.sign(truth["true_expression_single"][k, j] - ctrl_truth[j]) == -np.sign(W[a, j])
                observed = data.X[data.rows_of((data.gene_names[a],))][:, j].mean()
                if abs(truth["true_log_expression_single"][k, j] - truth["true_log_expression_ctrl"][j]) > 0.3:
                    assert np.sign(observed - data.ctrl_mean[j]) == -np.sign(W[a, j])
                checked += 1
    assert checked >= 3
    with pytest.raises(ConfigError, match="unknown option"):
        main([str(tmp_path / "x"), "genes=3"])


def test_bundled_sample(bundled):
    summary = bundled.summary()
    assert summary["singles"] == 40 and summary["doubles"] == 40 and summary["control_cells"] == 400
    assert bundled.dropped == {}
    size = sum(p.stat().st_size for p in bundled_perturbation_path().iterdir() if p.suffix != ".md")
    assert size < 1_000_000

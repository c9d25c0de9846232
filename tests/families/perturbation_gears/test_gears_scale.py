"""GEARS data at scale: the vectorised DE ranking against scanpy's path, group sums in one pass over row blocks
(also of an X that is not in memory), and the cache fingerprint that samples a large X instead of hashing it."""

from __future__ import annotations

import hashlib
import warnings

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from trainer.families.perturbation_gears import anndata_reader as AR
from trainer.families.perturbation_gears.anndata_reader import (
    bundled_perturbation_path,
    group_means,
    group_sums,
    rank_genes_by_cell_type,
    rank_genes_by_cell_type_scanpy,
    read_perturbation_data,
    welch_t_scores,
)
from trainer.families.perturbation_gears.conditions import condition_name


def _bundled() -> tuple[anndata.AnnData, np.ndarray, np.ndarray, np.ndarray]:
    adata = anndata.read_h5ad(bundled_perturbation_path() / AR.DATA_FILE)
    cell_types = adata.obs["cell_type"].astype(str).to_numpy()
    names = np.array([condition_name(t, c) for t, c in zip(cell_types, adata.obs["condition"].astype(str))])
    return adata, names, cell_types, adata.var_names.to_numpy().astype(str)


def _scanpy_scores(X, names: np.ndarray, reference: str) -> dict[str, np.ndarray]:
    """scanpy's t statistics per group, back in gene order."""
    import scanpy as sc

    ad = anndata.AnnData(X=X, obs=pd.DataFrame({"group": pd.Categorical(names)},
                                               index=[str(i) for i in range(len(names))]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc.tl.rank_genes_groups(ad, groupby="group", reference=reference, method="t-test", rankby_abs=True,
                                n_genes=X.shape[1], use_raw=False)
    result = ad.uns["rank_genes_groups"]
    out = {}
    for group in result["names"].dtype.names:
        scores = np.zeros(X.shape[1])
        scores[np.asarray(result["names"][group]).astype(np.int64)] = np.asarray(result["scores"][group])
        out[group] = scores
    return out


@pytest.mark.numerics
def test_vectorised_de_equals_scanpy_on_the_bundled_set():
    adata, names, cell_types, var_names = _bundled()
    ours, skipped = rank_genes_by_cell_type(adata.X, names, cell_types, var_names)
    theirs, skipped_theirs = rank_genes_by_cell_type_scanpy(adata.X, names, cell_types, var_names)
    assert set(ours) == set(theirs) and len(ours) == 80
    for group in theirs:  # the whole ranking of every group, ties included
        np.testing.assert_array_equal(ours[group], theirs[group], err_msg=group)
    assert skipped == skipped_theirs
    scores, _ = welch_t_scores(adata.X, names, cell_types, block=512)
    reference = _scanpy_scores(adata.X, names, f"{cell_types[0]}_ctrl_1")
    for group, t in reference.items():
        np.testing.assert_allclose(scores[group], t, rtol=1e-6, atol=1e-6, err_msg=group)


def test_de_per_cell_type_with_skipped_groups_equals_scanpy():
    rng = np.random.default_rng(0)
    n, g = 90, 12
    dense = np.where(rng.random((n, g)) < 0.4, rng.gamma(2.0, 1.0, (n, g)), 0).astype(np.float32)
    dense[:, 3] = 0  # a gene zero everywhere: t = 0/0 -> 0, tied with the others at 0
    dense[:, 7] = dense[:, 8]  # two equal genes: a tie scanpy breaks its own way
    cell_types = np.array(["K562"] * 50 + ["RPE1"] * 37 + ["HEPG2"] * 3)
    conditions = np.array((["ctrl"] * 20 + ["A+ctrl"] * 15 + ["A+B"] * 14 + ["B+ctrl"])  # B+ctrl: one cell
                          + (["ctrl"] * 12 + ["A+ctrl"] * 25) + ["ctrl", "A+ctrl", "A+ctrl"])  # HEPG2: 1 control
    names = np.array([condition_name(t, c) for t, c in zip(cell_types, conditions)])
    var_names = np.array([f"g{i}" for i in range(g)])
    X = sp.csr_matrix(dense)
    ours, skipped = rank_genes_by_cell_type(X, names, cell_types, var_names, block=7)
    theirs, skipped_theirs = rank_genes_by_cell_type_scanpy(X, names, cell_types, var_names)
    assert set(ours) == set(theirs) == {"K562_A+ctrl_1+1", "K562_A+B_1+1", "RPE1_A+ctrl_1+1"}
    for group in theirs:
        np.testing.assert_array_equal(ours[group], theirs[group], err_msg=group)
    assert skipped == skipped_theirs
    assert skipped["single_cell_group"] == 1 and skipped["no_control_in_cell_type"] == 1
    # the same from a dense X (row blocks of a non-CSR matrix)
    dense_ranking, _ = rank_genes_by_cell_type(dense, names, cell_types, var_names, block=11)
    for group in theirs:
        np.testing.assert_array_equal(dense_ranking[group], theirs[group])


@pytest.mark.parametrize("block", [1, 5, 4096])
def test_group_sums_one_pass_over_row_blocks(block):
    rng = np.random.default_rng(1)
    dense = np.where(rng.random((41, 9)) < 0.3, rng.normal(size=(41, 9)), 0).astype(np.float32)
    codes = rng.integers(-2, 4, size=41)  # negative codes: rows left out
    sums, squares, counts = group_sums(sp.csr_matrix(dense), codes, 5, block=block, squares=True)
    for k in range(5):
        rows = dense[codes == k].astype(np.float64)
        np.testing.assert_allclose(sums[k], rows.sum(axis=0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(squares[k], (dense[codes == k] ** 2).astype(np.float64).sum(axis=0),
                                   rtol=1e-12, atol=1e-12)
        assert counts[k] == (codes == k).sum()
    means, _ = group_means(sp.csr_matrix(dense), codes, 5, block=block)
    assert np.isnan(means[4]).all()  # group 4 is empty
    with pytest.raises(ValueError, match="group codes"):
        group_sums(sp.csr_matrix(dense), codes[:-1], 5)


def test_group_sums_read_a_backed_x_in_row_blocks(tmp_path):
    """X on disk (anndata backed mode): the sums come from row slices, X is never loaded whole."""
    rng = np.random.default_rng(2)
    X = sp.random(300, 20, density=0.2, format="csr", dtype=np.float32, random_state=3)
    path = tmp_path / "x.h5ad"
    anndata.AnnData(X=X).write_h5ad(path)
    codes = rng.integers(0, 6, size=300)
    backed = anndata.read_h5ad(path, backed="r")
    try:
        sums, _, _ = group_sums(backed.X, codes, 6, block=64)
    finally:
        backed.file.close()
    expected, _, _ = group_sums(X, codes, 6)
    np.testing.assert_allclose(sums, expected, rtol=1e-12)


def _old_fingerprint(data) -> str:
    """The fingerprint as it was: every byte of X hashed, the per-cell conditions as the int32 they were stored as."""
    h = hashlib.blake2b(digest_size=16)
    for arr in (data.X.indptr, data.X.indices, data.X.data, data.cell_condition.astype(np.int32)):
        h.update(np.ascontiguousarray(arr).view(np.uint8))
    h.update("\0".join(data.gene_names.tolist()).encode())
    h.update("\0".join(data.condition_strings).encode())
    h.update("\0".join(data.pert_genes).encode())
    return h.hexdigest()


def test_fingerprint_samples_a_large_x_and_keeps_small_keys(monkeypatch):
    data = read_perturbation_data(bundled_perturbation_path())
    assert data.fingerprint == _old_fingerprint(data)  # a small X: the same keys (graph caches stay valid)
    monkeypatch.setattr(AR, "FULL_HASH_BYTES", 0)
    monkeypatch.setattr(AR, "FINGERPRINT_WINDOWS", 4)
    monkeypatch.setattr(AR, "FINGERPRINT_WINDOW", 8)

    def fresh(X):
        copy = read_perturbation_data(bundled_perturbation_path())
        copy.X = X
        return copy.fingerprint

    X = data.X
    base = fresh(X.copy())
    assert base != data.fingerprint and base == fresh(X.copy())  # sampled, and the same for the same content
    inside = X.copy()
    inside.data[0] += 1.0  # in the first window
    assert fresh(inside) != base
    outside = X.copy()
    outside.data[X.nnz // 8] += 1.0  # between windows: not seen (documented)
    assert fresh(outside) == base
    shorter = X.copy()
    shorter.indptr = shorter.indptr.copy()
    shorter.indptr[5] += 1  # a row's length: always seen
    assert fresh(shorter) != base


def _same_data(a, b) -> None:
    assert (a.X != b.X).nnz == 0 and a.X.shape == b.X.shape and a.X.dtype == b.X.dtype == np.float32
    assert a.conditions == b.conditions and a.pert_genes == b.pert_genes
    np.testing.assert_array_equal(a.cell_condition, b.cell_condition)
    np.testing.assert_array_equal(a.ctrl_rows, b.ctrl_rows)
    np.testing.assert_array_equal(a.ctrl_mean, b.ctrl_mean)
    for field in ("de_idx", "ranked_de_idx", "non_zeros_gene_idx", "non_dropout_gene_idx", "top_non_zero_de_20"):
        mine, theirs = getattr(a, field), getattr(b, field)
        assert mine.keys() == theirs.keys()
        for key in mine:
            np.testing.assert_array_equal(mine[key], theirs[key], err_msg=f"{field} {key}")
    assert a.dropped == b.dropped and a.fingerprint == b.fingerprint


def _file_with_drops(tmp_path):
    """The bundled set plus cells a reader must drop: a malformed condition and a one-cell group, mid-file."""
    adata = anndata.read_h5ad(bundled_perturbation_path() / AR.DATA_FILE)
    conditions = adata.obs["condition"].astype(str).to_numpy().copy()
    conditions[[7, 1500]] = "A+B+C"  # malformed: dropped before DE
    single = conditions[900]
    conditions[conditions == single] = "ctrl"
    conditions[900] = single  # now a one-cell group: no DE ranking, dropped after DE
    adata.obs["condition"] = pd.Categorical(conditions)
    path = tmp_path / "data" / AR.DATA_FILE
    path.parent.mkdir()
    adata.write_h5ad(path)
    return path


@pytest.mark.numerics
def test_backed_reader_equals_the_in_memory_reader(tmp_path, monkeypatch):
    path = _file_with_drops(tmp_path)
    monkeypatch.setattr(AR, "X_BLOCK_ROWS", 333)  # many row blocks, not aligned with the dropped rows
    in_memory = read_perturbation_data(anndata.read_h5ad(path))
    assert in_memory.dropped == {"malformed_condition": 1, "no_de_ranking": 1}
    plain = read_perturbation_data(path)  # backed, X read in row blocks into this process
    _same_data(plain, in_memory)
    cache = tmp_path / "cache"
    mapped = read_perturbation_data(path, x_cache_dir=cache)
    _same_data(mapped, in_memory)
    assert isinstance(mapped.X.data, np.memmap) and isinstance(mapped.X.indices, np.memmap)
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    assert (folder / "done").is_file() and not [p for p in cache.iterdir() if p.name.startswith(".")]
    entries = sorted(p.name for p in cache.iterdir())  # X's folder and the DE fields' file
    again = read_perturbation_data(path, x_cache_dir=cache)  # the same file: the same folder, reused
    assert sorted(p.name for p in cache.iterdir()) == entries
    _same_data(again, in_memory)
    np.testing.assert_array_equal(again.dense_rows([0, 5]), in_memory.dense_rows([0, 5]))


def test_backed_reader_names_the_cell_with_a_non_finite_value(tmp_path):
    adata = anndata.read_h5ad(bundled_perturbation_path() / AR.DATA_FILE)
    X = adata.X.copy()
    X.data[X.indptr[2000] + 1] = np.nan
    adata.X = X
    path = tmp_path / "bad.h5ad"
    adata.write_h5ad(path)
    name = adata.obs_names[2000]
    with pytest.raises(AR.DataError, match=rf"bad.h5ad: X has a non-finite value in cell '{name}' \(row 2000\)"):
        read_perturbation_data(path, x_cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob(".x_*"))  # no partial copy of X left behind


def test_row_blocks_read_selected_rows_only():
    X = sp.random(50, 6, density=0.5, format="csr", dtype=np.float32, random_state=4)
    rows = np.array([1, 2, 7, 30, 31, 49])
    blocks = AR.RowBlocks(X, rows)
    assert blocks.shape == (6, 6)
    np.testing.assert_array_equal(blocks[1:4].toarray(), X[[2, 7, 30]].toarray())
    np.testing.assert_array_equal(blocks[0:2].toarray(), X[[1, 2]].toarray())
    assert blocks[6:9].shape == (0, 6)
    with pytest.raises(TypeError):
        blocks[[0, 1]]


@pytest.mark.numerics
def test_de_fields_are_computed_once_and_read_back(tmp_path, monkeypatch):
    """A raw file's DE fields go into the content-keyed cache: the next start reads them, equal, without a pass
    over X; another file (another identity) computes its own."""
    path = _file_with_drops(tmp_path)
    in_memory = read_perturbation_data(anndata.read_h5ad(path))
    cache = tmp_path / "cache"
    calls = []
    real, real_sums = AR.rank_genes_by_cell_type, AR.group_sums
    monkeypatch.setattr(AR, "rank_genes_by_cell_type", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = read_perturbation_data(path, x_cache_dir=cache)
    assert len(calls) == 1
    (de_file,) = [p for p in cache.iterdir() if p.name.startswith("de_")]
    _same_data(first, in_memory)

    def no_pass_over_x(*args, **kwargs):
        raise AssertionError("DE recomputed although cached")

    monkeypatch.setattr(AR, "rank_genes_by_cell_type", no_pass_over_x)
    monkeypatch.setattr(AR, "group_sums", no_pass_over_x)
    second = read_perturbation_data(path, x_cache_dir=cache)
    _same_data(second, in_memory)
    assert isinstance(second.non_zeros_gene_idx, AR.ConditionGeneSets)
    # a damaged cache file is recomputed, not trusted
    de_file.write_bytes(b"not an npz")
    monkeypatch.setattr(AR, "rank_genes_by_cell_type", real)
    monkeypatch.setattr(AR, "group_sums", real_sums)
    _same_data(read_perturbation_data(path, x_cache_dir=cache), in_memory)


def test_condition_gene_sets_pack_positions():
    sets = AR.ConditionGeneSets.from_positions({("A",): np.array([0, 9, 3]), ("B",): np.array([], dtype=np.int64)}, 10)
    assert sets.bits.shape == (2, 2) and sets.bits.dtype == np.uint8
    np.testing.assert_array_equal(sets[("A",)], [0, 3, 9])
    assert sets[("A",)].dtype == np.int64 and sets[("B",)].size == 0
    np.testing.assert_array_equal(sets.mask(("A",)), np.isin(np.arange(10), [0, 3, 9]))
    assert list(sets) == [("A",), ("B",)] and ("C",) not in sets and len(sets) == 2


def _top_reference(weights: np.ndarray, top_k: int, threshold: float) -> list[list[int]]:
    """The whole-row stable argsort the graphs were first built with."""
    out = []
    for row in weights:
        order = np.argsort(-row, kind="stable")[: top_k + 1]
        out.append(order[row[order] > threshold].tolist())
    return out


@pytest.mark.parametrize("top_k", [0, 2, 5, 40])
def test_top_per_target_from_a_partition_equals_a_whole_row_sort(top_k):
    from trainer.families.perturbation_gears.gene_graphs import _top_per_target

    rng = np.random.default_rng(top_k)
    weights = np.round(rng.random((37, 30)), 1)  # many ties, at the cut too
    weights[3] = 0.5  # a row of ties only
    weights[4] = 0.0
    sources, targets, values = [], [], []
    _top_per_target(weights, np.arange(37), top_k, 0.4, sources, targets, values, band=8)
    assert [s.tolist() for s in sources] == _top_reference(weights, top_k, 0.4)
    for s, t, v in zip(sources, targets, values):
        np.testing.assert_array_equal(v, weights[t[0] if len(t) else 0, s].astype(np.float32))


@pytest.mark.numerics
def test_float32_products_keep_pearson_and_the_bundled_graph():
    from trainer.families.perturbation_gears.gene_graphs import abs_pearson, build_coexpression_graph, coexpression_rows
    from trainer.families.perturbation_gears.splits import split_conditions

    rng = np.random.default_rng(3)
    latent = rng.gamma(1.0, 1.0, size=(5000, 8))
    dense = np.log1p(rng.poisson(latent @ rng.random((8, 120)))).astype(np.float32)  # correlated, sparse-ish counts
    dense[:, 7] = 2.0  # a constant gene
    X = sp.csr_matrix(dense)
    with np.errstate(invalid="ignore", divide="ignore"):
        expected = np.abs(np.corrcoef(dense.astype(np.float64), rowvar=False))
    expected[~np.isfinite(expected)] = 0.0
    np.testing.assert_allclose(abs_pearson(X, precision="float32"), expected, atol=1e-5)
    np.testing.assert_allclose(abs_pearson(dense, precision="float32"), expected, atol=1e-5)
    with pytest.raises(ValueError, match="precision"):
        abs_pearson(X, precision="half")
    # the bundled set is far below the float32 threshold: its graph is float64's, edges and weights exactly
    data = read_perturbation_data(bundled_perturbation_path())
    rows = coexpression_rows(data, split_conditions(data.condition_strings, "simulation", seed=1).train)
    exact = abs_pearson(data.X, rows, precision="float64")
    np.testing.assert_array_equal(abs_pearson(data.X, rows), exact)
    # and float32 products on it pick the same edges, weights within 1e-5
    f32 = abs_pearson(data.X, rows, precision="float32")
    np.testing.assert_allclose(f32, exact, atol=1e-5)
    from trainer.families.perturbation_gears import gene_graphs as GG

    with pytest.MonkeyPatch.context() as mp:  # "auto" above the threshold: the float32 products
        mp.setattr(GG, "FLOAT32_PRODUCTS_ABOVE", 0)
        np.testing.assert_array_equal(abs_pearson(data.X, rows), f32)
    picked = [_top_reference(w, 20, 0.4) for w in (f32, exact)]
    assert picked[0] == picked[1]
    index, _ = build_coexpression_graph(data.X, rows, data.gene_names)
    assert index[0].tolist() == [s for row in picked[1] for s in row]


def test_de_cache_is_keyed_by_which_fields_are_computed(tmp_path, monkeypatch):
    """A file that brings its own ranking but no dropout fields: a run that keeps the file's ranking and one that
    recomputes it (`recompute`) compute different fields, so neither reads the other's cache."""
    adata, *_ = _bundled()
    computed = adata.copy()
    AR.add_gears_fields(computed)
    own_ranking = {k: np.asarray(v)[::-1].copy() for k, v in computed.uns["rank_genes_groups_cov_all"].items()}

    def file_like() -> anndata.AnnData:
        copy = adata.copy()
        copy.uns = {"rank_genes_groups_cov_all": dict(own_ranking)}
        return copy

    calls = []
    real = AR.rank_genes_by_cell_type
    monkeypatch.setattr(AR, "rank_genes_by_cell_type", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = tmp_path / "de.npz"
    AR.add_gears_fields(file_like(), cache=cache)  # the file's ranking kept, the dropout fields computed
    assert calls == []
    recomputed = file_like()
    AR.add_gears_fields(recomputed, recompute=True, cache=cache)
    assert calls == [1]  # not the first run's fields, built on the file's ranking
    again = file_like()
    AR.add_gears_fields(again, recompute=True, cache=cache)
    assert calls == [1]  # its own cache, read back
    for key, genes in recomputed.uns["rank_genes_groups_cov_all"].items():
        names = np.asarray(adata.var_names)[np.asarray(again.uns["rank_genes_groups_cov_all"][key])]
        np.testing.assert_array_equal(names, np.asarray(genes)[:len(names)], err_msg=key)


def test_a_truncated_de_cache_is_recomputed(tmp_path):
    adata, *_ = _bundled()
    bare = adata.copy()
    bare.uns = {}
    cache = tmp_path / "de.npz"
    AR.add_gears_fields(bare, cache=cache)
    (written,) = tmp_path.glob("de*.npz")
    written.write_bytes(written.read_bytes()[:100])  # a zip cut short
    again = adata.copy()
    again.uns = {}
    AR.add_gears_fields(again, cache=cache)
    assert set(again.uns) >= set(AR.GEARS_UNS_FIELDS)

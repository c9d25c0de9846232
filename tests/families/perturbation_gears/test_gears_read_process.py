"""GEARS' data read in a short-lived child process (`read_process`): the same data, graphs and statistics as a read
in the rank, X mapped again from its cache (no copy in the pickle), errors and log records handed back; per-cell
cell types and conditions as small codes; the gene -> GO mapping packed over the perturbable genes."""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from trainer.errors import DataError
from trainer.families.perturbation_gears import anndata_reader as AR
from trainer.families.perturbation_gears import read_process as RP
from trainer.families.perturbation_gears import task as T
from trainer.families.perturbation_gears.gene_graphs import build_go_graph, cached_graphs, gene2go_digest
from trainer.families.perturbation_gears.gene_ontology import PackedGeneToGo, read_gene2go
from trainer.families.perturbation_gears.spec import PerturbationGearsConfig
from trainer.families.perturbation_gears.splits import split_conditions

FOLDER = AR.bundled_perturbation_path()
FIELDS = ("de_idx", "ranked_de_idx", "top_non_dropout_de_20", "top_non_zero_de_20", "non_zeros_gene_idx",
          "non_dropout_gene_idx")


def _same_data(a: AR.PerturbationData, b: AR.PerturbationData) -> None:
    assert (a.X != b.X).nnz == 0 and a.X.shape == b.X.shape and a.X.dtype == b.X.dtype == np.float32
    assert a.conditions == b.conditions and a.pert_genes == b.pert_genes and a.condition_names == b.condition_names
    assert a.gene_names.tolist() == b.gene_names.tolist() and a.var_names.tolist() == b.var_names.tolist()
    np.testing.assert_array_equal(a.cell_condition, b.cell_condition)
    assert np.asarray(a.cell_type).tolist() == np.asarray(b.cell_type).tolist()
    np.testing.assert_array_equal(a.ctrl_rows, b.ctrl_rows)
    np.testing.assert_array_equal(a.ctrl_mean, b.ctrl_mean)
    for field in FIELDS:
        mine, theirs = getattr(a, field), getattr(b, field)
        assert list(mine) == list(theirs)
        for key in mine:
            np.testing.assert_array_equal(mine[key], theirs[key])
    assert (a.dropped, a.dropped_cells, a.dropped_examples) == (b.dropped, b.dropped_cells, b.dropped_examples)
    assert a.fingerprint == b.fingerprint


def test_a_mapped_data_set_pickles_without_x_and_maps_it_again(tmp_path):
    data = AR.read_perturbation_data(FOLDER, x_cache_dir=tmp_path)
    assert AR.mapped_folder(data.X) is not None
    payload = pickle.dumps(data)
    assert len(payload) < data.X.data.nbytes  # X's values alone are more than the whole pickle
    again = pickle.loads(payload)
    assert isinstance(again.X.data, np.memmap) and AR.mapped_folder(again.X) == AR.mapped_folder(data.X)
    _same_data(again, data)
    in_memory = AR.read_perturbation_data(FOLDER)  # X in this process: pickled whole, as before
    assert AR.mapped_folder(in_memory.X) is None
    _same_data(pickle.loads(pickle.dumps(in_memory)), in_memory)


def test_cell_types_and_conditions_are_small_codes():
    import anndata

    data = AR.read_perturbation_data(FOLDER)
    adata = anndata.read_h5ad(FOLDER / AR.DATA_FILE, backed="r")
    expected = adata.obs["cell_type"].astype(str).to_numpy(dtype=object)
    assert isinstance(data.cell_type, pd.Categorical) and data.cell_type.codes.dtype == np.int8
    assert np.asarray(data.cell_type).tolist() == expected.tolist()
    assert data.cell_condition.dtype == np.int16  # a few dozen conditions
    # the graph cache key hashes the conditions as the int32 they were: caches built before stay valid
    wide = AR.PerturbationData(**{f: getattr(data, f) for f in AR.PerturbationData.__dataclass_fields__})
    wide.cell_condition = data.cell_condition.astype(np.int32)
    assert wide.fingerprint == data.fingerprint
    codes = AR.coded_strings(pd.Series(["x", None, "x"]))
    assert np.asarray(codes).tolist() == ["x", "None", "x"] and codes.codes.dtype == np.int8
    assert len(AR.coded_strings(pd.Series([], dtype=object))) == 0


def test_packed_gene2go_reads_as_the_mapping_over_the_perturbable_genes():
    gene2go = read_gene2go(FOLDER / "gene2go.tsv")
    genes = sorted(gene2go)[::2] + ["NOT_A_GENE"]
    packed = RP.packed_gene2go(gene2go, genes)
    assert isinstance(packed, PackedGeneToGo) and list(packed) == [g for g in genes if g in gene2go]
    assert all(packed[g] == gene2go[g] for g in packed) and "NOT_A_GENE" not in packed
    assert packed.get("NOT_A_GENE") is None and packed.codes.dtype == np.int32
    assert gene2go_digest(genes, packed) == gene2go_digest(genes, gene2go)  # the stored digest
    assert gene2go_digest(genes[:-2], packed) == gene2go_digest(genes[:-2], gene2go)  # computed: other genes
    for mine, theirs in zip(build_go_graph(genes, packed), build_go_graph(genes, gene2go)):
        np.testing.assert_array_equal(mine, theirs)


def test_the_child_reads_the_same_data_without_torch(tmp_path):
    """The child's side run as `read_apart` runs it: a fresh interpreter, only the reader's modules loaded."""
    cache = tmp_path / "cache"
    answer = tmp_path / "answer.pkl"
    request = {"sys_path": list(sys.path), "data_path": str(FOLDER), "gene2go_path": str(FOLDER / "gene2go.tsv"),
               "x_cache_dir": str(cache), "options": {}, "answer": str(answer), "log_level": logging.INFO}
    code = RP._CHILD + "print(sorted(m for m in ('torch', 'accelerate') if m in sys.modules))\n"
    proc = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(request), capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().split() == ["[]"]
    result = pickle.loads(answer.read_bytes())
    assert result["error"] is None
    gene2go = read_gene2go(FOLDER / "gene2go.tsv")
    here = AR.read_perturbation_data(FOLDER, gene2go, x_cache_dir=cache)
    _same_data(result["data"], here)
    assert AR.mapped_folder(result["data"].X) == AR.mapped_folder(here.X)
    split = split_conditions(here.condition_strings, "simulation", seed=1)
    theirs = cached_graphs(result["data"], split, result["gene2go"], None)
    mine = cached_graphs(here, split, gene2go, None)
    assert theirs.key == mine.key
    for name in ("go_edge_index", "go_edge_weight", "coexpression_edge_index", "coexpression_edge_weight"):
        np.testing.assert_array_equal(getattr(theirs, name), getattr(mine, name))


def test_a_large_file_is_read_apart_with_the_same_statistics(tmp_path, monkeypatch):
    cfg = PerturbationGearsConfig(cache_dir=str(tmp_path), split="simulation", split_seed=1)
    here = T.PerturbationGearsTask(cfg).build_data().stats
    calls = []
    real = RP.read_apart
    monkeypatch.setattr(RP, "read_apart", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(T, "READ_APART_BYTES", 0)
    apart = T.PerturbationGearsTask(cfg).build_data().stats
    assert len(calls) == 1
    assert apart == here


@pytest.mark.extended
def test_the_childs_error_is_raised_here_naming_the_file(tmp_path, caplog):
    import anndata

    adata = anndata.read_h5ad(FOLDER / AR.DATA_FILE)
    path = tmp_path / AR.DATA_FILE
    del adata.obs["cell_type"]
    adata.write_h5ad(path)
    with pytest.raises(DataError, match=rf"{path}.*obs\['cell_type'\] is missing"):
        RP.read_apart(path, FOLDER / "gene2go.tsv", x_cache_dir=tmp_path / "cache")
    adata = anndata.read_h5ad(FOLDER / AR.DATA_FILE)
    adata.obs["condition"] = adata.obs["condition"].astype(str)
    adata.obs.loc[adata.obs_names[0], "condition"] = "A+B+C"  # outside GEARS' grammar: dropped, counted, logged
    adata.write_h5ad(path)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        data, _ = RP.read_apart(path, FOLDER / "gene2go.tsv", x_cache_dir=tmp_path / "cache2")
    assert data.dropped.get("malformed_condition") == 1
    assert any(r.name == AR.__name__ and "malformed_condition" in r.getMessage() for r in caplog.records)


def test_training_pairs_hold_no_row_per_cell():
    from trainer.families.perturbation_gears.dataset import PerturbationPairs

    data = AR.read_perturbation_data(FOLDER)
    split = split_conditions(data.condition_strings, "simulation", seed=1)
    wanted = list(split.train) + [split.train[0]]  # a condition twice: its cells twice, as before
    pairs = PerturbationPairs(data, wanted, seed=3)
    expected = np.concatenate([data.rows_of(AR.parse_condition(c)) for c in wanted])
    assert len(pairs) == len(expected) and pairs.rows.tolist() == expected.tolist()
    assert [pairs.row_at(i) for i in range(len(pairs))] == expected.tolist()
    assert pairs.row_at(-1) == expected[-1] and pairs.get_item(5)["cell"] == expected[5]
    with pytest.raises(IndexError):
        pairs.row_at(len(pairs))
    per_cell = [k for k, v in vars(pairs).items() if isinstance(v, np.ndarray) and v.size >= len(pairs)
                and not np.shares_memory(v, data.row_order)]
    assert per_cell == []
    assert len(PerturbationPairs(data, [], seed=0)) == 0

"""`trainer import gears` and `trainer export --format reference` for perturbation_gears.

Without the reference: the golden `GEARS.save_model` folder (tests/families/perturbation_gears/golden_checkpoint,
written by the reference's own model_initialize and save_model through scripts/parity/reference_checkpoints.py:
a randomised GEARS_Model at the bundled simulated set's sizes, on seeded graphs of its own) reads through the key
map, imports into a run on the bundled set whose graphs are config.pkl's, evaluates, and exports back equal. Live
against a checkout named by TRAINER_REFERENCE_GEARS: exported back and read by the reference's `load_pretrained`.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from parity_support import golden_dir, live_checkpoint_test
from safetensors.torch import load_file

from trainer.errors import CheckpointError
from trainer.families.perturbation_gears.model import GEARSModel
from trainer.families.perturbation_gears.reference import (
    CONFIG_FILE,
    GRAPH_BUFFERS,
    MODEL_FILE,
    REFERENCE_FORMAT,
    from_reference_state_dict,
)
from trainer.reference_formats import restricted_unpickle, tensor_globals

GOLDEN = golden_dir(__file__, "golden_checkpoint")


def _golden() -> tuple[dict, dict]:
    """model.pt (weights-only) and config.pkl (read as the format reads it)."""
    return (torch.load(GOLDEN / MODEL_FILE, weights_only=True),
            restricted_unpickle(GOLDEN / CONFIG_FILE, tensor_globals()))


def _ours(model: dict, config: dict) -> dict:
    return from_reference_state_dict(model, (config["G_coexpress"], config["G_coexpress_weight"]),
                                     (config["G_go"], config["G_go_weight"]))


@pytest.mark.numerics
def test_golden_checkpoint_reads_through_the_key_map():
    """Weights are model.pt's through the key map, the graph buffers config.pkl's tensors (carried with the
    checkpoint), the model options task overrides and GEARS' train() recipe the recipe."""
    meta = json.loads((GOLDEN / "meta.json").read_text())
    assert meta["reference"]["license"] == "MIT" and len(meta["reference"]["commit"]) == 40
    ckpt = REFERENCE_FORMAT.read(GOLDEN)
    model, config = _golden()
    expected = _ours(model, config)
    assert set(ckpt.model) == set(expected)
    assert all(torch.equal(ckpt.model[k], v) for k, v in expected.items())
    for ours, ref in GRAPH_BUFFERS.items():
        assert torch.equal(ckpt.model[ours], config[ref].to(ckpt.model[ours].dtype)), ours
    assert sorted(GEARSModel.CHECKPOINT_SHAPED_BUFFERS) == sorted(GRAPH_BUFFERS)  # the model takes their shapes
    assert {"task.name=\"perturbation_gears\"", "task.hidden_size=8", "task.num_gene_gnn_layers=2",
            "task.num_go_gnn_layers=1", "task.uncertainty=false"} <= set(ckpt.overrides)
    assert {"optim.decay_all_parameters=true", "train.grad_clip_value=1.0"} <= set(ckpt.recipe)
    assert ckpt.step == 0 and ckpt.optimizer is None and ckpt.ema is None
    assert [f.name for f in ckpt.files] == [MODEL_FILE, CONFIG_FILE]


def test_config_pickle_with_code_is_refused(tmp_path):
    """config.pkl naming any global but tensors' rebuild functions is refused, naming the file and the global,
    and its code never runs; its plain tensors load without torch's full unpickler."""
    shutil.copy(GOLDEN / MODEL_FILE, tmp_path / MODEL_FILE)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    config = dict(_golden()[1])
    (tmp_path / CONFIG_FILE).write_bytes(pickle.dumps({**config, "device": Payload()}))
    with pytest.raises(CheckpointError, match=r"refusing to load .*config\.pkl: it names the global '(posix|os)\.system'"):
        REFERENCE_FORMAT.read(tmp_path)
    assert not marker.exists()
    # A tensor's storage read by torch's own (full) unpickler would run code too: it is read weights-only.
    (tmp_path / CONFIG_FILE).write_bytes(pickle.dumps({**config, "G_go": torch.nn.Linear(1, 1)}))
    with pytest.raises(CheckpointError, match=r"config\.pkl: it names the global 'torch\.nn\.modules\.linear\.Linear'"):
        REFERENCE_FORMAT.read(tmp_path)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_config_pickle_of_any_protocol_reads(tmp_path, protocol):
    """GEARS pickles with the default protocol of its Python (3 before 3.8, then 4); 2 writes bytes through
    _codecs.encode: every one reads, tensors equal."""
    shutil.copy(GOLDEN / MODEL_FILE, tmp_path / MODEL_FILE)
    config = _golden()[1]
    (tmp_path / CONFIG_FILE).write_bytes(pickle.dumps(config, protocol=protocol))
    ckpt = REFERENCE_FORMAT.read(tmp_path)
    assert torch.equal(ckpt.model["go_edge_index"], config["G_go"])
    assert torch.equal(ckpt.model["coexpress_edge_weight"], config["G_coexpress_weight"])


@pytest.mark.parametrize("change, message", [
    ({"num_genes": 199}, r"config\.pkl: field 'num_genes' is 199, but model\.pt's 'gene_emb\.weight' has 200 rows"),
    ({"G_go": None}, r"config\.pkl: field 'G_go' is missing"),
    ({"no_perturb": True}, r"config\.pkl: field 'no_perturb' is True"),
    ({"G_go_weight": [1.0]}, r"config\.pkl: field 'G_go_weight' is a list, not a tensor"),
])
def test_config_fields_the_model_cannot_have_are_named(tmp_path, change, message):
    shutil.copy(GOLDEN / MODEL_FILE, tmp_path / MODEL_FILE)
    (tmp_path / CONFIG_FILE).write_bytes(pickle.dumps({**_golden()[1], **change}))
    with pytest.raises(ValueError, match=message):
        REFERENCE_FORMAT.read(tmp_path)


def test_missing_file_is_named(tmp_path):
    shutil.copy(GOLDEN / CONFIG_FILE, tmp_path / CONFIG_FILE)
    with pytest.raises(ValueError, match=r"no model\.pt there"):
        REFERENCE_FORMAT.read(tmp_path)


def test_model_takes_the_graphs_of_the_state_dict_it_loads():
    """A checkpoint carries its graphs: GEARSModel loads another edge count whole, and predicts as the model that
    saved it (the normalised adjacencies are rebuilt from the loaded graphs)."""
    g = torch.Generator().manual_seed(0)

    def graph(nodes: int, edges: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, nodes, (2, edges), generator=g), torch.rand(edges, generator=g)

    source = GEARSModel(6, 5, graph(6, 9), graph(5, 4), hidden_size=4).eval()
    target = GEARSModel(6, 5, graph(6, 14), graph(5, 7), hidden_size=4).eval()
    target.load_state_dict(source.state_dict(), strict=True)
    for name in GRAPH_BUFFERS:
        assert torch.equal(getattr(target, name), getattr(source, name)), name
    x, perts = torch.rand(3, 6, generator=g), torch.tensor([[0, -1], [1, 3], [-1, -1]])
    torch.testing.assert_close(target(x, perts), source(x, perts), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="gene_emb.weight"):
        GEARSModel(7, 5, graph(7, 9), graph(5, 4), hidden_size=4).load_state_dict(source.state_dict())


def test_resume_check_takes_the_graphs_from_the_checkpoint(tmp_path):
    """The resume's same-model check lets the graph buffers' shapes come with the checkpoint, and still names any
    other difference."""
    from safetensors.torch import save_file

    from trainer.core.checkpoint import convert

    g = torch.Generator().manual_seed(1)

    def model(genes: int, edges: int) -> GEARSModel:
        return GEARSModel(genes, 5, (torch.randint(0, genes, (2, edges), generator=g), None),
                          (torch.randint(0, 5, (2, 3), generator=g), None), hidden_size=4)

    (tmp_path / "ckpt").mkdir()
    save_file(model(6, 9).state_dict(), tmp_path / "ckpt" / convert.WEIGHTS)
    convert.check_same_model(tmp_path / "ckpt", {"backend": "MULTI_CPU"}, model(6, 14))
    with pytest.raises(CheckpointError, match=r"holds another model than this run's: parameter 'indv_w1' has shape "
                                              r"\(6, 4, 1\) there and \(7, 4, 1\) here"):
        convert.check_same_model(tmp_path / "ckpt", {"backend": "MULTI_CPU"}, model(7, 9))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """`trainer import gears` of the golden folder on the bundled set: the run folder."""
    from trainer.cli import main

    run = tmp_path_factory.mktemp("gears_import") / "run"
    assert main(["import", "gears", str(GOLDEN), str(run), "train.max_steps=1", "log.progress_bar=false"]) == 0
    return run


@pytest.mark.numerics
def test_import_evaluate_and_export_back(imported, tmp_path):
    """The imported run holds model.pt's weights and config.pkl's graphs (not the bundled set's), evaluates, and
    `export --format reference` gives back the same model.pt tensors and config.pkl graphs and options."""
    from trainer.cli import main
    from trainer.config import load_config
    from trainer.core.trainer import Trainer

    run, out = imported, tmp_path / "export"
    step_dir = run / "checkpoints" / "step_00000000"
    assert (run / "checkpoints" / "latest").read_text().strip() == step_dir.name
    model = load_file(step_dir / "model.safetensors")
    golden_model, golden_config = _golden()
    expected = _ours(golden_model, golden_config)
    assert all(torch.equal(model[k], v.to(model[k].dtype)) for k, v in expected.items())
    assert json.loads((run / "imported.json").read_text())["format"] == "gears"

    trainer = Trainer(load_config(run / "config.yaml", ["log.progress_bar=false"]))  # resumes the import
    try:
        loaded = trainer.model.state_dict()
        assert torch.equal(loaded["go_edge_index"], golden_config["G_go"])
        metrics = trainer.evaluate()
    finally:
        trainer.log.close()
        trainer.accelerator.end_training()
    assert metrics is not None and metrics["n_conditions"] > 0 and torch.isfinite(torch.tensor(metrics["mse_de"]))

    assert main(["export", str(run), "--format", "reference", "--out", str(out)]) == 0
    back = torch.load(out / MODEL_FILE, weights_only=True)
    assert set(back) == set(golden_model)
    assert all(torch.equal(back[k], v) for k, v in golden_model.items())  # the unused modules too (randomise_)
    config = restricted_unpickle(out / CONFIG_FILE, tensor_globals())
    for key in ("G_coexpress", "G_coexpress_weight", "G_go", "G_go_weight"):
        assert torch.equal(config[key], golden_config[key]), key
    for key in ("hidden_size", "num_go_gnn_layers", "num_gene_gnn_layers", "uncertainty", "num_genes", "num_perts",
                "no_perturb"):
        assert config[key] == golden_config[key], key


def test_a_config_that_does_not_match_says_which_keys(tmp_path):
    from trainer.core.reference_checkpoints import import_reference

    run = tmp_path / "run"
    with pytest.raises(CheckpointError, match=r"model\.pt does not match the model of this config: shapes differ: "
                                              r".*'gene_emb\.weight' \(200, 8\) there, \(200, 16\) here"):
        import_reference("gears", GOLDEN, run, ["task.hidden_size=16", "log.progress_bar=false"])
    assert not run.exists()


test_live_reference_checkpoint_imports_and_exports_back = live_checkpoint_test(
    "gears", "TRAINER_REFERENCE_GEARS", "snap-stanford/GEARS")

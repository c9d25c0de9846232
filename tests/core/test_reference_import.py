"""The reference-format registry, restricted unpickling and state-dict checks behind `trainer import` and
`trainer export --format reference` (the families' layouts: tests/families/*/test_*_reference_checkpoints.py)."""

from __future__ import annotations

import argparse
import os
import pickle

import pytest
import torch

from trainer.errors import CheckpointError, ConfigError
from trainer.reference_formats import (
    check_state_dict,
    format_for_task,
    get_reference_format,
    namespace_fields,
    reference_format_names,
    restricted_unpickle,
)


def test_formats_by_name_and_by_task():
    assert set(reference_format_names()) == {"sedd", "edm", "comformer", "gears"}
    assert get_reference_format("sedd").task == "protein_sedd"
    assert format_for_task("molecules_edm").name == "edm"
    with pytest.raises(ConfigError, match=r"unknown reference checkpoint format 'nope'; known: .*edm.*sedd"):
        get_reference_format("nope")
    with pytest.raises(ConfigError, match=r"task 'regression' has no reference checkpoint format; known formats: .*"
                                          r"sedd \(protein_sedd\)"):
        format_for_task("regression")


def test_cli_names_the_known_formats(capsys):
    from trainer.cli import main

    assert main(["import", "nope", "src", "out"]) == 2
    err = capsys.readouterr().err
    assert "unknown reference checkpoint format 'nope'; known:" in err and "sedd" in err


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_restricted_unpickling_builds_data_only(tmp_path):
    """Builtin containers and scalars and the allowed classes load; any other global is refused before it is built,
    with the file and the global named."""
    good = tmp_path / "args.pickle"
    good.write_bytes(pickle.dumps(argparse.Namespace(nf=16, factors=[1, 4, 10], name="qm9", tags={"a"}, c=1 + 2j)))
    assert namespace_fields(good) == {"nf": 16, "factors": [1, 4, 10], "name": "qm9", "tags": {"a"}, "c": 1 + 2j}
    marker = tmp_path / "ran"
    bad = tmp_path / "config.pkl"
    bad.write_bytes(pickle.dumps({"x": _Payload(str(marker))}))
    with pytest.raises(CheckpointError, match=r"refusing to load .*config\.pkl: it names the global '(posix|os)\.system'"):
        restricted_unpickle(bad)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"global 'argparse\.Namespace'"):
        restricted_unpickle(good)  # nothing allowed beyond builtins unless named
    (tmp_path / "cut.pickle").write_bytes(good.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=r"cannot read .*cut\.pickle as a pickle"):
        namespace_fields(tmp_path / "cut.pickle")


def test_state_dict_check_names_keys_and_shapes():
    expected = {"a.weight": torch.zeros(2, 3), "b": torch.zeros(4)}
    check_state_dict(expected, {"a.weight": torch.ones(2, 3), "b": torch.ones(4)}, "src.pth")
    with pytest.raises(CheckpointError) as err:
        check_state_dict(expected, {"a.weight": torch.zeros(3, 3), "c": torch.zeros(1)}, "src.pth", hint="try X")
    text = str(err.value)
    assert text.startswith("src.pth does not match the model of this config: ")
    assert "missing keys: 'b'" in text and "unexpected keys: 'c'" in text
    assert "'a.weight' (3, 3) there, (2, 3) here" in text and text.endswith("(try X)")


def test_import_refuses_a_folder_with_checkpoints(tmp_path):
    from trainer.core.reference_checkpoints import import_reference
    from trainer.families.molecules_edm.reference import ARGS_FILE

    golden = os.path.join(os.path.dirname(__file__), "..", "families", "molecules_edm", "golden_checkpoint")
    assert os.path.isfile(os.path.join(golden, ARGS_FILE))
    (tmp_path / "run" / "checkpoints" / "step_00000002").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"already holds a run's checkpoints: import into a new folder"):
        import_reference("edm", golden, tmp_path / "run")

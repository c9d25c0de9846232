"""scripts/parity/parity_common.py: the ten-step golden files' layout, the per-name comparison and the golden check
that the family parity scripts share (their numbers are checked by each family's parity tests)."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import load_script
from parity_support import PARITY_DIR


@pytest.fixture(scope="module")
def common():
    return load_script(PARITY_DIR / "parity_common.py", "parity_common_under_test")


def test_ten_step_files_read_back_as_the_layout_names_them(common, tmp_path):
    state, inputs = {"w": torch.ones(2)}, {"x": torch.arange(3.0)}
    ref_out = {"losses": torch.tensor([1.0, 0.5]), "params": {"w": torch.full((2,), 2.0)}, "unsaved": torch.zeros(1)}
    layout = (("losses",), ("params",))
    common.write_ten_step_files(tmp_path, state, inputs, ref_out, layout, {"queue": [3, 1]})
    got_state, got_inputs, ref, meta = common.read_ten_step_files(tmp_path, "x.py", layout, from_meta={"q": "queue"})
    assert torch.equal(got_state["w"], state["w"]) and torch.equal(got_inputs["x"], inputs["x"])
    assert set(ref) == {"losses", "params", "q"} and ref["q"] == [3, 1] == meta["queue"]
    assert torch.equal(ref["params"]["w"], ref_out["params"]["w"])


def test_a_missing_ten_step_file_names_the_script_that_writes_it(common, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"ten_steps\.safetensors: golden file missing \(scripts/parity/x\.py "
                                                r"--ten-steps --write-golden .*golden writes it\)"):
        common.read_ten_step_files(tmp_path / "golden" / "v1", "x.py", ((), ()), write_dir=tmp_path / "golden")


def test_close_each_compares_by_name_and_names_a_different_set(common):
    failures: list[str] = []
    common.close_each("ten steps: params", {"a": torch.ones(1)}, {"a": torch.ones(1) + 1e-3}, 0.0, 1e-6, failures)
    assert len(failures) == 1 and failures[0].startswith("ten steps: params a: ")
    failures = []
    common.close_each("ten steps: ema", {"a": torch.ones(1)}, {"b": torch.ones(1)}, 0.0, 0.0, failures)
    assert failures == ["ten steps: ema names differ: ['a', 'b']"]


def test_check_golden_only_with_the_flag(common, tmp_path):
    def load(_):
        raise AssertionError("read without --check-golden")

    assert common.check_golden(argparse.Namespace(check_golden=None), load, {}, {}, {}, lambda a, b: ["x"]) == []
    golden = ({"w": torch.ones(1)}, {"x": torch.ones(1)}, "saved", {})
    failures = common.check_golden(argparse.Namespace(check_golden=tmp_path), lambda d: golden, {"w": torch.zeros(1)},
                                   {"x": torch.ones(1)}, "now", lambda now, saved: [f"{now} vs {saved}"])
    assert failures == [f"{tmp_path}/weights.safetensors: not the weights this script randomises", "golden now vs saved"]

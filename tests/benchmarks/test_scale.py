"""`benchmarks/scale.py`'s arithmetic and its checkpoint move, in-process (the script's end-to-end run is its
`--smoke` in test_smoke.py): the cost per doubling of N, the extrapolation, and a checkpoint moved to another step
still passing its manifest's checksums."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import sys

import pytest
from conftest import ROOT

_spec = importlib.util.spec_from_file_location("scale_bench", ROOT / "benchmarks" / "scale.py")
scale = importlib.util.module_from_spec(_spec)
sys.modules["scale_bench"] = scale  # its dataclass looks its module up there
_spec.loader.exec_module(scale)


def rows(ns, worlds=(1,)):
    """Sizes whose quantities are flat (rank RSS), linear (prepare_s) and square-root (first_step_s) in N, and linear
    in W (resume_s = 2 x W)."""
    sizes = [{"N": n, "prepare_s": n / 1000} for n in ns]
    per_w = [{"N": n, "W": w, "rank_peak_MiB": 500.0, "first_step_s": math.sqrt(n), "resume_s": 2.0 * w}
             for n in ns for w in worlds]
    return sizes, per_w


def test_cost_per_doubling_is_the_ratio_per_doubling_of_n():
    sizes, per_w = rows([1000, 4000, 8000])
    out = scale.per_doubling(sizes, per_w)
    assert [r["N"] for r in out] == ["1,000 -> 4,000", "4,000 -> 8,000"]
    for r in out:
        assert r["prepare_s"] == pytest.approx(2.0) and r["rank_peak_MiB"] == pytest.approx(1.0)
        assert r["first_step_s"] == pytest.approx(math.sqrt(2))


def test_extrapolation_follows_the_fitted_power_law_and_line():
    sizes, per_w = rows([1000, 2000, 4000], worlds=(1, 2, 4))
    ext = {r["quantity"]: r for r in scale.extrapolate(sizes, per_w, 64_000, 64)}
    assert ext["prepare_s"]["N=64,000 (W=1)"] == pytest.approx(64.0)
    assert ext["rank_peak_MiB"]["N=64,000 (W=1)"] == pytest.approx(500.0)
    assert ext["first_step_s"]["N=64,000 (W=1)"] == pytest.approx(math.sqrt(64_000))
    assert ext["resume_s"]["W=64 (N=4,000)"] == pytest.approx(128.0)
    assert math.isnan(ext["prepare_s"]["W=64 (N=4,000)"])  # a per-size quantity has no W


def test_moved_checkpoint_claims_the_step_and_keeps_its_manifest_true(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "world_size": 1}))
    (ckpt / "manifest.json").write_text(json.dumps({"files": {"trainer_state.json": {"size": 0, "sha256": "x"}}}))
    assert scale.move_checkpoint(tmp_path, 900) == ckpt
    data = (ckpt / "trainer_state.json").read_bytes()
    assert json.loads(data) == {"step": 900, "world_size": 1}
    entry = json.loads((ckpt / "manifest.json").read_text())["files"]["trainer_state.json"]
    assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

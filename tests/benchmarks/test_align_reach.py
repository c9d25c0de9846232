"""`benchmarks/align.py:force_target_reach`: what two kinds of improvement would reach on a start set, by hand."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # align.py imports its sibling bench_report
_spec = importlib.util.spec_from_file_location("bench_align", ROOT / "benchmarks" / "align.py")
bench_align = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_align)


def molecule(force_rms: float, closest_pair: float, ok: bool = True) -> dict:
    return {"forcefield_ok": ok, "force_rms": force_rms, "closest_pair": closest_pair}


def test_what_scaling_every_molecule_and_repairing_the_near_clashes_would_reach():
    start = [molecule(1.0, 1.0), molecule(2.0, 1.0), molecule(3.0, 1.0), molecule(10.0, 0.5),
             molecule(99.0, 0.1, ok=False)]  # not scored: left out
    reach = bench_align.force_target_reach(start, "")
    # values 1, 2, 3, 10: mean 4, sd sqrt(50/3); scaled: -sqrt(4) * 4 / sd
    assert reach["scaled"] == pytest.approx(-2 * 4 / math.sqrt(50 / 3))
    # the one close pair (10 -> the median 2.5): differences 0, 0, 0, -7.5, mean -1.875, sd 3.75
    assert reach["repaired"] == pytest.approx(2 * -1.875 / 3.75) and reach["close"] == 1
    assert math.isnan(bench_align.force_target_reach(start[:1], "")["scaled"])

"""Every script under benchmarks/ still runs: its `--smoke` mode (a few steps on tiny data, nothing
written to BENCHMARKS.md). The figures themselves are measured by hand: no timed assertions here."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, run_cmd

# Smoke runs of several minutes on 2 cores (whole pipelines: training, 1 and 2 process sampling, force-field
# sweeps, MLFF against GFN2 guidance; simulated data, two child processes): in the full suite (`make test-all`),
# not in `make test`.
# fsdp_checkpoints.py launches 2 FSDP processes; checkpoints.py smoke-tests the shared code in one; elastic.py runs
# three elastic jobs of agents on this host (the faults' code paths are in tests/core/test_elastic.py); scale.py
# launches `trainer data prepare` twice and `trainer train` twice plus a loader process; stream_engines.py starts a
# reader process per engine, world size and resume (each importing torch and datasets); scale_data_rate.py
# launches `trainer data prepare`, `trainer train` and a loader process; crystal_db_folder.py writes databases in
# child processes, then builds and trains.
HEAVY = {"molecules.py", "gears.py", "fsdp_checkpoints.py", "mlff_guidance.py", "elastic.py", "scale.py",
         "stream_engines.py", "scale_perturbation.py", "scale_molecules.py", "scale_data_rate.py",
         "crystal_db_folder.py"}
LIBRARIES = {"bench_report.py", "molecule_shards.py"}  # modules the scripts import, not scripts
SCRIPTS = [pytest.param(name, marks=pytest.mark.extended) if name in HEAVY else name
           for name in sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name not in LIBRARIES)]

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_mode_runs(script):
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    proc = run_cmd([sys.executable, str(ROOT / "benchmarks" / script), "--smoke"], timeout=300)
    assert "smoke run: nothing written" in proc.stdout + proc.stderr
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before


def test_overhead_paired_mode_runs_against_another_checkout():
    """`overhead.py --paired --versus`: child processes per side, one importing `trainer` from the other tree (this
    one here), per-pair ratios in the table."""
    proc = run_cmd([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--smoke", "--paired", "1",
                    "--versus", str(ROOT)], timeout=300)
    out = proc.stdout + proc.stderr
    assert "smoke run: nothing written" in out
    assert "| b/a step |" in out and "| b/v step |" in out and f"imported from {ROOT}" in out

"""`benchmarks/parity.py`: our step and loop timed side by side with SEDD's, EDM's and ComFormer's reference code.
The clock's bookkeeping and our sides' configs in-process; the `--smoke` runs (tiny models, a few steps, two child
processes per family) only where the reference checkouts are named (TRAINER_REFERENCE_SEDD / _EDM / _COMFORMER).
No timed assertions."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import ROOT, child_env, load_script, run_cmd

SCRIPT = ROOT / "benchmarks" / "parity.py"
parity = load_script(SCRIPT, "parity_bench")


def test_step_clock_times_calls_and_loop_periods_after_warmup(monkeypatch):
    """Steps are each call's own duration, loop periods run from one call's start to the next, in wall and CPU
    time; warm-up is dropped."""
    walls = [0.0, 0.1, 1.0, 1.3, 2.0, 2.2, 4.0, 4.4]  # (start, end) of four calls
    ticks = iter([(w, w / 2) for w in walls])  # CPU time: half the wall time
    monkeypatch.setattr(parity, "now", lambda: next(ticks))
    clock = parity.StepClock()
    step = clock.wrap(lambda x, y=0: x + y)
    assert [step(1, y=2) for _ in range(4)] == [3] * 4
    got = clock.result(warmup=1)
    assert got["step_ms"] == pytest.approx([300.0, 200.0, 400.0])
    assert got["loop_ms"] == pytest.approx([1000.0, 2000.0])  # the last call has no next start
    assert got["step_cpu_ms"] == pytest.approx([150.0, 100.0, 200.0])
    assert got["loop_cpu_ms"] == pytest.approx([500.0, 1000.0])


def test_summary_pools_runs_and_pairs_them_in_order():
    def run(ms: float) -> dict:
        return {"params": 7, "load_before": 1.0, "load_after": 2.0, **{m: [ms, ms, 3 * ms] for m in parity.MEASURES}}

    got = parity.summarise({"ours": [run(10.0), run(30.0)], "reference": [run(20.0), run(30.0)]})
    assert got["ours"]["step_ms"] == 30.0  # the median of the pooled steps [10, 10, 30, 30, 30, 90]
    assert got["ours"]["per_run_step_ms"] == [10.0, 30.0]
    assert got["pair_speed"]["step_cpu_ms"] == pytest.approx([2.0, 1.0])  # reference / ours, pair by pair


def test_table_gives_reference_over_ours_per_family_threads_and_measure():
    sides = {"ours": {"step_ms": 50.0, "loop_ms": 60.0, "step_cpu_ms": 40.0, "loop_cpu_ms": 50.0},
             "reference": {"step_ms": 100.0, "loop_ms": 45.0, "step_cpu_ms": 60.0, "loop_cpu_ms": 50.0},
             "pair_speed": {"step_ms": [1.5, 2.5], "loop_ms": [0.7], "step_cpu_ms": [1.5], "loop_cpu_ms": [1.0]}}
    rows = parity.table({"edm": {"threads": {2: sides}}}).splitlines()
    assert rows[2] == "| EDM (molecules_edm) | 2 | step | 50.0 | 100.0 | 2.00x | 40.0 | 60.0 | 1.50x | 1.50x, 2.50x; 1.50x |"
    assert rows[3] == "| EDM (molecules_edm) | 2 | loop | 60.0 | 45.0 | 0.75x | 50.0 | 50.0 | 1.00x | 0.70x; 1.00x |"


def test_edm_side_trains_with_the_paper_recipe(tmp_path):
    """Our EDM side does the reference's optimisation work: `task.preset=paper`'s amsgrad, adaptive clipping,
    decay of every parameter and EMA without warm-up, over edm_tiny.yaml's own choices (cosine, warm-up, norm
    clipping, EMA 0.999)."""
    from trainer.config import load_config

    job = {"config": parity.EDM, "work": str(tmp_path), "warmup": 1, "steps": 2}
    cfg = parity._edm_config(job)
    paper = load_config(None, ["task.name=molecules_edm", "task.preset=paper"])
    keys = {"train": ("grad_clip_mode", "adaptive_clip_history", "adaptive_clip_initial", "ema_decay", "ema_warmup"),
            "optim": ("amsgrad", "weight_decay", "decay_all_parameters", "scheduler", "warmup_steps")}
    for section, names in keys.items():
        for name in names:
            assert getattr(getattr(cfg, section), name) == getattr(getattr(paper, section), name), f"{section}.{name}"
    assert (cfg.train.grad_clip_mode, cfg.optim.amsgrad, cfg.train.ema_warmup) == ("adaptive", True, "none")
    assert (cfg.task.hidden, cfg.task.layers, cfg.train.max_steps) == (parity.EDM["hidden"], parity.EDM["layers"], 4)


def test_comformer_side_is_the_paper_preset_at_the_benchmark_size(tmp_path, monkeypatch):
    """Our ComFormer side: `task.preset=paper` (MSE, OneCycle, no clipping, no EMA, k = 25) with the model preset
    resized in the worker's process to the benchmark's sizes, the reference's layer counts kept."""
    from trainer.families.crystals import comformer

    monkeypatch.setitem(comformer.COMFORMER_PRESETS, "paper", dict(comformer.COMFORMER_PRESETS["paper"]))
    job = {"config": parity.COMFORMER, "work": str(tmp_path), "warmup": 1, "steps": 2}
    cfg = parity._comformer_config(job)
    assert (cfg.task.preset, cfg.task.model_preset, cfg.task.loss, cfg.task.max_neighbors) == ("paper", "paper", "mse", 25)
    assert (cfg.optim.scheduler, cfg.train.grad_clip_norm, cfg.train.ema_decay) == ("onecycle", 0.0, 0.0)
    assert (cfg.train.per_device_batch_size, cfg.train.max_steps) == (parity.COMFORMER["batch_size"], 4)
    assert comformer.comformer_config("paper").node_features == 256
    parity._comformer_sizes(parity.COMFORMER)
    model = comformer.comformer_config("paper")
    assert (model.conv_layers, model.edge_layers, model.node_features, model.fc_features) == (4, 1, 64, 64)
    assert parity.COMFORMER_PAPER["node_features"] == 256 and parity.COMFORMER_PAPER["k"] == 25


def test_smoke_without_checkouts_skips_each_family_and_writes_nothing():
    env = {k: v for k, v in child_env().items() if k not in parity.ENVS.values()}
    proc = run_cmd([sys.executable, str(SCRIPT), "--smoke"], timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert "sedd: skipped (TRAINER_REFERENCE_SEDD" in out and "edm: skipped (TRAINER_REFERENCE_EDM" in out
    assert "comformer: skipped (TRAINER_REFERENCE_COMFORMER" in out
    assert "smoke run: nothing written" in out


@pytest.mark.slow
@pytest.mark.skipif(not (os.environ.get("TRAINER_REFERENCE_SEDD") and os.environ.get("TRAINER_REFERENCE_EDM")),
                    reason="set TRAINER_REFERENCE_SEDD and TRAINER_REFERENCE_EDM to the reference checkouts")
def test_smoke_times_both_sides_of_both_families(tmp_path):
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    out_json = tmp_path / "parity.json"
    proc = run_cmd([sys.executable, str(SCRIPT), "--smoke", "--json", str(out_json)], timeout=300)
    out = proc.stdout + proc.stderr
    assert "smoke run: nothing written" in out
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before
    for name in ("SEDD (protein_sedd) | 1 | step", "SEDD (protein_sedd) | 1 | loop", "EDM (molecules_edm) | 1 | step",
                 "EDM (molecules_edm) | 1 | loop"):
        assert f"| {name} |" in out
    import json

    results = json.loads(out_json.read_text())["results"]
    for family in ("sedd", "edm"):
        sides = results[family]["threads"]["1"]
        # the same model on both sides: equal trainable parameter counts, and every timed step measured
        assert sides["ours"]["params"] == sides["reference"]["params"] > 0
        assert all(sides[s]["step_ms"] > 0 and sides[s]["loop_ms"] > 0 for s in ("ours", "reference"))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("TRAINER_REFERENCE_COMFORMER"),
                    reason="set TRAINER_REFERENCE_COMFORMER to the reference checkout (divelab/AIRS)")
def test_smoke_times_both_sides_of_comformer(tmp_path):
    """Both ComFormer sides run on the same crystals (our graphs, converted for the reference) with the same
    model: equal trainable parameters (the reference's unused modules left out), every step timed."""
    import json

    out_json = tmp_path / "parity.json"
    proc = run_cmd([sys.executable, str(SCRIPT), "--smoke", "--families", "comformer", "--json", str(out_json)],
                   timeout=300)
    out = proc.stdout + proc.stderr
    assert "| iComFormer (crystals) | 1 | step |" in out and "| iComFormer (crystals) | 1 | loop |" in out
    sides = json.loads(out_json.read_text())["results"]["comformer"]["threads"]["1"]
    assert sides["ours"]["params"] == sides["reference"]["params"] > 0
    assert all(sides[s]["step_ms"] > 0 and sides[s]["loop_ms"] > 0 for s in ("ours", "reference"))

"""trainer run-experiments with a `search:` block: parsing, an Optuna study on the slot scheduler (SQLite storage,
median pruning by SIGTERM, grid coverage), seed statistics, and --resume after the runner is killed with -9."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml
from conftest import ROOT, TINY, child_env

from trainer.sweep import ExperimentsError, parse_experiments
from trainer.sweep.searchspec import parse_search
from trainer.sweep.spec import load_experiments_file

optuna = pytest.importorskip("optuna")
scipy_stats = pytest.importorskip("scipy.stats")

# Tiny trials: a few seconds of training after start-up, evaluations often enough for the pruner to act.
TRIAL = {"eval.every_steps": 5, "task.delay_s": 0.05, "ckpt.every_steps": 0, "log.progress_bar": False,
         "log.tensorboard": False}
LRS = [0.03, 0.01, 1.0e-5, 3.0e-6]


def write_yaml(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def runner_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "run-experiments", *args]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def last_value(run_dir: Path, key: str = "eval/loss") -> float:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in lines if key in r][-1]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def search(**changes) -> dict:
    block = {"name": "reg_lr", "config": TINY, "overrides": {"train.max_steps": 20, **TRIAL}, "n_trials": 4,
             "sampler": "tpe", "pruner": "median", "params": {"optim.lr": {"type": "float", "low": 1e-4, "high": 1.0,
                                                                            "log": True}}}
    block.update(changes)
    return block


# --- parsing ---------------------------------------------------------------------------------------

def test_search_block_parsing_errors_repeats_and_dry_run(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the worked example of docs/experiments.md names its config relative to the checkout
    experiments, example = load_experiments_file("configs/sweep/search.yaml")
    assert experiments == [] and example.n_trials == 12 and example.confirm_top == 2
    spec = parse_search(search(params={"optim.lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
                                       "task.hidden": {"type": "categorical", "choices": [32, 64]}},
                               pruner={"type": "median", "n_startup_trials": 1}, confirm={"top": 2, "seeds": 3}),
                        "e.yaml", {})
    assert (spec.metric, spec.direction) == ("eval/loss", "minimize")  # the config's selection metric
    assert [p.key for p in spec.params] == ["optim.lr", "task.hidden"] and spec.params[0].log
    assert (spec.pruner, dict(spec.pruner_options), spec.confirm_top, spec.confirm_seeds) == ("median",
                                                                                               {"n_startup_trials": 1}, 2, 3)
    assert "train.max_steps=20" in spec.overrides
    assert spec.params[1].grid_values() == [32, 64]

    def error(**changes) -> str:
        with pytest.raises(ExperimentsError) as err:
            parse_search(search(**changes), "e.yaml", {})
        return str(err.value)

    assert "'n_trails'" in error(n_trails=3)
    assert "unknown key 'lo'" in error(params={"optim.lr": {"type": "float", "lo": 1e-4, "high": 1.0}})
    assert "low must be < high" in error(params={"optim.lr": {"type": "float", "low": 1.0, "high": 1e-4}})
    assert "low > 0" in error(params={"optim.lr": {"type": "float", "low": 0.0, "high": 1.0, "log": True}})
    assert "type: float | int | categorical" in error(params={"optim.lr": {"type": "uniform", "low": 0, "high": 1}})
    assert "needs `choices` or a `step`" in error(sampler="grid")
    assert "only 2 point(s)" in error(sampler="grid", params={"task.hidden": {"type": "categorical",
                                                                               "choices": [32, 64]}})
    assert "annealing" in error(sampler="annealing")
    assert "'n_warmup'" in error(pruner={"type": "median", "n_warmup": 3})
    assert "does not load" in error(params={"optim.lrr": {"type": "float", "low": 0.1, "high": 1.0}})
    assert "seeds must be >= 2" in error(confirm={"top": 1, "seeds": 1})
    assert "both searched and overridden" in error(overrides={"optim.lr": 0.1})
    with pytest.raises(ExperimentsError, match="not both"):
        parse_experiments({"search": search(), "experiments": [{"name": "a", "command": "true"}]}, "e.yaml")

    runs = parse_experiments({"experiments": [{"name": "lr{optim.lr}", "config": TINY, "repeats": 3,
                                               "grid": {"optim.lr": [0.1, 0.01]}}]})
    assert [r.name for r in runs][:4] == ["lr0.1_seed0", "lr0.1_seed1", "lr0.1_seed2", "lr0.01_seed0"]
    assert runs[4].group == "lr0.01" and "run.seed=1" in runs[4].overrides and "optim.lr=0.01" in runs[4].overrides
    with pytest.raises(ExperimentsError, match="repeats"):
        parse_experiments({"experiments": [{"name": "a", "config": TINY, "repeats": 2,
                                            "overrides": {"run.seed": 3}}]})

    # --dry-run shows the search space; neither it nor a plain experiments file imports Optuna.
    study_file = write_yaml(tmp_path / "study.yaml", {"search": search()})
    plain_file = write_yaml(tmp_path / "plain.yaml", {"experiments": [{"name": "a", "command": "true"}]})
    code = ("import sys; from trainer.cli import main\n"
            f"for f in ({study_file!r}, {plain_file!r}):\n"
            "    assert main(['run-experiments', f, '--out', 'unused', '--dry-run']) == 0\n"
            "print('OPTUNA' if 'optuna' in sys.modules else 'LIGHT')")
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "study reg_lr: 4 trial(s), minimize eval/loss" in proc.stdout
    assert "optim.lr  float [0.0001, 1.0] log" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "LIGHT"


# --- a study on two slots ------------------------------------------------------------------------

def test_grid_study_prunes_by_sigterm_and_confirms_with_seed_statistics(tmp_path):
    # Seed 4 of the grid sampler asks the two good rates first: the bad ones are then pruned at an early
    # evaluation, against the completed trials' values at the same step.
    block = search(sampler={"type": "grid", "seed": 4}, pruner={"type": "median", "n_startup_trials": 1},
                   params={"optim.lr": {"type": "categorical", "choices": LRS}}, confirm={"top": 1, "seeds": 2})
    path = write_yaml(tmp_path / "study.yaml", {"search": block})
    out = tmp_path / "out"
    proc = subprocess.run(runner_cmd(path, "--slots", "2", "--out", str(out), "--grace", "20"), env=child_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    study = optuna.load_study(study_name="reg_lr", storage=f"sqlite:///{out / 'study.db'}")
    trials = study.get_trials()
    assert len(trials) == 4
    assert sorted(t.params["optim.lr"] for t in trials) == sorted(LRS)  # the grid, each point once
    states = {t.number: t.state for t in trials}
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned and all(states[t.number] in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
                          for t in trials)
    assert study.best_trial.params["optim.lr"] in (0.03, 0.01)

    rows = {row["name"]: row for row in read_csv(out / "summary.csv")}
    assert len(rows) == 4 and {row["state"] for row in rows.values()} <= {"complete", "pruned"}
    results = {r["name"]: r for r in json.loads((out / "results.json").read_text())["experiments"]}
    for trial in pruned:
        name = f"trial_{trial.number:04d}"
        run_dir = out / name
        # SIGTERM, not a kill: the trainer checkpointed at the step it stopped and exited with its status 75.
        assert results[name]["status"] == "pruned" and results[name]["exit_code"] == 75
        marker = json.loads((run_dir / "preempted.json").read_text())
        assert (run_dir / "checkpoints" / f"step_{marker['step']:08d}").is_dir()
        assert trial.value == trial.intermediate_values[max(trial.intermediate_values)]
        assert rows[name]["state"] == "pruned" and float(rows[name]["eval/loss"]) == trial.value
        assert int(rows[name]["step"]) < 20
    for trial in trials:
        config = yaml.safe_load((out / f"trial_{trial.number:04d}" / "config.yaml").read_text())
        assert config["optim"]["lr"] == trial.params["optim.lr"]  # the sampled value is in the run's config
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert all(t.value == last_value(out / f"trial_{t.number:04d}") for t in complete)
    assert "[4/4] trial_" in proc.stdout and "pruned at step" in proc.stdout

    # confirm: the best config with run.seed 0 and 1; statistics as numpy and scipy compute them.
    best = f"trial_{study.best_trial.number:04d}"
    values = np.array([last_value(out / "confirm" / f"{best}_seed{seed}") for seed in range(2)])
    (row,) = read_csv(out / "confirm.csv")
    assert row["config"] == best and int(row["n"]) == 2 and values[0] != values[1]
    sem = values.std(ddof=1) / np.sqrt(2)
    low, high = scipy_stats.t.interval(0.95, 1, loc=values.mean(), scale=sem)
    expected = [values.mean(), values.std(ddof=1), sem, low, high]
    got = [float(row[key]) for key in ("mean", "std", "sem", "ci95_low", "ci95_high")]
    assert np.allclose(got, expected, rtol=1e-12, atol=0)
    assert values[0] == study.best_trial.value  # seed 0 is the config's own seed: the same run again
    assert "winner by mean eval/loss" in proc.stdout
    assert {p.name for p in (out / "plots").iterdir()} >= {"optimization_history.png", "confirm.png"}


def test_runner_killed_with_sigkill_then_resume_counts_each_trial_once(tmp_path):
    block = search(n_trials=3, sampler={"type": "random", "seed": 0}, pruner="none",
                   overrides={"train.max_steps": 40, **TRIAL})
    path = write_yaml(tmp_path / "study.yaml", {"search": block})
    out = tmp_path / "out"
    runner = subprocess.Popen(runner_cmd(path, "--slots", "2", "--out", str(out)), env=child_env(), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    orphans: list[int] = []
    try:
        deadline = time.time() + 120
        while not ((out / "trial_0000" / "metrics.jsonl").is_file()
                   and "eval/loss" in (out / "trial_0000" / "metrics.jsonl").read_text()):
            assert runner.poll() is None and time.time() < deadline, "the study did not start"
            time.sleep(0.1)
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait(timeout=30)
        # The trials run in sessions of their own; the kernel sends them SIGTERM when the runner dies
        # (PR_SET_PDEATHSIG), so they checkpoint and exit rather than go on without it.
        results = json.loads((out / "results.json").read_text())["experiments"]
        orphans = [r["pid"] for r in results if r["status"] == "running" and r["pid"]]
        assert orphans
        deadline = time.time() + 90
        while not all(gone(pid) for pid in orphans):
            assert time.time() < deadline, [pid for pid in orphans if not gone(pid)]
            time.sleep(0.2)
        before = optuna.load_study(study_name="reg_lr", storage=f"sqlite:///{out / 'study.db'}").get_trials()
        lost = {t.number: t.params for t in before if t.state == optuna.trial.TrialState.RUNNING}
        assert lost

        proc = subprocess.run(runner_cmd(path, "--slots", "2", "--out", str(out), "--resume"), env=child_env(),
                              cwd=ROOT, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        for pid in orphans:
            if not gone(pid):
                os.killpg(pid, signal.SIGKILL)

    trials = optuna.load_study(study_name="reg_lr", storage=f"sqlite:///{out / 'study.db'}").get_trials()
    counted = [t for t in trials if "outcome" in t.user_attrs]
    assert len(counted) == 3 and all(t.state == optuna.trial.TrialState.COMPLETE for t in counted)
    interrupted = [t for t in trials if "outcome" not in t.user_attrs]
    assert {t.number for t in interrupted} == set(lost)
    assert all(t.state == optuna.trial.TrialState.FAIL for t in interrupted)
    reruns = {t.user_attrs["rerun_of"]: t for t in trials if "rerun_of" in t.user_attrs}
    assert set(reruns) == set(lost)  # each lost trial re-run once, with its parameters
    assert all(reruns[number].params == params for number, params in lost.items())
    assert len({t.number for t in counted}) == 3 and not set(lost) & {t.number for t in counted}
    # A seeded sampler is reseeded on resume: the new trial does not repeat an earlier trial's parameters.
    assert len({t.params["optim.lr"] for t in counted}) == 3
    rows = read_csv(out / "summary.csv")
    assert [row["state"] for row in rows].count("interrupted") == len(lost)
    assert [row["state"] for row in rows].count("complete") == 3


def test_slurm_array_tasks_share_the_study_through_its_journal(tmp_path):
    pytest.importorskip("submitit")
    from trainer.cli import main

    block = search(n_trials=3, sampler={"type": "random", "seed": 0}, pruner="none",
                   overrides={"train.max_steps": 10, **TRIAL})
    path = write_yaml(tmp_path / "study.yaml", {"search": block})
    out = tmp_path / "out"
    # submitit's LocalExecutor runs the two array tasks here; each runs trials until the study has three.
    assert main(["run-experiments", path, "--out", str(out), "--slurm", "--slurm-executor", "local",
                 "--slurm-array-parallelism", "2"]) == 0
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(out / "study.journal")))
    deadline = time.time() + 300
    while True:
        trials = optuna.load_study(study_name="reg_lr", storage=storage).get_trials()
        if sum(t.state.is_finished() for t in trials) >= 3 and all(
                (out / f"trial_{t.number:04d}" / "result.json").is_file() for t in trials):
            break
        assert time.time() < deadline, "the array tasks did not finish the study"
        time.sleep(0.5)
    assert len(trials) == 3 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert len({t.params["optim.lr"] for t in trials}) == 3  # the tasks' samplers are seeded apart
    assert main(["run-experiments", path, "--out", str(out), "--collect"]) == 0
    rows = read_csv(out / "summary.csv")
    assert [row["state"] for row in rows] == ["complete"] * 3
    records = json.loads((out / "results.json").read_text())["experiments"]
    assert len({r["slurm_job_id"] for r in records}) == 2  # both tasks ran trials
    assert all(float(row["eval/loss"]) == last_value(out / row["name"]) for row in rows)


def test_repeats_seed_statistics_and_verdict(tmp_path, capsys):
    # Two configs of a `repeats: 3` entry, as the runner leaves them: each run's config.yaml (the selection
    # metric) and metrics.jsonl; the statistics must equal numpy/scipy's, the winner is the better mean.
    from trainer.sweep.stats import write_repeats_statistics

    values = {"good": [0.10, 0.12, 0.11], "bad": [0.30, 0.36, 0.33]}
    records = []
    for group, vals in values.items():
        for seed, value in enumerate(vals):
            run_dir = tmp_path / f"{group}_seed{seed}"
            run_dir.mkdir()
            (run_dir / "config.yaml").write_text(yaml.safe_dump({"eval": {"metric": "mae", "mode": "min"}}))
            (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 5, "eval/mae": 9.0}) + "\n"
                                                   + json.dumps({"step": 10, "eval/mae": value}) + "\n")
            records.append({"name": run_dir.name, "entry": 0, "kind": "config", "status": "completed",
                            "out_dir": str(run_dir), "group": group})
    records.append({"name": "other", "entry": 1, "kind": "config", "status": "completed",
                    "out_dir": str(tmp_path / "missing")})
    write_repeats_statistics(records, tmp_path, sys.stdout)
    rows = read_csv(tmp_path / "confirm.csv")
    assert [row["config"] for row in rows] == ["good", "bad"]
    for row in rows:
        vals = np.array(values[row["config"]])
        sem = vals.std(ddof=1) / np.sqrt(3)
        low, high = scipy_stats.t.interval(0.95, 2, loc=vals.mean(), scale=sem)
        got = [float(row[k]) for k in ("mean", "std", "sem", "ci95_low", "ci95_high")]
        assert np.allclose(got, [vals.mean(), vals.std(ddof=1), sem, low, high], rtol=1e-12, atol=0)
    said = capsys.readouterr().out
    assert "winner by mean eval/mae: good" in said and "beyond their 95 % intervals" in said

    from trainer.sweep.stats import rank_configs, verdict
    close = rank_configs({"a": [0.10, 0.14, 0.12], "b": [0.11, 0.15, 0.13]}, "minimize")
    assert "overlap" in verdict(close, "eval/loss") and close[0]["config"] == "a"
    assert rank_configs({"a": [1.0, 2.0], "b": [3.0, 4.0]}, "maximize")[0]["config"] == "b"


def test_a_trials_report_at_its_last_planned_step_is_never_pruned(tmp_path):
    """The final report comes as the trial finishes: a SIGTERM then would meet a process past its stop points."""
    from trainer.sweep.study import is_final_report

    assert not is_final_report(tmp_path, 20)  # no plan yet
    (tmp_path / "plan.json").write_text(json.dumps({"max_steps": 20}))
    assert not is_final_report(tmp_path, 15) and not is_final_report(tmp_path, None)
    assert is_final_report(tmp_path, 20)

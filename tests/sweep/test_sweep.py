"""trainer run-experiments: grid expansion, the slot queue, failure isolation, timeouts, resume,
Ctrl-C, cleanup of setsid descendants, the real trainer as an experiment, and the SLURM path through submitit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import ROOT, TINY, child_env

from trainer.sweep import ExperimentsError, expand_grid, free_port, load_experiments, parse_experiments, run_experiments

JOB = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    mode, out_dir, name, counter = sys.argv[1:5]
    with open(counter, "a") as f:
        f.write(name + "\\n")
    if mode == "ok":
        value = float(sys.argv[5])
        time.sleep(1.0)
        with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 0, "event": "start"}) + "\\n")
            f.write(json.dumps({"step": 1, "loss": value}) + "\\n")
            f.write(json.dumps({"step": 2, "eval/loss": value / 4}) + "\\n")
            f.write(json.dumps({"step": 2, "loss": value / 2}) + "\\n")
    elif mode == "crash":
        raise ValueError("boom in " + name)
    elif mode == "hang":
        time.sleep(60)
    elif mode == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "exit137":
        sys.exit(137)
    elif mode == "env":
        print("CVD=" + repr(os.environ["CUDA_VISIBLE_DEVICES"]), "gpus=" + repr(sys.argv[5]))
    elif mode == "tree":
        if sys.argv[5] == "ignore-term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with open(os.path.join(out_dir, "pids.json"), "w") as f:
            json.dump({"self": os.getpid(), "child": child.pid}, f)
        time.sleep(60)
""")


@pytest.fixture
def job(tmp_path) -> dict[str, str]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return {"script": str(script), "counter": str(tmp_path / "counter.txt")}


def cmd(job: dict[str, str], mode: str, *extra: str) -> list[str]:
    return ["{python}", job["script"], mode, "{out_dir}", "{name}", job["counter"], *extra]


def write_yaml(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def runner_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "run-experiments", *args]


def max_concurrency(records: list[dict]) -> int:
    events = sorted([(r["start_epoch"], 1) for r in records] + [(r["end_epoch"], -1) for r in records],
                    key=lambda e: (e[0], e[1]))  # an end and a start at the same instant do not overlap
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def load_results(out: Path) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads((out / "results.json").read_text())["experiments"]}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --- spec ------------------------------------------------------------------------------------------

def test_grid_names_are_stable_and_errors_name_the_entry(tmp_path):
    spec = {"experiments": [{"name": "sweep_b{branch_counts}_n{noise_scale}",
                             "command": "{python} sample.py --branches {branch_counts} --noise {noise_scale}",
                             "grid": {"branch_counts": [2, 4, 8], "noise_scale": [0.1, 0.3]}}]}
    path = write_yaml(tmp_path / "e.yaml", spec)
    golden = ["sweep_b2_n0.1", "sweep_b2_n0.3", "sweep_b4_n0.1", "sweep_b4_n0.3", "sweep_b8_n0.1", "sweep_b8_n0.3"]
    assert [e.name for e in load_experiments(path)] == golden
    assert [e.name for e in load_experiments(path)] == golden  # same order on every call
    exp = load_experiments(path)[3]
    assert exp.grid == {"branch_counts": 4, "noise_scale": 0.3}
    assert exp.argv("/o/x")[1:] == ["sample.py", "--branches", "4", "--noise", "0.3"]
    assert expand_grid({"a": [1, 2], "b": ["x"]}) == [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}]
    assert expand_grid(None) == [{}]

    def error(data: dict) -> str:
        with pytest.raises(ExperimentsError) as err:
            parse_experiments(data, "e.yaml")
        return str(err.value)

    msg = error({"experiments": [{"name": "same", "command": "true", "grid": {"x": [1, 2]}}]})
    assert "duplicate" in msg and "same" in msg
    msg = error({"experiments": [{"name": "a", "command": "true"}, {"name": "b", "comand": "true"}]})
    assert "'comand'" in msg and "experiments[1]" in msg and "'b'" in msg
    assert "'retries'" in error({"defaults": {"retries": 2}, "experiments": [{"name": "a", "command": "true"}]})
    assert "{lr}" in error({"experiments": [{"name": "a", "command": "train --lr {lr}"}]})
    assert "not a safe folder name" in error({"experiments": [{"name": "a/{x}", "command": "true",
                                                                "grid": {"x": [1]}}]})
    assert "not found" in error({"experiments": [{"name": "a", "config": str(tmp_path / "missing.yaml")}]})
    assert "run.output_dir" in error({"experiments": [{"name": "a", "config": TINY,
                                                        "overrides": ["run.output_dir=/x"]}]})
    assert "exactly one" in error({"experiments": [{"name": "a", "config": TINY, "command": "true"}]})


def test_config_experiment_command_lines(tmp_path):
    data = {"defaults": {"timeout": "2m", "gpus_per_experiment": 2},
            "experiments": [{"name": "lr{optim.lr}_s{seed}", "config": TINY,
                             "overrides": {"train.max_steps": 5, "run.seed": "{seed}"},
                             "grid": {"optim.lr": [0.01], "seed": [3]}},
                            {"name": "one", "config": TINY, "gpus_per_experiment": 1, "timeout": 7}]}
    multi, single = parse_experiments(data, cli_defaults={"timeout": 30})
    assert (multi.timeout, single.timeout) == (30.0, 7.0)  # entry > command line > file defaults
    assert multi.overrides == ["train.max_steps=5", "run.seed={seed}", "optim.lr=0.01"]
    port = free_port()
    argv = multi.argv(tmp_path / multi.name, [0, 1], port)
    assert argv[1:3] == ["-m", "accelerate.commands.launch"]
    assert argv[argv.index("--num_processes") + 1] == "2"
    assert argv[argv.index("--main_process_port") + 1] == str(port) and port > 0
    assert argv[argv.index("-m", 3):][:3] == ["-m", "trainer", "train"]
    assert "run.seed=3" in argv and "run.resume=none" in argv
    assert argv[-1] == f"run.output_dir={tmp_path / 'lr0.01_s3'}"
    assert "run.resume=none" not in single.argv(tmp_path, fresh=False)
    assert single.argv(tmp_path)[:4] == [sys.executable, "-m", "trainer", "train"]
    with pytest.raises(ExperimentsError, match="needs 2 CPU slots"):
        run_experiments([multi], tmp_path / "out", slots=1, stream=None)


# --- the local runner -----------------------------------------------------------------------------

def test_two_slots_failures_timeout_and_resume(tmp_path, job):
    spec = {"defaults": {"timeout": 30},
            "experiments": [{"name": "ok_{i}", "command": cmd(job, "ok", "{i}"), "grid": {"i": [1, 2, 3, 4]}},
                            {"name": "crash", "command": cmd(job, "crash")},
                            {"name": "slow", "command": cmd(job, "hang"), "timeout": 1.5}]}
    path = write_yaml(tmp_path / "exp.yaml", spec)
    out = tmp_path / "out"
    proc = subprocess.run(runner_cmd(path, "--slots", "2", "--out", str(out), "--grace", "2"),
                          env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    results = load_results(out)
    assert list(results) == ["ok_1", "ok_2", "ok_3", "ok_4", "crash", "slow"]
    statuses = {name: r["status"] for name, r in results.items()}
    assert statuses == {"ok_1": "completed", "ok_2": "completed", "ok_3": "completed", "ok_4": "completed",
                        "crash": "failed", "slow": "timeout"}
    assert "ValueError: boom in crash" in results["crash"]["log_tail"]
    assert results["crash"]["exit_code"] == 1
    assert results["slow"]["signal"] == "SIGTERM" and 1.4 < results["slow"]["runtime_s"] < 10
    ok = results["ok_3"]
    assert ok["metrics"]["loss"] == 1.5 and ok["metrics"]["step"] == 2  # last value of each key
    assert ok["final_eval"] == {"step": 2, "eval/loss": 0.75}
    assert ok["grid"] == {"i": 3} and ok["gpus"] == [] and ok["peak_rss_mib"] > 1
    assert ok["log_tail"] is None and Path(ok["log"]).is_file()
    assert json.loads((out / "ok_3" / "result.json").read_text())["status"] == "completed"

    records = list(results.values())
    assert max_concurrency(records) == 2  # two at once, never more
    for slot in (0, 1):  # a slot runs one experiment at a time
        on_slot = sorted((r for r in records if r["slots"] == [slot]), key=lambda r: r["start_epoch"])
        assert on_slot and all(a["end_epoch"] <= b["start_epoch"] for a, b in zip(on_slot, on_slot[1:]))
    summary = (out / "summary.csv").read_text().splitlines()
    assert summary[0].startswith("name,status,") and len(summary) == 7 and "eval/loss" in summary[0]
    assert sorted(Path(job["counter"]).read_text().split()) == sorted(results)

    proc = subprocess.run(runner_cmd(path, "--slots", "2", "--out", str(out), "--grace", "2", "--resume"),
                          env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "4 already completed" in proc.stdout
    again = load_results(out)
    assert Path(job["counter"]).read_text().split()[6:] in (["crash", "slow"], ["slow", "crash"])
    for name in ("ok_1", "ok_2", "ok_3", "ok_4"):
        assert again[name]["start_epoch"] == results[name]["start_epoch"]
    assert again["crash"]["start_epoch"] > results["slow"]["end_epoch"]
    assert again["crash"]["attempt"] == 2 and again["slow"]["status"] == "timeout"
    assert (out / "crash" / "log.txt").read_text().count("# run-experiments attempt") == 2


def test_signals_and_launch_errors_are_isolated(tmp_path, job):
    spec = {"experiments": [{"name": "segv", "command": cmd(job, "segv")},
                            {"name": "killed", "command": cmd(job, "sigkill")},
                            {"name": "oom137", "command": cmd(job, "exit137")},
                            {"name": "no_such_binary", "command": "/nonexistent/bin/tool --x"},
                            {"name": "env", "command": cmd(job, "env", "[{gpus}]")}]}
    out = tmp_path / "out"
    status, records = run_experiments(parse_experiments(spec), out, slots=2, stream=None)
    assert status == 1
    by_name = {r["name"]: r for r in records}
    assert [by_name[n]["status"] for n in ("segv", "killed", "oom137", "no_such_binary", "env")] == \
        ["failed", "failed", "failed", "failed", "completed"]
    assert (by_name["segv"]["exit_code"], by_name["segv"]["signal"]) == (-11, "SIGSEGV")
    assert (by_name["killed"]["exit_code"], by_name["killed"]["signal"]) == (-9, "SIGKILL")
    assert "out-of-memory" in by_name["killed"]["error"]
    assert (by_name["oom137"]["exit_code"], by_name["oom137"]["signal"]) == (137, "SIGKILL")
    assert "could not start" in by_name["no_such_binary"]["error"]
    assert "CVD='' gpus='[]'" in (out / "env" / "log.txt").read_text()  # CPU slot: no GPUs visible
    assert load_results(out)["segv"]["status"] == "failed"


def test_ctrl_c_stops_every_process_and_records_interrupted(tmp_path, job):
    spec = {"experiments": [{"name": "polite", "command": cmd(job, "tree", "-")},
                            {"name": "stubborn", "command": cmd(job, "tree", "ignore-term")},
                            {"name": "waiting", "command": cmd(job, "tree", "-")}]}
    path = write_yaml(tmp_path / "exp.yaml", spec)
    out = tmp_path / "out"
    runner = subprocess.Popen(runner_cmd(path, "--slots", "2", "--out", str(out), "--grace", "1"), env=child_env(),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid_files = [out / "polite" / "pids.json", out / "stubborn" / "pids.json"]
    pids: list[int] = []
    try:
        deadline = time.time() + 40
        while not all(p.is_file() and p.stat().st_size for p in pid_files):
            assert runner.poll() is None and time.time() < deadline, "experiments did not start"
            time.sleep(0.1)
        pids = [pid for p in pid_files for pid in json.loads(p.read_text()).values()]
        runner.send_signal(signal.SIGINT)
        output, _ = runner.communicate(timeout=30)
        assert runner.returncode == 130, output
        results = load_results(out)
        assert [results[n]["status"] for n in ("polite", "stubborn", "waiting")] == \
            ["interrupted", "interrupted", "pending"]
        assert results["stubborn"]["exit_code"] == -9  # ignored SIGTERM, got SIGKILL after the grace period
        assert results["polite"]["pid"] in pids and results["stubborn"]["pid"] in pids
        time.sleep(0.2)
        assert all(gone(pid) for pid in pids), [pid for pid in pids if not gone(pid)]
        assert not (out / "waiting" / "log.txt").exists()
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        for pid in pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_cleanup_reaches_setsid_descendants_and_records_them(tmp_path):
    # "hangs": one setsid child stays in the tree, one double-forks out of it at once; both would outlive
    # their shell. "leaves": exits 0 and leaves a setsid daemon behind. Each grandchild writes its pid
    # after setsid, and the shells wait for that, so the runner meets them outside the process group.
    grandchild = "setsid bash -c 'echo $$ > {out_dir}/%s.pid; exec sleep %d'"
    ready = "until [ -s {out_dir}/%s.pid ]; do sleep 0.05; done; "
    hangs = (f"{grandchild % ('child', 300)} & ({grandchild % ('escaped', 301)} &); "
             f"{ready % 'child'}{ready % 'escaped'}wait")
    leaves = f"({grandchild % ('escaped', 302)} &); {ready % 'escaped'}"
    spec = {"experiments": [{"name": "hangs", "command": ["bash", "-c", hangs], "timeout": 3},
                            {"name": "leaves", "command": ["bash", "-c", leaves]}]}
    out = tmp_path / "out"
    pid_files = [out / "hangs" / "child.pid", out / "hangs" / "escaped.pid", out / "leaves" / "escaped.pid"]
    try:
        status, _ = run_experiments(parse_experiments(spec), out, slots=2, grace=1, stream=None)
        assert status == 1
        pids = [int(p.read_text()) for p in pid_files]
        assert all(gone(pid) for pid in pids), [pid for pid in pids if not gone(pid)]
        by_name = load_results(out)
        assert [by_name[n]["status"] for n in ("hangs", "leaves")] == ["timeout", "completed"]
        killed = {n: {k["pid"]: k for k in by_name[n]["killed_processes"]} for n in ("hangs", "leaves")}
        for name, pid in (("hangs", pids[0]), ("hangs", pids[1]), ("leaves", pids[2])):
            assert killed[name][pid]["outside_group"], killed
        assert "sleep 300" in killed["hangs"][pids[0]]["command"]
        assert killed["hangs"][by_name["hangs"]["pid"]]["signal"] == "SIGTERM"  # the shell, through its group
        assert killed["leaves"][pids[2]]["signal"] == "SIGKILL" and str(pids[2]) in by_name["leaves"]["error"]
    finally:
        for pid_file in pid_files:
            if pid_file.is_file() and pid_file.read_text().strip() and not gone(pid := int(pid_file.read_text())):
                os.kill(pid, signal.SIGKILL)


def test_config_experiments_run_the_trainer(tmp_path):
    spec = {"experiments": [{"name": "tiny_lr{optim.lr}", "config": TINY,
                             "overrides": ["train.max_steps=5", "eval.every_steps=5", "ckpt.every_steps=0",
                                           "log.progress_bar=false", "log.tensorboard=false"],
                             "grid": {"optim.lr": [0.01, 0.003]}}]}
    out = tmp_path / "out"
    status, records = run_experiments(parse_experiments(spec), out, slots=2, stream=None)
    assert status == 0, [r["log_tail"] for r in records]
    assert [r["name"] for r in records] == ["tiny_lr0.01", "tiny_lr0.003"]
    for record in records:
        run_dir = out / record["name"]
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert record["final_eval"] == [r for r in lines if "eval/loss" in r][-1]
        assert record["metrics"]["step"] == 5 and record["metrics"]["loss"] == [r for r in lines if "loss" in r][-1]["loss"]
        assert f"run.output_dir={run_dir}" in record["command"]
        assert f"optim.lr={record['grid']['optim.lr']}" in record["command"]
        assert (run_dir / "config.yaml").is_file()
    assert records[0]["final_eval"]["eval/loss"] != records[1]["final_eval"]["eval/loss"]


# --- SLURM through submitit ---------------------------------------------------------------------------

def test_slurm_submission_is_one_array_job(tmp_path, job, monkeypatch):
    pytest.importorskip("submitit")
    from trainer.cli import main

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    copy = tmp_path / "submitted.sh"
    (fake_bin / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {copy}\necho "Submitted batch job 4242"\n')
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("sbatch", "srun"):
        (fake_bin / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    spec = {"defaults": {"gpus_per_experiment": 2},
            "experiments": [{"name": "b{b}", "command": cmd(job, "ok", "{b}"), "grid": {"b": [1, 2, 3]}}]}
    path = write_yaml(tmp_path / "sweep.yaml", spec)
    out = tmp_path / "out"
    assert main(["run-experiments", path, "--out", str(out), "--slurm", "--slurm-partition", "debug",
                 "--slurm-time", "1:30:00", "--slurm-array-parallelism", "2", "--slurm-mem", "16G",
                 "--slurm-setup", "module load cuda"]) == 0
    script = copy.read_text()
    for line in ("#SBATCH --array=0-2%2", "#SBATCH --partition=debug", "#SBATCH --time=90",
                 "#SBATCH --gpus-per-task=2", "#SBATCH --job-name=sweep", "#SBATCH --mem=16G", "module load cuda"):
        assert line in script, line
    results = load_results(out)
    assert [r["status"] for r in results.values()] == ["pending"] * 3
    assert [r["slurm_job_id"] for r in results.values()] == ["4242_0", "4242_1", "4242_2"]


def test_slurm_array_tasks_run_locally_and_collect(tmp_path, job):
    pytest.importorskip("submitit")
    from trainer.cli import main

    spec = {"experiments": [{"name": "ok_{i}", "command": cmd(job, "ok", "{i}"), "grid": {"i": [1, 2]}},
                            {"name": "crash", "command": cmd(job, "crash")}]}
    path = write_yaml(tmp_path / "exp.yaml", spec)
    out = tmp_path / "out"
    assert main(["run-experiments", path, "--out", str(out), "--slurm", "--slurm-executor", "local"]) == 0
    deadline = time.time() + 45
    names = ["ok_1", "ok_2", "crash"]

    def finished(name: str) -> bool:
        record_file = out / name / "result.json"
        return record_file.is_file() and json.loads(record_file.read_text())["status"] not in ("pending", "running")

    while not all(finished(n) for n in names):
        assert time.time() < deadline, "array tasks did not finish"
        time.sleep(0.2)
    assert main(["run-experiments", path, "--out", str(out), "--collect"]) == 1
    results = load_results(out)
    assert [results[n]["status"] for n in names] == ["completed", "completed", "failed"]
    assert results["ok_2"]["final_eval"]["eval/loss"] == 0.5 and results["ok_1"]["slurm_job_id"]
    assert "ValueError: boom in crash" in results["crash"]["log_tail"]
    assert (out / "summary.csv").read_text().count("\n") == 4

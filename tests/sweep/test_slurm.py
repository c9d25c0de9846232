"""scripts/slurm/train.sbatch on a fake two-node SLURM (srun/scontrol stand-ins, one host):
machine ranks and main address reach the launchers, the time-limit signal gives a checkpoint on
every rank and a requeue, and the requeued job resumes."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, ROOT, TINY, child_env, read_jsonl

from trainer.core.checkpoint import latest_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def wait_for(predicate, proc: subprocess.Popen, timeout: float) -> None:
    # Local rather than imported from tests/core: `pytest tests/sweep` alone must collect.
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"process ended early with {proc.returncode}: {proc.stdout.read()[-3000:]}")
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def job_id_with_free_port() -> int:
    """A job id whose derived port (20000 + id % 20000, as in the script) is free here."""
    for _ in range(100):
        job_id = random.randint(1000, 10**6)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 20000 + job_id % 20000))
                return job_id
            except OSError:
                continue
    raise RuntimeError("no free port")


def sbatch_env(tmp_path, run_dir):
    env = child_env()
    env.update(PATH=f"{Path(__file__).parent / 'fake_slurm'}:{BIN}:{env['PATH']}", SLURM_JOB_NAME="t",
               SLURM_JOB_ID=str(job_id_with_free_port()), SLURM_NNODES="2",
               SLURM_GPUS_ON_NODE="1", SLURM_JOB_NODELIST="node[1-2]", RUN_DIR=str(run_dir),
               FAKE_SLURM_REQUEUE=str(tmp_path / "requeued"))
    return env


def test_sbatch_time_limit_checkpoints_requeues_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    env = sbatch_env(tmp_path, run_dir)
    args = ["bash", str(ROOT / "scripts" / "slurm" / "train.sbatch"), TINY, "train.max_steps=400",
            "task.delay_s=0.02", "train.per_device_batch_size=8", "log.every_steps=1", "log.progress_bar=false",
            "log.tensorboard=false", "ckpt.every_steps=1000"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and metrics.read_text().count('"loss"') >= 3, proc, timeout=240)
    start = next(r for r in read_jsonl(run_dir) if r.get("event") == "start")
    assert start["world_size"] == 2  # two "nodes", one process each, one process group
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 does before the time limit
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-4000:]
    marker = json.loads((run_dir / "preempted.json").read_text())
    assert latest_checkpoint(run_dir / "checkpoints").name == f"step_{marker['step']:08d}"
    assert (tmp_path / "requeued").read_text().strip() == env["SLURM_JOB_ID"]
    assert "requeueing" in out

    # The requeued job: same script, same job id, resumes and finishes.
    args[args.index("train.max_steps=400")] = f"train.max_steps={marker['step'] + 2}"
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert not (run_dir / "preempted.json").exists()
    assert max(r["step"] for r in read_jsonl(run_dir) if "loss" in r) == marker["step"] + 2


@pytest.mark.extended
def test_sbatch_elastic_mode_goes_on_without_a_lost_node(tmp_path):
    """ELASTIC=1: one agent per "node" around the batch step's store; one node's task tree killed mid-run, the
    other finishes at world size 1 and the job ends well, with no requeue."""
    import psutil

    run_dir = tmp_path / "run"
    env = {**sbatch_env(tmp_path, run_dir), "ELASTIC": "1"}
    args = ["bash", str(ROOT / "scripts" / "slurm" / "train.sbatch"), TINY, "train.max_steps=30", "task.delay_s=0.05",
            "train.global_batch_size=32", "train.per_device_batch_size=16", "ckpt.every_steps=1", "log.every_steps=1",
            "log.progress_bar=false", "log.tensorboard=false", "eval.every_steps=0"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    progress = run_dir / "elastic.json"

    def at_world_two() -> bool:
        try:
            state = json.loads(progress.read_text())
        except (OSError, ValueError):
            return False
        return state.get("world_size") == 2 and state.get("step", 0) >= 3
    try:
        wait_for(at_world_two, proc, timeout=240)
        srun = next(p for p in psutil.Process(proc.pid).children() if "srun" in " ".join(p.cmdline()))
        node = srun.children()[-1]  # the second node's task: its agent, worker and all
        for p in [node, *node.children(recursive=True)]:
            p.kill()
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "membership changed: 2 -> 1 nodes" in out and "the run completed" in out, out[-4000:]
    assert not (tmp_path / "requeued").exists()

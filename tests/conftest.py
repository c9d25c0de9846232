"""Shared helpers: run the real launchers in subprocesses, reset accelerate's singletons."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# One OpenMP thread in the test process too (subprocesses get it from child_env): the tests' models are tiny,
# and on a loaded 2-core machine a second thread spin-waits for a busy core (an eval batch measured 10x slower).
# Set before any test module imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TRAIN = str(ROOT / "scripts" / "train.py")
TINY = str(ROOT / "configs" / "regression" / "tiny.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_cmd(cmd: list[str], timeout: float = 300, expect: int | None = 0, cwd: Path = ROOT,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a launcher command; on an unexpected exit show the output's tail."""
    proc = subprocess.run(cmd, cwd=cwd, env=env or child_env(), capture_output=True, text=True, timeout=timeout)
    if expect is not None and proc.returncode != expect:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode} (expected {expect}):\n{tail}")
    return proc


def accelerate_cmd(config: str, *args: str, nproc: int | None = None) -> list[str]:
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / config),
           "--main_process_port", str(free_port())]
    if nproc is not None:
        cmd += ["--num_processes", str(nproc)]
    return cmd + [TRAIN, *args]


def read_jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir) if "loss" in r}


def reset_accelerate() -> None:
    """Forget accelerate's process-global singletons, so the next in-process Trainer builds them afresh."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture
def fresh_accelerate():
    """In-process Trainers share accelerate's global state; reset it after each test."""
    yield
    reset_accelerate()

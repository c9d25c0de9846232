"""Data caches built once per job: a file lock in the cache folder, not a collective (trainer/data/build_lock.py).

Processes that build at once build once and all get the data; a builder that dies lets the next one build; a
build that outlasts run.collective_timeout_s does not fail a 2-process run (it waited in a barrier before).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BIN, TINY, TRAIN, child_env

from trainer.data import build_lock

WORKER = """
import logging, sys, time
from pathlib import Path
from trainer.data import build_lock
logging.basicConfig(level=logging.INFO, filename=sys.argv[4], format="%(message)s")
build_lock.LOG_EVERY_S = 0.2
lock, folder, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
cache = folder / "cache.txt"
with build_lock.build_once(lock, key="k", what="the test cache") as held:
    assert held
    if cache.exists():
        action = "load"
    else:
        (folder / f"building-{mode}").touch()
        if mode == "crash":
            time.sleep(600)  # killed here, holding the lock
        # Give another process the time to reach the same point (it does only without the lock): bounded.
        deadline = time.monotonic() + 1.5
        while len(list(folder.glob("building-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        cache.write_text("the data")
        action = "build"
with open(folder / "actions.txt", "a") as f:
    f.write(action + "\\n")
print(cache.read_text())
"""


def start(tmp_path: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "locks" / ".build.lock"), str(tmp_path), mode,
                             str(tmp_path / f"log-{mode}.txt")], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, text: str = "", within: float = 60) -> None:
    deadline = time.monotonic() + within
    while not (path.is_file() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{path} never showed {text!r}"
        time.sleep(0.05)


def test_two_processes_build_once_and_both_get_the_data(tmp_path):
    procs = [start(tmp_path, "a"), start(tmp_path, "b")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [out for out, _ in outs] == ["the data\n", "the data\n"]
    assert sorted((tmp_path / "actions.txt").read_text().split()) == ["build", "load"]


def test_a_builder_that_dies_lets_the_next_one_build(tmp_path):
    crash = start(tmp_path, "crash")
    try:
        wait_for(tmp_path / "building-crash")
        waiter = start(tmp_path, "b")
        wait_for(tmp_path / "log-b.txt", f":{crash.pid} to build the test cache")  # it says whom it waits for
        crash.send_signal(signal.SIGKILL)
        out, err = waiter.communicate(timeout=120)
    finally:
        crash.kill()
        crash.wait()
    assert waiter.returncode == 0, err
    assert out == "the data\n" and (tmp_path / "actions.txt").read_text().split() == ["build"]


def test_no_lock_support_uses_the_fallback(tmp_path, monkeypatch):
    def refuse(fd, mode):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(build_lock.fcntl, "flock", refuse)
    entered = []

    @contextlib.contextmanager
    def fallback():
        entered.append(True)
        yield

    with build_lock.build_once(tmp_path / ".build.lock", key="k", fallback=fallback) as held:
        assert entered == [True]
    assert held is False


def test_a_task_without_cache_dir_locks_in_the_folder_its_caches_go_to(tmp_path, monkeypatch):
    """The families' default caches go to the `datasets` cache (arrow_cache.cache_root): the lock must span the same
    nodes, not a folder of its own under the home directory."""
    import datasets.config

    from trainer.data.arrow_cache import cache_root

    monkeypatch.delenv("TRAINER_CACHE_DIR", raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    task = type("TaskCfg", (), {"name": "protein_sedd", "cache_dir": ""})()
    assert build_lock.task_lock_path(task).parent == cache_root(None, "protein_sedd").parent
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path / "own"))
    assert build_lock.task_lock_path(task).parent == tmp_path / "own"


def test_without_lock_support_every_process_builds_without_a_collective(tmp_path, monkeypatch):
    """The trainer passes no fallback: a barrier entered by the ranks whose lock failed, and not by the others,
    would pair with an unrelated collective."""
    import inspect

    import trainer.core.trainer

    monkeypatch.setattr(build_lock.fcntl, "flock", lambda fd, mode: (_ for _ in ()).throw(OSError(errno.ENOLCK, "no")))
    with build_lock.build_once(tmp_path / ".build.lock", key="k") as held:
        assert held is False
    source = inspect.getsource(trainer.core.trainer)
    assert "task_build_once(" in source and "main_process_first" not in source


SLOW_BUILD = """
import sys, time
from pathlib import Path
from trainer.families.regression.task import RegressionTask
from trainer.cli import main

build = RegressionTask.build_data


def slow_build(self):  # the first to build takes longer than the collective timeout; later loads are quick
    built = Path(sys.argv[1])
    if not built.exists():
        time.sleep(20)
        built.touch()
    return build(self)


RegressionTask.build_data = slow_build
sys.exit(main(["train", *sys.argv[2:]]))
"""


@pytest.mark.distributed
def test_a_build_longer_than_the_collective_timeout_does_not_fail(tmp_path):
    script = tmp_path / "slow_train.py"
    script.write_text(SLOW_BUILD)
    env = {**child_env(), "TRAINER_CACHE_DIR": str(tmp_path / "cache")}  # the lock folder of a task without cache_dir
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path / "built"), TINY,
           "train.max_steps=2", "train.per_device_batch_size=4", "eval.every_steps=0", "ckpt.every_steps=0",
           "log.tensorboard=false", "log.progress_bar=false",
           # above the ranks' skew on a loaded machine (DDP's first collective), well below the slow build's sleep
           "run.collective_timeout_s=8", f"run.output_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=Path(TRAIN).parents[1])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (tmp_path / "built").exists() and (tmp_path / "cache" / ".build-regression.lock").exists()
    assert os.path.isdir(tmp_path / "run")

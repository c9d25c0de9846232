"""Failures that must be one clear error, never a hang, a silent pass or a traceback: an unrestorable RNG state,
a kill while a save is finalised, data without one batch, an unwritable run or checkpoint directory,
a SIGTERM that no step boundary answers, DeepSpeed's warning in plain runs, the run lock after fit."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BIN, ROOT, TINY, TRAIN, accelerate_cmd, child_env, reset_accelerate, run_cmd

from trainer.config import ConfigError, load_config
from trainer.core.checkpoint import store as ckpt
from trainer.core.trainer import Trainer
from trainer.errors import CheckpointError, DataError

pytestmark = pytest.mark.usefixtures("fresh_accelerate")

QUIET = ["log.progress_bar=false", "log.tensorboard=false"]
LIVENESS_S = 120  # generous: each case below ends within seconds


def make(out: Path, *overrides: str) -> Trainer:
    return Trainer(load_config(None, ["task.preset=tiny", f"run.output_dir={out}", *QUIET, *overrides]))


def test_unrestorable_rng_state_is_an_error_unless_allowed(tmp_path, caplog):
    make(tmp_path, "train.max_steps=2").fit()
    step = tmp_path / "checkpoints" / "step_00000002"
    rng = step / "random_states_0.pkl"
    rng.write_bytes(rng.read_bytes()[:40])  # truncated, and the manifest re-signed: only loading can tell
    ckpt.write_manifest(step, json.loads((step / ckpt.STATE).read_text()), with_hashes=True)
    reset_accelerate()
    with pytest.raises(CheckpointError, match=r"step_00000002: random_states_0.pkl \(rank 0's RNG state\) cannot "
                                              r"be restored .*run.allow_inexact_resume"):
        make(tmp_path, "train.max_steps=4")
    reset_accelerate()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        trainer = make(tmp_path, "train.max_steps=4", "run.allow_inexact_resume=true")
    assert trainer.state.step == 2
    assert any("INEXACT RESUME" in r.getMessage() and "random_states_0.pkl" in r.getMessage() for r in caplog.records)
    assert trainer.fit() == "completed" and trainer.state.step == 4


def test_resume_recovers_from_a_kill_during_finalisation(tmp_path):
    make(tmp_path, "train.max_steps=4", "ckpt.every_steps=2", "eval.every_steps=2", "ckpt.keep_last=5").fit()
    root = tmp_path / "checkpoints"
    best_step = json.loads((root / "step_00000004" / ckpt.STATE).read_text())["best_step"]
    # As a kill after step_4's rename leaves the directory: latest one behind, the best pointer not yet moved
    # (here: missing), a half-replaced directory aside.
    (root / "latest").write_text("step_00000002\n")
    (root / "best").unlink()
    (root / ".old-step_00000004").mkdir()
    assert ckpt.latest_checkpoint(root) == root / "step_00000004"
    assert ckpt.best_checkpoint(root) == root / f"step_{best_step:08d}"
    reset_accelerate()
    trainer = make(tmp_path, "train.max_steps=6", "ckpt.every_steps=2", "eval.every_steps=2", "ckpt.keep_last=5")
    assert trainer.state.step == 4 and trainer.state.best_step == best_step
    assert (root / "latest").read_text().strip() == "step_00000004"
    assert (root / "best").read_text().strip() == f"step_{best_step:08d}"
    trainer.fit()
    assert (root / "latest").read_text().strip() == "step_00000006"
    assert not (root / ".old-step_00000004").exists()


def test_map_style_data_smaller_than_one_global_batch(tmp_path):
    with pytest.raises(DataError, match=r"task 'regression', split train: 6 samples, fewer than one global "
                                        r"batch of 8 \(8 per device x 1 accumulation x 1 processes\)"):
        make(tmp_path, "task.num_train=6")


def test_unwritable_output_dir_is_one_config_error_before_data_and_model(tmp_path, monkeypatch, capsys):
    from trainer import cli

    parent = tmp_path / "readonly"
    parent.mkdir()
    parent.chmod(0o555)
    if os.access(parent, os.W_OK):  # root ignores the mode: make creating the run directory fail instead
        real_mkdir = Path.mkdir

        def mkdir(self, *args, **kwargs):
            if parent in Path(self).absolute().parents:
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", mkdir)

    def no_data(*args, **kwargs):
        raise AssertionError("the task was built before the output directory was claimed")

    monkeypatch.setattr("trainer.core.trainer.get_task", no_data)
    try:
        code = cli.main(["train", TINY, f"run.output_dir={parent / 'run'}", *QUIET])
        reset_accelerate()
        with pytest.raises(ConfigError):  # the type, for API users
            make(parent / "run")
    finally:
        parent.chmod(0o755)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(f"trainer: config error: run.output_dir {parent / 'run'} cannot be written (")
    assert "Traceback" not in "\n".join(err)


def test_failed_save_names_the_path_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = make(tmp_path, "train.max_steps=4", "ckpt.every_steps=2")
    root = tmp_path / "checkpoints"
    real_write = ckpt.write_manifest

    def full_disk(ckpt_dir, state, with_hashes):
        if ckpt_dir.name == ".tmp-step_00000004":
            raise OSError(errno.ENOSPC, "No space left on device", str(ckpt_dir / ckpt.STATE))
        return real_write(ckpt_dir, state, with_hashes)

    monkeypatch.setattr(ckpt, "write_manifest", full_disk)
    with pytest.raises(CheckpointError) as raised:
        trainer.fit()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("could not save checkpoint step_00000004 (rank 0: ")
    assert f"no space left on device writing {root / '.tmp-step_00000004' / ckpt.STATE} (" in message
    assert message.endswith(f"the previous checkpoint {root / 'step_00000002'} is intact")
    assert not (root / ".tmp-step_00000004").exists()
    assert (root / "latest").read_text().strip() == "step_00000002"
    ckpt.verify_checkpoint(root / "step_00000002")


def test_run_lock_is_released_when_fit_returns(tmp_path):
    trainer = make(tmp_path, "train.max_steps=1")
    take = "import sys; from trainer.core.run_lock import acquire_run_lock; acquire_run_lock(sys.argv[1])"
    assert subprocess.run([sys.executable, "-c", take, str(tmp_path)], env=child_env()).returncode != 0
    trainer.fit()
    run_cmd([sys.executable, "-c", take, str(tmp_path)], timeout=LIVENESS_S)  # another process may start here


def test_preemption_without_a_step_boundary_exits_after_the_grace_period(tmp_path):
    """A rank that never reaches a step boundary (here: a busy loop) still ends after SIGTERM."""
    stuck = ("import os, signal\nfrom trainer.core.preemption import PreemptionWatcher\n"
             "watcher = PreemptionWatcher(1, grace_s=1.0)\nos.kill(os.getpid(), signal.SIGTERM)\nwhile True: pass\n")
    proc = subprocess.run([sys.executable, "-c", stuck], env=child_env(), capture_output=True, text=True,
                          timeout=LIVENESS_S)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "SIGTERM received, but no step ended within 1 s" in proc.stderr


@pytest.mark.slow
def test_plain_runs_do_not_import_deepspeed(tmp_path):
    out = tmp_path / "run"
    cmd = [str(BIN / "python"), TRAIN, TINY, f"run.output_dir={out}", *QUIET, "train.max_steps=2"]
    first = run_cmd(cmd, timeout=LIVENESS_S)
    resumed = run_cmd([*cmd[:-1], "train.max_steps=3"], timeout=LIVENESS_S)  # EMA, resume and save
    assert "resumed from" in resumed.stdout + resumed.stderr
    for proc in (first, resumed):
        assert "Setting accelerator to CPU" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_stream_without_a_full_batch_fails_at_once(tmp_path):
    proc = run_cmd([str(BIN / "python"), TRAIN, TINY, f"run.output_dir={tmp_path}", *QUIET, "task.streaming=true",
                    "task.num_train=6"], timeout=LIVENESS_S, expect=2)
    assert proc.stderr.strip().splitlines()[-1] == (
        "trainer: error: task 'regression', split train: the training stream gave 6 samples in epoch 0, fewer than "
        "one global batch of 16 (8 per device x 2 accumulation x 1 processes); lower train.per_device_batch_size or "
        "give more data")


@pytest.mark.slow
@pytest.mark.distributed
def test_stream_without_a_full_global_batch_stops_both_ranks(tmp_path):
    """20 samples, 10 a rank (more than a batch of 8 each), but fewer than one global batch of 32: every rank
    reads the same epoch and stops at once, none waits for the other."""
    proc = run_cmd(accelerate_cmd("ddp.yaml", TINY, f"run.output_dir={tmp_path}", *QUIET, "task.streaming=true",
                                  "task.num_train=20", "train.per_device_batch_size=8", nproc=2),
                   timeout=LIVENESS_S * 2, expect=None)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert ("the training stream gave 20 samples in epoch 0, fewer than one global batch of 32 (8 per device x 2 "
            "accumulation x 2 processes)") in output


@pytest.mark.slow
def test_second_sigterm_stops_a_slow_step_at_once(tmp_path):
    out = tmp_path / "run"
    log = tmp_path / "output.txt"
    cmd = [str(BIN / "python"), TRAIN, TINY, f"run.output_dir={out}", "log.tensorboard=false",
           "log.progress_bar=true", "task.delay_s=60", "train.max_steps=3"]
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for_text(log, "train:   0%", proc)  # the progress bar starts after the signal handlers are in place
        proc.send_signal(signal.SIGTERM)
        wait_for_text(log, "SIGTERM received: stopping after the current step", proc)
        time.sleep(3)  # more than DUPLICATE_SIGNAL_S: a second request, not the first delivered twice
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=LIVENESS_S) == 128 + signal.SIGTERM  # the step alone would take 120 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "second SIGTERM received before the step ended; exiting with status 143 without a checkpoint" in \
        log.read_text()
    assert not (out / "preempted.json").exists()


def wait_for_text(path: Path, text: str, proc: subprocess.Popen) -> None:
    deadline = time.time() + LIVENESS_S
    while time.time() < deadline:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"ended with {proc.returncode} before {text!r}: {path.read_text()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} within {LIVENESS_S} s: {path.read_text()[-3000:]}")


def test_resume_keeps_the_checkpoints_task_statistics(tmp_path, caplog):
    """The weights were trained with the checkpoint's statistics (e.g. target mean/std): a resume on data
    whose statistics changed keeps those, with a warning, instead of silently mixing the two."""
    make(tmp_path, "train.max_steps=2").fit()
    reset_accelerate()
    step = ckpt.latest_checkpoint(tmp_path / "checkpoints")
    (step / ckpt.TASK_STATS).write_text(json.dumps({"target_mean": [1.5]}))
    ckpt.write_manifest(step, json.loads((step / ckpt.STATE).read_text()), with_hashes=True)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        resumed = make(tmp_path, "train.max_steps=3")
    assert resumed.task.stats == {"target_mean": [1.5]}
    assert "keeps the checkpoint's" in caplog.text


def test_resuming_with_changed_task_settings_warns_loudly(tmp_path, caplog):
    make(tmp_path, "train.max_steps=2").fit()
    reset_accelerate()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        make(tmp_path, "train.max_steps=3", "task.noise=0.5")
    assert "RESUMING A CHANGED RUN" in caplog.text and "task.noise" in caplog.text and "0.1 -> 0.5" in caplog.text


def test_processes_sharing_a_node_share_its_cores_when_omp_threads_is_unset(monkeypatch):
    """The `deepspeed` launcher sets no OMP_NUM_THREADS: 2 local processes would each take every core."""
    import torch

    from trainer.core.distributed import share_cores_among_local_processes

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        monkeypatch.setenv("LOCAL_SIZE", "2")  # what the deepspeed launcher exports
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
        monkeypatch.setattr("psutil.cpu_count", lambda logical=True: 16 if logical else 8)  # 8 cores, 2 threads each
        assert share_cores_among_local_processes() == 4 and torch.get_num_threads() == 4
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # torchrun's name wins; never below one thread
        assert share_cores_among_local_processes() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's (or launcher's) choice stands
        assert share_cores_among_local_processes() is None
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert share_cores_among_local_processes() is None
    finally:
        torch.set_num_threads(before)

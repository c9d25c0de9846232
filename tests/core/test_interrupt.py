"""Ctrl-C is a save point: the first SIGINT finishes the step, checkpoints, says how to resume in one line and exits
130; a second one stops at once. Plain runs and the front end (`trainer train --nproc`) print no traceback; under a
bare launcher (accelerate launch) the ranks do the same and the launcher adds its own report. User errors under the
front end stay one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import BIN, ROOT, TINY, accelerate_cmd, child_env, run_cmd, train_losses

from trainer.core.checkpoint import latest_checkpoint
from trainer.core.checkpoint.export import load_model_weights
from trainer.core.command_line import _as_typed, resume_command

pytestmark = [pytest.mark.slow]

COMMON = ["log.every_steps=1", "log.progress_bar=false", "log.tensorboard=false", "ckpt.every_steps=1000",
          "eval.every_steps=0", "train.per_device_batch_size=8"]


def start(cmd: list[str]) -> subprocess.Popen:
    """A process group of its own, as a terminal's foreground job: Ctrl-C goes to every process in it."""
    return subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def ctrl_c(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)


def wait_for_steps(run_dir: Path, proc: subprocess.Popen, steps: int = 3, timeout: float = 200) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + timeout
    while not (metrics.is_file() and metrics.read_text().count('"loss"') >= steps):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "training did not start"
        time.sleep(0.05)


def stopped_cleanly(proc: subprocess.Popen, run_dir: Path) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output[-3000:]
    step = json.loads((run_dir / "preempted.json").read_text())["step"]
    assert json.loads((run_dir / "preempted.json").read_text())["signal"] == "SIGINT"
    assert latest_checkpoint(run_dir / "checkpoints").name == f"step_{step:08d}", output[-2000:]
    assert f"interrupted by Ctrl-C at step {step} of " in output, output[-2000:]
    return step, output


def test_ctrl_c_checkpoints_and_the_resume_equals_the_uninterrupted_run(tmp_path):
    steps = ["train.max_steps=40", "train.grad_accum_steps=2", "task.dropout=0.2"]
    ref = tmp_path / "ref"
    run_cmd([str(BIN / "trainer"), "train", TINY, *COMMON, *steps, f"run.output_dir={ref}"])

    out = tmp_path / "run"
    proc = start([str(BIN / "trainer"), "train", TINY, *COMMON, *steps, "task.delay_s=0.1", f"run.output_dir={out}",
                  "run.resume=none"])
    wait_for_steps(out, proc)
    ctrl_c(proc)
    step, output = stopped_cleanly(proc, out)
    assert "Traceback" not in output and step < 40
    resume = output.split("resume with: ")[1].splitlines()[0]
    assert resume.startswith("trainer train ") and "run.resume=none" not in resume and "run.resume=auto" in resume

    run_cmd([str(BIN / "trainer"), "train", TINY, *COMMON, *steps, f"run.output_dir={out}", "run.resume=auto"])
    assert not (out / "preempted.json").exists()
    assert train_losses(out) == train_losses(ref)
    got, want = load_model_weights(latest_checkpoint(out / "checkpoints")), load_model_weights(
        latest_checkpoint(ref / "checkpoints"))
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.distributed
def test_front_end_ctrl_c_once_then_resume_and_twice_at_once(tmp_path):
    """`trainer train --nproc 2`: one Ctrl-C gives a checkpoint, one line and 130, no traceback from any process;
    the same command resumes; Ctrl-C twice stops at once, the last complete checkpoint intact."""
    out = tmp_path / "run"
    cmd = [str(BIN / "trainer"), "train", TINY, "--nproc", "2", *COMMON, "train.max_steps=300", f"run.output_dir={out}"]
    proc = start([*cmd, "task.delay_s=0.05"])
    wait_for_steps(out, proc)
    ctrl_c(proc)
    step, output = stopped_cleanly(proc, out)
    assert "Traceback" not in output and "SignalException" not in output
    assert output.count("interrupted by Ctrl-C at step") == 1
    assert "--nproc 2" in output.split("resume with: ")[1]

    proc = start([*cmd, "task.delay_s=0.3"])  # resumes; stopped again, twice, before it can checkpoint
    wait_for_steps(out, proc, steps=step + 2)
    ctrl_c(proc)
    time.sleep(0.8)  # longer than a double press (preemption.DOUBLE_PRESS_S): a person pressing again
    ctrl_c(proc)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in output, output[-3000:]
    assert "Ctrl-C pressed again: stopping at once" in output, output[-3000:]
    assert latest_checkpoint(out / "checkpoints").name == f"step_{step:08d}"


def test_front_end_user_error_is_one_line(tmp_path):
    proc = subprocess.run([str(BIN / "trainer"), "train", TINY, "--nproc", "2", "task.num_trian=3",
                           f"run.output_dir={tmp_path / 'run'}"], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "launching 2 processes" not in line]
    assert len(lines) == 1 and lines[0].startswith("trainer: config error:") and "num_trian" in lines[0], proc.stderr


@pytest.mark.distributed
def test_ctrl_c_under_accelerate_launch_checkpoints_every_rank(tmp_path):
    """Under a bare launcher the ranks stop as one at a step, checkpoint, and rank 0 names the launcher's command
    to resume (the launcher then reports the signal itself)."""
    out = tmp_path / "run"
    proc = start(accelerate_cmd("ddp.yaml", TINY, *COMMON, "train.max_steps=300", "task.delay_s=0.05",
                                f"run.output_dir={out}"))
    wait_for_steps(out, proc)
    ctrl_c(proc)
    output, _ = proc.communicate(timeout=120)
    step = json.loads((out / "preempted.json").read_text())["step"]
    assert latest_checkpoint(out / "checkpoints").name == f"step_{step:08d}"
    assert output.count("interrupted by Ctrl-C at step") == 1
    assert output.split("resume with: ")[1].startswith("accelerate launch --config_file")


def test_resume_command_names_what_was_typed():
    from trainer.config import Config

    cfg = Config()
    assert _as_typed(["/v/bin/python3", "/v/bin/accelerate", "launch", "scripts/train.py", "c.yaml"]) == \
        ["accelerate", "launch", "scripts/train.py", "c.yaml"]
    assert _as_typed(["/v/bin/python", "scripts/train.py", "c.yaml"]) == ["python", "scripts/train.py", "c.yaml"]
    assert _as_typed(["/v/bin/python", "/src/trainer/__main__.py", "train"]) == ["python", "-m", "trainer", "train"]
    typed = ["trainer", "train", "a b.yaml", "run.resume=none", "train.max_steps=9"]
    cfg.run.resume = "none"
    assert resume_command(cfg, typed) == "trainer train 'a b.yaml' run.resume=auto train.max_steps=9"
    cfg.run.resume = "auto"
    assert resume_command(cfg, ["trainer", "train", "c.yaml"]) == "trainer train c.yaml"


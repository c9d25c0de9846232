"""Exact resume: SIGKILL after a checkpoint (one process, bit-identical), SIGTERM checkpoint and exit code (also
through accelerate launch), a stream checkpointed by 2 processes continued by one. Resume with 2 processes on the same or another
topology (DDP, ZeRO, FSDP, one process) is tested in test_resume_anywhere.py."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    BIN,
    ROOT,
    TINY,
    TRAIN,
    accelerate_cmd,
    assert_run_matches,
    child_env,
    cli_in_process,
    cut_run_back,
    run_cmd,
    train_losses,
)
from safetensors.torch import load_file

from trainer.core.checkpoint import latest_checkpoint
from trainer.core.checkpoint.export import load_model_weights
from trainer.core.preemption import PREEMPTED_EXIT_CODE

pytestmark = [pytest.mark.slow]

BASE = ["task.preset=tiny", "task.num_train=96", "train.grad_accum_steps=2", "train.ema_decay=0.9",
        "log.every_steps=1", "log.progress_bar=false", "log.tensorboard=false", "eval.every_steps=4",
        "ckpt.keep_last=20", "optim.lr=0.01"]


def python_cmd(out: Path, *extra: str) -> list[str]:
    return [str(BIN / "python"), TRAIN, TINY, *BASE, "train.per_device_batch_size=16", f"run.output_dir={out}", *extra]


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"process ended early with {proc.returncode}: {proc.stdout.read()[-3000:]}")
        time.sleep(0.02)
    raise AssertionError("timed out")


def final_state(run_dir: Path) -> tuple[dict, dict]:
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    return load_model_weights(ckpt), load_file(ckpt / "ema.safetensors")


@pytest.mark.numerics
def test_sigkill_and_resume_is_bit_identical(tmp_path):
    # Dropout draws from the RNG and 2 loader workers run: both must be restored/reseeded exactly.
    steps = ["train.max_steps=16", "ckpt.every_steps=4", "task.dropout=0.2", "data.num_workers=2"]
    run_cmd(python_cmd(tmp_path / "ref", *steps, "run.resume=none"))

    out = tmp_path / "killed"
    slow = python_cmd(out, *steps, "run.resume=auto", "task.delay_s=0.05")
    proc = subprocess.Popen(slow, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pointer = out / "checkpoints" / "latest"
    wait_for(lambda: pointer.is_file() and pointer.read_text().strip() == "step_00000008", proc)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up, possibly mid-way through a step
    proc.wait()
    losses_before = train_losses(out)
    assert max(losses_before) < 16
    run_cmd(python_cmd(out, *steps, "run.resume=auto"))  # resume=auto picks up step 8

    ref_model, ref_ema = final_state(tmp_path / "ref")
    got_model, got_ema = final_state(out)
    for key in ref_model:
        assert torch.equal(ref_model[key], got_model[key]), key
        assert torch.equal(ref_ema[key], got_ema[key]), key
    ref_losses, got_losses = train_losses(tmp_path / "ref"), train_losses(out)
    assert sorted(got_losses) == list(range(1, 17))  # metrics.jsonl has each step once after the replay
    assert got_losses == ref_losses


def test_sigterm_checkpoints_and_exits_with_documented_code(tmp_path):
    out = tmp_path / "run"
    cmd = python_cmd(out, "train.max_steps=400", "ckpt.every_steps=1000", "task.delay_s=0.02", "run.resume=auto")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and metrics.read_text().count('"loss"') >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == PREEMPTED_EXIT_CODE
    marker = json.loads((out / "preempted.json").read_text())
    assert marker["signal"] == "SIGTERM"
    latest = latest_checkpoint(out / "checkpoints")
    assert latest.name == f"step_{marker['step']:08d}" and 3 <= marker["step"] < 400
    # The requeued job continues from there and finishes; the marker is cleared.
    run_cmd(python_cmd(out, "train.max_steps=" + str(marker["step"] + 2), "run.resume=auto"))
    assert not (out / "preempted.json").exists()
    assert max(train_losses(out)) == marker["step"] + 2


@pytest.mark.distributed
def test_sigterm_through_accelerate_launch(tmp_path):
    """SLURM signals the launcher; torchrun's agent forwards SIGTERM to the ranks, which agree on a step."""
    out = tmp_path / "run"
    cmd = accelerate_cmd("ddp.yaml", TINY, *BASE, "train.per_device_batch_size=8", "train.max_steps=400",
                         "task.delay_s=0.02", "ckpt.every_steps=1000", f"run.output_dir={out}")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and metrics.read_text().count('"loss"') >= 3, proc, timeout=200)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    marker = json.loads((out / "preempted.json").read_text())
    assert latest_checkpoint(out / "checkpoints").name == f"step_{marker['step']:08d}"


@pytest.mark.distributed
def test_stream_checkpointed_by_two_processes_resumes_on_one_exactly(tmp_path, caplog):
    """The resume matrix's streaming case: a stream of 101 samples (3 global batches of 32 an epoch, the last 5
    left out) checkpointed by 2 DDP processes at step 4 (epoch 1, 32 samples in) and continued by one process
    (accumulation 2 -> 4) reads exactly the samples the uninterrupted run read: every step's loss, the weights
    and the EMA within 1e-5."""
    common = [*BASE, "task.num_train=101", "task.streaming=true", "train.per_device_batch_size=8",
              "train.max_steps=8", "ckpt.every_steps=4"]
    ref = tmp_path / "ref"
    log = run_cmd(accelerate_cmd("ddp.yaml", TINY, *common, f"run.output_dir={ref}", "run.resume=none"))
    assert "epoch 0 had 101 samples: 3 global batches of 32, the last 5 samples left out" in log.stdout + log.stderr
    state = json.loads((ref / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["data_position"] == [1, 32]  # (epoch, global samples read): the same on every rank
    out = cut_run_back(ref, tmp_path / "resumed", step=4)
    with caplog.at_level(logging.INFO, logger="trainer"):
        cli_in_process("train", TINY, *common, f"run.output_dir={out}", "run.resume=auto")
    assert "train.grad_accum_steps 2 -> 4" in caplog.text
    assert_run_matches(ref, out, tolerance=1e-5, steps=8)


@pytest.mark.extended
@pytest.mark.distributed
def test_stream_checkpointed_by_one_process_resumes_under_zero2_with_workers(tmp_path):
    """The reverse direction, through the topology-free form and with 2 DataLoader workers a process: a stream
    checkpointed by one process (8 per device x 4 accumulation) at step 4 and continued by ZeRO-2 x2 (8 x 2) ends
    within 1e-5 of the uninterrupted one-process run."""
    common = [*BASE, "task.num_train=101", "task.streaming=true", "train.per_device_batch_size=8",
              "train.global_batch_size=32", "train.max_steps=8", "ckpt.every_steps=4", "data.num_workers=2"]
    ref = tmp_path / "ref"
    cli_in_process("train", TINY, *common, f"run.output_dir={ref}", "run.resume=none")
    out = cut_run_back(ref, tmp_path / "resumed", step=4)
    proc = run_cmd(accelerate_cmd("zero2.yaml", TINY, *common, f"run.output_dir={out}", "run.resume=auto"),
                   timeout=400)
    assert "through the topology-free form" in proc.stdout + proc.stderr
    assert_run_matches(ref, out, tolerance=1e-5, steps=8)


def test_a_finished_run_rerun_says_so_in_one_line_and_writes_nothing(tmp_path, caplog):
    """Rerunning a finished run (run.resume=auto, the same output_dir) trains nothing, prints one line naming the
    step, when its results were made and how to train again, and leaves every file as it was; a run stopped at
    its last step (preempted.json) still gets its final evaluation and test on the rerun."""
    out = tmp_path / "run"
    args = ["train", TINY, *BASE, "train.max_steps=4", "eval.every_steps=0", f"run.output_dir={out}", "run.resume=auto"]
    cli_in_process(*args)

    def files() -> dict[str, tuple[int, bytes]]:
        return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()
                and p.name != ".lock"}

    before = files()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        cli_in_process(*args)
    said = [r.getMessage() for r in caplog.records if "already complete" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("run already complete at step 4/4: nothing to train"), caplog.text
    assert "run.resume=none or another run.output_dir" in said[0] and "final eval" not in caplog.text
    assert files() == before

    (out / "preempted.json").write_text(json.dumps({"step": 4, "signal": "SIGTERM"}))
    records = len((out / "metrics.jsonl").read_text().splitlines())
    cli_in_process(*args)
    assert not (out / "preempted.json").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) > records  # the final eval and test ran


@pytest.mark.distributed
def test_a_run_past_this_configs_plan_says_so_and_its_result_says_nothing_was_trained(tmp_path, capfd):
    """A config whose plan is shorter than the finished run in its folder (2 launched processes, as the README's
    Python example after its command-line one): one line saying the run is past this plan, no note about the ranks'
    random streams, and a result whose status says that nothing was trained."""
    from trainer.api import train
    from trainer.config import load_config

    out = tmp_path / "run"
    cli_in_process("train", TINY, *BASE, "train.max_steps=4", "eval.every_steps=0", f"run.output_dir={out}")
    capfd.readouterr()
    res = train(load_config(TINY, [*BASE, "train.max_steps=2", "eval.every_steps=0", f"run.output_dir={out}"]),
                num_processes=2)
    said = capfd.readouterr()
    assert res.status == "already_complete" and res.world_size == 1  # the finished run's
    assert "holds a run that ended at step 4, past this config's plan of 2 steps" in said.err + said.out
    assert "no saved RNG state" not in said.err + said.out

"""Resume anywhere: a checkpoint of one backend and number of processes resumed under another, with no
manual step, ends at the weights (and EMA) of the uninterrupted run (max difference 1e-5; on its own
topology 1e-6), on the regression task with 2 CPU processes over gloo. Bad input is one line and leaves the
run directory as it was.

CI runs a representative subset (`PAIRS`: each resumes one of the launch matrix's runs, one launch a pair;
FSDP's 2 processes hold half of each parameter and each writes its own shards (torch.distributed.checkpoint),
which one process reads through the on-demand conversion: FSDP -> one process stands for FSDP -> plain/DDP);
`make test-all` (the `extended` marker) runs every other pair (`FULL`, 27 pairs: each multi-process run costs
20-40 s on 2 cores, more on a loaded machine), the refusal of a ZeRO checkpoint whose optimizer state cannot
be converted, a run killed with SIGKILL at a random step that another topology continues, and protein SEDD
(DDP x2 -> ZeRO-2 x2 against one uninterrupted process, 1e-4; measured 7.5e-9)."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    BIN,
    ONE_PROCESS,
    REGRESSION_LAUNCHES,
    TINY,
    TRAIN,
    accelerate_cmd,
    assert_run_matches,
    child_env,
    cli_in_process,
    cut_run_back,
    reset_accelerate,
    run_cmd,
    train_losses,
)

from trainer.core.checkpoint import latest_checkpoint
from trainer.core.checkpoint.export import load_model_weights

pytestmark = [pytest.mark.slow]

# The sources are the session's shared uninterrupted regression runs (tests/conftest.py: 8 steps, checkpoints at 4
# and 8), cut back to step 4 as a stop there leaves them; the target continues the copy with run.resume=auto and
# its command line of 8 per device (one process: accumulation 2 -> 4 keeps the global batch of 32). Across
# topologies the result is compared with the one-process run (1e-5); on the source's own topology with the
# source's own run (1e-6: nothing may change but the restart).
PAIRS = [("ddp", "ddp"), ("zero2", "zero2"), ("ddp", "zero2"), ("zero2", "single"), ("zero3", "ddp"),
         ("fsdp", "single")]
FULL = [(a, b) for a in ("single", "ddp", "zero1", "zero2", "zero3", "fsdp")
        for b in ("single", "ddp", "zero2", "zero3", "fsdp")
        if a != b and (a, b) not in PAIRS] + [("zero2", "zero2x1"), ("zero3", "zero1"), ("ddp", "zero3_offload"),
                                               ("zero3_offload", "single"), ("fsdp", "fsdp"), ("zero3", "zero3")]
full_matrix = pytest.mark.extended  # `make test-all` (or `pytest -m extended`) runs it; `make test` leaves it out


def launch(topology: str, out: Path, *extra: str) -> list[str]:
    """The target's command: the shared run's, with 8 samples per device on one process too."""
    command = REGRESSION_LAUNCHES[topology](out, *extra)
    return [("train.per_device_batch_size=8" if arg == "train.per_device_batch_size=16" else arg) for arg in command]


def resume_and_compare(regression_runs, tmp_path: Path, source: str, target: str) -> None:
    """The new topology launched on the source's run directory stopped at step 4, with run.resume=auto, as after
    a requeue onto another allocation."""
    out = cut_run_back(regression_runs(source), tmp_path / f"{source}_to_{target}", step=4)
    proc = run_cmd(launch(target, out, "run.resume=auto"), timeout=400)
    log = proc.stdout + proc.stderr
    assert "through the topology-free form" in log or _same_layout(source, target)
    assert not list((out / "checkpoints").glob(".universal-*"))  # the conversion's folder is gone
    if ONE_PROCESS_TOPOLOGIES >= {target} and not ONE_PROCESS_TOPOLOGIES >= {source}:
        assert "train.grad_accum_steps 2 -> 4" in log, log[-3000:]  # the start log says what it changed
    same = source == target
    ref = regression_runs(source if same else "single")
    tolerance = 1e-6 if same else 1e-5
    assert_run_matches(ref, out, tolerance, steps=8)  # steps 1-4 by the source, 5-8 by the target


ONE_PROCESS_TOPOLOGIES = {"single", "zero2x1"}  # the others run 2


def _same_layout(source: str, target: str) -> bool:
    """Pairs the backend's own loader reads (plain <-> DDP at any number of processes, plain/DDP -> FSDP: whole
    tensors, each rank keeping its shards; a checkpoint on its own topology). FSDP's sharded checkpoint is
    converted for any other backend."""
    return source == target or {source, target} <= {"single", "ddp"} or (source in ("single", "ddp")
                                                                         and target == "fsdp")


@pytest.mark.distributed
@pytest.mark.parametrize("source, target", [  # one ZeRO conversion also under every vector unit (marker numerics)
    pytest.param(a, b, id=f"{a}-to-{b}", marks=[pytest.mark.numerics] if (a, b) == ("zero2", "single") else [])
    for a, b in PAIRS])
def test_resume_under_another_backend_matches_uninterrupted(regression_runs, tmp_path, source, target):
    resume_and_compare(regression_runs, tmp_path, source, target)


@full_matrix
@pytest.mark.distributed
@pytest.mark.parametrize("source, target", FULL, ids=[f"{a}-to-{b}" for a, b in FULL])
def test_full_resume_matrix(regression_runs, tmp_path, source, target):
    resume_and_compare(regression_runs, tmp_path, source, target)


def snapshot(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_checkpoint_of_another_model_or_task_is_one_line_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    run_cmd(launch("single", run, "train.max_steps=2", "ckpt.every_steps=2", "run.resume=none"))
    before = snapshot(run)
    proc = run_cmd(launch("single", run, "train.max_steps=4", "task.hidden=48"), expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("trainer: error:")]
    assert len(errors) == 1 and "holds another model than this run's: parameter '0.weight' has shape (32, 16) " \
                                  "there and (48, 16) here" in errors[0], proc.stderr[-2000:]
    assert snapshot(run) == before
    # A checkpoint of another task, named by run.resume in a fresh directory: refused before anything is loaded.
    other = tmp_path / "other"
    proc = run_cmd([str(BIN / "python"), TRAIN, str(Path(TINY).parents[1] / "protein_sedd" / "sedd_tiny.yaml"),
                    f"run.output_dir={other}", f"run.resume={run / 'checkpoints' / 'step_00000002'}",
                    "log.tensorboard=false"], expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("trainer: error:")]
    assert len(errors) == 1 and "was trained for task 'regression', this run trains task 'protein_sedd'" in errors[0]
    assert snapshot(run) == before
    assert not (other / "checkpoints").exists()


def train_in_process(out: Path, *extra: str) -> int:
    """`trainer train` of the one-process regression run (8 per device) in this process: its exit status."""
    from trainer.cli import main

    args = [("train.per_device_batch_size=8" if arg == "train.per_device_batch_size=16" else arg) for arg in ONE_PROCESS]
    try:
        return main(["train", TINY, *args, f"run.output_dir={out}", *extra])
    finally:
        reset_accelerate()


def one_error_line(status: int, err: str) -> str:
    """The one line a user-fixable failure prints (exit 2, no traceback)."""
    errors = [line for line in err.splitlines() if line.startswith("trainer: error:")]
    assert status == 2 and "Traceback" not in err and len(errors) == 1, err[-3000:]
    return errors[0]


@pytest.mark.distributed
def test_zero_checkpoint_on_a_full_disk_or_with_an_unreadable_file_is_one_line(regression_runs, tmp_path, monkeypatch,
                                                                              capsys):
    """The session's ZeRO-2 x2 run, cut back to step 4, resumed by one process in this process: the disk filling
    during the conversion, or a garbled DeepSpeed file with ckpt.verify=false, is one line naming the space or the
    file; the run folder is left as it was (DeepSpeed's latest_universal pointer included); with room again the
    resume ends at the uninterrupted run's weights."""
    import torch

    out = cut_run_back(regression_runs("zero2"), tmp_path / "zero2_to_single", step=4)
    root, before = out / "checkpoints", snapshot(out)
    real_save = torch.save

    def fill(obj, f, *args, **kwargs):
        if ".universal-" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a write's error names no file
        return real_save(obj, f, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", fill)
        line = one_error_line(train_in_process(out, "run.resume=auto"), capsys.readouterr().err)
    assert f"checkpoint {root / 'step_00000004'} could not be converted for this run: no space left on device " \
           f"writing " in line and f"free in {root} now, about " in line and "needed (the checkpoint's size)" in line, line
    assert snapshot(out) == before and not (root / "latest_universal").exists()

    ds = root / "step_00000004" / "pytorch_model"
    for damaged in (ds / "mp_rank_00_model_states.pt", sorted(ds.glob("*optim_states.pt"))[0]):
        intact = damaged.read_bytes()
        damaged.write_bytes(intact[:len(intact) // 2] + bytes(len(intact) - len(intact) // 2))
        line = one_error_line(train_in_process(out, "run.resume=auto", "ckpt.verify=false"), capsys.readouterr().err)
        assert f"checkpoint file {damaged} cannot be read" in line, line
        damaged.write_bytes(intact)
        assert snapshot(out) == before and not (root / "latest_universal").exists()

    assert train_in_process(out, "run.resume=auto") == 0
    assert not list(root.glob(".universal-*")) and not (root / "latest_universal").exists()
    assert_run_matches(regression_runs("single"), out, tolerance=1e-5, steps=8)


@full_matrix
@pytest.mark.distributed
def test_zero_state_that_cannot_be_converted_is_named_and_changes_nothing(tmp_path):
    """DeepSpeed's ds_to_universal converts Adam's moments only: a ZeRO checkpoint of SGD is refused in one line."""
    source = tmp_path / "sgd"
    run_cmd(launch("zero2", source, "train.max_steps=4", "optim.name=sgd", "train.ema_decay=0", "run.resume=none"),
            timeout=400)
    before = snapshot(source)
    out = tmp_path / "single"
    proc = run_cmd(launch("single", out, "train.max_steps=8", "optim.name=sgd", "train.ema_decay=0",
                          f"run.resume={source / 'checkpoints' / 'step_00000004'}"), expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("trainer: error:")]
    assert len(errors) == 1 and "the optimizer state cannot be converted" in errors[0], proc.stderr[-2000:]
    assert snapshot(source) == before and not (out / "checkpoints").exists()


@full_matrix
@pytest.mark.distributed
def test_sigkill_at_a_random_step_then_resume_on_another_topology(regression_runs, tmp_path):
    """One process killed without warning somewhere after its step-4 checkpoint; ZeRO-2 x2 continues the run
    directory (run.resume=auto) and ends at the uninterrupted run's weights."""
    out = tmp_path / "killed"
    # 8 per device (launch's one-process size) x 4 accumulated: the reference run's global batch of 32
    cmd = launch("single", out, "train.max_steps=8", "run.resume=none", "task.delay_s=0.05", "train.grad_accum_steps=4")
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pointer, deadline = out / "checkpoints" / "latest", time.time() + 300
    while not (pointer.is_file() and pointer.read_text().strip() == "step_00000004"):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its step-4 checkpoint"
        time.sleep(0.02)
    time.sleep(random.uniform(0.0, 0.3))  # a random point of steps 5-8 (each takes at least 0.1 s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_cmd(launch("zero2", out, "train.max_steps=8", "run.resume=auto"), timeout=400)
    assert_run_matches(regression_runs("single"), out, tolerance=1e-5)


@full_matrix
@pytest.mark.distributed
def test_sedd_resumed_under_another_backend_matches_uninterrupted(tmp_path):
    """Protein SEDD (dropout 0; diffusion time and corruption keyed by sample): a DDP x2 run stopped after its
    step-4 checkpoint and continued by ZeRO-2 x2 (converted through the topology-free form) ends within 1e-4 of
    one uninterrupted process with the same global batch of 8."""
    sedd = str(Path(TINY).parents[1] / "protein_sedd" / "sedd_tiny.yaml")
    common = [sedd, "task.max_length=32", "task.dropout=0", "train.per_device_batch_size=4",
              "train.global_batch_size=8", "train.max_steps=8", "ckpt.every_steps=4", "ckpt.keep_last=5",
              "eval.every_steps=0", "eval.sample_every=0", "log.every_steps=1", "log.progress_bar=false",
              "log.tensorboard=false", f"task.cache_dir={tmp_path / 'cache'}"]
    reference, source = tmp_path / "reference", tmp_path / "ddp"
    cli_in_process("train", *common, f"run.output_dir={reference}", "run.resume=none")
    run_cmd(accelerate_cmd("ddp.yaml", *common, f"run.output_dir={source}", "run.resume=none"), timeout=400)
    out = cut_run_back(source, tmp_path / "ddp_to_zero2", step=4)
    proc = run_cmd(accelerate_cmd("zero2.yaml", *common, f"run.output_dir={out}", "run.resume=auto"), timeout=400)
    assert "through the topology-free form" in proc.stdout + proc.stderr
    ref_losses, got_losses = train_losses(reference), train_losses(out)
    assert sorted(got_losses) == list(range(1, 9))
    for step, loss in got_losses.items():
        assert abs(loss - ref_losses[step]) <= 1e-4, (step, loss, ref_losses[step])
    ref_model = load_model_weights(latest_checkpoint(reference / "checkpoints"))
    got_model = load_model_weights(latest_checkpoint(out / "checkpoints"))
    difference = max(float((got_model[k].float() - ref_model[k].float()).abs().max()) for k in ref_model)
    print(f"SEDD DDP x2 -> ZeRO-2 x2 against one process: max weight difference {difference:.2e}")
    assert difference <= 1e-4

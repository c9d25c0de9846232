"""Resume anywhere: a checkpoint of one backend and number of processes resumed under another, with no
manual step, ends at the weights (and EMA) of the uninterrupted run (max difference 1e-5), on the
regression task with 2 CPU processes over gloo. Bad input is one line and leaves the run directory as it was.

CI runs a representative subset (`PAIRS`, about 5 minutes on 2 shared cores; FSDP's 2 processes hold half of
each parameter and write whole tensors, so FSDP -> one process stands for FSDP <-> plain/DDP); `make test-all`
(the `extended` marker) runs every other pair (`FULL`, 26 pairs: each multi-process run costs 20-40 s on 2 cores,
more on a loaded machine), the refusal of a ZeRO checkpoint whose optimizer state cannot be converted, and a run
killed with SIGKILL at a random step that another topology continues."""

from __future__ import annotations

import hashlib
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import BIN, TINY, TRAIN, accelerate_cmd, child_env, run_cmd, train_losses
from safetensors.torch import load_file

from trainer.core.checkpoint import latest_checkpoint
from trainer.core.export import load_model_weights

pytestmark = [pytest.mark.slow]

# 96 samples, global batch 32 (3 steps an epoch): 8 steps cross two epochs. The source runs stop at step 4
# (their last checkpoint); the reference trains 8 steps on one process without stopping.
COMMON = ["task.preset=tiny", "task.num_train=96", "task.num_eval=50", "train.grad_accum_steps=2",
          "train.ema_decay=0.9", "log.every_steps=1", "log.progress_bar=false", "log.tensorboard=false",
          "eval.every_steps=4", "ckpt.every_steps=4", "ckpt.keep_last=5", "optim.lr=0.01"]

# name -> (accelerate config or None for plain python, processes)
TOPOLOGIES = {"single": (None, 1), "ddp": ("ddp.yaml", 2), "zero1": ("zero1.yaml", 2), "zero2": ("zero2.yaml", 2),
              "zero3": ("zero3.yaml", 2), "zero2x1": ("zero2.yaml", 1), "zero3_offload": ("zero3_offload.yaml", 2),
              "fsdp": ("fsdp.yaml", 2)}
PAIRS = [("ddp", "zero2"), ("zero2", "single"), ("zero3", "ddp"), ("fsdp", "single")]
FULL = [(a, b) for a in ("single", "ddp", "zero1", "zero2", "zero3", "fsdp")
        for b in ("single", "ddp", "zero2", "zero3", "fsdp")
        if a != b and (a, b) not in PAIRS] + [("zero2", "zero2x1"), ("zero3", "zero1"), ("ddp", "zero3_offload"),
                                               ("zero3_offload", "single"), ("fsdp", "fsdp")]
full_matrix = pytest.mark.extended  # `make test-all` (or `pytest -m extended`) runs it; `make test` leaves it out


def launch(topology: str, out: Path, *extra: str) -> list[str]:
    config, nproc = TOPOLOGIES[topology]
    # 32 samples a step: 16 per device on one process, 8 on each of two (the global batch is kept on resume).
    args = [*COMMON, f"train.per_device_batch_size={32 // (2 * nproc)}", f"run.output_dir={out}", *extra]
    if config is None:
        return [str(BIN / "python"), TRAIN, TINY, *args]
    return accelerate_cmd(config, TINY, *args, nproc=nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted reference (8 steps, one process) and each source's step-4 checkpoint, made once."""
    root = tmp_path_factory.mktemp("anywhere")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            out = root / name
            steps = "train.max_steps=8" if name == "reference" else "train.max_steps=4"
            run_cmd(launch("single" if name == "reference" else name, out, steps, "run.resume=none"), timeout=400)
            made[name] = out
        return made[name]
    return get


def final(run_dir: Path) -> tuple[dict, dict]:
    path = latest_checkpoint(run_dir / "checkpoints")
    return load_model_weights(path), load_file(path / "ema.safetensors")


def resume_and_compare(runs, tmp_path: Path, source: str, target: str) -> None:
    """The new topology launched on (a copy of) the source's run directory with run.resume=auto, as after a
    requeue onto another allocation."""
    out = tmp_path / f"{source}_to_{target}"
    shutil.copytree(runs(source), out)
    proc = run_cmd(launch(target, out, "train.max_steps=8", "run.resume=auto"), timeout=400)
    assert "through the topology-free form" in proc.stdout + proc.stderr or _same_layout(source, target)
    assert not list((out / "checkpoints").glob(".universal-*"))  # the conversion's folder is gone
    ref = runs("reference")
    ref_losses, got_losses = train_losses(ref), train_losses(out)
    assert sorted(got_losses) == list(range(1, 9))  # steps 1-4 by the source, 5-8 by the target
    for step, loss in got_losses.items():
        assert abs(loss - ref_losses[step]) <= 1e-5, (step, loss, ref_losses[step])
    (ref_model, ref_ema), (got_model, got_ema) = final(ref), final(out)
    assert ref_model.keys() == got_model.keys() and ref_ema.keys() == got_ema.keys()
    for key in ref_model:
        torch.testing.assert_close(got_model[key].float(), ref_model[key].float(), rtol=0, atol=1e-5)
        torch.testing.assert_close(got_ema[key], ref_ema[key], rtol=0, atol=1e-5)


def _same_layout(source: str, target: str) -> bool:
    """Pairs the backend's own loader reads (plain <-> DDP <-> FSDP at any number of processes: an FSDP
    checkpoint holds whole tensors in a plain run's files)."""
    return {source, target} <= {"single", "ddp", "fsdp"}


@pytest.mark.distributed
@pytest.mark.parametrize("source, target", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_resume_under_another_backend_matches_uninterrupted(runs, tmp_path, source, target):
    resume_and_compare(runs, tmp_path, source, target)


@full_matrix
@pytest.mark.distributed
@pytest.mark.parametrize("source, target", FULL, ids=[f"{a}-to-{b}" for a, b in FULL])
def test_full_resume_matrix(runs, tmp_path, source, target):
    resume_and_compare(runs, tmp_path, source, target)


def snapshot(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_checkpoint_of_another_model_or_task_is_one_line_and_changes_nothing(runs, tmp_path):
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
def test_sigkill_at_a_random_step_then_resume_on_another_topology(runs, tmp_path):
    """One process killed without warning somewhere after its step-4 checkpoint; ZeRO-2 x2 continues the run
    directory (run.resume=auto) and ends at the uninterrupted run's weights."""
    out = tmp_path / "killed"
    cmd = launch("single", out, "train.max_steps=8", "run.resume=none", "task.delay_s=0.05")
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pointer, deadline = out / "checkpoints" / "latest", time.time() + 300
    while not (pointer.is_file() and pointer.read_text().strip() == "step_00000004"):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its step-4 checkpoint"
        time.sleep(0.02)
    time.sleep(random.uniform(0.0, 0.3))  # a random point of steps 5-8 (each takes at least 0.1 s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_cmd(launch("zero2", out, "train.max_steps=8", "run.resume=auto"), timeout=400)
    (ref_model, ref_ema), (got_model, got_ema) = final(runs("reference")), final(out)
    for key in ref_model:
        torch.testing.assert_close(got_model[key].float(), ref_model[key].float(), rtol=0, atol=1e-5)
        torch.testing.assert_close(got_ema[key], ref_ema[key], rtol=0, atol=1e-5)

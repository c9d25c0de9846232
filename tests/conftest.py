"""Shared helpers: run the real launchers in subprocesses, reset accelerate's singletons."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# One thread per pool in the test process too (subprocesses get it from child_env): the tests' models are tiny,
# and on a loaded 2-core machine a second thread spin-waits for a busy core (an eval batch measured 10x slower).
# OpenBLAS (numpy's) and MKL size their pools from their own variables, numba (scanpy's t-test, which ranks the DE
# genes of every GEARS data load) from NUMBA_NUM_THREADS, else from the core count: on a loaded machine each of their
# parallel loops would wait for a second core. Set before any test module imports torch (or numba).
ONE_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
for _name in ONE_THREAD_VARIABLES:
    os.environ.setdefault(_name, "1")

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
    env.update({name: "1" for name in ONE_THREAD_VARIABLES}, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
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


def cli_in_process(*args: str) -> None:
    """`trainer ARGS` in this process (a subprocess costs ~5 s of imports on 2 cores): for single-process runs
    whose launch is not what a test is about. Fails on a non-zero exit; leaves accelerate's state fresh."""
    from trainer.cli import main

    try:
        assert main(list(args)) == 0, f"trainer {' '.join(args)} failed"
    finally:
        reset_accelerate()


@pytest.fixture
def fresh_accelerate():
    """In-process Trainers share accelerate's global state; reset it after each test."""
    yield
    reset_accelerate()


# ---------------------------------------------------------------------------------------------------------------
# The regression task launched once per session under each launcher and backend, for the test files that
# inspect such runs (the launch matrix, resume anywhere, exact resume, checkpoint security): a launch costs
# 20-40 s on 2 cores, so each one is made once and shared.
#
# 101 training samples, global batch 32 (3 optimizer steps an epoch, 5 samples left over, different ones each
# epoch): 8 steps cross two epochs. 37 eval samples in eval batches of 5: 2 ranks get uneven shares.
# Checkpoints at steps 4 and 8: resume tests continue a copy cut back to step 4 (`cut_run_back`).
REGRESSION_RUN = ["task.preset=tiny", "task.num_train=101", "task.num_eval=37", "eval.batch_size=5",
                  "train.max_steps=8", "train.grad_accum_steps=2", "train.ema_decay=0.9", "eval.every_steps=4",
                  "ckpt.every_steps=4", "ckpt.keep_last=5", "log.every_steps=1", "log.progress_bar=false",
                  "log.tensorboard=false", "optim.lr=0.01"]
ONE_PROCESS = [*REGRESSION_RUN, "train.per_device_batch_size=16"]
TWO_PROCESSES = [*REGRESSION_RUN, "train.per_device_batch_size=8"]


def _deepspeed_cmd(ds_config: Path):
    return lambda out, *extra: [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), TRAIN,
                                TINY, *TWO_PROCESSES, f"run.output_dir={out}", *extra, "--deepspeed", str(ds_config)]


def _accelerate(config: str, nproc: int | None = None, base: list[str] = TWO_PROCESSES):
    return lambda out, *extra: accelerate_cmd(config, TINY, *base, f"run.output_dir={out}", *extra, nproc=nproc)


# topology -> command (output folder, extra overrides); "multinode_ddp" is two launchers (`launch_multinode`).
REGRESSION_LAUNCHES = {
    "single": lambda out, *extra: [str(BIN / "python"), TRAIN, TINY, *ONE_PROCESS, f"run.output_dir={out}", *extra],
    "cli": lambda out, *extra: [str(BIN / "trainer"), "train", TINY, *ONE_PROCESS, f"run.output_dir={out}", *extra],
    "accelerate_single": _accelerate("single.yaml", base=ONE_PROCESS),
    "ddp": _accelerate("ddp.yaml"),
    "torchrun": lambda out, *extra: [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", TRAIN, TINY,
                                     *TWO_PROCESSES, f"run.output_dir={out}", *extra],
    "zero1": _accelerate("zero1.yaml"),
    "zero2": _accelerate("zero2.yaml"),
    "zero2x1": _accelerate("zero2.yaml", nproc=1),
    "zero3": _accelerate("zero3.yaml"),
    "zero3_offload": _accelerate("zero3_offload.yaml"),
    # The deepspeed launcher with our json and the HF Trainer guide's ZeRO-2/3 files (optimizer/scheduler "auto").
    "deepspeed_zero1": _deepspeed_cmd(ROOT / "ds_configs" / "zero1.json"),
    "deepspeed_zero2": _deepspeed_cmd(ROOT / "tests" / "core" / "ds_configs_hf" / "zero2.json"),
    "deepspeed_zero3": _deepspeed_cmd(ROOT / "tests" / "core" / "ds_configs_hf" / "zero3.json"),
    # FSDP2 (fully_shard) over gloo: each of the 2 ranks holds half of every parameter.
    "fsdp": _accelerate("fsdp.yaml"),
    # Two "machines" on one host, one process each, as scripts/slurm/train.sbatch starts them.
    "multinode_ddp": None,
}


def launch_multinode(out: Path, *extra: str) -> str:
    port = free_port()
    procs = [subprocess.Popen(
        [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "multinode_ddp.yaml"),
         "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
         "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), TRAIN, TINY, *TWO_PROCESSES,
         f"run.output_dir={out}", *extra], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]
    return "\n".join(outputs)


def launch_regression(topology: str, out: Path, *extra: str) -> str:
    """Launch the shared regression run under `topology` into `out`; return its output."""
    if topology == "multinode_ddp":
        return launch_multinode(out, *extra)
    proc = run_cmd(REGRESSION_LAUNCHES[topology](out, *extra), timeout=400)
    return proc.stdout + proc.stderr


def session_shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder shared by every pytest-xdist worker of this session (each worker has its own base temp
    folder, `.../pytest-N/popen-gwK`; their parent is the session's), or this process's own without xdist."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    (root / name).mkdir(exist_ok=True)
    return root / name


@pytest.fixture(scope="session")
def regression_runs(tmp_path_factory):
    """`regression_runs(topology)`: the run directory of the uninterrupted 8-step run under that topology,
    launched on first use (its output in launch.log) by whichever test worker needs it first, while the others
    wait on its lock. Tests must not write into it: copy it first."""
    from filelock import FileLock

    root = session_shared_dir(tmp_path_factory, "regression_runs")

    def get(topology: str) -> Path:
        out = root / topology
        with FileLock(str(root / f"{topology}.lock")):
            if not (out / "launch.log").is_file():  # launch.log is written last: a failed launch is retried
                log = launch_regression(topology, out, "run.resume=none")
                (out / "launch.log").write_text(log)
        return out
    return get


def cut_run_back(source: Path, out: Path, step: int) -> Path:
    """A copy of run `source` as a run stopped (or killed) after its step-`step` checkpoint would leave it:
    later checkpoints gone, `latest` and `best` pointing at step `step` (metrics.jsonl keeps later lines, as a
    kill leaves them; a resumed run truncates them)."""
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("launch.log", "export*"))
    name = f"step_{step:08d}"
    checkpoints = out / "checkpoints"
    assert (checkpoints / name).is_dir(), f"{source} has no checkpoint {name}"
    for folder in checkpoints.glob("step_*"):
        if int(folder.name.split("_")[1].split(".")[0]) > step:
            shutil.rmtree(folder)
    for pointer in ("latest", "best"):
        (checkpoints / pointer).write_text(name + "\n")
    return out


def assert_run_matches(reference: Path, run: Path, tolerance: float, steps: int | None = None) -> None:
    """`run` ended where the uninterrupted `reference` did: its latest checkpoint's weights and EMA within
    `tolerance`, and (when `steps` is given) its metrics log holds steps 1..steps, each loss within `tolerance`."""
    import torch
    from safetensors.torch import load_file

    from trainer.core.checkpoint import latest_checkpoint
    from trainer.core.checkpoint.export import load_model_weights

    if steps is not None:
        ref_losses, got_losses = train_losses(reference), train_losses(run)
        assert sorted(got_losses) == list(range(1, steps + 1))
        for step, loss in got_losses.items():
            assert abs(loss - ref_losses[step]) <= tolerance, (step, loss, ref_losses[step])
    ref_ckpt, got_ckpt = latest_checkpoint(reference / "checkpoints"), latest_checkpoint(run / "checkpoints")
    for load in (load_model_weights, lambda path: load_file(path / "ema.safetensors")):
        ref, got = load(ref_ckpt), load(got_ckpt)
        assert ref.keys() == got.keys()
        for key in ref:
            torch.testing.assert_close(got[key].float(), ref[key].float(), rtol=0, atol=tolerance, msg=key)


# ---------------------------------------------------------------------------------------------------------------
# Each family's tiny config cut to 3 steps of global batch 4 (2 per device), dropout 0, nothing evaluated or
# checkpointed on the way: the runs that compare layouts (1 vs 2 processes) and devices (CPU vs GPU).
FAMILY_RUNS_COMMON = [
    "run.resume=none", "log.progress_bar=false", "log.tensorboard=false", "log.every_steps=1", "train.max_steps=3",
    "train.epochs=0", "eval.every_steps=0", "eval.every_epochs=0", "eval.sample_every=0", "ckpt.every_steps=0",
    "ckpt.every_epochs=0", "train.ema_decay=0", "train.per_device_batch_size=2", "train.global_batch_size=4",
    "data.num_workers=0"]
FAMILY_RUN_OVERRIDES = {
    "protein_sedd": ["task.max_length=32", "task.val_fraction=0", "task.dropout=0"],
    "molecules_edm": ["task.val_fraction=0", "task.test_fraction=0"],
    "crystal_property": ["data.batching=fixed"],
}
"""What a family's tiny config needs changed for these runs, on top of FAMILY_RUNS_COMMON (most need nothing)."""


def load_script(path: Path, name: str):
    """A script of the repository (scripts/, benchmarks/: not part of the package) imported as module `name`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trainable_families() -> list[str]:
    """This repository's tasks that train from a config of their own: each task whose spec lives in trainer/families,
    but one that post-trains another task's runs (a spec's `aligned_by`, run by `trainer align RUN_DIR`)."""
    from trainer.registry import available_tasks, get_spec

    names = available_tasks()
    aligners = {get_spec(name).aligned_by for name in names}
    return [name for name in names
            if name not in aligners and get_spec(name).config_cls.__module__.startswith("trainer.families.")]


def tiny_configs(configs: Path = ROOT / "configs") -> dict[str, list[str]]:
    """Task name -> its tiny configs under `configs` (`tiny.yaml` or `*_tiny.yaml`, by their `task.name`), relative
    to `configs`."""
    import yaml

    found: dict[str, list[str]] = {}
    for path in sorted(configs.rglob("*.yaml")):
        if path.stem == "tiny" or path.stem.endswith("_tiny"):
            task = (yaml.safe_load(path.read_text()) or {}).get("task") or {}
            if task.get("name"):
                found.setdefault(task["name"], []).append(path.relative_to(configs).as_posix())
    return found


def family_runs(configs: Path = ROOT / "configs") -> dict[str, tuple[str, list[str]]]:
    """Each trainable family with one tiny config: (that config under `configs`, FAMILY_RUN_OVERRIDES' entry). A family
    with none or several is left out here and named by test_adding_a_family.py's test_every_family_has_one_tiny_config."""
    found = tiny_configs(configs)
    return {name: (found[name][0], FAMILY_RUN_OVERRIDES.get(name, []))
            for name in trainable_families() if len(found.get(name, [])) == 1}


FAMILY_RUNS = family_runs()
"""Task name -> (its tiny config under configs/, its overrides on top of FAMILY_RUNS_COMMON), from the registry."""


def task_cache_dir(family: str, cache: Path) -> list[str]:
    """`task.cache_dir=cache` where the family's task has that option (its data cache, one per test), else nothing."""
    import dataclasses

    from trainer.registry import get_spec

    fields = {f.name for f in dataclasses.fields(get_spec(family).config_cls)}
    return [f"task.cache_dir={cache}"] if "cache_dir" in fields else []
DEEPSPEED_FAMILY_OVERRIDES = {"protein_sedd": ["task.val_fraction=0.05"], "molecules_edm": ["task.val_fraction=0.05"],
                              "perturbation_gears": ["train.grad_clip_value=0", "train.grad_clip_norm=1.0"]}
"""On top of FAMILY_RUNS under DeepSpeed: the validation split back where FAMILY_RUNS drops it (so eval and
samples run); GEARS clips by value, which DeepSpeed refuses: by norm here."""


def deepspeed_family_run(family: str, tmp_path: Path, precision: str, steps: int) -> tuple[list[dict], str]:
    """`family`'s FAMILY_RUNS config under ZeRO-2 on one process in `precision` for `steps` steps, evaluated at
    the end (with eval samples where the task generates): (its metrics records, its output)."""
    config, overrides = FAMILY_RUNS[family]
    out = tmp_path / "run"
    proc = run_cmd(accelerate_cmd("zero2.yaml", str(ROOT / "configs" / config), *FAMILY_RUNS_COMMON, *overrides,
                                  *DEEPSPEED_FAMILY_OVERRIDES.get(family, []), f"run.output_dir={out}",
                                  *task_cache_dir(family, tmp_path / "cache"), f"train.mixed_precision={precision}",
                                  f"train.max_steps={steps}", f"eval.every_steps={steps}", "eval.sample_every=1",
                                  "eval.num_samples=2", nproc=1), timeout=600)
    return read_jsonl(out), proc.stdout + proc.stderr

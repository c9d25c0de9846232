"""The launch API (`trainer.api.train`): one process in place, N processes started through
torch.distributed.run, or every rank in place under a launcher; the same `RunResult` either way."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY

from trainer.api import LaunchError, RunResult, train, under_launcher
from trainer.config import load_config
from trainer.core import launch
from trainer.errors import ConfigError

LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "OMP_NUM_THREADS")
# 64 training samples, global batch 32 (2 x 8 x 2 accumulation, or 1 x 16 x 2): 4 steps are 2 epochs.
COMMON = ["task.num_train=64", "task.num_eval=20", "task.num_test=10", "train.max_steps=4", "eval.every_steps=2",
          "eval.test_weights=best", "ckpt.every_steps=2", "log.every_steps=2", "log.progress_bar=false",
          "log.tensorboard=false", "run.resume=none"]


@pytest.fixture
def plain_process(monkeypatch):
    """No launcher variables in the environment (whatever started pytest)."""
    for key in LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("environ, expected", [
    ({}, False),
    ({"WORLD_SIZE": "2", "RANK": "1"}, False),  # set by hand, no launcher: nothing to follow
    ({"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}, True),  # torchrun --nproc_per_node=1
    ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2"}, True),  # torchrun, accelerate
    ({"LOCAL_RANK": "1", "RANK": "3", "WORLD_SIZE": "4"}, True),  # the deepspeed launcher
])
def test_under_launcher_over_environments(environ, expected, monkeypatch, plain_process):
    assert under_launcher(environ) is expected
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert under_launcher() is expected  # the default reads os.environ at call time


class FakeRun:
    """Stands in for the front end (`launch._FrontEnd`): records the launcher's command and environment, writes what
    ranks would."""

    def __init__(self, code: int = 0, preempted: bool = False):
        self.code, self.preempted, self.calls = code, preempted, []
        self.stopped_for = None  # the launcher was not stopped on a recorded failure

    def __call__(self, cmd, env, stop_for=None):
        self.calls.append((cmd, env))
        run_dir = Path(cmd[cmd.index("train") + 1]).parent
        records = [{"step": 0, "event": "start", "world_size": 3}, {"step": 2, "eval/loss": 0.5}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        if self.preempted:
            (run_dir / "preempted.json").write_text('{"step": 2, "signal": "SIGTERM"}')
        return self

    def run(self) -> tuple[int, int]:
        return self.code, 0


def test_launch_command_environment_and_errors(tmp_path, monkeypatch, plain_process):
    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}"])
    fake = FakeRun()
    monkeypatch.setattr(launch, "_FrontEnd", fake)
    monkeypatch.setenv("MASTER_PORT", "29500")
    result = train(cfg, num_processes=3, deepspeed_config="ds.json")
    cmd, env = fake.calls[-1]
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "-m", "trainer", "train",
                       str(tmp_path / "run" / "launch_config.yaml"), "--deepspeed", "ds.json"]
    assert env["OMP_NUM_THREADS"] == "1" and "MASTER_PORT" not in env and "CUDA_VISIBLE_DEVICES" not in env
    assert (result.status, result.world_size, result.eval_metrics, result.main_process) == ("completed", 3,
                                                                                             {"loss": 0.5}, True)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    train(cfg, num_processes=2, gpu_ids=[2, 3])
    cmd, env = fake.calls[-1]
    assert env["OMP_NUM_THREADS"] == "4" and env["CUDA_VISIBLE_DEVICES"] == "2,3" and "--nproc_per_node=2" in cmd
    train(cfg, num_processes=1, gpu_ids=[1])  # gpu_ids: launched even for one process
    assert len(fake.calls) == 3 and fake.calls[-1][1]["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(ConfigError, match=r"num_processes=3 but 2 gpu_ids"):
        train(cfg, num_processes=3, gpu_ids=[0, 1])

    monkeypatch.setattr(launch, "_FrontEnd", FakeRun(code=1))
    with pytest.raises(LaunchError) as err:
        train(cfg, num_processes=2)
    message = str(err.value)
    assert "\n" not in message and "status 1" in message and str(tmp_path / "run" / "metrics.jsonl") in message
    assert isinstance(err.value, RuntimeError)  # what the families raised before
    monkeypatch.setattr(launch, "_FrontEnd", FakeRun(code=1, preempted=True))
    assert train(cfg, num_processes=2).status == "preempted"


def test_under_a_launcher_every_rank_trains_in_place(tmp_path, monkeypatch, plain_process, caplog):
    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}"])
    here = []
    monkeypatch.setattr(launch, "_train_here", lambda c, ds: here.append((c, ds)) or RunResult("completed", tmp_path))
    monkeypatch.setattr(launch, "_FrontEnd", lambda *a, **k: pytest.fail("nothing is launched under a launcher"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING, logger="trainer"):
        train(cfg, num_processes=2)
        assert not caplog.records  # it agrees with the launcher
        train(cfg, num_processes=4)
    assert len(here) == 2 and "WORLD_SIZE=2" in caplog.text and "num_processes=4" in caplog.text
    assert not (tmp_path / "run" / "launch_config.yaml").exists()


@pytest.mark.numerics
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate")
def test_two_launched_processes_and_one_in_place_give_the_same_result(tmp_path, plain_process):
    """The regression `tiny` run on 2 processes train() starts and in this process (the same global batch):
    the same RunResult fields and metrics; launch_config.yaml reproduces the launched config."""
    two = load_config(TINY, [*COMMON, "train.per_device_batch_size=8", f"run.output_dir={tmp_path / 'two'}"])
    one = load_config(TINY, [*COMMON, "train.per_device_batch_size=16", f"run.output_dir={tmp_path / 'one'}"])
    launched, here = train(two, num_processes=2), train(one)
    assert load_config(str(tmp_path / "two" / "launch_config.yaml")) == two
    assert not (tmp_path / "one" / "launch_config.yaml").exists()
    for result, out, world in ((launched, tmp_path / "two", 2), (here, tmp_path / "one", 1)):
        assert (result.status, result.run_dir, result.world_size, result.main_process) == ("completed", out, world, True)
        assert result.eval_metrics["num_samples"] == 20 and result.eval_metrics["num_unique"] == 20
        assert result.test_metrics["num_samples"] == 10 and "weights_step" not in result.test_metrics
        assert result.best_step in (2, 4) and result.test_weights_step == result.best_step
        assert result.best_checkpoint == out / "checkpoints" / f"step_{result.best_step:08d}"
        assert result.latest_checkpoint == out / "checkpoints" / "step_00000004"
        assert result == RunResult.read(out)  # what train returns is what the run directory says
    assert launched.best_step == here.best_step
    for key in ("loss", "mae"):
        assert launched.eval_metrics[key] == pytest.approx(here.eval_metrics[key], rel=1e-4)
        assert launched.test_metrics[key] == pytest.approx(here.test_metrics[key], rel=1e-4)


def test_replicas_log_warnings_only():
    """Under N processes every rank but the main one stays quiet: info lines (a family's ingest line, the
    datasets progress bars) once, from rank 0; a replica's warnings still show."""
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s'); "
            "from trainer.core.distributed import quiet_replica; quiet_replica(); "
            "log = logging.getLogger('trainer.families.some_family.task'); log.info('ingest line'); "
            "log.warning('rank warning'); "
            "from datasets.utils.logging import is_progress_bar_enabled; print('bars', is_progress_bar_enabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["rank", "warning", "bars", "False"]


def test_config_error_is_said_once_per_launch(monkeypatch, capsys):
    """A config error is the same on every rank: rank 0 prints the line, the others only exit with status 2."""
    from trainer.cli import main

    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        assert main(["train", TINY, "train.max_step=3"]) == 2
        err = capsys.readouterr().err
        assert ("Did you mean: train.max_steps?" in err) is printed


def test_deepspeed_op_cache_is_this_environments(tmp_path, monkeypatch):
    """Set-up's build of DeepSpeed's CPU op is the one runs load: the cache is keyed to the Python environment."""
    from trainer.core import deepspeed_ops

    monkeypatch.setattr(deepspeed_ops.sys, "prefix", str(tmp_path / "venv"))
    environ: dict[str, str] = {}
    folder = deepspeed_ops.use_environment_op_cache(environ)
    assert folder == tmp_path / "venv" / "var" / "torch_extensions" and folder.is_dir()
    assert environ["TORCH_EXTENSIONS_DIR"] == str(folder)
    assert deepspeed_ops.use_environment_op_cache({"TORCH_EXTENSIONS_DIR": "/elsewhere"}) == Path("/elsewhere")

"""Every registered task's `tiny` preset through train, resume, eval, export and (where it generates)
sample, in-process on CPU: the contract of trainer/task.py holds for each family."""

import json
import math

import pytest
import torch
from conftest import reset_accelerate

from trainer.config import load_config
from trainer.core.checkpoint.export import consolidated_weights, export_run, load_exported
from trainer.core.generation import sample_run
from trainer.core.trainer import Trainer
from trainer.registry import available_tasks, get_task
from trainer.task import GenerativeTask

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


# The alignment's case draws groups of rollouts through all T steps of a trained-size model: `extended`, with
# tests/families/molecules_edm/test_align_task.py (T = 20) as its lean stand-in for train, resume, export and sample.
CONTRACT_CASES = [pytest.param(name, marks=pytest.mark.extended) if name == "molecules_edm_align" else name
                  for name in available_tasks()]


@pytest.mark.slow
@pytest.mark.parametrize("name", CONTRACT_CASES)
def test_tiny_preset_train_resume_eval_export_sample(name, tmp_path):
    run = tmp_path / "run"
    common = [f"task.name={name}", "task.preset=tiny", f"run.output_dir={run}", "train.epochs=0",
              "eval.every_epochs=0", "eval.every_steps=0", "eval.sample_every=0", "ckpt.every_epochs=0", "ckpt.every_steps=0",
              "train.per_device_batch_size=4", "log.every_steps=1", "log.progress_bar=false", "log.tensorboard=false"]
    task_cls = get_task(name)

    first = Trainer(load_config(None, [*common, "train.max_steps=2"]))
    assert first.fit() == "completed"
    reset_accelerate()

    generative = issubclass(task_cls, GenerativeTask)
    sampling = ["eval.sample_every=1", "eval.num_samples=2"] if generative else []
    resumed = Trainer(load_config(None, [*common, "train.max_steps=3", *sampling]))
    assert resumed.resumed_from is not None and resumed.state.step == 2
    assert resumed.fit() == "completed" and resumed.state.step == 3
    metrics = resumed.last_eval
    assert metrics, "the final evaluation produced no metrics"
    scores = {k for k in metrics if k.startswith("sample_")}
    assert bool(scores) == generative, f"sample metrics at the final eval: {sorted(scores)}"
    undeclared = set(metrics) - set(task_cls.metrics) - scores
    assert not undeclared, f"undeclared metrics {undeclared}"
    assert all(math.isfinite(v) for v in metrics.values())

    manifest_state = json.loads((run / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert "task_stats.json" in manifest_state["artifacts"]
    out = export_run(run)
    for artifact in manifest_state["artifacts"]:
        assert (out.parent / artifact).exists(), artifact
    # The export rebuilds the model from its own file alone (no build_data) and loads strictly, even when
    # another export into the same folder replaced the task_stats.json beside it.
    (out.parent / "task_stats.json").write_text('{"from": "another export"}')
    model, _ = load_exported(out)
    weights, _ = consolidated_weights(run)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, weights[key])
    reset_accelerate()

    if generative:
        samples = tmp_path / "samples" / "out.json"  # a .json out must not be overwritten by the statistics
        stats = sample_run(run, ["num_samples=2", f"out={samples}", "batch_size=2"])
        assert stats["num_samples"] == 2
        stats_file = tmp_path / "samples" / "out.json.stats.json"
        assert json.loads(stats_file.read_text())["num_samples"] == 2
        assert samples.exists()  # a file, or a folder for tasks that write several files
        if samples.is_file():
            assert samples.read_bytes() != stats_file.read_bytes()

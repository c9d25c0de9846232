"""Checks a model family's tests call: the task contract on a registered task's `tiny` preset.

`check_task_contract(name, workdir)` is what `tests/contract/test_contract.py` runs for every registered task, as a
function a family in a package of its own calls from its tests too (`trainer new-family` writes such a test):
train, resume, evaluate, export and (where the task generates) sample, in this process on CPU.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["check_task_contract", "reset_accelerate"]


def reset_accelerate() -> None:
    """Forget accelerate's process-global state, so that the next Trainer in this process builds it afresh."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def check_task_contract(name: str, workdir: str | Path, overrides: Sequence[str] = ()) -> None:
    """Run task `name`'s `tiny` preset (plus `overrides`) through the contract of trainer/task.py in `workdir`; an
    AssertionError says which part failed.

    Two steps, then a resume to a third step with a final evaluation (with samples scored where the task generates):
    the resume starts at step 2 and every metric is finite and declared in the spec. The export rebuilds the model
    from its own files alone and holds the checkpoint's weights; a generative task then samples from the run.
    """
    import torch

    from trainer.config import load_config
    from trainer.core.checkpoint.export import consolidated_weights, export_run, load_exported
    from trainer.core.generation import sample_run
    from trainer.core.trainer import Trainer
    from trainer.registry import get_task
    from trainer.task import GenerativeTask

    workdir = Path(workdir)
    run = workdir / "run"
    common = [f"task.name={name}", "task.preset=tiny", f"run.output_dir={run}", "train.epochs=0",
              "eval.every_epochs=0", "eval.every_steps=0", "eval.sample_every=0", "ckpt.every_epochs=0", "ckpt.every_steps=0",
              "train.per_device_batch_size=4", "log.every_steps=1", "log.progress_bar=false", "log.tensorboard=false",
              *overrides]
    task_cls = get_task(name)
    try:
        first = Trainer(load_config(None, [*common, "train.max_steps=2"]))
        assert first.fit() == "completed", "the first two steps did not complete"
        reset_accelerate()

        generative = issubclass(task_cls, GenerativeTask)
        sampling = ["eval.sample_every=1", "eval.num_samples=2"] if generative else []
        resumed = Trainer(load_config(None, [*common, "train.max_steps=3", *sampling]))
        assert resumed.resumed_from is not None and resumed.state.step == 2, "the second run did not resume at step 2"
        assert resumed.fit() == "completed" and resumed.state.step == 3, "the resumed run did not complete step 3"
        metrics = resumed.last_eval
        assert metrics, "the final evaluation produced no metrics"
        scores = {k for k in metrics if k.startswith("sample_")}
        assert bool(scores) == generative, f"sample metrics at the final eval: {sorted(scores)}"
        undeclared = set(metrics) - set(task_cls.metrics) - scores
        assert not undeclared, f"metrics not declared in the spec's `metrics`: {sorted(undeclared)}"
        assert all(math.isfinite(v) for v in metrics.values()), f"non-finite eval metrics: {metrics}"

        manifest_state = json.loads((run / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
        assert "task_stats.json" in manifest_state["artifacts"], "the checkpoint lists no task_stats.json"
        out = export_run(run)
        for artifact in manifest_state["artifacts"]:
            assert (out.parent / artifact).exists(), f"the export lacks the artifact {artifact}"
        # The export rebuilds the model from its own file alone (no build_data) and loads strictly, even when
        # another export into the same folder replaced the task_stats.json beside it.
        (out.parent / "task_stats.json").write_text('{"from": "another export"}')
        model, _ = load_exported(out)
        weights, _ = consolidated_weights(run)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, weights[key], msg=lambda m, key=key: f"exported {key}: {m}")
        reset_accelerate()

        if generative:
            samples = workdir / "samples" / "out.json"  # a .json out must not be overwritten by the statistics
            stats = sample_run(run, ["num_samples=2", f"out={samples}", "batch_size=2"])
            assert stats["num_samples"] == 2, f"sampling statistics: {stats}"
            stats_file = workdir / "samples" / "out.json.stats.json"
            assert json.loads(stats_file.read_text())["num_samples"] == 2, "the statistics file lacks num_samples=2"
            assert samples.exists(), "no samples written"  # a file, or a folder for tasks that write several files
            if samples.is_file():
                assert samples.read_bytes() != stats_file.read_bytes(), "the statistics overwrote the samples"
    finally:
        reset_accelerate()

"""A pickle payload planted in a DeepSpeed checkpoint (manifest re-signed, as anyone who can write the
checkpoint can do) must not run on export, on sample (the same weight loading) or on resume, for
ZeRO-1/2/3 and offload: DeepSpeed's own files are loaded weights-only too."""

import json
import os

import pytest
import torch
from conftest import accelerate_cmd, run_cmd

from trainer.core import checkpoint as ckpt
from trainer.core.export import consolidated_weights, export_run
from trainer.core.safe_load import weights_only_loading
from trainer.errors import CheckpointError

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# ZeRO-1 writes ZeRO-2's files and offload ZeRO-3's: those two are in the full matrix only (`make test-all`).
STAGES = [pytest.param("zero1.yaml", marks=pytest.mark.extended), "zero2.yaml", "zero3.yaml",
          pytest.param("zero3_offload.yaml", marks=pytest.mark.extended)]
COMMON = ["log.progress_bar=false", "log.tensorboard=false", "train.ema_decay=0"]


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(step_dir, marker):
    """Add the payload to the model-states file and re-sign the manifest."""
    target = next((step_dir / "pytorch_model").glob("*model_states.pt"))
    import deepspeed  # noqa: F401  (its data types join the allow-list once imported)

    with weights_only_loading():  # the file is still clean: weights-only loading reads it
        state = torch.load(target, map_location="cpu", weights_only=True)
    state["payload"] = Payload(str(marker))
    torch.save(state, target)
    saved = json.loads((step_dir / ckpt.STATE).read_text())
    ckpt.write_manifest(step_dir, saved, with_hashes=True)


@pytest.mark.parametrize("stage", STAGES)
def test_planted_pickle_never_runs(tmp_path, stage):
    run, marker = tmp_path / "run", tmp_path / "PWNED"
    run_cmd(accelerate_cmd(stage, "configs/regression/tiny.yaml", f"run.output_dir={run}", "train.max_steps=2",
                           *COMMON, nproc=1), timeout=600)
    plant(ckpt.latest_checkpoint(run / "checkpoints"), marker)

    with pytest.raises(CheckpointError, match=r"refusing to load .*model_states.pt.*posix.system"):
        export_run(run)
    with pytest.raises(CheckpointError, match=r"refusing to load"):
        consolidated_weights(run)  # what `trainer sample` loads the weights with
    resumed = run_cmd(accelerate_cmd(stage, "configs/regression/tiny.yaml", f"run.output_dir={run}",
                                     "train.max_steps=3", *COMMON, nproc=1), timeout=600, expect=None)
    assert resumed.returncode != 0
    assert "refusing to load" in resumed.stdout + resumed.stderr
    assert not marker.exists(), "the planted pickle ran"

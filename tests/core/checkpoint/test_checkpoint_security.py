"""A pickle payload planted in a DeepSpeed checkpoint (manifest re-signed, as anyone who can write the
checkpoint can do) must not run on export, on sample (the same weight loading) or on resume, for
ZeRO-1/2/3 and offload: DeepSpeed's own files are loaded weights-only too."""

import json
import os

import pytest
import torch
from conftest import REGRESSION_LAUNCHES, cut_run_back, run_cmd

from trainer.core.checkpoint import store as ckpt
from trainer.core.checkpoint.export import consolidated_weights, export_run
from trainer.core.checkpoint.safe_load import weights_only_loading
from trainer.errors import CheckpointError

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# ZeRO-1 writes ZeRO-2's files and offload ZeRO-3's: those two are in the full matrix only (`make test-all`).
# The runs are the launch matrix's (tests/conftest.py `regression_runs`, 2 processes), cut back to step 4.
STAGES = [pytest.param("zero1", marks=pytest.mark.extended), "zero2", "zero3",
          pytest.param("zero3_offload", marks=pytest.mark.extended)]


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(step_dir, marker):
    """Add the payload to the model-states file and re-sign the manifest."""
    # The last rank's file under ZeRO-3 (one a rank): only that rank meets the payload on resume.
    target = sorted((step_dir / "pytorch_model").glob("*model_states.pt"))[-1]
    import deepspeed  # noqa: F401  (its data types join the allow-list once imported)

    with weights_only_loading():  # the file is still clean: weights-only loading reads it
        state = torch.load(target, map_location="cpu", weights_only=True)
    state["payload"] = Payload(str(marker))
    torch.save(state, target)
    saved = json.loads((step_dir / ckpt.STATE).read_text())
    ckpt.write_manifest(step_dir, saved, with_hashes=True)


@pytest.mark.parametrize("stage", STAGES)
def test_planted_pickle_never_runs(regression_runs, tmp_path, stage):
    run, marker = cut_run_back(regression_runs(stage), tmp_path / "run", step=4), tmp_path / "PWNED"
    plant(ckpt.latest_checkpoint(run / "checkpoints"), marker)

    with pytest.raises(CheckpointError, match=r"refusing to load .*model_states.pt.*posix.system"):
        export_run(run)
    with pytest.raises(CheckpointError, match=r"refusing to load"):
        consolidated_weights(run)  # what `trainer sample` loads the weights with
    resumed = run_cmd(REGRESSION_LAUNCHES[stage](run, "run.resume=auto"), timeout=600, expect=None)
    assert resumed.returncode != 0
    assert "refusing to load" in resumed.stdout + resumed.stderr
    # Every rank stops at the refusal: none trains on, waiting in a collective until the launcher kills it.
    assert "Unable to shutdown process" not in resumed.stdout + resumed.stderr
    assert not marker.exists(), "the planted pickle ran"

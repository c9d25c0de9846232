"""A stop signal during an evaluation is a stop point: the evaluation ends within a batch or two (the ranks agree on
the batch), its partial metrics are dropped, the step's checkpoint and the preempted marker are written, and a resume
continues from that step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import BIN, ROOT, TINY, child_env, read_jsonl, reset_accelerate, train_losses

from trainer.config import load_config
from trainer.core.checkpoint import latest_checkpoint
from trainer.core.preemption import PREEMPTED_EXIT_CODE
from trainer.core.trainer import Trainer
from trainer.families.regression.task import RegressionTask

pytestmark = pytest.mark.usefixtures("fresh_accelerate")

RUN = ["task.preset=tiny", "task.num_eval=2000", "eval.batch_size=4", "train.max_steps=6", "ckpt.every_steps=1000",
       "log.every_steps=1", "log.progress_bar=false", "log.tensorboard=false"]
SIGNAL_AT_BATCH = 10
"""The evaluation batch whose eval_step sends the signal (of 500 in the split)."""


def evals(run: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run) if any(k.startswith("eval/") for k in r)]


@pytest.mark.parametrize("eval_every, stop_step", [(3, 3), (0, 6)], ids=["in-loop-eval", "final-eval"])
def test_sigterm_during_evaluation_checkpoints_the_step_and_drops_the_partial_eval(tmp_path, monkeypatch, eval_every,
                                                                                   stop_step):
    common = [*RUN, f"eval.every_steps={eval_every}"]
    ref = tmp_path / "ref"
    Trainer(load_config(None, [*common, f"run.output_dir={ref}"])).fit()
    reset_accelerate()

    calls = []
    evaluate_batch = RegressionTask.eval_step

    def eval_step(self, model, batch):
        calls.append(1)
        if len(calls) == SIGNAL_AT_BATCH:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before this returns
        return evaluate_batch(self, model, batch)

    monkeypatch.setattr(RegressionTask, "eval_step", eval_step)
    out = tmp_path / "run"
    cfg = load_config(None, [*common, f"run.output_dir={out}"])
    trainer = Trainer(cfg)
    assert trainer.fit() == "preempted"
    assert len(calls) == SIGNAL_AT_BATCH  # the next batch is not evaluated
    assert trainer.state.step == stop_step
    assert json.loads((out / "preempted.json").read_text()) == {"step": stop_step, "signal": "SIGTERM"}
    assert latest_checkpoint(out / "checkpoints").name == f"step_{stop_step:08d}"
    assert evals(out) == []  # no metrics of a partial evaluation
    assert trainer.accelerator.gradient_state.active_dataloader is None  # the abandoned eval loader unregistered
    monkeypatch.undo()

    reset_accelerate()
    resumed = Trainer(cfg)
    assert resumed.resumed_from is not None and resumed.state.step == stop_step
    assert resumed.fit() == "completed" and resumed.state.step == 6
    assert not (out / "preempted.json").exists()
    assert evals(out) == [6] and train_losses(out) == train_losses(ref)
    assert read_jsonl(out)[-1]["eval/num_samples"] == 2000


STOPPING_RANK = """
import os, signal, sys
from pathlib import Path
from trainer.families.regression.task import RegressionTask

evaluate_batch, calls, rank = RegressionTask.eval_step, [], int(os.environ["RANK"])

def eval_step(self, model, batch):
    calls.append(1)
    Path(sys.argv[1], f"eval_batches_{rank}").write_text(str(len(calls)))
    if rank == 1 and len(calls) == 10:
        os.kill(os.getpid(), signal.SIGTERM)  # this rank alone: the other learns of it from the agreement
    return evaluate_batch(self, model, batch)

RegressionTask.eval_step = eval_step
from trainer.cli import main
sys.exit(main(["train", *sys.argv[2:]]))
"""


@pytest.mark.distributed
def test_a_signal_on_one_rank_stops_every_ranks_evaluation_at_the_same_batch(tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "stopping_rank.py"
    script.write_text(STOPPING_RANK)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path), TINY, *RUN,
           "eval.every_steps=3", f"run.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert json.loads((out / "preempted.json").read_text())["step"] == 3, output[-4000:]
    assert latest_checkpoint(out / "checkpoints").name == "step_00000003"
    batches = [int((tmp_path / f"eval_batches_{rank}").read_text()) for rank in (0, 1)]
    assert batches[0] == batches[1] and 10 <= batches[0] <= 12, batches  # of 250 per rank
    assert evals(out) == []
    assert f"exiting with status {PREEMPTED_EXIT_CODE}" in output, output[-4000:]  # rank 0's line

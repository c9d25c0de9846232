"""Beyond 2 processes: resume anywhere and exactly-once evaluation at 3 and 4 CPU processes (gloo).

The regression task with a global batch of 24 (so 1, 3 and 4 processes all divide it) over 100 training samples (4
steps an epoch, 4 samples left over, different ones each epoch: the shuffled order is the same at any world size, so
the same ones; the DDP runs use the block-window order, data.shuffle_block) and 1001 eval samples in eval batches of
16 (neither 3 nor 4 divides it: every rank's share is padded and the padding dropped). A DDP x4 run (torchrun) is
cut back to its step-4 checkpoint and `trainer train --nproc 3` continues it to step 8; an FSDP x4 run (hidden width
30: uneven shards of each layer over 4 ranks) is resumed by one process. Each ends at the weights of one process
trained on the same global batch, within a few float32 ulps (`ULPS`); the eval loss is one process's within 1e-6
relative.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    BIN,
    TINY,
    TRAIN,
    accelerate_cmd,
    cli_in_process,
    cut_run_back,
    read_jsonl,
    run_cmd,
    train_losses,
)
from safetensors.torch import load_file

from trainer.core.checkpoint import latest_checkpoint
from trainer.core.checkpoint.export import load_model_weights
from trainer.core.samplers import sample_order_name

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RUN = ["task.preset=tiny", "task.num_train=100", "task.num_eval=1001", "eval.batch_size=16", "train.max_steps=8",
       "train.global_batch_size=24", "train.ema_decay=0.9", "eval.every_steps=4", "ckpt.every_steps=4",
       "ckpt.keep_last=5", "log.every_steps=1", "log.progress_bar=false", "log.tensorboard=false", "optim.lr=0.01"]
PER_DEVICE = {1: 8, 3: 8, 4: 6}  # one process accumulates 3 micro-batches of 8 to the global batch of 24
# Sums reduced in another order (per rank, then across ranks; over micro-batches in one process) round differently:
# float32 results then differ by a few units in the last place (ulps). Weights are compared to ULPS ulps of each
# tensor's largest reference value, losses to ULPS ulps of the reference loss.
ULPS = 4


def args(nproc: int, out: Path, *extra: str) -> list[str]:
    return [TINY, *RUN, f"train.per_device_batch_size={PER_DEVICE[nproc]}", f"run.output_dir={out}", *extra]


def torchrun_cmd(nproc: int, out: Path, *extra: str) -> list[str]:
    return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), TRAIN, *args(nproc, out, *extra)]


def start_world_sizes(run_dir: Path) -> list[int]:
    """The world size of each start (a resumed run adds one) in the run's metrics log."""
    return [r["world_size"] for r in read_jsonl(run_dir) if r.get("event") == "start"]


def ulps(value: float) -> float:
    """ULPS float32 units in the last place at `value`'s magnitude."""
    return ULPS * float(np.spacing(np.float32(abs(value))))


def assert_same_run(reference: Path, run: Path) -> None:
    """`run` trained steps 1-8 with the reference's losses and ended at its weights and EMA (ULPS float32 ulps)."""
    ref_losses, got_losses = train_losses(reference), train_losses(run)
    assert sorted(got_losses) == list(range(1, 9)), sorted(got_losses)
    for step, loss in got_losses.items():
        tolerance = ulps(ref_losses[step])
        assert abs(loss - ref_losses[step]) <= tolerance, (run.name, step, loss, ref_losses[step])
    ref_ckpt, got_ckpt = latest_checkpoint(reference / "checkpoints"), latest_checkpoint(run / "checkpoints")
    assert got_ckpt.name == "step_00000008", got_ckpt
    for load in (load_model_weights, lambda path: load_file(path / "ema.safetensors")):
        ref, got = load(ref_ckpt), load(got_ckpt)
        assert ref.keys() == got.keys()
        for key in ref:
            tolerance = ulps(float(ref[key].float().abs().max()))
            torch.testing.assert_close(got[key].float(), ref[key].float(), rtol=0, atol=tolerance,
                                       msg=f"{run.name} {key}")


BLOCK_WINDOW = ("data.shuffle_block=7", "data.shuffle_window=3")
"""The block-window order for the DDP runs (14 blocks of 7 and a partial one of 2, in windows of 3 blocks): the same
global batches at 1, 4 and 3 processes; the FSDP run keeps the full permutation."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One process (in this process); DDP x4 to step 8; that run cut back to step 4 and continued at x3."""
    root = tmp_path_factory.mktemp("many_processes")
    found = {"single": root / "single", "x4": root / "x4"}
    cli_in_process("train", *args(1, found["single"], "run.resume=none", *BLOCK_WINDOW))
    run_cmd(torchrun_cmd(4, found["x4"], "run.resume=none", *BLOCK_WINDOW), timeout=400)
    found["x4_to_x3"] = cut_run_back(found["x4"], root / "x4_to_x3", step=4)
    run_cmd([str(BIN / "trainer"), "train", "--nproc", "3", *args(3, found["x4_to_x3"], "run.resume=auto",
                                                                  *BLOCK_WINDOW)], timeout=400)
    return found


@pytest.mark.numerics
def test_ddp_4_processes_resumed_at_3_trains_what_one_process_trains(runs):
    assert start_world_sizes(runs["x4"]) == [4]
    assert start_world_sizes(runs["x4_to_x3"]) == [4, 3]  # steps 1-4 by 4 processes, 5-8 by 3
    assert_same_run(runs["single"], runs["x4"])
    assert_same_run(runs["single"], runs["x4_to_x3"])
    state = json.loads((latest_checkpoint(runs["x4_to_x3"] / "checkpoints") / "trainer_state.json").read_text())
    assert state["sample_order"] == sample_order_name(7, 3)  # the runs read the block-window order


def test_eval_counts_each_sample_once_where_3_and_4_do_not_divide_the_split(runs):
    """1001 eval samples: at 4 processes (step 4) and 3 (step 8, after the resume) each is evaluated exactly once
    and the eval loss is one process's."""
    reference = {r["step"]: r for r in read_jsonl(runs["single"]) if "eval/loss" in r}
    evals = {r["step"]: r for r in read_jsonl(runs["x4_to_x3"]) if "eval/loss" in r}
    assert sorted(evals) == sorted(reference) == [4, 8]
    for step, record in evals.items():
        assert record["eval/num_samples"] == 1001 and record["eval/num_unique"] == 1001, record
        assert record["eval/loss"] == pytest.approx(reference[step]["eval/loss"], rel=1e-6, abs=0), step


@pytest.mark.numerics
def test_fsdp_4_uneven_shards_resumed_by_one_process(tmp_path):
    """FSDP2 over 4 ranks with layers of width 30 (shards of 8, 8, 8 and 6 rows), stopped after its step-4
    checkpoint (cut back) and continued by one process through the conversion of the sharded checkpoint. Its
    evaluations cover eval.max_samples=333 of the 1001 (4 does not divide it): the same subset as one process's,
    each sample once."""
    uneven = ["task.hidden=30", "eval.max_samples=333"]
    reference, source = tmp_path / "single", tmp_path / "fsdp_x4"
    cli_in_process("train", *args(1, reference, *uneven, "run.resume=none"))
    proc = run_cmd(accelerate_cmd("fsdp.yaml", *args(4, source, *uneven, "run.resume=none"), nproc=4), timeout=400)
    log = proc.stdout + proc.stderr
    found = re.search(r"FSDP shards the model's (\d+) parameter values over 4 processes: (\d+) \+ (\d+) \+ (\d+) \+ "
                      r"(\d+) per rank", log)
    assert found, log[-3000:]
    total, *shares = map(int, found.groups())
    assert sum(shares) == total and len(set(shares)) > 1, shares  # really uneven
    out = cut_run_back(source, tmp_path / "fsdp_x4_to_single", step=4)
    state = json.loads((out / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["backend"] == "FSDP" and state["world_size"] == 4
    cli_in_process("train", *args(1, out, *uneven, "run.resume=auto"))
    assert start_world_sizes(out) == [4, 1]
    assert not list((out / "checkpoints").glob(".universal-*"))  # the conversion's folder is gone
    assert_same_run(reference, out)
    expected = {r["step"]: r for r in read_jsonl(reference) if "eval/loss" in r}
    evals = {r["step"]: r for r in read_jsonl(out) if "eval/loss" in r}  # step 4 by 4 processes, 8 by one
    assert sorted(evals) == sorted(expected) == [4, 8]
    for step, record in evals.items():
        assert record["eval/num_samples"] == 333 and record["eval/num_unique"] == 333, record
        assert record["eval/loss"] == pytest.approx(expected[step]["eval/loss"], rel=1e-6, abs=0), step

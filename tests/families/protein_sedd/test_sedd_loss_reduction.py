"""task.loss_reduction: `token` (ours, per token) and `sequence_sum` (SEDD's batch mean of per-sequence sums)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.families.protein_sedd.spec import ProteinSEDDConfig
from trainer.families.protein_sedd.task import ProteinSEDDTask, collate_crops
from trainer.sample_random import SampleRandom


def _task_and_batch(reduction: str) -> tuple[ProteinSEDDTask, dict, torch.nn.Module]:
    task = ProteinSEDDTask(ProteinSEDDConfig(loss_reduction=reduction, dropout=0.0), seed=0)
    torch.manual_seed(0)
    model = task.build_model({}).eval()
    g = np.random.default_rng(0)
    lengths = [12, 7, 12, 3]  # uneven crops: the two reductions are not a fixed multiple of each other
    batch = collate_crops([{"states": g.integers(0, 20, n), "index": i} for i, n in enumerate(lengths)])
    return task, batch, model


def test_sequence_sum_is_the_mean_of_per_sequence_sums_and_weights_by_sequences():
    losses = {}
    for reduction in ("token", "sequence_sum"):
        task, batch, model = _task_and_batch(reduction)
        losses[reduction] = task.loss(model, batch, SampleRandom([11, 12, 13, 14])).loss
        assert task.batch_weight(batch) == (batch["num_tokens"] if reduction == "token" else 4)
    # the same draws: total / tokens against total / sequences
    total = losses["token"] * batch["num_tokens"]
    torch.testing.assert_close(losses["sequence_sum"], total / 4, rtol=1e-6, atol=0)
    assert losses["sequence_sum"] > 5 * losses["token"]


def test_loss_reduction_is_checked():
    with pytest.raises(ValueError, match="task.loss_reduction must be 'token' or 'sequence_sum', got 'mean'"):
        ProteinSEDDTask(ProteinSEDDConfig(loss_reduction="mean"))

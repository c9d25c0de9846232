"""eval.max_samples: a hash-chosen subset of the validation split, the same at any world size and evaluation,
sharded like the whole split (each sample once); the whole split when 0; the test split never capped."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from accelerate.data_loader import prepare_data_loader
from conftest import (
    ONE_PROCESS,
    ROOT,
    TINY,
    TWO_PROCESSES,
    accelerate_cmd,
    cli_in_process,
    read_jsonl,
    reset_accelerate,
    run_cmd,
)

from trainer.config import ConfigError, load_config
from trainer.core.loaders import balanced_eval_order, build_eval_loader, eval_subset
from trainer.registry import get_task

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def test_whole_split_when_zero_or_not_smaller():
    assert eval_subset(37, 0) is None
    assert eval_subset(37, 37) is None
    assert eval_subset(37, 1000) is None


def test_subset_is_fixed_sorted_unique_and_spread():
    chosen = eval_subset(100_000, 1000)
    assert chosen is not None and len(chosen) == 1000
    assert np.array_equal(chosen, np.unique(chosen))  # ascending, no repeats
    assert 0 <= chosen[0] and chosen[-1] < 100_000
    assert np.array_equal(chosen, eval_subset(100_000, 1000))  # every evaluation, every rank: the same samples
    # Drawn from the whole split, not its head: each tenth of the split holds about a tenth of the subset.
    per_tenth = np.bincount(chosen // 10_000, minlength=10)
    assert per_tenth.min() > 50 and per_tenth.max() < 150
    # An index's hash does not depend on the split's length: a grown split keeps the chosen samples that still win.
    grown = eval_subset(200_000, 1000)
    assert set(grown[grown < 100_000]) <= set(chosen)


def test_negative_is_a_config_error():
    with pytest.raises(ConfigError, match=r"eval\.max_samples' must be >= 0"):
        load_config(TINY, ["eval.max_samples=-1"])
    with pytest.raises(ConfigError, match=r"eval\.max_samples"):
        eval_subset(10, -1)


def evaluated_indices(max_samples: int, world_size: int, batch_size: int = 5, num_eval: int = 37,
                      balanced: bool = False) -> list[int]:
    """The regression eval set's sample indices in the order `gather_for_metrics` returns them, with the loader
    sharded over `world_size` ranks as `accelerator.prepare` shards it (padded to even batches); the padding is cut
    off as gather_for_metrics cuts it, at the split's length."""
    cfg = load_config(TINY, [f"task.num_eval={num_eval}", f"eval.max_samples={max_samples}",
                             f"eval.batch_size={batch_size}", "data.num_workers=0", f"eval.balanced_batches={balanced}"])
    task = get_task(cfg.task.name)(cfg.task, seed=cfg.run.seed)
    task.unit_sizes = lambda dataset: (np.arange(len(dataset)) * 7919) % 13 + 1  # sizes for the balanced order
    loader = build_eval_loader(cfg, task, task.build_data().eval, cfg.train.per_device_batch_size, "eval")
    per_rank = [[batch["index"].tolist() for batch in prepare_data_loader(
        loader, num_processes=world_size, process_index=rank, put_on_device=False)] for rank in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1  # every rank the same number of batches (lock-step)
    gathered = [i for step in zip(*per_rank) for rank_batch in step for i in rank_batch]
    return gathered[:len(loader.dataset)]


def test_subset_same_and_each_sample_once_at_any_world_size():
    expected = eval_subset(37, 20).tolist()
    for world_size in (1, 2, 3):
        got = evaluated_indices(20, world_size)
        assert sorted(got) == expected, world_size  # the same 20 samples, each exactly once


def test_zero_evaluates_the_whole_split_at_any_world_size():
    for world_size in (1, 2, 3):
        assert sorted(evaluated_indices(0, world_size)) == list(range(37))


def test_balanced_batches_evaluate_each_sample_once_at_any_world_size():
    """eval.balanced_batches reorders the split (the whole one or the hash-chosen subset) and nothing else."""
    for world_size in (1, 2, 3):
        whole = evaluated_indices(0, world_size, balanced=True)
        assert sorted(whole) == list(range(37)) and whole != list(range(37)), world_size
        assert sorted(evaluated_indices(20, world_size, balanced=True)) == eval_subset(37, 20).tolist()


def test_balanced_order_evens_the_batches():
    sizes = np.clip(np.random.default_rng(0).lognormal(np.log(8), 0.7, 50_003).round(), 1, 64).astype(np.int64)
    for batch in (1, 16, 50_003, 60_000):
        order = balanced_eval_order(sizes, batch)
        assert np.array_equal(np.sort(order), np.arange(len(sizes))), batch  # a permutation
    order = balanced_eval_order(sizes, 16)
    full = sizes[order][:len(sizes) // 16 * 16].reshape(-1, 16).sum(axis=1)
    by_index = sizes[:len(full) * 16].reshape(-1, 16).sum(axis=1)
    assert full.max() <= 1.25 * full.mean()  # the largest batch near the average one
    assert by_index.max() > 1.5 * by_index.mean()  # where index order's largest batch is not
    assert np.array_equal(order, balanced_eval_order(sizes, 16))


def test_start_log_says_how_many_of_how_many(caplog):
    with caplog.at_level(logging.INFO, logger="trainer"):
        evaluated_indices(20, 1)
    assert "eval: 20 of the 37 validation samples" in caplog.text


def test_run_caps_eval_but_not_test(tmp_path):
    """A run evaluates max_samples validation samples at every evaluation, and the whole test split."""
    cli_in_process("train", TINY, "task.num_eval=37", "task.num_test=30", "eval.max_samples=20", "eval.batch_size=5",
                   "train.max_steps=2", "eval.every_steps=1", "log.progress_bar=false", "log.tensorboard=false",
                   f"run.output_dir={tmp_path}")
    records = read_jsonl(tmp_path)
    evals = [r for r in records if "eval/num_samples" in r]
    assert [r["step"] for r in evals] == [1, 2]
    assert all(r["eval/num_samples"] == r["eval/num_unique"] == 20 for r in evals)
    test = next(r for r in records if "test/num_samples" in r)
    assert test["test/num_samples"] == test["test/num_unique"] == 30


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_evaluate_the_same_subset_as_one(tmp_path):
    """DDP on 2 processes: the eval metrics over the capped split are those of one process (same global batch,
    same weights): the same samples, each once."""
    common = ["train.max_steps=2", "eval.every_steps=0", "eval.max_samples=20", "ckpt.every_steps=0"]
    run_cmd(accelerate_cmd("ddp.yaml", TINY, *TWO_PROCESSES, *common, f"run.output_dir={tmp_path / 'two'}"), timeout=400)
    cli_in_process("train", TINY, *ONE_PROCESS, *common, f"run.output_dir={tmp_path / 'one'}")
    final = {}
    for name in ("one", "two"):
        final[name] = next(r for r in reversed(read_jsonl(tmp_path / name)) if "eval/num_samples" in r)
        assert final[name]["eval/num_samples"] == final[name]["eval/num_unique"] == 20
    assert final["two"]["eval/loss"] == pytest.approx(final["one"]["eval/loss"], abs=1e-5)


def protein_eval_values(tmp_path, *overrides: str) -> tuple[dict[int, float], int]:
    """Per-sequence eval NELBO by sequence index of the streaming protein SEDD config before training, and the size
    of the eval set the loader holds."""
    from trainer.core.trainer import Trainer

    cfg = load_config(str(ROOT / "configs" / "protein_sedd" / "sedd_tiny.yaml"),
                      [f"run.output_dir={tmp_path}", "log.progress_bar=false", "log.tensorboard=false",
                       f"task.cache_dir={tmp_path / 'cache'}", "task.eval_draws=2", "task.streaming=true", *overrides])
    trainer = Trainer(cfg)
    seen: dict[str, torch.Tensor] = {}
    reduce = trainer.task.reduce_metrics

    def keep(values):
        seen.update(values)
        return reduce(values)

    trainer.task.reduce_metrics = keep
    trainer.evaluate()
    values = dict(zip(seen["index"].tolist(), seen["nelbo_sum"].tolist()))
    return values, len(trainer.eval_loader.dataset)


def test_protein_streaming_eval_subset_keeps_each_sequences_own_randomness(tmp_path):
    """protein SEDD streams its training set but its validation split is map-style: the cap applies, and a capped
    sequence's NELBO (its diffusion times drawn from its own index) is what the whole-split evaluation gives it."""
    whole, size = protein_eval_values(tmp_path / "whole", "eval.batch_size=32")
    reset_accelerate()
    capped, capped_size = protein_eval_values(tmp_path / "capped", "eval.max_samples=20", "eval.batch_size=7")
    assert capped_size == 20 < size == len(whole)
    assert sorted(capped) == eval_subset(size, 20).tolist()
    for index, nelbo in capped.items():
        assert nelbo == pytest.approx(whole[index], rel=1e-5), index

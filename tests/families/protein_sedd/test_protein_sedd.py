"""The protein_sedd task: training lowers the validation NELBO, crops are reproducible, eval is
exact-once and batch-size invariant, and the task runs under 2-process DDP."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from conftest import BIN, ROOT, accelerate_cmd, cli_in_process, free_port, read_jsonl, reset_accelerate, run_cmd

from trainer.config import load_config
from trainer.core.samplers import KeyedSamples
from trainer.core.trainer import Trainer
from trainer.families.protein_sedd.task import NUM_RESIDUES, PAD_STATE, collate_crops

CONFIG = str(ROOT / "configs" / "protein_sedd" / "sedd_tiny.yaml")


def make(tmp_path, *overrides):
    """The main job's config with 2 eval draws per sequence (its 8 cost 4x the eval time; the mechanics are the same)."""
    cfg = load_config(CONFIG, [f"run.output_dir={tmp_path}", "log.progress_bar=false", "log.tensorboard=false",
                               f"task.cache_dir={tmp_path / 'cache'}", "task.eval_draws=2", *overrides])
    return Trainer(cfg)


@pytest.mark.usefixtures("fresh_accelerate")
def test_tiny_training_lowers_validation_nelbo(tmp_path):
    trainer = make(tmp_path, "train.max_steps=120", "eval.every_steps=0", "ckpt.every_steps=0", "train.ema_decay=0")
    before = trainer.evaluate()
    trainer.fit()
    after = trainer.last_eval
    assert after["nelbo_per_token"] < before["nelbo_per_token"] - 0.3
    assert after["num_sequences"] == after["num_unique"] == len(trainer.eval_loader.dataset)
    # The unigram baseline is reported next to the bound (training frequencies scored on the eval residues).
    assert 15 < after["unigram_perplexity"] < 21


@pytest.mark.usefixtures("fresh_accelerate")
def test_no_validation_sequences_trains_without_eval_and_checkpoints(tmp_path, caplog):
    """val_fraction=0: no eval set; the run completes and checkpoints (it used to fail at the final eval)."""
    caplog.set_level(logging.INFO, logger="trainer.families.protein_sedd.task")
    trainer = make(tmp_path, "task.val_fraction=0", "train.max_steps=2", "eval.every_steps=1", "log.every_steps=1",
                   "ckpt.every_steps=0", "train.per_device_batch_size=4")
    assert trainer.eval_loader is None
    assert "no validation sequences (task.val_fraction=0.0): no evaluation" in caplog.text
    assert trainer.fit() == "completed"
    assert (tmp_path / "checkpoints" / "step_00000002" / "manifest.json").is_file()
    assert json.loads((tmp_path / "checkpoints" / "step_00000002" / "task_stats.json").read_text())["length_histogram"]


@pytest.mark.usefixtures("fresh_accelerate")
def test_eval_nelbo_does_not_depend_on_batch_size(tmp_path):
    a = make(tmp_path / "a", "eval.batch_size=32").evaluate()
    reset_accelerate()
    b = make(tmp_path / "b", "eval.batch_size=7").evaluate()
    assert a["nelbo_per_token"] == pytest.approx(b["nelbo_per_token"], rel=1e-5)


@pytest.mark.usefixtures("fresh_accelerate")
def test_crops_are_reproducible_per_epoch_and_valid(tmp_path):
    trainer = make(tmp_path)
    train = trainer.train_loader.dataset
    assert isinstance(train, KeyedSamples) and train.epoch_aware
    crops = train.dataset
    long_ones = [i for i in range(len(crops)) if len(crops.ids[i]["input_ids"]) > 3 * crops.max_length][:5]
    for i in long_ones:
        first, again = crops.get_item(i, epoch=3)["states"], crops.get_item(i, epoch=3)["states"]
        assert np.array_equal(first, again) and len(first) == crops.max_length
    assert any(not np.array_equal(crops.get_item(i, 0)["states"], crops.get_item(i, 1)["states"]) for i in long_ones)
    batch = collate_crops([crops.get_item(i) for i in range(8)])
    real = batch["states"][batch["mask"]]
    assert real.min() >= 0 and real.max() < NUM_RESIDUES
    assert (batch["states"][~batch["mask"]] == PAD_STATE).all()
    assert batch["num_tokens"] == int(batch["mask"].sum())


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """12 steps of the main job's config (crops of 24, dropout 0.1, 2 loader workers), checkpoints at 6 and 12,
    trained in this process: the resume test's reference and the sampling test's model."""
    root = tmp_path_factory.mktemp("sedd")
    cli_in_process("train", *RESUME_RUN, f"task.cache_dir={root / 'cache'}", f"run.output_dir={root / 'run'}")
    return root


RESUME_RUN = [CONFIG, "train.max_steps=12", "ckpt.every_steps=6", "ckpt.keep_last=5", "eval.every_steps=0",
              "log.every_steps=1", "log.progress_bar=false", "task.dropout=0.1", "task.max_length=24",
              "data.num_workers=2"]


@pytest.mark.distributed
@pytest.mark.slow
def test_sampling_same_sequences_with_one_and_two_processes(trained_run, tmp_path):
    run = trained_run / "run"
    one, two = tmp_path / "one.fasta", tmp_path / "two.fasta"
    cli_in_process("sample", str(run), f"out={one}", "num_samples=7", "steps=12")
    run_cmd([str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs" / "ddp.yaml"),
             "--main_process_port", str(free_port()), "-m", "trainer", "sample", str(run), f"out={two}",
             "batch_size=2", "num_samples=7", "steps=12"])
    assert one.read_text() == two.read_text()
    assert list((run / "tb" / "trainer_samples").glob("events.out.tfevents.*"))  # the run's TensorBoard gets them
    records = one.read_text().split(">")[1:]
    assert len(records) == 7
    lengths = []
    for record in records:
        header, *lines = record.strip().splitlines()
        seq = "".join(lines)
        assert set(seq) <= set("ACDEFGHIKLMNPQRSTVWYXBZUO")  # residues only, never mask or padding
        assert header.endswith(f"length={len(seq)}")
        lengths.append(len(seq))
    stats = json.loads(one.with_name("one.fasta.stats.json").read_text())  # beside the samples, not over them
    assert stats["num_samples"] == 7 and sum(stats["lengths"]["histogram"].values()) == 7
    assert stats["kl_samples_to_training"] >= 0
    # The tokenizer travels with every checkpoint and export.
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(run / "checkpoints" / "step_00000012" / "tokenizer"))
    assert tokenizer("MKV")["input_ids"] == [16, 14, 23]
    export = tmp_path / "export"
    cli_in_process("export", str(run), "--out", str(export / "model.safetensors"))
    assert (export / "tokenizer" / "tokenizer.json").is_file()
    assert "length_histogram" in json.loads((export / "task_stats.json").read_text())
    fixed = tmp_path / "fixed.fasta"
    cli_in_process("sample", str(run), f"out={fixed}", "num_samples=3", "length=17", "steps=8", "sampler=euler")
    assert all(len("".join(r.strip().splitlines()[1:])) == 17 for r in fixed.read_text().split(">")[1:])


@pytest.mark.slow
def test_resume_reproduces_crops_and_noise_exactly(trained_run, tmp_path):
    """Resuming from a mid-run checkpoint ends bit-identical: random crops (seed, epoch, index), the
    diffusion times and corruption (keyed by sample) and dropout (the rank's RNG) all replay exactly."""
    from safetensors.torch import load_file

    ref, resumed = trained_run / "run", tmp_path / "resumed"
    cli_in_process("train", *RESUME_RUN, f"task.cache_dir={trained_run / 'cache'}", f"run.output_dir={resumed}",
                   f"run.resume={ref / 'checkpoints' / 'step_00000006'}")
    a = load_file(ref / "checkpoints" / "step_00000012" / "model.safetensors")
    b = load_file(resumed / "checkpoints" / "step_00000012" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = {r["step"]: r["loss"] for r in read_jsonl(ref) if "loss" in r}
    assert {r["step"]: r["loss"] for r in read_jsonl(resumed) if "loss" in r} == {s: losses[s] for s in range(7, 13)}


def test_all_protein_configs_load():
    for name in ("protein_sedd/sedd_tiny.yaml", "protein_sedd/sedd_small.yaml", "protein_sedd/sedd_uniref50.yaml"):
        cfg = load_config(str(ROOT / "configs" / name))
        assert cfg.task.name == "protein_sedd"


@pytest.mark.usefixtures("fresh_accelerate")
def test_streaming_mode_trains_with_workers(tmp_path):
    trainer = make(tmp_path, "task.streaming=true", "data.num_workers=2", "train.max_steps=6", "eval.every_steps=0",
                   "ckpt.every_steps=3", "log.every_steps=3")
    assert trainer.streaming
    trainer.fit()
    assert np.isfinite(trainer.last_eval["nelbo_per_token"])
    state = (tmp_path / "checkpoints" / "step_00000003" / "trainer_state.json").read_text()
    batch = trainer.plan.per_device_batch_size * trainer.plan.grad_accum_steps
    assert json.loads(state)["data_position"] == [0, 3 * batch]  # (epoch, global samples read)


@pytest.mark.distributed
@pytest.mark.slow
def test_token_budget_batching_two_processes_resumes_exactly_across_epochs(tmp_path):
    """Length-bucketed token-budget batches under 2-process DDP: a run resumed after the first epoch
    boundary (budget plans differ in length per epoch) ends bit-identical to the uninterrupted one. Its
    evaluations score every validation sequence once."""
    from safetensors.torch import load_file

    common = [CONFIG, "train.max_steps=22", "ckpt.every_steps=20", "ckpt.keep_last=5", "eval.every_steps=10",
              "log.every_steps=1", "log.progress_bar=false", "task.max_length=24", "data.batching=budget",
              "data.max_units_per_batch=2048", "train.ema_decay=0", f"task.cache_dir={tmp_path / 'cache'}"]
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    run_cmd(accelerate_cmd("ddp.yaml", *common, f"run.output_dir={ref}"))
    records = read_jsonl(ref)
    assert max(r["epoch"] for r in records if "loss" in r) > 1.0  # the run crossed an epoch boundary
    assert next(r for r in records if r.get("event") == "start")["world_size"] == 2
    evals = [r for r in records if "eval/nelbo_per_token" in r]
    assert [r["step"] for r in evals] == [10, 20, 22]
    assert all(r["eval/num_sequences"] == r["eval/num_unique"] for r in evals)
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
    assert any("tokens_per_s" in r for r in records)
    run_cmd(accelerate_cmd("ddp.yaml", *common, f"run.output_dir={resumed}",
                           f"run.resume={ref / 'checkpoints' / 'step_00000020'}"))
    a = load_file(ref / "checkpoints" / "step_00000022" / "model.safetensors")
    b = load_file(resumed / "checkpoints" / "step_00000022" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert {r["step"]: r["loss"] for r in read_jsonl(resumed) if "loss" in r} == {21: losses[21], 22: losses[22]}


@pytest.mark.usefixtures("fresh_accelerate")
def test_packing_joins_every_training_sequence_once_with_separators(tmp_path):
    from trainer.families.protein_sedd.task import SEP_STATE, PackedBlocks, residue_states

    trainer = make(tmp_path, "task.packing=true", "train.max_steps=3", "eval.every_steps=0", "log.every_steps=1",
                   "train.ema_decay=0")
    blocks = trainer.data.dataset
    assert isinstance(blocks, PackedBlocks) and trainer.task.graph.dim == NUM_RESIDUES + 3  # pad, sep, mask
    stream = np.concatenate([blocks[i]["states"] for i in range(len(blocks))])
    assert not np.any(stream == PAD_STATE)  # packing leaves no padding
    from collections import Counter

    from trainer.families.protein_sedd.dataset import build_fasta_dataset, tokenize_dataset

    train, _ = build_fasta_dataset(str(ROOT / "trainer/families/protein_sedd/samples/uniprot_sample_3k.fasta.gz"),
                                   split="train",
                                   cache_dir=str(tmp_path / "cache"), val_fraction=0.05)
    want = Counter(tuple(residue_states(np.asarray(x)).tolist()) for x in tokenize_dataset(train)["input_ids"])
    seps = np.flatnonzero(stream == SEP_STATE)
    pieces = np.split(stream, seps)  # the first piece, then pieces that each start with a separator
    complete = Counter([tuple(pieces[0].tolist())] + [tuple(p[1:].tolist()) for p in pieces[1:-1]])
    missing = want - complete
    assert not (complete - want)  # every complete piece is a training sequence, none twice
    assert sum(missing.values()) <= 1  # only the one cut by the last block boundary
    tail = tuple(stream[seps[-1] + 1:].tolist())
    assert all(seq[:len(tail)] == tail for seq in missing)
    assert trainer.fit() == "completed"
    assert all(np.isfinite(r["loss"]) for r in read_jsonl(tmp_path) if "loss" in r)


def test_training_windows_start_at_the_first_residue_with_the_asked_share():
    from trainer.families.protein_sedd.task import crop_start

    def starts(share, n=400, length=300, max_length=64):
        return [crop_start(np.random.default_rng(i), length, max_length, share) for i in range(n)]

    # share 0 draws exactly the uniform window of earlier versions (a resumed old run crops the same)
    assert starts(0.0) == [int(np.random.default_rng(i).integers(0, 300 - 64 + 1)) for i in range(400)]
    assert set(starts(1.0)) == {0}
    at_start = sum(s == 0 for s in starts(0.5)) / 400
    assert 0.4 < at_start < 0.6
    assert crop_start(np.random.default_rng(0), 50, 64, 0.0) == 0  # shorter than a window: whole


def test_eval_times_are_stratified_per_sequence_and_the_unigram_is_scored_on_the_same_residues(tmp_path, monkeypatch):
    """Each eval sequence gets eval_draws diffusion times, one per stratum of (eps, 1), all from its own
    generator; unigram_perplexity is the training frequencies' cross-entropy on the eval residues."""
    import math

    import trainer.families.protein_sedd.task as task_module
    from trainer.registry import get_task

    cfg = load_config(CONFIG, [f"task.cache_dir={tmp_path / 'cache'}", "task.eval_draws=4", "task.max_length=32"])
    task = get_task("protein_sedd")(cfg.task, seed=0)
    data = task.build_data()
    task.attach_stats(data.stats)
    model = task.build_model(data.stats).eval()
    times = []

    def recording(*args, t=None, **kwargs):
        times.append(t.clone())
        return task_module.score_entropy_loss.__wrapped__(*args, t=t, **kwargs)

    recording.__wrapped__ = task_module.score_entropy_loss
    monkeypatch.setattr(task_module, "score_entropy_loss", recording)
    batch = collate_crops([data.eval[i] for i in range(6)])
    with torch.no_grad():
        values = task.eval_step(model, batch)
    eps = cfg.task.sampling_eps
    strata = torch.floor((torch.stack(times) - eps) / (1 - eps) * 4)  # [draw, sequence]
    assert torch.equal(strata, torch.arange(4.0)[:, None].expand(4, 6))
    with torch.no_grad():
        again = task.eval_step(model, collate_crops([data.eval[i] for i in (5, 4, 3)]))  # other batch, same rows
    assert torch.allclose(again["nelbo_sum"], values["nelbo_sum"][[5, 4, 3]])
    log_q = np.asarray(data.stats["unigram_log_probs"])
    residues = np.concatenate([data.eval[i]["states"] for i in range(6)])
    metrics = task.reduce_metrics(values)
    assert metrics["unigram_perplexity"] == pytest.approx(math.exp(-log_q[residues].mean()), rel=1e-6)
    assert metrics["num_sequences"] == 6
    assert task.baselines == {"perplexity_bound": "unigram_perplexity"}

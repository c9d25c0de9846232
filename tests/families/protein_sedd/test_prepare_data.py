"""`trainer data prepare CONFIG` builds the protein task's caches once (Arrow shards, split selections, the
statistics sidecar); a run with the same overrides then rebuilds and recounts nothing. The statistics read
from the sidecar are the ones counted from the training split, and a run that has to convert says how to
do it ahead of the job."""

from __future__ import annotations

import json
import logging
import pickle

import numpy as np
import pytest
from conftest import ROOT, cli_in_process

from trainer.config import load_config
from trainer.data.arrow_cache import column_array
from trainer.families.protein_sedd import task as protein_task
from trainer.families.protein_sedd.dataset import build_fasta_dataset, select_split, tokenize_dataset
from trainer.families.protein_sedd.task import PackedBlocks, ProteinSEDDTask, residue_counts, task_statistics

CONFIG = str(ROOT / "configs" / "protein_sedd" / "sedd_tiny.yaml")


def cache_files(cache):
    """path -> mtime of every cache file (the lock file is rewritten by every build: left out)."""
    return {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file() and not p.name.startswith(".build-")}


def test_prepare_then_train_rebuilds_and_recounts_nothing(tmp_path, monkeypatch, capsys, caplog):
    cache = tmp_path / "cache"
    caplog.set_level(logging.INFO, logger="trainer.families.protein_sedd.task")
    cli_in_process("data", "prepare", CONFIG, f"task.cache_dir={cache}")
    assert "not prepared" not in caplog.text  # prepare does not advise running prepare
    caplog.clear()
    printed = capsys.readouterr().out
    assert "records: train 2,837, validation 163" in printed and f"cache:   {cache} (4 files, " in printed
    built = cache_files(cache)
    assert any(p.suffix == ".arrow" for p in built) and any(p.parent.name == "protein_stats" for p in built)

    counted = []
    monkeypatch.setattr(protein_task, "residue_counts", lambda ds: counted.append(ds) or residue_counts(ds))
    run = tmp_path / "run"
    cli_in_process("train", CONFIG, f"task.cache_dir={cache}", f"run.output_dir={run}", "train.max_steps=2",
                   "eval.every_steps=0", "ckpt.every_steps=0", "task.eval_draws=1", "log.progress_bar=false",
                   "log.tensorboard=false")
    assert cache_files(cache) == built  # no shard or selection written or rewritten
    assert counted == []  # the statistics read from the sidecar, not counted
    assert "not prepared" not in caplog.text
    saved = json.loads(next(run.glob("checkpoints/*/task_stats.json")).read_text())
    assert saved == direct_statistics(cache, max_length=128)


def direct_statistics(cache, max_length: int) -> dict:
    """The statistics counted from the training split (what every rank used to compute itself)."""
    t = load_config(CONFIG).task
    records, _ = build_fasta_dataset(str(protein_task.default_protein_fasta()), cache_dir=str(cache),
                                     val_fraction=t.val_fraction, min_length=t.min_length, nonstandard=t.nonstandard)
    train = tokenize_dataset(select_split(records, "train"))
    lengths, counts = np.unique(np.minimum(column_array(train, "length"), max_length), return_counts=True)
    return task_statistics(residue_counts(train), dict(zip(lengths.tolist(), counts.tolist())))


@pytest.mark.parametrize("override, named", [("task.max_lenght=64", "max_length"),
                                             ("task.data_path=/no/such/uniref.fasta", "/no/such/uniref.fasta")])
def test_prepare_with_bad_input_is_one_clear_line(tmp_path, capsys, override, named):
    from trainer.cli import main

    assert main(["data", "prepare", CONFIG, f"task.cache_dir={tmp_path}", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainer: ") and named in err and len(err.splitlines()) == 1


def test_without_cache_dir_the_caches_go_beside_the_build_lock(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path))
    cli_in_process("data", "prepare", CONFIG, "task.cache_dir=")
    assert f"cache:   {tmp_path} (4 files" in capsys.readouterr().out
    assert {p.parent.name for p in cache_files(tmp_path)} == {"fasta_arrow", "fasta_stats", "protein_stats"}
    assert (tmp_path / ".build-protein_sedd.lock").is_file()


def build(cache, *overrides):
    cfg = load_config(CONFIG, [f"task.cache_dir={cache}", *overrides])
    return ProteinSEDDTask(cfg.task, seed=0).build_data()


@pytest.mark.parametrize("max_length", [128, 1024])
def test_statistics_from_the_sidecar_equal_the_counted_ones(tmp_path, monkeypatch, max_length):
    first = build(tmp_path, f"task.max_length={max_length}").stats
    monkeypatch.setattr(protein_task, "residue_counts", lambda ds: pytest.fail("counted again"))
    again = build(tmp_path, f"task.max_length={max_length}").stats
    assert again == first == direct_statistics(tmp_path, max_length)
    monkeypatch.undo()
    other = build(tmp_path, "task.max_length=64").stats  # another max_length: its own sidecar
    assert max(map(int, other["length_histogram"])) == 64 != max(map(int, first["length_histogram"]))


def test_streaming_statistics_come_from_the_validation_split_and_are_kept(tmp_path, monkeypatch):
    first = build(tmp_path, "task.streaming=true").stats
    monkeypatch.setattr(protein_task, "residue_counts", lambda ds: pytest.fail("counted again"))
    assert build(tmp_path, "task.streaming=true").stats == first
    t = load_config(CONFIG).task
    records, _ = build_fasta_dataset(str(protein_task.default_protein_fasta()), cache_dir=str(tmp_path),
                                     val_fraction=t.val_fraction, min_length=t.min_length, nonstandard=t.nonstandard)
    val = tokenize_dataset(select_split(records, "validation"))
    assert first["train_composition"] == (residue_counts(val) / residue_counts(val).sum()).tolist()


def test_a_run_that_converts_warns_once_naming_the_file_and_the_command(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(protein_task, "PREPARE_WARN_BYTES", 0)  # the bundled sample counts as big
    caplog.set_level(logging.WARNING, logger="trainer.families.protein_sedd.task")
    build(tmp_path)
    warnings = [r.getMessage() for r in caplog.records if "trainer data prepare CONFIG" in r.getMessage()]
    assert len(warnings) == 1 and "uniprot_sample_3k.fasta.gz (1.0 MB)" in warnings[0]
    caplog.clear()
    build(tmp_path)
    assert "trainer data prepare" not in caplog.text


def owned_bytes(obj) -> int:
    """Bytes of the numpy arrays in an object's __dict__ (lists of them too) that it owns: not views of Arrow buffers."""
    total = 0
    for value in vars(obj).values():
        arrays = value if isinstance(value, list) else [value]
        total += sum(a.nbytes for a in arrays if isinstance(a, np.ndarray) and a.flags.owndata)
    return total


def test_packed_blocks_hold_twelve_bytes_per_sequence(tmp_path):
    records, _ = build_fasta_dataset(str(protein_task.default_protein_fasta()), cache_dir=str(tmp_path))
    train = tokenize_dataset(select_split(records, "train"))  # a selection, as in a run
    packed = PackedBlocks(train, 64, seed=0)
    # the table row (int32) and the end (int64) of each sequence; the row reader's arrays view the Arrow buffers
    assert packed.rows.dtype == np.int32 and packed.ends.dtype == np.int64
    assert owned_bytes(packed) + owned_bytes(packed._column) <= 12 * len(train) + 1024
    assert len(pickle.dumps(packed)) <= 12 * len(train) + 4096  # what a spawned DataLoader worker receives
    sizes = ProteinSEDDTask.unit_sizes(None, packed)  # data.batching=budget: 4 bytes a block
    assert sizes.dtype == np.int32 and len(sizes) == len(packed) and set(sizes.tolist()) == {64}


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_first_build_derives_the_statistics_from_the_conversion_without_a_pass(tmp_path, monkeypatch, streaming):
    """The sidecar is written from the per-split sums the conversion counted: the training (streaming: validation)
    rows are not read again, and the values are those of a direct count (lengths above max_length folded)."""
    for name in ("residue_counts", "column_array"):
        monkeypatch.setattr(protein_task, name, lambda *a, **k: pytest.fail("a pass over the data"))
    stats = build(tmp_path, "task.max_length=128", f"task.streaming={str(streaming).lower()}").stats
    monkeypatch.undo()
    if not streaming:
        assert stats == direct_statistics(tmp_path, max_length=128)
        return
    t = load_config(CONFIG).task
    records, _ = build_fasta_dataset(str(protein_task.default_protein_fasta()), cache_dir=str(tmp_path),
                                     val_fraction=t.val_fraction, min_length=t.min_length, nonstandard=t.nonstandard)
    val = tokenize_dataset(select_split(records, "validation"))
    lengths, counts = np.unique(np.minimum(column_array(val, "length"), 128), return_counts=True)
    assert stats == task_statistics(residue_counts(val), dict(zip(lengths.tolist(), counts.tolist())))

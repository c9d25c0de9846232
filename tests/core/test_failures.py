"""Failures that must not surprise: a full disk during an export or a checkpoint save, checkpoint
folders that a resume passes over, exports that differed byte-wise. A full disk is simulated (no root for a
small tmpfs): writes that fill up and then fail as Python, torch's zip writer and safetensors report it."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import reset_accelerate
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from trainer import cli, disk_space
from trainer.config import load_config
from trainer.core.checkpoint import export, writer
from trainer.core.checkpoint import store as ckpt
from trainer.core.trainer import Trainer
from trainer.disk_space import disk_bytes, format_bytes, no_space_reason
from trainer.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("fresh_accelerate")

QUIET = ["log.progress_bar=false", "log.tensorboard=false"]
STEPS = ["train.max_steps=6", "ckpt.every_steps=2", "ckpt.keep_last=5", "train.ema_decay=0.9"]
SIZE = r"\d+(\.\d)? (B|KiB|MiB|GiB)"


def make(out: Path, *overrides: str) -> Trainer:
    return Trainer(load_config(None, ["task.preset=tiny", f"run.output_dir={out}", *QUIET, *overrides]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One tiny run with checkpoints at steps 2, 4 and 6 (and EMA), trained once for this module."""
    run = tmp_path_factory.mktemp("trained") / "run"
    make(run, *STEPS).fit()
    reset_accelerate()
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run that a test may damage."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (hidden ones too: a temp file left behind shows)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


class FillingFile:
    """A file on a disk with `room` bytes left: a write beyond them writes what fits, then fails as the OS does."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self.room:
            self.file.write(data[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def __getattr__(self, name):
        return getattr(self.file, name)


# ---------------------------------------------------------------- a) export onto a full disk

def fill_model_write(monkeypatch) -> None:
    monkeypatch.setattr(export, "open", lambda path, mode="r": FillingFile(open(path, mode), room=1000),
                        raising=False)


def fill_config_copy(monkeypatch) -> None:
    real = shutil.copyfile

    def copyfile(src, dst, **kwargs):
        if str(src).endswith("config.yaml"):  # as shutil reports a full disk: naming the source
            Path(dst).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src), None, str(dst))
        return real(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", copyfile)


@pytest.mark.parametrize("fill, written", [(fill_model_write, "model.safetensors"),
                                           (fill_config_copy, "model.config.yaml")])
def test_export_onto_a_full_disk_is_one_line_and_keeps_the_previous_export(run, tmp_path, monkeypatch, capsys,
                                                                           fill, written):
    out = tmp_path / "export" / "model.safetensors"
    assert cli.main(["export", str(run), "--out", str(out)]) == 0
    before = hashes(out.parent)
    fill(monkeypatch)
    code = cli.main(["export", str(run), "--out", str(out), "--weights", "model"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    step = run / "checkpoints" / "step_00000006"
    assert re.fullmatch(
        rf"trainer: error: could not export checkpoint {re.escape(str(step))} to {re.escape(str(out))}: no space "
        rf"left on device writing {re.escape(str(out.parent / written))} \({SIZE} free in {re.escape(str(out.parent))} "
        rf"now, {SIZE} needed\); the previous export {re.escape(str(out))} is intact", err[-1]), err[-1]
    assert hashes(out.parent) == before  # the previous export, and no temp file left
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"no space left on device .*; nothing was written$"):
        fill(monkeypatch)
        export.export_run(run, tmp_path / "fresh" / "model.safetensors")
    assert not any((tmp_path / "fresh").iterdir())


# ---------------------------------------------------------------- b) a checkpoint save on a full disk

def torch_short_write(monkeypatch, writing: str = ".tmp-step_00000008") -> None:
    """torch's zip writer on a full disk (for files under `writing`): a short write, reported only as
    "unexpected pos", on a disk left with 4 KiB free (which tells it from a quota or a failing device)."""
    real = torch.save
    monkeypatch.setattr(disk_space, "free_bytes", lambda path: 4096)

    def save(obj, f, *args, **kwargs):
        if writing in str(f):
            Path(f).write_bytes(b"x" * 300)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 8448 vs 8342")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def safetensors_full(monkeypatch) -> None:
    """safetensors on a full disk (the EMA's file here), as 0.4-0.8 word it."""
    def save_file(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(writer, "save_file", save_file)


def python_full(monkeypatch) -> None:
    def write_manifest(ckpt_dir, state, with_hashes):
        with open(ckpt_dir / ckpt.STATE, "w") as f:
            f.write("{")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a write's error names no file

    monkeypatch.setattr(ckpt, "write_manifest", write_manifest)


def test_checkpoint_save_on_a_full_disk_says_so(run, monkeypatch):
    trainer = make(run, *STEPS[1:], "train.max_steps=8")
    assert trainer.state.step == 6
    trainer.state.step = 8
    root = run / "checkpoints"
    previous, tmp = root / "step_00000006", root / ".tmp-step_00000008"
    for fill in (torch_short_write, safetensors_full, python_full):
        with monkeypatch.context() as patch:
            fill(patch)
            with pytest.raises(CheckpointError) as raised:
                trainer.checkpointer.save()
        message = str(raised.value)
        assert re.fullmatch(
            rf"could not save checkpoint step_00000008 \(rank 0: no space left on device writing {re.escape(str(tmp))} "
            rf"\({SIZE} of it written\)\); {SIZE} free in {re.escape(str(root))} now, about "
            rf"{re.escape(format_bytes(disk_bytes(previous)))} needed \(estimate: the previous checkpoint's size\); the "
            rf"previous checkpoint {re.escape(str(previous))} is intact", message), (fill.__name__, message)
        assert not tmp.exists()
        assert (root / "latest").read_text().strip() == "step_00000006"
        ckpt.verify_checkpoint(previous)
    assert trainer.checkpointer.save() == root / "step_00000008"  # with room again: saved


@pytest.mark.parametrize("err, reason", [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 8448 vs 8342"), None),  # the disk tells
    (RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"), None),
    (OSError(errno.EIO, "Input/output error"), None),
    (SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
     "no space left on device"),
    (PermissionError(errno.EACCES, "Permission denied"), None),
    (RuntimeError("CUDA out of memory"), None),
])
def test_full_disk_is_recognised_however_the_writer_reports_it(err, reason):
    assert no_space_reason(err) == reason
    try:
        try:
            raise err
        except Exception as inner:
            raise RuntimeError("saving failed") from inner
    except RuntimeError as outer:
        assert no_space_reason(outer) == reason


# ---------------------------------------------------------------- c) what a resume passes over, and why

def test_resume_names_every_checkpoint_it_skips_and_why(run, caplog):
    root = run / "checkpoints"
    foreign = Path(shutil.copytree(root / "step_00000002", root / "step_00000010"))
    (foreign / ckpt.MANIFEST).unlink()  # a final name without a manifest: not from an interrupted save
    (root / ".tmp-step_00000012").mkdir()  # an interrupted save
    (root / ".tmp-step_00000012" / "model.safetensors").write_bytes(b"half")
    shutil.copytree(root / "step_00000002", root / ".old-step_00000002")  # a kill while step 2 was saved again
    weights = root / "step_00000006" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))  # same size: only the hash tells
    (root / "step_00000004" / "optimizer.bin").unlink()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        trainer = make(run, *STEPS[1:], "train.max_steps=8")
    assert trainer.state.step == 2
    then = "; skipped it, resuming from step_00000002"
    expected = [
        f"checkpoint {root / '.old-step_00000002'} is an older copy of step_00000002, set aside while step_00000002 "
        f"was saved again (the next save removes it){then}",
        f"checkpoint {root / 'step_00000010'} is incomplete: no manifest.json (written by another tool, copied "
        f"incompletely, or its manifest was removed; an interrupted save leaves a .tmp- folder instead){then}",
        f"checkpoint {root / '.tmp-step_00000012'} is an unfinished save (the run stopped before it was complete and "
        f"renamed into place; the next save removes it){then}",
        f"checkpoint {root / 'step_00000006'} is corrupt: file model.safetensors fails its sha256 check{then}",
        f"checkpoint {root / 'step_00000004'} is corrupt: file optimizer.bin is missing{then}",
    ]
    assert [r.getMessage() for r in caplog.records if "skipped it" in r.getMessage()] == expected


def test_resume_with_no_complete_checkpoint_says_what_it_passed_over(run, caplog):
    root = run / "checkpoints"
    for step in ckpt.list_checkpoints(root):
        (step / ckpt.MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        trainer = make(run, *STEPS[1:])
    assert trainer.state.step == 0
    skipped = [r.getMessage() for r in caplog.records if "skipped it" in r.getMessage()]
    assert [m.split(" ")[1] for m in skipped] == [str(root / f"step_0000000{n}") for n in (2, 4, 6)]
    assert all(m.endswith("; skipped it, no complete checkpoint: starting from step 0") for m in skipped)


# ---------------------------------------------------------------- d) exports compare by hash

def test_exports_of_one_checkpoint_are_byte_identical(run, tmp_path, monkeypatch):
    first = export.export_run(run, tmp_path / "a" / "model.safetensors")
    monkeypatch.chdir(run.parent)  # the run spelled another way: same bytes
    second = export.export_run(run.name, tmp_path / "b" / "model.safetensors")
    assert hashes(first.parent) == hashes(second.parent)
    assert set(hashes(first.parent)) == {"model.safetensors", "model.config.yaml", ckpt.TASK_STATS}
    weights, _ = export.consolidated_weights(run)
    loaded = load_file(first)
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
    with safe_open(str(first), framework="pt") as f:
        metadata = f.metadata()
    assert metadata == {"checkpoint": "checkpoints/step_00000006", "step": "6", "weights": "ema",
                        "task_stats": (run / "checkpoints" / "step_00000006" / ckpt.TASK_STATS).read_text()}
    header = first.read_bytes()[8:8 + int.from_bytes(first.read_bytes()[:8], "little")]
    assert json.dumps(json.loads(header), sort_keys=True, separators=(",", ":")) == header.decode().rstrip()


def test_export_replaces_a_folder_artifact_whole(run, tmp_path):
    """A folder artifact (e.g. a tokenizer) is staged beside its target and swapped in: no stale files remain."""
    step = run / "checkpoints" / "step_00000006"
    state = json.loads((step / ckpt.STATE).read_text())
    (step / "vocab").mkdir()
    (step / "vocab" / "new.txt").write_text("new")
    ckpt.write_manifest(step, {**state, "artifacts": [*state["artifacts"], "vocab"]}, with_hashes=True)
    out = tmp_path / "export" / "model.safetensors"
    (out.parent / "vocab").mkdir(parents=True)
    (out.parent / "vocab" / "stale.txt").write_text("from an older export")
    export.export_run(run, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.config.yaml", "model.safetensors",
                                                           ckpt.TASK_STATS, "vocab"]
    assert [p.name for p in (out.parent / "vocab").iterdir()] == ["new.txt"]


def test_saving_over_a_step_folder_without_manifest_keeps_it_aside(tmp_path, caplog):
    """A `step_N` folder this trainer did not complete (no manifest: put there by hand, or copied without one)
    is renamed aside with a warning, never deleted, when a save of step N lands; a completed one is replaced."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    foreign = root / "step_00000004"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for step_content in ("first", "second"):
        tmp = root / ".tmp-step_00000004"
        tmp.mkdir()
        (tmp / "weights.bin").write_text(step_content)
        (tmp / ckpt.MANIFEST).write_text("{}")
        with caplog.at_level(logging.WARNING, logger="trainer.core.checkpoint.store"):
            ckpt.finalize(tmp, root / "step_00000004", root, best=False)
    kept = [p for p in root.iterdir() if p.name.startswith("step_00000004.replaced-")]
    assert len(kept) == 1 and (kept[0] / "notes.txt").read_text() == "mine"
    assert (root / "step_00000004" / "weights.bin").read_text() == "second"  # our own checkpoint is replaced
    assert sorted(p.name for p in root.iterdir()) == sorted(["latest", "step_00000004", kept[0].name])
    assert sum("had no manifest.json" in r.getMessage() for r in caplog.records) == 1
    assert ckpt.list_checkpoints(root) == [root / "step_00000004"]


# ---------------------------------------------------------------- e) resume's failure paths

def cut_back_to_step_4(run: Path) -> Path:
    """`run` as a stop after its step-4 checkpoint leaves it (the step-6 checkpoint not yet written)."""
    root = run / "checkpoints"
    shutil.rmtree(root / "step_00000006")
    for pointer in ("latest", "best"):
        (root / pointer).write_text("step_00000004\n")
    return run


def snapshot(run: Path) -> dict[str, str]:
    return {k: v for k, v in hashes(run).items() if not k.endswith(".lock")}


def force_conversion(monkeypatch) -> None:
    """Resume a plain checkpoint through the topology-free form, as a run of another layout does."""
    from trainer.core.checkpoint import convert

    monkeypatch.setattr(convert, "needs_conversion", lambda *args: True)


def test_disk_full_while_converting_a_checkpoint_is_one_line_and_changes_nothing(trained, run, monkeypatch, capsys):
    cut_back_to_step_4(run)
    root = run / "checkpoints"
    before = snapshot(run)
    force_conversion(monkeypatch)
    with monkeypatch.context() as patch:
        torch_short_write(patch, writing=".universal-")  # the disk fills while the conversion writes
        status = cli.main(["train", str(run / "config.yaml"), f"run.output_dir={run}", "train.max_steps=6", *QUIET])
    reset_accelerate()
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("trainer: error:")]
    assert status == 2 and "Traceback" not in err and len(errors) == 1, err[-3000:]
    assert re.fullmatch(
        rf"trainer: error: checkpoint {re.escape(str(root / 'step_00000004'))} could not be converted for this run: "
        rf"no space left on device writing {re.escape(str(root / '.universal-step_00000004' / 'universal'))}; "
        rf"{SIZE} free in {re.escape(str(root))} now, about "
        rf"{re.escape(format_bytes(disk_bytes(root / 'step_00000004')))} needed \(the checkpoint's size\); the checkpoint is "
        rf"intact: free space there, or resume with the layout that wrote it", errors[0]), errors[0]
    assert snapshot(run) == before  # no scratch folder, no pointer moved, nothing written
    # With room again the same resume converts and ends where the uninterrupted run did.
    trainer = make(run, *STEPS)
    assert trainer.state.step == 4
    trainer.fit()
    assert not list(root.glob(".universal-*")) and not (root / "latest_universal").exists()
    from conftest import assert_run_matches

    assert_run_matches(trained, run, tolerance=1e-6)


@pytest.mark.parametrize("damage", ["optimizer.bin", "random_states_0.pkl"])
def test_unreadable_file_with_verification_off_is_one_line_naming_it(run, damage, capsys):
    step = run / "checkpoints" / "step_00000006"
    data = bytearray((step / damage).read_bytes())
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)  # same size, garbled: only reading can tell
    (step / damage).write_bytes(bytes(data))
    before = snapshot(run)
    status = cli.main(["train", str(run / "config.yaml"), f"run.output_dir={run}", "train.max_steps=8",
                       "ckpt.verify=false", *QUIET])
    reset_accelerate()
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("trainer: error:")]
    assert status == 2 and "Traceback" not in err and len(errors) == 1, err[-3000:]
    assert str(step) in errors[0] and damage in errors[0] and "cannot be read" in errors[0], errors[0]
    assert snapshot(run) == before


def test_falling_back_from_a_corrupt_checkpoint_names_the_cause_and_sets_it_aside(run, caplog):
    root = run / "checkpoints"
    weights = root / "step_00000006" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="trainer"):
        trainer = make(run, *STEPS)
    assert trainer.state.step == 4
    repaired = [r.getMessage() for r in caplog.records if "pointers repaired" in r.getMessage()]
    assert repaired == ["checkpoint pointers repaired (newer checkpoints failed verification): latest -> "
                        "step_00000004"], repaired
    assert (root / "step_00000006").is_dir()  # set aside only when this run saves that step again
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        trainer.fit()
    kept = [p for p in root.iterdir() if p.name.startswith("step_00000006.corrupt-")]
    assert len(kept) == 1 and (kept[0] / "model.safetensors").read_bytes() == bytes(data)
    assert any("failed verification" in r.getMessage() and kept[0].name in r.getMessage() for r in caplog.records)
    assert (root / "step_00000006").is_dir(), sorted(p.name for p in root.iterdir())
    ckpt.verify_checkpoint(root / "step_00000006")  # the new one, complete


def test_an_error_every_rank_raised_alike_is_printed_once(monkeypatch, capsys):
    """Ranks that agreed on a checkpoint error all raise it: the main process says it, the others exit quietly."""
    from trainer.core.checkpoint.agreement import everywhere

    def train(args):
        raise everywhere(CheckpointError("checkpoint step_00000004 could not be converted for this run: no space"))

    monkeypatch.setattr(cli, "_train", train)
    for rank, said in (("0", "trainer: error: checkpoint step_00000004 could not be converted for this run: no space\n"),
                       ("1", "")):
        monkeypatch.setenv("RANK", rank)
        assert cli.main(["train", "config.yaml"]) == 2
        assert capsys.readouterr().err == said


def test_ranks_that_picked_different_checkpoints_all_resume_the_older_one(run, monkeypatch):
    """Each rank picks its target before a process group exists; hashes are read by each node's first process
    only, so one rank may refuse the newest checkpoint that another took: all go back to the older pick."""
    from types import SimpleNamespace

    from trainer.core.checkpoint import agreement, target

    root = run / "checkpoints"
    cfg = load_config(None, ["task.preset=tiny", f"run.output_dir={run}"])
    mine = target.pick_resume_target(cfg)
    assert mine.path == root / "step_00000006"
    picks = [("step_00000006", None), ("step_00000004", None)]  # rank 1 refused step 6
    monkeypatch.setattr(agreement, "gather_object",
                        lambda objs: picks if isinstance(objs[0], tuple) else [objs[0], None])
    acc = SimpleNamespace(num_processes=2, is_local_main_process=True)
    agreed = agreement.agree_on_target(acc, mine, check_hashes=True)
    assert agreed.path == root / "step_00000004" and agreed.step == 4
    assert agreed.corrupt == (root / "step_00000006",)
    assert agreed.skipped[-1] == f"checkpoint {root / 'step_00000006'} failed verification on another rank"

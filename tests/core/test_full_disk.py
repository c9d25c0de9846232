"""A full disk is named as such on every write path, whatever the writer raised: torch's C++ writer reports one
as "basic_ios::clear: iostream error" or as a short write, which name no cause, so the disk is looked at after a
failed write. A quota, an I/O error or a stale NFS handle is named as itself, never as a full disk.
Real full filesystems (a small tmpfs, where this process may mount one) and, for the many paths, in process."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import reset_accelerate
from safetensors import SafetensorError

from trainer import cli, disk_space
from trainer.config import load_config
from trainer.core import generation
from trainer.core.checkpoint import agreement, convert, export
from trainer.core.trainer import Trainer
from trainer.disk_space import LOW_SPACE, disk_bytes, format_bytes, no_space_reason
from trainer.errors import CheckpointError, DiskFullError

SIZE = r"\d+(\.\d)? (B|KiB|MiB|GiB)"
STREAM_ERROR = "basic_ios::clear: iostream error"
"""What torch.save raised on a full tmpfs when the file's tail failed to flush (no errno, no 'no space')."""
SHORT_WRITES = ("[enforce fail at inline_container.cc:672] . unexpected pos 8448 vs 8342",
                "PytorchStreamWriter failed writing file data/0: file write failed")
"""What torch's zip writer raises on any failed write: a full disk, an exceeded quota or a failing device alike."""
ROOMY = 50 << 30
pytestmark = pytest.mark.usefixtures("fresh_accelerate")
RUN = ["task.preset=tiny", "train.max_steps=4", "ckpt.every_steps=2", "ckpt.keep_last=5", "log.progress_bar=false",
       "log.tensorboard=false"]


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs; `fill(left)` fills it until `left` bytes are free. Skipped where mounting is not permitted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a small tmpfs is not permitted here: {done.stderr.strip()}")

    def fill(left: int) -> None:
        with open(mount / "filler", "wb") as f:
            f.write(b"\0" * (shutil.disk_usage(mount).free - left))

    try:
        yield SimpleNamespace(path=mount, fill=fill)
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)  # a run in this process may still hold its lock file


def hashes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}


def disk_with(monkeypatch, free: int) -> None:
    """Every folder reports `free` bytes free."""
    monkeypatch.setattr(disk_space, "free_bytes", lambda path: free)


# ---------------------------------------------------------------- what a full disk looks like, for real

def test_torch_stream_error_on_a_real_full_disk_is_named(small_disk):
    small_disk.fill(48 * 1024)
    target = small_disk.path / "state.pt"
    with pytest.raises(RuntimeError) as raised:
        torch.save({"a": torch.zeros(12_000)}, target)
    assert agreement.failure_reason(raised.value, target) == f"no space left on device writing {target}"


def test_a_full_disk_is_judged_by_looking_at_it_when_the_error_does_not_say(monkeypatch, tmp_path):
    """The verdict is taken while the failed write's output is there, and kept: removing it frees space."""
    disk_with(monkeypatch, LOW_SPACE // 2)
    err = RuntimeError(STREAM_ERROR)
    assert no_space_reason(err) is None  # the words alone do not tell
    assert no_space_reason(err, tmp_path) == "no space left on device"
    disk_with(monkeypatch, 50 << 30)
    assert no_space_reason(err, tmp_path) == "no space left on device"  # kept
    assert no_space_reason(RuntimeError(STREAM_ERROR), tmp_path) is None  # with room, the error is the file's
    disk_with(monkeypatch, 0)
    for named in (PermissionError(errno.EACCES, "Permission denied"), CheckpointError("checkpoint x: corrupt")):
        assert no_space_reason(named, tmp_path) is None  # an error that names its cause keeps it


@pytest.mark.parametrize("text", SHORT_WRITES, ids=["unexpected-pos", "file-write-failed"])
def test_a_short_write_is_a_full_disk_only_when_the_disk_is_full(monkeypatch, tmp_path, text):
    """torch's short-write texts name no cause: beside free space they are the writer's error, not a full disk."""
    target = tmp_path / "state.pt"
    assert no_space_reason(RuntimeError(text)) is None  # the words alone do not tell
    disk_with(monkeypatch, ROOMY)
    err = RuntimeError(text)
    assert no_space_reason(err, target) is None
    assert agreement.failure_reason(err, target) == f"RuntimeError: {text}"
    disk_with(monkeypatch, LOW_SPACE // 2)
    err = RuntimeError(text)
    assert agreement.failure_reason(err, target) == f"no space left on device writing {target}"


def quota_error() -> OSError:
    return OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))


@pytest.mark.parametrize("make, reason", [
    (quota_error, "disk quota exceeded"),
    (lambda: SafetensorError(f"Error while serializing: I/O error: Disk quota exceeded (os error {errno.EDQUOT})"),
     "disk quota exceeded"),
    (lambda: OSError(errno.EIO, os.strerror(errno.EIO)), "I/O error"),
    (lambda: SafetensorError(f"Error while serializing: I/O error: Input/output error (os error {errno.EIO})"),
     "I/O error"),
    (lambda: OSError(errno.ESTALE, os.strerror(errno.ESTALE)), "stale NFS file handle"),
    (lambda: SafetensorError(f"Error while serializing: I/O error: Stale file handle (os error {errno.ESTALE})"),
     "stale NFS file handle"),
], ids=["quota", "quota-safetensors", "eio", "eio-safetensors", "estale", "estale-safetensors"])
def test_quota_io_error_and_stale_handle_are_named_as_themselves(monkeypatch, tmp_path, make, reason):
    """Each as itself, with a full disk or room on it alike, and however deep in the chain the cause is."""
    target = tmp_path / "state.pt"
    for free in (0, ROOMY):
        disk_with(monkeypatch, free)
        assert agreement.failure_reason(make(), target) == f"{reason} writing {target}"
        try:
            try:
                raise make()
            except Exception as cause:
                raise RuntimeError(SHORT_WRITES[0]) from cause  # the short write names no cause; its cause does
        except RuntimeError as err:
            assert agreement.failure_reason(err, target) == f"{reason} writing {target}"
            assert no_space_reason(err) == (reason if reason == "disk quota exceeded" else None)


# ---------------------------------------------------------------- every write path

def test_resume_converting_on_a_real_full_disk_names_the_space_and_changes_nothing(small_disk, monkeypatch, capsys):
    """A plain checkpoint resumed through the topology-free form (as ZeRO-2 x 2 would) on a disk left 48 KB free."""
    run = small_disk.path / "run"
    Trainer(load_config(None, [*RUN, f"run.output_dir={run}"])).fit()
    reset_accelerate()
    root = run / "checkpoints"
    shutil.rmtree(root / "step_00000004")
    for pointer in ("latest", "best"):
        (root / pointer).write_text("step_00000002\n")
    small_disk.fill(48 * 1024)
    before = hashes(run)
    monkeypatch.setattr(convert, "needs_conversion", lambda *args: True)
    try:
        status = cli.main(["train", str(run / "config.yaml"), *RUN, f"run.output_dir={run}"])
    finally:
        reset_accelerate()
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("trainer: error:")]
    assert status == 2 and "Traceback" not in err and len(errors) == 1, err[-3000:]
    step = root / "step_00000002"
    assert re.fullmatch(
        rf"trainer: error: checkpoint {re.escape(str(step))} could not be converted for this run: no space left on "
        rf"device writing {re.escape(str(root))}/\.universal-step_00000002/universal\S*; {SIZE} free in "
        rf"{re.escape(str(root))} now, about {re.escape(format_bytes(disk_bytes(step)))} needed \(the checkpoint's "
        rf"size\); the checkpoint is intact: free space there, or resume with the layout that wrote it",
        errors[0]), errors[0]
    assert hashes(run) == before


def test_deepspeed_conversion_stream_error_on_a_full_disk_is_not_blamed_on_the_checkpoint(monkeypatch, tmp_path):
    from deepspeed.checkpoint import ds_to_universal

    def main(args):
        (Path(args.output_folder) / "zero" / "w").mkdir(parents=True)
        raise RuntimeError(STREAM_ERROR)

    monkeypatch.setattr(ds_to_universal, "main", main)
    checkpoint, scratch = tmp_path / "step_00000002", tmp_path / "checkpoints" / ".universal-step_00000002" / "universal"
    checkpoint.mkdir()
    disk_with(monkeypatch, 48 * 1024)
    with pytest.raises(RuntimeError) as raised:  # the disk's fault: not a CheckpointError naming the files
        convert.convert(checkpoint, scratch, {"backend": convert.DEEPSPEED}, [])
    line = agreement.conversion_failure(raised.value, checkpoint, scratch)
    assert line.startswith(f"checkpoint {checkpoint} could not be converted for this run: no space left on device "
                           f"writing {scratch}; 48.0 KiB free in {tmp_path / 'checkpoints'} now, about "), line
    assert not scratch.exists()


def trained_with_failing_saves(monkeypatch, tmp_path, failure, free: int) -> tuple[Trainer, Path]:
    """A run trained 2 steps (its checkpoint step_2 written), at step 4, whose next checkpoint's torch.save writes
    300 bytes and raises `failure()`, on a disk with `free` bytes: (the trainer, its checkpoints folder)."""
    trainer = Trainer(load_config(None, [*RUN, "train.max_steps=2", f"run.output_dir={tmp_path / 'run'}"]))
    trainer.fit()
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if ".tmp-" in str(f):
            Path(f).write_bytes(b"x" * 300)
            raise failure()
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    disk_with(monkeypatch, free)
    trainer.state.step = 4
    return trainer, trainer.run_dir.checkpoints


def test_checkpoint_save_with_a_stream_error_on_a_full_disk_names_the_space(monkeypatch, tmp_path):
    trainer, root = trained_with_failing_saves(monkeypatch, tmp_path, lambda: RuntimeError(STREAM_ERROR), 4096)
    with pytest.raises(CheckpointError, match=rf"^could not save checkpoint step_00000004 \(rank 0: no space left on "
                                              rf"device writing .*\); 4.0 KiB free in {re.escape(str(root))} now, about "
                                              rf"{SIZE} needed \(estimate: the previous checkpoint's size\); the "
                                              rf"previous checkpoint .*step_00000002 is intact$"):
        trainer.checkpointer.save()
    assert not (root / ".tmp-step_00000004").exists()


@pytest.mark.parametrize("failure, said", [
    (quota_error, rf"disk quota exceeded writing .*\); 50.0 GiB free in {{root}} now but none under your disk quota, "
                  rf"about {SIZE} needed \(estimate: the previous checkpoint's size\); "),
    (lambda: OSError(errno.EIO, os.strerror(errno.EIO)), r"I/O error writing .*\); "),
    (lambda: RuntimeError(SHORT_WRITES[0]), rf"RuntimeError: {re.escape(SHORT_WRITES[0])}\); "),
], ids=["quota", "eio", "short-write"])
def test_checkpoint_save_beside_free_space_is_not_called_a_full_disk(monkeypatch, tmp_path, failure, said):
    """A quota is named with its folder (the free space is not what ran out), an I/O error and a short write with
    room on the disk as what they are."""
    trainer, root = trained_with_failing_saves(monkeypatch, tmp_path, failure, ROOMY)
    with pytest.raises(CheckpointError) as raised:
        trainer.checkpointer.save()
    message = str(raised.value)
    assert re.fullmatch(rf"could not save checkpoint step_00000004 \(rank 0: {said.format(root=re.escape(str(root)))}"
                        rf"the previous checkpoint .*step_00000002 is intact", message), message
    assert "no space left on device" not in message
    assert not (root / ".tmp-step_00000004").exists()


def test_samples_beyond_a_quota_name_the_quota_and_keep_the_previous_set(monkeypatch, tmp_path):
    out = tmp_path / "samples" / "samples.fasta"
    out.parent.mkdir()
    out.write_text(">old\n")

    class Task:
        def write_samples(self, samples, options, partial):
            partial.write_text(">sample_0\n")
            raise quota_error()

    disk_with(monkeypatch, ROOMY)
    with pytest.raises(DiskFullError, match=rf"^could not write {re.escape(str(out))}: disk quota exceeded \(50.0 GiB "
                                            rf"free in {re.escape(str(out.parent))} now but none under your disk "
                                            rf"quota, about {SIZE} needed \(at least what was written before the "
                                            rf"space ran out\)\); the previous samples.fasta is intact$"):
        generation._write_whole(Task(), [], None, out)
    assert out.read_text() == ">old\n"


def test_export_refuses_before_writing_when_the_disk_has_too_little_room(monkeypatch, tmp_path):
    run = tmp_path / "run"
    Trainer(load_config(None, [*RUN, "train.max_steps=2", f"run.output_dir={run}"])).fit()
    out = tmp_path / "export" / "model.safetensors"
    disk_with(monkeypatch, 1024)
    with pytest.raises(CheckpointError, match=rf"no space left on device writing {re.escape(str(out))} \(1.0 KiB free "
                                              rf"in {re.escape(str(out.parent))} now, {SIZE} needed\); nothing was "
                                              rf"written$"):
        export.export_run(run, out)
    assert not any(out.parent.iterdir())


def test_samples_on_a_full_disk_are_one_error_and_keep_the_previous_set(monkeypatch, tmp_path):
    out = tmp_path / "samples" / "samples.fasta"
    out.parent.mkdir()
    out.write_text(">old\n")

    class Task:
        def write_samples(self, samples, options, partial):
            partial.write_text(">sample_0\n")
            raise RuntimeError(STREAM_ERROR)

    disk_with(monkeypatch, 8 * 1024)
    with pytest.raises(DiskFullError, match=rf"^could not write {re.escape(str(out))}: no space left on device \(8.0 "
                                            rf"KiB free in {re.escape(str(out.parent))} now, about {SIZE} needed "
                                            rf"\(at least what was written before the space ran out\)\); the previous "
                                            rf"samples.fasta is intact$"):
        generation._write_whole(Task(), [], None, out)
    assert [p.name for p in out.parent.iterdir()] == ["samples.fasta"] and out.read_text() == ">old\n"


def test_study_database_on_a_full_disk_is_one_line(monkeypatch, tmp_path, capsys):
    """Optuna wraps SQLite's SQLITE_FULL in a StorageInternalError."""
    from optuna.exceptions import StorageInternalError

    from trainer.sweep import cli as sweep_cli

    out = tmp_path / "sweep"
    out.mkdir()
    (out / "study.db").write_bytes(b"\0" * 20_000)

    def search(args):
        try:
            raise __import__("sqlite3").OperationalError("database or disk is full")
        except Exception as err:
            raise StorageInternalError("An exception is raised during the commit.") from err

    monkeypatch.setattr(sweep_cli, "_main", search)
    disk_with(monkeypatch, 0)
    assert cli.main(["run-experiments", str(tmp_path / "search.yaml"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"trainer: error: run-experiments could not write under {out}: no space left on device (0 B free in {out} now, "
        f"about {format_bytes(disk_bytes(out / 'study.db'))} needed (estimate: the size of study.db now)); what was "
        f"recorded before is kept: free space there and continue with --resume")

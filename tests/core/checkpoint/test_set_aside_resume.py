"""Where the file system cannot swap two folders in one step (NFS, Lustre), a step saved again is replaced in two
renames: the older copy aside to `.old-step_N`, then the new one into place. A kill between the two leaves the step
only as `.old-step_N`; the resume puts it back as `step_N` and resumes it, as the newest complete checkpoint."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from conftest import reset_accelerate

from trainer.config import load_config
from trainer.core.checkpoint import store
from trainer.core.checkpoint.store import Generation, StaleGenerationError
from trainer.core.trainer import Trainer
from trainer.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("fresh_accelerate")

QUIET = ["log.progress_bar=false", "log.tensorboard=false"]
EVERY_2 = ["ckpt.every_steps=2", "ckpt.keep_last=5"]


class Killed(BaseException):
    """The process died here: nothing after it runs (not even an `except BaseException` that renames back)."""


def killed_between_the_two_renames(root: Path, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Save `step` again (a copy of its folder) as the Checkpointer completes a save, where no swap is available,
    and "kill" the process at the second rename: every rename from then on fails."""
    final = root / store.step_dir_name(step)
    tmp = store.temp_dir(final, None)
    shutil.copytree(final, tmp)
    (tmp / store.MANIFEST).unlink()
    monkeypatch.setattr(store, "_exchange", lambda a, b: False)
    real_rename, calls = os.rename, []

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) >= 2:
            raise Killed
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(Killed):
        store.complete_checkpoint(tmp, final, {"step": step}, best=False, verify=True, keep_last=5)
    monkeypatch.undo()
    assert not final.exists() and (root / f".old-{final.name}").is_dir(), sorted(p.name for p in root.iterdir())


def make(out: Path, *overrides: str) -> Trainer:
    return Trainer(load_config(None, ["task.preset=tiny", f"run.output_dir={out}", *QUIET, *overrides]))


def test_resume_puts_back_a_step_a_kill_left_set_aside(tmp_path, monkeypatch, caplog):
    make(tmp_path, "train.max_steps=4", *EVERY_2).fit()
    root = tmp_path / "checkpoints"
    killed_between_the_two_renames(root, 4, monkeypatch)
    aside = root / ".old-step_00000004"
    assert store.resume_candidates(root) == [aside, root / "step_00000002"]
    assert store.skipped_checkpoints(root) == [
        f"checkpoint {root / '.tmp-step_00000004'} is an unfinished save (the run stopped before it was complete and "
        f"renamed into place; the next save removes it)"]

    reset_accelerate()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        trainer = make(tmp_path, "train.max_steps=6", *EVERY_2)
    assert trainer.state.step == 4  # the newest complete checkpoint, not step 2
    assert (root / "step_00000004").is_dir() and not aside.exists()
    store.verify_checkpoint(root / "step_00000004")
    assert (root / "latest").read_text().strip() == "step_00000004"
    assert f"checkpoint {aside} was left set aside by a save of its step that did not finish: put back as " \
           f"step_00000004" in caplog.text
    assert trainer.fit() == "completed" and trainer.state.step == 6
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(("step_", "."))) == [
        "step_00000002", "step_00000004", "step_00000006"]


def test_a_copy_set_aside_is_put_back_only_by_the_newest_generation_and_never_over_a_step(tmp_path):
    root = tmp_path / "checkpoints"
    aside = root / ".old-step_00000004"
    aside.mkdir(parents=True)
    (aside / "weights.bin").write_text("4")
    store.write_manifest(aside, {"step": 4}, with_hashes=True)
    file = tmp_path / ".generation"
    file.write_text("1\n")
    with pytest.raises(StaleGenerationError, match=rf"^checkpoint {aside} was not put back as step_00000004: this "
                                                   rf"worker group is generation 0 of the run, and generation 1"):
        store.put_back(aside, Generation(0, file))
    assert aside.is_dir() and not (root / "step_00000004").exists()

    (root / "step_00000004").mkdir()  # no manifest: not a checkpoint, but a step folder all the same
    assert store.set_aside_copies(root) == []  # a step folder exists: the copy is the older one, not a candidate
    with pytest.raises(CheckpointError, match="appeared meanwhile"):
        store.put_back(aside, Generation(1, file))
    (root / "step_00000004").rmdir()
    assert store.put_back(aside, Generation(1, file)) == root / "step_00000004"
    assert store.verify_checkpoint(root / "step_00000004") == {"step": 4} and not aside.exists()

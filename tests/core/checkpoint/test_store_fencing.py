"""Two worker groups on one checkpoint folder: a group that a newer generation took the run over from (a node cut off
from the others, still alive) renames, points and removes nothing, and a SIGKILL at any point of a save leaves
`latest` a complete checkpoint and the newer group's checkpoints as they were."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

from trainer.core.checkpoint import store
from trainer.core.checkpoint.store import Generation, StaleGenerationError
from trainer.core.run_lock import acquire_run_lock, generation_file, join_generation, run_generation
from trainer.rundir import RunDir


def save(root: Path, step: int, generation: Generation, by: str, keep_last: int = 3) -> list[str]:
    """A save of `step` by a worker group (`by` is written into its file), completed as the Checkpointer does."""
    final = root / store.step_dir_name(step)
    tmp = store.temp_dir(final, generation)
    shutil.rmtree(tmp, ignore_errors=True)  # what a kill left
    tmp.mkdir(parents=True)
    (tmp / "weights.bin").write_text(f"{by} {step}")
    return store.complete_checkpoint(tmp, final, {"step": step}, best=False, verify=True, keep_last=keep_last,
                                     generation=generation)


def take_over(run: Path) -> Generation:
    """What the run lock does when a newer worker group takes it over: one more generation in the file."""
    file = generation_file(run)
    number = store.read_generation(file) + 1
    file.write_text(f"{number}\n")
    return Generation(number, file)


def snapshot(root: Path, leaving_out: Path | None = None) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and (leaving_out is None or leaving_out not in p.parents)}


def by_whom(ckpt: Path) -> str:
    store.verify_checkpoint(ckpt)
    return (ckpt / "weights.bin").read_text()


def test_a_group_taken_over_renames_points_and_removes_nothing(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    old = Generation(0, generation_file(run))
    for step in (2, 4):
        save(root, step, old, "old")
    new = take_over(run)
    writing = store.temp_dir(root / "step_00000006", new)  # the newer group's save in progress
    writing.mkdir()
    (writing / "weights.bin").write_text("new 6")
    own = store.temp_dir(root / "step_00000006", old)
    assert writing != own
    before = snapshot(root, leaving_out=own)

    with pytest.raises(StaleGenerationError) as raised:
        save(root, 6, old, "old", keep_last=1)
    assert str(raised.value) == (
        f"checkpoint {root / 'step_00000006'} was not renamed into place: this worker group is generation 0 of the "
        f"run, and generation 1 has taken it over since ({run / '.generation'}); a group that was taken over leaves "
        f"the checkpoints to the newer one")
    assert snapshot(root, leaving_out=own) == before
    with pytest.raises(StaleGenerationError, match=f"^old checkpoints under {root} were not removed: this worker "
                                                   f"group is generation 0 of the run, and generation 1 has taken"):
        store.rotate(root, keep_last=1, generation=old)
    assert snapshot(root, leaving_out=own) == before

    # The newer group completes its save: its rotation removes the older generation's temp folder, never one of a
    # newer generation (taking the run over just now).
    (store.temp_dir(root / "step_00000008", Generation(2, new.file))).mkdir()
    assert store.complete_checkpoint(writing, root / "step_00000006", {"step": 6}, best=False, verify=True,
                                     keep_last=2, generation=new) == []
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_00000008.gen2", "latest", "step_00000004",
                                                      "step_00000006"]
    assert by_whom(store.latest_checkpoint(root)) == "new 6"


def test_taking_over_the_run_lock_starts_a_new_generation_that_every_rank_joins(tmp_path):
    """A holder that never released its lock (here a process that holds its flock, as a node cut off from the others
    may) is taken over by a restarted worker group of its elastic run, which starts generation 1; a lock its holder
    released is taken without a new generation."""
    run = tmp_path / "run"
    run.mkdir()
    holder = json.dumps({"host": "lost-node", "pid": 1, "elastic_run": "job-1"})
    hold = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
        "os.write(fd, sys.argv[2].encode()); print('held', flush=True); time.sleep(60)"), str(RunDir(run).lock), holder],
        stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        assert hold.stdout.readline().strip() == "held"
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
            patch.setenv("TORCHELASTIC_RUN_ID", "job-1")
            lock = acquire_run_lock(run)
    finally:
        hold.kill()
        hold.wait()
    assert lock.generation == 1 and generation_file(run).read_text() == "1\n"
    assert run_generation(run) == Generation(1, run.absolute() / ".generation")
    lock.release()
    assert run_generation(run) is None
    join_generation(run, 1)  # another rank of the group: its main process took the lock
    assert run_generation(run) == Generation(1, run.absolute() / ".generation")
    lock = acquire_run_lock(run)
    try:
        assert lock.generation == 1 and generation_file(run).read_text() == "1\n"
    finally:
        lock.release()


def test_a_failed_replacement_puts_the_older_copy_back(tmp_path, monkeypatch):
    """Where the file system cannot swap two folders in one step, a second rename that fails renames the older
    copy back: `step_N` is never left missing."""
    root = tmp_path / "checkpoints"
    generation = Generation(0, tmp_path / ".generation")
    save(root, 2, generation, "first")
    monkeypatch.setattr(store, "_exchange", lambda a, b: False)
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        save(root, 2, generation, "second")
    assert by_whom(root / "step_00000002") == "first 2"
    assert not (root / ".old-step_00000002").exists()


# A save of step 6 in a process of its own that SIGKILLs itself at one point of `complete_checkpoint`.
KILLED_SAVE = """
import os, shutil, signal, sys
from pathlib import Path
from trainer.core.checkpoint import store

root, point, number = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])

def die_at(owner, name, call=1, before=None):
    real, calls = getattr(owner, name), [0]
    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            if before is not None:
                before(*args)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(owner, name, wrapper)

def half_removed(path):
    path = Path(path)
    if path.name.endswith("step_00000002"):
        (path / "weights.bin").unlink()
        os.kill(os.getpid(), signal.SIGKILL)

if point.endswith("(two renames)"):
    store._exchange = lambda a, b: False
if point == "files written":
    die_at(store, "write_manifest")
elif point == "manifest written":
    die_at(store, "finalize")
elif point == "between the two renames (two renames)":
    die_at(os, "rename", call=2)
elif point.startswith("renamed into place"):
    die_at(store, "fsync_dir")
elif point == "between the best and latest pointers":
    die_at(store, "atomic_write_text", call=3)  # the manifest's, best's, then latest's
elif point == "pointers written":
    die_at(store, "rotate")
elif point == "halfway through removing a checkpoint":
    real_rmtree = shutil.rmtree
    def rmtree(path, *args, **kwargs):
        half_removed(path)
        return real_rmtree(path, *args, **kwargs)
    shutil.rmtree = rmtree

final = root / "step_00000006"
generation = store.Generation(number, root.parent / ".generation")
tmp = store.temp_dir(final, generation)
tmp.mkdir()
(tmp / "weights.bin").write_text("again 6")
store.complete_checkpoint(tmp, final, {"step": 6}, best=True, verify=True, keep_last=2, generation=generation)
"""

POINTS = ["files written", "manifest written", "between the two renames (two renames)", "renamed into place",
          "renamed into place (two renames)", "between the best and latest pointers", "pointers written",
          "halfway through removing a checkpoint"]


def killed_save(root: Path, point: str, generation: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILLED_SAVE, str(root), point, str(generation)], env=child_env(),
                          capture_output=True, text=True, timeout=120)


def assert_complete(root: Path) -> Path:
    """`latest` resolves to a complete checkpoint, and every checkpoint that looks complete verifies."""
    for ckpt in store.list_checkpoints(root):
        store.verify_checkpoint(ckpt)
    latest = store.latest_checkpoint(root)
    store.verify_checkpoint(latest)
    return latest


@pytest.fixture
def saved(tmp_path) -> Path:
    """A run's checkpoints folder with steps 2, 4 and 6 of generation 0 and a temp folder a kill left behind."""
    root = tmp_path / "run" / "checkpoints"
    for step in (2, 4, 6):
        save(root, step, Generation(0, generation_file(root.parent)), "first")
    (root / ".tmp-step_00000008").mkdir()
    return root


@pytest.mark.parametrize("point", POINTS)
def test_a_save_killed_at_any_point_then_a_newer_group_saves(saved, point):
    """Step 6 saved again (a group that went back), SIGKILLed at `point`: `latest` is a complete checkpoint and the
    step is never missing where the file system swaps folders in one step; the next group takes the run over and its
    saves leave nothing of the killed one behind."""
    root = saved
    killed = killed_save(root, point, 0)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    latest = assert_complete(root)
    if point != "between the two renames (two renames)":
        assert by_whom(root / "step_00000006") in ("first 6", "again 6")
    if point.startswith("renamed into place") or point in ("between the best and latest pointers", "pointers written"):
        assert latest == root / "step_00000006" and by_whom(latest) == "again 6"

    new = take_over(root.parent)
    with pytest.raises(StaleGenerationError):
        save(root, 8, Generation(0, new.file), "stale")
    save(root, 8, new, "new", keep_last=2)
    assert by_whom(root / "step_00000006") in ("first 6", "again 6")  # a copy a kill left set aside is put back
    for step in (6, 10):
        save(root, step, new, "new", keep_last=2)
    assert sorted(p.name for p in root.iterdir() if p.name != "best") == ["latest", "step_00000006", "step_00000010"]
    assert [by_whom(p) for p in store.newest_first(root)] == ["new 10", "new 6"]
    assert assert_complete(root) == root / "step_00000010"


@pytest.mark.parametrize("point", ["files written", None])
def test_a_stale_group_killed_or_refused_leaves_the_newer_groups_checkpoints(saved, point):
    """A newer group took the run over and saved step 6 first; the older group's save of step 6, killed before its
    manifest or run to its end, changes nothing outside its own temp folder."""
    root = saved
    new = take_over(root.parent)
    save(root, 6, new, "new", keep_last=2)
    own = store.temp_dir(root / "step_00000006", Generation(0, new.file))
    before = snapshot(root, leaving_out=own)
    stale = killed_save(root, point or "to its end", 0)
    if point is None:
        assert stale.returncode == 1 and "StaleGenerationError: checkpoint" in stale.stderr, stale.stderr
    else:
        assert stale.returncode == -signal.SIGKILL, stale.stderr
    assert snapshot(root, leaving_out=own) == before
    assert assert_complete(root) == root / "step_00000006" and by_whom(root / "step_00000006") == "new 6"


def test_a_trainer_taken_over_leaves_the_newer_groups_checkpoint_alone(tmp_path, fresh_accelerate):
    """The Checkpointer saves under its worker group's generation: once a newer one took the run over, its save of a
    step the newer group saved too is one error naming both generations, and changes nothing."""
    from trainer.config import load_config
    from trainer.core.trainer import Trainer
    from trainer.errors import CheckpointError

    trainer = Trainer(load_config(None, ["task.preset=tiny", f"run.output_dir={tmp_path}", "log.progress_bar=false",
                                         "log.tensorboard=false", "train.max_steps=4"]))
    root = tmp_path / "checkpoints"
    assert trainer.checkpointer.generation == Generation(0, tmp_path / ".generation")
    trainer.state.step = 2
    trainer.checkpointer.save()
    new = take_over(tmp_path)
    save(root, 4, new, "new")
    before = snapshot(root)
    trainer.state.step = 4
    with pytest.raises(CheckpointError, match=rf"^could not save checkpoint step_00000004 \(rank 0: checkpoint "
                                              rf"{root / 'step_00000004'} was not renamed into place: this worker "
                                              rf"group is generation 0 of the run, and generation 1 has taken it over"):
        trainer.checkpointer.save()
    assert snapshot(root) == before and by_whom(root / "step_00000004") == "new 4"


def test_the_writer_process_checks_the_generation_it_was_handed(tmp_path):
    from trainer.core.checkpoint.writer import BackgroundWriter, StagedFile, WriteJob

    root = tmp_path / "run" / "checkpoints"
    old = Generation(0, generation_file(root.parent))
    save(root, 2, old, "old")
    take_over(root.parent)
    before = snapshot(root)
    final = root / "step_00000004"
    w = BackgroundWriter()
    try:
        w.submit(WriteJob(store.temp_dir(final, old), final, [StagedFile("a.json", "json", {})], {"step": 4},
                          best=False, keep_last=1, verify=True, generation=old))
        err = w.wait()
    finally:
        w.close()
    assert f"checkpoint {final} was not renamed into place: this worker group is generation 0 of the run, and " \
           f"generation 1 has taken it over" in str(err), err
    assert snapshot(root) == before

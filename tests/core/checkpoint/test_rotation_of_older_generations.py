"""A rotation removes the temp folders of its own generation and of every older one (a killed group's partial
checkpoint would otherwise stay for ever: no later group writes under its name), never a newer generation's. A stale
group still writing into a temp folder removed under it loses that save, and only that: its files are not renamed
into place, and the newer group's checkpoints stay as they were."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from trainer.core.checkpoint import store
from trainer.core.checkpoint.store import Generation, StaleGenerationError


def save(root: Path, step: int, generation: Generation, by: str) -> None:
    final = root / store.step_dir_name(step)
    tmp = store.temp_dir(final, generation)
    tmp.mkdir(parents=True)
    (tmp / "weights.bin").write_text(f"{by} {step}")
    store.complete_checkpoint(tmp, final, {"step": step}, best=False, verify=True, keep_last=10, generation=generation)


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture
def generations(tmp_path) -> tuple[Path, Generation, Generation]:
    """A run of generation 0 with step 2 saved, then taken over by generation 2 (generation 1 was killed, leaving a
    temp folder); generation 0 is still alive and writing step 4."""
    root = tmp_path / "checkpoints"
    file = tmp_path / ".generation"
    old = Generation(0, file)
    save(root, 2, old, "old")
    (root / ".tmp-step_00000004.gen1").mkdir()
    (root / ".tmp-step_00000004.gen1" / "weights.bin").write_text("killed 4")
    writing = store.temp_dir(root / "step_00000004", old)
    writing.mkdir()
    (writing / "weights.bin").write_text("old 4")
    file.write_text("2\n")
    return root, old, Generation(2, file)


def test_the_rotation_removes_the_temp_folders_of_its_own_and_older_generations(generations):
    root, old, new = generations
    (root / ".tmp-step_00000008.gen3").mkdir()  # a newer group's save in progress
    (root / ".tmp-step_00000006.gen2").mkdir()  # its own, left by a failed save
    save(root, 4, new, "new")
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_00000008.gen3", "latest", "step_00000002",
                                                      "step_00000004"]
    assert (root / "step_00000004" / "weights.bin").read_text() == "new 4"


def test_a_stale_save_whose_temp_folder_was_removed_renames_nothing(generations):
    """Generation 0's save of step 4 goes on after generation 2's rotation removed its temp folder: before its check
    (the check refuses it) or after it (its rename finds nothing to rename); either way it changes nothing."""
    root, old, new = generations
    writing = store.temp_dir(root / "step_00000004", old)
    save(root, 6, new, "new")
    assert not writing.exists()
    before = snapshot(root)

    writing.mkdir()  # the stale writer recreates its folder and writes on
    (writing / "weights.bin").write_text("old 4")
    with pytest.raises(StaleGenerationError):
        store.complete_checkpoint(writing, root / "step_00000004", {"step": 4}, best=False, verify=True,
                                  keep_last=10, generation=old)
    assert snapshot(root) == {**before, **{f"{writing.name}/{n}": h for n, h in snapshot(writing).items()}}

    # Its check passed just before the takeover; the newer group's rotation then removed the folder under it.
    shutil.rmtree(writing)
    with pytest.raises(FileNotFoundError):
        store.finalize(writing, root / "step_00000004", root, best=False)
    assert snapshot(root) == before and not (root / "step_00000004").exists()

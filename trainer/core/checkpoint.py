"""Atomic, verifiable checkpoints in `RUN_DIR/checkpoints/`.

A checkpoint is written into `.tmp-step_N/`, completed with `trainer_state.json` and a
`manifest.json` (size and sha256 of every file), then renamed to `step_N/`; only after that is
the `latest` pointer replaced (write-temp + os.replace). A crash at any moment leaves either the
previous complete checkpoint or the new one as `latest`, never a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from trainer.atomic_io import atomic_write_text, fsync_dir
from trainer.errors import CheckpointError

STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
TASK_STATS = "task_stats.json"
"""The task's training-data statistics (`TaskData.stats`), an artifact of every checkpoint and export."""




def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(ckpt_dir: Path, state: dict[str, Any], with_hashes: bool) -> None:
    """Write trainer_state.json, then the manifest of every file (the mark of completeness)."""
    (ckpt_dir / STATE).write_text(json.dumps(state, indent=1))
    files = {}
    for path in sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = str(path.relative_to(ckpt_dir))
        files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path) if with_hashes else None}
        with open(path, "rb") as f:  # on disk before the rename makes the checkpoint visible
            os.fsync(f.fileno())
    atomic_write_text(ckpt_dir / MANIFEST, json.dumps({"files": files}, indent=1))


def verify_checkpoint(ckpt_dir: Path, check_hashes: bool = True) -> dict[str, Any]:
    """Check a checkpoint against its manifest; return its trainer state or raise CheckpointError."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint {ckpt_dir} does not exist")
    manifest_path = ckpt_dir / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {ckpt_dir} is incomplete: no {MANIFEST} (the save was interrupted)")
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as err:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {MANIFEST} is unreadable ({err})") from None
    for rel, meta in files.items():
        path = ckpt_dir / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: file {rel} is missing")
        size = path.stat().st_size
        if size != meta["size"]:
            raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: file {rel} has {size} bytes, "
                                  f"expected {meta['size']} (truncated?)")
        if check_hashes and meta.get("sha256") and _sha256(path) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: file {rel} fails its sha256 check")
    try:
        return json.loads((ckpt_dir / STATE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {STATE} is unreadable ({err})") from None


def list_checkpoints(root: Path) -> list[Path]:
    """Complete-looking step directories, oldest first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(dirs, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def read_pointer(root: Path, name: str) -> Path | None:
    pointer = root / name
    if not pointer.is_file():
        return None
    target = root / pointer.read_text().strip()
    return target if target.is_dir() else None


def latest_checkpoint(root: Path) -> Path | None:
    """The `latest` pointer's target, else the newest complete step directory."""
    target = read_pointer(root, "latest")
    if target is not None:
        return target
    found = list_checkpoints(root)
    return found[-1] if found else None


def resume_candidates(root: Path) -> list[Path]:
    """Checkpoints to try for run.resume=auto, best first: `latest`, then older complete ones."""
    found = list_checkpoints(root)[::-1]
    latest = read_pointer(root, "latest")
    if latest is not None:
        found = [latest] + [p for p in found if p != latest]
    return found


def resolve_checkpoint(path_or_run: str | Path, which: str = "latest") -> Path:
    """A checkpoint dir from a checkpoint path, a checkpoints/ dir or a run dir (`latest` or `best`)."""
    path = Path(path_or_run)
    if (path / MANIFEST).is_file() or STEP_DIR.match(path.name):
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    target = read_pointer(root, which) if which == "best" else latest_checkpoint(root)
    if target is None:
        raise CheckpointError(f"no {which} checkpoint under {root}")
    return target


def finalize(tmp_dir: Path, final_dir: Path, root: Path, best: bool) -> None:
    """Rename a completed temp checkpoint into place and move the pointers (main process only)."""
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.rename(tmp_dir, final_dir)
    fsync_dir(root)
    atomic_write_text(root / "latest", final_dir.name + "\n")
    if best:
        atomic_write_text(root / "best", final_dir.name + "\n")


def rotate(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints and the best one; remove stale temp dirs."""
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    keep = set(list_checkpoints(root)[-keep_last:]) if keep_last > 0 else set()
    for name in ("best", "latest"):
        target = read_pointer(root, name)
        if target is not None:
            keep.add(target)
    removed = []
    for ckpt in list_checkpoints(root):
        if ckpt not in keep:
            shutil.rmtree(ckpt)
            removed.append(ckpt)
    return removed

"""The files of a checkpoint: atomic, verifiable checkpoints in `RUN_DIR/checkpoints/`.

A checkpoint is written into a temp folder of its worker group (`temp_dir`: `.tmp-step_N/`), completed with
`trainer_state.json` and a `manifest.json` (size and sha256 of every file, and when it was completed), then renamed
to `step_N/`; only after that are the `best` and then the `latest` pointers replaced (write-temp +
os.replace). A crash at any moment leaves complete checkpoints and at worst stale pointers, never a
half-written checkpoint under a step name. The pointers are therefore hints: `latest_checkpoint` and
`resume_candidates` go by the completion time in the manifests (a kill between the rename and the
pointer leaves `latest` one checkpoint behind), and `best_checkpoint` by the best step recorded in the
newest checkpoint's `trainer_state.json`; `repair_pointers` rewrites them on resume.

Each takeover of the run lock starts a new generation of the run (run_lock.py). A save carries the `Generation` of
its worker group and checks it before its renames and before the rotation: once a newer generation has taken the run
over, an older group (a node cut off from the others, still alive, its writer process too) renames nothing, moves no
pointer and removes nothing. Temp folders carry their generation (`.tmp-step_N.genG` from the first takeover on), so
two groups never write into one, and a rotation removes those of its own and older generations only.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.atomic_io import atomic_write_text, fsync_dir
from trainer.errors import CheckpointError

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")
TEMP_DIR = re.compile(r"^\.tmp-(step_\d+)(?:\.gen(\d+))?$")
"""A save's temp folder: `.tmp-step_N`, with `.genG` from a worker group of generation G >= 1."""
SET_ASIDE = ".old-"
"""The prefix of an older copy of a step set aside while the step is saved again (`finalize`)."""
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
TASK_STATS = "task_stats.json"
EMA_FILE = "ema.safetensors"
"""The task's training-data statistics (`TaskData.stats`), an artifact of every checkpoint and export."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class StaleGenerationError(CheckpointError):
    """A save of a worker group that a newer generation has taken the run over from: it left the checkpoints alone."""


def read_generation(file: Path) -> int:
    """The run's newest generation kept in `file` (run_lock.py), 0 before the first takeover."""
    try:
        text = Path(file).read_text()
    except FileNotFoundError:
        return 0
    number = int(text.strip()) if text.strip().isdigit() else None
    if number is None:
        raise CheckpointError(f"{file} holds {text.strip()[:40]!r}, not a generation number (the count of takeovers "
                              f"of the run lock that the trainer keeps there); remove it when no process of this run "
                              f"is alive any more")
    return number


@dataclass(frozen=True)
class Generation:
    """The generation a save belongs to: `number`, that of the process's worker group, and `file`, where the run's
    newest generation is kept (run_lock.py starts a new one at each takeover of the run lock)."""

    number: int
    file: Path

    def check(self, what: str) -> None:
        """Raise StaleGenerationError, `what` (what was not done) first, when a newer generation took the run over."""
        newest = read_generation(self.file)
        if newest > self.number:
            raise StaleGenerationError(
                f"{what}: this worker group is generation {self.number} of the run, and generation {newest} has taken "
                f"it over since ({self.file}); a group that was taken over leaves the checkpoints to the newer one")


def temp_dir(final: Path, generation: Generation | None) -> Path:
    """The folder a save of `final` is written into before its rename, one per generation (`TEMP_DIR`)."""
    suffix = f".gen{generation.number}" if generation is not None and generation.number else ""
    return final.with_name(f".tmp-{final.name}{suffix}")


def saved_as(tmp: Path) -> str:
    """The step folder name a temp folder (`temp_dir`) is saved as."""
    match = TEMP_DIR.match(Path(tmp).name)
    return match.group(1) if match else Path(tmp).name.removeprefix(".tmp-")


def _temp_generation(name: str) -> int | None:
    """The generation whose temp folder `name` is (0: the first), None when it is none."""
    match = TEMP_DIR.match(name)
    return None if match is None else int(match.group(2) or 0)


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
    # written_at orders checkpoints by completion: step numbers do not when a run went back to an older one.
    atomic_write_text(ckpt_dir / MANIFEST, json.dumps({"files": files, "written_at": time.time()}, indent=1))


def verify_checkpoint(ckpt_dir: Path, check_hashes: bool = True) -> dict[str, Any]:
    """Check a checkpoint against its manifest; return its trainer state or raise CheckpointError."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint {ckpt_dir} does not exist")
    manifest_path = ckpt_dir / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(no_manifest_reason(ckpt_dir))
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


def no_manifest_reason(ckpt_dir: Path) -> str:
    """Why a folder without a manifest is no checkpoint. An interrupted save leaves a `.tmp-` folder (the
    manifest is written before the rename), so a `step_N` folder without one came from elsewhere."""
    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir.name.startswith(".tmp-"):
        return (f"checkpoint {ckpt_dir} is an unfinished save (the run stopped before it was complete and renamed "
                f"into place; the next save removes it)")
    return (f"checkpoint {ckpt_dir} is incomplete: no {MANIFEST} (written by another tool, copied incompletely, "
            f"or its manifest was removed; an interrupted save leaves a .tmp- folder instead)")


def skipped_checkpoints(root: Path) -> list[str]:
    """Why each checkpoint-like folder under `root` that `list_checkpoints` leaves out is left out, by step."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        temp = TEMP_DIR.match(path.name)
        name = temp.group(1) if temp else path.name.removeprefix(SET_ASIDE)
        match = STEP_DIR.match(name)
        if not path.is_dir() or match is None:
            continue
        if path.name.startswith(SET_ASIDE):
            if _is_set_aside_copy(path):
                continue  # a resume candidate: run.resume=auto puts it back as `name` (`put_back`)
            replaced = (root / name).exists()
            reason = (f"checkpoint {path} is an older copy of {name}, set aside while {name} was saved again" +
                      (" (the next save removes it)" if replaced else
                       f" by a save that did not finish (the next save puts it back as {name})"))
        elif path.name.startswith(".tmp-") or not (path / MANIFEST).is_file():
            reason = no_manifest_reason(path)
        else:
            continue
        found.append((int(match.group(1)), path.name, reason))
    return [reason for *_, reason in sorted(found)]


def list_checkpoints(root: Path) -> list[Path]:
    """Complete-looking step directories (with a manifest), oldest first (by step); `skipped_checkpoints`
    says why any other checkpoint-like folder is left out."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(dirs, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def _completed_at(ckpt_dir: Path) -> float:
    """When a checkpoint was completed: its manifest's `written_at`, or the manifest's mtime where it has none."""
    manifest = ckpt_dir / MANIFEST
    try:
        written = json.loads(manifest.read_text()).get("written_at")
        if isinstance(written, (int, float)):
            return float(written)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return manifest.stat().st_mtime
    except OSError:
        return 0.0


def _by_completion(path: Path) -> tuple[float, int]:
    return _completed_at(path), int(STEP_DIR.match(path.name.removeprefix(SET_ASIDE)).group(1))


def newest_first(root: Path) -> list[Path]:
    """Complete-looking step directories, the most recently completed first."""
    return sorted(list_checkpoints(root), key=_by_completion, reverse=True)


def _is_set_aside_copy(path: Path) -> bool:
    """Whether `path` is a complete checkpoint set aside as `.old-step_N` whose `step_N` is missing: a kill between
    `finalize`'s two renames (where the file system cannot swap folders) left the step with no other copy."""
    name = path.name.removeprefix(SET_ASIDE)
    return (path.name.startswith(SET_ASIDE) and STEP_DIR.match(name) is not None and path.is_dir()
            and (path / MANIFEST).is_file() and not (path.parent / name).exists())


def set_aside_copies(root: Path) -> list[Path]:
    """The complete checkpoints a kill left set aside with no `step_N` of their step (`_is_set_aside_copy`)."""
    root = Path(root)
    return [p for p in root.glob(f"{SET_ASIDE}step_*") if _is_set_aside_copy(p)] if root.is_dir() else []


def read_pointer(root: Path, name: str) -> Path | None:
    pointer = Path(root) / name
    if not pointer.is_file():
        return None
    target = Path(root) / pointer.read_text().strip()
    return target if target.is_dir() else None


def latest_checkpoint(root: Path) -> Path | None:
    """The most recently completed checkpoint (`latest` may lag one behind after a kill), else `latest`."""
    found = newest_first(root)
    return found[0] if found else read_pointer(root, "latest")


def _recorded_best(ckpt_dir: Path) -> Path | None:
    """The best checkpoint that `ckpt_dir`'s trainer_state.json names, if it is there and complete."""
    try:
        step = json.loads((ckpt_dir / STATE).read_text()).get("best_step")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(step, int):
        return None
    target = ckpt_dir.parent / step_dir_name(step)
    return target if (target / MANIFEST).is_file() else None


def best_checkpoint(root: Path) -> Path | None:
    """The best checkpoint as the newest checkpoint that records one names it, else the `best` pointer.

    Every checkpoint's trainer_state.json carries the run's best step so far, so a kill before the
    `best` pointer was written (or a lost pointer) loses nothing."""
    for ckpt_dir in newest_first(root):
        found = _recorded_best(ckpt_dir)
        if found is not None:
            return found
    return read_pointer(root, "best")


def resume_candidates(root: Path) -> list[Path]:
    """Checkpoints to try for run.resume=auto, best first: the most recently completed, then older ones.

    Not the `latest` pointer: a kill between a checkpoint's rename and the pointer leaves it behind. A complete
    checkpoint a kill left set aside (`.old-step_N`, no `step_N`: `set_aside_copies`) is one too, in its place by
    completion; the resume puts it back as `step_N` (`put_back`) once its process holds the run lock."""
    return sorted(list_checkpoints(root) + set_aside_copies(root), key=_by_completion, reverse=True)


def is_set_aside(path: Path) -> bool:
    """Whether `path` names a checkpoint set aside (`.old-step_N`) rather than a step folder."""
    return Path(path).name.startswith(SET_ASIDE)


def put_back(path: Path, generation: Generation | None) -> Path:
    """Rename a checkpoint set aside (`.old-step_N`, see `set_aside_copies`) back to `step_N` and return that (main
    process, holding the run lock). `generation`: the resuming group's; a newer one on disk raises
    StaleGenerationError and nothing is renamed. A `step_N` that appeared since is not replaced (CheckpointError)."""
    path = Path(path)
    final = path.with_name(path.name.removeprefix(SET_ASIDE))
    if generation is not None:
        generation.check(f"checkpoint {path} was not put back as {final.name}")
    if final.exists():
        raise CheckpointError(f"checkpoint {path} was not put back as {final.name}: {final} appeared meanwhile (another "
                              f"run saving into {path.parent}?)")
    os.rename(path, final)
    fsync_dir(path.parent)
    return final


def repair_pointers(root: Path, resumed: Path) -> list[str]:
    """After resuming from `resumed` (run.resume=auto): point `latest` at it and `best` at the best
    checkpoint its state records, where a kill during finalisation left them stale or missing.
    Returns what was repaired (main process only)."""
    root, repaired = Path(root), []
    if read_pointer(root, "latest") != resumed:
        atomic_write_text(root / "latest", resumed.name + "\n")
        repaired.append(f"latest -> {resumed.name}")
    best = _recorded_best(resumed)
    if best is not None and read_pointer(root, "best") != best:
        atomic_write_text(root / "best", best.name + "\n")
        repaired.append(f"best -> {best.name}")
    return repaired


def resolve_checkpoint(path_or_run: str | Path, which: str = "latest") -> Path:
    """A checkpoint dir from a checkpoint path, a checkpoints/ dir or a run dir (`latest` or `best`)."""
    path = Path(path_or_run)
    if (path / MANIFEST).is_file() or STEP_DIR.match(path.name):
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    target = best_checkpoint(root) if which == "best" else latest_checkpoint(root)
    if target is None:
        raise CheckpointError(f"no {which} checkpoint under {root}")
    return target


def finalize(tmp_dir: Path, final_dir: Path, root: Path, best: bool) -> None:
    """Rename a completed temp checkpoint into place and move the pointers (main process only).

    Order matters for a kill at any point: an older checkpoint of the same step is swapped with the new one in one
    step where the file system can (`_exchange`), else renamed aside to `.old-step_N` first and renamed back if the
    second rename fails (a kill between the two leaves `.old-step_N` alone, which the resume, else the next
    save, puts back);
    `latest` is written last (its move means the whole save is done), and whatever a kill leaves stale is
    recovered on resume (`repair_pointers`)."""
    if final_dir.exists() and not (final_dir / MANIFEST).is_file():
        # Not a checkpoint this trainer completed (those have a manifest): keep it, renamed, rather than delete
        # what a user may have put there.
        kept = set_aside(final_dir, "replaced")
        logger.warning("%s had no %s (not a completed checkpoint): moved to %s before saving this step",
                       final_dir, MANIFEST, kept.name)
    replaced = None
    if not final_dir.exists():
        os.rename(tmp_dir, final_dir)
    elif _exchange(tmp_dir, final_dir):
        replaced = tmp_dir  # the older copy, under the temp folder's name
    else:
        replaced = root / f"{SET_ASIDE}{final_dir.name}"
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final_dir, replaced)
        try:
            os.rename(tmp_dir, final_dir)
        except BaseException:
            os.rename(replaced, final_dir)
            raise
    fsync_dir(root)
    if best:
        atomic_write_text(root / "best", final_dir.name + "\n")
    atomic_write_text(root / "latest", final_dir.name + "\n")
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = frozenset((errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV))


@functools.cache
def _renameat2() -> Any:
    """libc's renameat2 (Linux, glibc 2.28 and later), None where there is none."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one atomic step (renameat2's RENAME_EXCHANGE); False where the platform or the file system
    cannot, and nothing was moved."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def complete_checkpoint(tmp: Path, final: Path, record: dict[str, Any], best: bool, verify: bool, keep_last: int,
                        set_aside_existing: bool = False, generation: Generation | None = None) -> list[str]:
    """Complete a checkpoint whose files are in `tmp`: trainer_state.json and the manifest (hashes unless not
    `verify`), the rename to `final`, the pointers, the rotation. Returns warnings to log (old checkpoints it
    could not remove: the new one is complete, so they are no error). `set_aside_existing`: an existing `final`
    failed verification when the run resumed from an older checkpoint: keep it renamed rather than replace it.
    `generation`: the save's; a newer one on disk raises StaleGenerationError before anything outside `tmp` is
    touched (after the rename: the rotation is skipped, with a warning)."""
    warnings = []
    root = final.parent
    write_manifest(tmp, record, with_hashes=verify)
    if generation is not None:
        generation.check(f"checkpoint {final} was not renamed into place")
    if set_aside_existing and final.exists():
        kept = set_aside(final, "corrupt")
        warnings.append(f"{final} failed verification when the run resumed from an older checkpoint: moved to "
                        f"{kept.name} before saving this step")
    finalize(tmp, final, root, best=best)
    try:
        rotate(root, keep_last, generation)
    except StaleGenerationError as err:
        warnings.append(str(err))
    except OSError as err:
        warnings.append(f"could not remove old checkpoints under {root}: {err}")
    return warnings


def set_aside(ckpt_dir: Path, why: str) -> Path:
    """Rename `ckpt_dir` to `<name>.<why>-<time>` (never deleted: out of the run's way, there to inspect)."""
    kept = ckpt_dir.with_name(f"{ckpt_dir.name}.{why}-{time.strftime('%Y%m%dT%H%M%S')}")
    os.rename(ckpt_dir, kept)
    return kept


def rotate(root: Path, keep_last: int, generation: Generation | None = None) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints and the best one; remove the temp folders of `generation`
    and older ones (a newer one's may be in use), put back an older copy that a kill left set aside, and remove
    one that was replaced. A newer generation on disk than `generation` raises StaleGenerationError first."""
    if generation is not None:
        generation.check(f"old checkpoints under {root} were not removed")
    own = generation.number if generation is not None else 0
    for stale in root.glob(".tmp-step_*"):
        owner = _temp_generation(stale.name)
        if owner is not None and owner <= own:
            shutil.rmtree(stale, ignore_errors=True)
    for aside in root.glob(f"{SET_ASIDE}step_*"):
        final = root / aside.name.removeprefix(SET_ASIDE)
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(aside, final)
    for doomed in root.glob(f"{REMOVING}step_*"):
        shutil.rmtree(doomed, ignore_errors=True)
    remove_conversion_scratch(root)
    keep = set(newest_first(root)[:keep_last]) if keep_last > 0 else set()
    for target in (read_pointer(root, "best"), read_pointer(root, "latest"), best_checkpoint(root)):
        if target is not None:
            keep.add(target)
    removed = []
    for ckpt in list_checkpoints(root):
        if ckpt not in keep:
            # Renamed first: a kill halfway through the removal must not leave a step folder with its manifest and
            # part of its files.
            doomed = ckpt.with_name(f"{REMOVING}{ckpt.name}")
            os.rename(ckpt, doomed)
            shutil.rmtree(doomed)
            removed.append(ckpt)
    return removed


REMOVING = ".removing-"
"""The prefix of a checkpoint the rotation is removing."""


CONVERSION_SCRATCH = ".universal-"
"""The prefix of a resume's conversion folder beside the checkpoints (manager.py)."""
DEEPSPEED_POINTER = "latest_universal"
"""DeepSpeed's converter writes this pointer beside its output folder: never one of ours."""


def remove_conversion_scratch(root: Path) -> None:
    """Remove what a conversion a kill interrupted left beside the checkpoints: its scratch folders, and any
    pointer of DeepSpeed's converter there (it writes one beside its output folder)."""
    root = Path(root)
    if not root.is_dir():
        return
    for stale in root.glob(f"{CONVERSION_SCRATCH}step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    (root / DEEPSPEED_POINTER).unlink(missing_ok=True)

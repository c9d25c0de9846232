"""What a failed write says about the storage under it, and the one description of a disk's space.

`disk_verdict` names the storage's fault behind an error of Python, safetensors, torch or SQLite, each as itself:
a full disk, an exceeded quota, an I/O error, a stale NFS handle. `no_space_reason` is the part of it that freeing
space cures; `space_report` describes the space (the folder, its free space, the size needed) in one way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

NO_SPACE = "no space left on device"
QUOTA = "disk quota exceeded"
IO_ERROR = "I/O error"
STALE_HANDLE = "stale NFS file handle"
OUT_OF_SPACE = (NO_SPACE, QUOTA)
"""The verdicts that more room cures (`no_space_reason`)."""

_BY_ERRNO = {errno.ENOSPC: NO_SPACE, errno.EDQUOT: QUOTA, errno.EIO: IO_ERROR, errno.ESTALE: STALE_HANDLE}
# Where an error carries no errno: its number in words (safetensors: "I/O error: No space left on device (os error
# 28)"; Python's "[Errno 122] ..." inside another error's text), else the system's and SQLite's words (Optuna wraps
# SQLite's "database or disk is full" and "disk I/O error" in a StorageInternalError). safetensors' own "I/O error:"
# prefixes every failed write, so it is not read as EIO.
_ERRNO_IN_WORDS = re.compile(r"os error (\d+)|\[errno (\d+)\]")
_BY_WORDS = ((NO_SPACE, ("no space left on device", "database or disk is full")),
             (QUOTA, ("disk quota exceeded",)),
             (IO_ERROR, ("input/output error", "disk i/o error")),
             (STALE_HANDLE, ("stale file handle", "stale nfs file handle")))
LOW_SPACE = 1 << 20
"""Less free than this right after a write failed, with what it wrote still there: the disk filled up (what a full
disk shows free varies by filesystem: reserved blocks, a block or two of slack, metadata)."""
_VERDICT = "_trainer_disk_verdict"


def _verdict_in_words(err: BaseException) -> tuple[str | None, bool]:
    """(the verdict the errors' numbers or words give, whether it was taken before and kept on one of them)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        known = getattr(current, _VERDICT, None)
        if known is not None:
            return known or None, True
        code = current.errno if isinstance(current, OSError) else None
        if code in _BY_ERRNO:
            return _BY_ERRNO[code], False
        text = str(current).lower()
        for match in _ERRNO_IN_WORDS.finditer(text):
            if (number := int(match.group(1) or match.group(2))) in _BY_ERRNO:
                return _BY_ERRNO[number], False
        for verdict, words in _BY_WORDS:
            if any(w in text for w in words):
                return verdict, False
        current = current.__cause__ or current.__context__
    return None, False


def disk_verdict(err: BaseException, writing: str | Path | None = None) -> str | None:
    """NO_SPACE, QUOTA, IO_ERROR or STALE_HANDLE when `err` (or what caused it) is one, else None.

    The error's number or words decide where they name one of them. torch's C++ writer names none: it reports any
    failed write as a short one ("unexpected pos", "PytorchStreamWriter failed writing ... file write failed") or
    as "basic_ios::clear: iostream error", whether the disk filled, a quota ran out or the device failed. So an error
    other than an OSError of another cause is a full disk only when the filesystem `writing` (the file or folder being
    written) is on has less than LOW_SPACE free now: call it first, before the failed write's output is removed.
    The verdict stays with `err`, so later calls agree."""
    verdict, known = _verdict_in_words(err)
    if known or verdict is not None or writing is None:
        return verdict
    named_cause = isinstance(err, OSError) and err.errno is not None
    own_words = type(err).__module__.startswith("trainer.")  # our errors name their own cause
    if not named_cause and not own_words:
        free = free_bytes(writing)
        verdict = NO_SPACE if free is not None and free < LOW_SPACE else None
    with contextlib.suppress(AttributeError, TypeError):  # an exception type without a __dict__ keeps no verdict
        setattr(err, _VERDICT, verdict or "")
    return verdict


def no_space_reason(err: BaseException, writing: str | Path | None = None) -> str | None:
    """NO_SPACE ('no space left on device') or QUOTA ('disk quota exceeded') when `err` is one (`disk_verdict`),
    else None: an I/O error or a stale handle is no lack of space."""
    verdict = disk_verdict(err, writing)
    return verdict if verdict in OUT_OF_SPACE else None


def space_report(folder: str | Path, needed: int | None, estimate: str = "", reason: str | None = NO_SPACE) -> str:
    """The one description of a full disk's space: '48.0 KiB free in FOLDER now, 1.2 MiB needed', with
    `estimate` ('the checkpoint's size') saying how the size needed was judged where it is not exact. With `reason`
    QUOTA the quota ran out, not the disk: '2.0 TiB free in FOLDER now but none under your disk quota, ...'."""
    room = f"{format_bytes(free_bytes(folder))} free in {folder} now"
    if reason == QUOTA:
        room += " but none under your disk quota"
    if needed is None:
        return room
    size = f"about {format_bytes(needed)} needed ({estimate})" if estimate else f"{format_bytes(needed)} needed"
    return f"{room}, {size}"


def require_space(folder: str | Path, needed: int) -> None:
    """Before a write of `needed` bytes into `folder`: raise ENOSPC (naming the folder) when there is less free,
    rather than fill the disk and fail part way."""
    free = free_bytes(folder)
    if free is not None and free < needed:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))


def disk_bytes(path: str | Path) -> int:
    """What a file or folder takes on disk (allocated blocks where the system reports them); 0 if it is gone."""
    path = Path(path)
    files = [path] if not path.is_dir() else [p for p in path.rglob("*") if not p.is_dir()]
    total = 0
    for file in files:
        try:
            st = file.lstat()
        except OSError:
            continue
        total += max(st.st_size, getattr(st, "st_blocks", 0) * 512)
    return total


def free_bytes(path: str | Path) -> int | None:
    """Free space on the filesystem holding `path` (or its nearest existing parent), None if unknown."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def format_bytes(n: float | None) -> str:
    """`n` bytes for a reader: '512 B', '48.0 KiB', '1.2 MiB'."""
    if n is None:
        return "an unknown amount"
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"

"""Atomic file writes: readers see the old file or the new one, never half of one.

Write to a temp file in the same folder, flush and fsync it, `os.replace` it over the target, fsync
the folder. Used for checkpoint pointers and manifests, cache sidecars, results files and markers.
Also: recognising a full disk, from the errors of Python, safetensors, torch and SQLite or else by looking at the
disk after a failed write, and describing it in one way: the folder, its free space and the size needed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Any


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: str | Path) -> Path:
    """A temp name beside `path`, unique per host, process and thread (ranks on several nodes, with the
    same small container pids, may write into one shared folder)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}.tmp")


def temp_paths_of(path: str | Path) -> list[Path]:
    """Every temp file `temp_path` may have made for `path` (by any host, process or thread)."""
    path = Path(path)
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))


def atomic_write_bytes(path: str | Path, data: bytes, durable: bool = True) -> None:
    """Replace `path` by `data` atomically; `durable` also fsyncs the file and its folder."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str, durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), durable)


def atomic_write_json(path: str | Path, obj: Any, durable: bool = True, **dumps: Any) -> None:
    dumps.setdefault("indent", 1)
    atomic_write_text(path, json.dumps(obj, **dumps), durable)


# A full disk. Python reports ENOSPC as OSError; safetensors as SafetensorError ("... I/O error: No space left
# on device (os error 28)"); torch's zip writer only as a short write ("[enforce fail at inline_container.cc]
# . unexpected pos 8448 vs 8342", "PytorchStreamWriter failed writing file data/0: file write failed"); SQLite
# (an Optuna study) as "database or disk is full". Other words are not a full disk's alone: torch's writer may
# say only "basic_ios::clear: iostream error", which `no_space_reason` tells by looking at the disk.
_NO_SPACE_TEXTS = ("no space left on device", "os error 28", "unexpected pos ", "pytorchstreamwriter failed writing",
                   "file write failed", "database or disk is full")
_QUOTA_TEXTS = ("disk quota exceeded", "os error 122")
NO_SPACE = "no space left on device"
LOW_SPACE = 1 << 20
"""Less free than this right after a write failed, with what it wrote still there: the disk filled up (what a full
disk shows free varies by filesystem: reserved blocks, a block or two of slack, metadata)."""
_VERDICT = "_trainer_no_space"


def _reason_in_words(err: BaseException) -> str | None:
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        known = getattr(current, _VERDICT, None)
        if known is not None:
            return known or None
        code = current.errno if isinstance(current, OSError) else None
        text = str(current).lower()
        if code == errno.EDQUOT or any(t in text for t in _QUOTA_TEXTS):
            return "disk quota exceeded"
        if code == errno.ENOSPC or any(t in text for t in _NO_SPACE_TEXTS):
            return NO_SPACE
        current = current.__cause__ or current.__context__
    return None


def no_space_reason(err: BaseException, writing: str | Path | None = None) -> str | None:
    """'no space left on device' or 'disk quota exceeded' when `err` (or what caused it) is one, else None.

    The error's words decide where they say so. Where they do not (torch's C++ writer reports a full disk as
    "basic_ios::clear: iostream error"), an error other than an OSError of another cause is a full disk when the
    filesystem `writing` (the file or folder being written) is on has less than LOW_SPACE free now: call it
    first, before the failed write's output is removed. The verdict stays with `err`, so later calls agree."""
    reason = _reason_in_words(err)
    if reason is not None or writing is None or hasattr(err, _VERDICT):
        return reason
    named_cause = isinstance(err, OSError) and err.errno is not None
    own_words = type(err).__module__.startswith("trainer.")  # our errors name their own cause
    if not named_cause and not own_words:
        free = free_bytes(writing)
        reason = NO_SPACE if free is not None and free < LOW_SPACE else None
    with contextlib.suppress(AttributeError, TypeError):  # an exception type without a __dict__ keeps no verdict
        setattr(err, _VERDICT, reason or "")
    return reason


def space_report(folder: str | Path, needed: int | None, estimate: str = "") -> str:
    """The one description of a full disk's space: '48.0 KiB free in FOLDER now, 1.2 MiB needed', with
    `estimate` ('the checkpoint's size') saying how the size needed was judged where it is not exact."""
    free = f"{format_bytes(free_bytes(folder))} free in {folder} now"
    if needed is None:
        return free
    size = f"about {format_bytes(needed)} needed ({estimate})" if estimate else f"{format_bytes(needed)} needed"
    return f"{free}, {size}"


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

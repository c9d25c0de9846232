"""Atomic file writes: readers see the old file or the new one, never half of one.

Write to a temp file in the same folder, flush and fsync it, `os.replace` it over the target, fsync
the folder. Used for checkpoint pointers and manifests, cache sidecars, results files and markers.
Also: recognising a full disk in the errors of Python, safetensors and torch, and how much space there is.
"""

from __future__ import annotations

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
# . unexpected pos 8448 vs 8342", "PytorchStreamWriter failed writing file data/0: file write failed").
_NO_SPACE_TEXTS = ("no space left on device", "os error 28", "unexpected pos ", "pytorchstreamwriter failed writing",
                   "file write failed")
_QUOTA_TEXTS = ("disk quota exceeded", "os error 122")


def no_space_reason(err: BaseException) -> str | None:
    """'no space left on device' or 'disk quota exceeded' when `err` (or what caused it) is one, else None."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        code = current.errno if isinstance(current, OSError) else None
        text = str(current).lower()
        if code == errno.EDQUOT or any(t in text for t in _QUOTA_TEXTS):
            return "disk quota exceeded"
        if code == errno.ENOSPC or any(t in text for t in _NO_SPACE_TEXTS):
            return "no space left on device"
        current = current.__cause__ or current.__context__
    return None


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
    if n is None:
        return "an unknown amount"
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"

"""Atomic file writes: readers see the old file or the new one, never half of one.

Write to a temp file in the same folder, flush and fsync it, `os.replace` it over the target, fsync
the folder. Used for checkpoint pointers and manifests, cache sidecars, results files and markers.
What a failed write says about the disk (a full disk, a quota, an I/O error) is told by `trainer.disk_space`,
whose names are importable from here too.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.disk_space import (  # noqa: F401 - re-exported: a writer takes its disk checks from here too
    IO_ERROR,
    LOW_SPACE,
    NO_SPACE,
    OUT_OF_SPACE,
    QUOTA,
    STALE_HANDLE,
    disk_bytes,
    disk_verdict,
    format_bytes,
    free_bytes,
    no_space_reason,
    require_space,
    space_report,
)


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
    atomic_write_pieces(path, [data], durable)


def atomic_write_pieces(path: str | Path, pieces: Iterable[bytes], durable: bool = True) -> None:
    """Replace `path` atomically by the concatenation of `pieces`, written as they come (a large report is never
    one string in memory); `durable` also fsyncs the file and its folder."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            for data in pieces:
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

"""What every benchmark section records: when, on what machine, by which command."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys


def cpu_model() -> str:
    """The CPU's model name and core count."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line() -> str:
    """The command that ran this benchmark, as one would type it again."""
    return shlex.join([os.path.basename(sys.executable), *sys.argv])

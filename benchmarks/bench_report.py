"""What every benchmark section records: when, on what machine, by which command."""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import sys
from pathlib import Path


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



_DATED = re.compile(r",\s*\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC\s*$")


def section_title(heading: str) -> str:
    """`## Overhead benchmark, 2026-11-22 01:55 UTC` -> `Overhead benchmark` (the key a rerun replaces)."""
    return _DATED.sub("", heading.lstrip("#").strip()).strip()


def write_section(path: str | Path, section: str) -> None:
    """Put `section` (markdown starting with a `## Title, date` heading) into the file at `path`: it
    replaces the section of the same title (heading to the next `## `), or is appended if none has it.

    So BENCHMARKS.md holds each benchmark's current figures exactly once; history lives in git.
    """
    section = section.strip("\n")
    heading = section.splitlines()[0]
    if not heading.startswith("## "):
        raise ValueError(f"a benchmark section starts with a '## ' heading, not {heading!r}")
    title = section_title(heading)
    path = Path(path)
    preamble: list[str] = []
    blocks: list[list[str]] = []  # each: a "## " heading and the lines up to the next one
    for line in (path.read_text().splitlines() if path.is_file() else []):
        if line.startswith("## "):
            blocks.append([line])
        elif blocks:
            blocks[-1].append(line)
        else:
            preamble.append(line)
    parts, placed = [], False
    for block in blocks:
        if section_title(block[0]) != title:
            parts.append("\n".join(block).strip("\n"))
        elif not placed:  # later sections of the same title (appended by older runs) are dropped
            parts.append(section)
            placed = True
    if not placed:
        parts.append(section)
    head = "\n".join(preamble).strip("\n")
    path.write_text("\n\n".join([head, *parts] if head else parts) + "\n")


def publish_section(section: str, out: str | Path | None, smoke: bool) -> None:
    """Print a benchmark's section, then write it into `out` (BENCHMARKS.md) unless this is a `--smoke` run."""
    print(section)
    if smoke:
        print("smoke run: nothing written")
    elif out:
        write_section(out, section)

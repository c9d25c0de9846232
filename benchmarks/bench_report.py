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



_DATED = re.compile(r",\s*\d{4}-\d{2}-\d{2}\b.*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def section_title(heading: str) -> str:
    """`## Overhead benchmark, 2026-11-22 01:55 UTC` -> `Overhead benchmark`: the heading without its date (from
    the first `, YYYY-MM-DD` on), the key by which a rerun finds its topic."""
    return _DATED.sub("", heading.lstrip("#").strip()).strip()


def _headings(lines: list[str]) -> list[bool]:
    """For each line: whether it is a markdown heading (outside fenced code, where `# ...` is a shell comment)."""
    out, fenced = [], False
    for line in lines:
        if _FENCE.match(line):
            fenced = not fenced
        out.append(not fenced and line.startswith("#"))
    return out


def _measurement(section: str) -> list[str]:
    """The section as a measurement of BENCHMARKS.md: its heading at `### `, its sub-headings one level below.
    Scripts print `## Title, date` (a page of its own on stdout); a `### ` section is taken as it is."""
    lines = section.strip("\n").splitlines()
    if lines and lines[0].startswith("### "):
        return lines
    if not lines or not lines[0].startswith("## "):
        raise ValueError(f"a benchmark section starts with a '## ' heading, not {lines[0] if lines else ''!r}")
    return ["#" + line if heading else line for line, heading in zip(lines, _headings(lines))]


def write_section(path: str | Path, section: str, topic: str | None = None) -> None:
    """File `section` (markdown starting with a `## Title, date` heading) into the BENCHMARKS.md at `path` as the
    newest measurement of its topic: demoted to `### Title, date`, placed at the top of the topic (after the
    topic's introduction), above the older measurements, which stay.

    Its topic (a `## ` section of the file): the one that already holds a measurement of the same title (the
    heading without its date); else `topic`; else a topic named after the title. A topic not in the file yet is
    appended at its end. A measurement with the very same heading (title and minute) is replaced in place, so
    writing one section twice leaves one copy. Other topics and measurements are left as they are.
    """
    new = _measurement(section)
    heading, title = new[0], section_title(new[0])
    path = Path(path)
    lines = path.read_text().splitlines() if path.is_file() else []
    # preamble, then topics: [topic heading, intro lines, [measurement blocks]]
    preamble: list[str] = []
    topics: list[list] = []
    for line, is_heading in zip(lines, _headings(lines)):
        if is_heading and line.startswith("## "):
            topics.append([line, [], []])
        elif not topics:
            preamble.append(line)
        elif is_heading and line.startswith("### "):
            topics[-1][2].append([line])
        elif topics[-1][2]:
            topics[-1][2][-1].append(line)
        else:
            topics[-1][1].append(line)

    def place() -> None:
        for t in topics:
            for k, block in enumerate(t[2]):
                if block[0].strip() == heading.strip():
                    t[2][k] = new
                    return
        home = next((t for t in topics if any(section_title(b[0]) == title for b in t[2])), None)
        name = topic or title
        home = home or next((t for t in topics if t[0][3:].strip() == name), None)
        if home is None:
            home = [f"## {name}", [], []]
            topics.append(home)
        home[2].insert(0, new)

    place()
    parts = ["\n".join(preamble).strip("\n")]
    for head, intro, blocks in topics:
        intro_text = "\n".join(intro).strip("\n")
        parts.append(f"{head}\n\n{intro_text}" if intro_text else head)
        parts += ["\n".join(block).strip("\n") for block in blocks]
    path.write_text("\n\n".join(part for part in parts if part) + "\n")


def publish_section(section: str, out: str | Path | None, smoke: bool, topic: str | None = None) -> None:
    """Print a benchmark's section, then write it into `out` (BENCHMARKS.md, under `topic`: `write_section`) unless
    this is a `--smoke` run."""
    print(section)
    if smoke:
        print("smoke run: nothing written")
    elif out:
        write_section(out, section, topic)

"""Console output of the runner: a status table redrawn in place on a terminal, else one line per event."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from trainer.sweep.record import RunRecord
from trainer.sweep.results import counts

TTY_REFRESH_S = 5.0


def render_table(records: Sequence[RunRecord], live_rss: Mapping[str, float] | None = None) -> str:
    """Plain-text status table: one row per experiment plus a count line (`live_rss`: MiB of running ones)."""
    now = time.time()
    rows = [("NAME", "STATUS", "DEVICES", "RUNTIME", "PEAK RSS MiB", "EXIT")]
    for r in records:
        runtime = r.runtime_s
        if r.status == "running" and r.start_epoch:
            runtime = now - r.start_epoch
        devices = ",".join(map(str, r.gpus)) if r.gpus else (
            "cpu" + ",".join(map(str, r.slots)) if r.slots is not None else "")
        peak = (live_rss or {}).get(r.name) or r.peak_rss_mib
        exit_text = "" if r.exit_code is None else str(r.exit_code)
        if r.signal:
            exit_text += f" ({r.signal})"
        rows.append((r.name, r.status, devices, "" if runtime is None else f"{runtime:.1f}s",
                     "" if not peak else f"{peak:.0f}", exit_text))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(count_line(records))
    return "\n".join(lines)


def count_line(records: Sequence[RunRecord]) -> str:
    return ", ".join(f"{n} {status}" for status, n in counts(records).items() if n)


class StatusDisplay:
    """A table redrawn in place on a terminal; one line per event when stdout is a file or pipe."""

    def __init__(self, stream: TextIO | None, tty: bool | None = None):
        self.stream = stream
        self.tty = bool(stream is not None and (stream.isatty() if tty is None else tty))
        self.drawn_lines = 0
        self.last_draw = 0.0

    def event(self, text: str) -> None:
        if self.stream is None or self.tty:
            return
        self.stream.write(f"[{time.strftime('%H:%M:%S')}] {text}\n")
        self.stream.flush()

    def table(self, records: Sequence[RunRecord], live_rss: Mapping[str, float] | None = None,
              force: bool = False) -> None:
        if self.stream is None or not self.tty:
            return
        now = time.monotonic()
        if not force and now - self.last_draw < TTY_REFRESH_S:
            return
        self.last_draw = now
        text = render_table(records, live_rss)
        # Move up over the previous table and clear to the end of the screen, then draw the new one.
        prefix = f"\x1b[{self.drawn_lines}F\x1b[J" if self.drawn_lines else ""
        self.stream.write(prefix + text + "\n")
        self.stream.flush()
        self.drawn_lines = text.count("\n") + 1

    def message(self, text: str) -> None:
        if self.stream is None:
            return
        self.stream.write(text + "\n")
        self.stream.flush()
        self.drawn_lines = 0  # the message scrolled the table out of reach; draw a fresh one below

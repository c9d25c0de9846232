"""The command line a person typed, for the lines that tell them what to run next (e.g. how to resume).

Imports no torch: the front end (core/launch.py) uses it too.
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.core.watchdog import started_by_launcher

if TYPE_CHECKING:
    from trainer.config import Config
    from trainer.rundir import RunDir

FRONT_END_ENV = "TRAINER_FRONT_END"
"""Set by `trainer train --nproc` (core/launch.py) for the ranks it starts: after a stop the ranks exit 0, so
the launcher between them stays quiet, and the front end, which reads the run's marker, says what happened
and exits with the stop's status."""


RANK_STATUS_ENV = "TRAINER_RANK_STATUS_DIR"
"""Set by the front end for the ranks it starts: each rank registers there and writes its exit status
(core/launch.py: `register_rank`, `write_rank_status`)."""


def interrupted_line(step: int | str, max_steps: int, checkpoint: Path | str | None, resume: str) -> str:
    """The one line a run stopped by Ctrl-C ends with."""
    return (f"trainer: interrupted by Ctrl-C at step {step} of {max_steps}: checkpoint {checkpoint} written; "
            f"resume with: {resume}")


def already_complete_line(run_dir: RunDir, step: int, planned: int, checkpoint: Path) -> str:
    """The one line a rerun of a finished run says: it trains and writes nothing; its results are `checkpoint`'s."""
    when = datetime.datetime.fromtimestamp(checkpoint.stat().st_mtime).strftime("%Y-%m-%d %H:%M")
    done = (f"run already complete at step {step}/{planned}" if step == planned else
            f"{run_dir.root} holds a run that ended at step {step}, past this config's plan of {planned} steps "
            f"(another config trained it)")
    return (f"{done}: nothing to train; its results are from {when} ({run_dir.metrics}, {checkpoint}); "
            f"run.resume=none or another run.output_dir trains this config")


def started_by_front_end(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a rank that `trainer train --nproc` started."""
    return environ.get(FRONT_END_ENV) == "1"


def resume_command(cfg: Config, argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> str:
    """The command that resumes this run: the one that started it (the launcher's, for a rank started by one),
    with `run.resume=auto` where it said otherwise."""
    words = list(argv) if argv is not None else _starting_command(environ)
    resumes = [w.startswith("run.resume=") for w in words]
    words = ["run.resume=auto" if r else w for w, r in zip(words, resumes)]
    if cfg.run.resume != "auto" and not any(resumes):
        words.append("run.resume=auto")
    return shlex.join(words)


def _starting_command(environ: Mapping[str, str]) -> list[str]:
    """The command line a person typed: this process's, or its launcher's (Linux /proc) for a launched rank."""
    words = [sys.executable, *sys.argv]
    if started_by_launcher(environ):
        pid = os.getppid()
        for _ in range(2):  # the deepspeed launcher starts ranks from a per-node helper: its parent was typed
            launcher = _cmdline(pid)
            if launcher is None:
                break
            words = launcher
            if "deepspeed.launcher.launch" not in launcher:
                break
            pid = _parent_of(pid)
    return _as_typed(words)


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [w.decode(errors="replace") for w in raw.split(b"\0")[:-1]] or None


def _parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _as_typed(words: list[str]) -> list[str]:
    """`/venv/bin/python /venv/bin/accelerate launch ...` -> `accelerate launch ...`; a script keeps `python`."""
    if len(words) >= 2 and Path(words[0]).name.startswith("python"):
        program = words[1]
        if Path(program).name == "__main__.py":  # python -m trainer
            return ["python", "-m", Path(program).parent.name, *words[2:]]
        if program == "-m" or program.endswith(".py"):
            return ["python", *words[1:]]
        return [Path(program).name, *words[2:]]
    return [Path(words[0]).name, *words[1:]] if words else words

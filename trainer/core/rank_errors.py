"""A rank's unexpected error: its traceback kept in the run folder, a lost peer told from an error of the run's own.

Every rank started by a launcher that fails with an error that is not the user's input (those are one line,
trainer/errors.py) appends its traceback to `RUN_DIR/errors/rank<RANK>.txt` (and, under torch's elastic agent,
to the agent's error file, TORCHELASTIC_ERROR_FILE, which its final report shows). Then:

- a peer lost under an agent that restarts the group (core/elastic.py `lost_peer`: a connection or store error,
  or a collective's timeout while some rank stopped beating): one line per node naming the file; the agent restarts
  the group;
- any other error under such an agent is the run's own (a CUDA fault, a collective's size mismatch, an
  out-of-memory, a collective that timed out with every rank alive): a restart would hit it again. The rank
  records it in `RUN_DIR/errors/failed.json`; the front end of every node (`trainer train --nnodes`) stops its
  agent when it appears and ends with the traceback and one line, and a worker group that starts after it (bare
  torchrun) refuses to train (`raise_if_run_failed`);
- without restarts the error propagates as before (its traceback printed), the file kept beside it.

Importing this module does not import torch.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.core.command_line import started_by_front_end
from trainer.core.elastic import EVERY_RANK_ALIVE, every_rank_alive, lost_peer, restartable
from trainer.core.watchdog import started_by_launcher
from trainer.errors import LaunchError, first_line

ERRORS_DIR = "errors"
"""The folder of the run directory that keeps the ranks' tracebacks."""

FAILED_FILE = "failed.json"
"""In ERRORS_DIR: the error of an elastic run's own that stopped it (rank, error, traceback file, time)."""


def traceback_file(run_dir: str | Path, environ: Mapping[str, str] = os.environ) -> Path:
    """Where rank RANK's tracebacks are kept."""
    return Path(run_dir) / ERRORS_DIR / f"rank{environ.get('RANK', '0')}.txt"


def keep_traceback(err: BaseException, run_dir: str | Path, environ: Mapping[str, str] = os.environ) -> Path | None:
    """Append `err`'s traceback to this rank's file (a header names the time, host, process and worker group);
    also write torch's elastic error file when the agent asked for one. The file, or None if it cannot be
    written (the run folder's disk full or gone: the error itself matters more)."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    _write_agent_error_file(err, text, environ)
    path = traceback_file(run_dir, environ)
    header = (f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {environ.get('RANK', '0')} (local "
              f"{environ.get('LOCAL_RANK', '0')}) on {socket.gethostname()}, pid {os.getpid()}"
              + (f", rendezvous {environ['TORCHELASTIC_RUN_ID']} restart {environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
                 if environ.get("TORCHELASTIC_RUN_ID") else "") + " ---\n")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(header + text + "\n")
    except OSError:
        return None
    return path


def _write_agent_error_file(err: BaseException, text: str, environ: Mapping[str, str]) -> None:
    """torch elastic's `@record` error file (the format of its ErrorHandler.record_exception): the agent's report
    of a failed worker then shows this error and traceback instead of `<N/A>`."""
    path = environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(err).__name__}: {err}",
                        "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass


def describe_failure(err: BaseException, environ: Mapping[str, str] = os.environ) -> str:
    """One line for an error of the run's own: its type and first line, after what it means where a collective timed
    out with every rank of the group alive (core/elastic.py `every_rank_alive`)."""
    what = f"{type(err).__name__}: {first_line(err)}"
    return f"{EVERY_RANK_ALIVE} ({what[:200]})" if every_rank_alive(err, environ) else what


def record_failure(err: BaseException, run_dir: str | Path, kept: Path | None,
                   environ: Mapping[str, str] = os.environ) -> None:
    """Record the error that ends an elastic run (FAILED_FILE), for the front ends and the next worker group."""
    folder = Path(run_dir) / ERRORS_DIR
    record = {"run_id": environ.get("TORCHELASTIC_RUN_ID"), "rank": environ.get("RANK", "0"),
              "host": socket.gethostname(), "time": time.time(), "error": describe_failure(err, environ),
              "traceback": str(kept) if kept else None}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{FAILED_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, folder / FAILED_FILE)
    except OSError:
        pass


def read_failure(run_dir: str | Path, run_id: str | None, since: float) -> dict[str, Any] | None:
    """The recorded failure of rendezvous run `run_id` written at or after `since` (wall time), else None."""
    try:
        record = json.loads((Path(run_dir) / ERRORS_DIR / FAILED_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("run_id") != run_id:
        return None
    try:
        return record if float(record.get("time", 0)) >= since else None
    except (TypeError, ValueError):
        return None


def failure_line(record: Mapping[str, Any]) -> str:
    """One line for a recorded failure: the rank, its error and where its traceback is."""
    where = f"; its traceback: {record['traceback']}" if record.get("traceback") else ""
    return (f"rank {record.get('rank', '?')} on {record.get('host', '?')} failed with an error a restart would "
            f"repeat: {record.get('error', '?')}{where}")


def report_rank_failure(err: BaseException, run_dir: str | Path | None,
                        environ: Mapping[str, str] = os.environ) -> int | None:
    """What the command line does with an unexpected error in a rank: keep its traceback, then say it in one line
    and return the exit status, or return None to let it propagate (its traceback printed). Module docstring."""
    if not started_by_launcher(environ):
        return None  # a plain process: the traceback on the terminal is the whole story
    kept = keep_traceback(err, run_dir, environ) if run_dir else None
    line = lost_peer(err, environ, kept)
    if line is not None:
        if int(environ.get("LOCAL_RANK", "0") or 0) == 0:  # one line a node: the next group says what changed
            print(line, file=sys.stderr, flush=True)
        return 1
    if not (restartable(environ) and run_dir and kept):
        return None
    record_failure(err, run_dir, kept, environ)
    if not started_by_front_end(environ):
        return None  # bare torchrun: the traceback goes to its log; the next group refuses to train
    # The front end stops its agent, prints this traceback from the file and ends with the line.
    print(f"trainer: rank {environ.get('RANK', '0')} failed: {describe_failure(err, environ)[:300]} "
          f"(traceback: {kept}); the elastic run stops", file=sys.stderr, flush=True)
    return 1


def agent_start_time() -> float | None:
    """When this worker's elastic agent (its parent process) started, None if unknown."""
    try:
        import psutil

        return psutil.Process(os.getppid()).create_time() if os.getppid() > 1 else None
    except Exception:  # noqa: BLE001 - psutil's errors and a platform without it alike: unknown
        return None


def raise_if_run_failed(run_dir: str | Path, environ: Mapping[str, str] = os.environ,
                        since: float | None = None) -> None:
    """In a worker of a restarting agent: refuse to train when an earlier group of this agent's run failed with
    an error of the run's own (a restart would repeat it; `since`: the agent's start, by default)."""
    if not restartable(environ):
        return
    since = agent_start_time() if since is None else since
    record = read_failure(run_dir, environ.get("TORCHELASTIC_RUN_ID"), since) if since is not None else None
    if record is None:
        return
    error = LaunchError(f"not restarting the elastic run: {failure_line(record)}; fix it and launch again",
                        exit_code=1)
    error.everywhere = True  # every rank of the group finds the same record: the main one says it
    raise error

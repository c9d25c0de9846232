"""Errors a user can act on. A leaf module: it imports nothing of ours, so everything may import it.

The command line prints these as one line (file, record, key and reason are in the message) and
shows the traceback only under `--debug`.
"""

from __future__ import annotations


class TrainerError(Exception):
    """Base of the errors below: a problem in the user's input, not a bug of ours."""

    everywhere: bool = False
    """Raised by every process of a run alike (they agreed on it): the command line prints it once, from the main
    process, and the others exit quietly with the same status."""


def first_line(err: BaseException) -> str:
    """The first line of an error's message (torch's run to paragraphs), else its type's name."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class ConfigError(TrainerError, ValueError):
    """A configuration problem the user must fix (unknown key, wrong type, bad choice)."""


class DataError(TrainerError, ValueError):
    """Input data that cannot be used: the message names the file, the record, the field and why."""


class CheckpointError(TrainerError, RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or unsafe to load."""


class DiskFullError(TrainerError, RuntimeError):
    """An output that could not be written for lack of space: the message names the folder, its free space and the
    size needed, and what was kept."""


class LaunchError(TrainerError, RuntimeError):
    """A run started on several local processes (`trainer.api.train`) that exited with an error status.

    `exit_code`: the status the command line exits with; `reported`: a rank has already said why in one line
    (the command line then adds nothing)."""

    def __init__(self, message: str, exit_code: int = 2, reported: bool = False):
        super().__init__(message)
        self.exit_code = exit_code
        self.reported = reported
